"""PPO policy / value / KL losses and their aggregation, truncated importance sampling against the rollout engine, reward standardization."""

from __future__ import annotations

from typing import Optional

import torch

from aligner.algorithms.core import _LOG_RATIO_CLAMP, Tensor, _check_ndim, _check_same_shape, _float_mask, _unknown, masked_mean, masked_sum
from aligner.algorithms.kl import kl_penalty

# ----------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def loss_agg_count(response_mask: Tensor, loss_agg: str = "token-mean") -> Tensor:
    """The denominator of :func:`aggregate_loss`: response tokens ("token-mean") or sequences
    with at least one response token (the two "seq-mean" modes).

    A loss over several micro-batches or data-parallel ranks is exact when each part adds
    ``aggregate_loss(part) * loss_agg_count(part)`` and the total is divided by the count
    of the whole batch.

    Args:
        response_mask: [B, R].
        loss_agg: one of ``LOSS_AGG_MODES``.

    Returns:
        0-dim float tensor.
    """
    if loss_agg not in LOSS_AGG_MODES:
        raise _unknown("loss_agg", loss_agg, LOSS_AGG_MODES)
    _check_ndim("response_mask", response_mask, 2, "[B, R]")
    mask = response_mask.float()
    return mask.sum() if loss_agg == "token-mean" else (mask.sum(-1) > 0).float().sum()


def aggregate_loss(loss_mat: Tensor, response_mask: Tensor, loss_agg: str = "token-mean") -> Tensor:
    """Reduce a per-token loss to a scalar (verl ``agg_loss``).

    - "token-mean": mean over all response tokens of the batch (PPO as in most RLHF code).
    - "seq-mean-token-mean": mean over sequences of each sequence's token mean (GRPO as
      written in Shao et al. 2024).
    - "seq-mean-token-sum": mean over sequences of each sequence's token sum (Dr. GRPO,
      Liu et al. 2025, "Understanding R1-Zero-Like Training", without its constant length
      normalizer).

    Sequences with no response token are left out of both "seq-mean" modes (verl counts
    them in "seq-mean-token-sum"); an empty batch gives 0.

    Args:
        loss_mat: [B, R] float per-token loss.
        response_mask: [B, R].
        loss_agg: one of ``LOSS_AGG_MODES``.

    Returns:
        0-dim tensor.
    """
    count = loss_agg_count(response_mask, loss_agg)
    _check_ndim("loss_mat", loss_mat, 2, "[B, R]")
    _check_same_shape("loss_mat", loss_mat, response_mask=response_mask)
    if loss_agg == "token-mean":
        total = masked_sum(loss_mat, response_mask)
    elif loss_agg == "seq-mean-token-sum":
        total = masked_sum(loss_mat, response_mask, dim=-1).sum()
    else:
        total = masked_mean(loss_mat, response_mask, dim=-1).sum()
    return total / count.to(total.dtype).clamp_min(1.0)


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    estimator: str = "k3",
    loss_agg: str = "token-mean",
) -> Tensor:
    """KL(pi || pi_ref) as a loss term, with gradient through ``log_probs``.

    The GRPO form (Shao et al. 2024, DeepSeekMath eq. 3-4: ``beta * k3`` added to the
    per-token objective; TRL ``GRPOTrainer`` ``beta``; verl ``use_kl_loss`` with
    ``kl_loss_type``): the per-token estimate of :func:`kl_penalty`, aggregated like the
    policy loss. The caller adds ``kl_loss_coef *`` it to the policy loss.

    Args:
        log_probs: [B, R] float, current policy log-probs (with gradient).
        ref_log_probs: [B, R] float, the reference policy's log-probs of the same tokens.
        response_mask: [B, R].
        estimator: a key of ``KL_ESTIMATORS`` ("k3" in DeepSeekMath and TRL).
        loss_agg: one of ``LOSS_AGG_MODES``.

    Returns:
        0-dim tensor.
    """
    return aggregate_loss(kl_penalty(log_probs, ref_log_probs.detach(), estimator), response_mask, loss_agg)


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_eps: float,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    loss_agg: str = "token-mean",
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017), with dual clip and TIS weights.

    ``ratio = exp(log_probs - old_log_probs)``; per token
    ``l = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))``.
    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"):
    for ``A < 0``, ``l = min(l, -A * dual_clip)``. Truncated importance-sampling weights
    (Yao et al. 2025) multiply ``l``. Then aggregated by ``loss_agg``.

    Args:
        log_probs: [B, R] float, current policy log-probs (with gradient).
        old_log_probs: [B, R] float, log-probs of the policy that collected the batch.
        advantages: [B, R] float.
        response_mask: [B, R].
        clip_eps: lower clip (and upper, unless ``clip_eps_high`` is set), > 0.
        clip_eps_high: upper clip (DAPO "clip-higher", Yu et al. 2025, arXiv:2503.14476);
            None = ``clip_eps``.
        dual_clip: dual-clip bound c > 1; None = off.
        loss_agg: one of ``LOSS_AGG_MODES``.
        is_weights: [B, R] float, e.g. :func:`truncated_is_weights`; None = 1.

    Returns:
        loss: 0-dim tensor.
        metrics: detached 0-dim tensors "clipfrac" (fraction of tokens where the clipped
        term is active), "dual_clipfrac", "approx_kl" (k3 estimate of KL(old || new)),
        "ratio_mean".
    """
    _check_ndim("log_probs", log_probs, 2, "[B, R]")
    _check_same_shape(
        "log_probs",
        log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        response_mask=response_mask,
        is_weights=is_weights,
    )
    if not clip_eps > 0:
        raise ValueError(f"clip_eps={clip_eps!r} is invalid: must be > 0 (e.g. 0.2)")
    if clip_eps_high is not None and not clip_eps_high > 0:
        raise ValueError(f"clip_eps_high={clip_eps_high!r} is invalid: must be > 0 (e.g. 0.28) or None")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip={dual_clip!r} is invalid: must be > 1 (e.g. 3.0) or None")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    advantages = advantages.detach()
    log_ratio = (log_probs - old_log_probs.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(loss_mat, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss_mat > bound)
        loss_mat = torch.where(dual_active, bound, loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, response_mask, loss_agg)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).to(log_probs.dtype), response_mask),
            "dual_clipfrac": masked_mean(dual_active.to(log_probs.dtype), response_mask),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    value_clip_eps: Optional[float],
    loss_agg: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO2 baselines; NeMo-Aligner ``PPOCritic``; verl ``compute_value_loss``).

    ``v_clip = old_values + clip(values - old_values, -value_clip_eps, value_clip_eps)``;
    per token ``0.5 * max((values - returns)^2, (v_clip - returns)^2)``;
    ``value_clip_eps=None`` gives the unclipped ``0.5 * (values - returns)^2``.

    Args:
        values: [B, R] float, current critic values (with gradient).
        old_values: [B, R] float, the values recorded at rollout time.
        returns: [B, R] float, value targets (e.g. from :func:`compute_gae`).
        response_mask: [B, R].
        value_clip_eps: clip range, > 0, or None.
        loss_agg: one of ``LOSS_AGG_MODES``.

    Returns:
        loss: 0-dim tensor.
        metrics: detached 0-dim tensors "value_clipfrac" (fraction of tokens where the
        clipped term is the larger), "values_mean", "value_error" (masked mean of
        ``(values - returns)^2``).
    """
    _check_ndim("values", values, 2, "[B, R]")
    _check_same_shape("values", values, old_values=old_values, returns=returns, response_mask=response_mask)
    if value_clip_eps is not None and not value_clip_eps > 0:
        raise ValueError(f"value_clip_eps={value_clip_eps!r} is invalid: must be > 0 (e.g. 0.2) or None")
    returns = returns.detach()
    unclipped = (values - returns).square()
    loss_mat = unclipped
    clipped_active = torch.zeros_like(unclipped, dtype=torch.bool)
    if value_clip_eps is not None:
        old_values = old_values.detach()
        v_clip = old_values + (values - old_values).clamp(-value_clip_eps, value_clip_eps)
        clipped = (v_clip - returns).square()
        clipped_active = clipped > unclipped
        loss_mat = torch.maximum(unclipped, clipped)
    loss = 0.5 * aggregate_loss(loss_mat, response_mask, loss_agg)
    with torch.no_grad():
        metrics = {
            "value_clipfrac": masked_mean(clipped_active.to(values.dtype), response_mask),
            "values_mean": masked_mean(values, response_mask),
            "value_error": masked_mean(unclipped, response_mask),
        }
    return loss, metrics


# ----------------------------------------------------------------------------------------
# rollout / trainer mismatch (Yao et al. 2025, "Your efficient RL framework secretly
# brings you off-policy RL training"; verl tis_imp_ratio_cap)
# ----------------------------------------------------------------------------------------


def truncated_is_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights ``min(exp(old_log_probs - rollout_log_probs), cap)``.

    Corrects for the rollout engine sampling from a slightly different distribution
    than the trainer's policy (Yao et al. 2025; verl ``tis_imp_ratio_cap``).

    Args:
        old_log_probs: [B, R] float, trainer-recomputed log-probs of the rollout policy.
        rollout_log_probs: [B, R] float, log-probs reported by the rollout engine.
        response_mask: [B, R].
        cap: truncation cap, > 0 (e.g. 2.0).

    Returns:
        is_weights: [B, R], detached, 0 on padding.
    """
    _check_ndim("old_log_probs", old_log_probs, 2, "[B, R]")
    _check_same_shape("old_log_probs", old_log_probs, rollout_log_probs=rollout_log_probs, response_mask=response_mask)
    if not cap > 0:
        raise ValueError(f"cap={cap!r} is invalid: the importance-weight cap must be > 0 (e.g. 2.0)")
    with torch.no_grad():
        log_ratio = (old_log_probs - rollout_log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        weights = torch.exp(log_ratio).clamp(max=cap)
        return weights * _float_mask(response_mask, weights)


def rollout_mismatch_metrics(rollout_log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the trainer's, over response tokens.

    Args:
        rollout_log_probs: [B, R] float, from the rollout engine.
        old_log_probs: [B, R] float, recomputed by the trainer.
        response_mask: [B, R].

    Returns:
        Detached 0-dim tensors: "log_probs_abs_diff_mean", "log_probs_abs_diff_max"
        (of ``|old_log_probs - rollout_log_probs|``) and "ratio_out_of_range_frac"
        (fraction of tokens with ``exp(old - rollout)`` outside [0.9, 1.1]).
    """
    _check_ndim("rollout_log_probs", rollout_log_probs, 2, "[B, R]")
    _check_same_shape("rollout_log_probs", rollout_log_probs, old_log_probs=old_log_probs, response_mask=response_mask)
    with torch.no_grad():
        diff = (old_log_probs - rollout_log_probs).float()
        keep = response_mask > 0
        abs_diff = diff.abs()
        ratio = torch.exp(diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        outside = ((ratio < 0.9) | (ratio > 1.1)).float()
        return {
            "log_probs_abs_diff_mean": masked_mean(abs_diff, keep),
            "log_probs_abs_diff_max": torch.where(keep, abs_diff, 0.0).max(),
            "ratio_out_of_range_frac": masked_mean(outside, keep),
        }


# ----------------------------------------------------------------------------------------
# reward standardization
# ----------------------------------------------------------------------------------------


def standardize_scores(scores: Tensor, mean: float, std: float, eps: float = 1e-8) -> Tensor:
    """``(scores - mean) / (std + eps)`` with a reward model's saved statistics (NeMo-Aligner
    ``reward_standardization``).

    Args:
        scores: [B] float, raw reward-model scores.
        mean: mean of the reward model's scores on its calibration data.
        std: their standard deviation, >= 0.
        eps: added to ``std``.

    Returns:
        rewards: [B], dtype of ``scores``.
    """
    if not std >= 0:
        raise ValueError(f"std={std!r} is invalid: a standard deviation must be >= 0")
    return (scores - mean) / (std + eps)
