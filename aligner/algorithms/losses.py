"""PPO policy / value / KL losses and their aggregation, truncated importance sampling against the rollout engine,
the decoupled PPO loss and staleness metrics for samples from stale weights, reward standardization."""

from __future__ import annotations

import math
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


def rollout_mismatch_metrics(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    response_mask: Tensor,
    *,
    rollout_experts: Optional[Tensor] = None,
    old_experts: Optional[Tensor] = None,
) -> dict[str, Tensor | float]:
    """How far the rollout engine's log-probs are from the trainer's, over response tokens.

    Args:
        rollout_log_probs: [B, R] float, from the rollout engine.
        old_log_probs: [B, R] float, recomputed by the trainer.
        response_mask: [B, R].
        rollout_experts, old_experts: [B, R, L, k] integer expert ids of a Mixture-of-Experts policy, the
            engine's and the trainer's (:func:`routing_mismatch`); None for a dense one.

    Returns:
        Detached 0-dim tensors: "log_probs_abs_diff_mean", "log_probs_abs_diff_max"
        (of ``|old_log_probs - rollout_log_probs|``) and "ratio_out_of_range_frac"
        (fraction of tokens with ``exp(old - rollout)`` outside [0.9, 1.1]); with both expert tensors
        also "moe_routing_mismatch", a python float (:func:`routing_mismatch`).
    """
    _check_ndim("rollout_log_probs", rollout_log_probs, 2, "[B, R]")
    _check_same_shape("rollout_log_probs", rollout_log_probs, old_log_probs=old_log_probs, response_mask=response_mask)
    with torch.no_grad():
        diff = (old_log_probs - rollout_log_probs).float()
        keep = response_mask > 0
        abs_diff = diff.abs()
        ratio = torch.exp(diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        outside = ((ratio < 0.9) | (ratio > 1.1)).float()
        out: dict[str, Tensor | float] = {
            "log_probs_abs_diff_mean": masked_mean(abs_diff, keep),
            "log_probs_abs_diff_max": torch.where(keep, abs_diff, 0.0).max(),
            "ratio_out_of_range_frac": masked_mean(outside, keep),
        }
    if rollout_experts is not None and old_experts is not None:
        out["moe_routing_mismatch"] = routing_mismatch(rollout_experts, old_experts, response_mask)
    return out


def routing_mismatch(rollout_experts: Tensor, old_experts: Tensor, response_mask: Tensor) -> float:
    """Fraction of (response token, MoE layer) pairs whose top-k expert SETS differ between the
    rollout engine and the trainer (NeMo-RL / verl report such routing differences as a source of
    the engine / trainer log-prob mismatch; verl's "routing replay" removes them).

    rollout_experts, old_experts: [B, R, L, k] integer expert ids (the engine's
    ``Generation.routed_experts`` and the trainer's :meth:`aligner.actor.policy.Policy.log_probs_with_routing`),
    compared after sorting along k; response_mask: [B, R] (1 on response tokens). Returns a python
    float in [0, 1] (0.0 when no token is masked in). Raises ValueError on shape disagreement.
    """
    if rollout_experts.shape != old_experts.shape or rollout_experts.shape[:2] != response_mask.shape:
        raise ValueError(
            f"routing_mismatch: rollout_experts {tuple(rollout_experts.shape)}, old_experts {tuple(old_experts.shape)} "
            f"and response_mask {tuple(response_mask.shape)} must agree as [B, R, L, k] / [B, R]"
        )
    a, b = rollout_experts.long().sort(-1).values, old_experts.long().sort(-1).values
    differ = (a != b).any(-1).float()  # [B, R, L]
    keep = (response_mask > 0).unsqueeze(-1).expand_as(differ)
    n = int(keep.sum())
    return float(differ[keep].sum()) / n if n else 0.0


# ----------------------------------------------------------------------------------------
# off-policy correction for bounded staleness (Fu et al. 2025, AReaL, arXiv:2505.24298,
# section 5.2; Hilton et al. 2022, "Batch size-invariance for policy optimization")
# ----------------------------------------------------------------------------------------


def _check_behavior_weight_cap(behavior_weight_cap: Optional[float]) -> None:
    if behavior_weight_cap is not None and not behavior_weight_cap > 1.0:
        raise ValueError(
            f"behavior_weight_cap={behavior_weight_cap!r} is invalid: must be > 1 (e.g. 5.0) or None; "
            "tokens whose behaviour weight pi_prox / pi_behav exceeds it are left out of the loss"
        )


def _behavior_weights(proximal_log_probs: Tensor, behavior_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """``exp(proximal_log_probs - behavior_log_probs)`` on response tokens, 0 on padding, detached
    (:func:`truncated_is_weights` with no truncation)."""
    return truncated_is_weights(proximal_log_probs, behavior_log_probs, response_mask, cap=math.inf)


def decoupled_policy_loss(
    log_probs: Tensor,
    proximal_log_probs: Tensor,
    behavior_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_eps: float,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    behavior_weight_cap: Optional[float] = None,
    loss_agg: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO loss for samples generated by stale weights (AReaL, Fu et al. 2025).

    The objective of AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
    Reinforcement Learning System for Language Reasoning", arXiv:2505.24298, section 5.2,
    eq. 5), the decoupled PPO of Hilton et al. 2022 ("Batch size-invariance for policy
    optimization", arXiv:2110.00641) applied per token::

        J(theta) = E_{a_t ~ pi_behav} [ sum_t  w_t * min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t) ]
        w_t = pi_prox(a_t) / pi_behav(a_t)      (behaviour weight, no gradient)
        r_t = pi_theta(a_t) / pi_prox(a_t)

    ``pi_behav`` is the policy that generated each token (the possibly stale weights the
    rollout engine held; its log-probs are the ones the engine reported), ``pi_prox`` the
    proximal policy: the trainer's weights before this update, i.e. the recomputed
    ``old_log_probs``. The trust region is centred on ``pi_prox`` and the lag between
    ``pi_behav`` and ``pi_prox`` is corrected by importance weighting instead of clipping.

    What is computed: per token ``l_t = w_t * l^PPO_t``, where ``l^PPO_t`` is the per-token
    loss of :func:`policy_loss` with ``old_log_probs = proximal_log_probs`` (asymmetric
    clip ``clip_eps`` / ``clip_eps_high``, and the dual clip when set, applied before the
    weight, as AReaL ``ppo_actor_loss_fn``), then aggregated by ``loss_agg`` over all
    response tokens. In fact the loss *is* ``policy_loss(..., is_weights=w)``. With
    ``behavior_weight_cap = C``, tokens with ``w_t > C`` get weight 0 (masked, not
    truncated to C, as AReaL ``behav_imp_weight_cap``: "we filter out the tokens where
    behav_imp_weight exceeds behav_imp_weight_cap"); they stay in the denominator of
    ``loss_agg`` (AReaL divides by the count of all response tokens too).

    Reduction: when ``behavior_log_probs == proximal_log_probs`` (no staleness and no
    engine/trainer mismatch) every ``w_t = exp(0) = 1`` exactly and the loss equals
    :func:`policy_loss` bit for bit. The weight also absorbs the rollout engine's
    numerical mismatch (``pi_behav`` is the engine's distribution), so truncated
    importance sampling (:func:`truncated_is_weights`, Yao et al. 2025) is not applied on
    top; the mismatch metrics stay :func:`rollout_mismatch_metrics` of the same two
    log-prob tensors.

    Args:
        log_probs: [B, R] float, current policy log-probs in nats (with gradient).
        proximal_log_probs: [B, R] float, log-probs of the same tokens under the weights
            before this update (the recomputed ``old_log_probs``); no gradient flows into it.
        behavior_log_probs: [B, R] float, log-probs the rollout engine recorded when it
            generated each token (each token under the weight version that produced it);
            no gradient flows into it.
        advantages: [B, R] float.
        response_mask: [B, R] 1.0 / True on response tokens.
        clip_eps: lower clip (and upper, unless ``clip_eps_high`` is set), > 0.
        clip_eps_high: upper clip (DAPO clip-higher); None = ``clip_eps``.
        dual_clip: dual-clip bound c > 1 (Ye et al. 2020); None = off.
        behavior_weight_cap: C > 1: tokens with ``pi_prox / pi_behav > C`` are left out of
            the loss; None = keep every token.
        loss_agg: one of ``LOSS_AGG_MODES``.

    Returns:
        loss: 0-dim tensor, dtype of ``log_probs``.
        metrics: detached 0-dim tensors: those of :func:`policy_loss` ("clipfrac",
        "dual_clipfrac", "approx_kl", "ratio_mean", all of ``r_t = pi_theta / pi_prox``)
        and those of :func:`policy_lag_metrics`.

    Raises:
        ValueError: a tensor is not [B, R] or not the shape of ``log_probs`` (naming it),
            ``clip_eps`` / ``clip_eps_high`` <= 0, ``dual_clip`` <= 1,
            ``behavior_weight_cap`` <= 1, unknown ``loss_agg``.
    """
    _check_ndim("log_probs", log_probs, 2, "[B, R]")
    _check_same_shape(
        "log_probs",
        log_probs,
        proximal_log_probs=proximal_log_probs,
        behavior_log_probs=behavior_log_probs,
        advantages=advantages,
        response_mask=response_mask,
    )
    _check_behavior_weight_cap(behavior_weight_cap)
    if loss_agg not in LOSS_AGG_MODES:
        raise _unknown("loss_agg", loss_agg, LOSS_AGG_MODES)
    weights = _behavior_weights(proximal_log_probs, behavior_log_probs, response_mask)
    if behavior_weight_cap is not None:
        weights = torch.where(weights > behavior_weight_cap, torch.zeros_like(weights), weights)
    loss, metrics = policy_loss(
        log_probs,
        proximal_log_probs,
        advantages,
        response_mask,
        clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
        loss_agg=loss_agg,
        is_weights=weights,
    )
    metrics.update(policy_lag_metrics(proximal_log_probs, behavior_log_probs, response_mask, behavior_weight_cap))
    return loss, metrics


def policy_lag_metrics(
    proximal_log_probs: Tensor,
    behavior_log_probs: Tensor,
    response_mask: Tensor,
    behavior_weight_cap: Optional[float] = None,
) -> dict[str, Tensor]:
    """The behaviour weights ``w = pi_prox / pi_behav`` of :func:`decoupled_policy_loss`, over response tokens.

    Args:
        proximal_log_probs: [B, R] float, the trainer's log-probs before the update.
        behavior_log_probs: [B, R] float, the rollout engine's log-probs of the same tokens.
        response_mask: [B, R].
        behavior_weight_cap: the loss's cap C > 1, or None.

    Returns:
        Detached 0-dim float tensors:
        "behavior_weight_mean", "behavior_weight_max", "behavior_weight_min" (of ``w``
        before the cap; ``|log w|`` is clamped at 20 as everywhere in this package);
        "behavior_weight_capped_frac" (fraction of response tokens with ``w > C``, which the
        loss leaves out; 0 when C is None);
        "behavior_approx_kl" (k3 estimate of KL(pi_behav || pi_prox) on the sampled tokens,
        ``w - 1 - log w``, :func:`kl_penalty` "k3", masked mean).
        All 0 when no token is a response token. The log-prob mismatch metrics are
        :func:`rollout_mismatch_metrics` ``(behavior_log_probs, proximal_log_probs, response_mask)``.

    Raises:
        ValueError: shape mismatch (naming the tensor), ``behavior_weight_cap`` <= 1.
    """
    _check_ndim("proximal_log_probs", proximal_log_probs, 2, "[B, R]")
    _check_same_shape("proximal_log_probs", proximal_log_probs, behavior_log_probs=behavior_log_probs, response_mask=response_mask)
    _check_behavior_weight_cap(behavior_weight_cap)
    with torch.no_grad():
        weights = _behavior_weights(proximal_log_probs, behavior_log_probs, response_mask).float()
        keep = response_mask > 0
        capped = weights > behavior_weight_cap if behavior_weight_cap is not None else torch.zeros_like(keep)
        kl = kl_penalty(behavior_log_probs.float(), proximal_log_probs.float(), "k3")
        return {
            "behavior_weight_mean": masked_mean(weights, keep),
            "behavior_weight_max": torch.where(keep, weights, 0.0).max() if weights.numel() else weights.new_zeros(()),
            "behavior_weight_min": torch.where(keep, weights, math.inf).min().nan_to_num(posinf=0.0)
            if weights.numel()
            else weights.new_zeros(()),
            "behavior_weight_capped_frac": masked_mean((capped & keep).float(), keep),
            "behavior_approx_kl": masked_mean(kl, keep),
        }


def staleness_metrics(weight_versions: Tensor, current_version: int, response_mask: Optional[Tensor] = None) -> dict[str, Tensor]:
    """How many weight updates behind the trainer each sample (or token) was generated.

    Staleness is ``current_version - weight_version``, in weight versions (optimizer steps
    between weight syncs): 0 for on-policy data, at most ``trainer.max_staleness`` under
    AReaL's staleness control (Fu et al. 2025, section 5.1, "max staleness" eta).

    Args:
        weight_versions: int tensor, the weight version that generated each sample, [B];
            or each token, [B, R], for rollouts interrupted by a weight update (AReaL's
            partial rollouts: every token records its version), with ``response_mask``.
        current_version: int >= 0, the trainer's weight version this batch updates.
        response_mask: [B, R], required with per-token versions, None with [B].

    Returns:
        Detached 0-dim float32 tensors "staleness_mean" (over samples, or over response
        tokens for [B, R]) and "staleness_max"; both 0 for an empty batch.

    Raises:
        ValueError: ``weight_versions`` is not an integer tensor of shape [B] or [B, R],
            ``response_mask`` missing for [B, R] (or given for [B], or of another shape),
            ``current_version`` < 0, or a version newer than ``current_version``
            (negative staleness: the versions are mislabelled).
    """
    if weight_versions.dtype.is_floating_point or weight_versions.dtype.is_complex or weight_versions.dtype == torch.bool:
        raise ValueError(f"weight_versions has dtype {weight_versions.dtype}, expected an integer tensor (e.g. torch.int64)")
    if not (isinstance(current_version, int) and not isinstance(current_version, bool)) or current_version < 0:
        raise ValueError(f"current_version={current_version!r} is invalid: must be an int >= 0 (the trainer's weight version)")
    if weight_versions.dim() == 1:
        if response_mask is not None:
            raise ValueError("response_mask is given with per-sample weight_versions [B]: pass it only with per-token versions [B, R]")
        keep = torch.ones_like(weight_versions, dtype=torch.bool)
    elif weight_versions.dim() == 2:
        if response_mask is None:
            raise ValueError("weight_versions is per token [B, R]: pass response_mask [B, R] too")
        _check_same_shape("weight_versions", weight_versions, response_mask=response_mask)
        keep = response_mask > 0
    else:
        raise ValueError(f"weight_versions has shape {list(weight_versions.shape)}, expected [B] or [B, R]")
    with torch.no_grad():
        staleness = (current_version - weight_versions).to(torch.float32)
        if bool((keep & (staleness < 0)).any()):
            newest = int(weight_versions[keep].max())
            raise ValueError(
                f"weight_versions holds version {newest}, newer than current_version={current_version}: "
                "a sample cannot come from weights the trainer has not produced yet"
            )
        return {
            "staleness_mean": masked_mean(staleness, keep),
            "staleness_max": torch.where(keep, staleness, 0.0).max() if staleness.numel() else staleness.new_zeros(()),
        }


def mixed_version_fraction(weight_versions: Tensor, response_mask: Tensor) -> Tensor:
    """The fraction of samples whose response tokens span more than one weight version.

    A sample generated while a weight sync landed between two decode steps (AReaL's interruptible
    generation, Fu et al. 2025; ``rollout.interruptible``) has tokens of two or more versions; its
    behaviour log-probs are still per token, which is what the decoupled objective
    (:func:`decoupled_policy_loss`) needs.

    Args:
        weight_versions: [B, R] int, the weight version of each response token.
        response_mask: [B, R], > 0 on response tokens (padding's versions are ignored).

    Returns:
        A detached 0-dim float32 tensor in [0, 1] (0 for B = 0; a sample with no response token counts
        as one version).

    Raises:
        ValueError: ``weight_versions`` not an integer [B, R] tensor, or ``response_mask`` of another shape.
    """
    if weight_versions.dtype.is_floating_point or weight_versions.dtype.is_complex or weight_versions.dtype == torch.bool:
        raise ValueError(f"weight_versions has dtype {weight_versions.dtype}, expected an integer tensor (e.g. torch.int64)")
    _check_ndim("weight_versions", weight_versions, 2, "[B, R]")
    _check_same_shape("weight_versions", weight_versions, response_mask=response_mask)
    if weight_versions.shape[0] == 0:
        return torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        keep = response_mask > 0
        big = torch.iinfo(weight_versions.dtype).max
        low = torch.where(keep, weight_versions, big).amin(dim=1)
        high = torch.where(keep, weight_versions, -big).amax(dim=1)
        return ((high > low) & keep.any(dim=1)).float().mean()


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
