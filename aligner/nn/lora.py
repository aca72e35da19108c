"""LoRA adapters on the tensor-parallel linears (Hu et al. 2021, "LoRA: Low-Rank Adaptation").

Owns: :class:`LoraAdapter` (the A / B pair of one linear, sharded like its layer),
:func:`apply_lora` (add adapters to the target linears of a built, sharded model and freeze the
rest), :func:`disable_adapters` (the base model, e.g. the reference policy, with no second copy of
the weights), :func:`merge_adapters` / :func:`unmerge_adapters` (in place, on local shards),
and the state-dict conversions: :func:`merged_state_dict` (the HF checkpoint with the adapters
folded in) and :func:`peft_adapter_state_dict` / :func:`peft_adapter_config` (PEFT's on-disk
adapter format, ``adapter_model.safetensors`` + ``adapter_config.json``).

Formula (PEFT's ``LoraLayer``, peft 0.21 ``tuners/lora/layer.py``): for y = x W^T + b,
``y = x W^T + b + scaling * B(A(dropout(x)))`` with A: [r, in], B: [out, r],
``scaling = alpha / r`` (rsLoRA off), A initialized like ``nn.init.kaiming_uniform_(a=sqrt(5))``
(uniform in +-1/sqrt(in)), B zeros, so the adapted model starts equal to the base.

Tensor parallelism (Megatron layout of the base layer, Shoeybi et al. 2019):

- column-parallel layer W [out/tp, in]: A [r, in] replicated, B [out/tp, r] holds the layer's
  rows (``row_index`` too: replicated GQA kv heads). Without sequence parallelism the adapter
  reads the same ``copy_to_tp`` input as the layer; with it, A is applied to the local sequence
  shard and only the [B, T/tp, r] product is all-gathered (reduce-scattered in backward).
  A's gradient is a partial sum per rank (each rank's B rows, or its sequence shard).
- row-parallel layer W [out, in/tp]: A [r, in/tp] holds the layer's input columns, B [out, r]
  replicated; the partial ``scaling * B A_local x_local`` is added before the layer's
  all-reduce / reduce-scatter (exact: the reduction is linear). B's gradient is a partial sum.

The partial gradients are summed over tp by :func:`aligner.parallel.tensor_parallel.sync_tp_grads`
(:meth:`LoraAdapter.tp_partial_grads`), like the norms under sequence parallelism.

Parameter names: ``<linear>.lora.A`` and ``<linear>.lora.B`` (e.g.
``model.layers.0.self_attn.q_proj.lora.A``); PEFT's are
``base_model.model.<linear>.lora_A.weight`` / ``.lora_B.weight``.

Simplifications: dropout draws its mask from each rank's own RNG (with tp > 1 and dropout > 0 the
ranks' masks are not one single-process mask); adapters on the lm_head and embedding are not
offered; the packed q/k/v GEMM of the rollout engine (:func:`aligner.nn.layers.pack_linears`) is
bypassed while an adapter is active (the engine itself gets merged weights and no adapters).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from aligner.nn import comm
from aligner.nn.layers import ColumnParallelLinear, ParallelLayer, RowParallelLinear

# the linears an adapter may target: our module names, which are HF's and PEFT's too
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "lora"  # submodule name of the adapter on its linear


class LoraAdapter(ParallelLayer):
    """The A / B pair of one Column- or RowParallelLinear, sharded like that layer.

    Args:
        base: the (already sharded) layer. rank: r >= 1. alpha: scaling numerator (scaling = alpha / r).
        dropout: probability on the adapter's input (0 = none).
        a_full: [r, in] the full A (this rank keeps its slice); B starts at zeros.
    Parameters: A [r, in] (column) or [r, in/tp] (row); B [out/tp (or the rows of row_index), r]
    (column) or [out, r] (row); dtype and device of the base weight.
    """

    def __init__(self, base: ParallelLayer, rank: int, alpha: float, dropout: float, a_full: torch.Tensor):
        super().__init__()
        if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
            raise TypeError(f"LoraAdapter: {type(base).__name__} is not a Column- or RowParallelLinear")
        self.column = isinstance(base, ColumnParallelLinear)
        self.tp_group, self.sequence_parallel = base.tp_group, base.sequence_parallel
        self.in_features, self.out_features = base.in_features, base.out_features
        self.row_index = base.row_index if self.column else None
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True  # False: the layer runs as its base (disable_adapters)
        self.merged = False  # True: scaling * B A is inside the base weight (merge_adapters)
        w = base.weight
        out_local = w.shape[0]
        self.A = nn.Parameter(self.full_to_local("A", a_full).to(device=w.device, dtype=w.dtype).clone())
        self.B = nn.Parameter(torch.zeros(out_local if self.column else self.out_features, rank, device=w.device, dtype=w.dtype))

    @property
    def active(self) -> bool:
        """True when forward adds the adapter's term (enabled and not merged)."""
        return self.enabled and not self.merged

    # ---- ParallelLayer protocol (gather, checkpoints, grad norm) ----------------------------
    def _rows(self) -> torch.Tensor:
        if self.row_index is not None:
            return self.row_index
        n, r = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        per = self.out_features // n
        return torch.arange(r * per, (r + 1) * per)

    def full_to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        n, r = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        if self.column:
            if name == "B" and (n > 1 or self.row_index is not None):
                return full[self._rows()]
            return full
        return full.chunk(n, dim=1)[r] if (name == "A" and n > 1) else full

    def local_to_full_spec(self, name: str):
        if self.column:
            return (0, self.row_index) if name == "B" else (None, None)
        return (1, None) if name == "A" else (None, None)

    def tp_partial_grads(self) -> list[tuple[torch.Tensor, Optional[torch.Tensor], Optional[int]]]:
        """(param, rows, full_rows) of the parameters whose gradient is a partial sum over tp:
        column A (rows None), column B on replicated GQA rows (rows = row_index of out_features),
        row B (rows None). Empty for tp_size 1."""
        if comm.group_size(self.tp_group) == 1:
            return []
        if self.column:
            out = [(self.A, None, None)]
            if self.row_index is not None:
                out.append((self.B, self.row_index, self.out_features))
            return out
        return [(self.B, None, None)]

    # ---- forward ----------------------------------------------------------------------------
    def column_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter term of a column-parallel layer: [B, T, out_local].

        x: the layer's input after ``copy_to_tp`` [B, T, in], or with sequence parallelism the
        local shard [B, T/tp, in] (A is applied first, then the [.., r] product is all-gathered).
        """
        u = F.linear(self.dropout(x), self.A)
        if self.sequence_parallel:
            u = comm.gather_from_sp(u, self.tp_group)
        return F.linear(u, self.B) * self.scaling

    def row_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter term of a row-parallel layer before its reduction: x [B, T, in/tp] -> [B, T, out] partial."""
        return F.linear(F.linear(self.dropout(x), self.A), self.B) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """scaling * B A: the local [out_local, in_local] change of the base weight (fp32 math, base dtype)."""
        return (self.B.float() @ self.A.float()) * self.scaling

    def extra_repr(self) -> str:
        kind = "column" if self.column else "row"
        return f"{kind}, r={self.rank}, alpha={self.alpha}, A={tuple(self.A.shape)}, B={tuple(self.B.shape)}"


def adapter_of(layer: nn.Module) -> Optional[LoraAdapter]:
    """The layer's LoraAdapter, or None."""
    return layer._modules.get(ADAPTER)


def _module_suffix(name: str) -> str:
    return name.rpartition(".")[2]


def kaiming_uniform_a(rank: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """A [rank, in_features] fp32 drawn as ``nn.init.kaiming_uniform_(A, a=sqrt(5))`` does:
    U(-b, b) with b = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + 5)), i.e. b = 1 / sqrt(in_features)."""
    bound = math.sqrt(2.0 / 6.0) * math.sqrt(3.0 / in_features)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)


def apply_lora(
    model: nn.Module, rank: int, alpha: float, dropout: float, target_modules, seed: int = 0, trainable: tuple[str, ...] = ()
) -> list[str]:
    """Add a LoraAdapter to every Column/RowParallelLinear of `model` whose name ends in one of
    `target_modules`, and freeze every other parameter (requires_grad False).

    model: built and tensor-parallel sharded (``parallelize`` steps 1-3), before data parallelism.
    Each adapter's A is drawn from a CPU generator seeded by (seed, the layer's full name), so a
    layer gets the same A on any tp / pp layout. trainable: parameter-name suffixes kept trainable
    besides the adapters (``("score.weight",)``: the scalar head of a critic / reward model, as
    PEFT's ``modules_to_save``).
    Returns the adapted layers' names (sets ``model.lora_layers`` and ``model.lora_targets``).
    Raises ValueError: rank < 1.
    """
    if rank < 1:
        raise ValueError(f"apply_lora: rank={rank} must be >= 1")
    targets = set(target_modules)
    adapted = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or _module_suffix(name) not in targets:
            continue
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        module.add_module(ADAPTER, LoraAdapter(module, rank, alpha, dropout, kaiming_uniform_a(rank, module.in_features, g)))
        adapted.append(name)
    for name, p in model.named_parameters():
        is_adapter = name.endswith((f".{ADAPTER}.A", f".{ADAPTER}.B"))
        p.requires_grad_(is_adapter or name.endswith(tuple(trainable)))
    model.lora_layers = adapted
    model.lora_targets = tuple(sorted(targets))
    return adapted


def adapters(model: nn.Module) -> Iterator[LoraAdapter]:
    """Every LoraAdapter under `model`."""
    return (m for m in model.modules() if isinstance(m, LoraAdapter))


def has_adapters(model: nn.Module) -> bool:
    """True when `model` carries at least one LoraAdapter."""
    return next(adapters(model), None) is not None


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base model inside the block (the reference policy of LoRA PPO: the
    same weights with the adapters off, no second copy). Restores each adapter's flag after."""
    ads = list(adapters(model))
    before = [a.enabled for a in ads]
    for a in ads:
        a.enabled = False
    try:
        yield
    finally:
        for a, e in zip(ads, before):
            a.enabled = e


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold scaling * B A into each adapted layer's local weight shard in place (no communication:
    column B rows and row A columns are the layer's own). Plain (not FSDP2-sharded) parameters only."""
    for m in model.modules():
        ad = adapter_of(m)
        if ad is not None and not ad.merged:
            m.weight.add_(ad.delta_weight().to(m.weight.dtype))
            ad.merged = True


@torch.no_grad()
def unmerge_adapters(model: nn.Module) -> None:
    """Undo :func:`merge_adapters` (subtracts the same product: exact up to rounding of the weight dtype)."""
    for m in model.modules():
        ad = adapter_of(m)
        if ad is not None and ad.merged:
            m.weight.sub_(ad.delta_weight().to(m.weight.dtype))
            ad.merged = False


# ---- full (HF-named) state dicts -----------------------------------------------------------
def is_adapter_key(name: str) -> bool:
    """True for ``...<linear>.lora.A`` / ``...lora.B`` names."""
    return name.endswith((f".{ADAPTER}.A", f".{ADAPTER}.B"))


def adapted_layers(full_sd: dict[str, torch.Tensor]) -> list[str]:
    """Names of the linears that have adapters in a full state dict (``model.layers.0.self_attn.q_proj`` ...)."""
    return [k[: -len(f".{ADAPTER}.A")] for k in full_sd if k.endswith(f".{ADAPTER}.A")]


@torch.no_grad()
def merged_state_dict(full_sd: dict[str, torch.Tensor], scaling: float, only_adapted: bool = False) -> dict[str, torch.Tensor]:
    """The HF state dict with every adapter folded in: W' = W + scaling * B A (fp32 math, W's dtype).

    full_sd: full (gathered) tensors, adapters under ``<linear>.lora.A`` [r, in] / ``.lora.B`` [out, r].
    only_adapted: return only the merged ``<linear>.weight`` tensors (a refit of the layers that change).
    Adapter keys are dropped; other tensors are passed through (not copied).
    """
    layers = adapted_layers(full_sd)
    out = {} if only_adapted else {k: v for k, v in full_sd.items() if not is_adapter_key(k)}
    for layer in layers:
        w = full_sd[f"{layer}.weight"]
        a, b = full_sd[f"{layer}.{ADAPTER}.A"], full_sd[f"{layer}.{ADAPTER}.B"]
        out[f"{layer}.weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out


def peft_adapter_state_dict(full_sd: dict[str, torch.Tensor], modules_to_save=()) -> dict[str, torch.Tensor]:
    """PEFT's adapter_model.safetensors contents: ``base_model.model.<linear>.lora_A.weight`` [r, in]
    and ``.lora_B.weight`` [out, r] (the names ``PeftModel.save_pretrained`` writes for a
    LlamaForCausalLM / LlamaForSequenceClassification), contiguous copies of the full adapter
    tensors; plus ``base_model.model.<m>.weight`` of each trained whole module in `modules_to_save`
    (``score``: a reward model's or critic's head, PEFT's SEQ_CLS layout)."""
    out = {f"base_model.model.{m}.weight": full_sd[f"{m}.weight"].detach().contiguous().clone() for m in modules_to_save}
    for layer in adapted_layers(full_sd):
        for ours, theirs in (("A", "lora_A"), ("B", "lora_B")):
            out[f"base_model.model.{layer}.{theirs}.weight"] = full_sd[f"{layer}.{ADAPTER}.{ours}"].detach().contiguous().clone()
    return out


def peft_adapter_config(rank: int, alpha: float, dropout: float, target_modules, base_model_name_or_path: str, kind: str = "lm") -> dict:
    """adapter_config.json for PEFT's ``LoraConfig`` (peft_type LORA, rsLoRA and DoRA off, no bias):
    what ``PeftModel.from_pretrained`` needs to rebuild the same adapters. kind "lm": task_type
    CAUSAL_LM; "score": SEQ_CLS with the trained head in ``modules_to_save`` (["score"])."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if kind == "lm" else "SEQ_CLS",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(set(target_modules)),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None if kind == "lm" else ["score"],
    }


def save_peft_adapter(full_sd: dict[str, torch.Tensor], out_dir: str, config: dict) -> str:
    """Write ``adapter_config.json`` (`config`, see :func:`peft_adapter_config`) and
    ``adapter_model.safetensors`` (:func:`peft_adapter_state_dict`) into `out_dir`; returns it."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    sd = peft_adapter_state_dict(full_sd, config.get("modules_to_save") or ())
    save_file(sd, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
