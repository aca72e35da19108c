"""One layout of one role evaluated: its structural problems, memory and step time (the planner's unit of search).

:func:`evaluate_layout` gives a :class:`~aligner.planner.cost_model.LayoutEstimate` (memory from
:mod:`aligner.planner.cost_model`, time from :mod:`aligner.planner.time_model`) or a
:class:`~aligner.planner.cost_model.Rejected` with the reason.
"""

from __future__ import annotations

from typing import Optional

from aligner.config import ClusterConfig, ModelConfig
from aligner.planner.cost_model import (
    DTYPE_BYTES,
    GIB,
    GPU_RESERVED_BYTES,
    Layout,
    LayoutEstimate,
    MemoryBreakdown,
    Rejected,
    RoleWork,
    activation_dtype_bytes,
    decode_weight_bytes,
    expert_layer_parameters,
    frozen_weight_bytes,
    inference_activation_bytes,
    kv_cache_bytes,
    layer_num_parameters,
    layers_on_pp_stage,
    lora_num_parameters,
    pp_stage_expert_parameters,
    pp_stage_num_parameters,
    pp_stage_num_tensors,
    train_activation_bytes,
    train_state_bytes,
    training_precision,
)
from aligner.planner.time_model import forward_step_time, generate_step_time, train_step_time


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
        # a token budget: the runner pads each training pass with filler micro-batches to a multiple of pp
        padded = work.micro_batch_tokens > 0 or m % layout.pp == 0
        if work.mode != "train" or layout.pp == 1 or model.num_layers % (layout.pp * layout.vpp) or not padded:
            return f"vpp={layout.vpp} needs a training role, pp > 1, layers divisible by pp x vpp and micro-batches by pp"
        if work.parallel.dp_backend == "deepspeed" and layout.dp > 1:
            return "the interleaved schedule runs with dp_backend fsdp2 or ddp, or dp=1"
    if layout.fsdp_reduce == "step" and (work.mode != "train" or work.parallel.dp_backend != "fsdp2" or layout.ep > 1):
        return "fsdp_reduce=step needs a training role with dp_backend fsdp2 and ep=1"
    if layout.cp > 1:
        if work.mode != "train":
            return "context parallelism is for training roles"
        if model.num_experts or work.parallel.dp_backend == "deepspeed":
            return "context parallelism runs with dense models and dp_backend fsdp2 or ddp"
    if work.micro_batch_tokens > 0 and work.mode != "generate" and work.parallel.dp_backend == "deepspeed":
        return "token-budget micro-batches (trainer.micro_batch_tokens) need dp_backend fsdp2 or ddp"
    if work.mode == "train":
        if work.batch % layout.dp:
            return f"{work.batch_field}={work.batch} not divisible by dp={layout.dp}"
        if not work.micro_batch_tokens and (work.batch // layout.dp) % layout.micro_batch_size:
            return f"{work.batch_field}/dp={work.batch // layout.dp} not divisible by micro_batch_size={layout.micro_batch_size}"
    return None


def estimate_layout(model: ModelConfig, work: RoleWork, layout: Layout, cluster: ClusterConfig) -> LayoutEstimate:
    """Memory (worst pipeline stage, bytes) and step time (seconds) of one structurally valid layout.

    The rollout engine (mode generate) holds weights, KV cache and activations in work.dtype
    (``rollout.dtype``); the other roles' element size is :func:`activation_dtype_bytes`."""
    e = DTYPE_BYTES[work.dtype] if work.mode == "generate" and work.dtype else activation_dtype_bytes(model, work.parallel)
    reserved = GPU_RESERVED_BYTES if cluster.gpus_per_node > 0 else 0.0
    experts_layer = expert_layer_parameters(model)
    layer_local = (layer_num_parameters(model) - 2 * model.hidden_size - experts_layer) // layout.tp + 2 * model.hidden_size
    layer_local += experts_layer // (layout.tp * layout.ep)
    best: Optional[MemoryBreakdown] = None
    grad_bytes = 0.0
    step = layout.fsdp_reduce == "step"  # FSDP2 holds every layer unsharded through the step (fsdp_step_buffer_bytes)
    for pp_stage in sorted({0, layout.pp - 1}):
        params = pp_stage_num_parameters(model, work.kind, layout.tp, layout.pp, pp_stage, layout.ep)
        last = pp_stage == layout.pp - 1
        if work.mode == "train":
            trained = params
            if work.lora_rank > 0:  # frozen base: weights only; the adapters (and a scalar head) train
                layers = layers_on_pp_stage(model.num_layers, layout.pp, pp_stage)
                n_ad, t_ad = lora_num_parameters(model, work.lora_rank, work.lora_targets, layout.tp, layers)
                head = model.hidden_size if (work.kind == "score" and last) else 0
                trained = n_ad + head
                w, _, _ = train_state_bytes(params + n_ad, 0, layer_local, work.parallel, model, layout.dp, work.optim_state_dtype, step)
                _, g, o = train_state_bytes(
                    trained, t_ad + (1 if head else 0), 0, work.parallel, model, layout.dp, work.optim_state_dtype, step
                )
            else:
                tensors = pp_stage_num_tensors(model, work.kind, layout.pp, pp_stage)
                # experts (E / ep per rank) are sharded over the expert-data-parallel ranks, dp / ep
                experts = pp_stage_expert_parameters(model, layout.tp, layout.pp, pp_stage, layout.ep) if layout.ep > 1 else 0
                w, g, o = train_state_bytes(
                    params - experts, tensors, layer_local, work.parallel, model, layout.dp, work.optim_state_dtype, step
                )
                if experts:
                    w2, g2, o2 = train_state_bytes(experts, 0, 0, work.parallel, model, layout.dp // layout.ep, work.optim_state_dtype)
                    w, g, o = w + w2, g + g2, o + o2
            w += work.frozen_copies * frozen_weight_bytes(params, work.parallel, model, layout.dp)
            m = max(1, work.batch // (layout.dp * layout.micro_batch_size))
            precision = training_precision(model, work.parallel, layout.dp)
            act = train_activation_bytes(model, work.kind, layout, e, work.seq_len, m, pp_stage, precision, work.lora_rank > 0)
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
        time = generate_step_time(model, work, layout, decode_weight_bytes(model, work.kind, layout, e), cluster, e)
    return LayoutEstimate(layout=layout, memory=best, time=time)


def memory_problem(est: LayoutEstimate, cluster: ClusterConfig) -> Optional[str]:
    """ "needs X GiB/GPU > Y GiB" when the worst pipeline stage does not fit in cluster.gpu_mem_gb GiB, else None."""
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
