"""Token rewards, GAE (Schulman et al. 2016) and the critic-free advantage estimators (GRPO, RLOO, REINFORCE++), with their registry."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from aligner.algorithms.core import Tensor, _check_ndim, _check_range, _check_same_shape, _float_mask, _unknown, masked_sum, masked_whiten

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


def overlong_penalty(response_lengths: Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), added to a sample's score.

    With L_max = max_new_tokens and L_cache = buffer, a response of |y| tokens gets

        0                                  if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max   (down to -1 at L_max)
        -1                                 if |y| > L_max

    times `factor`. A response cut at the limit has |y| = L_max, so it gets -factor: the length term
    tells the policy to finish within the budget instead of letting a truncated response keep the
    score of what it wrote (DAPO section 3.4; verl's ``overlong_buffer`` with ``penalty_factor``).

    Args:
        response_lengths: [B] int or float, response tokens per sample (>= 0).
        max_new_tokens: L_max, the generation budget in tokens (>= 1).
        buffer: L_cache, tokens before the budget where the penalty ramps, 1 <= buffer <= max_new_tokens.
        factor: the penalty at the budget (>= 0).

    Returns:
        [B] float32 penalties in [-factor, 0].

    Raises:
        ValueError: a length below 0, buffer outside [1, max_new_tokens], factor below 0.
    """
    _check_ndim("response_lengths", response_lengths, 1, "[B]")
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong_penalty: buffer={buffer} must be in [1, max_new_tokens={max_new_tokens}]")
    if factor < 0:
        raise ValueError(f"overlong_penalty: factor={factor} must be >= 0")
    lengths = response_lengths.float()
    if bool((lengths < 0).any()):
        raise ValueError("overlong_penalty: response_lengths must be >= 0")
    expected = max_new_tokens - buffer
    return (((expected - lengths) / buffer).clamp(min=-1.0, max=0.0) * factor).float()


def non_stop_scores(scores: Tensor, ended: Tensor, value: float) -> Tensor:
    """Tülu 3's non-stop penalty (Lambert et al. 2024, arXiv 2411.15124, RLVR; open-instruct's
    ``non_stop_penalty`` with ``penalty_reward_value``): a response that did not end with EOS (cut at the
    generation budget) gets ``value`` instead of its score, so a loop that happens to satisfy the
    verifier earns nothing for it (Tülu 3 uses -10; open-instruct's IF GRPO 0).

    Args:
        scores: [B] float, each sample's score.
        ended: [B] bool, True where the response ended with EOS.
        value: the score of a response that did not end.

    Returns:
        [B] scores' dtype: ``scores`` where ``ended``, else ``value``.

    Raises:
        ValueError: shapes that differ or are not [B].
    """
    _check_ndim("scores", scores, 1, "[B]")
    if ended.shape != scores.shape:
        raise ValueError(f"non_stop_scores: ended {tuple(ended.shape)} must have the shape of scores {tuple(scores.shape)}")
    return torch.where(ended.to(torch.bool), scores, torch.full_like(scores, float(value)))


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
