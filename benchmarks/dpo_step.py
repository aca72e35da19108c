"""Benchmark: one DPO step of aligner vs TRL's DPOTrainer (trl 1.16), alternating in one run.

What is measured: wall time of one DPO optimizer step (the frozen reference's forward over
the pairs, the policy's forward + backward over chosen and rejected, sigmoid DPO loss, one
AdamW step), on CPU, in two processes alive at once:

- aligner: :class:`aligner.workers.dpo.DPOWorker` in-process (the real worker class, no Ray):
  ``dpo_step`` on a collated batch of pairs, reference log-probs included.
- TRL: ``trl.DPOTrainer`` in the same interpreter's environment (trl is in aligner's ``test``
  extra) or ``--peer-python``; ``ref_model`` given explicitly, ``precompute_ref_log_probs``
  off (the reference runs every step, as in aligner), no gradient checkpointing. A
  TrainerCallback pauses it after every optimizer step (``on_step_end``) and reports the wall
  time since the previous one.

The driver alternates aligner step, TRL step, ... (after one warm-up step each) and prints the
CPU model and ISA, medians and the ratio aligner / TRL (the goal is <= 0.5x).

Same work: the same tiny Llama (hidden 256, 4 layers, 8 heads, vocab 32000) from one HF dir as
policy and reference, the same word-level tokenizer, 16 pairs a step of a 32-token prompt and
32-token chosen / 24-token rejected responses (random words; each response ends with EOS on
both sides: TRL appends it, aligner's pairs carry it), fp32, beta 0.1, AdamW lr 1e-6 constant,
micro-batch = the whole batch.

Differences that remain (stated, not hidden):
- TRL's step time includes its data loading and collation and its metric gathering; aligner's
  batch is collated before the timer starts (the driver collates while workers run).
- TRL's forward returns extra metrics (entropy, mean logits, top-1 accuracy) from its fused
  head; aligner computes only the log-probs.

    OMP_NUM_THREADS=1 python benchmarks/dpo_step.py            # 16 pairs, 5 repeats
    OMP_NUM_THREADS=1 python benchmarks/dpo_step.py --quick    # 8 pairs, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

EOS = 2  # common.SPECIALS


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 pairs, 2 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--chosen-len", type=int, default=32)
    ap.add_argument("--rejected-len", type=int, default=24)
    ap.add_argument("--fixtures", default="/tmp/aligner_bench_fixtures")
    ap.add_argument("--peer-python", default=sys.executable, help="the python that runs TRL (default: this one)")
    ap.add_argument("--peer-malloc", action="store_true", help="run the peer with the glibc malloc setting of aligner's CPU workers")
    ap.add_argument("--peer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--paths", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.repeats = 8, 2
    return args


def make_pairs(args: argparse.Namespace, n: int, vocab_size: int) -> list[tuple[list[int], list[int], list[int]]]:
    """`n` (prompt, chosen, rejected) id lists of random non-special tokens (no EOS)."""
    import torch

    g = torch.Generator().manual_seed(0)

    def ids(k):
        return torch.randint(len(C.SPECIALS), vocab_size, (k,), generator=g).tolist()

    return [(ids(args.prompt_len), ids(args.chosen_len), ids(args.rejected_len)) for _ in range(n)]


# ---- TRL side ------------------------------------------------------------------------------------
def trl_child(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    paths = json.loads(args.paths)
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    policy = AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32)
    words = lambda x: " ".join(f"w{i}" for i in x)  # noqa: E731
    pairs = make_pairs(args, args.pairs * 64, policy.config.vocab_size)
    ds = Dataset.from_dict(
        {
            "prompt": [words(p) for p, _, _ in pairs],
            "chosen": [" " + words(c) for _, c, _ in pairs],
            "rejected": [" " + words(r) for _, _, r in pairs],
        }
    )
    cfg = DPOConfig(
        output_dir="/tmp/trl_dpo_bench",
        per_device_train_batch_size=args.pairs,
        gradient_accumulation_steps=1,
        beta=0.1,
        loss_type=["sigmoid"],
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        max_length=None,
        precompute_ref_log_probs=False,
        max_steps=10_000,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=10_000,
        seed=0,
        gradient_checkpointing=False,  # aligner runs without recomputation here
    )

    class Pause(TrainerCallback):
        def on_train_begin(self, *a, **k):
            info = {
                "trl": __import__("trl").__version__,
                "transformers": __import__("transformers").__version__,
                "threads": torch.get_num_threads(),
            }
            C.peer_report("@@READY", 0.0, info)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            C.peer_report("@@STEP", time.perf_counter() - self.t0)
            self.t0 = time.perf_counter()

    trainer = DPOTrainer(model=policy, ref_model=ref, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Pause()])
    trainer.train()


# ---- aligner side --------------------------------------------------------------------------------
def build_aligner(args: argparse.Namespace, paths: dict, mc):
    from aligner.config import AlignerConfig, DataConfig, DPOConfig, OptimConfig, TrainableRoleConfig, TrainerConfig
    from aligner.workers.dpo import DPOWorker

    seq = args.prompt_len + max(args.chosen_len, args.rejected_len) + 1
    cfg = AlignerConfig(
        stage="dpo",
        model=mc,
        data=DataConfig(train_path="<benchmark pairs>", max_prompt_len=args.prompt_len, max_seq_len=seq),
        trainer=TrainerConfig(global_batch_size=args.pairs, micro_batch_size=args.pairs, progress=False),
        actor=TrainableRoleConfig(init=paths["policy"], optim=OptimConfig(lr=1e-6, warmup_steps=0, schedule="constant")),
        dpo=DPOConfig(beta=0.1, loss_type="sigmoid"),
    )
    return DPOWorker(cfg, total_steps=1000, init=paths["policy"], eos_token_id=EOS)


def aligner_batches(args: argparse.Namespace, vocab_size: int):
    """Collated batches of args.pairs pairs, cycling over the same pairs TRL trains on (EOS appended)."""
    from aligner.data.collate import collate_pairs

    pairs = make_pairs(args, args.pairs * 64, vocab_size)
    ex = [{"chosen_ids": p + c + [EOS], "rejected_ids": p + r + [EOS], "prompt_len": len(p)} for p, c, r in pairs]
    i = 0
    while True:
        yield collate_pairs(ex[i : i + args.pairs], pad_id=0)
        i = (i + args.pairs) % len(ex)


def main() -> None:
    args = parse()
    if args.peer == "trl":
        return trl_child(args)
    C.as_cpu_worker()
    import torch

    mc = C.tiny_model_cfg(max_seq_len=256)
    paths = C.make_checkpoints(args.fixtures, mc)
    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(
        f"work: {args.pairs} pairs a step, prompt {args.prompt_len} tokens, chosen {args.chosen_len} + EOS, rejected "
        f"{args.rejected_len} + EOS; {args.repeats} repeats after 1 warm-up step each",
        flush=True,
    )
    worker = build_aligner(args, paths, mc)
    batches = aligner_batches(args, mc.vocab_size)

    def ours() -> float:
        batch = next(batches)
        t0 = time.perf_counter()
        worker.dpo_step(batch)
        return time.perf_counter() - t0

    ours()  # warm-up
    peer = C.PeerProcess(
        Path(args.peer_python),
        [str(Path(__file__).resolve()), "--peer", "trl", "--paths", json.dumps(paths), *_size_args(args)],
        env=C.peer_env(args.peer_malloc),
    )
    print(f"aligner: torch threads {torch.get_num_threads()}; peer: {peer.ready}", flush=True)
    peer.first()  # warm-up
    a, t = [], []
    try:
        for i in range(args.repeats):
            a.append(ours())
            t.append(peer.step()[0])
            print(f"  repeat {i}: aligner {a[-1]:.3f} s, TRL {t[-1]:.3f} s", flush=True)
    finally:
        peer.close()
    ma, mt = C.median(a), C.median(t)
    paired = C.median([x / y for x, y in zip(a, t)])
    print(f"aligner DPO step: median {ma:.3f} s; TRL DPOTrainer step: median {mt:.3f} s")
    print(
        f"ratio aligner / TRL: {ma / mt:.2f}x of medians, {paired:.2f}x median of per-repeat pairs "
        f"(goal <= 0.5x: {'met' if max(ma / mt, paired) <= 0.5 else 'not met'})"
    )


def _size_args(args: argparse.Namespace) -> list[str]:
    return [
        "--pairs",
        str(args.pairs),
        "--prompt-len",
        str(args.prompt_len),
        "--chosen-len",
        str(args.chosen_len),
        "--rejected-len",
        str(args.rejected_len),
    ]


if __name__ == "__main__":
    main()
