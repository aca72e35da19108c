"""Cluster submission: a `ray start --head` cluster on 127.0.0.1 and `ray job submit` of a job
that uses aligner's WorkerGroup on that cluster.

The head runs as `ray start --block` in its own session; cleanup sends SIGTERM to that one
process (it stops the processes it started) and then to its session, never `ray stop`, which
would stop every Ray instance on the machine. The job is `python -m aligner.ppo conf=tiny
trainer.max_steps=2 ...`; the job's `python` is the venv's (its bin directory leads PATH) and
the uploaded working directory is on sys.path.
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

from tests.toolkit.paths import REPO

pytestmark = pytest.mark.e2e

VENV_BIN = Path(sys.executable).parent
RUNTIME_ENV = {"excludes": [".venv", ".git", "outputs", "runs", "*.egg-info", "__pycache__", ".pytest_cache"]}

# The main job, 2 PPO steps, as the README's `ray job submit --working-dir . -- python -m aligner.ppo ...`.
# A random policy and the dense rule reward keep it independent of SFT/RM checkpoints; the run
# joins the head through RAY_ADDRESS, which the job runtime sets.
PPO_OVERRIDES = (
    "conf=tiny trainer.max_steps=2 actor.init= reward.init= critic.init= reward.type=rule "
    "reward.rule=digit_fraction trainer.rollout_batch_size=8 trainer.mini_batch_size=8 trainer.micro_batch_size=8 "
    "task.num_sft=100 task.num_pairs=100 task.num_eval=16 trainer.progress=false"
)
EXPECTED = "held-out accuracy (greedy, rule-checked)"


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
        time.sleep(0.2)
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
def test_ray_job_submit_runs_ppo_on_cluster(tmp_path):
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
            "--", "python", "-m", "aligner.ppo", *shlex.split(PPO_OVERRIDES), f"output_dir={tmp_path / 'ppo'}",
        ]  # fmt: skip
        res = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=400)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-4000:]
        assert EXPECTED in out, out[-4000:]
        assert "succeeded" in out, out[-4000:]
        steps = [json.loads(line)["step"] for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [0, 1, 2], steps
    finally:
        _stop(head)
        _forget_cluster(gcs)
        log.close()
