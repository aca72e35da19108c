"""Benchmark: training-state bytes per parameter and AdamW step time, fp32 vs bf16 Adam moments.

What is measured, for ``optim.state_dtype`` float32 (torch's fused AdamW) and bfloat16
(aligner.runtime.adamw.MixedPrecisionAdamW), each on a TrainRuntime of the benchmark Llama
(hidden 256, 4 layers, vocab 32000, fp32) after one forward + backward and one optimizer step:

- bytes per parameter measured from the tensors themselves (storages of the parameters, of
  their gradients, and of every tensor in ``optimizer.state``: exp_avg, exp_avg_sq, step),
  beside the planner's formula (aligner.planner.train_bytes_per_parameter);
- wall time of ``optimizer.step()`` alone (the same gradients every time), the two settings
  alternating (fp32, bf16, fp32, ...) after one warm-up each; medians.

    python benchmarks/optimizer_state.py              # 9 alternating repeats
    python benchmarks/optimizer_state.py --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's aligner, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

DTYPES = ("float32", "bfloat16")


def runtime(mc, state_dtype: str):
    """A TrainRuntime with gradients from one forward + backward and one optimizer step taken."""
    from aligner.config import OptimConfig, ParallelConfig
    from aligner.parallel.dims import ParallelDims
    from aligner.runtime.train_runtime import TrainRuntime

    optim = OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant", grad_clip=0.0, state_dtype=state_dtype)
    rt = TrainRuntime(mc, "lm", ParallelConfig(), optim, ParallelDims(), total_steps=10_000, seed=0)
    ids = torch.randint(4, mc.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    rt(ids).float().logsumexp(-1).mean().backward()
    rt.optimizer.step()
    return rt


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measured_bytes(rt) -> tuple[float, float, float]:
    """(weights, grads, optimizer state) bytes per parameter, from the storages."""
    params = [p for p in rt.module.parameters()]
    n = sum(p.numel() for p in params)
    state = [t for st in rt.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    return _bytes(params) / n, _bytes(p.grad for p in params) / n, _bytes(state) / n


def step_seconds(rt) -> float:
    t0 = time.perf_counter()
    rt.optimizer.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9, help="alternating timed optimizer steps per setting")
    args = ap.parse_args()
    C.as_cpu_worker()
    from aligner.config import ParallelConfig
    from aligner.planner import train_bytes_per_parameter

    mc = C.tiny_model_cfg()
    rts = {d: runtime(mc, d) for d in DTYPES}
    n = sum(p.numel() for p in rts["float32"].module.parameters())
    print(C.env_line())
    print(C.command_line())
    print(f"model: hidden {mc.hidden_size}, {mc.num_layers} layers, vocab {mc.vocab_size}: {n:,} parameters, fp32")
    print(f"{'state_dtype':<12} {'optimizer':<20} {'measured B/param (w + g + optim = total)':<44} {'planner':<22}")
    for d in DTYPES:
        w, g, o = measured_bytes(rts[d])
        pw, pg, po = train_bytes_per_parameter(ParallelConfig(), mc, d)
        kind = type(rts[d].optimizer).__name__
        moments = {str(t.dtype).removeprefix("torch.") for st in rts[d].optimizer.state.values() for k, t in st.items() if k != "step"}
        print(
            f"{d:<12} {kind:<20} {w:.2f} + {g:.2f} + {o:.4f} = {w + g + o:.4f} (moments {','.join(sorted(moments))})"
            f"   {pw:g} + {pg:g} + {po:g} = {pw + pg + po:g}"
        )
    for d in DTYPES:  # warm-up
        step_seconds(rts[d])
    times: dict[str, list[float]] = {d: [] for d in DTYPES}
    for _ in range(args.repeats):
        for d in DTYPES:
            times[d].append(step_seconds(rts[d]))
    med = {d: C.median(times[d]) for d in DTYPES}
    for d in DTYPES:
        print(
            f"optimizer.step() {d:<9} median {med[d] * 1e3:7.2f} ms over {args.repeats} (all: {', '.join(f'{t * 1e3:.1f}' for t in times[d])})"
        )
    print(f"bf16 / fp32 step time: {med['bfloat16'] / med['float32']:.2f}x")


if __name__ == "__main__":
    main()
