"""File-system checks, run after planning and before any work (the trainers call
:meth:`AlignerConfig.check_paths`): every input path the run will read exists. They are not part of
building a config, so a plan (``python -m aligner.plan``, ``plan_only=true``) needs no files."""

from __future__ import annotations

import os
from typing import Optional

from aligner.config.view import RunView
from aligner.errors import ConfigError


def check_paths(cfg: RunView, roles: Optional[tuple[str, ...]] = None) -> None:
    """Check that every input path the run will read exists (after planning, before any work).

    Args:
        cfg: the run's config.
        roles: the roles whose init checkpoints are read; None = :meth:`AlignerConfig.roles_used`.

    Raises ConfigError naming the field, the path and what to give instead.
    """
    for name in ("train_path", "eval_path"):
        path = getattr(cfg.data, name)
        if path and not os.path.exists(path):
            raise ConfigError(f"data.{name}={path!r} does not exist: give an existing jsonl/json/parquet file or a saved HF dataset dir")
    if cfg.tokenizer.path and not os.path.exists(cfg.tokenizer.path):
        raise ConfigError(
            f"tokenizer.path={cfg.tokenizer.path!r} does not exist: give an HF tokenizer dir, tokenizer.json or tokenizer.model"
        )
    roles = cfg.roles_used() if roles is None else roles
    for role in sorted(roles, key=lambda r: not cfg.role(r).init):  # a role's own init before a fallback
        path = cfg.init_of(role)
        if path and not os.path.exists(path):
            raise ConfigError(
                f"{cfg.init_field(role)}={path!r} does not exist: give an aligner checkpoint dir or an HF model dir "
                "(for conf=tiny, run `python -m aligner.sft` and `python -m aligner.rm` first, or `make demo`)"
            )
