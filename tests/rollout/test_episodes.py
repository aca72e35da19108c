"""Episodes in the continuous scheduler: multi-turn generation that continues each
episode from its cached prefix (the observation written by an extension prefill into the episode's
slot) equals generating every turn from the full context without a cache.

Reference: the same model run on the whole conversation so far (prompt, earlier turns, observations)
with no KV cache, one full forward per token; greedy by argmax, sampled by the engine's documented
inverse-CDF draw, the request's draw j going to its j-th own token (draws are not spent on
observation tokens). Log-probs of the model's tokens by a full forward of the whole trajectory,
which is what the trainer computes (tolerance 1e-5 in fp32: the cached and uncached forwards take
different GEMM shapes).
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import SamplingConfig
from aligner.nn.vocab import vocab_parallel_log_probs
from aligner.rollout.torch_engine.engine import TorchEngine
from aligner.rollout.torch_engine.sampling import filter_top_k_top_p
from aligner.rollout.torch_engine.scheduler import SlotScheduler
from tests.toolkit.engine import ENGINE_CFG, VARLEN, engine_model

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [3, 3], [40, 41], [5], [60, 2, 9, 9]]
STOPS = [t for t in range(ENGINE_CFG.vocab_size) if t % 4 == 0]  # a quarter of the vocabulary ends a turn
BUDGET = 20
MAX_TURNS = 3


def observation(request: int, turn: list[int], n_turn: int) -> list[int]:
    """A deterministic environment: 1-3 observation tokens depending on the turn, none after MAX_TURNS."""
    if n_turn >= MAX_TURNS:
        return []
    return [(turn[0] * 7 + request + k) % 90 + 1 for k in range(1 + (len(turn) + request) % 3)]


class Env:
    """The engine's turn_end callback over :func:`observation`; records what it was given."""

    def __init__(self) -> None:
        self.turns: dict[int, list[list[int]]] = {}

    def __call__(self, request: int, turn: list[int], room: int):
        self.turns.setdefault(request, []).append(list(turn))
        return observation(request, turn, len(self.turns[request]))


@torch.no_grad()
def episode_reference(model, request: int, prompt: list[int], s: SamplingConfig, seed: int) -> tuple[list[int], list[bool]]:
    """The episode by full forwards of the whole context: (tokens after the prompt, own mask)."""
    u = torch.rand(BUDGET, generator=torch.Generator().manual_seed(seed))
    ids, own, turn, n_turns = list(prompt), [], [], 0
    while len(own) < BUDGET:
        logits = model(torch.tensor([ids]))[0, -1:].float()
        if s.temperature == 0:
            t = int(logits.argmax())
        else:
            probs = filter_top_k_top_p(logits / s.temperature, s.top_k, s.top_p).softmax(-1)[0]
            cdf = probs.cumsum(-1)
            t = min(int(torch.searchsorted(cdf, u[sum(own)] * cdf[-1], right=True)), len(cdf) - 1)
        ids.append(t)
        own.append(True)
        turn.append(t)
        room = BUDGET - len(own)
        if t in STOPS and room > 0:
            n_turns += 1
            obs = observation(request, turn, n_turns)
            turn = []
            if not obs or len(obs) >= room:
                break
            ids += obs
            own += [False] * len(obs)
        elif t in STOPS:
            break
    return ids[len(prompt) :], own


@torch.no_grad()
def trajectory_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    full = torch.tensor([prompt + response])
    logits = model(full)[:, len(prompt) - 1 : -1]
    return vocab_parallel_log_probs(logits, full[:, len(prompt) :], temperature=temperature)[0]


@pytest.fixture(scope="module")
def model():
    return engine_model()


GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=BUDGET, stop_token_ids=STOPS)
SAMPLED = SamplingConfig(temperature=0.9, top_k=30, max_new_tokens=BUDGET, stop_token_ids=STOPS)


@pytest.mark.parametrize(
    "sampling,attention,micro_batches",
    [(GREEDY, "sdpa", 1), (SAMPLED, "sdpa", 1), (GREEDY, "sdpa", 2), pytest.param(SAMPLED, "varlen", 1, marks=VARLEN)],
    ids=["greedy", "sampled", "greedy-2-blocks", "sampled-varlen"],
)
def test_episodes_from_the_prefix_cache_equal_full_context_generation(model, sampling, attention, micro_batches):
    seeds = [100 + i for i in range(len(PROMPTS))]
    refs = [episode_reference(model, i, p, sampling, s) for i, (p, s) in enumerate(zip(PROMPTS, seeds))]
    # the test's premise: several episodes have observations (more than one turn), some end before the
    # budget; greedy, some run to it
    assert sum(not all(own) for _, own in refs) >= 3 and any(len(ids) < BUDGET for ids, _ in refs)
    assert sampling.temperature > 0 or any(len(ids) == BUDGET for ids, _ in refs)
    env = Env()
    eng = TorchEngine(model, max_batch_size=4, decode_attention=attention, micro_batches=micro_batches)
    gens = eng.generate(PROMPTS, sampling, seeds=seeds, turn_end=env)
    temperature = sampling.temperature or 1.0
    for i, (p, g, (ids, own)) in enumerate(zip(PROMPTS, gens, refs)):
        assert g.token_ids == ids, f"episode {i}"
        assert g.own_mask == own, f"episode {i}"
        lp = torch.tensor(g.rollout_log_probs)
        assert (lp[~torch.tensor(own)] == 0).all()  # observation tokens carry no log-prob
        want = trajectory_log_probs(model, p, ids, temperature)
        torch.testing.assert_close(lp[torch.tensor(own)], want[torch.tensor(own)], atol=1e-5, rtol=0)
    st = eng.last_stats
    observed = sum(own.count(False) for _, own in refs)
    assert st["observation_tokens"] == observed and st["turns"] == sum(len(t) for t in env.turns.values())
    # each continued turn's stop token and its observation but the last token went through one extension forward
    assert st["extended_tokens"] == observed
    # no earlier turn is prefilled again: the only prefill is each prompt's, once
    assert st["prefilled_tokens"] + st["shared_prefix_tokens"] == sum(len(p) - 1 for p in PROMPTS)


class SlowEnv(Env):
    """:class:`Env` stepped on other threads: each observation arrives `delay_s` later (and after more for
    the even requests), as a Future; the scheduler parks the rows meanwhile."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.delay_s = ThreadPoolExecutor(4), delay_s

    def __call__(self, request: int, turn: list[int], room: int):
        import time

        def step(turn: list[int]):
            time.sleep(self.delay_s * (2 if request % 2 == 0 else 1))
            return Env.__call__(self, request, turn, room)

        return self.pool.submit(step, list(turn))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("slots", [2, 4])
def test_parked_rows_give_the_same_episodes_while_the_others_decode(model, sampling, slots):
    """Environments that answer after 20-40 ms (Futures): the rows wait parked, the others go on, and
    every episode, its own mask and its log-probs equal the synchronous run's; parked rows were
    decoded (and their samples dropped) while the others ran. (A first version lost a parked row's
    cache when every live row was parked and one of them had just been moved down the block.)"""
    seeds = [100 + i for i in range(len(PROMPTS))]
    sync = TorchEngine(model, max_batch_size=slots).generate(PROMPTS, sampling, seeds=seeds, turn_end=Env())
    slow = SlowEnv(0.02)
    eng = TorchEngine(model, max_batch_size=slots)
    gens = eng.generate(PROMPTS, sampling, seeds=seeds, turn_end=slow)
    for i, (a, b) in enumerate(zip(sync, gens)):
        assert b.token_ids == a.token_ids and b.own_mask == a.own_mask, f"episode {i}"
        torch.testing.assert_close(torch.tensor(b.rollout_log_probs), torch.tensor(a.rollout_log_probs), atol=1e-5, rtol=0)
    st = eng.last_stats
    assert st["parked_rows"] > 0 and st["turns"] == sum(len(t) for t in slow.turns.values())


def test_a_call_whose_every_row_is_parked_waits_instead_of_spinning(model):
    """One episode whose environment takes 0.3 s: the engine waits on the future (no decode steps spent
    while every live row is parked beyond the few before the wait) and returns the synchronous episode."""
    sync = TorchEngine(model).generate(PROMPTS[:1], GREEDY, turn_end=Env())
    slow = SlowEnv(0.15)
    eng = TorchEngine(model)
    gens = eng.generate(PROMPTS[:1], GREEDY, turn_end=slow)
    assert gens[0].token_ids == sync[0].token_ids
    turns = len(slow.turns[0])
    assert turns >= 2 and eng.last_stats["parked_rows"] == 0  # a lone parked row is never decoded


def test_single_turn_generations_carry_no_own_mask(model):
    gens = TorchEngine(model).generate(PROMPTS[:2], GREEDY)
    assert all(g.own_mask is None for g in gens)


def test_the_static_scheduler_refuses_episodes(model):
    with pytest.raises(ValueError, match="rollout.scheduler=continuous"):
        TorchEngine(model, scheduler="static").generate(PROMPTS[:1], GREEDY, turn_end=Env())


def run_plans(sched: SlotScheduler, script: dict[int, list[int]]) -> None:
    """Drive a scheduler with 'sampled' tokens from `script` (request -> its own tokens in order)."""
    while not sched.done():
        plan = sched.plan(0)
        toks = [script[r][s] for r, s in zip(plan.requests, plan.steps)]
        sched.apply(0, toks, [-0.5] * len(toks))


def test_the_budget_counts_observation_tokens_and_an_observation_that_does_not_fit_ends_the_episode():
    calls = []

    def turn_end(request, turn, room):
        calls.append((request, list(turn), room))
        return [50, 51, 52] if request == 0 else [60] * room  # request 1's observation leaves no room

    # request 0: turn [7, 0] (0 stops), observation 3 tokens, then [8, 9, 0], observation again does not fit
    sched = SlotScheduler([[1, 2], [3]], [9, 6], capacity=2, micro_batches=1, stop_ids=[0], turn_end=turn_end)
    run_plans(sched, {0: [7, 0, 8, 9, 0, 5], 1: [4, 0, 4]})
    (t0, lp0), (t1, lp1) = sched.outputs
    assert t0 == [7, 0, 50, 51, 52, 8, 9, 0] and sched.own[0] == [True, True, False, False, False, True, True, True]
    assert lp0 == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5, -0.5, -0.5]
    assert t1 == [4, 0] and sched.own[1] == [True, True]
    assert calls == [(0, [7, 0], 7), (1, [4, 0], 4), (0, [8, 9, 0], 1)]
    assert sched.stats()["observation_tokens"] == 3 and sched.stats()["turns"] == 3


def test_a_turn_cut_by_the_budget_is_reported_with_no_room():
    calls = []
    sched = SlotScheduler([[1]], [3], 1, 1, [0], turn_end=lambda r, t, room: calls.append((t, room)) or [9])
    run_plans(sched, {0: [5, 6, 7]})
    assert sched.outputs[0][0] == [5, 6, 7] and calls == [([5, 6, 7], 0)]
