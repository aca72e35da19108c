"""KL estimators (Schulman 2020; verl kl_penalty names) and KL-coefficient controllers (Ziegler et al. 2019)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from aligner.algorithms.core import _K3_CLAMP, _LOG_RATIO_CLAMP, Tensor, _check_same_shape, _unknown

# ----------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence", 2020; verl kl_penalty)
# ----------------------------------------------------------------------------------------


def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _kl_k3(log_ratio: Tensor) -> Tensor:
    # ratio = pi_ref / pi = exp(-d); k3 = ratio - 1 - log(ratio) = exp(-d) - 1 + d >= 0
    d = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(-d) - 1 + d).clamp(-_K3_CLAMP, _K3_CLAMP)


def _kl_abs(log_ratio: Tensor) -> Tensor:
    return log_ratio.abs()


def _kl_mse(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _kl_k1,
    "k3": _kl_k3,
    "abs": _kl_abs,
    "mse": _kl_mse,
}


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi.

    With ``d = log_probs - ref_log_probs`` (Schulman 2020, verl ``kl_penalty``):

    - "k1": ``d`` (unbiased, high variance, can be negative).
    - "k3": ``exp(-d) - 1 + d`` (low variance, >= 0; verl "low_var_kl"). The formula is
      unbiased, but as in verl ``d`` is clamped to [-20, 20] and the result to at most 10,
      so tokens with ``d < -2.6`` (the reference far more likely than the policy)
      contribute 10 instead of more: the clamped estimate is biased low there.
    - "abs": ``|d|``.
    - "mse": ``0.5 * d**2`` (k2).

    Args:
        log_probs: [B, R] float, log-probs of the sampled tokens under the policy.
        ref_log_probs: [B, R] float, the same tokens under the reference policy.
        estimator: a key of ``KL_ESTIMATORS``.

    Returns:
        kl: [B, R], same dtype as ``log_probs``; padding is not masked here.
    """
    if estimator not in KL_ESTIMATORS:
        raise _unknown("kl estimator", estimator, KL_ESTIMATORS)
    _check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs)
    return KL_ESTIMATORS[estimator](log_probs - ref_log_probs)


# ----------------------------------------------------------------------------------------
# KL controllers (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences")
# ----------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient (Ziegler et al. 2019, the non-adaptive baseline)."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef={kl_coef!r} is invalid: must be >= 0")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict:
        """Checkpointable state: ``{"kl_coef": float}``."""
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`."""
        if "kl_coef" not in state:
            raise ValueError(f"KL controller state {sorted(state)} has no 'kl_coef' key")
        self.value = float(state["kl_coef"])


class AdaptiveKLController(FixedKLController):
    """Adaptive KL coefficient (Ziegler et al. 2019, section 2.2).

    ``e = clip(current_kl / target - 1, -0.2, 0.2)``;
    ``kl_coef <- kl_coef * (1 + e * n_steps / horizon)``.

    Args:
        init_kl_coef: starting coefficient, >= 0.
        target: target KL (same unit as the ``current_kl`` passed to update,
            typically nats per sequence), > 0.
        horizon: adaptation horizon, in the unit of ``n_steps`` (samples), > 0.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        super().__init__(init_kl_coef)
        if not target > 0:
            raise ValueError(f"target={target!r} is invalid: the target KL must be > 0")
        if not horizon > 0:
            raise ValueError(f"horizon={horizon!r} is invalid: must be > 0")
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards the target after ``n_steps`` samples at ``current_kl``."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def build_kl_controller(kind: str, kl_coef: float, target: Optional[float] = None, horizon: Optional[float] = None) -> FixedKLController:
    """Build a KL controller by name (a key of ``KL_CONTROLLERS``).

    Args:
        kind: "fixed" or "adaptive".
        kl_coef: the (initial) coefficient.
        target: target KL, required for "adaptive".
        horizon: horizon in samples, required for "adaptive".
    """
    if kind not in KL_CONTROLLERS:
        raise _unknown("kl controller", kind, KL_CONTROLLERS)
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if target is None or horizon is None:
        raise ValueError(f"kl controller 'adaptive' needs target and horizon, got target={target!r}, horizon={horizon!r}")
    return AdaptiveKLController(kl_coef, target, horizon)
