"""A damaged checkpoint end to end, with real `python -m aligner.sft` processes.

A 4-step SFT run saves steps 2 and 4; 4 KB of finite bytes are written over the middle of step 4's
actor .distcp (what used to load silently and train on from different weights). `resume=true`
must then resume from step 2, warn naming the damaged file, finish with exit 0 and leave intact
checkpoints behind. With every checkpoint damaged, `resume=true` exits 2 with one line naming the
file instead of restarting from step 0.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aligner.run_ops.checkpointing import verify_checkpoint
from aligner.tracking import read_metrics
from tests.toolkit.overrides import SMALL
from tests.toolkit.paths import REPO

pytestmark = pytest.mark.e2e


def _sft(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aligner.sft", *SMALL, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def _damage(ckpt: Path) -> Path:
    """Overwrite 4 KB in the middle of the checkpoint's actor .distcp with finite float32 bytes."""
    (path,) = sorted((ckpt / "actor").glob("*.distcp"))
    size = path.stat().st_size
    assert size > 16384, size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\x00\x00\x80\x3e" * 1024)  # 0.25 as float32, 1024 times
    return path


@pytest.mark.slow
def test_resume_skips_a_damaged_checkpoint(cluster_env, tmp_path):
    out = tmp_path / "sft"
    first = _sft(cluster_env, "trainer.max_steps=4", "trainer.save_every=2", f"output_dir={out}")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000004"
    before = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert sorted(before) == [1, 2, 3, 4], before
    bad = _damage(ckpts / "step_00000004")

    resumed = _sft(cluster_env, "trainer.max_steps=6", "trainer.save_every=2", "resume=true", f"output_dir={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    warning = [ln for ln in resumed.stderr.splitlines() if "is damaged" in ln]
    assert warning and str(bad) in warning[0] and "step_00000004" in warning[0], resumed.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_00000002'} (step 2)" in resumed.stderr, resumed.stderr[-3000:]
    after = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert sorted(after) == [1, 2, 3, 4, 5, 6], after
    # steps 3-4 trained again from step 2's weights, data position and RNG: the same losses
    assert [after[s] for s in (3, 4)] == pytest.approx([before[s] for s in (3, 4)], rel=1e-5), (before, after)
    # the damaged step 4 was replaced by the resumed run's own; both kept checkpoints verify
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000006"]
    assert (ckpts / "latest").read_text() == "step_00000006"
    for name in ("step_00000004", "step_00000006"):
        assert verify_checkpoint(ckpts / name) is None, name
    assert (out / "hf" / "config.json").exists()

    # every checkpoint damaged: one error line naming the newest damaged file, exit 2, not a restart
    newest_bad = _damage(ckpts / "step_00000006")
    _damage(ckpts / "step_00000004")
    failed = _sft(cluster_env, "trainer.max_steps=8", "trainer.save_every=2", "resume=true", f"output_dir={out}")
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr + failed.stdout, failed.stderr[-3000:]
    lines = [ln for ln in failed.stderr.splitlines() if ln.strip() and not ln.startswith("[")]  # [..] = log lines
    assert len(lines) == 1 and lines[0].startswith("aligner sft: error: "), failed.stderr[-3000:]
    assert str(newest_bad) in lines[0] and "overwrite=true" in lines[0], lines[0]
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == 6
