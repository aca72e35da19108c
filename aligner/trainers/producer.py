"""Generation ahead of the update under bounded staleness, for the split rollout placement (docs/rollout.md).

With ``rollout.placement=split`` the engines form their own worker group (:mod:`aligner.workers.rollout`)
and receive the actor's weights by broadcast (:mod:`aligner.rollout.weight_sync.broadcast`). The
:class:`RolloutProducer` keeps a queue of generations in flight on that group: while the actor trains
on the batch of step t, the rollout group already generates the batches of steps t+1 .. t+k
(``trainer.max_staleness`` = k), the one-step off-policy pipeline of NeMo-RL and verl when k = 1.

Versions are counted in PPO steps: the actor's weights after t updates are version t, and the engines
hold the version of their last sync. A batch generated with version v and trained at step t is
t - v steps stale; before each new generation is queued the engines are synced to the actor's
current weights when its staleness at training time would exceed k. k = 0 syncs before every
generation: the colocated run's semantics (the same tokens: tests/trainers/test_split_placement.py).
The lag is corrected in the update by AReaL's decoupled PPO objective
(``algorithm.decoupled_loss``, on by default when k > 0).

By default a sync lands only between generations: Ray runs a worker's calls one at a time, so a sync
queued behind a generation in flight waits for it. With k = 1 the queue is empty when the sync is due
and generation overlaps the whole update; with k >= 2 a sync that is due while batches are in flight
waits for them.

Interruptible generation (``rollout.interruptible=true``, k >= 1; AReaL's interruptible rollout workers,
NeMo-RL's in-flight weight updates): the sync is issued when due without waiting for the generations in
flight. The rollout workers receive it beside the generate call (a concurrent call on a thread of their
own, :meth:`aligner.workers.rollout.RolloutWorker.receive_weights_beside`) into buffers, and the engine's
decode loop swaps it in at its next step boundary, keeping the KV cache of the requests in flight
(:mod:`aligner.rollout.weight_sync.staging`); every token records the version that sampled it. The sync is
still exact (the engines hold the actor's weights bit for bit once it lands) and a batch's tokens are
never older than its version at submission, so the staleness bound holds per token; a response can
span versions (``mixed_version_frac``), and the decoupled loss handles it with the engine's per-token
behaviour log-probs. Where the swap lands depends on timing, so such a run is not reproducible token
for token from its seed. Versions: the engines count syncs (their ``weight_version``); the producer
maps that count to the policy version each sync carried (:attr:`RolloutProducer.versions`).

Resume: the data position saved with a checkpoint is the one before the oldest batch not yet trained
(:meth:`RolloutProducer.data_state`), so a resumed run trains on the same prompts; the batches in
flight are dropped and regenerated with the resumed weights (version t instead of t - k).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from aligner import algorithms as alg
from aligner.rollout.base import token_versions_to_padded
from aligner.workers.group import WorkerGroup, get_all_across_groups


def token_staleness_metrics(token_versions: torch.Tensor, step: int, response_mask: torch.Tensor) -> dict[str, float]:
    """A batch's staleness counted per token, for interruptible generation (a sync may land mid-response).

    token_versions: [B, R] int64, the policy version of each response token. step: the PPO step that
    trains on the batch (the actor's current version, >= every version). response_mask: [B, R].
    Returns {"staleness": mean of step - version over response tokens, "staleness_max": its max,
    "mixed_version_frac": the fraction of samples whose tokens span more than one version}, in steps
    (the last: a fraction in [0, 1]). Raises ValueError as :func:`aligner.algorithms.staleness_metrics`
    (a version newer than `step`, bad shapes or dtypes).
    """
    m = alg.staleness_metrics(token_versions, step, response_mask)
    return {
        "staleness": float(m["staleness_mean"]),
        "staleness_max": float(m["staleness_max"]),
        "mixed_version_frac": float(alg.mixed_version_fraction(token_versions, response_mask)),
    }


@dataclass
class Pending:
    """A generation in flight: for training step `step`, from engines holding policy version `version`.

    rows: the prompt rows (each prompt n times in a row). future: the rollout group's generate call.
    data_state: the prompt iterator's state before this batch's prompts were drawn. prepared: the
    result of the work queued for it by :meth:`RolloutProducer.prepare` (None when none was).
    """

    step: int
    version: int
    rows: list[dict]
    future: Any
    data_state: dict
    prepared: Optional[Future] = None  # what :meth:`RolloutProducer.prepare` runs for it once generated


class _Done:
    """A finished result with the ``get()`` of a :class:`~aligner.workers.group.GroupFuture`."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self, timeout_s: Optional[float] = None) -> Any:
        return self.value


class RolloutProducer:
    """The rollout group, its weight sync from the actor group and the queue of generations in flight.

    actor: the actor's WorkerGroup (:class:`~aligner.workers.actor.ActorWorker`). rollout: the rollout
    WorkerGroup (:class:`~aligner.workers.rollout.RolloutWorker`). max_staleness: k >= 0.
    interruptible: syncs land between decode steps of the generations in flight (see the module docstring).
    Joining the sync group happens here (every member at once). It also has the ``refit()`` /
    ``generate()`` pair of the actor group, so the greedy evaluation runs on the rollout group.
    """

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup, max_staleness: int, interruptible: bool = False) -> None:
        if max_staleness < 0:
            raise ValueError(f"trainer.max_staleness={max_staleness} is invalid: must be >= 0")
        self.actor, self.rollout, self.k, self.interruptible = actor, rollout, max_staleness, interruptible
        self.engine_version = -1  # the policy version the engines hold (once the last sync lands); -1 = their seeded init
        self.policy_version = 0  # the actor's current version (the trainer sets it: PPO steps done)
        self.versions: list[int] = [-1]  # entry v: the policy version of the engines' weight_version v (their v-th sync)
        self.pending: deque[Pending] = deque()
        ips = {i["node_ip"] for i in actor.worker_info()[:1] + rollout.worker_info()}
        loopback = len(ips) == 1
        host, port = next(a for a in actor.sync_address(loopback).get() if a is not None)
        world = 1 + rollout.world_size
        get_all_across_groups([actor.join_weight_sync(host, port, world, loopback), rollout.join_weight_sync(host, port, world, loopback)])

    def sync(self) -> dict[str, float]:
        """Send the actor's current weights to every engine. Waits for the generations in flight on the
        rollout group, unless interruptible: then it returns once every engine holds the sync (staged for
        the running generation's next decode step, or applied when idle). Returns {"seconds", "bytes",
        "weight_version"}; bytes 0 when already current."""
        if self.engine_version == self.policy_version:
            return {"seconds": 0.0, "bytes": 0, "weight_version": self.engine_version}
        t0 = time.perf_counter()
        # a rollout worker that died since its last call is reported here, as the rollout group's death,
        # before the actor enters a broadcast that would fail with it (then only the whole run restarts)
        if self.interruptible:
            self.rollout.alive().get(timeout_s=60.0)  # answered beside the generation in flight
            receive = self.rollout.receive_weights_beside()
        else:
            self.rollout.worker_info(timeout_s=60.0)
            receive = self.rollout.receive_weights()
        sent, _ = get_all_across_groups([self.actor.send_weights(), receive])
        self.engine_version = self.policy_version
        self.versions.append(self.policy_version)
        return {"seconds": time.perf_counter() - t0, "bytes": sent[0]["bytes"], "weight_version": self.engine_version}

    def token_versions(self, gens: list, r: int) -> torch.Tensor:
        """[B, r] int64: the policy version of each response token of `gens` (right-padded with each
        row's last), from the engines' per-token ``token_versions`` (interruptible) or each Generation's
        weight_version, mapped through :attr:`versions`. r: the batch's padded response length."""
        return token_versions_to_padded(gens, r, self.versions)

    def due(self, step: int) -> bool:
        """Whether a batch for training step `step` generated now would be more than k steps stale."""
        return step - self.engine_version > self.k

    def submit(
        self, step: int, rows: list[dict], prompt_ids: list, sampling, seeds: list, data_state: dict, episodes=None, reward_rows=None
    ) -> None:
        """Queue the generation of step `step`'s batch on the engines as they are now (no wait);
        episodes: the rows' (prompt text, metadata) when each plays an episode (env.name), else None;
        reward_rows: the rows' {"prompt", "metadata"} when the engines stream them to the remote reward."""
        fut = self.rollout.generate(prompt_ids, sampling, seeds, episodes or None, reward_rows)
        self.pending.append(Pending(step, self.engine_version, rows, fut, data_state))

    def prepare(self, fn: Callable[[Pending], Any]) -> None:
        """Run ``fn(item)`` for the batch queued last on a thread of its own (a daemon: it waits for the
        generation, so it never holds up the driver's exit), its result or exception in ``item.prepared``.
        The trainer uses it to send a finished batch to the reference while the actor updates
        (``trainer.ref_ahead``). Ray calls are thread-safe; fn must not touch the trainer's state."""
        item, fut = self.pending[-1], Future()

        def run() -> None:
            fut.set_running_or_notify_cancel()
            try:
                fut.set_result(fn(item))
            except BaseException as e:  # handed to the step that takes the batch (a worker death: its restart)
                fut.set_exception(e)

        item.prepared = fut
        threading.Thread(target=run, name=f"prepare-step-{item.step}", daemon=True).start()

    def take(self, step: int) -> Pending:
        """The oldest batch in flight, which must be step `step`'s (RuntimeError otherwise)."""
        if not self.pending or self.pending[0].step != step:
            have = [p.step for p in self.pending]
            raise RuntimeError(f"no generation queued for step {step} (queued: {have})")
        return self.pending.popleft()

    def queued_steps(self) -> list[int]:
        return [p.step for p in self.pending]

    def data_state(self) -> Optional[dict]:
        """The prompt iterator's state before the oldest untrained batch in flight (None when none is)."""
        return self.pending[0].data_state if self.pending else None

    def drop(self) -> None:
        """Forget the generations in flight (a run that stops; their results, and those of their
        prepare threads, are never read)."""
        self.pending.clear()

    # ---- the actor group's evaluation interface -------------------------------------------------
    def refit(self) -> _Done:
        """Sync the engines to the actor's current weights (waits for generations in flight)."""
        return _Done(self.sync())

    def generate(self, prompt_ids: list, sampling, seeds: list, episodes=None, reward_rows=None):
        """The rollout group's generate (behind any generation in flight); episodes, reward_rows: as submit's."""
        return self.rollout.generate(prompt_ids, sampling, seeds, episodes, reward_rows)
