"""Configuration schemas for every aligner stage (SFT, RM, PPO, DPO, plan), a package by concern.

Owns: the keyword-only dataclasses that Hydra/OmegaConf compose into, and their validation
(``__post_init__``). Configs are never mutated after they are built; per-rank derived sizes
(local heads, local batch) live in separate objects in ``aligner.parallel``.

- schemas, one group per section or role: :mod:`~aligner.config.model`, :mod:`~aligner.config.data`
  (tokenizer, data, task), :mod:`~aligner.config.parallel` (a role's layout and resources),
  :mod:`~aligner.config.roles` (actor, critic, reward, ref), :mod:`~aligner.config.rollout`,
  :mod:`~aligner.config.env` (a multi-turn environment),
  :mod:`~aligner.config.algorithm` (PPO family, DPO), :mod:`~aligner.config.trainer`,
  :mod:`~aligner.config.cluster`, :mod:`~aligner.config.rs`; each section validates its own fields
  (its ``validate``);
- :mod:`~aligner.config.run`: the whole :class:`AlignerConfig`, which holds the sections and validates
  itself once, when built: its own fields, each section's, then the checks across sections;
- :mod:`~aligner.config.validation`: the checks across sections, one function per concern, with the
  stages and settings each applies to (``CROSS_CHECKS``);
- :mod:`~aligner.config.probes`: package probes of a chosen backend (run with the validation);
- :mod:`~aligner.config.paths`: the file-system checks (run after planning, before any work);
- :mod:`~aligner.config.renames`: renamed fields, whose old names the command line still takes for one release;
- :mod:`~aligner.config.view`: :class:`RunView`, the structural type by which validation, probes and
  paths read a whole config without importing :mod:`~aligner.config.run` (the imports point one way).

Every bad value raises :class:`ConfigError` (a ``ValueError``) whose message names
the dotted field, the bad value and the valid choices or the fix. The entry
points turn it into a one-line message and exit code 2, with no traceback.
Everything public is re-exported here: ``from aligner.config import AlignerConfig``.
"""

from __future__ import annotations

from aligner.config.agent import AgentConfig
from aligner.config.algorithm import (
    FOLLOW_THE_ESTIMATOR,
    LOSS_KL_COEF,
    REWARD_KL_COEF,
    AlgorithmConfig,
    DPOConfig,
    KTOConfig,
    SPINConfig,
    follow_the_estimator,
    kl_in_reward_by_default,
    resolve_kl,
)
from aligner.config.cluster import ClusterConfig
from aligner.config.common import (
    DATA_FORMATS,
    ENV_NAMES,
    GROUP_ESTIMATORS,
    LOGGERS,
    MODEL_ROLES,
    PRESETS,
    ROLES,
    STAGES,
    TOOL_NAMES,
)
from aligner.config.data import (
    DataConfig,
    TaskConfig,
    TokenizerConfig,
)
from aligner.config.env import EnvConfig
from aligner.config.model import (
    ModelConfig,
    RopeScalingConfig,
)
from aligner.config.parallel import (
    ParallelConfig,
    ResourceConfig,
)
from aligner.config.roles import (
    LORA_TARGETS,
    PROMPT_LEARNING_TYPES,
    ActorRoleConfig,
    LoraConfig,
    OptimConfig,
    PromptLearningConfig,
    RefRoleConfig,
    RewardRoleConfig,
    RoleConfig,
    TrainableRoleConfig,
)
from aligner.config.rollout import (
    RolloutConfig,
    SamplingConfig,
)
from aligner.config.run import (
    AlignerConfig,
    config_dict,
    config_yaml,
    hydra_schema,
    roles_with_field,
)
from aligner.config.trainer import TrainerConfig
from aligner.config.validation import (
    prompt_learning_of,
)
from aligner.config.view import RunView
from aligner.errors import ConfigError

__all__ = [
    "ConfigError",
    "PRESETS",
    "STAGES",
    "ROLES",
    "MODEL_ROLES",
    "DATA_FORMATS",
    "ENV_NAMES",
    "TOOL_NAMES",
    "GROUP_ESTIMATORS",
    "LOGGERS",
    "RopeScalingConfig",
    "ModelConfig",
    "TokenizerConfig",
    "DataConfig",
    "TaskConfig",
    "ParallelConfig",
    "ResourceConfig",
    "OptimConfig",
    "RoleConfig",
    "LORA_TARGETS",
    "LoraConfig",
    "TrainableRoleConfig",
    "PROMPT_LEARNING_TYPES",
    "PromptLearningConfig",
    "ActorRoleConfig",
    "RewardRoleConfig",
    "RefRoleConfig",
    "SamplingConfig",
    "RolloutConfig",
    "EnvConfig",
    "AgentConfig",
    "FOLLOW_THE_ESTIMATOR",
    "LOSS_KL_COEF",
    "REWARD_KL_COEF",
    "AlgorithmConfig",
    "DPOConfig",
    "KTOConfig",
    "SPINConfig",
    "follow_the_estimator",
    "kl_in_reward_by_default",
    "resolve_kl",
    "TrainerConfig",
    "ClusterConfig",
    "AlignerConfig",
    "RunView",
    "roles_with_field",
    "config_dict",
    "config_yaml",
    "hydra_schema",
    "prompt_learning_of",
]
