"""How long the planner times PPO's training and forward rows: the runtime pads a
rollout batch's rows to its width (prompt + the longest response) in row-count micro-batches, and cuts
each token-budget micro-batch to its longest row (``trainer.micro_batch_tokens``, rows sorted by
length: aligner.runtime.runner), so the step time follows prompt + the longest response, or prompt + the
mean response under a budget; the memory stays at data.max_seq_len. Before, every training and forward
row was timed at data.max_seq_len whatever the expected response lengths were."""

import math
from dataclasses import replace

import pytest

from aligner.cli import load_config
from aligner.config import ClusterConfig
from aligner.planner import Layout, estimate_layout, layout_problem, role_works, train_flops_per_token
from aligner.planner.cost_model import micro_batch_shape, role_flop_parameters
from aligner.planner.time_model import forward_flops_per_token

PROMPT, SEQ, MEAN, TAIL = 16, 64, 6.0, 40.0
CLUSTER = ClusterConfig(gpus_per_node=1)


def works(*extra: str) -> dict:
    cfg = load_config(
        "ppo",
        [
            "conf=tiny",
            "model.max_seq_len=64",
            f"data.max_prompt_len={PROMPT}",
            f"data.max_seq_len={SEQ}",
            "rollout.sampling.max_new_tokens=48",
            f"rollout.expected_response_len={MEAN}",
            *extra,
        ],
    )
    return cfg, {w.role: w for w in role_works(cfg)}


def test_rows_are_timed_at_the_batch_width_or_the_mean_under_a_token_budget():
    _, padded = works(f"rollout.expected_response_len_max={TAIL}")
    _, budget = works(f"rollout.expected_response_len_max={TAIL}", "trainer.micro_batch_tokens=128")
    for role in ("actor", "critic", "reward"):
        assert padded[role].seq_len == budget[role].seq_len == SEQ  # the memory's row
        assert padded[role].row_len == PROMPT + TAIL and padded[role].micro_batch_tokens == 0
        assert budget[role].row_len == PROMPT + MEAN and budget[role].micro_batch_tokens == 128
    assert padded["rollout"].row_len == 0  # the engine's time follows the decode model


def test_training_time_follows_the_row_length_and_memory_does_not():
    """Compute seconds scale as FLOPs per token x tokens at the row length (training passes and the
    forward-only ones alike); the memory of the same layout is the one at data.max_seq_len (a batch
    may hold a row that long)."""
    cfg, w = works(f"rollout.expected_response_len_max={TAIL}")
    n = role_flop_parameters(cfg.model, "lm")
    for work, per_token in (
        (replace(w["actor"], forward_seqs=0), lambda s: train_flops_per_token(n, cfg.model, s, "none")),
        (w["ref"], lambda s: forward_flops_per_token(n, cfg.model, s)),
    ):
        at_max = estimate_layout(cfg.model, replace(work, row_len=0.0), Layout(1, 1, 1, 4), CLUSTER)
        at_tail = estimate_layout(cfg.model, work, Layout(1, 1, 1, 4), CLUSTER)
        ratio = per_token(PROMPT + TAIL) * (PROMPT + TAIL) / (per_token(SEQ) * SEQ)
        assert at_tail.time.compute_s == pytest.approx(ratio * at_max.time.compute_s, rel=1e-9), work.role
        assert at_tail.memory.total == at_max.memory.total


def test_a_token_budget_packs_the_rows_into_fewer_micro_batches():
    cfg, w = works(f"rollout.expected_response_len_max={TAIL}", "trainer.micro_batch_tokens=128")
    actor = w["actor"]
    m, rows, seq = micro_batch_shape(actor, Layout(1, 1, 2, 1), actor.batch)
    assert seq == PROMPT + MEAN
    assert m == math.ceil(actor.batch * (PROMPT + MEAN) / (2 * 128))
    assert rows == pytest.approx(128 / (PROMPT + MEAN))
    budget = estimate_layout(cfg.model, actor, Layout(1, 1, 1, 2), CLUSTER)
    _, w2 = works(f"rollout.expected_response_len_max={TAIL}")
    padded = estimate_layout(cfg.model, w2["actor"], Layout(1, 1, 1, 2), CLUSTER)
    assert budget.time.compute_s < 0.6 * padded.time.compute_s  # (16 + 6) / (16 + 40) of the tokens


def test_a_token_budget_runs_with_pipeline_stages_but_not_deepspeed():
    """Issue 40 (planner II): the runtime runs token-budget micro-batches through 1F1B and interleaved 1F1B,
    so the planner times them (the bubble over tokens / budget micro-batches) instead of refusing pp > 1;
    DeepSpeed (one backward per step) is still refused."""
    cfg, w = works("trainer.micro_batch_tokens=128")
    actor = w["actor"]
    assert layout_problem(cfg.model, actor, Layout(1, 2, 1, 1), CLUSTER) is None
    assert layout_problem(cfg.model, actor, Layout(1, 1, 2, 3), CLUSTER) is None  # no row-count divisibility
    est = estimate_layout(cfg.model, actor, Layout(1, 2, 1, 1), CLUSTER)
    m, _, _ = micro_batch_shape(actor, Layout(1, 2, 1, 1), actor.batch)
    assert m == math.ceil(actor.batch * (PROMPT + MEAN) / 128) and est.time.bubble_s > 0
    ds = replace(actor, parallel=replace(actor.parallel, dp_backend="deepspeed"))
    problem = layout_problem(cfg.model, ds, Layout(1, 1, 1, 1), CLUSTER)
    assert problem and "micro_batch_tokens" in problem and "dp_backend fsdp2 or ddp" in problem
