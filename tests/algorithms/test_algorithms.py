"""Unit tests for aligner.algorithms: hand-computed and peer-pinned reference values."""

from __future__ import annotations

import math

import pytest
import torch

from aligner import algorithms as alg


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def _ragged_mask(lengths, r):
    return (torch.arange(r)[None, :] < torch.tensor(lengths)[:, None]).float()


# ---------------------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------------------


def test_masked_mean_and_sum_by_hand():
    x = _t([1.0, 2.0, 100.0], [3.0, 5.0, 7.0])
    mask = _t([1, 1, 0], [1, 0, 1])
    assert alg.masked_sum(x, mask).item() == pytest.approx(1 + 2 + 3 + 7)
    assert alg.masked_mean(x, mask).item() == pytest.approx(13 / 4)
    torch.testing.assert_close(alg.masked_mean(x, mask, dim=-1), torch.tensor([1.5, 5.0]))
    torch.testing.assert_close(alg.masked_sum(x, mask.bool(), dim=0), torch.tensor([4.0, 2.0, 7.0]))


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    assert alg.masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_masked_mean_shape_mismatch_names_argument():
    with pytest.raises(ValueError, match=r"mask has shape \[2, 4\], expected \[2, 3\]"):
        alg.masked_mean(torch.ones(2, 3), torch.ones(2, 4))


def test_masked_var_matches_torch_on_kept_entries():
    torch.manual_seed(0)
    x = torch.randn(4, 7)
    mask = _ragged_mask([7, 3, 5, 1], 7)
    kept = x[mask.bool()]
    assert alg.masked_var(x, mask).item() == pytest.approx(kept.var(unbiased=True).item(), rel=1e-5)
    assert alg.masked_var(x, mask, unbiased=False).item() == pytest.approx(kept.var(unbiased=False).item(), rel=1e-5)


def test_masked_var_unbiased_needs_two_entries():
    with pytest.raises(ValueError, match="at least 2"):
        alg.masked_var(torch.ones(1, 3), _t([1, 0, 0]))


def test_masked_whiten_mean_zero_var_one_on_masked_entries_and_zero_padding():
    torch.manual_seed(1)
    x = torch.randn(3, 6) * 5 + 3
    mask = _ragged_mask([6, 2, 4], 6)
    w = alg.masked_whiten(x, mask)
    assert abs(alg.masked_mean(w, mask).item()) < 1e-5
    assert alg.masked_var(w, mask).item() == pytest.approx(1.0, rel=1e-4)
    assert torch.all(w[mask == 0] == 0)
    # shift_mean=False rescales only: the mean is kept (TRL whiten)
    w2 = alg.masked_whiten(x, mask, shift_mean=False)
    assert alg.masked_mean(w2, mask).item() == pytest.approx(alg.masked_mean(x, mask).item(), rel=1e-5)
    assert alg.masked_var(w2, mask).item() == pytest.approx(1.0, rel=1e-4)


# ---------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    log_probs = _t([-1.0, -2.0, -0.5])
    ref_log_probs = _t([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]
    k1 = alg.kl_penalty(log_probs, ref_log_probs, "k1")
    k3 = alg.kl_penalty(log_probs, ref_log_probs, "k3")
    torch.testing.assert_close(k1, _t(d))
    torch.testing.assert_close(k3, _t([math.exp(-x) - 1 + x for x in d]))
    torch.testing.assert_close(alg.kl_penalty(log_probs, ref_log_probs, "abs"), _t([0.5, 1.0, 0.0]))
    torch.testing.assert_close(alg.kl_penalty(log_probs, ref_log_probs, "mse"), _t([0.125, 0.5, 0.0]))
    # exp(-0.5) - 1 + 0.5 = 0.10653..., exp(1) - 1 - 1 = 0.71828...
    assert k3[0, 0].item() == pytest.approx(0.1065307, abs=1e-6)
    assert k3[0, 1].item() == pytest.approx(0.7182818, abs=1e-6)


def test_k3_is_nonnegative_and_clamped_like_verl():
    torch.manual_seed(2)
    log_probs = torch.randn(8, 16) * 3
    ref_log_probs = torch.randn(8, 16) * 3
    k3 = alg.kl_penalty(log_probs, ref_log_probs, "k3")
    assert torch.all(k3 >= 0)
    extreme = alg.kl_penalty(_t([0.0]), _t([50.0]), "k3")  # d = -50: exp(50) would explode
    assert extreme.item() == 10.0


def test_unknown_kl_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="'k2'.*abs, k1, k3, mse"):
        alg.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k2")
    assert set(alg.KL_ESTIMATORS) == {"k1", "k3", "abs", "mse"}


def test_kl_penalty_shape_mismatch():
    with pytest.raises(ValueError, match="ref_log_probs has shape"):
        alg.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4))


# ---------------------------------------------------------------------------------------
# KL controllers (Ziegler et al. 2019)
# ---------------------------------------------------------------------------------------


def test_fixed_kl_controller_never_moves():
    ctl = alg.build_kl_controller("fixed", 0.1)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.1


@pytest.mark.parametrize("current_kl, expected_error", [(7.0, 1 / 6), (12.0, 0.2), (1.0, -0.2), (6.0, 0.0)])
def test_adaptive_kl_controller_follows_ziegler_formula(current_kl, expected_error):
    ctl = alg.build_kl_controller("adaptive", 0.2, target=6.0, horizon=10000)
    ctl.update(current_kl, n_steps=256)
    assert ctl.value == pytest.approx(0.2 * (1 + expected_error * 256 / 10000), rel=1e-12)


def test_adaptive_kl_controller_state_dict_round_trip():
    ctl = alg.AdaptiveKLController(0.05, target=1.0, horizon=100)
    for _ in range(3):
        ctl.update(2.0, n_steps=10)
    assert ctl.value == pytest.approx(0.05 * 1.02**3)
    fresh = alg.AdaptiveKLController(0.05, target=1.0, horizon=100)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value
    with pytest.raises(ValueError, match="kl_coef"):
        fresh.load_state_dict({"value": 1.0})


def test_build_kl_controller_bad_inputs():
    with pytest.raises(ValueError, match="'pid'.*adaptive, fixed"):
        alg.build_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="target"):
        alg.build_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="target=0"):
        alg.AdaptiveKLController(0.1, target=0, horizon=10)


# ---------------------------------------------------------------------------------------
# token rewards
# ---------------------------------------------------------------------------------------


def test_token_rewards_score_at_last_response_token_of_ragged_rows():
    scores = torch.tensor([1.0, 2.0, -3.0])
    kl = torch.full((3, 5), 0.5)
    mask = _ragged_mask([5, 2, 1], 5)
    r = alg.compute_token_rewards(scores, kl, mask, kl_coef=0.1)
    expected = -0.05 * mask
    expected[0, 4] += 1.0
    expected[1, 1] += 2.0
    expected[2, 0] += -3.0
    torch.testing.assert_close(r, expected)
    # NeMo-Aligner test_calculate_ppo_rewards_with_no_kl_penalty: with kl_coef 0 only the score remains
    r0 = alg.compute_token_rewards(scores, kl, mask, kl_coef=0.0)
    assert r0.sum(-1).tolist() == pytest.approx([1.0, 2.0, -3.0])


def test_token_rewards_row_without_response_raises():
    with pytest.raises(ValueError, match=r"rows \[1\] have no response token"):
        alg.compute_token_rewards(torch.zeros(2), torch.zeros(2, 3), _ragged_mask([2, 0], 3), 0.1)
    with pytest.raises(ValueError, match="scores has shape"):
        alg.compute_token_rewards(torch.zeros(3), torch.zeros(2, 3), torch.ones(2, 3), 0.1)


# ---------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------


def test_gae_nemo_aligner_small_example():
    # NeMo-Aligner tests/test_ppo_utils.py::test_calculate_advantage_and_returns_small_example
    values = _t([0.0, 1.0, 2.0, 3.0])
    rewards = _t([0.0, 0.0, 1.0, 0.0])
    adv, ret = alg.compute_gae(rewards, values, torch.ones(1, 4), gamma=0.5, gae_lambda=0.0)
    torch.testing.assert_close(adv, _t([0.5, 0.0, 0.5, -3.0]))
    torch.testing.assert_close(ret, adv + values)


def test_gae_nemo_rl_outcome_example():
    # NeMo-RL GAE hand example: score 5 on the last token, values [1, 2, 3], gamma 1, lambda 0:
    # delta = [0 + 2 - 1, 0 + 3 - 2, 5 + 0 - 3] = [1, 1, 2]
    adv, _ = alg.compute_gae(_t([0.0, 0.0, 5.0]), _t([1.0, 2.0, 3.0]), torch.ones(1, 3), gamma=1.0, gae_lambda=0.0)
    torch.testing.assert_close(adv, _t([1.0, 1.0, 2.0]))


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_values():
    torch.manual_seed(3)
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.ones(4, 6)
    adv, ret = alg.compute_gae(rewards, values, mask, gamma=1.0, gae_lambda=1.0)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, reward_to_go - values)
    torch.testing.assert_close(ret, reward_to_go)


def _slow_gae(rewards, values, lengths, gamma, lam):
    adv = torch.zeros_like(values)
    for b, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


def test_gae_matches_slow_reference_on_ragged_rows_with_garbage_padding():
    torch.manual_seed(4)
    lengths = [9, 1, 4, 7, 6]
    mask = _ragged_mask(lengths, 9)
    rewards, values = torch.randn(5, 9), torch.randn(5, 9)  # padding holds nonzero junk
    adv, ret = alg.compute_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.8)
    expected = _slow_gae(rewards, values, lengths, 0.9, 0.8)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)
    assert torch.all(adv[mask == 0] == 0)


def test_gae_skips_interior_masked_positions():
    # a masked hole (e.g. a tool-output span) is skipped: same result as the compacted row
    rewards, values = _t([0.3, 9.0, -0.2, 1.0]), _t([0.5, 7.0, 0.1, -0.4])
    adv, _ = alg.compute_gae(rewards, values, _t([1.0, 0.0, 1.0, 1.0]), gamma=0.9, gae_lambda=0.7)
    compact, _ = alg.compute_gae(rewards[:, [0, 2, 3]], values[:, [0, 2, 3]], torch.ones(1, 3), 0.9, 0.7)
    torch.testing.assert_close(adv[:, [0, 2, 3]], compact)
    assert adv[0, 1].item() == 0.0


def test_gae_carries_no_gradient_and_checks_ranges():
    values = torch.randn(2, 3, requires_grad=True)
    adv, ret = alg.compute_gae(torch.randn(2, 3), values, torch.ones(2, 3), 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(ValueError, match="gamma=1.5"):
        alg.compute_gae(torch.randn(2, 3), values, torch.ones(2, 3), 1.5, 0.95)
    with pytest.raises(ValueError, match="values has shape"):
        alg.compute_gae(torch.randn(2, 3), torch.randn(2, 4), torch.ones(2, 3), 1.0, 0.95)


# ---------------------------------------------------------------------------------------
# critic-free estimators
# ---------------------------------------------------------------------------------------


def test_rloo_leave_one_out_by_hand():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0])
    mask = _ragged_mask([3, 1, 2, 3], 3)
    adv = alg.compute_rloo_advantages(scores, mask, group_size=4)
    per_seq = torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2])
    torch.testing.assert_close(adv, per_seq[:, None] * mask)


def test_rloo_with_interleaved_group_ids():
    scores = torch.tensor([1.0, 10.0, 3.0, 30.0])
    group_ids = torch.tensor([7, 2, 7, 2])
    adv = alg.compute_rloo_advantages(scores, torch.ones(4, 1), group_ids=group_ids)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-2.0, -20.0, 2.0, 20.0]))


def test_grpo_by_hand():
    # group A scores [1, 3]: mean 2, unbiased std sqrt(2); group B [0, 0, 3]: mean 1, std sqrt(3)
    scores = torch.tensor([1.0, 3.0, 0.0, 0.0, 3.0])
    group_ids = torch.tensor([0, 0, 1, 1, 1])
    mask = _ragged_mask([2, 2, 1, 2, 2], 2)
    adv = alg.compute_grpo_advantages(scores, mask, group_ids=group_ids, eps=0.0)
    s2, s3 = math.sqrt(2), math.sqrt(3)
    per_seq = torch.tensor([-1 / s2, 1 / s2, -1 / s3, -1 / s3, 2 / s3])
    torch.testing.assert_close(adv, per_seq[:, None] * mask)
    no_std = alg.compute_grpo_advantages(scores, mask, group_ids=group_ids, norm_by_std=False)
    torch.testing.assert_close(no_std[:, 0], torch.tensor([-1.0, 1.0, -1.0, -1.0, 2.0]))


def test_grpo_equal_scores_give_zero_advantage():
    adv = alg.compute_grpo_advantages(torch.full((4,), 0.7), torch.ones(4, 3), group_size=2)
    assert torch.all(adv == 0)


@pytest.mark.parametrize("fn", [alg.compute_grpo_advantages, alg.compute_rloo_advantages])
def test_group_estimators_reject_bad_groups(fn):
    scores, mask = torch.randn(4), torch.ones(4, 2)
    with pytest.raises(ValueError, match="n_samples_per_prompt must be >= 2"):
        fn(scores, mask, group_size=1)
    with pytest.raises(ValueError, match="n_samples_per_prompt must be >= 2"):
        fn(scores, mask, group_ids=torch.tensor([0, 0, 0, 1]))
    with pytest.raises(ValueError, match="group_size=3"):
        fn(scores, mask, group_size=3)
    with pytest.raises(ValueError, match="exactly one of group_ids"):
        fn(scores, mask)
    with pytest.raises(ValueError, match="group_ids has shape"):
        fn(scores, mask, group_ids=torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_reinforce_pp_return_to_go_then_whitened():
    scores = torch.tensor([1.0, -1.0, 2.0])
    lengths = [3, 2, 1]
    mask = _ragged_mask(lengths, 3)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.9], [0.6, 9.9, 9.9]])
    adv, ret = alg.compute_reinforce_pp_advantages(scores, kl, mask, kl_coef=0.5, gamma=0.9)
    # slow reference: r_t = -0.5 kl_t (+ score at the last token), G_t = r_t + 0.9 G_{t+1}
    expected = torch.zeros(3, 3)
    for b, n in enumerate(lengths):
        g = 0.0
        for t in reversed(range(n)):
            r = -0.5 * kl[b, t].item() + (scores[b].item() if t == n - 1 else 0.0)
            g = r + 0.9 * g
            expected[b, t] = g
    torch.testing.assert_close(ret, expected)
    kept = expected[mask.bool()]
    torch.testing.assert_close(adv[mask.bool()], (kept - kept.mean()) / kept.std())
    assert torch.all(adv[mask == 0] == 0)


def test_reinforce_pp_baseline_is_invariant_to_per_group_shifts():
    torch.manual_seed(5)
    scores, kl, mask = torch.randn(6), torch.rand(6, 4), _ragged_mask([4, 3, 2, 4, 1, 2], 4)
    shifted = scores + torch.tensor([10.0, 10.0, 10.0, -3.0, -3.0, -3.0])
    a1, _ = alg.compute_reinforce_pp_advantages(scores, kl, mask, 0.1, baseline=True, group_size=3)
    a2, _ = alg.compute_reinforce_pp_advantages(shifted, kl, mask, 0.1, baseline=True, group_size=3)
    torch.testing.assert_close(a1, a2)
    a3, _ = alg.compute_reinforce_pp_advantages(shifted, kl, mask, 0.1)
    assert not torch.allclose(a1, a3)


def test_advantage_registry_names_and_unknown_name():
    assert set(alg.ADVANTAGE_ESTIMATORS) >= {"gae", "grpo", "rloo", "reinforce_pp"}
    with pytest.raises(ValueError, match="'ppo'.*gae, grpo, reinforce_pp, .*rloo"):
        alg.get_advantage_estimator("ppo")


def test_advantage_registry_shared_contract():
    torch.manual_seed(6)
    mask = _ragged_mask([3, 2, 3, 1], 3)
    kwargs = dict(
        scores=torch.randn(4),
        response_mask=mask,
        values=torch.randn(4, 3),
        kl=torch.rand(4, 3),
        kl_coef=0.1,
        gamma=1.0,
        gae_lambda=0.95,
        group_size=2,
    )
    for name in alg.ADVANTAGE_ESTIMATORS:
        adv, ret = alg.get_advantage_estimator(name)(**kwargs)
        assert adv.shape == ret.shape == (4, 3), name
        assert torch.all(adv[mask == 0] == 0), name
    adv, ret = alg.get_advantage_estimator("gae")(**kwargs)
    token_rewards = alg.compute_token_rewards(kwargs["scores"], kwargs["kl"], mask, 0.1)
    exp_adv, exp_ret = alg.compute_gae(token_rewards, kwargs["values"], mask, 1.0, 0.95)
    torch.testing.assert_close(adv, exp_adv)
    torch.testing.assert_close(ret, exp_ret)
    shaped = kwargs["scores"] - 0.1 * (kwargs["kl"] * mask).sum(-1)  # KL in the reward, per sequence
    adv, _ = alg.get_advantage_estimator("rloo")(**kwargs)
    torch.testing.assert_close(adv, alg.compute_rloo_advantages(shaped, mask, group_size=2))
    adv, _ = alg.get_advantage_estimator("grpo")(**kwargs)
    torch.testing.assert_close(adv, alg.compute_grpo_advantages(shaped, mask, group_size=2))
    with pytest.raises(ValueError, match="needs values"):
        alg.get_advantage_estimator("gae")(**{**kwargs, "values": None})


def test_kl_shaped_scores_by_hand():
    scores = torch.tensor([1.0, 2.0])
    kl = _t([0.5, 0.25, 9.0], [1.0, 9.0, 9.0])
    mask = _ragged_mask([2, 1], 3)
    out = alg.kl_shaped_scores(scores, kl, mask, kl_coef=0.2)
    torch.testing.assert_close(out, torch.tensor([1.0 - 0.2 * 0.75, 2.0 - 0.2 * 1.0]))
    assert torch.equal(alg.kl_shaped_scores(scores, kl, mask, kl_coef=0.0), scores)
    assert torch.equal(alg.kl_shaped_scores(scores, None, mask, kl_coef=0.5), scores)


def test_rloo_with_kl_in_reward_matches_trl_formula():
    """TRL RLOOTrainer: rlhf_reward = score - kl_coef * sum_t kl; advantage = rlhf_reward - mean of the others."""
    torch.manual_seed(0)
    k, n_prompts, R = 4, 3, 5
    scores, kl = torch.randn(k * n_prompts), torch.rand(k * n_prompts, R)
    mask = torch.ones(k * n_prompts, R)
    # TRL lays samples out as [k, n_prompts] (sample-major); ours groups contiguously by prompt
    rlhf = (scores - 0.3 * kl.sum(1)).reshape(n_prompts, k).T  # [k, n_prompts]
    expected = (rlhf - (rlhf.sum(0) - rlhf) / (k - 1)).T.reshape(-1)
    adv, _ = alg.get_advantage_estimator("rloo")(scores=scores, response_mask=mask, kl=kl, kl_coef=0.3, group_size=k)
    torch.testing.assert_close(adv[:, 0], expected)


@pytest.mark.parametrize("name", sorted(alg.ADVANTAGE_ESTIMATORS))
def test_kl_coef_changes_the_advantages_of_every_estimator(name):
    """Issue 16: GRPO and RLOO ignored the KL; every estimator must apply the KL in the reward."""
    torch.manual_seed(1)
    mask = _ragged_mask([4, 2, 3, 4, 1, 4], 4)
    kwargs = dict(
        scores=torch.randn(6),
        response_mask=mask,
        values=torch.randn(6, 4),
        kl=torch.rand(6, 4) * mask,
        gamma=1.0,
        gae_lambda=0.95,
        group_size=3,
    )
    estimator = alg.get_advantage_estimator(name)
    without, _ = estimator(**kwargs, kl_coef=0.0)
    with_kl, _ = estimator(**kwargs, kl_coef=0.5)
    assert (with_kl - without).abs().max() > 1e-3, name


def test_kl_loss_is_k3_with_gradient_through_the_policy():
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = _t([-1.5, -2.0, -3.0])
    mask = _t([1.0, 1.0, 0.0])
    loss = alg.kl_loss(log_probs, ref, mask, "k3")
    d = log_probs.detach() - ref
    expected = ((torch.exp(-d) - 1 + d) * mask).sum() / 2
    assert loss.item() == pytest.approx(expected.item())
    loss.backward()
    # d/d(lp) of exp(ref - lp) - 1 + (lp - ref) = 1 - exp(ref - lp), token mean over 2 tokens
    torch.testing.assert_close(log_probs.grad, ((1 - torch.exp(-d)) * mask) / 2)
    assert alg.kl_loss(ref.clone(), ref, mask).item() == 0.0


# ---------------------------------------------------------------------------------------
# policy loss
# ---------------------------------------------------------------------------------------


def test_policy_loss_at_ratio_one_is_minus_mean_advantage():
    torch.manual_seed(7)
    log_probs = torch.randn(3, 4)
    adv = torch.randn(3, 4)
    mask = _ragged_mask([4, 2, 3], 4)
    loss, metrics = alg.policy_loss(log_probs, log_probs.clone(), adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-adv[mask.bool()].mean().item(), rel=1e-6)
    assert metrics["clipfrac"].item() == 0.0
    assert metrics["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)


def test_policy_loss_clipping_zeroes_gradient_where_clipped():
    old = torch.zeros(1, 4)
    # ratios e^0.5 = 1.65 (clipped for A > 0), e^-0.5 = 0.61 (clipped for A < 0),
    # e^0.1 = 1.105 (inside), e^0.5 with A < 0 (unclipped: -A * ratio is the larger)
    log_probs = torch.tensor([[0.5, -0.5, 0.1, 0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    loss, metrics = alg.policy_loss(log_probs, old, adv, torch.ones(1, 4), clip_eps=0.2)
    loss.backward()
    grad = log_probs.grad[0]
    assert grad[0].item() == 0.0 and grad[1].item() == 0.0
    # d/dlp of -A * exp(lp) / 4 tokens
    assert grad[2].item() == pytest.approx(-2.0 * math.exp(0.1) / 4)
    assert grad[3].item() == pytest.approx(1.0 * math.exp(0.5) / 4)
    expected = (-1.2 + 0.8 - 2 * math.exp(0.1) + math.exp(0.5)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)


def test_policy_loss_clip_eps_high_is_asymmetric():
    lp = torch.tensor([[0.25]])  # ratio 1.284
    loss, _ = alg.policy_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    loss, _ = alg.policy_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(-1.2)


def test_policy_loss_dual_clip_bounds_negative_advantages():
    log_probs = torch.tensor([[math.log(10.0), math.log(10.0)]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]])
    loss, metrics = alg.policy_loss(log_probs, torch.zeros(1, 2), adv, torch.ones(1, 2), 0.2, dual_clip=3.0)
    # token 0: max(10, 1.2) = 10 bounded to -A * c = 3; token 1 (A > 0): max(-10, -1.2) = -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    loss.backward()
    assert torch.all(log_probs.grad == 0)
    assert metrics["dual_clipfrac"].item() == pytest.approx(0.5)
    no_dual, _ = alg.policy_loss(log_probs, torch.zeros(1, 2), adv, torch.ones(1, 2), 0.2)
    assert no_dual.item() == pytest.approx((10.0 - 1.2) / 2, rel=1e-5)


@pytest.mark.parametrize("bad", [1.0, 0.5])
def test_policy_loss_dual_clip_must_exceed_one(bad):
    with pytest.raises(ValueError, match=f"dual_clip={bad}.*> 1"):
        alg.policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, dual_clip=bad)


def test_policy_loss_aggregation_modes_by_hand():
    log_probs = torch.zeros(2, 3)
    adv = _t([1.0, 2.0, 3.0], [4.0, 0.0, 0.0])
    mask = _ragged_mask([3, 1], 3)
    token_mean, _ = alg.policy_loss(log_probs, log_probs, adv, mask, 0.2, loss_agg="token-mean")
    seq_mean, _ = alg.policy_loss(log_probs, log_probs, adv, mask, 0.2, loss_agg="seq-mean-token-mean")
    seq_sum, _ = alg.policy_loss(log_probs, log_probs, adv, mask, 0.2, loss_agg="seq-mean-token-sum")
    assert token_mean.item() == pytest.approx(-10 / 4)
    assert seq_mean.item() == pytest.approx(-(2 + 4) / 2)
    assert seq_sum.item() == pytest.approx(-(6 + 4) / 2)
    with pytest.raises(ValueError, match="'sum'.*seq-mean-token-mean, seq-mean-token-sum, token-mean"):
        alg.policy_loss(log_probs, log_probs, adv, mask, 0.2, loss_agg="sum")


def test_seq_mean_modes_leave_out_rows_without_response_tokens():
    loss_mat = _t([1.0, 2.0, 3.0], [7.0, 7.0, 7.0], [4.0, 0.0, 0.0])
    mask = _ragged_mask([3, 0, 1], 3)
    assert alg.aggregate_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert alg.aggregate_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert alg.aggregate_loss(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert alg.aggregate_loss(loss_mat, torch.zeros(3, 3), "seq-mean-token-sum").item() == 0.0


@pytest.mark.parametrize("mode", alg.LOSS_AGG_MODES)
def test_aggregate_loss_is_exact_over_parts(mode):
    """Each part adds aggregate * count; dividing by the whole batch's count gives the whole batch's loss
    (how ppo_update aggregates over micro-batches and dp ranks)."""
    torch.manual_seed(3)
    loss_mat = torch.randn(6, 5)
    mask = _ragged_mask([5, 0, 2, 4, 1, 3], 5)
    whole = alg.aggregate_loss(loss_mat, mask, mode)
    parts = sum(
        alg.aggregate_loss(loss_mat[i : i + 2], mask[i : i + 2], mode) * alg.loss_agg_count(mask[i : i + 2], mode) for i in (0, 2, 4)
    )
    torch.testing.assert_close(parts / alg.loss_agg_count(mask, mode), whole)


def test_policy_loss_is_weights_multiply_per_token_loss():
    log_probs = torch.zeros(1, 2)
    adv = _t([1.0, 1.0])
    w = _t([0.5, 2.0])
    loss, _ = alg.policy_loss(log_probs, log_probs, adv, torch.ones(1, 2), 0.2, is_weights=w)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    with pytest.raises(ValueError, match="is_weights has shape"):
        alg.policy_loss(log_probs, log_probs, adv, torch.ones(1, 2), 0.2, is_weights=torch.ones(2, 2))


# ---------------------------------------------------------------------------------------
# value loss and entropy
# ---------------------------------------------------------------------------------------


def test_value_loss_clipped_by_hand():
    values = torch.tensor([[1.5, 0.0, 0.95]], requires_grad=True)
    old_values = _t([1.0, 0.0, 1.0])
    returns = _t([2.0, 1.0, 0.0])
    loss, metrics = alg.value_loss(values, old_values, returns, torch.ones(1, 3), value_clip_eps=0.2)
    # token 0: v clipped to 1.2; (1.5-2)^2 = .25 vs (1.2-2)^2 = .64 -> .64 (clipped branch, no grad)
    # token 1: unchanged, (0-1)^2 = 1; token 2: inside the clip range, .95^2 = .9025
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0 + 0.9025) / 3, rel=1e-6)
    assert metrics["value_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert values.grad[0, 0].item() == 0.0
    assert values.grad[0, 1].item() == pytest.approx((0.0 - 1.0) / 3)
    unclipped, _ = alg.value_loss(values, old_values, returns, torch.ones(1, 3), value_clip_eps=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 1.0 + 0.9025) / 3, rel=1e-6)


def test_value_loss_ignores_padding():
    values, old_values = _t([1.0, 100.0]), _t([1.0, -100.0])
    loss, _ = alg.value_loss(values, old_values, _t([3.0, 0.0]), _t([1.0, 0.0]), value_clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 * 4.0)


# ---------------------------------------------------------------------------------------
# truncated importance sampling and rollout mismatch
# ---------------------------------------------------------------------------------------


def test_truncated_is_weights_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    rollout = _t([0.0, -1.0, 0.5, -0.2])
    mask = _t([1.0, 1.0, 1.0, 0.0])
    w = alg.truncated_is_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, _t([1.0, 2.0, math.exp(-0.5), 0.0]))  # e^1 = 2.72 capped at 2
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap=0"):
        alg.truncated_is_weights(old, rollout, mask, cap=0)


def test_rollout_mismatch_metrics_by_hand():
    old = _t([0.0, 0.0, 0.0, 0.0])
    rollout = _t([0.05, -0.3, 0.0, 5.0])  # last token is padding
    mask = _t([1.0, 1.0, 1.0, 0.0])
    m = alg.rollout_mismatch_metrics(rollout, old, mask)
    assert m["log_probs_abs_diff_mean"].item() == pytest.approx(0.35 / 3)
    assert m["log_probs_abs_diff_max"].item() == pytest.approx(0.3)
    # ratios: e^-0.05 = 0.951 (inside), e^0.3 = 1.35 (outside), 1 (inside)
    assert m["ratio_out_of_range_frac"].item() == pytest.approx(1 / 3)
    assert "moe_routing_mismatch" not in m  # a dense policy: no expert ids


def test_rollout_mismatch_metrics_count_moe_routing_by_hand():
    """(response token, layer) pairs whose top-k expert sets differ, order within k ignored, padding left out."""
    old_lp, mask = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]])
    rollout = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[5, 6], [5, 6]]]])  # [B=1, R=3, L=2, k=2]
    # token 0: the same sets; token 1: layer 1 differs; token 2 is padding
    old = torch.tensor([[[[1, 0], [2, 3]], [[0, 1], [2, 4]], [[0, 1], [0, 1]]]])
    m = alg.rollout_mismatch_metrics(old_lp, old_lp, mask, rollout_experts=rollout, old_experts=old)
    assert m["moe_routing_mismatch"] == pytest.approx(1 / 4)
    assert alg.routing_mismatch(rollout, old, mask) == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="must agree"):
        alg.routing_mismatch(rollout, old[:, :2], mask)


# ---------------------------------------------------------------------------------------
# reward standardization
# ---------------------------------------------------------------------------------------


def test_standardize_scores():
    out = alg.standardize_scores(torch.tensor([3.0, -1.0]), mean=1.0, std=2.0, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="std=-1"):
        alg.standardize_scores(torch.zeros(2), 0.0, -1.0)


def test_masked_whiten_uses_the_unbiased_variance_as_trl_not_nemo_aligner():
    """The docstring's claim: TRL's unbiased variance; NeMo-Aligner's biased one differs by sqrt((n-1)/n)."""
    x = _t([1.0, 2.0, 4.0, 9.0])
    mask = torch.ones(1, 4)
    ours = alg.masked_whiten(x, mask, eps=0.0)
    torch.testing.assert_close(ours, (x - x.mean()) / x.std(unbiased=True))
    nemo = (x - x.mean()) / x.std(unbiased=False)
    torch.testing.assert_close(nemo * (3 / 4) ** 0.5, ours)


def test_k3_clamp_biases_large_reference_excess_low():
    """The docstring's claim: k3 is clamped at 10, so d < -2.6 contributes less than the formula."""
    d = torch.tensor([[-5.0, -1.0, 0.0, 3.0]])
    k3 = alg.kl_penalty(d, torch.zeros_like(d), "k3")
    exact = torch.exp(-d) - 1 + d
    assert k3[0, 0].item() == 10.0 and exact[0, 0].item() > 140
    torch.testing.assert_close(k3[:, 1:], exact[:, 1:])


def test_overlong_penalty_is_dapos_soft_punishment():
    """DAPO eq. 13 (Yu et al. 2025) written out: 0 up to L_max - L_cache, then a linear ramp to -1 at
    L_max (a response cut at the budget), times the factor."""
    l_max, l_cache, factor = 256, 64, 0.5
    lengths = torch.tensor([0, 100, 192, 193, 224, 255, 256])

    def dapo(n: int) -> float:
        if n <= l_max - l_cache:
            return 0.0
        if n <= l_max:
            return ((l_max - l_cache) - n) / l_cache
        return -1.0

    want = torch.tensor([factor * dapo(int(n)) for n in lengths])
    got = alg.overlong_penalty(lengths, l_max, l_cache, factor)
    torch.testing.assert_close(got, want)
    assert got[-1] == -factor and got[2] == 0 and got.dtype == torch.float32
    assert alg.overlong_penalty(torch.tensor([256]), 256, 256)[0] == -1.0  # the buffer may span the whole budget
    for bad in (dict(buffer=0), dict(buffer=257), dict(factor=-1.0)):
        kw = {"buffer": 64, "factor": 1.0, **bad}
        with pytest.raises(ValueError, match="buffer|factor"):
            alg.overlong_penalty(lengths, 256, kw["buffer"], kw["factor"])
    with pytest.raises(ValueError, match="response_lengths"):
        alg.overlong_penalty(torch.tensor([-1]), 256, 64)


def test_non_stop_scores_replace_the_scores_of_responses_cut_at_the_budget():
    """Tülu 3's non-stop penalty written out: score where the response ended, the value elsewhere."""
    scores = torch.tensor([0.5, 1.0, 0.25, 0.0])
    ended = torch.tensor([True, False, True, False])
    got = alg.non_stop_scores(scores, ended, -10.0)
    torch.testing.assert_close(got, torch.tensor([0.5, -10.0, 0.25, -10.0]))
    assert alg.non_stop_scores(scores, torch.ones(4, dtype=torch.bool), 0.0).equal(scores)
    with pytest.raises(ValueError, match="shape"):
        alg.non_stop_scores(scores, ended[:3], 0.0)
