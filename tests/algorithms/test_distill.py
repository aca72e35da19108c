"""On-policy distillation's divergence (GKD, Agarwal et al. 2024): the per-token reverse KL equal to TRL's
``GKDTrainer.generalized_jsd_loss`` with beta = 1 (its own code) on fixed logits, in value and gradient,
float64; beta = 1 is KL(student || teacher) by hand; the sampled-token reward is an unbiased estimate of it."""

from __future__ import annotations

import pytest
import torch

from aligner import algorithms as alg

TOL = dict(atol=1e-6, rtol=1e-6)


def _logits(seed: int, b: int = 3, r: int = 5, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(b, r, v, generator=g, dtype=torch.float64) * 2
    t = torch.randn(b, r, v, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(b, r, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    return s, t, mask


def _gkd():
    pytest.importorskip("trl", reason="TRL is the reference implementation: pip install trl (the test extra)")
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:
        from trl import GKDTrainer
    return GKDTrainer


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reverse_kl_equals_trl_gkd_beta_1(seed, temperature):
    gkd = _gkd()
    s, t, mask = _logits(seed)
    labels = torch.where(mask > 0, 1, -100).long()
    x = s.clone().requires_grad_(True)
    want = gkd.generalized_jsd_loss(x, t, labels=labels, beta=1, temperature=temperature)
    want.backward()
    y = s.clone().requires_grad_(True)
    got = alg.distillation_loss(y, t, mask, temperature)
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(y.grad, x.grad, **TOL)
    assert got > 0


def test_beta_1_is_the_reverse_kl_by_hand():
    """KL(p_s || p_t) = sum_v p_s log(p_s / p_t), the mode-seeking direction GKD calls beta = 1."""
    s, t, _ = _logits(2)
    ps, pt = torch.softmax(s, -1), torch.softmax(t, -1)
    want = (ps * (ps.log() - pt.log())).sum(-1)
    torch.testing.assert_close(alg.reverse_kl_per_token(s, t), want, **TOL)
    forward = (pt * (pt.log() - ps.log())).sum(-1)
    assert (want - forward).abs().max() > 1e-3  # not the forward KL


def test_sampled_token_reward_is_an_unbiased_estimate():
    """E_{y ~ pi_s}[-(reward)] = sum_y pi_s(y) (log pi_s(y) - log pi_t(y)) = the exact per-token reverse KL."""
    s, t, _ = _logits(3)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    b, r, v = s.shape
    expected = torch.zeros(b, r, dtype=torch.float64)
    for tok in range(v):  # enumerate the student's choices at every position
        idx = torch.full((b, r, 1), tok)
        reward = alg.distillation_token_rewards(ls.gather(-1, idx)[..., 0], lt.gather(-1, idx)[..., 0], torch.ones(b, r))
        expected += ls.gather(-1, idx)[..., 0].exp() * -reward
    torch.testing.assert_close(expected, alg.reverse_kl_per_token(s, t), **TOL)


def test_another_vocabulary_is_refused():
    s, t, _ = _logits(4)
    with pytest.raises(ValueError, match="teacher_logits has shape"):
        alg.reverse_kl_per_token(s, t[..., :-1])
