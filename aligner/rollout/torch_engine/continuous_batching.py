"""The continuous scheduler of :class:`aligner.rollout.torch_engine.engine.TorchEngine` (the default): its execution.

Orca-style iteration-level scheduling (the plans: :mod:`aligner.rollout.torch_engine.scheduler`): every
request of a generate() call waits in one queue; a pool of ``max_batch_size`` KV-cache rows
(:class:`aligner.rollout.torch_engine.kv_cache.SlotKVCache`, no padding: a row's position is its cache slot)
decodes the live requests one token per step; a row that stops (stop token or its own
max_new_tokens) is refilled with the next request between two decode steps: its prompt minus
the last token is prefilled (batched with the other new prompts, right-padded) or, when a live
row already holds the same prompt, copied from it; the last prompt token then runs in the next
decode step with everybody else's. With pp > 1 the pool is split into ``micro_batches`` blocks
and pp rank 0 keeps one block's step in flight per pipeline stage (:class:`aligner.rollout.torch_engine.pipeline_link.PipelineLink`):
while pp rank 1 runs block 0, pp rank 0 runs block 1; pp rank 0 broadcasts the finished Generations
at the end of the call.

Decode attention: SDPA over each block's positions up to its longest context under a mask, or
(``decode_attention="varlen"``, fp32 on the CPU) the kernel of :mod:`aligner.rollout.torch_engine.cpu_kernels`,
each row reading its own keys only.

CUDA graphs (on cuda, pp = 1, one micro-batch, a dense model: :attr:`ContinuousBatching.uses_graphs`):
the decode step is captured once per (slots, cache length) in a :class:`SlotDecodeGraph` with
static shapes: every slot of the pool runs (rows past the live n get token 0 at position 0: free
rows, whose position 0 an admission rewrites before any read) and attention reads the whole cache
under a mask built in the graph from the positions. Prefill, copies and moves stay eager between
replays. The cache length is rounded up to a multiple of ``GRAPH_LEN_BLOCK`` so that calls whose
longest prompt differs by a few tokens share a graph; graphs (and their pools) are kept across
calls, as the static scheduler keeps its own, and dropped by ``TorchEngine.offload``.

Interruptible generation (``TorchEngine(interruptible=True)``, pp = 1): before each step's plan the
loop applies the weight syncs another thread staged (:class:`aligner.rollout.weight_sync.staging.WeightStaging`)
and goes on: the requests in flight keep their KV cache (computed with the old weights, as AReaL
keeps it) and their next tokens are sampled with the new weights; each token is labelled with the
engine's weight_version of the step that sampled it (``Generation.token_versions``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from aligner.rollout.base import Generation
from aligner.rollout.torch_engine.cuda_graphs import capture_cuda_graph
from aligner.rollout.torch_engine.kv_cache import SlotKVCache
from aligner.rollout.torch_engine.pipeline_link import PipelineLink, PlanMeta, plan_meta
from aligner.rollout.torch_engine.sampling import Sampler
from aligner.rollout.torch_engine.scheduler import OnFinish, SlotScheduler, StepPlan, TurnEnd
from aligner.rollout.torch_engine.shard import ModelShard
from aligner.runtime import progress

log = logging.getLogger(__name__)
PROGRESS_LOG_S = 60.0  # a generate call longer than this logs its progress (INFO) this often

GRAPH_LEN_BLOCK = 64  # a SlotDecodeGraph's cache length is a multiple of this many positions


class ContinuousBatching:
    """Runs generate() calls on the model shard `shard` by continuous batching over a slot pool (see the module docstring).

    Args:
        shard: the engine's :class:`ModelShard` (model, layout, hooks).
        max_batch_size: KV-cache slots; each of the ``micro_batches`` blocks gets max_batch_size // micro_batches (at least 1).
        micro_batches: blocks of the slot pool (with pp > 1 each pipeline stage works on one block while the next works on another).
        cuda_graphs: capture the decode step in CUDA graphs where it can (:attr:`uses_graphs`).
        varlen: decode attention by the varlen kernel (fp32 on the CPU) instead of SDPA.
        interruptible: weight syncs land between decode steps (``shard.step_boundary``) and every
            Generation carries ``token_versions`` (pp = 1).

    Without CUDA graphs the pool is allocated per call and freed at its end (the actor trains in
    the same process between calls); with them (:attr:`uses_graphs`) each :class:`SlotDecodeGraph`
    in ``graphs`` owns its pool, kept across calls. ``routing``: during a call on an MoE model, the
    [requests, max budget, L_local, k] int16 buffer of every response token's experts on this
    pipeline stage (-1 where unset). ``last_stats``: the last call's counters (the scheduler's, and generated tokens).
    """

    def __init__(self, shard: ModelShard, *, max_batch_size: int, micro_batches: int, cuda_graphs: bool, varlen: bool, interruptible: bool):
        self.shard = shard
        self.max_batch_size, self.micro_batches = max_batch_size, micro_batches
        self.cuda_graphs, self.varlen, self.interruptible = cuda_graphs, varlen, interruptible
        self.last_stats: dict[str, float] = {}
        self.routing: Optional[torch.Tensor] = None
        self.graphs: dict[tuple[int, int], SlotDecodeGraph] = {}
        self._graph: Optional[SlotDecodeGraph] = None  # the running call's

    @property
    def uses_graphs(self) -> bool:
        """Decode runs in CUDA graphs: asked for (``cuda_graphs``), on cuda, one pipeline stage, one
        micro-batch, SDPA decode attention and no MoE layer (an MoE step records its routing)."""
        sh = self.shard
        return (
            self.cuda_graphs
            and sh.device.type == "cuda"
            and sh.pp_size == 1
            and self.micro_batches == 1
            and not self.varlen
            and not sh.moe_layers
        )

    def _graph_for(self, slots: int, max_len: int) -> SlotDecodeGraph:
        key = (slots, -(-max_len // GRAPH_LEN_BLOCK) * GRAPH_LEN_BLOCK)
        if key not in self.graphs:
            self.graphs[key] = SlotDecodeGraph(self, *key)
        return self.graphs[key]

    def generate(
        self,
        prompts: list[list[int]],
        budgets: list[int],
        sampler: Sampler,
        stop: list[int],
        turn_end: Optional[TurnEnd] = None,
        on_finish: Optional[OnFinish] = None,
    ) -> list[Generation]:
        """Every request of a call, in prompt order, on every pipeline stage; sets ``last_stats``.
        turn_end: the episodes' callback (:data:`aligner.rollout.torch_engine.scheduler.TurnEnd`), run by the first
        pipeline stage's scheduler only; None for single-turn requests. on_finish: run by the first pipeline stage's
        scheduler as each request ends (:data:`aligner.rollout.torch_engine.scheduler.OnFinish`).

        Iteration-level scheduling over a slot pool (:class:`SlotScheduler`); with pp > 1 the
        first pipeline stage schedules and sends each step down the pipeline with its hidden states, the
        last pipeline stage samples and sends the tokens back, and ``micro_batches`` steps are in flight."""
        sh = self.shard
        if turn_end is not None and sh.pp_size > 1:
            raise ValueError("episodes (turn_end) with a pipeline-parallel engine are not built: use pp_size=1 engines")
        m = self.micro_batches
        capacity = max(1, min(self.max_batch_size // m, -(-len(prompts) // m)))  # no more slots than requests
        max_len = max(len(p) + n for p, n in zip(prompts, budgets))
        self._graph = self._graph_for(capacity * m, max_len) if self.uses_graphs else None
        # without graphs allocated per call and freed at its end: the actor trains in the same process between calls
        pool = self._graph.pool if self._graph is not None else SlotKVCache(
            list(sh.layers),
            capacity * m,
            sh.kv_heads,
            max_len,
            sh.head_dim,
            sh.dtype,
            sh.device,
            varlen=self.varlen,
            zeroed=turn_end is not None,
        )  # fmt: skip
        self.routing = None
        if sh.moe_layers:
            k = sh.moe_top_k
            self.routing = torch.full((len(prompts), max(budgets), sh.moe_layers, k), -1, dtype=torch.int16, device=sh.device)
        if not sh.is_first:
            self._serve_pp_stage(pool, sampler)
            sh.attach_routing(None, self.routing)
            self.routing = None
            return self._broadcast_generations(None)  # sets last_stats too
        sched = SlotScheduler(prompts, budgets, capacity, m, stop, turn_end, on_finish)
        link = self._link() if sh.pp_size > 1 else None
        in_flight: deque[tuple[int, int]] = deque()  # (micro-batch, rows) sent down the pipeline
        versions: Optional[list[list[int]]] = [[] for _ in prompts] if self.interruptible else None  # per request, per token
        mb = idle = 0
        started = time.monotonic()
        next_log = started + PROGRESS_LOG_S
        while True:
            now = time.monotonic()
            if now >= next_log:  # a long call says how far it is
                next_log += PROGRESS_LOG_S
                tokens, seconds = sum(len(t) for t, _ in sched.outputs), now - started
                log.info(
                    "generate: %d/%d requests finished, %d tokens in %.0f s (%.0f tokens/s)",
                    sched.finished,
                    len(prompts),
                    tokens,
                    seconds,
                    tokens / seconds,
                )
            progress.beat()  # a scheduler step is progress for the hang watchdog (aligner.runtime.progress)
            if in_flight and in_flight[0][0] == mb:
                _, n = in_flight.popleft()
                sched.apply(mb, *link.recv_tokens(n))
            if sched.done():
                break
            if versions is not None:  # a step boundary (pp = 1): a sync staged by another thread lands here
                sh.step_boundary()
            plan = sched.plan(mb)
            idle = 0 if plan is not None else idle + 1
            if plan is not None:
                if link is None:
                    tok, lp = self._run_plan(plan, pool, sampler, None)
                    sched.apply(mb, tok.tolist(), lp.tolist())
                    if versions is not None:
                        label_versions(versions, sched.outputs, plan.requests, sh.weight_version())
                else:
                    self._run_plan(plan, pool, sampler, link)
                    in_flight.append((mb, plan.n))
            elif idle >= m and not in_flight:  # every live row waits for its environment (parked rows)
                sched.wait_parked(0.05)
                idle = 0
            mb = (mb + 1) % m
        if link is not None:
            link.send_stop()
            link.wait()
        stop_set = set(stop)
        version = sh.weight_version()
        gens = [
            Generation(t, lp, "stop" if t and t[-1] in stop_set else "length", version, own_mask=own if turn_end else None)
            for (t, lp), own in zip(sched.outputs, sched.own)
        ]
        if versions is not None:  # tokens appended outside a decode step (an episode's last observation): the current version
            label_versions(versions, sched.outputs, range(len(gens)), version)
            for g, v in zip(gens, versions):
                g.token_versions = v
        sh.attach_routing(gens, self.routing)
        self.routing = None
        self.last_stats = {**sched.stats(), "generated_tokens": sum(len(g.token_ids) for g in gens)}
        return self._broadcast_generations(gens) if sh.pp_size > 1 else gens

    def _link(self) -> PipelineLink:
        sh = self.shard
        return PipelineLink(sh.pp_group, sh.device, sh.dtype, sh.hidden_size)

    def _run_plan(self, plan: StepPlan, pool: SlotKVCache, sampler: Sampler, link: Optional[PipelineLink]):
        """pp rank 0: run one StepPlan on this pipeline stage and send it on (pp > 1), or sample (pp = 1):
        (tokens [n], log_probs [n]) when this pipeline stage is also the last."""
        dev = self.shard.device
        prefill_x = None
        if plan.prefill_rows:
            t = max(len(x) for x in plan.prefill_ids)
            prefill_x = torch.zeros(len(plan.prefill_ids), t, dtype=torch.long)
            for i, x in enumerate(plan.prefill_ids):
                prefill_x[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            prefill_x = prefill_x.to(dev)
        decode_x = torch.tensor(plan.tokens, dtype=torch.long, device=dev).unsqueeze(1)
        meta = plan_meta(plan, prefill_x.shape[1] if prefill_x is not None else 0)
        return self._pp_stage_step(meta, prefill_x, decode_x, pool, sampler, link, plan.extends)

    def _serve_pp_stage(self, pool: SlotKVCache, sampler: Sampler) -> None:
        """Pipeline stages after the first: run every plan the previous one sends until it sends stop."""
        link = self._link()
        while True:
            got = link.recv_plan()
            if got is None:
                break
            self._pp_stage_step(*got, pool, sampler, link)
        link.send_stop()
        link.wait()

    def _pp_stage_step(
        self, meta: PlanMeta, prefill_x, decode_x, pool: SlotKVCache, sampler: Sampler, link: Optional[PipelineLink], extends=()
    ):
        """Execute a plan on this pipeline stage: prefill, copies, moves, extends (episodes, pp = 1), decode (scheduler.py's order)."""
        sh = self.shard
        dev = sh.device
        trunk = sh.trunk
        prefill_h = None
        if meta.prefill_rows.numel():
            pool.plan_prefill(meta.prefill_rows.to(dev))
            t = meta.prefill_len
            pos = torch.arange(t, device=dev).expand(meta.prefill_rows.numel(), t)
            prefill_h = trunk(prefill_x, position_ids=pos, kv_cache=pool)
        for src, dst, n in meta.copies.tolist():
            pool.copy(src, dst, n)
        for src, dst, n in meta.moves.tolist():
            pool.copy(src, dst, n)
        if extends:
            self._extend(extends, pool)
        if self._graph is not None:  # pp = 1, a dense model: this pipeline stage is also the last, no routing to record
            logits = self._graph.run(decode_x[:, 0], meta.positions.to(dev))
        else:
            h = self._decode_forward(meta, decode_x, pool)
            if self.routing is not None:  # decode row j produced token steps[j] of request requests[j]
                self.routing[meta.requests.to(dev), meta.steps.to(dev)] = sh.pp_stage_routing()
            if not sh.is_last:
                link.send_plan(meta, prefill_h, h)
                return None
            logits = sh.lm_head(h[:, -1]).float()
        tok, lp = sampler.sample_requests(logits, meta.requests.to(dev), meta.steps.to(dev), sh.tp_group)
        if link is not None:
            link.send_tokens(tok, lp)
            return None
        return tok.cpu(), lp.float().cpu()

    def _extend(self, extends: list[tuple[int, int, list[int]]], pool: SlotKVCache) -> None:
        """Episodes that go on after an observation: one forward of each row's new tokens (right-padded)
        at positions [offset, offset + len), writing their k/v into the row and attending to its cache
        before them (each query to its row's keys up to its own position); the outputs are not used."""
        dev = self.shard.device
        rows = torch.tensor([r for r, _, _ in extends], dtype=torch.long, device=dev)
        offsets = torch.tensor([o for _, o, _ in extends], dtype=torch.long, device=dev)
        lengths = torch.tensor([len(ids) for _, _, ids in extends], dtype=torch.long, device=dev)
        t = int(lengths.max())
        x = torch.zeros(len(extends), t, dtype=torch.long)
        for i, (_, _, ids) in enumerate(extends):
            x[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        positions = offsets.unsqueeze(1) + torch.arange(t, device=dev)  # [U, T]
        length = pool.plan_extend(rows, offsets, lengths)
        mask = (torch.arange(length, device=dev) <= positions.unsqueeze(2))[:, None]  # [U, 1, T, L]
        self.shard.trunk(x.to(dev), position_ids=positions, attn_mask=mask, kv_cache=pool)

    def _decode_forward(self, meta: PlanMeta, decode_x: torch.Tensor, pool: SlotKVCache) -> torch.Tensor:
        """The eager decode step of rows [start, start + n): hidden states [n, 1, H] of this pipeline stage, attention
        over each block's positions up to its longest context (masked where the rows' lengths differ)."""
        dev = self.shard.device
        positions = meta.positions.to(dev)
        length = int(meta.positions.max()) + 1
        mask = None  # the varlen kernel reads each row's own length from the pool: no mask to build
        if not pool.varlen and not bool((meta.positions == length - 1).all()):
            mask = (torch.arange(length, device=dev) <= positions.unsqueeze(1))[:, None, None, :]
        pool.plan_decode(meta.start, positions, length)
        return self.shard.trunk(decode_x, position_ids=positions.unsqueeze(1), attn_mask=mask, kv_cache=pool)

    def _broadcast_generations(self, gens: Optional[list[Generation]]) -> list[Generation]:
        """pp rank 0's Generations and last_stats on every pipeline stage (one object broadcast over the pp group)."""
        pp_group = self.shard.pp_group
        box = [(gens, self.last_stats)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pp_group, 0), group=pp_group)
        gens, self.last_stats = box[0]
        return gens


def label_versions(versions: list[list[int]], outputs: list[tuple[list[int], list[float]]], requests, version: int) -> None:
    """Give the tokens that `requests` (request indices) gained since their last labelling `version`:
    versions[i] grows to len(outputs[i][0]) (the scheduler's tokens of request i)."""
    for i in requests:
        have, n = len(versions[i]), len(outputs[i][0])
        if n > have:
            versions[i].extend([version] * (n - have))


class SlotDecodeGraph:
    """The continuous scheduler's decode step over all `slots` rows of its own pool, static shapes.

    Inputs ``tok`` [slots, 1] and ``pos`` [slots] int64 are copied in before each replay; the
    output ``out`` [slots, V/tp] fp32 is the last pipeline stage's logits (pp = 1). Attention reads all
    `max_len` cache positions with the mask ``positions <= pos`` built inside the step, and each
    row writes its new key/value at ``pos`` (:meth:`SlotKVCache.plan_decode` over every row).
    Captured in a CUDA graph at construction when the engine is on cuda; elsewhere (tests on the
    CPU) :meth:`run` calls the same step eagerly, so its static-shape arithmetic is checked
    against the per-step path without a GPU.

    Args:
        batching: the ContinuousBatching whose model shard it runs.
        slots: rows of the pool (capacity x micro-batches, = 1 micro-batch here).
        max_len: cache positions per row (a multiple of ``GRAPH_LEN_BLOCK``).
    """

    def __init__(self, batching: ContinuousBatching, slots: int, max_len: int):
        sh = batching.shard
        dev = sh.device
        self.shard, self.slots, self.max_len = sh, slots, max_len
        self.pool = SlotKVCache(list(sh.layers), slots, sh.kv_heads, max_len, sh.head_dim, sh.dtype, dev)
        self.tok = torch.zeros(slots, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.key_positions = torch.arange(max_len, device=dev)
        self.graph = None
        if dev.type != "cuda":
            return
        # the warm-up writes position 0 of every row: no request holds a row yet
        self.graph, self.out = capture_cuda_graph(self._step)

    def _step(self) -> torch.Tensor:
        sh = self.shard
        self.pool.plan_decode(0, self.pos, self.max_len)
        mask = (self.key_positions <= self.pos.unsqueeze(1))[:, None, None, :]  # [slots, 1, 1, max_len]
        h = sh.trunk(self.tok, position_ids=self.pos.unsqueeze(1), attn_mask=mask, kv_cache=self.pool)
        return sh.lm_head(h[:, -1]).float()

    def run(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tok [n], pos [n] int64 of the live rows 0 .. n-1 -> their logits [n, V/tp] fp32 (a copy).

        Rows n .. slots-1 run token 0 at position 0 (free rows: the next admission to one
        prefills or copies its positions, or, for a one-token prompt, decodes position 0 first)."""
        n = tok.shape[0]
        self.tok.zero_()
        self.pos.zero_()
        self.tok[:n, 0].copy_(tok)
        self.pos[:n].copy_(pos)
        if self.graph is None:
            return self._step()[:n]
        self.graph.replay()
        return self.out[:n].clone()
