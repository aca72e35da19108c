"""FSDP2's data-parallel traffic as aligner's runtime runs it: every layer all-gathered in
forward and again in backward and its gradient reduce-scattered, for every micro-batch (``fully_shard`` per
decoder layer, ``reshard_after_forward=True``, no ``set_requires_gradient_sync``), where DDP all-reduces once per
optimizer step (``no_sync`` before the last micro-batch)."""

import pytest

from aligner.config import ClusterConfig, ModelConfig, ParallelConfig
from aligner.planner import Layout, RoleWork, estimate_layout
from aligner.planner.cost_model import layer_num_parameters, layers_on_pp_stage
from aligner.planner.time_model import fsdp2_micro_batch_exposed_seconds

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32)
MODEL = ModelConfig(**LLAMA2_7B, max_seq_len=4096, dtype="bfloat16")
# a GPU so fast that no collective hides behind compute: the exposed time is the whole traffic
NO_OVERLAP_CLUSTER = ClusterConfig(num_nodes=2, gpus_per_node=8, gpu_mem_gb=80, gpu_peak_tflops=1e9)


def work(backend: str, batch: int = 64) -> RoleWork:
    pc = ParallelConfig(mixed_precision="bf16", dp_backend=backend)
    return RoleWork(role="actor", kind="lm", mode="train", parallel=pc, batch=batch, batch_field="b", seq_len=2048)


def dp_seconds(backend: str, mbs: int) -> float:
    return estimate_layout(MODEL, work(backend), Layout(tp=1, pp=1, dp=16, micro_batch_size=mbs), NO_OVERLAP_CLUSTER).time.dp_comm_s


def test_fsdp2_gathers_and_reduces_for_every_micro_batch_ddp_once():
    """4 rows a dp rank: 4 micro-batches of 1 pay 4 times FSDP2's traffic of 1 micro-batch of 4; DDP's one
    all-reduce per optimizer step is the same either way."""
    assert dp_seconds("fsdp2", 1) == pytest.approx(4 * dp_seconds("fsdp2", 4))
    assert dp_seconds("ddp", 1) == pytest.approx(dp_seconds("ddp", 4))


def test_fsdp2_bytes_per_micro_batch():
    """Unhidden, one micro-batch moves each layer's bf16 parameters twice (forward and backward all-gathers)
    and its fp32 gradient once (reduce-scatter), and the root's (embedding, final norm, lm_head) too (resharded
    after forward: apply_fsdp2 passes reshard_after_forward=True): (n - 1) / n of (2 + 2 + 4) bytes per layer
    and per root parameter, over 50 GB/s."""
    layout = Layout(tp=1, pp=1, dp=16, micro_batch_size=1)
    exposed = fsdp2_micro_batch_exposed_seconds(MODEL, work("fsdp2"), layout, 0.0, 0.0, NO_OVERLAP_CLUSTER)
    layer = layer_num_parameters(MODEL) * layers_on_pp_stage(MODEL.num_layers, 1, 0)
    root = MODEL.num_parameters() - layer
    assert exposed == pytest.approx(15 / 16 * (8 * layer + 8 * root) / 50e9)
    # a forward-only pass (PPO's old log-probs in the trained role) gathers once and reduces nothing
    forward = fsdp2_micro_batch_exposed_seconds(MODEL, work("fsdp2"), layout, 0.0, None, NO_OVERLAP_CLUSTER)
    assert forward == pytest.approx(15 / 16 * (2 * layer + 2 * root) / 50e9)


def test_fsdp2_traffic_hides_behind_compute_but_one_layer_per_pass():
    """With compute to spare, only the forward's first gather, the backward's last reduce-scatter and the root's
    collectives (two gathers, one reduce-scatter) stay exposed."""
    layout = Layout(tp=1, pp=1, dp=16, micro_batch_size=1)
    exposed = fsdp2_micro_batch_exposed_seconds(MODEL, work("fsdp2"), layout, 100.0, 100.0, NO_OVERLAP_CLUSTER)
    per_layer = layer_num_parameters(MODEL)
    root = MODEL.num_parameters() - per_layer * MODEL.num_layers
    assert exposed == pytest.approx(15 / 16 * (2 * per_layer + 4 * per_layer + 8 * root) / 50e9)
