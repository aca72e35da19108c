"""Data parallelism over the dp axis: FSDP2, DDP and DeepSpeed ZeRO, plus the global grad norm.

Owns:

- :func:`apply_fsdp2`: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and then
  on the root, over the dp mesh dimension. Our tensor parallelism is manual (plain-tensor local
  shards, not DTensor), so FSDP2 shards each rank's *TP-local* parameters over dp: every
  parameter becomes a DTensor on the 1-D dp mesh with ``Shard(0)``, and so do its gradients
  and the AdamW state (optimizer state is sharded over dp for free).
- :class:`FsdpStepReduce`: ``parallel.fsdp_reduce=step``, FSDP2 gradient accumulation with one
  all-gather and one reduce-scatter per unit per optimizer step instead of per micro-batch.
- :func:`apply_ddp`: ``DistributedDataParallel`` over the dp group (gradients averaged).
  Simplification: the DDP optimizer state is replicated on every dp rank (no
  ZeroRedundancyOptimizer), which keeps checkpoints a plain per-tensor layout.
- :func:`deepspeed_config` / :func:`init_deepspeed`: DeepSpeed ZeRO stages 0-3 with optional
  CPU-offloaded Adam (``DeepSpeedCPUAdam``), where tp = pp = 1 (checked by ParallelConfig).
- Mixed precision ``bf16``: bf16 compute, fp32 master weights, fp32 gradient reduction.
  FSDP2 uses ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; DDP (and
  unwrapped single-replica models) use ``torch.autocast(device, bfloat16)`` around forward:
  parameters and gradients stay fp32, matmuls run in bf16 (:func:`autocast_context`).
  DeepSpeed uses its own ``bf16`` section (bf16 module, fp32 master copy in the optimizer).
- :func:`clip_grad_norm_`: global-norm clipping over every axis (tp, pp and dp), equal to
  ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.

Nothing here builds process groups; they come from :class:`aligner.parallel.dims.ParallelDims`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.nn import comm
from aligner.nn.layers import ColumnParallelLinear, ParallelLayer, RMSNorm, RowParallelLinear
from aligner.nn.lora import LoraAdapter
from aligner.parallel.tensor_parallel import all_reduce_grad_pieces

DP_BACKENDS = ("fsdp2", "ddp", "deepspeed")
MIXED_PRECISION = ("fp32", "bf16")


def _check_choice(field: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is invalid: valid choices are {', '.join(map(str, choices))}")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a LlamaForCausalLM / LlamaForScore (or a PP stage of one)."""
    trunk = getattr(model, "model", None)
    layers = getattr(trunk, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: data parallelism expects an aligner Llama model")
    return list(layers.values())


# ---- expert parallelism ------------------------------------------------------------------
def ep_experts(model: nn.Module) -> list[nn.Module]:
    """The expert modules of `model` split over an expert-parallel group of more than one rank.

    Their parameters differ between the ranks of the ep group and are shared only with the
    expert-data-parallel group: data parallelism leaves them out of its dp-wide reduction and
    :func:`reduce_expert_grads` (or FSDP2 on the edp mesh) treats them instead."""
    from aligner.model.moe import GroupedExperts

    return [m for m in model.modules() if isinstance(m, GroupedExperts) and comm.group_size(m.ep_group) > 1]


def expert_param_ids(model: nn.Module) -> set[int]:
    """ids of the parameters of :func:`ep_experts`."""
    return {id(p) for m in ep_experts(model) for p in m.parameters()}


def fill_expert_grads(model: nn.Module) -> list[nn.Parameter]:
    """Give every parameter of :func:`ep_experts` a gradient (zeros where none of the ep group's
    tokens reached this rank's experts, so autograd left None) and return those parameters: the
    edp and cp reductions then see the same tensors on every rank (a rank skipping one would
    desynchronise the flat all-reduce)."""
    params = [p for m in ep_experts(model) for p in m.parameters()]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return params


def reduce_expert_grads(model: nn.Module, edp_group, dp_size: int, averaged_over: int = 1) -> None:
    """Expert-parallel gradients to the dp mean: the all-to-all backward already summed the
    contributions of the ep group's tokens into each expert's holder; sum over the expert-data-
    parallel group (the other holders of the same experts) and divide by dp_size, which is the
    gradient of the dp-mean loss (Megatron-LM's expert grads reduced over its expert-dp group).
    averaged_over > 1: FSDP2 already averaged them over that many edp ranks (its reduce-scatter);
    only the factor averaged_over / dp_size = 1 / ep_size is applied."""
    params = fill_expert_grads(model)
    grads = [_local_grad(p) for p in params]
    if not grads:
        return
    if averaged_over > 1:
        torch._foreach_mul_(grads, averaged_over / dp_size)
        return
    flat_all_reduce_(grads, edp_group, dp_size)


def flat_all_reduce_(grads: list[torch.Tensor], group, divisor: float = 1.0) -> None:
    """Sum `grads` over `group` in place and divide by `divisor`: one flat all-reduce per dtype."""
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        comm.all_reduce_no_grad(flat, group)
        flat /= divisor
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


# ---- FSDP2 -------------------------------------------------------------------------------
def apply_fsdp2(model: nn.Module, dp_mesh, mixed_precision: str = "fp32", reshard_after_forward: bool = True, edp_mesh=None) -> nn.Module:
    """Shard `model` over the 1-D `dp_mesh` with FSDP2 (in place; returns the same object).

    Args:
        model: an aligner Llama model (possibly TP-sharded and/or a PP stage); parameters fp32.
        dp_mesh: 1-D DeviceMesh over the dp axis (``dims.mesh["dp"]``).
        mixed_precision: "fp32" | "bf16" (bf16 unsharded params for compute, fp32 reduce-scatter).
        reshard_after_forward: free the unsharded layer after forward (ZeRO-3 style); False keeps
            it until backward (ZeRO-2 style, more memory, one all-gather less).
        edp_mesh: with expert parallelism, the 1-D expert-data-parallel mesh (``dims.expert_mesh["edp"]``,
            None when edp has one rank). Experts are sharded on it with their own ``fully_shard``
            (torchtitan's layout), whose reduce-scatter averages over edp; the runtime then scales
            them by 1 / ep_size (:func:`reduce_expert_grads`: a divide factor of dp_size would need
            NCCL's PREMUL_SUM, which gloo lacks). With one edp rank they stay plain tensors, left
            out of FSDP (``ignored_params``), and the runtime divides their grads by dp_size.
    Raises:
        ValueError: unknown mixed_precision, or dp_mesh is not 1-D.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _check_choice("parallel.mixed_precision", mixed_precision, MIXED_PRECISION)
    if dp_mesh is None or dp_mesh.ndim != 1:
        raise ValueError(f"apply_fsdp2: dp_mesh={dp_mesh!r} must be a 1-D DeviceMesh (dims.mesh['dp'])")
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    experts = ep_experts(model)
    ignored = None
    if experts and edp_mesh is None:
        ignored = {p for m in experts for p in m.parameters()}
    for m in experts if edp_mesh is not None else ():
        fully_shard(m, mesh=edp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    return model


class FsdpStepReduce:
    """FSDP2 gradient accumulation that communicates once per optimizer step (``parallel.fsdp_reduce=step``).

    By default (``fsdp_reduce=micro_batch``) every FSDP2 unit (each decoder layer, each expert
    group on the edp mesh, the root: embedding, final norm, head) is all-gathered in forward, freed,
    all-gathered again in backward and its gradient reduce-scattered, for every micro-batch. Here,
    through the ``FSDPModule`` switches of torch.distributed.fsdp (torch 2.13):

    - :meth:`begin` (before the step's first forward): ``set_requires_gradient_sync(False)`` (the
      post-backward keeps the unsharded gradient instead of reduce-scattering it),
      ``set_reshard_after_backward(False)`` and ``set_reshard_after_forward(False)`` on every unit,
      so a unit's first forward all-gathers it and it stays unsharded for the rest of the step;
    - :meth:`last_backward` (before chunk ``c``'s backward of the step's last micro-batch; the pp=1
      loop calls it before the last micro-batch, the 1F1B schedules before that backward on each
      chunk): gradient sync and reshard-after-backward back on for that chunk's units, so its
      post-backward reduce-scatters the accumulated gradient once and frees the unsharded
      parameters. The root unit (shared by a rank's interleaved chunks) is switched with the last
      chunk to reach this point, whose backward is the rank's last of the step;
    - :meth:`end` (after the step's backwards, also on error): every switch back to FSDP2's
      defaults as :func:`apply_fsdp2` set them (reshard after forward and backward, gradient sync).

    So each unit is all-gathered once and reduce-scattered once per step instead of 2m and m
    times for m micro-batches, at the memory cost of every unit's unsharded parameters and
    unsharded gradients alive through the step (DDP's footprint for those; the optimizer state
    stays sharded). Gradient dtype: with fp32 parameters (``MixedPrecisionPolicy()``) the unsharded
    gradients accumulate in fp32 ``.grad``; under ``mixed_precision=bf16`` (param_dtype bf16,
    reduce_dtype fp32) each micro-batch's backward yields a bf16 unsharded gradient, which FSDP2
    upcasts into an fp32 buffer (``FSDPParam.unsharded_accumulated_grad``, reduce_dtype) on the first
    accumulating backward and adds the later ones into: the sum is held and reduce-scattered in fp32.
    The result equals per-micro-batch reduction up to the order of fp32 additions.

    Args:
        root: the FSDP2 root model (:func:`apply_fsdp2`'s result, the rank's pipeline stage).
        chunks: the modules the schedule backpropagates through, each holding its decoder layers: the
            interleaved chunk views, or ``[root]``.
        reshard_after_forward: the value :func:`apply_fsdp2` was given (restored by :meth:`end`).
    """

    def __init__(self, root: nn.Module, chunks: list[nn.Module], reshard_after_forward: bool = True):
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(root, FSDPModule):
            raise ValueError(f"FsdpStepReduce: {type(root).__name__} is not an FSDP2 module (apply_fsdp2 first)")
        self.root = root
        self.reshard_after_forward = reshard_after_forward
        self.chunk_units = [[m for layer in decoder_layers(c) for m in layer.modules() if isinstance(m, FSDPModule)] for c in chunks]
        self._pending: set[int] = set()

    def begin(self) -> None:
        """Before the step's first forward: no gradient sync, no reshard after forward or backward (every unit)."""
        self.root.set_requires_gradient_sync(False)
        self.root.set_reshard_after_backward(False)
        self.root.set_reshard_after_forward(False)
        self._pending = set(range(len(self.chunk_units)))

    def last_backward(self, chunk: int = 0) -> None:
        """Before chunk `chunk`'s backward of the step's last micro-batch: that chunk's units (and, with
        the last chunk to get here, the root) reduce-scatter their accumulated gradients and reshard
        after this backward. Raises KeyError: `chunk` already switched this step or out of range."""
        self._pending.remove(chunk)
        units = self.chunk_units[chunk] + ([] if self._pending else [self.root])
        for m in units:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)

    def end(self) -> None:
        """After the step's backwards: FSDP2's defaults back on every unit (sync, reshard after backward and forward)."""
        self.root.set_requires_gradient_sync(True)
        self.root.set_reshard_after_backward(True)
        self.root.set_reshard_after_forward(self.reshard_after_forward)
        self._pending = set()

    def hold(self) -> None:
        """Before a forward-only pass (no autograd: old log-probs, values, scores) over several micro-batches:
        no reshard after forward on any unit, so the first micro-batch's forward all-gathers each unit and
        it stays unsharded for the others (once per pass instead of once per micro-batch)."""
        self.root.set_reshard_after_forward(False)

    def release(self) -> None:
        """After that pass: every unit resharded (its unsharded parameters freed; ``FSDPModule.reshard`` is
        not recursive, so each unit is called) and reshard after forward restored."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.root.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        self.root.set_reshard_after_forward(self.reshard_after_forward)


# ---- DDP ---------------------------------------------------------------------------------
def apply_ddp(model: nn.Module, dp_group: Optional[dist.ProcessGroup]) -> nn.Module:
    """Wrap `model` in DistributedDataParallel over `dp_group` (gradients averaged over dp).

    Returns the wrapper (``.module`` is `model`). With dp_group None (dp_size 1) returns `model`.
    Parameters must already be TP-sharded: DDP then all-reduces each TP-local gradient over dp.
    """
    if comm.group_size(dp_group) == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = expert_param_ids(model)
    if ids:  # expert-parallel experts: reduced over their edp group by reduce_expert_grads
        names = [n for n, p in model.named_parameters() if id(p) in ids]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return DistributedDataParallel(model, process_group=dp_group)


@contextlib.contextmanager
def autocast_context(enabled: bool, device_type: str = "cpu") -> Iterator[None]:
    """torch.autocast to bf16 when `enabled` (fp32 params and grads, bf16 matmuls), else nothing."""
    if not enabled:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        yield


# ---- DeepSpeed ----------------------------------------------------------------------------
def deepspeed_config(zero_stage: int, mixed_precision: str, grad_clip: float, offload_optimizer: bool) -> dict:
    """The DeepSpeed JSON config for one training engine (one backward per optimizer step).

    Args:
        zero_stage: 0-3. mixed_precision: fp32 | bf16. grad_clip: max global norm (0 = off).
        offload_optimizer: keep the fp32 master weights and Adam state on CPU (DeepSpeedCPUAdam).
    Raises:
        ValueError: zero_stage outside 0-3, unknown mixed_precision, offload with ZeRO stage 0.
    """
    _check_choice("parallel.zero_stage", zero_stage, (0, 1, 2, 3))
    _check_choice("parallel.mixed_precision", mixed_precision, MIXED_PRECISION)
    if offload_optimizer and zero_stage == 0:
        raise ValueError("parallel.offload_optimizer=True needs parallel.zero_stage >= 1 (ZeRO-Offload partitions the optimizer)")
    zero: dict = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": 1,  # nominal: the caller feeds whole local batches
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": mixed_precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - deepspeed is a core dependency
        raise ImportError("parallel.dp_backend=deepspeed needs DeepSpeed: pip install 'deepspeed>=0.16'") from e
    return deepspeed


def init_deepspeed(model: nn.Module, optimizer_kwargs: dict, config: dict):
    """deepspeed.initialize on `model` with an AdamW client optimizer; returns (engine, client_optimizer).

    optimizer_kwargs: lr, betas, eps, weight_decay. With CPU offload the client optimizer is
    ``DeepSpeedCPUAdam(adamw_mode=True)`` (JIT-compiles the cpu_adam op once), else torch AdamW.
    The learning rate is driven by writing ``param_groups[i]["lr"]`` of the client optimizer,
    whose group dicts the ZeRO wrapper shares.
    """
    deepspeed = _import_deepspeed()
    params = [p for p in model.parameters() if p.requires_grad]
    if config["zero_optimization"].get("offload_optimizer"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        client = DeepSpeedCPUAdam(params, adamw_mode=True, **optimizer_kwargs)
    else:
        client = torch.optim.AdamW(params, **optimizer_kwargs)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config, dist_init_required=False)
    return engine, client


# ---- global grad norm ------------------------------------------------------------------
def _tp_weight(module: nn.Module, pname: str, tp_size: int, tp_rank: int) -> float:
    """How much this rank's copy of a parameter counts in the global norm across tp.

    TP-split parameters count fully on every rank (each holds distinct rows); replicated ones
    (norms, row-parallel bias, scalar head) count on tp rank 0 only; rows replicated over
    several tp ranks (GQA key/value heads when num_kv_heads < tp_size) count 1/replicas each.
    """
    if tp_size == 1:
        return 1.0
    if not isinstance(module, ParallelLayer):
        mode = getattr(module, "parallel_mode", None)  # Transformer Engine layers (te_backend)
        if (mode in ("column", "row") and pname == "weight") or (mode == "column" and pname == "bias"):
            return 1.0
        return 1.0 if tp_rank == 0 else 0.0
    dim, row_index = module.local_to_full_spec(pname)
    if dim is None:
        return 1.0 if tp_rank == 0 else 0.0
    if row_index is not None:
        full = module.out_features
        return full / (len(row_index) * tp_size)
    return 1.0


def _local_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    g = p.grad
    if g is None:
        return None
    return g.to_local() if hasattr(g, "to_local") else g


def grad_norm_sq_local(model: nn.Module, tp_group=None, exclude: Optional[set[int]] = None) -> torch.Tensor:
    """Sum of squared gradient entries of this rank's parameters, weighted so a later sum over
    tp, pp (and dp for dp-sharded grads) counts every entry of the full model once. fp64 scalar.

    exclude: ids of parameters counted elsewhere (the last pipeline stage's copy of a tied embedding)."""
    tp_size, tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    seen: set[int] = set(exclude or ())
    by_weight: dict[float, list[torch.Tensor]] = {}
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            g = _local_grad(p)
            if g is None:
                continue
            w = _tp_weight(module, pname, tp_size, tp_rank)
            if w:
                by_weight.setdefault(float(w), []).append(g.detach())
    for w, grads in by_weight.items():  # one fused norm kernel per weight class, not one per tensor
        norms = torch.stack(torch._foreach_norm(grads, 2.0)).double()
        total += w * norms.pow(2).sum().cpu()
    return total


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    tp_group=None,
    pp_group=None,
    dp_group=None,
    grads_sharded_over_dp: bool = False,
    exclude: Optional[set[int]] = None,
    ep_group=None,
) -> float:
    """Global-norm gradient clipping over tp, pp and dp; returns the norm before clipping.

    Matches ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: the squared norm is
    summed over tp (replicated params once), over pp, and over dp only when the gradients are
    dp-sharded (FSDP2; DDP gradients are already identical on every dp rank). Grads are then
    scaled by ``min(1, max_norm / (norm + 1e-6))``. max_norm <= 0 only measures the norm.
    exclude: ids of parameters left out of the norm but still clipped (a tied embedding's
    second copy on the last pp stage). ep_group: with expert parallelism and dp-replicated grads
    (DDP), the ep ranks hold different experts, so the experts' squares are also summed over it.
    Must be called on every rank of the role (all-reduces).
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    experts = expert_param_ids(model) if not grads_sharded_over_dp and comm.group_size(ep_group) > 1 else set()
    sq = grad_norm_sq_local(model, tp_group, (exclude or set()) | experts)
    sq = sq.to(device=device, dtype=torch.float64 if device.type == "cpu" else torch.float32)
    if experts:
        everything_else = {id(p) for p in model.parameters()} - experts
        sq_exp = grad_norm_sq_local(model, tp_group, everything_else).to(device=device, dtype=sq.dtype)
        comm.all_reduce_no_grad(sq_exp, ep_group)
        sq = sq + sq_exp
    for group in (tp_group, pp_group, dp_group if grads_sharded_over_dp else None):
        comm.all_reduce_no_grad(sq, group)
    norm = math.sqrt(float(sq))
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            with torch.no_grad():
                for p in model.parameters():
                    g = _local_grad(p)
                    if g is not None:
                        g.mul_(coef)
    return norm


def sync_tp_grads_local(model: nn.Module, tp_group, dp_rank: int = 0, dp_size: int = 1) -> None:
    """:func:`aligner.parallel.tensor_parallel.sync_tp_grads` for dp-sharded (FSDP2 DTensor) grads.

    Same two reductions over `tp_group`, applied to each rank's local FSDP shard of the
    gradient: (1) sequence-parallel norm weights and row-parallel biases are summed over tp
    (the shards of a replicated parameter cover the same index range on every tp rank);
    (2) replicated GQA kv rows are summed between the ranks holding the same head, using the
    full rows this dp shard covers (``row_index.chunk(dp_size)[dp_rank]``). Reductions commute
    with FSDP's dp reduce-scatter, so the result equals the unsharded sync.
    """

    if comm.group_size(tp_group) == 1:
        return

    items: list[tuple] = []
    for m in model.modules():
        if not isinstance(m, ParallelLayer) or comm.group_size(m.tp_group) == 1:
            continue
        if m.sequence_parallel and isinstance(m, (RMSNorm, RowParallelLinear)):
            p = m.weight if isinstance(m, RMSNorm) else m.bias
            g = None if p is None else _local_grad(p)
            if g is not None:
                items.append((g, None, None))
        if isinstance(m, ColumnParallelLinear) and m.row_index is not None:
            rows = m.row_index.chunk(dp_size)[dp_rank] if dp_size > 1 else m.row_index
            for p in (m.weight, m.bias):
                g = None if p is None else _local_grad(p)
                if g is not None and g.shape[0] > 0:
                    items.append((g, rows, m.out_features))
        if isinstance(m, LoraAdapter):
            for p, rows, full in m.tp_partial_grads():
                g = _local_grad(p)
                if g is not None and g.shape[0] > 0:
                    items.append((g, None if rows is None else (rows.chunk(dp_size)[dp_rank] if dp_size > 1 else rows), full))
    all_reduce_grad_pieces(items, tp_group)
