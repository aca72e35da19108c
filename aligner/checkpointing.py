"""Crash-safe checkpoint directories for a whole run (every role + trainer state).

Owns the on-disk layout and its atomicity:

    output_dir/checkpoints/
        step_00000010/            a complete checkpoint (renamed into place when whole)
            actor/ critic/ ...    each role's model + optimizer, written by its workers
            trainer_state.json    step, data position, KL controller, metrics so far
            rng.pt                driver RNG states (loaded with weights_only=True)
            COMPLETE              written last, before the rename
        latest                    name of the newest complete checkpoint (atomic replace)

A save writes into ``.step_XXXXXXXX.tmp-<pid>`` and is renamed when complete, then
``latest`` is replaced; a SIGKILL at any moment leaves the previous checkpoint and the
pointer intact. Stale temp dirs from killed saves are removed on the next start.
Old checkpoints beyond `keep` are deleted after the pointer moves, among this run's own only:
every trainer_state.json records the run's ``run_id`` (a resumed run takes over the id of the
checkpoint it resumed from, :meth:`CheckpointManager.adopt`) and its ``stage``; a checkpoint
of another run (another id, or none) is never deleted, whatever its step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

COMPLETE = "COMPLETE"


class CheckpointManager:
    """Checkpoints of one run under ``output_dir/checkpoints`` (see module docstring)."""

    def __init__(self, output_dir: str | os.PathLike, keep: int = 2, stage: str = ""):
        self.root = Path(output_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.stage = stage  # recorded in trainer_state.json unless the caller's state has one
        self.run_id = uuid.uuid4().hex  # this run's id, until adopt() continues another's
        self.own: set[str] = set()  # step dir names this run wrote or resumed from
        for stale in self.root.glob(".step_*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.root.glob(".latest.tmp-*"):  # pointer temp file of a save killed before its rename
            stale.unlink(missing_ok=True)

    @staticmethod
    def name(step: int) -> str:
        return f"step_{step:08d}"

    def begin(self, step: int) -> Path:
        """A fresh temporary directory to write checkpoint `step` into."""
        tmp = self.root / f".{self.name(step)}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, trainer_state: dict[str, Any]) -> Path:
        """Write trainer state (+ run_id, stage) + RNG + COMPLETE into `tmp`, rename it to its final name,
        move `latest`, prune this run's older checkpoints."""
        state = {"run_id": self.run_id, **({"stage": self.stage} if self.stage else {}), **trainer_state}
        _write_json(tmp / "trainer_state.json", state)
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / COMPLETE).write_text(str(step))
        _fsync_dir(tmp)
        final = self.root / self.name(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.own.add(final.name)
        ptr_tmp = self.root / f".latest.tmp-{os.getpid()}"
        ptr_tmp.write_text(final.name)
        os.replace(ptr_tmp, self.root / "latest")
        _fsync_dir(self.root)
        self._prune()
        return final

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint: the one `latest` names, else the highest complete step dir."""
        return latest_checkpoint(self.root)

    def adopt(self, ckpt: Path) -> None:
        """Continue the run that wrote `ckpt` (resume): take over its run_id and count `ckpt` as this run's own."""
        run_id = _read_state(ckpt).get("run_id")
        if run_id:
            self.run_id = str(run_id)
        self.own.add(Path(ckpt).name)

    def _is_own(self, ckpt: Path) -> bool:
        return ckpt.name in self.own or _read_state(ckpt).get("run_id") == self.run_id

    def _prune(self) -> None:
        """Delete this run's complete checkpoints beyond the newest `keep`; other runs' are left alone."""
        done = sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).exists() and self._is_own(p))
        for old in done[: max(0, len(done) - self.keep)]:
            (old / COMPLETE).unlink(missing_ok=True)  # never half-deleted yet still marked complete
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under `root` (a checkpoints/ dir, maybe missing) without changing
    anything: the one `latest` names, else the highest complete step dir; None when there is none."""
    root = Path(root)
    ptr = root / "latest"
    if ptr.is_file():
        cand = root / ptr.read_text().strip()
        if (cand / COMPLETE).exists():
            return cand
    done = sorted(p for p in root.glob("step_*") if (p / COMPLETE).exists())
    return done[-1] if done else None


def _read_state(ckpt: Path) -> dict[str, Any]:
    """trainer_state.json of `ckpt` as a dict ({} when unreadable), without touching RNG states."""
    try:
        state = json.loads((Path(ckpt) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    """trainer_state.json of a complete checkpoint; restores the driver RNG states too."""
    path = Path(ckpt) / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable trainer state ({e}); delete this checkpoint or resume from another") from None
    rng = Path(ckpt) / "rng.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=True))
    return state


def rng_state() -> dict[str, Any]:
    """Python and torch CPU RNG states (weights_only-loadable)."""
    py = random.getstate()
    return {"torch": torch.get_rng_state(), "python_version": py[0], "python_state": torch.tensor(py[1], dtype=torch.int64)}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(int(x) for x in state["python_state"].tolist()), None))


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
