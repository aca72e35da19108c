"""Autograd-aware collectives for Megatron-style tensor and sequence parallelism.

Owns the four conjugate pairs of Shoeybi et al. 2019 (f/g operators) and
Korthikanti et al. 2022 (sequence-parallel all-gather / reduce-scatter):

    copy_to_tp          forward identity      backward all-reduce
    reduce_from_tp      forward all-reduce    backward identity
    gather_from_sp      forward all-gather    backward reduce-scatter   (sequence dim)
    scatter_to_sp       forward reduce-scatter backward all-gather      (sequence dim)
    split_to_sp         forward split          backward all-gather      (sequence dim)
    gather_from_sp_replicated  forward all-gather  backward split        (replicated consumers)

With ``group=None`` (or a group of size 1) every operator is the identity, so the
same layer classes serve single-process models. Every collective passes through
:func:`record`, which a :class:`CommCounter` can observe to count calls and bytes.
The sequence dimension is dim 1 ([B, T, H] activations).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator, Optional

import torch
import torch.distributed as dist

SEQ_DIM = 1
_COUNTERS: list[CommCounter] = []


class CommCounter:
    """Counts collectives issued by this module: calls and elements per op name.

    Use as a context manager: ``with CommCounter() as c: model(x)``; then
    ``c.calls["all_reduce"]`` and ``c.elements["all_reduce"]`` (elements of the
    full logical tensor each call reduces or produces), and ``c.seconds[op]`` for the
    waits timed with :func:`record_wait` (``"pp_wait"``: a pipeline rank blocked on its
    neighbours, the bubble).
    """

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.elements: Counter = Counter()
        self.seconds: Counter = Counter()

    def __enter__(self) -> CommCounter:
        _COUNTERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _COUNTERS.remove(self)


def record(op: str, numel: int) -> None:
    """Tell active CommCounters that a collective `op` moved a logical tensor of `numel` elements."""
    for c in _COUNTERS:
        c.calls[op] += 1
        c.elements[op] += numel


def record_wait(op: str, seconds: float) -> None:
    """Tell active CommCounters that this rank waited `seconds` (wall) on `op`."""
    for c in _COUNTERS:
        c.seconds[op] += seconds


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    record("all_reduce", x.numel())
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    record("all_gather", x.numel() * n)
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence parallelism: dim {dim} of size {x.shape[dim]} is not divisible by tp_size={n}; pad the sequence length T to a multiple of tp_size"
        )
    parts = [p.contiguous() for p in x.chunk(n, dim=dim)]
    out = torch.empty_like(parts[0])
    record("reduce_scatter", x.numel())
    dist.reduce_scatter(out, parts, group=group)
    return out


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence parallelism: dim {dim} of size {x.shape[dim]} is not divisible by tp_size={n}; pad the sequence length T to a multiple of tp_size"
        )
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, SEQ_DIM), None


class _GatherSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, SEQ_DIM), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, SEQ_DIM), None


class _SplitToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, SEQ_DIM), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        record("all_to_all", x.numel())
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        gi = g.new_empty((sum(ctx.in_splits), *g.shape[1:]))
        record("all_to_all", g.numel())
        dist.all_to_all_single(gi, g.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return gi, None, None, None


def all_to_all(x: torch.Tensor, group: Optional[dist.ProcessGroup], out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Variable-size all-to-all along dim 0 (expert-parallel token dispatch and combine).

    x: [sum(in_splits), ...]: rows in_splits[j] go to rank j of `group`. Returns
    [sum(out_splits), ...] with out_splits[j] rows from rank j, in rank order. Backward is the
    reverse all-to-all of the gradient. Identity when `group` has one rank.
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def copy_to_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient over `group` backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Megatron's g: all-reduce (sum) forward over `group`, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """x: [B, T/tp, ...] -> [B, T, ...] (all-gather forward, reduce-scatter backward)."""
    return x if group_size(group) == 1 else _GatherFromSP.apply(x, group)


def gather_from_sp_replicated(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """x: [B, T/tp, ...] -> [B, T, ...] for a replicated consumer (every rank computes the same
    loss from the gathered tensor): all-gather forward, keep this rank's slice backward."""
    return x if group_size(group) == 1 else _GatherSplit.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """x: [B, T, ...] partial sums -> [B, T/tp, ...] reduced (reduce-scatter forward, all-gather backward)."""
    return x if group_size(group) == 1 else _ScatterToSP.apply(x, group)


def split_to_sp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """x: [B, T, ...] replicated -> this rank's [B, T/tp, ...] slice (all-gather backward)."""
    return x if group_size(group) == 1 else _SplitToSP.apply(x, group)


def all_reduce_no_grad(x: torch.Tensor, group: Optional[dist.ProcessGroup], op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce outside autograd (statistics such as max/sum for vocab-parallel softmax)."""
    if group_size(group) > 1:
        record("all_reduce", x.numel())
        dist.all_reduce(x, op=op, group=group)
    return x


@contextlib.contextmanager
def counting() -> Iterator[CommCounter]:
    """Shorthand for ``with CommCounter() as c``."""
    with CommCounter() as c:
        yield c
