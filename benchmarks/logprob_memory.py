"""Benchmark: peak memory of aligner's per-token log-prob path vs a naive log_softmax over [B, T, V].

What is measured: the peak resident memory (bytes above the level just before the call) of
forward + backward of the per-token log-probs of given logits [B, T, V] (V = 32000):

- aligner: :func:`aligner.nn.vocab.vocab_parallel_log_probs` (the fused softmax
  statistics of Megatron's vocab-parallel cross entropy; tp_group=None, one process), as
  Policy.log_probs calls it (ppo_update calls its log-prob + entropy variant); the policy's
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

With ``--head`` it measures the LM head plus the log-probs instead, from the head's input
h [B*T, H] and weight W [V, H] (both fp32, requiring grad, allocated before the baseline):

- today: ``vocab_parallel_log_probs(F.linear(h, W), labels)``, the logits materialized as the
  policy does with ``parallel.logprob_chunk_size=0``;
- chunked: :func:`aligner.nn.chunked.chunked_log_probs_entropy` (chunks of ``--chunk``
  positions, default ``parallel.logprob_chunk_size``; its entropy output is computed too,
  unused), the policy's default path. With B*T <= chunk it keeps its one chunk for backward.

Both count the gradients they create: grad h [B*T, H] and grad W [V, H] (125 MiB at
V = 128,256, H = 256). The child also reports the wall time of the call (one thread).

    python benchmarks/logprob_memory.py          # B x T = 4 x 512, fp32 and bf16 logits, 3 repeats
    python benchmarks/logprob_memory.py --quick  # 2 x 256, 2 repeats
    python benchmarks/logprob_memory.py --head --vocab 128256   # Llama 3 vocabulary, H = 256, chunk 512
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from aligner.config import ParallelConfig  # noqa: E402


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


def today_head(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    from aligner.nn.vocab import vocab_parallel_log_probs

    return vocab_parallel_log_probs(F.linear(h, w), labels)


def chunked_head(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    from aligner.nn.chunked import chunked_log_probs_entropy

    return chunked_log_probs_entropy(h, w, labels, chunk_size=chunk)[0]


PATHS = {"aligner": aligner_path, "naive": naive_path}
HEAD_PATHS = {"today": today_head, "chunked": chunked_head}


def _peak_of(run) -> tuple[int, float]:
    """(peak RSS bytes above the level before, seconds) of run() (forward + backward)."""
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    return (_status_kb("VmHWM") - before) * 1024, seconds


def _child(name: str, shape: tuple[int, int, int], dtype: str, q) -> None:
    torch.set_num_threads(1)
    b, t, v = shape
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g).to(getattr(torch, dtype)).requires_grad_(True)
    labels = torch.randint(0, v, (b, t), generator=g)
    PATHS[name](logits[:1, :2].detach().clone().requires_grad_(True), labels[:1, :2]).sum().backward()  # import, warm
    q.put(_peak_of(lambda: PATHS[name](logits, labels).sum().backward()))


def _head_child(name: str, shape: tuple[int, int, int], hidden: int, chunk: int, q) -> None:
    torch.set_num_threads(1)
    n, v = shape[0] * shape[1], shape[2]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g).requires_grad_(True)
    w = (torch.randn(v, hidden, generator=g) * hidden**-0.5).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    small = torch.randn(4, hidden, requires_grad=True), torch.randn(8, hidden, requires_grad=True)
    HEAD_PATHS[name](*small, labels[:4] % 8, 2).sum().backward()  # import, warm
    q.put(_peak_of(lambda: HEAD_PATHS[name](h, w, labels, chunk).sum().backward()))


def measure(target, *args) -> tuple[int, float]:
    """(peak bytes, seconds) of one forked child running target(*args, queue)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    while True:
        try:
            out = q.get(timeout=1.0)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"measure: the child for {args} exited with code {p.exitcode} and no result") from None
    p.join()
    return out


def run_head(args) -> None:
    """The --head table: today's head + log-probs vs the chunked path, alternating children."""
    shape = (args.batch, args.seq, args.vocab)
    unit = args.batch * args.seq * args.vocab * 4
    print(
        f"head: h [B*T, H] = [{args.batch * args.seq}, {args.hidden}], W [V, H] = [{args.vocab}, {args.hidden}] fp32; "
        f"one fp32 [B*T, V] = {unit / 2**20:.0f} MiB; chunk {args.chunk} positions; forward + backward; "
        f"{args.repeats} repeats, alternating"
    )
    res: dict[str, list[tuple[int, float]]] = {n: [] for n in HEAD_PATHS}
    for _ in range(args.repeats):
        for n in HEAD_PATHS:
            res[n].append(measure(_head_child, n, shape, args.hidden, args.chunk))
    print(f"{'path':>8} {'peak MiB':>9} {'x [B*T,V] fp32':>15} {'s / call':>9}")
    for n, xs in res.items():
        m, sec = C.median([x[0] for x in xs]), C.median([x[1] for x in xs])
        print(f"{n:>8} {m / 2**20:9.0f} {m / unit:15.2f} {sec:9.2f}")
    peak = {n: C.median([x[0] for x in xs]) for n, xs in res.items()}
    sec = {n: C.median([x[1] for x in xs]) for n, xs in res.items()}
    print(f"ratio chunked / today: peak {peak['chunked'] / peak['today']:.3f}x, time {sec['chunked'] / sec['today']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 x 256 tokens, 2 repeats")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--head", action="store_true", help="measure the LM head + log-probs: today's path vs the chunked one")
    ap.add_argument("--hidden", type=int, default=256, help="--head: hidden size H")
    ap.add_argument(
        "--chunk", type=int, default=ParallelConfig().logprob_chunk_size, help="--head: positions per chunk (default: the policy's)"
    )
    args = ap.parse_args()
    if args.chunk < 0:  # the policy's automatic chunk (aligner.nn.chunked.auto_chunk_size)
        from aligner.nn.chunked import auto_chunk_size

        args.chunk = auto_chunk_size(args.vocab)
    if args.quick:
        args.batch, args.seq, args.repeats = 2, 256, 2
    shape = (args.batch, args.seq, args.vocab)
    unit = args.batch * args.seq * args.vocab * 4
    print(C.env_line())
    print(f"command: {C.command_line()}")
    if args.head:
        run_head(args)
        return
    print(
        f"logits [B, T, V] = {list(shape)}; one fp32 [B, T, V] = {unit / 2**20:.0f} MiB; forward + backward; "
        f"{args.repeats} repeats, alternating"
    )
    print(f"{'logits':>8} {'path':>8} {'peak MiB':>9} {'x [B,T,V] fp32':>15}")
    for dtype in ("float32", "bfloat16"):
        res: dict[str, list[int]] = {n: [] for n in PATHS}
        for _ in range(args.repeats):
            for n in PATHS:
                res[n].append(measure(_child, n, shape, dtype)[0])
        for n, xs in res.items():
            m = C.median(xs)
            print(f"{dtype:>8} {n:>8} {m / 2**20:9.0f} {m / unit:15.2f}")
        a, b = C.median(res["aligner"]), C.median(res["naive"])
        print(f"{dtype:>8} ratio aligner / naive: {a / b:.2f}x")


if __name__ == "__main__":
    main()
