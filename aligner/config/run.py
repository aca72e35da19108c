"""The whole run's schema: the training loop (:class:`TrainerConfig`), the cluster
(:class:`ClusterConfig`) and :class:`AlignerConfig`, which holds every section and is validated
once, when it is built (:func:`aligner.config.validation.validate_run`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, get_type_hints

from aligner.config.algorithm import FOLLOW_THE_ESTIMATOR, AlgorithmConfig, DPOConfig, KTOConfig, SPINConfig
from aligner.config.common import LOGGERS, MODEL_ROLES, _check, _choice
from aligner.config.data import DataConfig, TaskConfig, TokenizerConfig
from aligner.config.env import EnvConfig
from aligner.config.model import ModelConfig
from aligner.config.paths import check_paths
from aligner.config.roles import ActorRoleConfig, RefRoleConfig, RewardRoleConfig, RoleConfig, TrainableRoleConfig
from aligner.config.rollout import RolloutConfig
from aligner.config.rs import RSConfig
from aligner.config.validation import validate_run


@dataclass(kw_only=True)
class TrainerConfig:
    """The training loop: steps, batch sizes, seeds, logging and checkpoint cadence."""

    max_steps: int = 100  # optimizer steps (SFT/RM) or PPO steps
    seed: int = 42  # global seed (model init, data order, sampling)
    save_every: int = 0  # checkpoint every N steps; 0 = only at the end
    eval_every: int = 0  # evaluate every N steps; 0 = only at the end
    log_every: int = 1  # log metrics every N steps
    global_batch_size: int = 32  # SFT/RM: samples per optimizer step (over all dp ranks)
    micro_batch_size: int = 8  # samples per forward/backward per dp rank
    micro_batch_tokens: int = 0  # > 0: micro-batches by a token budget (rows x the micro-batch's longest row <= this; sorted first-fit) instead of micro_batch_size, for every role's training and forward passes; 0 = micro_batch_size rows (aligner.runtime.runner)
    rollout_batch_size: int = 32  # PPO: prompts per step
    n_samples_per_prompt: int = 1  # PPO: responses per prompt (>= 2 for grpo, rloo, reinforce_pp_baseline)
    mini_batch_size: int = 32  # PPO: samples per optimizer step
    shared_prompt_pack_len: int = 4096  # PPO with n_samples_per_prompt > 1: the actor and reference run a prompt's samples as one packed row, the prompt's positions once (aligner.actor.shared_prompt), when the row has at most this many tokens; 0 = padded rows
    eval_batch_size: int = 64  # prompts per evaluation batch
    max_nonfinite: int = 3  # consecutive non-finite updates before the run stops
    num_threads: int = 0  # torch threads per CPU worker; 0 = follow the work: the workers busy in a phase share their node's cores (a role running alone gets them all)
    progress: bool = True  # show a progress bar
    preempt_grace_s: float = 25.0  # after SIGTERM: seconds to finish the step and checkpoint (below the scheduler's grace, 30 s by default)
    # PPO with rollout.placement=split: batches the rollout group may generate ahead of the update (each
    # sample is at most this many weight versions old when trained); 0 = synchronous
    max_staleness: int = 0
    # max_staleness >= 1 with a reference role: its log-probs of a queued batch are computed as soon as the
    # batch is generated, beside the actor's update, instead of in the next step's inference phase (the
    # reference is fixed, so they need only the batch); None = on exactly where the reference has devices
    # of its own (no ref.colocate_with, cluster.placement=split): beside the update it would hold memory on
    # the actor's devices otherwise
    ref_ahead: Optional[bool] = None
    # a worker call with no result for this long is a hang: its stacks are dumped and it is handled as a
    # death (the automatic restart); counted from the call's submission; 0 = no watchdog
    hang_timeout_s: float = 1800.0
    # per-rank busy seconds of each worker group are in every step's metrics (ranks/<role>/busy_s_*); a rank busy this many
    # times its group's median in a step (of at least 1 s) is logged as a straggler; 0 = no straggler line
    straggler_factor: float = 1.5
    max_restarts: int = 2  # a worker process that dies: stop and restart the groups, resume from the latest checkpoint, at most this many times a run; 0 = end the run (resume=true by hand)
    # a restart waits this long for the cluster to hold the worker groups again (a lost node replaced, as
    # Kubernetes or an autoscaler does), then ends the run naming the cluster it needs; 0 = no wait
    restart_wait_s: float = 300.0
    # where metrics go (aligner.tracking.MetricsLogger): jsonl | tensorboard | wandb | mlflow. output_dir/metrics.jsonl is
    # always written (resume, the plots and the summary read it), named here or not; wandb and mlflow follow their
    # own environment variables (WANDB_MODE=offline, WANDB_API_KEY, MLFLOW_TRACKING_URI, ...)
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    logger_project: str = ""  # the W&B project and MLflow experiment; "" = WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else "aligner"

    def validate(self, prefix: str = "trainer") -> None:
        for name in (
            "max_steps",
            "global_batch_size",
            "micro_batch_size",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "mini_batch_size",
            "eval_batch_size",
            "max_nonfinite",
        ):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        for name in (
            "save_every",
            "eval_every",
            "num_threads",
            "shared_prompt_pack_len",
            "max_restarts",
            "micro_batch_tokens",
            "max_staleness",
        ):
            _check(getattr(self, name) >= 0, f"{prefix}.{name}", getattr(self, name), "must be >= 0")
        unknown = [n for n in self.loggers if n not in LOGGERS]
        _check(
            not unknown,
            f"{prefix}.loggers",
            list(self.loggers),
            f"unknown loggers {unknown}: valid loggers are {', '.join(LOGGERS)} (e.g. {prefix}.loggers=[jsonl,tensorboard,wandb])",
        )
        _check(len(set(self.loggers)) == len(self.loggers), f"{prefix}.loggers", list(self.loggers), "name each logger once")
        _check(self.hang_timeout_s >= 0, f"{prefix}.hang_timeout_s", self.hang_timeout_s, "must be >= 0 seconds (0 = no hang watchdog)")
        _check(
            self.restart_wait_s >= 0, f"{prefix}.restart_wait_s", self.restart_wait_s, "must be >= 0 seconds (0 = no wait for lost nodes)"
        )
        _check(
            self.straggler_factor == 0 or self.straggler_factor > 1,
            f"{prefix}.straggler_factor",
            self.straggler_factor,
            "must be > 1 (times the group's median busy time) or 0 for no straggler line",
        )
        _check(
            self.preempt_grace_s > 0,
            f"{prefix}.preempt_grace_s",
            self.preempt_grace_s,
            "must be > 0 seconds (a few below the scheduler's grace period, e.g. 25)",
        )
        _check(
            self.global_batch_size % self.micro_batch_size == 0,
            f"{prefix}.global_batch_size",
            self.global_batch_size,
            f"must be a multiple of {prefix}.micro_batch_size={self.micro_batch_size}",
        )
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        _check(
            samples % self.mini_batch_size == 0,
            f"{prefix}.mini_batch_size",
            self.mini_batch_size,
            f"must divide rollout_batch_size * n_samples_per_prompt = {samples}",
        )


@dataclass(kw_only=True)
class ClusterConfig:
    """The cluster the run is placed on (and that plans are made for)."""

    address: str = ""  # Ray address; "" = RAY_ADDRESS or a new local instance, "auto" = existing cluster
    num_nodes: int = 1  # nodes
    gpus_per_node: int = 0  # GPUs per node (0 = CPU-only)
    gpu_mem_gb: float = 80.0  # memory per GPU in GiB (2**30 B), as GPUs are sold: an "80 GB" H100 = 80 GiB
    cpus_per_node: int = 0  # CPUs per node; 0 = detect
    placement: str = "split"  # split (each role its own node group) | colocated (roles share bundles)
    gpu_peak_tflops: float = 989.0  # dense bf16 peak per GPU, TFLOP/s (H100 SXM), for plans
    intra_node_gbps: float = 450.0  # NVLink bandwidth per GPU, GB/s, for plans
    inter_node_gbps: float = 50.0  # network bandwidth per GPU, GB/s, for plans
    hbm_gbps: float = 3350.0  # HBM bandwidth per GPU, GB/s (H100 SXM), for plans (decode is bandwidth bound)

    def validate(self, prefix: str = "cluster") -> None:
        _check(self.num_nodes >= 1, f"{prefix}.num_nodes", self.num_nodes, "must be >= 1")
        _check(self.gpus_per_node >= 0, f"{prefix}.gpus_per_node", self.gpus_per_node, "must be >= 0")
        _check(self.gpu_mem_gb > 0, f"{prefix}.gpu_mem_gb", self.gpu_mem_gb, "must be positive")
        _choice(f"{prefix}.placement", self.placement, ("split", "colocated"))


@dataclass(kw_only=True)
class AlignerConfig:
    """The whole run. Built from Hydra (`conf=PRESET` plus overrides) and validated once."""

    stage: str = "ppo"  # sft | rm | ppo | plan | dpo | kto | spin | rs (set by the entry point)
    preset: str = "tiny"  # name of the preset the run started from
    output_dir: str = "outputs/tiny"  # checkpoints, metrics.jsonl, TensorBoard events, plots
    resume: bool = False  # continue from the latest complete checkpoint in output_dir
    # delete a previous run's outputs in output_dir first, then run fresh (without it, or resume=true,
    # a run refuses an output_dir that holds a previous run's files: see aligner/run_ops/run_dir.py)
    overwrite: bool = False
    plan_only: bool = False  # print the placement/memory plan and exit 0
    model: ModelConfig = field(default_factory=ModelConfig)  # policy (and, by default, every role's) dimensions
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actor: ActorRoleConfig = field(default_factory=ActorRoleConfig)  # policy (also the SFT model)
    critic: TrainableRoleConfig = field(default_factory=TrainableRoleConfig)  # value model
    reward: RewardRoleConfig = field(default_factory=RewardRoleConfig)  # reward model or rule (also the RM stage's model)
    ref: RefRoleConfig = field(default_factory=RefRoleConfig)  # frozen reference policy
    # frozen teacher of on-policy distillation (teacher.init set, with algorithm.distill_coef > 0): served like the reference
    teacher: RefRoleConfig = field(default_factory=RefRoleConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation engine
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn episodes (env.name set: each prompt plays one)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # the DPO stage's loss
    kto: KTOConfig = field(default_factory=KTOConfig)  # the KTO stage's loss
    spin: SPINConfig = field(default_factory=SPINConfig)  # the SPIN stage's rounds and loss
    rs: RSConfig = field(default_factory=RSConfig)  # the rejection-sampling stage (aligner.rs)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        validate_run(self)

    def roles_used(self) -> tuple[str, ...]:
        """The role groups this run starts.

        sft and dpo: actor (DPO's reference lives in the actor's workers). rm: reward. rs: actor, and reward
        when ``reward.type`` is model or judge. ppo: actor always; critic for gae; reward when
        ``reward.type`` is model or judge; ref when a KL term needs it (:attr:`AlgorithmConfig.uses_reference`).
        plan: the PPO roles.
        """
        if self.stage in ("sft", "dpo", "kto", "spin"):
            return ("actor",)
        if self.stage == "rs":  # rejection sampling: the actor samples and trains; a reward model or judge scores
            return ("actor", "reward") if self.reward.type in ("model", "judge") else ("actor",)
        if self.stage == "rm":
            return ("reward",)
        roles = ["actor"]
        if self.algorithm.advantage == "gae":
            roles.append("critic")
        if self.reward.type in ("model", "judge"):
            roles.append("reward")
        if self.algorithm.uses_reference and not self.ref_from_actor:
            roles.append("ref")
        if self.teacher.init:
            roles.append("teacher")
        return tuple(roles)

    @property
    def ref_from_actor(self) -> bool:
        """PPO with a LoRA actor (actor.lora.rank > 0) and a KL term: the reference policy is the actor
        with its adapters disabled (its frozen base), so no ref worker group is started."""
        return self.stage in ("ppo", "plan") and self.algorithm.uses_reference and self.actor.lora.rank > 0

    def init_of(self, role: str) -> str:
        """The checkpoint `role` starts from: its own ``init``, else the critic starts from the
        reward model (``reward.init``, when ``reward.type=model``) and the reference from the
        policy (``actor.init``); "" = random weights."""
        return self.role(role).init or (self.role(fallback).init if (fallback := self._init_fallback(role)) else "")

    def init_field(self, role: str) -> str:
        """How to name where `role`'s init comes from in a message: "critic.init", or
        "reward.init (critic.init is empty)" when it falls back."""
        fallback = self._init_fallback(role)
        if self.role(role).init or not fallback or not self.role(fallback).init:
            return f"{role}.init"
        return f"{fallback}.init (the {role} starts from it: {role}.init is empty)"

    def _init_fallback(self, role: str) -> str:
        if role == "critic":
            return "reward" if self.reward.type == "model" else ""
        return "actor" if role == "ref" else ""

    def check_paths(self, roles: Optional[tuple[str, ...]] = None) -> None:
        """Check that every input path the run will read exists (after planning, before any work):
        :func:`aligner.config.paths.check_paths`. Raises ConfigError naming the field, the path and the fix."""
        check_paths(self, roles)

    def role(self, name: str) -> RoleConfig:
        """The config of role `name` (actor, critic, reward, ref, teacher): a :class:`RoleConfig`, whose subclass
        depends on the role (:func:`roles_with_field`); ValueError for other names."""
        if name not in MODEL_ROLES:
            raise ValueError(f"unknown role {name!r}: valid roles are {', '.join(MODEL_ROLES)}")
        return getattr(self, name)


def roles_with_field(name: str) -> tuple[str, ...]:
    """The model-hosting roles whose schema has the field `name`: ``"type"`` -> ``("reward",)``,
    ``"optim"`` -> ``("actor", "critic", "reward")``, ``"init"`` -> all five; ``()`` for no role's field."""
    schemas = get_type_hints(AlignerConfig)
    return tuple(r for r in MODEL_ROLES if name in {f.name for f in fields(schemas[r])})


REDACTED = "<redacted>"
SECRET_FIELDS = ("reward.token",)  # never on the command line, never written or logged in clear


def secret_override_problem(overrides) -> str:
    """What is wrong with command-line `overrides` ("" when nothing): one sets a secret field
    (:data:`SECRET_FIELDS`), which other users of the machine read in /proc/PID/cmdline and loggers
    record (W&B stores the command line). The fix: the environment or a file."""
    for o in overrides:
        key = str(o).lstrip("+~").partition("=")[0].strip()
        if key in SECRET_FIELDS:
            return (
                f"{key} is not accepted on the command line (other users see a process's arguments, and loggers such "
                "as W&B record them): set the environment variable ALIGNER_RM_TOKEN, or reward.token_file=PATH "
                "(a file holding the token), or reward.token in a config file"
            )
    return ""


def _redacted_node(cfg: AlignerConfig):
    from omegaconf import OmegaConf

    node = OmegaConf.structured(cfg)
    if node.reward.token:
        node.reward.token = REDACTED
    return node


def config_yaml(cfg: AlignerConfig) -> str:
    """The config as YAML text (saved beside checkpoints and printed by --cfg), with secrets
    (``reward.token``, the remote reward server's shared token) written as ``<redacted>``: a run's
    output_dir is shared and copied, a credential does not belong in it."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(_redacted_node(cfg))


def config_dict(cfg: AlignerConfig) -> dict:
    """The config as nested plain dicts and lists, secrets redacted as in :func:`config_yaml` (what
    the W&B and MLflow loggers record as the run's config)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(_redacted_node(cfg), resolve=True)


def hydra_schema():
    """The structured OmegaConf node (an ``omegaconf.DictConfig`` typed :class:`AlignerConfig`) that Hydra
    composes the YAML files and overrides into: AlignerConfig's defaults, with the algorithm's KL fields
    that follow the advantage estimator (FOLLOW_THE_ESTIMATOR) left null, so that the config built from
    the composition resolves them for its own estimator (:func:`aligner.config.algorithm.resolve_kl`)."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(AlignerConfig)
    for name in FOLLOW_THE_ESTIMATOR:
        node.algorithm[name] = None
    return node
