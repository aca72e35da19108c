"""A worker process SIGKILLed mid-PPO-step: the run exits within seconds, non-zero, naming role and rank.

``python -m aligner.ppo`` (rule reward, random-init actor/critic/ref, save_every=1) runs in a
subprocess; once the first checkpoint exists, one of its Ray ``WorkerShell`` processes (found
among the driver's descendants in /proc: the local Ray instance is the driver's child, its
workers the raylet's children) is SIGKILLed while the next step runs. The driver must exit
within DEADLINE_S with a non-zero code and a message naming the role and the rank, leave no
process of the run alive, and a rerun with resume=true must continue from the last complete
checkpoint to the end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

DEADLINE_S = 30.0  # from the kill to the driver's exit
ARGS = [
    "reward.type=rule",
    "reward.rule=digit_fraction",
    "actor.init=",
    "reward.init=",
    "critic.init=",
    "trainer.save_every=1",
    "trainer.eval_every=0",
    "trainer.rollout_batch_size=8",
    "trainer.mini_batch_size=8",
    "trainer.micro_batch_size=8",
    "task.num_eval=8",
    "task.num_sft=100",
    "task.num_pairs=100",
    "task.num_rl=100",
    "trainer.progress=false",
]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_ppo(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "aligner.ppo", *ARGS, f"output_dir={out}", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def latest_step(out: Path) -> int:
    ptr = out / "checkpoints" / "latest"
    return int(ptr.read_text().strip().split("_")[1]) if ptr.exists() else 0


def test_worker_killed_mid_step_fails_fast_then_resumes(tmp_path):
    out = tmp_path / "run"
    proc = start_ppo(out, "trainer.max_steps=8")
    try:
        deadline = time.monotonic() + 400
        while latest_step(out) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, f"the run ended before its first checkpoint: {proc.communicate()[1][-3000:]}"
        assert latest_step(out) >= 1, "no checkpoint within 400 s"
        tree = descendants(proc.pid)
        workers = sorted(p for p in tree if cmdline(p).startswith("ray::WorkerShell"))
        assert workers, f"no ray::WorkerShell among the driver's descendants: {[cmdline(p)[:60] for p in tree]}"
        time.sleep(0.5)  # into the next step (refit / generate / inference / train)
        victim = workers[len(workers) // 2]
        step_at_kill = latest_step(out)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver hung for 120 s after worker pid {victim} was killed")
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, err[-3000:]
    assert took < DEADLINE_S, f"exit took {took:.1f} s after the kill"
    named = re.findall(r"(actor|critic|ref) rank (\d+)", err)
    assert named, f"the error does not name the role and rank: {err[-3000:]}"
    assert "died" in err, err[-3000:]
    assert f"pid: {victim}" in err, "the error is about another process than the one killed"
    assert "Traceback" not in err and "rerun with resume=true" in err, err[-3000:]
    time.sleep(5)
    stray = [(p, cmdline(p)[:80]) for p in tree if alive(p)]
    assert not stray, f"processes of the run still alive 5 s after it exited: {stray}"
    last = latest_step(out)
    assert last >= step_at_kill and (out / "checkpoints" / f"step_{last:08d}" / "COMPLETE").exists()

    resumed = start_ppo(out, "resume=true", f"trainer.max_steps={last + 1}")
    try:
        _, err2 = resumed.communicate(timeout=400)
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
    assert resumed.returncode == 0, err2[-3000:]
    assert f"(step {last})" in err2, "the rerun did not resume from the last checkpoint"
    assert latest_step(out) == last + 1
    report = Path(os.environ.get("ALIGNER_RELIABILITY_OUT", tmp_path)) / "worker_death.txt"
    report.write_text(
        f"victim={victim} workers={len(workers)} named={named[-1]} exit_s={took:.2f} rc={proc.returncode} "
        f"ckpt_at_kill={step_at_kill} resumed_from={last}\n--- driver stderr tail ---\n{err[-2500:]}\n"
    )
