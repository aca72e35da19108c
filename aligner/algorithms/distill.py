"""On-policy distillation (GKD, Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", arXiv:2306.13649): the per-token reverse KL from the student to a teacher on the
student's own samples, as an exact loss over the vocabulary and as a sampled-token reward."""

from __future__ import annotations

import torch

from aligner.algorithms.core import Tensor, _check_ndim, _check_same_shape
from aligner.algorithms.losses import aggregate_loss


def reverse_kl_per_token(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(pi_student || pi_teacher) at every position, over the full vocabulary (GKD's divergence D with
    beta = 1, eq. 1 of Agarwal et al. 2024; TRL ``GKDTrainer.generalized_jsd_loss(beta=1)`` per position)::

        KL_t = sum_v pi_s(v | y_<t) * (log pi_s(v | y_<t) - log pi_t(v | y_<t)),   pi = softmax(logits / temperature)

    Args:
        student_logits: [B, R, V] float (with gradient).
        teacher_logits: [B, R, V] float, the frozen teacher's (detached here); the same vocabulary.
        temperature: > 0.

    Returns:
        [B, R] float, nats, >= 0 (up to rounding).

    Raises:
        ValueError: shapes differ (a teacher with another vocabulary), temperature <= 0.
    """
    _check_ndim("student_logits", student_logits, 3, "[B, R, V]")
    _check_same_shape("student_logits", student_logits, teacher_logits=teacher_logits)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is invalid: must be > 0")
    s = torch.log_softmax(student_logits / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.detach() / temperature, dim=-1)
    return (s.exp() * (s - t)).sum(-1)


def distillation_loss(
    student_logits: Tensor, teacher_logits: Tensor, response_mask: Tensor, temperature: float = 1.0, loss_agg: str = "token-mean"
) -> Tensor:
    """The per-token reverse KL (:func:`reverse_kl_per_token`) aggregated over the response tokens by ``loss_agg``
    (token-mean: TRL's ``reduction="batchmean"`` with labels, the mean over unmasked positions).

    Args:
        student_logits, teacher_logits: [B, R, V]. response_mask: [B, R]. loss_agg: one of ``LOSS_AGG_MODES``.

    Returns:
        0-dim tensor, nats.
    """
    return aggregate_loss(reverse_kl_per_token(student_logits, teacher_logits, temperature), response_mask, loss_agg)


def distillation_token_rewards(student_log_probs: Tensor, teacher_log_probs: Tensor, response_mask: Tensor, coef: float = 1.0) -> Tensor:
    """The sampled-token signal of on-policy distillation: ``-coef * (log pi_s(y_t) - log pi_t(y_t))`` per response token
    of the student's own sample (no gradient; the k1 estimate of the reverse KL, whose expectation over the
    student's sampling of y_t is :func:`reverse_kl_per_token`), a per-token reward alone or beside a task reward.

    Args:
        student_log_probs: [B, R] float, the sampling (old) policy's log-probs of its tokens.
        teacher_log_probs: [B, R] float, the teacher's log-probs of the same tokens.
        response_mask: [B, R].
        coef: >= 0, nats -> reward units.

    Returns:
        [B, R] float, 0 on padding, detached.
    """
    _check_ndim("student_log_probs", student_log_probs, 2, "[B, R]")
    _check_same_shape("student_log_probs", student_log_probs, teacher_log_probs=teacher_log_probs, response_mask=response_mask)
    if not coef >= 0:
        raise ValueError(f"coef={coef!r} is invalid: must be >= 0")
    with torch.no_grad():
        return -coef * (student_log_probs - teacher_log_probs) * response_mask.to(student_log_probs.dtype)
