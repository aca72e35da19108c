"""A worker process SIGKILLed mid-PPO-step: the run heals by itself, once; the second kill ends it.

``python -m aligner.ppo`` (rule reward, random-init actor/critic/ref, save_every=1,
trainer.max_restarts=1) runs in a subprocess; once the first checkpoint exists, one of its Ray
``WorkerShell`` processes (found among the driver's descendants in /proc: the local Ray instance
is the driver's child, its workers the raylet's children) is SIGKILLed while the next step runs.

The run uses the split rollout placement with generation one step ahead (rollout.placement=split,
trainer.max_staleness=1). The first victim is the rollout group's worker (the group started last,
so the highest pid), killed while it may be generating the next step's batch beside the update: the
driver restarts the rollout group alone (a new rollout worker, every trainer worker still the same
process, the weights synced again, the step run again from its prompts), or, when the kill landed
in a weight sync (whose actor side fails with it), stops every group and resumes from the latest
complete checkpoint. Either way the log names the role, the rank and the killed pid. The second
victim is the trainer's worker of the lowest pid (the actor's, critic's and ref's groups start side
by side): past the budget (one restart a run, of either kind), the run must end within DEADLINE_S
with a non-zero code, one message naming role and rank that says the restarts were spent, and no
process of the run alive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.toolkit.processes import alive, alive_after, cmdline, descendants, worker_shells

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
    "rollout.placement=split",
    "trainer.max_staleness=1",
]


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


def _workers(pid: int, wait_s: float = 120) -> list[int]:
    """The driver's ray::WorkerShell descendants, once there are some (within wait_s)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = worker_shells(pid)
        if found:
            return found
        time.sleep(0.2)
    return []


def _wait_for_checkpoint(proc: subprocess.Popen, out: Path, after: int, wait_s: float = 400) -> int:
    deadline = time.monotonic() + wait_s
    while latest_step(out) <= after and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
    assert latest_step(out) > after, f"no checkpoint past step {after} within {wait_s:.0f} s"
    return latest_step(out)


def _stderr_tail(proc: subprocess.Popen) -> str:
    """The run's stderr (the process killed first if it still runs), for a failure message."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()[1][-3000:]


def _replacement(proc: subprocess.Popen, old: list[int], wait_s: float = 180) -> list[int]:
    """The driver's WorkerShell descendants once one of them is new (not in `old`), within wait_s."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        found = _workers(proc.pid, wait_s=1)
        if set(found) - set(old) and len(found) >= len(old):
            return found
        time.sleep(0.5)
    return []


def test_worker_killed_mid_step_restarts_once_then_fails_fast(tmp_path):
    out = tmp_path / "run"
    proc = start_ppo(out, "trainer.max_steps=30", "trainer.max_restarts=1")
    try:
        first = _wait_for_checkpoint(proc, out, 0)
        generation1 = _workers(proc.pid)
        assert generation1, f"no ray::WorkerShell among the driver's descendants: {[cmdline(p)[:60] for p in descendants(proc.pid)]}"
        time.sleep(0.5)  # into the next step (refit / generate / inference / train)
        victim = generation1[-1]  # the rollout group's worker
        os.kill(victim, signal.SIGKILL)
        # healed: a new worker (with the rollout group a step ahead, the death may be noticed only when the
        # driver waits for that batch, after the current step and its checkpoint), then a checkpoint past
        # the latest one at that time
        generation2 = _replacement(proc, generation1)
        assert generation2, f"no new worker after the kill: {_stderr_tail(proc)}"
        kept = [p for p in generation1 if p != victim and p in generation2]  # the trainer's workers, when the rollout group restarted alone
        healed_at = latest_step(out)
        _wait_for_checkpoint(proc, out, healed_at)
        alone = len(kept) == len(generation1) - 1
        if not alone:  # the whole run restarted: none of the first generation may be left
            stray = [(p, cmdline(p)[:80]) for p in generation1 if alive(p)]
            assert not stray, f"workers of the stopped groups still alive: {stray}"
        victim2 = min(_workers(proc.pid, wait_s=5))  # a trainer group's worker (those groups start side by side)
        os.kill(victim2, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver hung for 120 s after worker pid {victim2} was killed")
        took = time.monotonic() - t0
        tree = generation1 + generation2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert first >= 1 and proc.returncode != 0, err[-3000:]
    assert took < DEADLINE_S, f"exit took {took:.1f} s after the second kill"
    restart_line = next((line for line in err.splitlines() if "restart 1 of 1" in line), "")
    assert re.search(r"rollout rank 0 died during (step|the eval after step|the checkpoint of step) \d+", restart_line), err[-3000:]
    assert f"pid: {victim}" in restart_line, "the restart names another process than the one killed"
    if alone:
        assert "the rollout group alone" in restart_line, restart_line
        assert victim2 in generation1, "the actor's worker changed although only the rollout group restarted"
    else:
        assert "stopping and starting the worker groups" in restart_line and f"resumed from {out / 'checkpoints'}" in err, err[-3000:]
    named = re.findall(r"(actor|critic|ref) rank (\d+)", err.split(restart_line, 1)[1])
    assert named and "died" in err and f"pid: {victim2}" in err, err[-3000:]
    assert "every automatic restart was spent" in err, err[-3000:]
    assert "Traceback" not in err and "rerun with resume=true" in err, err[-3000:]
    stray = [(p, cmdline(p)[:80]) for p in alive_after(tree, 5.0)]
    assert not stray, f"processes of the run still alive 5 s after it exited: {stray}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(len(steps))), f"a metrics row twice or missing after the restart (step 0: the eval before training): {steps}"
    key = "rollout_restarts" if alone else "restarts"
    assert all(r.get(key) == 1.0 for r in rows if r["step"] > healed_at), [(r["step"], r.get(key)) for r in rows]
    report = Path(os.environ.get("ALIGNER_RELIABILITY_OUT", tmp_path)) / "worker_death.txt"
    report.write_text(
        f"victims={victim},{victim2} workers={len(generation1)} healed={'rollout group alone' if alone else 'every group'} "
        f"at_step={healed_at} exit_s={took:.2f} rc={proc.returncode}\n"
        f"--- driver stderr tail ---\n{err[-2500:]}\n"
    )
