"""Layer classes the Llama model is built from, tensor/sequence parallel when given a group.

Owns: ColumnParallelLinear (and its LMHead), RowParallelLinear, VocabParallelEmbedding, RMSNorm, ScalarHead and
the ParallelLayer protocol they share (Shoeybi et al. 2019, "Megatron-LM";
Korthikanti et al. 2022 for sequence parallelism), and :func:`frozen_weight_casts`, the per-step
cache of frozen weights' autocast casts that the linears' forwards read through :func:`autocast_weight`.

Each layer is built at full (unsharded) shape and runs single-process until
:meth:`ParallelLayer.shard_` is called on it from ``aligner.parallel.tensor_parallel``
with a tp group: the layer then keeps only its slice of each parameter, and its
forward issues the collectives of the Megatron scheme. Model code never reads a rank.

Sharded parameter slices: column-parallel weights split dim 0 (outputs), row-parallel
weights split dim 1 (inputs), the vocab-parallel embedding splits dim 0 (vocabulary).
A layer may carry a custom ``row_index`` (the output rows it owns in the full weight),
used for GQA key/value heads replicated when num_kv_heads < tp_size.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from aligner.nn import comm
from aligner.nn.chunked import LogProbSpec, lm_head_log_probs


class ParallelLayer(nn.Module):
    """Base of layers that know how to shard themselves over a tensor-parallel group."""

    tp_group: Optional[dist.ProcessGroup] = None
    sequence_parallel: bool = False

    def shard_(self, tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool = False) -> None:
        """Keep this rank's slice of every parameter and use `tp_group` in forward."""
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and comm.group_size(tp_group) > 1

    def full_to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Slice a full (unsharded) tensor for parameter `name` down to this rank's shard."""
        return full

    def local_to_full_spec(self, name: str) -> tuple[Optional[int], Optional[torch.Tensor]]:
        """(dim, row_index) telling how shards of `name` assemble into the full tensor.

        dim None: replicated. row_index: LongTensor of full rows this rank holds along dim
        (None: contiguous equal chunks in tp-rank order).
        """
        return None, None


_casts = threading.local()  # .cache: {id(weight): (weight, (version, data_ptr, dtype), cast)} inside frozen_weight_casts


@contextlib.contextmanager
def frozen_weight_casts(enabled: bool = True) -> Iterator[None]:
    """Share the autocast casts of frozen weights between the micro-batches run inside the block.

    torch.autocast caches the cast of a trainable fp32 leaf for its whole context but casts a frozen
    weight (requires_grad False: a LoRA base, a prompt-learning model) again at every call, and
    F.linear saves that cast for backward, so each micro-batch in flight (1F1B) would hold its own
    copy. Inside the block :func:`autocast_weight` makes each frozen weight's cast once and hands the
    same tensor to every later call on this thread (a per-thread cache: gloo tests may run ranks as
    threads), so the micro-batches save one copy; the results are bitwise those of autocast's own
    cast (the same ``Tensor.to``). The cache is dropped when the outermost block exits; a nested
    block, or `enabled` False, changes nothing. With full recomputation leave it off: each layer's
    casts would then live to the end of the block where the recomputed layer holds only its own.
    The sequence-parallel column linears (:class:`_SPGatherLinears`) save the fp32 weight, not a
    cast, and do not use it.
    """
    if not enabled or getattr(_casts, "cache", None) is not None:
        yield
        return
    _casts.cache = {}
    try:
        yield
    finally:
        _casts.cache = None


def autocast_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight a linear's forward passes to F.linear: `w` itself, or inside
    :func:`frozen_weight_casts` its shared autocast copy.

    The copy ``w.detach().to(dtype)`` (same shape, the autocast dtype of w's device, e.g. bf16) is
    returned when grad is enabled, autocast is on for w's device type, and w is a plain frozen
    floating-point tensor (requires_grad False, not float64, not already in that dtype: the
    tensors autocast would cast), outside a torch.compile'd region. It is made on the first call in
    the block and made again after an in-place change of w (``w._version``: merge_adapters, a refit)
    or a rebinding of its data."""
    if torch.compiler.is_compiling():  # first, so a compiled block (parallel.compile) guards on nothing here: it casts as before
        return w
    cache = getattr(_casts, "cache", None)
    if cache is None or w.requires_grad or not torch.is_grad_enabled() or type(w) not in (torch.Tensor, nn.Parameter):
        return w
    dev = w.device.type
    if not torch.amp.is_autocast_available(dev) or not torch.is_autocast_enabled(dev):
        return w
    dtype = torch.get_autocast_dtype(dev)
    if not w.is_floating_point() or w.dtype in (dtype, torch.float64):
        return w
    stamp = (w._version, w.data_ptr(), dtype)
    hit = cache.get(id(w))
    if hit is not None and hit[0] is w and hit[1] == stamp:
        return hit[2]
    cast = w.detach().to(dtype)
    cache[id(w)] = (w, stamp, cast)  # holding w keeps its id from being reused inside the block
    return cast


def _replace_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad))


class ColumnParallelLinear(ParallelLayer):
    """y = x W^T + b with W: [out, in] split along `out` over the tp group.

    Args:
        in_features, out_features: full sizes.
        bias: add a bias (split with the outputs).
    Forward: x: [B, T, in] ([B, T/tp, in] with sequence parallelism) -> [B, T, out/tp].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.row_index: Optional[torch.Tensor] = None

    def _rows(self) -> torch.Tensor:
        if self.row_index is not None:
            return self.row_index
        n, r = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        per = self.out_features // n
        return torch.arange(r * per, (r + 1) * per)

    def shard_(self, tp_group, sequence_parallel: bool = False, row_index: Optional[torch.Tensor] = None) -> None:
        super().shard_(tp_group, sequence_parallel)
        n = comm.group_size(tp_group)
        if row_index is None and self.out_features % n:
            raise ValueError(f"ColumnParallelLinear: out_features={self.out_features} not divisible by tp_size={n}")
        self.row_index = row_index
        rows = self._rows()
        _replace_param(
            self,
            "weight",
            self.weight[rows]
            if self.weight.device.type != "meta"
            else torch.empty(len(rows), self.in_features, device="meta", dtype=self.weight.dtype),
        )
        if self.bias is not None:
            _replace_param(
                self,
                "bias",
                self.bias[rows] if self.bias.device.type != "meta" else torch.empty(len(rows), device="meta", dtype=self.bias.dtype),
            )

    def full_to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full[self._rows()] if comm.group_size(self.tp_group) > 1 or self.row_index is not None else full

    def local_to_full_spec(self, name: str):
        return 0, self.row_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linears(x, (self,))[0]


class LMHead(ColumnParallelLinear):
    """The causal LM's vocab-parallel output layer: a bias-free ColumnParallelLinear [V/tp, H].

    Forward: x [B, T, H] ([B, T/tp, H] with sequence parallelism) -> logits [B, T, V/tp]; or, with
    ``logprob`` (a :class:`aligner.nn.chunked.LogProbSpec`) and ``labels`` [B, R] int64, the
    per-token (log_probs [B, R] fp32, entropy [B, R] fp32 nats) at positions ``head_index`` [B, R]
    (all T when None) without the logits (:func:`aligner.nn.chunked.lm_head_log_probs`). Both run
    inside this module's own call, so a wrapper that gathers a module's parameters around its
    forward (DeepSpeed ZeRO-3) sees the weight on either path.
    """

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        logprob: Optional[LogProbSpec] = None,
        head_index: Optional[torch.Tensor] = None,
    ):
        if logprob is None:
            return super().forward(x)
        if labels is None:
            raise ValueError("LMHead: logprob needs labels [B, R] (the tokens to score)")
        return lm_head_log_probs(self, x, labels, logprob, head_index)


class _SPGatherLinears(torch.autograd.Function):
    """All-gather x along the sequence once, apply several column-parallel linears to it.

    Saves only the local shard x: [B, T/tp, in] and all-gathers it again in backward
    (Korthikanti et al. 2022, sec. 4.2.2), so the gathered input costs 1/tp of the memory.
    Backward: grad_x = reduce_scatter(sum_i g_i W_i), grad_W_i = g_i^T x_full, grad_b_i = sum g_i.
    """

    @staticmethod
    def forward(ctx, x, group, *weights_and_biases):
        full = comm._all_gather(x, group, comm.SEQ_DIM)
        pairs = list(zip(weights_and_biases[0::2], weights_and_biases[1::2]))
        ctx.group, ctx.has_bias = group, [b is not None for _, b in pairs]
        ctx.save_for_backward(x, *[w for w, _ in pairs])
        return tuple(F.linear(full, w, b) for w, b in pairs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = comm._all_gather(x, ctx.group, comm.SEQ_DIM).flatten(0, -2)
        grad_full, out = None, []
        for g, w, has_b in zip(grads, weights, ctx.has_bias):
            g2 = g.flatten(0, -2)
            gi = g2 @ w
            grad_full = gi if grad_full is None else grad_full + gi
            out += [g2.t() @ full, g2.sum(0) if has_b else None]
        grad_x = comm._reduce_scatter(grad_full.view(x.shape[0], -1, x.shape[-1]), ctx.group, comm.SEQ_DIM)
        return (grad_x, None, *out)


def column_parallel_linears(x: torch.Tensor, layers) -> tuple[torch.Tensor, ...]:
    """Apply column-parallel linears that share one input with one input collective.

    x: [B, T, in] ([B, T/tp, in] with sequence parallelism) -> one [B, T, out_i/tp] per layer.
    Without sequence parallelism the shared input passes one ``copy_to_tp`` (a single
    all-reduce of the summed input gradient in backward, as Megatron's fused QKV does);
    with it, one all-gather forward and one reduce-scatter backward, saving only the
    local shard. All layers must share tp_group and sequence_parallel. Layers packed by
    :func:`pack_linears` run as one GEMM over the packed weight (inference only).
    """
    first = layers[0]
    assert all(l.tp_group is first.tp_group and l.sequence_parallel == first.sequence_parallel for l in layers)
    adapters = [_active_adapter(l) for l in layers]
    if first.sequence_parallel:
        args = [t for l in layers for t in (l.weight, l.bias)]
        outs = _SPGatherLinears.apply(x, first.tp_group, *args)
        return tuple(o if a is None else o + a.column_delta(x) for o, a in zip(outs, adapters))
    x = comm.copy_to_tp(x, first.tp_group)
    if any(a is not None for a in adapters):  # LoRA: the packed GEMM is bypassed (aligner.nn.lora)
        return tuple(
            F.linear(x, autocast_weight(l.weight), l.bias) + (0 if a is None else a.column_delta(x)) for l, a in zip(layers, adapters)
        )
    inference = not torch.is_grad_enabled()
    packed = first.__dict__.get("packed")
    if packed is not None and packed[2] == tuple(layers) and inference:
        w, b, _ = packed
        y = onednn_linear(x, first.__dict__.get("onednn_group"), b) if "onednn_group" in first.__dict__ else F.linear(x, w, b)
        return y.split([l.weight.shape[0] for l in layers], dim=-1)
    if inference:
        return tuple(
            F.linear(x, l.weight, l.bias) if "onednn" not in l.__dict__ else onednn_linear(x, l.__dict__["onednn"], l.bias) for l in layers
        )
    return tuple(F.linear(x, autocast_weight(l.weight), l.bias) for l in layers)


def onednn_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


_onednn_runs: dict[tuple, tuple[bool, str]] = {}


def onednn_supports(dtype: torch.dtype) -> tuple[bool, str]:
    """(True, "") when oneDNN's prepacked linear runs here for weights and inputs of `dtype`, else
    (False, why): the build has the ops (:func:`onednn_available`), the ISA cap allows the dtype
    (:func:`aligner.nn.cpu_isa.onednn_bf16_allowed`: bf16 needs AVX-512 or AVX-NE-CONVERT), torch's
    own query agrees (``torch.ops.mkldnn._is_mkldnn_bf16_supported`` / ``_fp16_``, which follow
    ``ONEDNN_MAX_CPU_ISA``), and last a [8, 8] weight packed and multiplied in `dtype` does not raise.
    Kept per (dtype, :func:`aligner.nn.cpu_isa.isa_signature`)."""
    from aligner.nn.cpu_isa import isa_signature, onednn_bf16_allowed

    key = (dtype, isa_signature())
    if key in _onednn_runs:
        return _onednn_runs[key]
    name = str(dtype).removeprefix("torch.")
    why = ""
    if not onednn_available():
        why = "this torch build has no oneDNN linear ops"
    elif dtype == torch.bfloat16 and not onednn_bf16_allowed():
        from aligner.nn.cpu_isa import ISA_ENV, isa_cap

        why = f"oneDNN's bf16 linear needs AVX-512 or AVX-NE-CONVERT and {ISA_ENV}={isa_cap()} caps the CPU below it"
    elif dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        why = "oneDNN's bf16 linear does not run on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
    elif dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        why = "oneDNN's fp16 linear does not run on this CPU (it needs AVX-512 FP16 or AVX-NE-CONVERT)"
    elif dtype not in (torch.float32, torch.bfloat16, torch.float16):
        why = f"oneDNN's prepacked linear takes float32, bfloat16 or float16, not {name}"
    else:
        try:
            w = torch.ones(8, 8, dtype=dtype)
            onednn_linear(torch.ones(2, 8, dtype=dtype), onednn_pack(w, 2), None)
        except RuntimeError as e:
            why = f"oneDNN's {name} linear failed here: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
    _onednn_runs[key] = (not why, why)
    return _onednn_runs[key]


def onednn_pack(weight: torch.Tensor, batch: int) -> torch.Tensor:
    """oneDNN's blocked copy of a CPU linear weight [out, in] (fp32 or bf16), laid out for inputs of
    about `batch` rows (an opaque ``torch._mkldnn`` tensor, the same bytes as `weight`).

    It is a copy: a later in-place change of `weight` does not reach it (pack again).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x W^T + b with W prepacked by :func:`onednn_pack`: x [..., in] -> [..., out] (fp32
    accumulation; its own GEMM kernel, so results differ from F.linear's in the last bits)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_onednn(model: nn.Module, batch: int) -> int:
    """Give every Column/RowParallelLinear under `model` a oneDNN-prepacked copy of its weight
    (each :func:`pack_linears` group one copy of its packed weight), which their forwards use
    when grad is off (inference only; LoRA adapters bypass it). CPU only; it doubles the bytes
    held for linear weights. Raises ValueError where oneDNN's linear does not run for the weights'
    dtype here (:func:`onednn_supports`). The copies are snapshots: whoever changes the weights (a refit)
    calls this again, or :func:`drop_onednn` to go back to F.linear. Returns the bytes packed.
    """
    drop_onednn(model)
    weights = [m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    if weights:
        ok, why = onednn_supports(weights[0].dtype)
        if not ok:
            raise ValueError(f"prepack_onednn: {why}; multiply with F.linear instead (the engine's cpu_layout out_in or in_out)")
    nbytes = 0
    with torch.no_grad():
        for m in model.modules():
            packed = m.__dict__.get("packed")
            if packed is not None:
                m.__dict__["onednn_group"] = onednn_pack(packed[0], batch)
                nbytes += packed[0].numel() * packed[0].element_size()
        grouped = {id(l) for m in model.modules() if "packed" in m.__dict__ for l in m.__dict__["packed"][2]}
        for m in model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and id(m) not in grouped:
                m.__dict__["onednn"] = onednn_pack(m.weight, batch)
                nbytes += m.weight.numel() * m.weight.element_size()
    return nbytes


def drop_onednn(model: nn.Module) -> None:
    """Forget every :func:`prepack_onednn` copy under `model` (forwards use F.linear again)."""
    for m in model.modules():
        m.__dict__.pop("onednn", None)
        m.__dict__.pop("onednn_group", None)


def _active_adapter(layer: nn.Module):
    """The layer's LoRA adapter (:class:`aligner.nn.lora.LoraAdapter`) when it adds its term, else None."""
    ad = layer._modules.get("lora")
    return ad if ad is not None and ad.active else None


def pack_linears(layers, device: torch.device, transposed: bool) -> None:
    """Make the weights (and biases) of column-parallel `layers` that share an input row blocks
    of one tensor on `device`, so :func:`column_parallel_linears` runs them as one GEMM
    (vLLM's QKVParallelLinear idea, for inference).

    Each layer's parameters become views into the packed tensor (the Parameter objects stay),
    so an in-place ``copy_`` into ``q_proj.weight`` (a refit) writes what the GEMM reads.
    transposed: store the packed weight as [in, sum out_i] (its ``.t()`` view is what F.linear
    gets), the no-transpose GEMM form that is faster on some CPUs. Training never packs.
    """
    layers = tuple(layers)
    w = _pack_rows([l.weight for l in layers], device, transposed)
    b = None if layers[0].bias is None else _pack_rows([l.bias for l in layers], device, False)
    layers[0].__dict__["packed"] = (w, b, layers)


def unpack_linears(module: nn.Module) -> None:
    """Forget every :func:`pack_linears` grouping under `module` (the parameters keep their values)."""
    for m in module.modules():
        m.__dict__.pop("packed", None)


def _pack_rows(tensors: list[torch.Tensor], device: torch.device, transposed: bool) -> torch.Tensor:
    """Concatenate [out_i, ...] tensors along dim 0 into one new tensor on `device` (stored as
    [in, sum out_i] when `transposed`) and rebind each tensor's .data to its row block; returns the whole."""
    rows = [t.shape[0] for t in tensors]
    if transposed:
        whole = torch.cat([t.to(device).t() for t in tensors], dim=1).t()
    else:
        whole = torch.cat([t.to(device) for t in tensors], dim=0)
    for t, part in zip(tensors, whole.split(rows, 0)):
        t.data = part
    return whole


class RowParallelLinear(ParallelLayer):
    """y = x W^T + b with W: [out, in] split along `in`; partial sums all-reduced over tp.

    Forward: x: [B, T, in/tp] -> [B, T, out] ([B, T/tp, out] reduce-scattered with
    sequence parallelism). The bias is replicated and added after the reduction.
    ``residual`` [B, T(/tp), out] is added to the output; without grad, tp = 1 and no bias the
    add runs inside the GEMM (``addmm``, or oneDNN's fused binary add with a
    :func:`prepack_onednn` weight), one kernel fewer per layer in decode.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def shard_(self, tp_group, sequence_parallel: bool = False) -> None:
        super().shard_(tp_group, sequence_parallel)
        n = comm.group_size(tp_group)
        if self.in_features % n:
            raise ValueError(f"RowParallelLinear: in_features={self.in_features} not divisible by tp_size={n}")
        _replace_param(
            self,
            "weight",
            self.full_to_local("weight", self.weight)
            if self.weight.device.type != "meta"
            else torch.empty(self.out_features, self.in_features // n, device="meta", dtype=self.weight.dtype),
        )

    def full_to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "bias":
            return full
        n, r = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        return full.chunk(n, dim=1)[r] if n > 1 else full

    def local_to_full_spec(self, name: str):
        return (None, None) if name == "bias" else (1, None)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        adapter = _active_adapter(self)
        packed = self.__dict__.get("onednn") if adapter is None and not torch.is_grad_enabled() else None
        if (
            residual is not None
            and self.bias is None
            and adapter is None
            and comm.group_size(self.tp_group) == 1
            and not torch.is_grad_enabled()
        ):
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
            return torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), self.weight.t()).view_as(residual)
        y = F.linear(x, autocast_weight(self.weight)) if packed is None else onednn_linear(x, packed, None)
        if adapter is not None:  # LoRA's partial B A_local x_local, before the reduction (aligner.nn.lora)
            y = y + adapter.row_delta(x)
        if self.sequence_parallel:
            y = comm.scatter_to_sp(y, self.tp_group)
        else:
            y = comm.reduce_from_tp(y, self.tp_group)
        y = y if self.bias is None else y + self.bias
        return y if residual is None else residual + y


class VocabParallelEmbedding(ParallelLayer):
    """Token embedding with the vocabulary split over tp (Megatron VocabParallelEmbedding).

    Forward: input_ids: [B, T] int64 -> [B, T, H] (all-reduced), or [B, T/tp, H]
    (reduce-scattered) with sequence parallelism. Ids outside this rank's range
    contribute zeros. num_embeddings must be divisible by tp_size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.vocab_start = 0

    def shard_(self, tp_group, sequence_parallel: bool = False) -> None:
        super().shard_(tp_group, sequence_parallel)
        n = comm.group_size(tp_group)
        if self.num_embeddings % n:
            raise ValueError(f"VocabParallelEmbedding: vocab_size={self.num_embeddings} not divisible by tp_size={n}")
        per = self.num_embeddings // n
        self.vocab_start = comm.group_rank(tp_group) * per
        _replace_param(
            self,
            "weight",
            self.full_to_local("weight", self.weight)
            if self.weight.device.type != "meta"
            else torch.empty(per, self.embedding_dim, device="meta", dtype=self.weight.dtype),
        )

    def full_to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        n, r = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        return full.chunk(n, dim=0)[r] if n > 1 else full

    def local_to_full_spec(self, name: str):
        return 0, None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if comm.group_size(self.tp_group) == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.scatter_to_sp(out, self.tp_group)
        return comm.reduce_from_tp(out, self.tp_group)


class _RMSNormFn(torch.autograd.Function):
    """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), saving for backward only x
    (in its own dtype) and the fp32 rsqrt per row, not the fp32 copy and the normalized tensor the
    op-by-op graph keeps (Megatron's and Apex's fused norms save the same); backward recomputes the
    normalized rows and runs the op-by-op graph's backward ops in its order (equal gradients)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        y = (h * r).to(x.dtype)
        ctx.save_for_backward(x, weight, r)
        return weight * y

    @staticmethod
    def backward(ctx, grad):
        x, weight, r = ctx.saved_tensors
        h = x.float()
        y = (h * r).to(x.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * y).sum_to_size(weight.shape).to(weight.dtype)
        grad_h = (grad * weight).to(x.dtype).float()  # y's gradient in y's dtype, then through .to(dtype) back to fp32
        grad_r = (grad_h * h).sum(-1, keepdim=True)
        grad_m = -0.5 * grad_r * r.pow(3)  # rsqrt'(m) = -r^3 / 2, in autograd's order
        grad_x = grad_h * r + grad_m.expand_as(h) / h.shape[-1] * (2.0 * h)
        return grad_x.to(x.dtype), grad_w, None


class _SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up, saving only gate and up (the op-by-op graph also keeps silu(gate)): backward
    recomputes silu(gate) and uses the same ``aten.silu_backward`` as autograd (equal gradients)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (Shazeer 2020), [..., I] each -> [..., I]; under autograd only gate and up are
    saved for backward (2 of the 3 I-wide tensors the op-by-op graph keeps)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLUFn.apply(gate, up)
    return F.silu(gate) * up


class RMSNorm(ParallelLayer):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in fp32 as HF Llama does.

    Forward: x: [..., H] -> [..., H] in x's dtype. The weight is replicated over tp;
    with sequence parallelism its gradient is partial per rank and is all-reduced over
    the tp group by ``aligner.parallel.tensor_parallel.sync_tp_grads``. Under autograd only x and
    the fp32 rsqrt per row are saved for backward (:class:`_RMSNormFn`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one kernel, the same math (inference)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ScalarHead(ParallelLayer):
    """Replicated Linear(H, 1) head (HF ``score``) for values and rewards.

    Forward: h [B, T(/tp), H] -> [B, T] fp32. With sequence parallelism the sequence is
    gathered first (backward keeps this rank's slice: every rank computes the same loss).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            h = comm.gather_from_sp_replicated(h, self.tp_group)
        return F.linear(h, autocast_weight(self.weight)).squeeze(-1).float()
