"""Benchmark: TorchEngine vs HF transformers ``generate`` on the same weights, and refit vs a plain copy.

Not a test. Tiny Llama (hidden 256, 4 layers, 8 heads, vocab 32000), prompt 64 tokens,
128 new tokens, greedy with every stop token disabled (both generate the full length),
runs alternate between the two engines and the table shows medians over repeats:

    python benchmarks/generation.py            # batch 1, 8, 32, 128
    python benchmarks/generation.py --quick    # batch 1, 8; prompt 32, 32 new tokens

Our parameter names equal HF's, so HF's LlamaForCausalLM gets our state dict directly
(strict load). The refit row times ``refit`` (bucketed update_weights) against
``param.copy_`` of the same tensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from aligner.config import ModelConfig, SamplingConfig
from aligner.model.llama import build_model
from aligner.rollout.refit import refit
from aligner.rollout.torch_engine import TorchEngine


def hf_model(cfg: ModelConfig, sd: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(hf_cfg).eval()
    model.load_state_dict(sd, strict=True)
    return model


def time_hf(model, ids: torch.Tensor, new: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return dt


def time_ours(engine: TorchEngine, prompts: list[list[int]], new: int) -> float:
    t0 = time.perf_counter()
    gens = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=new))
    dt = time.perf_counter() - t0
    assert all(len(g.token_ids) == new for g in gens)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 and 8, prompt 32, 32 new tokens, 2 repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=str, default="")
    args = ap.parse_args()
    prompt_len, new = (32, 32) if args.quick else (64, 128)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1, 8] if args.quick else [1, 8, 32, 128])
    repeats = 2 if args.quick else args.repeats
    cfg = ModelConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=8, max_seq_len=prompt_len + new)
    ours = build_model(cfg, seed=0).eval()
    sd = {k: v.clone() for k, v in ours.state_dict().items()}
    hf = hf_model(cfg, sd)
    engine = TorchEngine(ours, max_batch_size=max(batches))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, prompt {prompt_len}, new {new}, repeats {repeats}, "
          f"load {os.getloadavg()[0]:.2f}, command: python benchmarks/generation.py {' '.join(sys.argv[1:])}")
    print(f"{'batch':>6} {'HF tok/s':>10} {'ours tok/s':>11} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for b in batches:
        ids = torch.randint(1, cfg.vocab_size, (b, prompt_len), generator=g)
        prompts = ids.tolist()
        time_ours(engine, prompts, 4), time_hf(hf, ids, 4)  # warm up
        t_hf, t_ours = [], []
        for _ in range(repeats):  # alternate so drift hits both alike
            t_hf.append(time_hf(hf, ids, new))
            t_ours.append(time_ours(engine, prompts, new))
        hf_tps, our_tps = b * new / statistics.median(t_hf), b * new / statistics.median(t_ours)
        print(f"{b:>6} {hf_tps:>10.0f} {our_tps:>11.0f} {our_tps / hf_tps:>6.2f}x")
    # refit vs plain copy of the same bytes
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


if __name__ == "__main__":
    main()
