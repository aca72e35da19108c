"""The planner's text output: per-role tables of layouts (GiB per device, seconds per step), the node
split, the overrides that apply the best layouts, and the check of the configured layouts.

Owns: :func:`format_plan` / :func:`print_plan` (``python -m aligner.plan`` and ``plan_only=true``)
and :func:`check_fits` (run before weights are loaded; its error carries the planner's suggestion).
"""

from __future__ import annotations

import math
import sys
from typing import Optional

from aligner.config import AlignerConfig, ModelConfig
from aligner.errors import PlanError
from aligner.planner.cost_model import GIB, Layout, LayoutEstimate, Rejected, RoleWork, train_bytes_per_parameter
from aligner.planner.evaluate import evaluate_layout
from aligner.planner.search import Plan, RolePlan, cluster_text, make_plan, role_works
from aligner.planner.time_model import MFU_HALF_DIM, MFU_MAX, MODEL_FLOPS_EFFICIENCY, decode_graphed, devices_per_node

SHOW_RANKED = 5  # layouts per role in format_plan
SHOW_REJECTED = 5  # rejected layouts per role in format_plan


# --------------------------------------------------------------------------- output


def _gib(x: float) -> str:
    return f"{x / GIB:7.1f}"


def _layout_row(est: LayoutEstimate) -> str:
    m, t = est.memory, est.time
    return (
        f"  {est.layout.describe():<50} {_gib(m.weights)} {_gib(m.grads)} {_gib(m.optimizer)} {_gib(m.activations)} "
        f"{_gib(m.kv_cache)} {_gib(m.total)}  {t.total_s:9.2f} (compute {t.compute_s:.2f}, tp {t.tp_comm_s:.2f}, "
        f"dp {t.dp_comm_s:.2f}, bubble {t.bubble_s:.2f}, decode {t.decode_s:.2f}"
        + (f", all-to-all {t.a2a_s:.2f}" if t.a2a_s else "")
        + (f", cp {t.cp_comm_s:.2f}" if t.cp_comm_s else "")
        + (f", pp {t.pp_comm_s:.2f})" if t.pp_comm_s else ")")
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
    """A readable table of one role's ranked layouts (GiB, seconds) and best rejected layouts; with
    `model`, a trained role's line of training-state bytes per parameter (:func:`train_state_line`)."""
    what = {"train": "training", "forward": "inference", "generate": "rollout engine"}[plan.work.mode]
    if plan.work.mode == "generate":  # how its decode time reads the KV cache (aligner.planner.time_model)
        w = plan.work
        read = "each row's own tokens (paged)" if w.engine == "trtllm" else "every row to its full length"
        what += f": {w.engine}, {w.scheduler} scheduler, a decode step reads {read}"
        if model is not None and w.engine == "torch":  # its fixed cost per step (time_model.decode_graphed)
            graphed = decode_graphed(model, w, Layout(tp=1, pp=1, dp=1, micro_batch_size=1))
            what += ", in a CUDA graph at pp = 1, eagerly with pipeline stages" if graphed else ", eagerly (no CUDA graph)"
    idle = f", {plan.idle} more of its group idle: no layout fits them all" if plan.idle else ""
    lines = [f"{plan.role} ({what}, {plan.devices} devices{idle}):"]
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
        cp = f" {name}.parallel.cp_size={lay.cp}" if lay.cp > 1 else ""
        out.append(f"{name}.parallel.tp_size={lay.tp}{cp} {name}.parallel.pp_size={lay.pp} {name}.parallel.dp_size={lay.dp}")
        if lay.ep > 1:
            out[-1] += f" {name}.parallel.ep_size={lay.ep}"
        if lay.vpp > 1:
            out[-1] += f" {name}.parallel.virtual_pp_size={lay.vpp}"
        if lay.fsdp_reduce == "step":
            out[-1] += f" {name}.parallel.fsdp_reduce=step"
        if rp.idle and name != "rollout":  # the role's group has more nodes than its layout uses
            out[-1] += f" {name}.resources.num_nodes={rp.devices // devices_per_node(plan.cluster)}"
        if rp.work.mode == "train":
            out.append(f"{name}.parallel.sequence_parallel={str(lay.sp).lower()} {name}.parallel.recompute={lay.recompute}")
    return out


def efficiency_text() -> str:
    """The fraction of peak FLOP/s the time estimates assume, as the cost model applies it."""
    if MFU_HALF_DIM > 0:
        train = f"{MFU_MAX:g} x d / (d + {MFU_HALF_DIM:g}), d = min(hidden / tp, tokens per micro-batch / cp)"
    else:
        train = f"{MFU_MAX:g}"
    return (
        f"training and forward passes {train} of peak (fitted to Narayanan et al. 2021, Table 1); "
        f"rollout prefill {MODEL_FLOPS_EFFICIENCY:g}, decode by HBM bandwidth; DDP's all-reduce overlapped with the last "
        "micro-batch's backward at pp = 1; FSDP2's gathers and reduce-scatters per micro-batch, beside each pass's compute, "
        "or once per step with fsdp_reduce=step"
    )


def format_plan(plan: Plan) -> str:
    """The whole plan as text: cluster, node split, per-role tables (memory in GiB, time in s)."""
    c = plan.cluster
    lines = [
        f"plan for stage {plan.stage} on {cluster_text(c.num_nodes, c.gpus_per_node, c.gpu_mem_gb)} "
        f"({plan.placement} placement; peak {c.gpu_peak_tflops:g} TFLOP/s)",
        f"efficiency: {efficiency_text()}",
    ]
    if plan.node_split:
        ns = plan.node_split
        lines.append(f"node split: actor group (actor, rollout) {ns.actor_nodes} of {c.num_nodes} nodes, critic group {ns.critic_nodes}")
        tried = ", ".join(f"{a}:{t:.1f}s" if isinstance(t, float) else f"{a}:no fit" for a, t in ns.tried)
        lines.append(f"  splits tried (actor nodes: step time): {tried}")
    rollout = plan.roles.get("rollout")
    if rollout is not None and rollout.work.group == "rollout":
        lines.append(
            f"rollout group (rollout.placement=split): {rollout.devices} devices of its own, whole engine replicas; "
            f"trainer.max_staleness={plan.max_staleness} ({'generation overlaps the update' if plan.max_staleness else 'synchronous'})"
        )
    lines.append(f"estimated step time: {plan.step_time_s:.2f} s (memory in GiB per device, times in seconds per step)")
    for rp in plan.roles.values():
        lines.append("")
        lines.append(format_role(rp, plan.model))
    lines.append("")
    lines.append("overrides for the best layouts:")
    lines.extend(f"  {o}" for o in recommended_overrides(plan))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the configured layout


def configured_layout(cfg: AlignerConfig, work: RoleWork) -> Layout:
    """The layout cfg asks for (role.parallel sizes; trainer.micro_batch_size for training roles, or
    under a token budget the rows at seq_len it holds, rounded up: what the memory assumes)."""
    pc = work.parallel
    if work.micro_batch_tokens > 0 and work.mode != "generate":
        mbs = math.ceil(work.micro_batch_tokens / work.seq_len)
    elif work.mode == "train":
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
        cp=getattr(pc, "cp_size", 1) if work.mode == "train" else 1,
        vpp=getattr(pc, "virtual_pp_size", 1) if work.mode == "train" else 1,
        fsdp_reduce=getattr(pc, "fsdp_reduce", "micro_batch") if work.mode == "train" else "micro_batch",
    )


def check_fits(cfg: AlignerConfig) -> dict[str, LayoutEstimate]:
    """Check the configured layout of every role against cfg.cluster before any weights are loaded.

    Returns each role's estimate. Raises PlanError listing each role that does not fit (why, in
    GiB or devices), what the planner would choose instead, or the smallest cluster that fits."""
    c = cfg.cluster
    total = c.num_nodes * devices_per_node(c)
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
