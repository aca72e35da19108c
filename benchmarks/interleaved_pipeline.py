"""Benchmark: the interleaved 1F1B schedule (v = 2 model chunks per rank) against plain 1F1B (v = 1),
pp = 2.

One SFT optimizer step (:meth:`aligner.actor.policy.Policy.sft_step`: the runtime's pipeline path)
of m micro-batches on pp = 2 gloo ranks of this machine (one thread each), an 8-layer GQA Llama
(H 512, 8 query heads over 2 kv heads, vocab 2048, fp32), micro-batches of one 512-token row.
Measured per rank: the step's wall time (median of the repeats) and the time the rank spent blocked
on its neighbours (``aligner.nn.comm.CommCounter`` ``pp_wait``: the bubble, plus the transfers);
printed beside the schedule's ideal bubble share of a step, (p - 1) / (v m + p - 1).

    python benchmarks/interleaved_pipeline.py               # m = 4 and 8
    python benchmarks/interleaved_pipeline.py --m 4 --repeats 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _measure(args, v: int, dims) -> dict:
    from aligner.actor.policy import Policy
    from aligner.config import ModelConfig, OptimConfig, ParallelConfig
    from aligner.nn.comm import CommCounter

    cfg = ModelConfig(
        vocab_size=2048, hidden_size=args.hidden, intermediate_size=int(args.hidden * 3.5), num_layers=8, num_heads=8, num_kv_heads=2,
        max_seq_len=args.seq,
    )  # fmt: skip
    pol = Policy(cfg, ParallelConfig(pp_size=2, virtual_pp_size=v), OptimConfig(lr=1e-4, warmup_steps=0), dims, seed=0)
    out = {}
    for m in args.m:
        g = torch.Generator().manual_seed(m)
        ids = torch.randint(4, 2048, (m, args.seq), generator=g)
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
        pol.sft_step(batch, micro_batch_size=1)  # warm-up
        steps, waits = [], []
        for _ in range(args.repeats):
            with CommCounter() as c:
                t0 = time.perf_counter()
                pol.sft_step(batch, micro_batch_size=1)
                steps.append(time.perf_counter() - t0)
            waits.append(c.seconds["pp_wait"])
        k = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]
        out[m] = (steps[k], waits[k])
    return out


def _rank(rank: int, world: int, args, v: int) -> dict:
    from aligner.parallel.dims import ParallelDims

    return _measure(args, v, ParallelDims(pp_size=2, world_size=world, rank=rank).build())


def run(v: int, args) -> list[dict]:
    from common import run_gloo_ranks

    return run_gloo_ranks(_rank, 2, (args, v), threads=1)


def main() -> None:
    from common import command_line, env_line

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="v=1 and v=2 alternate this many times")
    args = ap.parse_args()
    print(env_line())
    print(command_line())
    rounds = {1: [], 2: []}
    for _ in range(args.rounds):
        for v in (1, 2):
            rounds[v].append(run(v, args))
    print(f"SFT step, pp=2, 8 layers, H={args.hidden}, micro-batches of 1 x {args.seq} tokens, fp32, 1 thread per rank")
    print("| m | v | step s (median of rounds) | waiting, rank 0 / rank 1 | waiting share of the step, rank 0 / 1 | ideal bubble share |")
    print("|---|---|---|---|---|---|")
    for m in args.m:
        for v, res in rounds.items():
            k = sorted(range(len(res)), key=lambda i: res[i][0][m][0])[len(res) // 2]
            (s0, w0), (s1, w1) = res[k][0][m], res[k][1][m]
            step = max(s0, s1)
            ideal = (2 - 1) / (v * m + 2 - 1)
            print(f"| {m} | {v} | {step:.3f} | {w0:.3f} / {w1:.3f} s | {w0 / s0:.1%} / {w1 / s1:.1%} | {ideal:.1%} |")


if __name__ == "__main__":
    main()
