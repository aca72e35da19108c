"""SlotScheduler (continuous batching) driven by a fake model over a shadow KV cache.

The fake model's next token is a hash of the whole sequence in the row's cache plus the
step's input token, so a plan that leaves a row's cache wrong (a bad prefill, copy or move)
changes the tokens that come out. Every plan is executed on a shadow cache in the engine's
order (prefill, copies, moves, decode) and its invariants checked: decode rows are the
contiguous block ``start .. start + n - 1`` inside the micro-batch's own range, each decode
row's cache holds exactly its prompt and response so far, moves only when the queue is empty.
Outputs are compared with each request run alone (its own prompt, budget and stop tokens).
"""

from __future__ import annotations

import random
import zlib
from collections import deque

import pytest

from aligner.rollout.torch_engine.scheduler import SlotScheduler

VOCAB = 23


def fake_token(seq: list[int]) -> int:
    """The fake model: the next token after `seq` (a deterministic hash, ids in [0, VOCAB))."""
    return zlib.crc32(bytes(str(seq), "ascii")) % VOCAB


def fake_log_prob(seq: list[int]) -> float:
    return -1.0 - len(seq) / 100.0 - fake_token(seq) / 1000.0


def alone(prompt: list[int], budget: int, stop) -> list[int]:
    """The request's response when it runs alone: sample until a stop token or the budget."""
    seq, out = list(prompt), []
    while len(out) < budget:
        t = fake_token(seq)
        out.append(t)
        seq.append(t)
        if t in stop:
            break
    return out


class Shadow:
    """Drives a SlotScheduler like ContinuousBatching.generate, executing each plan on a
    per-row list of cache contents and recording what it saw."""

    def __init__(self, prompts, budgets, capacity, micro_batches, stop, pipelined=False):
        self.sched = SlotScheduler(prompts, budgets, capacity, micro_batches, stop)
        self.capacity, self.m, self.pipelined = capacity, micro_batches, pipelined
        self.cache: dict[int, list[int]] = {}  # row -> tokens at positions [0, len)
        self.plans = []

    def execute(self, plan) -> tuple[list[int], list[float]]:
        s = self.sched
        lo, hi = plan.micro_batch * self.capacity, (plan.micro_batch + 1) * self.capacity
        assert plan.start == lo and 1 <= plan.n <= self.capacity, (plan.start, plan.n)
        for row in plan.prefill_rows + [d for _, d, _ in plan.copies + plan.moves]:
            assert lo <= row < hi, f"micro-batch {plan.micro_batch} touched row {row} outside [{lo}, {hi})"
        if plan.moves:
            assert not s.pending, "a move planned while requests were still queued"
        for row, ids in zip(plan.prefill_rows, plan.prefill_ids):
            self.cache[row] = list(ids)
        for src, dst, n in plan.copies:
            prompt = self.prompts[plan.requests[dst - plan.start]]
            assert n == len(prompt) - 1 and self.cache[src][:n] == prompt[:n], (
                f"copy {src} -> {dst} of {n}: the source does not hold the prompt"
            )
            self.cache[dst] = self.cache[src][:n]
        for src, dst, n in plan.moves:
            self.cache[dst] = self.cache[src][:n]
        tokens, lps = [], []
        for i, (tok, pos, req, step) in enumerate(zip(plan.tokens, plan.positions, plan.requests, plan.steps)):
            row = plan.start + i
            seq = s.outputs[req][0]
            full = self.prompts[req] + seq
            assert step == len(seq) and pos == len(self.prompts[req]) - 1 + step, (req, step, pos)
            assert tok == full[pos], (req, tok, full)
            cached = self.cache.get(row, [])[:pos]
            assert cached == full[:pos], f"row {row} (request {req}) holds {cached}, expected {full[:pos]}"
            self.cache[row] = cached + [tok]
            tokens.append(fake_token(cached + [tok]))
            lps.append(fake_log_prob(cached + [tok]))
        self.plans.append(plan)
        return tokens, lps

    def run(self, prompts):
        self.prompts = [list(p) for p in prompts]
        s, in_flight, mb = self.sched, deque(), 0
        for _ in range(100_000):
            if in_flight and in_flight[0][0] == mb:
                _, tok, lp = in_flight.popleft()
                s.apply(mb, tok, lp)
            if s.done():
                return s
            plan = s.plan(mb)
            if plan is not None:
                tok, lp = self.execute(plan)
                if self.pipelined:
                    in_flight.append((mb, tok, lp))
                else:
                    s.apply(mb, tok, lp)
            mb = (mb + 1) % self.m
        raise AssertionError("the scheduler did not finish")


def run(prompts, budgets, capacity, micro_batches=1, stop=(), pipelined=False) -> Shadow:
    sh = Shadow(prompts, budgets, capacity, micro_batches, stop, pipelined)
    sh.run(prompts)
    return sh


def check_outputs(sh: Shadow, prompts, budgets, stop) -> None:
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        tok, lp = sh.sched.outputs[i]
        assert tok == alone(p, n, stop), f"request {i}"
        assert lp == [fake_log_prob(list(p) + tok[:j]) for j in range(len(tok))], f"request {i}"


def test_slots_are_refilled_and_never_exceed_capacity():
    prompts = [[i + 1, i + 2, 3] if i % 2 else [i + 1] for i in range(11)]
    budgets = [1 + (7 * i) % 6 for i in range(11)]
    sh = run(prompts, budgets, capacity=3)
    check_outputs(sh, prompts, budgets, ())
    generated = sum(len(t) for t, _ in sh.sched.outputs)
    st = sh.sched.stats()
    assert st["decode_rows"] == generated == sum(budgets)
    assert max(p.n for p in sh.plans) == 3 and all(p.n <= 3 for p in sh.plans)
    assert st["decode_steps"] == len(sh.plans) < generated
    # refills: a request admitted after the first step, into a slot another request freed
    first = {}
    for k, p in enumerate(sh.plans):
        for row, req in enumerate(p.requests):
            first.setdefault(req, (k, row))
    assert sorted(first) == list(range(11)) and any(k > 0 for k, _ in first.values())
    assert st["prompt_tokens"] == sum(len(p) for p in prompts)
    assert st["prefilled_tokens"] == sum(len(p) - 1 for p in prompts)  # all distinct: each prefilled once


def test_per_request_budgets_are_respected():
    prompts = [[1, 2], [3], [4, 5, 6], [7, 8], [9]]
    budgets = [5, 1, 9, 2, 4]
    sh = run(prompts, budgets, capacity=2)
    assert [len(t) for t, _ in sh.sched.outputs] == budgets
    check_outputs(sh, prompts, budgets, ())


def test_stop_tokens_end_a_row():
    prompts = [[i, i + 1] for i in range(8)]
    budgets = [12] * 8
    ref = [alone(p, 12, ()) for p in prompts]
    stop = {ref[0][2], ref[3][1]}  # request 0 stops at step 2 at the latest, request 3 at step 1
    sh = run(prompts, budgets, capacity=3, stop=stop)
    check_outputs(sh, prompts, budgets, stop)
    outs = [t for t, _ in sh.sched.outputs]
    assert len(outs[0]) <= 3 and len(outs[3]) <= 2 and outs[0][-1] in stop and outs[3][-1] in stop
    assert all(t not in stop for o in outs for t in o[:-1])
    assert any(len(o) == 12 for o in outs)  # and some rows run to their budget
    assert sh.sched.stats()["decode_rows"] == sum(map(len, outs))


def test_live_block_stays_contiguous_and_moves_keep_request_and_position():
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11], [12, 13]]
    budgets = [2, 9, 1, 7, 3, 8]  # rows stop out of order once the queue is empty
    sched = SlotScheduler(prompts, budgets, 4, 1, ())
    moved = 0
    while not sched.done():
        before = {i: (r.request.index, r.pos, r.token, r.step) for i, r in enumerate(sched.rows[0]) if r is not None}
        plan = sched.plan(0)
        rows = sched.rows[0]
        assert plan.start == 0 and len(rows) == plan.n and all(r is not None for r in rows)  # rows 0 .. n-1, no hole
        assert plan.requests == [r.request.index for r in rows] and plan.positions == [r.pos for r in rows]
        if plan.moves:
            assert not sched.pending
        for src, dst, n in plan.moves:
            assert dst < src and before[src][1] == n  # the whole cache [0, pos) moves
            assert (rows[dst].request.index, rows[dst].pos, rows[dst].token, rows[dst].step) == before[src]
            moved += 1
        sched.apply(0, [fake_token([r.request.index, r.step]) for r in rows], [0.0] * plan.n)
    assert moved > 0 and sched.stats()["moved_rows"] == moved
    assert [len(t) for t, _ in sched.outputs] == budgets


@pytest.mark.parametrize("capacity", [8, 16])
def test_identical_prompts_admitted_together_are_prefilled_once(capacity):
    a, b = [1, 2, 3, 4], [5, 6, 7]
    prompts = [a, a, b, a, b, b, a, b]  # 4 samples of each, admitted in one plan
    budgets = [3, 5, 2, 4, 6, 1, 2, 3]
    sh = run(prompts, budgets, capacity=capacity)
    check_outputs(sh, prompts, budgets, ())
    st = sh.sched.stats()
    first = sh.plans[0]
    assert st["prefilled_tokens"] == (len(a) - 1) + (len(b) - 1)
    assert st["shared_prefix_tokens"] == 3 * (len(a) - 1) + 3 * (len(b) - 1)
    assert len(first.prefill_rows) == 2 and first.prefill_ids == [a[:-1], b[:-1]]
    # the 6 other samples copy from the row prefilling their prompt (Shadow.execute checks it holds the prompt)
    assert sorted((src, dst) for src, dst, _ in first.copies) == [(0, 1), (0, 3), (0, 6), (2, 4), (2, 5), (2, 7)]
    assert all(not p.copies and not p.prefill_rows for p in sh.plans[1:])


def test_identical_prompt_admitted_while_a_sibling_is_live_is_copied():
    a, b = [1, 2, 3, 4, 5], [6, 7]
    prompts = [a, b, a, a]
    budgets = [10, 1, 3, 2]  # b frees its slot after one step; the later a's join the live first a
    sh = run(prompts, budgets, capacity=2)
    check_outputs(sh, prompts, budgets, ())
    st = sh.sched.stats()
    assert st["prefilled_tokens"] == (len(a) - 1) + (len(b) - 1)
    assert st["shared_prefix_tokens"] == 2 * (len(a) - 1)
    later = [c for p in sh.plans[1:] for c in p.copies]
    assert later and all(src == 0 and n == len(a) - 1 for src, _, n in later)


def test_one_token_prompts_need_no_prefill():
    prompts = [[5], [5], [6], [7]]
    sh = run(prompts, [3, 2, 4, 1], capacity=4)
    check_outputs(sh, prompts, [3, 2, 4, 1], ())
    assert all(not p.prefill_rows and not p.copies for p in sh.plans)
    st = sh.sched.stats()
    assert st["prefilled_tokens"] == 0 and st["shared_prefix_tokens"] == 0 and st["prompt_tokens"] == 4


@pytest.mark.parametrize("pipelined", [False, True])
def test_micro_batches_use_disjoint_row_ranges(pipelined):
    prompts = [[i % 5 + 1, 2, 3][: 1 + i % 3] for i in range(14)]
    budgets = [1 + (5 * i) % 7 for i in range(14)]
    sh = run(prompts, budgets, capacity=2, micro_batches=3, pipelined=pipelined)
    check_outputs(sh, prompts, budgets, ())
    seen = {m: set() for m in range(3)}
    for p in sh.plans:
        rows = set(range(p.start, p.start + p.n)) | set(p.prefill_rows) | {r for c in p.copies + p.moves for r in c[:2]}
        assert rows <= set(range(2 * p.micro_batch, 2 * p.micro_batch + 2)), (p.micro_batch, rows)
        seen[p.micro_batch] |= rows
    assert all(seen[m] for m in range(3))  # every block was used
    assert sh.sched.stats()["decode_rows"] == sum(budgets)


@pytest.mark.parametrize("seed", range(30))
def test_random_workloads_match_each_request_alone(seed):
    """Random prompts drawn from a few shared ones, budgets, stop tokens, pool shapes and
    pipelining: every plan passes the shadow-cache checks and every output is the request's own."""
    rng = random.Random(seed)
    base = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    prompts = [rng.choice(base) for _ in range(rng.randint(1, 16))]
    budgets = [rng.randint(1, 9) for _ in prompts]
    stop = set(rng.sample(range(VOCAB), rng.randint(0, 2)))
    sh = run(prompts, budgets, capacity=rng.randint(1, 5), micro_batches=rng.randint(1, 3), stop=stop, pipelined=rng.random() < 0.5)
    check_outputs(sh, prompts, budgets, stop)
    st = sh.sched.stats()
    assert st["decode_rows"] == sum(len(t) for t, _ in sh.sched.outputs)
    assert st["prefilled_tokens"] + st["shared_prefix_tokens"] == sum(len(p) - 1 for p in prompts)


@pytest.mark.parametrize("capacity,micro_batches", [(0, 1), (1, 0), (-2, 2)])
def test_bad_capacity_is_refused(capacity, micro_batches):
    with pytest.raises(ValueError, match="capacity"):
        SlotScheduler([[1]], [1], capacity, micro_batches, ())
