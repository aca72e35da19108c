"""Benchmark: peak memory of aligner's per-token log-prob path vs a naive log_softmax over [B, T, V].

What is measured: the peak resident memory (bytes above the level just before the call) of
forward + backward of the per-token log-probs of given logits [B, T, V] (V = 32000):

- aligner: :func:`aligner.nn.vocab.vocab_parallel_log_probs` (the fused softmax
  statistics of Megatron's vocab-parallel cross entropy; tp_group=None, one process), as
  Policy.log_probs calls it (ppo_step calls its log-prob + entropy variant); the policy's
  response-only head already shrinks the logits from [B, T, V] to [B, R, V] before this;
- naive: ``torch.log_softmax(logits.float(), -1).gather(-1, labels)``, the textbook path
  (and what HF-based trainers do).

Each measurement runs in a forked child: the logits are allocated first, then the child
resets the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5, Linux), runs
forward + ``.sum().backward()``, and reads VmHWM - VmRSS(before). Large tensors are mmap'd by
the allocator, so the counter sees every one of them. Children alternate (aligner, naive,
...) and the table shows medians over repeats, in MiB and in units of one fp32 [B, T, V]
tensor. The logits themselves exist before the baseline and are not counted; their gradient
(one [B, T, V] in the logits' dtype) is counted for both paths alike.

    python benchmarks/logprob_memory.py          # B x T = 4 x 512, fp32 and bf16 logits, 3 repeats
    python benchmarks/logprob_memory.py --quick  # 2 x 256, 2 repeats
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def aligner_path(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from aligner.nn.vocab import vocab_parallel_log_probs

    return vocab_parallel_log_probs(logits, labels)


def naive_path(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


PATHS = {"aligner": aligner_path, "naive": naive_path}


def _child(name: str, shape: tuple[int, int, int], dtype: str, q) -> None:
    torch.set_num_threads(1)
    b, t, v = shape
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g).to(getattr(torch, dtype)).requires_grad_(True)
    labels = torch.randint(0, v, (b, t), generator=g)
    PATHS[name](logits[:1, :2].detach().clone().requires_grad_(True), labels[:1, :2]).sum().backward()  # import, warm
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    PATHS[name](logits, labels).sum().backward()
    q.put((_status_kb("VmHWM") - before) * 1024)


def measure(name: str, shape: tuple[int, int, int], dtype: str) -> int:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(name, shape, dtype, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 x 256 tokens, 2 repeats")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.seq, args.repeats = 2, 256, 2
    shape = (args.batch, args.seq, args.vocab)
    unit = args.batch * args.seq * args.vocab * 4
    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(
        f"logits [B, T, V] = {list(shape)}; one fp32 [B, T, V] = {unit / 2**20:.0f} MiB; forward + backward; "
        f"{args.repeats} repeats, alternating"
    )
    print(f"{'logits':>8} {'path':>8} {'peak MiB':>9} {'x [B,T,V] fp32':>15}")
    for dtype in ("float32", "bfloat16"):
        res: dict[str, list[int]] = {n: [] for n in PATHS}
        for _ in range(args.repeats):
            for n in PATHS:
                res[n].append(measure(n, shape, dtype))
        for n, xs in res.items():
            m = C.median(xs)
            print(f"{dtype:>8} {n:>8} {m / 2**20:9.0f} {m / unit:15.2f}")
        a, b = C.median(res["aligner"]), C.median(res["naive"])
        print(f"{dtype:>8} ratio aligner / naive: {a / b:.2f}x")


if __name__ == "__main__":
    main()
