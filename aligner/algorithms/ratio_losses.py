"""Policy losses that change where the importance ratio is taken or clipped: GSPO (one ratio per
sequence) and CISPO (the ratio clipped as a stop-gradient weight), beside PPO's token-level clipped
surrogate (:func:`aligner.algorithms.policy_loss`). ``POLICY_LOSSES`` names the three choices of
``algorithm.policy_loss``."""

from __future__ import annotations

from typing import Optional

import torch

from aligner.algorithms.core import _LOG_RATIO_CLAMP, Tensor, _check_ndim, _check_same_shape, masked_mean
from aligner.algorithms.losses import aggregate_loss

POLICY_LOSSES = ("ppo", "gspo", "cispo")  # algorithm.policy_loss


def _check_ratio_inputs(log_probs: Tensor, **others: Optional[Tensor]) -> None:
    _check_ndim("log_probs", log_probs, 2, "[B, R]")
    _check_same_shape("log_probs", log_probs, **others)


def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_eps: float,
    clip_eps_high: Optional[float] = None,
    loss_agg: str = "seq-mean-token-mean",
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071), in its
    GSPO-token form (section 4.3, eq. 13-14).

    The importance ratio of sequence i is the length-normalized sequence likelihood ratio::

        s_i = exp( (1 / |y_i|) * sum_t (log pi(y_i,t) - log pi_old(y_i,t)) )

    and each token uses ``s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]`` (numerically s_i)::

        l_i,t = max(-A_i,t * s_i,t, -A_i,t * clip(s_i,t, 1 - clip_eps, 1 + clip_eps_high))

    aggregated by ``loss_agg``. With one advantage per sequence (A_i,t = A_i: grpo, rloo) and
    ``loss_agg="seq-mean-token-mean"`` (the paper's 1/G sum_i 1/|y_i| sum_t) this is GSPO's
    sequence objective ``mean_i max(-A_i s_i, -A_i clip(s_i))`` in value and gradient, which is
    TRL's ``GRPOTrainer`` with ``importance_sampling_level="sequence"`` and ``loss_type="grpo"``.
    The clip is taken per sequence: a sequence is clipped whole or not at all.

    Args:
        log_probs: [B, R] float, current policy log-probs (with gradient).
        old_log_probs: [B, R] float, log-probs of the policy that collected the batch.
        advantages: [B, R] float (constant along each sequence for the sequence objective).
        response_mask: [B, R]; every response token of a sequence must be in this call (the
            ratio is a mean over the whole sequence).
        clip_eps: lower clip of s_i, > 0 (the paper uses 3e-4; TRL's ``epsilon``).
        clip_eps_high: upper clip (the paper: 4e-4); None = ``clip_eps``.
        loss_agg: one of ``LOSS_AGG_MODES``.
        is_weights: [B, R] float per-token weights (truncated IS), or None.

    Returns:
        loss: 0-dim tensor.
        metrics: detached 0-dim tensors "clipfrac" (fraction of response tokens whose sequence is
        clipped), "seq_clipfrac" (fraction of sequences), "approx_kl" (k3 of the token ratios),
        "ratio_mean" (mean of s_i over sequences with a response token).

    Raises:
        ValueError: shapes differ, clip_eps or clip_eps_high not > 0.
    """
    _check_ratio_inputs(log_probs, old_log_probs=old_log_probs, advantages=advantages, response_mask=response_mask, is_weights=is_weights)
    if not clip_eps > 0:
        raise ValueError(f"clip_eps={clip_eps!r} is invalid: must be > 0 (e.g. 3e-4, GSPO)")
    if clip_eps_high is not None and not clip_eps_high > 0:
        raise ValueError(f"clip_eps_high={clip_eps_high!r} is invalid: must be > 0 (e.g. 4e-4, GSPO) or None")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = response_mask.to(log_probs.dtype)
    advantages = advantages.detach()
    token_log_ratio = log_probs - old_log_probs.detach()
    seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B]
    # GSPO-token: log s_i,t = sg[log s_i] + log pi_t - sg[log pi_t]
    log_s = seq_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1 - clip_eps, 1 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, mask, loss_agg)
    with torch.no_grad():
        active = (clipped > unclipped).to(log_probs.dtype)
        has_tokens = mask.sum(-1) > 0
        seq_clipped = (active * mask).amax(dim=-1)
        ratio = torch.exp(token_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        metrics = {
            "clipfrac": masked_mean(active, mask),
            "seq_clipfrac": masked_mean(seq_clipped, has_tokens),
            "approx_kl": masked_mean(ratio - 1 - token_log_ratio, mask),
            "ratio_mean": masked_mean(torch.exp(seq_log_ratio), has_tokens),
        }
    return loss, metrics


def cispo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_eps_high: float,
    loss_agg: str = "token-mean",
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585, section 3.1, eq. 4-5).

    The importance weight is clipped and detached, and multiplies a REINFORCE term, so every
    token keeps a gradient (PPO's clip zeroes the gradient of clipped tokens)::

        r_t   = pi(y_t) / pi_old(y_t)
        w_t   = sg[ min(r_t, 1 + clip_eps_high) ]
        l_t   = -w_t * A_t * log pi(y_t)

    aggregated by ``loss_agg`` (the paper and TRL: ``token-mean`` over the batch's response
    tokens). The paper's lower bound 1 - eps_low is not imposed (MiniMax-M1 sets eps_low large,
    i.e. none). TRL's ``loss_type="cispo"`` with ``epsilon_high = 1 + clip_eps_high`` (TRL's
    epsilon_high is the weight's bound itself, ScaleRL's eps_max; 5.0 there, i.e. clip_eps_high=4).

    Args:
        log_probs: [B, R] float, current policy log-probs (with gradient).
        old_log_probs: [B, R] float, log-probs of the policy that collected the batch.
        advantages: [B, R] float.
        response_mask: [B, R].
        clip_eps_high: the weight's bound is 1 + clip_eps_high, > 0.
        loss_agg: one of ``LOSS_AGG_MODES``.
        is_weights: [B, R] float per-token weights (truncated IS), or None.

    Returns:
        loss: 0-dim tensor.
        metrics: detached 0-dim tensors "clipfrac" (fraction of tokens whose weight is clipped),
        "approx_kl" (k3 estimate of KL(old || new)), "ratio_mean".

    Raises:
        ValueError: shapes differ, clip_eps_high not > 0.
    """
    _check_ratio_inputs(log_probs, old_log_probs=old_log_probs, advantages=advantages, response_mask=response_mask, is_weights=is_weights)
    if not clip_eps_high > 0:
        raise ValueError(f"clip_eps_high={clip_eps_high!r} is invalid: must be > 0 (the weight's bound is 1 + clip_eps_high, e.g. 4.0)")
    mask = response_mask.to(log_probs.dtype)
    log_ratio = (log_probs - old_log_probs.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(max=1 + clip_eps_high)
    loss_mat = -weight * advantages.detach() * log_probs
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, mask, loss_agg)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((ratio > 1 + clip_eps_high).to(log_probs.dtype), mask),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics
