"""Run a stage as a test needs it: in-process (on the session Ray instance), as the user's command
line (a subprocess), or interrupted after a checkpoint; read its logged metrics back."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from tests.toolkit.paths import REPO


def run_stage(trainer_cls, stage: str, overrides: list[str]) -> int:
    """`trainer_cls(load_config(stage, overrides)).run()` in this process; its exit code."""
    from aligner.cli import load_config

    return trainer_cls(load_config(stage, overrides)).run()


def run_cli(
    module: str, *args: str, cwd: Path = REPO, timeout: int = 600, env: Optional[dict] = None
) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m module args...` with this checkout first on PYTHONPATH: (the completed process, wall seconds).

    env: the environment (the ``cluster_env`` fixture joins the session's Ray instance); default: this
    process's, so the run starts its own Ray instance. Raises subprocess.TimeoutExpired after `timeout` seconds.
    """
    env = env or {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


def start_cli(module: str, *args: str, log: Path, cwd: Path = REPO) -> subprocess.Popen:
    """Start `python -m module args...` as :func:`run_cli` does, without waiting; stdout and stderr go to the file `log`."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "w") as f:  # the child holds its own descriptor
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)


def logged(out: Path, key: str = "loss") -> dict[int, float]:
    """step -> value of `key` for the rows of out/metrics.jsonl that have it."""
    from aligner.tracking import read_metrics

    return {r["step"]: r[key] for r in read_metrics(out / "metrics.jsonl") if key in r}


class Interrupted(Exception):
    """Raised by an :func:`interrupting` trainer right after its checkpoint of the chosen step."""


def interrupting(trainer_cls, at_step: int):
    """A subclass of `trainer_cls` that raises Interrupted(step) once the checkpoint of `at_step` is saved."""

    class Stopper(trainer_cls):
        def save(self, manager):
            path = super().save(manager)
            if self.step == at_step:
                raise Interrupted(self.step)
            return path

    return Stopper
