"""The output_dir rules (aligner.run_ops.run_dir), pruning by a run's own history (aligner.run_ops.checkpointing)
and the cut last line of metrics.jsonl (aligner.tracking). Issue 21, "Reliability II".

- decide(): fresh / refused / overwrite / resume, resume=true into another stage's run,
  resume=true with overwrite=true, overwrite=true of a dir holding one of the run's inputs;
- make_output_dir(): a file, a path under a file, a read-only dir: one-line UserErrors;
- the lock: held by a live process -> refused naming its pid and host; left by a SIGKILLed
  process -> not blocking; released when the claimed block raises;
- pruning keeps other runs' checkpoints, however high their steps;
- a metrics.jsonl whose last line was cut: dropped with a warning (any other bad line: file:line).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aligner.cli import UserError, load_config
from aligner.config import ConfigError
from aligner.run_ops.checkpointing import CheckpointManager
from aligner.run_ops.run_dir import LOCK_NAME, RunLock, claim_output_dir, decide, make_output_dir, previous_run_entries
from aligner.tracking import MetricsLogger, read_metrics, repair_metrics
from tests.toolkit.paths import REPO


def _cfg(stage: str, out: Path, *extra: str):
    return load_config(stage, [f"output_dir={out}", *extra])


def _previous_run(out: Path, stage: str = "sft") -> Path:
    """A finished run's files (config.yaml, metrics.jsonl, one checkpoint of `stage`, hf/)."""
    ck = out / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text(json.dumps({"step": 4, "stage": stage, "run_id": "old"}))
    (ck / "COMPLETE").write_text("4")
    (out / "checkpoints" / "latest").write_text(ck.name)
    (out / "config.yaml").write_text(f"stage: {stage}\noutput_dir: {out}\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text("{}")
    return out


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- fresh / non-empty / overwrite / resume ------------------------------------------------
def test_missing_empty_or_unrelated_dir_is_fresh(tmp_path):
    assert decide(_cfg("sft", tmp_path / "none"), tmp_path / "none") == "fresh"
    (tmp_path / "checkpoints").mkdir()  # empty: no previous run
    (tmp_path / "notes.txt").write_text("mine")  # not a run's output
    (tmp_path / LOCK_NAME).write_text('{"pid": 1}')  # a stale lock file
    assert previous_run_entries(tmp_path) == []
    assert decide(_cfg("sft", tmp_path), tmp_path) == "fresh"
    assert decide(_cfg("sft", tmp_path, "resume=true"), tmp_path) == "fresh"


@pytest.mark.parametrize("entry", ["config.yaml", "metrics.jsonl", "checkpoints/step_00000001", "hf", ".hf.tmp-12"])
def test_previous_run_without_resume_or_overwrite_is_refused(tmp_path, entry):
    (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / entry).write_text("x")
    with pytest.raises(UserError) as e:
        decide(_cfg("sft", tmp_path), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and f"output_dir='{tmp_path}' holds a previous run" in msg, msg
    assert entry.split("/")[0] in msg
    for fix in ("another output_dir", "resume=true", "overwrite=true"):
        assert fix in msg, msg


def test_overwrite_and_resume_decisions(tmp_path):
    _previous_run(tmp_path, "sft")
    assert decide(_cfg("sft", tmp_path, "overwrite=true"), tmp_path) == "overwrite"
    assert decide(_cfg("sft", tmp_path, "resume=true"), tmp_path) == "resume"
    with pytest.raises(ConfigError, match="resume=true and overwrite=true contradict"):
        decide(_cfg("sft", tmp_path, "resume=true", "overwrite=true"), tmp_path)


@pytest.mark.parametrize("stage,extra", [("rm", []), ("ppo", ["actor.init=", "reward.init=", "critic.init="])])
def test_resume_into_another_stages_run_is_refused(tmp_path, stage, extra):
    _previous_run(tmp_path, "sft")
    with pytest.raises(UserError) as e:
        decide(_cfg(stage, tmp_path, "resume=true", *extra), tmp_path)
    assert "holds a run of stage sft" in str(e.value) and "trainer_state.json" in str(e.value), e.value
    assert f"not {stage}" in str(e.value)


def test_resume_stage_falls_back_to_config_yaml(tmp_path):
    (tmp_path / "config.yaml").write_text("stage: ppo\n")  # a PPO run killed before its first checkpoint
    with pytest.raises(UserError, match=r"holds a run of stage ppo \(.*config.yaml\), not sft"):
        decide(_cfg("sft", tmp_path, "resume=true"), tmp_path)


def test_overwrite_refuses_to_delete_an_input(tmp_path):
    _previous_run(tmp_path / "run", "sft")
    data = tmp_path / "run" / "task" / "pairs.jsonl"  # e.g. the previous run's generated data
    cfg = _cfg("rm", tmp_path / "run", "overwrite=true", f"data.train_path={data}")
    with pytest.raises(UserError, match="overwrite=true would delete data.train_path="):
        decide(cfg, tmp_path / "run")
    with pytest.raises(UserError, match="overwrite=true would delete reward.init="):  # a stage's own init (rm default)
        decide(_cfg("rm", tmp_path / "run", "overwrite=true"), tmp_path / "run", {"reward.init": str(tmp_path / "run")})


def test_overwrite_deletes_only_the_previous_runs_outputs(tmp_path, caplog):
    _previous_run(tmp_path, "sft")
    (tmp_path / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="aligner"), claim_output_dir(_cfg("sft", tmp_path, "overwrite=true")) as mode:
        assert mode == "overwrite"
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, "notes.txt"]
    assert "overwrite=true: deleting the previous run's outputs" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "the lock file is removed on release"


def test_refused_run_changes_nothing(tmp_path):
    _previous_run(tmp_path, "sft")
    before = _snapshot(tmp_path)
    with pytest.raises(UserError):
        with claim_output_dir(_cfg("sft", tmp_path)):
            pytest.fail("a refused run must not get here")
    assert _snapshot(tmp_path) == before and not (tmp_path / LOCK_NAME).exists()


def test_empty_output_dir_is_a_config_error():
    with pytest.raises(ConfigError, match="output_dir='' is invalid: .*current directory"):
        load_config("sft", ["output_dir="])


# ---- the directory itself -------------------------------------------------------------------
def test_output_dir_that_is_a_file_or_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match=f"output_dir='{f}' is a file, not a directory"):
        make_output_dir(f)
    with pytest.raises(UserError, match=f"output_dir='{f / 'a' / 'b'}' lies under the file '{f}'"):
        make_output_dir(f / "a" / "b")
    assert f.read_text() == "x"


def test_read_only_output_dir(tmp_path):
    ro = Path("/sys/kernel")  # read-only even for root (chmod does not stop root)
    try:
        os.close(os.open(ro / LOCK_NAME, os.O_RDWR | os.O_CREAT))
        pytest.skip("/sys/kernel is writable here")
    except PermissionError:
        pass
    except OSError:
        pytest.skip("no /sys/kernel")
    with pytest.raises(UserError, match="output_dir='/sys/kernel' is not writable"):
        with claim_output_dir(_cfg("sft", ro)):
            pass


# ---- the lock -------------------------------------------------------------------------------
HOLDER = """
import sys, time
from pathlib import Path
from aligner.run_ops.run_dir import RunLock
RunLock.acquire(Path(sys.argv[1]), "sft")
print("READY", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process in another process group holding the lock of tmp_path/out."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        yield out, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_lock_held_by_a_live_process_is_refused_naming_pid_and_host(holder):
    out, proc = holder
    with pytest.raises(UserError) as e:
        RunLock.acquire(out)
    msg = str(e.value)
    assert f"output_dir='{out}' is in use by pid {proc.pid} on host {socket.gethostname()} (started " in msg, msg
    assert msg.endswith("wait for it or use another output_dir") and "\n" not in msg
    with pytest.raises(UserError, match=f"pid {proc.pid}"):  # the whole claim, before any decision
        with claim_output_dir(_cfg("sft", out)):
            pass


def test_lock_of_a_killed_process_does_not_block(holder):
    out, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stale = out / LOCK_NAME
    assert json.loads(stale.read_text())["pid"] == proc.pid, "the killed holder leaves its file behind"
    lock = RunLock.acquire(out)
    assert json.loads(stale.read_text())["pid"] == os.getpid()
    lock.release()
    assert not stale.exists()


def test_lock_is_released_when_the_run_raises(tmp_path):
    with pytest.raises(RuntimeError):
        with claim_output_dir(_cfg("sft", tmp_path)):
            raise RuntimeError("training failed")
    RunLock.acquire(tmp_path).release()


# ---- pruning by this run's own history --------------------------------------------------------
def _other_run_ckpt(out: Path, step: int, run_id: str | None = "other") -> Path:
    ck = out / "checkpoints" / CheckpointManager.name(step)
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text(json.dumps({"step": step, **({"run_id": run_id} if run_id else {})}))
    (ck / "COMPLETE").write_text(str(step))
    return ck


def _save(mgr: CheckpointManager, step: int) -> Path:
    return mgr.commit(mgr.begin(step), step, {"step": step})


def test_pruning_leaves_other_runs_higher_steps_alone(tmp_path):
    _other_run_ckpt(tmp_path, 50)
    _other_run_ckpt(tmp_path, 100, run_id=None)  # a checkpoint from before run ids
    mgr = CheckpointManager(tmp_path, keep=2, stage="sft")
    for step in (2, 4, 6):
        _save(mgr, step)
    names = sorted(p.name for p in mgr.root.glob("step_*"))
    assert names == ["step_00000004", "step_00000006", "step_00000050", "step_00000100"], names
    assert mgr.latest().name == "step_00000006"
    state = json.loads((mgr.root / "step_00000006" / "trainer_state.json").read_text())
    assert state["run_id"] == mgr.run_id and state["stage"] == "sft"


def test_a_resumed_run_prunes_the_run_it_continues(tmp_path):
    first = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2):
        _save(first, step)
    _other_run_ckpt(tmp_path, 9)
    resumed = CheckpointManager(tmp_path, keep=2)
    resumed.adopt(resumed.root / "step_00000002")
    assert resumed.run_id == first.run_id
    for step in (3, 4):
        _save(resumed, step)
    assert sorted(p.name for p in resumed.root.glob("step_*")) == ["step_00000003", "step_00000004", "step_00000009"]


# ---- metrics.jsonl with a cut last line --------------------------------------------------------
def test_cut_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert f"{path}:3: dropped the last line, cut short" in caplog.text
    repair_metrics(path)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    logger = MetricsLogger(tmp_path, "sft", 4, start_step=2, progress=False)  # what a resumed run does
    logger.log(3, {"loss": 1.0})
    logger.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_resumed_logger_survives_a_cut_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss"')
    MetricsLogger(tmp_path, "sft", 4, start_step=1, progress=False).close()  # raised JSONDecodeError before
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]


def test_a_bad_line_before_the_last_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON object"):
        read_metrics(path)
    _previous_run(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n[1]\n{"step": 3}\n')
    with pytest.raises(UserError, match=r"resume=true: .*metrics.jsonl:2: not a JSON object"):
        with claim_output_dir(_cfg("sft", tmp_path / "run", "resume=true")):
            pass


def _run_with_saved_config(out: Path, *overrides: str) -> Path:
    """A previous SFT run whose config.yaml is the real composed config of `overrides`."""
    from aligner.config import config_yaml

    _previous_run(out)
    (out / "config.yaml").write_text(config_yaml(_cfg("sft", out, *overrides)))
    return out


def test_resume_with_a_changed_model_dimension_is_refused_naming_both_values(tmp_path):
    out = _run_with_saved_config(tmp_path / "run")
    before = _snapshot(out)
    with pytest.raises(UserError) as e:
        decide(_cfg("sft", out, "resume=true", "model.hidden_size=256", "model.num_heads=8"), out)
    msg = str(e.value)
    assert "model.hidden_size=256 differs from the run in output_dir" in msg and "config.yaml: 128" in msg, msg
    assert _snapshot(out) == before  # the saved config.yaml is not replaced by the failing one


def test_resume_with_another_max_steps_says_the_schedule_is_reshaped(tmp_path, caplog):
    out = _run_with_saved_config(tmp_path / "run", "trainer.max_steps=100")
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert decide(_cfg("sft", out, "resume=true", "trainer.max_steps=300"), out) == "resume"
    assert "trainer.max_steps changed from 100 to 300" in caplog.text and "reshaped" in caplog.text


def test_ppo_resume_without_a_checkpoint_says_it_starts_from_step_0(tmp_path, caplog):
    """As SFT/RM do: resume=true into a dir with no complete checkpoint is logged, not silent."""
    from aligner.trainers.loop import train
    from aligner.trainers.ppo import PPOTrainer

    class FakePPO(PPOTrainer):  # PPOTrainer on the loop, its worker calls faked (no Ray)
        def evaluate(self, num_prompts=None):
            return {"eval_accuracy": 0.5}

        def run_step(self):
            return {"score_mean": 1.0}

        def save_roles(self, tmp):
            pass

    cfg = _cfg("ppo", tmp_path / "run", "resume=true", "trainer.max_steps=1", "trainer.progress=false")
    prompts = [{"prompt_ids": [1, 2], "prompt": "1+1="}]
    with caplog.at_level(logging.INFO, logger="aligner"):
        train(FakePPO(cfg, None, prompts, prompts))
    assert "ppo: resume=true but" in caplog.text and "holds no complete checkpoint: starting from step 0" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1]
