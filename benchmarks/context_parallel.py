"""Benchmark: activation bytes one decoder layer saves for backward per cp rank, cp = 1, 2, 4.

What is measured: :func:`aligner.parallel.memory.saved_bytes` (autograd's saved tensors, each
storage once, parameters and the layer-shared RoPE tables excluded) of one decoder layer's
forward on a [B, S] batch, on cp gloo ranks (torch.multiprocessing, CPU), the rank's S / cp
tokens in the zigzag layout of :mod:`aligner.parallel.context_parallel`. Rows:

- ``cp=1 stock``: the model as every layout runs it today (``Attention.core``: GQA by
  ``repeat_interleave``, so SDPA saves K and V expanded to all query heads);
- ``cp=1 cp-attn``: :func:`cp_attention` on one rank (GQA inside SDPA, K/V saved once);
- ``cp=2``, ``cp=4``: :func:`apply_context_parallel` on cp ranks (rank 0 reported; every rank
  saves the same bytes up to its chunk sizes).

Saved bytes per layer are linear in S here (flash SDPA keeps no [S, S] tensor; the script checks
it at two lengths), so under a fixed activation budget the longest trainable sequence scales as
bytes-per-token(cp=1) / bytes-per-token(cp): the printed "longest S vs cp=1" (the issue's goal:
>= 1.9x at cp=2). Parameters, gradients and optimizer state (replicated over cp) are not counted;
neither is the transient full K/V of the layer being computed (2 kvh S hd elements).

    python benchmarks/context_parallel.py            # H 512, 8 heads over 2 kv heads, S 2048 and 4096
    python benchmarks/context_parallel.py --quick    # S 512 and 1024
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def model_config(args):
    from aligner.config import ModelConfig

    return ModelConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 3.5),
        num_layers=1,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_seq_len=max(args.seq),
    )


def layer_bytes(cfg, seq_len: int, batch: int, group, mode: str, recompute: str) -> int:
    """Saved bytes of layer 0's forward for this rank's tokens (mode: stock | cp)."""
    import functools

    from aligner.model.llama import build_model, rope_cos_sin
    from aligner.nn import comm
    from aligner.parallel.context_parallel import apply_context_parallel, cp_attention, zigzag_index
    from aligner.parallel.memory import saved_bytes
    from aligner.parallel.parallelize import apply_recompute

    model = build_model(cfg, seed=0)
    if comm.group_size(group) > 1:
        apply_context_parallel(model, group)
    elif mode == "cp":
        attn = model.model.layers["0"].self_attn
        attn.__dict__["core"] = functools.partial(cp_attention, group=None)
    apply_recompute(model, recompute)
    cp, r = comm.group_size(group), comm.group_rank(group)
    idx = zigzag_index(seq_len, cp, r)
    pos = idx.expand(batch, -1)
    cos, sin = rope_cos_sin(model.model.inv_freq, pos, torch.float32)
    h = torch.randn(batch, idx.numel(), cfg.hidden_size, requires_grad=True)
    block = model.model.layers["0"]
    return saved_bytes(lambda x: block(x, cos, sin, None), h, exclude=[*model.parameters(), cos, sin])


def _rank(rank: int, world: int, args) -> dict[int, int]:
    cfg = model_config(args)
    return {s: layer_bytes(cfg, s, args.batch, dist.group.WORLD, "cp", args.recompute) for s in args.seq}


def run_cp(cp: int, args) -> dict[int, int]:
    from common import run_gloo_ranks

    return run_gloo_ranks(_rank, cp, (args,), threads=1, timeout_s=600)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, nargs=2, default=[2048, 4096])
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.seq = [512, 1024]
    cfg = model_config(args)
    rows = {
        "cp=1 stock": {s: layer_bytes(cfg, s, args.batch, None, "stock", args.recompute) for s in args.seq},
        "cp=1 cp-attn": {s: layer_bytes(cfg, s, args.batch, None, "cp", args.recompute) for s in args.seq},
    }
    for cp in (2, 4):
        rows[f"cp={cp}"] = run_cp(cp, args)
    s1, s2 = args.seq
    base = rows["cp=1 stock"][s2] / s2
    print(
        f"one decoder layer, H={args.hidden}, heads {args.heads} over {args.kv_heads} kv heads, B={args.batch}, fp32, "
        f"recompute={args.recompute}; saved bytes per cp rank"
    )
    print(f"| layout | S={s1} MiB | S={s2} MiB | bytes/token (S={s2}) | linear in S | longest S vs cp=1 stock |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        per_tok = r[s2] / s2
        linear = abs(r[s2] / r[s1] - s2 / s1) < 0.02 * s2 / s1
        print(
            f"| {name} | {r[s1] / 2**20:.2f} | {r[s2] / 2**20:.2f} | {per_tok:.0f} | {'yes' if linear else 'no'} | {base / per_tok:.2f}x |"
        )


if __name__ == "__main__":
    main()
