"""A real PPO run with rollout.backend=trtllm: Ray worker groups, TensorRT-LLM on the actor's GPU.

Two PPO steps (RLOO, rule reward, no critic or reference, so the actor is the only GPU role)
through ``python -m aligner.ppo``'s entry point: the actor group builds a TensorRT-LLM replica
beside the trainer, refits it every step over CUDA IPC, sleeps it during training and wakes it
for generation, and the step's metrics carry the same keys as with the torch engine.
Skipped unless CUDA, tensorrt_llm and ray are all importable. It has NOT run anywhere (no GPU
machine with tensorrt_llm was available); the log-prob bound (bf16 engine vs fp32 trainer)
is a guess until it does.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("tensorrt_llm") is None or importlib.util.find_spec("ray") is None,
        reason="needs CUDA, tensorrt_llm (pip install aligner[trtllm]) and ray",
    ),
]

ARGS = [
    "actor.init=",
    "reward.init=",
    "critic.init=",
    "reward.type=rule",
    "reward.rule=digit_fraction",
    "algorithm.advantage=rloo",
    "algorithm.kl_coef=0",
    "trainer.n_samples_per_prompt=4",
    "trainer.rollout_batch_size=4",
    "trainer.mini_batch_size=16",
    "trainer.micro_batch_size=8",
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "task.num_eval=8",
    "task.num_sft=200",
    "task.num_pairs=200",
    "rollout.backend=trtllm",
    "rollout.dtype=bfloat16",
    "actor.resources.gpus_per_node=1",
    "cluster.gpus_per_node=1",
]


def test_two_ppo_steps_with_the_trtllm_engine(tmp_path):
    from aligner.ppo import main as ppo_main

    assert ppo_main([*ARGS, f"output_dir={tmp_path}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in rows if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # the torch engine's metrics: refit bytes and seconds, weight_version, rollout/trainer mismatch
        assert m["refit_bytes"] > 0 and m["time/refit"] > 0 and m["time/generate"] > 0, m
        assert math.isfinite(m["log_probs_abs_diff_mean"]) and m["log_probs_abs_diff_mean"] < 0.1, m
        assert 0.0 <= m["ratio_out_of_range_frac"] <= 1.0 and math.isfinite(m["policy_loss"]), m
    assert steps[1]["weight_version"] > steps[0]["weight_version"] >= 1
