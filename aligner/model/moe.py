"""Sparse Mixture-of-Experts feed-forward for the Llama family (Mixtral's layer), tensor parallel.

Owns: the routers (:func:`route`: top-k softmax as Mixtral, Fedus et al. 2021 / Jiang et al. 2024;
Sinkhorn top-k as NeMo / Megatron-LM's S-BASE, Clark et al. 2022), the auxiliary losses
(:func:`switch_load_balancing_loss`, :func:`router_z_loss`), the expert weights
(:class:`GroupedExperts`), the block (:class:`SparseMoE`, HF ``MixtralSparseMoeBlock``) and
:func:`moe_metrics`.

Parameter names: ``mlp.gate.weight`` [E, H] (the router), ``mlp.experts.gate_proj`` [E, I, H],
``mlp.experts.up_proj`` [E, I, H], ``mlp.experts.down_proj`` [E, H, I]. HF Mixtral checkpoints
store ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.{e}.w1|w3|w2.weight``
(gate, up, down); :mod:`aligner.model.hf` renames.

Tensor parallelism: the router is replicated; each expert MLP is tensor parallel like the dense
MLP (gate/up split along I, down along its input I), so every rank holds every expert's 1/tp
slice and the experts' partial outputs are summed over tp once per layer (all-reduce, or
reduce-scatter with sequence parallelism). Routing runs on the full tokens on every rank (with
sequence parallelism the tokens are all-gathered first), so the routing, the auxiliary losses and
therefore every gradient equal the single-process ones.

Expert parallelism (``ep_size`` > 1): :meth:`GroupedExperts.shard_ep_` keeps this rank's
num_experts / ep_size consecutive experts; :meth:`SparseMoE._run_experts` sends each routed row to
the ep rank that holds its expert and the outputs back, by all-to-all over the ep group
(:mod:`aligner.parallel.dims` builds the groups; the expert gradients are reduced over the
expert-data-parallel group, :func:`aligner.parallel.data_parallel.reduce_expert_grads`). The
rollout engine holds every expert (no expert parallelism inside the engine).

Dispatch is dropless by default: every token reaches its top-k experts (a loop over the experts
that received tokens, HF's scheme). With a capacity factor c each expert takes at most
ceil(c * N * k / E) of the N * k assignments, in token order; the rest are dropped (their
contribution is zero, the residual carries the token) and counted. Capacity applies in training
only: in eval (the engine, reference log-probs) routing is dropless, so a token's output never
depends on the batch it is decoded with.

Auxiliary losses reach the gradient without being returned: :class:`_AuxLoss` is the identity on
the block's output and adds d(coef * aux)/d(router) in backward (Megatron-LM's
MoEAuxLossAutoScaler), so the pipeline schedule and every loss function stay unchanged. Each is
computed per micro-batch on that micro-batch's tokens (as Megatron-LM does) and weighted by
1 / num_micro_batches (:func:`set_aux_loss_scale`, called by the training step): a step adds coef
times their mean over its micro-batches (and over data-parallel ranks, whose gradients are
averaged). Splitting a batch into micro-batches therefore changes the auxiliary term (a mean of
per-micro-batch losses is not the loss of the whole batch); the language-model loss is unchanged.
The per-micro-batch values are kept on the module for metrics (:func:`moe_metrics`). Under context
parallelism (``cp_group``, one sequence split over cp ranks) the micro-batch's tokens are spread
over the cp ranks: :func:`cp_router_losses` all-reduces the router's sums over cp before forming
the losses and statistics, so they equal the whole micro-batch's on one rank.

Engine / trainer routing: each forward keeps its expert choices (``SparseMoE.last_experts``); the
rollout engine reports them per response token (``Generation.routed_experts``), the trainer records
them in its old-log-probs forward (:func:`record_routing`), and :func:`aligner.algorithms.routing_mismatch`
counts the (token, layer) pairs whose top-k sets differ (PPO's ``moe_routing_mismatch``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from aligner.nn import comm
from aligner.nn.layers import ParallelLayer, autocast_weight

ROUTERS = ("topk_softmax", "sinkhorn")


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4, max_iters: int = 1000) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of exp(cost) (Megatron-LM's ``sinkhorn``; S-BASE, Clark et al. 2022).

    cost: [N, E] fp32 router logits. Returns [N, E] = d1 * exp(cost) * d0[:, None], whose rows and
    columns are (within `tol`, mean absolute change of d1) balanced to sum 1/N and 1/E: taking the
    top-k of it assigns tokens to experts almost evenly. No gradient flows through it.
    """
    cost = torch.exp(cost)
    d0 = torch.ones(cost.shape[0], dtype=cost.dtype, device=cost.device)
    d1 = torch.ones(cost.shape[1], dtype=cost.dtype, device=cost.device)
    eps = 1e-8
    d1_old = d1
    for _ in range(max_iters):
        d0 = (1.0 / d0.shape[0]) / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1.0 / d1.shape[0]) / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        if torch.mean(torch.abs(d1_old - d1)) <= tol:
            break
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def route(
    logits: torch.Tensor, top_k: int, router: str, training: bool, norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose each token's experts and their combine weights.

    logits: [N, E] router logits (any float dtype). Returns (weights [N, k] fp32, experts [N, k]
    int64, probs [N, E] fp32).

    - ``topk_softmax`` (Mixtral; HF ``MixtralTopKRouter``): probs = softmax(logits) in fp32, the k
      largest, renormalized to sum 1 when `norm_topk_prob` (Mixtral always does). probs feed the
      load-balancing loss.
    - ``sinkhorn`` (NeMo / Megatron-LM S-BASE): in training the experts are the top-k of
      :func:`sinkhorn` (logits) (balanced, no gradient) and the weights are sigmoid (k = 1) or
      softmax (k > 1) of the logits at those experts; in eval plain top-k of that activation. So a
      sinkhorn model routes differently in training and in generation (and depends on the other
      tokens of the micro-batch in training). probs is the activation.
    """
    if router == "topk_softmax":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs
    if router == "sinkhorn":
        act = torch.sigmoid(logits.float()) if top_k == 1 else torch.softmax(logits.float(), dim=-1)
        if training:
            with torch.no_grad():
                experts = torch.topk(sinkhorn(logits.detach().float()), top_k, dim=-1).indices
            weights = act.gather(1, experts)
        else:
            weights, experts = torch.topk(act, top_k, dim=-1)
        return weights, experts, act
    raise ValueError(f"router={router!r}: valid choices are {', '.join(ROUTERS)}")


def switch_load_balancing_loss(
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    counts: Optional[torch.Tensor] = None,
    token_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4-6), for top-k routing.

    probs: [N, E] fp32 router probabilities; experts: [N, k] int64 chosen experts. Returns the
    scalar E * sum_i f_i * P_i with f_i the fraction of the N * k assignments that went to expert i
    and P_i the mean router probability of expert i; 1.0 when perfectly balanced. (HF's
    ``load_balancing_loss_func`` counts f_i over N, not N * k, and pools the layers: on one layer
    it equals k times this.) token_mask: [N] bool, the tokens counted (padding excluded, as HF's
    ``attention_mask``; `counts` is then ignored); 0 (with a gradient path) when none is.
    """
    if token_mask is not None:
        probs, experts, counts = probs[token_mask], experts[token_mask], None
        if experts.shape[0] == 0:
            return probs.sum() * 0.0
    n, k = experts.shape
    if counts is None:  # counts [E]: assignments per expert, when the caller has them already
        counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    f = counts.to(probs.dtype) / (n * k)
    p = probs.mean(dim=0)
    return num_experts * torch.sum(f * p)


def router_z_loss(logits: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2.

    logits: [N, E]; token_mask: [N] bool, the tokens counted (0 when none is). Returns a scalar fp32.
    """
    if token_mask is not None:
        logits = logits[token_mask]
        if logits.shape[0] == 0:
            return logits.float().sum() * 0.0
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def cp_router_losses(
    logits: torch.Tensor,
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    token_mask: Optional[torch.Tensor],
    group,
    load_balancing: bool = True,
    z_loss: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's auxiliary losses over the tokens of every rank of `group` (context parallelism:
    one sequence split over the cp ranks), equal to :func:`switch_load_balancing_loss` and
    :func:`router_z_loss` of the whole sequence on one rank.

    logits: [N, E] router logits of this rank's N tokens (any float dtype); probs: [N, E] fp32;
    experts: [N, k] int64; token_mask: [N] bool (the tokens counted; None = all of this rank's).
    Each rank forms local sums (assignments per expert C_i and the token count n, no gradient;
    sum_t probs[t, i] and sum_t logsumexp(logits[t])^2, differentiable), all-reduces them over
    `group` (two all-reduces: one of E + 1 counts, one of E + 1 sums) and divides:

    - Switch load balancing (Fedus et al. 2021, eq. 4-6): E * sum_i f_i * P_i with
      f_i = C_i / (n k), P_i = sum_t probs[t, i] / n (0 when no token is counted on any rank);
    - router z-loss (Zoph et al. 2022, eq. 5): sum_t logsumexp(logits[t])^2 / n.

    Gradients: the sums are all-reduced by Megatron's g (forward all-reduce, identity backward).
    Every rank computes the same loss, so the gradient reaching rank r's probs (and logits) is the
    whole-sequence loss's partial derivative for rank r's tokens; the router gradients are then
    partial over cp and :func:`aligner.parallel.context_parallel.sync_cp_grads` sums them, which
    gives the one-rank gradient (a backward all-reduce would count it cp times).
    Returns (aux, z, counts): 0-dim fp32 losses equal on every rank (`aux` 0 when not
    `load_balancing`, `z` 0 when not `z_loss`) and the global counts [E] fp32 (no gradient).
    Collective over `group`: every rank must call it once per MoE layer forward.
    """
    n_local, k = experts.shape
    keep = token_mask.reshape(-1).bool() if token_mask is not None else torch.ones(n_local, dtype=torch.bool, device=experts.device)
    w = keep.to(torch.float32)
    tallies = torch.cat([torch.bincount(experts[keep].reshape(-1), minlength=num_experts).double(), w.sum().double().view(1)])
    comm.all_reduce_no_grad(tallies, group)
    counts, n = tallies[:num_experts].float(), tallies[num_experts].float().clamp_min(1.0)
    p_sum = (probs * w.unsqueeze(-1)).sum(0) if load_balancing else probs.new_zeros(num_experts)
    z_sum = (torch.logsumexp(logits.float(), dim=-1).pow(2) * w).sum().view(1) if z_loss else probs.new_zeros(1)
    sums = comm.reduce_from_tp(torch.cat([p_sum, z_sum]), group)
    aux = num_experts * torch.sum(counts / (n * k) * (sums[:num_experts] / n)) if load_balancing else probs.new_zeros(())
    z = sums[num_experts] / n if z_loss else probs.new_zeros(())
    return aux, z, counts


class _AuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, d(aux)/d(inputs of aux) with gradient `coef` (Megatron-LM's
    MoEAuxLossAutoScaler): the auxiliary loss trains the router without being part of the loss
    the caller returns."""

    @staticmethod
    def forward(ctx, out, aux, coef: float):
        ctx.coef = coef
        ctx.aux_shape = aux.shape
        return out

    @staticmethod
    def backward(ctx, g):
        return g, torch.full(ctx.aux_shape, ctx.coef, dtype=torch.float32, device=g.device), None


class Router(ParallelLayer):
    """The router ``gate``: logits = x W^T with W [E, H], replicated over tp (HF ``MixtralTopKRouter``)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, H] -> logits [N, E] in x's dtype."""
        return F.linear(x, self.weight)


class GroupedExperts(ParallelLayer):
    """E SwiGLU expert MLPs as three stacked weights, each expert tensor parallel like the dense MLP.

    gate_proj, up_proj: [E, I, H] split along I (dim 1) over tp; down_proj: [E, H, I] split along
    its input I (dim 2). Forward returns the rank's partial sums (the caller reduces over tp).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    ep_group: Optional[torch.distributed.ProcessGroup] = None
    expert_offset = 0  # global id of this rank's first expert

    @property
    def num_local_experts(self) -> int:
        return self.gate_proj.shape[0]

    def _dim(self, name: str) -> int:
        return 2 if name == "down_proj" else 1

    def shard_(self, tp_group, sequence_parallel: bool = False) -> None:
        super().shard_(tp_group, sequence_parallel)
        n = comm.group_size(tp_group)
        if self.intermediate_size % n:
            raise ValueError(f"GroupedExperts: intermediate_size={self.intermediate_size} not divisible by tp_size={n}")
        self._reshard(lambda name, full: full.chunk(n, dim=self._dim(name))[comm.group_rank(tp_group)] if n > 1 else full)

    def shard_ep_(self, ep_group) -> None:
        """Keep this rank's num_experts / ep_size consecutive experts (expert parallelism over `ep_group`)."""
        n = comm.group_size(ep_group)
        if self.num_experts % n:
            raise ValueError(f"GroupedExperts: num_experts={self.num_experts} not divisible by ep_size={n}")
        self.ep_group = ep_group
        per = self.num_experts // n
        self.expert_offset = comm.group_rank(ep_group) * per
        self._reshard(lambda name, full: full[self.expert_offset : self.expert_offset + per])

    def _reshard(self, take) -> None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            p = getattr(self, name)
            if p.device.type == "meta":
                local = take(name, torch.empty(p.shape, device="meta", dtype=p.dtype))
                local = torch.empty(local.shape, device="meta", dtype=p.dtype)
            else:
                local = take(name, p)
            setattr(self, name, nn.Parameter(local.detach().clone(), requires_grad=p.requires_grad))

    def full_to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Slice a full [E, ., .] expert tensor to this rank's experts (ep) and tp slice."""
        per = self.num_local_experts
        if per != self.num_experts:
            full = full[self.expert_offset : self.expert_offset + per]
        n, r = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        return full.chunk(n, dim=self._dim(name))[r] if n > 1 else full

    def local_to_full_spec(self, name: str):
        """(tp dim, None); the expert dim 0 is split over ``ep_group`` too (:func:`ep_sharded`)."""
        return self._dim(name), None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `e` (global id expert_offset + e) on its tokens x [n, H] -> partial output [n, H]
        (down(silu(gate x) * up x)); partial over tp. Frozen expert weights (a LoRA base) are read
        through :func:`aligner.nn.layers.autocast_weight`: under autocast inside a training step each
        stacked weight is cast once and every expert and micro-batch indexes (and saves) that cast."""
        gate, up, down = (autocast_weight(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        return F.linear(F.silu(F.linear(x, gate[e])) * F.linear(x, up[e]), down[e])

    def forward(self, rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """rows [M, H] in blocks: for each source s (in order), counts[s][j] rows for local expert j
        (one source without expert parallelism). Returns the local experts' partial outputs [M, H]
        in the same order. A module call (not :meth:`expert`), so FSDP2 unshards the weights around it."""
        per = self.num_local_experts
        starts, offset = [], 0
        for src in counts:
            starts.append([])
            for c in src:
                starts[-1].append(offset)
                offset += c
        # rows * 0, not new_empty: the output stays connected to `rows` when this rank got no rows
        # (or an expert none), so every ep rank runs the same all-to-alls in backward
        out = rows * 0
        for j in range(per):
            idx = [torch.arange(starts[s][j], starts[s][j] + counts[s][j]) for s in range(len(counts)) if counts[s][j]]
            if not idx:
                continue
            idx = torch.cat(idx).to(rows.device)
            out = out.index_copy(0, idx, self.expert(j, rows[idx]))
        return out


class SparseMoE(nn.Module):
    """Sparse MoE feed-forward replacing the dense MLP (HF ``MixtralSparseMoeBlock``); see the module docstring.

    Args: cfg: a ModelConfig with num_experts > 0 (num_experts_per_tok, moe_router,
    router_aux_loss_coef, router_z_loss_coef, moe_capacity_factor, moe_norm_topk_prob).
    Forward: x [B, T(/tp), H] -> [B, T(/tp), H] (plus `residual` when given).
    After each training forward ``stats`` holds (eval, e.g. the engine's decode, computes no auxiliary loss or statistics) detached fp32 scalars of that micro-batch:
    ``aux_loss`` (Switch loss, 0 for sinkhorn), ``z_loss``, ``dropped`` (assignments dropped by the
    capacity), ``max_load`` (largest expert share of the assignments times E; 1.0 is balanced).
    ``last_experts`` [N, k] int64 are the experts chosen (for engine / trainer routing comparisons).
    """

    def __init__(self, cfg):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.router = cfg.moe_router
        self.aux_coef, self.z_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.capacity_factor: Optional[float] = cfg.moe_capacity_factor
        self.norm_topk_prob = cfg.moe_norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size)
        self.stats: dict[str, torch.Tensor] = {}
        self.last_experts: Optional[torch.Tensor] = None
        self.aux_scale = 1.0  # 1 / micro-batches of the step (set_aux_loss_scale)
        # context parallelism (set by aligner.parallel.context_parallel.apply_context_parallel): the
        # auxiliary losses and statistics are reduced over this group (cp_router_losses)
        self.cp_group: Optional[torch.distributed.ProcessGroup] = None

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Assignments each expert takes per forward: ceil(c * N * k / E), or None (dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T(/tp), H]; token_mask [B, T] bool (the full T, also under sequence parallelism; None
        = every token): the tokens the auxiliary losses and statistics count. Padding and
        shared-prompt pad segments then change neither (the routing and dispatch still run on them)."""
        group = self.experts.tp_group
        sp = self.experts.sequence_parallel
        shape = x.shape
        if sp:  # the router needs every token (replicated consumer); the experts' input grads are partial
            x_route = comm.gather_from_sp_replicated(x, group)
            x_exp = comm.gather_from_sp(x, group)
        else:
            x_route = x
            x_exp = comm.copy_to_tp(x, group)
        b, t, h = x_route.shape
        x_route, x_exp = x_route.reshape(b * t, h), x_exp.reshape(b * t, h)
        logits = self.gate(x_route)
        weights, experts, probs = route(logits, self.top_k, self.router, self.training, self.norm_topk_prob)
        self.last_experts = experts.detach()
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)  # once: dispatch, loss and stats
        out = self._dispatch(x_exp, comm.copy_to_tp(weights, group), experts, counts)
        out = comm.scatter_to_sp(out.view(b, t, h), group) if sp else comm.reduce_from_tp(out.view(b, t, h), group)
        out = out.view(shape)
        if self.training:  # auxiliary losses and router statistics; none in eval (the engine's decode steps)
            keep = token_mask.reshape(-1).bool() if token_mask is not None else None
            topk = self.router == "topk_softmax"
            if comm.group_size(self.cp_group) > 1:  # context parallelism: over the whole sequence's tokens
                aux, z, c = cp_router_losses(logits, probs, experts, self.num_experts, keep, self.cp_group, topk, bool(self.z_coef))
            else:
                aux = switch_load_balancing_loss(probs, experts, self.num_experts, counts, keep) if topk else probs.new_zeros(())
                z = router_z_loss(logits, keep) if self.z_coef else probs.new_zeros(())
                c = (counts if keep is None else torch.bincount(experts[keep].reshape(-1), minlength=self.num_experts)).float()
            if torch.is_grad_enabled():
                if self.aux_coef and topk:
                    out = _AuxLoss.apply(out, aux, float(self.aux_coef * self.aux_scale))
                if self.z_coef:
                    out = _AuxLoss.apply(out, z, float(self.z_coef * self.aux_scale))
            if c.sum() > 0:  # a filler micro-batch (no real token) leaves the statistics alone
                self.stats.update(aux_loss=aux.detach(), z_loss=z.detach(), max_load=c.max() * self.num_experts / c.sum())
        return out if residual is None else residual + out

    def _dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, k] fp32, experts [N, k] -> [N, H] sum over kept assignments of w * expert(x).

        Assignments are sorted by expert (token order within an expert), cut to the capacity, and
        run expert by expert; with expert parallelism the rows of each ep rank's experts travel
        there and back by all-to-all (:meth:`_run_experts`)."""
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order within
        cap = self.capacity(n) if self.training else None
        dropped = 0
        if cap is not None and int(counts.max()) > cap:
            rank_in_expert = torch.arange(order.numel(), device=order.device) - torch.repeat_interleave(
                torch.cumsum(counts, 0) - counts, counts
            )
            keep = rank_in_expert < cap
            dropped = int((~keep).sum())
            order = order[keep]
            counts = counts.clamp(max=cap)
        self.stats["dropped"] = torch.tensor(float(dropped))
        token = order // k
        y = self._run_experts(x[token], counts.tolist())
        w = weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, (y.float() * w).to(x.dtype))

    def _run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [M, H] sorted by global expert with counts[e] rows each -> expert outputs [M, H] (partial over tp).

        Expert parallelism (ep_size > 1): rows for the experts of ep rank j go to rank j (one
        all-to-all of the counts, one of the rows), each rank runs its experts on the rows of
        every source (grouped by expert), and the outputs return by the reverse all-to-all."""
        ex = self.experts
        group = ex.ep_group
        ep = comm.group_size(group)
        if ep == 1:
            return self.experts(rows, [counts])
        per = ex.num_local_experts
        send = torch.tensor(counts, dtype=torch.long)  # [ep * per]: per destination rank, per local expert
        recv = torch.empty_like(send)
        dev_send = send.to(rows.device)
        dev_recv = torch.empty_like(dev_send)
        torch.distributed.all_to_all_single(dev_recv, dev_send, group=group)
        recv = dev_recv.cpu().view(ep, per)  # rows from source s for my local expert j
        in_splits = send.view(ep, per).sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        got = comm.all_to_all(rows, group, out_splits, in_splits)
        y = self.experts(got, recv.tolist())
        return comm.all_to_all(y, group, in_splits, out_splits)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Weight each micro-batch's auxiliary losses by `scale` (the training step sets 1 / num_micro_batches,
    so a step adds coef * the mean over its micro-batches, whatever the loss reduction)."""
    for m in moe_layers(model):
        m.aux_scale = scale


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    """The :class:`SparseMoE` blocks of `model` (those of this pipeline stage), in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def stack_routing(experts: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer expert choices [..., k] (layer order) -> [..., L, k] int16, sorted along k, so two
    routings compare as sets of experts whatever order top-k returned them in."""
    return torch.stack(experts, -2).sort(dim=-1).values.to(torch.int16)


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Record every forward's ``last_experts`` of this pipeline stage's MoE layers while the context is open.

    Yields one list per :class:`SparseMoE` of `model` (layer order) that receives, per forward of
    that layer (per micro-batch, in the order they ran), its experts [N, k] int16 on the layer's
    device (N = B * T rows in row-major [B, T] order; T the full sequence, gathered under sequence
    parallelism; int16 keeps a whole batch's choices at 2 bytes each). A forward hook, so it works
    under DDP, FSDP2 and the pipeline schedules alike; removed on exit.
    """
    layers = moe_layers(model)
    logs: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(mod, args, out, log):
        log.append(mod.last_experts.to(torch.int16))

    handles = [m.register_forward_hook(lambda mod, args, out, log=log: hook(mod, args, out, log)) for m, log in zip(layers, logs)]
    try:
        yield logs
    finally:
        for h in handles:
            h.remove()


def global_moe_metrics(model: nn.Module, dims) -> dict[str, float]:
    """:func:`moe_metrics` over every MoE layer of the role: layer sums all-reduced over the pp group
    (each pipeline stage holds some layers) and averaged over dp ranks; {} for a dense model. Collective over
    pp and dp (every rank of the role calls it after a step)."""
    import torch.distributed as dist

    if not getattr(getattr(model, "cfg", None), "num_experts", 0):  # a dense model: nothing to gather
        return {}
    layers = [m for m in moe_layers(model) if m.stats]
    keys = ("aux_loss", "z_loss", "max_load", "dropped")
    t = torch.tensor([sum(float(m.stats.get(k, 0.0)) for m in layers) for k in keys] + [float(len(layers))], dtype=torch.float64)
    if dims.pp_size > 1:
        t = t.to(dims.device)
        dist.all_reduce(t, group=dims.pp_group)
    if dims.dp_size > 1:
        t = t.to(dims.device)
        dist.all_reduce(t, group=dims.dp_group)
        t[:-1] /= dims.dp_size
        t[-1] /= dims.dp_size
    t = t.cpu()
    n = max(float(t[-1]), 1.0)
    out = {f"moe_{k}": float(t[i]) / n for i, k in enumerate(keys[:3])}
    out["moe_dropped"] = float(t[3])
    return out


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Mean over this pipeline stage's MoE layers of their last forward's ``stats`` (empty for a dense model):
    ``moe_aux_loss``, ``moe_z_loss``, ``moe_max_load``; ``moe_dropped`` is the sum over layers."""
    layers = [m for m in moe_layers(model) if m.stats]
    if not layers:
        return {}
    out = {f"moe_{k}": sum(float(m.stats[k]) for m in layers) / len(layers) for k in ("aux_loss", "z_loss", "max_load")}
    out["moe_dropped"] = sum(float(m.stats.get("dropped", 0.0)) for m in layers)
    return out
