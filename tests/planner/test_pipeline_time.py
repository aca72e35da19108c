"""The planner's pipeline time: the point-to-point messages ("pipeline point-to-point costed":
every slot of aligner's 1F1B schedules ends in a blocking message, each over the link its stage boundary
crosses in aligner's rank order, tp, cp, pp, dp: tp fastest), and the pace of the busiest rank (the LM head
on the last stage)."""

import pytest

from aligner.config import ClusterConfig, ModelConfig
from aligner.planner import Layout, layer_num_parameters
from aligner.planner.time_model import pipeline_p2p_seconds, pipeline_stage_factor, pp_seconds_per_byte

NODE8 = ClusterConfig(num_nodes=2, gpus_per_node=8, gpu_mem_gb=80, intra_node_gbps=400.0, inter_node_gbps=25.0)
INTRA, INTER = 1 / 400e9, 1 / 25e9
MODEL = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32)


@pytest.mark.parametrize(
    "tp,pp,dp,vpp,expected",
    [
        (1, 4, 4, 1, INTRA),  # a pipeline is 4 consecutive ranks: inside a node
        (2, 4, 2, 1, INTRA),  # 8 consecutive ranks: one node
        (4, 4, 1, 1, (2 * INTRA + INTER) / 3),  # stages 0-1 on node 0, 2-3 on node 1: one boundary of three crosses
        (4, 4, 1, 2, (2 * INTRA + 2 * INTER) / 4),  # interleaved: the chunks wrap from stage 3 to stage 0, a crossing
        (8, 2, 1, 1, INTER),  # a stage per node
    ],
)
def test_each_stage_boundary_uses_the_link_it_crosses(tp, pp, dp, vpp, expected):
    lay = Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=1, vpp=vpp)
    assert pp_seconds_per_byte(lay, NODE8) == pytest.approx(expected)


def test_cpu_nodes_are_one_device_each():
    cpu = ClusterConfig(num_nodes=4, gpus_per_node=0, intra_node_gbps=400.0, inter_node_gbps=25.0)
    assert pp_seconds_per_byte(Layout(tp=1, pp=4, dp=1, micro_batch_size=1), cpu) == pytest.approx(INTER)


def test_slots_messages_and_sizes():
    """Training: 2 (v m + p - 1) messages of [b, s / cp (/ tp with SP), H] elements; forward only: half; none at
    pp = 1."""
    m, seq, e = 8, 4096, 2
    lay = Layout(tp=2, pp=4, dp=2, micro_batch_size=2)
    msg = 2 * seq * MODEL.hidden_size * e * INTRA
    assert pipeline_p2p_seconds(MODEL, lay, m, seq, e, NODE8) == pytest.approx(2 * (m + 3) * msg)
    assert pipeline_p2p_seconds(MODEL, lay, m, seq, e, NODE8, directions=1) == pytest.approx((m + 3) * msg)
    sp = Layout(tp=2, pp=4, dp=2, micro_batch_size=2, sp=True, vpp=2)  # the wrap edge 3 -> 0 stays in the node
    assert pipeline_p2p_seconds(MODEL, sp, m, seq, e, NODE8) == pytest.approx(2 * (2 * m + 3) * msg / 2)
    assert pipeline_p2p_seconds(MODEL, Layout(tp=2, pp=1, dp=8, micro_batch_size=2), m, seq, e, NODE8) == 0.0


LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8)


@pytest.mark.parametrize("pp,vpp", [(2, 1), (16, 1), (16, 2), (4, 2)])
def test_the_last_stage_carries_the_head(pp, vpp):
    """Llama 3 8B's head (V = 128,256) has 2.4 layers' parameters, 2.1 layers' training FLOPs at 4,096 tokens: a
    pipeline runs at its last rank's pace, (its layers + the head) x pp / (all layers + the head); the head is
    not recomputed."""
    seq, h = 4096, LLAMA3_8B.hidden_size
    layer = 6 * layer_num_parameters(LLAMA3_8B) + 12 * h * seq
    head = 6 * h * LLAMA3_8B.vocab_size
    assert 2.3 < LLAMA3_8B.vocab_size * h / layer_num_parameters(LLAMA3_8B) < 2.5 and 2.0 < head / layer < 2.2
    lay = Layout(tp=1, pp=pp, dp=1, micro_batch_size=1, vpp=vpp)
    per_rank = 32 // pp
    expect = (per_rank * layer + head) * pp / (32 * layer + head)
    assert pipeline_stage_factor(LLAMA3_8B, lay, "lm", seq) == pytest.approx(expect, rel=1e-9)
    full = Layout(tp=1, pp=pp, dp=1, micro_batch_size=1, vpp=vpp, recompute="full")
    expect_full = (per_rank * layer * 4 / 3 + head) * pp / (32 * layer * 4 / 3 + head)
    assert pipeline_stage_factor(LLAMA3_8B, full, "lm", seq) == pytest.approx(expect_full, rel=1e-9)
    # a score head (one output) leaves the even split's pace
    assert pipeline_stage_factor(LLAMA3_8B, lay, "score", seq) == pytest.approx(1.0, abs=1e-4)
    assert pipeline_stage_factor(LLAMA3_8B, Layout(tp=8, pp=1, dp=1, micro_batch_size=1), "lm", seq) == 1.0
