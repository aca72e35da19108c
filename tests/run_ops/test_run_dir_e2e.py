"""output_dir rules end to end, with real `python -m aligner.*` processes.

- a second fresh SFT run into a finished run's dir exits 2 with one line and leaves every file
  of the first run byte-identical;
- resume=true into a dir left by another stage (PPO or RM into an SFT run) exits 2, one line;
- overwrite=true deletes the previous run's outputs and runs fresh;
- a second run started while the first trains exits 2 naming the first's pid and host, and the
  first's metrics.jsonl is not truncated; once the first is SIGKILLed its lock does not block;
- output_dir empty, a file, under a file, or read-only: exit 2, one line, no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from aligner.tracking import read_metrics
from tests.toolkit.overrides import PPO_RULE, SMALL
from tests.toolkit.paths import REPO

pytestmark = pytest.mark.e2e

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _cli(module: str, *args: str, cwd: Path = REPO, timeout: int = 300, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`python -m module SMALL args`; env: cluster_env to join the session's Ray instance (default: its own)."""
    return subprocess.run(
        [sys.executable, "-m", module, *SMALL, *args], cwd=cwd, env=env or ENV, capture_output=True, text=True, timeout=timeout
    )


def _one_error_line(proc: subprocess.CompletedProcess, stage: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("[")]  # [..] = log lines
    assert len(lines) == 1 and lines[0].startswith(f"aligner {stage}: error: "), proc.stderr[-3000:]
    return lines[0]


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes), and every dir (-> b"<dir>")."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, cluster_env) -> Path:
    """A finished 2-step SFT run's output_dir (not to be modified by the tests that use it)."""
    out = tmp_path_factory.mktemp("first") / "sft"
    proc = _cli("aligner.sft", "trainer.max_steps=2", f"output_dir={out}", env=cluster_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "hf" / "config.json").exists() and not (out / ".aligner.lock").exists()
    return out


@pytest.mark.slow
def test_second_fresh_run_is_refused_and_changes_nothing(sft_run):
    before = _snapshot(sft_run)
    line = _one_error_line(_cli("aligner.sft", "trainer.max_steps=1", f"output_dir={sft_run}"), "sft")
    assert f"output_dir='{sft_run}' holds a previous run (" in line, line
    for fix in ("another output_dir", "resume=true", "overwrite=true"):
        assert fix in line, line
    assert _snapshot(sft_run) == before, "a refused run modified the previous run's files"


@pytest.mark.slow
@pytest.mark.parametrize("stage,extra", [("ppo", PPO_RULE), ("rm", ["reward.init="])])
def test_resume_into_another_stages_dir_is_refused(sft_run, stage, extra):
    before = _snapshot(sft_run)
    line = _one_error_line(_cli(f"aligner.{stage}", *extra, "resume=true", f"output_dir={sft_run}"), stage)
    assert f"resume=true: output_dir='{sft_run}' holds a run of stage sft (" in line and f"not {stage}" in line, line
    assert _snapshot(sft_run) == before


@pytest.mark.slow
def test_overwrite_deletes_the_previous_run_and_runs_fresh(sft_run, cluster_env, tmp_path):
    out = tmp_path / "sft"
    shutil.copytree(sft_run, out)
    old_id = json.loads((out / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())["run_id"]
    proc = _cli("aligner.sft", "trainer.max_steps=3", "trainer.save_every=1", "overwrite=true", f"output_dir={out}", env=cluster_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"overwrite=true: deleting the previous run's outputs in {out}" in proc.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    states = [json.loads((p / "trainer_state.json").read_text()) for p in sorted((out / "checkpoints").glob("step_*"))]
    assert [s["step"] for s in states] == [2, 3], "keep=2 of this run's own checkpoints"
    assert {s["run_id"] for s in states} != {old_id} and len({s["run_id"] for s in states}) == 1


@pytest.mark.slow
def test_second_run_while_the_first_trains_is_refused(tmp_path, cluster_env):
    out = tmp_path / "sft"
    first = subprocess.Popen(
        [sys.executable, "-m", "aligner.sft", *SMALL, "trainer.max_steps=100000", f"output_dir={out}"],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.1)
        second = _cli("aligner.sft", "trainer.max_steps=100000", "resume=true", f"output_dir={out}")
        n_before = len(read_metrics(out / "metrics.jsonl"))
        assert first.poll() is None, "the first run ended before the second was refused"
        line = _one_error_line(second, "sft")
        assert f"output_dir='{out}' is in use by pid {first.pid} on host {socket.gethostname()} (started " in line and line.endswith(
            "wait for it or use another output_dir"
        ), line
        deadline = time.monotonic() + 1.0  # the first run keeps appending: up to 1 s for a row past n_before
        while len(read_metrics(out / "metrics.jsonl")) <= n_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(read_metrics(out / "metrics.jsonl")) >= n_before, "the refused run truncated the first's metrics"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert (out / ".aligner.lock").exists(), "a SIGKILLed holder leaves its lock file"
    third = _cli("aligner.sft", "trainer.max_steps=1", "overwrite=true", f"output_dir={out}", env=cluster_env)  # not killed: joins
    assert third.returncode == 0, f"the dead run's lock blocked a new run:\n{third.stderr[-3000:]}"


def _unwritable(d: Path) -> bool:
    try:
        os.close(os.open(d / ".aligner.lock", os.O_RDWR | os.O_CREAT))
    except PermissionError:
        return True
    except OSError:
        return False
    (d / ".aligner.lock").unlink()
    return False


@pytest.mark.parametrize("kind", ["empty", "file", "under_file", "read_only"])
def test_unusable_output_dir_exits_2_with_one_line(tmp_path, kind):
    f = tmp_path / "file"
    f.write_text("x")
    value, expect = {
        "empty": ("", "output_dir='' is invalid: "),
        "file": (str(f), f"output_dir='{f}' is a file, not a directory"),
        "under_file": (str(f / "run"), f"output_dir='{f / 'run'}' lies under the file '{f}'"),
        "read_only": ("/sys/kernel", "output_dir='/sys/kernel' is not writable"),
    }[kind]
    if kind == "read_only" and not _unwritable(Path("/sys/kernel")):  # read-only even for root (chmod is not)
        pytest.skip("/sys/kernel is missing or writable here")
    line = _one_error_line(_cli("aligner.sft", "trainer.max_steps=1", f"output_dir={value}", cwd=tmp_path), "sft")
    assert expect in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and f.read_text() == "x"
