"""Fault injection: a run meets three faults and finishes by itself, with the uninterrupted run's metrics.

For a stage (``sft``: 20 steps, the actor on dp=2; ``ppo``: 10 steps, rule reward, random-init actor /
critic / reference), the script runs ``python -m aligner.<stage>`` twice in subprocesses with
``trainer.save_every=1``: once uninterrupted, once with ``trainer.max_restarts=3`` and
``trainer.hang_timeout_s`` short, injecting, each after the next checkpoint:

1. SIGKILL to the first worker (the first group's rank 0: a process death);
2. SIGSTOP to the first worker (a hang: no progress until the watchdog names it and the run restarts);
3. SIGKILL to the last-started worker (in PPO another role's group; in SFT the actor's last rank), or
   with ``--node-loss`` the loss of a node: both runs join a local two-node cluster (``ray start``: a
   head with no CPUs, so every worker is on the one worker node), every process of the worker node is
   SIGKILLed (its raylet and the workers on it) and a replacement node joins ``--replace-after-s``
   later, as Kubernetes or an autoscaler would bring one; the restart waits for it
   (``trainer.restart_wait_s``).

It then checks that the faulted run ended with exit 0, counted three restarts, and that every step's
metrics equal the uninterrupted run's (wall-time keys ``time/`` and ``ranks/`` aside, and the restart
counters), and prints what each fault cost: seconds from the fault to the next step's checkpoint, and
the steps run again.

    python benchmarks/fault_injection.py --stage sft
    python benchmarks/fault_injection.py --stage ppo
    python benchmarks/fault_injection.py --stage sft --node-loss
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tests.toolkit

from aligner.tracking import read_metrics  # noqa: E402
from tests.toolkit.processes import cmdline, descendants, worker_shells  # noqa: E402

VENV_BIN = Path(sys.executable).parent

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
SKIP = ("time/", "ranks/", "restarts", "rollout_restarts", "weight_version", "tokens_per_s", "step_time_s")  # wall times, counters


def latest_step(out: Path) -> int:
    ptr = out / "checkpoints" / "latest"
    try:
        return int(ptr.read_text().strip().split("_")[1]) if ptr.exists() else 0
    except (OSError, ValueError, IndexError):
        return 0


def start(stage: str, out: Path, extra: list[str], env: dict | None = None) -> subprocess.Popen:
    steps, args = STAGES[stage]
    cmd = [sys.executable, "-m", f"aligner.{stage}", *COMMON, *args, f"trainer.max_steps={steps}", f"output_dir={out}", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)


class LocalCluster:
    """A Ray cluster of nodes on this machine: a head with no CPUs (it places no worker) and worker nodes,
    each a ``ray start --block`` in its own session, so one node's processes can be killed alone (never
    ``ray stop``, which stops every Ray instance on the machine)."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.nodes = log_dir, []
        self.port = _os_port()
        self.env = {
            **os.environ,
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent),  # the workers import this checkout
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.head = self._start("head", ["--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false"])
        self._wait_raylet(self.head, "head")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        cmd = [str(VENV_BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
               "--object-store-memory=300000000", *args]  # fmt: skip
        log = open(self.log_dir / f"ray_{name}.log", "w")
        return subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def add_node(self, cpus: int = 8) -> subprocess.Popen:
        """Start a worker node and wait until its raylet is up."""
        name = f"node{len(self.nodes)}"
        node = self._start(name, [f"--address={self.address}", f"--num-cpus={cpus}"])
        self.nodes.append(node)
        self._wait_raylet(node, name)
        return node

    def _wait_raylet(self, proc: subprocess.Popen, name: str) -> None:
        """Until `proc`'s raylet runs and its ``ray start`` log (``ray_<name>.log``) says the runtime started."""
        t0, log = time.monotonic(), self.log_dir / f"ray_{name}.log"
        while not any("raylet" in cmdline(p) for p in descendants(proc.pid)) or "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() - t0 > 120:
                raise RuntimeError(f"ray start ({name}) did not start (see {log})")
            time.sleep(0.5)

    def kill_node(self, node: subprocess.Popen) -> int:
        """SIGKILL every process of `node` (its raylet and the workers on it); returns how many."""
        procs = [*descendants(node.pid), node.pid]
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.wait(timeout=30)
        return len(procs)

    def stop(self) -> None:
        for proc in [*self.nodes, self.head]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        pointer = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"  # `ray start` names its head here
        try:
            if pointer.read_text().strip().endswith(f":{self.port}"):
                pointer.unlink()
        except OSError:
            pass


def _os_port() -> int:
    """A port the OS picks (its ephemeral range): aligner.runtime.ports.free_port draws below that range,
    where Ray's own worker ports (10002-19999) are, and `ray start` refuses a GCS port among them."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_worker_shells(cluster: LocalCluster) -> list[int]:
    """The ray::WorkerShell processes on the cluster's live worker nodes, by pid."""
    return sorted(p for n in cluster.nodes if n.poll() is None for p in descendants(n.pid) if cmdline(p).startswith("ray::WorkerShell"))


def _wait_for(proc: subprocess.Popen, probe, what: str, limit_s: float = 900):
    """Poll `probe()` until it returns something other than None, while the run goes on; returns it.
    Raises RuntimeError (with the run's stderr) when the run ends first or `limit_s` passes."""
    t0 = time.monotonic()
    while (found := probe()) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (code {proc.returncode}) before {what}: {proc.communicate()[1][-3000:]}")
        if time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"no {what} within {limit_s:.0f} s")
        time.sleep(0.1)
    return found


def wait_checkpoint_past(proc: subprocess.Popen, out: Path, step: int) -> int:
    """The latest checkpoint's step once it is past `step`."""
    return _wait_for(proc, lambda: latest_step(out) if latest_step(out) > step else None, f"a checkpoint past step {step}")


def _rows(out: Path) -> list[dict]:
    """The metrics rows written so far (a file being written: a cut last line is skipped silently)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def _wait_restarted(proc: subprocess.Popen, out: Path, n: int) -> dict:
    """The first metrics row the run writes after its n-th restart (rows carry ``restarts``)."""

    def probe():
        rows = [r for r in _rows(out) if r.get("restarts", 0) + r.get("rollout_restarts", 0) >= n]
        return rows[0] if rows else None

    return _wait_for(proc, probe, f"a step finished after restart {n}")


def faulted_run(
    stage: str, out: Path, hang_s: float, cluster: LocalCluster | None = None, replace_after_s: float = 20.0
) -> tuple[subprocess.Popen, list[dict], float, str]:
    """Run `stage` with the three faults injected; (the process, one dict per fault, wall seconds, stderr).
    Per fault: the seconds from the fault to the first step the restarted run finishes, and the steps
    run again (those past the checkpoint it resumed from that had finished before the fault). With a
    `cluster`, the third fault is the loss of its worker node, replaced `replace_after_s` later."""
    env = None if cluster is None else {**cluster.env, "RAY_ADDRESS": cluster.address}
    proc = start(stage, out, ["trainer.max_restarts=3", f"trainer.hang_timeout_s={hang_s}"], env=env)
    t_start = time.monotonic()
    steps = STAGES[stage][0]
    faults = []
    kinds = [
        ("SIGKILL, the first worker", signal.SIGKILL, 0),
        ("SIGSTOP (hang), the first worker", signal.SIGSTOP, 0),
        ("SIGKILL, the last-started worker", signal.SIGKILL, -1)
        if cluster is None
        else (f"the worker node lost (every process SIGKILLed), a new one after {replace_after_s:g} s", None, None),
    ]
    try:
        for n, (step, (what, sig, pick)) in enumerate(zip([steps // 5, steps // 2, (4 * steps) // 5], kinds), start=1):
            wait_checkpoint_past(proc, out, step - 1)
            shells = worker_shells(proc.pid) if cluster is None else node_worker_shells(cluster)
            if not shells:
                raise RuntimeError("no ray::WorkerShell process found under the driver or on the nodes")
            time.sleep(0.3)  # into the next step
            done = max((r["step"] for r in _rows(out)), default=0)
            t0 = time.monotonic()
            if sig is None:
                killed = cluster.kill_node(cluster.nodes[-1])
                what = f"{what} ({killed} processes)"
                time.sleep(replace_after_s)
                cluster.add_node()
                pick, shells = 0, [cluster.nodes[-2].pid]  # the lost node's `ray start`, for the table
            else:
                os.kill(shells[pick], sig)
            first = _wait_restarted(proc, out, n)
            lost = max(0, done - (first["step"] - 1))
            faults.append(
                {"fault": what, "pid": shells[pick], "steps done": done, "recovery s": round(time.monotonic() - t0, 1), "lost": lost}
            )
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
    ap.add_argument("--node-loss", action="store_true", help="the third fault is the loss of a node of a local two-node cluster")
    ap.add_argument("--replace-after-s", type=float, default=20.0, help="--node-loss: seconds until the replacement node starts")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    print(env_line())
    print(command_line())
    root = Path(args.out or tempfile.mkdtemp(prefix=f"faults_{args.stage}_"))
    root.mkdir(parents=True, exist_ok=True)
    cluster = None
    try:
        if args.node_loss:
            cluster = LocalCluster(root)
            cluster.add_node()
        env = None if cluster is None else {**cluster.env, "RAY_ADDRESS": cluster.address}
        t0 = time.monotonic()
        clean = start(args.stage, root / "clean", [], env=env)
        _, err = clean.communicate(timeout=1800)
        clean_s = time.monotonic() - t0
        if clean.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed (code {clean.returncode}): {err[-3000:]}")
        proc, faults, faulted_s, err = faulted_run(args.stage, root / "faulted", args.hang_timeout_s, cluster, args.replace_after_s)
    finally:
        if cluster is not None:
            cluster.stop()
    want, got = ({r["step"]: r for r in read_metrics(root / name / "metrics.jsonl")} for name in ("clean", "faulted"))
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
    print("| fault | steps finished before it | seconds to the first step after the restart | steps run again |")
    print("|---|---|---|---|")
    for f in faults:
        print(f"| {f['fault']} (pid {f['pid']}) | {f['steps done']} | {f['recovery s']} | {f['lost']} |")
    print(f"restarts counted in the metrics: {restarts}; steps with metrics: {sorted(got) == sorted(want)}")
    print(f"metric values that differ from the uninterrupted run: {len(diffs)}" + (f" (first: {diffs[:3]})" if diffs else ""))
    lines = [line for line in err.splitlines() if "restart" in line]
    for line in lines:
        print("  log:", line[:240])
    if proc.returncode != 0 or diffs or restarts != 3:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
