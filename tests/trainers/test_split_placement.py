"""The split rollout placement and bounded staleness, end to end on CPU.

The rollout engines run in their own Ray worker group and receive the actor's weights by broadcast
(aligner.rollout.weight_sync.broadcast); with trainer.max_staleness = k they generate up to k batches ahead of
the update (aligner.trainers.producer). Checked here: k = 0 gives the colocated run's tokens and
losses; engines of tp = 2 or pp = 2 ranks hold the trainer's weights after every sync; k = 1 trains on batches exactly one step stale, through the decoupled loss, reproducibly
from its seed; a resumed k = 1 run trains on the same prompts; with rollout.interruptible (part 4) a sync
lands between the decode steps of a batch in flight and the staleness is counted per token; bad settings
stop before Ray starts.
"""

from __future__ import annotations

import json

import pytest

from aligner.ppo import main as ppo_main
from aligner.tracking import read_metrics
from tests.toolkit.overrides import PPO_RULE

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.e2e, pytest.mark.usefixtures("ray_cluster")]

BASE = PPO_RULE + [
    "trainer.rollout_batch_size=16",
    "trainer.mini_batch_size=8",  # two optimizer steps a PPO step: the proximal policy moves within a step
    "trainer.micro_batch_size=8",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "trainer.max_steps=3",
    "trainer.save_every=1",
    "task.num_eval=16",
    "task.num_rl=200",
]
SPLIT = ["rollout.placement=split"]
# keys that differ between placements by construction: wall times, the engines' version counters,
# the refit/sync bytes (the split placement sends only when the engines are behind) and the split-only metrics
NOT_COMPARED = ("time/", "ranks/", "weight_version", "refit_bytes", "staleness", "sync_seconds")


def run(out, *extra) -> list[dict]:
    assert ppo_main([*BASE, f"output_dir={out}", *extra]) == 0
    return [m for m in read_metrics(out / "metrics.jsonl") if m["step"] > 0]


def _saved_data(out, step: int) -> dict:
    """The prompt iterator's position in the run's checkpoint of `step`."""
    return json.loads((out / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text())["data"]


def comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(NOT_COMPARED)}


def test_split_k0_equals_colocated_and_k1_trains_one_step_stale(tmp_path):
    """k = 0 on the split placement: every metric of every step (scores, losses, KL, clip fractions,
    the engine-vs-trainer log-prob mismatch) equals the colocated run's within 1e-6 in fp32.
    k = 1: the first batch is fresh, every later one exactly one step stale; the decoupled loss is
    on (its behaviour weights logged) and a second run from the same seed, with the reference's
    log-probs computed in the inference phase instead of ahead (trainer.ref_ahead), gives the same metrics."""
    colocated = run(tmp_path / "colocated")
    split = run(tmp_path / "split", *SPLIT)
    assert len(split) == len(colocated) == 3
    for a, b in zip(split, colocated):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-6, rel=1e-6), (a["step"], k)
    assert [m["staleness"] for m in split] == [0.0, 0.0, 0.0]
    # the evaluation before training synced version 0, so step 1 sends nothing; each later step sends
    assert [m["refit_bytes"] > 0 for m in split] == [False, True, True]

    k1 = run(tmp_path / "k1", *SPLIT, "trainer.max_staleness=1")
    assert [m["staleness"] for m in k1] == [0.0, 1.0, 1.0]
    assert all("behavior_weight_mean" in m for m in k1)
    # one step of lag: the behaviour policy is the previous update's, so the weights move off 1
    assert k1[0]["behavior_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert k1[1]["behavior_approx_kl"] > k1[0]["behavior_approx_kl"]
    # step 1's batch is the same in both runs (generated from the initial weights); later ones differ
    assert k1[0]["score_mean"] == pytest.approx(split[0]["score_mean"], abs=1e-6)
    # step 2's checkpoint keeps the data position before the batch still in flight (step 3's prompts
    # were drawn during step 2), so a run resumed there trains on the prompts the uninterrupted one does
    assert _saved_data(tmp_path / "k1", 2) == _saved_data(tmp_path / "split", 2)
    # trainer.ref_ahead (on here: the reference has a node group of its own) sends a queued batch to the
    # reference beside the update; off, its log-probs come in the next step's inference phase: the same run
    assert "ref_ahead: true" in (tmp_path / "k1" / "config.yaml").read_text()
    again = run(tmp_path / "k1_again", *SPLIT, "trainer.max_staleness=1", "trainer.ref_ahead=false")
    for a, b in zip(again, k1):
        a, b = comparable(a), comparable(b)
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-6, rel=1e-6), (a["step"], k)


@pytest.mark.parametrize("layout", ["tp_size=2", "pp_size=2"])
def test_split_engines_with_tp_or_pp_hold_the_trainers_weights(tmp_path, layout):
    """rollout.parallel tp = 2 or pp = 2 on the split placement: every engine rank receives the full tensors
    of each weight sync and keeps its tp shard of its stage's layers. At k = 0 the engine's log-probs of
    every step's samples equal the trainer's recomputed ones within 1e-4 (fp32): after the first update
    that holds only if each sync reached every rank's shard (the engines start from the seeded init)."""
    steps = run(tmp_path / "split", *SPLIT, f"rollout.parallel.{layout}")
    assert len(steps) == 3
    assert all(m["refit_bytes"] > 0 for m in steps[1:])
    for m in steps:
        assert m["log_probs_abs_diff_max"] < 1e-4, (m["step"], m["log_probs_abs_diff_max"])
        assert m["ratio_out_of_range_frac"] == 0.0


def test_split_k2_interruptible_lands_syncs_mid_generation(tmp_path):
    """rollout.interruptible with k = 2: from step 2 on, each step's sync (for the batch
    two steps ahead) is issued while the next step's batch generates and lands between its decode steps.
    The run completes and logs the per-token staleness (mean, max) and the fraction of samples spanning two
    versions; a batch in flight at a sync holds samples whose tokens come from two versions, and no token
    is more than k = 2 steps stale."""
    # one KV-cache slot and 32-token responses: a batch's 8 responses decode one after another, ~256 decode
    # steps, so generating a batch takes about as long as an update of 8 samples and a sync finds one in flight
    slow = ["rollout.max_batch_size=1", "rollout.sampling.max_new_tokens=32", "trainer.rollout_batch_size=8"]
    slow += ["trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "trainer.max_steps=5", "task.num_eval=4"]
    steps = run(tmp_path / "k2", *SPLIT, *slow, "trainer.max_staleness=2", "rollout.interruptible=true")
    assert len(steps) == 5
    for m in steps:
        assert {"staleness", "staleness_max", "mixed_version_frac"} <= m.keys()
        assert 0.0 <= m["staleness"] <= m["staleness_max"] <= 2.0
    # steps 1-2 were generated from the first sync alone; steps 3 and 4 were in flight at the next syncs
    assert [m["mixed_version_frac"] for m in steps[:2]] == [0.0, 0.0]
    mixed = [m for m in steps[2:4] if m["mixed_version_frac"] > 0]
    assert mixed, [(m["step"], m["staleness"], m["mixed_version_frac"]) for m in steps]
    for m in mixed:  # its old tokens are 2 steps stale, its new ones 1
        assert 1.0 < m["staleness"] < 2.0 == m["staleness_max"]


def test_bad_split_settings_exit_2_before_ray(tmp_path, capsys):
    """max_staleness without the split placement, a negative one, interruptible tp > 1 split engines, and interruptible
    generation without the split placement, with the static scheduler or with k = 0: one line, exit 2."""
    cases = [
        (["trainer.max_staleness=1"], "trainer.max_staleness=1 is invalid: generation runs ahead"),
        ([*SPLIT, "trainer.max_staleness=-1"], "trainer.max_staleness=-1 is invalid: must be >= 0"),
        ([*SPLIT, "trainer.ref_ahead=true"], "trainer.ref_ahead=True is invalid: the reference's log-probs go ahead only"),
        (
            [*SPLIT, "rollout.parallel.tp_size=2", "trainer.max_staleness=1", "rollout.interruptible=true"],
            "interruptible generation swaps weights on engines of one rank",
        ),
        ([*SPLIT, "rollout.placement=sideways"], "rollout.placement='sideways' is invalid"),
        (["rollout.interruptible=true"], "rollout.interruptible=True is invalid: a sync lands mid-generation only on the split"),
        (
            [*SPLIT, "trainer.max_staleness=1", "rollout.interruptible=true", "rollout.scheduler=static"],
            "rollout.interruptible=True is invalid: weights are swapped between the continuous scheduler's decode steps",
        ),
        ([*SPLIT, "rollout.interruptible=true"], "rollout.interruptible=True is invalid: with trainer.max_staleness=0 no generation"),
    ]
    for extra, want in cases:
        assert ppo_main([*BASE, f"output_dir={tmp_path / 'bad'}", *extra]) == 2
        err = capsys.readouterr().err
        assert want in err, err
    assert not (tmp_path / "bad").exists()
