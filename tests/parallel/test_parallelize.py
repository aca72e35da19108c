"""parallelize() applies recomputation (and the rest) from outside the model: parameter names stay HF's,
gradients do not change, the saved activations do, and the mode can be switched back."""

from __future__ import annotations

import pytest
import torch

from aligner.config import ModelConfig, ParallelConfig
from aligner.model.llama import LlamaModel, build_model
from aligner.parallel.dims import ParallelDims
from aligner.parallel.memory import layer_saved_bytes
from aligner.parallel.parallelize import apply_recompute, decode_layer_split, parallelize, pp_stage_layer_ids, recompute_mode
from tests.toolkit.models import tiny_model_config

CFG = tiny_model_config(vocab_size=96, hidden_size=64, intermediate_size=160)


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


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_blocks_train_like_the_eager_model(recompute):
    """parallel.compile=true (tp 1): every decoder block is compiled (parameter names unchanged),
    and the loss and every gradient equal the uncompiled model's within 1e-5 (fp32; inductor's
    fused kernels round differently, so not bitwise), also under full recomputation and for a
    second sequence length (the automatic-dynamic recompile)."""
    ref = apply_recompute(build_model(CFG, seed=3), recompute)
    model = parallelize(build_model(CFG, seed=3), ParallelDims(), ParallelConfig(recompute=recompute, compile=True))
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers.values())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for t in (24, 17):
            ids = torch.randint(0, CFG.vocab_size, (2, t), generator=torch.Generator().manual_seed(t))
            losses = []
            for m in (ref, model):
                m.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=0)
            for (n, a), b in zip(ref.named_parameters(), model.parameters()):
                torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=0, msg=n)


def test_pp_stage_layer_ids_split():
    assert [pp_stage_layer_ids(5, 2, s) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [pp_stage_layer_ids(4, 2, s, [1, 3]) for s in range(2)] == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="pp_layer_split"):
        pp_stage_layer_ids(4, 2, 0, [2, 1])


SMOLLM2_DIMS = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, max_seq_len=2048
)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_decode_layer_split_balances_the_head_against_layers(pp):
    """Stage costs in weight elements (a layer's GEMM weights; the head V x h on the last stage): the
    split is valid, and no other choice of the last stage's layer count brings the stages closer."""
    cfg = SMOLLM2_DIMS
    h, q, kv = cfg.hidden_size, cfg.num_heads * 64, cfg.num_kv_heads * 64
    layer, head = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size, cfg.vocab_size * h

    def worst(split):
        return max([n * layer for n in split[:-1]] + [split[-1] * layer + head])

    split = decode_layer_split(cfg, pp)
    assert len(split) == pp and sum(split) == cfg.num_layers and min(split) >= 1
    assert split[-1] < split[0]  # the head takes the place of layers
    for last in range(1, cfg.num_layers - pp + 2):
        rest = cfg.num_layers - last
        other = [rest // (pp - 1) + (1 if s < rest % (pp - 1) else 0) for s in range(pp - 1)] + [last]
        assert worst(split) <= worst(other), (split, other)
    pp_stage_layer_ids(cfg.num_layers, pp, pp - 1, split)  # accepted by the pipeline split


def test_decode_layer_split_edge_cases():
    tiny = tiny_model_config()
    assert decode_layer_split(tiny, 1) == [2] and decode_layer_split(tiny, 2) == [1, 1]
    with pytest.raises(ValueError, match="exceeds num_layers"):
        decode_layer_split(tiny, 3)
    assert decode_layer_split(SMOLLM2_DIMS, 2) == [19, 11]
