"""Benchmark: TorchEngine vs HF transformers ``generate`` on the same weights, and refit vs a plain copy.

Not a test. Both sides get the same weights (our parameter names equal HF's: strict load), the
same dtype, the same prompts; greedy with every stop token disabled, so both generate the full
length; runs alternate between the two (after one warm-up each) and the table shows medians.

CPU (default): tiny Llama (hidden 256, 4 layers, 8 heads, vocab 32000), prompt 64, 128 new
tokens, batch 1, 8, 32, 128, in float32 and in bfloat16 (both sides in the same dtype on each
row). The refit row times ``refit`` (bucketed update_weights) against ``param.copy_``. Each
row also shows a floor: the same weights through only the step's GEMMs plus one read of the
KV cache per step (``cpu_floor``), and floor / HF, the most any engine built from these GEMMs
could gain over HF here.

GPU (``--gpu``, used by benchmarks/gpu_suite.sh): a ~1.1B Llama (TinyLlama-1.1B dims, GQA 32/4
heads) in bf16 on CUDA, prompt 128, 256 new tokens, TorchEngine with CUDA-graph decode against
HF generate (static shapes are not forced on HF: its default dynamic cache), and against the
memory-bandwidth bound. Four engine variants (``GPU_ENGINES``): the static scheduler with CUDA-graph
decode, the continuous scheduler (the default), each also with ``compile="on"``; each gets its own
copy of the weights and one warm-up call at the largest batch, whose time (capture, compile) is
printed. Against the bound: every decode step reads every weight once, so tokens/s <= batch x
(measured device copy bandwidth) / (weight bytes). KV-cache reads are not in the bound.

    python benchmarks/generation.py                 # CPU, batch 1, 8, 32, 128, fp32 and bf16
    python benchmarks/generation.py --quick         # CPU, batch 1, 8; prompt 32, 32 new tokens
    python benchmarks/generation.py --gpu           # CUDA, 1.1B, batch 1, 8, 32, 64
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from aligner.config import ModelConfig, SamplingConfig  # noqa: E402
from aligner.model.llama import build_model  # noqa: E402
from aligner.rollout.torch_engine.engine import TorchEngine  # noqa: E402
from aligner.rollout.weight_sync.refit import refit  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_hf(model, ids: torch.Tensor, new: int) -> float:
    _sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )
    _sync()
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return dt


def time_ours(engine: TorchEngine, prompts: list[list[int]], new: int) -> float:
    _sync()
    t0 = time.perf_counter()
    gens = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=new))
    _sync()
    dt = time.perf_counter() - t0
    assert all(len(g.token_ids) == new for g in gens)
    return dt


def compare(engine: TorchEngine, hf, ids: torch.Tensor, new: int, repeats: int) -> tuple[float, float]:
    """(ours tok/s, HF tok/s): medians over `repeats` alternating runs after one warm-up each."""
    prompts = ids.tolist()
    time_ours(engine, prompts, new), time_hf(hf, ids, new)
    t_ours, t_hf = [], []
    for _ in range(repeats):  # alternate so drift hits both alike
        t_ours.append(time_ours(engine, prompts, new))
        t_hf.append(time_hf(hf, ids, new))
    b = ids.shape[0]
    return b * new / statistics.median(t_ours), b * new / statistics.median(t_hf)


def cpu_floor(engine: TorchEngine, batch: int, context: int, steps: int, repeats: int) -> float:
    """tok/s of a loop doing only what a decode step cannot avoid: the engine's own weights through
    the same GEMMs (fused q/k/v, o, fused gate/up, down, head) and one read of each layer's K and
    V cache at `context` slots (the mean over the run). No attention math, norms, RoPE,
    sampling or Python bookkeeping: the GEMM-and-memory floor of this machine for this model."""
    model, cfg = engine.model, engine.cfg
    dtype, hd = engine.dtype, cfg.resolved_head_dim
    weights = [
        (l.self_attn.q_proj.packed[0], l.self_attn.o_proj.weight, l.mlp.gate_proj.packed[0], l.mlp.down_proj.weight)
        for l in model.model.layers.values()
    ]
    kv = [torch.randn(batch, cfg.num_kv_heads, context, hd).to(dtype) for _ in range(2 * len(weights))]
    x = torch.randn(batch, cfg.hidden_size).to(dtype)

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            h = x
            for i, (w_qkv, w_o, w_gu, w_down) in enumerate(weights):
                qkv = F.linear(h, w_qkv)
                kv[2 * i].sum(), kv[2 * i + 1].sum()
                h = h + F.linear(qkv[:, : w_o.shape[1]], w_o)
                h = h + F.linear(F.linear(h, w_gu)[:, : w_down.shape[1]], w_down)
            F.linear(h, model.lm_head.weight)
        return time.perf_counter() - t0

    with torch.inference_mode():
        run()
        return batch * steps / statistics.median(run() for _ in range(repeats))


def cpu_main(args) -> None:
    prompt_len, new = (32, 32) if args.quick else (64, 128)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1, 8] if args.quick else [1, 8, 32, 128])
    repeats = 2 if args.quick else args.repeats
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    cfg = ModelConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=8, max_seq_len=prompt_len + new
    )
    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(f"prompt {prompt_len}, new {new}, greedy, repeats {repeats} (medians)")
    print(
        f"{'dtype':>9} {'batch':>6} {'HF tok/s':>10} {'ours tok/s':>11} {'ratio':>6} {'floor tok/s':>12} {'ours/floor':>11} {'floor/HF':>9}",
        flush=True,
    )
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        ours = build_model(cfg, seed=0).eval().to(getattr(torch, dtype))
        hf = C.hf_llama(cfg, {k: v.clone() for k, v in ours.state_dict().items()})
        engine = TorchEngine(ours, max_batch_size=max(batches))
        for b in batches:
            ids = torch.randint(1, cfg.vocab_size, (b, prompt_len), generator=g)
            our_tps, hf_tps = compare(engine, hf, ids, new, repeats)
            floor = cpu_floor(engine, b, prompt_len + new // 2, new, repeats)
            print(
                f"{dtype:>9} {b:>6} {hf_tps:>10.0f} {our_tps:>11.0f} {our_tps / hf_tps:>5.2f}x {floor:>12.0f} "
                f"{100 * our_tps / floor:>10.0f}% {floor / hf_tps:>8.2f}x",
                flush=True,
            )
        del hf
    # refit vs plain copy of the same bytes (fp32 trainer -> fp32 engine)
    engine = TorchEngine(build_model(cfg, seed=0).eval())
    trainer = build_model(cfg, seed=1)
    t_refit, t_copy = [], []
    for _ in range(repeats):
        t_refit.append(refit(trainer, engine, bucket_mb=256).seconds)
        t0 = time.perf_counter()
        with torch.no_grad():
            for p, q in zip(engine.model.parameters(), trainer.parameters()):
                p.copy_(q)
        t_copy.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    r, c = statistics.median(t_refit), statistics.median(t_copy)
    print(f"refit {nbytes / 2**20:.1f} MiB: {r * 1e3:.1f} ms (plain copy {c * 1e3:.1f} ms, ratio {r / c:.2f}x)")


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth, bytes/s counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 20 * nbytes / (start.elapsed_time(end) / 1e3)


GPU_ENGINES = {  # column name -> TorchEngine options (every engine gets its own copy of the weights)
    "static": dict(scheduler="static", cuda_graphs=True, compile="off"),
    "continuous": dict(scheduler="continuous", compile="off"),
    "cont+fused": dict(scheduler="continuous", compile="off", fused_decode=True),  # packed q/k/v, gate/up (off by default on CUDA)
    "cont+compile": dict(scheduler="continuous", compile="on"),
    "static+compile": dict(scheduler="static", cuda_graphs=True, compile="on"),
}


def gpu_main(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA")
    torch.manual_seed(0)
    prompt_len, new = 128, 256
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, 8, 32, 64]
    names = args.engines.split(",") if args.engines else list(GPU_ENGINES)
    cfg = ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        max_seq_len=prompt_len + new,
    )
    model = build_model(cfg, seed=0, device="cuda").to(torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth()
    hf = C.hf_llama(cfg, {k: v.clone() for k, v in model.state_dict().items()})
    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(
        f"{cfg.num_parameters() / 1e9:.2f}B params, {weight_bytes / 1e9:.2f} GB of bf16 weights; copy bandwidth "
        f"{bw / 1e9:.0f} GB/s (read + write); prompt {prompt_len}, {new} new tokens, greedy, {args.repeats} repeats"
    )
    print("engines: " + "; ".join(f"{n} = TorchEngine({', '.join(f'{k}={v!r}' for k, v in GPU_ENGINES[n].items())})" for n in names))
    engines, first_call = {}, {}
    for n in names:  # build and warm each engine once at the largest batch (compile time shows here)
        ids = torch.randint(4, cfg.vocab_size, (max(batches), prompt_len), device="cuda")
        try:
            eng = TorchEngine(copy.deepcopy(model), max_batch_size=max(batches), **GPU_ENGINES[n])
            first_call[n] = time_ours(eng, ids.tolist(), new)
            engines[n] = eng
        except Exception as e:  # noqa: BLE001  (a variant that fails is reported; the others go on)
            print(f"{n}: FAILED at build or first call: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    print(
        "first call at batch "
        + str(max(batches))
        + " (includes capture / compile): "
        + ", ".join(f"{n} {t:.1f} s" for n, t in first_call.items())
    )
    head = f"{'batch':>5} {'bound tok/s':>12} {'HF tok/s':>9}" + "".join(f" {n + ' tok/s':>20} {'of bound':>8} {'/HF':>6}" for n in engines)
    print(head, flush=True)
    for b in batches:
        ids = torch.randint(4, cfg.vocab_size, (b, prompt_len), device="cuda")
        rate = compare_many(engines, hf, ids, new, args.repeats)
        bound = b * bw / weight_bytes
        row = f"{b:>5} {bound:>12,.0f} {rate['HF']:>9,.0f}"
        row += "".join(f" {rate[n]:>20,.0f} {100 * rate[n] / bound:>7.0f}% {rate[n] / rate['HF']:>5.2f}x" for n in engines)
        print(row, flush=True)
    print("(times include the prefill of the prompt; the bound counts decode weight reads only)")


def compare_many(engines: dict, hf, ids: torch.Tensor, new: int, repeats: int) -> dict[str, float]:
    """tok/s per engine name and for "HF": medians over `repeats` runs alternating all of them, after one warm-up each."""
    prompts = ids.tolist()
    runs = {n: (lambda e=e: time_ours(e, prompts, new)) for n, e in engines.items()}
    runs["HF"] = lambda: time_hf(hf, ids, new)
    for f in runs.values():
        f()
    times = {n: [] for n in runs}
    for _ in range(repeats):  # alternate so drift hits all alike
        for n, f in runs.items():
            times[n].append(f())
    return {n: ids.shape[0] * new / statistics.median(t) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU: batch 1 and 8, prompt 32, 32 new tokens, 2 repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=str, default="", help="comma-separated batch sizes")
    ap.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"], help="CPU rows' dtype")
    ap.add_argument("--gpu", action="store_true", help="1.1B Llama on CUDA vs the bandwidth bound and HF")
    ap.add_argument(
        "--engines", type=str, default="", help=f"--gpu: comma-separated engine variants of {', '.join(GPU_ENGINES)} (default all)"
    )
    args = ap.parse_args()
    if args.gpu:
        return gpu_main(args)
    C.as_cpu_worker()
    cpu_main(args)


if __name__ == "__main__":
    main()
