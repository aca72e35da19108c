"""Weight syncs that land between decode steps: interruptible generation (docs/rollout.md; AReaL's interruptible rollout).

AReaL's interruptible rollout workers (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
Learning System for Language Reasoning", arXiv:2505.24298) and NeMo-RL's in-flight weight updates: a
sync that arrives while a generate() call decodes does not wait for the call to end. The receiving
thread stages the received tensors here; the decode loop of the continuous scheduler
(:mod:`aligner.rollout.torch_engine.continuous_batching`) applies them at its next step boundary, with the
engine's own ``update_weights`` / ``finish_weight_update`` (in-place copies, so CUDA graphs and the
KV-cache pool stay valid), and goes on with the requests in flight. Each response token then
records the engine's ``weight_version`` that produced it (``Generation.token_versions``).

Owns: :class:`WeightStaging` (the lock, the staged syncs, whether a call decodes).

Simplifications, as AReaL: the KV cache of the requests in flight is kept, so their positions
computed before the swap keep the old weights' keys and values (and a new request that shares a
live row's prompt copies that row's old-weight prefix); only the tokens after the swap are sampled
with the new weights. A staged sync holds its received tensors until it is applied: up to one more
copy of the weights per sync staged during one decode step (each sync is applied whole, in order).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Protocol

import torch

Bucket = list[tuple[str, torch.Tensor]]


class Updatable(Protocol):
    """What a WeightStaging applies syncs to: a rollout engine's bucketed weight-update protocol."""

    weight_version: int

    def update_weights(self, named_tensors: Bucket) -> None: ...

    def finish_weight_update(self) -> None: ...


class WeightStaging:
    """Syncs received while a call decodes, applied by the decode loop at its next step boundary.

    Thread-safe between one decoding thread (:meth:`decoding`, :meth:`step_boundary`) and one
    receiving thread (:meth:`offer`). ``swaps``: syncs applied in the middle of a call, in total.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: list[list[Bucket]] = []  # syncs not applied yet, oldest first (each: its buckets)
        self._decoding = False
        self.swaps = 0

    @staticmethod
    def _apply(engine: Updatable, sync: list[Bucket]) -> None:
        for bucket in sync:
            engine.update_weights(bucket)
        engine.finish_weight_update()

    def offer(self, engine: Updatable, sync: list[Bucket]) -> bool:
        """A whole received sync (its buckets of (hf_name, tensor), tensors owned by the caller from now
        on): applied to `engine` at once when no call decodes (returns True), else staged for the
        decode loop's next step boundary (returns False)."""
        with self._lock:
            if not self._decoding:
                self._apply(engine, sync)
                return True
            self._staged.append(sync)
            return False

    def step_boundary(self, engine: Updatable) -> bool:
        """Between two decode steps: apply every staged sync to `engine`, in order. True when one was applied."""
        if not self._staged:  # a list's truth under the GIL: a sync staged just after is applied at the next boundary
            return False
        with self._lock:
            staged, self._staged = self._staged, []
            for sync in staged:
                self._apply(engine, sync)
            self.swaps += len(staged)
            return bool(staged)

    @contextmanager
    def decoding(self, engine: Updatable) -> Iterator[None]:
        """Around a generate() call: syncs offered meanwhile are staged; any left when the call ends
        (offered after its last step boundary) are applied then, so the engine holds the newest weights."""
        with self._lock:
            self._decoding = True
        try:
            yield
        finally:
            with self._lock:
                self._decoding = False
                staged, self._staged = self._staged, []
                for sync in staged:
                    self._apply(engine, sync)
