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

    python benchmarks/grpo_step.py            # 16 prompts x 4 samples x 64 new tokens, 5 repeats
    python benchmarks/grpo_step.py --quick    # 16 prompts x 2 samples x 16 new tokens, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

TRL_VENV = C.BENCH / ".venv-trl"
TRL_PKGS = ["torch==2.13.0", "trl"]


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
    ap.add_argument("--peer-malloc", action="store_true", help="run the peer with the glibc malloc setting of aligner's CPU workers")
    ap.add_argument("--peer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--paths", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
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
    reward = AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1, dtype=torch.float32)
    prompts = C.make_prompts(args.prompts * 64, args.prompt_len, policy.config.vocab_size)
    ds = Dataset.from_dict({"prompt": [p["prompt"] for p in prompts]})
    n = args.prompts * args.samples
    cfg = GRPOConfig(
        output_dir="/tmp/trl_grpo_bench",
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=args.samples,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
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
        reward_processing_classes=tok,
        callbacks=[Pause()],
    )
    trainer.train()


# ---- aligner side ------------------------------------------------------------------------------
def build_aligner(args: argparse.Namespace, paths: dict, mc, scheduler: str = "continuous"):
    from aligner.data.tokenizer import load_tokenizer

    tok = load_tokenizer(paths["tokenizer"])
    cfg = C.ppo_config(
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
    prompts = C.make_prompts(args.prompts * 64, args.prompt_len, mc.vocab_size)
    return C.inprocess_trainer(cfg, tok, prompts)


def main() -> None:
    args = parse()
    if args.peer == "trl":
        return trl_child(args)
    C.as_cpu_worker()
    mc = C.tiny_model_cfg(max_seq_len=max(256, args.prompt_len + args.new_tokens))
    paths = C.make_checkpoints(args.fixtures, mc)
    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(
        f"work: {args.prompts} prompts x {args.samples} samples, {args.prompt_len} prompt tokens, {args.new_tokens} new tokens, "
        f"1 epoch, 1 mini-batch of {args.prompts * args.samples}, {args.repeats} repeats after 1 warm-up step each",
        flush=True,
    )
    if args.schedulers:
        return compare_schedulers(args, paths, mc)
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
            ],
            env=C.peer_env(args.peer_malloc),
        )
        print(f"peer: trl {peer.ready.get('trl')}, transformers {peer.ready.get('transformers')}", flush=True)
        peer.first()  # warm-up
    C.alternate_and_compare(trainer, peer, args.repeats, "GRPO", "GRPOTrainer")


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
