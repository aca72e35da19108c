"""Context parallelism (CP): one sequence split over a cp group, attention by all-gather of K/V.

Owns the zigzag sequence layout (:func:`zigzag_index`, :func:`zigzag_split`,
:func:`zigzag_gather`), the CP attention applied to a built model from outside
(:func:`apply_context_parallel`), the inputs of a cp rank (:func:`cp_inputs`: globally shifted
labels, global RoPE positions, the mask rows of packed / shared-prompt batches), the token-mean
across cp (:func:`cp_token_mean`) and the gradient sum over cp (:func:`sync_cp_grads`).

Layout (load-balanced causal CP, Megatron-LM CP / ring-attention implementations): a sequence of
S tokens (padded to a multiple of 2 * cp) is cut into 2 * cp chunks of c = S / (2 cp); cp rank r
holds chunks r and 2cp-1-r, so every rank does the same causal attention work (chunk j's queries
see (j + 1) c keys; r + 1 + 2cp - r = 2cp + 1 chunks of keys per rank). Embeddings, norms, MLPs
and the head are per token and run on the rank's 2c tokens unchanged; RoPE reads the global
positions (:func:`cp_inputs` passes them as ``position_ids``).

Attention: each layer all-gathers K and V (the kv heads only: GQA's num_kv_heads, after TP's
split) over the cp group and reorders them to global order; each rank's queries then attend to
the keys with a global position <= their own: the chunk-r queries to the first (r + 1) c keys and
the chunk-(2cp-1-r) queries to the first (2cp - r) c keys, each one SDPA call with a lower-right
aligned causal mask (``torch.nn.attention.bias.causal_lower_right``: no mask tensor on CUDA, whose
efficient-attention kernel takes it; elsewhere torch materializes a [c, end] bool mask, quadratic in
S: benchmarks/context_parallel.py). Backward reduce-scatters dK and dV (each rank's queries give a
partial gradient of every key). This is Llama 3's CP (Dubey et al. 2024, sec. 3.3.2).

Why all-gather, per layer, for B sequences of S tokens, h query / g kv heads per tp rank, head
dim d, e bytes per element (Llama 3 8B at tp 1: h 32, g 8, d 128, bf16 e 2; S 128k, cp 8, B 1):

    all-gather K/V   received 2 g S d e (cp-1)/cp forward, the same reduce-scattered backward
                     (448 MiB each way); holds the full K and V, 2 g S d e (512 MiB) during
                     the layer (re-gathered in backward under recompute=selective); the stock
                     attention kernel, any mask (packed documents, shared prompts), no head limit.
    ring (K/V p2p)   the same volume in cp-1 send/recv steps, overlappable with compute; holds
                     two K/V chunks, 2 * 2 g (S/cp) d e (128 MiB); needs each step's log-sum-exp
                     to merge partial softmaxes (not exposed by SDPA on CPU), a second ring pass
                     for dK/dV in backward, and a per-step mask for packed documents.
    Ulysses (a2a)    all-to-all of q, k, v and the output: 2 (h + g) (S/cp) d e (cp-1)/cp
                     (280 MiB) forward and backward; holds (h + 2g)/cp heads of the full sequence
                     (192 MiB); needs cp to divide h and g (per tp rank): Llama 3 8B at tp 8 has
                     one kv head per rank, so Ulysses cannot split it at all.

All-gather moves 2 g S against Ulysses' 2 (h + g) S / cp: it is the smaller exchange while
cp < (h + g) / g (5 for Llama 3's 4:1 GQA), it is exact with the attention every layout already
uses (the tests compare it with one process at 1e-5), it composes with TP at any head count and
with document masks, and it has no ring's merge or second backward pass. Its cost is the full K/V
per layer (g / h of the query size), which GQA keeps small; ring attention is the choice where
that does not fit (cp >> 8 or MHA models).

The rollout engine never uses CP (its KV cache is per sequence); :func:`apply_context_parallel`
models serve training forwards only.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from aligner.nn import comm
from aligner.parallel.data_parallel import flat_all_reduce_

SEQ = 1  # the sequence dim of [B, S, ...] batch tensors
KV_SEQ = 3  # the sequence dim of stacked K/V [2, B, kvh, T, hd]


# ---- layout ------------------------------------------------------------------------------------
def check_cp_length(seq_len: int, cp_size: int) -> None:
    """Raise ValueError when `seq_len` is not a multiple of 2 * cp_size (pad with :func:`pad_to_cp` first)."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallelism: sequence length {seq_len} is not a multiple of 2 * cp_size = {2 * cp_size}; "
            f"pad it to {padded_len(seq_len, cp_size)} (aligner.parallel.context_parallel.pad_to_cp)"
        )


def padded_len(seq_len: int, cp_size: int) -> int:
    """The smallest multiple of 2 * cp_size that is >= seq_len."""
    m = 2 * cp_size
    return -(-seq_len // m) * m


def zigzag_index(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions [2c] int64 of cp rank `cp_rank`'s tokens: chunk r, then chunk 2cp-1-r (c = S / 2cp).

    Raises ValueError: seq_len not a multiple of 2 * cp_size.
    """
    check_cp_length(seq_len, cp_size)
    c = seq_len // (2 * cp_size)
    a, b = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(a, a + c, device=device), torch.arange(b, b + c, device=device)])


def rank_major_order(seq_len: int, cp_size: int, device=None) -> torch.Tensor:
    """[S] int64: the global position at each index of an all-gather over cp (rank 0's tokens, rank 1's, ...)."""
    return torch.cat([zigzag_index(seq_len, cp_size, r, device) for r in range(cp_size)])


def pad_to_cp(x: torch.Tensor, cp_size: int, value=0, dim: int = SEQ) -> torch.Tensor:
    """x padded at the end of `dim` with `value` to a multiple of 2 * cp_size (x itself when it is one)."""
    return _pad_to(x, padded_len(x.shape[dim], cp_size), value, dim)


def _pad_to(x: torch.Tensor, s: int, value, dim: int = SEQ) -> torch.Tensor:
    """x right-padded along `dim` with `value` to `s` positions (x itself when it has them)."""
    if x.shape[dim] == s:
        return x
    shape = list(x.shape)
    shape[dim] = s - x.shape[dim]
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def zigzag_split(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = SEQ) -> torch.Tensor:
    """x [B, S, ...] (any dtype, the same on every cp rank) -> this rank's [B, 2c, ...] (chunks r and 2cp-1-r).

    Not differentiable through the split (inputs: ids, positions, labels, masks, per-token targets).
    Raises ValueError: S not a multiple of 2 * cp_size.
    """
    cp = comm.group_size(group)
    if cp == 1:
        return x
    return x.index_select(dim, zigzag_index(x.shape[dim], cp, comm.group_rank(group), x.device))


class _ZigzagGather(torch.autograd.Function):
    """All-gather along `dim` and reorder to global order; backward keeps this rank's positions
    (every rank's consumer of the gathered tensor is the same replicated computation)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        cp, n = comm.group_size(group), x.shape[dim] * comm.group_size(group)
        order = rank_major_order(n, cp, x.device)
        ctx.group, ctx.dim, ctx.local = group, dim, zigzag_index(n, cp, comm.group_rank(group), x.device)
        return comm._all_gather(x, group, dim).index_select(dim, torch.argsort(order))

    @staticmethod
    def backward(ctx, g):
        return g.index_select(ctx.dim, ctx.local), None, None


def zigzag_gather(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = SEQ) -> torch.Tensor:
    """This rank's [B, 2c, ...] -> the full [B, S, ...] in global order on every cp rank (inverse of
    :func:`zigzag_split`). Differentiable: the gradient of a replicated consumer flows to this rank's slice."""
    if comm.group_size(group) == 1:
        return x
    return _ZigzagGather.apply(x, group, dim)


# ---- attention ---------------------------------------------------------------------------------
class _GatherKV(torch.autograd.Function):
    """(k, v) [B, kvh, 2c, hd] each -> (k, v) [B, kvh, S, hd] in global order; one all-gather
    forward, one reduce-scatter (sum of every rank's partial dK, dV) backward."""

    @staticmethod
    def forward(ctx, k, v, group):
        cp = comm.group_size(group)
        order = rank_major_order(k.shape[2] * cp, cp, k.device)
        ctx.group, ctx.order = group, order
        full = comm._all_gather(torch.stack([k, v]), group, KV_SEQ).index_select(KV_SEQ, torch.argsort(order))
        return full[0], full[1]

    @staticmethod
    def backward(ctx, gk, gv):
        g = torch.stack([gk, gv]).index_select(KV_SEQ, ctx.order)
        g = comm._reduce_scatter(g, ctx.group, KV_SEQ)
        return g[0], g[1], None


def gather_kv(k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, kvh, 2c, hd] of this cp rank -> [B, kvh, S, hd] each, global order (all-gather / reduce-scatter)."""
    if comm.group_size(group) == 1:
        return k, v
    return _GatherKV.apply(k, v, group)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, group) -> torch.Tensor:
    """Causal attention of this cp rank's queries over the whole sequence's keys: softmax(q k^T /
    sqrt(hd)) v, the same math as :meth:`aligner.model.llama.Attention.core`, whose place it takes.

    GQA runs inside SDPA (``enable_gqa``): the kv heads are never repeated, so a layer saves the
    gathered K and V once (2 kvh S hd elements) for backward, not h / kvh copies per query chunk.
    q [B, h, 2c, hd], k, v [B, kvh, 2c, hd]: this
        rank's tokens in zigzag order, RoPE applied with global positions. mask: None (plain
        causal: right padding needs no mask) or bool [B, 1, 2c, S] whose keys are in global order
        (:func:`cp_inputs` builds it). Returns [B, h, 2c, hd].
    Raises ValueError: a mask whose key dim is not S (a local mask built without :func:`cp_inputs`).
    """
    cp, r = comm.group_size(group), comm.group_rank(group)
    c = q.shape[2] // 2
    s = 2 * c * cp
    if mask is not None and mask.shape[-1] != s:
        raise ValueError(
            f"context parallelism: attn_mask has {mask.shape[-1]} keys, expected the whole sequence's {s}: "
            "build the model inputs with aligner.parallel.context_parallel.cp_inputs"
        )
    k, v = gather_kv(k, v, group)
    outs = []
    for rows, end in ((slice(0, c), (r + 1) * c), (slice(c, 2 * c), (2 * cp - r) * c)):
        if mask is not None:
            m = mask[:, :, rows, :end]
        else:  # the last query of the chunk is key end-1: lower-right aligned causal (none for one query)
            from torch.nn.attention.bias import causal_lower_right  # here, not at import: it imports torch._dynamo (~1 s per process)

            m = causal_lower_right(c, end) if c > 1 else None
        outs.append(F.scaled_dot_product_attention(q[:, :, rows], k[:, :, :end], v[:, :, :end], attn_mask=m, enable_gqa=True))
    return torch.cat(outs, dim=2)


def apply_context_parallel(model: nn.Module, cp_group: Optional[dist.ProcessGroup]) -> nn.Module:
    """Make every attention layer of `model` (LlamaForCausalLM / LlamaForScore, full or a TP/PP part)
    attend across `cp_group`, from outside the model: each ``self_attn.core`` is replaced on the
    instance by :func:`cp_attention` (so ``recompute=selective`` later checkpoints it, all-gather
    included: backward gathers again instead of keeping the full K/V). Sets ``model.cp_group``.
    No-op for a group of one rank. Returns `model`.

    MoE models: every :class:`aligner.model.moe.SparseMoE` block gets ``cp_group``, so its router's
    auxiliary losses and statistics are reduced over the cp ranks (the whole sequence's tokens,
    :func:`aligner.model.moe.cp_router_losses`); its ``token_mask`` input is this rank's share
    (:func:`cp_micro_batch` splits it).

    The model's inputs must then come from :func:`cp_inputs` (this rank's tokens, global positions,
    global-key masks). Raises ValueError: the model uses the Transformer Engine backend; an MoE
    block with the Sinkhorn router or a capacity factor (both decide per forward from the rank's
    tokens alone, so the routing would differ from one process).
    """
    from aligner.model.moe import moe_layers

    model.cp_group = cp_group
    if comm.group_size(cp_group) == 1:
        return model
    if getattr(model.cfg, "backend", "torch") != "torch":
        raise ValueError(f"context parallelism needs model.backend=torch, not {model.cfg.backend!r}")
    for moe in moe_layers(model):
        if moe.router != "topk_softmax" or moe.capacity_factor is not None:
            raise ValueError(
                f"context parallelism with an MoE model needs model.moe_router=topk_softmax and model.moe_capacity_factor=null, "
                f"not {moe.router!r} / {moe.capacity_factor!r}: both route each cp rank's tokens alone"
            )
        moe.cp_group = cp_group
    for layer in model.model.layers.values():
        attn = layer.self_attn
        attn.__dict__["core"] = functools.partial(cp_attention, group=cp_group)
        attn.cp_group = cp_group
    return model


# ---- inputs, loss and gradients ----------------------------------------------------------------
def shift_labels(input_ids: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """labels [B, S] int64: labels[:, t] = input_ids[:, t + 1], the last column `pad_id` (mask it).

    Shift BEFORE :func:`zigzag_split`: a chunk's last token is scored against the first token of
    the next chunk, which lives on another cp rank.
    """
    return torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), pad_id)], dim=1)


def cp_inputs(
    input_ids: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    position_ids: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
    prompt_segments: Optional[torch.Tensor] = None,
    pad_id: int = 0,
    seq_multiple: int = 1,
) -> dict:
    """This cp rank's share of a batch, for a model under :func:`apply_context_parallel`.

    input_ids [B, S0] int64, the whole right-padded batch (the same on every cp rank). Optional, each
    [B, S0]: position_ids (default 0..S0-1, restarting per segment with segment_ids), segment_ids
    (packed documents, 0 = padding: block-diagonal causal), prompt_segments (shared-prompt rows,
    :func:`aligner.model.llama.shared_prompt_mask`; -1 = padding). S0 is padded to
    S = :func:`padded_len` (ids with pad_id, positions continuing, segments with 0 / -1), a multiple
    of 2 * cp_size * seq_multiple (sequence parallelism needs each rank's 2c tokens to split over tp).

    Returns dict: ``model`` (the forward's kwargs beyond the ids: position_ids [B, 2c], attn_mask
    None or bool [B, 1, 2c, S] with keys in global order), ``input_ids`` [B, 2c], ``labels`` [B, 2c]
    (shifted globally, :func:`shift_labels`), ``index`` [2c] (global positions), ``seq_len`` S.
    Per-token tensors aligned with the labels ([B, S0 - 1], a shifted loss mask, advantages...)
    go through :func:`split_shifted`.
    """
    from aligner.model.llama import default_position_ids

    cp, r = comm.group_size(group), comm.group_rank(group)
    b, s0 = input_ids.shape
    s = padded_len(s0, cp * seq_multiple)
    if position_ids is None:
        position_ids = default_position_ids(b, s, input_ids.device, _pad_to(segment_ids, s, 0) if segment_ids is not None else None)
    else:
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, s - s0 + 1, device=input_ids.device)], 1)
    ids = _pad_to(input_ids, s, pad_id)
    idx = zigzag_index(s, cp, r, input_ids.device)
    mask = None
    if segment_ids is not None or prompt_segments is not None:
        seg = _pad_to(segment_ids if segment_ids is not None else prompt_segments, s, 0 if segment_ids is not None else -1)
        qs, ks = seg[:, idx].unsqueeze(-1), seg.unsqueeze(-2)
        causal = idx.unsqueeze(-1) >= torch.arange(s, device=idx.device)
        allowed = (qs == ks) if segment_ids is not None else (ks == 0) | (qs == ks) | (qs == -1)
        mask = (causal & allowed).unsqueeze(1)
    return {
        "input_ids": ids[:, idx],
        "labels": shift_labels(ids, pad_id)[:, idx],
        "model": {"position_ids": position_ids[:, idx], "attn_mask": mask},
        "index": idx,
        "seq_len": s,
    }


# ---- the runtime's micro-batches -----------------------------------------------------------------
SOURCE = "_cp_source"  # key of a cp micro-batch holding the micro-batch it was cut from
HELD = "_cp_held"  # key of a cp micro-batch: [b, R] bool, which head positions this rank holds


def cp_micro_batch(mb: dict, group: Optional[dist.ProcessGroup], seq_multiple: int = 1, pad_id: int = 0) -> dict:
    """A runtime micro-batch (:mod:`aligner.runtime.runner`: ``input_ids`` [b, T] and the model
    inputs of ``aligner.parallel.pipeline.MODEL_INPUT_KEYS``, the same on every cp rank) -> this cp
    rank's micro-batch: ``input_ids`` / ``position_ids`` [b, 2c] (:func:`cp_inputs`), ``attn_mask``
    for packed documents and shared-prompt rows, and the original under :data:`SOURCE` (what the
    loss reads). With a ``logprob`` spec the labels go too: in the response layout (``head_index``
    [b, R], ``labels`` [b, R]: shared-prompt rows score other samples' tokens than the next one)
    each head position becomes its index among this rank's tokens, those it does not hold marked in
    :data:`HELD`; in the token layout, ``labels`` [b, 2c] shifted globally (:func:`shift_labels`).
    An MoE ``token_mask`` [b, T] bool (the tokens the router's auxiliary losses count) becomes this
    rank's [b, 2c] (the cp padding is not counted); the MoE blocks reduce their sums over cp
    (:func:`aligner.model.moe.cp_router_losses`). Other keys (fillers' flags, non-tensors) are kept.
    """
    if comm.group_size(group) == 1:
        return mb
    cut = cp_inputs(
        mb["input_ids"],
        group,
        position_ids=mb.get("position_ids"),
        segment_ids=mb.get("segment_ids"),
        prompt_segments=mb.get("prompt_segments"),
        pad_id=pad_id,
        seq_multiple=seq_multiple,
    )
    out = {k: v for k, v in mb.items() if not torch.is_tensor(v) and k != "logprob"}
    out.update({"input_ids": cut["input_ids"], "position_ids": cut["model"]["position_ids"], SOURCE: mb})
    if cut["model"]["attn_mask"] is not None:
        out["attn_mask"] = cut["model"]["attn_mask"]
    if mb.get("token_mask") is not None:
        out["token_mask"] = _pad_to(mb["token_mask"].bool(), cut["seq_len"], False)[:, cut["index"]]
    if mb.get("logprob") is None:
        return out
    out["logprob"] = mb["logprob"]
    if "head_index" not in mb:
        out["labels"] = cut["labels"]
        return out
    local = torch.full((cut["seq_len"],), -1, dtype=torch.long, device=cut["index"].device)
    local[cut["index"]] = torch.arange(cut["index"].numel(), device=local.device)
    head = local[mb["head_index"]]
    out.update({"head_index": head.clamp(min=0), "labels": mb["labels"], HELD: head >= 0})
    return out


def cp_outputs(out, mb: dict, group: Optional[dist.ProcessGroup]):
    """The model's per-token output on this cp rank's tokens -> the output the whole micro-batch
    gives without cp, on every cp rank. Response layout (:data:`HELD` in `mb`): each [b, R] tensor
    keeps the positions this rank holds (zeros elsewhere) and is summed over cp (forward all-reduce,
    identity backward). Otherwise each [b, 2c] tensor (scores, or log-probs and entropy of the
    shifted labels) is gathered to [b, S] in global order (:func:`zigzag_gather`) and cut to the
    source's T positions.

    Differentiable: every cp rank computes the same loss from these outputs and keeps the gradient
    of its own positions, so the parameters' gradients are partial sums over the rank's tokens
    (summed over cp by :func:`sync_cp_grads`). Raises ValueError: an output with a vocabulary dim
    (logits; context parallelism needs the log-prob head, ``logprob_chunk_size != 0``).
    """
    if SOURCE not in mb:
        return out
    if isinstance(out, tuple):
        return tuple(cp_outputs(o, mb, group) for o in out)
    if out.dim() != 2:
        raise ValueError(
            f"context parallelism gathers per-token outputs [b, 2c], got {tuple(out.shape)} (logits?): "
            "set parallel.logprob_chunk_size=-1 so the model returns log-probs"
        )
    if HELD in mb:
        return comm.reduce_from_tp(torch.where(mb[HELD], out, torch.zeros_like(out)), group)
    return zigzag_gather(out, group)[:, : mb[SOURCE]["input_ids"].shape[1]]


def source_of(mb: dict) -> dict:
    """The micro-batch a cp micro-batch was cut from (`mb` itself without cp)."""
    return mb.get(SOURCE, mb)


def split_shifted(x: torch.Tensor, group: Optional[dist.ProcessGroup], value=0) -> torch.Tensor:
    """A per-token tensor aligned with next-token labels, [B, S0 - 1, ...] (position t scores token
    t + 1: loss masks, advantages, old log-probs) -> this rank's [B, 2c, ...], padded with `value`
    (0: masked) to S = padded_len(S0) first."""
    return zigzag_split(_pad_to(x, padded_len(x.shape[SEQ] + 1, comm.group_size(group)), value), group)


def cp_token_mean(values: torch.Tensor, mask: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The token-mean over every cp rank's tokens: sum(values * mask) / sum(mask), both summed over cp.

    values, mask: [B, 2c] (float; mask 1 = counted). Returns a 0-dim tensor equal on every cp rank;
    backward gives each rank the gradient of its own tokens (forward all-reduce, identity backward:
    Megatron's g), so the parameters' grads are partial and :func:`sync_cp_grads` sums them.
    """
    m = mask.to(values.dtype)
    count = comm.all_reduce_no_grad(m.sum().detach().clone(), group)
    return comm.reduce_from_tp((values * m).sum(), group) / count.clamp_min(1.0)


def sync_cp_grads(model: nn.Module, cp_group: Optional[dist.ProcessGroup]) -> None:
    """Sum every parameter's gradient over `cp_group` in place (one flat all-reduce per dtype), after
    backward: parameters are replicated over cp and each rank's grad covers its own tokens only.
    FSDP2 grads (DTensors sharded over dp) are summed as their local shards: the cp ranks of one dp
    rank hold the same shard. Commutes with the TP and dp reductions (both linear). No-op for one
    rank; parameters without a grad are skipped on every rank alike."""
    if comm.group_size(cp_group) == 1:
        return
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in model.parameters()) if g is not None]
    if grads:
        flat_all_reduce_(grads, cp_group)
