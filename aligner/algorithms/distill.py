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


def distillation_advantages(teacher_kl: Tensor, response_mask: Tensor, distill_coef: float) -> Tensor:
    """The per-token advantage of on-policy distillation (discount 0; Thinking Machines' "On-Policy Distillation",
    2025), ``distill_coef * (mean(d) - d_t)`` on every response token, 0 on padding; mean(d) is the batch's mean over
    response tokens (a constant baseline, as the Tinker cookbook's ``incorporate_kl_penalty``). In expectation over
    y_t ~ pi, ``grad log pi(y_t) * -d_t`` is ``-grad KL(pi || pi_teacher)`` at that position.

    Args:
        teacher_kl: [B, R] float nats, d_t = log pi(y_t) - log pi_teacher(y_t) on the student's sampled tokens
            (no gradient).
        response_mask: [B, R].
        distill_coef: >= 0, nats -> advantage units.

    Returns:
        [B, R] float, detached.

    Raises:
        ValueError: distill_coef < 0 or shapes differ."""
    if not distill_coef >= 0:
        raise ValueError(f"distill_coef={distill_coef!r} is invalid: must be >= 0")
    if teacher_kl.shape != response_mask.shape:
        raise ValueError(f"teacher_kl {tuple(teacher_kl.shape)} and response_mask {tuple(response_mask.shape)} differ in shape")
    m = response_mask.to(teacher_kl.dtype)
    with torch.no_grad():
        baseline = (teacher_kl * m).sum() / m.sum().clamp(min=1)
        return distill_coef * (baseline - teacher_kl) * m
