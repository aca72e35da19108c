"""Pipeline (1F1B) with TP/SP inside stages against the single-process model (4 gloo ranks, one spawn).

Layouts: tp=2 x pp=2 (GQA sharded / replicated, SP, recomputation, tied embeddings
across the first and last stage, the score model, uneven layer splits), pp=2 x dp=2 and
pp=4 (more and fewer micro-batches than stages). Each checks the gathered weights,
forward-only log_probs / entropy / values broadcast to every pp rank, the loss, every
gradient after 1F1B over the micro-batches (= whole-batch gradients) and the parameters
after 3 AdamW steps (tolerance 1e-5, fp32). Extra checks: "mean" loss scaling, building
a stage from a full state dict on meta, gathering onto one pp rank, split validation.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.toolkit.assertions import assert_layout_matches
from tests.toolkit.layouts import layout_model_config, make_batch, make_dims, run_layout
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

PP_LAYOUTS = {
    # name: ((tp, pp, dp), model overrides, kind, run_layout keywords)
    "tp2 x pp2, kv sharded, bias, 3 layers (2+1), 4 mb": (
        (2, 2, 1),
        dict(num_layers=3, attention_bias=True),
        "lm",
        dict(num_micro_batches=4),
    ),
    "tp2 x pp2, kv replicated, SP, full, tied, 4 mb": (
        (2, 2, 1),
        dict(num_kv_heads=1, tie_word_embeddings=True),
        "lm",
        dict(sp=True, recompute="full", num_micro_batches=4),
    ),
    "tp2 x pp2, SP, selective, split 1+2, 2 mb": (
        (2, 2, 1),
        dict(num_layers=3),
        "lm",
        dict(sp=True, recompute="selective", layer_split=[1, 2], num_micro_batches=2),
    ),
    "tp2 x pp2, score model, SP, 4 mb": ((2, 2, 1), dict(num_kv_heads=1), "score", dict(sp=True, num_micro_batches=4)),
    "pp2 x dp2, tied, split 1+2, 4 mb": (
        (1, 2, 2),
        dict(num_layers=3, tie_word_embeddings=True),
        "lm",
        dict(layer_split=[1, 2], num_micro_batches=4),
    ),
    "pp4, 4 layers, 4 mb": ((1, 4, 1), dict(num_layers=4), "lm", dict(num_micro_batches=4)),
    "pp4, 4 layers, 2 mb (fewer than stages), selective": (
        (1, 4, 1),
        dict(num_layers=4),
        "lm",
        dict(num_micro_batches=2, recompute="selective"),
    ),
}


def _mean_reduction_check(dims) -> float:
    """loss_reduction="mean" with a plain per-micro-batch mean equals the whole-batch mean."""
    from aligner.model.llama import build_model
    from aligner.nn.vocab import vocab_parallel_log_probs
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.parallel.pipeline import pipeline_train_step, split_micro_batches
    from aligner.parallel.sharding import gather_full_state_dict
    from aligner.parallel.tensor_parallel import vocab_start

    cfg = layout_model_config(num_layers=3)
    ref = build_model(cfg, seed=3)
    stage = build_parallel_model(cfg, "lm", dims, seed=3, sequence_parallel=True)
    batch = make_batch(cfg)

    def loss_fn(logits, mb, group=dims.tp_group, start=vocab_start(stage)):
        return -vocab_parallel_log_probs(logits[:, :-1], mb["input_ids"][:, 1:], group, start).mean()

    loss_fn(ref(batch["input_ids"]), batch, None, 0).backward()
    losses = pipeline_train_step(stage, dims, split_micro_batches(batch, 4), loss_fn, loss_reduction="mean")
    for p in stage.parameters():
        p.data, p.grad = p.grad, p.data
    grads = gather_full_state_dict(stage, dims.tp_group, dims.pp_group)
    ref_grads = {k: ref.get_parameter(k).grad for k in grads}
    err = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads)
    with torch.no_grad():
        ref_loss = loss_fn(ref(batch["input_ids"]), batch, None, 0)
    return max(err, float((losses.mean() - ref_loss).abs()))


def _meta_build_and_dst_gather(dims) -> dict:
    """A stage built on meta from a full state dict equals the seeded one; gather onto pp rank 0 only."""
    from aligner.model.llama import build_model
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.parallel.sharding import gather_full_state_dict

    cfg = layout_model_config(num_layers=3, num_kv_heads=1, tie_word_embeddings=True)
    full = build_model(cfg, seed=5).state_dict()
    stage = build_parallel_model(cfg, "lm", dims, full_state_dict=full)
    seeded = build_parallel_model(cfg, "lm", dims, seed=5)
    out = {"meta vs seeded": max(float((a - b).abs().max()) for a, b in zip(stage.state_dict().values(), seeded.state_dict().values()))}
    out["inv_freq"] = float((stage.model.inv_freq - seeded.model.inv_freq).abs().max())
    got = gather_full_state_dict(stage, dims.tp_group, dims.pp_group, dst_pp_rank=0)
    if dims.pp_rank == 0:
        assert list(got) == list(full), (list(got), list(full))
        out["dst gather"] = max(float((got[k] - full[k]).abs().max()) for k in full)
    else:
        out["dst gather"] = 0.0 if set(got) < set(full) else 1.0
    return out


def pp_battery(rank: int, world_size: int) -> dict:
    from aligner.parallel.parallelize import pp_stage_layer_ids
    from aligner.parallel.pipeline import split_micro_batches

    torch.manual_seed(0)
    out = {"layouts": {}, "extra": {}, "errors": {}}
    dims_cache = {}
    for name, (shape, overrides, kind, kw) in PP_LAYOUTS.items():
        if shape not in dims_cache:
            dims_cache[shape] = make_dims(*shape)
        t0 = time.perf_counter()
        out["layouts"][name] = run_layout(dims_cache[shape], layout_model_config(**overrides), kind, **kw)
        out.setdefault("seconds", {})[name] = time.perf_counter() - t0
    dims = dims_cache[(2, 2, 1)]
    out["extra"]["mean loss scaling, tp2 x pp2 SP"] = _mean_reduction_check(dims)
    out["extra"].update(_meta_build_and_dst_gather(dims))
    out["split 3 on 2"] = [pp_stage_layer_ids(3, 2, s) for s in range(2)]
    for args in ((3, 2, 0, [2, 2]), (3, 2, 0, [3, 0])):
        try:
            pp_stage_layer_ids(*args)
        except ValueError as e:
            out["errors"][str(args[3])] = str(e)
    try:
        split_micro_batches({"input_ids": torch.zeros(4, 8)}, 3)
    except ValueError as e:
        out["errors"]["mb"] = str(e)
    return out


@pytest.fixture(scope="module")
def pp_results():
    return run_distributed(pp_battery, world_size=4)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(PP_LAYOUTS))
def test_pipeline_layout_matches_single_process(pp_results, layout):
    assert_layout_matches([res["layouts"][layout] for res in pp_results], layout)


@pytest.mark.distributed
def test_pipeline_extra_checks(pp_results):
    assert_layout_matches([res["extra"] for res in pp_results], "extra checks")


@pytest.mark.distributed
def test_pipeline_split_and_validation(pp_results):
    res = pp_results[0]
    assert res["split 3 on 2"] == [[0, 1], [2]]
    assert "pp_layer_split=[2, 2]" in res["errors"]["[2, 2]"]
    assert "pp_layer_split=[3, 0]" in res["errors"]["[3, 0]"]
    assert "num_micro_batches=3" in res["errors"]["mb"]
