"""PPO end to end on CPU (Ray worker groups, gloo): layouts, critic-free estimators, resume, learning.

The runs start from a random policy with the dense rule reward ``digit_fraction`` so they need
no SFT/RM checkpoints; the built-in task supplies the prompts.
"""

from __future__ import annotations

import json
import math

import pytest

from aligner.ppo import main as ppo_main
from tests.toolkit.overrides import PPO_RULE

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.e2e, pytest.mark.usefixtures("ray_cluster")]

BASE = PPO_RULE + [
    "trainer.rollout_batch_size=16",
    "trainer.mini_batch_size=16",
    "trainer.micro_batch_size=8",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "task.num_eval=32",
    "task.num_sft=200",
    "task.num_pairs=200",
]
TIMING = (
    "time/",
    "ranks/",
    "weight_version",
)  # wall times (per phase, per rank), and the engine's refit counter (restarts with the process)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run(out, *extra) -> list[dict]:
    assert ppo_main([*BASE, f"output_dir={out}", *extra]) == 0
    return metrics(out)


def comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(TIMING)}


def test_split_placement_tp2_actor_two_steps_and_resume(tmp_path):
    """tp=2 actor (engine tp=2) on its own node group: exact rollout log-probs, export, and resume == uninterrupted."""
    layout = ["actor.parallel.tp_size=2", "rollout.parallel.tp_size=2", "trainer.max_steps=2", "trainer.save_every=1"]
    full = run(tmp_path / "full", *layout)
    steps = [m for m in full if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # the engine (tp=2) and the trainer (tp=2) see the same weights: log-probs agree
        assert m["log_probs_abs_diff_max"] < 1e-4, m
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
        assert m["value_loss"] >= 0 and "critic/grad_norm" in m
    assert steps[1]["weight_version"] > steps[0]["weight_version"]
    hf = tmp_path / "full" / "hf"
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf)
    assert model.config.num_hidden_layers == 4
    assert (tmp_path / "full" / "ppo_report.png").stat().st_size > 1000
    # resume: one step, then continue to two; step 2 equals the uninterrupted run's step 2
    run(tmp_path / "resumed", *[a.replace("max_steps=2", "max_steps=1") for a in layout])
    resumed = run(tmp_path / "resumed", *layout, "resume=true")
    assert [m["step"] for m in resumed if m["step"] > 0] == [1, 2]
    assert comparable(resumed[-1]) == comparable(full[-1])


@pytest.mark.parametrize(
    "advantage,kl",
    [
        # KL as a loss term (DeepSeekMath); on-policy, so the old-log-prob forward is skipped (TRL's default)
        ("grpo", ["algorithm.kl_coef=0", "algorithm.kl_loss_coef=0.05", "algorithm.recompute_old_log_probs=false"]),
        # KL in the reward (TRL RLOO, OpenRLHF); with DAPO's dynamic sampling (the batch is scored before inference)
        ("rloo", ["algorithm.kl_coef=0.2", "algorithm.dynamic_sampling=true"]),
        # the same one batch ahead: the queued batch is the first round, refills come from newer weights
        ("rloo", ["algorithm.kl_coef=0.2", "algorithm.dynamic_sampling=true", "rollout.placement=split", "trainer.max_staleness=1"]),
    ],
)
def test_critic_free_estimators_two_steps(tmp_path, advantage, kl):
    ms = run(
        tmp_path,
        f"algorithm.advantage={advantage}",
        "trainer.n_samples_per_prompt=4",
        "trainer.rollout_batch_size=4",
        "trainer.max_steps=2",
        *kl,
    )
    steps = [m for m in ms if m["step"] > 0]
    assert len(steps) == 2
    assert all("value_loss" not in m for m in steps)  # no critic group
    assert all(math.isfinite(m["policy_loss"]) and abs(m["advantages_mean"]) < 1.0 for m in steps)
    if advantage == "grpo":  # the reference runs and its KL reaches the actor's loss, not the reward
        assert all(m["kl_coef"] == 0.0 and math.isfinite(m["kl_loss"]) for m in steps)
        assert steps[1]["kl_loss"] > 0  # the policy moved after the first update
        # no old-log-prob forward: nothing to compare the engine with, and the ratio is exactly 1
        assert all("log_probs_abs_diff_max" not in m and m["clipfrac"] == 0.0 for m in steps)
    else:
        assert all(m["kl_coef"] == pytest.approx(0.2) and "kl_loss" not in m for m in steps)
        # every step kept 4 groups whose 4 scores differ, after one round or more
        assert all(m["dynamic_sampling/kept_groups"] == 4 and m["dynamic_sampling/rounds"] >= 1 for m in steps)
        assert all(m["dynamic_sampling/rounds"] > 1 or m["dynamic_sampling/dropped_groups"] == 0 for m in steps)
        if "rollout.placement=split" in kl:  # tokens at most one step stale; refill rounds are fresher
            assert steps[0]["staleness_max"] == 0.0 and all(0.0 <= m["staleness"] <= m["staleness_max"] <= 1.0 for m in steps)


def test_reward_rises(tmp_path):
    """A seeded run: the dense digit_fraction reward rises by at least 0.15 within 15 steps."""
    ms = run(
        tmp_path,
        "trainer.max_steps=15",
        "actor.optim.lr=3e-3",
        "critic.optim.lr=3e-3",
        "trainer.rollout_batch_size=32",
        "trainer.mini_batch_size=16",
        "algorithm.kl_coef=0.0",
        "algorithm.entropy_coef=0.0",
    )
    scores = [m["score_mean"] for m in ms if "score_mean" in m]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last - first >= 0.15, scores


def test_context_parallel_actor_and_critic_through_ray(tmp_path):
    """Actor and critic at cp=2 through the worker groups (each sequence split over two ranks; the
    actor's colocated engines, one per rank, refit from the cp layout): two steps train, and the
    trainer's cp log-probs equal the engine's, which never splits a sequence (the role-level equality
    with cp=1 is tests/runtime/test_context_parallel_runtime.py's)."""
    ms = [m for m in run(tmp_path, "trainer.max_steps=2", "actor.parallel.cp_size=2", "critic.parallel.cp_size=2") if m["step"] > 0]
    assert [m["step"] for m in ms] == [1, 2]
    for m in ms:
        assert m["log_probs_abs_diff_max"] < 1e-4, m
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
        assert m["value_loss"] > 0 and m["actor/grad_norm"] > 0 and m["critic/grad_norm"] > 0
    assert ms[1]["weight_version"] > ms[0]["weight_version"]
