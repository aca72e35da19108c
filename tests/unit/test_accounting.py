"""Activation-memory accounting of one decoder layer (single process): measured saved bytes
equal the Llama-adjusted Korthikanti et al. 2022 formula (aligner.parallel.memory),
for each recomputation mode, MHA and GQA. TP / SP cases run in
tests/distributed/test_tensor_parallel.py (same formula with t = 2)."""

from __future__ import annotations

import pytest

from aligner.config import ModelConfig
from aligner.model.llama import build_model
from aligner.parallel.memory import LayerDims, korthikanti_bytes, layer_comm, layer_saved_bytes, llama_layer_activation_elements
from aligner.parallel.parallelize import apply_recompute

S, BATCH, H, A, I = 32, 2, 64, 4, 160


@pytest.mark.parametrize("kv", [4, 2])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_saved_bytes_match_adjusted_formula(kv, recompute):
    cfg = ModelConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=A, num_kv_heads=kv, max_seq_len=S)
    model = build_model(cfg, seed=0)
    apply_recompute(model, recompute)
    measured = layer_saved_bytes(model, BATCH, S)
    adjusted = 4 * llama_layer_activation_elements(LayerDims(s=S, b=BATCH, h=H, a=A, i=I, kv=kv), recompute=recompute)
    assert measured == adjusted, (measured, adjusted)


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


def test_single_process_layer_has_no_collectives():
    cfg = ModelConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=A, num_kv_heads=A, max_seq_len=S)
    c = layer_comm(build_model(cfg, seed=0), BATCH, S, backward=True)
    assert sum(c.calls.values()) == 0
