"""SIGKILL during checkpoint saves: the previous checkpoint stays loadable and `latest` names a complete one.

One harness subprocess (this file run as a script) imports torch once and forks a saver child
per trial, so each trial costs a fork, not a torch import. The saver child loops: set every
parameter of a tiny TrainRuntime to a value that encodes the step, ``CheckpointManager.begin``,
``TrainRuntime.save`` (dcp, aligner.runtime.checkpoint) into ``<tmp>/actor``, ``commit``. The
harness SIGKILLs it

- at deterministic points: the child's hooks (monkeypatches of dcp.save, checkpoint._commit,
  os.replace and CheckpointManager._prune, installed only in the child) report the phase on a
  pipe and sleep, and the harness kills it there;
- after random delays across many trials (a seeded uniform delay per trial).

After each kill a fresh CheckpointManager must clean every temp entry, ``latest()`` must name a
checkpoint whose COMPLETE, trainer_state and role meta agree on the step, and a fresh engine
loading it must hold exactly the weights saved at that step. The same is done for the HF export
(``save_hf`` killed while writing the safetensors, before and between the directory swap).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

NARROW = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, max_seq_len=16)  # of tiny_model_config
CKPT_PHASES = {  # phase -> step latest() must name when killed there while saving step s (s - 1 = previous)
    "begun": -1,  # temp dir made, nothing written
    "role_written": -1,  # dcp files written into actor.tmp, no meta.json, not renamed
    "before_role_rename": -1,  # role checkpoint complete inside the temp dir
    "before_commit": -1,  # role renamed inside the temp dir, no trainer_state/COMPLETE
    "before_ckpt_rename": -1,  # COMPLETE written, temp dir not yet renamed
    "before_pointer": -1,  # step dir renamed into place, `latest` still names s - 1
    "before_prune": 0,  # pointer moved
}
HF_PHASES = {"hf_in_write": -1, "hf_before_swap": -1, "hf_between_swap": -1}
RANDOM_TRIALS = 30
SEED = 20240611


# ---- the harness (runs in its own process) ------------------------------------------------
def _value(step: int, index: int) -> float:
    return float(step) + 0.001 * index


def _engine():
    from aligner.config import OptimConfig, ParallelConfig
    from aligner.parallel.dims import ParallelDims
    from aligner.runtime.train_runtime import TrainRuntime
    from tests.toolkit.models import tiny_model_config

    return TrainRuntime(tiny_model_config(**NARROW), "lm", ParallelConfig(), OptimConfig(), ParallelDims(), total_steps=100)


def _set_step(module, step: int) -> None:
    import torch

    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(module.named_parameters())):
            p.fill_(_value(step, i))


def _step_of(module) -> int | None:
    """The step encoded in every parameter, or None when they do not all agree with one step."""
    params = [p for _, p in sorted(module.named_parameters())]
    step = round(float(params[0].flatten()[0]))
    ok = all(bool((p == _value(step, i)).all()) for i, p in enumerate(params))
    return step if ok else None


def _install_hooks(phase: str, pipe_w: int, min_step: int) -> dict:
    """Monkeypatch the save path in this (child) process: report `phase` on the pipe and sleep there."""
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    import aligner.runtime.checkpoint as pc
    from aligner.run_ops.checkpointing import CheckpointManager

    state = {"step": 0}

    def hit(name: str) -> None:
        if name == phase and state["step"] >= min_step:
            os.write(pipe_w, f"AT {name} {state['step']}\n".encode())
            time.sleep(600)

    def wrap(fn, before=None, after=None):
        def inner(*a, **k):
            if before:
                before(*a, **k)
            out = fn(*a, **k)
            if after:
                after(*a, **k)
            return out

        return inner

    real_replace = os.replace

    def on_replace(src, dst, *a, **k):
        name = Path(src).name
        if name.startswith(".step_"):
            hit("before_ckpt_rename")
        elif name.startswith(".latest.tmp"):
            hit("before_pointer")
        elif name.startswith(".hf.tmp"):
            hit("hf_between_swap")  # the previous export was moved aside already
        elif Path(src).name == "hf" and Path(dst).name.startswith(".hf.old"):
            hit("hf_before_swap")

    dcp.save = wrap(dcp.save, after=lambda *a, **k: hit("role_written"))
    pc._commit = wrap(pc._commit, before=lambda *a, **k: hit("before_role_rename"))
    os.replace = wrap(real_replace, before=on_replace)
    CheckpointManager._prune = wrap(CheckpointManager._prune, before=lambda *a, **k: hit("before_prune"))
    st.save_file = wrap(st.save_file, after=lambda *a, **k: hit("hf_in_write"))
    state["hit"] = hit
    return state


def _saver(root: str, phase: str, pipe_w: int, min_step: int) -> None:
    """Child: save checkpoints (or HF exports) forever, one step after the other."""
    from aligner.model.hf import save_hf
    from aligner.run_ops.checkpointing import CheckpointManager

    state = _install_hooks(phase, pipe_w, min_step)
    eng = _engine()
    mgr = CheckpointManager(root)
    last = mgr.latest()
    step = int((last / "COMPLETE").read_text()) + 1 if last else 1
    os.write(pipe_w, b"READY\n")
    while True:
        state["step"] = step
        _set_step(eng.module, step)
        if phase.startswith("hf_"):
            save_hf(eng.full_state_dict(), eng.model_cfg, os.path.join(root, "hf"))
        else:
            eng.step_count = step
            tmp = mgr.begin(step)
            state["hit"]("begun")
            eng.save(str(tmp / "actor"))
            state["hit"]("before_commit")
            mgr.commit(tmp, step, {"step": step})
        os.write(pipe_w, f"SAVED {step}\n".encode())
        step += 1


def _run_child(root: str, phase: str, min_step: int, delay: float | None, timeout: float = 120.0) -> dict:
    """Fork a saver; kill it at `phase` (delay None) or after `delay` s of saving. Returns what it reported."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            _saver(root, phase, w, min_step)
        finally:
            os._exit(3)
    os.close(w)
    buf, saved, at = b"", [], None
    deadline = time.monotonic() + timeout
    kill_at = None
    with os.fdopen(r, "rb", buffering=0) as f:
        os.set_blocking(r, False)
        while time.monotonic() < deadline:
            try:
                chunk = f.read(4096) or b""
            except BlockingIOError:
                chunk = b""
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                word, *rest = line.decode().split()
                if word == "READY" and delay is not None:
                    kill_at = time.monotonic() + delay
                elif word == "SAVED":
                    saved.append(int(rest[0]))
                elif word == "AT":
                    at = int(rest[1])
            if at is not None or (kill_at is not None and time.monotonic() >= kill_at):
                break
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return {"saved": saved, "at": at, "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL}


def _check_ckpt(root: str) -> dict:
    """A fresh manager's view after a kill: stale entries, latest, and whether it loads exactly."""
    from aligner.run_ops.checkpointing import CheckpointManager

    ptr = Path(root) / "checkpoints" / "latest"
    ptr_ok = (not ptr.exists()) or (ptr.parent / ptr.read_text().strip() / "COMPLETE").exists()
    mgr = CheckpointManager(root)
    stale = sorted(p.name for p in mgr.root.iterdir() if p.name.startswith("."))
    latest = mgr.latest()
    out = {"pointer_complete": ptr_ok, "stale": stale, "latest": None, "loads": None}
    if latest is None:
        return out
    step = int((latest / "COMPLETE").read_text())
    state = json.loads((latest / "trainer_state.json").read_text())
    eng = _engine()
    meta = eng.load(str(latest / "actor"))
    loaded = _step_of(eng.module)
    out.update(latest=step, loads=(loaded == step and state["step"] == step and meta["step"] == step), loaded_step=loaded)
    return out


def _check_hf(root: str) -> dict:
    from aligner.model.hf import load_hf_model

    d = Path(root) / "hf"
    stale = sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".hf."))
    try:
        model, _ = load_hf_model(d)
    except Exception as e:  # noqa: BLE001 - recorded and asserted on by the test
        return {"latest": None, "error": f"{type(e).__name__}: {e}", "stale": stale}
    return {"latest": _step_of(model), "stale": stale}


def harness(work: str) -> dict:
    import torch

    torch.set_num_threads(1)
    results: dict = {"phases": {}, "hf": {}, "random": []}
    for phase in CKPT_PHASES:  # deterministic points, each in its own run dir, killed while saving step 2
        root = os.path.join(work, phase)
        run = _run_child(root, phase, min_step=2, delay=None)
        results["phases"][phase] = {**run, **_check_ckpt(root)}
    for phase in HF_PHASES:
        root = os.path.join(work, phase)
        run = _run_child(root, phase, min_step=2, delay=None)
        results["hf"][phase] = {**run, **_check_hf(root)}
    rng = random.Random(SEED)
    root = os.path.join(work, "random")
    for _ in range(RANDOM_TRIALS):  # one run dir: every trial resumes after the previous kill
        t0 = time.monotonic()
        run = _run_child(root, "none", min_step=10**9, delay=rng.uniform(0.0, 1.0))
        results["random"].append({**run, **_check_ckpt(root), "seconds": time.monotonic() - t0})
    return results


# ---- the tests ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt_kill")
    repo = str(Path(__file__).resolve().parents[2])  # the harness (this file as a script) imports tests.toolkit
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, __file__, str(work)], capture_output=True, text=True, timeout=800, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (Path(os.environ.get("ALIGNER_RELIABILITY_OUT", work)) / "checkpoint_kill.json").write_text(json.dumps(out, indent=1))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(CKPT_PHASES))
def test_kill_at_phase_keeps_previous_checkpoint(results, phase):
    r = results["phases"][phase]
    assert r["at"] == 2 and r["killed"], f"the child never reached {phase}: {r}"
    assert r["pointer_complete"], f"`latest` names an incomplete checkpoint after a kill at {phase}"
    assert r["stale"] == [], f"temp entries left after the next start: {r['stale']}"
    assert r["latest"] == 2 + CKPT_PHASES[phase], r
    assert r["loads"], f"checkpoint step {r['latest']} does not hold the weights saved at that step: {r}"


@pytest.mark.slow
def test_random_kills_keep_a_loadable_latest(results):
    trials = results["random"]
    assert len(trials) == RANDOM_TRIALS and all(t["killed"] for t in trials)
    assert sum(len(t["saved"]) for t in trials) >= RANDOM_TRIALS, "too few saves completed: kills did not land across saves"
    newest = 0
    for i, t in enumerate(trials):
        newest = max([newest, *t["saved"]])
        assert t["pointer_complete"] and t["stale"] == [], (i, t)
        if newest:
            assert t["latest"] is not None and newest <= t["latest"] <= newest + 1, (i, t)
            assert t["loads"], (i, t)
        newest = max(newest, t["latest"] or 0)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["hf_in_write", "hf_before_swap"])
def test_kill_during_hf_export_keeps_previous_export(results, phase):
    r = results["hf"][phase]
    assert r["at"] == 2 and r["killed"], r
    assert r["latest"] == 1, f"HF export after a kill at {phase}: {r}"


@pytest.mark.slow
def test_kill_between_hf_dir_swap_keeps_previous_export(results):
    """The kill leaves no dir at the export path for a moment; the next reader moves the previous one back."""
    r = results["hf"]["hf_between_swap"]
    assert r["at"] == 2 and r["killed"], r
    assert r["latest"] == 1, r


if __name__ == "__main__":
    print(json.dumps(harness(sys.argv[1])))
