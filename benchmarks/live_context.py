"""Benchmark: the tokens a decoding row holds, on a real model's sampled responses (the paged-KV read).

Not a test. The planner times a paged engine's KV-cache read (``rollout.backend=trtllm``) from the mean and the
longest response alone: over its decode steps a row holds prompt + min(mean, (mean + longest) / 4) tokens on
average (``aligner.planner.live_context_tokens``: the middle of the bounds mean / 2 and longest / 2, at most the mean), where the exact figure is prompt + E[L(L - 1) / 2] / E[L] (a response of
L tokens is decoded at positions 0 .. L - 1). This samples SmolLM2-135M-Instruct's responses to GSM8K train
prompts (the chat template, temperature 1, stop at EOS) with aligner's continuous engine in fp32 on the CPU and
prints the lengths (mean, quantiles, longest), both figures, and the total KV tokens read over the generation:
exact (each response with its own prompt) against the planner's requests x mean x live_context_tokens, with
the longest taken as measured and as the cap (``max_new_tokens``: the planner's default when nothing is known).

    python benchmarks/live_context.py                          # 64 prompts x 4 samples, max_new_tokens 512
    python benchmarks/live_context.py --prompts 32 --samples 2 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from aligner.config import SamplingConfig  # noqa: E402
from aligner.model.hf import load_hf_model  # noqa: E402
from aligner.planner import live_context_tokens  # noqa: E402
from aligner.rollout.torch_engine.engine import TorchEngine  # noqa: E402


def quantile(xs: list[int], q: float) -> int:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--slots", type=int, default=64, help="the continuous engine's rows (rollout.max_batch_size)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    print(C.env_line())
    print(f"command: {C.command_line()}")
    torch.manual_seed(args.seed)
    model_dir = C.smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model, _ = load_hf_model(model_dir)
    model.eval()
    prompts = [p for p in C.gsm8k_prompts(tok, args.prompts) for _ in range(args.samples)]
    engine = TorchEngine(model, eos_token_id=tok.eos_token_id, max_batch_size=args.slots)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    gens = engine.generate(prompts, sampling, seeds=[args.seed * 100003 + i for i in range(len(prompts))])
    secs = time.perf_counter() - t0
    lengths = [len(g.token_ids) for g in gens]
    plens = [len(p) for p in prompts]
    n, total = len(lengths), sum(lengths)
    mean, longest = total / n, max(lengths)
    prompt = statistics.mean(plens)
    capped = sum(1 for L in lengths if L >= args.max_new_tokens)
    print(
        f"{n} responses ({args.prompts} GSM8K prompts x {args.samples}) in {secs:.0f} s; prompt tokens mean {prompt:.1f}; "
        f"response tokens mean {mean:.1f}, p50 {quantile(lengths, 0.5)}, p90 {quantile(lengths, 0.9)}, "
        f"p99 {quantile(lengths, 0.99)}, longest {longest}; {capped} at the cap {args.max_new_tokens}"
    )
    exact_pos = sum(L * (L - 1) / 2 for L in lengths) / total  # mean position over all decode steps
    exact_reads = sum(P * L + L * (L - 1) / 2 for P, L in zip(plens, lengths))  # KV tokens over the generation
    print(f"mean position over the decode steps, exact E[L(L-1)/2]/E[L]: {exact_pos:.1f} tokens")
    print(f"E[L^2] / (2 E[L]) / mean = {sum(L * L for L in lengths) / (2 * total) / mean:.2f} (0.5: equal lengths; 1.0: exponential)")
    for name, tail in (("measured longest", longest), (f"the cap {args.max_new_tokens}", args.max_new_tokens)):
        ctx = live_context_tokens(prompt, mean, tail)
        model_reads = n * mean * ctx
        print(
            f"planner, longest = {name}: position {ctx - prompt:.1f} ({100 * ((ctx - prompt) / exact_pos - 1):+.1f}%; the bounds "
            f"mean / 2 = {mean / 2:.1f}, longest / 2 = {tail / 2:.1f}: the exact position lies "
            f"{100 * (exact_pos - mean / 2) / max(tail / 2 - mean / 2, 1e-9):.0f}% of the way); KV tokens read "
            f"{model_reads:,.0f} against {exact_reads:,.0f} exact ({100 * (model_reads / exact_reads - 1):+.1f}%)"
        )


if __name__ == "__main__":
    main()
