"""The planner's rollout (decode) time model against measurements: the fit of its per-step overhead, and
NeMo-Aligner's published Llama 3 70B PPO step times.

Two parts (issue 40, "Planner II", part 2):

1. ``--fit``: the decode overhead per decoder layer per step, fitted to aligner's own GPU
   measurements (benchmarks/RESULTS.md, "GPU suite (H200, 2026-11-26)" and
   benchmarks/gpu_results_2026-11-22_h100.txt): a 1.10B Llama (hidden 2048, 22 layers, 32 heads /
   4 KV heads, intermediate 5632, vocab 32000) in bf16, TorchEngine's static scheduler with CUDA
   graphs, prompt 128, 256 new tokens, greedy, times including the prefill. Each measured call is
   prefill + 256 decode steps; a step is the planner's roofline (weights + the whole KV cache over
   the copy bandwidth, or FLOPs over peak x efficiency) plus 22 x the overhead. The least-squares
   constant over the eight rows (one additive unknown: the mean of the per-row constants) is what
   ``aligner.planner.cost_model.DECODE_OVERHEAD_S_PER_LAYER`` holds; the residuals are printed.

2. (default) NeMo-Aligner's TensorRT-LLM PPO scaling table (NVIDIA/NeMo-Aligner/docs/user-guide/rlhf.rst, "PPO Performance
   Results with TensorRT-LLM"): Llama 3 70B actor and reward model, Helpsteer2 prompts,
   num_rollout_samples=1024, global_batch_size=128, reshard on (inference TP only), the engine kept
   on the GPU, rollout_micro_batch_size 8 (16 at 64 + 32 nodes). Published per scale: actor + critic
   nodes, mean tokens generated per response, step seconds. The settings the table does not state are
   NeMo-Aligner's defaults (examples/nlp/gpt/conf/gpt_ppo_actor.yaml): encoder_seq_length 4096,
   length_params.max_length = 4096 / 2 = 2048, trt_llm.max_input_len 1024; its generation runs
   static batches of rollout_micro_batch_size per data-parallel worker. The planner is evaluated at
   the published node split (not the split it would choose), with the mean response length set to
   the published tokens generated and the longest response of a batch left at max_length (the
   table gives no tail). Nothing here is fitted to these rows.

Runs on the CPU in seconds; on code without ``rollout.expected_response_len`` (before issue 40
part 2) it plans the max length, as that code did.

    python benchmarks/planner_validation.py          # the validation table
    python benchmarks/planner_validation.py --fit    # the overhead fit and its residuals
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aligner.cli import load_config  # noqa: E402
from aligner.config import ModelConfig, RolloutConfig  # noqa: E402
from aligner.planner import (  # noqa: E402
    GB,
    MODEL_FLOPS_EFFICIENCY,
    forward_flops_per_token,
    kv_cache_bytes,
    plan_role,
    ppo_step_seconds,
    role_works,
)

# ---- part 1: aligner's decode measurements -------------------------------------------------

# benchmarks/RESULTS.md / gpu_results_*: static scheduler, CUDA graphs, bf16; batch -> tok/s
MEASURED = {
    "H200 (2026-11-26)": (4245.0, {1: 337, 8: 2434, 32: 9015, 64: 16464}),  # copy bandwidth GB/s, rows
    "H100 (2026-11-22)": (3012.0, {1: 318, 8: 2303, 32: 8530, 64: 15674}),
}
PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM and H200 alike
PROMPT, NEW = 128, 256
TINY_LLAMA = ModelConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4, max_seq_len=PROMPT + NEW
)


def roofline_parts(batch: int, bw_gbps: float) -> tuple[float, float]:
    """(prefill seconds, decode roofline seconds per step) of one measured call, by the planner's formulas."""
    m = TINY_LLAMA
    n = m.num_parameters()
    prefill = forward_flops_per_token(n, m, PROMPT) * batch * PROMPT / (PEAK_TFLOPS * 1e12 * MODEL_FLOPS_EFFICIENCY)
    kv = kv_cache_bytes(m, 2, 1, 1, batch, PROMPT + NEW)  # the graphed step reads the whole cache under a mask
    flops_s = 2.0 * n * batch / (PEAK_TFLOPS * 1e12 * MODEL_FLOPS_EFFICIENCY)
    return prefill, max((2 * n + kv) / (bw_gbps * GB), flops_s)


def fit_overhead() -> tuple[float, list[tuple[str, int, float, float]]]:
    """(overhead seconds per layer per step, rows of (gpu, batch, measured tok/s, predicted tok/s)).

    The constant minimising the squared error of the per-step time over all rows: the mean of each
    row's (measured step - roofline) / layers."""
    per_row = []
    for gpu, (bw, rows) in MEASURED.items():
        for b, tps in rows.items():
            prefill, roof = roofline_parts(b, bw)
            step = (b * NEW / tps - prefill) / NEW
            per_row.append((gpu, b, tps, (step - roof) / TINY_LLAMA.num_layers))
    c = sum(r[3] for r in per_row) / len(per_row)
    out = []
    for gpu, b, tps, _ in per_row:
        prefill, roof = roofline_parts(b, MEASURED[gpu][0])
        t = prefill + NEW * (roof + TINY_LLAMA.num_layers * c)
        out.append((gpu, b, tps, b * NEW / t))
    return c, out


def print_fit() -> None:
    c, rows = fit_overhead()
    print(
        f"fitted decode overhead: {c * 1e6:.1f} us per decoder layer per step ({TINY_LLAMA.num_layers * c * 1e3:.2f} ms per step of 22 layers)"
    )
    for gpu in MEASURED:
        cg = fit_one(gpu)
        print(f"{gpu}: fitted alone {cg * 1e6:.1f} us")
    print(f"{'GPU':<18} {'batch':>5} {'measured tok/s':>15} {'predicted tok/s':>16} {'residual':>9}")
    for gpu, b, tps, pred in rows:
        print(f"{gpu:<18} {b:>5} {tps:>15,} {pred:>16,.0f} {100 * (pred / tps - 1):>8.1f}%")


def fit_one(gpu: str) -> float:
    """The overhead fitted to one GPU's rows alone (seconds per layer per step)."""
    bw, rows = MEASURED[gpu]
    cs = []
    for b, tps in rows.items():
        prefill, roof = roofline_parts(b, bw)
        cs.append(((b * NEW / tps - prefill) / NEW - roof) / TINY_LLAMA.num_layers)
    return sum(cs) / len(cs)


# ---- part 2: NeMo-Aligner's published Llama 3 70B PPO rows ---------------------------------

# (actor nodes, critic nodes, mean tokens generated, step seconds, rollout_micro_batch_size)
PUBLISHED = [(8, 4, 350.7, 366.7, 8), (16, 8, 323.3, 190.4, 8), (32, 16, 331.7, 108.0, 8), (64, 32, 334.0, 56.9, 16)]
LLAMA3_70B = [  # Llama 3 70B's dimensions on the llama2_70b preset (HF config.json of Meta-Llama-3-70B)
    "conf=llama2_70b",
    "model.vocab_size=128256",
    "model.max_seq_len=8192",
    "model.rope_theta=500000.0",
]
NEMO_ALIGNER_SETTINGS = [
    "data.max_prompt_len=1024",  # trt_llm.max_input_len default
    "data.max_seq_len=3072",  # prompt + max_length
    "rollout.sampling.max_new_tokens=2048",  # length_params.max_length = encoder_seq_length // 2
    "trainer.rollout_batch_size=1024",  # num_rollout_samples
    "trainer.n_samples_per_prompt=1",
    "trainer.mini_batch_size=128",  # global_batch_size
    "trainer.micro_batch_size=1",
    "rollout.scheduler=static",  # TRT-LLM batches of rollout_micro_batch_size per worker
    "rollout.dtype=bfloat16",
    "cluster.gpus_per_node=8",
    "cluster.gpu_mem_gb=80",
]


def has_length_fields() -> bool:
    return "expected_response_len" in {f.name for f in dataclasses.fields(RolloutConfig)}


def plan_at_split(cfg, actor_nodes: int, critic_nodes: int) -> tuple[float, float]:
    """(step seconds, rollout seconds) of the planner's best layouts on the given node split."""
    g = cfg.cluster.gpus_per_node
    roles = {}
    for w in role_works(cfg):
        nodes = actor_nodes if w.group == "actor" else critic_nodes
        p = plan_role(cfg.model, w, nodes * g, cfg.cluster)
        if p.best is None:
            raise SystemExit(f"{w.role} does not fit on {nodes} nodes: {p.rejected[0].reason if p.rejected else '?'}")
        roles[w.role] = p
    rollout = sum(p.best.time.total_s for p in roles.values() if p.work.mode == "generate")
    return ppo_step_seconds(roles, True), rollout


def plan_row(a: int, c: int, mean: float, mbs: int, tail: float) -> tuple[float, float]:
    """(step, rollout) seconds planned for one published scale; tail 0 = max_length (or no length fields)."""
    extra = [f"cluster.num_nodes={a + c}", f"rollout.max_batch_size={mbs}"]
    if has_length_fields():
        extra += [f"rollout.expected_response_len={mean}", f"rollout.expected_response_len_max={tail}"]
    return plan_at_split(load_config("ppo", LLAMA3_70B + NEMO_ALIGNER_SETTINGS + extra), a, c)


def print_validation() -> None:
    """The published rows against the plan: longest response of a batch = max_length (the default),
    and = the mean (every response equally long: the least decode a static batch can take)."""
    print("NeMo-Aligner Llama 3 70B PPO (TensorRT-LLM), published vs planned at the published split")
    if has_length_fields():
        print("mean response = published tokens generated; longest of a batch = max_length 2048 (A) or = the mean (B)")
        cols = (0.0, None)
    else:
        print("this code plans max_length (2048) for every response")
        cols = (0.0,)
    head = f"{'nodes':>7} {'published s':>11}"
    for name in "AB"[: len(cols)]:
        head += f" {'planned ' + name:>9} {'ratio':>6} {'rollout':>8}"
    print(head)
    for a, c, mean, step, mbs in PUBLISHED:
        row = f"{a:>3}+{c:<3} {step:>11.1f}"
        for tail in cols:
            t, roll = plan_row(a, c, mean, mbs, mean if tail is None else tail)
            row += f" {t:>9.1f} {t / step:>5.2f}x {100 * roll / t:>7.0f}%"
        print(row)
    print("(rollout: the rollout engine's share of the planned step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="print the decode-overhead fit and its residuals")
    args = ap.parse_args()
    print_fit() if args.fit else print_validation()


if __name__ == "__main__":
    main()
