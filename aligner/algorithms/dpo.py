"""Direct preference optimization losses (Rafailov et al. 2023; IPO, Azar et al. 2023; cDPO label smoothing)."""

from __future__ import annotations

from typing import Optional

import torch

from aligner.algorithms.core import Tensor, _check_ndim, _check_same_shape, _unknown

# ----------------------------------------------------------------------------------------
# direct preference optimization
# ----------------------------------------------------------------------------------------

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lens: Optional[Tensor] = None,
    rejected_lens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair DPO-family losses and the implicit rewards, from sequence log-probs.

    With the log-ratios ``c = policy_chosen_logps - ref_chosen_logps`` and
    ``r = policy_rejected_logps - ref_rejected_logps`` (each the sum over the response's
    tokens of log pi(y_t | x, y_<t), TRL's convention):

    - ``"sigmoid"``: DPO (Rafailov et al. 2023, eq. 7), ``-log sigmoid(beta (c - r))``; with
      ``label_smoothing = eps > 0`` conservative DPO (Mitchell 2023, "cDPO": the label is flipped
      with probability eps), ``-(1 - eps) log sigmoid(beta (c - r)) - eps log sigmoid(-beta (c - r))``.
      (TRL's ``sigmoid`` loss ignores label_smoothing since TRL 1.x; its ``2 (1 - eps) sigmoid -
      (1 - 2 eps) robust`` combination is the same cDPO loss, which the tests use.)
    - ``"ipo"``: IPO (Azar et al. 2023, eq. 17 with tau = beta), ``(c / |y_w| - r / |y_l| -
      1 / (2 beta))^2``: as TRL, each log-ratio is divided by its response length (the
      average per token; TRL notes the IPO authors' results use this normalization), so
      ``chosen_lens`` and ``rejected_lens`` are required (clamped at 1 token).

    The implicit rewards are ``beta * c`` and ``beta * r`` (detached; TRL's ``rewards/chosen``,
    ``rewards/rejected``, also for IPO: not length-normalized). The SFT term of RPO
    (Pang et al. 2024) is token-level and added by the caller.

    Args:
        policy_chosen_logps, policy_rejected_logps: [B] float, nats, with gradient.
        ref_chosen_logps, ref_rejected_logps: [B] float, nats, of the frozen reference (no gradient).
        beta: > 0, the KL-regularization strength (the inverse temperature of the implicit reward).
        loss_type: a key of ``DPO_LOSS_TYPES``.
        label_smoothing: in [0, 0.5), sigmoid only.
        chosen_lens, rejected_lens: [B] response tokens per sequence (ipo only).

    Returns:
        (losses [B] with gradient, chosen_rewards [B], rejected_rewards [B] detached).

    Raises:
        ValueError: unknown loss_type, beta <= 0, label_smoothing out of range or with ipo,
        mismatched shapes, or ipo without lengths.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise _unknown("DPO loss type", loss_type, DPO_LOSS_TYPES)
    if not beta > 0:
        raise ValueError(f"beta={beta!r} is invalid: must be > 0 (e.g. 0.1)")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing!r} is invalid: must be in [0, 0.5)")
    _check_ndim("policy_chosen_logps", policy_chosen_logps, 1, "[B]")
    _check_same_shape(
        "policy_chosen_logps",
        policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_lens=chosen_lens,
        rejected_lens=rejected_lens,
    )
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        logits = beta * (chosen_logratios - rejected_logratios)
        losses = -torch.nn.functional.logsigmoid(logits)
        if label_smoothing > 0:
            losses = (1 - label_smoothing) * losses - label_smoothing * torch.nn.functional.logsigmoid(-logits)
    else:
        if label_smoothing > 0:
            raise ValueError(f"label_smoothing={label_smoothing!r} applies to loss_type=sigmoid only, not ipo: set it to 0")
        if chosen_lens is None or rejected_lens is None:
            raise ValueError("loss_type=ipo normalizes by response length: give chosen_lens and rejected_lens ([B] tokens)")
        c = chosen_logratios / chosen_lens.to(chosen_logratios.dtype).clamp(min=1.0)
        r = rejected_logratios / rejected_lens.to(rejected_logratios.dtype).clamp(min=1.0)
        losses = (c - r - 1.0 / (2.0 * beta)) ** 2
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
