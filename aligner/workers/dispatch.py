"""Dispatch modes of worker methods, and batch splitting / result collection (Ray-free).

A worker class is a plain Python class; :func:`dispatch` marks which of its methods the driver
may call and how (verl's ``@register``; docs/design.md, "Declared dispatch modes"). :class:`aligner.workers.group.WorkerGroup`
reads the marks and does the Ray calls; everything here runs without Ray.

    broadcast   same call on every rank; result: list indexed by rank
    dp_split    first positional argument (dict of tensors/lists, list, tuple, tensor or
                dataclass) split into dp_size contiguous chunks by dp_rank (:func:`split_batch`);
                results from each replica concatenated in order (:func:`concat_results`)
    rank0       called on rank 0 only; result: rank 0's return value

A method marked ``concurrent=True`` runs beside the worker's other calls (on a thread of its own,
one such call at a time) instead of after them: the rollout worker's staged weight receive of
interruptible generation (docs/rollout.md), which must not wait for the generate call in flight.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Optional, Sequence

DISPATCH_MODES = ("broadcast", "dp_split", "rank0")
_ATTR = "_aligner_dispatch"
_CONCURRENT_ATTR = "_aligner_concurrent"


# ---- declaring methods -------------------------------------------------------------
def dispatch(mode: str, concurrent: bool = False) -> Callable[[Callable], Callable]:
    """Mark a worker method as callable from the driver with dispatch `mode`.

    mode: one of broadcast, dp_split, rank0 (see the module docstring). concurrent: the call runs
    beside the worker's other calls, not queued behind them (see the module docstring); the method
    must then be thread-safe against them.
    The method itself is unchanged (tests call it directly). Raises ValueError for an
    unknown mode, or concurrent with a mode other than broadcast.
    """
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {mode!r} is invalid: valid modes are {', '.join(DISPATCH_MODES)}")
    if concurrent and mode != "broadcast":
        raise ValueError(f"concurrent=True with dispatch mode {mode!r} is not built: concurrent calls are broadcast")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _ATTR, mode)
        setattr(fn, _CONCURRENT_ATTR, bool(concurrent))
        return fn

    return mark


def dispatched_methods(worker_cls: type) -> dict[str, str]:
    """Method name -> dispatch mode for every method of `worker_cls` marked with :func:`dispatch`."""
    out = {}
    for name, fn in inspect.getmembers(worker_cls, predicate=callable):
        mode = getattr(fn, _ATTR, None)
        if mode is not None:
            out[name] = mode
    return out


def is_concurrent(worker_cls: type, method: str) -> bool:
    """Whether `method` of `worker_cls` was marked ``dispatch(..., concurrent=True)``."""
    return bool(getattr(getattr(worker_cls, method, None), _CONCURRENT_ATTR, False))


# ---- batches -----------------------------------------------------------------------
def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _batch_axis_len(x: Any) -> Optional[int]:
    """Length along the batch axis of a splittable value, None for values copied whole."""
    if _is_tensor(x):
        return x.shape[0] if x.dim() > 0 else None
    if isinstance(x, (list, tuple)):
        return len(x)
    return None


def _bounds(length: int, n: int) -> list[tuple[int, int]]:
    if length < n:
        raise ValueError(f"a batch of {length} sample(s) cannot be split over dp_size={n}: give at least dp_size samples")
    base, extra = divmod(length, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _fields(batch: Any) -> dict[str, Any]:
    if isinstance(batch, Mapping):
        return dict(batch)
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def _rebuild(batch: Any, values: dict[str, Any]) -> Any:
    if isinstance(batch, Mapping):
        return type(batch)(values) if type(batch) is not dict else values
    return dataclasses.replace(batch, **values)


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split `batch` into `n` contiguous chunks along the batch axis (dim 0).

    batch: a tensor [B, ...], a list/tuple of B items, or a dict / dataclass whose tensor
        and list values all have length B along dim 0 (other values, e.g. scalars, are
        copied into every chunk).
    Raises ValueError when values disagree on B (naming the key), when B < n, or when
    nothing in the batch has a batch axis.
    """
    if n < 1:
        raise ValueError(f"n={n} is invalid: must be >= 1")
    if _is_tensor(batch) or isinstance(batch, (list, tuple)):
        length = _batch_axis_len(batch)
        if length is None:
            raise ValueError("a 0-dim tensor has no batch axis to split: give a [B, ...] tensor")
        return [batch[a:b] for a, b in _bounds(length, n)]
    if not (isinstance(batch, Mapping) or dataclasses.is_dataclass(batch)):
        raise ValueError(f"cannot split a {type(batch).__name__}: give a dict of tensors/lists, a list, a tensor or a dataclass")
    values = _fields(batch)
    lengths = {k: _batch_axis_len(v) for k, v in values.items()}
    sized = {k: v for k, v in lengths.items() if v is not None}
    if not sized:
        raise ValueError(f"nothing to split in the batch (keys {list(values)}): give tensors or lists with a batch axis")
    first_key, length = next(iter(sized.items()))
    for k, v in sized.items():
        if v != length:
            raise ValueError(f"batch[{k!r}] has {v} samples but batch[{first_key!r}] has {length}: every tensor/list must share dim 0")
    chunks = []
    for a, b in _bounds(length, n):
        chunks.append(_rebuild(batch, {k: (v[a:b] if lengths[k] is not None else v) for k, v in values.items()}))
    return chunks


def concat_results(results: Sequence[Any]) -> Any:
    """Concatenate per-replica results in order (the inverse of :func:`split_batch`).

    Tensors with a batch axis are concatenated along dim 0, lists and tuples joined,
    dicts and dataclasses concatenated value by value; values without a batch axis
    (scalars, 0-dim tensors, strings) come back as a list with one entry per replica;
    all-None gives None. Raises ValueError when dict results have different keys.
    """
    first = results[0]
    if all(r is None for r in results):
        return None
    if _is_tensor(first) and first.dim() > 0:
        import torch

        return torch.cat(list(results), dim=0)
    if isinstance(first, list):
        return [x for r in results for x in r]
    if isinstance(first, tuple):
        return tuple(x for r in results for x in r)
    if isinstance(first, Mapping) or (dataclasses.is_dataclass(first) and not isinstance(first, type)):
        keys = list(_fields(first))
        for r in results[1:]:
            if list(_fields(r)) != keys:
                raise ValueError(f"dp replicas returned different keys: {keys} vs {list(_fields(r))}")
        merged = {k: concat_results([_fields(r)[k] for r in results]) for k in keys}
        return _rebuild(first, merged)
    return list(results)
