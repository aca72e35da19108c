"""The planner's decode model for a paged KV cache (rollout.backend=trtllm): a step reads the tokens its
rows hold, not every slot to its capacity as aligner's graphed decode does; checked against a step-by-step
simulation of a continuous slot pool (the decode model)."""

import dataclasses
import math
import random

import pytest

from aligner.cli import load_config
from aligner.planner import (
    Layout,
    decode_step_seconds,
    decode_steps,
    decode_weight_bytes,
    format_plan,
    generate_step_time,
    kv_cache_bytes,
    live_context_tokens,
    make_plan,
    paged_kv_bytes_per_step,
    role_flop_parameters,
    role_works,
)

TINY = ["rollout.dtype=bfloat16"]


def simulate_pool(prompt: int, lengths: list[int], slots: int) -> tuple[int, int]:
    """(decode steps, KV tokens read over them) of a continuous pool of `slots` rows that admits the
    responses in order as rows free up; at a step a row at position j of its response holds prompt + j
    tokens (positions 0 .. L - 1, as :func:`live_context_tokens` counts them)."""
    waiting, rows, steps, reads = list(lengths), [], 0, 0
    while waiting or rows:
        while waiting and len(rows) < slots:
            rows.append([waiting.pop(0), 0])  # [length, position]
        steps += 1
        reads += sum(prompt + pos for _, pos in rows)
        for r in rows:
            r[1] += 1
        rows = [r for r in rows if r[1] < r[0]]
    return steps, reads


def test_live_context_is_the_length_biased_mean_position_of_a_simulated_pool():
    """Every response as long as the longest: prompt + L / 2 (the simulation: prompt + (L - 1) / 2).
    Exponentially distributed lengths far below the cap: prompt + the mean, within 5% of the simulated
    average over 4,000 responses. In between the model takes the middle of the bounds mean / 2 and
    tail / 2, (mean + tail) / 4, at most the mean."""
    prompt = 100
    steps, reads = simulate_pool(prompt, [300] * 64, slots=16)
    assert reads / (64 * 300) == pytest.approx(prompt + 299 / 2)
    assert live_context_tokens(prompt, 300, 300) == prompt + 150
    rng = random.Random(0)
    lengths = [max(1, round(rng.expovariate(1 / 400))) for _ in range(4000)]
    mean = sum(lengths) / len(lengths)
    steps, reads = simulate_pool(prompt, lengths, slots=64)
    assert live_context_tokens(prompt, mean, 8 * mean) == pytest.approx(reads / sum(lengths), rel=0.05)
    assert live_context_tokens(prompt, 400, 600) == prompt + 250
    assert live_context_tokens(prompt, 400, 2000) == prompt + 400  # capped at the mean


def test_paged_kv_read_times_steps_is_the_simulated_total():
    """Per-step bytes x steps = the simulated pool's KV tokens x one token's bytes on one device, for
    equal lengths (exact up to the half token the model rounds) on tp 2 pp 2."""
    cfg = load_config("ppo", TINY)
    model = cfg.model
    lay = Layout(tp=2, pp=2, dp=1, micro_batch_size=8)
    prompt, L, requests = 24, 40, 32
    steps, reads = simulate_pool(prompt, [L] * requests, slots=8)
    assert steps == decode_steps("continuous", requests, 8, L, L)
    per_token = kv_cache_bytes(model, 2, 2, 2, 1, 1)
    got = paged_kv_bytes_per_step(model, lay, 2, requests, prompt, L, L, steps) * steps
    assert got == pytest.approx(per_token * (reads + requests * L / 2))


def test_trtllm_engine_decodes_with_the_paged_read_and_in_flight_batching():
    """rollout.backend=trtllm: the rollout work is continuous even under rollout.scheduler=static (the
    engine batches in flight), and its decode time is the steps times a step that reads the paged bytes;
    aligner's engine reads every slot to prompt + new_tokens, so it is slower on the same layout."""
    cfg = load_config("ppo", TINY + ["rollout.scheduler=static", "rollout.expected_response_len=3"])
    torch_work = next(w for w in role_works(cfg) if w.mode == "generate")
    cfg.rollout.backend = "trtllm"  # after loading: a plan needs no importable tensorrt_llm
    work = next(w for w in role_works(cfg) if w.mode == "generate")
    assert (torch_work.engine, torch_work.scheduler) == ("torch", "static")
    assert (work.engine, work.scheduler) == ("trtllm", "continuous")
    lay = Layout(tp=1, pp=1, dp=1, micro_batch_size=8)
    t = generate_step_time(cfg.model, work, lay, decode_weight_bytes(cfg.model, work.kind, lay, 2), cfg.cluster, 2)
    requests, mean, tail = work.batch, work.mean_response_len, work.tail_response_len
    steps = decode_steps("continuous", requests, 8, mean, tail)
    kv = paged_kv_bytes_per_step(cfg.model, lay, 2, requests, work.seq_len, mean, tail, steps)
    n = role_flop_parameters(cfg.model, "lm")
    assert t.decode_s == pytest.approx(
        steps * decode_step_seconds(cfg.model, lay, decode_weight_bytes(cfg.model, work.kind, lay, 2), kv, n, 2, cfg.cluster)
    )
    capacity = kv_cache_bytes(cfg.model, 2, 1, 1, 8, work.seq_len + work.new_tokens)
    assert kv < capacity
    continuous_torch = dataclasses.replace(work, engine="torch")
    slower = generate_step_time(cfg.model, continuous_torch, lay, decode_weight_bytes(cfg.model, work.kind, lay, 2), cfg.cluster, 2)
    assert slower.decode_s > t.decode_s
    assert math.isclose(slower.compute_s, t.compute_s)  # the prefill is the same


def test_the_plan_says_how_its_engine_reads_the_kv_cache():
    """The rollout role's heading in the plan names the engine, its scheduler, the KV read its time assumes and,
    for aligner's engine, whether its decode steps run in CUDA graphs."""
    cfg = load_config("ppo", TINY + ["rollout.scheduler=static"])
    text = format_plan(make_plan(cfg))
    assert "rollout engine: torch, static scheduler, a decode step reads every row to its full length, in a CUDA graph at pp = 1" in text
    cfg.rollout.cuda_graphs = False
    assert "a decode step reads every row to its full length, eagerly (no CUDA graph)" in format_plan(make_plan(cfg))
    cfg.rollout.backend = "trtllm"
    assert "rollout engine: trtllm, continuous scheduler, a decode step reads each row's own tokens (paged)" in format_plan(make_plan(cfg))
