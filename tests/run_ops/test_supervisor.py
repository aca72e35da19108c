"""The driver's supervisor (aligner.run_ops.supervisor): the parent process of a command-line run.

Each test runs a small program that calls ``supervisor.fork`` and lets its child (standing in for
the driver) end the way a Ray driver can: ``_Exit(1)`` after a SIGTERM (what Ray's core worker does
when the raylet's object store is gone), killed by SIGKILL, leaving a grandchild behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.toolkit.paths import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(2) is Linux's")

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _program(tmp_path: Path, child_body: str, output_dir: str = "None") -> str:
    """A supervised program: the parent prints the child's pid to tmp_path/child and returns
    supervisor.fork's code; the child writes its pid, then runs `child_body`."""
    return f"""
import os, signal, sys, time
from aligner.run_ops import supervisor
code = supervisor.fork("sft", lambda: {output_dir})
if code is None:
    open({str(tmp_path / "child")!r}, "w").write(str(os.getpid()))
{child_body}
    os._exit(0)
sys.exit(code)
"""


def _start(tmp_path: Path, child_body: str, output_dir: str = "None") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _program(tmp_path, child_body, output_dir)],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _child_pid(tmp_path: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        f = tmp_path / "child"
        if f.exists() and f.read_text():
            return int(f.read_text())
        time.sleep(0.05)
    raise AssertionError("the child never started")


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            return True
        if "Z" in state:
            return True
        time.sleep(0.05)
    return False


def test_a_driver_that_ray_ends_after_sigterm_is_reported_as_preempted_with_143(tmp_path):
    """The flaw itself: SIGTERM reaches the parent, which forwards it; the child ends with _Exit(1)
    (Ray's QuickExit), no Python handler of its own running: the parent exits 143 with one line
    naming the signal, the child's exit and the newest complete checkpoint."""
    from aligner.run_ops.checkpointing import CheckpointManager

    out = tmp_path / "run"
    manager = CheckpointManager(out)
    saved = manager.commit(manager.begin(4), 4, {"step": 4})
    body = "    signal.signal(signal.SIGTERM, lambda s, f: os._exit(1))\n    time.sleep(60)"
    proc = _start(tmp_path, body, repr(str(out)))
    _child_pid(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("aligner sft: stopped by SIGTERM: the driver (pid ") and "exited 1" in line, line
    assert f"the newest complete checkpoint, {saved}, is intact" in line and line.endswith("rerun with resume=true"), line


def test_the_drivers_own_codes_pass_through(tmp_path):
    """0, 2 (bad input) and 143 (the driver's own preemption line) are the child's to say; any other
    code without a signal passes through unchanged."""
    for code in (0, 2, 3, 143):
        (tmp_path / "child").unlink(missing_ok=True)
        proc = _start(tmp_path, f"    os._exit({code})")
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == code, (code, err)
        assert "aligner sft:" not in err, err


def test_a_driver_killed_by_sigkill_is_named_in_one_line(tmp_path):
    proc = _start(tmp_path, "    time.sleep(60)")
    os.kill(_child_pid(tmp_path), signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 137, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("aligner sft: error: the driver (pid ") and "killed by SIGKILL" in line and "OOM" in line, line


def test_sigterm_is_forwarded_and_the_drivers_143_stands(tmp_path):
    """A scheduler that signals only the first process reaches the driver through the parent; the
    driver's own graceful exit (143, its line) is the run's."""
    body = (
        "    signal.signal(signal.SIGTERM, lambda s, f: (print('aligner sft: stopped by SIGTERM after step 3', file=sys.stderr), "
        "os._exit(143)))\n    time.sleep(60)"
    )
    proc = _start(tmp_path, body)
    _child_pid(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "aligner sft: stopped by SIGTERM after step 3", err


def test_the_driver_dies_with_the_supervisor(tmp_path):
    """SIGKILL to the parent ends the driver too (PR_SET_PDEATHSIG), as it did before the parent existed."""
    proc = _start(tmp_path, "    time.sleep(60)")
    child = _child_pid(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert _gone(child), "the driver outlived its supervisor"


def test_processes_the_driver_leaves_are_killed(tmp_path):
    """A driver ended by _Exit leaves its local Ray instance running; the parent (their subreaper once
    the driver is gone) kills them before it exits."""
    pid_file = tmp_path / "grandchild"
    body = (
        "    import subprocess\n"
        "    g = subprocess.Popen(['sleep', '300'])\n"
        f"    open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
        "    os._exit(1)"
    )
    proc = _start(tmp_path, body)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert _gone(int(pid_file.read_text())), "a process the driver started outlived the run"


def test_in_process_calls_and_the_switch_do_not_supervise(monkeypatch):
    from aligner.run_ops import supervisor

    assert not supervisor.enabled(["trainer.max_steps=1"])  # aligner.sft.main([...]) from Python, tests, the demo
    monkeypatch.setenv("ALIGNER_SUPERVISOR", "0")
    assert not supervisor.enabled(None)
    monkeypatch.setenv("ALIGNER_SUPERVISOR", "1")
    assert supervisor.enabled(None)
