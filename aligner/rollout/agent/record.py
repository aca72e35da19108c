"""What the OpenAI-compatible endpoint records of an agent's calls, and the training samples built
from those records (docs/agents.md).

Every choice the engine samples for a call is one :class:`CallRecord`: the prompt's token ids as the
engine read them, the completion's token ids as it sampled them, each sampled token's log-prob and the
engine's ``weight_version`` (per token with an interruptible engine). Records are keyed by the
episode id the agent passes and never re-tokenized.

Segments. A call whose prompt extends an earlier record's prompt + completion token for token (the
endpoint builds such a prompt from that record's tokens plus the tokens of what the agent added)
names that record as its ``parent``. A call that does not (the agent edited or dropped history, the
chat template rewrote an earlier turn, e.g. stripped reasoning, or a tokenization that cannot be
spliced) starts a new segment, with ``break_reason`` saying why; so does a second call extending a
record that already has a continuation (a branch). :func:`build_samples` turns each chain of
records (a root and its continuations) into one training sample: the root's prompt, then every
completion and, between them, the tokens the agent added (tool results, user turns), which are
masked from the loss, as :mod:`aligner.envs.episodes`' observations are. Splitting instead of
refusing keeps the agent running; every sample is still exactly what the engine read and sampled.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from aligner.rollout.base import Generation


@dataclass
class CallRecord:
    """One sampled choice of one endpoint call.

    episode_id: the agent's episode id. call: the call's index in its episode (choices of one call
    share it); choice: the choice's index (0 .. n-1). prompt_ids: list[int], the prompt the engine
    read. completion_ids: list[int], the sampled tokens (the stop token included when sampled).
    log_probs: list[float] (len = len(completion_ids)), natural-log probability of each sampled token
    as the engine reports it (:class:`aligner.rollout.base.Generation`). weight_version: the engine's
    weight_version at sampling; token_versions: per token (interruptible engines) or None.
    finish_reason: the engine's ("stop" or "length"; "stop" also for a stop string cut here).
    parent: the index, in the episode's records, of the record whose prompt + completion this
    prompt extends token for token, or None for a segment's first call. break_reason: "" when the
    call continues `parent` or is the episode's first; else why a new segment started (one line).
    """

    episode_id: str
    call: int
    choice: int
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    weight_version: int
    token_versions: Optional[list[int]] = None
    finish_reason: str = "stop"
    parent: Optional[int] = None
    break_reason: str = ""
    # the text the prompt stands for and the completion's decoded text (special tokens kept): how the
    # next call is matched against this one (not part of the training data)
    prompt_text: str = field(default="", repr=False, compare=False)
    completion_text: str = field(default="", repr=False, compare=False)

    @property
    def context_ids(self) -> list[int]:
        """prompt_ids + completion_ids: the prefix a continuing call's prompt starts with."""
        return self.prompt_ids + self.completion_ids

    @property
    def versions(self) -> list[int]:
        """The weight version of each completion token."""
        return list(self.token_versions) if self.token_versions is not None else [self.weight_version] * len(self.completion_ids)


@dataclass
class AgentSample:
    """One training sample: a chain of records as the trainer's (prompt, Generation) pair.

    prompt_ids: the chain's first prompt. generation: token_ids = every completion and, between
    them, the tokens the agent added; own_mask False and rollout_log_probs 0.0 on the added tokens;
    token_versions per token (an added token gets the version of the completion before it);
    weight_version = the oldest version in the chain; finish_reason = the last completion's;
    extra = {"episode_id", "records" (the chain's record indices), "added_tokens"}.
    """

    episode_id: str
    prompt_ids: list[int]
    generation: Generation


class AgentRecorder:
    """The records of every episode, thread-safe. The endpoint calls :meth:`add`; a trainer takes an
    episode's records with :meth:`pop` (or reads them with :meth:`records`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, list[CallRecord]] = {}
        self._calls: dict[str, int] = {}
        self._children: dict[str, set[int]] = {}
        self._rewards: dict[str, float] = {}
        self.breaks = 0  # segments started after an episode's first call (drift, edits, branches)

    def lock(self) -> threading.Lock:
        """The recorder's lock (held while a call is matched against and added to its episode)."""
        return self._lock

    def next_call(self, episode_id: str) -> int:
        """The index the episode's next call gets (call with the lock held)."""
        n = self._calls.get(episode_id, 0)
        self._calls[episode_id] = n + 1
        return n

    def records(self, episode_id: str) -> list[CallRecord]:
        """A copy of the episode's records, in the order they were added ([] for an unknown id)."""
        with self._lock:
            return list(self._episodes.get(episode_id, ()))

    def _records(self, episode_id: str) -> list[CallRecord]:
        return self._episodes.get(episode_id, [])

    def has_child(self, episode_id: str, index: int) -> bool:
        """Whether record `index` of the episode already has a continuation (call with the lock held)."""
        return index in self._children.get(episode_id, ())

    def add(self, record: CallRecord) -> int:
        """Append `record` to its episode (call with the lock held); a parent that already has a
        continuation turns this record into a new segment ("branch"). Returns its index."""
        recs = self._episodes.setdefault(record.episode_id, [])
        children = self._children.setdefault(record.episode_id, set())
        if record.parent is not None:
            if record.parent in children:
                record.break_reason = f"branch: record {record.parent} was already continued by another call"
                record.parent = None
            else:
                children.add(record.parent)
        if record.parent is None and record.break_reason:
            self.breaks += 1
        recs.append(record)
        return len(recs) - 1

    def set_reward(self, episode_id: str, reward: float) -> None:
        """Keep the return the agent reported for its episode (the last report wins)."""
        with self._lock:
            self._rewards[episode_id] = float(reward)

    def reward(self, episode_id: str) -> Optional[float]:
        """The return the agent reported, None when it reported none."""
        with self._lock:
            return self._rewards.get(episode_id)

    def episode_ids(self) -> list[str]:
        """The ids of the episodes with records."""
        with self._lock:
            return list(self._episodes)

    def pop(self, episode_id: str) -> list[CallRecord]:
        """Remove and return the episode's records ([] for an unknown id), forgetting its reported reward."""
        with self._lock:
            self._calls.pop(episode_id, None)
            self._children.pop(episode_id, None)
            self._rewards.pop(episode_id, None)
            return self._episodes.pop(episode_id, [])


def build_samples(records: list[CallRecord]) -> list[AgentSample]:
    """The training samples of one episode's records (in the order they were added), one per chain.

    A chain starts at a record without a parent and follows each record's one continuation. Raises
    ValueError when a record's prompt does not start with its parent's prompt + completion (records
    not made by the endpoint) or a parent index is out of range."""
    child: dict[int, int] = {}
    for i, r in enumerate(records):
        if r.parent is not None:
            if not 0 <= r.parent < i:
                raise ValueError(f"record {i} names parent {r.parent}: a parent must be an earlier record")
            child.setdefault(r.parent, i)
    samples = []
    for root, r in enumerate(records):
        if r.parent is not None:
            continue
        chain = [root]
        while chain[-1] in child:
            chain.append(child[chain[-1]])
        samples.append(_sample(records, chain))
    return samples


def _sample(records: list[CallRecord], chain: list[int]) -> AgentSample:
    first = records[chain[0]]
    ids, lps, own, versions = [], [], [], []
    added = 0
    prev: Optional[CallRecord] = None
    for i in chain:
        r = records[i]
        if prev is not None:
            ctx = prev.context_ids
            if r.prompt_ids[: len(ctx)] != ctx:
                raise ValueError(f"record {i}'s prompt does not start with its parent's prompt + completion: not a continuation")
            extra = r.prompt_ids[len(ctx) :]
            last_version = (prev.versions or [prev.weight_version])[-1]
            ids += extra
            lps += [0.0] * len(extra)
            own += [False] * len(extra)
            versions += [last_version] * len(extra)
            added += len(extra)
        ids += r.completion_ids
        lps += list(r.log_probs)
        own += [True] * len(r.completion_ids)
        versions += r.versions
        prev = r
    last = records[chain[-1]]
    gen = Generation(
        token_ids=ids,
        rollout_log_probs=lps,
        finish_reason=last.finish_reason,
        weight_version=min(records[i].weight_version for i in chain),
        own_mask=own,
        token_versions=versions,
        extra={"episode_id": first.episode_id, "records": list(chain), "added_tokens": added},
    )
    return AgentSample(first.episode_id, list(first.prompt_ids), gen)
