"""Policy.ppo_update's loss equals the formula of aligner.algorithms on the whole mini-batch.

The reference computes, in one full-sequence forward of an identical model,
``policy_loss - entropy_coef * entropy + kl_loss_coef * kl_loss`` with every term
aggregated by ``loss_agg`` over the whole mini-batch, and backpropagates it. ppo_update runs
the same mini-batch as three micro-batches of one row; its gradients (left on the
parameters after the step) must equal the reference's for every aggregation mode, with the
clip-higher bound, the entropy bonus and the KL loss term all active.
"""

from __future__ import annotations

import pytest
import torch

from aligner import algorithms as alg
from aligner.actor.policy import Policy
from aligner.config import AlgorithmConfig, OptimConfig, ParallelConfig
from aligner.model.llama import build_model, select_positions
from aligner.nn.vocab import vocab_parallel_entropy, vocab_parallel_log_probs
from aligner.parallel.dims import ParallelDims
from aligner.protocol import build_sequences, response_index
from tests.toolkit.models import tiny_model_config

CFG = tiny_model_config(init_std=0.2)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
TEMPERATURE = 0.9


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in (3, 6, 2)]
    responses = [torch.randint(4, 64, (n,), generator=g).tolist() for n in (5, 1, 3)]
    seq = build_sequences(prompts, responses, pad_id=0)
    mask = seq["response_mask"]
    shape = mask.shape
    return {
        "input_ids": seq["input_ids"],
        "prompt_lens": seq["prompt_lens"],
        "response_mask": mask,
        "advantages": torch.randn(shape, generator=g) * mask,
        "old_offset": torch.randn(shape, generator=g) * 0.3,  # old = current - offset: ratios around 1, some clipped
        "ref_offset": torch.randn(shape, generator=g) * 0.5,
    }


def _response_logits(model, batch):
    idx = response_index(batch["prompt_lens"], batch["response_mask"].shape[1], batch["input_ids"].shape[1] - 1)
    logits = select_positions(model(batch["input_ids"]), idx)
    return logits, batch["input_ids"].gather(1, idx + 1)


def _reference_grads(batch, algo: AlgorithmConfig) -> dict[str, torch.Tensor]:
    model = build_model(CFG, kind="lm", seed=0)
    logits, labels = _response_logits(model, batch)
    mask = batch["response_mask"]
    lp = vocab_parallel_log_probs(logits, labels, temperature=TEMPERATURE) * mask
    ent = vocab_parallel_entropy(logits, temperature=TEMPERATURE)
    loss, _ = alg.policy_loss(
        lp, batch["old_log_probs"], batch["advantages"], mask, algo.clip_eps, clip_eps_high=algo.clip_eps_high, loss_agg=algo.loss_agg
    )
    loss = loss - algo.entropy_coef * alg.aggregate_loss(ent, mask, algo.loss_agg)
    loss = loss + algo.kl_loss_coef * alg.kl_loss(lp, batch["ref_log_probs"], mask, algo.kl_loss_estimator, algo.loss_agg)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_agg", alg.LOSS_AGG_MODES)
def test_ppo_update_gradient_equals_the_whole_batch_formula(loss_agg):
    algo = AlgorithmConfig(
        advantage="grpo", kl_coef=0.0, kl_loss_coef=0.3, entropy_coef=0.05, clip_eps=0.1, clip_eps_high=0.3, loss_agg=loss_agg
    )
    pol = Policy(CFG, ParallelConfig(), OPTIM, ParallelDims(device_type="cpu"), seed=0)
    batch = _batch()
    with torch.no_grad():
        current = pol.log_probs(batch, micro_batch_size=3, temperature=TEMPERATURE)
    mask = batch["response_mask"]
    batch["old_log_probs"] = (current - batch.pop("old_offset")) * mask
    batch["ref_log_probs"] = (current - batch.pop("ref_offset")) * mask
    want = _reference_grads(batch, algo)
    metrics = pol.ppo_update(batch, algo, micro_batch_size=1, temperature=TEMPERATURE)
    got = {n: p.grad for n, p in pol.runtime.module.named_parameters()}
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)
    assert metrics["kl_loss"] > 0


def test_kl_loss_coef_changes_the_update():
    """The KL loss term must reach the gradient (GRPO with a KL coefficient and no KL term anywhere would train without it)."""
    batch = _batch()
    grads = []
    for coef in (0.0, 0.5):
        pol = Policy(CFG, ParallelConfig(), OPTIM, ParallelDims(device_type="cpu"), seed=0)
        b = dict(batch)
        with torch.no_grad():
            current = pol.log_probs(b, micro_batch_size=3)
        b["old_log_probs"] = current * b["response_mask"]
        b["ref_log_probs"] = (current - b.pop("ref_offset")) * b["response_mask"]
        b.pop("old_offset")
        pol.ppo_update(b, AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=coef), micro_batch_size=3)
        grads.append(torch.cat([p.grad.flatten() for p in pol.runtime.module.parameters()]))
    assert (grads[1] - grads[0]).abs().max() > 1e-4


def _with_and_without_old_log_probs(algo: AlgorithmConfig, batch: dict, behaviour: bool) -> tuple[list[dict], list[dict]]:
    """ppo_update from the same seeded policy twice: with the recomputed old log-probs (the current
    policy's) and without them. behaviour: also give rollout_log_probs = current - old_offset (an older
    behaviour policy). Returns ([metrics with, without], [gradients with, without])."""
    grads, metrics = [], []
    for recompute in (True, False):
        pol = Policy(CFG, ParallelConfig(), OPTIM, ParallelDims(device_type="cpu"), seed=0)
        b = dict(batch)
        with torch.no_grad():
            current = pol.log_probs(b, micro_batch_size=3, temperature=TEMPERATURE)
        mask = b["response_mask"]
        b["ref_log_probs"] = (current - b.pop("ref_offset")) * mask
        offset = b.pop("old_offset")
        if behaviour:
            b["rollout_log_probs"] = (current - offset) * mask
        if recompute:
            b["old_log_probs"] = current * mask
        metrics.append(pol.ppo_update(b, algo, micro_batch_size=2, temperature=TEMPERATURE))
        grads.append({n: p.grad.clone() for n, p in pol.runtime.module.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4, msg=name)
    return metrics, grads


def test_ppo_update_without_old_log_probs_is_the_on_policy_update():
    """algorithm.recompute_old_log_probs=false: ppo_update without old_log_probs (its own forward's,
    detached, stand in) takes the same step as with the recomputed old log-probs of an on-policy batch."""
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.2, clip_eps=0.1, recompute_old_log_probs=False)
    metrics, _ = _with_and_without_old_log_probs(algo, _batch(), behaviour=False)
    assert metrics[1]["clipfrac"] == 0.0 and abs(metrics[1]["approx_kl"]) < 1e-12
    for k in ("policy_loss", "kl_loss", "grad_norm"):
        assert metrics[1][k] == pytest.approx(metrics[0][k], rel=1e-4, abs=1e-6), k


def test_decoupled_loss_without_old_log_probs_uses_the_update_forward_as_proximal():
    """algorithm.decoupled_loss with recompute_old_log_probs=false: the proximal policy is the
    update's own forward, detached; for an on-policy step (one epoch, one mini-batch) that is the same
    step, loss and behaviour weights as with the recomputed old log-probs, for a stale batch whose
    behaviour log-probs differ from the current policy's."""
    algo = AlgorithmConfig(
        advantage="grpo", kl_coef=0.0, kl_loss_coef=0.2, clip_eps=0.1, decoupled_loss=True, recompute_old_log_probs=False
    )
    metrics, _ = _with_and_without_old_log_probs(algo, _batch(), behaviour=True)
    assert abs(metrics[0]["behavior_weight_mean"] - 1.0) > 1e-3  # the behaviour weights are not trivially 1
    for k in ("policy_loss", "kl_loss", "grad_norm", "behavior_weight_mean", "behavior_approx_kl"):
        assert metrics[1][k] == pytest.approx(metrics[0][k], rel=1e-4, abs=1e-6), k
