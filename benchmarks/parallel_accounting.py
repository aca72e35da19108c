"""Print per-layer communication and activation-memory accounting for TP / SP / recomputation.

    python benchmarks/parallel_accounting.py [--seq 64] [--batch 2] [--hidden 128] [--heads 4] [--kv-heads 4] [--ffn 352] [--precision bf16]

Spawns 2 gloo ranks (tp_size 2) and a single-process baseline; for each of none /
selective / full recomputation, without and with TP+SP, prints bytes saved for backward
by one decoder layer (measured with saved_tensors_hooks, storages counted once), the
Llama-adjusted formula (aligner.parallel.memory) and Korthikanti et al. 2022's GPT
formula in 16-bit and Megatron-LM's estimator (theoretical_memory_usage.py: s b h (18 + 4 ffn / h) / t,
2-byte activations, for SP with selective recomputation), with the ratios; then the collectives of one
layer forward/backward. ``--precision bf16`` runs the layer in bf16 (FSDP2's bf16 mixed precision).

Why the paper's formula differs from ours (measured / paper is printed; measured /
adjusted should be 1.00): fp32 activations (4 bytes, paper 2) unless --precision bf16; no
dropout (paper: 2 sbh of masks + as^2b softmax-dropout mask); the fused SDPA kernel saves a
logsumexp (a*s*b) and a float additive mask (b*s^2) instead of the softmax and its dropout output
(4as^2b); SwiGLU saves 3 tensors of s*b*i (gate, up and the down projection's input; i ~ 8h/3)
where GeLU saves 2 of 4sbh; RMSNorm saves its input and one fp32 statistic per row, as a fused
LayerNorm does.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repo root: tests.toolkit.spawn

MODES = ("none", "selective", "full")


def _measure(args, tp_group, sp: bool) -> dict:
    from aligner.config import ModelConfig
    from aligner.model.llama import build_model
    from aligner.parallel.memory import layer_comm, layer_saved_bytes
    from aligner.parallel.parallelize import apply_recompute
    from aligner.parallel.tensor_parallel import apply_tensor_parallel

    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_layers=1,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_seq_len=args.seq,
    )
    model = apply_tensor_parallel(build_model(cfg, seed=0), tp_group, sequence_parallel=sp)
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    out = {}
    for mode in MODES:
        apply_recompute(model, mode)
        out[mode] = layer_saved_bytes(model, args.batch, args.seq)
    apply_recompute(model, "none")
    fwd = layer_comm(model, args.batch, args.seq)
    both = layer_comm(model, args.batch, args.seq, backward=True)
    out["comm"] = (dict(fwd.calls), dict(fwd.elements), dict(both.calls), dict(both.elements))
    return out


def _tp_worker(rank: int, world_size: int, args) -> dict:
    import torch.distributed as dist

    from aligner.parallel.dims import ParallelDims

    dims = ParallelDims(tp_size=world_size, world_size=world_size, rank=dist.get_rank()).build()
    return {sp: _measure(args, dims.tp_group, sp) for sp in (False, True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=352)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = p.parse_args()
    from aligner.parallel.memory import LayerDims, korthikanti_bytes, layer_activation_bytes
    from tests.toolkit.spawn import run_distributed

    single = _measure(args, None, False)
    tp = run_distributed(_tp_worker, world_size=2, args=(args,))[0]
    s, b, h, a, i = args.seq, args.batch, args.hidden, args.heads, args.ffn
    print(f"one decoder layer, s={s} b={b} h={h} a={a} kv={args.kv_heads} i={i}, {args.precision}; bytes saved for backward per rank")
    head = f"{'layout':<12}{'recompute':<11}{'measured':>11}{'adjusted':>11}{'meas/adj':>9}{'paper16':>11}{'meas/paper':>11}"
    print(head + f"{'megatron':>11}{'meas/meg':>9}")
    for name, t, sp, res in (("t=1", 1, False, single), ("t=2", 2, False, tp[False]), ("t=2 + SP", 2, True, tp[True])):
        d = LayerDims(s=s, b=b, h=h, a=a, i=i, t=t, kv=args.kv_heads)
        megatron = s * b * h * (18 + 4 * i / h) / t
        for mode in MODES:
            adj = layer_activation_bytes(d, args.precision, sp, mode)
            paper = korthikanti_bytes(d, sp, mode)
            print(
                f"{name:<12}{mode:<11}{res[mode]:>11,}{adj:>11,.0f}{res[mode] / adj:>9.2f}{paper:>11,.0f}{res[mode] / paper:>11.2f}"
                f"{megatron:>11,.0f}{res[mode] / megatron:>9.2f}"
            )
    bth = b * s * h
    print(f"\ncollectives of one layer (tp=2), elements in units of B*T*H = {bth}:")
    for sp in (False, True):
        fc, fe, bc, be = tp[sp]["comm"]
        print(f"  {'SP ' if sp else 'TP '} forward: " + ", ".join(f"{k} x{fc[k]} ({fe[k] / bth:g})" for k in sorted(fc)))
        print("      fwd+bwd: " + ", ".join(f"{k} x{bc[k]} ({be[k] / bth:g})" for k in sorted(bc)))
    print(
        "(forward: 2 all-reduces, or all-gather + reduce-scatter of the same total volume; with SP the backward\n"
        " re-gathers each linear input shard instead of saving the gathered input, Korthikanti et al. sec. 4.2.2)"
    )


if __name__ == "__main__":
    main()
