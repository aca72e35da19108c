"""The planner against measurements and published runs: the fit of its decode overhead, NeMo-Aligner's
published Llama 3 70B PPO step times, and the validation table of published layouts and times.

Three parts:

1. ``--fit``: the decode overhead per decoder layer per step, fitted to aligner's own GPU
   measurements (benchmarks/RESULTS.md, "GPU suite (H200, 2026-11-26)" and
   benchmarks/gpu_results_2026-11-22_h100.txt): a 1.10B Llama (hidden 2048, 22 layers, 32 heads /
   4 KV heads, intermediate 5632, vocab 32000) in bf16, TorchEngine's static scheduler with CUDA
   graphs, prompt 128, 256 new tokens, greedy, times including the prefill. Each measured call is
   prefill + 256 decode steps; a step is the planner's roofline (weights + the whole KV cache over
   the copy bandwidth, or FLOPs over peak x efficiency) plus 22 x the overhead. The least-squares
   constant over the eight rows (one additive unknown: the mean of the per-row constants) is what
   ``aligner.planner.time_model.DECODE_OVERHEAD_S_PER_LAYER`` holds; the residuals are printed.

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

3. ``--table``: published configurations against the planner, printed as the markdown
   of docs/planner.md's "Validation table": NeMo 24.07's training rows, Narayanan et al. 2021's Table 1,
   NeMo-Aligner's PPO rows (the four above and its Llama 3.1 405B run) and NeMo-RL's dense GRPO rows.
   For each row the published layout as the planner evaluates it (the fields the source gives fixed,
   the others the planner's best for that layout), its memory per GPU against 80 GiB, its rank among
   the planner's feasible layouts and its time relative to the planner's best, and its predicted time
   against the published one; then the goals met and the rows not expressible. Each row's source and
   the settings it leaves out (stated as assumptions) are in the comments at its list below.

Runs on the CPU in seconds (``--table``: about 20 s); on code without ``rollout.expected_response_len``
(before the decode model) part 2 plans the max length, as that code did.

    python benchmarks/planner_validation.py                            # part 2: the 70B PPO table
    python benchmarks/planner_validation.py --fit                      # part 1: the overhead fit and its residuals
    python benchmarks/planner_validation.py --table [--family training|rl]   # part 3: the validation table
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aligner.cli import load_config  # noqa: E402
from aligner.config import ModelConfig, RolloutConfig  # noqa: E402
from aligner.planner import (  # noqa: E402
    GB,
    GIB,
    MODEL_FLOPS_EFFICIENCY,
    Layout,
    LayoutEstimate,
    RolePlan,
    candidate_layouts,
    evaluate_layout,
    forward_flops_per_token,
    gemm_efficiency,
    kv_cache_bytes,
    layers_on_pp_stage,
    plan_role,
    ppo_step_seconds,
    role_flop_parameters,
    role_works,
)
from aligner.planner.cost_model import interleaved_in_flight  # noqa: E402

# ---- part 1: aligner's decode measurements -------------------------------------------------

# benchmarks/RESULTS.md / gpu_results_*: static scheduler, CUDA graphs, bf16; batch -> tok/s
MEASURED = {
    "H200 (2026-11-26)": (4245.0, {1: 337, 8: 2434, 32: 9015, 64: 16464}),  # copy bandwidth GB/s, rows
    "H100 (2026-11-22)": (3012.0, {1: 318, 8: 2303, 32: 8530, 64: 15674}),
}
# The continuous scheduler's decode of the same calls on the same H200, without CUDA graphs (it had none then:
# benchmarks/RESULTS.md, "continuous (eager on CUDA then)"): what DECODE_OVERHEAD_EAGER_S_PER_LAYER is fitted to
MEASURED_EAGER = {"H200 (2026-11-26), eager": (4245.0, {1: 69, 8: 590, 32: 2283, 64: 4967})}
PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM and H200 alike
PROMPT, NEW = 128, 256
TINY_LLAMA = ModelConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4, max_seq_len=PROMPT + NEW
)


def roofline_parts(batch: int, bw_gbps: float) -> tuple[float, float]:
    """(prefill seconds, decode roofline seconds per step) of one measured call, by the planner's formulas."""
    m = TINY_LLAMA
    n = role_flop_parameters(m, "lm")  # untied: the input embedding is a lookup, neither read whole nor multiplied
    prefill = forward_flops_per_token(n, m, PROMPT) * batch * PROMPT / (PEAK_TFLOPS * 1e12 * MODEL_FLOPS_EFFICIENCY)
    kv = kv_cache_bytes(m, 2, 1, 1, batch, PROMPT + NEW)  # the graphed step reads the whole cache under a mask
    flops_s = 2.0 * n * batch / (PEAK_TFLOPS * 1e12 * MODEL_FLOPS_EFFICIENCY)
    return prefill, max((2 * n + kv) / (bw_gbps * GB), flops_s)


def fit_overhead(measured: Optional[dict] = None) -> tuple[float, list[tuple[str, int, float, float]]]:
    """(overhead seconds per layer per step, rows of (gpu, batch, measured tok/s, predicted tok/s)).

    The constant minimising the squared error of the per-step time over all rows of `measured` (MEASURED,
    the graphed decode, by default; MEASURED_EAGER for the eager one): the mean of each row's (measured
    step - roofline) / layers."""
    measured = MEASURED if measured is None else measured
    per_row = []
    for gpu, (bw, rows) in measured.items():
        for b, tps in rows.items():
            prefill, roof = roofline_parts(b, bw)
            step = (b * NEW / tps - prefill) / NEW
            per_row.append((gpu, b, tps, (step - roof) / TINY_LLAMA.num_layers))
    c = sum(r[3] for r in per_row) / len(per_row)
    out = []
    for gpu, b, tps, _ in per_row:
        prefill, roof = roofline_parts(b, measured[gpu][0])
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
    c, rows = fit_overhead(MEASURED_EAGER)
    print(f"fitted eager decode overhead (no CUDA graphs): {c * 1e6:.1f} us per decoder layer per step")
    for gpu, b, tps, pred in rows:
        print(f"{gpu:<25} {b:>5} {tps:>15,} {pred:>16,.0f} {100 * (pred / tps - 1):>8.1f}%")


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


def as_generated(work, generation: str):
    """A role's work with its generation timed as the row's system ran it (the other roles unchanged):
    "aligner", aligner's engine as configured; "vllm" (NeMo-RL), a paged KV cache (PagedAttention reads each
    row's own tokens) batching in flight: the planner's trtllm engine; "trtllm-static" (NeMo-Aligner),
    TensorRT-LLM (a paged KV read, its own CUDA graphs, also with pipeline stages) called on static
    micro-batches of rollout_micro_batch_size: the static scheduler's steps, which aligner's TensorRT-LLM
    engine, all requests in flight, does not run."""
    if work.mode != "generate" or generation == "aligner":
        return work
    return dataclasses.replace(work, engine="trtllm", scheduler="static" if generation == "trtllm-static" else "continuous")


def plan_at_split(cfg, actor_nodes: int, critic_nodes: int) -> tuple[float, float]:
    """(step seconds, rollout seconds) of the planner's best layouts on the given node split, NeMo-Aligner's
    generation timed as it ran (:func:`as_generated`, "trtllm-static")."""
    g = cfg.cluster.gpus_per_node
    roles = {}
    for w in (as_generated(w, "trtllm-static") for w in role_works(cfg)):
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


# ---- part 3: the validation table -------------------------------------------
#
# Published layouts and times against the planner. For every row: the published layout evaluated by the
# planner (the fields the source gives fixed, the others: recomputation, SP, micro-batch rows of an engine,
# the planner's best choice for that layout), its memory per GPU against the GPU's 80 GiB, its rank among
# the planner's feasible candidates and its predicted time relative to the planner's best, and its
# predicted time against the published one. Nothing is fitted to these rows but half of Narayanan et al.'s
# (MFU_FIT_ROWS: the training efficiency's two constants), whose time errors are reported apart from the
# held-out half's.

GIB_PER_GPU = 80.0  # an "80 GB" H100 SXM / A100 SXM: 80 GiB (cluster.gpu_mem_gb)


@dataclass(frozen=True)
class Gpu:
    """A GPU kind as cluster.* fields: dense bf16/fp16 peak (TFLOP/s), HBM, NVLink per direction and
    network per GPU (GB/s)."""

    name: str
    peak_tflops: float
    hbm_gbps: float
    intra_gbps: float
    inter_gbps: float

    def overrides(self, nodes: int) -> list[str]:
        return [
            f"cluster.num_nodes={nodes}",
            "cluster.gpus_per_node=8",
            f"cluster.gpu_mem_gb={GIB_PER_GPU:g}",
            f"cluster.gpu_peak_tflops={self.peak_tflops:g}",
            f"cluster.hbm_gbps={self.hbm_gbps:g}",
            f"cluster.intra_node_gbps={self.intra_gbps:g}",
            f"cluster.inter_node_gbps={self.inter_gbps:g}",
        ]


# H100 SXM: 989 TFLOP/s dense bf16, 3,350 GB/s HBM3, NVLink 4 900 GB/s (450 per direction) (NVIDIA H100 datasheet),
# a 400 Gb/s port per GPU (50 GB/s, DGX H100): the planner's ClusterConfig defaults. NeMo, NeMo-Aligner and NeMo-RL
# ran on DGX-H100.
H100 = Gpu("H100", 989.0, 3350.0, 450.0, 50.0)
# A100 SXM 80 GB: 312 TFLOP/s dense bf16/fp16, 2,039 GB/s HBM2e, NVLink 3 600 GB/s (300 per direction) (NVIDIA A100
# datasheet); Selene's nodes have eight 200 Gb/s HDR InfiniBand HCAs for 8 GPUs: 25 GB/s per GPU (Narayanan et al.
# 2021, sec. 5).
A100 = Gpu("A100", 312.0, 2039.0, 300.0, 25.0)

# Model dimensions (ModelConfig fields over conf=llama2_7b's)
LLAMA2 = {  # the presets conf/conf/llama2_7b.yaml, llama2_13b.yaml, llama2_70b.yaml (HF config.json of meta-llama/Llama-2-*-hf)
    "7B": {},
    "13B": {"hidden_size": 5120, "intermediate_size": 13824, "num_layers": 40, "num_heads": 40, "num_kv_heads": 40},
    "70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8},
}
LLAMA3_8B = {  # HF config.json of meta-llama/Meta-Llama-3-8B (and Llama-3.1-8B)
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "rope_theta": 500000.0,
}
LLAMA3_70B_DIMS = {**LLAMA2["70B"], "vocab_size": 128256, "rope_theta": 500000.0}  # HF config.json of Meta-Llama-3-70B
LLAMA31_405B = {  # HF config.json of meta-llama/Llama-3.1-405B
    "vocab_size": 128256,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_layers": 126,
    "num_heads": 128,
    "num_kv_heads": 8,
    "rope_theta": 500000.0,
}
QWEN3_32B = {  # HF config.json of Qwen/Qwen3-32B (its q/k RMSNorms, 2 x 128 weights a layer, are not modelled)
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_layers": 64,
    "num_heads": 64,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 1000000.0,
}


def gpt_as_llama(hidden: int, layers: int, heads: int) -> dict:
    """A GPT-3-style model of Narayanan et al. 2021 (vocabulary 51,200, tied embeddings, multi-head attention,
    a 4h GeLU MLP) as a Llama layer: SwiGLU width i with 3hi = 8h^2 (rounded to a multiple of 8), so a layer
    keeps GPT's 12h^2 parameters and FLOPs; biases, LayerNorm's bias and the 2,048 x h position embeddings
    (under 0.1% of the parameters) are left out. With full recomputation (Table 1's setting) a layer saves only
    its input, so SwiGLU's wider activations do not change the memory."""
    return {
        "vocab_size": 51200,
        "hidden_size": hidden,
        "intermediate_size": round(8 * hidden / 3 / 8) * 8,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": heads,
        "tie_word_embeddings": True,
    }


@dataclass(frozen=True)
class TrainRow:
    """One published training configuration: the model, the layout and the published iteration time.

    published_s: seconds per iteration (GBS sequences of `seq` tokens). vp: the published virtual pipeline
    size; recompute / sp: as published, or None where the source does not say (the planner's best for the
    layout). backend: aligner's dp backend the row is evaluated with. fp8: published at FP8 (the planner's
    time model is bf16's: its time is shown, not compared). system: what the publishing system could run, the
    layouts the row's "best" is searched among: "aligner" (every layout the planner tries), "megatron-core" or
    "megatron-2021" (:func:`system_allows`, :func:`system_model`)."""

    family: str
    name: str
    model: dict
    gpu: Gpu
    gpus: int
    gbs: int
    mbs: int
    seq: int
    tp: int
    pp: int
    published_s: float
    published_from: str
    cp: int = 1
    vp: int = 1
    recompute: Optional[str] = None
    sp: Optional[bool] = None
    backend: str = "fsdp2"
    fp8: bool = False
    lora: bool = False
    system: str = "aligner"


def nemo_row(family, name, model, gpus, gbs, seq, tp, pp, cp, vp, tok_s_gpu, lora=False) -> TrainRow:
    """A NeMo 24.07 row: iteration seconds = GBS x seq / (tokens/s/GPU x GPUs); MBS 1 in every row."""
    t = gbs * seq / (tok_s_gpu * gpus)
    pub = f"{tok_s_gpu:,} tok/s/GPU"
    return TrainRow(family, name, model, H100, gpus, gbs, 1, seq, tp, pp, t, pub, cp=cp, vp=vp, fp8=True, lora=lora, system="megatron-core")


# NeMo 24.07 performance summary (NVIDIA/NeMo/docs/source/performance/performance_summary.md, the version in the
# index: commit 070a0bb168d405d653b9734c0017cf5078e77c0d, the "24.07 perf numbers" table of 2024-09-09), DGX-H100,
# FP8, container NeMo 24.07. Columns used: #GPUs, GBS, MBS (1 in these rows), sequence length, TP, PP, CP, VP,
# tokens/s/GPU. Fine-tuning: SQuAD v1.1 packed to 4,096 tokens. Not stated, assumed: Megatron's DDP with its
# distributed optimizer (ZeRO-1), which aligner does not run; neither of aligner's backends is its equivalent.
# aligner's DDP has its communication (one gradient reduction per optimizer step, overlapped with backward) but
# not its memory (16 B a parameter on every dp rank, where the distributed optimizer keeps 6 + 12 / dp); FSDP2
# has less memory than it (16 / dp) but gathers and reduce-scatters every layer for every micro-batch. Evaluated
# on FSDP2 (aligner's default; every published layout fits), the planner's best on FSDP2 too; --nemo-backend ddp
# evaluates them (and the planner's best) on DDP instead, where 6 of the 11 published layouts do not fit.
# Recomputation and SP are the planner's best for the layout.
# LoRA: NeMo's default adapters (examples/nlp/language_modeling/tuning/conf/megatron_gpt_finetuning_config.yaml
# at NeMo's 24.07-era commit 8e3d65dc: rank 32 on attention_qkv, i.e. q, k and v).
NEMO_ROWS = [
    nemo_row("NeMo 24.07 pre-training", "Llama 2 7B", LLAMA2["7B"], 8, 128, 4096, 1, 1, 1, 1, 16847),
    nemo_row("NeMo 24.07 pre-training", "Llama 2 13B", LLAMA2["13B"], 16, 128, 4096, 1, 4, 1, 10, 8646),
    nemo_row("NeMo 24.07 pre-training", "Llama 2 70B", LLAMA2["70B"], 64, 128, 4096, 4, 4, 1, 20, 1707),
    nemo_row("NeMo 24.07 pre-training", "Llama 3 8B", LLAMA3_8B, 8, 128, 8192, 1, 1, 2, 1, 12036),
    nemo_row("NeMo 24.07 pre-training", "Llama 3 70B", LLAMA3_70B_DIMS, 64, 128, 8192, 4, 4, 2, 5, 1533),
    nemo_row("NeMo 24.07 SFT", "Llama 2 7B", LLAMA2["7B"], 8, 32, 4096, 1, 1, 1, 1, 17120),
    nemo_row("NeMo 24.07 SFT", "Llama 2 13B", LLAMA2["13B"], 8, 32, 4096, 1, 4, 1, 1, 9741),
    nemo_row("NeMo 24.07 SFT", "Llama 2 70B", LLAMA2["70B"], 16, 32, 4096, 4, 4, 1, 1, 1833),
    nemo_row("NeMo 24.07 LoRA", "Llama 2 7B", LLAMA2["7B"], 8, 32, 4096, 1, 1, 1, 1, 25206, lora=True),
    nemo_row("NeMo 24.07 LoRA", "Llama 2 13B", LLAMA2["13B"], 8, 32, 4096, 1, 1, 1, 1, 14161, lora=True),
    nemo_row("NeMo 24.07 LoRA", "Llama 2 70B", LLAMA2["70B"], 8, 32, 4096, 2, 4, 1, 1, 2557, lora=True),
]


def narayanan_row(name, hidden, layers, heads, tp, pp, gpus, gbs, mbs, vp, tflops) -> TrainRow:
    """A row of Table 1: iteration seconds = F / (GPUs x achieved TFLOP/s), F the paper's FLOPs per iteration
    (its eq. 3, with full recomputation): 96 B s l h^2 (1 + s / 6h + V / 16lh)."""
    s, v = 2048, 51200
    flops = 96 * gbs * s * layers * hidden**2 * (1 + s / (6 * hidden) + v / (16 * layers * hidden))
    t = flops / (gpus * tflops * 1e12)
    m = gpt_as_llama(hidden, layers, heads)
    fam, pub = "Narayanan et al. 2021", f"{tflops} TFLOP/s/GPU"
    return TrainRow(
        fam, name, m, A100, gpus, gbs, mbs, s, tp, pp, t, pub, vp=vp, recompute="full", sp=False, backend="ddp", system="megatron-2021"
    )


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
# (arXiv 2104.04473), Table 1, weak scaling on Selene's A100s (80 GB), sequence 2,048, vocabulary 51,200. Published
# per row: hidden, layers, parameters, model-parallel size (TP x PP), GPUs, batch size, achieved TFLOP/s per GPU
# (NVIDIA/Megatron-LM README's images/cases_april2021.png, commit 50a4b5fa, 2021-04-08, the paper's Table 1).
# The split of the model-parallel size, heads, micro-batch size, interleaving, recomputation and DDP are the
# authors' reproduction script: NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (commit 6985e589, 2021-08-18):
# full recomputation ("--activations-checkpoint-method uniform") in every row, --num-layers-per-virtual-pipeline-
# stage 5 / 5 / 3 / 1 for 76B / 145B / 310B / 530B (v = 3 / 2 / 2 / 3), fp16 (examples/sc21/CONFIG.sh; evaluated as
# bf16 mixed precision: the same bytes and peak), plain data parallelism (torch or Megatron's local DDP: DDP).
NARAYANAN_ROWS = [
    narayanan_row("1.7B", 2304, 24, 24, 1, 1, 32, 512, 16, 1, 137),
    narayanan_row("3.6B", 3072, 30, 32, 2, 1, 64, 512, 16, 1, 138),
    narayanan_row("7.5B", 4096, 36, 32, 4, 1, 128, 512, 16, 1, 142),
    narayanan_row("18B", 6144, 40, 48, 8, 1, 256, 1024, 8, 1, 135),
    narayanan_row("39B", 8192, 48, 64, 8, 2, 512, 1536, 4, 1, 138),
    narayanan_row("76B", 10240, 60, 80, 8, 4, 1024, 1792, 2, 3, 140),
    narayanan_row("145B", 12288, 80, 96, 8, 8, 1536, 2304, 2, 2, 148),
    narayanan_row("310B", 16384, 96, 128, 8, 16, 1920, 2160, 1, 2, 155),
    narayanan_row("530B", 20480, 105, 128, 8, 35, 2520, 2520, 1, 3, 163),
    narayanan_row("1T", 25600, 128, 160, 8, 64, 3072, 3072, 1, 1, 163),
]


def materialised_score_bytes(model, work, lay: Layout) -> float:
    """Bytes per GPU of the attention scores an unfused attention keeps for backward: Korthikanti et al. 2022,
    Table 2's 5as^2b/t per layer (16-bit softmax output 2 B, dropout mask 1 B, dropout output 2 B per score), on
    every layer of the first stage, times the micro-batches it holds in flight (:func:`interleaved_in_flight`);
    0 under full recomputation (a layer keeps only its input). The planner's own memory model is aligner's
    flash-style attention, which keeps none of these (aligner.parallel.memory)."""
    if lay.recompute == "full":
        return 0.0
    m = max(1, work.batch // (lay.dp * lay.micro_batch_size))
    in_flight = interleaved_in_flight(lay.pp, lay.vpp, m, 0)
    s = work.seq_len // lay.cp
    per_layer = 5 * model.num_heads * s * work.seq_len * lay.micro_batch_size / lay.tp
    return layers_on_pp_stage(model.num_layers, lay.pp, 0) * in_flight * per_layer


def system_allows(row: TrainRow, est: LayoutEstimate, model, work, cluster) -> bool:
    """Whether the row's publishing system could run the layout `est` (feasible on aligner's model).

    megatron-core (NeMo 24.07, evaluated on FSDP2): Megatron's DDP with its distributed optimizer, which
    all-gathers the parameters and reduce-scatters the gradients once per optimizer step and never shards the
    bf16 parameters between micro-batches: of aligner's FSDP2 layouts, those with ``fsdp_reduce=step`` (the same
    traffic; 6 + 16 / dp bytes per parameter against the distributed optimizer's 6 + 12 / dp, so a layout that fits
    only in the difference is missed) or one dp rank. megatron-2021 (Narayanan et al. 2021's Megatron-LM): no
    sequence parallelism and no selective recomputation (both Korthikanti et al. 2022) and no fused (flash)
    attention (Dao et al. 2022): the layout must also fit with :func:`materialised_score_bytes` added."""
    lay = est.layout
    if row.system == "aligner":
        return True
    if row.system == "megatron-core":
        return lay.dp == 1 or lay.fsdp_reduce == "step"
    if lay.sp or lay.recompute == "selective":
        return False
    return est.memory.total + materialised_score_bytes(model, work, lay) <= cluster.gpu_mem_gb * GIB


@contextlib.contextmanager
def system_model(row: TrainRow):
    """The planner's models as the row's publishing system ran; patches ``aligner.planner`` for the duration (this
    script only).

    megatron-core: the distributed optimizer's memory, 6 + 12 / dp bytes per parameter (bf16 parameters and an
    fp32 gradient buffer on every dp rank, fp32 master weights and Adam moments sharded: the Megatron Core
    developer guide's "Distributed Optimizer" page, bf16 parameters with fp32 gradients), where aligner's ``fsdp_reduce=step`` holds 6 + 16 / dp: a sharded
    fp32 copy of the reduced gradient besides (4 / dp, taken off); and bf16 parameters at one dp rank, with
    no autocast: 2 B per frozen parameter (a LoRA base) and 6 B (+ the fp32 master) per trained one, where aligner
    keeps fp32 parameters under torch.autocast (4 B, plus a stage's bf16 casts). megatron-2021: the data-parallel all-reduce
    after the backward pass, not overlapped (Megatron-LM's ``--DDP-impl local`` of 2021, which run_table_1.sh
    keeps; assumed from its training loop of that time: aligner's DDP overlaps it), and the pipeline's messages
    split over the tensor-parallel ranks without SP (the scatter/gather optimisation, Narayanan et al. 2021,
    sec. 4.1: each of the t ranks sends 1/t of the activation over its own link; aligner's runtime sends the
    whole activation from every tp rank)."""
    import aligner.planner.evaluate as evaluate
    import aligner.planner.time_model as time_model

    overlap, p2p = time_model.dp_overlap_exposed, time_model.pipeline_p2p_seconds
    state, precision = evaluate.train_state_bytes, evaluate.training_precision

    def scattered(model, layout, *args, **kwargs):
        return p2p(model, layout, *args, **kwargs) / (1 if layout.sp else layout.tp)

    def distributed_optimizer(params, tensors, layer_params, pc, model, dp, state_dtype="float32", fsdp_step=False):
        w, g, o = state(params, tensors, layer_params, pc, model, dp, state_dtype, fsdp_step)
        if pc.dp_backend != "fsdp2" or pc.mixed_precision != "bf16":
            return w, g, o
        if fsdp_step and dp > 1:
            g -= math.ceil(4 * params / dp)
        elif dp == 1:
            # bf16 parameters, no autocast: 2 B each, + a 4 B fp32 master for trained ones. estimate_layout's LoRA
            # branch asks for the weights of base + adapters with tensors=0 (and takes only w from that call), every
            # full-parameter call passes the stage's tensors: so tensors=0 at dp 1 is a frozen base (the adapters'
            # masters, 0.2% of it, left out). tests/planner/test_validation_systems.py checks both cases.
            w = (6 if tensors else 2) * params
        return w, g, o

    if row.system == "megatron-2021":
        time_model.dp_overlap_exposed = lambda dp_s, *_: dp_s
        time_model.pipeline_p2p_seconds = scattered
    elif row.system == "megatron-core":
        evaluate.train_state_bytes = distributed_optimizer
        evaluate.training_precision = lambda model, pc, dp: "bf16" if pc.mixed_precision == "bf16" else precision(model, pc, dp)
    try:
        yield
    finally:
        time_model.dp_overlap_exposed, time_model.pipeline_p2p_seconds = overlap, p2p
        evaluate.train_state_bytes, evaluate.training_precision = state, precision


def model_overrides(model: dict, seq: int) -> list[str]:
    """conf=llama2_7b with `model`'s dimensions (the 7B's where absent) and room for `seq` tokens."""
    return ["conf=llama2_7b", f"model.max_seq_len={max(seq, 4096)}"] + [f"model.{k}={v}" for k, v in model.items()]


def train_work(row: TrainRow):
    """(config, RoleWork) of the row as aligner's SFT stage: GBS sequences of `seq` tokens per step."""
    nodes = max(1, row.gpus // 8)
    ov = model_overrides(row.model, row.seq) + row.gpu.overrides(nodes)
    ov += [
        f"data.max_seq_len={row.seq}",
        f"trainer.global_batch_size={row.gbs}",
        f"trainer.micro_batch_size={row.mbs}",
        f"actor.parallel.dp_backend={row.backend}",
        # the preset's fsdp_reduce=step runs only on fsdp2; the search tries both modes as layouts whatever this says
        f"actor.parallel.fsdp_reduce={'step' if row.backend == 'fsdp2' else 'micro_batch'}",
        "actor.parallel.mixed_precision=bf16",
        f"actor.resources.num_nodes={nodes}",
    ]
    if row.lora:
        ov += ["actor.lora.rank=32", "actor.lora.target_modules=[q_proj,k_proj,v_proj]"]
    cfg = load_config("sft", ov)
    return cfg, role_works(cfg)[0]


def best_matching(model, work, devices: int, cluster, fixed: dict, vpp: int = 1):
    """The fastest feasible layout with the published fields `fixed` (Layout attributes), the others the
    planner's candidates' (:func:`candidate_layouts`); `vpp` > 1 applied to each. None feasible: the Rejected
    closest to fitting (its estimate's memory), or the first structural refusal."""
    ok, bad = [], []
    for lay in candidate_layouts(model, work, devices):
        if any(getattr(lay, k) != v for k, v in fixed.items()):
            continue
        r = evaluate_layout(model, work, dataclasses.replace(lay, vpp=vpp), cluster)
        (ok if isinstance(r, LayoutEstimate) else bad).append(r)
    if ok:
        return min(ok, key=lambda e: (e.time.total_s, e.memory.total))
    with_est = [r for r in bad if r.estimate is not None]
    if with_est:
        return min(with_est, key=lambda r: r.estimate.memory.total)
    return bad[0] if bad else None


def rank_in(plan: RolePlan, est: LayoutEstimate) -> tuple[int, int, float]:
    """(rank, candidates, predicted time / the planner's best) of a feasible layout among the role's ranked
    feasible layouts (counting it once if the planner did not list it: an interleaved variant, say)."""
    t = est.time.total_s
    faster = sum(1 for e in plan.ranked if e.time.total_s < t * (1 - 1e-9))
    listed = any(e.layout == est.layout for e in plan.ranked)
    best = min(plan.best.time.total_s, t) if plan.best else t
    return faster + 1, len(plan.ranked) + (0 if listed else 1), t / best


def short(lay: Layout) -> str:
    """tp4 pp4 dp4 mbs1 sp sel step: a layout in a table cell (step: FSDP2 with parallel.fsdp_reduce=step)."""
    parts = [f"tp{lay.tp}"] + ([f"cp{lay.cp}"] if lay.cp > 1 else []) + [f"pp{lay.pp}"]
    parts += [f"vp{lay.vpp}"] if lay.vpp > 1 else []
    parts += [f"dp{lay.dp}", f"mbs{lay.micro_batch_size}"] + (["sp"] if lay.sp else [])
    rc = {"none": "", "selective": "sel", "full": "full"}[lay.recompute]
    return " ".join(parts + ([rc] if rc else []) + (["step"] if lay.fsdp_reduce == "step" else []))


def published_fixed(row: TrainRow) -> tuple[dict, int, str]:
    """(Layout fields the row publishes, the vpp evaluated, a note on what could not be expressed)."""
    dp = row.gpus // (row.tp * row.pp * row.cp)
    fixed = {"tp": row.tp, "pp": row.pp, "cp": row.cp, "dp": dp, "micro_batch_size": row.mbs}
    if row.recompute is not None:
        fixed["recompute"] = row.recompute
    if row.sp is not None:
        fixed["sp"] = row.sp and row.tp > 1
    vpp, note = row.vp, ""
    if row.vp > 1 and row.backend == "deepspeed" and dp > 1:  # interleaving runs on DDP and FSDP2 (2026-11-28)
        vpp, note = 1, f"VP{row.vp} run as VP1"
    return fixed, vpp, note


def train_result(row: TrainRow) -> dict:
    """The row's published layout against the planner (one table row's values): ranked among the layouts its
    publishing system could run, under that system's models (:func:`system_allows`, :func:`system_model`), and
    for a system other than aligner's also against aligner's own best under aligner's models ("aligner_rel")."""
    cfg, work = train_work(row)
    fixed, vpp, note = published_fixed(row)
    with system_model(row):
        plan = plan_role(cfg.model, work, row.gpus, cfg.cluster)
        r = best_matching(cfg.model, work, row.gpus, cfg.cluster, fixed, vpp)
    out = {"row": row, "plan": plan, "note": note, "est": r}
    if row.system != "aligner":
        allowed = [e for e in plan.ranked if system_allows(row, e, cfg.model, work, cfg.cluster)]
        out["plan"] = plan = dataclasses.replace(plan, ranked=allowed)
        out["aligner_plan"] = own = plan_role(cfg.model, work, row.gpus, cfg.cluster)
        mine = best_matching(cfg.model, work, row.gpus, cfg.cluster, fixed, vpp)
        if isinstance(mine, LayoutEstimate):
            out["aligner_rel"] = rank_in(own, mine)[2]
    if isinstance(r, LayoutEstimate):
        out["rank"] = rank_in(plan, r)
    return out


def fmt_train(res: dict) -> str:
    row, plan, r = res["row"], res["plan"], res["est"]
    best = short(plan.best.layout) + f", {plan.best.time.total_s:.2f} s" if plan.best else "none fits"
    cells = [f"{row.name}", f"{row.gpus} {row.gpu.name}"]
    if isinstance(r, LayoutEstimate):
        rank, n, rel = res["rank"]
        t = r.time.total_s
        ratio = f"({t / row.published_s:.2f}x, FP8)" if row.fp8 else f"{t / row.published_s:.2f}x"
        cells += [short(r.layout) + (f" ({res['note']})" if res["note"] else ""), f"yes, {r.memory.total / GIB:.1f}"]
        vs = f"{rel:.3f}x" + (f" (aligner's: {res['aligner_rel']:.3f}x)" if "aligner_rel" in res else "")
        cells += [f"{rank} / {n}", vs, f"{row.published_s:.2f}", f"{t:.2f}", ratio]
    else:
        mem = f"no, {r.estimate.memory.total / GIB:.1f}" if r is not None and r.estimate else f"no: {r.reason if r else '?'}"
        cells += [short(r.layout) if r is not None else "-", mem, "-", "-", f"{row.published_s:.2f}", "-", "-"]
    if res.get("aligner_plan") is not None and res["aligner_plan"].best is not None:
        ab = res["aligner_plan"].best
        best += f" (aligner's: {short(ab.layout)}, {ab.time.total_s:.2f} s)"
    cells.append(best)
    return "| " + " | ".join(cells) + " |"


TRAIN_HEAD = (
    "| row | GPUs | published layout (as evaluated) | fits: GiB/GPU of 80 | rank | vs best | published s | predicted s | ratio | planner's best |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def print_training() -> list[str]:
    """The training families' table: one iteration (GBS sequences) per row. Returns the goal lines."""
    fam, results = None, []
    for row in NEMO_ROWS + NARAYANAN_ROWS:
        if row.family != fam:
            fam = row.family
            print(f"\n**{fam}**\n\n{TRAIN_HEAD}")
        results.append(train_result(row))
        print(fmt_train(results[-1]))
    near = [r for r in results if "rank" in r and r["rank"][2] <= 1.05]
    timed = [r for r in results if not r["row"].fp8 and "rank" in r]
    in_band = [r for r in timed if abs(r["est"].time.total_s / r["row"].published_s - 1) <= 0.25]
    name = lambda r: f"{r['row'].family.replace('NeMo 24.07 ', '').replace(' et al. 2021', '')} {r['row'].name}"  # noqa: E731
    return [
        f"training: published layout feasible {sum('rank' in r for r in results)} / {len(results)}, within 5% of the best "
        f"{len(near)} / {len(results)} (missing: {', '.join(name(r) for r in results if r not in near)})",
        f"training: time within +-25% {len(in_band)} / {len(timed)} bf16/fp16 rows (FP8 rows not compared: {len(results) - len(timed)})",
    ] + [held_out_line(timed, held) for held in (False, True)]


def held_out_line(timed: list, held: bool) -> str:
    """The Narayanan rows' time errors, those the efficiency is fitted to (MFU_FIT_ROWS) or the held-out rest."""
    rows = [r for r in timed if r["row"].family.startswith("Narayanan") and (r["row"].name in MFU_FIT_ROWS) != held]
    errs = [r["est"].time.total_s / r["row"].published_s - 1 for r in rows]
    each = ", ".join(f"{r['row'].name} {e:+.0%}" for r, e in zip(rows, errs))
    what = "held out" if held else "fitted to (MFU_MAX, MFU_HALF_DIM)"
    mean = sum(abs(e) for e in errs) / max(1, len(errs))
    inside = sum(abs(e) <= 0.25 for e in errs)
    return f"training time, Narayanan rows {what}: {each} (mean |error| {mean:.0%}, within +-25% {inside} / {len(rows)})"


@dataclass(frozen=True)
class RlRow:
    """One published RL step: the config (overrides), the node groups, the published step seconds and mean
    response tokens, and the published layouts (role -> Layout fields; {} = not published).

    prompt: data.max_prompt_len; actor_nodes / critic_nodes: the split placement's node groups (critic 0:
    colocated); rollout_nodes: the rollout group's own nodes (rollout.placement=split)."""

    family: str
    name: str
    overrides: tuple
    nodes: int
    published_s: float
    mean: float
    prompt: int
    actor_nodes: int = 0
    critic_nodes: int = 0
    rollout_nodes: int = 0
    layouts: tuple = ()  # ((role, {field: value}), ...)
    reshard_off: bool = False  # the engine runs in the actor's (the planner's best) layout
    generation: str = "aligner"  # how its generation is timed: aligner | vllm | trtllm-static (:func:`as_generated`)


def aligner_row(name, model, actor_nodes, critic_nodes, mean, step, mbs, rollouts, gbs, reshard_off=False) -> RlRow:
    """A NeMo-Aligner PPO row on conf=llama2_70b with NeMo-Aligner's defaults (NEMO_ALIGNER_SETTINGS, part 2)."""
    ov = ["conf=llama2_70b", "model.max_seq_len=8192"] + [f"model.{k}={v}" for k, v in model.items()]
    ov += [o for o in NEMO_ALIGNER_SETTINGS if not o.startswith(("trainer.rollout_batch_size", "trainer.mini_batch_size"))]
    ov += [f"trainer.rollout_batch_size={rollouts}", f"trainer.mini_batch_size={gbs}", f"rollout.max_batch_size={mbs}"]
    ov += H100.overrides(actor_nodes + critic_nodes)
    nodes = actor_nodes + critic_nodes
    return RlRow(
        "NeMo-Aligner PPO",
        name,
        tuple(ov),
        nodes,
        step,
        mean,
        1024,
        actor_nodes,
        critic_nodes,
        reshard_off=reshard_off,
        generation="trtllm-static",
    )


# NeMo-Aligner (NVIDIA/NeMo-Aligner/docs/user-guide/rlhf.rst, "PPO Performance Results with TensorRT-LLM"): the four
# Llama 3 70B scaling rows of part 2 (PUBLISHED), and the Llama 3.1 405B actor and reward model run on 84 actor +
# 42 critic nodes: num_rollout_samples=128, global_batch_size=128, reshard off (generation in the training layout),
# engine kept on the GPU, 915.6 tokens generated per response, 164.6 s per step. Not stated, assumed as in part 2:
# NeMo-Aligner's defaults (examples/nlp/gpt/conf/gpt_ppo_actor.yaml): rollout_micro_batch_size 8 (also for the 405B
# run), max_length 2048, max_input_len 1024. No layout is published: the planner's best at the published split;
# the 405B run also with the engine in the planner's actor layout (reshard off: generation in the training layout).
ALIGNER_ROWS = [aligner_row("Llama 3 70B", LLAMA3_70B_DIMS, a, c, mean, step, mbs, 1024, 128) for a, c, mean, step, mbs in PUBLISHED]
ALIGNER_ROWS.append(aligner_row("Llama 3.1 405B", LLAMA31_405B, 84, 42, 915.6, 164.6, 8, 128, 128))
ALIGNER_ROWS.append(aligner_row("Llama 3.1 405B, reshard off", LLAMA31_405B, 84, 42, 915.6, 164.6, 8, 128, 128, reshard_off=True))


def nemo_rl_row(
    name, model, nodes, mean, step, tok_s_gpu, actor: dict, engine_tp: int, rollout_nodes: int = 0, packed: bool = False
) -> RlRow:
    """A NeMo-RL GRPO row: 64 prompts x 32 generations, 512 per optimizer step, the KL to the reference (0.01,
    k3) as a loss, a rule reward (math verification), vLLM's continuous batching; colocated generation, or
    (rollout_nodes > 0) generation on its own nodes one step off policy. The prompt length: the published
    tokens per sample (tokens/s/GPU x GPUs x step / 2,048 samples) less the G-average sequence length."""
    prompt = round(tok_s_gpu * 8 * nodes * step / 2048 - mean)
    ov = model_overrides(model, 4096) + H100.overrides(nodes)
    ov += [
        f"data.max_prompt_len={prompt}",
        "data.max_seq_len=4096",
        f"rollout.sampling.max_new_tokens={4096 - prompt}",
        "trainer.rollout_batch_size=64",
        "trainer.n_samples_per_prompt=32",
        "trainer.mini_batch_size=512",
        "trainer.micro_batch_size=1",
        "algorithm.advantage=grpo",
        "algorithm.kl_loss_coef=0.01",
        "reward.type=rule",
        "rollout.scheduler=continuous",
        "rollout.dtype=bfloat16",
        "cluster.placement=colocated",
    ]
    if packed:  # NeMo-RL's sequence packing into 4,096-token rows: aligner's token budget of 4,096 (any pp)
        ov += ["trainer.micro_batch_tokens=4096"]
    if rollout_nodes:
        ov += ["rollout.placement=split", f"rollout.resources.num_nodes={rollout_nodes}", "trainer.max_staleness=1"]
        ov += ["rollout.parallel.tp_size=1", "rollout.parallel.pp_size=1", f"rollout.parallel.dp_size={8 * rollout_nodes}"]
    train_gpus = 8 * (nodes - rollout_nodes)
    dp = train_gpus // (actor["tp"] * actor["pp"])
    gen = 8 * (rollout_nodes or nodes)
    layouts = (
        ("actor", {**actor, "dp": dp, "cp": 1, **({} if packed else {"micro_batch_size": 1})}),  # packed: the budget's rows
        ("ref", {"tp": actor["tp"], "pp": actor["pp"], "dp": dp}),
        ("rollout", {"tp": engine_tp, "pp": 1, "dp": gen // engine_tp}),
    )
    return RlRow(
        "NeMo-RL GRPO", name, tuple(ov), nodes, step, mean, prompt, rollout_nodes=rollout_nodes, layouts=layouts, generation="vllm"
    )


# NeMo-RL performance summary (NVIDIA-NeMo/RL/docs/about/performance-summary.md, "Nemo RL v0.5", H100 BF16: the last
# version with dense-model rows, commit 4c1a0cd49 of 2026-04-12; v0.6, commit 69c7ca117, has none), GRPO on
# OpenMathInstruct-2, DGX-H100, bf16 training (Megatron core) and generation (vLLM), T-Max sequence length 4,096.
# Published per row: GPUs, G-GBS 2,048, T-GBS 512, generation [TP, PP], training [TP, CP, EP, PP], G-average
# sequence length, step seconds. The Llama row's training column is garbled ("[1,1,1,1,1,2,n/a]"); the layouts and
# the settings are the recipes' (examples/configs/recipes/llm/performance/ at that commit, over grpo_math_1B.yaml):
# llama3.1-8b-instruct-2n8g: 64 prompts x 32 generations, tp 1, pp 2, activation checkpointing (full), micro-batch 1,
# colocated vLLM tp 1; its -async-1off: pp 1, one node training, one node generating (8 tp-1 engines), one step off;
# qwen3-32b-4n8g: tp 4, pp 4, sequence parallel, no recomputation, vLLM tp 4. Not stated, derived or assumed: the
# G-average sequence length read as the mean response (the published tokens/s/GPU x GPUs x step / 2,048 exceed it
# by 103 to 131 tokens a sample in every row: the prompts), every prompt that long (data.max_prompt_len) and the
# responses capped at 4,096 less it (vLLM's max_model_len); the reference log-probs in the training layout
# (NeMo-RL computes them in the policy's workers); at most 256 sequences per engine (vLLM's max_num_seqs,
# rollout.max_batch_size). NeMo-RL's sequence packing (training on packed 4,096-token rows) is evaluated as
# aligner's token-budget micro-batches of 4,096 tokens (trainer.micro_batch_tokens; rows timed at prompt + mean)
# in every row: all three recipes inherit grpo_math_1B.yaml, whose policy.sequence_packing.enabled is true, and
# none turns it off. The pp > 1 rows (the colocated Llama, pp 2; Qwen3-32B, pp 4) since 2026-11-28, when the
# runtime's budget began to run with pipeline stages (before, row-count micro-batches of one row at the batch's
# width: Llama A 2.35x, M 0.81x; Qwen3-32B A 1.20x, M 0.97x).
NEMO_RL_ROWS = [
    nemo_rl_row("Llama 3.1 8B", LLAMA3_8B, 2, 1019, 92.8, 1581, {"tp": 1, "pp": 2, "recompute": "full"}, 1, packed=True),
    nemo_rl_row(
        "Llama 3.1 8B, 1-step off", LLAMA3_8B, 2, 1123, 64.8, 2478, {"tp": 1, "pp": 1, "recompute": "full"}, 1, rollout_nodes=1, packed=True
    ),
    nemo_rl_row("Qwen3-32B", QWEN3_32B, 4, 3251, 376.0, 571, {"tp": 4, "pp": 4, "recompute": "none", "sp": True}, 4, packed=True),
]

# Published but not expressible by the planner, or left out (row, reason)
NOT_EXPRESSIBLE = [
    ("NeMo-RL v0.5 H100 FP8: Llama 3.1 8B, 1-step off (53.0 s)", "FP8 generation and training: the planner models bf16 only"),
    (
        "NeMo-RL v0.5 H100 BF16: Qwen3-32B, 1-step off (64 GPUs, 200 s)",
        "generation on its own 4 nodes with tp-4 vLLM engines: the planner's split rollout group runs one-GPU engines only",
    ),
    (
        "NeMo-RL v0.5 GB200: Llama 3.1 8B (2 rows), Qwen3-32B (2 rows)",
        "GB200-NVL72 (4 GPUs a node): not evaluated, no sourced peak, HBM and bandwidth figures here",
    ),
    ("NeMo-RL v0.5: DeepSeek V3, Qwen3-235B, Qwen3-30B-A3B", "MoE rows: outside this table (dense models only)"),
    ("NeMo 24.07: GPT3 and Nemotron rows", "left out: this table takes NeMo's Llama rows (all of its rows are FP8)"),
]


def rl_config(row: RlRow, mean_only: bool):
    """The row's config: A (mean_only False): mean response = the published mean, the longest = the cap,
    training rows data.max_seq_len long; M: every response and training row at the mean (the responses'
    cap and data.max_seq_len cut to prompt + mean)."""
    ov = list(row.overrides) + [f"rollout.expected_response_len={row.mean}"]
    if mean_only:
        n = math.ceil(row.mean)
        ov += [
            f"rollout.sampling.max_new_tokens={n}",
            f"data.max_seq_len={row.prompt + n}",
            f"rollout.expected_response_len_max={row.mean}",
        ]
    return load_config("ppo", ov)


def role_devices(row: RlRow, work) -> int:
    if work.group == "rollout":
        return 8 * row.rollout_nodes
    if row.critic_nodes:
        return 8 * (row.actor_nodes if work.group == "actor" else row.critic_nodes)
    return 8 * (row.nodes - row.rollout_nodes)


def rl_step(cfg, row: RlRow, layouts: dict) -> tuple[dict, dict]:
    """(role -> the planner's RolePlan, role -> the published layout's estimate or Rejected) for one config;
    `layouts`: the published Layout fields per role (a role without: the planner's best; with reshard_off
    the engine takes the planner's actor layout)."""
    plans, chosen = {}, {}
    works = [as_generated(w, row.generation) for w in role_works(cfg)]
    for w in sorted(works, key=lambda w: w.mode == "generate"):  # the engine after the actor
        n = role_devices(row, w)
        plans[w.role] = plan_role(cfg.model, w, n, cfg.cluster)
        if w.mode == "generate" and row.reshard_off:  # generation in the actor's training layout
            a = plans["actor"].best.layout
            chosen[w.role] = best_matching(cfg.model, w, n, cfg.cluster, {"tp": a.tp, "pp": a.pp, "dp": a.dp})
        elif w.role in layouts:
            chosen[w.role] = best_matching(cfg.model, w, n, cfg.cluster, layouts[w.role])
        elif plans[w.role].best is None:
            raise SystemExit(f"{row.name}: {w.role} does not fit on {n} devices")
    return plans, chosen


def step_of(plans: dict, chosen: dict, row: RlRow, cfg) -> Optional[float]:
    """The step with the chosen layouts (the planner's best for the others); None if one does not fit."""
    roles = {}
    for name, p in plans.items():
        est = chosen.get(name, p.best)
        if not isinstance(est, LayoutEstimate):
            return None
        roles[name] = RolePlan(role=name, work=p.work, devices=p.devices, ranked=[est])
    return ppo_step_seconds(roles, row.critic_nodes > 0, cfg.trainer.max_staleness)


def rl_result(row: RlRow) -> dict:
    layouts = dict(row.layouts)
    out = {"row": row}
    for key, mean_only in (("A", False), ("M", True)):
        cfg = rl_config(row, mean_only)
        plans, chosen = rl_step(cfg, row, layouts)
        out[key] = step_of(plans, chosen, row, cfg)
        out[key + "_best"] = step_of(plans, {}, row, cfg)
        if key == "A":
            out["plans"], out["chosen"] = plans, chosen
            roll = [p for p in plans.values() if p.work.mode == "generate"][0]
            est = chosen.get(roll.role, roll.best)
            out["rollout_share"] = est.time.total_s / out["A"] if out["A"] and isinstance(est, LayoutEstimate) else None
    return out


def fmt_rl(res: dict) -> str:
    row = res["row"]
    cells = [row.name, f"{8 * row.nodes} H100" + (f" ({row.actor_nodes}+{row.critic_nodes} nodes)" if row.critic_nodes else "")]
    if row.rollout_nodes:
        cells[-1] += f" ({row.nodes - row.rollout_nodes}+{row.rollout_nodes} nodes)"
    chosen, plans = res["chosen"], res["plans"]
    if row.reshard_off:
        r = chosen["rollout"]
        cells += [f"not published; engine in the actor's: {short(r.layout)}", "-", "-", "-"]
    elif chosen:
        lay, mem, ranks = [], [], []
        for role in ("actor", "rollout"):
            r = chosen[role]
            lay.append(f"{role}: {short(r.layout)}")
            if isinstance(r, LayoutEstimate):
                mem.append(f"{r.memory.total / GIB:.1f}")
                k, n, _ = rank_in(plans[role], r)
                ranks.append(f"{k}/{n}")
            else:
                mem.append(f"no, {r.estimate.memory.total / GIB:.1f}" if r.estimate else "no")
                ranks.append("-")
        ok = all(isinstance(chosen[x], LayoutEstimate) for x in chosen)
        cells += ["; ".join(lay), ("yes, " if ok else "") + " / ".join(mem), ", ".join(ranks)]
        cells.append(f"{res['A'] / res['A_best']:.3f}x" if res["A"] else "-")
    else:
        cells += ["not published", "-", "-", "-"]
    a, m = res["A"], res["M"]
    cells += [f"{row.published_s:.1f}", f"{a:.1f}" if a else "-", f"{m:.1f}" if m else "-"]
    cells += [f"{a / row.published_s:.2f}x" if a else "-", f"{m / row.published_s:.2f}x" if m else "-"]
    cells.append(f"{100 * res['rollout_share']:.0f}%" if res["rollout_share"] else "-")
    return "| " + " | ".join(cells) + " |"


RL_HEAD = (
    "| row | GPUs | published layout (as evaluated) | fits: GiB/GPU of 80, actor / engine | rank: actor, engine | vs best (A) "
    "| published s | A s | M s | A ratio | M ratio | rollout share (A) |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def print_rl() -> list[str]:
    """The RL families' table: one PPO / GRPO step per row, A and M bounds. Returns the goal lines."""
    fam, results = None, []
    for row in ALIGNER_ROWS + NEMO_RL_ROWS:
        if row.family != fam:
            fam = row.family
            print(f"\n**{fam}**\n\n{RL_HEAD}")
        results.append(rl_result(row))
        print(fmt_rl(results[-1]))
    pub = [r for r in results if r["row"].layouts]
    near = [r for r in pub if r["A"] and r["A"] / r["A_best"] <= 1.05]
    band = lambda key: sum(1 for r in results if r[key] and abs(r[key] / r["row"].published_s - 1) <= 0.4)  # noqa: E731
    between = sum(1 for r in results if r["M"] <= r["row"].published_s <= r["A"])
    return [
        f"RL: published layouts feasible {sum(1 for r in pub if r['A'])} / {len(pub)}, step within 5% of the planner's best {len(near)} / {len(pub)}",
        f"RL: step within +-40%: A {band('A')} / {len(results)}, M {band('M')} / {len(results)}; published between M and A {between} / {len(results)}",
    ]


# The rows of Table 1 that MFU_MAX and MFU_HALF_DIM are fitted to (every other row, by size, so both halves
# span 1.7B to 1T and x = 768 to 2,304); the other five are held out: the table reports their time error apart.
MFU_FIT_ROWS = ("1.7B", "7.5B", "39B", "145B", "530B")


def fit_mfu(rows: tuple = MFU_FIT_ROWS) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(MFU_MAX, MFU_HALF_DIM, [(row, x, implied efficiency)] for every Table 1 row): the saturating efficiency
    MFU_MAX * x / (x + MFU_HALF_DIM) of ``aligner.planner.time_model.gemm_efficiency`` fitted to the Table 1
    rows of Narayanan et al. 2021 named in `rows` (MFU_FIT_ROWS: half of them; the rest held out). Each row's published layout is evaluated as in the table; the efficiency it implies
    is the one at which the planner's time equals the published: its compute at 100% of peak, times 1 + the
    bubble's fraction, over the published seconds less the modelled TP, DP and point-to-point time, all as the
    system ran (:func:`system_model`: the DP all-reduce after the backward pass, scatter/gather pipeline
    messages). The constants minimise the squared
    relative error of the efficiency (so of the time) over the fitted rows: MFU_HALF_DIM on a grid of 5, MFU_MAX
    in closed form for each."""
    pts = []
    for row in NARAYANAN_ROWS:
        cfg, work = train_work(row)
        fixed, vpp, _ = published_fixed(row)
        with system_model(row):  # Table 1's runs: the all-reduce after backward, scatter/gather messages
            est = best_matching(cfg.model, work, row.gpus, cfg.cluster, fixed, vpp)
        t, lay = est.time, est.layout
        x = min(cfg.model.hidden_size / lay.tp, lay.micro_batch_size * row.seq / lay.cp)
        c1 = t.compute_s * gemm_efficiency(cfg.model, lay, lay.micro_batch_size, row.seq)
        bf = t.bubble_s / (t.compute_s + t.tp_comm_s)
        other = t.tp_comm_s * (1 + bf) + t.dp_comm_s + t.pp_comm_s + t.cp_comm_s + t.a2a_s
        pts.append((row.name, x, c1 * (1 + bf) / (row.published_s - other)))
    best = None
    for half in range(0, 4001, 5):
        r = [x / (x + half) / y for name, x, y in pts if name in rows]  # predicted / implied at MFU_MAX = 1
        top = sum(r) / sum(v * v for v in r)
        err = sum((top * v - 1) ** 2 for v in r)
        if best is None or err < best[0]:
            best = (err, top, float(half))
    return best[1], best[2], pts


def print_fit_mfu() -> None:
    top, half, pts = fit_mfu()
    print(f"MFU_MAX = {top:.3f}, MFU_HALF_DIM = {half:g} (least squares over Table 1's rows {', '.join(MFU_FIT_ROWS)})")
    print("| row | x = min(h / tp, tokens / cp) | implied efficiency | model | residual | |\n| --- | --- | --- | --- | --- | --- |")
    for name, x, y in pts:
        f = top * x / (x + half)
        print(f"| {name} | {x:g} | {y:.3f} | {f:.3f} | {f / y - 1:+.1%} | {'fitted' if name in MFU_FIT_ROWS else 'held out'} |")
    all_top, all_half, _ = fit_mfu(tuple(n for n, _, _ in pts))
    print(f"\n(fitted to all {len(pts)} rows instead: MFU_MAX = {all_top:.3f}, MFU_HALF_DIM = {all_half:g})")


def print_table(family: str) -> None:
    goals = []
    if family in ("all", "training"):
        goals += print_training()
    if family in ("all", "rl"):
        goals += print_rl()
    print("\n**Goals**\n")
    for line in goals:
        print(f"- {line}")
    print("\n**Not expressible or left out**\n")
    for what, why in NOT_EXPRESSIBLE:
        print(f"- {what}: {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="print the decode-overhead fit and its residuals")
    ap.add_argument("--fit-mfu", action="store_true", help="print the training efficiency's fit to Narayanan et al. 2021")
    ap.add_argument("--table", action="store_true", help="print the validation table (markdown)")
    ap.add_argument("--family", choices=("all", "training", "rl"), default="all", help="with --table: which rows")
    ap.add_argument(
        "--nemo-backend",
        choices=("fsdp2", "ddp"),
        default="fsdp2",
        help="aligner's dp backend the NeMo 24.07 rows (Megatron DDP + distributed optimizer) are evaluated on",
    )
    args = ap.parse_args()
    system = "megatron-core" if args.nemo_backend == "fsdp2" else "aligner"  # on DDP: every layout aligner's DDP runs
    NEMO_ROWS[:] = [dataclasses.replace(r, backend=args.nemo_backend, system=system) for r in NEMO_ROWS]
    if args.fit:
        print_fit()
    elif args.fit_mfu:
        print_fit_mfu()
    elif args.table:
        print_table(args.family)
    else:
        print_validation()


if __name__ == "__main__":
    main()
