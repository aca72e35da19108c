"""Each of GSPO, CISPO, KTO, SPIN and on-policy distillation: two steps on SmolLM2-135M-Instruct that run and log finite
metrics (CPU, Ray). A smoke check on a real pretrained model (30 layers, a 49k vocabulary, its chat template), not a
learning result.

The converted model dir (config.json, model.safetensors, tokenizer.json; ``python -m aligner.convert``,
docs/real_models.md) is found at $ALIGNER_SMOLLM2_DIR or models/smollm2-135m, the
data (gsm8k/train.jsonl for the RL stages and SPIN, hh-rlhf/harmless-base-test.jsonl for KTO) at $ALIGNER_REAL_DATA
or data/; the test skips, naming what is missing, where either is absent. Distillation's teacher is
the same model (its reverse KL starts at 0: the check is that the teacher role runs on a real model, with
``reward.type=none``, the distillation signal alone). Outputs go to pytest's tmp_path only.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.e2e, pytest.mark.usefixtures("ray_cluster")]

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _first(candidates, ok) -> Path | None:
    for c in candidates:
        if c and ok(Path(c)):
            return Path(c)
    return None


MODEL = _first(
    (os.environ.get("ALIGNER_SMOLLM2_DIR", ""), "models/smollm2-135m"),
    lambda p: all((p / f).is_file() for f in MODEL_FILES),
)
DATA = _first(
    (os.environ.get("ALIGNER_REAL_DATA", ""), "data"),
    lambda p: (p / "gsm8k" / "train.jsonl").is_file() and (p / "hh-rlhf" / "harmless-base-test.jsonl").is_file(),
)
needs_model = pytest.mark.skipif(
    MODEL is None or DATA is None,
    reason="SmolLM2-135M-Instruct (converted: python -m aligner.convert, docs/real_models.md) with "
    + ", ".join(MODEL_FILES)
    + " in $ALIGNER_SMOLLM2_DIR or models/smollm2-135m, and gsm8k/train.jsonl + hh-rlhf/harmless-base-test.jsonl "
    + "in $ALIGNER_REAL_DATA or data/: "
    + ("model missing" if MODEL is None else "data missing"),
)

SHORT = [
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.progress=false",
    "task.num_eval=2",
    "trainer.eval_batch_size=2",
]


def _ppo(extra: list[str]) -> tuple[str, list[str]]:
    rl = [
        f"actor.init={MODEL}",
        f"ref.init={MODEL}",
        f"tokenizer.path={MODEL}",
        f"data.train_path={DATA}/gsm8k/train.jsonl",
        "algorithm.advantage=grpo",
        "trainer.rollout_batch_size=2",
        "trainer.n_samples_per_prompt=2",
        "trainer.mini_batch_size=4",
        "trainer.micro_batch_size=2",
        "rollout.sampling.max_new_tokens=16",
    ]
    return "ppo", rl + extra


RUNS = {  # name: (stage, overrides), each with conf=smollm2_135m
    "gspo": _ppo(
        ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-mean", "algorithm.clip_eps=3e-4", "algorithm.clip_eps_high=4e-4"]
    ),
    "cispo": _ppo(["algorithm.policy_loss=cispo", "algorithm.clip_eps_high=4.0"]),
    "distill": _ppo(
        [f"teacher.init={MODEL}", "algorithm.distill_coef=1.0", "reward.type=none", "reward.init=", "algorithm.kl_loss_coef=0", "ref.init="]
    ),
    "kto": (
        "kto",
        [
            f"actor.init={MODEL}",
            f"tokenizer.path={MODEL}",
            f"data.train_path={DATA}/hh-rlhf/harmless-base-test.jsonl",
            "data.format=hh",
            "data.prompt_suffix=",
            "data.truncation=left",
            "data.max_prompt_len=96",
            "data.max_seq_len=160",
            "data.skip_invalid=true",  # harmless-base-test has rows whose chosen reply is empty (line 87): skipped, counted
            "data.eval_fraction=0.004",  # ~9 held-out pairs: the eval at the end runs the whole split
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2",
            "actor.optim.lr=5e-7",
        ],
    ),
    "spin": (
        "spin",
        [
            f"actor.init={MODEL}",
            f"tokenizer.path={MODEL}",
            f"data.train_path={DATA}/gsm8k/train.jsonl",
            "data.truncation=skip",  # one GSM8K train row (line 311) is over the preset's data.max_seq_len: skipped, counted
            "spin.iterations=2",
            "spin.prompts_per_iteration=4",
            "rollout.sampling.max_new_tokens=16",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2",
            "actor.optim.lr=5e-7",
        ],
    ),
}
KEY = {"gspo": "policy_loss", "cispo": "policy_loss", "distill": "teacher_kl", "kto": "loss", "spin": "loss"}


def _main(stage: str):
    if stage == "ppo":
        from aligner.ppo import main
    elif stage == "kto":
        from aligner.kto import main
    else:
        from aligner.spin import main
    return main


@needs_model
@pytest.mark.parametrize(
    "name",
    list(RUNS),
)
def test_two_steps_on_smollm2_log_finite_metrics(name, tmp_path):
    stage, overrides = RUNS[name]
    out = tmp_path / name
    assert _main(stage)(["conf=smollm2_135m", *SHORT, *overrides, f"output_dir={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("step", 0) > 0 and KEY[name] in r]
    assert [r["step"] for r in steps] == [1, 2], rows
    for r in steps:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (name, r["step"], bad)
    if name == "distill":  # the teacher is the student's own weights: the first step's estimate is 0
        assert steps[0]["teacher_kl"] == pytest.approx(0.0, abs=1e-3) and steps[0]["score_mean"] == 0.0
