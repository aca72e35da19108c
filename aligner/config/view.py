"""What the checks of a whole run read of its config: :class:`RunView`, a structural type.

The cross-section checks (:mod:`aligner.config.validation`), the package probes
(:mod:`aligner.config.probes`) and the file-system checks (:mod:`aligner.config.paths`) receive the
run's config typed by this Protocol, so that they need no import of :mod:`aligner.config.run`, which
builds the config and calls them: the imports between the config's modules point one way, from the
whole run down to its sections. :class:`aligner.config.run.AlignerConfig` satisfies it
(``tests/config/test_validation.py`` checks every member).
"""

from __future__ import annotations

from typing import Protocol

from aligner.config.algorithm import AlgorithmConfig, DPOConfig, KTOConfig, SPINConfig
from aligner.config.cluster import ClusterConfig
from aligner.config.data import DataConfig, TaskConfig, TokenizerConfig
from aligner.config.env import EnvConfig
from aligner.config.model import ModelConfig
from aligner.config.roles import ActorRoleConfig, RefRoleConfig, RewardRoleConfig, RoleConfig, TrainableRoleConfig
from aligner.config.rollout import RolloutConfig
from aligner.config.rs import RSConfig
from aligner.config.trainer import TrainerConfig


class RunView(Protocol):
    """A whole run's config: the run's own fields, every section, and the questions about roles that
    need more than one section (:class:`aligner.config.run.AlignerConfig` documents each)."""

    stage: str
    preset: str
    output_dir: str
    model: ModelConfig
    tokenizer: TokenizerConfig
    data: DataConfig
    task: TaskConfig
    trainer: TrainerConfig
    actor: ActorRoleConfig
    critic: TrainableRoleConfig
    reward: RewardRoleConfig
    ref: RefRoleConfig
    teacher: RefRoleConfig
    rollout: RolloutConfig
    env: EnvConfig
    algorithm: AlgorithmConfig
    dpo: DPOConfig
    kto: KTOConfig
    spin: SPINConfig
    rs: RSConfig
    cluster: ClusterConfig

    def roles_used(self) -> tuple[str, ...]:
        """The role groups the run starts."""

    @property
    def ref_from_actor(self) -> bool:
        """Whether the reference policy is the LoRA actor with its adapters disabled."""

    def init_of(self, role: str) -> str:
        """The checkpoint `role` starts from ("" = random weights)."""

    def init_field(self, role: str) -> str:
        """How to name in a message where `role`'s init comes from."""

    def role(self, name: str) -> RoleConfig:
        """The config of role `name`."""
