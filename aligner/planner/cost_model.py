"""The planner's cost model: bytes per device and seconds per step of one role's layout.

Owns: parameter counts per role and stage, the analytic memory model (weights, gradients,
optimizer state, activations, KV cache), the analytic step-time model, and the evaluation of one
layout (:func:`evaluate_layout`: a :class:`LayoutEstimate`, or :class:`Rejected` with the reason).

Memory model (per device, bytes; ``cluster.gpu_mem_gb`` and every printed figure are GiB, 2**30
bytes, the unit GPU memory is sold in: an "80 GB" H100 or A100 has 80 GiB = 85.9e9 bytes, of
which torch.cuda reports about 79.2 GiB = 85.0e9 as total_memory):
- Parameters: :meth:`ModelConfig.num_parameters` (score models drop lm_head and add a [1, H]
  head). TP shards everything but the RMSNorm weights; PP splits layers evenly (the first
  ``L % pp`` stages take one more); embedding and lm_head sit on the first/last stage.
- Training state follows ZeRO's accounting (Rajbhandari et al. 2020, section 3.1): mixed
  precision keeps a bf16 compute copy (2 B) and an fp32 master (4 B), fp32 grads (4 B; bf16
  under DeepSpeed) and Adam m, v in fp32 (8 B; 4 B with ``optim.state_dtype=bfloat16``,
  aligner.runtime.adamw) plus torch's 4 B ``step`` tensor per parameter tensor. FSDP2 shards
  all three over dp; DeepSpeed ZeRO-1/2/3 shards optimizer (and master) / + grads / + params;
  DDP shards nothing. Sharded parameters are gathered to run (:func:`zero3_buffer_bytes`):
  FSDP2 gathers a decoder layer and prefetches the next, and in backward holds the layer's
  unsharded gradient and its reduce-scatter input; DeepSpeed ZeRO-3 gathers per submodule
  (the largest weight, plus the next one while fewer than stage3_max_live_parameters are live)
  and copies each gradient into its reduce bucket.
- Activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models"), Table 2, re-derived for aligner's Llama layers instead of GPT's:
  no dropout (their masks vanish); the SwiGLU MLP saves gate, up, silu(gate) and their
  product (4I elements instead of GPT's 4h + 4h GeLU in/out); attention saves q, the
  GQA-repeated k and v and the output (4 q-widths) and the fp32 log-sum-exp per head (no
  a*s^2 score matrix and no mask: the causal kernel is flash-style, so the paper's 5as/h term
  becomes 4a/e); each unfused
  RMSNorm saves an fp32 copy of its input, the normalized tensor and its output (Korthikanti's
  2 bytes per LayerNorm becomes 4 + 2e). TP divides everything inside the TP regions; SP also
  divides the norm regions; selective recomputation keeps only q, k, v (un-repeated) and the
  core output; full recomputation keeps the layer input (2sbh in the paper). The last stage
  adds the fp32 log-softmax of the logits (the paper's 4sbv/t). 1F1B keeps min(pp - i, m)
  micro-batches in flight on stage i (the first stage holds pp). Under torch.autocast (fp32
  parameters, bf16 compute: bf16 mixed precision with DDP or one dp rank) the bf16 casts of
  the weights are held once per stage, not per micro-batch in flight: autocast caches a trainable
  weight's cast for its context, and the training step shares a frozen weight's (a LoRA base,
  :func:`aligner.nn.layers.frozen_weight_casts`); a frozen base under full recomputation holds
  only the recomputed layer's casts.
- Rollout engine: weights, KV cache and activations in ``rollout.dtype`` (the engine's model is
  cast to it on refit; its KV caches take the model's dtype), whatever model.dtype is. KV cache:
  2 * layers/pp * max(kv_heads/tp, 1) * head_dim * bytes * batch * seq.

Step-time model (seconds): FLOPs per token 6N + 12*L*H*T for training (4 instead of 6 per frozen
parameter of a LoRA base: no weight gradients) and 2N + 4*L*H*T for
a forward pass (Chowdhery et al. 2022, PaLM appendix B), plus one forward for full
recomputation or the attention core for selective, divided by devices * peak * efficiency;
TP all-reduces (4 per layer per micro-batch in forward + backward, Shoeybi et al. 2019) of
B*T*H elements over the intra-node bandwidth with ring volume 2(n-1)/n; the data-parallel
gradient all-reduce over the inter-node bandwidth when the dp group spans nodes, once per optimizer step
(DDP, less what the last micro-batch's backward hides: :func:`dp_overlap_exposed`; DeepSpeed), or FSDP2's
per-layer all-gathers (forward and backward) and reduce-scatters for every micro-batch, exposed beyond each
pass's compute (:func:`fsdp2_microbatch_exposed_seconds`); the 1F1B bubble multiplies compute by 1 + (p-1)/m (Narayanan et al.
2021). Rollout: a compute-bound prefill, then decode steps, each the larger of reading the stage
weights and the whole KV cache from HBM and its FLOPs, plus a fixed overhead per decoder layer
(DECODE_OVERHEAD_S_PER_LAYER, fitted to aligner's measured decode) and the TP all-reduces; a token
walks all pp stages in turn. The steps follow ``rollout.scheduler`` and the expected response
lengths (``rollout.expected_response_len*``): a static batch decodes until its longest response
stops, a continuous pool refills its rows, so the mean governs it (:func:`decode_steps`). The
engine's rows per replica (its KV cache) are the layout's micro-batch size, checked in memory like
any other layout: a rollout batch larger than the rows that fit runs in waves.

MoE (Mixtral-style layers): FLOPs follow the active parameters (router + top-k experts per token,
:func:`role_active_parameters`), memory the total; each rank holds E / ep of every layer's experts,
whose training state FSDP2 shards over the dp / ep expert-data-parallel ranks; expert parallelism
adds 2 all-to-alls per MoE layer per forward (4 with backward, 6 with full recomputation) of
tokens * k * H elements each, (ep-1)/ep of them leaving the rank, over the dp axis's bandwidth.

Simplifications: roles sharing a node group are time-sliced (the others offloaded), so each
role's memory is checked alone; a PPO step is rollout + max(actor group, critic group) for
split placement and the sum of all phases when colocated; plain 1F1B's point-to-point PP traffic,
allocator fragmentation (a fixed reserve instead) and interleaved
schedules are not modelled. On a CPU-only cluster (gpus_per_node = 0) each node counts as one
device with gpu_mem_gb of memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from aligner.config import ClusterConfig, ModelConfig, ParallelConfig
from aligner.parallel.memory import LayerDims, layer_activation_bytes

GIB = 2**30  # bytes per GiB: cluster.gpu_mem_gb and every memory figure the planner prints
GB = 1e9  # bytes per GB (decimal): bandwidths, cluster.*_gbps in GB/s
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Fraction of peak FLOP/s the rollout engine's prefill and compute-bound decode steps reach (unchanged, not
# fitted: decode is rarely compute bound). Training and forward passes use gemm_efficiency instead.
MODEL_FLOPS_EFFICIENCY = 0.4
# Training / forward efficiency as a function of the per-GPU GEMM shape (gemm_efficiency):
# MFU_MAX * x / (x + MFU_HALF_DIM), x = min(hidden / tp, tokens per micro-batch / cp), the smaller dimension of
# a layer's per-GPU GEMMs. Both constants are one least-squares fit (benchmarks/planner_validation.py --fit-mfu,
# on the relative error) to the efficiency that five of the ten rows of Narayanan et al. 2021, Table 1 imply
# (1.7B, 7.5B, 39B, 145B, 530B: MFU_FIT_ROWS there; the other five are held out and reported apart in
# docs/planner.md). Table 1: A100, fp16, full recomputation, 135-163 TFLOP/s = 43-52% of 312, which includes
# their bubble and communication: the planner's modelled TP, DP (not overlapped, as Megatron-LM's local DDP of
# 2021 ran it) and bubble time is taken out, leaving 0.52-0.62. The rows span x = 768-2,304 and show no trend
# with x: the held-in fit is flat (MFU_HALF_DIM = 0; all ten rows give 0.587 and 45, equally flat above a few
# hundred), so **the model is a constant 0.574 of peak for training and forward passes**: the saturating
# form is kept for a fit to shapes these rows do not cover (narrow shards, short micro-batches: the GPU suite's
# measurements, issue 40 part 2), which is where it would matter. The fit is an A100's, applied to every GPU.
MFU_MAX = 0.574
MFU_HALF_DIM = 0.0
# torch DDP's default gradient bucket (bucket_cap_mb=25; aligner does not set it): the last bucket's all-reduce
# starts when backward ends, so at least it is exposed (bytes)
DDP_BUCKET_BYTES = 25 * 2**20
# per GPU: the ~0.8 GiB an "80 GB" GPU keeps from CUDA (80 GiB sold, 79.2 GiB total_memory on an
# H100 SXM), the CUDA context, NCCL buffers and allocator slack
GPU_RESERVED_BYTES = 2.0 * GIB
# DeepSpeed ZeRO-3 defaults (deepspeed/runtime/zero/config.py, DeepSpeed 0.19): elements prefetched
# ahead of the running submodule, elements kept gathered at most, elements per gradient reduce bucket
DS_PREFETCH_BUCKET_SIZE = 50_000_000  # stage3_prefetch_bucket_size
DS_MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters
DS_REDUCE_BUCKET_SIZE = 500_000_000  # reduce_bucket_size
COLLECTIVE_LATENCY_S = 10e-6  # fixed cost of one small collective (decode steps), seconds
# Fixed cost of one decoder layer in one decode step of aligner's TorchEngine, seconds (kernel launches,
# the CUDA-graph replay, sampling and the host loop, spread over the layers), beyond the step's HBM /
# FLOP roofline. Least-squares fit (benchmarks/planner_validation.py --fit) to the static scheduler's
# CUDA-graph decode of a 1.10B Llama (22 layers) in bf16, prompt 128, 256 new tokens, batches 1, 8, 32, 64
# (benchmarks/RESULTS.md): 126.2 us from the H200's rows alone (4,245 GB/s), 124.3 us from the H100's
# (3,012 GB/s), 125.2 us from both; residuals in tok/s -9.5 / -0.8 / +3.5 / +8.5% (H200) and
# -9.9 / -1.6 / +2.3 / +6.1% (H100) at batch 1 / 8 / 32 / 64 (the measured overhead grows with the batch,
# the constant does not). It is TorchEngine's: TensorRT-LLM's C++ runtime has a lower one (not measured
# here), and an eager step (no CUDA graphs) a much higher one (14.5 ms per 22-layer step at batch 1).
# Only one model depth was measured: that the cost scales with the layers is assumed (kernels per layer).
DECODE_OVERHEAD_S_PER_LAYER = 125e-6


# --------------------------------------------------------------------------- data structures


@dataclass(frozen=True)
class Layout:
    """One role's layout: tp x cp x pp x dp devices, micro-batch size (sequences), SP, recomputation."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    sp: bool = False
    recompute: str = "none"
    ep: int = 1  # expert parallelism inside dp (MoE)
    cp: int = 1  # context parallelism: each sequence split over cp ranks (training roles)
    vpp: int = 1  # model chunks per pipeline rank (interleaved 1F1B, training roles)

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        sp = " sp" if self.sp else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        vpp = f" vpp={self.vpp}" if self.vpp > 1 else ""
        return f"tp={self.tp}{cp} pp={self.pp}{vpp} dp={self.dp}{ep}{sp} mbs={self.micro_batch_size} recompute={self.recompute}"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak memory of one device (the worst pipeline stage), bytes."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float
    reserved: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_cache + self.reserved


@dataclass(frozen=True)
class StepTime:
    """A role's share of one step, seconds: compute, TP and DP communication, PP bubble, decode."""

    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    bubble_s: float
    decode_s: float = 0.0
    a2a_s: float = 0.0  # expert-parallel token all-to-alls (MoE)
    cp_comm_s: float = 0.0  # context parallelism: K/V all-gathers and reduce-scatters, the gradient sum over cp
    pp_comm_s: float = 0.0  # the interleaved schedule's extra point-to-point messages (plain 1F1B's are not modelled)

    @property
    def total_s(self) -> float:
        return (
            self.compute_s + self.tp_comm_s + self.dp_comm_s + self.bubble_s + self.decode_s + self.a2a_s + self.cp_comm_s + self.pp_comm_s
        )


@dataclass(frozen=True)
class LayoutEstimate:
    """A layout with its memory (bytes) and step time (seconds)."""

    layout: Layout
    memory: MemoryBreakdown
    time: StepTime


@dataclass(frozen=True)
class Rejected:
    """A layout that does not work, why, and its estimates where they could be made."""

    layout: Layout
    reason: str
    estimate: Optional[LayoutEstimate] = None


@dataclass(frozen=True)
class RoleWork:
    """What one role does per step (sequences, tokens) and with which settings.

    kind: lm | score (model head); mode: train | forward | generate. batch: sequences per
    optimizer step (train) or per step (forward/generate); opt_steps: optimizer steps per step;
    forward_seqs: extra forward-only sequences per step (old log-probs, values; DPO's reference).
    optim_state_dtype: the trained role's ``optim.state_dtype`` (float32 | bfloat16 Adam moments).
    lora_rank / lora_targets: the trained role's LoRA (rank 0: full fine-tuning): only the adapters
    (and a scalar head) have gradients and optimizer state; the frozen base holds its weights only.
    frozen_copies: frozen copies of the model's weights on the same devices and layout (DPO's
    reference: model.dtype bytes per parameter, sharded over dp where the parameters are).
    dtype: the rollout engine's ``rollout.dtype`` (its weights, KV cache and activations); "" for
    the other roles (their dtype follows model.dtype and the role's mixed precision).
    scheduler, mean_response_len, tail_response_len: the rollout engine's ``rollout.scheduler`` and
    the response lengths (tokens) the decode time assumes: the mean and the longest of a batch
    (0 = new_tokens; :func:`decode_steps`).
    row_len: tokens per row the step time of a training or forward role assumes (0 = seq_len, which
    the memory always assumes: a batch may hold a row that long). For PPO's roles: the rollout
    batch's width, prompt + the longest response, under row-count micro-batches (every row is padded
    to it); prompt + the mean response under a token budget (each micro-batch is cut to its longest
    row, rows sorted by length: :mod:`aligner.runtime.runner`).
    micro_batch_tokens: ``trainer.micro_batch_tokens`` (0: row-count micro-batches of
    layout.micro_batch_size rows): micro-batches of up to this many tokens, batch * row_len / (dp *
    micro_batch_tokens) of them per pass (:func:`micro_batch_shape`); pp must be 1.
    """

    role: str
    kind: str
    mode: str
    parallel: ParallelConfig
    batch: int
    batch_field: str
    seq_len: int
    opt_steps: int = 1
    forward_seqs: int = 0
    new_tokens: int = 0
    max_batch_size: int = 0
    group: str = "actor"
    optim_state_dtype: str = "float32"
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    frozen_copies: int = 0
    dtype: str = ""
    scheduler: str = "continuous"
    mean_response_len: float = 0.0
    tail_response_len: float = 0.0
    row_len: float = 0.0
    micro_batch_tokens: int = 0


def micro_batch_shape(work: RoleWork, layout: Layout, seqs: int) -> tuple[int, float, float]:
    """(micro-batches per pass on one dp rank, rows per micro-batch, tokens per row) the step time of
    `seqs` sequences of a training or forward role assumes.

    Row-count micro-batches: ceil(seqs / (dp * layout.micro_batch_size)) of micro_batch_size rows.
    A token budget (work.micro_batch_tokens = N): the pass's seqs * row_len tokens per dp rank in
    micro-batches of N tokens, ceil(seqs * row_len / (dp * N)) of them, N / row_len rows each (a
    sorted first-fit of rows of about equal length fills each micro-batch; verl's dynamic batch size).
    Tokens per row: work.row_len, or work.seq_len when it is 0."""
    row = work.row_len or work.seq_len
    if work.micro_batch_tokens > 0:
        m = max(1, math.ceil(seqs * row / (layout.dp * work.micro_batch_tokens)))
        return m, max(1.0, work.micro_batch_tokens / row), row
    return max(1, math.ceil(seqs / (layout.dp * layout.micro_batch_size))), float(layout.micro_batch_size), row


# --------------------------------------------------------------------------- parameter counts


def role_num_parameters(model: ModelConfig, kind: str) -> int:
    """Parameters of the whole model: lm (causal LM) or score (trunk + [1, H] scalar head)."""
    n = model.num_parameters()
    if kind == "lm":
        return n
    if kind == "score":
        head = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
        return n - head + model.hidden_size
    raise ValueError(f"kind={kind!r}: valid choices are lm, score")


def role_active_parameters(model: ModelConfig, kind: str) -> int:
    """Parameters one token uses (MoE: the router and its top-k experts; a dense model: all):
    what FLOPs per token scale with (Fedus et al. 2021)."""
    return role_num_parameters(model, kind) - (model.num_parameters() - model.num_parameters(active=True))


def expert_layer_parameters(model: ModelConfig) -> int:
    """Expert MLP parameters of one MoE layer (E * 3 * H * I; 0 for a dense model), without the router."""
    return model.num_experts * 3 * model.hidden_size * model.intermediate_size if model.num_experts else 0


def layer_num_parameters(model: ModelConfig) -> int:
    """Parameters of one decoder layer (attention, SwiGLU MLP, two RMSNorm weights)."""
    h = model.hidden_size
    head = 0 if model.tie_word_embeddings else model.vocab_size * h
    return (model.num_parameters() - model.vocab_size * h - head - h) // model.num_layers


def layers_on_stage(num_layers: int, pp: int, stage: int) -> int:
    """Decoder layers on pipeline stage `stage` of `pp` (even split, first stages take the rest)."""
    return num_layers // pp + (1 if stage < num_layers % pp else 0)


def stage_expert_parameters(model: ModelConfig, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Expert parameters on one device of (tp, pp stage, ep): each MoE layer's E / ep experts, 1/tp of each."""
    return layers_on_stage(model.num_layers, pp, stage) * (expert_layer_parameters(model) // (tp * ep))


def stage_num_parameters(model: ModelConfig, kind: str, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Parameters held by one device of (tp, pp stage): TP shards all but RMSNorm weights (and the
    MoE router); expert parallelism keeps E / ep of each layer's experts."""
    h, v = model.hidden_size, model.vocab_size
    layer = layer_num_parameters(model)
    experts = expert_layer_parameters(model)
    router = model.num_experts * h
    dense = (layer - 2 * h - experts - router) // tp + 2 * h + router
    n = layers_on_stage(model.num_layers, pp, stage) * (dense + experts // (tp * ep))
    if stage == 0:
        n += v * h // tp
    if stage == pp - 1:
        n += h  # final norm
        if kind == "score":
            n += h
        elif not model.tie_word_embeddings or pp > 1:
            n += v * h // tp  # lm_head (a tied copy lives on the last stage when pp > 1)
    return n


def largest_weight_numel(model: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """Elements of the largest weight tensor on one device: the embedding / lm_head [V/tp, H], a
    SwiGLU weight [I/tp, H] (an MoE layer's stacked experts: E/ep of them) or q / o [q/tp, H]."""
    h = model.hidden_size
    mlp = h * model.intermediate_size // tp * (model.num_experts // ep if model.num_experts else 1)
    return max(model.vocab_size * h // tp, mlp, model.num_heads * model.resolved_head_dim * h // tp)


def lora_num_parameters(model: ModelConfig, rank: int, targets: Iterable[str], tp: int, layers: int) -> tuple[int, int]:
    """(parameters, tensors) of the LoRA adapters on one device holding `layers` decoder layers
    (aligner.nn.lora): per adapted linear A [r, in] + B [out, r], column-parallel ones (q, k, v,
    gate, up) with B split over tp, row-parallel ones (o, down) with A split over tp."""
    h, hd, inter = model.hidden_size, model.resolved_head_dim, model.intermediate_size
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    shapes = {  # (in, out, column-parallel)
        "q_proj": (h, q, True),
        "k_proj": (h, kv, True),
        "v_proj": (h, kv, True),
        "o_proj": (q, h, False),
        "gate_proj": (h, inter, True),
        "up_proj": (h, inter, True),
        "down_proj": (inter, h, False),
    }
    per_layer = 0
    names = [t for t in targets if t in shapes]
    for t in names:
        i, o, column = shapes[t]
        per_layer += rank * i + math.ceil(rank * o / tp) if column else math.ceil(rank * i / tp) + rank * o
    return per_layer * layers, 2 * len(names) * layers


def stage_num_tensors(model: ModelConfig, kind: str, pp: int, stage: int) -> int:
    """Parameter tensors on one stage (each gets a 4-byte Adam ``step`` tensor in torch)."""
    per_layer = 9 + (3 if model.attention_bias else 0) + (1 if getattr(model, "o_proj_bias", False) else 0)
    per_layer += 1 if model.num_experts else 0  # router + 3 stacked expert tensors instead of 3 MLP weights
    n = layers_on_stage(model.num_layers, pp, stage) * per_layer
    if stage == 0:
        n += 1
    if stage == pp - 1:
        n += 1 + (1 if kind == "score" or not model.tie_word_embeddings or pp > 1 else 0)
    return n


# --------------------------------------------------------------------------- memory model


def activation_dtype_bytes(model: ModelConfig, pc: ParallelConfig) -> int:
    """Bytes per activation element: 2 under bf16 mixed precision, else the model dtype's."""
    return 2 if pc.mixed_precision == "bf16" else DTYPE_BYTES[model.dtype]


def _dp_shards(pc: ParallelConfig) -> tuple[bool, bool, bool]:
    """(params, grads, optimizer) sharded over dp: FSDP2 all (ZeRO-3), DDP none, DeepSpeed by stage."""
    if pc.dp_backend == "fsdp2":
        return True, True, True
    if pc.dp_backend == "ddp":
        return False, False, False
    return pc.zero_stage >= 3, pc.zero_stage >= 2, pc.zero_stage >= 1


def train_state_bytes(
    params: int, tensors: int, layer_params: int, pc: ParallelConfig, model: ModelConfig, dp: int, state_dtype: str = "float32"
) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes on one device holding `params` parameters before dp sharding.

    ZeRO accounting (Rajbhandari et al. 2020): mixed precision = bf16 copy 2 B + fp32 master 4 B,
    fp32 grads 4 B (bf16 2 B under DeepSpeed), Adam m and v 8 B; without mixed precision every
    state is in model.dtype (torch's AdamW allocates m, v like the parameter). state_dtype
    (``optim.state_dtype``) bfloat16 stores m and v in 2 B each (aligner.runtime.adamw), so an fp32
    run holds 4 + 4 + 4 = 12 B per parameter instead of 16. The fp32 master counts as optimizer
    state under DeepSpeed (sharded from ZeRO-1) and as weights otherwise. `tensors`: parameter
    tensors (a 4 B Adam ``step`` each). `layer_params`: one layer's parameters on this device
    (0: count no gathered buffers); with sharded parameters and dp > 1 the weights add the gathered
    parameters and the grads the unsharded gradient buffers of :func:`zero3_buffer_bytes`.
    Raises KeyError: an unknown state_dtype.
    """
    p_sh, g_sh, o_sh = _dp_shards(pc)

    def sh(x: float, flag: bool) -> float:
        return math.ceil(x / dp) if flag else x

    bf16 = pc.mixed_precision == "bf16"
    e = DTYPE_BYTES[model.dtype]
    deepspeed = pc.dp_backend == "deepspeed"
    offload = deepspeed and pc.offload_optimizer
    master = 0 if offload else (4 * params if bf16 else e * params)
    compute_copy = 2 * params if bf16 else 0
    if deepspeed:
        weights = sh(compute_copy if bf16 else master, p_sh) + (0 if not bf16 else sh(master, o_sh))
    else:
        weights = sh(master + compute_copy if not p_sh else master, p_sh)
    grads = sh(params * ((2 if deepspeed else 4) if bf16 else e), g_sh)
    if p_sh and dp > 1 and layer_params > 0:
        gathered, grad_buffers = zero3_buffer_bytes(layer_params, params, pc, model)
        weights, grads = weights + gathered, grads + grad_buffers
    moment = DTYPE_BYTES[state_dtype] if state_dtype != "float32" else (4 if bf16 else e)
    adam = 0 if offload else sh(params * 2 * moment, o_sh) + 4 * tensors
    return float(weights), float(grads), float(adam)


def zero3_buffer_bytes(layer_params: int, params: int, pc: ParallelConfig, model: ModelConfig) -> tuple[float, float]:
    """(gathered parameters, unsharded gradient buffers) bytes at the peak of a ZeRO-3-style step
    (FSDP2, DeepSpeed stage 3), on one device of a dp > 1 group, beside the dp-sharded state.

    Gathered parameters and gradients are in the compute dtype c (bf16 under bf16 mixed precision:
    FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16), DeepSpeed's bf16 partitions; else model.dtype).
    - FSDP2 (aligner.parallel.data_parallel.apply_fsdp2: ``fully_shard`` per decoder layer):
      the layer running and the next one, prefetched (FSDP2's implicit prefetch in forward and
      backward): 2 * layer_params * c; in backward the layer's unsharded gradient (c) and the
      reduce-scatter input FSDP2 copies it into in the reduce dtype r (float32 under bf16:
      ``reduce_dtype=float32``; else c): layer_params * (c + r).
    - DeepSpeed ZeRO-3 (partitioned_param_coordinator, DeepSpeed 0.19 defaults): each submodule's
      own parameters are gathered at its pre-forward hook and released after it; the next
      parameters are prefetched, at least one tensor and up to stage3_prefetch_bucket_size (5e7)
      elements, only while fewer than stage3_max_live_parameters (1e9) are gathered. Counted: the
      largest weight W (:func:`largest_weight_numel`) plus, when W < 1e9, max(W, 5e7) prefetched
      (at most the device's parameters). In backward W's full gradient (c) and the reduce bucket,
      reduce_bucket_size (5e8) elements of c (at most the device's parameters).
    `layer_params`: one layer's parameters on this device; `params`: the device's parameters before
    dp sharding (bounds DeepSpeed's prefetch and bucket on small models).
    """
    bf16 = pc.mixed_precision == "bf16"
    c = 2 if bf16 else DTYPE_BYTES[model.dtype]
    if pc.dp_backend == "deepspeed":
        w = min(largest_weight_numel(model), params)
        prefetch = 0 if w >= DS_MAX_LIVE_PARAMETERS else min(max(w, DS_PREFETCH_BUCKET_SIZE), params)
        return float((w + prefetch) * c), float((w + min(DS_REDUCE_BUCKET_SIZE, params)) * c)
    r = 4 if bf16 else c
    return float(2 * layer_params * c), float(layer_params * (c + r))


def frozen_weight_bytes(params: int, pc: ParallelConfig, model: ModelConfig, dp: int) -> float:
    """Bytes of a frozen copy of `params` parameters (no grads, no optimizer state) in model.dtype,
    sharded over dp where the trained copy's parameters are (FSDP2, ZeRO-3)."""
    p_sh, _, _ = _dp_shards(pc)
    n = DTYPE_BYTES[model.dtype] * params
    return float(math.ceil(n / dp) if p_sh else n)


def train_bytes_per_parameter(pc: ParallelConfig, model: ModelConfig, state_dtype: str = "float32") -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per trained parameter before dp sharding, without the
    per-tensor Adam ``step`` and FSDP2's gathered layers: :func:`train_state_bytes` of one
    parameter. fp32: (4, 4, 8) = 16 B; with state_dtype=bfloat16: (4, 4, 4) = 12 B."""
    return train_state_bytes(1, 0, 0, pc, model, 1, state_dtype)


def rmsnorm_bytes_per_token(hidden: int, e: int) -> int:
    """One unfused RMSNorm: fp32 input (4h), normalized and output in the activation dtype (2eh), fp32 rstd."""
    return 4 * hidden + 2 * e * hidden + 4


def training_precision(model: ModelConfig, pc: ParallelConfig, dp: int) -> str:
    """How a training layout computes (aligner.parallel.memory.PRECISIONS): fp32; bf16 parameters
    (FSDP2 with dp > 1, DeepSpeed, or a bf16 model dtype); or fp32 parameters under torch.autocast
    (bf16 mixed precision with DDP or a single dp rank, as aligner.runtime.train_runtime runs it)."""
    if pc.mixed_precision != "bf16":
        return "fp32" if DTYPE_BYTES[model.dtype] == 4 else "bf16"
    if pc.dp_backend == "deepspeed" or (pc.dp_backend == "fsdp2" and dp > 1):
        return "bf16"
    return "autocast"


def layer_activation_bytes_per_token(model: ModelConfig, precision: str, tp: int, sp: bool, recompute: str, seq_len: int) -> float:
    """Bytes saved for backward per token by one decoder layer: :func:`aligner.parallel.memory.layer_activation_bytes`
    (the one activation-memory model, measured in tests/parallel/test_memory.py) over a [1, seq_len]
    micro-batch, divided by seq_len. Under autocast it includes the layer's bf16 weight casts spread
    over the tokens. RL and RM batches are unpacked (plain causal attention, no mask). An MoE layer
    is counted as a SwiGLU MLP k times as wide (each token runs through k experts of width I; the
    router's [tokens, E] logits are left out)."""
    dims = LayerDims.of(model, seq_len, 1, tp)
    if model.num_experts:
        dims = replace(dims, i=dims.i * model.num_experts_per_tok)
    return layer_activation_bytes(dims, precision, sp, recompute) / seq_len


def shared_activation_bytes(model: ModelConfig, e: int, batch: int, seq_len: int, recompute: str, first: bool) -> float:
    """Per micro-batch, not per layer: input ids (int64, first stage) and RoPE cos and sin
    (unpacked batches build no attention mask)."""
    ids = 8 * batch * seq_len if first else 0
    rope = 2 * batch * seq_len * model.resolved_head_dim * e
    return ids + rope


def head_activation_bytes_per_token(model: ModelConfig, e: int, tp: int, sp: bool, kind: str) -> float:
    """Last stage: final RMSNorm plus the fp32 log-softmax of the logits, 4V/t (the paper's 4sbv/t);
    a score head keeps one fp32 scalar per token instead."""
    norm = rmsnorm_bytes_per_token(model.hidden_size, e) / (tp if sp else 1)
    return norm + (4 * model.vocab_size / tp if kind == "lm" else 4)


def autocast_weight_cast_bytes(model: ModelConfig, tp: int) -> float:
    """Bytes of the bf16 casts of one decoder layer's linear weights on one device under
    torch.autocast: the tokens-independent term of :func:`aligner.parallel.memory.layer_activation_bytes`
    (2 B per q, k, v, o, gate, up, down weight element / tp), taken from it at s = 0."""
    return layer_activation_bytes(replace(LayerDims.of(model, 1, 1, tp), s=0), "autocast", False, "none")


def train_activation_bytes(
    model: ModelConfig,
    kind: str,
    layout: Layout,
    e: int,
    seq_len: int,
    num_microbatches: int,
    stage: int,
    precision: str,
    frozen_base: bool = False,
) -> float:
    """Activation bytes on pipeline stage `stage` under 1F1B: min(pp - stage, m) micro-batches in flight.

    e: activation element bytes (shared inputs, head); precision: how the layers compute (:func:`training_precision`).
    frozen_base: the layers' linear weights are frozen (LoRA). Under "autocast" the bf16 weight casts
    (:func:`autocast_weight_cast_bytes` per layer) are counted as the runtime holds them: once per
    stage, whatever the micro-batches in flight. torch.autocast caches the cast of a trainable fp32
    leaf for its whole context (the forward with pp = 1, the whole 1F1B step with pp > 1;
    recomputation hits the cache); it never caches a frozen weight's, but
    ``TrainRuntime.forward_backward`` makes each frozen cast once per step and shares it between the
    micro-batches (:func:`aligner.nn.layers.frozen_weight_casts`). Under full recomputation the
    runtime does not share the frozen casts: only the layer being recomputed holds them.
    tests/test_planner.py measures both on the CPU.
    """
    b, pp = layout.micro_batch_size, layout.pp
    in_flight = interleaved_in_flight(pp, layout.vpp, num_microbatches, stage)
    layers = layers_on_stage(model.num_layers, pp, stage)
    full_len, seq_len = seq_len, seq_len // layout.cp  # a cp rank holds seq_len / cp tokens of every row
    layer = layer_activation_bytes(LayerDims.of(model, seq_len, b, layout.tp), precision, layout.sp, layout.recompute)
    layer += cp_gathered_kv_bytes(model, layout, b, full_len, e)
    casts = 0.0
    if precision == "autocast":
        cast = autocast_weight_cast_bytes(model, layout.tp)
        if layout.recompute != "full":
            layer -= cast  # counted below, once per stage
        casts = cast if frozen_base and layout.recompute == "full" else layers * cast
    per_mb = layers * layer + shared_activation_bytes(model, e, b, seq_len, layout.recompute, stage == 0)
    head = head_activation_bytes_per_token(model, e, layout.tp, layout.sp, kind) * b * seq_len if stage == pp - 1 else 0
    return in_flight * per_mb + head + casts


def cp_gathered_kv_bytes(model: ModelConfig, layout: Layout, batch: int, seq_len: int, e: int) -> float:
    """What context parallelism changes in one layer's saved bytes on a cp rank (beyond holding
    seq_len / cp tokens): without recomputation the attention saves the all-gathered K and V of the
    whole sequence (kv heads, not repeated: GQA runs inside SDPA) where one process saves K and V
    repeated to the query heads for its own tokens; recomputing the core saves only the local q, k,
    v (as without cp). 0 for cp = 1 or recompute selective / full. Bytes, may be negative."""
    if layout.cp == 1 or layout.recompute != "none":
        return 0.0
    hd, t = model.resolved_head_dim, layout.tp
    q, kv = model.num_heads * hd / t, max(model.num_kv_heads, t) * hd / t
    return 2.0 * e * batch * (kv * seq_len - q * seq_len / layout.cp)


def cp_comm_seconds(model: ModelConfig, layout: Layout, batch: float, seq_len: float, e: int, passes: int, cluster: ClusterConfig) -> float:
    """Seconds of context parallelism's K/V exchange in `passes` layer passes of one micro-batch
    (forward all-gather, backward reduce-scatter, a recomputed core gathers again): each moves the
    whole sequence's K and V (kv heads, tp-split), an all-gather costing half a ring all-reduce,
    inside a node while tp * cp fits one."""
    if layout.cp == 1:
        return 0.0
    kv = max(model.num_kv_heads, layout.tp) * model.resolved_head_dim / layout.tp
    nbytes = 2 * batch * seq_len * kv * e
    return passes * 0.5 * ring_allreduce_seconds(nbytes, layout.cp, _cp_gbps(layout, cluster))


def _cp_gbps(layout: Layout, cluster: ClusterConfig) -> float:
    """cp groups sit next to tp in the rank order: inside a node while tp * cp fits one."""
    inside = cluster.gpus_per_node <= 0 or layout.tp * layout.cp <= cluster.gpus_per_node
    return cluster.intra_node_gbps if inside else cluster.inter_node_gbps


def inference_activation_bytes(model: ModelConfig, kind: str, tp: int, e: int, tokens: int, last: bool) -> float:
    """Forward-only working set for `tokens` tokens: one layer's live tensors (input, normed, q, k, v,
    output, gate, up, product) plus, on the last stage, the fp32 logits (lm) or scores."""
    h, hd = model.hidden_size, model.resolved_head_dim
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    layer = e * (2 * h + (2 * q + 2 * kv + 3 * model.intermediate_size) / tp)
    head = (4 + e) * model.vocab_size / tp if kind == "lm" else 4
    return tokens * (layer + (head if last else 0))


def kv_cache_bytes(model: ModelConfig, e: int, tp: int, pp: int, batch: int, seq_len: int) -> float:
    """KV cache of one device: 2 * ceil(L/pp) * max(kv_heads/tp, 1) * head_dim * e * batch * seq (bytes).

    With tp > num_kv_heads the KV heads are replicated, so each device still holds one."""
    layers = layers_on_stage(model.num_layers, pp, 0)
    kv_local = max(model.num_kv_heads // tp, 1)
    return 2.0 * layers * kv_local * model.resolved_head_dim * e * batch * seq_len


# --------------------------------------------------------------------------- time model


def train_flops_per_token(n_params: int, model: ModelConfig, seq_len: int, recompute: str, frozen_params: int = 0) -> float:
    """Training FLOPs per token: 6N + 12*L*H*T (PaLM, Chowdhery et al. 2022, appendix B), plus a
    second forward (2N + 4LHT) for full recomputation or the attention core (4LHT) for selective.
    frozen_params (of n_params, a LoRA base): no weight gradients, so 4 FLOPs per token each (forward
    and input gradient) instead of 6; the attention core has no weights and keeps its 12LHT."""
    attn = 4.0 * model.num_layers * model.hidden_size * seq_len
    extra = {"none": 0.0, "selective": attn, "full": 2.0 * n_params + attn}[recompute]
    return 6.0 * n_params - 2.0 * frozen_params + 3 * attn + extra


def forward_flops_per_token(n_params: int, model: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token: 2N + 4*L*H*T (PaLM appendix B)."""
    return 2.0 * n_params + 4.0 * model.num_layers * model.hidden_size * seq_len


def a2a_elements_per_layer(model: ModelConfig, tokens: int) -> int:
    """Elements one expert-parallel all-to-all moves for `tokens` tokens (dispatch or combine):
    every token's k rows of H, dropless. A forward does two per MoE layer (dispatch, combine), a
    backward two more. The CommCounter of aligner.nn.comm counts the same elements."""
    return tokens * model.num_experts_per_tok * model.hidden_size if model.num_experts else 0


def a2a_seconds(nbytes: float, n: int, gbps: float) -> float:
    """All-to-all of `nbytes` per rank over n ranks: (n-1)/n of it leaves the rank; 0 for n = 1."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / (gbps * GB) + COLLECTIVE_LATENCY_S


def ring_allreduce_seconds(nbytes: float, n: int, gbps: float) -> float:
    """Ring all-reduce of `nbytes` over n ranks: 2(n-1)/n * bytes / bandwidth (GB/s); 0 for n = 1."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes / (gbps * GB)


def compute_seconds(flops: float, devices: int, cluster: ClusterConfig, efficiency: float = MODEL_FLOPS_EFFICIENCY) -> float:
    """FLOPs / (devices * peak TFLOP/s * efficiency), seconds; efficiency defaults to
    MODEL_FLOPS_EFFICIENCY (the rollout engine's prefill), training passes give :func:`gemm_efficiency`."""
    return flops / (devices * cluster.gpu_peak_tflops * 1e12 * efficiency)


def gemm_efficiency(model: ModelConfig, layout: Layout, rows: float, seq: float) -> float:
    """Fraction of peak FLOP/s (MFU) a training or forward pass reaches on this layout's GEMMs:
    MFU_MAX * x / (x + MFU_HALF_DIM) with x = min(hidden / tp, rows * seq / cp), the smaller dimension of
    a layer's per-GPU GEMMs (a [tokens, H] x [H, H / tp] projection): narrow tp shards and short
    micro-batches would run the tensor cores further from their peak. Constants fitted to half of Narayanan
    et al. 2021, Table 1 (see MFU_MAX), whose fit is flat (MFU_HALF_DIM = 0): MFU_MAX at every shape until a
    fit to smaller shapes sets the half-point; dimensionless, in (0, MFU_MAX]."""
    x = min(model.hidden_size / layout.tp, rows * seq / layout.cp)
    return MFU_MAX * x / (x + MFU_HALF_DIM) if x > 0 else 0.0


def exposed_dp_seconds(total_s: float, window_s: float, tail_s: float) -> float:
    """Seconds of a data-parallel gradient reduction of `total_s` seconds that the step waits for when it
    runs beside `window_s` seconds of compute: what exceeds the window, and at least `tail_s` (the last
    bucket or layer, reduced after the compute ends); never more than total_s."""
    return min(total_s, max(total_s - window_s, tail_s))


def pipeline_bubble_fraction(pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """1F1B bubble relative to the ideal compute time: (p - 1) / m, and (p - 1) / (v m) with v model
    chunks per rank (interleaved; Narayanan et al. 2021, sec. 2.2)."""
    return (pp - 1) / (max(num_microbatches, 1) * vpp)


def interleaved_in_flight(pp: int, vpp: int, num_microbatches: int, stage: int) -> float:
    """Micro-batches' worth of stage `stage`'s layer activations held at its peak: min(pp - stage, m)
    under 1F1B; with v chunks per rank, min(m v, 2 (pp - stage - 1) + (v - 1) pp + 1) chunk forwards of
    1 / v of the stage's layers each (Megatron's interleaved warm-up plus the forward before the first
    backward: on stage 0 about 1 + (p - 1) / (p v) times plain 1F1B's, Narayanan et al. 2021)."""
    if vpp == 1:
        return float(min(pp - stage, num_microbatches))
    return min(num_microbatches * vpp, 2 * (pp - stage - 1) + (vpp - 1) * pp + 1) / vpp


def interleaved_p2p_seconds(model: ModelConfig, layout: Layout, micro_batches: int, seq: int, e: int, cluster: ClusterConfig) -> float:
    """Seconds of the point-to-point messages the interleaved schedule adds to plain 1F1B's in one
    optimizer step: (v - 1) m more activation sends and as many gradient sends per rank, each
    [b, seq / cp (/ tp with SP), H] elements, over the inter-node link when the pipeline spans nodes."""
    if layout.vpp == 1:
        return 0.0
    nbytes = layout.micro_batch_size * seq / layout.cp * model.hidden_size * e / (layout.tp if layout.sp else 1)
    return 2 * (layout.vpp - 1) * micro_batches * nbytes / (_dp_gbps(layout, cluster) * 1e9)


def devices_per_node(cluster: ClusterConfig) -> int:
    """Devices per node the planner counts: the GPUs, or 1 on a CPU-only cluster (gpus_per_node = 0)."""
    return cluster.gpus_per_node if cluster.gpus_per_node > 0 else 1


def _dp_gbps(layout: Layout, cluster: ClusterConfig) -> float:
    """dp groups (and the pipeline's ring of stages) are the slowest-varying mesh axes: inside a node
    only if the whole mesh is."""
    inside = cluster.gpus_per_node > 0 and layout.devices <= cluster.gpus_per_node
    return cluster.intra_node_gbps if inside else cluster.inter_node_gbps


def _pass_time(
    flops: float,
    mb: int,
    layers: int,
    colls: int,
    layout: Layout,
    model: ModelConfig,
    e: int,
    seq: float,
    cluster: ClusterConfig,
    rows: Optional[float] = None,
) -> tuple[float, float, float]:
    """(compute, tp comm, bubble) seconds of `mb` micro-batches of `rows` rows (None:
    layout.micro_batch_size) of `seq` tokens through the pipeline, the compute at
    :func:`gemm_efficiency` of peak. `layers`: the
    first (largest) stage's; with stages of unequal depth (num_layers not divisible by pp: the first
    num_layers % pp stages take one more) the pipeline runs at that stage's pace, so the compute is
    scaled by layers * pp / num_layers."""
    rows = layout.micro_batch_size if rows is None else rows
    eff = gemm_efficiency(model, layout, rows, seq)
    compute = compute_seconds(flops, layout.devices, cluster, eff) * layers * layout.pp / model.num_layers
    size = rows * seq / layout.cp * model.hidden_size * e  # a cp rank's tokens
    tp_comm = mb * layers * colls * ring_allreduce_seconds(size, layout.tp, cluster.intra_node_gbps)
    bubble = (compute + tp_comm) * pipeline_bubble_fraction(layout.pp, mb, layout.vpp)
    return compute, tp_comm, bubble


def _a2a_time(
    model: ModelConfig,
    layout: Layout,
    micro_batches: int,
    seq: float,
    e: int,
    per_layer: int,
    cluster: ClusterConfig,
    rows: Optional[float] = None,
) -> float:
    """Expert-parallel all-to-all seconds of `micro_batches` passes of `rows` rows (None:
    layout.micro_batch_size): `per_layer` all-to-alls per MoE
    layer of this stage (2 forward, 4 forward + backward, 6 with full recomputation)."""
    if layout.ep <= 1 or not model.num_experts:
        return 0.0
    layers = layers_on_stage(model.num_layers, layout.pp, 0)
    rows = layout.micro_batch_size if rows is None else rows
    nbytes = a2a_elements_per_layer(model, math.ceil(rows * seq)) * e
    return micro_batches * layers * per_layer * a2a_seconds(nbytes, layout.ep, _dp_gbps(layout, cluster))


def train_step_time(model: ModelConfig, work: RoleWork, layout: Layout, grad_bytes: float, cluster: ClusterConfig) -> StepTime:
    """Seconds per step of a training role: opt_steps optimizer steps (+ the forward-only passes).
    FLOPs follow the active parameters (MoE: top-k experts per token); with LoRA the frozen base
    computes no weight gradients (:func:`train_flops_per_token`) and the adapters add theirs."""
    n = role_active_parameters(model, work.kind)
    frozen = 0
    if work.lora_rank > 0:  # the base is frozen (a score head trains: h parameters); the adapters train
        frozen = n - (model.hidden_size if work.kind == "score" else 0)
        n += lora_num_parameters(model, work.lora_rank, work.lora_targets, 1, model.num_layers)[0]
    e = activation_dtype_bytes(model, work.parallel)
    layers = layers_on_stage(model.num_layers, layout.pp, 0)
    m, rows, seq = micro_batch_shape(work, layout, work.batch)
    colls = 6 if layout.recompute == "full" else 4
    flops = train_flops_per_token(n, model, seq, layout.recompute, frozen) * work.batch * seq
    c, t, b = _pass_time(flops, m, layers, colls, layout, model, e, seq, cluster, rows)
    fsdp = work.parallel.dp_backend == "fsdp2" and layout.dp > 1
    fwd_share = forward_flops_per_token(n, model, seq) / train_flops_per_token(n, model, seq, layout.recompute, frozen)
    if fsdp:  # per micro-batch, overlapped per pass; the pipeline's slots (and so its bubble) grow with it
        dp = m * fsdp2_microbatch_exposed_seconds(model, work, layout, c / m * fwd_share, c / m * (1.0 - fwd_share), cluster)
        b += dp * pipeline_bubble_fraction(layout.pp, m, layout.vpp)
    else:
        p_sh, _, _ = _dp_shards(work.parallel)
        factor = 1.5 if p_sh else 1.0  # ZeRO-3: all-gather + reduce-scatter = 1.5 all-reduces
        dp = factor * ring_allreduce_seconds(grad_bytes, layout.dp, _dp_gbps(layout, cluster))
        dp = dp_overlap_exposed(dp, c, m, layers, n, frozen, model, seq, layout, work, grad_bytes, cluster)
    steps = work.opt_steps
    a2a = _a2a_time(model, layout, m, seq, e, 6 if layout.recompute == "full" else 4, cluster, rows)
    passes = 2 if layout.recompute == "none" else 3
    cp = m * layers * cp_comm_seconds(model, layout, rows, seq, e, passes, cluster)
    if layout.cp > 1:  # the gradient sum over cp (parameters are replicated over it)
        cp += ring_allreduce_seconds(grad_bytes, layout.cp, _cp_gbps(layout, cluster))
    pp = interleaved_p2p_seconds(model, layout, m, seq, e, cluster)
    c, t, b, dp, a2a, cp, pp = c * steps, t * steps, b * steps, dp * steps, a2a * steps, cp * steps, pp * steps
    if work.forward_seqs:
        mf, rows_f, _ = micro_batch_shape(work, layout, work.forward_seqs)
        ff = forward_flops_per_token(n, model, seq) * work.forward_seqs * seq
        c2, t2, b2 = _pass_time(ff, mf, layers, 2, layout, model, e, seq, cluster, rows_f)
        if fsdp:  # the forward-only passes all-gather every layer too (no backward, no reduce-scatter)
            d2 = mf * fsdp2_microbatch_exposed_seconds(model, work, layout, c2 / mf, None, cluster)
            dp, b2 = dp + d2, b2 + d2 * pipeline_bubble_fraction(layout.pp, mf, layout.vpp)
        c, t, b = c + c2, t + t2, b + b2
        a2a += _a2a_time(model, layout, mf, seq, e, 2, cluster, rows_f)
        cp += mf * layers * cp_comm_seconds(model, layout, rows_f, seq, e, 1, cluster)
    return StepTime(compute_s=c, tp_comm_s=t, dp_comm_s=dp, bubble_s=b, a2a_s=a2a, cp_comm_s=cp, pp_comm_s=pp)


def dp_overlap_exposed(
    dp_s: float,
    compute_s: float,
    micro_batches: int,
    layers: int,
    n: int,
    frozen: int,
    model: ModelConfig,
    seq: float,
    layout: Layout,
    work: RoleWork,
    grad_bytes: float,
    cluster: ClusterConfig,
) -> float:
    """Seconds of one optimizer step's dp gradient reduction (`dp_s` in all) left after its overlap with
    compute, where aligner's runtime overlaps it (:mod:`aligner.runtime.train_runtime`):

    - DDP with pp = 1: the bucketed all-reduce runs during the last micro-batch's backward (the earlier ones
      accumulate under ``no_sync``): exposed is what exceeds that backward (compute_s / micro_batches times
      the backward's share of the training FLOPs), at least the last bucket's all-reduce (DDP_BUCKET_BYTES).
    - DDP with pp > 1: all-reduced after the pipeline's flush (``finalize_grads``): not overlapped.
    - FSDP2 with dp > 1: not charged here, per micro-batch instead (:func:`fsdp2_microbatch_exposed_seconds`).
    - DeepSpeed: not overlapped (aligner's DeepSpeed config leaves ``overlap_comm`` at its default, off
      for ZeRO-1/2), once per step. An undercount for m > 1 left as it was: the config's
      ``gradient_accumulation_steps: 1`` makes every ``engine.backward`` (one per micro-batch) an accumulation
      boundary, so DeepSpeed reduces (ZeRO-3: also gathers) for every micro-batch (docs/planner.md).

    compute_s: one optimizer step's compute on a stage (seconds, no bubble); n, frozen: the trained
    role's active and frozen parameters (:func:`train_flops_per_token`)."""
    if dp_s <= 0.0 or layout.dp <= 1:
        return dp_s
    backend = work.parallel.dp_backend
    if backend == "ddp" and layout.pp == 1:
        total = train_flops_per_token(n, model, seq, layout.recompute, frozen)
        share = max(0.0, 1.0 - forward_flops_per_token(n, model, seq) / total)
        tail = ring_allreduce_seconds(min(DDP_BUCKET_BYTES, grad_bytes), layout.dp, _dp_gbps(layout, cluster))
        return exposed_dp_seconds(dp_s, compute_s / max(micro_batches, 1) * share, tail)
    return dp_s


def fsdp2_microbatch_exposed_seconds(
    model: ModelConfig, work: RoleWork, layout: Layout, forward_s: float, backward_s: Optional[float], cluster: ClusterConfig
) -> float:
    """Seconds FSDP2's collectives add to one micro-batch on a stage (dp > 1), beyond its compute.

    What aligner's runtime does, per micro-batch (not per optimizer step):
    - :func:`aligner.parallel.data_parallel.apply_fsdp2` calls ``fully_shard`` on every decoder layer and then on
      the model (the root: embedding, final norm, head), with ``reshard_after_forward=True``
      (:func:`aligner.parallel.parallelize.apply_data_parallel` passes no other value), and the runtime never calls
      ``set_requires_gradient_sync``, ``set_reshard_after_backward`` or ``no_sync`` for FSDP2
      (:meth:`aligner.runtime.train_runtime.TrainRuntime._accumulating` skips DDP's sync only; pipeline.py neither).
      So every micro-batch's forward all-gathers each layer's parameters, its backward all-gathers them again
      and reduce-scatters the layer's gradient (torch FSDP2: a layer's group is unsharded in its pre-forward and
      pre-backward hooks and reduce-scattered in its post-backward). The root is not resharded after forward
      (torch's FSDP2 root heuristic): gathered once per micro-batch, reduce-scattered once.
    - Bytes: gathers in the compute dtype c (bf16: ``MixedPrecisionPolicy(param_dtype=bfloat16)`` casts the
      shard before the all-gather; else model.dtype), reduce-scatters in the reduce dtype r (fp32:
      ``reduce_dtype=float32``; else c), of the trained parameters only (a LoRA base is sharded and gathered
      but has no gradient). MoE experts with ep > 1 sit on their own ``fully_shard`` over dp / ep ranks.
      Each collective's time is (n - 1) / n of the unsharded bytes over :func:`_dp_gbps` (half a ring
      all-reduce: an all-gather or a reduce-scatter).
    - Overlap, per pass: torch runs the collectives on their own streams; in forward the next layer's
      all-gather is issued while the current layer computes (implicit prefetch), in backward the next layer's
      all-gather is prefetched explicitly and each reduce-scatter runs beside the next layer's backward. Exposed:
      what exceeds the pass's compute (`forward_s`, `backward_s`: this micro-batch's forward and backward compute
      on the stage), and at least one layer's transfer per pass (the forward's first gather, the backward's last
      reduce-scatter), plus the root's gather (before the first layer) and reduce-scatter (after the last).
    backward_s None: a forward-only pass (the trained role's extra forwards: gathers, no reduce-scatter).
    Not modelled: contention between these collectives and TP's or the pipeline's on shared links, and the
    interleaved schedule's chunks (a stage's layers are gathered once per micro-batch and pass, as without)."""
    if layout.dp <= 1:
        return 0.0
    bf16 = work.parallel.mixed_precision == "bf16"
    c = 2 if bf16 else DTYPE_BYTES[model.dtype]
    r = 4 if bf16 else c
    h = model.hidden_size
    experts = expert_layer_parameters(model)
    router = model.num_experts * h
    dense = (layer_num_parameters(model) - 2 * h - experts - router) // layout.tp + 2 * h + router
    local_experts = experts // (layout.tp * layout.ep)
    if layout.ep > 1:  # experts on the expert-data-parallel mesh (dp / ep ranks); ep = dp: not FSDP-sharded
        exp_dp = layout.dp // layout.ep
    else:
        dense, local_experts, exp_dp = dense + local_experts, 0, 1
    adapters = lora_num_parameters(model, work.lora_rank, work.lora_targets, layout.tp, 1)[0] if work.lora_rank > 0 else 0
    gbps = _dp_gbps(layout, cluster)

    def half(nbytes: float, n: int) -> float:
        return 0.5 * ring_allreduce_seconds(nbytes, n, gbps)

    gather = half((dense + adapters) * c, layout.dp) + half(local_experts * c, exp_dp)
    if work.lora_rank > 0:
        reduce = half(adapters * r, layout.dp)
    else:
        reduce = half(dense * r, layout.dp) + half(local_experts * r, exp_dp)
    layers = layers_on_stage(model.num_layers, layout.pp, 0)
    root = 0
    for stage in sorted({0, layout.pp - 1}):
        held = stage_num_parameters(model, work.kind, layout.tp, layout.pp, stage, layout.ep)
        root = max(root, held - layers_on_stage(model.num_layers, layout.pp, stage) * (dense + local_experts))
    root_trained = (h if work.kind == "score" else 0) if work.lora_rank > 0 else root
    exposed = half(root * c, layout.dp) + exposed_dp_seconds(layers * gather, forward_s, gather)
    if backward_s is not None:
        exposed += half(root_trained * r, layout.dp) + exposed_dp_seconds(layers * (gather + reduce), backward_s, reduce)
    return exposed


def forward_step_time(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> StepTime:
    """Seconds per step of a forward-only role (reference log-probs, reward scores)."""
    n = role_active_parameters(model, work.kind)
    e = activation_dtype_bytes(model, work.parallel)
    mb, rows, seq = micro_batch_shape(work, layout, work.batch)
    flops = forward_flops_per_token(n, model, seq) * work.batch * seq
    c, t, b = _pass_time(flops, mb, layers_on_stage(model.num_layers, layout.pp, 0), 2, layout, model, e, seq, cluster, rows)
    return StepTime(compute_s=c, tp_comm_s=t, dp_comm_s=0.0, bubble_s=b)


def decode_step_seconds(
    model: ModelConfig, layout: Layout, weight_bytes: float, kv_bytes: float, n: int, e: int, cluster: ClusterConfig
) -> float:
    """Seconds of one decode step of `layout.micro_batch_size` rows on one engine replica.

    Each pipeline stage in turn reads its weights and its KV cache from HBM (`weight_bytes`,
    `kv_bytes`: one device's, bytes) or, when 2N * rows / (tp * pp) FLOPs take longer, is compute
    bound (peak x MODEL_FLOPS_EFFICIENCY); every decoder layer adds DECODE_OVERHEAD_S_PER_LAYER
    (the engine's fixed cost per layer per step) and, with tp > 1, 2 all-reduces of rows * H
    elements (COLLECTIVE_LATENCY_S each plus the ring volume over the intra-node bandwidth).
    n: the active parameters; e: element bytes of the engine's activations.
    """
    b = layout.micro_batch_size
    flops_s = 2.0 * n * b / (layout.tp * layout.pp * cluster.gpu_peak_tflops * 1e12 * MODEL_FLOPS_EFFICIENCY)
    stage_s = max((weight_bytes + kv_bytes) / (cluster.hbm_gbps * GB), flops_s)
    comm = 0.0
    if layout.tp > 1:
        per = COLLECTIVE_LATENCY_S + ring_allreduce_seconds(b * model.hidden_size * e, layout.tp, cluster.intra_node_gbps)
        comm = 2 * model.num_layers * per
    return layout.pp * stage_s + model.num_layers * DECODE_OVERHEAD_S_PER_LAYER + comm


def decode_steps(scheduler: str, requests: int, slots: int, mean_len: float, tail_len: float) -> float:
    """Decode steps one engine replica runs to generate `requests` responses on `slots` KV-cache rows.

    static (``rollout.scheduler=static``): ceil(requests / slots) batches in turn, each decoding until
    its longest response stops: waves * tail_len. continuous (Orca-style, Yu et al. 2022): a row is
    refilled as soon as its response stops, so while requests wait the slots are busy for
    mean_len row-steps per response, and after the last admission the pool drains for up to the
    longest response: max(requests - slots, 0) * mean_len / slots + tail_len. With mean_len =
    tail_len (every response as long as the longest) both give requests * tail_len / slots up to
    the static scheduler's last, partial wave. Lengths in tokens (one step per token).
    Raises ValueError: an unknown scheduler.
    """
    if scheduler == "static":
        return math.ceil(requests / slots) * tail_len
    if scheduler == "continuous":
        return max(requests - slots, 0) * mean_len / slots + tail_len
    raise ValueError(f"scheduler={scheduler!r}: valid choices are static, continuous")


def generate_step_time(
    model: ModelConfig, work: RoleWork, layout: Layout, weight_bytes: float, cluster: ClusterConfig, e: Optional[int] = None
) -> StepTime:
    """Seconds per step of the rollout engine: compute-bound prefill, then the decode steps.

    Each replica (dp of them) generates ceil(batch / dp) responses on layout.micro_batch_size
    KV-cache rows (the engine's ``rollout.max_batch_size``: the static batch or the continuous
    pool), the rows the memory check sized the KV cache for. The steps follow work.scheduler and
    the expected response lengths (:func:`decode_steps`; work.mean_response_len /
    work.tail_response_len, 0 = work.new_tokens); each step costs :func:`decode_step_seconds` with
    the whole KV cache read: aligner's graphed decode step attends over the cache's full length
    (prompt + new_tokens) under a mask. e: the engine's element bytes (``rollout.dtype``; None:
    work.dtype, else :func:`activation_dtype_bytes`).
    """
    n = role_active_parameters(model, work.kind)
    if e is None:
        e = DTYPE_BYTES[work.dtype] if work.dtype else activation_dtype_bytes(model, work.parallel)
    prompt = work.seq_len
    prefill = compute_seconds(forward_flops_per_token(n, model, prompt) * work.batch * prompt, layout.devices, cluster)
    b = layout.micro_batch_size
    kv = kv_cache_bytes(model, e, layout.tp, layout.pp, b, prompt + work.new_tokens)
    mean = work.mean_response_len or work.new_tokens
    tail = work.tail_response_len or work.new_tokens
    steps = decode_steps(work.scheduler, math.ceil(work.batch / layout.dp), b, mean, tail)
    decode = steps * decode_step_seconds(model, layout, weight_bytes, kv, n, e, cluster)
    return StepTime(compute_s=prefill, tp_comm_s=0.0, dp_comm_s=0.0, bubble_s=0.0, decode_s=decode)


# --------------------------------------------------------------------------- one layout


def layout_problem(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> Optional[str]:
    """Why a layout cannot run at all (before memory), or None."""
    g = cluster.gpus_per_node
    if g > 0 and layout.tp > g:
        return f"tp={layout.tp} exceeds gpus_per_node={g} (TP stays inside a node)"
    if model.num_heads % layout.tp:
        return f"num_heads={model.num_heads} not divisible by tp={layout.tp}"
    kv = model.num_kv_heads
    if kv % layout.tp and layout.tp % kv:
        return f"num_kv_heads={kv} neither divisible by nor a divisor of tp={layout.tp}"
    if model.intermediate_size % layout.tp:
        return f"intermediate_size={model.intermediate_size} not divisible by tp={layout.tp}"
    if layout.pp > model.num_layers:
        return f"pp={layout.pp} exceeds num_layers={model.num_layers}"
    if work.parallel.dp_backend == "deepspeed" and layout.tp * layout.pp > 1 and work.mode == "train":
        return "dp_backend=deepspeed needs tp = pp = 1"
    if layout.ep > 1:
        if not model.num_experts or model.num_experts % layout.ep or layout.dp % layout.ep:
            return f"ep={layout.ep} must divide dp={layout.dp} and num_experts={model.num_experts}"
        if work.parallel.dp_backend == "deepspeed" and work.mode == "train":
            return "expert parallelism needs dp_backend fsdp2 or ddp"
    if layout.vpp > 1:
        m = work.batch // max(1, layout.dp * layout.micro_batch_size)
        if work.mode != "train" or layout.pp == 1 or model.num_layers % (layout.pp * layout.vpp) or m % layout.pp:
            return f"vpp={layout.vpp} needs a training role, pp > 1, layers divisible by pp x vpp and micro-batches by pp"
        if work.parallel.dp_backend == "deepspeed" and layout.dp > 1:
            return "the interleaved schedule runs with dp_backend fsdp2 or ddp, or dp=1"
    if layout.cp > 1:
        if work.mode != "train":
            return "context parallelism is for training roles"
        if model.num_experts or work.parallel.dp_backend == "deepspeed":
            return "context parallelism runs with dense models and dp_backend fsdp2 or ddp"
    if work.micro_batch_tokens > 0 and work.mode != "generate" and (layout.pp > 1 or work.parallel.dp_backend == "deepspeed"):
        return "token-budget micro-batches (trainer.micro_batch_tokens) need pp=1 and dp_backend fsdp2 or ddp"
    if work.mode == "train":
        if work.batch % layout.dp:
            return f"{work.batch_field}={work.batch} not divisible by dp={layout.dp}"
        if not work.micro_batch_tokens and (work.batch // layout.dp) % layout.micro_batch_size:
            return f"{work.batch_field}/dp={work.batch // layout.dp} not divisible by micro_batch_size={layout.micro_batch_size}"
    return None


def estimate_layout(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> LayoutEstimate:
    """Memory (worst stage, bytes) and step time (seconds) of one structurally valid layout.

    The rollout engine (mode generate) holds weights, KV cache and activations in work.dtype
    (``rollout.dtype``); the other roles' element size is :func:`activation_dtype_bytes`."""
    e = DTYPE_BYTES[work.dtype] if work.mode == "generate" and work.dtype else activation_dtype_bytes(model, work.parallel)
    reserved = GPU_RESERVED_BYTES if cluster.gpus_per_node > 0 else 0.0
    experts_layer = expert_layer_parameters(model)
    layer_local = (layer_num_parameters(model) - 2 * model.hidden_size - experts_layer) // layout.tp + 2 * model.hidden_size
    layer_local += experts_layer // (layout.tp * layout.ep)
    best: Optional[MemoryBreakdown] = None
    grad_bytes = 0.0
    for stage in sorted({0, layout.pp - 1}):
        params = stage_num_parameters(model, work.kind, layout.tp, layout.pp, stage, layout.ep)
        last = stage == layout.pp - 1
        if work.mode == "train":
            trained = params
            if work.lora_rank > 0:  # frozen base: weights only; the adapters (and a scalar head) train
                layers = layers_on_stage(model.num_layers, layout.pp, stage)
                n_ad, t_ad = lora_num_parameters(model, work.lora_rank, work.lora_targets, layout.tp, layers)
                head = model.hidden_size if (work.kind == "score" and last) else 0
                trained = n_ad + head
                w, _, _ = train_state_bytes(params + n_ad, 0, layer_local, work.parallel, model, layout.dp, work.optim_state_dtype)
                _, g, o = train_state_bytes(trained, t_ad + (1 if head else 0), 0, work.parallel, model, layout.dp, work.optim_state_dtype)
            else:
                tensors = stage_num_tensors(model, work.kind, layout.pp, stage)
                # experts (E / ep per rank) are sharded over the expert-data-parallel ranks, dp / ep
                experts = stage_expert_parameters(model, layout.tp, layout.pp, stage, layout.ep) if layout.ep > 1 else 0
                w, g, o = train_state_bytes(params - experts, tensors, layer_local, work.parallel, model, layout.dp, work.optim_state_dtype)
                if experts:
                    w2, g2, o2 = train_state_bytes(experts, 0, 0, work.parallel, model, layout.dp // layout.ep, work.optim_state_dtype)
                    w, g, o = w + w2, g + g2, o + o2
            w += work.frozen_copies * frozen_weight_bytes(params, work.parallel, model, layout.dp)
            m = max(1, work.batch // (layout.dp * layout.micro_batch_size))
            precision = training_precision(model, work.parallel, layout.dp)
            act = train_activation_bytes(model, work.kind, layout, e, work.seq_len, m, stage, precision, work.lora_rank > 0)
            kv = 0.0
            grad_bytes = max(grad_bytes, trained * (4 if work.parallel.mixed_precision == "bf16" else e))
        else:
            w, g, o = float(params * e), 0.0, 0.0
            act = inference_activation_bytes(model, work.kind, layout.tp, e, layout.micro_batch_size * work.seq_len, last)
            kv = (
                kv_cache_bytes(model, e, layout.tp, layout.pp, layout.micro_batch_size, work.seq_len + work.new_tokens)
                if work.mode == "generate"
                else 0.0
            )
        mem = MemoryBreakdown(weights=w, grads=g, optimizer=o, activations=act, kv_cache=kv, reserved=reserved)
        if best is None or mem.total > best.total:
            best = mem
    if work.mode == "train":
        time = train_step_time(model, work, layout, grad_bytes, cluster)
    elif work.mode == "forward":
        time = forward_step_time(model, work, layout, cluster)
    else:
        time = generate_step_time(model, work, layout, best.weights, cluster, e)
    return LayoutEstimate(layout=layout, memory=best, time=time)


def memory_problem(est: LayoutEstimate, cluster: ClusterConfig) -> Optional[str]:
    """ "needs X GiB/GPU > Y GiB" when the worst stage does not fit in cluster.gpu_mem_gb GiB, else None."""
    if est.memory.total > cluster.gpu_mem_gb * GIB:
        return f"needs {est.memory.total / GIB:.1f} GiB/GPU > {cluster.gpu_mem_gb:g} GiB"
    return None


def evaluate_layout(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> LayoutEstimate | Rejected:
    """A LayoutEstimate if `layout` runs and fits in memory, else Rejected with the reason."""
    problem = layout_problem(model, work, layout, cluster)
    if problem:
        return Rejected(layout, problem)
    est = estimate_layout(model, work, layout, cluster)
    problem = memory_problem(est, cluster)
    return Rejected(layout, problem, est) if problem else est
