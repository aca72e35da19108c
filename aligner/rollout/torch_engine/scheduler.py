"""Continuous batching: which request runs in which KV-cache slot at each decode step.

Owns the planning half of :class:`aligner.rollout.torch_engine.engine.TorchEngine`'s continuous
mode (Orca's iteration-level scheduling, Yu et al. OSDI 2022; vLLM and TensorRT-LLM's
in-flight batching): a queue of requests, a fixed pool of KV-cache slots split into
micro-batches, and per step a :class:`StepPlan` that the engine executes on every pipeline
stage (:mod:`aligner.rollout.torch_engine.continuous_batching`). Pure Python (no torch): every rank of an engine runs the same scheduler on the same
requests and sampled tokens, so they agree on every plan without exchanging it (pipeline
stages after the first receive the plan's numbers with the hidden states).

Slots. The pool has ``micro_batches * capacity`` rows; micro-batch m owns rows
``[m * capacity, (m + 1) * capacity)``, and its live rows are always the first n of them, so
a decode step reads the contiguous block ``[start, start + n)``. A row holds one request:
cache positions ``[0, pos)`` are its prompt and response so far, ``token`` is the input of
the next decode forward, written at position ``pos``.

Admission (between decode steps). A stopped row's slot is refilled by the next pending
request; when no request is pending, the last live rows move into the holes (``moves``) so
the block stays contiguous. A request with a P-token prompt enters with its first P-1 tokens
in the cache and its last prompt token as the input of its first decode step, so its first
response token comes out of the same decode forward as everybody else's. The P-1 tokens are
either prefilled (``prefill_rows``: one batched forward of the new prompts, right-padded),
or, when a live row already holds the same prompt, copied from it (``copies``: a shared
prompt prefix, e.g. the n samples of a GRPO group prefill their prompt once).

Execution order of a plan on every pipeline stage: prefill, copies, moves, extends (below), decode. Copies
read their sources before moves write; a move's destination is a hole no copy reads.

Episodes (multi-turn, docs/environments.md). With a ``turn_end`` callback a request is an episode: when
a row samples a stop token, the callback gets the turn's tokens and returns the observation's
tokens (a tool's result, the next user message, rendered by the chat template), or None to end the
episode. The row keeps its slot and its cache: in its next step the stop token and the observation
minus its last token are written by an extension prefill (``extends``: one forward of those tokens
at the row's positions, attending to the row's cache, batched with the other rows' extensions), and
the observation's last token is the row's input of the same step's decode, whose sample is the
first token of the model's next turn. Earlier turns are never prefilled again. A request's budget
counts every token after its prompt, the model's and the observations'; ``own`` marks which are the
model's.

Parked rows (environments stepped beside decoding). When ``turn_end`` returns a Future, the turn
ends of one step are waited for together up to ``turn_wait_s`` (a fast environment continues as if
synchronous); a row whose future is still running is parked: it keeps its slot and its place in
the block, and each step decodes it with its stop token at its next position (what that position
holds anyway until the extension rewrites it) and drops the sample, so the other rows never wait
for it. The plan that finds its future done continues it (an extension) or frees its slot, exactly
as a synchronous ``turn_end`` would have. ``parked_rows`` counts the decode rows spent on parked rows.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

TurnEnd = Callable[[int, list[int], int], Any]
"""``turn_end(request, turn_ids, room) -> observation ids or None``: request is the request's index in
the call, turn_ids the model's turn just ended (its stop token last, unless the budget cut it), room
the tokens left in the request's budget (0 when the budget cut the turn: the return value is then
ignored). Returning None, [] or more than room - 1 ids ends the episode (one token of room must stay
for the model's next turn). It may instead return a ``concurrent.futures.Future`` of that value (an
environment stepped on another thread): the row is *parked* until the future is done (see the
module docstring) while the other rows decode."""

OnFinish = Callable[[int, list[int]], None]
"""``on_finish(request, token_ids)``: request's index in the call and its whole response (observations
included for episodes), called once per request as soon as it ends, before the call returns: what
finished can be used (scored by a remote reward) while the other rows still decode."""


@dataclass
class Request:
    """One generate() request: its index in the call, prompt token ids and token budget."""

    index: int
    prompt: list[int]
    max_new_tokens: int

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(self.prompt)


@dataclass
class Row:
    """A live slot: ``token`` is written at cache position ``pos`` by the next decode step;
    ``step`` response tokens have been sampled so far."""

    request: Request
    token: int
    pos: int
    step: int = 0
    turn: list[int] = field(default_factory=list)  # the model's tokens of its current turn (episodes)
    extension: list[int] = field(default_factory=list)  # episodes: tokens to write at [pos, pos + len) next step
    next_token: int = 0  # episodes: the input after the extension (the observation's last token)
    parked: Optional[tuple[Future, bool, int, int]] = None  # episodes: (observation future, stopped, room, stop token)


@dataclass
class StepPlan:
    """One step of one micro-batch, as the engine executes it on every pipeline stage.

    prefill_rows [U] with prefill_ids [U][<= T]: rows whose prompt (minus its last token) is
    prefilled, right-padded to T = the longest. copies / moves: (src_row, dst_row, length)
    copies of cache positions [0, length). extends: (row, offset, ids) of episodes that continue
    after an observation: ids written at cache positions [offset, offset + len(ids)) of the row,
    attending to its positions before them (run after the moves, with rows as they are after
    them). Decode: rows ``start .. start + n - 1`` with input
    ``tokens`` [n] at ``positions`` [n]; ``requests`` [n] (request index) and ``steps`` [n]
    (response token index) pick each row's random draw.
    """

    micro_batch: int
    start: int
    prefill_rows: list[int] = field(default_factory=list)
    prefill_ids: list[list[int]] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    extends: list[tuple[int, int, list[int]]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.tokens)


class SlotScheduler:
    """Iteration-level scheduler over ``micro_batches`` blocks of ``capacity`` slots.

    Args:
        prompts: B prompts (non-empty token-id lists). max_new_tokens: B budgets (>= 1).
        capacity: slots per micro-batch (>= 1). micro_batches: blocks (>= 1).
        stop_ids: token ids that end a response (included in it).
        turn_end: None (one turn per request), or the episodes' :data:`TurnEnd` callback.
        on_finish: None, or the :data:`OnFinish` callback, run when a request frees its slot.
        turn_wait_s: how long one step's turn ends that returned Futures are waited for before their
            rows are parked, seconds.
    Use: ``plan(m)`` -> a StepPlan or None (nothing to run in m), then ``apply(m, tokens,
    log_probs)`` with the step's sampled tokens [n] and log-probs [n], until ``done()``;
    ``outputs`` holds each request's (token_ids, log_probs) and ``own`` whether each token is the
    model's (False for observation tokens, whose log-prob is recorded as 0.0).
    Counters: ``prompt_tokens`` (sum of P), ``prefilled_tokens`` (tokens run through a
    prefill forward), ``shared_tokens`` (copied from a live row instead), ``decode_steps``
    (decode forwards), ``decode_rows`` (rows in them), ``moved_rows``, ``turns`` (model turns
    ended), ``observation_tokens`` (the environments'), ``extended_tokens`` (run through extension
    prefills: each continued turn's stop token and its observation but the last token).
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        capacity: int,
        micro_batches: int,
        stop_ids,
        turn_end: Optional[TurnEnd] = None,
        on_finish: Optional[OnFinish] = None,
        turn_wait_s: float = 0.01,
    ):
        if capacity < 1 or micro_batches < 1:
            raise ValueError(f"capacity={capacity}, micro_batches={micro_batches}: both must be >= 1")
        self.capacity, self.micro_batches = capacity, micro_batches
        self.stop = frozenset(int(t) for t in stop_ids)
        self.pending = deque(Request(i, list(p), int(n)) for i, (p, n) in enumerate(zip(prompts, max_new_tokens)))
        self.rows: list[list[Optional[Row]]] = [[] for _ in range(micro_batches)]
        self.holders: dict[tuple[int, ...], set[int]] = {}  # prompt -> live rows whose [0, P-1) hold it
        self.outputs: list[tuple[list[int], list[float]]] = [([], []) for _ in range(len(self.pending))]
        self.own: list[list[bool]] = [[] for _ in range(len(self.pending))]
        self.turn_end, self.on_finish, self.turn_wait_s = turn_end, on_finish, turn_wait_s
        self.live = self.finished = 0
        self.prompt_tokens = sum(len(r.prompt) for r in self.pending)
        self.prefilled_tokens = self.shared_tokens = self.decode_steps = self.decode_rows = self.moved_rows = 0
        self.turns = self.observation_tokens = self.extended_tokens = self.parked_rows = 0

    def done(self) -> bool:
        return not self.pending and self.live == 0

    def _hold(self, key, row: int) -> None:
        self.holders.setdefault(key, set()).add(row)

    def _release(self, key, row: int) -> None:
        rows = self.holders.get(key)
        if rows is not None:
            rows.discard(row)
            if not rows:
                del self.holders[key]

    def plan(self, m: int) -> Optional[StepPlan]:
        """Refill micro-batch m's holes from the queue, compact it, and describe its next step."""
        rows, base = self.rows[m], m * self.capacity
        for i, r in enumerate(rows):  # parked rows whose environment answered: go on or end, as in apply
            if r is not None and r.parked is not None and r.parked[0].done():
                fut, stopped, room, t = r.parked
                r.parked = None
                self._resume(rows, base, i, fut.result(), stopped, room, t)
        plan = StepPlan(m, base)
        prefilled: dict[tuple[int, ...], int] = {}  # prompt -> the row prefilling it in this plan

        def admit(i: int) -> None:
            req = self.pending.popleft()
            row, key, p = base + i, req.key, len(req.prompt)
            if p > 1:
                src = prefilled.get(key)
                if src is None and key in self.holders:
                    src = min(self.holders[key])
                if src is None:
                    prefilled[key] = row
                    plan.prefill_rows.append(row)
                    plan.prefill_ids.append(req.prompt[:-1])
                    self.prefilled_tokens += p - 1
                else:
                    plan.copies.append((src, row, p - 1))
                    self.shared_tokens += p - 1
            rows[i] = Row(req, req.prompt[-1], p - 1)
            self._hold(key, row)
            self.live += 1

        for i in range(len(rows)):
            if rows[i] is None and self.pending:
                admit(i)
        while self.pending and len(rows) < self.capacity:
            rows.append(None)
            admit(len(rows) - 1)
        while rows and rows[-1] is None:
            rows.pop()
        # no request left to fill the holes: move the last rows down (no admission follows, so the
        # prefix holders need no update)
        for i in range(len(rows)):
            if i >= len(rows):
                break
            if rows[i] is None:
                last = rows.pop()
                plan.moves.append((base + len(rows), base + i, last.pos))
                rows[i] = last
                self.moved_rows += 1
                while rows and rows[-1] is None:
                    rows.pop()
        if not rows or (all(r.parked is not None for r in rows) and not plan.moves):
            return None  # nothing to run (every live row waits for its environment: see wait_parked); moves must run
        for i, r in enumerate(rows):
            if r.extension:  # an episode goes on after its observation (see the module docstring)
                plan.extends.append((base + i, r.pos, r.extension))
                self.extended_tokens += len(r.extension)
                r.pos, r.token, r.extension = r.pos + len(r.extension), r.next_token, []
        for r in rows:
            plan.tokens.append(r.token)
            plan.positions.append(r.pos)
            plan.requests.append(r.request.index)
            plan.steps.append(r.step)
        self.decode_steps += 1
        self.decode_rows += len(rows)
        self.parked_rows += sum(r.parked is not None for r in rows)
        return plan

    def parked(self) -> list[Future]:
        """The futures of the parked rows (every micro-batch)."""
        return [r.parked[0] for rows in self.rows for r in rows if r is not None and r.parked is not None]

    def wait_parked(self, timeout_s: float) -> None:
        """Block until a parked row's future is done or `timeout_s` passed (the engine calls it when no
        micro-batch had anything to run)."""
        futures = self.parked()
        if futures:
            wait(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def apply(self, m: int, tokens: Sequence[int], log_probs: Sequence[float]) -> None:
        """Record micro-batch m's sampled tokens [n] and log-probs [n] (its last plan's row order);
        rows that sampled a stop token or reached their budget free their slot, unless the episode's
        ``turn_end`` returns an observation (then the row goes on with an extension in its next
        plan) or a Future still running (then the row is parked; see the module docstring). A
        parked row's sample is dropped."""
        rows, base = self.rows[m], m * self.capacity
        ended: list[tuple[int, Any, bool, int, int]] = []  # turn ends: (row, observation or its future, stopped, room, token)
        for i, (t, lp) in enumerate(zip(tokens, log_probs)):
            r = rows[i]
            if r.parked is not None:
                continue
            out_t, out_lp = self.outputs[r.request.index]
            out_t.append(int(t))
            out_lp.append(float(lp))
            self.own[r.request.index].append(True)
            r.step += 1
            r.token, r.pos = int(t), r.pos + 1
            stopped = int(t) in self.stop
            room = r.request.max_new_tokens - len(out_t)
            if self.turn_end is not None:
                r.turn.append(int(t))
                if stopped or room <= 0:
                    self.turns += 1
                    ended.append((i, self.turn_end(r.request.index, r.turn, max(room, 0)), stopped, room, int(t)))
                    r.turn = []
                    continue
            if stopped or room <= 0:
                self._end(rows, base, i)
        futures = [obs for _, obs, _, _, _ in ended if isinstance(obs, Future)]
        if futures:
            wait(futures, timeout=self.turn_wait_s)
        for i, obs, stopped, room, t in ended:
            if isinstance(obs, Future):
                if not obs.done():
                    rows[i].parked = (obs, stopped, room, t)
                    continue
                obs = obs.result()
            self._resume(rows, base, i, obs, stopped, room, t)

    def _resume(self, rows: list, base: int, i: int, obs, stopped: bool, room: int, t: int) -> None:
        """After row i's turn ended with stop token `t` (`stopped`) and `room` tokens of budget left: go
        on with observation `obs` (an extension in the next plan) when it fits, else end the request."""
        r = rows[i]
        if stopped and room > 0 and obs and len(obs) < room:
            obs = [int(x) for x in obs]
            out_t, out_lp = self.outputs[r.request.index]
            out_t += obs
            out_lp += [0.0] * len(obs)
            self.own[r.request.index] += [False] * len(obs)
            r.extension, r.next_token = [t] + obs[:-1], obs[-1]
            self.observation_tokens += len(obs)
            return
        self._end(rows, base, i)

    def _end(self, rows: list, base: int, i: int) -> None:
        """Request of row i is done: free its slot, report it (on_finish)."""
        r = rows[i]
        self._release(r.request.key, base + i)
        rows[i] = None
        self.live -= 1
        self.finished += 1
        if self.on_finish is not None:
            self.on_finish(r.request.index, self.outputs[r.request.index][0])

    def stats(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "shared_prefix_tokens": self.shared_tokens,
            "decode_steps": self.decode_steps,
            "decode_rows": self.decode_rows,
            "moved_rows": self.moved_rows,
            **(
                {
                    "turns": self.turns,
                    "observation_tokens": self.observation_tokens,
                    "extended_tokens": self.extended_tokens,
                    "parked_rows": self.parked_rows,
                }
                if self.turn_end is not None
                else {}
            ),
        }
