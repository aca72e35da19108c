"""The planner's step-time model: seconds per step of one role's layout (training, forward, generation).

Owns: FLOPs per token, the communication terms (TP all-reduces, the data-parallel reduction and what the
runtime overlaps of it, FSDP2's traffic per micro-batch or per step (``parallel.fsdp_reduce``), context parallelism's K/V exchange, expert
all-to-alls, pipeline point-to-point), the training efficiency (:func:`gemm_efficiency`) and the decode
model, on the types and parameter counts of :mod:`aligner.planner.cost_model`.

Step-time model (seconds): FLOPs per token 6N + 12*L*H*T for training (4 instead of 6 per frozen
parameter of a LoRA base: no weight gradients) and 2N + 4*L*H*T for
a forward pass (Chowdhery et al. 2022, PaLM appendix B; N the parameters a token multiplies by, without an
untied input embedding: :func:`aligner.planner.cost_model.role_flop_parameters`), plus one forward for full
recomputation or the attention core for selective, divided by devices * peak * efficiency;
TP all-reduces (4 per layer per micro-batch in forward + backward, Shoeybi et al. 2019) of
B*T*H elements over the intra-node bandwidth with ring volume 2(n-1)/n; the data-parallel
gradient all-reduce over the inter-node bandwidth when the dp group spans nodes, once per optimizer step
(DDP, less what the last micro-batch's backward hides: :func:`dp_overlap_exposed`; DeepSpeed), or FSDP2's
per-layer all-gathers (forward and backward) and reduce-scatters for every micro-batch, exposed beyond each
pass's compute (``parallel.fsdp_reduce=micro_batch``, the default: :func:`fsdp2_micro_batch_exposed_seconds`),
or once per optimizer step (``fsdp_reduce=step``: one all-gather per layer beside the first micro-batch's
forward, one reduce-scatter beside the last one's backward: :func:`fsdp2_step_exposed_seconds`); the 1F1B bubble multiplies compute by 1 + (p-1)/m (Narayanan et al.
2021). Rollout: a compute-bound prefill, then decode steps, each the larger of reading the pipeline stage
weights and the KV cache from HBM (the whole cache with aligner's engine, the rows' own tokens with
TensorRT-LLM's paged one: :func:`paged_kv_bytes_per_step`) and its FLOPs, plus a fixed overhead per decoder layer
(DECODE_OVERHEAD_S_PER_LAYER in a CUDA graph, DECODE_OVERHEAD_EAGER_S_PER_LAYER without: :func:`decode_graphed`;
both fitted to aligner's measured decode) and the TP all-reduces; a token
walks all pp stages in turn. The steps follow ``rollout.scheduler`` and the expected response
lengths (``rollout.expected_response_len*``): a static batch decodes until its longest response
stops, a continuous pool refills its rows, so the mean governs it (:func:`decode_steps`). The
engine's rows per replica (its KV cache) are the layout's micro-batch size, checked in memory like
any other layout: a rollout batch larger than the rows that fit runs in waves.
"""

from __future__ import annotations

import math
from typing import Optional

from aligner.config import ClusterConfig, ModelConfig
from aligner.planner.cost_model import (
    DTYPE_BYTES,
    GB,
    Layout,
    RoleWork,
    StepTime,
    _dp_shards,
    activation_dtype_bytes,
    expert_layer_parameters,
    kv_cache_bytes,
    layer_num_parameters,
    layers_on_pp_stage,
    lora_num_parameters,
    micro_batch_shape,
    pp_stage_num_parameters,
    role_flop_parameters,
)

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
# 2021 ran it), pipeline point-to-point (split over the tp ranks, Megatron's scatter/gather) and bubble time is
# taken out, and the busiest pipeline rank's share (the head on the last pipeline stage) put in, leaving 0.52-0.66. The
# rows span x = 768-2,304 and show no trend
# with x: the held-in fit is flat (MFU_HALF_DIM = 0; all ten rows give 0.597 and 60, equally flat above a few
# hundred), so **the model is a constant 0.575 of peak for training and forward passes**: the saturating
# form is kept for a fit to shapes these rows do not cover (narrow shards, short micro-batches: the GPU suite's
# measurements in benchmarks/RESULTS.md), which is where it would matter. The fit is an A100's, applied to every GPU.
MFU_MAX = 0.575
MFU_HALF_DIM = 0.0
# torch DDP's default gradient bucket (bucket_cap_mb=25; aligner does not set it): the last bucket's all-reduce
# starts when backward ends, so at least it is exposed (bytes)
DDP_BUCKET_BYTES = 25 * 2**20
COLLECTIVE_LATENCY_S = 10e-6  # fixed cost of one small collective (decode steps), seconds
# Fixed cost of one decoder layer in one decode step of aligner's TorchEngine, seconds (kernel launches,
# the CUDA-graph replay, sampling and the host loop, spread over the layers), beyond the step's HBM /
# FLOP roofline. Least-squares fit (benchmarks/planner_validation.py --fit) to the static scheduler's
# CUDA-graph decode of a 1.10B Llama (22 layers) in bf16, prompt 128, 256 new tokens, batches 1, 8, 32, 64
# (benchmarks/RESULTS.md): 127.8 us from the H200's rows alone (4,245 GB/s), 126.4 us from the H100's
# (3,012 GB/s), 127.1 us from both (2026-11-28: the roofline reads no untied input embedding; 125.2 before);
# residuals in tok/s -9.8 / -1.1 / +3.4 / +8.5% (H200) and
# -9.9 / -1.5 / +2.5 / +6.4% (H100) at batch 1 / 8 / 32 / 64 (the measured overhead grows with the batch,
# the constant does not). It is TorchEngine's: TensorRT-LLM's C++ runtime has a lower one (not measured
# here), and an eager step (no CUDA graphs) a much higher one (DECODE_OVERHEAD_EAGER_S_PER_LAYER, below).
# Only one model depth was measured: that the cost scales with the layers is assumed (kernels per layer).
DECODE_OVERHEAD_S_PER_LAYER = 127e-6
# The same for a decode step TorchEngine runs eagerly (no CUDA graph: :func:`decode_graphed` is False), seconds
# per decoder layer: the same fit (benchmarks/planner_validation.py --fit, MEASURED_EAGER) to the continuous
# scheduler's decode of the same 1.10B Llama on the H200 of 2026-11-26, which ran without CUDA graphs then
# (69 / 590 / 2,283 / 4,967 tok/s at batch 1 / 8 / 32 / 64: 12.9-14.5 ms a step, the Python dispatch of
# about 30 kernels a layer): 596.7 us, residuals in tok/s +6.4 / -0.7 / +1.8 / -7.4%. One GPU, one model depth, as above.
DECODE_OVERHEAD_EAGER_S_PER_LAYER = 597e-6


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


def pipeline_bubble_fraction(pp: int, num_micro_batches: int, vpp: int = 1) -> float:
    """1F1B bubble relative to the ideal compute time: (p - 1) / m, and (p - 1) / (v m) with v model
    chunks per rank (interleaved; Narayanan et al. 2021, sec. 2.2)."""
    return (pp - 1) / (max(num_micro_batches, 1) * vpp)


def pipeline_p2p_seconds(
    model: ModelConfig, layout: Layout, micro_batches: int, seq: float, e: int, cluster: ClusterConfig, directions: int = 2
) -> float:
    """Seconds of the pipeline's point-to-point messages on the schedule's critical path in one pass over
    `micro_batches` micro-batches (0 at pp = 1). aligner's schedules exchange each pipeline stage's activations and
    gradients with ``batch_isend_irecv`` and wait (:mod:`aligner.parallel.pipeline`), so nothing hides them:
    1F1B runs m + p - 1 forward slots and as many backward slots, each ending in one message; interleaving
    with v chunks per rank makes it v m + p - 1 chunk slots (v times the messages, Narayanan et al. 2021,
    sec. 2.2). directions: 2 for a training pass (activations forward, gradients back), 1 for a forward-only
    pass. A message is [b, seq / cp (/ tp with SP), H] elements of e bytes, over the link its pipeline stage boundary
    crosses (:func:`pp_seconds_per_byte`)."""
    if layout.pp == 1:
        return 0.0
    nbytes = layout.micro_batch_size * seq / layout.cp * model.hidden_size * e / (layout.tp if layout.sp else 1)
    slots = layout.vpp * micro_batches + layout.pp - 1
    return directions * slots * nbytes * pp_seconds_per_byte(layout, cluster)


def pp_seconds_per_byte(layout: Layout, cluster: ClusterConfig) -> float:
    """Mean seconds per byte over the pipeline stage boundaries a micro-batch crosses (p - 1; p with interleaving, whose
    chunks wrap from the last pipeline stage to the first). aligner's rank order is tp, cp, pp, dp (tp fastest;
    :mod:`aligner.parallel.dims`), so a pipeline stage is tp x cp consecutive ranks and a boundary stays inside a node
    unless it falls on a node's edge: the whole pipeline inside one node while tp x cp x pp ranks fit it. On a
    CPU-only cluster (gpus_per_node = 0) each node is one device: every boundary is inter-node."""
    g, span = cluster.gpus_per_node, layout.tp * layout.cp
    edges = [(i, i + 1) for i in range(layout.pp - 1)] + ([(layout.pp - 1, 0)] if layout.vpp > 1 else [])
    inter = 1.0 / (cluster.inter_node_gbps * 1e9)
    if g <= 0:
        return inter
    intra = 1.0 / (cluster.intra_node_gbps * 1e9)
    return sum(inter if (a * span) // g != (b * span) // g else intra for a, b in edges) / len(edges)


def devices_per_node(cluster: ClusterConfig) -> int:
    """Devices per node the planner counts: the GPUs, or 1 on a CPU-only cluster (gpus_per_node = 0)."""
    return cluster.gpus_per_node if cluster.gpus_per_node > 0 else 1


def _dp_gbps(layout: Layout, cluster: ClusterConfig) -> float:
    """dp groups are the slowest-varying mesh axis (aligner's rank order tp, cp, pp, dp): inside a node
    only if the whole mesh is."""
    inside = cluster.gpus_per_node > 0 and layout.devices <= cluster.gpus_per_node
    return cluster.intra_node_gbps if inside else cluster.inter_node_gbps


def pipeline_stage_factor(model: ModelConfig, layout: Layout, kind: str, seq: float, training: bool = True) -> float:
    """How much longer the pipeline's busiest rank computes than the average rank: max over ranks of its FLOPs
    x pp / all the FLOPs (1.0 at pp = 1); the pipeline runs at that rank's pace.

    A rank's FLOPs per token: its decoder layers (the runtime's split: the first num_layers % pp pipeline stages take one
    more; v equal chunks per rank when interleaved), each 6 P + 12 h s in training (P the layer's active
    parameters; PaLM's count, as :func:`train_flops_per_token`; a full recomputation adds a third, a selective
    one the attention core's 4 h s) or 2 P + 4 h s forward only, and, on the last rank, the head: 6 h V for a
    causal LM (2 h V forward only), 6 h for a score model. The head is not recomputed. Over a large vocabulary it
    outweighs layers: Llama 3 8B's (V = 128,256) has 2.4 layers' parameters, 2.1 layers' FLOPs at 4,096 tokens,
    so a deep pipeline waits on its last pipeline stage
    (Megatron-LM splits the first and last pipeline stages unevenly for this reason: --decoder-first/last-pipeline-num-layers)."""
    if layout.pp == 1:
        return 1.0
    h, pp = model.hidden_size, layout.pp
    # a layer's parameters less its experts that a token skips (MoE; 0 for a dense model)
    p_layer = layer_num_parameters(model) - (model.num_parameters() - model.num_parameters(active=True)) / model.num_layers
    passes = 3.0 if training else 1.0
    layer = passes * (2 * p_layer + 4 * h * seq)
    if training and layout.recompute == "full":
        layer *= 4 / 3
    elif training and layout.recompute == "selective":
        layer += 4 * h * seq
    head = passes * 2 * h * (model.vocab_size if kind == "lm" else 1)
    if layout.vpp > 1:
        first = last = model.num_layers // pp
    else:
        first, last = layers_on_pp_stage(model.num_layers, pp, 0), layers_on_pp_stage(model.num_layers, pp, pp - 1)
    total = model.num_layers * layer + head
    return max(first * layer, last * layer + head) * pp / total


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
    kind: str = "lm",
    training: bool = True,
) -> tuple[float, float, float]:
    """(compute, tp comm, bubble) seconds of `mb` micro-batches of `rows` rows (None:
    layout.micro_batch_size) of `seq` tokens through the pipeline, the compute at
    :func:`gemm_efficiency` of peak. `layers`: the first (largest) pipeline stage's, for the tp collectives. The
    pipeline runs at its busiest rank's pace, so the compute is scaled by :func:`pipeline_stage_factor`
    (unequal layer counts, the head on the last pipeline stage); kind, training: the role's head and pass."""
    rows = layout.micro_batch_size if rows is None else rows
    eff = gemm_efficiency(model, layout, rows, seq)
    compute = compute_seconds(flops, layout.devices, cluster, eff) * pipeline_stage_factor(model, layout, kind, seq, training)
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
    layer of this pipeline stage (2 forward, 4 forward + backward, 6 with full recomputation)."""
    if layout.ep <= 1 or not model.num_experts:
        return 0.0
    layers = layers_on_pp_stage(model.num_layers, layout.pp, 0)
    rows = layout.micro_batch_size if rows is None else rows
    nbytes = a2a_elements_per_layer(model, math.ceil(rows * seq)) * e
    return micro_batches * layers * per_layer * a2a_seconds(nbytes, layout.ep, _dp_gbps(layout, cluster))


def train_step_time(model: ModelConfig, work: RoleWork, layout: Layout, grad_bytes: float, cluster: ClusterConfig) -> StepTime:
    """Seconds per step of a training role: opt_steps optimizer steps (+ the forward-only passes).
    FLOPs follow the active parameters (MoE: top-k experts per token); with LoRA the frozen base
    computes no weight gradients (:func:`train_flops_per_token`) and the adapters add theirs."""
    n = role_flop_parameters(model, work.kind)
    frozen = 0
    if work.lora_rank > 0:  # the base is frozen (a score head trains: h parameters); the adapters train
        frozen = n - (model.hidden_size if work.kind == "score" else 0)
        n += lora_num_parameters(model, work.lora_rank, work.lora_targets, 1, model.num_layers)[0]
    e = activation_dtype_bytes(model, work.parallel)
    layers = layers_on_pp_stage(model.num_layers, layout.pp, 0)
    m, rows, seq = micro_batch_shape(work, layout, work.batch)
    colls = 6 if layout.recompute == "full" else 4
    flops = train_flops_per_token(n, model, seq, layout.recompute, frozen) * work.batch * seq
    c, t, b = _pass_time(flops, m, layers, colls, layout, model, e, seq, cluster, rows, work.kind)
    fsdp = work.parallel.dp_backend == "fsdp2" and layout.dp > 1
    fwd_share = forward_flops_per_token(n, model, seq) / train_flops_per_token(n, model, seq, layout.recompute, frozen)
    if fsdp and layout.fsdp_reduce == "step":  # once per step: gathers in the first forward, reduce-scatters in the last backward
        dp = fsdp2_step_exposed_seconds(model, work, layout, c / m * fwd_share, c / m * (1.0 - fwd_share), cluster)
    elif fsdp:  # per micro-batch, overlapped per pass; the pipeline's slots (and so its bubble) grow with it
        dp = m * fsdp2_micro_batch_exposed_seconds(model, work, layout, c / m * fwd_share, c / m * (1.0 - fwd_share), cluster)
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
    pp = pipeline_p2p_seconds(model, layout, m, seq, e, cluster)
    c, t, b, dp, a2a, cp, pp = c * steps, t * steps, b * steps, dp * steps, a2a * steps, cp * steps, pp * steps
    if work.forward_seqs:
        mf, rows_f, _ = micro_batch_shape(work, layout, work.forward_seqs)
        ff = forward_flops_per_token(n, model, seq) * work.forward_seqs * seq
        c2, t2, b2 = _pass_time(ff, mf, layers, 2, layout, model, e, seq, cluster, rows_f, work.kind, training=False)
        if fsdp and layout.fsdp_reduce == "step":  # the pass gathers each layer once (TrainRuntime.forward_only)
            dp += fsdp2_micro_batch_exposed_seconds(model, work, layout, c2 / mf, None, cluster)
        elif fsdp:  # the forward-only passes all-gather every layer too (no backward, no reduce-scatter)
            d2 = mf * fsdp2_micro_batch_exposed_seconds(model, work, layout, c2 / mf, None, cluster)
            dp, b2 = dp + d2, b2 + d2 * pipeline_bubble_fraction(layout.pp, mf, layout.vpp)
        c, t, b = c + c2, t + t2, b + b2
        a2a += _a2a_time(model, layout, mf, seq, e, 2, cluster, rows_f)
        cp += mf * layers * cp_comm_seconds(model, layout, rows_f, seq, e, 1, cluster)
        pp += pipeline_p2p_seconds(model, layout, mf, seq, e, cluster, directions=1)
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
    - FSDP2 with dp > 1: not charged here, per micro-batch (:func:`fsdp2_micro_batch_exposed_seconds`) or, with
      ``fsdp_reduce=step``, once per step (:func:`fsdp2_step_exposed_seconds`) instead.
    - DeepSpeed: not overlapped (aligner's DeepSpeed config leaves ``overlap_comm`` at its default, off
      for ZeRO-1/2), once per step. An undercount for m > 1 left as it was: the config's
      ``gradient_accumulation_steps: 1`` makes every ``engine.backward`` (one per micro-batch) an accumulation
      boundary, so DeepSpeed reduces (ZeRO-3: also gathers) for every micro-batch (docs/planner.md).

    compute_s: one optimizer step's compute on a pipeline stage (seconds, no bubble); n, frozen: the trained
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


def fsdp2_micro_batch_exposed_seconds(
    model: ModelConfig, work: RoleWork, layout: Layout, forward_s: float, backward_s: Optional[float], cluster: ClusterConfig
) -> float:
    """Seconds FSDP2's collectives add to one micro-batch on a pipeline stage (dp > 1), beyond its compute.

    What aligner's runtime does, per micro-batch, under ``parallel.fsdp_reduce=micro_batch`` (the default;
    ``step``: :func:`fsdp2_step_exposed_seconds`):
    - :func:`aligner.parallel.data_parallel.apply_fsdp2` calls ``fully_shard`` on every decoder layer and then on
      the model (the root: embedding, final norm, head), with ``reshard_after_forward=True``
      (:func:`aligner.parallel.parallelize.apply_data_parallel` passes no other value), and with
      ``fsdp_reduce=micro_batch`` the runtime leaves FSDP2's ``set_requires_gradient_sync`` /
      ``set_reshard_after_backward`` switches at their defaults.
      So every micro-batch's forward all-gathers each layer's parameters, its backward all-gathers them again
      and reduce-scatters the layer's gradient (torch FSDP2: a layer's group is unsharded in its pre-forward and
      pre-backward hooks and reduce-scattered in its post-backward). The root too: ``apply_fsdp2`` passes
      ``reshard_after_forward=True`` explicitly, which turns off torch's keep-the-root-unsharded default, so it is
      gathered twice per micro-batch and reduce-scattered once (counted on gloo:
      tests/parallel/test_fsdp_reduce_per_step.py sees 2m all-gathers per unit and step).
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
      on the pipeline stage), and at least one layer's transfer per pass (the forward's first gather, the backward's last
      reduce-scatter), plus the root's gathers (before the first layer in forward and in backward) and its
      reduce-scatter (after the last).
    backward_s None: a forward-only pass (the trained role's extra forwards: gathers, no reduce-scatter).
    Not modelled: contention between these collectives and TP's or the pipeline's on shared links, and the
    interleaved schedule's chunks (a pipeline stage's layers are gathered once per micro-batch and pass, as without)."""
    if layout.dp <= 1:
        return 0.0
    root_gather, gather, layers, root_reduce, reduce = fsdp2_unit_seconds(model, work, layout, cluster)
    exposed = root_gather + exposed_dp_seconds(layers * gather, forward_s, gather)
    if backward_s is not None:
        exposed += root_gather + root_reduce + exposed_dp_seconds(layers * (gather + reduce), backward_s, reduce)
    return exposed


def fsdp2_step_exposed_seconds(
    model: ModelConfig, work: RoleWork, layout: Layout, forward_s: float, backward_s: float, cluster: ClusterConfig
) -> float:
    """Seconds FSDP2's collectives add to one optimizer step on a pipeline stage under ``parallel.fsdp_reduce=step``
    (dp > 1), beyond its compute.

    What the runtime does (:class:`aligner.parallel.data_parallel.FsdpStepReduce`): every unit is all-gathered
    in the step's first forward and stays unsharded (no reshard after forward or backward, no gradient sync)
    until the last micro-batch's backward, which reduce-scatters each unit's accumulated gradient once. So per
    step: one all-gather per unit, overlapped with the first micro-batch's forward (`forward_s`: one
    micro-batch's forward compute on the pipeline stage), and one reduce-scatter per unit beside the last micro-batch's
    backward (`backward_s`), each exposed beyond that pass's compute and at least one layer's transfer, plus
    the root's gather and reduce-scatter; bytes and bandwidth as :func:`fsdp2_micro_batch_exposed_seconds`.
    The forward-only passes (separate calls: old log-probs, values) gather each unit once per pass too
    (``TrainRuntime.forward_only`` keeps the units unsharded through the pass; charged in :func:`train_step_time`
    as one micro-batch's gathers). Not added to the pipeline bubble: paid once per step, not in every slot."""
    if layout.dp <= 1:
        return 0.0
    root_gather, gather, layers, root_reduce, reduce = fsdp2_unit_seconds(model, work, layout, cluster)
    return (
        root_gather
        + exposed_dp_seconds(layers * gather, forward_s, gather)
        + root_reduce
        + exposed_dp_seconds(layers * reduce, backward_s, reduce)
    )


def fsdp2_unit_seconds(
    model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig
) -> tuple[float, float, int, float, float]:
    """FSDP2's collective times on the largest pipeline stage (dp > 1), seconds: (the root's all-gather, one decoder
    layer's all-gather, decoder layers on the pipeline stage, the root's reduce-scatter, one layer's reduce-scatter).
    Bytes and bandwidth: :func:`fsdp2_micro_batch_exposed_seconds`."""
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
    layers = layers_on_pp_stage(model.num_layers, layout.pp, 0)
    root = 0
    for pp_stage in sorted({0, layout.pp - 1}):
        held = pp_stage_num_parameters(model, work.kind, layout.tp, layout.pp, pp_stage, layout.ep)
        root = max(root, held - layers_on_pp_stage(model.num_layers, layout.pp, pp_stage) * (dense + local_experts))
    root_trained = (h if work.kind == "score" else 0) if work.lora_rank > 0 else root
    return half(root * c, layout.dp), gather, layers, half(root_trained * r, layout.dp), reduce


def forward_step_time(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> StepTime:
    """Seconds per step of a forward-only role (reference log-probs, reward scores)."""
    n = role_flop_parameters(model, work.kind)
    e = activation_dtype_bytes(model, work.parallel)
    mb, rows, seq = micro_batch_shape(work, layout, work.batch)
    flops = forward_flops_per_token(n, model, seq) * work.batch * seq
    c, t, b = _pass_time(
        flops, mb, layers_on_pp_stage(model.num_layers, layout.pp, 0), 2, layout, model, e, seq, cluster, rows, work.kind, False
    )
    pp = pipeline_p2p_seconds(model, layout, mb, seq, e, cluster, directions=1)
    return StepTime(compute_s=c, tp_comm_s=t, dp_comm_s=0.0, bubble_s=b, pp_comm_s=pp)


def decode_graphed(model: ModelConfig, work: RoleWork, layout: Layout) -> bool:
    """Whether the engine runs `layout`'s decode steps in CUDA graphs, as TorchEngine decides: asked for
    (``rollout.cuda_graphs``, work.cuda_graphs) and one pipeline stage; the continuous scheduler also needs a
    dense model (an MoE step records its routing) and one slot-pool micro-batch (``rollout.micro_batches`` 0 or
    1 at pp 1) (``uses_graphs`` of aligner.rollout.torch_engine.static_batching / continuous_batching). TensorRT-LLM
    (work.engine trtllm) captures its own graphs: counted as graphed."""
    if work.engine != "torch":
        return True
    if not work.cuda_graphs or layout.pp > 1:
        return False
    return work.scheduler == "static" or (not model.num_experts and work.micro_batches <= 1)


def decode_step_seconds(
    model: ModelConfig,
    layout: Layout,
    weight_bytes: float,
    kv_bytes: float,
    n: int,
    e: int,
    cluster: ClusterConfig,
    overhead_s_per_layer: float = DECODE_OVERHEAD_S_PER_LAYER,
) -> float:
    """Seconds of one decode step of `layout.micro_batch_size` rows on one engine replica.

    Each pipeline stage in turn reads its weights and its KV cache from HBM (`weight_bytes`,
    `kv_bytes`: one device's, bytes) or, when 2N * rows / (tp * pp) FLOPs take longer, is compute
    bound (peak x MODEL_FLOPS_EFFICIENCY); every decoder layer adds `overhead_s_per_layer` (the
    engine's fixed cost per layer per step: DECODE_OVERHEAD_S_PER_LAYER in a CUDA graph,
    DECODE_OVERHEAD_EAGER_S_PER_LAYER without) and, with tp > 1, 2 all-reduces of rows * H
    elements (COLLECTIVE_LATENCY_S each plus the ring volume over the intra-node bandwidth).
    n: the active parameters; e: element bytes of the engine's activations.
    """
    b = layout.micro_batch_size
    flops_s = 2.0 * n * b / (layout.tp * layout.pp * cluster.gpu_peak_tflops * 1e12 * MODEL_FLOPS_EFFICIENCY)
    pp_stage_s = max((weight_bytes + kv_bytes) / (cluster.hbm_gbps * GB), flops_s)
    comm = 0.0
    if layout.tp > 1:
        per = COLLECTIVE_LATENCY_S + ring_allreduce_seconds(b * model.hidden_size * e, layout.tp, cluster.intra_node_gbps)
        comm = 2 * model.num_layers * per
    return layout.pp * pp_stage_s + model.num_layers * overhead_s_per_layer + comm


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


def live_context_tokens(prompt: float, mean_len: float, tail_len: float) -> float:
    """Expected tokens a decoding row holds at a decode step, over a whole generation (tokens).

    A response of length L is decoded in L steps at positions 0 .. L - 1, so over all steps a row
    holds prompt + E[L^2] / (2 E[L]) tokens on average (less half a token): the length-biased mean
    position, whatever the scheduler (each response's steps count once). From the mean and the longest
    alone it lies in [mean / 2, tail / 2] (E[L^2] >= E[L]^2; L <= tail). The planner takes the middle of
    those bounds, (mean + tail) / 4, and at most the mean (E[L^2] = 2 E[L]^2: exponentially distributed
    lengths, a long tail far below the cap): mean / 2 when every response is as long as the longest.
    Measured (benchmarks/live_context.py, SmolLM2-135M-Instruct sampling GSM8K answers, 38% of them at
    the cap): the exact position lay 46% (cap 512) and 61% (cap 1,024) of the way from mean / 2 to
    tail / 2; the middle is within 7% of both (+1.7%, -6.4%), the upper bound 22-23% over them.
    """
    return prompt + min(mean_len, (mean_len + tail_len) / 4)


def paged_kv_bytes_per_step(
    model: ModelConfig, layout: Layout, e: int, requests: int, prompt: float, mean_len: float, tail_len: float, steps: float
) -> float:
    """KV-cache bytes one device of a paged engine reads in an average decode step (bytes).

    A paged KV cache (TensorRT-LLM's; vLLM's PagedAttention, Kwon et al. 2023) reads each row's own
    tokens, not a slot's capacity: over the generation of `requests` responses on one replica,
    requests * mean_len row-steps of :func:`live_context_tokens` tokens each, spread over its `steps`
    decode steps; per device its share of the layers and KV heads (:func:`kv_cache_bytes`).
    """
    per_token = kv_cache_bytes(model, e, layout.tp, layout.pp, 1, 1)
    return per_token * requests * mean_len * live_context_tokens(prompt, mean_len, tail_len) / max(steps, 1.0)


def generate_step_time(
    model: ModelConfig, work: RoleWork, layout: Layout, weight_bytes: float, cluster: ClusterConfig, e: Optional[int] = None
) -> StepTime:
    """Seconds per step of the rollout engine: compute-bound prefill, then the decode steps.

    Each replica (dp of them) generates ceil(batch / dp) responses on layout.micro_batch_size
    KV-cache rows (the engine's ``rollout.max_batch_size``: the static batch or the continuous
    pool), the rows the memory check sized the KV cache for. The steps follow work.scheduler and
    the expected response lengths (:func:`decode_steps`; work.mean_response_len /
    work.tail_response_len, 0 = work.new_tokens); each step costs :func:`decode_step_seconds` with
    the KV cache read as the engine reads it (work.engine): torch, the whole cache: aligner's graphed
    decode step attends over the cache's full length (prompt + new_tokens) under a mask; trtllm, the
    tokens the rows hold (:func:`paged_kv_bytes_per_step`). e: the engine's element bytes
    (``rollout.dtype``; None: work.dtype, else :func:`activation_dtype_bytes`).
    """
    n = role_flop_parameters(model, work.kind)
    if e is None:
        e = DTYPE_BYTES[work.dtype] if work.dtype else activation_dtype_bytes(model, work.parallel)
    prompt = work.seq_len
    prefill = compute_seconds(forward_flops_per_token(n, model, prompt) * work.batch * prompt, layout.devices, cluster)
    b = layout.micro_batch_size
    mean = work.mean_response_len or work.new_tokens
    tail = work.tail_response_len or work.new_tokens
    requests = math.ceil(work.batch / layout.dp)
    steps = decode_steps(work.scheduler, requests, b, mean, tail)
    if work.engine == "trtllm":
        kv = paged_kv_bytes_per_step(model, layout, e, requests, prompt, mean, tail, steps)
    else:
        kv = kv_cache_bytes(model, e, layout.tp, layout.pp, b, prompt + work.new_tokens)
    overhead = DECODE_OVERHEAD_S_PER_LAYER if decode_graphed(model, work, layout) else DECODE_OVERHEAD_EAGER_S_PER_LAYER
    decode = steps * decode_step_seconds(model, layout, weight_bytes, kv, n, e, cluster, overhead)
    return StepTime(compute_s=prefill, tp_comm_s=0.0, dp_comm_s=0.0, bubble_s=0.0, decode_s=decode)


# --------------------------------------------------------------------------- one layout
