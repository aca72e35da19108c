"""SPIN (Chen et al. 2024): the pairs (chosen = the SFT response, rejected = the model's own generation) and the
loss against the paper's formula (eq. 4.7, logistic loss); the loss is DPO's sigmoid with beta = lambda; the
worker's reference reset makes the reference the current policy."""

from __future__ import annotations

import math

import pytest
import torch

from aligner import algorithms as alg


def test_spin_loss_equals_the_paper_formula():
    g = torch.Generator().manual_seed(0)
    pr, pg, rr, rg = (torch.randn(6, generator=g, dtype=torch.float64) * 5 for _ in range(4))
    lam = 0.3
    x = pr.clone().requires_grad_(True)
    y = pg.clone().requires_grad_(True)
    losses, real_r, gen_r = alg.spin_loss(x, y, rr, rg, lam)
    for i in range(6):
        t = lam * (float(pr[i]) - float(rr[i])) - lam * (float(pg[i]) - float(rg[i]))
        assert float(losses[i]) == pytest.approx(math.log1p(math.exp(-t)), abs=1e-12)
    losses.sum().backward()
    # dl/dt = -sigmoid(-t): d/d log p(y) = -lam sigmoid(-t), d/d log p(y') = +lam sigmoid(-t)
    t = lam * (pr - rr) - lam * (pg - rg)
    torch.testing.assert_close(x.grad, -lam * torch.sigmoid(-t), atol=1e-12, rtol=0)
    torch.testing.assert_close(y.grad, lam * torch.sigmoid(-t), atol=1e-12, rtol=0)
    torch.testing.assert_close(real_r - gen_r, t, atol=1e-12, rtol=0)


def test_spin_loss_is_dpo_sigmoid_with_beta_lambda():
    g = torch.Generator().manual_seed(1)
    pr, pg, rr, rg = (torch.randn(5, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    want, _, _ = alg.dpo_loss(pr, pg, rr, rg, 0.2, "sigmoid")
    got, _, _ = alg.spin_loss(pr, pg, rr, rg, 0.2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_spin_pairs():
    from aligner.trainers.spin import prompt_and_response, spin_pairs

    ex = {"input_ids": [1, 5, 6, 7, 8, 2], "loss_mask": [0, 0, 0, 1, 1, 1]}
    p, y = prompt_and_response(ex)
    assert (p, y) == ([1, 5, 6], [7, 8, 2])
    pairs = spin_pairs([p, p], [y, y], [[9, 2], [7, 8, 2]])
    assert pairs == [{"chosen_ids": [1, 5, 6, 7, 8, 2], "rejected_ids": [1, 5, 6, 9, 2], "prompt_len": 3}]  # the tie is dropped
    with pytest.raises(ValueError):
        prompt_and_response({"input_ids": [1, 2], "loss_mask": [0, 0]})


def test_reset_reference_copies_the_policy():
    """After a DPO step the policy differs from the reference; SPINWorker.reset_reference's copy makes the
    reference's pair log-probs equal the policy's (run on the Ray-free classes, in process)."""
    from aligner.actor.policy import Policy
    from aligner.config import DPOConfig, OptimConfig, ParallelConfig
    from aligner.data.collate import collate_pairs
    from aligner.parallel.dims import ParallelDims
    from aligner.trainers.spin import spin_pairs
    from aligner.workers.spin import SPINWorker
    from tests.toolkit.models import tiny_model_config

    cfg = tiny_model_config(init_std=0.2)
    dims = ParallelDims(device_type="cpu")
    optim = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant")
    pol = Policy(cfg, ParallelConfig(), optim, dims, seed=0)
    ref = Policy(cfg, ParallelConfig(), optim, dims, seed=0)
    batch = collate_pairs(spin_pairs([[1, 5, 6], [1, 9]], [[7, 8, 2], [4, 2]], [[9, 2], [3, 3, 2]]), 0)
    batch = {**batch, **ref.pair_sequence_log_probs(batch, 2)}
    pol.dpo_step(batch, DPOConfig(beta=0.1), 2)
    before = ref.pair_sequence_log_probs(batch, 2)
    after_policy = pol.pair_sequence_log_probs(batch, 2)
    assert (before["ref_chosen_logps"] - after_policy["ref_chosen_logps"]).abs().max() > 1e-4
    stand_in = type("W", (), {"reference": ref, "policy": pol})()
    SPINWorker.reset_reference(stand_in)  # the dispatch mark leaves the method itself unchanged
    got = ref.pair_sequence_log_probs(batch, 2)
    torch.testing.assert_close(got["ref_chosen_logps"], after_policy["ref_chosen_logps"], atol=1e-6, rtol=0)
    torch.testing.assert_close(got["ref_rejected_logps"], after_policy["ref_rejected_logps"], atol=1e-6, rtol=0)


def test_spin_with_lora_is_refused():
    from aligner.cli import load_config
    from aligner.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config("spin", ["conf=tiny", "actor.lora.rank=4"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("actor.lora.rank=4 is invalid") and "set actor.lora.rank=0" in msg, msg
