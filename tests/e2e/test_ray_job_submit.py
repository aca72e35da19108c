"""Cluster submission: a `ray start --head` cluster on 127.0.0.1 and `ray job submit` of a job
that uses aligner's WorkerGroup on that cluster.

The head runs as `ray start --block` in its own session; cleanup sends SIGTERM to that one
process (it stops the processes it started) and then to its session, never `ray stop`, which
would stop every Ray instance on the machine. The job's command is JOB_COMMAND (one line to
change, e.g. to `python -m aligner.sft conf=tiny`); the job's `python` is the venv's (its bin
directory leads PATH) and the uploaded working directory is on sys.path.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RUNTIME_ENV = {"excludes": [".venv", ".git", "outputs", "runs", "*.egg-info", "__pycache__", ".pytest_cache"]}

JOB_SCRIPT = """
from aligner.config import ClusterConfig, ParallelConfig, ResourceConfig
from aligner.parallel.ray_runtime import init_ray
from aligner.parallel.worker_group import WorkerGroup, dispatch

class Summer:
    def __init__(self, dims):
        self.dims = dims

    @dispatch("broadcast")
    def tp_sum(self):
        import torch, torch.distributed as dist
        t = torch.tensor([float(self.dims.rank + 1)])
        dist.all_reduce(t, group=self.dims.tp_group)
        return t.item()

init_ray(ClusterConfig(address="auto"))
with WorkerGroup.create("actor", Summer, ParallelConfig(tp_size=2), ResourceConfig()) as group:
    print("ALIGNER_RESULT", group.tp_sum().get(timeout_s=120))
"""
JOB_COMMAND = f"python -c {shlex.quote(JOB_SCRIPT)}"
EXPECTED = "ALIGNER_RESULT [3.0, 3.0]"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
    )
    env.pop("RAY_ADDRESS", None)
    return env


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def _forget_cluster(gcs_port: int) -> None:
    """Remove Ray's pointer to this (stopped) cluster, as `ray stop` would, if it still names it."""
    pointer = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    try:
        if pointer.read_text().strip().endswith(f":{gcs_port}"):
            pointer.unlink()
    except OSError:
        pass


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the head (it kills the processes it started), then its session as a backstop."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the head's own session (start_new_session=True)
    except ProcessLookupError:
        pass


@pytest.mark.slow
@pytest.mark.distributed
def test_ray_job_submit_runs_worker_group_on_cluster(tmp_path):
    gcs, dash, client, agent = (_free_port() for _ in range(4))
    env = _env()
    start = [
        str(VENV_BIN / "ray"), "start", "--head", "--block",
        "--node-ip-address=127.0.0.1", f"--port={gcs}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
        "--num-cpus=4", "--disable-usage-stats",
    ]  # fmt: skip
    log = open(tmp_path / "ray_start.log", "w")
    head = subprocess.Popen(start, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{dash}/api/version", head, timeout_s=120)
        submit = [
            str(VENV_BIN / "ray"), "job", "submit",
            "--address", f"http://127.0.0.1:{dash}",
            "--working-dir", str(REPO),
            "--runtime-env-json", json.dumps(RUNTIME_ENV),
            "--", *shlex.split(JOB_COMMAND),
        ]  # fmt: skip
        res = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=400)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-4000:]
        assert EXPECTED in out, out[-4000:]
        assert "succeeded" in out, out[-4000:]
    finally:
        _stop(head)
        _forget_cluster(gcs)
        log.close()
