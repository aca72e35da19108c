"""Per-layer communication and activation-memory accounting for TP / SP / recomputation.

Owns: measuring what one decoder layer communicates (:func:`layer_comm`, via
``aligner.nn.comm.CommCounter``) and what it saves for backward
(:func:`layer_saved_bytes`, via ``torch.autograd.graph.saved_tensors_hooks``, deduped by
storage, parameters and layer-shared inputs excluded), and the closed forms they are
compared with: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2; :func:`korthikanti_bytes`) and the same derivation redone
for this model (:func:`layer_activation_bytes`, the one activation-memory model: the planner
uses it, and tests/parallel/test_memory.py checks it against measured saved bytes).

Derivation for our Llama layer (elements saved per layer; s seq, b micro-batch, h hidden,
a query heads, i SwiGLU width, t tp_size), term by term against the paper's GPT layer:

    RMSNorm x2          2 * input sbh + 2 sb (rsqrt)                    paper LayerNorm: input only (fused kernel)
                        (aligner.nn.layers._RMSNormFn recomputes the normalized rows in backward)
    linear inputs       QKV input sbh + MLP input sbh                   same as paper
    attention           q, k, v (post-RoPE; GQA k/v repeated to a heads) same as paper (QK^T inputs, V)
                        + output-projection input sbh                   same as paper
                        + logsumexp a*sb                                paper: softmax 2as^2b + its dropout
                        + additive float mask b*s^2 (packed batches only) mask and output (fused flash kernel here)
    SwiGLU              gate, up, product: 3 * sbi                      paper GeLU: 4h input + 4h output
                        (aligner.nn.layers.swiglu recomputes silu(gate) in backward)
    dropout             none (Llama has no dropout)                     paper: 2 sbh masks + as^2b mask

    none:       sbh (8 + 3i/h + (a + 2)/h) [+ b s^2 packed]
    TP:         norms and the two linear inputs are replicated: sbh (4 + 2/h) + sbh (4 + 3i/h + a/h) / t [+ b s^2]
    TP + SP:    everything in T/t (linear inputs saved as the local shard, re-gathered in backward):
                [sbh (8 + 3i/h + (a + 2)/h)] / t [+ b s^2]
    selective:  the attention core (logsumexp, float mask) is recomputed: drop a*sb/t and b s^2;
                its saved inputs k, v are the kv-head tensors (GQA repeat happens inside the core):
                q, k, v cost sbh (1 + 2 kv/a) instead of 3 sbh
    full:       only the layer input: sbh (sbh/t with SP)

RoPE's cos/sin [b, s, hd] (and a packed batch's boolean mask) are built once per forward and
shared by all layers, so they are excluded (as the paper excludes embeddings). Unpacked
batches use SDPA's causal kernels and save no mask at all. Bytes = elements x
element size (4 in fp32 here; the paper counts 2-byte activations and 1-byte dropout masks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn

from aligner.model.llama import build_attention_mask, rope_cos_sin
from aligner.nn import comm
from aligner.parallel.tensor_parallel import seq_shards


@dataclass(frozen=True)
class LayerDims:
    """Sizes in the formulas: s seq len (tokens), b micro-batch, h hidden, a heads, i SwiGLU width,
    t tp_size, kv key/value heads (None: a), hd head dim (None: h // a)."""

    s: int
    b: int
    h: int
    a: int
    i: int
    t: int = 1
    kv: int | None = None
    hd: int | None = None

    @classmethod
    def of(cls, model, seq_len: int, batch: int = 1, tp: int = 1) -> LayerDims:
        """The dims of a ModelConfig `model` for a [batch, seq_len] micro-batch on tp ranks."""
        return cls(
            s=seq_len,
            b=batch,
            h=model.hidden_size,
            a=model.num_heads,
            i=model.intermediate_size,
            t=tp,
            kv=model.num_kv_heads,
            hd=model.resolved_head_dim,
        )


def korthikanti_bytes(d: LayerDims, sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes per transformer layer from Korthikanti et al. 2022, Table 2 (16-bit GPT layer).

    none: sbh(10 + 24/t + 5as/(ht)); with SP: sbh/t (34 + 5as/h); selective: 34 sbh/t with SP,
    sbh(10 + 24/t) without; full: 2 sbh (2 sbh/t with SP).
    """
    s, b, h, a, t = d.s, d.b, d.h, d.a, d.t
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attn = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh * (34 + attn) / t
    return sbh * (10 + 24 / t + attn / t)


PRECISIONS = ("fp32", "bf16", "autocast")


def layer_activation_bytes(
    d: LayerDims, precision: str = "fp32", sequence_parallel: bool = False, recompute: str = "none", mask: bool = False
) -> float:
    """Bytes one decoder layer saves for backward on one [b, s] micro-batch: the activation-memory
    model of aligner (the planner's, and the one the accounting tests measure).

    precision: how the layer computes.
        fp32      fp32 parameters and activations (element size e = 4).
        bf16      bf16 parameters and activations (e = 2): FSDP2's and DeepSpeed's bf16 mixed
                  precision. RMSNorm keeps its fp32 statistic (one per row).
        autocast  fp32 parameters under ``torch.autocast(bfloat16)`` (DDP, or one dp rank): the
                  residual stream and the norms stay fp32; each linear saves its own bf16 cast of
                  its input (three casts of the shared q/k/v input, two of the gate/up input) and
                  of its weight (autocast's weight-cast cache: 2 bytes per layer parameter, per
                  micro-batch in flight); post-RoPE q and k are fp32 (fp32 cos/sin).
    sequence_parallel, recompute (none | selective | full), mask (a packed batch's additive
    b*s^2 mask, "none" only): as in the module docstring; t = d.t.
    Raises ValueError: an unknown precision or recompute mode.

    Per token (elements x bytes), t-sharded terms / t, replicated terms / t only with SP:
        norms      2 (2eh + 4): input, output, rsqrt [fp32, bf16]; 2 (4h + 4) + 10 * 2h casts [autocast]
        attention  q, k, v (k, v repeated to a heads) 3 e q + output e q + fp32 log-sum-exp 4a;
                   selective keeps the core's inputs instead (e q + 2 e kv; autocast 4q + 6kv)
                   and the output, and drops the log-sum-exp and the mask
        SwiGLU     gate, up, product: 3 e i (silu(gate) recomputed)
        full       only the layer input: e h (4h under autocast)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: valid choices are {', '.join(PRECISIONS)}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: valid choices are none, selective, full")
    s, b, h, a, i, t = d.s, d.b, d.h, d.a, d.i, d.t
    hd = d.hd or h // a
    tokens = s * b
    split = t if sequence_parallel else 1
    auto = precision == "autocast"
    e = 4 if precision == "fp32" else 2
    if recompute == "full":
        return tokens * (4 if auto else e) * h / split
    q = a * hd
    kv = max(d.kv or a, t) * hd  # kv heads replicated when fewer than t: each rank holds one
    if auto:
        # per norm its fp32 input and fp32 rsqrt (aligner.nn.layers._RMSNormFn); bf16 input casts: one per
        # linear without SP, with SP the local fp32 shard once per linear group (re-gathered in backward)
        replicated = 2 * (4 * h + 4) + (2 * 4 * h if sequence_parallel else 5 * 2 * h)
        if recompute == "selective":
            attn = 4 * q + 4 * kv + 2 * kv + 2 * q  # fp32 post-RoPE q, k; bf16 v; bf16 output
        else:
            attn = 3 * 2 * q + 2 * q + 4 * a
        sharded = attn + 3 * 2 * i  # SwiGLU: gate, up (aligner.nn.layers.swiglu) and the down projection's input
        weights = 2 * ((2 * q + 2 * kv) * h + 3 * h * i) / t  # bf16 casts of q, k, v, o, gate, up, down
        body = tokens * ((replicated / split) + sharded / t) + weights
    else:
        replicated = 2 * (2 * e * h + 4)  # per norm: its input and rsqrt, and its output (the next linears' input)
        if recompute == "selective":
            attn = e * (q + 2 * kv) + e * q
        else:
            attn = 3 * e * q + e * q + 4 * a
        sharded = attn + 3 * e * i
        body = tokens * (replicated / split + sharded / t)
    mask_bytes = e * b * s * s if (mask and recompute == "none") else 0
    return body + mask_bytes


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def saved_bytes(fn, *args, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes autograd saves for backward while running fn(*args), each storage counted once.

    Storages of `exclude` (parameters, layer-shared inputs) are not counted. Tensors saved
    inside non-reentrant checkpoints are not saved (they are recomputed), so they are not seen;
    the checkpoint's own saved inputs are.
    """
    skip = {_storage_key(t) for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(seen.values())


def _layer_inputs(model: nn.Module, batch_size: int, seq_len: int, requires_grad: bool):
    trunk = model.model
    shards = seq_shards(model)
    if seq_len % shards:
        raise ValueError(f"seq_len={seq_len} must be divisible by tp_size={shards} with sequence parallelism")
    p = next(model.parameters())
    h = torch.randn(batch_size, seq_len // shards, model.cfg.hidden_size, dtype=p.dtype, device=p.device, requires_grad=requires_grad)
    cos, sin = rope_cos_sin(trunk.inv_freq, torch.arange(seq_len, device=p.device).expand(batch_size, seq_len), p.dtype)
    return h, cos, sin, build_attention_mask(batch_size, seq_len, p.device)


def layer_saved_bytes(model: nn.Module, batch_size: int, seq_len: int, layer: str | None = None) -> int:
    """Bytes this rank's decoder layer `layer` (default: the first) saves for backward on one
    micro-batch [batch_size, seq_len], under the model's recompute mode and TP/SP sharding.

    Excludes parameters and the layer-shared cos/sin (a plain causal micro-batch has no mask).
    """
    trunk = model.model
    block = trunk.layers[layer or next(iter(trunk.layers))]
    h, cos, sin, mask = _layer_inputs(model, batch_size, seq_len, requires_grad=True)

    def run(x):  # recomputation, if any, is on the block itself (aligner.parallel.parallelize.apply_recompute)
        return block(x, cos, sin, mask)

    return saved_bytes(run, h, exclude=[*model.parameters(), cos, sin, *([] if mask is None else [mask])])


def layer_comm(model: nn.Module, batch_size: int, seq_len: int, backward: bool = False) -> comm.CommCounter:
    """Collectives one decoder layer issues on a [batch_size, seq_len] micro-batch (forward, or
    forward + backward); counts and elements per op in the returned CommCounter."""
    trunk = model.model
    block = trunk.layers[next(iter(trunk.layers))]
    h, cos, sin, mask = _layer_inputs(model, batch_size, seq_len, requires_grad=backward)
    with comm.CommCounter() as c, torch.set_grad_enabled(backward):
        out = block(h, cos, sin, mask)
        if backward:
            out.sum().backward()
    return c
