"""Pure RL math for PPO-family RLHF: advantages, KL penalties and controllers, losses.

Owns: masked reductions (mean / sum / var / whiten), KL estimators (``KL_ESTIMATORS``),
KL-coefficient controllers (``KL_CONTROLLERS``), the KL in the reward (per token, or per
sequence for outcome rewards) or as a loss term, GAE and the critic-free advantage
estimators (``ADVANTAGE_ESTIMATORS``), the PPO policy / value losses and their
aggregation (``LOSS_AGG_MODES``), truncated importance sampling against the rollout
engine's log-probs, reward standardization, and the DPO-family preference losses
(``DPO_LOSS_TYPES``: sigmoid DPO with cDPO label smoothing, IPO). Everything here is a pure function of tensors
(torch only, no other aligner import, no process group): the trainer and the workers
call it, tests check it against hand-computed and peer reference values.

Conventions. Shape letters: B batch (sequences), R response length. Per-token tensors
are ``[B, R]`` and right padded; ``response_mask: [B, R]`` is 1.0 on real response
tokens and 0.0 on padding (a bool mask is accepted too). Per-sequence tensors are
``[B]``. Log-probabilities are natural-log nats. Advantages, returns and
importance weights carry no gradient; losses carry gradient to ``log_probs`` /
``values`` only. Masked (padding) positions of every returned per-token tensor are 0.

Registries, each keyed by the name used in the config:

- ``KL_ESTIMATORS``: "k1", "k3", "abs", "mse" (verl ``kl_penalty`` names).
- ``KL_CONTROLLERS``: "fixed", "adaptive" (Ziegler et al. 2019).
- ``ADVANTAGE_ESTIMATORS``: "gae", "grpo", "rloo", "reinforce_pp", and
  "reinforce_pp_baseline". Every entry has one keyword-only calling contract
  (see :func:`get_advantage_estimator`) and returns ``(advantages, returns)``.
- ``LOSS_AGG_MODES``: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum".
- ``DPO_LOSS_TYPES``: "sigmoid" (DPO, cDPO), "ipo" (:func:`dpo_loss`).

Simplifications: advantages are never whitened here except where the method defines it
(REINFORCE++); whitening GAE advantages is the caller's choice (``masked_whiten``).
Group statistics (GRPO std) use the unbiased estimator, as ``torch.std`` in verl and TRL.
Loss metrics are returned as detached 0-dim tensors (no host sync); call ``float()`` to log.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

Tensor = torch.Tensor

_LOG_RATIO_CLAMP = 20.0  # |log ratio| clamp before exp (verl), keeps exp finite in fp32
_K3_CLAMP = 10.0  # k3 output clamp, as verl's "low_var_kl" (biases the estimate low beyond it)


# ----------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------


def _check_same_shape(ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    for name, t in others.items():
        if t is not None and tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(ref.shape)} (the shape of {ref_name})")


def _check_ndim(name: str, t: Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {layout}")


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} is invalid: must be in [{lo}, {hi}]")


def _unknown(kind: str, name: object, valid) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}: valid choices are {', '.join(sorted(valid))}")


def _float_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(like.dtype)


# ----------------------------------------------------------------------------------------
# masked reductions
# ----------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` over entries where ``mask`` is nonzero.

    Args:
        x: [...] any float tensor, e.g. ``[B, R]``.
        mask: same shape as ``x``; 1.0 (or True) keeps an entry, 0 drops it.
        dim: reduce over this dimension only; None reduces over all entries.

    Returns:
        0-dim tensor (``dim=None``) or ``x`` reduced over ``dim``.
    """
    _check_same_shape("x", x, mask=mask)
    prod = x * _float_mask(mask, x)
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is nonzero (0 where nothing is kept).

    As NeMo-Aligner ``masked_mean`` / verl ``masked_mean``.

    Args:
        x: [...] any float tensor, e.g. ``[B, R]``.
        mask: same shape as ``x``; 1.0 (or True) keeps an entry.
        dim: reduce over this dimension only (``[B, R]`` -> ``[B]`` for ``dim=-1``);
            None reduces over all entries.

    Returns:
        0-dim tensor (``dim=None``) or ``x`` reduced over ``dim``.
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all entries where ``mask`` is nonzero (TRL ``masked_var``).

    Args:
        x: [...] float tensor, e.g. ``[B, R]``.
        mask: same shape as ``x``.
        unbiased: apply Bessel's correction n / (n - 1).

    Returns:
        0-dim tensor.

    Raises:
        ValueError: the mask keeps no entry, or one entry with ``unbiased=True``.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return var
    n = float(_float_mask(mask, x).sum())
    if n < 2:
        raise ValueError(f"mask keeps {n:g} entries: the unbiased variance needs at least 2 (or pass unbiased=False)")
    return var * (n / (n - 1))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize ``x`` to mean 0 and unit (unbiased) variance over the masked entries.

    As TRL ``masked_whiten``: ``(x - mean) / sqrt(var + eps)`` with the unbiased
    (Bessel-corrected) variance. NeMo-Aligner's ``masked_whiten`` divides by the biased
    variance instead, so its result is ours times ``sqrt((n - 1) / n)`` for n masked
    entries. With ``shift_mean=False`` the mean is added back (only the scale changes).
    Entries outside the mask are set to 0.

    Args:
        x: [B, R] float tensor (e.g. advantages).
        mask: [B, R] response mask.
        shift_mean: subtract the masked mean.
        eps: added to the variance.

    Returns:
        [B, R] tensor, same dtype as ``x``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * _float_mask(mask, x)


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


# ----------------------------------------------------------------------------------------
# token rewards and GAE
# ----------------------------------------------------------------------------------------


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of the last real response token of each row.

    Args:
        response_mask: [B, R].

    Returns:
        [B] int64.

    Raises:
        ValueError: a row has no response token.
    """
    _check_ndim("response_mask", response_mask, 2, "[B, R]")
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(response_mask > 0, positions, -1).amax(dim=1)
    empty = (last < 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"response_mask rows {empty} have no response token: every row needs at least one")
    return last


def compute_token_rewards(scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float) -> Tensor:
    """KL-shaped per-token rewards (Ziegler et al. 2019; Ouyang et al. 2022).

    ``token_rewards[b, t] = -kl_coef * kl[b, t]`` on every response token, plus
    ``scores[b]`` at the last real response token of row ``b``; 0 on padding.

    Args:
        scores: [B] float, the sequence reward (raw or standardized).
        kl: [B, R] float, per-token KL estimate (see :func:`kl_penalty`).
        response_mask: [B, R].
        kl_coef: KL penalty coefficient, >= 0.

    Returns:
        token_rewards: [B, R], dtype of ``kl``, no gradient.
    """
    _check_ndim("kl", kl, 2, "[B, R]")
    _check_same_shape("kl", kl, response_mask=response_mask)
    if tuple(scores.shape) != (kl.shape[0],):
        raise ValueError(f"scores has shape {list(scores.shape)}, expected [B] = [{kl.shape[0]}]")
    last = last_token_index(response_mask)
    with torch.no_grad():
        token_rewards = -kl_coef * kl * _float_mask(response_mask, kl)
        token_rewards[torch.arange(kl.shape[0], device=kl.device), last] += scores.to(kl.dtype)
    return token_rewards.detach()


def compute_gae(token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, gae_lambda: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``; ``A_t = delta_t + gamma * lambda * A_{t+1}``,
    with ``V = 0`` after the last response token (the episode ends there). Masked
    positions are skipped (the recursion carries over them, as verl's
    ``compute_gae_advantage_return``), so right-padded rows of different lengths and
    values at padding are handled; masked positions get 0.

    Args:
        token_rewards: [B, R] float (see :func:`compute_token_rewards`).
        values: [B, R] float, critic values V(s_t) of the rollout.
        response_mask: [B, R].
        gamma: discount in [0, 1].
        gae_lambda: GAE lambda in [0, 1].

    Returns:
        advantages: [B, R], no gradient, 0 on padding.
        returns: [B, R] = advantages + values on response tokens, 0 on padding.
    """
    _check_ndim("token_rewards", token_rewards, 2, "[B, R]")
    _check_same_shape("token_rewards", token_rewards, values=values, response_mask=response_mask)
    _check_range("gamma", gamma, 0.0, 1.0)
    _check_range("gae_lambda", gae_lambda, 0.0, 1.0)
    with torch.no_grad():
        mask = _float_mask(response_mask, values)
        values = values.detach() * mask
        rewards = token_rewards.detach().to(values.dtype) * mask
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * gae_lambda * last_gae
            m = mask[:, t]
            next_value = m * values[:, t] + (1 - m) * next_value
            last_gae = m * gae + (1 - m) * last_gae
            advantages[:, t] = m * gae
        returns = (advantages + values) * mask
    return advantages, returns


# ----------------------------------------------------------------------------------------
# critic-free advantage estimators (outcome reward, n samples per prompt)
# ----------------------------------------------------------------------------------------


def kl_shaped_scores(scores: Tensor, kl: Optional[Tensor], response_mask: Tensor, kl_coef: float) -> Tensor:
    """Sequence rewards with the KL penalty in them: ``scores - kl_coef * sum_t kl[:, t]``.

    How an outcome-reward estimator (GRPO, RLOO) puts the KL into the reward: verl
    ``apply_kl_penalty`` subtracts ``kl_coef * kl`` from the token-level rewards and its
    GRPO / RLOO estimators sum them per sequence; TRL's ``RLOOTrainer`` adds
    ``-kl_coef * kl.sum(1)`` to the score before the leave-one-out baseline. The group
    baseline is then taken over these KL-shaped rewards.

    Args:
        scores: [B] float, one outcome reward per sample.
        kl: [B, R] float per-token KL estimate (:func:`kl_penalty`), or None (no KL).
        response_mask: [B, R]; only response tokens are summed.
        kl_coef: KL coefficient, >= 0; 0 returns ``scores`` unchanged.

    Returns:
        [B] float, no gradient.
    """
    _check_outcome_inputs(scores, response_mask)
    if kl is None or kl_coef == 0:
        return scores.detach()
    _check_same_shape("response_mask", response_mask, kl=kl)
    return (scores - kl_coef * masked_sum(kl.detach(), response_mask, dim=-1).to(scores.dtype)).detach()


def _group_index(batch_size: int, group_ids: Optional[Tensor], group_size: Optional[int]) -> Tensor:
    """[B] int64 dense group index 0..G-1 from ``group_ids: [B]`` or a contiguous ``group_size``."""
    if (group_ids is None) == (group_size is None):
        raise ValueError(
            "pass exactly one of group_ids ([B] int tensor, the prompt of each row) or "
            f"group_size (rows grouped contiguously); got group_ids={'set' if group_ids is not None else None}, "
            f"group_size={group_size!r}"
        )
    if group_size is not None:
        if group_size < 1 or batch_size % group_size:
            raise ValueError(f"group_size={group_size!r} is invalid: must be >= 1 and divide the batch size {batch_size}")
        return torch.arange(batch_size) // group_size
    if tuple(group_ids.shape) != (batch_size,) or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"group_ids has shape {list(group_ids.shape)} and dtype {group_ids.dtype}, "
            f"expected an integer tensor of shape [B] = [{batch_size}]"
        )
    return torch.unique(group_ids, return_inverse=True)[1]


def _group_mean_and_count(scores: Tensor, index: Tensor, what: str) -> tuple[Tensor, Tensor]:
    """Per-row group mean and group size, both [B]; groups of size 1 raise ValueError."""
    index = index.to(scores.device)
    counts = torch.bincount(index)
    if bool((counts < 2).any()):
        raise ValueError(
            f"{what} needs at least 2 samples per group (n_samples_per_prompt must be >= 2); "
            f"found group sizes {sorted(set(counts.tolist()))}"
        )
    sums = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(0, index, scores)
    count = counts.to(scores.dtype)[index]
    return sums[index] / count, count


def _broadcast(per_seq: Tensor, response_mask: Tensor) -> Tensor:
    return per_seq[:, None] * _float_mask(response_mask, per_seq)


def _check_outcome_inputs(scores: Tensor, response_mask: Tensor) -> None:
    _check_ndim("response_mask", response_mask, 2, "[B, R]")
    if tuple(scores.shape) != (response_mask.shape[0],):
        raise ValueError(f"scores has shape {list(scores.shape)}, expected [B] = [{response_mask.shape[0]}]")


def compute_grpo_advantages(
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Optional[Tensor] = None,
    group_size: Optional[int] = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath, outcome supervision).

    ``A_i = (s_i - mean_g(s)) / (std_g(s) + eps)`` (``std`` unbiased; dropped when
    ``norm_by_std=False``, as Dr. GRPO / verl ``norm_adv_by_std_in_grpo``), the same
    value on every response token of row i.

    Args:
        scores: [B] float, one outcome reward per sample.
        response_mask: [B, R].
        group_ids: [B] int, the prompt group of each row (any integer labels).
        group_size: alternatively, rows are grouped contiguously in groups of this size.
        norm_by_std: divide by the group standard deviation.
        eps: added to the std.

    Returns:
        advantages: [B, R], no gradient, 0 on padding.
    """
    _check_outcome_inputs(scores, response_mask)
    index = _group_index(scores.shape[0], group_ids, group_size)
    scores = scores.detach()
    mean, count = _group_mean_and_count(scores, index, "grpo")
    adv = scores - mean
    if norm_by_std:
        sq = torch.zeros_like(mean).index_add_(0, index.to(scores.device), adv.square())
        std = (sq[index.to(scores.device)] / (count - 1)).sqrt()
        adv = adv / (std + eps)
    return _broadcast(adv, response_mask)


def compute_rloo_advantages(
    scores: Tensor, response_mask: Tensor, group_ids: Optional[Tensor] = None, group_size: Optional[int] = None
) -> Tensor:
    """RLOO advantages (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

    ``A_i = s_i - mean_{j != i in group} s_j = n / (n - 1) * (s_i - mean_g(s))``,
    the same value on every response token of row i.

    Args:
        scores: [B] float, one outcome reward per sample.
        response_mask: [B, R].
        group_ids: [B] int, the prompt group of each row.
        group_size: alternatively, rows are grouped contiguously in groups of this size.

    Returns:
        advantages: [B, R], no gradient, 0 on padding.
    """
    _check_outcome_inputs(scores, response_mask)
    index = _group_index(scores.shape[0], group_ids, group_size)
    scores = scores.detach()
    mean, count = _group_mean_and_count(scores, index, "rloo")
    baseline = (mean * count - scores) / (count - 1)
    return _broadcast(scores - baseline, response_mask)


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over response tokens.

    Args:
        token_rewards: [B, R] float.
        response_mask: [B, R]; masked rewards are ignored.
        gamma: discount in [0, 1].

    Returns:
        returns: [B, R], no gradient, 0 on padding.
    """
    _check_ndim("token_rewards", token_rewards, 2, "[B, R]")
    _check_same_shape("token_rewards", token_rewards, response_mask=response_mask)
    _check_range("gamma", gamma, 0.0, 1.0)
    with torch.no_grad():
        mask = _float_mask(response_mask, token_rewards)
        rewards = token_rewards.detach() * mask
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            running = rewards[:, t] + gamma * running
            returns[:, t] = running
    return returns * mask


def compute_reinforce_pp_advantages(
    scores: Tensor,
    kl: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    gamma: float = 1.0,
    baseline: bool = False,
    group_ids: Optional[Tensor] = None,
    group_size: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ advantages (Hu 2025, arXiv:2501.03262; OpenRLHF ``reinforce_plus_plus``).

    KL-shaped token rewards (:func:`compute_token_rewards`), discounted return-to-go,
    then whitened over the whole batch's response tokens. With ``baseline=True``
    (REINFORCE++-baseline) the group mean score is subtracted first, which needs
    ``group_ids`` or ``group_size``.

    Args:
        scores: [B] float, sequence rewards.
        kl: [B, R] float, per-token KL estimate.
        response_mask: [B, R].
        kl_coef: KL penalty coefficient.
        gamma: discount in [0, 1].
        baseline: subtract the group mean score.
        group_ids: [B] int, the prompt group of each row (baseline only).
        group_size: alternatively, contiguous groups of this size (baseline only).

    Returns:
        advantages: [B, R] whitened return-to-go, no gradient, 0 on padding.
        returns: [B, R] un-whitened return-to-go, 0 on padding.
    """
    _check_outcome_inputs(scores, response_mask)
    scores = scores.detach()
    if baseline:
        index = _group_index(scores.shape[0], group_ids, group_size)
        scores = scores - _group_mean_and_count(scores, index, "reinforce_pp_baseline")[0]
    token_rewards = compute_token_rewards(scores, kl.detach(), response_mask, kl_coef)
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


# Registry adapters: one keyword-only contract for every estimator (see get_advantage_estimator).


def _zeros_kl(kl: Optional[Tensor], response_mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(response_mask.shape, dtype=dtype, device=response_mask.device) if kl is None else kl


def _gae_estimator(*, scores, response_mask, values=None, kl=None, kl_coef=0.0, gamma=1.0, gae_lambda=1.0, **_):
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values [B, R] from the critic; got values=None")
    kl = _zeros_kl(kl, response_mask, values.dtype)
    token_rewards = compute_token_rewards(scores, kl, response_mask, kl_coef)
    return compute_gae(token_rewards, values, response_mask, gamma, gae_lambda)


def _grpo_estimator(*, scores, response_mask, kl=None, kl_coef=0.0, group_ids=None, group_size=None, norm_by_std=True, **_):
    scores = kl_shaped_scores(scores, kl, response_mask, kl_coef)
    adv = compute_grpo_advantages(scores, response_mask, group_ids, group_size, norm_by_std)
    return adv, adv


def _rloo_estimator(*, scores, response_mask, kl=None, kl_coef=0.0, group_ids=None, group_size=None, **_):
    scores = kl_shaped_scores(scores, kl, response_mask, kl_coef)
    adv = compute_rloo_advantages(scores, response_mask, group_ids, group_size)
    return adv, adv


def _reinforce_pp_estimator(*, scores, response_mask, kl=None, kl_coef=0.0, gamma=1.0, **_):
    kl = _zeros_kl(kl, response_mask, scores.dtype)
    return compute_reinforce_pp_advantages(scores, kl, response_mask, kl_coef, gamma)


def _reinforce_pp_baseline_estimator(*, scores, response_mask, kl=None, kl_coef=0.0, gamma=1.0, group_ids=None, group_size=None, **_):
    kl = _zeros_kl(kl, response_mask, scores.dtype)
    return compute_reinforce_pp_advantages(
        scores, kl, response_mask, kl_coef, gamma, baseline=True, group_ids=group_ids, group_size=group_size
    )


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "gae": _gae_estimator,
    "grpo": _grpo_estimator,
    "rloo": _rloo_estimator,
    "reinforce_pp": _reinforce_pp_estimator,
    "reinforce_pp_baseline": _reinforce_pp_baseline_estimator,
}


def get_advantage_estimator(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The advantage estimator registered under ``name`` (a key of ``ADVANTAGE_ESTIMATORS``).

    Every estimator is called with keywords only and ignores the ones it does not use::

        advantages, returns = get_advantage_estimator(name)(
            scores=scores,                # [B] sequence reward
            response_mask=response_mask,  # [B, R]
            values=values,                # [B, R] critic values (gae only, required there)
            kl=kl, kl_coef=kl_coef,       # [B, R] KL estimate and its coefficient in the reward; None = 0
            gamma=gamma, gae_lambda=gae_lambda,
            group_ids=group_ids,          # [B] int prompt group (grpo, rloo, reinforce_pp_baseline)
            group_size=None,              # or contiguous groups of this size
            norm_by_std=True,             # grpo only
        )

    Both outputs are [B, R] with no gradient and 0 on padding. Every estimator puts
    ``kl_coef * kl`` into the reward: per token for GAE and REINFORCE++
    (:func:`compute_token_rewards`), summed per sequence for GRPO and RLOO
    (:func:`kl_shaped_scores`); pass ``kl_coef=0`` when the KL is a loss term instead
    (:func:`kl_loss`). The critic-free estimators return their advantages as ``returns``
    (there is no critic to train), except REINFORCE++ which returns its un-whitened
    return-to-go.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise _unknown("advantage estimator", name, ADVANTAGE_ESTIMATORS)
    return ADVANTAGE_ESTIMATORS[name]


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


def rollout_mismatch_metrics(rollout_log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the trainer's, over response tokens.

    Args:
        rollout_log_probs: [B, R] float, from the rollout engine.
        old_log_probs: [B, R] float, recomputed by the trainer.
        response_mask: [B, R].

    Returns:
        Detached 0-dim tensors: "log_probs_abs_diff_mean", "log_probs_abs_diff_max"
        (of ``|old_log_probs - rollout_log_probs|``) and "ratio_out_of_range_frac"
        (fraction of tokens with ``exp(old - rollout)`` outside [0.9, 1.1]).
    """
    _check_ndim("rollout_log_probs", rollout_log_probs, 2, "[B, R]")
    _check_same_shape("rollout_log_probs", rollout_log_probs, old_log_probs=old_log_probs, response_mask=response_mask)
    with torch.no_grad():
        diff = (old_log_probs - rollout_log_probs).float()
        keep = response_mask > 0
        abs_diff = diff.abs()
        ratio = torch.exp(diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        outside = ((ratio < 0.9) | (ratio > 1.1)).float()
        return {
            "log_probs_abs_diff_mean": masked_mean(abs_diff, keep),
            "log_probs_abs_diff_max": torch.where(keep, abs_diff, 0.0).max(),
            "ratio_out_of_range_frac": masked_mean(outside, keep),
        }


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
