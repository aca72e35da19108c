"""The static scheduler of :class:`aligner.rollout.torch_engine.engine.TorchEngine` (``scheduler="static"``,
the first engine), and its CUDA-graph decode step.

It runs batches of max_batch_size prompts. How a batch runs:
- prompts are left-padded to the longest P; one cache of P + max_new_tokens slots is
  preallocated (:class:`aligner.rollout.torch_engine.kv_cache.StaticKVCache`); slot j holds the same column
  j for every row.
- positions per row are ``cumsum(valid) - 1`` (so padding never shifts RoPE); the mask is
  causal AND key-valid, built once per forward (not per layer). Padding queries attend to
  themselves only, so no softmax row is empty (no NaN leaks through 0 * NaN into real rows).
- decode reads the cache sliced to the slots written so far (CPU) or the whole cache with a
  key mask (CUDA graphs, static shapes: :class:`DecodeGraph`, on cuda with pp = 1).
- the batch decodes until every row has stopped (a stop token or its own budget); tokens past
  a row's stop are cut.

PP: pipeline stage s receives hidden states [B, T, H] from pipeline stage s-1 (``dist.recv`` on the pp group),
runs its layers and sends to s+1; the last pipeline stage samples and broadcasts the tokens and
log-probs to every pipeline stage, so all ranks return the same Generations.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from aligner.rollout.base import Generation
from aligner.rollout.torch_engine.cuda_graphs import capture_cuda_graph
from aligner.rollout.torch_engine.kv_cache import StaticKVCache
from aligner.rollout.torch_engine.sampling import Sampler
from aligner.rollout.torch_engine.scheduler import OnFinish
from aligner.rollout.torch_engine.shard import ModelShard
from aligner.runtime import progress


class StaticBatching:
    """Runs generate() calls on the model shard `shard` as static batches (see the module docstring).

    Args:
        shard: the engine's :class:`ModelShard` (model, layout, hooks).
        max_batch_size: prompts per batch.
        cuda_graphs: capture the decode step in CUDA graphs where it can (:attr:`uses_graphs`).

    ``graphs``: the captured decode steps, one :class:`DecodeGraph` per (batch, cache length),
    kept across calls (their caches and inputs are static; refit copies weights in place).
    ``last_stats``: the last call's counters (prompt, prefilled and generated tokens).
    """

    def __init__(self, shard: ModelShard, *, max_batch_size: int, cuda_graphs: bool):
        self.shard = shard
        self.max_batch_size = max_batch_size
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.last_stats: dict[str, float] = {}

    @property
    def uses_graphs(self) -> bool:
        """Decode runs in CUDA graphs: the engine asks for them, runs on cuda, and has one pipeline stage."""
        s = self.shard
        return self.cuda_graphs and s.device.type == "cuda" and s.pp_size == 1

    def generate(
        self, prompts: list[list[int]], budgets: list[int], sampler: Sampler, stop: list[int], on_finish: Optional[OnFinish] = None
    ) -> list[Generation]:
        """Every request of a call, max_batch_size at a time, in prompt order; sets ``last_stats``.
        on_finish: called for each request of a batch when the batch ends (:data:`aligner.rollout.torch_engine.scheduler.OnFinish`)."""
        out: list[Generation] = []
        for s in range(0, len(prompts), self.max_batch_size):
            chunk = range(s, min(len(prompts), s + self.max_batch_size))
            out.extend(self._generate_batch([prompts[i] for i in chunk], [budgets[i] for i in chunk], sampler, chunk, stop))
            for i in chunk if on_finish is not None and self.shard.is_first else ():
                on_finish(i, out[i].token_ids)
        n_prompt = sum(len(p) for p in prompts)
        self.last_stats = {
            "prompt_tokens": n_prompt,
            "prefilled_tokens": n_prompt,
            "generated_tokens": sum(len(g.token_ids) for g in out),
        }
        return out

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A StaticKVCache for this pipeline stage's layers only: k, v dicts {layer: [B, kvh_local, max_len, hd]}."""
        s = self.shard
        return StaticKVCache(list(s.layers), batch, s.kv_heads, max_len, s.head_dim, s.dtype, s.device)

    def _generate_batch(self, prompts, budgets: list[int], sampler: Sampler, requests: range, stop: list[int]) -> list[Generation]:
        """One batch of requests (their indices in the call): prefill, then decode until every row stopped."""
        sh = self.shard
        dev = sh.device
        b, p = len(prompts), max(len(x) for x in prompts)
        n_new = max(budgets)
        total = p + n_new
        ids = torch.zeros(b, p, dtype=torch.long)
        valid = torch.zeros(b, total, dtype=torch.bool)
        for i, x in enumerate(prompts):
            ids[i, p - len(x) :] = torch.tensor(x, dtype=torch.long)
            valid[i, p - len(x) : p] = True
        valid[:, p:] = True
        ids, valid = ids.to(dev), valid.to(dev)
        lens = torch.tensor([len(x) for x in prompts], device=dev)
        req = torch.tensor(list(requests), device=dev)
        stop_t = torch.tensor(stop, dtype=torch.long, device=dev)
        budget_t = torch.tensor(budgets, device=dev)
        graph = self._graph_for(b, total) if self.uses_graphs else None
        cache = graph.cache if graph is not None else self.new_cache(b, total)
        if graph is not None:
            graph.set_valid(valid)
        # a one-token query may attend to every cached slot unless a row is left-padded
        no_padding = graph is None and all(len(x) == p for x in prompts)
        # asking whether every row has stopped syncs with the device: on a GPU only every 8 steps
        check_every = 1 if dev.type == "cpu" else 8

        # prefill
        pos = (valid[:, :p].long().cumsum(-1) - 1).clamp(min=0)
        eye = torch.eye(p, dtype=torch.bool, device=dev)
        mask = ((torch.ones(p, p, dtype=torch.bool, device=dev).tril() & valid[:, None, :p]) | eye).unsqueeze(1)
        cache.length = p
        logits = self.forward(ids, pos, mask, cache, torch.arange(p, device=dev))
        # MoE: the experts of the position that produces each token (the last prompt token's row here);
        # not with CUDA graphs (an MoE decode step syncs with the host, so it is never captured)
        routing = [sh.pp_stage_routing().view(b, p, sh.moe_layers, -1)[:, -1]] if sh.moe_layers and graph is None else None
        step_t = torch.zeros(b, dtype=torch.long, device=dev)
        tok, lp = self._sample(logits, sampler, req, step_t)
        tokens, log_probs = [tok], [lp]
        finished = torch.isin(tok, stop_t) | (budget_t <= 1)
        for step in range(1, n_new):
            progress.beat()  # a decode step is progress for the hang watchdog (aligner.runtime.progress)
            if step % check_every == 0 and bool(finished.all()):
                break
            slot = p + step - 1
            pos = (lens + step - 1).unsqueeze(1)
            if graph is not None:
                logits = graph.run(tok, pos, slot)
            else:
                cache.length = slot + 1
                key_mask = None if no_padding else valid[:, None, None, : slot + 1]
                logits = self.forward(tok.unsqueeze(1), pos, key_mask, cache, torch.tensor([slot], device=dev))
            if routing is not None:
                routing.append(sh.pp_stage_routing())
            tok, lp = self._sample(logits, sampler, req, step_t + step)  # draws past a budget are cut below
            tokens.append(tok)
            log_probs.append(lp)
            finished = finished | torch.isin(tok, stop_t) | (budget_t <= step + 1)
        gens = self._to_generations(torch.stack(tokens, 1).cpu(), torch.stack(log_probs, 1).float().cpu(), stop)
        for g, n in zip(gens, budgets):
            if len(g.token_ids) > n:
                g.token_ids, g.rollout_log_probs, g.finish_reason = g.token_ids[:n], g.rollout_log_probs[:n], "length"
        if routing is not None:
            sh.attach_routing(gens, torch.stack(routing, 1))
        return gens

    def _to_generations(self, tokens: torch.Tensor, log_probs: torch.Tensor, stop: list[int]) -> list[Generation]:
        """tokens, log_probs: [B, n] -> Generations cut after the first stop token."""
        gens = []
        stop_set = set(stop)
        for row_t, row_l in zip(tokens.tolist(), log_probs.tolist()):
            end = next((j + 1 for j, t in enumerate(row_t) if t in stop_set), None)
            n = end if end is not None else len(row_t)
            gens.append(Generation(row_t[:n], row_l[:n], "stop" if end is not None else "length", self.shard.weight_version()))
        return gens

    def forward(self, x, position_ids, mask, cache: StaticKVCache, cache_positions) -> Optional[torch.Tensor]:
        """One forward of the last query position through this pipeline stage -> local logits [B, V/tp] fp32 (or None off the last pipeline stage).

        x: token ids [B, T] (first pipeline stage; later ones receive hidden states [B, T, H] from the
        previous one), position_ids [B, T], mask [B, 1, T, Tk] bool or None, cache_positions [T]:
        the cache slots written."""
        sh = self.shard
        if not sh.is_first:
            b, t = position_ids.shape
            x = torch.empty(b, t, sh.hidden_size, dtype=sh.dtype, device=sh.device)
            dist.recv(x, src=dist.get_global_rank(sh.pp_group, sh.pp_rank - 1), group=sh.pp_group)
        h = sh.trunk(x, position_ids=position_ids, attn_mask=mask, kv_cache=cache, cache_positions=cache_positions)
        if not sh.is_last:
            dist.send(h.contiguous(), dst=dist.get_global_rank(sh.pp_group, sh.pp_rank + 1), group=sh.pp_group)
            return None
        return sh.lm_head(h[:, -1]).float()

    def _sample(self, logits: Optional[torch.Tensor], sampler: Sampler, requests: torch.Tensor, steps: torch.Tensor):
        """Local logits [B, V/tp] on the last pipeline stage -> (tokens [B] int64, log_probs [B] fp32) on every rank."""
        sh = self.shard
        if sh.is_last:
            tok, lp = sampler.sample_requests(logits, requests, steps, sh.tp_group)
        else:
            tok = torch.empty(requests.shape[0], dtype=torch.long, device=sh.device)
            lp = torch.empty(requests.shape[0], dtype=torch.float32, device=sh.device)
        if sh.pp_size > 1:
            src = dist.get_global_rank(sh.pp_group, sh.pp_size - 1)
            dist.broadcast(tok, src=src, group=sh.pp_group)
            dist.broadcast(lp, src=src, group=sh.pp_group)
        return tok, lp

    def _graph_for(self, batch: int, total: int) -> DecodeGraph:
        key = (batch, total)
        if key not in self.graphs:
            self.graphs[key] = DecodeGraph(self, batch, total)
        return self.graphs[key]


class DecodeGraph:
    """A captured decode step for one (batch, cache length): static cache, inputs and logits.

    Attention reads all `total` slots with a key mask (static shapes); the slot written is a
    device tensor, so one graph serves every step. Captured at construction (on cuda only).

    Args:
        batching: the StaticBatching whose :meth:`StaticBatching.forward` it captures.
        batch: rows B. total: cache slots, the longest prompt P + the most new tokens.
    """

    def __init__(self, batching: StaticBatching, batch: int, total: int):
        dev = batching.shard.device
        self.batching = batching
        self.cache = batching.new_cache(batch, total)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.slot = torch.full((1,), total - 1, dtype=torch.long, device=dev)
        self.valid = torch.ones(batch, total, dtype=torch.bool, device=dev)  # key slots holding real tokens
        self.slots = torch.arange(total, device=dev)
        self.total = total
        # the warm-up writes only slot total-1, which decode overwrites before reading it
        self.graph, self.out = capture_cuda_graph(self._step)

    def _step(self) -> torch.Tensor:
        self.cache.length = self.total
        mask = (self.valid & (self.slots <= self.slot))[:, None, None, :]  # [B, 1, 1, total], built in the graph
        return self.batching.forward(self.tok, self.pos, mask, self.cache, self.slot)

    def set_valid(self, valid: torch.Tensor) -> None:
        """valid [B, total] bool: this generate call's key slots (left padding False); once per call."""
        self.valid.copy_(valid)

    def run(self, tok: torch.Tensor, pos: torch.Tensor, slot: int) -> torch.Tensor:
        """tok [B], pos [B, 1], slot int -> local logits [B, V/tp] (a copy)."""
        self.tok.copy_(tok.unsqueeze(1))
        self.pos.copy_(pos)
        self.slot.fill_(slot)
        self.graph.replay()
        return self.out.clone()
