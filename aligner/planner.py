"""The placement planner: per-role TP x PP x DP layouts, micro-batch size and recomputation.

Owns: the analytic memory model (bytes per device: weights, gradients, optimizer state,
activations, KV cache), the analytic step-time model (seconds), the enumeration and ranking
of layouts per role, the split of nodes between the actor's group and the critic's group,
the smallest cluster that fits, and :func:`check_fits` (run before weights are loaded).

Memory model (per device, bytes):
- Parameters: :meth:`ModelConfig.num_parameters` (score models drop lm_head and add a [1, H]
  head). TP shards everything but the RMSNorm weights; PP splits layers evenly (the first
  ``L % pp`` stages take one more); embedding and lm_head sit on the first/last stage.
- Training state follows ZeRO's accounting (Rajbhandari et al. 2020, section 3.1): mixed
  precision keeps a bf16 compute copy (2 B) and an fp32 master (4 B), fp32 grads (4 B; bf16
  under DeepSpeed) and Adam m, v in fp32 (8 B; 4 B with ``optim.state_dtype=bfloat16``,
  aligner.runtime.adamw) plus torch's 4 B ``step`` tensor per parameter tensor. FSDP2 shards
  all three over dp (plus two unsharded layers in flight); DeepSpeed ZeRO-1/2/3 shards
  optimizer (and master) / + grads / + params; DDP shards nothing.
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
  micro-batches in flight on stage i (the first stage holds pp).
- KV cache (rollout engine): 2 * layers/pp * max(kv_heads/tp, 1) * head_dim * bytes * batch * seq.

Step-time model (seconds): FLOPs per token 6N + 12*L*H*T for training and 2N + 4*L*H*T for
a forward pass (Chowdhery et al. 2022, PaLM appendix B), plus one forward for full
recomputation or the attention core for selective, divided by devices * peak * efficiency;
TP all-reduces (4 per layer per micro-batch in forward + backward, Shoeybi et al. 2019) of
B*T*H elements over the intra-node bandwidth with ring volume 2(n-1)/n; the data-parallel
gradient all-reduce (or FSDP's all-gather + reduce-scatter) over the inter-node bandwidth when
the dp group spans nodes; the 1F1B bubble multiplies compute by 1 + (p-1)/m (Narayanan et al.
2021). Decoding is memory-bandwidth bound: each token step reads the stage weights and the KV
cache from HBM, and a token walks all pp stages in turn.

MoE (Mixtral-style layers): FLOPs follow the active parameters (router + top-k experts per token,
:func:`role_active_parameters`), memory the total; each rank holds E / ep of every layer's experts,
whose training state FSDP2 shards over the dp / ep expert-data-parallel ranks; expert parallelism
adds 2 all-to-alls per MoE layer per forward (4 with backward, 6 with full recomputation) of
tokens * k * H elements each, (ep-1)/ep of them leaving the rank, over the dp axis's bandwidth.

Simplifications: roles sharing a node group are time-sliced (the others offloaded), so each
role's memory is checked alone; a PPO step is rollout + max(actor group, critic group) for
split placement and the sum of all phases when colocated; point-to-point PP traffic,
FSDP prefetch overlap, allocator fragmentation (a fixed reserve instead) and interleaved
schedules are not modelled. On a CPU-only cluster (gpus_per_node = 0) each node counts as one
device with gpu_mem_gb of memory.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from aligner.config import AlignerConfig, ClusterConfig, ModelConfig, ParallelConfig
from aligner.errors import PlanError
from aligner.parallel.memory import LayerDims, layer_activation_bytes

GB = 1e9  # bytes per GB (decimal, as GPU vendors quote memory)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MODEL_FLOPS_EFFICIENCY = 0.4  # fraction of peak FLOP/s a well-tuned Megatron-style step reaches (MFU)
GPU_RESERVED_BYTES = 2.0 * GB  # CUDA context, NCCL buffers and allocator slack per GPU
COLLECTIVE_LATENCY_S = 10e-6  # fixed cost of one small collective (decode steps), seconds
MAX_NODES = 4096  # smallest_cluster gives up beyond this many nodes
RECOMPUTE_MODES = ("none", "selective", "full")
SHOW_RANKED = 5  # layouts per role in format_plan
SHOW_REJECTED = 5  # rejected layouts per role in format_plan


# --------------------------------------------------------------------------- data structures


@dataclass(frozen=True)
class Layout:
    """One role's layout: tp x pp x dp devices, micro-batch size (sequences), SP, recomputation."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    sp: bool = False
    recompute: str = "none"
    ep: int = 1  # expert parallelism inside dp (MoE)

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        sp = " sp" if self.sp else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{ep}{sp} mbs={self.micro_batch_size} recompute={self.recompute}"


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

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.dp_comm_s + self.bubble_s + self.decode_s + self.a2a_s


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


@dataclass
class RolePlan:
    """Ranked feasible layouts (fastest first) and the best rejected ones for one role."""

    role: str
    work: RoleWork
    devices: int
    ranked: list[LayoutEstimate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def best(self) -> Optional[LayoutEstimate]:
        return self.ranked[0] if self.ranked else None


@dataclass(frozen=True)
class NodeSplit:
    """Nodes given to the actor's group (actor, rollout) and to the critic's (critic, reward, ...)."""

    actor_nodes: int
    critic_nodes: int
    step_time_s: float
    tried: tuple = ()  # (actor_nodes, step seconds or reason) for every split tried


@dataclass
class Plan:
    """The whole plan: per-role plans, the node split (split placement) and the step estimate."""

    stage: str
    cluster: ClusterConfig
    placement: str
    roles: dict[str, RolePlan]
    node_split: Optional[NodeSplit]
    step_time_s: float
    model: Optional[ModelConfig] = None  # the planned model (format_plan prints training bytes per parameter)


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
    (FSDP2 gathers two unsharded at a time). Raises KeyError: an unknown state_dtype.
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
    if p_sh and dp > 1 and not deepspeed:
        weights += 2 * layer_params * (2 if bf16 else e)  # FSDP2: current + prefetched unsharded layer
    grads = sh(params * ((2 if deepspeed else 4) if bf16 else e), g_sh)
    moment = DTYPE_BYTES[state_dtype] if state_dtype != "float32" else (4 if bf16 else e)
    adam = 0 if offload else sh(params * 2 * moment, o_sh) + 4 * tensors
    return float(weights), float(grads), float(adam)


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


def train_activation_bytes(
    model: ModelConfig, kind: str, layout: Layout, e: int, seq_len: int, num_microbatches: int, stage: int, precision: str
) -> float:
    """Activation bytes on pipeline stage `stage` under 1F1B: min(pp - stage, m) micro-batches in flight.

    e: activation element bytes (shared inputs, head); precision: how the layers compute (:func:`training_precision`).
    """
    b, pp = layout.micro_batch_size, layout.pp
    in_flight = min(pp - stage, num_microbatches)
    layer = layer_activation_bytes(LayerDims.of(model, seq_len, b, layout.tp), precision, layout.sp, layout.recompute)
    per_mb = layers_on_stage(model.num_layers, pp, stage) * layer + shared_activation_bytes(
        model, e, b, seq_len, layout.recompute, stage == 0
    )
    head = head_activation_bytes_per_token(model, e, layout.tp, layout.sp, kind) * b * seq_len if stage == pp - 1 else 0
    return in_flight * per_mb + head


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


def train_flops_per_token(n_params: int, model: ModelConfig, seq_len: int, recompute: str) -> float:
    """Training FLOPs per token: 6N + 12*L*H*T (PaLM, Chowdhery et al. 2022, appendix B), plus a
    second forward (2N + 4LHT) for full recomputation or the attention core (4LHT) for selective."""
    attn = 4.0 * model.num_layers * model.hidden_size * seq_len
    extra = {"none": 0.0, "selective": attn, "full": 2.0 * n_params + attn}[recompute]
    return 6.0 * n_params + 3 * attn + extra


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


def compute_seconds(flops: float, devices: int, cluster: ClusterConfig) -> float:
    """FLOPs / (devices * peak TFLOP/s * MODEL_FLOPS_EFFICIENCY)."""
    return flops / (devices * cluster.gpu_peak_tflops * 1e12 * MODEL_FLOPS_EFFICIENCY)


def pipeline_bubble_fraction(pp: int, num_microbatches: int) -> float:
    """1F1B bubble relative to the ideal compute time: (p - 1) / m (Narayanan et al. 2021)."""
    return (pp - 1) / max(num_microbatches, 1)


def _devices_per_node(cluster: ClusterConfig) -> int:
    return cluster.gpus_per_node if cluster.gpus_per_node > 0 else 1


def _dp_gbps(layout: Layout, cluster: ClusterConfig) -> float:
    """dp groups are the slowest-varying mesh axis: inside a node only if the whole mesh is."""
    inside = cluster.gpus_per_node > 0 and layout.devices <= cluster.gpus_per_node
    return cluster.intra_node_gbps if inside else cluster.inter_node_gbps


def _pass_time(
    flops: float, mb: int, layers: int, colls: int, layout: Layout, model: ModelConfig, e: int, seq: int, cluster: ClusterConfig
) -> tuple[float, float, float]:
    """(compute, tp comm, bubble) seconds of `mb` micro-batches through the pipeline."""
    compute = compute_seconds(flops, layout.devices, cluster)
    size = layout.micro_batch_size * seq * model.hidden_size * e
    tp_comm = mb * layers * colls * ring_allreduce_seconds(size, layout.tp, cluster.intra_node_gbps)
    bubble = (compute + tp_comm) * pipeline_bubble_fraction(layout.pp, mb)
    return compute, tp_comm, bubble


def _a2a_time(model: ModelConfig, layout: Layout, micro_batches: int, seq: int, e: int, per_layer: int, cluster: ClusterConfig) -> float:
    """Expert-parallel all-to-all seconds of `micro_batches` passes: `per_layer` all-to-alls per MoE
    layer of this stage (2 forward, 4 forward + backward, 6 with full recomputation)."""
    if layout.ep <= 1 or not model.num_experts:
        return 0.0
    layers = layers_on_stage(model.num_layers, layout.pp, 0)
    nbytes = a2a_elements_per_layer(model, layout.micro_batch_size * seq) * e
    return micro_batches * layers * per_layer * a2a_seconds(nbytes, layout.ep, _dp_gbps(layout, cluster))


def train_step_time(model: ModelConfig, work: RoleWork, layout: Layout, grad_bytes: float, cluster: ClusterConfig) -> StepTime:
    """Seconds per step of a training role: opt_steps optimizer steps (+ the forward-only passes).
    FLOPs follow the active parameters (MoE: top-k experts per token)."""
    n = role_active_parameters(model, work.kind)
    e = activation_dtype_bytes(model, work.parallel)
    seq, layers = work.seq_len, layers_on_stage(model.num_layers, layout.pp, 0)
    m = work.batch // (layout.dp * layout.micro_batch_size)
    colls = 6 if layout.recompute == "full" else 4
    flops = train_flops_per_token(n, model, seq, layout.recompute) * work.batch * seq
    c, t, b = _pass_time(flops, m, layers, colls, layout, model, e, seq, cluster)
    p_sh, _, _ = _dp_shards(work.parallel)
    factor = 1.5 if p_sh else 1.0  # FSDP / ZeRO-3: all-gather + reduce-scatter = 1.5 all-reduces
    dp = factor * ring_allreduce_seconds(grad_bytes, layout.dp, _dp_gbps(layout, cluster))
    steps = work.opt_steps
    a2a = _a2a_time(model, layout, m, seq, e, 6 if layout.recompute == "full" else 4, cluster)
    c, t, b, dp, a2a = c * steps, t * steps, b * steps, dp * steps, a2a * steps
    if work.forward_seqs:
        mf = max(1, math.ceil(work.forward_seqs / (layout.dp * layout.micro_batch_size)))
        ff = forward_flops_per_token(n, model, seq) * work.forward_seqs * seq
        c2, t2, b2 = _pass_time(ff, mf, layers, 2, layout, model, e, seq, cluster)
        c, t, b = c + c2, t + t2, b + b2
        a2a += _a2a_time(model, layout, mf, seq, e, 2, cluster)
    return StepTime(compute_s=c, tp_comm_s=t, dp_comm_s=dp, bubble_s=b, a2a_s=a2a)


def forward_step_time(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> StepTime:
    """Seconds per step of a forward-only role (reference log-probs, reward scores)."""
    n = role_active_parameters(model, work.kind)
    e = activation_dtype_bytes(model, work.parallel)
    mb = max(1, math.ceil(work.batch / (layout.dp * layout.micro_batch_size)))
    flops = forward_flops_per_token(n, model, work.seq_len) * work.batch * work.seq_len
    c, t, b = _pass_time(flops, mb, layers_on_stage(model.num_layers, layout.pp, 0), 2, layout, model, e, work.seq_len, cluster)
    return StepTime(compute_s=c, tp_comm_s=t, dp_comm_s=0.0, bubble_s=b)


def generate_step_time(model: ModelConfig, work: RoleWork, layout: Layout, weight_bytes: float, cluster: ClusterConfig) -> StepTime:
    """Seconds per step of the rollout engine: compute-bound prefill, then bandwidth-bound decode.

    Each decode step reads a stage's weights and (on average) half its final KV cache from HBM,
    or is compute bound if 2N*batch/(tp*pp) FLOPs take longer; a token walks the pp stages in
    turn, and each layer does 2 TP all-reduces of batch*H elements.
    """
    n = role_active_parameters(model, work.kind)
    e = activation_dtype_bytes(model, work.parallel)
    prompt = work.seq_len
    prefill = compute_seconds(forward_flops_per_token(n, model, prompt) * work.batch * prompt, layout.devices, cluster)
    per_replica = math.ceil(work.batch / layout.dp)
    waves = math.ceil(per_replica / layout.micro_batch_size)
    b = layout.micro_batch_size
    kv = kv_cache_bytes(model, e, layout.tp, layout.pp, b, prompt + work.new_tokens) / 2
    hbm = getattr(cluster, "hbm_gbps", 3350.0) * GB
    stage_s = max(
        (weight_bytes + kv) / hbm, 2.0 * n * b / (layout.tp * layout.pp * cluster.gpu_peak_tflops * 1e12 * MODEL_FLOPS_EFFICIENCY)
    )
    comm = 0.0
    if layout.tp > 1:
        per = COLLECTIVE_LATENCY_S + ring_allreduce_seconds(b * model.hidden_size * e, layout.tp, cluster.intra_node_gbps)
        comm = 2 * model.num_layers * per
    decode = waves * work.new_tokens * (layout.pp * stage_s + comm)
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
    if work.mode == "train":
        if work.batch % layout.dp:
            return f"{work.batch_field}={work.batch} not divisible by dp={layout.dp}"
        if (work.batch // layout.dp) % layout.micro_batch_size:
            return f"{work.batch_field}/dp={work.batch // layout.dp} not divisible by micro_batch_size={layout.micro_batch_size}"
    return None


def estimate_layout(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> LayoutEstimate:
    """Memory (worst stage, bytes) and step time (seconds) of one structurally valid layout."""
    e = activation_dtype_bytes(model, work.parallel)
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
            m = work.batch // (layout.dp * layout.micro_batch_size)
            act = train_activation_bytes(
                model, work.kind, layout, e, work.seq_len, m, stage, training_precision(model, work.parallel, layout.dp)
            )
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
        time = generate_step_time(model, work, layout, best.weights, cluster)
    return LayoutEstimate(layout=layout, memory=best, time=time)


def memory_problem(est: LayoutEstimate, cluster: ClusterConfig) -> Optional[str]:
    """ "needs X GB/GPU > Y GB" when the worst stage does not fit, else None."""
    if est.memory.total > cluster.gpu_mem_gb * GB:
        return f"needs {est.memory.total / GB:.1f} GB/GPU > {cluster.gpu_mem_gb:g} GB"
    return None


def evaluate_layout(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> LayoutEstimate | Rejected:
    """A LayoutEstimate if `layout` runs and fits in memory, else Rejected with the reason."""
    problem = layout_problem(model, work, layout, cluster)
    if problem:
        return Rejected(layout, problem)
    est = estimate_layout(model, work, layout, cluster)
    problem = memory_problem(est, cluster)
    return Rejected(layout, problem, est) if problem else est


# --------------------------------------------------------------------------- roles and search


def _lora_fields(role_cfg) -> dict:
    """RoleWork's lora_rank / lora_targets from a trained role's ``lora`` config."""
    return {"lora_rank": role_cfg.lora.rank, "lora_targets": tuple(role_cfg.lora.target_modules)}


def role_works(cfg: AlignerConfig) -> list[RoleWork]:
    """What each role does per step of cfg.stage (sft, dpo: actor; rm: reward; ppo/plan: all PPO roles)."""
    t, d = cfg.trainer, cfg.data
    if cfg.stage == "sft":
        return [
            RoleWork(
                role="actor",
                kind="lm",
                mode="train",
                parallel=cfg.actor.parallel,
                batch=t.global_batch_size,
                batch_field="trainer.global_batch_size",
                seq_len=d.max_seq_len,
                optim_state_dtype=cfg.actor.optim.state_dtype,
                **_lora_fields(cfg.actor),
            )
        ]
    if cfg.stage == "dpo":  # chosen + rejected per pair; the reference's forward and weights beside the policy
        return [
            RoleWork(
                role="actor",
                kind="lm",
                mode="train",
                parallel=cfg.actor.parallel,
                batch=2 * t.global_batch_size,
                batch_field="2*trainer.global_batch_size",
                seq_len=d.max_seq_len,
                forward_seqs=2 * t.global_batch_size,
                optim_state_dtype=cfg.actor.optim.state_dtype,
                frozen_copies=0 if cfg.actor.lora.rank > 0 else 1,  # LoRA: the reference is the adapters-off policy
                **_lora_fields(cfg.actor),
            )
        ]
    if cfg.stage == "rm":
        return [
            RoleWork(
                role="reward",
                kind="score",
                mode="train",
                parallel=cfg.reward.parallel,
                batch=2 * t.global_batch_size,
                batch_field="2*trainer.global_batch_size",
                seq_len=d.max_seq_len,
                optim_state_dtype=cfg.reward.optim.state_dtype,
                **_lora_fields(cfg.reward),
            )
        ]
    samples = t.rollout_batch_size * t.n_samples_per_prompt
    opt_steps = samples // t.mini_batch_size * cfg.algorithm.ppo_epochs
    new_tokens = min(cfg.rollout.sampling.max_new_tokens, d.max_seq_len - d.max_prompt_len)

    def group(name: str, default: str) -> str:
        c = cfg.role(name).colocate_with
        return "actor" if c in ("actor", "rollout") else ("critic" if c in ("critic", "reward") else default)

    train = dict(
        mode="train",
        batch=t.mini_batch_size,
        batch_field="trainer.mini_batch_size",
        seq_len=d.max_seq_len,
        opt_steps=opt_steps,
        forward_seqs=samples,
    )
    works = [
        RoleWork(
            role="actor",
            kind="lm",
            parallel=cfg.actor.parallel,
            group="actor",
            optim_state_dtype=cfg.actor.optim.state_dtype,
            **_lora_fields(cfg.actor),
            **{**train, "forward_seqs": samples * (2 if cfg.ref_from_actor else 1)},  # + reference log-probs (adapters off)
        ),
        RoleWork(
            role="rollout",
            kind="lm",
            mode="generate",
            parallel=cfg.rollout.parallel,
            batch=samples,
            batch_field="samples",
            seq_len=d.max_prompt_len,
            new_tokens=new_tokens,
            max_batch_size=cfg.rollout.max_batch_size,
            group="actor",
        ),
    ]
    roles = cfg.roles_used()
    if "critic" in roles:
        works.append(
            RoleWork(
                role="critic",
                kind="score",
                parallel=cfg.critic.parallel,
                group="critic",
                optim_state_dtype=cfg.critic.optim.state_dtype,
                **_lora_fields(cfg.critic),
                **train,
            )
        )
    if "reward" in roles:
        works.append(
            RoleWork(
                role="reward",
                kind="score",
                mode="forward",
                parallel=cfg.reward.parallel,
                batch=samples,
                batch_field="samples",
                seq_len=d.max_seq_len,
                group=group("reward", "critic"),
            )
        )
    if "ref" in roles:
        works.append(
            RoleWork(
                role="ref",
                kind="lm",
                mode="forward",
                parallel=cfg.ref.parallel,
                batch=samples,
                batch_field="samples",
                seq_len=d.max_seq_len,
                group=group("ref", "critic"),
            )
        )
    return works


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(work: RoleWork, dp: int, minimal: bool) -> list[int]:
    if work.mode == "train":
        local = work.batch // dp if work.batch % dp == 0 else 1
    else:
        local = max(1, math.ceil(work.batch / dp))
        if work.mode == "generate" and work.max_batch_size:
            local = min(local, work.max_batch_size)
    if minimal:
        return [1]
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= local and (work.mode != "train" or local % b == 0)]
    if work.mode == "generate" and local not in sizes:
        sizes.append(local)
    return sizes or [1]


def candidate_layouts(model: ModelConfig, work: RoleWork, devices: int, minimal: bool = False) -> Iterable[Layout]:
    """Every tp x pp x dp = devices with tp <= num_heads and pp dividing num_layers, each micro-batch
    size, recomputation and SP (training roles, tp > 1), and for an MoE training role each ep dividing
    dp and num_experts (the rollout engine holds every expert per replica). minimal: only the
    least-memory choices."""
    modes = (("full",) if minimal else RECOMPUTE_MODES) if work.mode == "train" else ("none",)
    for tp in _divisors(devices):
        if tp > model.num_heads:
            continue
        for pp in _divisors(devices // tp):
            if model.num_layers % pp:
                continue  # even stages only (pp_layer_split is for hand-made layouts)
            dp = devices // (tp * pp)
            eps = [d for d in _divisors(dp) if model.num_experts and model.num_experts % d == 0] if work.mode == "train" else []
            for ep in eps or [1]:
                for mbs in _micro_batches(work, dp, minimal):
                    for rc in modes:
                        for sp in ((True,) if minimal else (False, True)) if tp > 1 and work.mode == "train" else (False,):
                            yield Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, sp=sp, recompute=rc, ep=ep)


def plan_role(model: ModelConfig, work: RoleWork, devices: int, cluster: ClusterConfig, minimal: bool = False) -> RolePlan:
    """Rank the feasible layouts of one role on `devices` devices by step time (then memory).

    Rejected layouts keep one per structural reason and, per (tp, pp), the one closest to fitting
    in memory; those with an estimate come first, fastest first."""
    plan = RolePlan(role=work.role, work=work, devices=devices)
    closest: dict = {}
    for layout in candidate_layouts(model, work, devices, minimal):
        r = evaluate_layout(model, work, layout, cluster)
        if isinstance(r, LayoutEstimate):
            plan.ranked.append(r)
            if minimal:
                break
            continue
        key = (layout.tp, layout.pp) if r.estimate else r.reason
        old = closest.get(key)
        if old is None or (r.estimate and old.estimate and r.estimate.memory.total < old.estimate.memory.total):
            closest[key] = r
    plan.ranked.sort(key=lambda x: (x.time.total_s, x.memory.total))
    plan.rejected = sorted(
        closest.values(), key=lambda r: (r.estimate is None, r.estimate.time.total_s if r.estimate else 0.0, r.layout.tp, r.layout.pp)
    )
    return plan


def _group_time(roles: dict[str, RolePlan], group: str) -> float:
    return sum(p.best.time.total_s for p in roles.values() if p.work.group == group and p.work.mode != "generate")


def ppo_step_seconds(roles: dict[str, RolePlan], split: bool) -> float:
    """Split placement: rollout, then the actor's and the critic's groups concurrently (the slower
    dominates). Colocated: every phase in turn."""
    if not split:
        return sum(p.best.time.total_s for p in roles.values())
    rollout = sum(p.best.time.total_s for p in roles.values() if p.work.mode == "generate")
    return rollout + max(_group_time(roles, "actor"), _group_time(roles, "critic"))


def _plan_on(
    cfg: AlignerConfig, num_nodes: int, minimal: bool, cache: dict
) -> tuple[Optional[dict[str, RolePlan]], Optional[NodeSplit], str]:
    """Best role plans on `num_nodes` nodes (trying every node split), the split, or the reason none fits."""
    cluster = replace(cfg.cluster, num_nodes=num_nodes)
    g = _devices_per_node(cluster)
    works = role_works(cfg)

    def role_plan(work: RoleWork, nodes: int) -> RolePlan:
        key = (work.role, nodes, minimal)
        if key not in cache:
            cache[key] = plan_role(cfg.model, work, nodes * g, cluster, minimal)
        return cache[key]

    groups = {w.group for w in works}
    split = cfg.cluster.placement == "split" and num_nodes >= 2 and len(groups) == 2
    options = [(a, num_nodes - a) for a in range(1, num_nodes)] if split else [(num_nodes, num_nodes)]
    best, best_split, tried, reason = None, None, [], ""
    for a, c in options:
        roles = {w.role: role_plan(w, a if w.group == "actor" or not split else c) for w in works}
        missing = [p for p in roles.values() if p.best is None]
        if missing:
            p = missing[0]
            why = p.rejected[0].reason if p.rejected else "no candidate layout"
            reason = f"{p.role} on {p.devices} devices: {why}"
            tried.append((a, reason))
            continue
        t = ppo_step_seconds(roles, split) if cfg.stage in ("ppo", "plan") else sum(p.best.time.total_s for p in roles.values())
        tried.append((a, t))
        if best is None or t < best_split[2]:
            best, best_split = roles, (a, c, t)
    if best is None:
        return None, None, reason
    node_split = NodeSplit(best_split[0], best_split[1], best_split[2], tuple(tried)) if split else None
    return best, node_split, ""


def smallest_cluster(cfg: AlignerConfig) -> tuple[int, int]:
    """(num_nodes, gpus_per_node): the fewest nodes of cfg.cluster's kind on which every role fits.

    Raises PlanError if none up to MAX_NODES does."""
    cache: dict = {}
    for n in range(1, MAX_NODES + 1):
        roles, _, _ = _plan_on(cfg, n, True, cache)
        if roles is not None:
            return n, cfg.cluster.gpus_per_node
        if n >= 64:
            break
    n = 128
    while n <= MAX_NODES:
        roles, _, _ = _plan_on(cfg, n, True, cache)
        if roles is not None:
            return n, cfg.cluster.gpus_per_node
        n *= 2
    raise PlanError(
        f"no cluster of up to {MAX_NODES} nodes x {cfg.cluster.gpus_per_node} GPUs x {cfg.cluster.gpu_mem_gb:g} GB fits this model"
    )


def _cluster_text(nodes: int, gpus: int, mem: float) -> str:
    return f"{nodes} node{'s' if nodes != 1 else ''} x {gpus} GPUs x {mem:g} GB"


def make_plan(cfg: AlignerConfig) -> Plan:
    """The ranked layouts per role for cfg.cluster, the node split and the estimated step time.

    Raises PlanError naming the role that does not fit, why, and the smallest cluster that would."""
    cache: dict = {}
    roles, node_split, reason = _plan_on(cfg, cfg.cluster.num_nodes, False, cache)
    c = cfg.cluster
    if roles is None:
        try:
            n, g = smallest_cluster(cfg)
            fix = f"the smallest cluster that fits is {_cluster_text(n, g, c.gpu_mem_gb)} (cluster.num_nodes={n})"
        except PlanError as err:
            fix = str(err)
        raise PlanError(f"no layout fits on {_cluster_text(c.num_nodes, c.gpus_per_node, c.gpu_mem_gb)}: {reason}; {fix}")
    split = node_split is not None
    if cfg.stage in ("ppo", "plan"):
        step = ppo_step_seconds(roles, split)
    else:
        step = sum(p.best.time.total_s for p in roles.values())
    return Plan(
        stage=cfg.stage,
        cluster=c,
        placement="split" if split else "colocated",
        roles=roles,
        node_split=node_split,
        step_time_s=step,
        model=cfg.model,
    )


# --------------------------------------------------------------------------- output


def _gb(x: float) -> str:
    return f"{x / GB:7.1f}"


def _layout_row(est: LayoutEstimate) -> str:
    m, t = est.memory, est.time
    return (
        f"  {est.layout.describe():<50} {_gb(m.weights)} {_gb(m.grads)} {_gb(m.optimizer)} {_gb(m.activations)} "
        f"{_gb(m.kv_cache)} {_gb(m.total)}  {t.total_s:9.2f} (compute {t.compute_s:.2f}, tp {t.tp_comm_s:.2f}, "
        f"dp {t.dp_comm_s:.2f}, bubble {t.bubble_s:.2f}, decode {t.decode_s:.2f}" + (f", all-to-all {t.a2a_s:.2f})" if t.a2a_s else ")")
    )


def train_state_line(work: RoleWork, model: ModelConfig) -> str:
    """ "training state per parameter: 4 B weights + 4 B grads + 4 B optimizer = 12 B (...)" for a trained role."""
    w, g, o = train_bytes_per_parameter(work.parallel, model, work.optim_state_dtype)
    return (
        f"training state per parameter: {w:g} B weights + {g:g} B grads + {o:g} B optimizer = {w + g + o:g} B "
        f"(optim.state_dtype={work.optim_state_dtype}, mixed_precision={work.parallel.mixed_precision}, before dp sharding)"
        + (
            f"; LoRA r={work.lora_rank} on {','.join(work.lora_targets)}: grads and optimizer only for the adapters"
            if work.lora_rank
            else ""
        )
    )


def format_role(plan: RolePlan, model: Optional[ModelConfig] = None) -> str:
    """A readable table of one role's ranked layouts (GB, seconds) and best rejected layouts; with
    `model`, a trained role's line of training-state bytes per parameter (:func:`train_state_line`)."""
    what = {"train": "training", "forward": "inference", "generate": "rollout engine"}[plan.work.mode]
    lines = [f"{plan.role} ({what}, {plan.devices} devices):"]
    if model is not None and plan.work.mode == "train":
        lines.append(f"  {train_state_line(plan.work, model)}")
    lines.append(f"  {'layout':<50} {'weights':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'kv':>7} {'total':>7}  {'step s':>9}")
    for est in plan.ranked[:SHOW_RANKED]:
        lines.append(_layout_row(est))
    if not plan.ranked:
        lines.append("  (no layout fits)")
    if plan.rejected:
        lines.append("  rejected (best first):")
        for r in plan.rejected[:SHOW_REJECTED]:
            lines.append(f"    {r.layout.describe():<50} {r.reason}")
    return "\n".join(lines)


def recommended_overrides(plan: Plan) -> list[str]:
    """Command-line overrides that apply the best layout of each role (for presets and runs)."""
    out = []
    for name, rp in plan.roles.items():
        lay = rp.best.layout
        out.append(f"{name}.parallel.tp_size={lay.tp} {name}.parallel.pp_size={lay.pp} {name}.parallel.dp_size={lay.dp}")
        if lay.ep > 1:
            out[-1] += f" {name}.parallel.ep_size={lay.ep}"
        if rp.work.mode == "train":
            out.append(f"{name}.parallel.sequence_parallel={str(lay.sp).lower()} {name}.parallel.recompute={lay.recompute}")
    return out


def format_plan(plan: Plan) -> str:
    """The whole plan as text: cluster, node split, per-role tables (memory in GB, time in s)."""
    c = plan.cluster
    lines = [
        f"plan for stage {plan.stage} on {_cluster_text(c.num_nodes, c.gpus_per_node, c.gpu_mem_gb)} "
        f"({plan.placement} placement; peak {c.gpu_peak_tflops:g} TFLOP/s x {MODEL_FLOPS_EFFICIENCY} efficiency)",
    ]
    if plan.node_split:
        ns = plan.node_split
        lines.append(f"node split: actor group (actor, rollout) {ns.actor_nodes} of {c.num_nodes} nodes, critic group {ns.critic_nodes}")
        tried = ", ".join(f"{a}:{t:.1f}s" if isinstance(t, float) else f"{a}:no fit" for a, t in ns.tried)
        lines.append(f"  splits tried (actor nodes: step time): {tried}")
    lines.append(f"estimated step time: {plan.step_time_s:.2f} s (memory in GB per device, times in seconds per step)")
    for rp in plan.roles.values():
        lines.append("")
        lines.append(format_role(rp, plan.model))
    lines.append("")
    lines.append("overrides for the best layouts:")
    lines.extend(f"  {o}" for o in recommended_overrides(plan))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the configured layout


def configured_layout(cfg: AlignerConfig, work: RoleWork) -> Layout:
    """The layout cfg asks for (role.parallel sizes; trainer.micro_batch_size for training roles)."""
    pc = work.parallel
    if work.mode == "train":
        mbs = cfg.trainer.micro_batch_size
    elif work.mode == "generate":
        mbs = min(work.max_batch_size or work.batch, math.ceil(work.batch / pc.dp_size))
    else:
        mbs = min(cfg.trainer.micro_batch_size, math.ceil(work.batch / pc.dp_size))
    return Layout(
        tp=pc.tp_size,
        pp=pc.pp_size,
        dp=pc.dp_size,
        micro_batch_size=max(1, mbs),
        sp=pc.sequence_parallel and pc.tp_size > 1,
        recompute=pc.recompute if work.mode == "train" else "none",
        ep=getattr(pc, "ep_size", 1) if work.mode == "train" else 1,
    )


def check_fits(cfg: AlignerConfig) -> dict[str, LayoutEstimate]:
    """Check the configured layout of every role against cfg.cluster before any weights are loaded.

    Returns each role's estimate. Raises PlanError listing each role that does not fit (why, in
    GB or devices), what the planner would choose instead, or the smallest cluster that fits."""
    c = cfg.cluster
    total = c.num_nodes * _devices_per_node(c)
    out, problems = {}, []
    for work in role_works(cfg):
        layout = configured_layout(cfg, work)
        if c.gpus_per_node > 0 and layout.devices > total:
            problems.append(f"{work.role}: {layout.describe()} needs {layout.devices} GPUs > {total} in the cluster")
            continue
        r = evaluate_layout(cfg.model, work, layout, c)
        if isinstance(r, Rejected):
            problems.append(f"{work.role}: {layout.describe()}: {r.reason}")
        else:
            out[work.role] = r
    if not problems:
        return out
    try:
        hint = "the planner suggests:\n" + format_plan(make_plan(cfg))
    except PlanError as err:
        hint = str(err)
    raise PlanError("the configured layouts do not fit the cluster:\n  " + "\n  ".join(problems) + "\n" + hint)


def print_plan(cfg: AlignerConfig) -> int:
    """Print the plan for cfg (stdout) and return 0, or print why nothing fits and the smallest
    cluster that would (stderr) and return 1."""
    try:
        plan = make_plan(cfg)
    except PlanError as err:
        print(f"aligner.plan: {err}", file=sys.stderr)
        return 1
    print(format_plan(plan))
    return 0
