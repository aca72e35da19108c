"""The whole run's schema, :class:`AlignerConfig`: the run's own fields and every section (model, data,
trainer, roles, rollout, algorithm, cluster, ...), validated once, when it is built
(:meth:`AlignerConfig.validate`: each section validates its own fields, then
:func:`aligner.config.validation.validate_run` checks the sections against each other)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, get_type_hints

from aligner.config.agent import AgentConfig
from aligner.config.algorithm import FOLLOW_THE_ESTIMATOR, AlgorithmConfig, DPOConfig, KTOConfig, SPINConfig
from aligner.config.cluster import ClusterConfig
from aligner.config.common import MODEL_ROLES, PRESETS, STAGES, _check, _choice
from aligner.config.data import DataConfig, TaskConfig, TokenizerConfig
from aligner.config.env import EnvConfig
from aligner.config.model import ModelConfig
from aligner.config.paths import check_paths
from aligner.config.roles import ActorRoleConfig, RefRoleConfig, RewardRoleConfig, RoleConfig, TrainableRoleConfig
from aligner.config.rollout import RolloutConfig
from aligner.config.rs import RSConfig
from aligner.config.trainer import TrainerConfig
from aligner.config.validation import validate_run


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
    agent: AgentConfig = field(default_factory=AgentConfig)  # env.name=agent: the agent program played through the OpenAI endpoint
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # the DPO stage's loss
    kto: KTOConfig = field(default_factory=KTOConfig)  # the KTO stage's loss
    spin: SPINConfig = field(default_factory=SPINConfig)  # the SPIN stage's rounds and loss
    rs: RSConfig = field(default_factory=RSConfig)  # the rejection-sampling stage (aligner.rs)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every check of the built config, in order: the run's own fields (stage, conf, output_dir), each
        section's own (its ``validate``), then the checks across sections and the package probes
        (:func:`aligner.config.validation.validate_run`, which also resolves the fields that follow
        others: ``algorithm.decoupled_loss``, ``trainer.ref_ahead``). Raises ConfigError at the first."""
        _choice("stage", self.stage, STAGES)
        _choice("conf", self.preset, PRESETS)
        _check(
            bool(self.output_dir.strip()),
            "output_dir",
            self.output_dir,
            "give a directory, e.g. output_dir=outputs/run1 (empty would write into the current directory)",
        )
        self.model.validate("model")
        self.data.validate("data")
        self.task.validate("task")
        self.trainer.validate("trainer")
        for role in MODEL_ROLES:
            getattr(self, role).validate(role, self.model)
        self.rollout.validate("rollout", self.model)
        self.env.validate("env")
        self.agent.validate("agent")
        self.algorithm.validate("algorithm")
        self.dpo.validate("dpo")
        self.kto.validate("kto")
        self.spin.validate("spin")
        self.rs.validate("rs")
        self.cluster.validate("cluster")
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
