"""Pipeline parallelism: a 1F1B schedule with explicit P2P between pipeline stage models.

Owns, for the pipeline stage models :func:`aligner.parallel.parallelize.build_parallel_model` builds,
the one-forward-one-backward schedule of PipeDream-Flush / Megatron (Narayanan et al. 2021) for training
(:func:`pipeline_train_step`), a forward-only schedule returning per-token outputs
(:func:`pipeline_forward`), and the gradient finalization TP/PP leave to the caller
(:func:`finalize_grads`: SP norm / replicated kv grads, tied embeddings across pipeline stages).

Why explicit P2P rather than ``torch.distributed.pipelining``: the RL losses take
per-micro-batch tensors (advantages, old_log_probs, masks, normalizers) that are not
model inputs, and forward-only log-prob passes need a caller function on the last pipeline
stage; here a micro-batch is a dict of tensors every pp rank holds, the model reads
``input_ids`` / ``position_ids`` / ``segment_ids`` and the loss gets the whole dict.
Activations between pipeline stages are [b, T/seq_shards, H] in the model dtype, with shapes
known from the micro-batch, so no shape handshake is needed; every buffer is sized from its own
micro-batch, so micro-batches of different [b, T] (token budgets) run in one schedule. P2P runs on the pp group
with ``batch_isend_irecv`` (paired send/recv, deadlock-free in the 1F1B order).

Loss scaling: ``loss_reduction="mean"`` divides each micro-batch loss by
num_micro_batches (whole-batch mean of equal-sized micro-batch means); ``"sum"`` leaves it
(the loss_fn already divides by a whole-batch normalizer such as the masked token count),
so either way the accumulated gradients equal the whole-batch gradients.

Interleaved 1F1B (``parallel.virtual_pp_size`` = v > 1; Narayanan et al. 2021, sec. 2.2.2, Megatron's
``forward_backward_pipelining_with_interleaving``): each rank holds v model chunks (virtual pipeline stage
j = chunk * pp + rank, so a rank's layers are not contiguous) and runs them in Megatron's order:
forward k uses chunk (k mod pp v) div pp of micro-batch (k div pp v) pp + k mod pp, warm-up
2 (pp - rank - 1) + (v - 1) pp forwards, then one forward one backward, then the remaining
backwards (backward k runs the chunks in reverse). The bubble shrinks from (pp - 1) / m to
(pp - 1) / (v m) of the step, at v times the point-to-point messages; it needs m to be a multiple
of pp. Activations travel rank to rank and from the last rank back to the first for the next
chunk; each message is tagged with its direction, micro-batch and chunk and sent asynchronously
(:class:`_Ring`), so the order in which ranks post them never pairs the wrong tensors.

Tied embeddings with pp_size > 1: the first pipeline stage holds embed_tokens and the last
an lm_head sharing the same initial weight; :func:`finalize_grads` sums their grads
between the two pipeline stages so both copies stay equal under any deterministic optimizer.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.model.llama import default_position_ids
from aligner.model.moe import set_aux_loss_scale
from aligner.nn import comm
from aligner.parallel.tensor_parallel import seq_shards, sync_tp_grads

MODEL_INPUT_KEYS = ("position_ids", "segment_ids", "prompt_segments", "attn_mask", "head_index", "logprob", "token_mask")


def split_micro_batches(batch: dict[str, torch.Tensor], num_micro_batches: int) -> list[dict[str, torch.Tensor]]:
    """Split every [B, ...] tensor of `batch` along dim 0 into num_micro_batches dicts.

    0-dim tensors and non-tensors are shared by all micro-batches.
    Raises ValueError: B not divisible by num_micro_batches.
    """
    sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"split_micro_batches: batch tensors disagree on dim 0 sizes {sorted(sizes)}")
    b = sizes.pop()
    if num_micro_batches < 1 or b % num_micro_batches:
        raise ValueError(f"num_micro_batches={num_micro_batches} must divide the batch size {b}")
    out = [{} for _ in range(num_micro_batches)]
    for k, v in batch.items():
        parts = v.chunk(num_micro_batches) if torch.is_tensor(v) and v.dim() > 0 else [v] * num_micro_batches
        for mb, part in zip(out, parts):
            mb[k] = part
    return out


class _P2P:
    """Paired point-to-point transfers with the neighbouring pipeline stages on the pp group."""

    def __init__(self, dims):
        self.group, self.rank, self.size = dims.pp_group, dims.pp_rank, dims.pp_size
        self.first, self.last = self.rank == 0, self.rank == self.size - 1

    def run(self, send_prev=None, send_next=None, recv_prev=None, recv_next=None) -> None:
        ops = []
        for t, peer, op in (
            (send_prev, self.rank - 1, dist.isend),
            (send_next, self.rank + 1, dist.isend),
            (recv_prev, self.rank - 1, dist.irecv),
            (recv_next, self.rank + 1, dist.irecv),
        ):
            if t is not None:
                if op is dist.isend:
                    comm.record("send", t.numel())
                ops.append(dist.P2POp(op, t, group=self.group, group_peer=peer))
        if ops:
            t0 = time.perf_counter()
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            comm.record_wait("pp_wait", time.perf_counter() - t0)


def model_kwargs(mb: dict) -> dict:
    """The model-input tensors of micro-batch `mb` (MODEL_INPUT_KEYS present and not None).

    position_ids [b, T] are always included (the model's default from ``input_ids`` and
    ``segment_ids`` when the batch has none): a later pipeline stage receives hidden states,
    which under sequence parallelism hold T / tp positions, so it cannot infer T itself.
    With ``logprob`` (an ``aligner.nn.chunked.LogProbSpec``, shared by all micro-batches) the
    micro-batch's ``labels`` go too: the causal LM then returns per-token log-probs and entropy.
    """
    kw = {k: mb[k] for k in MODEL_INPUT_KEYS if k in mb and mb[k] is not None}
    if "logprob" in kw:
        kw["labels"] = mb["labels"]
    if "position_ids" not in kw:
        ids = mb["input_ids"]
        kw["position_ids"] = default_position_ids(ids.shape[0], ids.shape[1], ids.device, kw.get("segment_ids"))
    return kw


def _hidden_buffer(model: nn.Module, mb: dict, requires_grad: bool) -> torch.Tensor:
    b, t = mb["input_ids"].shape
    shards = seq_shards(model)
    if t % shards:
        raise ValueError(f"sequence length T={t} must be divisible by tp_size={shards} with sequence parallelism: pad it")
    p = next(model.parameters())
    return torch.empty(
        b, t // shards, model.cfg.hidden_size, dtype=_activation_dtype(model, p.dtype), device=p.device, requires_grad=requires_grad
    )


def _activation_dtype(model: nn.Module, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype a pipeline stage's hidden states travel in: FSDP2 mixed precision's compute dtype (its
    unsharded parameters, bf16), else the parameters' own (fp32 master weights under autocast).
    Found once per pipeline stage module (a walk of its modules) and kept on it: this runs per received micro-batch."""
    cached = model.__dict__.get("_activation_dtype")
    if cached is not None:
        return cached
    from torch.distributed._composable_state import _get_module_state

    dtype = param_dtype
    for m in model.modules():
        policy = getattr(_get_module_state(m), "_mp_policy", None)
        if policy is not None:
            dtype = policy.param_dtype or param_dtype
            break
    model.__dict__["_activation_dtype"] = dtype
    return dtype


def pipeline_train_step(
    model: nn.Module,
    dims,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, dict], torch.Tensor],
    *,
    loss_reduction: str = "mean",
    finalize: bool = True,
    before_last_backward: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """Forward and backward over all micro-batches in the 1F1B order; gradients accumulate in .grad.

    Args:
        model: this rank's pipeline stage (``build_parallel_model``), or the list of its chunks (virtual
            pipeline stages, :func:`aligner.parallel.parallelize.chunk_views`): the interleaved schedule.
        dims: ParallelDims (pp_group, pp_rank, pp_size, tp_group, is_first/last_pp_stage).
        micro_batches: num_micro_batches dicts, the same on every pp rank: ``input_ids`` [b, T]
            int64 (shapes on every pipeline stage, tokens on the first), optional ``position_ids`` /
            ``segment_ids`` [b, T], and any extra tensors the loss needs (advantages,
            old_log_probs, masks, labels, normalizers).
        loss_fn: (output, mb) -> scalar loss, run on the last pipeline stage; output is the last
            pipeline stage's model output (logits [b, T, V/tp], scores [b, T], or (log_probs, entropy)
            [b, R] each when the micro-batch carries a ``logprob`` spec).
        loss_reduction: "mean" (scale each loss by 1/num_micro_batches) or "sum" (no scaling).
        finalize: run :func:`finalize_grads` after the last backward.
        before_last_backward: called with a chunk's index (0 without interleaving) just before that
            chunk's backward of the last micro-batch (backwards run in micro-batch order on every
            chunk): where FSDP2 turns its per-step gradient reduction back on
            (:class:`aligner.parallel.data_parallel.FsdpStepReduce`).
    Returns:
        losses: [num_micro_batches] fp32, the unscaled loss_fn values, on every pp rank.
    Raises ValueError: bad loss_reduction, no micro-batches, T not divisible under SP, or (interleaved)
        a number of micro-batches that is not a multiple of pp_size.
    """
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction={loss_reduction!r}: valid choices are mean, sum")
    m = len(micro_batches)
    if m == 0:
        raise ValueError("pipeline_train_step: got no micro-batches")
    scale = 1.0 / m if loss_reduction == "mean" else 1.0
    if isinstance(model, (list, tuple)):  # virtual pipeline stages: this rank's chunks
        for chunk in model:
            set_aux_loss_scale(chunk, 1.0 / m)
        losses = _interleaved_train_step(model, dims, micro_batches, loss_fn, scale, before_last_backward)
        if finalize:
            finalize_grads(model, dims)
        return _broadcast_from_last(torch.stack(losses) if dims.is_last_pp_stage else None, dims)
    set_aux_loss_scale(model, 1.0 / m)
    p2p = _P2P(dims)
    losses: list[torch.Tensor] = []

    def recv_input(mb):
        return None if p2p.first else _hidden_buffer(model, mb, requires_grad=False)

    def forward(i, x):
        mb = micro_batches[i]
        if x is not None:
            x.requires_grad_(True)
        out = model(mb["input_ids"] if x is None else x, **model_kwargs(mb))
        if p2p.last:
            loss = loss_fn(out, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            losses.append(loss.detach().float())
            return loss * scale
        return out

    backwards = [0]

    def backward(x, y, grad):
        backwards[0] += 1
        if backwards[0] == m and before_last_backward is not None:
            before_last_backward(0)
        torch.autograd.backward(y, grad_tensors=None if p2p.last else grad)
        return None if x is None else x.grad

    warmup = min(p2p.size - p2p.rank - 1, m)
    inputs, outputs = deque(), deque()
    for i in range(warmup):
        x = recv_input(micro_batches[i])
        p2p.run(recv_prev=x)
        y = forward(i, x)
        p2p.run(send_next=y.detach() if not p2p.last else None)
        inputs.append(x)
        outputs.append(y)
    x = recv_input(micro_batches[warmup]) if warmup < m else None
    if warmup < m:
        p2p.run(recv_prev=x)
    for j in range(m - warmup):
        i = warmup + j
        y = forward(i, x)
        inputs.append(x)
        outputs.append(y)
        # the gradient that arrives is micro-batch j's (the oldest in flight), shaped like its output:
        # micro-batches may differ in [b, T] (token budgets), so not like y's
        grad = None if p2p.last else torch.empty_like(outputs[0])
        p2p.run(send_next=None if p2p.last else y.detach(), recv_next=grad)
        dx = backward(inputs.popleft(), outputs.popleft(), grad)
        if j == m - warmup - 1:
            p2p.run(send_prev=dx)
        else:
            x = recv_input(micro_batches[i + 1])
            p2p.run(send_prev=dx, recv_prev=x)
    for _ in range(warmup):
        x0, y0 = inputs.popleft(), outputs.popleft()
        grad = torch.empty_like(y0)
        p2p.run(recv_next=grad)
        p2p.run(send_prev=backward(x0, y0, grad))
    if finalize:
        finalize_grads(model, dims)
    return _broadcast_from_last(torch.stack(losses) if p2p.last else None, dims)


@torch.no_grad()
def pipeline_forward(
    model: nn.Module,
    dims,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    output_fn: Callable[[torch.Tensor, dict], torch.Tensor],
    broadcast: bool = True,
) -> Optional[torch.Tensor]:
    """Forward-only pass over the micro-batches (no autograd graph kept).

    output_fn: (output, mb) -> [b, ...] per micro-batch on the last pipeline stage, e.g. log_probs
        [b, T-1] from ``vocab_parallel_log_probs`` on logits [b, T, V/tp], or values [b, T].
    Returns: the per-micro-batch outputs concatenated on dim 0 ([B, ...]) on the last pipeline stage,
        and on every pp rank when `broadcast` (else None elsewhere).
    model: the pipeline stage, or the list of this rank's chunks (virtual pipeline stages).
    """
    if isinstance(model, (list, tuple)):
        results = _interleaved_forward(model, dims, micro_batches, output_fn)
        result = torch.cat(results) if dims.is_last_pp_stage else None
        return _broadcast_from_last(result, dims) if broadcast else result
    p2p = _P2P(dims)
    pending, results = [], []
    for mb in micro_batches:
        x = None
        if not p2p.first:
            x = _hidden_buffer(model, mb, requires_grad=False)
            p2p.run(recv_prev=x)
        out = model(mb["input_ids"] if x is None else x, **model_kwargs(mb))
        if p2p.last:
            results.append(output_fn(out, mb))
        else:
            comm.record("send", out.numel())
            pending.append((out, dist.isend(out.contiguous(), group=p2p.group, group_dst=p2p.rank + 1)))
    for _, req in pending:
        req.wait()
    result = torch.cat(results) if p2p.last else None
    return _broadcast_from_last(result, dims) if broadcast else result


# ---- interleaved 1F1B (virtual pipeline stages) ---------------------------------------------------
class _Ring:
    """Tagged asynchronous point-to-point between virtual pipeline stages: rank r's chunk c feeds rank r + 1's
    chunk c, the last rank's chunk c feeds rank 0's chunk c + 1 (gradients travel back the same way).
    Sends are posted at once and waited at :meth:`finish`; a receive blocks until its tensor is in."""

    def __init__(self, dims, num_micro_batches: int, num_chunks: int):
        self.group, self.rank, self.size = dims.pp_group, dims.pp_rank, dims.pp_size
        self.m, self.v = num_micro_batches, num_chunks
        self.pending: list = []

    def _tag(self, backward: bool, mb: int, chunk: int) -> int:
        return 1 + (int(backward) * self.m + mb) * self.v + chunk

    def next_of(self, chunk: int) -> tuple[int, int]:
        """(rank, chunk) of the virtual pipeline stage after this rank's `chunk`."""
        return (self.rank + 1, chunk) if self.rank < self.size - 1 else (0, chunk + 1)

    def prev_of(self, chunk: int) -> tuple[int, int]:
        """(rank, chunk) of the virtual pipeline stage before this rank's `chunk`."""
        return (self.rank - 1, chunk) if self.rank > 0 else (self.size - 1, chunk - 1)

    def send(self, t: torch.Tensor, peer: tuple[int, int], mb: int, backward: bool) -> None:
        t = t.contiguous()
        comm.record("send", t.numel())
        req = dist.isend(t, group=self.group, group_dst=peer[0], tag=self._tag(backward, mb, peer[1]))
        self.pending.append((req, t))

    def recv(self, buf: torch.Tensor, peer: tuple[int, int], mb: int, chunk: int, backward: bool) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.irecv(buf, group=self.group, group_src=peer[0], tag=self._tag(backward, mb, chunk)).wait()
        comm.record_wait("pp_wait", time.perf_counter() - t0)
        return buf

    def finish(self) -> None:
        t0 = time.perf_counter()
        for req, _ in self.pending:
            req.wait()
        self.pending.clear()
        comm.record_wait("pp_wait", time.perf_counter() - t0)


def interleaved_order(num_micro_batches: int, pp_size: int, num_chunks: int, pp_rank: int) -> tuple[list[tuple[int, int]], int]:
    """Megatron's interleaved 1F1B order for one rank: ([(micro-batch, chunk)] of the m v forwards in
    order (the backwards run the same list with each chunk reversed: v - 1 - chunk), warm-up count).
    Raises ValueError: m not a multiple of pp."""
    m, p, v = num_micro_batches, pp_size, num_chunks
    if m % p:
        raise ValueError(
            f"the interleaved pipeline schedule needs a number of micro-batches that is a multiple of pp_size={p}, got {m}: "
            "change trainer.micro_batch_size (or the batch sizes) so each dp rank runs a multiple of pp_size micro-batches"
        )
    order = [((k // (p * v)) * p + k % p, (k % (p * v)) // p) for k in range(m * v)]
    warmup = m * v if m == p else min(m * v, (p - pp_rank - 1) * 2 + (v - 1) * p)
    return order, warmup


def _interleaved_train_step(chunks, dims, micro_batches, loss_fn, scale: float, before_last_backward=None) -> list[torch.Tensor]:
    """The interleaved 1F1B forward/backward of :func:`pipeline_train_step` over this rank's chunks;
    returns the unscaled losses by micro-batch (last rank) or an empty list. before_last_backward(c)
    runs before chunk c's backward of micro-batch m - 1 (each chunk's backwards run in micro-batch order)."""
    p, r, v, m = dims.pp_size, dims.pp_rank, len(chunks), len(micro_batches)
    order, warmup = interleaved_order(m, p, v, r)
    ring = _Ring(dims, m, v)
    first = lambda c: r == 0 and c == 0  # noqa: E731  (the virtual pipeline stage with the embedding)
    last = lambda c: r == p - 1 and c == v - 1  # noqa: E731  (the one with the head and the loss)
    saved: dict[tuple[int, int], tuple] = {}
    losses: dict[int, torch.Tensor] = {}

    def forward(k: int) -> None:
        i, c = order[k]
        mb = micro_batches[i]
        x = None
        if not first(c):
            x = ring.recv(_hidden_buffer(chunks[c], mb, requires_grad=False), ring.prev_of(c), i, c, backward=False)
            x.requires_grad_(True)
        out = chunks[c](mb["input_ids"] if x is None else x, **model_kwargs(mb))
        if last(c):
            loss = loss_fn(out, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            losses[i] = loss.detach().float()
            out = loss * scale
        else:
            ring.send(out.detach(), ring.next_of(c), i, backward=False)
        saved[(i, c)] = (x, out)

    def backward(k: int) -> None:
        i, c = order[k][0], v - 1 - order[k][1]
        x, y = saved.pop((i, c))
        grad = None if last(c) else ring.recv(torch.empty_like(y), ring.next_of(c), i, c, backward=True)
        if i == m - 1 and before_last_backward is not None:
            before_last_backward(c)
        torch.autograd.backward(y, grad_tensors=grad)
        if not first(c):
            ring.send(x.grad, ring.prev_of(c), i, backward=True)

    for k in range(warmup):
        forward(k)
    for j in range(m * v - warmup):
        forward(warmup + j)
        backward(j)
    for j in range(m * v - warmup, m * v):
        backward(j)
    ring.finish()
    return [losses[i] for i in sorted(losses)]


@torch.no_grad()
def _interleaved_forward(chunks, dims, micro_batches, output_fn) -> list:
    """Forward-only over this rank's chunks, chunk by chunk (every rank finishes chunk c of every
    micro-batch before chunk c + 1, so no wait is circular); outputs on the last rank."""
    p, r, v, m = dims.pp_size, dims.pp_rank, len(chunks), len(micro_batches)
    ring = _Ring(dims, m, v)
    results = []
    for c in range(v):
        for i, mb in enumerate(micro_batches):
            x = None
            if not (r == 0 and c == 0):
                x = ring.recv(_hidden_buffer(chunks[c], mb, requires_grad=False), ring.prev_of(c), i, c, backward=False)
            out = chunks[c](mb["input_ids"] if x is None else x, **model_kwargs(mb))
            if r == p - 1 and c == v - 1:
                results.append(output_fn(out, mb))
            else:
                ring.send(out, ring.next_of(c), i, backward=False)
    ring.finish()
    return results


def _broadcast_from_last(t: Optional[torch.Tensor], dims) -> torch.Tensor:
    """Broadcast tensor `t` (given on the last pipeline stage) to every rank of the pp group."""
    if dims.pp_size == 1:
        return t
    last = dims.pp_size - 1
    header = [None]
    if dims.pp_rank == last:
        header = [(tuple(t.shape), t.dtype)]
    dist.broadcast_object_list(header, group_src=last, group=dims.pp_group)
    shape, dtype = header[0]
    if dims.pp_rank != last:
        t = torch.empty(shape, dtype=dtype, device=dims.device)
    t = t.contiguous()
    dist.broadcast(t, group_src=last, group=dims.pp_group)
    return t


def sync_tied_embedding_grads(model: nn.Module, dims) -> None:
    """Sum the grads of the tied embedding copies on the first and last pp stages.

    No-op unless tie_word_embeddings and pp_size > 1. The two ends exchange their
    [V/tp, H] grads point-to-point (same tp_rank on both ends) and add them.
    """
    if not model.cfg.tie_word_embeddings or dims.pp_size == 1 or not (dims.is_first_pp_stage or dims.is_last_pp_stage):
        return
    p = model.model.embed_tokens.weight if dims.is_first_pp_stage else model.lm_head.weight
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    other = torch.empty_like(p.grad)
    peer = dims.pp_size - 1 if dims.is_first_pp_stage else 0
    ops = [
        dist.P2POp(dist.isend, p.grad.contiguous(), group=dims.pp_group, group_peer=peer),
        dist.P2POp(dist.irecv, other, group=dims.pp_group, group_peer=peer),
    ]
    comm.record("send", p.grad.numel())
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    p.grad.add_(other)


def finalize_grads(model, dims) -> None:
    """TP/SP grad reductions (:func:`sync_tp_grads`) then tied-embedding sync across pipeline stages.
    `model`: the pipeline stage, or the list of this rank's chunks (disjoint layers; the embedding in the
    first chunk, the head in the last).

    Data-parallel reduction is the dp backend's (FSDP2 / DDP / DeepSpeed) job, not this one's.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        sync_tp_grads(chunk, dims.tp_group)
    sync_tied_embedding_grads(chunks[0] if dims.is_first_pp_stage else chunks[-1], dims)
