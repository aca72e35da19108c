"""SIGTERM end to end, with real processes.

What Slurm, Kubernetes and Ray send before they kill:

- SIGTERM to the driver (SFT and PPO): the current step finishes, a checkpoint of it is
  written, the run exits 143 within trainer.preempt_grace_s with one line saying what was
  saved; resume=true continues from exactly that step;
- SIGTERM to every process of the run (driver, Ray's own processes, the workers): the
  workers are gone, so nothing new can be saved: the run exits 143 within the grace time
  with one line, and the last complete checkpoint is intact and resumable (said by the driver, or by
  its supervising parent when Ray's core worker ended the driver first: aligner.run_ops.supervisor).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aligner.run_ops.checkpointing import CheckpointManager
from aligner.tracking import read_metrics
from tests.toolkit.overrides import PPO_RULE, SMALL
from tests.toolkit.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.e2e]

PPO = PPO_RULE + [
    "trainer.rollout_batch_size=8",
    "trainer.mini_batch_size=8",
    "trainer.eval_every=0",
]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
GRACE_S = 20


def _start(module: str, out: Path, *args: str) -> subprocess.Popen:
    """The run in its own session (so the test can signal all of its processes, and only them)."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *SMALL, f"output_dir={out}", f"trainer.preempt_grace_s={GRACE_S}", *args],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if (out / "metrics.jsonl").exists() and len([r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps within {timeout} s")


def _stop(proc: subprocess.Popen, pids: list[int]) -> tuple[int, str, float]:
    t0 = time.monotonic()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    _, err = proc.communicate(timeout=GRACE_S + 60)
    return proc.returncode, err, time.monotonic() - t0


def _last_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("aligner ")]
    assert lines, err[-3000:]
    return lines[-1]


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == sid]


@pytest.mark.parametrize("module,extra", [("aligner.sft", []), ("aligner.ppo", PPO)])
def test_sigterm_to_the_driver_saves_the_current_step_and_exits_143(tmp_path, request, module, extra):
    out = tmp_path / "run"
    proc = _start(module, out, "trainer.max_steps=100000", "trainer.save_every=0", *extra)
    _wait_for_steps(proc, out, 2)
    code, err, secs = _stop(proc, [proc.pid])
    assert code == 143, err[-3000:]
    assert secs < GRACE_S + 30, secs
    line = _last_line(err)
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    last = steps[-1]
    stage = module.split(".")[1]
    assert (
        line.startswith(f"aligner {stage}: stopped by SIGTERM after step {last} ")
        and f"saved the checkpoint of step {last}" in line
        and "resume=true" in line
    ), line
    assert "Traceback" not in err
    latest = CheckpointManager(out).latest()
    assert latest is not None and latest.name == CheckpointManager.name(last)
    assert not (out / ".aligner.lock").exists()
    if module == "aligner.sft":  # resume continues from exactly the saved step (on the session's Ray instance: not signalled)
        done = subprocess.run(
            [sys.executable, "-m", module, *SMALL, f"output_dir={out}", "resume=true", f"trainer.max_steps={last + 2}", *extra],
            cwd=REPO,
            env=request.getfixturevalue("cluster_env"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == steps + [last + 1, last + 2]


@pytest.mark.parametrize("order", ["driver first", "ray first"])
def test_sigterm_to_every_process_exits_143_within_the_grace_time_and_keeps_the_last_checkpoint(tmp_path, order):
    """ "driver first": the supervisor, then the rest by pid (the driver, then Ray's processes). "ray first":
    Ray's processes newest first, the driver, the supervisor last, as a scheduler's pid order can be once pids
    wrap (pid_max 32768 here, reached during a full suite): the raylet ends before the driver's handler runs,
    and Ray's core worker may end the driver itself (_Exit(1)), which only the supervisor can report."""
    out = tmp_path / "run"
    proc = _start("aligner.sft", out, "trainer.max_steps=100000", "trainer.save_every=2")
    _wait_for_steps(proc, out, 4)
    saved = CheckpointManager(out).latest()
    assert saved is not None
    rest = [p for p in _session_pids(os.getsid(proc.pid)) if p != proc.pid]
    pids = [proc.pid, *rest] if order == "driver first" else [*sorted(rest, reverse=True), proc.pid]
    code, err, secs = _stop(proc, pids)
    assert secs < GRACE_S + 30, secs
    latest = CheckpointManager(out).latest()
    assert latest is not None and int(latest.name.split("_")[1]) >= int(saved.name.split("_")[1])
    # Ray's core worker can end the driver itself (_Exit(1)) once the raylet's object store is gone; the
    # supervising parent (aligner.run_ops.supervisor) then reports the preemption: 143 either way
    assert code == 143, err[-3000:]
    line = _last_line(err)
    assert line.startswith("aligner sft: ") and "SIGTERM" in line and "resume=true" in line, line
    if order == "driver first":  # with the raylet gone first, Ray's own threads in the driver may print theirs
        assert "Traceback" not in err, err[-3000:]
    print(f"exit {code} after {secs:.1f} s: {line}")  # which process said it: the driver, or its supervisor (-rP shows it)


def test_the_watchdog_kills_the_drivers_descendants_before_it_exits(tmp_path):
    """Grace time over: the driver exits 143 and takes the processes it started (a local Ray instance
    and its workers; here a child with a grandchild) with it instead of leaving them running."""
    pid_file = tmp_path / "pids"
    script = f"""
import os, signal, subprocess, sys, time
from aligner.run_ops import preemption
preemption.install("ppo", 1.0)
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; g = subprocess.Popen(['sleep', '300']); "
                          "open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(300)"])
while not os.path.exists({str(pid_file)!r}) or not open({str(pid_file)!r}).read():
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)  # a step that does not finish within the grace time
"""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143 and time.monotonic() - t0 < 30, proc.stderr[-2000:]
    assert "did not finish within trainer.preempt_grace_s=1 s" in _last_line(proc.stderr)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{grandchild}").exists() and "Z" not in _proc_state(grandchild):
        time.sleep(0.1)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in _proc_state(grandchild), "the driver's grandchild survived"


def _proc_state(pid: int) -> str:
    try:
        return next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:"))
    except (FileNotFoundError, StopIteration):
        return "Z"


def test_a_worker_that_dies_after_sigterm_ends_a_preempted_run_with_143(capsys, monkeypatch):
    """A scheduler signals every process; a Ray worker can die of it before the driver's step ends
    (seen in a full-suite run: the driver got the worker's death and exited 1). That is preemption:
    exit 143, one line naming SIGTERM, the worker and resume=true; without SIGTERM it stays a failure (1)."""
    from aligner import cli
    from aligner.errors import WorkerError
    from aligner.run_ops import preemption

    def main(cfg):
        preemption.install("sft", 30.0)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs between bytecodes of the main thread
            raise WorkerError("actor", 0, "Traceback ...\nRayActorError: the actor died unexpectedly", "sft_step")
        finally:
            preemption.uninstall()

    monkeypatch.setattr(preemption, "_SIGTERM_SEEN", False)
    assert cli.run("sft", main, ["trainer.max_steps=1"]) == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("aligner sft: stopped by SIGTERM: actor rank 0 ended during the step (sft_step)") and "resume=true" in line
    monkeypatch.setattr(preemption, "_SIGTERM_SEEN", False)

    def broken(cfg):
        raise WorkerError("actor", 0, "Traceback ...\nValueError: bad", "sft_step")

    assert cli.run("sft", broken, ["trainer.max_steps=1"]) == 1


def test_after_sigterm_rays_logged_tracebacks_become_one_line_and_aligners_stay_whole():
    """Ray's code in the driver may log a traceback while it reads the deaths of workers the scheduler
    signalled too (CI, 2026-11-28: Ray 2.60's ``AssertionError`` in serialization.py). From SIGTERM until
    uninstall, a Ray logger's record with an exception is one line; aligner's records keep theirs."""
    import io
    import logging

    from aligner.run_ops import preemption

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s -- %(message)s"))
    ray_logger, ours = logging.getLogger("ray"), logging.getLogger("aligner.test_preemption")
    ray_logger.addHandler(handler)
    ours.addHandler(handler)

    def log_both() -> str:
        stream.seek(0), stream.truncate()
        for logger in (logging.getLogger("ray._private.serialization"), ours):
            try:
                raise AssertionError("actor_died_error")
            except AssertionError as e:
                logger.exception(e)
        return stream.getvalue()

    try:
        preemption.install("sft", 60.0)
        before = log_both()
        assert before.count("Traceback") == 2, before
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not preemption.requested() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert preemption.requested()
        after = log_both()
        ray_line, rest = after.split("\n", 1)
        assert ray_line == (
            "ray._private.serialization ERROR -- actor_died_error [AssertionError: actor_died_error; "
            "Ray's traceback not shown: the run was stopped by SIGTERM]"
        ), after
        assert rest.startswith("aligner.test_preemption ERROR -- actor_died_error\nTraceback"), rest
        preemption.uninstall()
        assert log_both().count("Traceback") == 2
    finally:
        preemption.uninstall()
        ray_logger.removeHandler(handler)
        ours.removeHandler(handler)
