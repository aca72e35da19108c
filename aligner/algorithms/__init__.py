"""Pure RL math for PPO-family RLHF: advantages, KL penalties and controllers, losses.

Owns (one module per concern: core.py, kl.py, advantages.py, losses.py, dpo.py; every name
re-exported here): masked reductions (mean / sum / var / whiten), KL estimators (``KL_ESTIMATORS``),
KL-coefficient controllers (``KL_CONTROLLERS``), the KL in the reward (per token, or per
sequence for outcome rewards) or as a loss term, GAE and the critic-free advantage
estimators (``ADVANTAGE_ESTIMATORS``), the PPO policy / value losses and their
aggregation (``LOSS_AGG_MODES``), truncated importance sampling against the rollout
engine's log-probs and the engine / trainer mismatch (log-probs, MoE routing), the decoupled PPO loss of AReaL for samples from stale weights with its
lag and staleness metrics, reward standardization, and the DPO-family preference losses
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
- ``POLICY_LOSSES``: "ppo" (:func:`policy_loss`), "gspo" (:func:`gspo_loss`, Zheng et al. 2025),
  "cispo" (:func:`cispo_loss`, MiniMax-M1).

Simplifications: advantages are never whitened here except where the method defines it
(REINFORCE++); whitening GAE advantages is the caller's choice (``masked_whiten``).
Group statistics (GRPO std) use the unbiased estimator, as ``torch.std`` in verl and TRL.
Loss metrics are returned as detached 0-dim tensors (no host sync); call ``float()`` to log.
"""

from __future__ import annotations

from aligner.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    compute_token_rewards,
    discounted_returns,
    get_advantage_estimator,
    kl_shaped_scores,
    last_token_index,
    non_stop_scores,
    overlong_penalty,
)
from aligner.algorithms.core import (
    Tensor,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from aligner.algorithms.distill import (
    distillation_advantages,
    distillation_loss,
    distillation_token_rewards,
    reverse_kl_per_token,
)
from aligner.algorithms.dpo import (
    DPO_LOSS_TYPES,
    dpo_loss,
)
from aligner.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_penalty,
)
from aligner.algorithms.kto import (
    kto_loss,
    kto_reference_point,
)
from aligner.algorithms.losses import (
    LOSS_AGG_MODES,
    aggregate_loss,
    decoupled_policy_loss,
    kl_loss,
    loss_agg_count,
    mixed_version_fraction,
    policy_lag_metrics,
    policy_loss,
    rollout_mismatch_metrics,
    routing_mismatch,
    staleness_metrics,
    standardize_scores,
    truncated_is_weights,
    value_loss,
)
from aligner.algorithms.ratio_losses import (
    POLICY_LOSSES,
    cispo_loss,
    gspo_loss,
)
from aligner.algorithms.spin import spin_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "DPO_LOSS_TYPES",
    "FixedKLController",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "Tensor",
    "aggregate_loss",
    "build_kl_controller",
    "cispo_loss",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_rloo_advantages",
    "compute_token_rewards",
    "decoupled_policy_loss",
    "discounted_returns",
    "distillation_advantages",
    "distillation_loss",
    "distillation_token_rewards",
    "dpo_loss",
    "get_advantage_estimator",
    "gspo_loss",
    "kl_loss",
    "kl_penalty",
    "kl_shaped_scores",
    "kto_loss",
    "kto_reference_point",
    "last_token_index",
    "loss_agg_count",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mixed_version_fraction",
    "overlong_penalty",
    "non_stop_scores",
    "policy_lag_metrics",
    "policy_loss",
    "reverse_kl_per_token",
    "rollout_mismatch_metrics",
    "routing_mismatch",
    "staleness_metrics",
    "spin_loss",
    "standardize_scores",
    "truncated_is_weights",
    "value_loss",
]
