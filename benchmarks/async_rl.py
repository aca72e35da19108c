"""Benchmark: generation overlapped with training: the split rollout placement at
trainer.max_staleness = 1 against 0, and against the colocated placement, on SmolLM2-135M.

What is measured: samples per second of whole PPO steps (wall time of ``PPOTrainer.run_step``) of
GRPO on SmolLM2-135M-Instruct with GSM8K chat prompts (the work of ``benchmarks/grpo_step.py
--real``: 4 prompts x 4 samples, 128 new tokens forced (no EOS), rule reward gsm8k_format, KL loss
0.04 against a reference role, micro-batches of 4, fp32), through Ray worker groups, three ways:

- ``split k=1``: rollout.placement=split, trainer.max_staleness=1: the rollout group (one worker,
  one CPU, one torch thread) generates step t+1's batch while the actor (one CPU) runs step t's
  update, and the reference (one CPU) computes step t+1's log-probs as soon as that batch is
  generated (``trainer.ref_ahead``, on by default where the reference has devices of its own);
  AReaL's decoupled loss corrects the lag, with the update's own forward as the proximal policy;
- ``split k=1 ref-inline``: the same with trainer.ref_ahead=false: the reference's log-probs in the
  inference phase of the step that trains on the batch (as at k = 0);
- ``split k=0``: the same placement and threads, synchronous (the sync, then generation, then the
  update, one after another);
- ``colocated k=0``: today's default: the engine in the actor's process, the workers of each
  phase sharing both cores (trainer.num_threads=0);
- ``split k=2``: as ``split k=1`` with trainer.max_staleness=2: two batches may be in flight, but a
  sync lands only between generations (Ray runs a rollout worker's calls one at a time), so a sync
  that falls due waits for the batches in flight before the next generation is queued;
- ``split k=2 interruptible``: the same with rollout.interruptible=true: the sync is
  issued when due and lands between decode steps of the generation in flight (a response may then
  span two weight versions: ``mixed_version_frac``; staleness is counted per token).

--configs picks the configurations (comma-separated names; default: all six). Every
configuration does the same work per step: ``grpo_step.py --real``'s, one optimizer step per batch
with no old-log-prob forward (algorithm.recompute_old_log_probs=false: the update's own forward,
detached, is the old policy, and with the decoupled loss the proximal one; until 2026-11-28 every
configuration here ran that forward as well, since the decoupled loss required it; --recompute
restores it). Blocks of --steps steps per configuration, alternating
(A, B, C, A, B, C, ...) --rounds times, each block on a trainer started for it and stopped after it
(three SmolLM2 trainers with their AdamW state did not fit 24 GiB at once); the first step of each
block is dropped (it starts with the queue empty), so only steady-state steps count (at k=2 the queue
fills over two steps: the second step of a block is 1 step stale, the later ones 2).
The bound of the overlap is (generate + update) / max(generate, update); the goal is >= 1.6x.
Also printed: the weight sync's bytes and seconds per step (split) and the refit's (colocated), and
the mean staleness per configuration (with interruptible generation also the mean
mixed_version_frac, the only configuration that logs it).

    python benchmarks/async_rl.py                  # 2 rounds of blocks of 4 steps
    python benchmarks/async_rl.py --rounds 1 --steps 3
    python benchmarks/async_rl.py --rounds 2 --steps 3 --configs "split k=1,split k=2,split k=2 interruptible"
    python benchmarks/async_rl.py --rounds 2 --steps 3 --configs "split k=1,split k=1 ref-inline,split k=0,colocated k=0"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

CONFIGS = {
    "split k=1": dict(placement="split", k=1),
    "split k=1 ref-inline": dict(placement="split", k=1, ref_ahead=False),
    "split k=0": dict(placement="split", k=0),
    "colocated k=0": dict(placement="colocated", k=0),
    "split k=2": dict(placement="split", k=2),
    "split k=2 interruptible": dict(placement="split", k=2, interruptible=True),
}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="blocks per configuration")
    ap.add_argument("--steps", type=int, default=4, help="steps per block (the first is dropped)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated configurations to run, of: {', '.join(CONFIGS)} (default: all)"
    )
    ap.add_argument("--recompute", action="store_true", help="run the actor's old-log-prob forward in every configuration")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama and random prompts instead (a smoke test of the script)")
    args = ap.parse_args()
    args.configs = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in args.configs if n not in CONFIGS]
    if unknown or not args.configs:
        ap.error(f"--configs: unknown {unknown} (known: {', '.join(CONFIGS)})")
    return args


def build(
    args: argparse.Namespace,
    placement: str,
    k: int,
    model_dir: str,
    mc,
    tok,
    prompts,
    interruptible: bool = False,
    ref_ahead: bool | None = None,
):
    """A Ray PPOTrainer of the benchmark's work with this placement and staleness (interruptible
    generation, the reference's log-probs ahead or inline), started."""
    from grpo_step import grpo_config

    from aligner.config import AlgorithmConfig, RewardRoleConfig
    from aligner.config.validation import validate_run
    from aligner.trainers.ppo import PPOTrainer

    cfg = grpo_config(args, {"policy": model_dir, "tokenizer": model_dir}, mc)
    cfg.reward = RewardRoleConfig(type="rule", rule="gsm8k_format")
    cfg.trainer.micro_batch_size = 4
    cfg.algorithm = AlgorithmConfig(
        advantage="grpo", kl_coef=0.0, kl_loss_coef=0.04, ppo_epochs=1, normalize_rewards=False, recompute_old_log_probs=args.recompute
    )
    cfg.rollout.placement = placement
    cfg.trainer.max_staleness = k
    cfg.rollout.interruptible = interruptible  # syncs land between decode steps (split, k >= 1)
    cfg.trainer.ref_ahead = ref_ahead  # None: on where it applies (split, k >= 1, the reference on a CPU of its own)
    cfg.trainer.num_threads = 0  # colocated: threads follow the work; split: each worker its one CPU's thread
    validate_run(cfg)  # resolves algorithm.decoupled_loss (on for k > 0)
    from grpo_step import NoEos

    trainer = PPOTrainer(cfg, NoEos(tok), prompts, prompts)
    trainer.start()
    return trainer


def settle(trainer) -> None:
    """Wait for the generations a trainer left in flight (none runs beside the next block)."""
    if trainer.producer is not None:
        for p in trainer.producer.pending:
            p.future.get()


def main() -> None:
    args = parse()
    C.as_cpu_worker()
    from aligner.data.tokenizer import load_tokenizer
    from aligner.model.hf import model_config_from_hf, read_hf_config
    from aligner.workers.ray_runtime import init_ray, shutdown_ray

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpo_step import real_prompts

    if args.tiny:
        mc = C.tiny_model_cfg(max_seq_len=max(256, args.prompt_len + args.new_tokens))
        paths = C.make_checkpoints(C.CACHE / "async_rl_tiny", mc)
        model_dir, tok = paths["policy"], load_tokenizer(paths["tokenizer"])
        prompts = [{**p, "metadata": {"answer": "1"}} for p in C.make_prompts(256, 16, mc.vocab_size)]
    else:
        model_dir = str(C.smollm2_dir())
        mc = model_config_from_hf(read_hf_config(model_dir))
        tok = load_tokenizer(model_dir)
        prompts = [p for p in real_prompts(tok, 256) if len(p["prompt_ids"]) <= args.prompt_len]
    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(
        f"work: SmolLM2-135M-Instruct GRPO, GSM8K chat prompts, {args.prompts} prompts x {args.samples} samples, "
        f"{args.new_tokens} new tokens forced, KL loss 0.04, micro-batches of 4, fp32; blocks of {args.steps} steps "
        f"(first dropped) x {args.rounds} rounds per configuration; old-log-prob forward: {'yes' if args.recompute else 'no'}",
        flush=True,
    )
    init_ray()
    rows: dict[str, list[dict]] = {n: [] for n in args.configs}
    try:
        for r in range(args.rounds):
            for name in args.configs:
                c = CONFIGS[name]
                # one trainer at a time (three SmolLM2 trainers with AdamW state do not fit 24 GiB together),
                # started for its block and stopped after it: nothing of it runs beside the next block
                t = build(args, c["placement"], c["k"], model_dir, mc, tok, prompts, c.get("interruptible", False), c.get("ref_ahead"))
                try:
                    for i in range(args.steps):
                        t0 = time.perf_counter()
                        m = t.run_step()
                        wall = time.perf_counter() - t0
                        t.step += 1
                        if i:
                            rows[name].append({**m, "wall": wall})
                            mixed = f", mixed_version_frac {m['mixed_version_frac']:.2f}" if "mixed_version_frac" in m else ""
                            print(f"  round {r} {name}: step {wall:.2f} s, staleness {m.get('staleness', 0):.2f}{mixed}", flush=True)
                    settle(t)
                finally:
                    t.stop()
    finally:
        shutdown_ray()
    samples = args.prompts * args.samples
    med = {n: C.median([x["wall"] for x in rows[n]]) for n in rows}
    for n in rows:
        gen, infer, train = (C.median([x.get(f"time/{p}", 0.0) for x in rows[n]]) for p in ("generate", "inference", "train"))
        sync = C.median([x.get("refit_bytes", 0.0) for x in rows[n]]) / 2**20
        secs = C.median([x.get("sync_seconds", x.get("time/refit", 0.0)) for x in rows[n]])
        print(
            f"{n:>14}: step {med[n]:.2f} s = {samples / med[n]:.2f} samples/s (generate-phase wait {gen:.2f} s, inference {infer:.2f} s, train {train:.2f} s); "
            f"weights sent {sync:.0f} MiB in {secs:.2f} s a step"
        )
        stale = C.mean([x.get("staleness", 0.0) for x in rows[n]])
        mixed = [x["mixed_version_frac"] for x in rows[n] if "mixed_version_frac" in x]
        extra = f", mixed_version_frac mean {C.mean(mixed):.2f}" if mixed else ""
        print(f"{'':>14}  staleness mean {stale:.2f} steps (max {max(x.get('staleness', 0.0) for x in rows[n]):.2f}){extra}")

    def ratio(a: str, b: str, note: str = "") -> None:  # samples/s of a over b (step time of b over a)
        if a in med and b in med:
            print(f"samples/s, {a} / {b}{note}: {med[b] / med[a]:.2f}x")

    if "split k=1" in med and "split k=0" in med:
        r10 = med["split k=0"] / med["split k=1"]
        print(f"samples/s, split k=1 / split k=0: {r10:.2f}x (goal >= 1.6x: {'met' if r10 >= 1.6 else 'not met'})")
    ratio("split k=1", "colocated k=0", " (both cores)")
    ratio("split k=1", "split k=1 ref-inline")
    ratio("split k=2", "split k=1")
    ratio("split k=2 interruptible", "split k=1")
    ratio("split k=2 interruptible", "split k=2")
    ratio("split k=2", "split k=0")
    ratio("split k=2 interruptible", "split k=0")


if __name__ == "__main__":
    main()
