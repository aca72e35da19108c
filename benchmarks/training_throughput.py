"""Benchmark: training tokens/s of aligner's Llama vs HF transformers' LlamaForCausalLM, alternating.

What is measured: wall time of one training step (forward, next-token NLL, backward, AdamW
step) on the same config, same weights (aligner's parameter names equal HF's, so HF gets our
state dict with a strict load), same batch of random tokens. aligner runs through its real
training path: :class:`aligner.actor.policy.Policy` ``sft_step`` (TrainRuntime + ModelRunner +
vocab-parallel log-probs, single process, fp32 on CPU); HF runs ``model(input_ids,
labels=...)`` + ``loss.backward()`` + ``torch.optim.AdamW.step()`` in a child process (each side
has its own heap, as in the TRL benchmarks; both with the environment of aligner's CPU workers,
which the script re-runs itself in). Runs alternate (aligner, HF, aligner, ...) after one
warm-up step each; tokens/s = batch * seq / median time.

On a GPU (``--gpu``, used by benchmarks/gpu_suite.sh) it instead reports the MFU of aligner's
training step on a Llama of about 1B parameters in bf16:
MFU = 6 * params * tokens / time / peak bf16 FLOP/s (``--peak-tflops``, H100 SXM 989).

    python benchmarks/training_throughput.py            # batch 8 x 256 tokens, 5 repeats
    python benchmarks/training_throughput.py --quick    # batch 4 x 128 tokens, 3 repeats
    python benchmarks/training_throughput.py --gpu      # 1B Llama MFU (CUDA)
    python benchmarks/training_throughput.py --moe      # the same with 8 experts, top-2 (Mixtral's layer)
                                                        # vs HF MixtralForCausalLM (router aux loss on both)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def policy(mc, parallel=None, lr: float = 1e-5):
    from aligner.actor.policy import Policy
    from aligner.config import OptimConfig, ParallelConfig
    from aligner.parallel.dims import ParallelDims

    optim = OptimConfig(lr=lr, warmup_steps=0, schedule="constant", grad_clip=0.0)
    return Policy(mc, parallel or ParallelConfig(), optim, ParallelDims(), total_steps=10_000, seed=0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def model_cfg(args):
    """The benchmark Llama, or with --moe its Mixtral-style twin: 8 experts of width 688, top-2."""
    extra = dict(num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001) if args.moe else {}
    return C.tiny_model_cfg(max_seq_len=max(256, args.seq), **extra)


def _batch(mc, args) -> torch.Tensor:
    return torch.randint(4, mc.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))


def hf_child(args) -> None:
    """The HF side in its own process (its own heap, as TRL's peers): one step per "go" from the driver."""
    import transformers
    from safetensors.torch import load_file

    mc = model_cfg(args)
    if args.moe:  # the HF Mixtral export of the same weights; output_router_logits adds its aux loss as ours does
        hf = transformers.MixtralForCausalLM.from_pretrained(args.sd, output_router_logits=True).train()
    else:
        hf = C.hf_llama(mc, load_file(args.sd), train=True)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ids = _batch(mc, args)
    C.peer_report("@@READY", {"transformers": transformers.__version__})
    while True:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        hf(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        C.peer_report("@@STEP", time.perf_counter() - t0)


def cpu_compare(args) -> None:
    import tempfile

    from safetensors.torch import save_file

    mc = model_cfg(args)
    pol = policy(mc)
    sd = {k: v.detach().clone().contiguous() for k, v in pol.full_state_dict().items()}
    ids = _batch(mc, args)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    tmp = tempfile.TemporaryDirectory()
    if args.moe:
        from aligner.model.hf import save_hf

        save_hf(sd, mc, f"{tmp.name}/hf")
    else:
        save_file(sd, f"{tmp.name}/model.safetensors")
    peer = C.PeerProcess(
        Path(sys.executable),
        [
            str(Path(__file__).resolve()),
            "--peer",
            "hf",
            "--sd",
            f"{tmp.name}/hf" if args.moe else f"{tmp.name}/model.safetensors",
            *(["--moe"] if args.moe else []),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
        ],
    )

    def ours() -> float:
        t0 = time.perf_counter()
        pol.sft_step(batch, micro_batch_size=args.batch)
        return time.perf_counter() - t0

    def theirs() -> float:
        return peer.step()[0]

    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(
        f"model: hidden 256, 4 layers, 8 heads, vocab {mc.vocab_size}, {mc.num_parameters() / 1e6:.1f}M params"
        + (
            f" ({mc.num_experts} experts, top-{mc.num_experts_per_tok}, {mc.num_parameters(active=True) / 1e6:.1f}M active); "
            if args.moe
            else "; "
        )
        + f"batch {args.batch} x {args.seq} tokens, fp32, {args.repeats} repeats after 1 warm-up each",
        flush=True,
    )
    ours(), peer.first()  # warm-up: the peer's first step runs as soon as it is ready
    a, b = [], []
    try:
        for i in range(args.repeats):
            a.append(ours())
            b.append(theirs())
            print(f"  repeat {i}: aligner {a[-1]:.3f} s, HF {b[-1]:.3f} s", flush=True)
    finally:
        peer.close()
        tmp.cleanup()
    tok = args.batch * args.seq
    ta, tb = tok / C.median(a), tok / C.median(b)
    print(f"aligner {ta:,.0f} tok/s, HF {tb:,.0f} tok/s, ratio {ta / tb:.2f}x (goal >= 1.0x: {'met' if ta >= tb else 'not met'})")
    if args.profile:  # aligner's side only: HF runs in its own process
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ours()
        print("--- aligner: top ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def gpu_mfu(args) -> None:
    from aligner.config import ModelConfig, ParallelConfig

    # ~1.1B parameters: Llama shape (TinyLlama-1.1B dims, GQA 32/4 heads), vocab 32000. The policy
    # places itself on the GPU (ParallelDims.device) and its runner moves the batch there.
    mc = ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        max_seq_len=args.seq,
        dtype="float32",
    )
    pol = policy(mc, ParallelConfig(mixed_precision="bf16"))
    assert pol.runtime.device.type == "cuda", pol.runtime.device
    ids = torch.randint(4, mc.vocab_size, (args.batch, args.seq))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    for _ in range(2):
        pol.sft_step(batch, micro_batch_size=args.micro)
    sync()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        stats = pol.sft_step(batch, micro_batch_size=args.micro)
        sync()
        times.append(time.perf_counter() - t0)
    t = C.median(times)
    params = mc.num_parameters()
    tokens = args.batch * args.seq
    mfu = 6 * params * tokens / t / (args.peak_tflops * 1e12)
    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(
        f"model {params / 1e9:.2f}B params, batch {args.batch} x {args.seq}, micro {args.micro}, bf16 mixed precision "
        f"(fp32 master weights), loss {stats['loss']:.3f}, peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )
    print(
        f"training step median {t:.3f} s, {tokens / t:,.0f} tok/s, MFU {100 * mfu:.1f}% "
        f"(6 * params * tokens / time / {args.peak_tflops} TFLOP/s; attention FLOPs not counted)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 4 x 128, 3 repeats")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="torch.profiler top ops of one step each")
    ap.add_argument("--gpu", action="store_true", help="1B Llama MFU on CUDA instead of the CPU comparison")
    ap.add_argument("--moe", action="store_true", help="8 experts, top-2, vs HF MixtralForCausalLM (CPU comparison)")
    ap.add_argument("--micro", type=int, default=4, help="--gpu: micro-batch size")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="--gpu: dense bf16 peak, TFLOP/s")
    ap.add_argument("--peer", default="", help=argparse.SUPPRESS)  # child mode: "hf"
    ap.add_argument("--sd", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer == "hf":
        return hf_child(args)
    if args.quick:
        args.batch, args.seq, args.repeats = 4, 128, 3
    if not args.gpu:
        C.as_cpu_worker()
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs CUDA")
        if args.batch == 8 and args.seq == 256:
            args.batch, args.seq = 16, 2048
        gpu_mfu(args)
    else:
        cpu_compare(args)


if __name__ == "__main__":
    main()
