"""Command-line layer shared by every entry point (sft, rm, ppo, plan).

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

import logging
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from aligner.config import PRESETS, AlignerConfig, ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
log = logging.getLogger("aligner")


class UserError(Exception):
    """A problem with the user's input (data, checkpoint, cluster) that ends the run with a message."""


def _preset_of(overrides: Sequence[str]) -> str:
    preset = "tiny"
    for o in overrides:
        if o.startswith("conf="):
            preset = o.split("=", 1)[1]
    return preset


def compose(stage: str, overrides: Sequence[str] = ()) -> "omegaconf.DictConfig":  # noqa: F821
    """Compose the raw Hydra config for `stage` with `overrides` (``key=value`` strings).

    Raises ConfigError for an unknown preset, an unknown key or a value of the wrong type.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for o in overrides:
        if o.startswith(("+", "~")):
            raise ConfigError(f"override {o!r}: adding or deleting config keys is not allowed; every field already exists "
                              "(set it with key=value; --cfg lists the fields)")
    preset = _preset_of(overrides)
    if preset not in PRESETS:
        raise ConfigError(f"conf={preset!r} is not a preset: valid choices are {', '.join(PRESETS)}")
    if not CONF_DIR.is_dir():
        raise ConfigError(f"config directory {CONF_DIR} is missing: run from an aligner checkout (pip install -e .)")
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="aligner_schema", node=AlignerConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            merged = hydra_compose(config_name=stage, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_explain(e)) from None
    except (AttributeError, AssertionError) as e:  # OmegaConf merging into a None-valued Optional dataclass node
        keys = [o.split("=", 1)[0] for o in overrides if "=" in o]
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"bad configuration: cannot apply {', '.join(keys)} ({type(e).__name__}: {first}); "
                          "set model.rope_scaling in a preset YAML file") from None
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
        msg += " (no such config field; run with --cfg to list the fields)"
    return f"bad configuration: {msg}"


def load_config(stage: str, overrides: Sequence[str] = ()) -> AlignerConfig:
    """Compose and validate: the AlignerConfig for `stage`. Raises ConfigError naming field, value and fix."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = compose(stage, overrides)
    merged.stage = stage
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"bad configuration: {str(e).strip().splitlines()[0]}") from None


def config_yaml(cfg: AlignerConfig) -> str:
    """The config as YAML text (saved beside checkpoints and printed by --cfg)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def setup_logging() -> None:
    level = os.environ.get("ALIGNER_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")


def run(stage: str, main: Callable[[AlignerConfig], Optional[int]], argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` (default sys.argv[1:]) as Hydra overrides, validate, call `main(cfg)`.

    Returns the exit code: main's return (0 if None), 2 for configuration/user errors.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    show_cfg = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    if "-h" in argv or "--help" in argv:
        print(f"usage: python -m aligner.{stage} [conf={'|'.join(PRESETS)}] [key=value ...] [--cfg]\n"
              "Any field of the config (see --cfg) can be overridden, e.g. trainer.max_steps=10 output_dir=runs/x")
        return 0
    try:
        cfg = load_config(stage, argv)
        if show_cfg:
            print(config_yaml(cfg))
            return 0
        code = main(cfg)
        return 0 if code is None else int(code)
    except (ConfigError, UserError) as e:
        print(f"aligner {stage}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a worker failure ends the run with its role, rank and traceback
        from aligner.parallel.worker_group import WorkerError

        if not isinstance(e, WorkerError):
            raise
        print(f"aligner {stage}: error: {e}\nthe last complete checkpoint in output_dir is intact: rerun with resume=true",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"aligner {stage}: interrupted", file=sys.stderr)
        return 130
