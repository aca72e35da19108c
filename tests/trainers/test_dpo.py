"""`python -m aligner.dpo conf=tiny` end to end on the built-in task's preference pairs (CPU, Ray).

One run through the command line (4 steps from the seeded random init, in an empty working
directory so the tiny SFT run is not the default init): exit 0, the DPO metrics in
metrics.jsonl (step 1's loss is log 2: the reference is the initial policy), the held-out DPO
metrics and the task accuracy in the last row, a checkpoint, TensorBoard events, the curves
PNG and an HF export. Then the same run interrupted after its step-2 checkpoint and resumed:
its losses, rewards and eval metrics equal the uninterrupted run's (the reference is rebuilt
from the initial weights, not from the checkpoint). The config errors of the dpo section exit 2.
"""

from __future__ import annotations

import math

import pytest

from aligner.cli import load_config
from aligner.tracking import read_metrics
from aligner.trainers.dpo import DPOTrainer, default_init
from tests.toolkit.stages import Interrupted, interrupting, logged, run_cli, run_stage

pytestmark = pytest.mark.e2e

COMMON = [
    "trainer.progress=false",
    "task.num_eval=32",
    "trainer.eval_batch_size=32",
    "task.num_pairs=300",
    "trainer.max_steps=4",
    "trainer.save_every=2",
    "trainer.eval_every=2",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=8",
    "actor.optim.lr=1e-3",
    "actor.optim.warmup_steps=0",
    "dpo.rpo_alpha=0.5",
]
DPO_KEYS = ("loss", "dpo_loss", "nll", "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "logps_chosen")


def test_dpo_config_errors_exit_2(tmp_path):
    proc, _ = run_cli("aligner.dpo", "dpo.loss_type=ipo", "dpo.label_smoothing=0.1", f"output_dir={tmp_path / 'out'}", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (
        "aligner dpo: error: dpo.label_smoothing=0.1 is invalid: applies to dpo.loss_type=sigmoid only "
        "(conservative DPO): set it to 0 with loss_type=ipo"
    )
    assert not (tmp_path / "out").exists()


def test_tiny_dpo_default_init(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, other = load_config("dpo", []), load_config("dpo", ["data.train_path=x.jsonl"])
    assert default_init(cfg) == ""  # no SFT run yet: random init
    (tmp_path / "outputs/tiny/sft/hf").mkdir(parents=True)
    (tmp_path / "outputs/tiny/sft/hf/config.json").write_text("{}")
    assert default_init(cfg) == "outputs/tiny/sft"
    assert default_init(other) == "", "the default is for the built-in task only"


@pytest.mark.slow
def test_tiny_dpo_cli_outputs_and_resume(ray_cluster, cluster_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    full = tmp_path / "full"
    proc, _ = run_cli("aligner.dpo", "conf=tiny", *COMMON, f"output_dir={full}", cwd=tmp_path, env=cluster_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in DPO_KEYS:
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6) and rows[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert abs(rows[-1]["rewards_chosen"]) > 1e-4 and abs(rows[-1]["reward_margin"]) > 1e-4  # the policy left the reference
    last = rows[-1]
    for key in ("eval_loss", "eval_reward_accuracy", "eval_reward_margin", "task_accuracy", "task_n"):
        assert key in last, key
    assert last["task_n"] == 32
    assert (full / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert (full / "hf" / "config.json").is_file() and (full / "hf" / "model.safetensors").is_file()
    assert (full / "hf" / "tokenizer.json").is_file()
    assert (full / "curves.png").is_file() and any((full / "tensorboard").iterdir())

    cut = tmp_path / "cut"
    with pytest.raises(Interrupted, match="2"):
        run_stage(interrupting(DPOTrainer, 2), "dpo", COMMON + [f"output_dir={cut}"])
    assert max(logged(cut)) == 2
    assert run_stage(DPOTrainer, "dpo", COMMON + [f"output_dir={cut}", "resume=true"]) == 0
    for key in DPO_KEYS + ("grad_norm", "eval_loss", "eval_reward_margin"):
        a, b = logged(full, key), logged(cut, key)
        assert sorted(a) == sorted(b) and len(a) >= 2, (key, a, b)
        assert a == pytest.approx(b, abs=1e-6), f"{key}: resumed run differs from the uninterrupted one: {a} vs {b}"
