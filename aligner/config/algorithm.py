"""The algorithms' schemas: the PPO family (advantage estimator, clipping, where the KL goes) and DPO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Optional

from aligner import algorithms as alg
from aligner.config.common import _check, _choice


@dataclass(kw_only=True)
class AlgorithmConfig:
    """PPO-family algorithm settings (formulas and papers in aligner.algorithms).

    The KL to the reference policy enters in one or both of two places: in the reward
    (``kl_in_reward``, coefficient ``kl_coef`` under ``kl_controller``: per token for gae
    and reinforce_pp, per sequence for grpo and rloo), or as a loss term of the actor
    (``kl_loss_coef`` with ``kl_loss_estimator``, as DeepSeekMath's GRPO). The three KL fields
    left ``None`` follow the advantage estimator, resolved once, when the config is built
    (:func:`resolve_kl`): the KL goes into the reward (``kl_coef`` 0.05) for gae, rloo,
    reinforce_pp and reinforce_pp_baseline, and into the loss (``kl_loss_coef`` 0.04,
    DeepSeekMath) for grpo. A coefficient set where nothing applies it is refused.
    """

    advantage: str = "gae"  # a key of aligner.algorithms.ADVANTAGE_ESTIMATORS
    # the actor's policy loss (aligner.algorithms.POLICY_LOSSES): ppo (token ratios, clipped surrogate) | gspo (one
    # length-normalized ratio per sequence, clipped per sequence; Zheng et al. 2025; needs loss_agg=seq-mean-token-mean)
    # | cispo (the token ratio clipped at 1 + clip_eps_high as a stop-gradient weight of a REINFORCE term; MiniMax-M1)
    policy_loss: str = "ppo"
    gamma: float = 1.0  # discount
    gae_lambda: float = 0.95  # GAE lambda
    clip_eps: float = 0.2  # PPO ratio clip (lower, and upper unless clip_eps_high is set)
    clip_eps_high: Optional[float] = None  # upper ratio clip, "clip-higher" (DAPO, Yu et al. 2025); None = clip_eps
    dual_clip: Optional[float] = None  # dual-clip bound c > 1 (Ye et al. 2020); None = off
    value_clip_eps: Optional[float] = 0.2  # clipped value loss; None = unclipped
    loss_agg: str = "token-mean"  # actor loss aggregation: token-mean | seq-mean-token-mean (GRPO paper) | seq-mean-token-sum (Dr. GRPO)
    norm_by_std: bool = True  # grpo only: divide by the group std; false = Dr. GRPO (Liu et al. 2025)
    kl_in_reward: Optional[bool] = None  # KL penalty in the reward; None = true except for grpo (KL as a loss there)
    kl_coef: Optional[float] = None  # (initial) coefficient of the KL in the reward; None = 0.05 with the KL in the reward, else 0
    kl_estimator: str = "k1"  # KL estimator in the reward and the KL metrics: a key of KL_ESTIMATORS
    kl_controller: str = "fixed"  # fixed | adaptive (Ziegler et al. 2019), for kl_coef
    kl_target: float = 6.0  # adaptive controller target KL, nats per sequence
    kl_horizon: int = 10000  # adaptive controller horizon, samples
    # coefficient of the KL loss term in the actor loss (TRL GRPO beta, verl kl_loss_coef); 0 = off;
    # None = 0.04 (DeepSeekMath) with the KL out of the reward (grpo's default), else 0
    kl_loss_coef: Optional[float] = None
    kl_loss_estimator: str = "k3"  # estimator of the KL loss term (DeepSeekMath: k3)
    entropy_coef: float = 0.0  # entropy bonus weight
    whiten_advantages: bool = True  # gae: normalize advantages over the batch
    ppo_epochs: int = 1  # passes over each rollout batch
    critic_warmup_steps: int = 0  # steps that train only the critic
    normalize_rewards: bool = True  # standardize RM scores with the RM's saved mean/std
    tis_cap: Optional[float] = None  # truncated importance-sampling cap on exp(old - rollout); None = off
    # AReaL's decoupled PPO objective (Fu et al. 2025) with the engine's log-probs as the behaviour policy and the
    # recomputed old log-probs as the proximal one (with recompute_old_log_probs=false the update's own forward,
    # detached: exact for an on-policy update); None = on exactly when trainer.max_staleness > 0 (resolved
    # when the run's config is built)
    decoupled_loss: Optional[bool] = None
    behavior_weight_cap: Optional[float] = None  # decoupled loss: tokens whose pi_prox / pi_behav exceeds this are left out; None = no cap
    # false: skip the actor's old-log-prob forward of the inference phase; the update uses its own
    # forward's log-probs, detached, as old (ratio 1; exact only when the update is on-policy: one
    # epoch, one mini-batch, no KL in the reward, no tis_cap; TRL GRPOTrainer with num_iterations=1).
    # With the decoupled loss they are the proximal policy: pi_prox / pi_behav then weighs the policy gradient.
    # The engine-vs-trainer mismatch metrics are then not measured.
    recompute_old_log_probs: bool = True
    vf_coef: float = 1.0  # value-loss weight
    # on-policy distillation (GKD, Agarwal et al. 2024): the per-token reverse KL to the teacher (teacher.init) on the
    # student's own samples, -distill_coef * (log pi(y_t) - log pi_teacher(y_t)), centered, added to each token's advantage; 0 = off
    distill_coef: float = 0.0
    # DAPO's soft overlong punishment (Yu et al. 2025): responses longer than max_new_tokens - overlong_buffer
    # lose up to overlong_penalty (at the budget, i.e. a cut response) from their score; 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # Tülu 3's non-stop penalty (Lambert et al. 2024; open-instruct's non_stop_penalty with
    # penalty_reward_value): a response that did not end with EOS (cut at max_new_tokens) gets this score
    # instead of its reward (after an RM score's standardization, before the advantage estimator; Tülu 3: -10;
    # open-instruct's IF GRPO: 0). None = off. Applied to rule, model and environment scores alike.
    non_stop_score: Optional[float] = None
    # DAPO's dynamic sampling (Yu et al. 2025): groups whose n samples all got the same score are
    # dropped and more prompts are generated, up to dynamic_sampling_max_rounds generation rounds a
    # step, until rollout_batch_size groups are kept (group estimators: grpo, rloo, reinforce_pp_baseline)
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4

    def __post_init__(self) -> None:
        resolve_kl(self)

    @property
    def resolved_kl_in_reward(self) -> bool:
        """``kl_in_reward``, or its default: true for every estimator but grpo."""
        return self.advantage != "grpo" if self.kl_in_reward is None else bool(self.kl_in_reward)

    @property
    def reward_kl_coef_used(self) -> bool:
        """Whether the KL-in-reward coefficient can be nonzero in this run."""
        return self.resolved_kl_in_reward and (self.kl_coef > 0 or self.kl_controller == "adaptive")

    @property
    def uses_reference(self) -> bool:
        """Whether any KL term needs the reference policy's log-probs."""
        return self.reward_kl_coef_used or self.kl_loss_coef > 0

    def validate(self, prefix: str = "algorithm") -> None:
        _choice(f"{prefix}.advantage", self.advantage, tuple(alg.ADVANTAGE_ESTIMATORS))
        _choice(f"{prefix}.kl_estimator", self.kl_estimator, tuple(alg.KL_ESTIMATORS))
        _choice(f"{prefix}.kl_loss_estimator", self.kl_loss_estimator, tuple(alg.KL_ESTIMATORS))
        _choice(f"{prefix}.kl_controller", self.kl_controller, tuple(alg.KL_CONTROLLERS))
        _choice(f"{prefix}.loss_agg", self.loss_agg, alg.LOSS_AGG_MODES)
        _choice(f"{prefix}.policy_loss", self.policy_loss, alg.POLICY_LOSSES)
        validate_policy_loss(self, prefix)
        _check(0 <= self.gamma <= 1, f"{prefix}.gamma", self.gamma, "must be in [0, 1]")
        _check(0 <= self.gae_lambda <= 1, f"{prefix}.gae_lambda", self.gae_lambda, "must be in [0, 1]")
        _check(self.clip_eps > 0, f"{prefix}.clip_eps", self.clip_eps, "must be positive (e.g. 0.2)")
        if self.clip_eps_high is not None:
            _check(self.clip_eps_high > 0, f"{prefix}.clip_eps_high", self.clip_eps_high, "must be positive (e.g. 0.28, DAPO) or null")
        _check(self.ppo_epochs >= 1, f"{prefix}.ppo_epochs", self.ppo_epochs, "must be >= 1")
        _check(self.distill_coef >= 0, f"{prefix}.distill_coef", self.distill_coef, "must be >= 0 (e.g. 1.0 with teacher.init; 0 = off)")
        if self.dual_clip is not None:
            _check(self.dual_clip > 1, f"{prefix}.dual_clip", self.dual_clip, "must be > 1 (e.g. 3.0) or null")
        if self.tis_cap is not None:
            _check(self.tis_cap >= 1, f"{prefix}.tis_cap", self.tis_cap, "must be >= 1 (e.g. 2.0) or null")
        if self.behavior_weight_cap is not None:
            _check(
                self.behavior_weight_cap > 1, f"{prefix}.behavior_weight_cap", self.behavior_weight_cap, "must be > 1 (e.g. 5.0) or null"
            )
        _check(self.overlong_buffer >= 0, f"{prefix}.overlong_buffer", self.overlong_buffer, "must be >= 0 (tokens; 0 = off)")
        _check(self.overlong_penalty >= 0, f"{prefix}.overlong_penalty", self.overlong_penalty, "must be >= 0 (e.g. 1.0, DAPO)")
        _check(
            self.dynamic_sampling_max_rounds >= 1,
            f"{prefix}.dynamic_sampling_max_rounds",
            self.dynamic_sampling_max_rounds,
            "must be >= 1 (generation rounds a step may take to fill the batch, e.g. 4)",
        )
        _check(
            not self.dynamic_sampling or self.advantage in GROUP_ESTIMATORS,
            f"{prefix}.dynamic_sampling",
            self.dynamic_sampling,
            f"drops groups of samples of one prompt, which advantage={self.advantage} has none of: "
            f"use advantage={' / '.join(GROUP_ESTIMATORS)} or dynamic_sampling=false",
        )
        _check(
            self.norm_by_std or self.advantage == "grpo",
            f"{prefix}.norm_by_std",
            self.norm_by_std,
            f"applies to advantage=grpo only (advantage={self.advantage} has no group std): remove it",
        )


def validate_policy_loss(a: AlgorithmConfig, prefix: str = "algorithm") -> None:
    """What ``policy_loss=gspo|cispo`` cannot honour, refused (ConfigError naming the field and the fix):
    gspo's objective is a mean over sequences of per-sequence terms (loss_agg=seq-mean-token-mean); neither
    has a dual clip; the decoupled loss for stale samples is PPO's (its per-token proximal clip). The
    decoupled loss's own default (``trainer.max_staleness > 0``) is checked by
    :func:`aligner.config.validation.validate_staleness` after it resolves."""
    if a.policy_loss == "ppo":
        return
    _check(
        a.dual_clip is None,
        f"{prefix}.dual_clip",
        a.dual_clip,
        f"the dual clip bounds PPO's token surrogate, which policy_loss={a.policy_loss} has none of: set it to null or policy_loss=ppo",
    )
    _check(
        not a.decoupled_loss,
        f"{prefix}.decoupled_loss",
        a.decoupled_loss,
        f"the decoupled loss for samples from stale weights is PPO's objective: set it false (with trainer.max_staleness=0) "
        f"or policy_loss=ppo instead of {a.policy_loss}",
    )
    if a.policy_loss == "gspo":
        _check(
            a.loss_agg == "seq-mean-token-mean",
            f"{prefix}.loss_agg",
            a.loss_agg,
            "policy_loss=gspo is a mean over sequences of each sequence's clipped ratio term (Zheng et al. 2025, eq. 5); "
            "another aggregation weights sequences by their length: set algorithm.loss_agg=seq-mean-token-mean",
        )


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")  # baselines from a prompt's own samples
FOLLOW_THE_ESTIMATOR = ("kl_in_reward", "kl_coef", "kl_loss_coef")  # None in the Hydra schema: resolve_kl fills them
REWARD_KL_COEF = 0.05  # kl_coef nobody set, with the KL in the reward (gae, rloo, reinforce_pp, reinforce_pp_baseline)
LOSS_KL_COEF = 0.04  # kl_loss_coef nobody set, with the KL out of the reward (grpo: DeepSeekMath's beta, Shao et al. 2024)


def kl_in_reward_by_default(advantage: str) -> bool:
    """Where the KL goes when ``algorithm.kl_in_reward`` is not set: the reward for every estimator but
    grpo, whose KL is a loss term (DeepSeekMath, Shao et al. 2024)."""
    return advantage != "grpo"


def resolve_kl(a: AlgorithmConfig, prefix: str = "algorithm") -> None:
    """Fill the KL fields of `a` left None with the estimator's defaults, in place (once, as it is built).

    ``kl_in_reward``: :func:`kl_in_reward_by_default`. ``kl_coef``: REWARD_KL_COEF with the KL in the
    reward, else 0 (not applied). ``kl_loss_coef``: 0 with the KL in the reward, else LOSS_KL_COEF.
    Raises ConfigError for a negative coefficient, and for a reward-KL coefficient (or an adaptive
    controller) that was set while the KL is not in the reward: nothing would apply it.
    """
    if a.kl_coef is not None:
        _check(a.kl_coef >= 0, f"{prefix}.kl_coef", a.kl_coef, "must be >= 0")
    if a.kl_loss_coef is not None:
        _check(a.kl_loss_coef >= 0, f"{prefix}.kl_loss_coef", a.kl_loss_coef, "must be >= 0 (e.g. 0.04, DeepSeekMath)")
    in_reward = kl_in_reward_by_default(a.advantage) if a.kl_in_reward is None else bool(a.kl_in_reward)
    if not in_reward:
        where = (
            f"{prefix}.kl_in_reward=false"
            if a.kl_in_reward is not None
            else f"{prefix}.kl_in_reward is false by default for advantage={a.advantage}"
        )
        fix = (
            f"the KL is not in the reward ({where}): set {prefix}.kl_coef=0 and put the KL in the loss with "
            f"{prefix}.kl_loss_coef (e.g. 0.04, DeepSeekMath), or set {prefix}.kl_in_reward=true"
        )
        _check(not a.kl_coef, f"{prefix}.kl_coef", a.kl_coef, fix)
        _check(a.kl_controller == "fixed", f"{prefix}.kl_controller", a.kl_controller, fix)
    a.kl_in_reward = in_reward
    if a.kl_coef is None:
        a.kl_coef = REWARD_KL_COEF if in_reward else 0.0
    if a.kl_loss_coef is None:
        a.kl_loss_coef = 0.0 if in_reward else LOSS_KL_COEF


def follow_the_estimator(algorithm: Any, explicit: Collection[str], prefix: str = "algorithm") -> None:
    """Reset, in a composed config's `algorithm` node (before it is built), the reward-KL settings that
    a preset file gave but this run's KL placement does not apply, unless the command line set them.

    A preset's ``kl_coef`` / ``kl_controller`` are tuned for the preset's estimator: with
    ``algorithm.advantage=grpo`` on a gae preset (or ``algorithm.kl_in_reward=false``) the KL leaves
    the reward, so they reset to the estimator's default (``kl_coef`` None, resolved by
    :func:`resolve_kl`; ``kl_controller`` fixed). A value in `explicit` (the dotted keys given on the
    command line) is kept, and refused by :func:`resolve_kl` if nothing applies it.
    """
    advantage, kl_in_reward = algorithm.advantage, algorithm.kl_in_reward
    if kl_in_reward_by_default(advantage) if kl_in_reward is None else bool(kl_in_reward):
        return
    if f"{prefix}.kl_coef" not in explicit:
        algorithm.kl_coef = None
    if f"{prefix}.kl_controller" not in explicit:
        algorithm.kl_controller = "fixed"


@dataclass(kw_only=True)
class KTOConfig:
    """The KTO stage's loss (Ethayarajh et al. 2024; formulas in :func:`aligner.algorithms.kto_loss`)."""

    beta: float = 0.1  # implicit reward = beta * (log pi - log pi_ref), nats (TRL KTOConfig.beta)
    desirable_weight: float = 1.0  # lambda_D, the weight of desirable examples' losses
    undesirable_weight: float = 1.0  # lambda_U (the paper: keep lambda_D n_D / (lambda_U n_U) in [1, 4/3])

    def validate(self, prefix: str = "kto") -> None:
        _check(self.beta > 0, f"{prefix}.beta", self.beta, "must be > 0 (e.g. 0.1)")
        for name in ("desirable_weight", "undesirable_weight"):
            _check(getattr(self, name) >= 0, f"{prefix}.{name}", getattr(self, name), "must be >= 0 (e.g. 1.0)")


@dataclass(kw_only=True)
class SPINConfig:
    """The SPIN stage (Chen et al. 2024; the loss in :func:`aligner.algorithms.spin_loss`): ``iterations`` rounds of
    DPO with chosen = the SFT data's response and rejected = the current policy's own (greedy) response to the same
    prompt, against the policy at the round's start (``trainer.max_steps`` split evenly over the rounds)."""

    iterations: int = 2  # self-play rounds (the paper: 3-4)
    prompts_per_iteration: int = 256  # SFT examples each round generates for (sampled without replacement, seeded)
    lam: float = 0.1  # the paper's lambda: the loss is DPO's sigmoid with beta = lam

    def validate(self, prefix: str = "spin") -> None:
        _check(self.iterations >= 1, f"{prefix}.iterations", self.iterations, "must be >= 1 (e.g. 2)")
        _check(self.prompts_per_iteration >= 2, f"{prefix}.prompts_per_iteration", self.prompts_per_iteration, "must be >= 2 (e.g. 256)")
        _check(self.lam > 0, f"{prefix}.lam", self.lam, "must be > 0 (e.g. 0.1)")


@dataclass(kw_only=True)
class DPOConfig:
    """The DPO stage's loss (formulas in :func:`aligner.algorithms.dpo_loss`)."""

    beta: float = 0.1  # KL-regularization strength: implicit reward = beta * (log pi - log pi_ref), nats
    loss_type: str = "sigmoid"  # sigmoid (DPO, Rafailov et al. 2023) | ipo (Azar et al. 2023, length-normalized as TRL)
    label_smoothing: float = 0.0  # sigmoid only: probability a preference label is flipped (conservative DPO), in [0, 0.5)
    rpo_alpha: float = 0.0  # weight of the chosen responses' NLL (token mean) added to the loss (RPO, Pang et al. 2024); 0 = off

    def validate(self, prefix: str = "dpo") -> None:
        _choice(f"{prefix}.loss_type", self.loss_type, alg.DPO_LOSS_TYPES)
        _check(self.beta > 0, f"{prefix}.beta", self.beta, "must be > 0 (e.g. 0.1)")
        _check(0 <= self.label_smoothing < 0.5, f"{prefix}.label_smoothing", self.label_smoothing, "must be in [0, 0.5) (e.g. 0.1)")
        _check(
            self.label_smoothing == 0 or self.loss_type == "sigmoid",
            f"{prefix}.label_smoothing",
            self.label_smoothing,
            f"applies to {prefix}.loss_type=sigmoid only (conservative DPO): set it to 0 with loss_type={self.loss_type}",
        )
        _check(self.rpo_alpha >= 0, f"{prefix}.rpo_alpha", self.rpo_alpha, "must be >= 0 (e.g. 1.0; 0 = off)")
