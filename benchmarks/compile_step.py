"""Benchmark: torch.compile'd decoder blocks vs eager, for generation and for a training step (CPU).

Not a test. Decode: two TorchEngines on copies of the same weights, ``compile="off"`` and
``compile="on"`` (:func:`aligner.rollout.torch_engine.engine.compile_decode`), both with the same CPU
weight layout (the one ``cpu_layout="auto"`` picks), greedy with no stop token, so both generate
the full length; the first compiled call's time is reported as compile time (it includes one
generation). Training: forward + backward of a next-token cross-entropy on [B, T] random tokens,
eager vs :func:`aligner.parallel.parallelize.apply_compile` (no optimizer step; the optimizer is
not compiled). After the warm-ups, eager and compiled runs alternate (A, B, A, B, ...) and the
medians are shown (a layer hitting Dynamo's recompile limit raises instead of running eager), so load drift on a shared machine hits both alike. Also printed: whether
greedy tokens are equal and the largest |log-prob difference| / loss and grad differences.

    python benchmarks/compile_step.py                          # tiny Llama (benchmarks/common.py)
    python benchmarks/compile_step.py --model smollm2          # ~/.cache/aligner-bench/smollm2-135m
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import benchmarks.common as C  # noqa: E402
from aligner.config import SamplingConfig  # noqa: E402
from aligner.model.llama import build_model  # noqa: E402
from aligner.parallel.parallelize import apply_compile  # noqa: E402
from aligner.rollout.torch_engine.engine import TorchEngine  # noqa: E402

SMOLLM2 = Path.home() / ".cache" / "aligner-bench" / "smollm2-135m"


def load(name: str):
    if name == "tiny":
        cfg = C.tiny_model_cfg()
        return build_model(cfg, seed=0), cfg
    from aligner.model.hf import load_hf_model

    return load_hf_model(SMOLLM2)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def decode(model, cfg, args) -> None:
    eager = TorchEngine(copy.deepcopy(model), max_batch_size=args.batch, compile="off")
    layout = "in_out" if eager.transposed else "out_in"
    comp = TorchEngine(copy.deepcopy(model), max_batch_size=args.batch, compile="on", cpu_layout=layout, fused_decode=eager.fused_decode)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, cfg.vocab_size, (args.batch, args.prompt), generator=g).tolist()
    sc = SamplingConfig(temperature=0.0, max_new_tokens=args.new, stop_token_ids=[])
    t_eager0, ref = timed(lambda: eager.generate(prompts, sc))
    t_compile, out = timed(lambda: comp.generate(prompts, sc))
    times = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, eng in (("eager", eager), ("compiled", comp)):
            t, gens = timed(lambda eng=eng: eng.generate(prompts, sc))
            times[name].append(t)
    tokens = args.batch * args.new
    med = {k: statistics.median(v) for k, v in times.items()}
    same = all(a.token_ids == b.token_ids for a, b in zip(ref, gens))
    lp = max(abs(x - y) for a, b in zip(ref, gens) for x, y in zip(a.rollout_log_probs, b.rollout_log_probs))
    print(
        f"decode  {args.model} {cfg.num_layers} layers, layout {eager.layout.get('transposed') and 'in_out' or 'out_in'}"
        f"{'+fused' if eager.fused_decode else ''}, batch {args.batch}, prompt {args.prompt}, {args.new} new, {args.rounds} rounds:"
    )
    print(f"  first call: eager {t_eager0:.2f} s, compiled {t_compile:.2f} s (compile + one generation)")
    print(
        f"  eager {tokens / med['eager']:.1f} tok/s ({med['eager']:.3f} s), compiled {tokens / med['compiled']:.1f} tok/s "
        f"({med['compiled']:.3f} s), compiled/eager speed {med['eager'] / med['compiled']:.3f}x"
    )
    print(f"  greedy tokens equal: {same}; max |log-prob diff| {lp:.2e}")
    print(f"  every round, s: eager {[round(t, 3) for t in times['eager']]}, compiled {[round(t, 3) for t in times['compiled']]}")


def train(model, cfg, args) -> None:
    eager = copy.deepcopy(model).train()
    comp = apply_compile(copy.deepcopy(model).train())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, cfg.vocab_size, (args.train_batch, args.train_len + 1), generator=g)

    def step(m):
        m.zero_grad(set_to_none=True)
        logits = m(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    t_eager0, l0 = timed(lambda: step(eager))
    t_compile, l1 = timed(lambda: step(comp))
    times = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, m in (("eager", eager), ("compiled", comp)):
            t, _ = timed(lambda m=m: step(m))
            times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    gd = max((a.grad - b.grad).abs().max().item() for a, b in zip(eager.parameters(), comp.parameters()) if a.grad is not None)
    print(f"train   {args.model} forward+backward, batch {args.train_batch} x {args.train_len} tokens, {args.rounds} rounds:")
    print(f"  first step: eager {t_eager0:.2f} s, compiled {t_compile:.2f} s (compile + one step)")
    print(
        f"  eager {med['eager']:.3f} s, compiled {med['compiled']:.3f} s, compiled/eager speed {med['eager'] / med['compiled']:.3f}x; "
        f"|loss diff| {abs(l0 - l1).item():.2e}, max |grad diff| {gd:.2e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--train-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip", choices=("none", "decode", "train"), default="none")
    args = ap.parse_args()
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # a silent fallback to eager would time eager twice
    print(C.env_line())
    print(f"torch threads {torch.get_num_threads()}")
    model, cfg = load(args.model)
    model = model.float()
    if args.skip != "decode":
        decode(model, cfg, args)
    if args.skip != "train":
        train(model, cfg, args)


if __name__ == "__main__":
    main()
