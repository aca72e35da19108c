"""TokenEpisodes (aligner.envs.episodes): the engine's turn_end callback, driven here by hand.

The observation's tokens follow the chat template exactly: the model's tokens, then what the
template renders after them (checked against the template's rendering of the whole conversation);
environments that raise, hang, misbehave or return reset messages fail their own episode only;
max_turns, a budget with no room and a finished episode end it with the final reward.
"""

from __future__ import annotations

import time

import pytest

from aligner.config import TaskConfig
from aligner.data.task import build_task_tokenizer
from aligner.data.tokenizer import load_tokenizer
from aligner.envs import Environment, EnvSpec, Message, RetryEnv, StepResult, TokenEpisodes, make_env
from aligner.envs.retry_env import FEEDBACK

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def task_tok(tmp_path_factory):
    """The built-in task's tokenizer with the default role-tag template (eos ends an assistant turn)."""
    return load_tokenizer(build_task_tokenizer(TaskConfig(), str(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def chatml_tok(tmp_path_factory):
    """The same vocabulary with ChatML's special tokens and template (eos = <|im_end|>, as SmolLM2's)."""
    tok = load_tokenizer(build_task_tokenizer(TaskConfig(), str(tmp_path_factory.mktemp("tok2"))), CHATML)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    return tok


def exact(prompt: str, response: str, metadata: dict) -> float:
    return float(response.strip() == metadata["answer"])


def retry_episodes(tok, rows, max_turns=3):
    spec = EnvSpec(reward_fn=exact, chat_template=tok.chat_template)
    return TokenEpisodes(lambda: make_env("retry", spec), tok, rows, max_turns=max_turns, timeout_s=5, stop_ids=[tok.eos_token_id])


@pytest.mark.parametrize("which", ["task_tok", "chatml_tok"])
def test_observation_tokens_follow_the_chat_template(which, request):
    tok = request.getfixturevalue(which)
    eos = tok.eos_token_id
    ep = retry_episodes(tok, [("12+39=", {"answer": "51"})])
    prompt_ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "12+39="}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    turn1 = tok.encode("41", add_special_tokens=False) + [eos]
    obs = ep(0, turn1, room=100)
    assert obs is not None
    turn2 = tok.encode("51", add_special_tokens=False) + [eos]
    assert ep(0, turn2, room=100 - len(turn1) - len(obs)) is None  # right: done
    # the trajectory's text is the template's rendering of the conversation (the model's last turn included)
    convo = [
        {"role": "user", "content": "12+39="},
        {"role": "assistant", "content": "41"},
        {"role": "user", "content": FEEDBACK},
        {"role": "assistant", "content": "51"},
    ]
    want = tok.apply_chat_template(convo, tokenize=False)
    got = tok.decode(prompt_ids + turn1 + obs + turn2, skip_special_tokens=False)
    assert got == want.rstrip("\n")  # ChatML renders a newline after the last <|im_end|>, which the model never writes
    e = ep.episodes[0]
    assert [t.role for t in e.turns] == ["user", "assistant", "user", "assistant"] and [t.own for t in e.turns] == [
        False,
        True,
        False,
        True,
    ]
    assert e.done and not e.truncated and e.final_reward == 1.0 and e.counts == {"retries": 1}


def test_max_turns_and_a_budget_without_room_end_the_episode(task_tok):
    eos = task_tok.eos_token_id
    wrong = task_tok.encode("7", add_special_tokens=False) + [eos]
    ep = retry_episodes(task_tok, [("1+1=", {"answer": "2"})] * 3, max_turns=2)
    assert ep(0, wrong, 100) is not None and ep(0, wrong, 100) is None  # the second turn is the last
    assert ep(1, wrong, 2) is None  # the observation does not fit in 2 tokens
    assert ep(2, task_tok.encode("77", add_special_tokens=False), 0) is None  # cut by the budget, no stop token
    for e, turns in zip(ep.episodes, (2, 1, 1)):
        assert e.truncated and not e.done and not e.failed and len(e.model_turns) == turns and e.final_reward == 0.0
    assert ep.episodes[2].model_turns[0].text == "77"


class Raises(Environment):
    def reset(self, prompt, metadata):
        return ()

    def step(self, turn):
        raise RuntimeError("tool crashed")

    def finish(self):
        return 1.0


class Hangs(Raises):
    def step(self, turn):
        time.sleep(5)


class Greets(Raises):
    def reset(self, prompt, metadata):
        return (Message("system", "hello"),)


class BadReward(Raises):
    def step(self, turn):
        return StepResult(reward=float("nan"))


@pytest.mark.parametrize(
    "env_cls,failure",
    [
        (Raises, "step 1 raised RuntimeError: tool crashed"),
        (Hangs, "step 1 timed out after 0.2 s"),
        (Greets, "reset returned messages"),
        (BadReward, "a finite number is needed"),
    ],
)
def test_a_failing_environment_fails_its_own_episode_only(task_tok, env_cls, failure):
    envs = iter([env_cls(), RetryEnv(EnvSpec(reward_fn=exact))])
    ep = TokenEpisodes(
        lambda: next(envs), task_tok, [("1+1=", {"answer": "2"}), ("1+1=", {"answer": "2"})], max_turns=2, timeout_s=0.2, stop_ids=[2]
    )
    right = task_tok.encode("2", add_special_tokens=False) + [2]
    assert ep(0, right, 50) is None
    assert ep(1, right, 50) is None
    bad, good = ep.episodes
    assert bad.failed and failure in bad.failure and bad.final_reward == 0.0
    assert bad.model_turns[0].text == "2"  # the model's turn is kept in the trajectory
    assert not good.failed and good.done and good.final_reward == 1.0


def test_step_workers_return_futures_of_the_same_observations_and_failures(task_tok):
    """step_workers=2: each turn end comes back as a Future run on a step thread; the observations, the
    trajectories and a hanging environment's timeout are those of the synchronous callback."""
    from concurrent.futures import Future

    eos = task_tok.eos_token_id
    wrong = task_tok.encode("7", add_special_tokens=False) + [eos]
    rows = [("1+1=", {"answer": "2"})] * 2
    sync = retry_episodes(task_tok, rows)
    spec = EnvSpec(reward_fn=exact)
    threaded = TokenEpisodes(lambda: make_env("retry", spec), task_tok, rows, max_turns=3, timeout_s=5, stop_ids=[eos], step_workers=2)
    futures = [threaded(i, wrong, 100) for i in range(2)]
    assert all(isinstance(f, Future) for f in futures)
    assert [f.result(timeout=10) for f in futures] == [sync(i, wrong, 100) for i in range(2)]
    assert [e.turns for e in threaded.episodes] == [e.turns for e in sync.episodes]
    threaded.close()
    envs = iter([Hangs(), Hangs()])
    hangs = TokenEpisodes(lambda: next(envs), task_tok, rows, max_turns=2, timeout_s=0.2, stop_ids=[2], step_workers=2)
    right = task_tok.encode("2", add_special_tokens=False) + [2]
    assert [hangs(i, right, 50).result(timeout=10) for i in range(2)] == [None, None]
    assert all(e.failed and "step 1 timed out after 0.2 s" in e.failure for e in hangs.episodes)
    hangs.close()


def test_an_environment_that_cannot_be_built_fails_its_episode():
    def factory():
        raise ValueError("no tools")

    ep = TokenEpisodes(factory, None, [("p", {})], max_turns=1, timeout_s=1, stop_ids=[2])
    assert ep.episodes[0].failed and "building the environment raised ValueError: no tools" in ep.episodes[0].failure


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_turns=0 must be >= 1"):
        TokenEpisodes(lambda: None, None, [], max_turns=0, timeout_s=1, stop_ids=[])
    with pytest.raises(ValueError, match="step_workers=-1 >= 0"):
        TokenEpisodes(lambda: None, None, [], max_turns=1, timeout_s=1, stop_ids=[], step_workers=-1)
