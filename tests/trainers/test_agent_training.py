"""PPO through the OpenAI-compatible endpoint (docs/agents.md, "Training through the endpoint"): agent
programs with the real `openai` client play the episodes (``env.name=agent``), and the trainer trains on
exactly the tokens the engine sampled for them.

- the config section: a command that does not exist, bad values, env.name without a command, the
  preset ``tiny_agent``: one line naming the field, exit 2, before any worker starts;
- the batch left without dropped placeholders (group ids kept);
- end to end (Ray, the built-in task, a random policy, GRPO, 2 steps): a two-call agent
  (tests/toolkit/two_turn_agent.py) logs the prompt and completion token ids and log-probs the
  endpoint returned for every call; every trained row is one logged episode, token for token: the first
  call's prompt, then each completion (trained) and what the agent added between them (masked), with
  the engine's log-probs; the episodes of one crashing agent per batch share are dropped and counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from aligner.cli import load_config
from aligner.errors import ConfigError
from aligner.protocol import RolloutBatch
from aligner.rollout.base import Generation
from aligner.tracking import read_metrics
from aligner.trainers.agent_samples import AgentEpisodesError, without_dropped
from tests.toolkit.paths import REPO

AGENT = str(REPO / "tests" / "toolkit" / "two_turn_agent.py")


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["agent.command=no-such-agent --x"], "agent.command='no-such-agent --x' is invalid: the program 'no-such-agent' is not on PATH"),
        (["agent.command=python examples/nope.py"], "agent.command='python examples/nope.py' is invalid: the script"),
        (["agent.command="], "agent.command='' is invalid: env.name=agent runs the agent's program"),
        (["agent.parallel=0"], "agent.parallel=0 is invalid"),
        (["agent.deadline_s=0"], "agent.deadline_s=0.0 is invalid"),
        (["agent.max_dropped_frac=1"], "agent.max_dropped_frac=1.0 is invalid"),
        (["agent.reward=judge"], "agent.reward='judge' is invalid: valid choices are agent, rule"),
        (["env.name=tool", "env.tools=[calculator]"], "env.name='tool' is invalid: agent.command is set: set env.name=agent"),
        (["rollout.placement=split"], "rollout.placement='split' is invalid"),
        (["reward.type=model"], "reward.type='model' is invalid"),
    ],
)
def test_bad_agent_settings_are_one_line(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config("ppo", ["conf=tiny_agent", *overrides])
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_the_cli_refuses_a_missing_agent_with_exit_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "aligner.ppo", "conf=tiny_agent", "agent.command=no-such-agent", f"output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "ALIGNER_SUPERVISOR": "0"},
        timeout=600,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "aligner ppo: error: agent.command='no-such-agent' is invalid: the program 'no-such-agent' is not on PATH nor an executable file: "
        "give its path or install it"
    ]
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_the_tiny_agent_preset():
    cfg = load_config("ppo", ["conf=tiny_agent"])
    tools = load_config("ppo", ["conf=tiny_tools"])
    assert (cfg.env.name, cfg.agent.command, cfg.agent.teach_tools, cfg.agent.reward) == (
        "agent",
        "python examples/calculator_agent.py",
        False,
        "agent",
    )
    # the same task, model, policy and schedule as the in-process environment's demo
    for section in ("model", "task", "data", "algorithm", "rollout"):
        assert getattr(cfg, section) == getattr(tools, section), section
    assert (cfg.actor.init, cfg.trainer.max_steps, cfg.trainer.n_samples_per_prompt) == (tools.actor.init, 40, 4)
    assert load_config("sft", ["conf=tiny_agent"]).output_dir == load_config("sft", ["conf=tiny_tools"]).output_dir


def _batch(gens, n):
    b = len(gens)
    return RolloutBatch(
        input_ids=torch.arange(b)[:, None].repeat(1, 3),
        attention_mask=torch.ones(b, 3, dtype=torch.long),
        prompt_lens=torch.ones(b, dtype=torch.long),
        response_lens=torch.full((b,), 2),
        response_mask=torch.ones(b, 2),
        group_ids=torch.arange(b // n).repeat_interleave(n),
        meta=[{"i": i} for i in range(b)],
    )


def test_dropped_placeholders_leave_the_batch_with_their_group_ids_kept():
    ok = Generation([1, 2], [0.0, 0.0], "stop", 0)
    gone = Generation([0], [0.0], "stop", 0, own_mask=[False], extra={"dropped": "exited with code 3: boom"})
    gens = [ok, gone, ok, ok, gone, gone]
    out = without_dropped(_batch(gens, 2), gens)
    assert out.dropped == 3 and [m["i"] for m in out.meta] == [0, 2, 3]
    assert out.group_ids.tolist() == [0, 1, 1] and out.input_ids[:, 0].tolist() == [0, 2, 3]
    assert without_dropped(_batch([ok, ok], 2), [ok, ok]).dropped == 0
    # a group estimator: the prompt left with one sample (row 0) is left out too
    out = without_dropped(_batch(gens, 2), gens, grouped=True)
    assert out.dropped == 4 and [m["i"] for m in out.meta] == [2, 3] and out.group_ids.tolist() == [1, 1]
    with pytest.raises(
        AgentEpisodesError, match="no agent episode of the batch of 2 can be trained .*the first dropped: exited with code 3"
    ):
        without_dropped(_batch([gone, gone], 2), [gone, gone])
    err = Generation([0], [0.0], "stop", 0, own_mask=[False], extra={"dropped": "x", "agent_error": "3 of 4 agent episodes were dropped"})
    with pytest.raises(AgentEpisodesError, match="3 of 4 agent episodes were dropped"):
        without_dropped(_batch([ok, err], 2), [ok, err])


E2E = [
    "conf=tiny_agent",
    "actor.init=",
    "trainer.max_steps=2",
    "trainer.rollout_batch_size=4",
    "trainer.n_samples_per_prompt=2",
    "trainer.mini_batch_size=8",
    "trainer.micro_batch_size=8",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.progress=false",
    "task.num_eval=4",
    "task.num_rl=32",
    "task.num_sft=100",
    "task.num_pairs=10",
    "rollout.sampling.max_new_tokens=12",
    "agent.parallel=8",
    "agent.deadline_s=120",
    "agent.max_dropped_frac=0.25",
]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.usefixtures("ray_cluster")
def test_ppo_trains_on_the_tokens_the_engine_sampled_for_the_agents(tmp_path, monkeypatch):
    pytest.importorskip("openai", reason="the openai client is not installed (pip install openai; it is in aligner[test])")
    from aligner.ppo import main as ppo_main
    from aligner.trainers.ppo import PPOTrainer

    logs = tmp_path / "calls"
    logs.mkdir()
    trained: list[RolloutBatch] = []
    update = PPOTrainer.update

    def spy(self, batch):
        trained.append(batch)
        return update(self, batch)

    monkeypatch.setattr(PPOTrainer, "update", spy)
    out = tmp_path / "run"
    # a share is 8 episodes (one engine): the one of index 3 crashes after its first call (1/8 dropped)
    assert ppo_main([*E2E, f"agent.command={sys.executable} {AGENT} {logs} -3", f"output_dir={out}"]) == 0

    episodes = {}
    for f in logs.iterdir():
        calls = json.loads(f.read_text())
        assert len(calls) == 2
        first, second = calls
        context = first["prompt_token_ids"] + first["token_ids"]
        assert second["prompt_token_ids"][: len(context)] == context  # the second prompt continues the first call token for token
        added = second["prompt_token_ids"][len(context) :]
        assert added  # the agent's "Check again." turn and the template's tags
        ids = first["prompt_token_ids"] + first["token_ids"] + added + second["token_ids"]
        own = (
            [False] * len(first["prompt_token_ids"])
            + [True] * len(first["token_ids"])
            + [False] * len(added)
            + [True] * len(second["token_ids"])
        )
        lps = first["logprobs"] + second["logprobs"]
        episodes.setdefault(tuple(ids), []).append((own, lps, len(first["prompt_token_ids"])))
    assert len(trained) == 2
    rows = 0
    for batch in trained:
        # 8 episodes: the crashing one left out, and its prompt's other sample (GRPO needs two)
        assert len(batch) == 6 and batch.dropped == 2
        for b in range(len(batch)):
            p, r = int(batch.prompt_lens[b]), int(batch.response_lens[b])
            ids = tuple(batch.input_ids[b, : p + r].tolist())
            assert ids in episodes and episodes[ids], "a trained row is not a logged episode token for token"
            own, lps, plen = episodes[ids].pop()
            assert p == plen
            mask = batch.response_mask[b, :r].bool().tolist()
            assert mask == own[p:]  # the completions trained, the agent's additions masked
            got = batch.rollout_log_probs[b, :r][batch.response_mask[b, :r].bool()]
            torch.testing.assert_close(got, torch.tensor(lps), rtol=0, atol=1e-6)
            rows += 1
    assert rows == 12 and len(list(logs.iterdir())) >= 14  # every trained row an episode; the evaluation's too are logged
    steps = [m for m in read_metrics(out / "metrics.jsonl") if m["step"] > 0 and "env/dropped" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["env/dropped"] == 2.0 and m["env/turns"] == 2.0 and m["env/agent_calls"] == 2.0
        assert m["env/observation_tokens"] > 0 and m["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(m["policy_loss"]))
        # the trainer's forward over each trained row gives the engine's log-probs at its sampled tokens
        assert m["log_probs_abs_diff_max"] < 1e-3
