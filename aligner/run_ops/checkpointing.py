"""Crash-safe checkpoints of a whole run: one directory a step, holding every role checkpoint and the trainer state.

Vocabulary (the same in :mod:`aligner.runtime.checkpoint` and :class:`aligner.trainers.loop.Checkpoints`): a
*checkpoint* (`ckpt`) is one step's directory ``step_N/`` below, complete or absent; a *role checkpoint* is one
role's directory inside it, written by the role's ranks (:mod:`aligner.runtime.checkpoint`); the *trainer state* is
the driver's part (``trainer_state.json``, ``rng.pt``); the *pointer* is ``latest``.

Owns the on-disk layout and its atomicity:

    output_dir/checkpoints/
        step_00000010/            a complete checkpoint (renamed into place when whole)
            actor/ critic/ ...    the role checkpoints: model + optimizer, written by each role's workers
            trainer_state.json    step, data position, KL controller, metrics so far
            rng.pt                driver RNG states (loaded with weights_only=True)
            MANIFEST.json         size + CRC-32 of every file above (all files under the dir)
            COMPLETE              written last, before the rename
        latest                    name of the newest complete checkpoint (atomic replace)

A save writes into ``.step_XXXXXXXX.tmp-<pid>`` and is renamed when complete, then
``latest`` is replaced; a SIGKILL at any moment leaves the previous checkpoint and the
pointer intact. Stale temp dirs from killed saves are removed on the next start.
Old checkpoints beyond `keep` are deleted after the pointer moves, among this run's own only:
every trainer_state.json records the run's ``run_id`` (a resumed run takes over the id of the
checkpoint it resumed from, :meth:`CheckpointManager.adopt`) and its ``stage``; a checkpoint
of another run (another id, or none) is never deleted, whatever its step.

Integrity: :meth:`CheckpointManager.commit` records every file's size and CRC-32 in
``MANIFEST.json`` before ``COMPLETE`` is written; :meth:`CheckpointManager.latest` verifies
the candidate against it (and that trainer_state.json parses) before returning it, and falls
back to the next older complete checkpoint with a warning naming the first bad file. With no
intact checkpoint left it raises :class:`aligner.cli.UserError` rather than returning None
(which would silently restart from step 0). Checkpoints written before manifests existed are
accepted with a warning that they cannot be verified.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from aligner.errors import UserError

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "aligner-manifest-v1"
_UNHASHED = {COMPLETE, MANIFEST, MANIFEST + ".tmp"}  # written after (or as) the manifest
_CHUNK = 1 << 20  # read size when hashing (1 MiB; larger chunks were not faster here)
log = logging.getLogger("aligner")


class CheckpointManager:
    """Writes, finds, verifies and prunes the checkpoints of one run under ``output_dir/checkpoints`` (module docstring)."""

    def __init__(self, output_dir: str | os.PathLike, keep: int = 2, stage: str = ""):
        self.root = Path(output_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.stage = stage  # recorded in trainer_state.json unless the caller's state has one
        self.run_id = uuid.uuid4().hex  # this run's id, until adopt() continues another's
        self.own: set[str] = set()  # step dir names this run wrote or resumed from
        self.damaged: set[str] = set()  # step dir names latest() found damaged (skipped by resume, pruned)
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
        """Write trainer state (+ run_id, stage) + RNG + MANIFEST.json + COMPLETE into `tmp`, rename it to
        its final name, move `latest`, prune this run's older checkpoints.

        MANIFEST.json holds the size and CRC-32 of every file under `tmp` (the role dirs the workers
        wrote, trainer_state.json, rng.pt; see :func:`write_manifest`): it is written before COMPLETE,
        so no checkpoint is complete without it. Reads every byte of the checkpoint once (cost in
        docs/reliability.md). OSError from reading or writing propagates; nothing is renamed then."""
        state = {
            "run_id": self.run_id,
            **({"stage": self.stage} if self.stage else {}),
            **trainer_state,
            "manifest": MANIFEST,
        }  # a complete checkpoint without its manifest is then damaged, not "old"
        _write_json(tmp / "trainer_state.json", state)
        torch.save(rng_state(), tmp / "rng.pt")
        write_manifest(tmp, step)
        (tmp / COMPLETE).write_text(str(step))
        _fsync_dir(tmp)
        final = self.root / self.name(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.own.add(final.name)
        self.damaged.discard(final.name)  # a damaged checkpoint of this step was just replaced
        ptr_tmp = self.root / f".latest.tmp-{os.getpid()}"
        ptr_tmp.write_text(final.name)
        os.replace(ptr_tmp, self.root / "latest")
        _fsync_dir(self.root)
        self._prune()
        return final

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint that passes :func:`verify_checkpoint`; None when there is no
        complete checkpoint at all.

        Candidates in order: the one `latest` names, then the complete step dirs below it, newest
        first (without a usable pointer: every complete step dir, newest first). A damaged candidate
        (a file missing, of another size or CRC-32 than MANIFEST.json records, an unreadable
        manifest or trainer_state.json) is logged as a warning naming the checkpoint and its first
        bad file, and the next one is tried. One without MANIFEST.json (written before manifests)
        is accepted with a warning that it cannot be verified. Verification reads every byte of a
        candidate once per process (the result is cached by path and every file's size/mtime) and
        never modifies or deletes anything.

        Raises :class:`aligner.cli.UserError` naming the newest damaged file when complete
        checkpoints exist but none is intact (returning None would restart from step 0 silently).
        """
        first_bad: Optional[tuple[Path, Damage]] = None
        for cand in _candidates(self.root):
            damage = _verify_cached(cand)
            if damage is not None:
                log.warning("checkpoint %s is damaged: %s: %s; trying the previous complete checkpoint", cand, damage.file, damage.reason)
                self.damaged.add(cand.name)
                first_bad = first_bad or (cand, damage)
                continue
            if not (cand / MANIFEST).exists():
                log.warning(
                    "checkpoint %s has no %s (written before checkpoints were checksummed): its files cannot be verified", cand, MANIFEST
                )
            if first_bad is not None:
                log.warning("using checkpoint %s instead of the damaged %s", cand, first_bad[0])
            return cand
        if first_bad is not None:
            ckpt, damage = first_bad
            raise UserError(
                f"checkpoint {ckpt} is damaged ({damage.file}: {damage.reason}) and no older intact "
                f"checkpoint is left in {self.root}: restore that file, or rerun with overwrite=true "
                "instead of resume=true to start over from step 0"
            )
        return None

    def adopt(self, ckpt: Path) -> None:
        """Continue the run that wrote `ckpt` (resume): take over its run_id and count `ckpt` as this run's own."""
        run_id = _read_state(ckpt).get("run_id")
        if run_id:
            self.run_id = str(run_id)
        self.own.add(Path(ckpt).name)

    def _is_own(self, ckpt: Path) -> bool:
        return ckpt.name in self.own or _read_state(ckpt).get("run_id") == self.run_id

    def _prune(self) -> None:
        """Delete this run's complete checkpoints beyond the newest `keep` intact ones; other runs' are left
        alone. This run's checkpoints that latest() found damaged do not count towards `keep` and go too
        (prune runs after a commit, so the run has a newer intact checkpoint by then)."""
        done = sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).exists() and self._is_own(p))
        intact = [p for p in done if p.name not in self.damaged]
        doomed = intact[: max(0, len(intact) - self.keep)] + [p for p in done if p.name in self.damaged]
        for old in doomed:
            (old / COMPLETE).unlink(missing_ok=True)  # never half-deleted yet still marked complete
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under `root` (a checkpoints/ dir, maybe missing) without changing
    anything: the one `latest` names, else the highest complete step dir; None when there is none.
    Not verified (cheap; for reading its recorded stage): resume uses :meth:`CheckpointManager.latest`."""
    root = Path(root)
    ptr = root / "latest"
    if ptr.is_file():
        cand = root / ptr.read_text().strip()
        if (cand / COMPLETE).exists():
            return cand
    done = sorted(p for p in root.glob("step_*") if (p / COMPLETE).exists())
    return done[-1] if done else None


def _candidates(root: Path):
    """Complete checkpoints to try, best first: the pointer's, then the older complete ones, newest first."""
    done = sorted(p for p in root.glob("step_*") if (p / COMPLETE).exists())
    ptr = root / "latest"
    try:
        named = root / ptr.read_text().strip() if ptr.is_file() else None
    except OSError:
        named = None
    if named is not None and named.name.startswith("step_") and (named / COMPLETE).exists():
        yield named
        done = [p for p in done if p.name < named.name]
    yield from reversed(done)


# ---- manifests ---------------------------------------------------------------------------------
class Damage(NamedTuple):
    """Why a checkpoint failed verification: the first bad file (absolute) and what is wrong with it."""

    file: Path
    reason: str


def file_crc32(path: str | os.PathLike) -> str:
    """CRC-32 (zlib) of the file's bytes, streamed in 1 MiB chunks, as 8 hex digits. Raises OSError."""
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _hashed_files(ckpt: Path) -> list[str]:
    """Relative paths (posix) of every regular file under `ckpt` except COMPLETE and the manifest, sorted."""
    out = []
    for dirpath, _, names in os.walk(ckpt):
        for name in names:
            rel = Path(dirpath, name).relative_to(ckpt).as_posix()
            if rel not in _UNHASHED:
                out.append(rel)
    return sorted(out)


def _crc_all(ckpt: Path, rels: list[str]) -> dict[str, str]:
    """{rel: CRC-32} of the files, read in parallel threads (zlib releases the GIL on large buffers)."""
    if len(rels) <= 1:
        return {rel: file_crc32(ckpt / rel) for rel in rels}
    with ThreadPoolExecutor(max_workers=min(len(rels), os.cpu_count() or 1, 8)) as pool:
        return dict(zip(rels, pool.map(lambda rel: file_crc32(ckpt / rel), rels)))


def write_manifest(ckpt: str | os.PathLike, step: int) -> dict[str, Any]:
    """Hash every file under `ckpt` (all but COMPLETE and MANIFEST.json itself, subdirs included) and write
    ``ckpt/MANIFEST.json``: {"format", "step", "algorithm": "crc32", "files": {relative path: {"size",
    "crc32"}}}. Returns the manifest. Raises OSError when a file cannot be read or the manifest written."""
    ckpt = Path(ckpt)
    rels = _hashed_files(ckpt)
    crcs = _crc_all(ckpt, rels)
    files = {rel: {"size": (ckpt / rel).stat().st_size, "crc32": crcs[rel]} for rel in rels}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "algorithm": "crc32", "files": files}
    _write_json(ckpt / MANIFEST, manifest)
    return manifest


def verify_checkpoint(ckpt: str | os.PathLike) -> Optional[Damage]:
    """Check a checkpoint dir against its MANIFEST.json without changing anything; None when intact.

    Damage (the first bad file in path order, and why) when: MANIFEST.json is unreadable or not a
    manifest; a listed file is missing, unreadable, or differs in size or CRC-32; MANIFEST.json is
    missing although trainer_state.json says one was written; trainer_state.json is not a JSON object.
    Sizes are checked before any file is read. A checkpoint without MANIFEST.json whose
    trainer_state.json does not name one (written before manifests) only gets the trainer_state check.
    Files not listed in the manifest are ignored. Never raises for a damaged checkpoint.
    """
    ckpt = Path(ckpt)
    state_path = ckpt / "trainer_state.json"
    mpath = ckpt / MANIFEST
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text())
            files = manifest["files"]
            if manifest.get("algorithm") != "crc32" or not isinstance(files, dict):
                raise ValueError(f"not an {MANIFEST_FORMAT} crc32 manifest")
            expect = {str(rel): (int(v["size"]), str(v["crc32"])) for rel, v in files.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return Damage(mpath, f"unreadable manifest ({type(e).__name__}: {e})")
        rels = sorted(expect)
        for rel in rels:
            try:
                size = (ckpt / rel).stat().st_size
            except FileNotFoundError:
                return Damage(ckpt / rel, f"missing (listed in {MANIFEST})")
            except OSError as e:
                return Damage(ckpt / rel, f"unreadable ({e})")
            if size != expect[rel][0]:
                return Damage(ckpt / rel, f"size {size} bytes, {MANIFEST} records {expect[rel][0]} (truncated or rewritten)")
        try:
            crcs = _crc_all(ckpt, rels)
        except OSError as e:
            return Damage(Path(getattr(e, "filename", None) or ckpt), f"unreadable ({e})")
        for rel in rels:
            if crcs[rel] != expect[rel][1]:
                return Damage(ckpt / rel, f"CRC-32 {crcs[rel]}, {MANIFEST} records {expect[rel][1]} (contents changed)")
    try:
        state = json.loads(state_path.read_text())
    except FileNotFoundError:
        return Damage(state_path, "missing")
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return Damage(state_path, f"unreadable ({type(e).__name__}: {e})")
    if not isinstance(state, dict):
        return Damage(state_path, f"not a JSON object but {type(state).__name__}")
    if not mpath.exists() and state.get("manifest") == MANIFEST:
        return Damage(mpath, "missing (trainer_state.json says one was written)")
    return None


_VERIFIED: dict[str, tuple[tuple, Optional[Damage]]] = {}  # path -> (stat key, result), per process


def _stat_key(ckpt: Path) -> tuple:
    """(relative path, inode, size, mtime_ns) of every file under `ckpt`: a change to any file re-verifies."""
    key = []
    for dirpath, _, names in os.walk(ckpt):
        for name in names:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            key.append((os.path.relpath(os.path.join(dirpath, name), ckpt), st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(sorted(key))


def _verify_cached(ckpt: Path) -> Optional[Damage]:
    """verify_checkpoint(ckpt), cached per process while no file under `ckpt` changes (stat only)."""
    path = str(Path(ckpt).resolve())
    key = _stat_key(Path(ckpt))
    hit = _VERIFIED.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    result = verify_checkpoint(ckpt)
    _VERIFIED[path] = (key, result)
    return result


def _read_state(ckpt: Path) -> dict[str, Any]:
    """trainer_state.json of `ckpt` as a dict ({} when unreadable), without touching RNG states."""
    try:
        state = json.loads((Path(ckpt) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    """trainer_state.json of a complete checkpoint; restores the driver RNG states too.

    Raises :class:`aligner.cli.UserError` naming the file when it is unreadable or not a JSON object
    (resume only reaches here with a checkpoint :meth:`CheckpointManager.latest` verified)."""
    path = Path(ckpt) / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError(f"not a JSON object but {type(state).__name__}")
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable trainer state ({e}); delete this checkpoint or resume from another") from None
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
