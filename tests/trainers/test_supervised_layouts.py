"""The SFT and RM stages on tp=2, pp=2 (1F1B and interleaved, v=2), dp=2 and cp=2 give the one-worker losses (CPU, gloo, Ray).

Each stage runs in-process (one local Ray instance with a few logical CPUs for the module)
for 3 steps per layout on the built-in task, with gradient accumulation in play
(global batch 16, micro-batches of 4 per dp rank), and the per-step metrics.jsonl losses
(plus the RM's accuracy/margin and the SFT validation loss) must match the
single-worker run within 1e-4. Minimum runs: one reference and five layouts per stage.
"""

from __future__ import annotations

import pytest

from aligner.cli import load_config
from aligner.tracking import read_metrics
from aligner.trainers.rm import RMTrainer
from aligner.trainers.sft import SFTTrainer
from tests.toolkit.assertions import assert_metrics_match

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAYOUTS = {"tp2": (2, 1, 1, 1, 1), "pp2": (1, 2, 1, 1, 1), "pp2 v2": (1, 2, 1, 1, 2), "dp2": (1, 1, 2, 1, 1), "cp2": (1, 1, 1, 2, 1)}
COMMON = [
    "trainer.progress=false",
    "trainer.max_steps=3",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=4",
    "trainer.eval_batch_size=32",
    "task.num_eval=32",
    "task.num_sft=200",
    "task.num_pairs=64",
]
STAGES = {"sft": (SFTTrainer, "actor", ("loss", "eval_loss")), "rm": (RMTrainer, "reward", ("loss", "accuracy", "margin", "eval_loss"))}


def _run(stage: str, out, layout=(1, 1, 1, 1, 1)) -> list[dict]:
    trainer_cls, role, _ = STAGES[stage]
    tp, pp, dp, cp, v = layout
    overrides = COMMON + [
        f"output_dir={out}",
        f"{role}.parallel.tp_size={tp}",
        f"{role}.parallel.pp_size={pp}",
        f"{role}.parallel.dp_size={dp}",
        f"{role}.parallel.cp_size={cp}",
        f"{role}.parallel.virtual_pp_size={v}",
    ]
    assert trainer_cls(load_config(stage, overrides)).run() == 0
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_layouts_match_single_worker(ray_cluster, tmp_path, monkeypatch, stage):
    monkeypatch.chdir(tmp_path)  # the tiny RM's default init (outputs/tiny/sft) must not exist here
    keys = STAGES[stage][2]
    ref = _run(stage, tmp_path / "ref")
    assert [r["step"] for r in ref] == [1, 2, 3]
    assert ref[0]["loss"] != ref[-1]["loss"], "the reference must train (the comparison would be vacuous otherwise)"
    for name, layout in LAYOUTS.items():
        assert_metrics_match(_run(stage, tmp_path / name.replace(" ", "_"), layout), ref, keys, f"{stage} {name}")
