"""Command-line layer shared by every entry point (sft, rm, ppo, dpo, plan).

Owns: composing the Hydra config (``conf/<stage>.yaml`` + preset ``conf=NAME`` + the
preset's stage file + command-line overrides), checking it against the dataclass
schema in :mod:`aligner.config`, and turning every configuration error into one line
on stderr and exit code 2 (no traceback wall).

Simplification: we call Hydra's compose API rather than ``@hydra.main``, so Hydra does
not change the working directory or write its own ``.hydra`` folder; the composed
config is saved to ``output_dir/config.yaml`` by the trainers instead. ``--cfg``
prints the composed config and exits.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from aligner.config import (
    MODEL_ROLES,
    PRESETS,
    AlignerConfig,
    ConfigError,
    config_yaml,
    follow_the_estimator,
    hydra_schema,
    roles_with_field,
)
from aligner.config.renames import renamed_hint, renamed_overrides
from aligner.errors import PlacementError, UserError
from aligner.nn.cpu_isa import isa_cap
from aligner.run_ops import preemption, supervisor
from aligner.run_ops.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE
from aligner.run_ops.preemption import Preempted

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
log = logging.getLogger("aligner")


def _preset_of(overrides: Sequence[str]) -> str:
    preset = "tiny"
    for o in overrides:
        if o.startswith("conf="):
            preset = o.split("=", 1)[1]
    return preset


@functools.cache
def _store_schema() -> None:
    """Put :func:`aligner.config.hydra_schema` in Hydra's ConfigStore, once a process (the store keeps a
    copy, and building the node is a quarter of a :func:`compose`)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="aligner_schema", node=hydra_schema())


def compose(stage: str, overrides: Sequence[str] = ()) -> omegaconf.DictConfig:  # noqa: F821
    """Compose the raw Hydra config for `stage` with `overrides` (``key=value`` strings).

    A renamed field's old name in `overrides` sets the new field (:func:`aligner.config.renames.renamed_overrides`).
    Raises ConfigError for an unknown preset, an unknown key or a value of the wrong type.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = renamed_overrides(overrides)
    for o in overrides:
        if o.startswith(("+", "~")):
            raise ConfigError(
                f"override {o!r}: adding or deleting config keys is not allowed; every field already exists "
                "(set it with key=value; --cfg lists the fields)"
            )
    preset = _preset_of(overrides)
    if preset not in PRESETS:
        raise ConfigError(f"conf={preset!r} is not a preset: valid choices are {', '.join(PRESETS)}")
    if not CONF_DIR.is_dir():
        raise ConfigError(f"config directory {CONF_DIR} is missing: run from an aligner checkout (pip install -e .)")
    _store_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            merged = hydra_compose(config_name=stage, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_explain(e)) from None
    except (AttributeError, AssertionError) as e:  # OmegaConf merging into a None-valued Optional dataclass node
        keys = [o.split("=", 1)[0] for o in overrides if "=" in o]
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(
            f"bad configuration: cannot apply {', '.join(keys)} ({type(e).__name__}: {first}); set model.rope_scaling in a preset YAML file"
        ) from None
    return merged


def _explain(e: BaseException) -> str:
    """One line from a Hydra/OmegaConf error: the override, and the cause if there is one."""
    lines = str(e).strip().splitlines()
    parts = [" ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else type(e).__name__)]
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        parts.append(str(cause).strip().splitlines()[0])
    msg = ": ".join(parts)
    if "Could not override" in msg:
        msg += f" (no such config field{_role_field_hint(msg)}; run with --cfg to list the fields)"
    return f"bad configuration: {msg}{renamed_hint(msg)}"


def _role_field_hint(msg: str) -> str:
    """For an override ``ROLE.FIELD...`` whose FIELD is a field of other roles only (``actor.type``,
    ``ref.optim.lr``): ": type is a field of reward only", else ""."""
    m = re.search(r"Could not override '([^']+)'", msg)
    parts = m.group(1).split(".") if m else []
    if len(parts) < 2 or parts[0] not in MODEL_ROLES:
        return ""
    owners = roles_with_field(parts[1])
    if not owners or parts[0] in owners:
        return ""
    return f": {parts[1]} is a field of {', '.join(owners)} only"


def load_config(stage: str, overrides: Sequence[str] = ()) -> AlignerConfig:
    """Compose and validate: the AlignerConfig for `stage`. Raises ConfigError naming field, value and fix.

    Before the config is built, the model's dimensions follow the primary role's checkpoint
    (:func:`adopt_checkpoint_dims`) and a preset's reward-KL settings that this run's estimator does not
    apply follow the estimator (:func:`aligner.config.follow_the_estimator`; `overrides` are the values
    set explicitly). A renamed field's old name in `overrides` logs one deprecation line and sets the new field."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from aligner.config.run import secret_override_problem

    overrides = renamed_overrides(overrides, log.warning)

    problem = secret_override_problem(overrides)
    if problem:
        raise ConfigError(problem)
    merged = compose(stage, overrides)
    merged.stage = stage
    adopt_checkpoint_dims(merged, stage, overrides)
    follow_the_estimator(merged.algorithm, _explicit_keys(overrides))
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"bad configuration: {str(e).strip().splitlines()[0]}") from None
    check_role_checkpoints(cfg)
    return cfg


# ModelConfig fields a checkpoint's config.json defines (the rest: init_std, backend, dtype, the MoE loss
# coefficients and capacity, are run choices)
CHECKPOINT_DIMS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_seq_len",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "o_proj_bias",
    "num_experts",
    "num_experts_per_tok",
    "moe_router",
)


def primary_role(stage: str) -> str:
    """The role whose model ``model.*`` describes: the reward model in the RM stage, else the policy."""
    return "reward" if stage == "rm" else "actor"


def checkpoint_model_config(init: str, field_name: str) -> Optional[ModelConfig]:  # noqa: F821
    """The ModelConfig of the HF checkpoint that `init` (an HF dir or a run dir) names; None when `init`
    is empty or does not name one (the path checks report that later). Raises ConfigError naming
    `field_name` for a config.json aligner cannot build (another architecture, an unsupported field)."""
    from aligner.model.hf import CheckpointError, model_config_from_hf, read_hf_config
    from aligner.runtime.role import resolve_init

    try:
        hf_dir = resolve_init(init)
    except ValueError:
        return None
    if hf_dir is None:
        return None
    try:
        return model_config_from_hf(read_hf_config(hf_dir), str(hf_dir / "config.json"))
    except (CheckpointError, ConfigError) as e:
        raise ConfigError(f"{field_name}={init!r}: {e}") from None


def _explicit_keys(overrides: Sequence[str]) -> set[str]:
    """The dotted keys the command line sets: ``["algorithm.kl_coef=0.1"]`` -> ``{"algorithm.kl_coef"}``."""
    return {o.split("=", 1)[0].strip() for o in overrides if "=" in o}


def adopt_checkpoint_dims(merged, stage: str, overrides: Sequence[str]) -> None:
    """Set ``model.*`` to the dimensions of the primary role's init checkpoint, before validation.

    The model is built from the checkpoint's config.json, so the preset's dimensions must not be
    what lengths and layouts are checked against. An explicit ``model.<field>=`` override on the
    command line that disagrees with the checkpoint raises ConfigError naming both values.
    """
    from omegaconf import OmegaConf

    role = primary_role(stage)
    init = merged[role].init
    if stage == "rm" and not init:
        from aligner.trainers.rm import default_init

        init = default_init(merged)
    if stage in ("dpo", "kto", "spin", "rs") and not init:
        from aligner.trainers.dpo import default_init as dpo_default_init

        init = dpo_default_init(merged)
    ckpt = checkpoint_model_config(init, f"{role}.init")
    if ckpt is None:
        return
    explicit = _explicit_keys(overrides)
    preset = OmegaConf.to_object(merged.model)
    for name in CHECKPOINT_DIMS:
        have, want = getattr(preset, name), getattr(ckpt, name)
        if name == "head_dim":
            have, want = preset.resolved_head_dim, ckpt.resolved_head_dim
        if _same_value(have, want):
            continue
        if f"model.{name}" in explicit:
            raise ConfigError(
                f"model.{name}={have!r} conflicts with {role}.init={init!r}, whose config.json gives "
                f"{want!r}: the model is built from the checkpoint; drop the model.{name} override "
                f"or give another {role}.init"
            )
        merged.model[name] = getattr(ckpt, name)


def _same_value(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
        except (TypeError, ValueError):
            return False
    return a == b


def check_role_checkpoints(cfg: AlignerConfig) -> None:
    """Validate every other role the run starts against its own init checkpoint's dimensions
    (a critic or reward model may differ from the policy): its layout and data.max_seq_len."""
    primary = primary_role(cfg.stage)
    checked = {cfg.init_of(primary)}
    for role in cfg.roles_used():
        init = cfg.init_of(role)
        if not init or init in checked:
            continue
        checked.add(init)
        ckpt = checkpoint_model_config(init, cfg.init_field(role))
        if ckpt is None:
            continue
        cfg.role(role).parallel.validate(f"{role}.parallel", ckpt)
        if cfg.data.max_seq_len > ckpt.max_seq_len:
            raise ConfigError(
                f"data.max_seq_len={cfg.data.max_seq_len} is invalid: must not exceed the {role} "
                f"model's max_seq_len={ckpt.max_seq_len} ({cfg.init_field(role)}={init!r}, "
                "config.json max_position_embeddings)"
            )


CFG_FLAGS = ("--cfg", "-c")
CFG_KINDS = ("job", "all")  # Hydra's --cfg takes job|hydra|all; aligner's config is the job's ("all" shows the same)


def split_cfg_flag(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """Take Hydra's print-the-config flag out of a command line: ``--cfg``, ``--cfg job``, ``--cfg=job``,
    ``-c job`` (Hydra's forms; ``all`` prints the same, aligner has no separate Hydra config).

    Returns (whether the flag was given, the rest of `argv` in order).
    Raises ConfigError for ``--cfg hydra`` (there is no Hydra runtime config to show).
    """
    show, rest, i = False, [], 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        flag, eq, kind = a.partition("=")
        if flag in CFG_FLAGS:
            show = True
            if not eq and i + 1 < len(argv) and "=" not in argv[i + 1] and not argv[i + 1].startswith("-"):
                kind = argv[i + 1]
                i += 1
            if kind and kind not in CFG_KINDS:
                raise ConfigError(f"{flag} {kind} is invalid: aligner prints its job config only; use --cfg or --cfg job")
        else:
            rest.append(a)
        i += 1
    return show, rest


def _output_dir(stage: str, argv: Sequence[str]) -> Optional[str]:
    """The output_dir the command line `argv` gives `stage` (the preset's default unless overridden);
    None when it does not compose."""
    try:
        return str(compose(stage, split_cfg_flag(argv)[1]).output_dir)
    except Exception:  # noqa: BLE001 - the caller's message goes on without it
        return None


def setup_logging() -> None:
    """Log lines "[time logger] message" to stderr: aligner's loggers at ALIGNER_LOG_LEVEL (default
    INFO), every other library's at WARNING and above (their INFO lines, such as matplotlib's
    "generated new fontManager" on a first run, tell a user nothing to act on)."""
    level = os.environ.get("ALIGNER_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("aligner").setLevel(level)


def run(stage: str, main: Callable[[AlignerConfig], Optional[int]], argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` (default sys.argv[1:]) as Hydra overrides, validate, call `main(cfg)`.

    Returns the exit code: main's return (0 if None), 2 for configuration/user errors, 143
    after a SIGTERM that stopped the run at a step boundary (aligner.run_ops.preemption).
    On the command line (`argv` None) the process first forks: the parent supervises the driver
    (:mod:`aligner.run_ops.supervisor`) and returns the child's exit code.
    """
    if stage != "plan" and supervisor.enabled(argv):
        code = supervisor.fork(stage, lambda: _output_dir(stage, sys.argv[1:]))
        if code is not None:
            return code
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    try:
        show_cfg, argv = split_cfg_flag(argv)
    except ConfigError as e:
        print(f"aligner {stage}: error: {e}", file=sys.stderr)
        return 2
    if "-h" in argv or "--help" in argv:
        print(
            f"usage: python -m aligner.{stage} [conf={'|'.join(PRESETS)}] [key=value ...] [--cfg [job]]\n"
            "Any field of the config (see --cfg) can be overridden, e.g. trainer.max_steps=10 output_dir=runs/x"
        )
        return 0
    try:
        cfg = load_config(stage, argv)
        isa_cap()  # ALIGNER_CPU_ISA: a bad value stops the run here, before any worker starts
        if show_cfg:
            print(config_yaml(cfg))
            return 0
        code = main(cfg)
        return 0 if code is None else int(code)
    except (ConfigError, UserError, PlacementError) as e:  # PlacementError: a cluster (joined, or after a restart) too small
        print(f"aligner {stage}: error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        print(f"aligner {stage}: {e}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        # Ray's driver handler (installed by ray.init) turns a SIGTERM that aligner's handler did not take
        # (before it is installed, after it is removed at teardown) into sys.exit(15): same contract as Preempted
        print(
            f"aligner {stage}: stopped by SIGTERM outside a training step (Ray's handler took it); the last complete "
            "checkpoint in output_dir is intact: rerun with resume=true",
            file=sys.stderr,
        )
        return PREEMPTED_EXIT_CODE
    except Exception as e:  # noqa: BLE001 - a worker failure ends the run with its role, rank and traceback
        from aligner.errors import WorkerError, disk_full_path

        full = disk_full_path(e)
        if full is not None:  # the driver's or a worker's write: one line, no traceback
            who = f" ({e.role} rank {e.rank}, {e.method})" if isinstance(e, WorkerError) else ""
            print(
                f"aligner {stage}: error: the disk is full: no space left on device writing {full}{who}; free space "
                "there or give another output_dir, then rerun with resume=true (the last complete checkpoint in "
                "output_dir is intact: saves are atomic)",
                file=sys.stderr,
            )
            return 1
        if not isinstance(e, WorkerError):
            raise
        if preemption.was_requested():  # SIGTERM reached the workers too and one ended before the step did
            print(
                f"aligner {stage}: stopped by SIGTERM: {e.role} rank {e.rank} ended during the step ({e.method}) after the "
                "signal, so the step was abandoned; the last complete checkpoint in output_dir is intact: rerun with resume=true",
                file=sys.stderr,
            )
            return PREEMPTED_EXIT_CODE
        print(f"aligner {stage}: error: {e}\nthe last complete checkpoint in output_dir is intact: rerun with resume=true", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"aligner {stage}: interrupted", file=sys.stderr)
        return 130
