"""The one training loop (aligner.trainers.loop) with a fake in-process trainer: no Ray, no workers.

The fake "model" is one float that every step folds its data batch and a torch.rand draw into,
so its losses depend on the weights, the data position and the RNG state that a checkpoint must
carry. Checked: the order of the phases (plan_only stops before output_dir is claimed; Ray
before the SIGTERM handler before the worker groups; the lock held through finish and stop),
eval / final metrics / checkpoint cadence (eval_every, save_every, last step, eval before
training), what a step writes before its checkpoint, resume from the latest checkpoint (same
losses as the uninterrupted run, metrics rows past the checkpoint redone once, the run id
adopted), and the stop at a step boundary after SIGTERM (saving the step unless it was saved).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from aligner.cli import load_config
from aligner.data.sampler import DataIterator
from aligner.errors import Preempted, UserError, WorkerDiedError
from aligner.run_ops import preemption
from aligner.run_ops.run_dir import LOCK_NAME
from aligner.tracking import read_metrics
from aligner.trainers.loop import Trainer


def _cfg(out: Path, *extra: str):
    return load_config("sft", [f"output_dir={out}", "trainer.progress=false", "trainer.preempt_grace_s=120", *extra])


class Toy(Trainer):
    """A Trainer whose phases record themselves in `events`."""

    name = "sft"  # the config's stage: resume checks the stage recorded in the checkpoints
    bar_keys = ("loss",)

    def __init__(
        self,
        cfg,
        eval_before: bool = False,
        sigterm_at: int = -1,
        fail_at: int = -1,
        die_at: tuple[int, ...] = (),
        die_in_start: int = 0,
        die_in_load: int = 0,
    ):
        super().__init__(cfg)
        self.die_in_start, self.die_in_load = die_in_start, die_in_load  # deaths in the next restarts' start / checkpoint read
        self.events: list = []
        self.eval_before_training = eval_before
        self.sigterm_at, self.fail_at = sigterm_at, fail_at
        self.die_at = list(die_at)  # steps whose first run a worker death ends (each once)
        self.weight = 0.0
        self.it = None

    def _locked(self) -> bool:
        return (self.out / LOCK_NAME).exists()

    def check(self):
        self.events.append("check")
        return 0 if self.cfg.plan_only else None

    def write_config(self):
        self.events.append(("config", self._locked()))
        super().write_config()

    def load_inputs(self):
        self.events.append("inputs")
        torch.manual_seed(1234)
        self.it = DataIterator(list(range(10)), seed=self.cfg.data.shuffle_seed)

    def init_ray(self):
        self.events.append(("ray", preemption._STATE is not None))

    def shutdown_ray(self):
        self.events.append("ray_down")

    def start(self):
        self.events.append(("start", preemption._STATE is not None))
        self.weight = 0.0  # fresh workers hold the initial weights
        if self.die_in_start and len(_of(self.events, "start")) > 1:
            self.die_in_start -= 1
            raise WorkerDiedError("critic", 0, "the worker process died or became unreachable: pid 4343 killed", "__init__")

    def stop(self):
        self.events.append(("stop", self._locked()))

    def finish(self):
        self.events.append(("finish", self._locked()))

    def run_step(self):
        step = self.step + 1
        if step == self.fail_at:
            raise RuntimeError(f"boom at step {step}")
        if step in self.die_at:
            self.die_at.remove(step)
            self.weight += 100.0  # the lost step's work, which a restart must not keep
            raise WorkerDiedError("actor", 1, "the worker process died or became unreachable: pid 4242 killed", "ppo_update")
        self.weight = 0.5 * self.weight + sum(self.it.next_batch(3)) + float(torch.rand(()))
        self.events.append(("step", step))
        if step == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"loss": self.weight}

    def evaluate(self):
        self.events.append(("eval", self.step))
        return {"eval_loss": 2 * self.weight}

    def final_metrics(self):
        self.events.append(("final", self.step))
        return {"final_weight": self.weight}

    def save_roles(self, tmp):
        logged = max(r["step"] for r in read_metrics(self.out / "metrics.jsonl"))
        self.events.append(("save", self.step, logged))
        (tmp / "toy").mkdir()
        (tmp / "toy" / "weight.json").write_text(json.dumps(self.weight))

    def load_roles(self, ckpt):
        self.events.append(("load", ckpt.name))
        if self.die_in_load:
            self.die_in_load -= 1
            raise WorkerDiedError("actor", 0, "the worker process died or became unreachable: pid 4444 killed", "load_checkpoint")
        self.weight = json.loads((ckpt / "toy" / "weight.json").read_text())

    def state_dict(self):
        return {"step": self.step, "data": self.it.state_dict()}

    def load_state_dict(self, state):
        self.it.load_state_dict(state["data"])
        self.step = int(state["step"])


def _of(events, kind) -> list:
    return [e[1] for e in events if isinstance(e, tuple) and e[0] == kind]


def _rows(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


def _ckpts(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


# ---- phases --------------------------------------------------------------------------------
def test_phases_run_in_order_with_the_lock_held_to_the_end(tmp_path):
    out = tmp_path / "run"
    toy = Toy(_cfg(out, "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=0"))
    assert toy.run() == 0
    names = [e if isinstance(e, str) else e[0] for e in toy.events]
    assert names == ["check", "inputs", "config", "ray", "start", "step", "step", "eval", "final", "save", "finish", "stop", "ray_down"], (
        names
    )
    ev = dict((e[0], e[1:]) for e in toy.events if isinstance(e, tuple) and e[0] in ("config", "ray", "start", "finish", "stop"))
    assert ev["config"] == (True,), "output_dir is claimed (locked) before config.yaml is written"
    assert ev["ray"] == (False,) and ev["start"] == (True,), "the SIGTERM handler comes after Ray, before the worker groups"
    assert ev["finish"] == (True,) and ev["stop"] == (True,), "the lock is held through finish and stop"
    assert not (out / LOCK_NAME).exists() and preemption._STATE is None
    assert (out / "config.yaml").exists()


def test_plan_only_returns_before_output_dir_is_claimed(tmp_path):
    out = tmp_path / "run"
    toy = Toy(_cfg(out, "plan_only=true"))
    assert toy.run() == 0
    assert toy.events == ["check"] and not out.exists()


def test_a_bad_input_stops_before_ray_and_releases_the_lock(tmp_path):
    out = tmp_path / "run"

    class BadInputs(Toy):
        def load_inputs(self):
            super().load_inputs()
            raise UserError("data.train_path: no rows")

    toy = BadInputs(_cfg(out, "trainer.max_steps=2"))
    with pytest.raises(UserError, match="no rows"):
        toy.run()
    assert [e if isinstance(e, str) else e[0] for e in toy.events] == ["check", "inputs"]  # nothing written: the dir stays fresh
    assert not (out / "config.yaml").exists()
    assert not (out / LOCK_NAME).exists()


def test_a_failing_step_still_stops_the_groups_and_ray(tmp_path):
    out = tmp_path / "run"
    toy = Toy(_cfg(out, "trainer.max_steps=5"), fail_at=2)
    with pytest.raises(RuntimeError, match="boom at step 2"):
        toy.run()
    assert toy.events[-2:] == [("stop", True), "ray_down"] and "finish" not in [e[0] for e in toy.events if isinstance(e, tuple)]
    assert not (out / LOCK_NAME).exists() and preemption._STATE is None
    assert [r["step"] for r in _rows(out)] == [1]


# ---- cadence -------------------------------------------------------------------------------
def test_eval_and_checkpoint_cadence_and_the_last_step(tmp_path):
    out = tmp_path / "run"
    toy = Toy(_cfg(out, "trainer.max_steps=7", "trainer.eval_every=3", "trainer.save_every=2"))
    assert toy.run() == 0
    assert _of(toy.events, "step") == [1, 2, 3, 4, 5, 6, 7]
    assert _of(toy.events, "eval") == [3, 6, 7]
    assert _of(toy.events, "final") == [7]
    saves = [e[1:] for e in toy.events if isinstance(e, tuple) and e[0] == "save"]
    assert saves == [(2, 2), (4, 4), (6, 6), (7, 7)], "a checkpoint every save_every steps and at the last, after its metrics row"
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6, 7]
    assert [r["step"] for r in rows if "final_weight" in r] == [7]
    for r in rows:
        if "eval_loss" in r:
            assert r["eval_loss"] == 2 * r["loss"], "eval runs after the step, on its weights"
    assert [h["step"] for h in toy.history] == [3, 6, 7]
    assert _ckpts(out) == ["step_00000006", "step_00000007"]  # keep=2
    state = json.loads((out / "checkpoints" / "step_00000007" / "trainer_state.json").read_text())
    assert state["stage"] == "sft" and state["step"] == 7 and state["data"]["position"] == (7 * 3) % 10


def test_without_eval_every_and_save_every_only_the_last_step_evaluates_and_saves(tmp_path):
    toy = Toy(_cfg(tmp_path / "run", "trainer.max_steps=4", "trainer.eval_every=0", "trainer.save_every=0"))
    assert toy.run() == 0
    assert _of(toy.events, "eval") == [4] and _of(toy.events, "save") == [4]


def test_eval_before_training_is_step_0_of_a_fresh_run_only(tmp_path):
    out = tmp_path / "run"
    toy = Toy(_cfg(out, "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=1"), eval_before=True)
    assert toy.run() == 0
    assert _of(toy.events, "eval") == [0, 2]
    assert toy.events.index(("eval", 0)) < toy.events.index(("step", 1))
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0] == {"step": 0, "eval_loss": 0.0}
    assert [h["step"] for h in toy.history] == [0, 2]
    again = Toy(_cfg(out, "trainer.max_steps=3", "trainer.eval_every=0", "resume=true"), eval_before=True)
    assert again.run() == 0
    assert _of(again.events, "eval") == [3], "a resumed run does not evaluate before its first step"
    assert [r["step"] for r in _rows(out)] == [0, 1, 2, 3]


# ---- resume --------------------------------------------------------------------------------
def test_resume_continues_from_the_latest_checkpoint_exactly(tmp_path):
    common = ["trainer.max_steps=6", "trainer.eval_every=2", "trainer.save_every=2"]
    full = Toy(_cfg(tmp_path / "full", *common))
    assert full.run() == 0

    cut_dir = tmp_path / "cut"
    cut = Toy(_cfg(cut_dir, *common), fail_at=6)  # step 5 is logged, its checkpoint never written
    with pytest.raises(RuntimeError):
        cut.run()
    assert [r["step"] for r in _rows(cut_dir)] == [1, 2, 3, 4, 5] and _ckpts(cut_dir)[-1] == "step_00000004"
    old_id = json.loads((cut_dir / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())["run_id"]

    resumed = Toy(_cfg(cut_dir, *common, "resume=true"))
    assert resumed.run() == 0
    assert _of(resumed.events, "load") == ["step_00000004"]
    assert _of(resumed.events, "step") == [5, 6] and _of(resumed.events, "eval") == [6]
    rows = _rows(cut_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], "the row of step 5 past the checkpoint is redone once"
    assert rows == _rows(tmp_path / "full"), "weights, data position and RNG come back: the same losses"
    new_id = json.loads((cut_dir / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())["run_id"]
    assert new_id == old_id, "the resumed run continues the checkpoint's run (its checkpoints are its own to prune)"


def test_resume_without_a_checkpoint_starts_from_step_0_and_says_so(tmp_path, caplog):
    out = tmp_path / "run"
    toy = Toy(_cfg(out, "trainer.max_steps=2", "resume=true"))
    with caplog.at_level(logging.INFO, logger="aligner"):
        assert toy.run() == 0
    assert "sft: resume=true but" in caplog.text and "holds no complete checkpoint: starting from step 0" in caplog.text
    assert _of(toy.events, "step") == [1, 2] and _of(toy.events, "load") == []


def test_resume_with_other_data_is_a_user_error_naming_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    assert Toy(_cfg(out, "trainer.max_steps=2")).run() == 0

    class OtherData(Toy):
        def load_inputs(self):
            super().load_inputs()
            self.it = DataIterator(list(range(7)))

    with pytest.raises(UserError, match=r"resume from .*step_00000002: DataIterator: checkpoint was taken over 10 examples"):
        OtherData(_cfg(out, "trainer.max_steps=4", "resume=true")).run()
    assert not (out / LOCK_NAME).exists()


# ---- SIGTERM -------------------------------------------------------------------------------
def test_sigterm_saves_the_step_and_stops_at_its_boundary(tmp_path):
    out = tmp_path / "run"
    toy = Toy(_cfg(out, "trainer.max_steps=100", "trainer.save_every=0", "trainer.eval_every=0"), sigterm_at=3)
    with pytest.raises(Preempted, match=r"stopped by SIGTERM after step 3 .*saved the checkpoint of step 3 in .*resume=true"):
        toy.run()
    assert _of(toy.events, "step") == [1, 2, 3] and _of(toy.events, "save") == [3]
    assert _of(toy.events, "eval") == [] and "finish" not in [e[0] for e in toy.events if isinstance(e, tuple)]
    assert toy.events[-2:] == [("stop", True), "ray_down"]
    assert [r["step"] for r in _rows(out)] == [1, 2, 3] and _ckpts(out) == ["step_00000003"]
    assert not (out / LOCK_NAME).exists() and preemption._STATE is None
    done = Toy(_cfg(out, "trainer.max_steps=5", "trainer.save_every=0", "trainer.eval_every=0", "resume=true"))
    assert done.run() == 0 and _of(done.events, "step") == [4, 5]


def test_sigterm_after_a_saved_step_does_not_save_it_again(tmp_path):
    out = tmp_path / "run"
    toy = Toy(_cfg(out, "trainer.max_steps=100", "trainer.save_every=3", "trainer.eval_every=0"), sigterm_at=3)
    with pytest.raises(Preempted, match=r"after step 3 .*the checkpoint of step 3 in .* is current"):
        toy.run()
    assert _of(toy.events, "save") == [3]


# ---- automatic restarts --------------------------------------------------------------------
RESTART = ["trainer.max_steps=6", "trainer.eval_every=2", "trainer.save_every=2"]


def test_a_worker_death_restarts_the_groups_and_resumes_from_the_latest_checkpoint_exactly(tmp_path, caplog):
    full = Toy(_cfg(tmp_path / "full", *RESTART))
    assert full.run() == 0
    out = tmp_path / "healed"
    toy = Toy(_cfg(out, *RESTART), die_at=(5, 6))  # two deaths: the default budget (2) covers them
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert toy.run() == 0
    assert _of(toy.events, "load") == ["step_00000004", "step_00000004"]
    assert _of(toy.events, "step") == [1, 2, 3, 4, 5, 5, 6]  # step 5 again after each death; 6's first try died
    assert [e[0] for e in toy.events if isinstance(e, tuple) and e[0] in ("start", "stop")] == [
        "start",
        "stop",
        "start",
        "stop",
        "start",
        "stop",
    ]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [r["loss"] for r in _rows(tmp_path / "full")], "the same losses as the run without deaths"
    assert [r.get("restarts") for r in rows] == [None] * 4 + [2.0, 2.0]
    assert "actor rank 1 died during step 5" in caplog.text and "restart 1 of 2" in caplog.text and "pid 4242" in caplog.text


def test_a_death_before_the_first_checkpoint_starts_again_from_step_0s_state(tmp_path):
    full = Toy(_cfg(tmp_path / "full", *RESTART), eval_before=True)
    assert full.run() == 0
    toy = Toy(_cfg(tmp_path / "healed", *RESTART), eval_before=True, die_at=(2,))
    assert toy.run() == 0
    assert _of(toy.events, "load") == [] and _of(toy.events, "step") == [1, 1, 2, 3, 4, 5, 6]
    assert _of(toy.events, "eval") == [0, 2, 4, 6], "the eval before training is not repeated"
    assert [(r["step"], r.get("loss")) for r in _rows(tmp_path / "healed")] == [
        (r["step"], r.get("loss")) for r in _rows(tmp_path / "full")
    ]


@pytest.mark.parametrize("budget,deaths", [(0, (3,)), (1, (3, 5))])
def test_a_death_past_the_restart_budget_ends_the_run_saying_so(tmp_path, budget, deaths):
    toy = Toy(_cfg(tmp_path / "run", *RESTART, f"trainer.max_restarts={budget}"), die_at=deaths)
    with pytest.raises(WorkerDiedError) as err:
        toy.run()
    assert ("every automatic restart was spent" in str(err.value)) == (budget > 0)
    assert toy.events[-2:] == [("stop", True), "ray_down"]


@pytest.mark.parametrize("where", ["start", "load"])
def test_a_death_during_the_restart_is_one_more_restart(tmp_path, caplog, where):
    """A fault while the groups are rebuilt (a worker dies in start) or the checkpoint is read (in load):
    one more restart of the same budget, and the run still ends with the uninterrupted run's losses;
    with the budget spent by it, one line saying so."""
    full = Toy(_cfg(tmp_path / "full", *RESTART))
    assert full.run() == 0
    out = tmp_path / "healed"
    toy = Toy(_cfg(out, *RESTART), die_at=(5,), **{f"die_in_{where}": 1})
    with caplog.at_level(logging.WARNING, logger="aligner"):
        assert toy.run() == 0
    assert [r["loss"] for r in _rows(out)] == [r["loss"] for r in _rows(tmp_path / "full")]
    assert [r.get("restarts") for r in _rows(out)][-2:] == [2.0, 2.0]
    assert "restart 2 of 2" in caplog.text
    if where == "start":
        assert "died during the restart (stopping and starting the worker groups)" in caplog.text, caplog.text
    spent = Toy(_cfg(tmp_path / "spent", *RESTART, "trainer.max_restarts=1"), die_at=(5,), **{f"die_in_{where}": 1})
    with pytest.raises(WorkerDiedError) as err:
        spent.run()
    assert "every automatic restart was spent" in str(err.value)
    assert spent.events[-1] == "ray_down"


def test_restarts_of_one_group_alone_count_in_the_same_budget(tmp_path):
    """A run that already restarted one group alone (trainer.partial_restarts: PPO's split rollout
    group) has that restart counted: with max_restarts=1 the next death ends it, saying so."""
    toy = Toy(_cfg(tmp_path / "run", *RESTART, "trainer.max_restarts=1"), die_at=(3,))
    toy.partial_restarts = 1
    with pytest.raises(WorkerDiedError) as err:
        toy.run()
    assert "every automatic restart was spent" in str(err.value)
    assert _of(toy.events, "load") == [] and _of(toy.events, "step") == [1, 2]  # step 3 died: no restart


def test_no_restart_after_sigterm(tmp_path, monkeypatch):
    monkeypatch.setattr(preemption, "was_requested", lambda: True)
    toy = Toy(_cfg(tmp_path / "run", *RESTART), die_at=(3,))
    with pytest.raises(WorkerDiedError):
        toy.run()
    assert _of(toy.events, "step") == [1, 2]


def test_the_final_log_line_keeps_small_values_such_as_the_learning_rate():
    from aligner.trainers.supervised import shown

    assert shown({"lr": 1e-5, "loss": 0.65183, "stage": "rs", "steps": 3, "eval_n": 64.0}) == {"lr": 1e-5, "loss": 0.6518, "eval_n": 64.0}
