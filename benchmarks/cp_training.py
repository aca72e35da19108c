"""Benchmark: context parallelism in the training runtime, cp = 1 against cp = 2.

One SFT optimizer step (:meth:`aligner.actor.policy.Policy.sft_step`, the ModelRunner path every
role uses: the micro-batch cut to the rank's zigzag tokens, per-token log-probs gathered back, the
gradients summed over cp) on one sequence of S tokens, fp32, a 4-layer GQA Llama (H 512, 8 query
heads over 2 kv heads, vocab 2048), recompute none (or ``--recompute``), on cp gloo ranks of this machine (cp = 1: one
process with every core's threads; cp = 2: two processes with half each, so both use the same cores).

Measured per cp rank:
- activation bytes: what autograd saves for backward during the step's forward (each storage once,
  parameters excluded: :func:`aligner.parallel.memory.saved_bytes`), at two lengths; the longest
  sequence under a fixed activation budget scales as bytes-per-token(cp=1) / bytes-per-token(cp=2)
  (the issue's goal: >= 1.9x). Parameters, gradients and Adam state are replicated over cp and not
  counted.
- tokens/s: S / the median step time (the same step, repeated; both layouts alternate).

    python benchmarks/cp_training.py                 # S 2048 and 4096
    python benchmarks/cp_training.py --seq 512 1024  # quick
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _policy(args, cp: int, dims):
    from aligner.actor.policy import Policy
    from aligner.config import ModelConfig, OptimConfig, ParallelConfig

    cfg = ModelConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 3.5),
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=2,
        max_seq_len=max(args.seq),
    )
    return Policy(cfg, ParallelConfig(cp_size=cp, recompute=args.recompute), OptimConfig(lr=1e-4, warmup_steps=0), dims, seed=0)


def _batch(seq_len: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 2048, (1, seq_len), generator=g)
    return {"input_ids": ids, "loss_mask": torch.ones_like(ids)}


def _measure(args, cp: int, dims) -> dict:
    from aligner.parallel.memory import saved_bytes

    pol = _policy(args, cp, dims)
    params = list(pol.runtime.module.parameters())
    out = {"bytes": {}, "seconds": {}}
    for s in args.seq:
        batch = _batch(s)
        pol.sft_step(batch, micro_batch_size=1)  # warm-up (allocator, first-call paths)
        out["bytes"][s] = saved_bytes(pol.sft_step, batch, 1, exclude=params)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            pol.sft_step(batch, micro_batch_size=1)
            times.append(time.perf_counter() - t0)
        out["seconds"][s] = sorted(times)[len(times) // 2]
    return out


def _rank(rank: int, world: int, args) -> dict:
    from aligner.parallel.dims import ParallelDims

    dims = ParallelDims(cp_size=world, world_size=world, rank=rank).build() if world > 1 else ParallelDims(device_type="cpu")
    return _measure(args, world, dims)


def run(cp: int, args) -> dict:
    from common import run_gloo_ranks

    return run_gloo_ranks(_rank, cp, (args,), threads=max(1, (os.cpu_count() or 1) // cp))[0]


def main() -> None:
    from common import command_line, env_line

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, nargs=2, default=[2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="cp=1 and cp=2 alternate this many times")
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    args = ap.parse_args()
    print(env_line())
    print(command_line())
    rounds = {1: [], 2: []}
    for _ in range(args.rounds):
        for cp in (1, 2):
            rounds[cp].append(run(cp, args))
    s1, s2 = args.seq
    base = rounds[1][0]["bytes"][s2] / s2
    print(f"SFT step, {args.layers} layers, H={args.hidden}, 8 heads over 2 kv heads, fp32, B=1, recompute {args.recompute}; per cp rank")
    print(f"| layout | saved MiB S={s1} | saved MiB S={s2} | longest S vs cp=1 | tokens/s S={s1} | tokens/s S={s2} |")
    print("|---|---|---|---|---|---|")
    for cp, res in rounds.items():
        b = res[0]["bytes"]
        tps = {s: s / sorted(r["seconds"][s] for r in res)[len(res) // 2] for s in args.seq}
        print(f"| cp={cp} | {b[s1] / 2**20:.1f} | {b[s2] / 2**20:.1f} | {base / (b[s2] / s2):.2f}x | {tps[s1]:.0f} | {tps[s2]:.0f} |")


if __name__ == "__main__":
    main()
