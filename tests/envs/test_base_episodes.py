"""The environment interface and the episode loop (aligner.envs.base).

Scripted environments and scripted policies: max_turns is respected and the trajectory keeps
every turn; an environment that raises, hangs past the per-call timeout or returns a bad value
fails its own episode with the reason, never raises, and the other episodes of the batch run.
"""

from __future__ import annotations

import time

import pytest

from aligner.envs import (
    ENVIRONMENTS,
    Environment,
    EnvSpec,
    Message,
    StepResult,
    episode_metrics,
    get_env,
    make_env,
    register_env,
    run_episode,
    run_episodes,
)


class CountingEnv(Environment):
    """Answers every turn with "obs N", rewards turn N with N/10, done after `done_after` turns (never: 0).

    Hooks: `raise_at` / `sleep_at` (turn number) make that step raise or sleep `sleep_s`; `bad_at` returns `bad`."""

    name = "counting"

    def __init__(self, done_after=0, raise_at=0, sleep_at=0, sleep_s=5.0, bad_at=0, bad=None, finish_reward=1.0):
        self.done_after, self.raise_at, self.sleep_at, self.sleep_s = done_after, raise_at, sleep_at, sleep_s
        self.bad_at, self.bad, self.finish_reward = bad_at, bad, finish_reward
        self.steps: list[str] = []

    def reset(self, prompt, metadata):
        self.prompt = prompt
        return (Message("system", f"rules for {metadata.get('id', '?')}"),)

    def step(self, turn):
        self.steps.append(turn)
        n = len(self.steps)
        if n == self.raise_at:
            raise RuntimeError("boom in step")
        if n == self.sleep_at:
            time.sleep(self.sleep_s)
        if n == self.bad_at:
            return self.bad
        return StepResult(messages=(Message("user", f"obs {n}"),), reward=n / 10, done=n == self.done_after, info={"calls": 1})

    def finish(self):
        return self.finish_reward


class ScriptedPolicy:
    """The model: turn i's text is "turn i"; keeps every conversation it was shown."""

    def __init__(self):
        self.seen: list[list[dict]] = []

    def __call__(self, messages):
        self.seen.append(messages)
        return f"turn {len(self.seen)}"


def test_max_turns_cuts_the_episode_and_the_trajectory_keeps_every_turn():
    env, policy = CountingEnv(), ScriptedPolicy()
    ep = run_episode(env, "2+2=", {"id": 7}, policy, max_turns=3, timeout_s=5)
    assert len(policy.seen) == 3 and env.steps == ["turn 1", "turn 2", "turn 3"]
    assert (ep.done, ep.truncated, ep.failed) == (False, True, False)
    # prompt, reset's message, then turn/observation pairs; the last step's observation is dropped
    assert [(t.role, t.text, t.own) for t in ep.turns] == [
        ("user", "2+2=", False),
        ("system", "rules for 7", False),
        ("assistant", "turn 1", True),
        ("user", "obs 1", False),
        ("assistant", "turn 2", True),
        ("user", "obs 2", False),
        ("assistant", "turn 3", True),
    ]
    assert [t.reward for t in ep.model_turns] == pytest.approx([0.1, 0.2, 0.3])
    assert ep.final_reward == 1.0 and ep.total_reward == pytest.approx(1.6)
    assert ep.counts == {"calls": 3}
    # the model saw the conversation so far: its second turn came after the first observation
    assert policy.seen[1][-2:] == [{"role": "assistant", "content": "turn 1"}, {"role": "user", "content": "obs 1"}]


def test_done_ends_the_episode_before_max_turns():
    ep = run_episode(CountingEnv(done_after=2), "p", {}, ScriptedPolicy(), max_turns=10, timeout_s=5)
    assert (ep.done, ep.truncated, ep.failed) == (True, False, False)
    assert len(ep.model_turns) == 2 and ep.turns[-1].text == "turn 2"  # no observation after the last turn


@pytest.mark.parametrize(
    "env,reason",
    [
        (CountingEnv(raise_at=2), "step 2 raised RuntimeError: boom in step"),
        (CountingEnv(bad_at=1, bad=None), "step 1 returned NoneType, not a StepResult"),
        (CountingEnv(bad_at=1, bad=StepResult(reward=float("nan"))), "step 1 gave the reward nan"),
        (CountingEnv(bad_at=1, bad=StepResult(info={"calls": "one"})), "step 1 gave the info {'calls': 'one'}"),
        (CountingEnv(finish_reward="high"), "finish gave the reward 'high'"),
    ],
    ids=["raises", "returns-none", "nan-reward", "info-not-numbers", "bad-final-reward"],
)
def test_an_env_that_raises_or_misbehaves_fails_its_episode_with_the_reason(env, reason):
    ep = run_episode(env, "p", {}, ScriptedPolicy(), max_turns=4, timeout_s=5)
    assert ep.failed and not ep.done
    assert reason in ep.failure and ep.failure.startswith("counting: "), ep.failure
    assert ep.final_reward == 0.0


def test_an_env_that_hangs_past_the_timeout_fails_its_episode_in_time():
    start = time.monotonic()
    ep = run_episode(CountingEnv(sleep_at=1, sleep_s=5.0), "p", {}, ScriptedPolicy(), max_turns=4, timeout_s=0.2)
    assert time.monotonic() - start < 2.0  # the loop did not wait for the 5 s step
    assert ep.failed and "step 1 timed out after 0.2 s" in ep.failure, ep.failure


def test_reset_and_finish_are_under_the_same_guard():
    class BadReset(CountingEnv):
        def reset(self, prompt, metadata):
            raise KeyError("id")

    class SlowFinish(CountingEnv):
        def finish(self):
            time.sleep(5)

    assert "reset raised KeyError" in run_episode(BadReset(), "p", {}, ScriptedPolicy(), max_turns=2, timeout_s=5).failure
    assert "finish timed out" in run_episode(SlowFinish(done_after=1), "p", {}, ScriptedPolicy(), max_turns=2, timeout_s=0.2).failure


def test_the_other_episodes_go_on_and_the_metrics_count_the_failures():
    envs = iter([CountingEnv(done_after=1), CountingEnv(raise_at=1), CountingEnv(sleep_at=1), None, CountingEnv()])

    def factory():
        env = next(envs)
        if env is None:
            raise OSError("no sandbox")
        return env

    rows = [(f"p{i}", {"id": i}) for i in range(5)]
    eps = run_episodes(factory, rows, lambda messages: "t", max_turns=2, timeout_s=0.2)
    assert [e.prompt for e in eps] == ["p0", "p1", "p2", "p3", "p4"]
    assert [e.failed for e in eps] == [False, True, True, True, False]
    assert "building the environment raised OSError: no sandbox" in eps[3].failure
    assert (eps[0].done, eps[4].truncated) == (True, True)
    m = episode_metrics(eps)
    assert m["env/episodes"] == 5 and m["env/failed"] == pytest.approx(3 / 5) and m["env/truncated"] == pytest.approx(1 / 5)
    assert m["env/turns"] == pytest.approx((1 + 1 + 1 + 0 + 2) / 5)
    assert m["env/final_reward_mean"] == 1.0  # over the two that did not fail
    assert m["env/calls"] == pytest.approx((1 + 2) / 5)  # p0's one step and p4's two (failed steps report no info)
    assert episode_metrics(eps, prefix="")["turns"] == m["env/turns"] and episode_metrics([])["env/episodes"] == 0


def test_run_episode_refuses_max_turns_below_one():
    with pytest.raises(ValueError, match="max_turns=0"):
        run_episode(CountingEnv(), "p", {}, ScriptedPolicy(), max_turns=0, timeout_s=1)


def test_registry_by_name():
    assert list(ENVIRONMENTS) == ["single_turn", "retry", "tool"]
    with pytest.raises(ValueError, match=r"env.name='nope' is unknown: valid environments are single_turn, retry, tool"):
        get_env("nope")
    with pytest.raises(ValueError, match="registered twice"):
        register_env("tool")(CountingEnv)


def test_single_turn_env_is_one_turn_scored_by_the_reward_function():
    env = make_env("single_turn", EnvSpec(reward_fn=lambda prompt, response, meta: float(response == meta["answer"])))
    ep = run_episode(env, "2+2=", {"answer": "4"}, lambda messages: "4", max_turns=5, timeout_s=5)
    assert (ep.done, len(ep.model_turns), ep.final_reward) == (True, 1, 1.0)
    env = make_env("single_turn", EnvSpec(reward_fn=lambda prompt, response, meta: float(response == meta["answer"])))
    assert run_episode(env, "2+2=", {"answer": "4"}, lambda messages: "5", max_turns=1, timeout_s=5).final_reward == 0.0


def test_env_runner_times_out_a_hung_call_and_serves_the_next_on_a_fresh_thread():
    import threading
    import time

    from aligner.envs.base import EnvFailure, EnvRunner, call_env

    runner = EnvRunner()
    release = threading.Event()
    with pytest.raises(EnvFailure, match="step 1 timed out after 0.1 s"):
        call_env(lambda: release.wait(5), 0.1, "step 1", runner)
    t0 = time.perf_counter()
    assert call_env(lambda: 42, 1.0, "step 2", runner) == 42  # not queued behind the hung call
    assert time.perf_counter() - t0 < 0.5
    with pytest.raises(EnvFailure, match="step 3 raised ValueError: bad"):
        call_env(lambda: (_ for _ in ()).throw(ValueError("bad")), 1.0, "step 3", runner)
    release.set()
