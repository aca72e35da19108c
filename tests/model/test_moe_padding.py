"""MoE router losses and statistics ignore padding.

Before: the Switch load-balancing loss and the z-loss pooled every position of a micro-batch,
padding included, so they depended on how far rows were padded as well as on the micro-batch
partition. These tests show both causes on the tiny MoE, then that with the token mask only the
(documented) per-micro-batch partition changes them: a padded batch's aux loss equals the
unpadded one's within 1e-6, the masked loss equals HF Mixtral's ``load_balancing_loss_func``
with its ``attention_mask``, and a Policy step through the runner (which builds the mask from
the rows' lengths) reports the same ``moe_aux_loss`` whatever the padding.
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import OptimConfig, ParallelConfig
from aligner.model.llama import build_model
from aligner.model.moe import moe_layers, route, router_z_loss, switch_load_balancing_loss
from tests.toolkit.models import tiny_model_config

CFG = tiny_model_config(
    intermediate_size=48, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01, router_z_loss_coef=0.001, init_std=0.2
)


def _aux(model, ids: torch.Tensor, token_mask=None) -> tuple[float, float]:
    """(mean over layers of aux_loss, of z_loss) of one training forward."""
    model.train()
    model(ids, token_mask=token_mask)
    layers = moe_layers(model)
    return tuple(sum(float(m.stats[k]) for m in layers) / len(layers) for k in ("aux_loss", "z_loss"))


def _rows(n: int = 3, t: int = 7, pad: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [n, t], the same rows right-padded by `pad` pad tokens [n, t + pad], its token mask)."""
    ids = torch.randint(4, 64, (n, t), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([ids, torch.zeros(n, pad, dtype=ids.dtype)], dim=1)
    return ids, padded, torch.arange(t + pad).unsqueeze(0).expand(n, -1) < t


def test_padding_and_partition_both_moved_the_aux_loss_and_the_mask_removes_padding():
    model = build_model(CFG, kind="lm", seed=0)
    ids, padded, mask = _rows()
    plain = _aux(model, ids)
    # cause 1, padding: the same rows and partition, padded -> the unmasked losses move
    unmasked = _aux(model, padded)
    assert abs(unmasked[0] - plain[0]) > 1e-4 and abs(unmasked[1] - plain[1]) > 1e-4
    # the fix: with the token mask, padding changes neither loss
    masked = _aux(model, padded, mask)
    assert masked[0] == pytest.approx(plain[0], abs=1e-6) and masked[1] == pytest.approx(plain[1], abs=1e-6)
    # cause 2, the partition (documented, kept): the same unpadded rows as two micro-batches
    halves = [_aux(model, ids[:1]), _aux(model, ids[1:])]
    assert abs((halves[0][0] + halves[1][0]) / 2 - plain[0]) > 1e-4


def test_masked_switch_loss_equals_hf_load_balancing_loss_with_attention_mask():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(5)
    b, t, e = 3, 6, 8
    logits = torch.randn(b * t, e, generator=g) * 2
    attention = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    keep = attention.reshape(-1).bool()
    for k in (1, 2):
        _, experts, probs = route(logits, k, "topk_softmax", training=True)
        ours = float(switch_load_balancing_loss(probs, experts, e, token_mask=keep))
        hf = float(load_balancing_loss_func((logits,), e, k, attention))
        assert ours * k == pytest.approx(hf, abs=1e-6)  # HF counts f_i over N, not N * k (moe docstring)
        # and the masked loss is the loss of the real tokens alone
        assert ours == pytest.approx(float(switch_load_balancing_loss(probs[keep], experts[keep], e)), abs=1e-7)
    assert float(router_z_loss(logits, keep)) == pytest.approx(float(router_z_loss(logits[keep])), abs=1e-6)
    assert float(switch_load_balancing_loss(probs, experts, e, token_mask=torch.zeros_like(keep))) == 0.0


def test_policy_step_moe_aux_loss_ignores_padding():
    """Through Policy.sft_step: the runner builds the token mask from attention_mask."""
    from aligner.actor.policy import Policy
    from aligner.parallel.dims import ParallelDims

    optim = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
    ids, padded, mask = _rows()
    out, grads = [], []
    for x, m in ((ids, torch.ones_like(ids)), (padded, mask.long())):
        pol = Policy(CFG, ParallelConfig(), optim, ParallelDims(device_type="cpu"), seed=0)
        batch = {"input_ids": x, "attention_mask": m, "loss_mask": m.float()}
        out.append(pol.sft_step(batch, micro_batch_size=3))
        grads.append({n: p.grad.clone() for n, p in pol.runtime.module.named_parameters()})
    assert out[1]["moe_aux_loss"] == pytest.approx(out[0]["moe_aux_loss"], abs=1e-6)
    assert out[1]["moe_z_loss"] == pytest.approx(out[0]["moe_z_loss"], abs=1e-6)
    assert out[1]["loss"] == pytest.approx(out[0]["loss"], abs=1e-6)
    for n, g in grads[0].items():  # the routers' gradients (aux + z terms) included
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-5, msg=n)
