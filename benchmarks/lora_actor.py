"""Benchmark: the PPO actor with LoRA vs full fine-tuning: training-state memory, step time, refit bytes.

Same run config on both sides: the benchmark Llama (hidden 256, 4 layers, vocab 32000, fp32,
``common.tiny_model_cfg``), a Policy on one process (tp = pp = dp = 1), the same PPO batch
(8 sequences of 64 prompt + 64 response tokens, micro-batch 4). LoRA: rank 8, alpha 16 on
q_proj, v_proj (PEFT's Llama default) unless told otherwise.

- memory: bytes of the parameters, their gradients (after one ``ppo_update``'s backward, before
  ``zero_grad``: measured from a step whose optimizer.step is replayed manually) and every tensor
  in ``optimizer.state``, counted from the storages;
- step time: ``Policy.ppo_update`` (forward, backward, clipping, AdamW), the two sides alternating
  after one warm-up each; medians;
- refit bytes: what :func:`aligner.rollout.weight_sync.refit.refit` hands the engine on a full refit and on the
  following LoRA refits (merged weights of the adapted linears only).

    python benchmarks/lora_actor.py                  # 5 alternating repeats
    python benchmarks/lora_actor.py --repeats 3 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
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


def policy(mc, lora_cfg):
    from aligner.actor.policy import Policy
    from aligner.config import OptimConfig, ParallelConfig
    from aligner.parallel.dims import ParallelDims

    optim = OptimConfig(lr=1e-5, warmup_steps=0, schedule="constant")
    return Policy(mc, ParallelConfig(dp_backend="ddp"), optim, ParallelDims(), total_steps=10_000, seed=0, lora=lora_cfg)


def batch(mc):
    from aligner.protocol import build_sequences

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, mc.vocab_size, (64,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(4, mc.vocab_size, (64,), generator=g).tolist() for _ in range(8)]
    seq = build_sequences(prompts, responses, pad_id=0)
    mask = seq["response_mask"]
    return {k: seq[k] for k in ("input_ids", "prompt_lens", "response_mask")} | {
        "advantages": torch.randn(mask.shape, generator=g) * mask,
        "old_log_probs": (torch.randn(mask.shape, generator=g) * 0.1 - 10.0) * mask,
    }


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def memory(pol, b) -> tuple[int, int, int, int]:
    """(trainable params, weight bytes, grad bytes, optimizer-state bytes) after a PPO step's backward."""
    from aligner.config import AlgorithmConfig

    rt = pol.runtime
    pol.ppo_update(b, AlgorithmConfig(), 4)  # creates the AdamW state
    rt.model.train()
    out = rt(b["input_ids"])  # one more backward to hold gradients (ppo_update drops them at its end)
    out.float().logsumexp(-1).mean().backward()
    params = list(rt.module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for st in rt.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    n_train = sum(p.numel() for p in params if p.requires_grad)
    sizes = (n_train, _bytes(params), _bytes(grads), _bytes(state))
    rt.zero_grad()
    return sizes


def refit_bytes(pol, mc) -> tuple[int, int]:
    """(bytes of the first, full refit; bytes of a LoRA refit after it) into a TorchEngine."""
    from aligner.model.llama import build_model
    from aligner.nn.lora import has_adapters
    from aligner.rollout.torch_engine.engine import TorchEngine
    from aligner.rollout.weight_sync.refit import refit

    engine = TorchEngine(build_model(mc, seed=1).eval())
    first = refit(pol.runtime.module, engine, bucket_mb=256).bytes
    later = refit(pol.runtime.module, engine, bucket_mb=256, adapted_only=has_adapters(pol.runtime.module)).bytes
    return first, later


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="alternating timed ppo_updates per side")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--targets", default="q_proj,v_proj")
    args = ap.parse_args()
    C.as_cpu_worker()
    from aligner.config import AlgorithmConfig, LoraConfig

    mc = C.tiny_model_cfg()
    lcfg = LoraConfig(rank=args.rank, alpha=args.alpha, target_modules=args.targets.split(","))
    sides = {"full": policy(mc, None), f"lora r={args.rank}": policy(mc, lcfg)}
    b = batch(mc)
    print(C.env_line())
    print(C.command_line())
    n = sum(p.numel() for p in sides["full"].runtime.module.parameters())
    print(f"model: hidden {mc.hidden_size}, {mc.num_layers} layers, vocab {mc.vocab_size}: {n:,} parameters, fp32; LoRA on {args.targets}")
    print(f"{'side':<12} {'trainable':>12} {'weights MiB':>12} {'grads MiB':>10} {'optim MiB':>10} {'g+o MiB':>9} {'w+g+o MiB':>10}")
    mib = 2**20
    for name, pol in sides.items():
        t, w, g, o = memory(pol, b)
        print(f"{name:<12} {t:>12,} {w / mib:>12.2f} {g / mib:>10.3f} {o / mib:>10.3f} {(g + o) / mib:>9.3f} {(w + g + o) / mib:>10.2f}")
    for name, pol in sides.items():
        first, later = refit_bytes(pol, mc)
        print(f"refit bytes {name:<12} first {first:>12,}   each later step {later:>12,}")
    times: dict[str, list[float]] = {k: [] for k in sides}
    for pol in sides.values():  # warm-up
        pol.ppo_update(b, AlgorithmConfig(), 4)
    for _ in range(args.repeats):
        for name, pol in sides.items():
            t0 = time.perf_counter()
            pol.ppo_update(b, AlgorithmConfig(), 4)
            times[name].append(time.perf_counter() - t0)
    med = {k: C.median(v) for k, v in times.items()}
    for name in sides:
        print(f"ppo_update {name:<12} median {med[name]:.3f} s over {args.repeats} (all: {', '.join(f'{t:.3f}' for t in times[name])})")
    names = list(sides)
    print(f"LoRA / full step time: {med[names[1]] / med[names[0]]:.2f}x")


if __name__ == "__main__":
    main()
