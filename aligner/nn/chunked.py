"""Chunked vocab-parallel log-probs and entropy straight from the LM head's input.

Owns the fusion of the LM head GEMM with the softmax statistics of :mod:`aligner.nn.vocab`,
done over chunks of positions so that the fp32 logits exist one chunk, [chunk_size, V/tp], at a
time, never as [N, V/tp] for N > chunk_size. It is the idea of Liger Kernel's fused linear
cross-entropy (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training") and of
NeMo-RL's / verl's chunked log-prob, for RL's per-token losses: the upstream gradient is one
number per position, unknown at forward time, so unlike Liger (a scalar mean loss) the backward
recomputes each chunk's logits (one more head GEMM than the plain path) instead of computing the
gradients during forward. Simplification: when all N positions fit in one chunk (N <= chunk_size)
and a gradient is needed, that one chunk's log-softmax is kept for backward instead of recomputed
(the same GEMM count as the plain path, one fp32 [N, V/tp] tensor held until backward, which may
then run once: ``retain_graph`` is refused).

Per chunk of positions, with z = (h W^T) / T in fp32 (W this rank's [V/tp, H] vocabulary shard,
T the temperature), each rank keeps its local statistics m_r = max z, s_r = sum exp(z - m_r),
w_r = sum exp(z - m_r) (z - m_r) and the label's z_y - m_r. After all chunks, one all-reduce MAX
(m) and one all-reduce SUM over tp combine them (Megatron's vocab-parallel cross entropy,
Shoeybi et al. 2019, with the rescaling of online softmax, Milakov & Gimelshein 2018):

    s        = sum_r exp(m_r - m) s_r                       = sum_v exp(z_v - m)
    w        = sum_r exp(m_r - m) (w_r + (m_r - m) s_r)     = sum_v exp(z_v - m) (z_v - m)
    log p(y) = (z_y - m) - log s
    H        = log s - w / s                                (nats)

Backward keeps only lse = m + log s and H per position ([N] fp32 each) and recomputes each
chunk (or reads the kept one): p_v = exp(z_v - lse), and with upstream gradients g (log-probs)
and g_H (entropy),

    d z_v      = g (1[v = y] - p_v) - g_H p_v (log p_v + H)     (dH/dz_v = -p_v (log p_v + H))
    d logits   = d z / T
    grad h     = d logits W     (partial: this rank's vocabulary shard only)
    grad W    += d logits^T h

The partial grad h is summed over tp by what runs before the function, exactly as for the plain
head (:func:`aligner.nn.layers.column_parallel_linears`): ``copy_to_tp`` (all-reduce in backward)
or, with sequence parallelism, ``gather_from_sp`` (reduce-scatter in backward);
:func:`lm_head_log_probs` composes them.

Precision: the GEMMs run in the autocast dtype when autocast is on (bf16 logits, as the plain
head's ``F.linear`` gives under autocast), else in h's dtype; every softmax statistic is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aligner.nn import comm


@dataclass(frozen=True)
class LogProbSpec:
    """What a causal LM's forward computes instead of logits: per-token log-probs and entropy.

    Passed as the model input ``logprob`` (see ``LlamaForCausalLM.forward``) together with
    ``labels``; a plain value shared by every micro-batch.
    """

    temperature: float = 1.0  # > 0; logits are divided by it (the rollout sampling temperature)
    chunk_size: int = 512  # positions per chunk of the head GEMM and the softmax; >= 1 (ParallelConfig.logprob_chunk_size)


AUTO_CHUNK_BYTES = 256 * 2**20  # parallel.logprob_chunk_size=-1: the fp32 logits of one chunk stay within this


def auto_chunk_size(local_vocab: int, budget_bytes: int = AUTO_CHUNK_BYTES) -> int:
    """Positions per chunk whose fp32 logits [c, V/tp] fit `budget_bytes` (``parallel.logprob_chunk_size=-1``).

    local_vocab: V/tp, the head rows on this rank. At 256 MiB: 2,097 positions at V = 32,000 (a whole
    2k-token micro-batch in one chunk: on the development CPU a 512-position chunk made an 8 x 256
    SFT step 1.3x slower than one chunk), 523 at V = 128,256 (Llama 3: 0.21x the unchunked peak)."""
    return max(1, budget_bytes // (4 * max(1, local_vocab)))


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The GEMM dtype the plain head would use: autocast's where it is on for h's device, else h's."""
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """z = (h w^T) / temperature into `out`: h [c, H], w [V/tp, H] in the compute dtype, out [c, V/tp] fp32.

    Writing into one workspace for every chunk (``torch.mm(out=)``) instead of a new tensor each
    time matters on CPU: a fresh [c, V/tp] buffer is page-faulted in on every chunk."""
    if w.dtype == torch.float32:
        torch.mm(h.float(), w.t(), out=out)
    else:
        out.copy_(F.linear(h.to(w.dtype), w))
    return out.div_(temperature) if temperature != 1.0 else out


class _ChunkedHeadLogProbs(torch.autograd.Function):
    """(h, W, labels) -> (log p(labels), entropy) of softmax(h W^T / T), chunk by chunk (module docstring)."""

    @staticmethod
    def forward(ctx, h, weight, labels, temperature, tp_group, vocab_start, chunk_size, grad_wanted):
        cdt = _compute_dtype(h)
        n, v_local = h.shape[0], weight.shape[0]
        local = labels - vocab_start
        inside = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1).unsqueeze(1)
        m = torch.empty(n, dtype=torch.float32, device=h.device)
        stats = torch.empty(3, n, dtype=torch.float32, device=h.device)  # s_r, w_r, z_y - m_r
        z_ws, e_ws = _workspaces(min(chunk_size, n), v_local, h.device)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(cdt)
            for a in range(0, n, chunk_size):
                b = min(a + chunk_size, n)
                z = _chunk_logits(h[a:b], w, temperature, z_ws[: b - a])
                mc = z.max(dim=-1, keepdim=True).values
                z.sub_(mc)  # z - m_r
                stats[2, a:b] = z.gather(1, local[a:b]).squeeze(1)
                e = torch.exp(z, out=e_ws[: b - a])
                stats[0, a:b] = e.sum(dim=-1)
                stats[1, a:b] = e.mul_(z).sum(dim=-1)
                m[a:b] = mc.squeeze(1)
        del e_ws
        gm, s, w_sum, zy = _combine(m, stats, inside, tp_group)
        log_s = s.log()
        lse = gm + log_s
        entropy = log_s - w_sum / s
        ctx.kept = grad_wanted and 0 < n <= chunk_size
        kept = z_ws.add_((m - lse).unsqueeze(1)) if ctx.kept else None  # the one chunk's z - lse = log p
        del z_ws
        ctx.save_for_backward(h, weight, local, inside, lse, entropy, kept)
        ctx.temperature, ctx.chunk_size, ctx.cdt = temperature, chunk_size, cdt
        ctx.set_materialize_grads(False)
        return zy - log_s, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, local, inside, lse, entropy, kept = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return (None,) * 8
        if ctx.kept:
            if getattr(ctx, "used", False):
                raise RuntimeError("chunked log-probs: backward ran twice through a kept chunk (retain_graph is not supported)")
            ctx.used = True
        t, c, cdt, n = ctx.temperature, ctx.chunk_size, ctx.cdt, h.shape[0]
        g_lp = None if g_lp is None else g_lp.float() / t  # d/dlogits = d/dz / T: fold 1/T into the upstream grads
        g_ent = None if g_ent is None else g_ent.float() / t
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        z_ws, p_ws = _workspaces(min(c, n), weight.shape[0], h.device, count=1 if ctx.kept else 2)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(cdt)
            for a in range(0, n, c):
                b = min(a + c, n)
                logp = kept if ctx.kept else _chunk_logits(h[a:b], w, t, z_ws[: b - a]).sub_(lse[a:b].unsqueeze(1))
                dz = _chunk_grad(logp, p_ws[: b - a], entropy[a:b], local[a:b], inside[a:b], g_lp, g_ent, a, b)
                dz, hc = dz.to(cdt), h[a:b].to(cdt)
                if need_h:
                    grad_h[a:b] = dz @ w
                if need_w:
                    if cdt == torch.float32:
                        grad_w.addmm_(dz.t(), hc)
                    else:
                        grad_w += (dz.t() @ hc).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def _workspaces(rows: int, cols: int, device, count: int = 2) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """fp32 [rows, cols] buffers every chunk writes into (the peak extra memory of a call): two, or
    (None, one) with count=1."""
    bufs = [torch.empty(rows, cols, dtype=torch.float32, device=device) for _ in range(count)]
    return (bufs[0], bufs[1]) if count == 2 else (None, bufs[0])


def _chunk_grad(logp, p_ws, entropy, local, inside, g_lp, g_ent, a: int, b: int) -> torch.Tensor:
    """d logits of one chunk, [c, V/tp] fp32 in p_ws (logp is overwritten), the grads already divided by T.

    logp: [c, V/tp] log p = z - lse; p_ws: [c, V/tp] workspace; entropy: [c]; local: [c, 1] label
    index in the shard, inside: [c] bool (the label is in this shard); g_lp, g_ent: [N] or None,
    rows a:b used.
    """
    p = torch.exp(logp, out=p_ws)
    if g_ent is not None:
        coef = logp.add_(entropy.unsqueeze(1)).mul_(g_ent[a:b].unsqueeze(1))  # g_H (log p + H)
        if g_lp is not None:
            coef.add_(g_lp[a:b].unsqueeze(1))
        dz = p.mul_(coef).neg_()  # -p (g + g_H (log p + H))
    else:
        dz = p.mul_(g_lp[a:b].unsqueeze(1)).neg_()  # -p g
    if g_lp is not None:
        dz.scatter_add_(1, local, (g_lp[a:b] * inside).unsqueeze(1))  # + g at the label
    return dz


def _combine(
    m: torch.Tensor, stats: torch.Tensor, inside: torch.Tensor, tp_group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-rank statistics -> global (m, s, w, z_y - m) over the vocabulary, each [N] fp32 (module docstring).

    m: [N] local maxima m_r; stats: [3, N] local s_r, w_r, z_y - m_r; inside: [N] bool."""
    if comm.group_size(tp_group) == 1:
        return m, stats[0], stats[1], torch.where(inside, stats[2], 0.0)
    gm = comm.all_reduce_no_grad(m.clone(), tp_group, op=dist.ReduceOp.MAX)
    delta = m - gm  # <= 0
    scale = delta.exp()
    red = torch.stack([stats[0] * scale, scale * (stats[1] + delta * stats[0]), torch.where(inside, stats[2] + delta, 0.0)])
    comm.all_reduce_no_grad(red, tp_group)
    return gm, red[0], red[1], red[2]


def chunked_log_probs_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: int = 0,
    chunk_size: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `labels` and the entropy under softmax(h W^T / temperature), chunk by chunk.

    Equal (up to GEMM rounding) to ``vocab_parallel_log_probs_entropy(F.linear(h, weight), ...)``
    without its [N, V/tp] fp32 tensors; formulas and references in the module docstring.
    Collectives over `tp_group`: two all-reduces in forward ([N] MAX, [3, N] SUM), none in
    backward. The gradient w.r.t. h is this rank's partial sum: compose with ``copy_to_tp`` or
    ``gather_from_sp`` as the plain head does (:func:`lm_head_log_probs` does).

    Args:
        h: [N, H] head inputs (any float dtype; the GEMM runs in the autocast dtype when on).
        weight: [V/tp, H] this rank's vocabulary shard of the head (or tied embedding) weight.
        labels: [N] int64 token ids in the full vocabulary, in [0, V).
        temperature: > 0; the logits are divided by it.
        tp_group: the group the vocabulary is split over (None: single process).
        vocab_start: first vocabulary id of this rank's shard.
        chunk_size: positions per chunk (>= 1); peak extra memory is about two fp32
            [min(N, chunk_size), V/tp] tensors. N <= chunk_size with a gradient wanted keeps
            the one chunk's log-softmax for backward (no recomputation; backward runs once).
    Returns:
        (log_probs [N] fp32, entropy [N] fp32 nats), both differentiable w.r.t. h and weight.
    Raises:
        ValueError: temperature <= 0, chunk_size < 1, or h / weight / labels shapes that disagree.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for log-probs and entropy (greedy uses 1.0)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (positions per chunk)")
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1] or labels.shape != h.shape[:1]:
        raise ValueError(
            f"chunked_log_probs_entropy: h {tuple(h.shape)} must be [N, H], weight {tuple(weight.shape)} [V/tp, H], "
            f"labels {tuple(labels.shape)} [N]"
        )
    grad_wanted = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _ChunkedHeadLogProbs.apply(h, weight, labels, float(temperature), tp_group, int(vocab_start), int(chunk_size), grad_wanted)


def lm_head_log_probs(
    head, h: torch.Tensor, labels: torch.Tensor, spec: LogProbSpec, head_index: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropy of a column-parallel LM head's output, never materializing it.

    The same collectives as ``head(h)`` followed by vocab-parallel log-probs: without sequence
    parallelism ``copy_to_tp`` (all-reduce of grad h in backward), with it ``gather_from_sp``
    (all-gather forward, reduce-scatter of the partial grads backward); then
    :func:`chunked_log_probs_entropy` on this rank's weight shard. A tied head passes the
    embedding's Parameter as ``head.weight`` and its gradient accumulates there.

    Args:
        head: an ``LMHead`` (a bias-free ``ColumnParallelLinear``), this rank's [V/tp, H] rows.
        h: [B, T, H] hidden states ([B, T/tp, H] with sequence parallelism).
        labels: [B, R] int64 (R = T without head_index) full-vocabulary token ids.
        spec: temperature and chunk size.
        head_index: [B, R] int64 positions in [0, T) whose log-probs are wanted; None: all T.
    Returns:
        (log_probs [B, R] fp32, entropy [B, R] fp32 nats), differentiable.
    Raises:
        ValueError: the head has a bias or a custom row_index, or a bad spec / shapes.
    """
    if head.bias is not None or head.row_index is not None:
        raise ValueError("lm_head_log_probs: the head must have no bias and contiguous vocabulary rows")
    group = head.tp_group
    if head.sequence_parallel:
        h = comm.gather_from_sp(h, group)
    if head_index is not None:
        h = h.gather(1, head_index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
    if not head.sequence_parallel:
        h = comm.copy_to_tp(h, group)
    start = comm.group_rank(group) * head.weight.shape[0]
    lp, ent = chunked_log_probs_entropy(
        h.reshape(-1, h.shape[-1]), head.weight, labels.reshape(-1), spec.temperature, group, start, spec.chunk_size
    )
    return lp.view(labels.shape), ent.view(labels.shape)
