"""Benchmark: one GRPO step of aligner vs TRL's GRPOTrainer (current trl), alternating in one run.

What is measured: wall time of one GRPO step (generate G samples per prompt, old log-probs
and reward-model scores, group-normalized advantages, one optimizer step of the policy),
on CPU, with both processes alive at once:

- aligner: :class:`aligner.trainers.ppo.PPOTrainer` with ``algorithm.advantage=grpo``, kl_coef 0
  (no reference), no critic, driven in-process through benchmarks/common.py ``InProcessGroup``
  (the real worker classes, no Ray); its per-phase times are reported.
- TRL: ``trl.GRPOTrainer`` (newest trl) in benchmarks/.venv-trl, created with
  ``pip install torch==2.13.0 trl`` when missing. A TrainerCallback pauses it after every
  optimizer step (``on_step_end``) and reports the wall time since the previous one.

The driver alternates aligner step, TRL step, ... (after one warm-up step each) and prints
medians and the ratio aligner / TRL.

Same work: the same tiny Llama (hidden 256, 4 layers, 8 heads, vocab 32000) from one HF dir,
a reward model of the same dims (HF LlamaForSequenceClassification dir, random init), the
same word-level tokenizer, 16 prompts of 32 tokens x G samples (default 4), 64 new tokens at
temperature 1 forced to the full length (aligner: no stop token; TRL: min_new_tokens), fp32,
one optimizer step over all samples (TRL: per_device_train_batch_size = 16 G,
steps_per_generation 1, num_iterations 1), beta / kl_coef 0, AdamW lr 1e-5.

Differences that remain (stated, not hidden):
- TRL skips the old-log-prob forward when num_iterations = 1 (it uses the detached current
  log-probs); aligner always recomputes old_log_probs in the inference phase (one extra
  forward of 16 G sequences).
- Loss normalization: TRL's default loss_type; aligner's token-mean clipped loss. Same FLOPs.
- TRL's step time includes its metric logging after the previous ``on_step_end``.

``--real``: the same comparison on a real pretrained model with real prompts (issue "Real
models"): SmolLM2-135M-Instruct converted from its PyPI GGUF (benchmarks/common.py
``smollm2_dir``), GSM8K train questions with conf=smollm2_135m's answer-format instruction
through the model's chat template (TRL applies the template itself to conversational prompts;
aligner's prompt ids come from the same template), the verifiable reward of
``reward.rule=gsm8k_format`` on both sides (TRL: a reward function in this file scoring the
same way, since TRL's venv has no aligner), the KL to the initial policy as a k3 loss term with
coefficient 0.04 on both sides (TRL ``beta``, aligner ``algorithm.kl_loss_coef``: both load a
reference model and run its forward), G = 4, responses forced to the full max new tokens,
fp32, torch's default threads on both sides, micro-batches of 4 samples on both sides (one
optimizer step over the 16; with all 16 in one micro-batch the two processes' activations did
not fit 24 GiB together: TRL's reached 12.9 GB before the OOM killer stopped it). Neither side
runs an old-log-prob forward: TRL skips it with num_iterations = 1, aligner with
``algorithm.recompute_old_log_probs=false`` (the same on-policy update: ratio 1). One difference
in work remains: aligner runs each prompt's positions once per group of G samples in the
reference forward and in the update (shared-prompt packing, ``trainer.shared_prompt_pack_len``,
on by default), TRL once per sample.

``--ray`` (with or without ``--real``): no peer; the same aligner step in process and through
Ray (the real PPOTrainer.start: Ray worker groups, CPU threads following the work), alternating,
for the goal "the step through Ray within 1.3x of the in-process step" (issue "Real models",
part 6). Both sides get no EOS, so the work is equal.

    python benchmarks/grpo_step.py            # 16 prompts x 4 samples x 64 new tokens, 5 repeats
    python benchmarks/grpo_step.py --quick    # 16 prompts x 2 samples x 16 new tokens, 2 repeats
    python benchmarks/grpo_step.py --real     # SmolLM2 on GSM8K: 4 prompts x 4 samples x 128 new tokens, 3 repeats
    python benchmarks/grpo_step.py --real --ray
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

TRL_VENV = C.BENCH / ".venv-trl"
TRL_PKGS = ["torch==2.13.0", "trl"]
REAL_KL = 0.04  # --real: TRL GRPOConfig.beta = aligner algorithm.kl_loss_coef (k3 estimator on both sides)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 samples per prompt, 16 new tokens, 2 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4, help="G: samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--fixtures", default="/tmp/aligner_bench_fixtures")
    ap.add_argument("--aligner-only", action="store_true", help="no peer: aligner's phases only")
    ap.add_argument(
        "--schedulers",
        action="store_true",
        help="no peer: aligner's step with the static and the continuous rollout scheduler, alternating",
    )
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct on GSM8K chat prompts, rule reward, KL loss 0.04")
    ap.add_argument("--micro-batch", type=int, default=0, help="samples per forward/backward (0 = all; --real: 4)")
    ap.add_argument("--ray", action="store_true", help="no peer: aligner in process vs aligner through Ray, alternating")
    ap.add_argument("--peer-malloc", action="store_true", help="run the peer with the glibc malloc setting of aligner's CPU workers")
    ap.add_argument("--peer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--paths", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.real and not args.peer:  # the real model's defaults, unless given
        given = set(sys.argv)
        for flag, value in (("--prompts", 4), ("--new-tokens", 128), ("--repeats", 3), ("--prompt-len", 320), ("--micro-batch", 4)):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    if args.quick:
        args.samples, args.new_tokens, args.repeats = 2, 16, 2
    return args


# ---- TRL side (runs in benchmarks/.venv-trl) ------------------------------------------------------
def trl_child(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    paths = json.loads(args.paths)
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    policy = AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32)
    if args.real:
        rows = C.gsm8k_rows(args.prompts * 64)
        ds = Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": r["question"]}] for r in rows], "answer": [r["answer"] for r in rows]}
        )
        reward, beta = trl_gsm8k_format, REAL_KL
    else:
        reward = AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1, dtype=torch.float32)
        prompts = C.make_prompts(args.prompts * 64, args.prompt_len, policy.config.vocab_size)
        ds = Dataset.from_dict({"prompt": [p["prompt"] for p in prompts]})
        beta = 0.0
    n = args.prompts * args.samples
    micro = args.micro_batch or n
    cfg = GRPOConfig(
        output_dir="/tmp/trl_grpo_bench",
        per_device_train_batch_size=micro,  # one generation of n samples, one optimizer step over n // micro micro-batches
        gradient_accumulation_steps=n // micro,
        steps_per_generation=n // micro,
        num_iterations=1,
        num_generations=args.samples,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=beta,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        generation_kwargs={"min_new_tokens": args.new_tokens},
        max_steps=10_000,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=10_000,
        seed=0,
        gradient_checkpointing=False,  # TRL defaults to True; aligner runs without recomputation here
    )

    class Pause(TrainerCallback):
        def on_train_begin(self, *a, **k):
            C.peer_report("@@READY", 0.0, {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__})
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            C.peer_report("@@STEP", time.perf_counter() - self.t0)
            self.t0 = time.perf_counter()

    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        reward_processing_classes=None if args.real else tok,
        callbacks=[Pause()],
    )
    trainer.train()


_FORMAT_LINE = re.compile(r"^####\s*(-?\d[\d,]*(?:\.\d+)?)\.?$")  # as aligner.reward.rules.gsm8k_formatted


def trl_gsm8k_format(completions, answer, **kwargs) -> list[float]:
    """TRL reward function scoring as aligner's ``reward.rule=gsm8k_format``: 0.5 for a last
    non-empty line ``#### <number>``, +0.5 when the number equals the reference answer."""
    out = []
    for c, ref in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        m = _FORMAT_LINE.match(lines[-1]) if lines else None
        if m is None:
            out.append(0.0)
            continue
        try:
            right = float(m.group(1).replace(",", "")) == float(ref)
        except ValueError:
            right = False
        out.append(0.5 + 0.5 * right)
    return out


# ---- aligner side ------------------------------------------------------------------------------
def grpo_config(args: argparse.Namespace, paths: dict, mc, scheduler: str = "continuous"):
    """The benchmark step's AlignerConfig: GRPO, --prompts x --samples, --new-tokens, no KL in the reward."""
    return C.ppo_config(
        advantage="grpo",
        prompts=args.prompts,
        n_samples=args.samples,
        new_tokens=args.new_tokens,
        prompt_len=args.prompt_len,
        model_cfg=mc,
        paths=paths,
        kl_coef=0.0,
        scheduler=scheduler,
    )


def build_aligner(args: argparse.Namespace, paths: dict, mc, scheduler: str = "continuous", ray: bool = False):
    from aligner.data.tokenizer import load_tokenizer

    tok = load_tokenizer(paths["tokenizer"])
    cfg = grpo_config(args, paths, mc, scheduler)
    if args.real:
        make_real(cfg, args)
        prompts = real_prompts(tok, args.prompts * 64)
    else:
        prompts = C.make_prompts(args.prompts * 64, args.prompt_len, mc.vocab_size)
    return ray_trainer(cfg, tok, prompts) if ray else C.inprocess_trainer(cfg, tok, prompts)


def make_real(cfg, args: argparse.Namespace) -> None:
    """--real: the step of conf=smollm2_135m's kind (rule reward gsm8k_format, KL as a k3 loss term,
    a reference role) at the benchmark's sizes, in micro-batches of --micro-batch samples."""
    from aligner.config import AlgorithmConfig, RewardRoleConfig

    cfg.reward = RewardRoleConfig(type="rule", rule="gsm8k_format")
    cfg.trainer.micro_batch_size = args.micro_batch or cfg.trainer.micro_batch_size
    cfg.algorithm = AlgorithmConfig(
        advantage="grpo", kl_coef=0.0, kl_loss_coef=REAL_KL, ppo_epochs=1, normalize_rewards=False, recompute_old_log_probs=False
    )


def real_prompts(tok, n: int) -> list[dict]:
    """GSM8K rows through the chat template: [{"prompt", "prompt_ids", "metadata": {"answer"}}]."""
    out = []
    for r in C.gsm8k_rows(n):
        text = tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False)
        out.append({"prompt": text, "prompt_ids": tok(text, add_special_tokens=False)["input_ids"], "metadata": {"answer": r["answer"]}})
    return out


class NoEos:
    """The tokenizer with ``eos_token_id`` None: PPOTrainer.start gives its actor workers no EOS, so
    every response runs to max_new_tokens, as in :func:`benchmarks.common.inprocess_trainer`."""

    eos_token_id = None

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)


def ray_trainer(cfg, tok, prompts: list[dict]):
    """The real PPOTrainer with Ray worker groups (init_ray + start, as ``python -m aligner.ppo``)."""
    from aligner.trainers.ppo import PPOTrainer

    cfg.trainer.num_threads = 0  # the default: CPU threads follow the work
    trainer = PPOTrainer(cfg, NoEos(tok), prompts, prompts)
    trainer.init_ray()
    trainer.start()
    return trainer


def main() -> None:
    args = parse()
    if args.peer == "trl":
        return trl_child(args)
    C.as_cpu_worker()
    if args.real:
        from aligner.model.hf import model_config_from_hf, read_hf_config

        model_dir = str(C.smollm2_dir())
        mc = model_config_from_hf(read_hf_config(model_dir))
        paths = {"policy": model_dir, "tokenizer": model_dir}
    else:
        mc = C.tiny_model_cfg(max_seq_len=max(256, args.prompt_len + args.new_tokens))
        paths = C.make_checkpoints(args.fixtures, mc)
    print(C.env_line())
    print(f"command: {C.command_line()}")
    what = (
        f"SmolLM2-135M-Instruct, GSM8K chat prompts (up to {args.prompt_len} tokens), rule reward gsm8k_format, KL loss {REAL_KL} (k3)"
        if args.real
        else f"tiny random Llama, {args.prompt_len} prompt tokens"
    )
    print(
        f"work: {what}; {args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, "
        f"1 epoch, 1 mini-batch of {args.prompts * args.samples} in micro-batches of {args.micro_batch or args.prompts * args.samples}, "
        f"{args.repeats} repeats after 1 warm-up step each",
        flush=True,
    )
    if args.schedulers:
        return compare_schedulers(args, paths, mc)
    if args.ray:
        return compare_ray(args, paths, mc)
    trainer = build_aligner(args, paths, mc)
    C.timed_step(trainer)  # warm-up
    peer = None
    if not args.aligner_only:
        py = C.ensure_venv(TRL_VENV, TRL_PKGS, "from trl import GRPOTrainer")
        peer = C.PeerProcess(
            py,
            [
                str(Path(__file__).resolve()),
                "--peer",
                "trl",
                "--paths",
                json.dumps(paths),
                "--prompts",
                str(args.prompts),
                "--prompt-len",
                str(args.prompt_len),
                "--new-tokens",
                str(args.new_tokens),
                "--samples",
                str(args.samples),
                "--micro-batch",
                str(args.micro_batch),
                *(["--real"] if args.real else []),
            ],
            env=C.peer_env(args.peer_malloc),
        )
        print(f"peer: trl {peer.ready.get('trl')}, transformers {peer.ready.get('transformers')}", flush=True)
        peer.first()  # warm-up
    C.alternate_and_compare(trainer, peer, args.repeats, "GRPO", "GRPOTrainer")


def compare_ray(args: argparse.Namespace, paths: dict, mc) -> None:
    """The same step in process and through Ray (worker groups, threads following the work),
    alternating after one warm-up step each: step and phase medians, and the ratio Ray / in-process."""
    sides = {"in-process": build_aligner(args, paths, mc), "ray": build_aligner(args, paths, mc, ray=True)}
    rows: dict[str, list[dict]] = {s: [] for s in sides}
    try:
        for i in range(args.repeats + 1):  # step 0 warms up
            for s, t in sides.items():
                m = C.timed_step(t)
                if i:
                    rows[s].append(m)
                    print(f"  repeat {i - 1}: {s} {m['time/step']:.2f} s", flush=True)
    finally:
        sides["ray"].stop()
        sides["ray"].shutdown_ray()
    for s in sides:
        print(f"{s} step: median {C.median([r['time/step'] for r in rows[s]]):.2f} s; phases (median):\n{C.phase_table(rows[s])}")
    a, b = (C.median([r["time/step"] for r in rows[s]]) for s in sides)
    paired = C.median([y["time/step"] / x["time/step"] for x, y in zip(rows["in-process"], rows["ray"])])
    print(
        f"ratio Ray / in-process: {b / a:.2f}x of medians, {paired:.2f}x paired (goal <= 1.3x: {'met' if max(b / a, paired) <= 1.3 else 'not met'})"
    )


def compare_schedulers(args: argparse.Namespace, paths: dict, mc) -> None:
    """The same GRPO step with rollout.scheduler=static and =continuous, alternating: generate-phase
    and step medians, and the prompt tokens each engine prefilled in its last step."""
    trainers = {s: build_aligner(args, paths, mc, s) for s in ("static", "continuous")}
    rows: dict[str, list[dict]] = {s: [] for s in trainers}
    for i in range(args.repeats + 1):  # step 0 warms up
        for s, t in trainers.items():
            m = C.timed_step(t)
            if i:
                rows[s].append(m)
    for s, t in trainers.items():
        stats = t.groups["actor"].worker.engine.last_stats
        gen, step = C.median([r["time/generate"] for r in rows[s]]), C.median([r["time/step"] for r in rows[s]])
        print(f"{s:>10}: generate {gen:.3f} s, step {step:.3f} s (medians); prompt tokens prefilled {stats['prefilled_tokens']}")
    a, b = (C.median([r["time/generate"] for r in rows[s]]) for s in ("static", "continuous"))
    print(f"generate phase, continuous / static: {b / a:.2f}x")


if __name__ == "__main__":
    main()
