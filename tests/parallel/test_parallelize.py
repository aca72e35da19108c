"""parallelize() applies recomputation (and the rest) from outside the model: parameter names stay HF's,
gradients do not change, the saved activations do, and the mode can be switched back."""

from __future__ import annotations

import pytest
import torch

from aligner.config import ModelConfig, ParallelConfig
from aligner.model.llama import LlamaModel, build_model
from aligner.parallel.dims import ParallelDims
from aligner.parallel.memory import layer_saved_bytes
from aligner.parallel.parallelize import apply_recompute, parallelize, recompute_mode, stage_layer_ids

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)


def _grads(model) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_model_holds_no_parallel_state():
    assert not hasattr(LlamaModel, "set_recompute")
    trunk = build_model(CFG).model
    assert not hasattr(trunk, "seq_shards") and not hasattr(trunk, "recompute")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_keeps_names_and_gradients_and_saves_less(mode):
    ref = build_model(CFG, seed=1)
    names = [n for n, _ in ref.named_parameters()]
    want, saved_none = _grads(ref), layer_saved_bytes(ref, 2, 24)
    model = apply_recompute(build_model(CFG, seed=1), mode)
    assert recompute_mode(model) == mode and [n for n, _ in model.named_parameters()] == names
    got = _grads(model)
    for n in names:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=0)
    assert layer_saved_bytes(model, 2, 24) < saved_none
    apply_recompute(model, "none")  # switching back restores the plain forward
    assert layer_saved_bytes(model, 2, 24) == saved_none


def test_parallelize_on_one_rank_applies_the_configured_recomputation():
    model = build_model(CFG, seed=2)
    out = parallelize(model, ParallelDims(), ParallelConfig(recompute="full"))
    assert out is model and recompute_mode(model) == "full" and len(model.model.layers) == CFG.num_layers
    with pytest.raises(ValueError, match="recompute='some'"):
        apply_recompute(model, "some")


def test_stage_layer_ids_split():
    assert [stage_layer_ids(5, 2, s) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [stage_layer_ids(4, 2, s, [1, 3]) for s in range(2)] == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="pp_layer_split"):
        stage_layer_ids(4, 2, 0, [2, 1])
