"""The rejection-sampling stage (aligner.rs): selection by hand, bad input refused up front, and the
stage end to end on the built-in task.

- :func:`select_best` and :func:`select_pairs` against selections worked out by hand on fixed scores
  (ties, the threshold, EOS-only, NaN, degenerate samples);
- the SFT rows and the round's batches (loss on response tokens only; every batch full);
- bad input: N < 2, a threshold a rule cannot reach, a missing prompt file, a reward that cannot score
  a row: one line naming the field or file:line, exit 2, no output_dir (nothing ran);
- end to end (slow): a short SFT policy on the built-in task, then rejection sampling with the task's
  rule reward raises held-out greedy accuracy; a round that keeps nothing stops with exit 2 before
  training; a resumed run continues from its checkpoint; the pairs file is a preference dataset the
  DPO stage reads.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from aligner.trainers.rs import round_batches, select_best, select_pairs, sft_rows
from tests.toolkit.stages import run_cli

T, F = True, False


# ---- selection by hand -------------------------------------------------------------------------
def test_select_best_by_hand():
    scores = torch.tensor(
        [
            [0.5, 1.0, 1.0, 0.2],  # tie between 1 and 2: the lower index
            [0.9, 0.3, 0.95, 0.1],  # the best (2) was cut: eos_only falls back to 0 (0.9)
            [0.4, 0.6, 0.7, 0.5],  # best 0.7 < threshold 0.8: nothing kept
            [1.0, 1.0, 0.0, 0.0],  # only cut samples reach the threshold: nothing kept under eos_only
            [float("nan"), 0.85, 0.9, 0.8],  # NaN is never kept; 2 is the best
        ]
    )
    ended = torch.tensor([[T, T, T, T], [T, T, F, T], [T, T, T, T], [F, F, T, T], [T, T, T, T]])
    assert select_best(scores, ended, threshold=0.8, eos_only=True) == [1, 0, -1, -1, 2]
    assert select_best(scores, ended, threshold=0.8, eos_only=False) == [1, 2, -1, 0, 2]
    assert select_best(scores, ended, threshold=0.0, eos_only=True) == [1, 0, 2, 2, 2]
    assert select_best(scores, ended, threshold=0.95, eos_only=False) == [1, 2, -1, 0, -1]  # >= threshold: 0.95 is kept
    assert select_best(scores, ended, threshold=1.01, eos_only=False) == [-1] * 5
    with pytest.raises(ValueError, match="must all be"):
        select_best(scores, ended[:, :3], 0.5, True)
    # a sample that is not eligible (degenerate) is never a candidate: the next best is kept, or nothing
    eligible = torch.tensor([[T, F, T, T], [F, T, T, T], [T, T, T, T], [T, T, F, T], [T, T, F, T]])
    assert select_best(scores, ended, threshold=0.8, eos_only=True, eligible=eligible) == [2, -1, -1, -1, 1]
    with pytest.raises(ValueError, match="must all be"):
        select_best(scores, ended, 0.5, True, eligible[:, :3])


def test_select_pairs_by_hand():
    scores = torch.tensor(
        [
            [1.0, 0.5, 0.0, 1.0],  # chosen 0 (first full pass that ended); rejected 2 (lowest)
            [1.0, 1.0, 1.0, 1.0],  # all pass and end: no rejected -> None
            [0.5, 0.5, 1.0, 0.5],  # rejected: 0.5 three times; the cut one (3) before the ended ones
            [1.0, 0.2, 0.6, 0.9],  # chosen 0; 1, 2 and 3 fail (< 1): the lowest, 1 (0.2), is rejected
            [1.0, 0.0, 0.0, 0.0],  # the only pass (0) was cut: no chosen -> None
            [1.0, 1.0, 0.3, 1.0],  # the lowest score first: the 0.3 that ended (2) before the full-scoring cut one (1)
        ]
    )
    ended = torch.tensor([[T, T, T, T], [T, T, T, T], [T, T, T, F], [T, T, T, T], [F, T, T, T], [T, F, T, T]])
    assert select_pairs(scores, ended, threshold=1.0) == [(0, 2), None, (2, 3), (0, 1), None, (0, 2)]
    # at threshold 0.5 the 0.5s pass: prompt 2's only failure is then its cut sample; prompt 5's the 0.3
    assert select_pairs(scores, ended, threshold=0.5)[2] == (2, 3)
    assert select_pairs(scores, ended, threshold=0.5)[5] == (0, 2)
    # a loop that scores full marks is still the rejected side when nothing else fails
    s = torch.tensor([[1.0, 1.0]])
    assert select_pairs(s, torch.tensor([[T, F]]), threshold=1.0) == [(0, 1)]
    # a degenerate sample is never chosen and is the rejected side before any lower score
    s = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    e = torch.tensor([[T, T, T, T]])
    assert select_pairs(s, e, threshold=1.0, eligible=torch.tensor([[F, T, T, T]])) == [(1, 0)]
    assert select_pairs(s, e, threshold=1.0, eligible=torch.tensor([[T, T, T, F]])) == [(0, 3)]
    assert select_pairs(s, e, threshold=1.0, eligible=torch.tensor([[F, F, T, F]])) == [None]  # nothing left to choose


def test_sft_rows_and_round_batches():
    rows = sft_rows([[5, 6, 7], [8]], [[1, 2, 0], [3]], max_len=5)
    assert rows[0] == {"input_ids": [5, 6, 7, 1, 2], "loss_mask": [0, 0, 0, 1, 1]}  # cut to max_len
    assert rows[1] == {"input_ids": [8, 3], "loss_mask": [0, 1]}
    b = round_batches(10, epochs=1.0, batch_size=4, seed=0)
    assert len(b) == 3 and all(len(x) == 4 for x in b)  # ceil(10 / 4) full batches
    assert set(b[0] + b[1]) | set(b[2]) == set(range(10))  # the first pass covers every row once
    assert len(set(b[0] + b[1] + b[2][:2])) == 10
    assert len(round_batches(3, epochs=1.0, batch_size=8, seed=0)) == 1  # fewer rows than a batch: one batch, rows repeated
    assert len(round_batches(100, epochs=0.5, batch_size=10, seed=0)) == 5
    assert round_batches(10, 1.0, 4, seed=3) == round_batches(10, 1.0, 4, seed=3)
    with pytest.raises(ValueError, match="no rows"):
        round_batches(0, 1.0, 4, 0)


# ---- bad input: one line, exit 2, before any worker --------------------------------------------
def _refused(tmp_path, *args: str, out: str = "out") -> str:
    out = tmp_path / out
    proc, _ = run_cli("aligner.rs", f"output_dir={out}", "trainer.progress=false", *args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("aligner rs: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "worker group" not in proc.stderr and "ready in" not in proc.stderr, "a worker started"
    return lines[0]


def test_bad_config_exits_2(tmp_path):
    assert _refused(tmp_path, "rs.num_samples=1") == (
        "aligner rs: error: rs.num_samples=1 is invalid: must be >= 2: rejection sampling keeps the best of several samples per prompt (e.g. 4 or 8)"
    )
    line = _refused(tmp_path, "rs.threshold=1.5")
    assert line.startswith("aligner rs: error: rs.threshold=1.5 is invalid: no response can be kept: reward.type=rule scores in [0, 1]")
    line = _refused(tmp_path, "data.train_path=nowhere/prompts.jsonl", "data.format=prompt")
    assert line.startswith("aligner rs: error: data.train_path='nowhere/prompts.jsonl' does not exist")
    line = _refused(tmp_path, "rollout.sampling.temperature=0")
    assert "rollout.sampling.temperature=0" in line and "greedy" in line
    assert not (tmp_path / "out").exists()


def test_reward_that_cannot_score_a_row_exits_2(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2="}) + "\n" + json.dumps({"prompt": "3+4="}) + "\n")
    line = _refused(tmp_path, f"data.train_path={prompts}", "data.format=prompt", "reward.rule=gsm8k")
    assert line.startswith(f"aligner rs: error: {prompts}:1: reward.rule=gsm8k cannot score this row"), line
    assert "metadata['answer']" in line
    if_rows = tmp_path / "if.jsonl"
    row = {"prompt": "Say hi.", "instruction_id_list": ["punctuation:no_comma", "nope:unknown"], "kwargs": [{}, {}]}
    if_rows.write_text(
        json.dumps({"prompt": "Say hello.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]})
        + "\n"
        + json.dumps(row)
        + "\n"
    )
    pytest.importorskip("if_verifiable", reason="the IFEval checkers (pip install 'aligner[ifeval]') are not installed")
    line = _refused(tmp_path, f"data.train_path={if_rows}", "data.format=prompt", "reward.rule=ifeval", out="out_if")
    assert f"{if_rows}:2" in line and "nope:unknown" in line, line


# ---- the loop, fast: a random policy and a dense rule ----------------------------------------------
FAST_RS = [
    "conf=tiny",
    "trainer.progress=false",
    "task.num_eval=32",
    "trainer.eval_batch_size=32",
    "task.num_sft=200",
    "reward.rule=digit_fraction",
    "rs.threshold=0.3",
    "rs.eos_only=false",
    "rs.prompts_per_round=64",
    "rs.num_samples=4",
    "trainer.global_batch_size=32",
    "trainer.micro_batch_size=32",
    "actor.optim.lr=3e-3",
    "trainer.max_steps=3",
    "trainer.save_every=1",
    "trainer.eval_every=3",
]


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # 3 rounds and 2 evaluations: more than the suite's 900 s on a loaded machine
def test_rs_rounds_raise_a_dense_reward(tmp_path, ray_cluster, cluster_env):
    """From random weights (an empty working directory: no tiny SFT run to start from), with the
    digit-fraction rule (dense: a random policy already writes some digits) and threshold 0.3: each round
    keeps some prompts, trains on them, and the mean reward of all samples rises from round 1 to 3
    (the policy imitates its own most digit-heavy samples); the pairs file holds every round's pairs."""
    out = tmp_path / "full"
    pairs = tmp_path / "pairs.jsonl"
    proc, secs = run_cli("aligner.rs", *FAST_RS, f"output_dir={out}", f"rs.write_pairs={pairs}", cwd=tmp_path, env=cluster_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from aligner.tracking import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    rounds = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in rounds] == [1, 2, 3] and rows[0]["step"] == 0 and "eval_accuracy" in rows[0]
    for r in rounds:
        assert 0 < r["kept"] <= 64 and r["kept_fraction"] == r["kept"] / 64, r
        assert r["reward_mean_kept"] >= 0.3 and r["reward_mean_kept"] >= r["reward_mean_all"], r
        assert r["sft_steps"] == math.ceil(r["kept"] / 32) and math.isfinite(r["loss"]), r
        assert 0 < r["response_len_all"] <= 8 and 0 <= r["ended_fraction"] <= 1, r
    print(f"rs (random init, digit_fraction): {secs:.0f} s; rounds {rounds}")
    assert rounds[-1]["reward_mean_all"] > rounds[0]["reward_mean_all"] + 0.05, rounds
    assert "eval_accuracy" in rounds[-1] and (out / "hf" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    lines = [json.loads(x) for x in pairs.read_text().splitlines()]
    assert len(lines) == sum(r["pairs"] for r in rounds)
    assert all(x["chosen_reward"] >= 0.3 > x["rejected_reward"] or x["rejected_cut"] for x in lines)


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # three runs through the command line: more than the suite's 900 s on a loaded machine
def test_rs_resume_repeats_the_rounds(tmp_path, ray_cluster, cluster_env):
    """Two rounds in one run, and the same run stopped after its round-1 checkpoint and resumed: the
    resumed run's round 2 samples, scores and keeps what the uninterrupted one did (same seeds, weights,
    data position)."""
    args = [
        *FAST_RS,
        "rs.prompts_per_round=32",
        "trainer.max_steps=2",
        "trainer.eval_every=0",
        "task.num_eval=16",
        "trainer.eval_batch_size=16",
    ]
    from aligner.tracking import read_metrics

    full, cut = tmp_path / "full", tmp_path / "cut"
    proc, _ = run_cli("aligner.rs", *args, f"output_dir={full}", cwd=tmp_path, env=cluster_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = run_cli("aligner.rs", *args, "trainer.max_steps=1", f"output_dir={cut}", cwd=tmp_path, env=cluster_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = run_cli("aligner.rs", *args, f"output_dir={cut}", "resume=true", cwd=tmp_path, env=cluster_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {r["step"]: r for r in read_metrics(full / "metrics.jsonl") if r["step"] >= 1}
    got = {r["step"]: r for r in read_metrics(cut / "metrics.jsonl") if r["step"] >= 1}
    assert sorted(got) == sorted(want) == [1, 2]
    for step in (1, 2):
        for key in ("kept", "reward_mean_all", "reward_mean_kept", "response_len_all", "sft_steps"):
            assert got[step][key] == pytest.approx(want[step][key], abs=1e-6), (key, step, got[step], want[step])


@pytest.mark.e2e
def test_a_round_that_keeps_nothing_stops_before_training(tmp_path, ray_cluster, cluster_env):
    """A threshold no sample reaches in practice (every character a digit, from random weights): the round
    samples and scores, then the run stops with one line naming rs.threshold, exit 2, no checkpoint."""
    out = tmp_path / "none"
    proc, _ = run_cli(
        "aligner.rs",
        *FAST_RS,
        "rs.threshold=1.0",
        "rs.eos_only=true",
        "trainer.max_steps=1",
        "rollout.sampling.max_new_tokens=1",
        f"output_dir={out}",
        cwd=tmp_path,
        env=cluster_env,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("aligner rs: error:")]
    assert len(line) == 1 and line[0].startswith("aligner rs: error: rs.threshold=1 kept no response in round 1: 64 prompts x 4 samples"), (
        line
    )
    assert "nothing was trained on it" in line[0] and "rs.eos_only=false" in line[0], line
    assert not (out / "checkpoints" / "latest").exists()


@pytest.mark.e2e
def test_degenerate_responses_are_never_kept(tmp_path, ray_cluster, cluster_env):
    """rs.reject_degenerate=true with threshold 0 (every score passes) and one new token: every response has
    fewer than 3 words (aligner.reward.degenerate: "no content"), so nothing is kept and the run stops with
    the one line naming the filter, exit 2, no checkpoint."""
    out = tmp_path / "degenerate"
    args = [*FAST_RS, "rs.threshold=0.0", "trainer.max_steps=1", "rollout.sampling.max_new_tokens=1", "rs.eos_only=false"]
    proc, _ = run_cli("aligner.rs", *args, "rs.reject_degenerate=true", f"output_dir={out}", cwd=tmp_path, env=cluster_env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("aligner rs: error:")]
    assert len(line) == 1 and line[0].startswith("aligner rs: error: rs.threshold=0 with rs.reject_degenerate kept no response"), line
    assert line[0].endswith(", or set rs.reject_degenerate=false"), line
    assert not (out / "checkpoints" / "latest").exists()


# ---- end to end on the built-in task -----------------------------------------------------------
SFT = [
    "conf=tiny",
    "trainer.progress=false",
    "trainer.max_steps=700",
    "trainer.save_every=0",
    "trainer.eval_every=0",
    "task.num_sft=8000",
    "task.num_eval=128",
]
RS = [
    "conf=tiny",
    "trainer.progress=false",
    "task.num_eval=128",
    "trainer.eval_batch_size=128",
    "rs.prompts_per_round=128",
    "trainer.max_steps=4",
    "trainer.eval_every=4",
    "trainer.save_every=2",
]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_rs_raises_accuracy_on_the_builtin_task(tmp_path, ray_cluster, cluster_env):
    """A 700-step SFT policy (half-trained: its greedy answers are often wrong), then 4 rounds of
    rejection sampling with the task's checker as the reward: held-out greedy accuracy rises by at
    least 10 points; the pairs file is read by the DPO stage; a resumed run logs the uninterrupted
    run's rounds; a threshold no answer reaches stops after sampling, exit 2, with nothing trained."""
    sft = tmp_path / "sft"
    proc, _ = run_cli("aligner.sft", *SFT, f"output_dir={sft}", cwd=tmp_path, env=cluster_env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "rs"
    pairs = tmp_path / "pairs.jsonl"
    args = [*RS, f"actor.init={sft}", f"rs.write_pairs={pairs}"]
    proc, secs = run_cli("aligner.rs", *args, f"output_dir={out}", cwd=tmp_path, env=cluster_env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from aligner.tracking import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and last["step"] == 4, rows
    rounds = [r for r in rows if r["step"] >= 1]
    for r in rounds:
        assert 0 < r["kept_fraction"] <= 1 and r["reward_mean_kept"] == 1.0, r  # threshold 1 on a 0/1 reward
        assert r["reward_mean_all"] <= r["reward_mean_kept"] and r["response_len_kept"] > 0 and r["sft_steps"] >= 1, r
        assert math.isfinite(r["loss"]), r
    gain = last["eval_accuracy"] - first["eval_accuracy"]
    print(f"rs: held-out accuracy {first['eval_accuracy']:.3f} -> {last['eval_accuracy']:.3f} in {secs:.0f} s; rounds {rounds}")
    assert gain >= 0.10, (first, last)
    assert rounds[-1]["reward_mean_all"] > rounds[0]["reward_mean_all"], rounds
    assert (out / "hf" / "model.safetensors").is_file() and (out / "checkpoints" / "latest").read_text().strip() == "step_00000004"

    # the pairs: as many rows as the rounds logged, every chosen scored 1 and ended, and the DPO stage reads them
    lines = [json.loads(x) for x in pairs.read_text().splitlines()]
    assert len(lines) == sum(r["pairs"] for r in rounds) > 0
    assert all(x["chosen_reward"] == 1.0 and (x["rejected_reward"] < 1.0 or x["rejected_cut"]) for x in lines)
    proc, _ = run_cli(
        "aligner.dpo",
        "conf=tiny",
        "trainer.progress=false",
        f"actor.init={sft}",
        f"data.train_path={pairs}",
        "data.format=pairs",
        "data.eval_fraction=0.1",
        "trainer.max_steps=2",
        "trainer.global_batch_size=16",
        "trainer.micro_batch_size=16",
        f"output_dir={tmp_path / 'dpo'}",
        cwd=tmp_path,
        env=cluster_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "dpo" / "metrics.jsonl")] == [1, 2]
