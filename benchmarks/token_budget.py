"""Padded tokens and step time: token-budget micro-batches vs fixed-size ones.

The row lengths are real: the prompt + response token counts of SmolLM2-135M's IFEval responses
(``/work/runs/ifeval_after.responses.jsonl``, fields ``prompt`` and ``response``, tokenized with
the SmolLM2 tokenizer; a long-tailed distribution), scaled by ``--scale`` to fit a small model on
the CPU. One batch of ``--rows`` rows drawn with a fixed seed runs a PPO update (``Policy.ppo_update``)
with ``trainer.micro_batch_size`` rows per micro-batch, then with a token budget of
micro_batch_size x the batch's longest row (the fixed layout's worst micro-batch: the same peak
activation memory). Prints pad tokens, pad fraction and the median step time of ``--repeats``
alternating runs, with the CPU model.

    PYTHONPATH=$PWD python benchmarks/token_budget.py [--rows 64] [--micro-batch-size 8] [--scale 0.25]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from aligner.actor.policy import Policy
from aligner.config import AlgorithmConfig, ModelConfig, OptimConfig, ParallelConfig
from aligner.parallel.dims import ParallelDims
from aligner.protocol import build_sequences


def lengths(path: str, tokenizer: str) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of every line of the responses file."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    out = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out.append((len(tok(rec["prompt"])["input_ids"]), max(1, len(tok(rec["response"])["input_ids"]))))
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--responses", default="/work/runs/ifeval_after.responses.jsonl")
    ap.add_argument("--tokenizer", default="/work/models/smollm2-135m")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.25, help="row lengths x this (a small model on the CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pairs = random.Random(0).sample(lengths(args.responses, args.tokenizer), args.rows)
    pairs = [(max(1, round(p * args.scale)), max(1, round(r * args.scale))) for p, r in pairs]
    t_max = max(p + r for p, r in pairs)
    cfg = ModelConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=t_max + 8
    )
    g = torch.Generator().manual_seed(0)
    seq = build_sequences(
        [torch.randint(4, 512, (p,), generator=g).tolist() for p, _ in pairs],
        [torch.randint(4, 512, (r,), generator=g).tolist() for _, r in pairs],
        pad_id=0,
    )
    mask = seq["response_mask"]
    batch = {**seq, "advantages": torch.randn(mask.shape, generator=g) * mask}
    algo = AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0)
    optim = OptimConfig(lr=1e-5, warmup_steps=0, schedule="constant")
    budget = args.micro_batch_size * t_max
    policies = {
        name: Policy(cfg, ParallelConfig(), optim, ParallelDims(device_type="cpu"), seed=0, micro_batch_tokens=tokens)
        for name, tokens in (("fixed", 0), ("budget", budget))
    }
    times: dict[str, list[float]] = {name: [] for name in policies}
    metrics: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, pol in policies.items():
            t0 = time.perf_counter()
            metrics[name] = pol.ppo_update(batch, algo, args.micro_batch_size)
            times[name].append(time.perf_counter() - t0)
    lens = sorted(p + r for p, r in pairs)
    print(f"cpu: {cpu_model()}, torch {torch.__version__}, 1 thread")
    print(
        f"rows {args.rows} (IFEval SmolLM2 lengths x {args.scale}): min {lens[0]}, median {lens[len(lens) // 2]}, "
        f"p90 {lens[int(0.9 * len(lens))]}, max {lens[-1]} tokens; micro_batch_size {args.micro_batch_size}, budget {budget}"
    )
    print(f"{'layout':8} {'pad_tokens':>11} {'pad_fraction':>13} {'step s (median)':>16}")
    for name in policies:
        m = metrics[name]
        print(f"{name:8} {m['pad_tokens']:>11.0f} {m['pad_fraction']:>13.3f} {statistics.median(times[name]):>16.3f}")


if __name__ == "__main__":
    main()
