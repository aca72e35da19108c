"""The planner's cost model: bytes per device and seconds per step of one role's layout.

Owns: the layout and estimate types (:class:`Layout`, :class:`RoleWork`, :class:`LayoutEstimate`,
:class:`Rejected`), parameter counts per role and pipeline stage and the analytic memory model (weights,
gradients, optimizer state, activations, KV cache). The step-time model is
:mod:`aligner.planner.time_model`; one layout's evaluation (:func:`~aligner.planner.evaluate.evaluate_layout`:
a :class:`LayoutEstimate`, or :class:`Rejected` with the reason) is :mod:`aligner.planner.evaluate`.

Memory model (per device, bytes; ``cluster.gpu_mem_gb`` and every printed figure are GiB, 2**30
bytes, the unit GPU memory is sold in: an "80 GB" H100 or A100 has 80 GiB = 85.9e9 bytes, of
which torch.cuda reports about 79.2 GiB = 85.0e9 as total_memory):
- Parameters: :meth:`ModelConfig.num_parameters` (score models drop lm_head and add a [1, H]
  head). TP shards everything but the RMSNorm weights; PP splits layers evenly (the first
  ``L % pp`` pipeline stages take one more); embedding and lm_head sit on the first/last pipeline stage.
- Training state follows ZeRO's accounting (Rajbhandari et al. 2020, section 3.1): mixed
  precision keeps a bf16 compute copy (2 B) and an fp32 master (4 B), fp32 grads (4 B; bf16
  under DeepSpeed) and Adam m, v in fp32 (8 B; 4 B with ``optim.state_dtype=bfloat16``,
  aligner.runtime.adamw) plus torch's 4 B ``step`` tensor per parameter tensor. FSDP2 shards
  all three over dp; DeepSpeed ZeRO-1/2/3 shards optimizer (and master) / + grads / + params;
  DDP shards nothing. Sharded parameters are gathered to run (:func:`zero3_buffer_bytes`):
  FSDP2 (``parallel.fsdp_reduce=micro_batch``, reducing every micro-batch) gathers a decoder layer and
  prefetches the next, and in backward holds the layer's unsharded gradient and its reduce-scatter
  input; with ``fsdp_reduce=step`` (one all-gather and one reduce-scatter per step) it holds every
  layer's unsharded parameters (c) and accumulated unsharded gradients (fp32 under bf16) through the
  step, as DDP does, the optimizer state still sharded (:func:`fsdp_step_buffer_bytes`); DeepSpeed ZeRO-3 gathers per submodule
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
  core output; full recomputation keeps the layer input (2sbh in the paper). The last pipeline stage
  adds the fp32 log-softmax of the logits (the paper's 4sbv/t). 1F1B keeps min(pp - i, m)
  micro-batches in flight on pipeline stage i (the first holds pp). Under torch.autocast (fp32
  parameters, bf16 compute: bf16 mixed precision with DDP or one dp rank) the bf16 casts of
  the weights are held once per pipeline stage, not per micro-batch in flight: autocast caches a trainable
  weight's cast for its context, and the training step shares a frozen weight's (a LoRA base,
  :func:`aligner.nn.layers.frozen_weight_casts`); a frozen base under full recomputation holds
  only the recomputed layer's casts.
- Rollout engine: weights, KV cache and activations in ``rollout.dtype`` (the engine's model is
  cast to it on refit; its KV caches take the model's dtype), whatever model.dtype is. KV cache:
  2 * layers/pp * max(kv_heads/tp, 1) * head_dim * bytes * batch * seq.

MoE (Mixtral-style layers): FLOPs follow the active parameters (router + top-k experts per token,
:func:`role_active_parameters`), memory the total; each rank holds E / ep of every layer's experts,
whose training state FSDP2 shards over the dp / ep expert-data-parallel ranks; expert parallelism
adds 2 all-to-alls per MoE layer per forward (4 with backward, 6 with full recomputation) of
tokens * k * H elements each, (ep-1)/ep of them leaving the rank, over the dp axis's bandwidth.

Simplifications: roles sharing a node group are time-sliced (the others offloaded), so each
role's memory is checked alone; a PPO step is rollout + max(actor group, critic group) for
split placement and the sum of all phases when colocated; allocator fragmentation (a fixed reserve
instead) is not modelled. On a CPU-only cluster (gpus_per_node = 0) each node counts as one
device with gpu_mem_gb of memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from aligner.config import ModelConfig, ParallelConfig
from aligner.parallel.memory import LayerDims, layer_activation_bytes

GIB = 2**30  # bytes per GiB: cluster.gpu_mem_gb and every memory figure the planner prints
GB = 1e9  # bytes per GB (decimal): bandwidths, cluster.*_gbps in GB/s
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# per GPU: the ~0.8 GiB an "80 GB" GPU keeps from CUDA (80 GiB sold, 79.2 GiB total_memory on an
# H100 SXM), the CUDA context, NCCL buffers and allocator slack
GPU_RESERVED_BYTES = 2.0 * GIB
# DeepSpeed ZeRO-3 defaults (deepspeed/runtime/zero/config.py, DeepSpeed 0.19): elements prefetched
# ahead of the running submodule, elements kept gathered at most, elements per gradient reduce bucket
DS_PREFETCH_BUCKET_SIZE = 50_000_000  # stage3_prefetch_bucket_size
DS_MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters
DS_REDUCE_BUCKET_SIZE = 500_000_000  # reduce_bucket_size


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
    # FSDP2's gradient reduction (parallel.fsdp_reduce): micro_batch (gather and reduce-scatter every micro-batch)
    # or step (once per optimizer step, every layer's unsharded parameters and gradients held through it)
    fsdp_reduce: str = "micro_batch"

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        sp = " sp" if self.sp else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        vpp = f" vpp={self.vpp}" if self.vpp > 1 else ""
        fr = " fsdp_reduce=step" if self.fsdp_reduce == "step" else ""
        return f"tp={self.tp}{cp} pp={self.pp}{vpp} dp={self.dp}{ep}{sp} mbs={self.micro_batch_size} recompute={self.recompute}{fr}"


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
    pp_comm_s: float = 0.0  # pipeline point-to-point messages on the critical path (time_model.pipeline_p2p_seconds)

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
    engine: the rollout engine's ``rollout.backend``: torch (aligner's TorchEngine: a decode step reads
    every KV-cache row to its full length) | trtllm (TensorRT-LLM's paged KV cache: a step reads the
    tokens its rows hold; in-flight batching, so its scheduler is continuous).
    cuda_graphs, micro_batches: ``rollout.cuda_graphs`` and ``rollout.micro_batches`` (0 = pp), which with
    the layout decide whether TorchEngine's decode steps run in CUDA graphs (time_model.decode_graphed).
    row_len: tokens per row the step time of a training or forward role assumes (0 = seq_len, which
    the memory always assumes: a batch may hold a row that long). For PPO's roles: the rollout
    batch's width, prompt + the longest response, under row-count micro-batches (every row is padded
    to it); prompt + the mean response under a token budget (each micro-batch is cut to its longest
    row, rows sorted by length: :mod:`aligner.runtime.runner`).
    micro_batch_tokens: ``trainer.micro_batch_tokens`` (0: row-count micro-batches of
    layout.micro_batch_size rows): micro-batches of up to this many tokens, batch * row_len / (dp *
    micro_batch_tokens) of them per pass (:func:`micro_batch_shape`), with or without pipeline
    pipeline stages (the runtime runs them through 1F1B and interleaved 1F1B; not with DeepSpeed).
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
    engine: str = "torch"
    cuda_graphs: bool = True
    micro_batches: int = 0
    row_len: float = 0.0
    micro_batch_tokens: int = 0


def micro_batch_shape(work: RoleWork, layout: Layout, seqs: int) -> tuple[int, float, float]:
    """(micro-batches per pass on one dp rank, rows per micro-batch, tokens per row) the step time of
    `seqs` sequences of a training or forward role assumes.

    Row-count micro-batches: ceil(seqs / (dp * layout.micro_batch_size)) of micro_batch_size rows.
    A token budget (work.micro_batch_tokens = N): the pass's seqs * row_len tokens per dp rank in
    micro-batches of N tokens, ceil(seqs * row_len / (dp * N)) of them, N / row_len rows each (a
    sorted first-fit of rows of about equal length fills each micro-batch; verl's dynamic batch size).
    With pp > 1 that count is also the pipeline's m (its bubble is (pp - 1) / (vpp m)); the filler
    micro-batches the interleaved schedule adds up to a multiple of pp are one short row each and
    are not counted. Tokens per row: work.row_len, or work.seq_len when it is 0."""
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
    """Parameters one token uses (MoE: the router and its top-k experts; a dense model: all), as model
    cards count them (Mixtral 8x7B: 12.9B active, embeddings included; Fedus et al. 2021)."""
    return role_num_parameters(model, kind) - (model.num_parameters() - model.num_parameters(active=True))


def input_embedding_is_lookup(model: ModelConfig, kind: str, pp: int = 1) -> bool:
    """Whether the [V, H] input embedding is only gathered from (a token's row: no GEMM, no full read): always
    for a score model and an untied LM; for a tied LM only with pipeline stages, where the last pipeline stage
    multiplies by its own copy. On one pipeline stage a tied LM's embedding is also its output head, a [H, V] GEMM."""
    return kind == "score" or not model.tie_word_embeddings or pp > 1


def role_flop_parameters(model: ModelConfig, kind: str) -> int:
    """Parameters a token multiplies by: :func:`role_active_parameters` less the input embedding where it is
    only a lookup (:func:`input_embedding_is_lookup`; a tied LM's matrix counts once, as its head). What the
    6N of training FLOPs per token counts (Kaplan et al. 2020 leave embeddings out of N; the LM head is a
    [H, V] GEMM). Llama 3 8B: 7.50B of its 8.03B (the [128,256, 4,096] embedding is 6.5% of it)."""
    lookup = model.vocab_size * model.hidden_size if input_embedding_is_lookup(model, kind) else 0
    return role_active_parameters(model, kind) - lookup


def expert_layer_parameters(model: ModelConfig) -> int:
    """Expert MLP parameters of one MoE layer (E * 3 * H * I; 0 for a dense model), without the router."""
    return model.num_experts * 3 * model.hidden_size * model.intermediate_size if model.num_experts else 0


def layer_num_parameters(model: ModelConfig) -> int:
    """Parameters of one decoder layer (attention, SwiGLU MLP, two RMSNorm weights)."""
    h = model.hidden_size
    head = 0 if model.tie_word_embeddings else model.vocab_size * h
    return (model.num_parameters() - model.vocab_size * h - head - h) // model.num_layers


def layers_on_pp_stage(num_layers: int, pp: int, pp_stage: int) -> int:
    """Decoder layers on pipeline stage `pp_stage` of `pp` (even split, the first pipeline stages take the rest)."""
    return num_layers // pp + (1 if pp_stage < num_layers % pp else 0)


def pp_stage_expert_parameters(model: ModelConfig, tp: int, pp: int, pp_stage: int, ep: int = 1) -> int:
    """Expert parameters on one device of (tp, pp stage, ep): each MoE layer's E / ep experts, 1/tp of each."""
    return layers_on_pp_stage(model.num_layers, pp, pp_stage) * (expert_layer_parameters(model) // (tp * ep))


def pp_stage_num_parameters(model: ModelConfig, kind: str, tp: int, pp: int, pp_stage: int, ep: int = 1) -> int:
    """Parameters held by one device of (tp, pp stage): TP shards all but RMSNorm weights (and the
    MoE router); expert parallelism keeps E / ep of each layer's experts."""
    h, v = model.hidden_size, model.vocab_size
    layer = layer_num_parameters(model)
    experts = expert_layer_parameters(model)
    router = model.num_experts * h
    dense = (layer - 2 * h - experts - router) // tp + 2 * h + router
    n = layers_on_pp_stage(model.num_layers, pp, pp_stage) * (dense + experts // (tp * ep))
    if pp_stage == 0:
        n += v * h // tp
    if pp_stage == pp - 1:
        n += h  # final norm
        if kind == "score":
            n += h
        elif not model.tie_word_embeddings or pp > 1:
            n += v * h // tp  # lm_head (a tied copy lives on the last pipeline stage when pp > 1)
    return n


def decode_weight_bytes(model: ModelConfig, kind: str, layout: Layout, e: int) -> float:
    """Weight bytes one device of the busiest pipeline stage reads in a decode step (bytes): its weights
    (:func:`pp_stage_num_parameters` x `e`), less the input embedding on the first pipeline stage, of which a step gathers
    only its rows' tokens (:func:`input_embedding_is_lookup`).
    Expert layers are counted whole (at decode batch sizes every expert is routed to)."""
    h, v = model.hidden_size, model.vocab_size
    out = 0.0
    for pp_stage in sorted({0, layout.pp - 1}):
        params = pp_stage_num_parameters(model, kind, layout.tp, layout.pp, pp_stage, layout.ep)
        if pp_stage == 0 and input_embedding_is_lookup(model, kind, layout.pp):
            params -= v * h // layout.tp
        out = max(out, float(params * e))
    return out


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


def pp_stage_num_tensors(model: ModelConfig, kind: str, pp: int, pp_stage: int) -> int:
    """Parameter tensors on one pipeline stage (each gets a 4-byte Adam ``step`` tensor in torch)."""
    per_layer = 9 + (3 if model.attention_bias else 0) + (1 if getattr(model, "o_proj_bias", False) else 0)
    per_layer += 1 if model.num_experts else 0  # router + 3 stacked expert tensors instead of 3 MLP weights
    n = layers_on_pp_stage(model.num_layers, pp, pp_stage) * per_layer
    if pp_stage == 0:
        n += 1
    if pp_stage == pp - 1:
        n += 1 + (1 if kind == "score" or not model.tie_word_embeddings or pp > 1 else 0)
    return n


# --------------------------------------------------------------------------- memory model


def activation_dtype_bytes(model: ModelConfig, pc: ParallelConfig) -> int:
    """Bytes per activation element: 2 under bf16 mixed precision, else the model dtype's."""
    return 2 if pc.mixed_precision == "bf16" else DTYPE_BYTES[model.dtype]


def _dp_shards(pc: ParallelConfig) -> tuple[bool, bool, bool]:
    """(params, grads, optimizer) sharded over dp: FSDP2 all (ZeRO-3), DDP none, DeepSpeed by ZeRO stage."""
    if pc.dp_backend == "fsdp2":
        return True, True, True
    if pc.dp_backend == "ddp":
        return False, False, False
    return pc.zero_stage >= 3, pc.zero_stage >= 2, pc.zero_stage >= 1


def train_state_bytes(
    params: int,
    tensors: int,
    layer_params: int,
    pc: ParallelConfig,
    model: ModelConfig,
    dp: int,
    state_dtype: str = "float32",
    fsdp_step: bool = False,
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
    fsdp_step: FSDP2 with ``parallel.fsdp_reduce=step`` and dp > 1 (:func:`fsdp_step_buffer_bytes`): every
    parameter is held unsharded through the step and its gradient accumulated unsharded, instead of one
    layer at a time; counted even where layer_params is 0 (a LoRA run's adapters).
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
    if fsdp_step and pc.dp_backend == "fsdp2" and dp > 1:
        gathered, grad_buffers = fsdp_step_buffer_bytes(layer_params, params, pc, model)
        weights, grads = weights + gathered, grads + grad_buffers
    elif p_sh and dp > 1 and layer_params > 0:
        gathered, grad_buffers = zero3_buffer_bytes(layer_params, params, pc, model)
        weights, grads = weights + gathered, grads + grad_buffers
    moment = DTYPE_BYTES[state_dtype] if state_dtype != "float32" else (4 if bf16 else e)
    adam = 0 if offload else sh(params * 2 * moment, o_sh) + 4 * tensors
    return float(weights), float(grads), float(adam)


def zero3_buffer_bytes(layer_params: int, params: int, pc: ParallelConfig, model: ModelConfig) -> tuple[float, float]:
    """(gathered parameters, unsharded gradient buffers) bytes at the peak of a ZeRO-3-style step
    (FSDP2, DeepSpeed ZeRO stage 3), on one device of a dp > 1 group, beside the dp-sharded state.

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


def fsdp_step_buffer_bytes(layer_params: int, params: int, pc: ParallelConfig, model: ModelConfig) -> tuple[float, float]:
    """(gathered parameters, unsharded gradient buffers) bytes of FSDP2 under ``parallel.fsdp_reduce=step`` on
    one device of a dp > 1 group, beside the dp-sharded state (:class:`aligner.parallel.data_parallel.FsdpStepReduce`).

    Every unit stays unsharded from the step's first forward to its last backward, so all `params` (the device's
    parameters before dp sharding) are held gathered in the compute dtype c (bf16 under bf16 mixed precision,
    else model.dtype): params * c. Their gradients accumulate unsharded over the micro-batches in the reduce
    dtype r (fp32 under bf16: FSDP2 upcasts each micro-batch's bf16 gradient into an fp32 buffer; else c):
    params * r, plus, in a layer's backward, its fresh micro-batch gradient (c) and, at the last micro-batch,
    its reduce-scatter input (r): layer_params * (c + r). DDP's footprint for parameters and gradients, with the
    optimizer state still sharded."""
    bf16 = pc.mixed_precision == "bf16"
    c = 2 if bf16 else DTYPE_BYTES[model.dtype]
    r = 4 if bf16 else c
    return float(params * c), float(params * r + layer_params * (c + r))


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
    """Per micro-batch, not per layer: input ids (int64, first pipeline stage) and RoPE cos and sin
    (unpacked batches build no attention mask)."""
    ids = 8 * batch * seq_len if first else 0
    rope = 2 * batch * seq_len * model.resolved_head_dim * e
    return ids + rope


def head_activation_bytes_per_token(model: ModelConfig, e: int, tp: int, sp: bool, kind: str) -> float:
    """Last pipeline stage: final RMSNorm plus the fp32 log-softmax of the logits, 4V/t (the paper's 4sbv/t);
    a score head keeps one fp32 scalar per token instead."""
    norm = rmsnorm_bytes_per_token(model.hidden_size, e) / (tp if sp else 1)
    return norm + (4 * model.vocab_size / tp if kind == "lm" else 4)


def autocast_weight_cast_bytes(model: ModelConfig, tp: int) -> float:
    """Bytes of the bf16 casts of one decoder layer's linear weights on one device under
    torch.autocast: the tokens-independent term of :func:`aligner.parallel.memory.layer_activation_bytes`
    (2 B per q, k, v, o, gate, up, down weight element / tp), taken from it at s = 0."""
    return layer_activation_bytes(replace(LayerDims.of(model, 1, 1, tp), s=0), "autocast", False, "none")


def interleaved_in_flight(pp: int, vpp: int, num_micro_batches: int, pp_stage: int) -> float:
    """Micro-batches' worth of pipeline stage `pp_stage`'s layer activations held at its peak: min(pp - pp_stage, m)
    under 1F1B; with v chunks per rank, min(m v, 2 (pp - pp_stage - 1) + (v - 1) pp + 1) chunk forwards of
    1 / v of the pipeline stage's layers each (Megatron's interleaved warm-up plus the forward before the first
    backward: on pipeline stage 0 about 1 + (p - 1) / (p v) times plain 1F1B's, Narayanan et al. 2021)."""
    if vpp == 1:
        return float(min(pp - pp_stage, num_micro_batches))
    return min(num_micro_batches * vpp, 2 * (pp - pp_stage - 1) + (vpp - 1) * pp + 1) / vpp


def train_activation_bytes(
    model: ModelConfig,
    kind: str,
    layout: Layout,
    e: int,
    seq_len: int,
    num_micro_batches: int,
    pp_stage: int,
    precision: str,
    frozen_base: bool = False,
) -> float:
    """Activation bytes on pipeline stage `pp_stage` under 1F1B: min(pp - pp_stage, m) micro-batches in flight.

    e: activation element bytes (shared inputs, head); precision: how the layers compute (:func:`training_precision`).
    frozen_base: the layers' linear weights are frozen (LoRA). Under "autocast" the bf16 weight casts
    (:func:`autocast_weight_cast_bytes` per layer) are counted as the runtime holds them: once per
    pipeline stage, whatever the micro-batches in flight. torch.autocast caches the cast of a trainable fp32
    leaf for its whole context (the forward with pp = 1, the whole 1F1B step with pp > 1;
    recomputation hits the cache); it never caches a frozen weight's, but
    ``TrainRuntime.forward_backward`` makes each frozen cast once per step and shares it between the
    micro-batches (:func:`aligner.nn.layers.frozen_weight_casts`). Under full recomputation the
    runtime does not share the frozen casts: only the layer being recomputed holds them.
    tests/planner/test_planner.py measures both on the CPU.
    """
    b, pp = layout.micro_batch_size, layout.pp
    in_flight = interleaved_in_flight(pp, layout.vpp, num_micro_batches, pp_stage)
    layers = layers_on_pp_stage(model.num_layers, pp, pp_stage)
    full_len, seq_len = seq_len, seq_len // layout.cp  # a cp rank holds seq_len / cp tokens of every row
    layer = layer_activation_bytes(LayerDims.of(model, seq_len, b, layout.tp), precision, layout.sp, layout.recompute)
    layer += cp_gathered_kv_bytes(model, layout, b, full_len, e)
    casts = 0.0
    if precision == "autocast":
        cast = autocast_weight_cast_bytes(model, layout.tp)
        if layout.recompute != "full":
            layer -= cast  # counted below, once per pipeline stage
        casts = cast if frozen_base and layout.recompute == "full" else layers * cast
    per_mb = layers * layer + shared_activation_bytes(model, e, b, seq_len, layout.recompute, pp_stage == 0)
    head = head_activation_bytes_per_token(model, e, layout.tp, layout.sp, kind) * b * seq_len if pp_stage == pp - 1 else 0
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


def inference_activation_bytes(model: ModelConfig, kind: str, tp: int, e: int, tokens: int, last: bool) -> float:
    """Forward-only working set for `tokens` tokens: one layer's live tensors (input, normed, q, k, v,
    output, gate, up, product) plus, on the last pipeline stage, the fp32 logits (lm) or scores."""
    h, hd = model.hidden_size, model.resolved_head_dim
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    layer = e * (2 * h + (2 * q + 2 * kv + 3 * model.intermediate_size) / tp)
    head = (4 + e) * model.vocab_size / tp if kind == "lm" else 4
    return tokens * (layer + (head if last else 0))


def kv_cache_bytes(model: ModelConfig, e: int, tp: int, pp: int, batch: int, seq_len: int) -> float:
    """KV cache of one device: 2 * ceil(L/pp) * max(kv_heads/tp, 1) * head_dim * e * batch * seq (bytes).

    With tp > num_kv_heads the KV heads are replicated, so each device still holds one."""
    layers = layers_on_pp_stage(model.num_layers, pp, 0)
    kv_local = max(model.num_kv_heads // tp, 1)
    return 2.0 * layers * kv_local * model.resolved_head_dim * e * batch * seq_len


# --------------------------------------------------------------------------- time model
