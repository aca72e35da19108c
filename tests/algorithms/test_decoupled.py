"""The decoupled PPO loss and the lag / staleness metrics for samples from stale weights.

The loss is checked against AReaL's objective (Fu et al. 2025, arXiv:2505.24298, section 5.2,
eq. 5) written out again below token by token in float64, for every loss aggregation, with
and without the behaviour-weight cap and the dual clip; its gradient against autograd through
that reference and against the closed form; its reduction to ``policy_loss`` when the behaviour
policy is the proximal one; and against AReaL's own ``ppo_actor_loss_fn`` where the ``areal``
package is importable (it is not installable here, so that test skips).
"""

from __future__ import annotations

import math

import pytest
import torch

from aligner import algorithms as alg


def _ragged_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)


def _inputs(seed: int, dtype=torch.float64, lengths=(6, 0, 3, 5, 1), width: int = 6):
    """Random log-probs with a spread of behaviour weights (about 0.2 to 5) and ragged rows,
    one of them without response tokens. Padding holds garbage that must not matter."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    proximal = -torch.rand(b, width, generator=g, dtype=torch.float64) * 3
    log_probs = proximal + 0.3 * torch.randn(b, width, generator=g, dtype=torch.float64)
    behavior = proximal + 0.8 * torch.randn(b, width, generator=g, dtype=torch.float64)
    advantages = torch.randn(b, width, generator=g, dtype=torch.float64)
    mask = _ragged_mask(list(lengths), width)
    pad = mask == 0
    behavior = torch.where(pad, torch.full_like(behavior, -30.0), behavior)  # weight e^27 on padding
    log_probs = torch.where(pad, torch.full_like(log_probs, 5.0), log_probs)
    return [t.to(dtype) for t in (log_probs, proximal, behavior, advantages)] + [mask.to(dtype)]


def _reference_loss(log_probs, proximal, behavior, advantages, mask, eps_low, eps_high, dual_clip, cap, loss_agg):
    """AReaL eq. 5 as a loss, one token at a time in float64:
    l_t = -(pi_prox / pi_behav) * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t), r_t = pi_theta / pi_prox;
    dual clip (A_t < 0): the objective is max(that min, c A_t); tokens with pi_prox / pi_behav > cap get weight 0
    (AReaL behav_imp_weight_cap) and still count in the denominator. Autograd flows through ``log_probs`` only."""
    rows, width = mask.shape
    row_sums, row_counts = [], []
    for b in range(rows):
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        for t in range(width):
            if mask[b, t].item() == 0:
                continue
            count += 1
            w = math.exp(proximal[b, t].item() - behavior[b, t].item())
            if cap is not None and w > cap:
                w = 0.0
            a = advantages[b, t].item()
            r = torch.exp(log_probs[b, t] - proximal[b, t].item())
            r_clipped = min(max(r, 1.0 - eps_low), 1.0 + eps_high)
            surrogate = min(r * a, r_clipped * a)
            if dual_clip is not None and a < 0:
                surrogate = max(surrogate, dual_clip * a)
            total = total - w * surrogate
        row_sums.append(total)
        row_counts.append(count)
    if loss_agg == "token-mean":
        return sum(row_sums) / max(sum(row_counts), 1)
    kept = [(s, n) for s, n in zip(row_sums, row_counts) if n > 0]
    if loss_agg == "seq-mean-token-mean":
        return sum(s / n for s, n in kept) / max(len(kept), 1)
    assert loss_agg == "seq-mean-token-sum"
    return sum(s for s, _ in kept) / max(len(kept), 1)


CASES = [
    # clip_eps, clip_eps_high, dual_clip, behavior_weight_cap
    (0.2, None, None, None),
    (0.2, 0.28, None, 2.0),
    (0.1, 0.3, 1.25, 1.5),  # dual clip active where A < 0 and r > 1.25
]


@pytest.mark.parametrize("loss_agg", alg.LOSS_AGG_MODES)
@pytest.mark.parametrize("clip_eps, clip_eps_high, dual_clip, cap", CASES)
def test_loss_and_gradient_match_the_papers_formula(loss_agg, clip_eps, clip_eps_high, dual_clip, cap):
    log_probs, proximal, behavior, advantages, mask = _inputs(seed=11)
    weights = torch.exp(proximal - behavior)[mask > 0]
    if cap is not None:  # the inputs exercise the cap: some tokens above it, most below
        assert 0 < int((weights > cap).sum()) < weights.numel() // 2
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    ours_lp = log_probs.clone().requires_grad_(True)
    loss, metrics = alg.decoupled_policy_loss(
        ours_lp, proximal, behavior, advantages, mask, clip_eps, clip_eps_high, dual_clip, cap, loss_agg
    )
    assert metrics["clipfrac"].item() > 0
    if dual_clip is not None:
        assert metrics["dual_clipfrac"].item() > 0
    ref_lp = log_probs.clone().requires_grad_(True)
    expected = _reference_loss(ref_lp, proximal, behavior, advantages, mask, clip_eps, eps_high, dual_clip, cap, loss_agg)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)

    (grad,) = torch.autograd.grad(loss, ours_lp)
    (ref_grad,) = torch.autograd.grad(expected, ref_lp)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert torch.all(grad[mask == 0] == 0)


def test_float32_inputs_agree_with_the_float64_reference():
    log_probs, proximal, behavior, advantages, mask = _inputs(seed=5, dtype=torch.float32)
    loss, _ = alg.decoupled_policy_loss(log_probs, proximal, behavior, advantages, mask, 0.2, 0.28, None, 1.5)
    assert loss.dtype == torch.float32
    d = [t.double() for t in (log_probs, proximal, behavior, advantages, mask)]
    expected = _reference_loss(*d, 0.2, 0.28, None, 1.5, "token-mean")
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_gradient_is_the_closed_form_and_skips_proximal_and_behavior():
    """Token mean, no dual clip: d loss / d log_probs_t = -w_t A_t r_t / N where the unclipped term is
    the smaller objective (0 where the clip is active or the cap drops the token)."""
    log_probs, proximal, behavior, advantages, mask = _inputs(seed=23)
    cap, eps = 2.5, 0.2
    lp = log_probs.clone().requires_grad_(True)
    prox = proximal.clone().requires_grad_(True)
    behav = behavior.clone().requires_grad_(True)
    adv = advantages.clone().requires_grad_(True)
    loss, _ = alg.decoupled_policy_loss(lp, prox, behav, adv, mask, eps, behavior_weight_cap=cap)
    grad_lp, grad_prox, grad_behav, grad_adv = torch.autograd.grad(loss, [lp, prox, behav, adv], allow_unused=True)
    assert grad_prox is None and grad_behav is None and grad_adv is None

    w = torch.exp(proximal - behavior)
    w = torch.where(w > cap, 0.0, w)
    r = torch.exp(log_probs - proximal)
    unclipped_active = r * advantages <= r.clamp(1 - eps, 1 + eps) * advantages
    closed_form = -w * advantages * r * unclipped_active * mask / mask.sum()
    torch.testing.assert_close(grad_lp, closed_form, rtol=1e-12, atol=1e-12)
    assert int((closed_form != 0).sum()) > 0 and int(((closed_form == 0) & (mask > 0)).sum()) > 0


@pytest.mark.parametrize("loss_agg", alg.LOSS_AGG_MODES)
@pytest.mark.parametrize("clip_eps_high, dual_clip, cap", [(None, None, None), (0.28, 3.0, None), (None, 2.0, 1.5)])
def test_equals_policy_loss_exactly_when_behavior_is_proximal(loss_agg, clip_eps_high, dual_clip, cap):
    """Weight exp(0) = 1 on every token (below any cap > 1): the loss, its gradient and the PPO metrics
    are policy_loss's, bit for bit."""
    log_probs, proximal, _, advantages, mask = _inputs(seed=3, dtype=torch.float32)
    lp_a = log_probs.clone().requires_grad_(True)
    lp_b = log_probs.clone().requires_grad_(True)
    ours, ours_metrics = alg.decoupled_policy_loss(
        lp_a, proximal, proximal.clone(), advantages, mask, 0.2, clip_eps_high, dual_clip, cap, loss_agg
    )
    ppo, ppo_metrics = alg.policy_loss(lp_b, proximal, advantages, mask, 0.2, clip_eps_high, dual_clip, loss_agg)
    assert torch.equal(ours, ppo)
    ours.backward()
    ppo.backward()
    assert torch.equal(lp_a.grad, lp_b.grad)
    for key, value in ppo_metrics.items():
        assert torch.equal(ours_metrics[key], value), key
    assert ours_metrics["behavior_weight_mean"].item() == 1.0
    assert ours_metrics["behavior_weight_capped_frac"].item() == 0.0
    assert ours_metrics["behavior_approx_kl"].item() == 0.0


def test_cap_masks_exactly_the_tokens_whose_weight_exceeds_it():
    """Weights 0.5, 1.5, 2.5, 4 on response tokens and e^10 on padding, cap 2: the last two response
    tokens leave the loss (weight 0, no gradient) but stay in the token-mean denominator; nothing is
    truncated to the cap (as AReaL behav_imp_weight_cap, unlike TIS)."""
    weights = [0.5, 1.5, 2.5, 4.0, math.exp(10.0)]
    proximal = torch.zeros(1, 5, dtype=torch.float64)
    behavior = -torch.log(torch.tensor([weights], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -2.0, 3.0, -4.0, 5.0]], dtype=torch.float64)
    lp = proximal.clone().requires_grad_(True)  # ratio 1: inside the clip range on every token
    loss, metrics = alg.decoupled_policy_loss(lp, proximal, behavior, advantages, mask, 0.2, behavior_weight_cap=2.0)
    assert loss.item() == pytest.approx(-(0.5 * 1.0 + 1.5 * -2.0) / 4, rel=1e-12)
    loss.backward()
    kept = torch.tensor([[True, True, False, False, False]])
    assert torch.all(lp.grad[~kept] == 0)
    torch.testing.assert_close(lp.grad[kept], torch.tensor([-0.5 * 1.0 / 4, -1.5 * -2.0 / 4], dtype=torch.float64))
    assert metrics["behavior_weight_capped_frac"].item() == pytest.approx(2 / 4)
    assert metrics["behavior_weight_max"].item() == pytest.approx(4.0)
    assert metrics["behavior_weight_min"].item() == pytest.approx(0.5)
    assert metrics["behavior_weight_mean"].item() == pytest.approx((0.5 + 1.5 + 2.5 + 4.0) / 4)

    uncapped, _ = alg.decoupled_policy_loss(proximal, proximal, behavior, advantages, mask, 0.2)
    assert uncapped.item() == pytest.approx(-(0.5 - 3.0 + 7.5 - 16.0) / 4, rel=1e-12)


def test_policy_lag_metrics_by_hand():
    proximal = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    behavior = torch.tensor([[0.0, -math.log(2.0), math.log(2.0), 3.0]])  # weights 1, 2, 0.5; padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    m = alg.policy_lag_metrics(proximal, behavior, mask, behavior_weight_cap=1.8)
    assert m["behavior_weight_mean"].item() == pytest.approx(3.5 / 3)
    assert m["behavior_weight_max"].item() == pytest.approx(2.0)
    assert m["behavior_weight_min"].item() == pytest.approx(0.5)
    assert m["behavior_weight_capped_frac"].item() == pytest.approx(1 / 3)
    # k3 of KL(behav || prox): w - 1 - log w per token
    k3 = [(w - 1 - math.log(w)) for w in (1.0, 2.0, 0.5)]
    assert m["behavior_approx_kl"].item() == pytest.approx(sum(k3) / 3, rel=1e-6)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    assert alg.policy_lag_metrics(proximal, behavior, mask)["behavior_weight_capped_frac"].item() == 0.0
    empty = alg.policy_lag_metrics(proximal, behavior, torch.zeros(1, 4), behavior_weight_cap=1.8)
    assert all(v.item() == 0.0 for v in empty.values())


def test_staleness_metrics_per_sample_and_per_token():
    m = alg.staleness_metrics(torch.tensor([7, 5, 7, 4]), current_version=7)
    assert m["staleness_mean"].item() == pytest.approx((0 + 2 + 0 + 3) / 4)
    assert m["staleness_max"].item() == 3.0
    # a partial rollout: row 0 switched from version 5 to 6 mid-response; padding versions ignored
    versions = torch.tensor([[5, 5, 6, 6], [6, 6, 0, 0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    m = alg.staleness_metrics(versions, current_version=6, response_mask=mask)
    assert m["staleness_mean"].item() == pytest.approx(2 / 6)
    assert m["staleness_max"].item() == 1.0
    empty = alg.staleness_metrics(torch.zeros(0, dtype=torch.long), current_version=3)
    assert empty["staleness_mean"].item() == 0.0 and empty["staleness_max"].item() == 0.0


def test_staleness_metrics_bad_input():
    with pytest.raises(ValueError, match="weight_versions has dtype torch.float32"):
        alg.staleness_metrics(torch.tensor([1.0]), 2)
    with pytest.raises(ValueError, match="pass response_mask"):
        alg.staleness_metrics(torch.tensor([[1, 2]]), 2)
    with pytest.raises(ValueError, match="response_mask is given"):
        alg.staleness_metrics(torch.tensor([1, 2]), 2, response_mask=torch.ones(2))
    with pytest.raises(ValueError, match="response_mask has shape"):
        alg.staleness_metrics(torch.tensor([[1, 2]]), 2, response_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="current_version=-1"):
        alg.staleness_metrics(torch.tensor([0]), -1)
    with pytest.raises(ValueError, match="version 5, newer than current_version=4"):
        alg.staleness_metrics(torch.tensor([3, 5]), 4)
    # a newer version on padding is not an error
    alg.staleness_metrics(torch.tensor([[3, 9]]), 4, response_mask=torch.tensor([[1.0, 0.0]]))


def test_bad_input_names_the_argument():
    log_probs, proximal, behavior, advantages, mask = _inputs(seed=1)
    with pytest.raises(ValueError, match=r"behavior_log_probs has shape \[5, 5\], expected \[5, 6\]"):
        alg.decoupled_policy_loss(log_probs, proximal, behavior[:, :5], advantages, mask, 0.2)
    with pytest.raises(ValueError, match=r"proximal_log_probs has shape"):
        alg.decoupled_policy_loss(log_probs, proximal[:4], behavior, advantages, mask, 0.2)
    with pytest.raises(ValueError, match=r"log_probs has shape \[30\], expected \[B, R\]"):
        alg.decoupled_policy_loss(log_probs.flatten(), proximal, behavior, advantages, mask, 0.2)
    for bad_cap in (-1.0, 0.0, 1.0):
        with pytest.raises(ValueError, match=f"behavior_weight_cap={bad_cap}.*> 1"):
            alg.decoupled_policy_loss(log_probs, proximal, behavior, advantages, mask, 0.2, behavior_weight_cap=bad_cap)
        with pytest.raises(ValueError, match=f"behavior_weight_cap={bad_cap}"):
            alg.policy_lag_metrics(proximal, behavior, mask, bad_cap)
    with pytest.raises(ValueError, match="unknown loss_agg 'sum'"):
        alg.decoupled_policy_loss(log_probs, proximal, behavior, advantages, mask, 0.2, loss_agg="sum")
    with pytest.raises(ValueError, match="clip_eps=0"):
        alg.decoupled_policy_loss(log_probs, proximal, behavior, advantages, mask, 0)
    with pytest.raises(ValueError, match="dual_clip=1.0"):
        alg.decoupled_policy_loss(log_probs, proximal, behavior, advantages, mask, 0.2, dual_clip=1.0)
    with pytest.raises(ValueError, match="behavior_log_probs has shape"):
        alg.policy_lag_metrics(proximal, behavior[:, :2], mask)


def test_matches_areal_ppo_actor_loss_fn():
    """AReaL's own decoupled loss (token mean over all response tokens) on the same inputs."""
    functional = pytest.importorskip("areal.utils.functional", reason="AReaL (package areal) is not installed here")
    ppo_actor_loss_fn = getattr(functional, "ppo_actor_loss_fn", None)
    if ppo_actor_loss_fn is None:
        pytest.skip("this areal version has no areal.utils.functional.ppo_actor_loss_fn")
    log_probs, proximal, behavior, advantages, mask = _inputs(seed=17)
    for eps_high, c_clip, cap in [(None, None, None), (0.28, 3.0, 2.0)]:
        ours, _ = alg.decoupled_policy_loss(log_probs, proximal, behavior, advantages, mask, 0.2, eps_high, c_clip, cap)
        theirs, _ = ppo_actor_loss_fn(
            logprobs=log_probs,
            proximal_logprobs=proximal,
            old_logprobs=behavior,
            advantages=advantages,
            eps_clip=0.2,
            loss_mask=mask.bool(),
            eps_clip_higher=eps_high,
            c_clip=c_clip,
            behav_imp_weight_cap=cap,
        )
        torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-10, atol=1e-10)


def test_mixed_version_fraction_counts_samples_spanning_versions():
    """Row 0 switched from version 5 to 6 mid-response (a sync landed between decode steps); row 1's
    padding holds another version but is masked; row 2 is one version; row 3 has no response token."""
    versions = torch.tensor([[5, 5, 6, 6], [6, 6, 0, 0], [4, 4, 4, 4], [1, 2, 3, 4]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert alg.mixed_version_fraction(versions, mask).item() == pytest.approx(1 / 4)
    assert alg.mixed_version_fraction(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3)).item() == 0.0
    with pytest.raises(ValueError, match="weight_versions has dtype"):
        alg.mixed_version_fraction(versions.float(), mask)
    with pytest.raises(ValueError, match="response_mask"):
        alg.mixed_version_fraction(versions, mask[:, :3])
