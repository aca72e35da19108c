"""SPIN: self-play fine-tuning (Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak Language Models to Strong
Language Models", arXiv:2401.01335): the loss of one iteration."""

from __future__ import annotations

import torch.nn.functional as F

from aligner.algorithms.core import Tensor, _check_ndim, _check_same_shape


def spin_loss(
    policy_real_logps: Tensor, policy_gen_logps: Tensor, ref_real_logps: Tensor, ref_gen_logps: Tensor, lam: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair SPIN losses of iteration t (Chen et al. 2024, eq. 4.7, with the logistic loss l(t) = log(1 + exp(-t)))::

        L = l( lam * log(p_theta(y | x) / p_theta_t(y | x)) - lam * log(p_theta(y' | x) / p_theta_t(y' | x)) )

    y the SFT data's response, y' ~ p_theta_t(. | x) the previous iteration's own generation, p_theta_t the frozen
    previous iterate (the reference). Sequence log-probs are sums over the response's tokens. This is DPO's sigmoid
    loss with beta = lam, chosen = y and rejected = y' (:func:`aligner.algorithms.dpo_loss`).

    Args:
        policy_real_logps, policy_gen_logps: [B] float, log p_theta of y and y' (with gradient).
        ref_real_logps, ref_gen_logps: [B] float, log p_theta_t of y and y'.
        lam: > 0, the paper's lambda (the KL-regularization strength).

    Returns:
        losses [B]; rewards of y and of y' [B] (``lam`` times the log-ratios, detached).

    Raises:
        ValueError: shapes differ, lam <= 0.
    """
    _check_ndim("policy_real_logps", policy_real_logps, 1, "[B]")
    _check_same_shape(
        "policy_real_logps",
        policy_real_logps,
        policy_gen_logps=policy_gen_logps,
        ref_real_logps=ref_real_logps,
        ref_gen_logps=ref_gen_logps,
    )
    if not lam > 0:
        raise ValueError(f"lam={lam!r} is invalid: must be > 0 (e.g. 0.1)")
    real = lam * (policy_real_logps - ref_real_logps.detach())
    gen = lam * (policy_gen_logps - ref_gen_logps.detach())
    return F.softplus(-(real - gen)), real.detach(), gen.detach()
