"""Benchmark: one PPO step of aligner vs TRL's PPOTrainer (trl 1.12.0, the last release with PPO), alternating.

What is measured: wall time of one full PPO step (generate, inference forwards, advantages,
one optimizer step of policy and value model), on CPU, in two processes alive at once:

- aligner: :class:`aligner.trainers.ppo.PPOTrainer` driven in-process (benchmarks/common.py
  ``InProcessGroup``: the real ActorWorker / PolicyWorker / CriticWorker / RewardWorker, no
  Ray), so the phases are the trainer's own; its per-phase times are reported.
- TRL: ``trl.experimental.ppo.PPOTrainer`` in benchmarks/.venv-trl112 (created with
  ``pip install torch==2.13.0 trl==1.12.0`` when missing). A TrainerCallback pauses it after
  every optimizer step (``on_step_end``) and reports the wall time since the previous one.

The driver alternates aligner step, TRL step, aligner step, ... (after one warm-up step each)
and prints medians over repeats and the ratio aligner / TRL.

Same work on both sides: the same tiny Llama (hidden 256, 4 layers, 8 heads, vocab 32000)
loaded from the same HF dir, a reward and value model of the same dims (one HF
LlamaForSequenceClassification dir, random init), the same word-level tokenizer, 16 prompts
of 32 tokens, 64 new tokens sampled at temperature 1 with no stop token (both generate the
full length), fp32, 1 PPO epoch, one mini-batch of 16, kl_coef 0.05, AdamW lr 1e-5.

Differences that remain (stated, not hidden):
- TRL trains policy and value head through one wrapper and one optimizer; aligner has two
  engines and two optimizers (as a distributed system has).
- TRL computes rewards with its ``get_reward`` on the last non-pad token; aligner's reward
  worker does the same with its own score head. Both random-init, so scores are noise.
- TRL recomputes the per-token log-probs of the rollout in a separate forward after
  generation; aligner recomputes old_log_probs as well (the trainer never trusts the engine's).
- TRL's reported step time includes its metric gathering after ``on_step_end`` of the
  previous step (small: a few reductions of [16, 64] tensors).

    python benchmarks/ppo_step.py            # 16 prompts x 64 new tokens, 5 repeats
    python benchmarks/ppo_step.py --quick    # 16 prompts x 16 new tokens, 2 repeats
    python benchmarks/ppo_step.py --aligner-only   # phases only (GPU suite: the roles use CUDA when it is there)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

TRL_VENV = C.BENCH / ".venv-trl112"
TRL_PKGS = ["torch==2.13.0", "trl==1.12.0"]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 2 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--fixtures", default="/tmp/aligner_bench_fixtures")
    ap.add_argument("--aligner-only", action="store_true", help="no peer: aligner's phases only")
    ap.add_argument("--peer-malloc", action="store_true", help="run the peer with the glibc malloc setting of aligner's CPU workers")
    ap.add_argument("--peer", default="", help=argparse.SUPPRESS)  # child mode: "trl"
    ap.add_argument("--paths", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 16, 2
    return args


# ---- TRL side (runs in benchmarks/.venv-trl112) ------------------------------------------------
def trl_child(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    paths = json.loads(args.paths)
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    policy = AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1, dtype=torch.float32)
    for m in (policy, ref):
        m.generation_config.eos_token_id = None  # no stop token: the full response length, like aligner
    prompts = C.make_prompts(args.prompts * 64, args.prompt_len, policy.config.vocab_size)
    ds = Dataset.from_dict({"input_ids": [p["prompt_ids"] for p in prompts]})
    cfg = PPOConfig(
        output_dir="/tmp/trl_ppo_bench",
        per_device_train_batch_size=args.prompts,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=1,
        local_rollout_forward_batch_size=args.prompts,
        response_length=args.new_tokens,
        temperature=1.0,
        kl_coef=0.05,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        total_episodes=args.prompts * 10_000,
        num_sample_generations=0,
        stop_token=None,
        missing_eos_penalty=None,
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

    trainer = PPOTrainer(
        args=cfg,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=ds,
        callbacks=[Pause()],
    )
    trainer.train()


# ---- aligner side ------------------------------------------------------------------------------
def build_aligner(args: argparse.Namespace, paths: dict, mc):
    from aligner.data.tokenizer import load_tokenizer

    tok = load_tokenizer(paths["tokenizer"])
    cfg = C.ppo_config(prompts=args.prompts, new_tokens=args.new_tokens, prompt_len=args.prompt_len, model_cfg=mc, paths=paths)
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
        f"work: {args.prompts} prompts x {args.prompt_len} prompt tokens, {args.new_tokens} new tokens, "
        f"1 epoch, 1 mini-batch of {args.prompts}, {args.repeats} repeats after 1 warm-up step each",
        flush=True,
    )
    trainer = build_aligner(args, paths, mc)
    C.timed_step(trainer)  # warm-up
    peer = None
    if not args.aligner_only:
        py = C.ensure_venv(TRL_VENV, TRL_PKGS, "import trl.experimental.ppo")
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
            ],
            env=C.peer_env(args.peer_malloc),
        )
        print(f"peer: trl {peer.ready.get('trl')}, transformers {peer.ready.get('transformers')}", flush=True)
        peer.first()  # warm-up
    C.alternate_and_compare(trainer, peer, args.repeats, "PPO", "PPOTrainer")


if __name__ == "__main__":
    main()
