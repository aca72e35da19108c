"""The planner's layout search: each role's workload, its candidate layouts ranked by step time,
the split of nodes between the actor's and the critic's groups, and the smallest cluster that fits.

Owns: :func:`role_works` (what each role does per step of a stage, from the config),
:func:`candidate_layouts` / :func:`plan_role` (enumeration and ranking, costed by
:mod:`aligner.planner.evaluate`), :func:`make_plan` and :func:`smallest_cluster`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from aligner.config import AlignerConfig, ClusterConfig, ModelConfig
from aligner.config.parallel import cp_runs_with_ep
from aligner.errors import ConfigError, PlanError
from aligner.planner.cost_model import Layout, LayoutEstimate, Rejected, RoleWork, micro_batch_shape
from aligner.planner.evaluate import evaluate_layout
from aligner.planner.time_model import devices_per_node
from aligner.tracking import read_metrics

MAX_NODES = 4096  # smallest_cluster gives up beyond this many nodes
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass
class RolePlan:
    """Ranked feasible layouts (fastest first) and the best rejected ones for one role."""

    role: str
    work: RoleWork
    devices: int
    ranked: list[LayoutEstimate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    idle: int = 0  # devices of the role's group it leaves idle (whole nodes: no layout fits them all)

    @property
    def best(self) -> Optional[LayoutEstimate]:
        return self.ranked[0] if self.ranked else None


ROLLOUT = "rollout"  # the rollout engines' node group of rollout.placement=split (a RoleWork group)


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
    max_staleness: int = 0  # trainer.max_staleness (the split rollout group overlaps the update when > 0)


# --------------------------------------------------------------------------- roles and search


def _lora_fields(role_cfg) -> dict:
    """RoleWork's lora_rank / lora_targets from a trained role's ``lora`` config."""
    return {"lora_rank": role_cfg.lora.rank, "lora_targets": tuple(role_cfg.lora.target_modules)}


def expected_response_lengths(cfg: AlignerConfig, new_tokens: int) -> tuple[float, float]:
    """(mean, longest) response tokens the rollout's decode time assumes, each at most `new_tokens`.

    The mean: ``rollout.expected_response_len``, or the mean of the ``response_len`` metric over
    the rows of ``rollout.expected_response_len_from`` (a previous PPO run's metrics.jsonl: one
    mean per step), else new_tokens. The longest (of a batch): ``rollout.expected_response_len_max``,
    or the mean over that file's rows of ``response_len_max`` (each step's longest response; runs
    before the metric existed have none), else new_tokens. Raises ConfigError naming the field when
    the file has no response_len.
    """
    r = cfg.rollout
    mean, tail = r.expected_response_len, r.expected_response_len_max
    if r.expected_response_len_from:
        try:
            rows = list(read_metrics(r.expected_response_len_from))
        except ValueError as err:
            raise ConfigError(f"rollout.expected_response_len_from={r.expected_response_len_from!r}: {err}") from None
        values = [row["response_len"] for row in rows if "response_len" in row]
        if not values:
            raise ConfigError(
                f"rollout.expected_response_len_from={r.expected_response_len_from!r} is invalid: no row has a response_len "
                "metric: give a PPO run's metrics.jsonl, or set rollout.expected_response_len instead"
            )
        mean = sum(values) / len(values)
        longest = [row["response_len_max"] for row in rows if "response_len_max" in row]
        if longest and not tail:
            tail = max(sum(longest) / len(longest), mean)
    return min(mean or new_tokens, new_tokens), min(tail or new_tokens, new_tokens)


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
                micro_batch_tokens=t.micro_batch_tokens,
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
                micro_batch_tokens=t.micro_batch_tokens,
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
                micro_batch_tokens=t.micro_batch_tokens,
                optim_state_dtype=cfg.reward.optim.state_dtype,
                **_lora_fields(cfg.reward),
            )
        ]
    samples = t.rollout_batch_size * t.n_samples_per_prompt
    opt_steps = samples // t.mini_batch_size * cfg.algorithm.ppo_epochs
    new_tokens = min(cfg.rollout.sampling.max_new_tokens, d.max_seq_len - d.max_prompt_len)
    mean_len, tail_len = expected_response_lengths(cfg, new_tokens)

    def group(name: str, default: str) -> str:
        c = cfg.role(name).colocate_with
        return "actor" if c in ("actor", "rollout") else ("critic" if c in ("critic", "reward") else default)

    # the rows the training and forward passes run: padded to the batch's width (prompt + the longest
    # response) in row-count micro-batches, about their own length under a token budget
    rows = dict(row_len=d.max_prompt_len + (mean_len if t.micro_batch_tokens else tail_len), micro_batch_tokens=t.micro_batch_tokens)
    train = dict(
        mode="train",
        batch=t.mini_batch_size,
        batch_field="trainer.mini_batch_size",
        seq_len=d.max_seq_len,
        opt_steps=opt_steps,
        forward_seqs=samples,
        **rows,
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
            group=ROLLOUT if cfg.rollout.placement == "split" else "actor",
            dtype=cfg.rollout.dtype,
            # TensorRT-LLM batches in flight whatever rollout.scheduler says (aligner.rollout.trtllm_engine)
            scheduler=cfg.rollout.scheduler if cfg.rollout.backend == "torch" else "continuous",
            mean_response_len=mean_len,
            tail_response_len=tail_len,
            engine=cfg.rollout.backend,
            cuda_graphs=cfg.rollout.cuda_graphs,
            micro_batches=cfg.rollout.micro_batches,
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
                **rows,
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
                **rows,
            )
        )
    return works


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(work: RoleWork, dp: int, minimal: bool) -> list[int]:
    if work.micro_batch_tokens > 0 and work.mode != "generate":  # a token budget: its rows at seq_len, for memory
        return [math.ceil(work.micro_batch_tokens / work.seq_len)]
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


def _cp_sizes(model: ModelConfig, work: RoleWork, devices: int) -> list[int]:
    """Context-parallel sizes to try for a role on `devices` devices: 1, and for a training role on
    fsdp2 / ddp the powers of two up to 16 that divide the devices and leave each rank at least 4096
    tokens of the sequence: cp is for long sequences (NeMo's published layouts use it from 8k tokens:
    CP2 for Llama 3 70B at 8k), where shorter shares would trade dp's gradient sharding for K/V traffic
    the cost model counts without overlap. An MoE role only where the runtime runs cp with it
    (``ParallelConfig.validate``: the top-k softmax router, no capacity factor; ep = 1, or ep = dp at
    tp = pp = 1, which :func:`candidate_layouts` keeps)."""
    if work.mode != "train" or work.parallel.dp_backend == "deepspeed":
        return [1]
    if model.num_experts and (model.moe_router != "topk_softmax" or model.moe_capacity_factor is not None):
        return [1]
    return [c for c in (1, 2, 4, 8, 16) if devices % c == 0 and (c == 1 or work.seq_len // c >= 4096)]


def _vpp_sizes(model: ModelConfig, work: RoleWork, pp: int, dp: int, mbs: int) -> list[int]:
    """Model chunks per pipeline rank to try: 1, and for a training role with pp > 1 on ddp or fsdp2 (or one
    dp rank: DeepSpeed wraps the whole pipeline stage) 2 and 4 where pp x v divides the layers and the micro-batches
    per step are a multiple of pp (the rules of ``ParallelConfig.validate_virtual_pp`` and
    ``aligner.config.validation.validate_interleaved``)."""
    if work.mode != "train" or pp == 1 or (work.parallel.dp_backend == "deepspeed" and dp > 1):
        return [1]
    m = work.batch // max(1, dp * mbs)
    return [1] + [v for v in (2, 4) if model.num_layers % (pp * v) == 0 and m % pp == 0]


def _try_interleaving(model: ModelConfig, work: RoleWork, cluster: ClusterConfig, plan: RolePlan) -> None:
    """When the best layout is a pipeline, add its interleaved variants (:func:`_vpp_sizes`) that fit,
    ranked with the rest. Interleaving refines a pipeline layout rather than being a reason to choose
    one: the cost model counts only the messages it adds, not plain 1F1B's, so it is not offered to
    layouts without pipeline stages."""
    best = plan.ranked[0].layout
    if best.pp == 1:
        return
    for v in _vpp_sizes(model, work, best.pp, best.dp, best.micro_batch_size)[1:]:
        r = evaluate_layout(model, work, replace(best, vpp=v), cluster)
        if isinstance(r, LayoutEstimate):
            plan.ranked.append(r)
    plan.ranked.sort(key=lambda x: (x.time.total_s, x.memory.total))


def _fsdp_step_applies(work: RoleWork, layout: Layout) -> bool:
    """Whether ``parallel.fsdp_reduce=step`` is a distinct choice for `layout`: a training role on FSDP2 with
    dp > 1, ep = 1 (the runtime refuses it with expert parallelism) and more than one micro-batch per step
    (with one, both modes communicate once)."""
    if work.mode != "train" or work.parallel.dp_backend != "fsdp2" or layout.dp == 1 or layout.ep > 1:
        return False
    return micro_batch_shape(work, layout, work.batch)[0] > 1


def candidate_layouts(model: ModelConfig, work: RoleWork, devices: int, minimal: bool = False) -> Iterable[Layout]:
    """Every tp x cp x pp x dp = devices with tp <= num_heads and pp <= num_layers (unequal pipeline stages
    allowed: the runtime's default split), each micro-batch
    size, recomputation and SP (training roles, tp > 1), for an MoE training role each ep dividing
    dp and num_experts (the rollout engine holds every expert per replica; with cp > 1 only ep = 1 or ep = dp at tp = pp = 1), and for a
    training role the context-parallel sizes of :func:`_cp_sizes`; each FSDP2 training layout with more than one
    micro-batch also with ``fsdp_reduce=step`` (:func:`_fsdp_step_applies`). minimal: only the least-memory choices.
    (Interleaving is tried afterwards, on the best pipeline layout: :func:`plan_role`.)"""
    modes = (("full",) if minimal else RECOMPUTE_MODES) if work.mode == "train" else ("none",)
    for tp in _divisors(devices):
        if tp > model.num_heads:
            continue
        for pp in _divisors(devices // tp):
            if pp > model.num_layers:
                continue  # uneven pipeline stages allowed (the runtime's default split: the first num_layers % pp take one more)
            if work.group == ROLLOUT and tp * pp > 1:
                continue  # the split placement's engines are whole replicas
            for cp in _cp_sizes(model, work, devices // (tp * pp)):
                dp = devices // (tp * pp * cp)
                eps = [d for d in _divisors(dp) if model.num_experts and model.num_experts % d == 0] if work.mode == "train" else []
                for ep in [d for d in eps if cp == 1 or cp_runs_with_ep(tp, pp, dp, d)] or [1]:
                    for mbs in _micro_batches(work, dp, minimal):
                        for rc in modes:
                            for sp in ((True,) if minimal else (False, True)) if tp > 1 and work.mode == "train" else (False,):
                                lay = Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, sp=sp, recompute=rc, ep=ep, cp=cp)
                                yield lay
                                if not minimal and _fsdp_step_applies(work, lay):
                                    yield replace(lay, fsdp_reduce="step")


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
    if plan.ranked and not minimal:
        _try_interleaving(model, work, cluster, plan)
    plan.rejected = sorted(
        closest.values(), key=lambda r: (r.estimate is None, r.estimate.time.total_s if r.estimate else 0.0, r.layout.tp, r.layout.pp)
    )
    return plan


def _group_time(roles: dict[str, RolePlan], group: str) -> float:
    return sum(p.best.time.total_s for p in roles.values() if p.work.group == group and p.work.mode != "generate")


def ppo_step_seconds(roles: dict[str, RolePlan], split: bool, max_staleness: int = 0) -> float:
    """Split placement: rollout, then the actor's and the critic's groups concurrently (the slower
    dominates). Colocated: every phase in turn. With the rollout engines on a node group of their
    own (rollout.placement=split) and trainer.max_staleness >= 1, generation overlaps the update:
    the step is the longer of the two (the weight sync not counted)."""
    rollout = sum(p.best.time.total_s for p in roles.values() if p.work.mode == "generate")
    if split:
        update = max(_group_time(roles, "actor"), _group_time(roles, "critic"))
    else:
        update = sum(p.best.time.total_s for p in roles.values() if p.work.mode != "generate")
    own_group = any(p.work.group == ROLLOUT for p in roles.values())
    return max(rollout, update) if own_group and max_staleness > 0 else rollout + update


def _plan_on(
    cfg: AlignerConfig, num_nodes: int, minimal: bool, cache: dict
) -> tuple[Optional[dict[str, RolePlan]], Optional[NodeSplit], str]:
    """Best role plans on `num_nodes` nodes (trying every node split), the split, or the reason none fits."""
    cluster = replace(cfg.cluster, num_nodes=num_nodes)
    g = devices_per_node(cluster)
    works = role_works(cfg)

    def role_plan(work: RoleWork, nodes: int) -> RolePlan:
        """The role's plan on its group's `nodes` nodes, or, when no layout uses every device, on the
        most nodes of them some layout fits (the rest idle: 48 GPUs are 3 x 16, a factor a 70B layout
        may not absorb where 32 of them fit)."""
        key = (work.role, nodes, minimal)
        if key not in cache:
            plan = plan_role(cfg.model, work, nodes * g, cluster, minimal)
            for fewer in range(nodes - 1, 0, -1) if plan.best is None and work.group != ROLLOUT else ():
                smaller = plan_role(cfg.model, work, fewer * g, cluster, minimal)
                if smaller.best is not None:
                    smaller.idle = (nodes - fewer) * g
                    plan = smaller
                    break
            cache[key] = plan
        return cache[key]

    groups = {w.group for w in works} - {ROLLOUT}
    rollout_nodes = cfg.rollout.resources.num_nodes if any(w.group == ROLLOUT for w in works) else 0
    left = num_nodes - rollout_nodes  # the rollout group's own nodes (rollout.placement=split) are not shared
    if left < 1:
        return None, None, f"rollout.resources.num_nodes={rollout_nodes} leaves none of {num_nodes} nodes to the other roles"
    split = cfg.cluster.placement == "split" and left >= 2 and len(groups) == 2
    options = [(a, left - a) for a in range(1, left)] if split else [(left, left)]
    best, best_split, tried, reason = None, None, [], ""
    for a, c in options:
        nodes = {ROLLOUT: rollout_nodes, "actor": a, "critic": c if split else a}
        roles = {w.role: role_plan(w, nodes[w.group]) for w in works}
        actor = roles.get("actor")
        for w in works:  # a colocated engine lives in the actor's processes: it has the actor's devices, idle ones too
            if w.mode == "generate" and w.group == "actor" and actor is not None and actor.idle and actor.best is not None:
                roles[w.role] = plan_role(cfg.model, w, actor.devices, cluster, minimal)
                roles[w.role].idle = actor.idle
        missing = [p for p in roles.values() if p.best is None]
        if missing:
            p = missing[0]
            why = p.rejected[0].reason if p.rejected else "no candidate layout"
            reason = f"{p.role} on {p.devices} devices: {why}"
            tried.append((a, reason))
            continue
        t = (
            ppo_step_seconds(roles, split, cfg.trainer.max_staleness)
            if cfg.stage in ("ppo", "plan")
            else sum(p.best.time.total_s for p in roles.values())
        )
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
        f"no cluster of up to {MAX_NODES} nodes x {cfg.cluster.gpus_per_node} GPUs x {cfg.cluster.gpu_mem_gb:g} GiB fits this model"
    )


def cluster_text(nodes: int, gpus: int, mem: float) -> str:
    """ "N nodes x G GPUs x M GiB" (cluster.gpu_mem_gb is GiB)."""
    return f"{nodes} node{'s' if nodes != 1 else ''} x {gpus} GPUs x {mem:g} GiB"


def make_plan(cfg: AlignerConfig) -> Plan:
    """The ranked layouts per role for cfg.cluster, the node split and the estimated step time.

    Raises PlanError naming the role that does not fit, why, and the smallest cluster that would."""
    cache: dict = {}
    roles, node_split, reason = _plan_on(cfg, cfg.cluster.num_nodes, False, cache)
    c = cfg.cluster
    if roles is None:
        try:
            n, g = smallest_cluster(cfg)
            fix = f"the smallest cluster that fits is {cluster_text(n, g, c.gpu_mem_gb)} (cluster.num_nodes={n})"
        except PlanError as err:
            fix = str(err)
        raise PlanError(f"no layout fits on {cluster_text(c.num_nodes, c.gpus_per_node, c.gpu_mem_gb)}: {reason}; {fix}")
    split = node_split is not None
    if cfg.stage in ("ppo", "plan"):
        step = ppo_step_seconds(roles, split, cfg.trainer.max_staleness)
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
        max_staleness=cfg.trainer.max_staleness,
    )
