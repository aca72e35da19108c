"""On-policy distillation's signal in the PPO stage (GKD, Agarwal et al. 2024, arXiv:2306.13649): the teacher role
(``teacher.init``, a frozen model served like the reference) scores the student's sampled tokens, and the per-token
reverse-KL estimate ``log pi(y_t) - log pi_teacher(y_t)`` enters the reward with ``algorithm.distill_coef``, beside
the task reward and the reference KL, through the advantage estimator's KL input (per token for gae and
reinforce_pp, summed per sequence for the group estimators, as the reference KL)."""

from __future__ import annotations

import torch

from aligner import algorithms as alg
from aligner.protocol import RolloutBatch


def distilled_kl(
    batch: RolloutBatch, policy_log_probs: torch.Tensor, kl_coef: float, distill_coef: float, metrics: dict
) -> tuple[torch.Tensor, float]:
    """(kl [B, R], coef) for the advantage estimator, which subtracts ``coef * kl`` from the rewards: the reference KL
    ``batch.kl`` with the controller's `kl_coef`, plus, with the teacher's log-probs in `batch`, ``distill_coef`` times
    the student's per-token reverse-KL estimate to the teacher (:func:`aligner.algorithms.distillation_token_rewards`),
    as ``(kl_coef * batch.kl + distill_coef * teacher_kl, 1.0)``. Adds ``teacher_kl`` (nats per sequence, the mean of
    the per-sequence sums) and ``teacher_kl_token`` (nats per response token, the mean over the batch's tokens) to
    `metrics`. Without a teacher: ``(batch.kl, kl_coef)`` unchanged.

    policy_log_probs: [B, R] the sampling policy's log-probs of its tokens (the recomputed old ones)."""
    if batch.teacher_log_probs is None or distill_coef == 0:
        return batch.kl, kl_coef
    mask = batch.response_mask
    teacher_kl = -alg.distillation_token_rewards(policy_log_probs, batch.teacher_log_probs, mask, 1.0)
    metrics["teacher_kl"] = float(teacher_kl.sum(-1).mean())
    metrics["teacher_kl_token"] = float(teacher_kl.sum() / mask.sum().clamp(min=1))
    return kl_coef * batch.kl + distill_coef * teacher_kl, 1.0
