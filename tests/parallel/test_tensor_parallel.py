"""Tensor/sequence parallelism against the single-process model (2 gloo ranks, one spawn).

Every layout runs :func:`run_layout` in each child: the sharded model's gathered logits,
vocab-parallel log_probs and entropy, the loss, EVERY gathered parameter gradient and
the parameters after 3 AdamW steps are compared with the unsharded model built from the
same seed (fp32, tolerance 1e-5). Layouts cover GQA kv heads sharded and replicated,
QKV bias, tied embeddings, SP on/off, each recomputation mode, the score model and
micro-batch accumulation. ``run_layout`` (tests.toolkit.layouts) serves test_pipeline.py too.
"""

from __future__ import annotations

import pytest
import torch

from tests.toolkit.assertions import assert_layout_matches
from tests.toolkit.layouts import B, T, layout_model_config, make_dims, run_layout
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

TP_LAYOUTS = {
    # name: (model config overrides, kind, run_layout keywords)
    "kv sharded, qkv bias, no SP": (dict(num_kv_heads=2, attention_bias=True), "lm", dict()),
    "kv replicated (kv=1), SP, selective": (dict(num_kv_heads=1), "lm", dict(sp=True, recompute="selective")),
    "kv replicated, SP, full, 2 micro-batches": (
        dict(num_kv_heads=1, attention_bias=True),
        "lm",
        dict(sp=True, recompute="full", num_micro_batches=2),
    ),
    "tied embeddings, SP, none": (dict(tie_word_embeddings=True), "lm", dict(sp=True)),
    "MHA, no SP, full": (dict(num_kv_heads=4), "lm", dict(recompute="full")),
    "score model, kv replicated, SP": (dict(num_kv_heads=1), "score", dict(sp=True)),
    "score model, no SP, selective": (dict(), "score", dict(recompute="selective")),
}


def tp_battery(rank: int, world_size: int) -> dict:
    """Every TP layout on tp=2, plus input-validation and collective-count checks."""
    from aligner.model.llama import build_model
    from aligner.parallel.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    dims = make_dims(tp=2, pp=1)
    out = {"layouts": {}, "errors": {}, "comm": {}}
    for name, (overrides, kind, kw) in TP_LAYOUTS.items():
        out["layouts"][name] = run_layout(dims, layout_model_config(**overrides), kind, **kw)

    # bad inputs raise ValueError naming the value
    try:
        apply_tensor_parallel(build_model(layout_model_config(vocab_size=63), seed=0), dims.tp_group)
    except ValueError as e:
        out["errors"]["vocab"] = str(e)
    sp_model = apply_tensor_parallel(build_model(layout_model_config(), seed=0), dims.tp_group, sequence_parallel=True)
    try:
        sp_model(torch.zeros(1, 7, dtype=torch.long))
    except ValueError as e:
        out["errors"]["odd T"] = str(e)

    # collectives per layer forward: 2 all-reduces of B*T*H (no SP), or all-gather +
    # reduce-scatter of the same volume (SP); and saved bytes vs the adjusted formula
    from aligner.parallel.memory import LayerDims, layer_activation_bytes, layer_comm, layer_saved_bytes
    from aligner.parallel.parallelize import apply_recompute

    out["memory"] = {}
    for sp in (False, True):
        m = apply_tensor_parallel(build_model(layout_model_config(), seed=0), dims.tp_group, sequence_parallel=sp)
        c = layer_comm(m, B, T)
        out["comm"][sp] = (dict(c.calls), dict(c.elements))
        for kv in (4, 1):
            cfg = layout_model_config(hidden_size=64, intermediate_size=160, num_kv_heads=kv, num_layers=1, max_seq_len=32)
            m = apply_tensor_parallel(build_model(cfg, seed=0), dims.tp_group, sequence_parallel=sp)
            for mode in ("none", "selective", "full"):
                apply_recompute(m, mode)
                formula = layer_activation_bytes(LayerDims(s=32, b=2, h=64, a=4, i=160, t=2, kv=kv), "fp32", sp, mode)
                out["memory"][(kv, sp, mode)] = (layer_saved_bytes(m, 2, 32), formula)
    return out


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(tp_battery, world_size=2)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_tp_layout_matches_single_process(tp_results, layout):
    assert_layout_matches([res["layouts"][layout] for res in tp_results], layout)


@pytest.mark.distributed
def test_tp_bad_inputs_raise_value_error(tp_results):
    errors = tp_results[0]["errors"]
    assert "vocab_size=63" in errors["vocab"]
    assert "tp_size=2" in errors["odd T"] and "pad" in errors["odd T"]


@pytest.mark.distributed
def test_tp_layer_collectives(tp_results):
    """Shoeybi et al.: 2 all-reduces of B*T*H per layer forward; Korthikanti et al.: with SP,
    all-gather + reduce-scatter of the same total volume."""
    calls, elems = tp_results[0]["comm"][False]
    assert calls == {"all_reduce": 2} and elems == {"all_reduce": 2 * B * T * 32}
    calls, elems = tp_results[0]["comm"][True]
    assert calls == {"all_gather": 2, "reduce_scatter": 2}
    assert elems == {"all_gather": 2 * B * T * 32, "reduce_scatter": 2 * B * T * 32}


@pytest.mark.distributed
def test_tp_sp_activation_memory_matches_formula(tp_results):
    """Saved bytes per layer with tp=2 (SP off/on, each recompute mode, kv split/replicated) equal
    the Llama-adjusted Korthikanti et al. formula (aligner.parallel.memory)."""
    for rank, res in enumerate(tp_results):
        bad = {k: v for k, v in res["memory"].items() if v[0] != v[1]}
        assert not bad, f"rank {rank}: (measured, formula) differ: {bad}"
