"""Checkpoint integrity: every file of a
checkpoint is recorded (size + CRC-32) in MANIFEST.json at commit, and CheckpointManager.latest()
verifies the candidate, falls back to the previous complete checkpoint with a warning naming the
first bad file, and raises UserError (one line, naming the file) when no intact one is left.

Checkpoints are real: a tiny TrainRuntime saves its dcp files into the role dir as
tests/run_ops/test_checkpointing_kill.py does, then CheckpointManager.commit writes the rest.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

import pytest
import torch

import aligner.run_ops.checkpointing as ckpting
from aligner.cli import UserError
from aligner.run_ops.checkpointing import MANIFEST, CheckpointManager, load_trainer_state, verify_checkpoint
from tests.toolkit.models import tiny_model_config

NARROW = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, max_seq_len=16)  # of tiny_model_config


@pytest.fixture(scope="module")
def engine():
    from aligner.config import OptimConfig, ParallelConfig
    from aligner.parallel.dims import ParallelDims
    from aligner.runtime.train_runtime import TrainRuntime

    return TrainRuntime(tiny_model_config(**NARROW), "lm", ParallelConfig(), OptimConfig(), ParallelDims(), total_steps=100)


def _set_step(module, step: int) -> None:
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(module.named_parameters())):
            p.fill_(step + 0.001 * i)


def _step_of(module) -> int:
    return round(float(sorted(module.named_parameters())[0][1].flatten()[0]))


def _save(mgr: CheckpointManager, eng, step: int) -> Path:
    _set_step(eng.module, step)
    eng.step_count = step
    tmp = mgr.begin(step)
    eng.save(str(tmp / "actor"))
    return mgr.commit(tmp, step, {"step": step, "data": {"pos": step}})


def _distcp(ckpt: Path) -> Path:
    files = sorted((ckpt / "actor").glob("*.distcp"))
    assert len(files) == 1, files
    return files[0]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def two(tmp_path, engine):
    """A run dir with complete checkpoints of steps 1 and 2 (`latest` names step 2)."""
    mgr = CheckpointManager(tmp_path, keep=2, stage="sft")
    _save(mgr, engine, 1)
    _save(mgr, engine, 2)
    return mgr.root


def _overwrite(path: Path, data: bytes) -> None:
    """Overwrite len(data) bytes in the middle of `path` in place (size unchanged)."""
    size = path.stat().st_size
    assert size > len(data) + 64, (path, size)
    with open(path, "r+b") as f:
        f.seek((size - len(data)) // 2)
        f.write(data)


def _corrupt(ckpt: Path, how: str) -> Path:
    """Damage `ckpt` the way `how` says; returns the damaged file."""
    if how == "finite_4k":
        bad = _distcp(ckpt)
        _overwrite(bad, torch.full((1024,), 0.25, dtype=torch.float32).numpy().tobytes())  # finite floats
    elif how == "ff_4k":
        bad = _distcp(ckpt)
        _overwrite(bad, b"\xff" * 4096)  # NaN as float32
    elif how == "truncated":
        bad = _distcp(ckpt)
        os.truncate(bad, bad.stat().st_size // 2)
    elif how == "deleted":
        bad = _distcp(ckpt)
        bad.unlink()
    elif how == "trainer_state":
        bad = ckpt / "trainer_state.json"
        text = bad.read_text()
        bad.write_text(text[: len(text) // 2])  # cut: not JSON any more
    elif how == "rng":
        bad = ckpt / "rng.pt"
        _overwrite(bad, b"\x00" * 64)
    elif how == "role_meta":
        bad = ckpt / "actor" / "meta.json"
        bad.write_text(bad.read_text().replace('"step": 2', '"step": 9'))
    else:
        raise AssertionError(how)
    return bad


# ---- the manifest ------------------------------------------------------------------------------
def test_manifest_records_size_and_crc32_of_every_file(two, caplog):
    ckpt = two / "step_00000002"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name not in ("COMPLETE", MANIFEST))
    assert sorted(manifest["files"]) == on_disk
    assert {"trainer_state.json", "rng.pt", "actor/meta.json", "actor/.metadata", _distcp(ckpt).relative_to(ckpt).as_posix()} <= set(
        on_disk
    )
    for rel, rec in manifest["files"].items():
        data = (ckpt / rel).read_bytes()
        assert rec == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, rel
    assert manifest["algorithm"] == "crc32" and manifest["step"] == 2
    assert json.loads((ckpt / "trainer_state.json").read_text())["manifest"] == MANIFEST
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert CheckpointManager(two.parent).latest() == ckpt
    assert caplog.text == ""
    assert verify_checkpoint(ckpt) is None


# ---- damage -> the previous checkpoint, with a warning naming the file ----------------------------
@pytest.mark.parametrize("how", ["finite_4k", "ff_4k", "truncated", "deleted", "trainer_state", "rng", "role_meta"])
def test_damaged_newest_falls_back_to_the_previous_checkpoint(two, engine, how, caplog):
    newest = two / "step_00000002"
    bad = _corrupt(newest, how)
    before = _snapshot(two)
    mgr = CheckpointManager(two.parent, keep=2, stage="sft")
    with caplog.at_level(logging.WARNING, logger="aligner"):
        got = mgr.latest()
    assert got == two / "step_00000001"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(newest) in w and str(bad) in w for w in warnings), warnings
    assert _snapshot(two) == before, "verification changed files"
    assert (two / "latest").read_text() == "step_00000002"
    # what resume does next: the fallback loads the step-1 weights and trainer state
    eng_state = load_trainer_state(got)
    assert eng_state["step"] == 1 and eng_state["data"] == {"pos": 1}
    meta = engine.load(str(got / "actor"))
    assert meta["step"] == 1 and _step_of(engine.module) == 1


def test_finite_overwrite_of_tensor_bytes_loads_silently_without_the_check(two, engine):
    """Why the manifest exists: dcp loads finite garbage in a tensor's bytes without complaint (the
    tiny model's tensors are < 4 KB, so 1 KB inside one tensor's data stands in for the 4 KB)."""
    ckpt = two / "step_00000002"
    path = _distcp(ckpt)
    data = bytearray(path.read_bytes())
    for i in range(len(list(engine.module.parameters()))):
        at = data.find(torch.full((256,), 2 + 0.001 * i, dtype=torch.float32).numpy().tobytes())
        if at >= 0:
            data[at : at + 1024] = torch.full((256,), 0.25, dtype=torch.float32).numpy().tobytes()
            break
    else:
        raise AssertionError("no 256-element parameter found in the .distcp bytes")
    path.write_bytes(bytes(data))
    meta = engine.load(str(ckpt / "actor"))  # no error from dcp
    assert meta["step"] == 2
    params = [p for _, p in sorted(engine.module.named_parameters())]
    assert all(torch.isfinite(p).all() for p in params)
    assert any((p == 0.25).any() for p in params), "the garbage did not reach the weights"
    damage = verify_checkpoint(ckpt)
    assert damage is not None and damage.file == path and "CRC-32" in damage.reason


def test_damage_in_two_newest_falls_back_two_steps(tmp_path, engine, caplog):
    mgr = CheckpointManager(tmp_path, keep=3)
    for step in (1, 2, 3):
        _save(mgr, engine, step)
    _corrupt(mgr.root / "step_00000003", "ff_4k")
    _corrupt(mgr.root / "step_00000002", "deleted")
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert CheckpointManager(tmp_path).latest() == mgr.root / "step_00000001"
    assert "step_00000003" in caplog.text and "step_00000002" in caplog.text


def test_unreadable_manifest_falls_back(two, caplog):
    (two / "step_00000002" / MANIFEST).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert CheckpointManager(two.parent).latest() == two / "step_00000001"
    assert str(two / "step_00000002" / MANIFEST) in caplog.text


def test_deleted_manifest_of_a_checksummed_checkpoint_is_damage(two, caplog):
    (two / "step_00000002" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert CheckpointManager(two.parent).latest() == two / "step_00000001"
    assert str(two / "step_00000002" / MANIFEST) in caplog.text


# ---- nothing intact left -> one clear error line -------------------------------------------------
@pytest.mark.parametrize("how", ["finite_4k", "trainer_state"])
def test_damaged_only_checkpoint_raises_user_error_naming_the_file(tmp_path, engine, how):
    mgr = CheckpointManager(tmp_path)
    ckpt = _save(mgr, engine, 1)
    bad = _corrupt(ckpt, how)
    with pytest.raises(UserError) as err:
        CheckpointManager(tmp_path).latest()
    msg = str(err.value)
    assert str(bad) in msg and "overwrite=true" in msg and "\n" not in msg, msg


def test_no_checkpoint_at_all_is_still_none(tmp_path):
    assert CheckpointManager(tmp_path).latest() is None


def test_load_trainer_state_of_a_corrupt_file_is_a_user_error(tmp_path):
    (tmp_path / "trainer_state.json").write_text('{"step": 3, "da')
    with pytest.raises(UserError, match=str(tmp_path / "trainer_state.json")):
        load_trainer_state(tmp_path)
    (tmp_path / "trainer_state.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="not a JSON object"):
        load_trainer_state(tmp_path)


# ---- checkpoints from before manifests ---------------------------------------------------------
def _legacy(root: Path, step: int, state: str | None = None) -> Path:
    ck = root / "checkpoints" / CheckpointManager.name(step)
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text(state if state is not None else json.dumps({"step": step}))
    (ck / "COMPLETE").write_text(str(step))
    return ck


def test_checkpoint_without_manifest_is_accepted_with_a_warning(tmp_path, caplog):
    old = _legacy(tmp_path, 5)
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert CheckpointManager(tmp_path).latest() == old
    assert str(old) in caplog.text and "cannot be verified" in caplog.text


def test_legacy_checkpoint_with_corrupt_trainer_state_falls_back_or_errors(tmp_path, caplog):
    _legacy(tmp_path, 5, state='{"step": 5, "dat')
    with pytest.raises(UserError, match="trainer_state.json"):
        CheckpointManager(tmp_path).latest()
    good = _legacy(tmp_path, 4)
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert CheckpointManager(tmp_path).latest() == good
    assert str(tmp_path / "checkpoints" / "step_00000005" / "trainer_state.json") in caplog.text


# ---- caching and pruning -----------------------------------------------------------------------
def test_verification_is_cached_until_a_file_changes(two, monkeypatch):
    calls = []
    real = ckpting.file_crc32
    monkeypatch.setattr(ckpting, "file_crc32", lambda p: calls.append(p) or real(p))
    mgr = CheckpointManager(two.parent)
    assert mgr.latest() == two / "step_00000002"
    first = len(calls)
    assert first >= 4
    assert mgr.latest() == two / "step_00000002"
    assert CheckpointManager(two.parent).latest() == two / "step_00000002"
    assert len(calls) == first, "the second latest() hashed the files again"
    bad = _corrupt(two / "step_00000002", "ff_4k")  # in place: new mtime
    st = bad.stat()
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse-mtime file systems
    assert mgr.latest() == two / "step_00000001"


def test_a_resumed_run_replaces_or_prunes_the_damaged_checkpoint(tmp_path, engine):
    first = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        _save(first, engine, step)
    _corrupt(first.root / "step_00000003", "ff_4k")
    resumed = CheckpointManager(tmp_path, keep=2)
    ckpt = resumed.latest()
    assert ckpt == first.root / "step_00000002"
    resumed.adopt(ckpt)
    _save(resumed, engine, 4)  # a newer intact checkpoint: the damaged step 3 does not take a `keep` slot
    assert sorted(p.name for p in resumed.root.glob("step_*")) == ["step_00000002", "step_00000004"]
    again = CheckpointManager(tmp_path, keep=2)
    ckpt = again.latest()
    assert ckpt == first.root / "step_00000004" and verify_checkpoint(ckpt) is None


def test_resaving_the_damaged_step_replaces_it(two, engine):
    _corrupt(two / "step_00000002", "truncated")
    mgr = CheckpointManager(two.parent, keep=2)
    mgr.adopt(mgr.latest())
    _save(mgr, engine, 2)
    assert sorted(p.name for p in mgr.root.glob("step_*")) == ["step_00000001", "step_00000002"]
    assert CheckpointManager(two.parent).latest() == two / "step_00000002"
