"""Benchmark: how aligner's PPO step time grows with rollout_batch_size and response length (CPU), with a PNG.

What is measured: wall time of one :class:`aligner.trainers.ppo.PPOTrainer` step and its phases
(refit, generate, inference, advantages, train), driven in-process through
benchmarks/common.py ``InProcessGroup`` (the real workers, no Ray), on the tiny Llama of
benchmarks/ppo_step.py (hidden 256, 4 layers, 8 heads, vocab 32000; critic, reward and
reference of the same dims), prompts of 32 tokens, responses forced to the full length,
1 epoch, one mini-batch of the whole rollout batch.

Two sweeps through a common point: rollout_batch_size in (8, 16, 32, 64) at 64 new tokens,
and new tokens in (32, 64, 128) at 16 prompts. Each point: one warm-up step, then the median
of ``--repeats`` steps. Points of a sweep are interleaved repeat by repeat (8, 16, 32, 64,
8, 16, ...) so load drift spreads over all of them. Writes a table and
benchmarks/scaling.png (step time and phases vs each variable, log-log).

    python benchmarks/scaling.py            # both sweeps, 2 repeats
    python benchmarks/scaling.py --quick    # batch (8, 16, 32) at 16 tokens, tokens (16, 32, 64) at batch 8, 1 repeat
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

PHASES = ("refit", "generate", "inference", "advantages", "train")


def sweep(points: list[tuple[int, int]], repeats: int, paths: dict, mc, tok) -> dict[tuple[int, int], list[dict]]:
    trainers = {}
    for b, r in points:
        cfg = C.ppo_config(prompts=b, new_tokens=r, prompt_len=32, model_cfg=mc, paths=paths)
        trainers[(b, r)] = tr = C.inprocess_trainer(cfg, tok, C.make_prompts(b * 8, 32, mc.vocab_size))
        C.timed_step(tr)  # warm-up
    out: dict[tuple[int, int], list[dict]] = {p: [] for p in points}
    for _ in range(repeats):
        for p in points:
            out[p].append(C.timed_step(trainers[p]))
            print(f"  batch {p[0]:>3}, new tokens {p[1]:>3}: {out[p][-1]['time/step']:.2f} s", flush=True)
    return out


def summarize(res: dict[tuple[int, int], list[dict]]) -> dict[tuple[int, int], dict[str, float]]:
    return {p: {k: C.median([r[f"time/{k}"] for r in rows]) for k in (*PHASES, "step")} for p, rows in res.items()}


def plot(by_batch: dict, by_len: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, data, idx, label in (
        (axes[0], by_batch, 0, "rollout_batch_size (prompts)"),
        (axes[1], by_len, 1, "response length (new tokens)"),
    ):
        xs = sorted(data, key=lambda p: p[idx])
        x = [p[idx] for p in xs]
        for k in ("step", "generate", "inference", "train"):
            ax.plot(x, [data[p][k] for p in xs], marker="o", label=k, lw=2.5 if k == "step" else 1.2)
        ref = data[xs[0]]["step"]
        ax.plot(x, [ref * v / x[0] for v in x], ls=":", color="gray", label="linear from first point")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("seconds (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fixed = (f"new tokens {next(iter(by_batch))[1]}", f"batch {next(iter(by_len))[0]}")
    axes[0].set_title(f"PPO step vs batch ({fixed[0]})")
    axes[1].set_title(f"PPO step vs response length ({fixed[1]})")
    fig.suptitle("aligner PPO step on CPU (tiny Llama, in-process trainer)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(data: dict, idx: int, name: str) -> str:
    lines = [f"{name:>10} " + " ".join(f"{k:>10}" for k in (*PHASES, "step"))]
    for p in sorted(data, key=lambda p: p[idx]):
        lines.append(f"{p[idx]:>10} " + " ".join(f"{data[p][k]:10.3f}" for k in (*PHASES, "step")))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fixtures", default="/tmp/aligner_bench_fixtures")
    ap.add_argument("--out", default=str(C.BENCH / "scaling.png"))
    args = ap.parse_args()
    C.as_cpu_worker()
    batches, lengths, fixed_len, fixed_batch = (8, 16, 32, 64), (32, 64, 128), 64, 16
    if args.quick:
        batches, lengths, fixed_len, fixed_batch, args.repeats = (8, 16, 32), (16, 32, 64), 16, 8, 1
    from aligner.data.tokenizer import load_tokenizer

    mc = C.tiny_model_cfg(max_seq_len=max(256, 32 + max(lengths)))
    paths = C.make_checkpoints(args.fixtures, mc)
    tok = load_tokenizer(paths["tokenizer"])
    print(C.env_line())
    print(f"command: {C.command_line()}", flush=True)
    by_batch = summarize(sweep([(b, fixed_len) for b in batches], args.repeats, paths, mc, tok))
    by_len = summarize(sweep([(fixed_batch, r) for r in lengths], args.repeats, paths, mc, tok))
    print(f"seconds per PPO step (median of {args.repeats}), new tokens {fixed_len}:\n{table(by_batch, 0, 'batch')}")
    print(f"seconds per PPO step (median of {args.repeats}), batch {fixed_batch}:\n{table(by_len, 1, 'new tokens')}")
    plot(by_batch, by_len, Path(args.out))
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
