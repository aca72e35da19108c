"""On-policy distillation's signal in the PPO stage (GKD, Agarwal et al. 2024, arXiv:2306.13649; the per-token
formulation of Thinking Machines' "On-Policy Distillation", 2025): the teacher role (``teacher.init``, a frozen model
served like the reference) scores the student's sampled tokens, and each response token's advantage gets
``-distill_coef * (d_t - mean(d))`` with ``d_t = log pi(y_t) - log pi_teacher(y_t)``, the sampled-token reverse-KL
estimate, added after the advantage estimator has turned the task reward and the reference KL into advantages.

Why per token and not through the reward: with discount 0 each token's policy-gradient term
``grad log pi(y_t) * -d_t`` is, in expectation over y_t ~ pi(. | y_<t), exactly ``-grad KL(pi || pi_teacher)`` at that
position (``E[grad log pi] = 0`` removes the derivative of the log pi inside d_t, and the same identity makes the
constant baseline ``mean(d)`` unbiased). Summed into a sequence reward and group-normalized (GRPO), every token would
carry the whole sequence's KL noise, scaled by the group's spread: the same expectation for the sequence-level KL, a
variance ~R times higher for R response tokens, and a step size set by the spread rather than by the KL."""

from __future__ import annotations

from typing import Optional

import torch

from aligner import algorithms as alg
from aligner.protocol import RolloutBatch


def teacher_kl_estimate(batch: RolloutBatch, policy_log_probs: torch.Tensor, metrics: dict) -> Optional[torch.Tensor]:
    """The student's per-token reverse-KL estimate to the teacher on its own samples, ``d_t = log pi(y_t) -
    log pi_teacher(y_t)`` [B, R] float32 nats, 0 on padding (:func:`aligner.algorithms.distillation_token_rewards` with
    coef 1, negated), or None without the teacher's log-probs in `batch`. Adds ``teacher_kl`` (nats per sequence, the
    mean of the per-sequence sums) and ``teacher_kl_token`` (nats per response token, the mean over the batch's tokens)
    to `metrics`.

    policy_log_probs: [B, R] the sampling policy's log-probs of its tokens (the recomputed old ones)."""
    if batch.teacher_log_probs is None:
        return None
    mask = batch.response_mask
    d = -alg.distillation_token_rewards(policy_log_probs, batch.teacher_log_probs, mask, 1.0)
    metrics["teacher_kl"] = float(d.sum(-1).mean())
    metrics["teacher_kl_token"] = float(d.sum() / mask.sum().clamp(min=1))
    return d
