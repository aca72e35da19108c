"""The KTO loss (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
arXiv:2402.01306): alignment from unpaired completions labelled desirable or undesirable."""

from __future__ import annotations

import torch

from aligner.algorithms.core import Tensor, _check_ndim, _check_same_shape


def kto_reference_point(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """The KL reference point z0 of KTO (eq. 7-8): ``max(0, mean_j (log pi(y'_j | x_j) - log pi_ref(y'_j | x_j)))``,
    detached, over mismatched pairs (x_j, y'_j) of the batch (each prompt with another example's completion,
    TRL's rotation by one), a biased estimate of KL(pi || pi_ref) as in the paper and TRL's ``KTOTrainer``.

    Args:
        kl_logps: [B] float, the policy's sequence log-probs (sums over completion tokens, nats) of the mismatched pairs.
        ref_kl_logps: [B] float, the reference's.

    Returns:
        0-dim tensor >= 0, no gradient. Raises ValueError for shapes that differ or an empty batch.
    """
    _check_ndim("kl_logps", kl_logps, 1, "[B]")
    _check_same_shape("kl_logps", kl_logps, ref_kl_logps=ref_kl_logps)
    if kl_logps.numel() == 0:
        raise ValueError("kl_logps is empty: the KL reference point needs at least one mismatched pair")
    return (kl_logps - ref_kl_logps).detach().mean().clamp(min=0)


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    z0: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Per-example KTO losses (Ethayarajh et al. 2024, eq. 7-8, with 1 - v as the loss, as TRL's ``KTOTrainer``
    ``loss_type="kto"``).

    With the log-ratio ``r = policy_logps - ref_logps`` (sums over the completion's tokens, nats)::

        desirable   (label true):  lambda_D * (1 - sigmoid(beta * (r - z0)))
        undesirable (label false): lambda_U * (1 - sigmoid(beta * (z0 - r)))

    The batch loss is the mean of these over the examples (TRL: ``losses.nanmean()``).

    Args:
        policy_logps: [B] float, the policy's sequence log-probs (with gradient).
        ref_logps: [B] float, the frozen reference's.
        labels: [B] bool (or 0/1), true = desirable.
        z0: 0-dim float, the reference point (:func:`kto_reference_point`), no gradient.
        beta: > 0, the implicit reward's scale.
        desirable_weight, undesirable_weight: lambda_D, lambda_U >= 0.

    Returns:
        losses [B] and rewards [B] (``beta * r``, detached).

    Raises:
        ValueError: shapes differ, beta <= 0, a negative weight.
    """
    _check_ndim("policy_logps", policy_logps, 1, "[B]")
    _check_same_shape("policy_logps", policy_logps, ref_logps=ref_logps, labels=labels)
    if not beta > 0:
        raise ValueError(f"beta={beta!r} is invalid: must be > 0 (e.g. 0.1)")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(f"desirable_weight={desirable_weight!r}, undesirable_weight={undesirable_weight!r}: must be >= 0")
    good = labels.bool()
    r = policy_logps - ref_logps.detach()
    z0 = z0.detach().to(r.dtype)
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    return torch.where(good, desirable, undesirable), beta * r.detach()
