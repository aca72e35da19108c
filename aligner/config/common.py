"""What every config module shares: the preset, stage and role names, and the two checks every
validation is written with (:func:`_check`, :func:`_choice`), which raise :class:`ConfigError`
naming the dotted field, the bad value and the fix."""

from __future__ import annotations

from typing import Any

from aligner.errors import ConfigError

PRESETS = ("tiny", "tiny_tools", "smollm2_135m", "smollm2_ifeval", "llama2_7b", "llama2_13b", "llama2_70b", "tiny_agent")
STAGES = ("sft", "rm", "ppo", "plan", "dpo", "kto", "spin", "rs")
ROLES = ("actor", "critic", "reward", "ref", "teacher", "rollout")
MODEL_ROLES = ("actor", "critic", "reward", "ref", "teacher")  # the roles with a RoleConfig (init, parallel, resources)
# the keys of aligner.data.formats.FORMATS, in order (config imports nothing from aligner.data, which imports
# config; tests/config/test_validation.py asserts the two agree)
DATA_FORMATS = ("prompt", "sft", "chat", "pairs", "hh", "gsm8k", "text", "prompt_completion", "unpaired")
# the names of aligner.envs.ENVIRONMENTS and aligner.envs.TOOLS, in order (the config sits below aligner.envs;
# tests/config/test_validation.py asserts they agree)
ENV_NAMES = ("single_turn", "retry", "tool")
TOOL_NAMES = ("calculator",)
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")  # advantage estimators with a per-prompt group baseline
# trainer.loggers: where metrics go (aligner.tracking.MetricsLogger); metrics.jsonl is written whatever the list says
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
# logger -> (the module it imports, what pip installs it as); jsonl needs nothing
LOGGER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


def _check(ok: bool, field_name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}={value!r} is invalid: {fix}")


def _choice(field_name: str, value: Any, choices: tuple) -> None:
    _check(value in choices, field_name, value, f"valid choices are {', '.join(map(str, choices))}")
