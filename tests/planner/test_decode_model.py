"""The planner's rollout (decode) time model: the per-layer step overhead and its fit to aligner's
measured decode, the expected response lengths per scheduler, KV-cache waves, and the refusal of
bad length settings."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from aligner.cli import load_config
from aligner.config import ClusterConfig, ModelConfig
from aligner.errors import ConfigError
from aligner.planner import (
    DECODE_OVERHEAD_EAGER_S_PER_LAYER,
    DECODE_OVERHEAD_S_PER_LAYER,
    GIB,
    Layout,
    LayoutEstimate,
    Rejected,
    decode_graphed,
    decode_steps,
    decode_weight_bytes,
    estimate_layout,
    evaluate_layout,
    generate_step_time,
    kv_cache_bytes,
    make_plan,
    plan_role,
    pp_stage_num_parameters,
    role_works,
)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
# a cluster on which every roofline term vanishes: what remains of a decode step is its fixed overhead
NO_ROOFLINE = ClusterConfig(gpus_per_node=1, gpu_peak_tflops=1e12, hbm_gbps=1e15)
TINY = ["rollout.dtype=bfloat16"]


def rollout_work(overrides):
    """The rollout engine's RoleWork of the tiny preset (prompt 16, 8 new tokens, 64 rollouts)."""
    cfg = load_config("ppo", TINY + list(overrides))
    return cfg, next(w for w in role_works(cfg) if w.mode == "generate")


def decode_seconds(cfg, work, layout, cluster=None):
    cluster = cluster or cfg.cluster
    return generate_step_time(cfg.model, work, layout, decode_weight_bytes(cfg.model, work.kind, layout, 2), cluster).decode_s


def test_fitted_overhead_is_the_fit_of_both_gpus_measurements():
    """The constant is what benchmarks/planner_validation.py fits to the H200 and H100 rows; each GPU
    alone gives the same constant within 2%, and the model is within 10% of every measured row."""
    sys.path.insert(0, str(BENCH))
    try:
        import planner_validation as v
    finally:
        sys.path.remove(str(BENCH))
    c, rows = v.fit_overhead()
    assert c == pytest.approx(DECODE_OVERHEAD_S_PER_LAYER, abs=0.5e-6)
    h200, h100 = (v.fit_one(g) for g in v.MEASURED)
    assert abs(h200 - h100) / c < 0.02
    assert len(rows) == 8
    for gpu, b, measured, predicted in rows:
        assert abs(predicted / measured - 1) < 0.10, (gpu, b, measured, predicted)


def test_eager_overhead_is_the_fit_of_the_eager_measurements_and_applies_where_the_engine_has_no_graphs():
    """DECODE_OVERHEAD_EAGER_S_PER_LAYER is the fit to the H200's eager continuous decode (within 8% of each
    row). The engine decodes without CUDA graphs with pipeline stages, with rollout.cuda_graphs=false, and
    (continuous scheduler) with MoE layers or several slot-pool micro-batches: there a step's fixed cost is the
    eager one, elsewhere the graphed one (on a cluster where the roofline vanishes, decode = steps x layers x it)."""
    sys.path.insert(0, str(BENCH))
    try:
        import planner_validation as v
    finally:
        sys.path.remove(str(BENCH))
    c, rows = v.fit_overhead(v.MEASURED_EAGER)
    assert c == pytest.approx(DECODE_OVERHEAD_EAGER_S_PER_LAYER, abs=0.5e-6)
    assert c > 4 * DECODE_OVERHEAD_S_PER_LAYER
    for gpu, b, measured, predicted in rows:
        assert abs(predicted / measured - 1) < 0.08, (gpu, b, measured, predicted)
    one = Layout(tp=1, pp=1, dp=1, micro_batch_size=8)
    cases = [  # (overrides, layout, graphed)
        (["rollout.scheduler=continuous"], one, True),
        (["rollout.scheduler=static"], one, True),
        (["rollout.scheduler=continuous", "rollout.cuda_graphs=false"], one, False),
        (["rollout.scheduler=static", "rollout.cuda_graphs=false"], one, False),
        (["rollout.scheduler=continuous"], Layout(tp=1, pp=2, dp=1, micro_batch_size=8), False),
        (["rollout.scheduler=static"], Layout(tp=1, pp=2, dp=1, micro_batch_size=8), False),
        (["rollout.scheduler=continuous", "rollout.micro_batches=2"], one, False),
    ]
    for overrides, layout, graphed in cases:
        cfg, work = rollout_work(overrides + ["rollout.max_batch_size=8", "rollout.expected_response_len=8"])
        assert decode_graphed(cfg.model, work, layout) is graphed, overrides
        steps = decode_steps(work.scheduler, work.batch, 8, 8, 8)
        per_layer = DECODE_OVERHEAD_S_PER_LAYER if graphed else DECODE_OVERHEAD_EAGER_S_PER_LAYER
        got = decode_seconds(cfg, work, layout, NO_ROOFLINE)
        assert got == pytest.approx(steps * cfg.model.num_layers * per_layer, rel=1e-3), overrides
    moe = dataclasses.replace(cfg.model, num_experts=4, num_experts_per_tok=2)
    assert not decode_graphed(moe, work, one) and decode_graphed(moe, dataclasses.replace(work, scheduler="static"), one)


def test_twice_the_layers_twice_the_overhead():
    """With the roofline gone, a decode step costs layers x the overhead: 2L layers cost twice L's."""
    cfg, work = rollout_work(["rollout.scheduler=static", "rollout.max_batch_size=64"])
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=64)
    one = decode_seconds(cfg, work, layout, NO_ROOFLINE)
    deep = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=2 * cfg.model.num_layers))
    two = decode_seconds(deep, work, layout, NO_ROOFLINE)
    steps = work.new_tokens  # one static batch of 64 rows, every response max_new_tokens long
    assert one == pytest.approx(steps * cfg.model.num_layers * DECODE_OVERHEAD_S_PER_LAYER, rel=1e-6)
    assert two == pytest.approx(2 * one, rel=1e-6)


@pytest.mark.parametrize(
    "scheduler,lengths,steps",
    [
        # 64 requests on 8 rows, max_new_tokens 8. static: 8 batches x the longest response
        ("static", [], 8 * 8),
        ("static", ["rollout.expected_response_len=2"], 8 * 8),  # the mean does not shorten a static batch
        ("static", ["rollout.expected_response_len=2", "rollout.expected_response_len_max=4"], 8 * 4),
        # continuous: (64 - 8) requests refill at the mean, then the pool drains for the longest
        ("continuous", [], 56 * 8 / 8 + 8),
        ("continuous", ["rollout.expected_response_len=2"], 56 * 2 / 8 + 8),
        ("continuous", ["rollout.expected_response_len=2", "rollout.expected_response_len_max=4"], 56 * 2 / 8 + 4),
    ],
)
def test_mean_governs_continuous_longest_governs_static(scheduler, lengths, steps):
    """Decode time = steps x one step's seconds; the steps follow the scheduler as documented."""
    cfg, work = rollout_work([f"rollout.scheduler={scheduler}", "rollout.max_batch_size=8"] + lengths)
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=8)
    _, base = rollout_work([f"rollout.scheduler={scheduler}", "rollout.max_batch_size=8"])
    one_step = decode_seconds(cfg, base, layout) / 64  # the default: 64 steps for either scheduler
    assert decode_seconds(cfg, work, layout) == pytest.approx(steps * one_step, rel=1e-9)


def test_mean_and_longest_read_from_a_previous_runs_metrics(tmp_path):
    rows = [{"step": 0, "eval_accuracy": 0.1}, {"step": 1, "response_len": 3.0}, {"step": 2, "response_len": 5.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, work = rollout_work([f"rollout.expected_response_len_from={path}"])
    assert (work.mean_response_len, work.tail_response_len) == (4.0, 8)  # no response_len_max: the cap
    rows[1]["response_len_max"], rows[2]["response_len_max"] = 6.0, 7.0  # each step's longest (PPO writes it)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, work = rollout_work([f"rollout.expected_response_len_from={path}"])
    assert (work.mean_response_len, work.tail_response_len) == (4.0, 6.5)
    _, work = rollout_work([f"rollout.expected_response_len_from={path}", "rollout.expected_response_len_max=5"])
    assert work.tail_response_len == 5  # the field, when given, stays the longest
    path.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    cfg = load_config("ppo", TINY + [f"rollout.expected_response_len_from={path}"])
    with pytest.raises(ConfigError, match=r"^rollout.expected_response_len_from=.*no row has a response_len"):
        make_plan(cfg)


def test_waves_when_the_kv_cache_does_not_fit():
    """A rollout whose 64 rows per replica do not fit decodes in waves of the rows that do: the best
    layout's rows fit (twice as many do not), and its decode takes ceil(64 / rows) static batches."""
    cfg, work = rollout_work(["rollout.scheduler=static", "rollout.max_batch_size=64"])
    model = ModelConfig(**{**dataclasses.asdict(cfg.model), "num_layers": 4, "max_seq_len": 4096})
    work = dataclasses.replace(work, seq_len=1024, new_tokens=1024, tail_response_len=0, mean_response_len=0)
    size = {b: estimate_layout(model, work, Layout(1, 1, 1, b), cfg.cluster).memory.total for b in (4, 8, 64)}
    cluster = dataclasses.replace(cfg.cluster, gpu_mem_gb=(size[4] + size[8]) / 2 / GIB)  # 4 rows fit, 8 do not
    assert isinstance(evaluate_layout(model, work, Layout(1, 1, 1, 64), cluster), Rejected)
    best = plan_role(model, work, 1, cluster).best
    assert isinstance(best, LayoutEstimate) and best.layout.micro_batch_size == 4
    assert best.memory.kv_cache == kv_cache_bytes(model, 2, 1, 1, 4, 1024 + 1024)  # sized for its 4 rows, bf16
    assert isinstance(evaluate_layout(model, work, Layout(1, 1, 1, 8), cluster), Rejected)
    one_wave = dataclasses.replace(work, batch=4)
    assert best.time.decode_s == pytest.approx(math.ceil(64 / 4) * decode_seconds_at(model, one_wave, best, cluster), rel=1e-9)


def decode_seconds_at(model, work, est, cluster):
    return generate_step_time(model, work, est.layout, decode_weight_bytes(model, work.kind, est.layout, 2), cluster).decode_s


@pytest.mark.parametrize(
    "overrides,field,fix",
    [
        (["rollout.expected_response_len=-3"], "rollout.expected_response_len=-3.0", "0 for max_new_tokens"),
        (["rollout.expected_response_len=9"], "rollout.expected_response_len=9.0", "rollout.sampling.max_new_tokens=8"),
        (["rollout.expected_response_len_max=0.5"], "rollout.expected_response_len_max=0.5", "[1, rollout.sampling.max_new_tokens=8]"),
        (
            ["rollout.expected_response_len=6", "rollout.expected_response_len_max=4"],
            "rollout.expected_response_len=6.0",
            "cannot exceed rollout.expected_response_len_max=4.0",
        ),
        (
            ["rollout.expected_response_len_from=/nonexistent/metrics.jsonl"],
            "rollout.expected_response_len_from='/nonexistent",
            "no such file",
        ),
    ],
)
def test_bad_length_settings_refused_in_one_line(overrides, field, fix):
    with pytest.raises(ConfigError) as e:
        load_config("ppo", overrides)
    msg = str(e.value)
    assert msg.startswith(field) and fix in msg and "\n" not in msg


def test_mean_given_twice_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"response_len": 3.0}) + "\n")
    with pytest.raises(ConfigError, match=r"^rollout.expected_response_len_from=.*give the mean once"):
        load_config("ppo", [f"rollout.expected_response_len_from={path}", "rollout.expected_response_len=2"])


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_reads_no_lookup_table(tied):
    """The weight bytes of a decode step: the busiest stage's weights, less an input embedding that is only a
    lookup (untied; or tied with pipeline stages, where the last stage holds its own head copy). Tied on one
    stage, the matrix is the LM head and is read."""
    model = ModelConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, tie_word_embeddings=tied
    )
    table = 1000 * 64 // 2
    one = Layout(tp=2, pp=1, dp=1, micro_batch_size=1)
    whole = pp_stage_num_parameters(model, "lm", 2, 1, 0) * 2
    assert decode_weight_bytes(model, "lm", one, 2) == (whole if tied else whole - 2 * table)
    two = Layout(tp=2, pp=2, dp=1, micro_batch_size=1)
    first = (pp_stage_num_parameters(model, "lm", 2, 2, 0) - table) * 2
    last = pp_stage_num_parameters(model, "lm", 2, 2, 1) * 2
    assert decode_weight_bytes(model, "lm", two, 2) == max(first, last) == last  # the head's stage is the busiest
    score = pp_stage_num_parameters(model, "score", 2, 1, 0) * 2
    assert decode_weight_bytes(model, "score", one, 2) == score - 2 * table  # a score model's embedding: a lookup
