"""parallelize(): every parallelism applied to a built model from the outside, in one order.

The model (:mod:`aligner.model.llama`) knows nothing of ranks, recomputation or pipeline
stages; :func:`parallelize` turns a full single-process model into this rank's part of a
TP x PP x DP layout, the way torchtitan's ``parallelize_llama`` does:

    1. pipeline split   keep the decoder layers of dims.pp_rank, and the embedding / final
                        norm / head only on the first / last pipeline stage (:func:`prune_to_pp_stage`)
    2. TP / SP          shard every building-block layer over dims.tp_group
                        (:func:`aligner.parallel.tensor_parallel.apply_tensor_parallel`)
    2b. EP              MoE experts split over dims.ep_group (:func:`apply_expert_parallel`)
    2c. CP              with a ``cp_group``: attention all-gathers K/V over it (context
                        parallelism, :func:`aligner.parallel.context_parallel.apply_context_parallel`;
                        not yet a ParallelDims axis: the caller builds the group)
    3. weights          a model built on the meta device is materialized on `device` and
                        loaded from a full state dict (:func:`aligner.parallel.sharding.load_full_state_dict`);
                        otherwise the sharded model moves to `device`
    3b. LoRA            with a ``lora`` config of rank > 0: adapters on the target linears, sharded
                        like their layers, every other parameter frozen (:func:`aligner.nn.lora.apply_lora`)
    4. recomputation    none | selective (the attention core, softmax(QK^T)V) | full (each
                        decoder layer), Korthikanti et al. 2022 (:func:`apply_recompute`)
    5. Transformer Engine  model.backend=te swaps the decoder layers for TE layers (GPU only)
    5b. compile         parallel.compile: torch.compile per decoder block (:func:`apply_compile`),
                        after TP and recomputation and before FSDP, torchtitan's order
    6. data parallel    FSDP2 (``fully_shard`` per decoder layer, then the root) or DDP over
                        dims.dp_group (:func:`apply_data_parallel`); DeepSpeed owns the optimizer
                        too, so :class:`aligner.runtime.train_runtime.TrainRuntime` wraps it there

The training runtime and the rollout engine's layout (no step 6) both go through it;
:func:`build_parallel_model` builds a model (seeded, or on the meta device from a full state
dict) and parallelizes it without data parallelism.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from aligner.config import LoraConfig, ModelConfig, ParallelConfig
from aligner.model.llama import build_model, rope_inv_freq
from aligner.nn.lora import apply_lora
from aligner.parallel import data_parallel as dpmod
from aligner.parallel.context_parallel import apply_context_parallel
from aligner.parallel.dims import ParallelDims
from aligner.parallel.sharding import load_full_state_dict
from aligner.parallel.te_backend import apply_te_backend
from aligner.parallel.tensor_parallel import apply_tensor_parallel

RECOMPUTE_MODES = ("none", "selective", "full")


def pp_stage_layer_ids(num_layers: int, pp_size: int, pp_rank: int, layer_split: Optional[Sequence[int]] = None) -> list[int]:
    """Global decoder-layer indices of pipeline stage `pp_rank`.

    layer_split: layers per pipeline stage (ParallelConfig.pp_layer_split); None splits evenly with
    the first num_layers % pp_size pipeline stages taking one extra layer.
    Raises ValueError: the split does not have pp_size positive entries summing to num_layers.
    """
    if layer_split is None:
        if pp_size > num_layers:
            raise ValueError(f"pp_size={pp_size} exceeds num_layers={num_layers}: use at most {num_layers} pipeline stages")
        base, extra = divmod(num_layers, pp_size)
        layer_split = [base + (1 if s < extra else 0) for s in range(pp_size)]
    split = list(layer_split)
    if len(split) != pp_size or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"pp_layer_split={split} needs {pp_size} positive entries summing to num_layers={num_layers}")
    start = sum(split[:pp_rank])
    return list(range(start, start + split[pp_rank]))


def virtual_pp_stage_layer_ids(num_layers: int, pp_size: int, num_chunks: int, pp_rank: int) -> list[list[int]]:
    """Global decoder-layer indices of each of rank `pp_rank`'s `num_chunks` model chunks (virtual
    pipeline stages, Megatron's interleaved layout): chunk c is virtual pipeline stage c * pp_size + pp_rank of
    pp_size * num_chunks even ones (:func:`pp_stage_layer_ids`), so a rank's layers are not contiguous.
    Raises ValueError: more virtual pipeline stages than layers."""
    virtual_pp_stages = pp_size * num_chunks
    if virtual_pp_stages > num_layers:
        raise ValueError(
            f"pp_size x virtual_pp_size = {virtual_pp_stages} exceeds num_layers={num_layers}: use at most {num_layers} virtual pipeline stages"
        )
    return [pp_stage_layer_ids(num_layers, virtual_pp_stages, c * pp_size + pp_rank) for c in range(num_chunks)]


def chunk_views(model: nn.Module, dims: ParallelDims, num_chunks: int) -> list[nn.Module]:
    """This rank's model chunks for the interleaved schedule: views of `model` (the rank's module,
    holding every layer of its chunks, parallelized) that share its submodules and parameters, each
    with only its chunk's layers; the embedding stays in the first chunk of the first rank, the
    final norm and head in the last chunk of the last rank. Parameter names, checkpoints and the
    optimizer stay on `model`. Returns [model] for num_chunks = 1."""
    if num_chunks == 1:
        return [model]
    ids = virtual_pp_stage_layer_ids(model.cfg.num_layers, dims.pp_size, num_chunks, dims.pp_rank)
    views = []
    for c, layer_ids in enumerate(ids):
        view, trunk = _shallow(model), _shallow(model.model)
        trunk.layers = nn.ModuleDict({str(i): model.model.layers[str(i)] for i in layer_ids})
        if c > 0:
            trunk.embed_tokens = None
        if c < num_chunks - 1:
            trunk.norm = None
            for head in ("lm_head", "score"):
                if getattr(view, head, None) is not None:
                    setattr(view, head, None)
        view.model = trunk
        views.append(view)
    return views


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of `module` sharing its parameters, buffers and submodules, whose own registries can change.
    Its class is `module`'s, an FSDP2 root's included (whose ``__new__`` would rebuild the model: the
    copy is made without it), and it keeps `module`'s hooks, so a view of an FSDP2 root all-gathers
    and reshards the root's parameters (embedding, final norm, head) as the root itself does."""
    out = object.__new__(type(module))
    out.__dict__.update(module.__dict__)
    out._modules = dict(module._modules)
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    return out


def decode_layer_split(cfg: ModelConfig, pp_size: int) -> list[int]:
    """Layers per pipeline stage that balance a pipeline-parallel *decode* step's GEMM work.

    In decode every pipeline stage's time is its weight GEMMs; the last one also runs the
    [hidden, vocab] head (SmolLM2-135M: as much as 8 of its 30 layers). Per-token cost is
    counted as weight elements: a layer h(h_q + 2 kv_dim) + h_q h + 3 h I, the head V h (the
    embedding lookup is no GEMM). The last pipeline stage gets the layers that bring it to the mean
    pipeline stage cost (at least 1), the others split the rest evenly, extra layers to the first.
    Returns pp_size positive ints summing to cfg.num_layers (the even split when pp_size is 1).
    Raises ValueError: pp_size > num_layers.
    """
    n = cfg.num_layers
    if pp_size > n:
        raise ValueError(f"pp_size={pp_size} exceeds num_layers={n}: use at most {n} pipeline stages")
    if pp_size == 1:
        return [n]
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    head = cfg.vocab_size * h
    target = (n * layer + head) / pp_size
    last = min(n - (pp_size - 1), max(1, round((target - head) / layer)))
    base, extra = divmod(n - last, pp_size - 1)
    return [base + (1 if s < extra else 0) for s in range(pp_size - 1)] + [last]


def prune_to_pp_stage(model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """Keep only decoder layers `layer_ids` (global indices) and the ends this pipeline stage owns.

    The pipeline stage is the same class with the other layers deleted and ``embed_tokens`` (not first),
    ``norm`` and the head (not last) set to None; parameter names stay HF's.
    """
    trunk = model.model
    keep = {str(i) for i in layer_ids}
    for key in list(trunk.layers.keys()):
        if key not in keep:
            del trunk.layers[key]
    if not first:
        trunk.embed_tokens = None
    if not last:
        trunk.norm = None
        for head in ("lm_head", "score"):
            if hasattr(model, head):
                setattr(model, head, None)
    return model


def _checkpointed(fn: Callable) -> Callable:
    """`fn` recomputed in backward (non-reentrant activation checkpointing) while grad is enabled."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    return run


def _set_checkpointed(module: nn.Module, attr: str, on: bool) -> None:
    """Wrap (on) or unwrap the instance's `attr` in :func:`_checkpointed`; a wrapper set before (the
    context-parallel ``core`` of :func:`aligner.parallel.context_parallel.apply_context_parallel`)
    is kept inside the checkpoint and restored on unwrapping."""
    saved = f"_before_recompute_{attr}"
    if saved in module.__dict__:  # undo an earlier apply_recompute
        before = module.__dict__.pop(saved)
        module.__dict__.pop(attr)
        if before is not None:
            module.__dict__[attr] = before
    if on:
        module.__dict__[saved] = module.__dict__.get(attr)
        module.__dict__[attr] = _checkpointed(getattr(module, attr))


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Activation recomputation (Korthikanti et al. 2022), set on the model from outside.

    mode: "none"; "selective" recomputes each attention core (softmax(QK^T)V, the O(T^2) part)
    in backward; "full" recomputes each decoder layer and saves only its input. Parameter names
    do not change (the bound method is wrapped on the instance, not the module replaced).
    Calling it again replaces the previous mode. Raises ValueError for another mode.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r}: valid choices are {', '.join(RECOMPUTE_MODES)}")
    for layer in model.model.layers.values():
        _set_checkpointed(layer, "forward", mode == "full")
        _set_checkpointed(layer.self_attn, "core", mode == "selective")
    model.recompute = mode
    return model


def recompute_mode(model: nn.Module) -> str:
    """The mode :func:`apply_recompute` last set on `model` ("none" if never)."""
    return getattr(model, "recompute", "none")


def emulate_eager_rounding() -> None:
    """Make inductor round bf16/fp16 intermediates where eager rounds them
    (``torch._inductor.config.emulate_precision_casts``, process-wide; no effect on fp32).

    Inductor otherwise keeps a fused chain of pointwise ops (RMSNorm, RoPE, SwiGLU) in fp32 and
    rounds once, where eager rounds after every op: measured on the CPU (tiny test model, bf16
    weights and KV cache, 8 greedy rows x 10 tokens), compiled vs eager decode log-probs differed
    by up to 1.5e-2 with 6 of 8 rows token-identical; with the emulation 1.7e-4 and 8 of 8. In RL
    the trainer's forward is the reference the rollout's log-probs are compared with (the
    rollout/trainer mismatch), so the compiled engine follows eager's rounding.
    """
    torch._inductor.config.emulate_precision_casts = True


def apply_compile(model: nn.Module) -> nn.Module:
    """torch.compile each decoder block in place, from outside the model (torchtitan's per-block
    compile: one compiled block's code is reused by every layer of the same shapes).

    ``nn.Module.compile`` keeps parameter names, the state dict and the bound-method wrapping of
    :func:`apply_recompute` (the compiled call runs the checkpointed forward). Shapes are
    automatically dynamic (``dynamic=None``): a batch of new sequence lengths recompiles once,
    then the lengths are symbolic. Training parity with the uncompiled model (loss and grads
    within 1e-5 fp32, tp 1) is tested on the CPU; on the GPU it has not run. bf16/fp16
    intermediates are rounded as eager rounds them (inductor's ``emulate_precision_casts``, set
    process-wide by :func:`emulate_eager_rounding`).
    Returns `model`.
    """
    emulate_eager_rounding()
    for layer in model.model.layers.values():
        layer.compile(dynamic=None)
    model.compiled = True
    return model


def build_parallel_model(
    cfg: ModelConfig,
    kind: str,
    dims: ParallelDims,
    *,
    layer_split: Optional[Sequence[int]] = None,
    sequence_parallel: bool = False,
    recompute: str = "none",
    compile: bool = False,
    seed: int = 0,
    full_state_dict: Optional[dict[str, torch.Tensor]] = None,
    device: Any = "cpu",
    cp_group=None,
    virtual_pp_size: int = 1,
) -> nn.Module:
    """This rank's part of a TP x PP model: pipeline split, TP/SP sharding and recomputation applied.

    Args:
        cfg: ModelConfig. kind: "lm" (policy) | "score" (critic / reward model), see ``build_model``.
        dims: ParallelDims (tp_size, pp_size, pp_rank, is_first_pp_stage, is_last_pp_stage, tp_group).
        layer_split: decoder layers per pipeline stage; None = even.
        sequence_parallel / recompute: SP on the tp group; none | selective | full.
        compile: torch.compile each decoder block (:func:`apply_compile`).
        seed: without `full_state_dict`, weights equal ``build_model(cfg, kind, seed)``'s
            (the full model is built, then pruned and sliced: fine for tests and small models).
        full_state_dict: HF-named full weights; the model is built on the meta device, split and
            sharded, then materialized on `device` and loaded (no full model in memory).
        cp_group: context-parallel group (step 2c of :func:`parallelize`); None = no CP.
        virtual_pp_size: model chunks per rank (interleaved 1F1B): the rank keeps the layers of its
            chunks (:func:`virtual_pp_stage_layer_ids`); :func:`chunk_views` splits it for the schedule.
    Returns: LlamaForCausalLM / LlamaForScore with this pipeline stage's layers and this rank's shards.
    Raises ValueError: a layer split or tp size the model cannot take, an unknown recompute mode.
    """
    model = build_model(cfg, kind, seed=seed, device="meta" if full_state_dict is not None else device)
    layout = ParallelConfig(
        tp_size=dims.tp_size,
        pp_size=dims.pp_size,
        dp_size=dims.dp_size,
        ep_size=dims.ep_size,
        pp_layer_split=list(layer_split) if layer_split else None,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        compile=compile,
        virtual_pp_size=virtual_pp_size,
    )
    return parallelize(model, dims, layout, full_state_dict=full_state_dict, device=device, data_parallel=False, cp_group=cp_group)


def apply_expert_parallel(model: nn.Module, ep_group) -> nn.Module:
    """Step 2b: keep this rank's num_experts / ep_size experts of every MoE layer (expert
    parallelism over `ep_group`, dp ranks; tokens travel by all-to-all, aligner.model.moe). No-op
    without an ep group or MoE layers."""
    from aligner.model.moe import GroupedExperts

    if ep_group is None:
        return model
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.shard_ep_(ep_group)
    return model


def apply_data_parallel(model: nn.Module, dims: ParallelDims, parallel_cfg: ParallelConfig) -> nn.Module:
    """Step 6: FSDP2 (dp_backend fsdp2, dp_size > 1: in place, returns `model`) or DDP (dp_backend ddp,
    pp_size 1: returns the DDP wrapper); otherwise `model` unchanged (DDP with pp > 1 averages
    gradients in the runtime's finalize step, DeepSpeed is wrapped with its optimizer)."""
    if parallel_cfg.dp_backend == "fsdp2" and dims.dp_size > 1:
        edp_mesh = dims.expert_mesh["edp"] if dims.ep_size > 1 and dims.dp_size > dims.ep_size else None
        dpmod.apply_fsdp2(model, dims.mesh["dp"], parallel_cfg.mixed_precision, edp_mesh=edp_mesh)
        return model
    if parallel_cfg.dp_backend == "ddp" and dims.pp_size == 1:
        return dpmod.apply_ddp(model, dims.dp_group)
    return model


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    parallel_cfg: ParallelConfig,
    *,
    full_state_dict: Optional[dict[str, torch.Tensor]] = None,
    device: Any = None,
    data_parallel: bool = True,
    lora: Optional[LoraConfig] = None,
    lora_seed: int = 0,
    cp_group=None,
) -> nn.Module:
    """Apply steps 1-6 of the module docstring to a full `model`, in place.

    model: a full single-process LlamaForCausalLM / LlamaForScore (``build_model``), with weights,
        or on the meta device when `full_state_dict` is given.
    dims: the built ParallelDims; parallel_cfg: its ParallelConfig (pp_layer_split, sequence_parallel,
        recompute, compile, dp_backend, mixed_precision are read; the sizes come from `dims`).
    full_state_dict: HF-named full weights for a meta-device model. device: where the parameters end
        up (default: dims.device).
    data_parallel: False skips step 6 (the rollout engine's layout, or a caller that wraps itself).
    lora: step 3b when ``lora.rank > 0`` (A drawn from `lora_seed` and each layer's name; a scalar-head
        model keeps its ``score`` head trainable).
    cp_group: step 2c, context parallelism over this group (None or one rank: none); refused with
        parallel_cfg.compile (untested) and the TE backend.
    Returns what forward runs: `model` itself, or its DDP wrapper.
    Raises ValueError: a layout the model cannot take (layer split, tp size, recompute mode, TE off GPU).
    """
    device = device if device is not None else dims.device
    v = getattr(parallel_cfg, "virtual_pp_size", 1)
    if v > 1:  # interleaved: this rank holds its v chunks' layers (:func:`chunk_views` runs them apart)
        ids = sorted(i for chunk in virtual_pp_stage_layer_ids(model.cfg.num_layers, dims.pp_size, v, dims.pp_rank) for i in chunk)
    else:
        ids = pp_stage_layer_ids(model.cfg.num_layers, dims.pp_size, dims.pp_rank, parallel_cfg.pp_layer_split)
    prune_to_pp_stage(model, ids, dims.is_first_pp_stage, dims.is_last_pp_stage)
    apply_tensor_parallel(model, dims.tp_group, parallel_cfg.sequence_parallel)
    apply_expert_parallel(model, dims.ep_group)
    if cp_group is not None and parallel_cfg.compile:
        raise ValueError("context parallelism with parallel.compile is untested: set parallel.compile=false")
    apply_context_parallel(model, cp_group)
    if full_state_dict is not None:
        model.to_empty(device=device)
        model.model.inv_freq = rope_inv_freq(model.cfg).to(device)
        load_full_state_dict(model, full_state_dict)
    else:
        model.to(device)
    if lora is not None and lora.rank > 0:
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules, seed=lora_seed, trainable=("score.weight",))
    apply_recompute(model, parallel_cfg.recompute)
    if model.cfg.backend == "te":
        apply_te_backend(model, dims.tp_group, parallel_cfg.sequence_parallel)
    if parallel_cfg.compile:
        apply_compile(model)
    return apply_data_parallel(model, dims, parallel_cfg) if data_parallel else model
