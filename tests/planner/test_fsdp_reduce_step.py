"""The planner's model of ``parallel.fsdp_reduce=step`` (FSDP2 communicating once per optimizer step): one
all-gather and one reduce-scatter per parameter per step whatever the number of micro-batches, every layer's
unsharded parameters and gradients held through the step, and the search offering both modes (the plan's
overrides set the field) where FSDP2 runs more than one micro-batch."""

import pytest

from aligner.config import ClusterConfig, ModelConfig, ParallelConfig
from aligner.planner import Layout, RoleWork, estimate_layout, evaluate_layout, fsdp_step_buffer_bytes, train_state_bytes
from aligner.planner.cost_model import layer_num_parameters
from aligner.planner.search import candidate_layouts, plan_role
from aligner.planner.time_model import fsdp2_step_exposed_seconds

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32)
MODEL = ModelConfig(**LLAMA2_7B, max_seq_len=4096, dtype="bfloat16")
# a GPU so fast that no collective hides behind compute: the exposed time is the whole traffic (50 GB/s between nodes)
NO_OVERLAP_CLUSTER = ClusterConfig(num_nodes=2, gpus_per_node=8, gpu_mem_gb=80, gpu_peak_tflops=1e9)


def work(backend: str = "fsdp2", batch: int = 64) -> RoleWork:
    pc = ParallelConfig(mixed_precision="bf16", dp_backend=backend)
    return RoleWork(role="actor", kind="lm", mode="train", parallel=pc, batch=batch, batch_field="b", seq_len=2048)


def estimate(mbs: int, mode: str, model: ModelConfig = MODEL):
    return estimate_layout(model, work(), Layout(tp=1, pp=1, dp=16, micro_batch_size=mbs, fsdp_reduce=mode), NO_OVERLAP_CLUSTER)


def test_step_mode_moves_each_parameter_once_per_step():
    """Unhidden, a step moves every parameter's bf16 copy once (all-gather) and its fp32 gradient once
    (reduce-scatter): (n - 1) / n of (2 + 4) bytes per parameter over 50 GB/s, for any number of micro-batches;
    the per-micro-batch mode pays (2 + 2 + 4) bytes per parameter for each of the 4 micro-batches."""
    exposed = fsdp2_step_exposed_seconds(MODEL, work(), Layout(tp=1, pp=1, dp=16, micro_batch_size=1), 0.0, 0.0, NO_OVERLAP_CLUSTER)
    n = MODEL.num_parameters()
    assert exposed == pytest.approx(15 / 16 * 6 * n / 50e9)
    step1, step4 = estimate(1, "step").time.dp_comm_s, estimate(4, "step").time.dp_comm_s
    assert step1 == pytest.approx(step4) == pytest.approx(exposed)  # 64 rows / 16 ranks: 4 micro-batches of 1, or 1 of 4
    assert estimate(1, "micro_batch").time.dp_comm_s == pytest.approx(4 * 15 / 16 * 8 * n / 50e9)


def test_step_mode_hides_behind_the_first_forward_and_the_last_backward():
    """With compute to spare only one layer's gather, one layer's reduce-scatter and the root's two collectives
    stay exposed."""
    layout = Layout(tp=1, pp=1, dp=16, micro_batch_size=1)
    exposed = fsdp2_step_exposed_seconds(MODEL, work(), layout, 100.0, 100.0, NO_OVERLAP_CLUSTER)
    layer = layer_num_parameters(MODEL)
    root = MODEL.num_parameters() - layer * MODEL.num_layers
    assert exposed == pytest.approx(15 / 16 * (2 * layer + 4 * layer + 6 * root) / 50e9)


def test_step_mode_memory_holds_every_layer_unsharded():
    """1,000 parameters on a device, 100 in a layer, dp = 4, bf16 mixed precision, fp32 Adam:
    weights = fp32 master sharded 4 * 1000 / 4 + every parameter gathered in bf16 2 * 1000 = 3,000 B;
    grads = fp32 sharded 4 * 1000 / 4 + the fp32 unsharded accumulation 4 * 1000 + one layer's bf16 gradient
    and fp32 reduce-scatter input (2 + 4) * 100 = 5,600 B; optimizer = 8 * 1000 / 4 + 4 * 10 tensors = 2,040 B.
    Per micro-batch instead: two layers gathered (2 * 100 * 2) and one layer's buffers ((2 + 4) * 100)."""
    pc = ParallelConfig(mixed_precision="bf16")
    model = ModelConfig(**LLAMA2_7B, dtype="float32")
    assert fsdp_step_buffer_bytes(100, 1000, pc, model) == (2000.0, 4600.0)
    assert train_state_bytes(1000, 10, 100, pc, model, 4, fsdp_step=True) == (3000.0, 5600.0, 2040.0)
    assert train_state_bytes(1000, 10, 100, pc, model, 4) == (1000.0 + 400.0, 1000.0 + 600.0, 2040.0)
    fp32 = ParallelConfig(mixed_precision="fp32")  # fp32: gathered and accumulated in 4 B
    assert train_state_bytes(1000, 10, 100, fp32, model, 4, fsdp_step=True) == (1000.0 + 4000.0, 1000.0 + 4000.0 + 800.0, 2040.0)


def test_step_mode_estimate_adds_the_unsharded_model():
    """On the 7B at dp=16: the step mode's weights hold the whole stage in bf16 and its grads the whole stage in
    fp32 (less the per-layer buffers the per-micro-batch mode counts)."""
    n = MODEL.num_parameters()
    layer = layer_num_parameters(MODEL)
    mb, st = estimate(1, "micro_batch").memory, estimate(1, "step").memory
    assert st.weights - mb.weights == pytest.approx(2 * n - 2 * 2 * layer)
    assert st.grads - mb.grads == pytest.approx(4 * n)
    assert st.optimizer == mb.optimizer and st.activations == mb.activations


def test_search_offers_step_where_fsdp2_runs_several_micro_batches():
    layouts = list(candidate_layouts(MODEL, work(), 16))
    step = [lay for lay in layouts if lay.fsdp_reduce == "step"]
    assert step and all(lay.dp > 1 and 64 // (lay.dp * lay.micro_batch_size) > 1 for lay in step)
    assert any(lay.dp > 1 and 64 // (lay.dp * lay.micro_batch_size) > 1 and lay.fsdp_reduce == "micro_batch" for lay in layouts)
    assert not any(lay.fsdp_reduce == "step" for lay in candidate_layouts(MODEL, work("ddp"), 16))
    assert not any(lay.fsdp_reduce == "step" for lay in candidate_layouts(MODEL, work(), 16, minimal=True))
    refused = evaluate_layout(MODEL, work("ddp"), Layout(tp=1, pp=1, dp=16, micro_batch_size=1, fsdp_reduce="step"), NO_OVERLAP_CLUSTER)
    assert "fsdp_reduce=step needs a training role with dp_backend fsdp2" in refused.reason


def test_plan_overrides_set_fsdp_reduce_when_chosen():
    """A step-mode layout is faster than its per-micro-batch twin (same memory otherwise), and a plan whose
    best layout is one carries ``parallel.fsdp_reduce=step`` in its overrides, so the plan runs as estimated."""
    from aligner.planner.report import recommended_overrides
    from aligner.planner.search import Plan, RolePlan

    cluster = ClusterConfig(num_nodes=2, gpus_per_node=8, gpu_mem_gb=141)
    lay = Layout(tp=1, pp=1, dp=16, micro_batch_size=1)
    mb = estimate_layout(MODEL, work(), lay, cluster)
    st = estimate_layout(MODEL, work(), Layout(tp=1, pp=1, dp=16, micro_batch_size=1, fsdp_reduce="step"), cluster)
    assert st.time.total_s < mb.time.total_s and st.memory.total > mb.memory.total
    ranked = [e for e in plan_role(MODEL, work(), 16, cluster).ranked if e.layout.fsdp_reduce == "step"]
    assert ranked, "the search ranks step-mode layouts"
    assert "fsdp_reduce=step" in st.layout.describe()
    plan = Plan(stage="sft", cluster=cluster, placement="colocated", roles={}, node_split=None, step_time_s=0.0)
    plan.roles["actor"] = RolePlan(role="actor", work=work(), devices=16, ranked=[st])
    assert any("actor.parallel.fsdp_reduce=step" in line for line in recommended_overrides(plan))
    plan.roles["actor"] = RolePlan(role="actor", work=work(), devices=16, ranked=[mb])
    assert not any("fsdp_reduce" in line for line in recommended_overrides(plan))


def test_configured_layout_reads_fsdp_reduce():
    """check_fits estimates a config as it runs: the llama2_7b preset's trained roles reduce once per step."""
    from aligner.cli import load_config
    from aligner.planner import configured_layout
    from aligner.planner.search import role_works

    cfg = load_config("ppo", ["conf=llama2_7b"])
    by_role = {w.role: configured_layout(cfg, w) for w in role_works(cfg)}
    assert by_role["actor"].fsdp_reduce == "step" and by_role["critic"].fsdp_reduce == "step"
    assert by_role["ref"].fsdp_reduce == "micro_batch"  # a forward-only role has no gradients to reduce


def test_step_mode_forward_only_passes_gather_once():
    """An actor's forward-only pass (old log-probs over 64 rows: 4 micro-batches a rank) adds its gathers once
    under fsdp_reduce=step (TrainRuntime.forward_only holds the units through the pass), 4 times per
    micro-batch: unhidden, 15/16 of 2 bytes per parameter once, against 4 times."""
    import dataclasses

    n = MODEL.num_parameters()
    with_fwd = dataclasses.replace(work(), forward_seqs=64)
    layout = Layout(tp=1, pp=1, dp=16, micro_batch_size=1)

    def extra(mode: str) -> float:
        lay = dataclasses.replace(layout, fsdp_reduce=mode)
        plain = estimate_layout(MODEL, work(), lay, NO_OVERLAP_CLUSTER).time.dp_comm_s
        return estimate_layout(MODEL, with_fwd, lay, NO_OVERLAP_CLUSTER).time.dp_comm_s - plain

    assert extra("step") == pytest.approx(15 / 16 * 2 * n / 50e9)
    assert extra("micro_batch") == pytest.approx(4 * 15 / 16 * 2 * n / 50e9)
