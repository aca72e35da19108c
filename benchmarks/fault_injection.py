"""Fault injection: a run meets three faults and finishes by itself, with the uninterrupted run's metrics
(issue 41, its "Tests" runs).

For a stage (``sft``: 20 steps, the actor on dp=2; ``ppo``: 10 steps, rule reward, random-init actor /
critic / reference), the script runs ``python -m aligner.<stage>`` twice in subprocesses with
``trainer.save_every=1``: once uninterrupted, once with ``trainer.max_restarts=3`` and
``trainer.hang_timeout_s`` short, injecting, each after the next checkpoint:

1. SIGKILL to a worker of the first group (a process death);
2. SIGSTOP to a worker (a hang: no progress until the watchdog names it and the run restarts);
3. SIGKILL to the last-started group's worker (another role's death).

It then checks that the faulted run ended with exit 0, counted three restarts, and that every step's
metrics equal the uninterrupted run's (wall-time keys ``time/`` and ``ranks/`` aside, and the restart
counters), and prints what each fault cost: seconds from the fault to the next step's checkpoint, and
the steps run again. Not injected: the loss of a node (aligner's placement pins no group to a node,
so a local two-node cluster cannot force a group onto the node it stops).

    python benchmarks/fault_injection.py --stage sft
    python benchmarks/fault_injection.py --stage ppo
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

COMMON = [
    "trainer.save_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "task.num_eval=8",
    "task.num_sft=200",
    "task.num_pairs=100",
    "task.num_rl=100",
]
STAGES = {
    "sft": (20, ["actor.parallel.dp_size=2", "trainer.global_batch_size=16", "trainer.micro_batch_size=8"]),
    "ppo": (
        10,
        [
            "reward.type=rule",
            "reward.rule=digit_fraction",
            "actor.init=",
            "reward.init=",
            "critic.init=",
            "trainer.rollout_batch_size=8",
            "trainer.mini_batch_size=8",
            "trainer.micro_batch_size=8",
        ],
    ),
}
SKIP = ("time/", "ranks/", "restarts", "rollout_restarts", "weight_version")


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


def workers(pid: int) -> list[int]:
    """The run's ray::WorkerShell processes (descendants of the driver), oldest first."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    shells = []
    for p in out:
        try:
            if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::WorkerShell"):
                shells.append(p)
        except OSError:
            pass
    return sorted(shells)


def latest_step(out: Path) -> int:
    ptr = out / "checkpoints" / "latest"
    try:
        return int(ptr.read_text().strip().split("_")[1]) if ptr.exists() else 0
    except (OSError, ValueError, IndexError):
        return 0


def metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def start(stage: str, out: Path, extra: list[str]) -> subprocess.Popen:
    steps, args = STAGES[stage]
    cmd = [sys.executable, "-m", f"aligner.{stage}", *COMMON, *args, f"trainer.max_steps={steps}", f"output_dir={out}", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_checkpoint_past(proc: subprocess.Popen, out: Path, step: int, limit_s: float = 900) -> float:
    """Seconds until a checkpoint past `step` exists (the run must still be going)."""
    t0 = time.monotonic()
    while latest_step(out) <= step:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the run ended (code {proc.returncode}) before a checkpoint past step {step}: {proc.communicate()[1][-3000:]}"
            )
        if time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"no checkpoint past step {step} within {limit_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - t0


def faulted_run(stage: str, out: Path, hang_s: float) -> tuple[subprocess.Popen, list[dict], float, str]:
    """Run `stage` with the three faults injected; (the process, one dict per fault, wall seconds, stderr)."""
    proc = start(stage, out, ["trainer.max_restarts=3", f"trainer.hang_timeout_s={hang_s}"])
    t_start = time.monotonic()
    steps = STAGES[stage][0]
    faults = []
    try:
        at = [max(1, steps // 5), max(2, steps // 2), max(3, (4 * steps) // 5)]
        kinds = [
            ("SIGKILL, first group", signal.SIGKILL, 0),
            ("SIGSTOP (hang)", signal.SIGSTOP, 0),
            ("SIGKILL, last group", signal.SIGKILL, -1),
        ]
        for step, (what, sig, pick) in zip(at, kinds):
            wait_checkpoint_past(proc, out, step - 1)
            shells = workers(proc.pid)
            if not shells:
                raise RuntimeError("no ray::WorkerShell process found under the driver")
            victim = shells[pick]
            ckpt = latest_step(out)
            time.sleep(0.3)  # into the next step
            os.kill(victim, sig)
            healed_s = wait_checkpoint_past(proc, out, ckpt)
            faults.append({"fault": what, "pid": victim, "after checkpoint": ckpt, "to the next checkpoint s": round(healed_s, 1)})
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, faults, time.monotonic() - t_start, err


def main() -> None:
    from common import command_line, env_line

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", choices=sorted(STAGES), default="sft")
    ap.add_argument("--hang-timeout-s", type=float, default=20.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    print(env_line())
    print(command_line())
    root = Path(args.out or tempfile.mkdtemp(prefix=f"faults_{args.stage}_"))
    t0 = time.monotonic()
    clean = start(args.stage, root / "clean", [])
    _, err = clean.communicate(timeout=1800)
    clean_s = time.monotonic() - t0
    if clean.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed (code {clean.returncode}): {err[-3000:]}")
    proc, faults, faulted_s, err = faulted_run(args.stage, root / "faulted", args.hang_timeout_s)
    want, got = metrics(root / "clean"), metrics(root / "faulted")
    diffs = []
    for step, row in want.items():
        other = got.get(step, {})
        for k, v in row.items():
            if k.startswith(SKIP):
                continue
            if other.get(k) != v:
                diffs.append((step, k, v, other.get(k)))
    restarts = max((r.get("restarts", 0) + r.get("rollout_restarts", 0) for r in got.values()), default=0)
    print(f"stage {args.stage}: {max(want)} steps; uninterrupted {clean_s:.0f} s, with faults {faulted_s:.0f} s (exit {proc.returncode})")
    print("| fault | pid | after checkpoint | seconds to the next checkpoint |")
    print("|---|---|---|---|")
    for f in faults:
        print(f"| {f['fault']} | {f['pid']} | step {f['after checkpoint']} | {f['to the next checkpoint s']} |")
    print(f"restarts counted in the metrics: {restarts}; steps with metrics: {sorted(got) == sorted(want)}")
    print(f"metric values that differ from the uninterrupted run: {len(diffs)}" + (f" (first: {diffs[:3]})" if diffs else ""))
    lines = [line for line in err.splitlines() if "restart" in line]
    for line in lines:
        print("  log:", line[:240])
    if proc.returncode != 0 or diffs or restarts != 3:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
