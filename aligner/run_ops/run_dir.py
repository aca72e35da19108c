"""The rules for a run's output_dir, checked in the driver before anything is written there.

Owns what a stage (SFT, RM, PPO) may do with ``output_dir``, and the lock that keeps a
second run out of it:

    output_dir names a directory    "" is refused by the config (aligner/config/); a file, a path under a file
                                    and a directory this user cannot write are one-line errors
    one run at a time               ``.aligner.lock`` (pid, host, start time) under fcntl.flock:
                                    the OS drops the lock when its process ends in any way
                                    (SIGKILL included), so a stale file never blocks
    fresh                           nothing of a previous run in the dir (see RUN_ENTRIES)
    non-empty + resume=true         continue it; refused when it is another stage's run
    non-empty + overwrite=true      delete the previous run's outputs (logged), then run fresh
    non-empty, neither              refused: another dir, resume=true or overwrite=true

A refused run leaves every file already in the dir as it was. Files that are not a run's
outputs (RUN_ENTRIES) neither make a dir non-empty nor get deleted by overwrite=true.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from aligner.config import AlignerConfig, ConfigError
from aligner.errors import UserError
from aligner.run_ops import supervisor
from aligner.run_ops.checkpointing import latest_checkpoint
from aligner.tracking import repair_metrics

log = logging.getLogger("aligner")

LOCK_NAME = ".aligner.lock"
# What a run writes into its output_dir (checkpoints/ counts only when it holds something).
RUN_ENTRIES = (
    "config.yaml",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "checkpoints",
    "hf",
    "tensorboard",
    "summary.json",
    "curves.png",
    "ppo_report.png",
    "tokenizer",
    "task",
    "loggers.json",  # the W&B and MLflow run ids (aligner.tracking)
    "loggers.json.tmp",
    "wandb",  # trainer.loggers with wandb (unless WANDB_DIR is set)
    "mlruns",  # trainer.loggers with mlflow (unless MLFLOW_TRACKING_URI is set)
)
RUN_ENTRY_PATTERNS = (".hf.tmp-*", ".hf.old-*")  # an HF export killed half-way


# ---- the directory itself ----------------------------------------------------------------
def make_output_dir(out: Path) -> None:
    """Create `out` (and its parents) when missing.

    Raises UserError (one line) when `out` is a file, lies under a file, or cannot be created.
    """
    name = f"output_dir={str(out)!r}"
    if out.exists() and not out.is_dir():
        raise UserError(f"{name} is a file, not a directory: give a directory path")
    blocker = _file_above(out)
    if blocker is not None:
        raise UserError(f"{name} lies under the file {str(blocker)!r}: give a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{name} cannot be created ({e.strerror}): give a writable directory") from None


def _file_above(out: Path) -> Optional[Path]:
    """The first existing non-directory among `out`'s parents, or None."""
    for parent in reversed(out.absolute().parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def previous_run_entries(out: Path) -> list[str]:
    """Names of a previous run's outputs in `out` (sorted; "checkpoints" only when non-empty)."""
    if not out.is_dir():
        return []
    found = []
    for entry in sorted(out.iterdir()):
        if entry.name == "checkpoints" and entry.is_dir() and not any(entry.iterdir()):
            continue
        if entry.name in RUN_ENTRIES or any(entry.match(p) for p in RUN_ENTRY_PATTERNS):
            found.append(entry.name)
    return found


# ---- the lock ----------------------------------------------------------------------------
class RunLock:
    """An exclusive lock on one output_dir: ``.aligner.lock`` held with fcntl.flock.

    The file records the holder's pid, host and start time for the message a second run
    prints. The OS releases a flock when its last fd closes, so a holder killed by any
    signal leaves a stale file that the next run simply takes over. (On network file
    systems without flock support the lock is only as good as the file system's.)
    """

    def __init__(self, path: Path, fd: int):
        self.path = path
        self.fd = fd

    @classmethod
    def acquire(cls, out: Path, stage: str = "") -> RunLock:
        """Take the lock of `out` (an existing directory) without waiting.

        Raises UserError naming the holder's pid, host and start time when another live run
        holds it, or naming `out` when the lock file cannot be created (read-only dir).
        """
        path = out / LOCK_NAME
        for _ in range(20):
            fd = _open_lock_file(path, out)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise UserError(f"output_dir={str(out)!r} is in use by {holder}: wait for it or use another output_dir") from None
            if _same_file(fd, path):
                lock = cls(path, fd)
                lock._write_holder(stage)
                return lock
            os.close(fd)  # the previous holder removed the file between our open and flock: open the new one
        raise UserError(f"output_dir={str(out)!r}: could not take {LOCK_NAME} (it keeps being replaced): retry")

    def _write_holder(self, stage: str) -> None:
        info = {"pid": supervisor.run_pid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "stage": stage}
        data = json.dumps(info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd < 0:
            return
        try:
            if _same_file(self.fd, self.path):
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def _open_lock_file(path: Path, out: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"output_dir={str(out)!r} is not writable ({e.strerror}): give a writable directory") from None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read_holder(fd: int, wait_s: float = 2.0) -> str:
    """'pid N on host H (started T)' from a held lock file (its holder may still be writing it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"null")
        except ValueError:
            info = None
        if isinstance(info, dict) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    info = info if isinstance(info, dict) else {}
    return (
        f"pid {info.get('pid', '?')} on host {info.get('host', '?')} "
        f"(started {info.get('started', '?')}{', ' + info['stage'] if info.get('stage') else ''})"
    )


# ---- fresh / resume / overwrite -----------------------------------------------------------
def decide(cfg: AlignerConfig, out: Path, inputs: Optional[dict[str, str]] = None) -> str:
    """What this run does with `out`: "fresh", "resume" or "overwrite". Writes nothing.

    Args:
        inputs: field -> path of what the run reads (default :func:`input_paths`); overwrite=true
            must not delete any of them.

    Raises ConfigError for resume=true with overwrite=true; UserError for a previous run's
    outputs without resume/overwrite, for resume=true into another stage's run, and for
    overwrite=true of a dir holding one of the run's inputs.
    """
    check_flags(cfg)
    entries = previous_run_entries(out)
    if not entries:
        return "fresh"
    if cfg.overwrite:
        _check_inputs_outside(out, input_paths(cfg) if inputs is None else inputs)
        return "overwrite"
    if cfg.resume:
        _check_same_stage(cfg.stage, out)
        _check_same_run_settings(cfg, out)
        return "resume"
    shown = ", ".join(e + ("/" if (out / e).is_dir() else "") for e in entries)
    raise UserError(
        f"output_dir={str(out)!r} holds a previous run ({shown}): give another output_dir, "
        "or resume=true to continue that run, or overwrite=true to delete it and start fresh"
    )


def check_flags(cfg: AlignerConfig) -> None:
    """Raises ConfigError when resume=true and overwrite=true are both given."""
    if cfg.resume and cfg.overwrite:
        raise ConfigError(
            "resume=true and overwrite=true contradict each other: resume=true continues the run "
            "in output_dir, overwrite=true deletes it; give one"
        )


def input_paths(cfg: AlignerConfig) -> dict[str, str]:
    """field -> path of every file or dir the run reads (non-empty ones)."""
    paths = {cfg.init_field(r): cfg.init_of(r) for r in cfg.roles_used()}
    paths.update({"data.train_path": cfg.data.train_path, "data.eval_path": cfg.data.eval_path, "tokenizer.path": cfg.tokenizer.path})
    return {k: v for k, v in paths.items() if v}


def _check_inputs_outside(out: Path, inputs: dict[str, str]) -> None:
    root = out.resolve()
    for field_name, path in inputs.items():
        p = Path(path).resolve()
        if p == root or root in p.parents:
            raise UserError(
                f"overwrite=true would delete {field_name}={path!r}, which lies in output_dir={str(out)!r}: give another output_dir"
            )


def previous_stage(out: Path) -> Optional[tuple[str, str]]:
    """(stage, where it is recorded) of the run in `out`: the latest complete checkpoint's
    trainer_state.json, else config.yaml; None when neither records one."""

    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is not None:
        try:
            stage = json.loads((ckpt / "trainer_state.json").read_text()).get("stage")
        except (OSError, ValueError, AttributeError):
            stage = None
        if stage:
            return str(stage), str(ckpt / "trainer_state.json")
    try:
        import yaml

        stage = (yaml.safe_load((out / "config.yaml").read_text()) or {}).get("stage")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        stage = None
    return (str(stage), str(out / "config.yaml")) if stage else None


def _check_same_stage(stage: str, out: Path) -> None:
    found = previous_stage(out)
    if found is not None and found[0] != stage:
        raise UserError(
            f"resume=true: output_dir={str(out)!r} holds a run of stage {found[0]} ({found[1]}), not {stage}: "
            f"give the {stage} run's output_dir, or another output_dir to start fresh"
        )


def _saved_config(out: Path) -> dict:
    """The previous run's config.yaml as a dict ({} when missing or unreadable)."""
    import yaml

    try:
        return yaml.safe_load((out / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _check_same_run_settings(cfg: AlignerConfig, out: Path) -> None:
    """A resumed run must build the model it continues; a changed schedule length is said, not refused.

    Raises UserError naming the first ``model.*`` field whose value differs from the run's
    config.yaml (its checkpoints load only into the model they were saved from). Logs a
    warning when ``trainer.max_steps`` differs: the LR schedule (warmup + decay over
    max_steps) is reshaped from the resumed step on.
    """
    from omegaconf import OmegaConf

    saved = _saved_config(out)
    now = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    for name, value in (saved.get("model") or {}).items():
        if name in now["model"] and now["model"][name] != value:
            raise UserError(
                f"resume=true: model.{name}={now['model'][name]!r} differs from the run in output_dir="
                f"{str(out)!r} (config.yaml: {value!r}); its checkpoints load only into the model they were "
                f"saved from: drop the model.{name} override, or give another output_dir to start fresh"
            )
    old_steps = (saved.get("trainer") or {}).get("max_steps")
    if old_steps is not None and old_steps != cfg.trainer.max_steps:
        log.warning(
            "resume=true: trainer.max_steps changed from %s to %d: the learning-rate schedule (warmup and "
            "decay over max_steps) is reshaped from the resumed step on",
            old_steps,
            cfg.trainer.max_steps,
        )


def delete_previous_run(out: Path) -> None:
    """Delete the previous run's outputs in `out` (RUN_ENTRIES), logging what goes.

    Raises UserError naming the entry that cannot be deleted.
    """
    entries = previous_run_entries(out)
    log.warning("overwrite=true: deleting the previous run's outputs in %s: %s", out, ", ".join(entries))
    for name in entries:
        path = out / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as e:
            raise UserError(f"overwrite=true: cannot delete {str(path)!r} ({e.strerror})") from None


def _prepare_resume(out: Path) -> None:

    try:
        repair_metrics(out / "metrics.jsonl")
    except ValueError as e:
        raise UserError(f"resume=true: {e}") from None


@contextmanager
def claim_output_dir(cfg: AlignerConfig, inputs: Optional[dict[str, str]] = None) -> Iterator[str]:
    """Check and lock ``cfg.output_dir`` for this run; yields "fresh", "resume" or "overwrite".

    Order: the directory (created when missing), the lock, then :func:`decide`; overwrite
    deletes the previous outputs, resume drops a cut last line of metrics.jsonl. The lock is
    released when the block ends, on any exception too.

    Raises UserError / ConfigError (see :func:`make_output_dir`, :meth:`RunLock.acquire`, :func:`decide`).
    """
    check_flags(cfg)
    out = Path(cfg.output_dir)
    make_output_dir(out)
    lock = RunLock.acquire(out, cfg.stage)
    try:
        mode = decide(cfg, out, inputs)
        if mode == "overwrite":
            delete_previous_run(out)
        elif mode == "resume":
            _prepare_resume(out)
        yield mode
    finally:
        lock.release()
