"""Activation-memory accounting of one decoder layer (single process): measured saved bytes
equal aligner's one activation-memory model (aligner.parallel.memory.layer_activation_bytes, the
formula the planner uses) for each recomputation mode, MHA, GQA and MQA, and each way a layer
computes (fp32; bf16 parameters as under FSDP2; fp32 parameters under torch.autocast as under DDP).
TP / SP cases run in tests/parallel/test_tensor_parallel.py (same formula with t = 2)."""

from __future__ import annotations

import pytest
import torch

from aligner.config import ModelConfig
from aligner.model.llama import build_model
from aligner.parallel.memory import LayerDims, korthikanti_bytes, layer_activation_bytes, layer_comm, layer_saved_bytes
from aligner.parallel.parallelize import apply_recompute
from aligner.planner import layer_activation_bytes_per_token, training_precision

S, BATCH, H, A, I = 32, 2, 64, 4, 160


@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_saved_bytes_equal_the_memory_model(kv, recompute, precision):
    cfg = ModelConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=A, num_kv_heads=kv, max_seq_len=S)
    model = build_model(cfg, seed=0)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    apply_recompute(model, recompute)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        measured = layer_saved_bytes(model, BATCH, S)
    assert measured == layer_activation_bytes(LayerDims.of(cfg, S, BATCH), precision, recompute=recompute)
    # the planner's per-token figure is the same model
    per_token = layer_activation_bytes_per_token(cfg, precision, 1, False, recompute, S)
    assert per_token * S == pytest.approx(layer_activation_bytes(LayerDims.of(cfg, S, 1), precision, recompute=recompute))


def test_the_planner_picks_the_precision_the_runtime_computes_in():
    from aligner.config import ParallelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=A, max_seq_len=S)
    assert training_precision(cfg, ParallelConfig(), 2) == "fp32"
    assert training_precision(cfg, ParallelConfig(mixed_precision="bf16", dp_backend="fsdp2"), 2) == "bf16"
    assert training_precision(cfg, ParallelConfig(mixed_precision="bf16", dp_backend="fsdp2"), 1) == "autocast"
    assert training_precision(cfg, ParallelConfig(mixed_precision="bf16", dp_backend="ddp"), 4) == "autocast"


def test_recomputation_orders_memory():
    cfg = ModelConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=A, num_kv_heads=A, max_seq_len=S)
    model = build_model(cfg, seed=0)
    got = {}
    for mode in ("none", "selective", "full"):
        apply_recompute(model, mode)
        got[mode] = layer_saved_bytes(model, BATCH, S)
    assert got["full"] < got["selective"] < got["none"]
    assert got["full"] == S * BATCH * H * 4  # only the layer input, fp32


def test_paper_formula_values():
    """Korthikanti et al. 2022 Table 2 at s=2048, b=1, h=12288, a=96 (GPT-3 175B), t=8."""
    d = LayerDims(s=2048, b=1, h=12288, a=96, i=4 * 12288, t=8)
    sbh = 2048 * 12288
    assert korthikanti_bytes(LayerDims(s=2048, b=1, h=12288, a=96, i=0)) == pytest.approx(sbh * (34 + 5 * 96 * 2048 / 12288))
    assert korthikanti_bytes(d, sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / 8)
    assert korthikanti_bytes(d, recompute="full") == 2 * sbh


def megatron_layer_bytes(s: int, b: int, h: int, ffn: int, t: int) -> float:
    """Megatron-LM's estimate of one transformer layer's activations with sequence parallelism and
    selective recomputation, 2-byte activations (megatron/training/theoretical_memory_usage.py,
    ``compute_activation_memory``: s b h (18 + 4 ffn / h), over tp)."""
    return s * b * h * (18 + 4 * ffn / h) / t


LLAMAS = {
    "Llama 2 7B": dict(h=4096, a=32, kv=32, i=11008),
    "Llama 2 70B": dict(h=8192, a=64, kv=8, i=28672),
    "Llama 3 8B": dict(h=4096, a=32, kv=8, i=14336),
}


@pytest.mark.parametrize("size", sorted(LLAMAS))
def test_bf16_sp_selective_layer_against_megatrons_estimate(size):
    """Issue 39 part 3: the Llama layer in bf16 with SP and selective recomputation against
    Megatron's estimator (before the lean RMSNorm and SwiGLU backward: 1.52x for Llama 2 70B, the
    norms keeping fp32 copies and normalized rows, SwiGLU keeping silu(gate)). The estimator counts
    a GeLU MLP, 4 ffn bytes per token; a gated MLP must keep gate and up (4 ffn) and the down
    projection's input (2 ffn). So: everything but the MLP within Megatron's 18 sbh, the whole layer
    within 1.1x for the GQA models (1.05x, 1.06x) and 1.12x for MHA Llama 2 7B (1.117x: its k and v are
    as wide as q). The formula is the one measured against saved tensors above."""
    dims = LLAMAS[size]
    for t in (1, 8):
        d = LayerDims(s=4096, b=1, t=t, **dims)
        ours = layer_activation_bytes(d, "bf16", sequence_parallel=t > 1, recompute="selective")
        sbh = 4096 * dims["h"] / t
        assert ours - 4096 * 6 * dims["i"] / t <= 18 * sbh, (size, t)
        ratio = ours / megatron_layer_bytes(4096, 1, dims["h"], dims["i"], t)
        assert ratio <= (1.1 if dims["kv"] < dims["a"] else 1.12), (size, t, ratio)


def test_single_process_layer_has_no_collectives():
    cfg = ModelConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=A, num_kv_heads=A, max_seq_len=S)
    c = layer_comm(build_model(cfg, seed=0), BATCH, S, backward=True)
    assert sum(c.calls.values()) == 0
