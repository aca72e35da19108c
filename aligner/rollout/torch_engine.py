"""TorchEngine: batched generation with aligner's own Llama and a static KV cache.

Owns: left-padded batched prefill + decode over :class:`aligner.model.llama.KVCache`,
greedy / temperature / top-k / top-p sampling with per-request seeds, stop tokens,
rollout log-probs, the HF-named weight update, tensor- and pipeline-parallel generation
in the engine's own layout, and CUDA-graph decode on GPU (run on an H100, 2026-11-22:
tests/rollout/test_trtllm_engine_gpu.py and benchmarks/generation.py --gpu; TP/PP engines on GPUs
have not run, only on gloo).

How a batch runs:
- prompts are left-padded to the longest P; one cache of P + max_new_tokens slots is
  preallocated; slot j holds the same column j for every row.
- positions per row are ``cumsum(valid) - 1`` (so padding never shifts RoPE); the mask is
  causal AND key-valid, built once per forward (not per layer). Padding queries attend to
  themselves only, so no softmax row is empty (no NaN leaks through 0 * NaN into real rows).
- decode reads the cache sliced to the slots written so far (CPU) or the whole cache with a
  key mask (CUDA graphs, static shapes).
- prefill and decode run the model's own modules (:mod:`aligner.model.llama` with a KVCache):
  there is one decoder forward in aligner. Its inference fast paths live in the building
  blocks: packed q/k/v and gate/up GEMMs (:func:`aligner.nn.layers.pack_linears`), the residual
  add inside the o / down GEMM, fp32 RMSNorm in one kernel, GQA decode without repeated k/v. On
  the CPU linear weights are stored [in, out] (see :func:`_pack_weights`). The packed
  parameters are views, so refit is unchanged.

Sampling choices (documented simplifications):
- Under TP the last position's logits [B, V/tp] are all-gathered to [B, V] on every tp rank
  (only the last position, once per step: B * V floats), and every rank samples the same
  token and log-prob from the same full logits with identically seeded generators. This keeps
  tokens independent of the tp layout (tp 1 and tp 2 give the same tokens for the same seeds).
- Sampling is inverse-CDF: each row draws one uniform u per step and takes the first token
  whose cumulative (top-k / top-p filtered) probability mass exceeds u times the kept mass, the
  method of ``torch.multinomial``; one random number per row and step instead of V (Gumbel-max)
  keeps sampling a small part of a decode step. Each seeded row's uniforms come from its own
  ``torch.Generator``, drawn for the whole response at the start, so a row's tokens depend on
  its seed and the weights only, not on the other rows of the batch. Greedy takes the max.
- ``rollout_log_probs`` are log softmax(logits / T) over the FULL vocabulary (T = 1 for
  greedy), not renormalized over the top-k / top-p set. That is the quantity the trainer
  recomputes (``old_log_probs``), so the mismatch metric measures engine numerics only; the
  truncated distribution actually sampled differs by -log(kept mass) per token, which the
  engine does not report.

PP: stage s receives hidden states [B, T, H] from stage s-1 (``dist.recv`` on the pp group),
runs its layers and sends to s+1; the last stage samples and broadcasts the tokens and
log-probs to every stage, so all ranks return the same Generations.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.model.llama import KVCache, build_model
from aligner.nn import comm
from aligner.nn.layers import ColumnParallelLinear, ParallelLayer, RMSNorm, RowParallelLinear, pack_linears, unpack_linears
from aligner.rollout.base import Generation, RolloutEngine, check_prompts, check_sampling
from aligner.runtime.host import keep_freed_host_memory


class TorchEngine(RolloutEngine):
    """Generation with a (possibly TP-sharded, possibly PP-pruned) aligner LlamaForCausalLM.

    Args:
        model: aligner LlamaForCausalLM; already sharded with apply_tensor_parallel over
            `tp_group` and/or pruned to this pp stage when those groups are given.
        eos_token_id: stop token besides sampling.stop_token_ids (None: none).
        tp_group: the engine's tensor-parallel group (None: no TP).
        pp_group: the engine's pipeline group; stage index = rank in it (None: no PP).
        max_batch_size: prompts per engine batch; larger requests are split.
        cuda_graphs: capture the decode step in CUDA graphs (only when on cuda, pp = 1).
        seed: seed of the engine RNG used when generate() gets no seeds.
        fused_decode: pack each layer's q/k/v and gate/up weights so each group runs as one GEMM
            (:func:`aligner.nn.layers.pack_linears`). None (default): on for CPU engines, off on
            CUDA, where packing (and CUDA graphs of it) has not run yet
            (tests/rollout/test_trtllm_engine_gpu.py checks it there). Ignored for models whose layers
            are not aligner's own (e.g. Transformer Engine modules) or that use sequence parallelism.
    The engine owns `model`: it re-lays its linear weights out in place (see :func:`_pack_weights`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_id: Optional[int] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        pp_group: Optional[dist.ProcessGroup] = None,
        max_batch_size: int = 256,
        cuda_graphs: bool = True,
        seed: int = 0,
        fused_decode: Optional[bool] = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} is invalid: must be >= 1")
        self.model = model.eval()
        self.cfg = model.cfg
        self.eos_token_id = eos_token_id
        self.tp_group, self.pp_group = tp_group, pp_group
        self.tp_size, self.tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.pp_size, self.pp_rank = comm.group_size(pp_group), comm.group_rank(pp_group)
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self.cuda_graphs = cuda_graphs
        self._rng_seed = seed
        self._calls = 0
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        if self.device.type == "cpu":
            keep_freed_host_memory()
        if fused_decode is None:
            fused_decode = self.device.type == "cpu"
        self.fused_decode = fused_decode and _fusable(model)
        _pack_weights(model, self.device, transposed=self.device.type == "cpu", fuse=self.fused_decode)  # before the slots
        self._params = _param_slots(model)
        self._full_names = {n for n, _ in build_model(self.cfg, device="meta").named_parameters(remove_duplicate=False)}
        self._received: set[str] = set()
        self._offloaded: list[torch.Tensor] = []

    # ---- properties of the local model --------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _local_layers(self) -> list[int]:
        return sorted(int(k) for k in self.model.model.layers.keys())

    def _kv_heads_local(self) -> int:
        attn = next(iter(self.model.model.layers.values())).self_attn
        return attn.k_proj.weight.shape[0] // attn.head_dim

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A KVCache for this stage's layers only: k, v dicts {layer: [B, kvh_local, max_len, hd]}."""
        cache = KVCache(0, batch, 1, max_len, 1, self.dtype, self.device)
        shape = (batch, self._kv_heads_local(), max_len, self.cfg.resolved_head_dim)
        cache.k = {i: torch.zeros(shape, dtype=self.dtype, device=self.device) for i in self._local_layers()}
        cache.v = {i: torch.zeros(shape, dtype=self.dtype, device=self.device) for i in self._local_layers()}
        return cache

    # ---- weights ------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of (hf_name, tensor) in place (addresses are kept, so graphs stay valid).

        tensor: the full (unsharded) HF tensor, or this rank's engine shard. Names of layers
        that live on another pp stage are skipped. Raises ValueError for a name the model
        does not have, or a shape that is neither the full nor the local one.
        """
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in self._full_names:
                    raise ValueError(
                        f"update_weights: unknown parameter name {name!r}; expected HF Llama names such as 'model.layers.0.self_attn.q_proj.weight'"
                    )
                slot = self._params.get(name)
                if slot is None:
                    continue  # another pipeline stage owns it
                module, pname = slot
                param = getattr(module, pname)
                local = tensor if tensor.shape == param.shape else _to_local(module, pname, tensor)
                if local.shape != param.shape:
                    raise ValueError(
                        f"update_weights: {name} has shape {tuple(tensor.shape)}; expected the full shape or this rank's shard {tuple(param.shape)}"
                    )
                param.copy_(local)
                self._received.add(name)

    def finish_weight_update(self) -> None:
        """Bump weight_version; drop cached decode graphs' KV contents (weights are copied in place)."""
        self.weight_version += 1
        self.last_update_names = set(self._received)
        self._received.clear()

    def offload(self) -> None:
        """Move parameters to host memory and drop graphs/caches (no-op on CPU)."""
        if self.device.type != "cuda":
            return
        self._graphs.clear()
        _pack_weights(self.model, torch.device("cpu"), transposed=False, fuse=self.fused_decode)
        torch.cuda.empty_cache()
        self._offloaded_device = torch.device("cuda", torch.cuda.current_device())

    def onload(self) -> None:
        """Move parameters back to the device they were offloaded from (no-op otherwise)."""
        dev = getattr(self, "_offloaded_device", None)
        if dev is None:
            return
        _pack_weights(self.model, dev, transposed=False, fuse=self.fused_decode)
        self._offloaded_device = None

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling: Any, seeds: Optional[list[int]] = None) -> list[Generation]:
        """Sample one response per prompt (see the module docstring for the sampling semantics).

        Args:
            prompt_ids: list[list[int]], B non-empty prompts of ragged length.
            sampling: SamplingConfig-like (temperature >= 0, top_k >= 0, top_p in (0, 1],
                max_new_tokens >= 1, stop_token_ids).
            seeds: list[int] of length B (per-request generators) or None (engine RNG).
        Returns:
            list[Generation] of length B; rollout_log_probs fp32 per response token.
        Raises:
            ValueError: bad sampling parameters, empty prompt, token id outside the vocabulary,
                or longest prompt + max_new_tokens > model.max_seq_len.
        """
        check_sampling(sampling)
        check_prompts(prompt_ids, seeds, self.cfg.vocab_size)
        longest = max(len(p) for p in prompt_ids)
        if longest + sampling.max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(
                f"sampling.max_new_tokens={sampling.max_new_tokens} with the longest prompt of {longest} tokens "
                f"exceeds model.max_seq_len={self.cfg.max_seq_len}: shorten prompts or lower max_new_tokens"
            )
        self._calls += 1
        out: list[Generation] = []
        for s in range(0, len(prompt_ids), self.max_batch_size):
            chunk = prompt_ids[s : s + self.max_batch_size]
            chunk_seeds = None if seeds is None else seeds[s : s + self.max_batch_size]
            with torch.inference_mode():
                out.extend(self._generate_batch(chunk, sampling, chunk_seeds, s))
        return out

    def _generate_batch(self, prompts, sampling, seeds, offset: int) -> list[Generation]:
        dev = self.device
        b, p = len(prompts), max(len(x) for x in prompts)
        n_new = sampling.max_new_tokens
        total = p + n_new
        ids = torch.zeros(b, p, dtype=torch.long)
        valid = torch.zeros(b, total, dtype=torch.bool)
        for i, x in enumerate(prompts):
            ids[i, p - len(x) :] = torch.tensor(x, dtype=torch.long)
            valid[i, p - len(x) : p] = True
        valid[:, p:] = True
        ids, valid = ids.to(dev), valid.to(dev)
        lens = torch.tensor([len(x) for x in prompts], device=dev)
        sampler = _Sampler(sampling, seeds, b, n_new, dev, self._rng_seed * 1_000_003 + self._calls * 7919 + offset)
        stop = sorted({*sampling.stop_token_ids, *([] if self.eos_token_id is None else [self.eos_token_id])})
        stop_t = torch.tensor(stop, dtype=torch.long, device=dev)
        graph = self._graph_for(b, total) if self._use_graphs() else None
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
        logits = self._forward(ids, pos, mask, cache, torch.arange(p, device=dev))
        tok, lp = self._sample(logits, sampler, 0)
        tokens, log_probs = [tok], [lp]
        finished = torch.isin(tok, stop_t)
        for step in range(1, n_new):
            if step % check_every == 0 and bool(finished.all()):
                break
            slot = p + step - 1
            pos = (lens + step - 1).unsqueeze(1)
            if graph is not None:
                logits = graph.run(tok, pos, slot)
            else:
                cache.length = slot + 1
                key_mask = None if no_padding else valid[:, None, None, : slot + 1]
                logits = self._forward(tok.unsqueeze(1), pos, key_mask, cache, torch.tensor([slot], device=dev))
            tok, lp = self._sample(logits, sampler, step)
            tokens.append(tok)
            log_probs.append(lp)
            finished = finished | torch.isin(tok, stop_t)
        return self._to_generations(torch.stack(tokens, 1).cpu(), torch.stack(log_probs, 1).float().cpu(), stop)

    def _to_generations(self, tokens: torch.Tensor, log_probs: torch.Tensor, stop: list[int]) -> list[Generation]:
        """tokens, log_probs: [B, n] -> Generations cut after the first stop token."""
        gens = []
        stop_set = set(stop)
        for row_t, row_l in zip(tokens.tolist(), log_probs.tolist()):
            end = next((j + 1 for j, t in enumerate(row_t) if t in stop_set), None)
            n = end if end is not None else len(row_t)
            gens.append(Generation(row_t[:n], row_l[:n], "stop" if end is not None else "length", self.weight_version))
        return gens

    def _forward(self, x, position_ids, mask, cache: KVCache, cache_positions) -> Optional[torch.Tensor]:
        """One stage-to-stage forward of the last query position -> local logits [B, V/tp] fp32 (or None off the last stage)."""
        if not self.is_first:
            b, t = position_ids.shape
            x = torch.empty(b, t, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=dist.get_global_rank(self.pp_group, self.pp_rank - 1), group=self.pp_group)
        h = self.model.model(x, position_ids=position_ids, attn_mask=mask, kv_cache=cache, cache_positions=cache_positions)
        if not self.is_last:
            dist.send(h.contiguous(), dst=dist.get_global_rank(self.pp_group, self.pp_rank + 1), group=self.pp_group)
            return None
        return self.model.lm_head(h[:, -1]).float()

    def _sample(self, logits: Optional[torch.Tensor], sampler: _Sampler, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local logits [B, V/tp] on the last stage -> (tokens [B] int64, log_probs [B] fp32) on every rank."""
        if self.is_last:
            full = logits if self.tp_size == 1 else _gather_vocab(logits, self.tp_group)
            tok, lp = sampler.sample(full, step)
        else:
            tok = sampler.skip()
            lp = torch.empty(tok.shape[0], dtype=torch.float32, device=self.device)
        if self.pp_size > 1:
            src = dist.get_global_rank(self.pp_group, self.pp_size - 1)
            dist.broadcast(tok, src=src, group=self.pp_group)
            dist.broadcast(lp, src=src, group=self.pp_group)
        return tok, lp

    # ---- CUDA graphs --------------------------------------------------------------------
    def _use_graphs(self) -> bool:
        return self.cuda_graphs and self.device.type == "cuda" and self.pp_size == 1

    def _graph_for(self, batch: int, total: int) -> _DecodeGraph:
        key = (batch, total)
        if key not in self._graphs:
            self._graphs[key] = _DecodeGraph(self, batch, total)
        return self._graphs[key]


class _DecodeGraph:
    """A captured decode step for one (batch, cache length): static cache, inputs and logits.

    Attention reads all `total` slots with a key mask (static shapes); the slot written is a
    device tensor, so one graph serves every step.
    """

    def __init__(self, engine: TorchEngine, batch: int, total: int):
        dev = engine.device
        self.engine = engine
        self.cache = engine.new_cache(batch, total)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.slot = torch.full((1,), total - 1, dtype=torch.long, device=dev)
        self.valid = torch.ones(batch, total, dtype=torch.bool, device=dev)  # key slots holding real tokens
        self.slots = torch.arange(total, device=dev)
        self.total = total
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (writes only slot total-1, which decode overwrites before reading)
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()

    def _step(self) -> torch.Tensor:
        self.cache.length = self.total
        mask = (self.valid & (self.slots <= self.slot))[:, None, None, :]  # [B, 1, 1, total], built in the graph
        return self.engine._forward(self.tok, self.pos, mask, self.cache, self.slot)

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


class _Sampler:
    """Per-step token choice: greedy (max), or inverse-CDF sampling under temperature / top-k / top-p.

    Args:
        sampling: SamplingConfig-like. seeds: one seed per row, or None (one engine generator).
        batch, n_new: rows and decode steps. fallback_seed: the engine generator's seed.
    Seeded rows draw their n_new uniforms [n_new] from their own torch.Generator up front, so a
    row's draws do not depend on the batch it is in.
    """

    def __init__(self, sampling, seeds: Optional[list[int]], batch: int, n_new: int, device, fallback_seed: int):
        self.temperature = float(sampling.temperature)
        self.top_k, self.top_p = int(sampling.top_k), float(sampling.top_p)
        self.batch, self.device = batch, device
        self.greedy = self.temperature == 0
        self.uniforms: Optional[torch.Tensor] = None  # [B, n_new] fp32 in [0, 1)
        if not self.greedy:
            if seeds is None:
                g = torch.Generator().manual_seed(fallback_seed % (2**63))
                u = torch.rand(batch, n_new, generator=g)
            else:
                u = torch.stack([torch.rand(n_new, generator=torch.Generator().manual_seed(int(s) % (2**63))) for s in seeds])
            self.uniforms = u.to(device)

    def skip(self) -> torch.Tensor:
        """Off the last stage: no token yet (filled by the broadcast)."""
        return torch.empty(self.batch, dtype=torch.long, device=self.device)

    def sample(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, V] fp32 (full vocabulary) -> (tokens [B] int64, log_probs [B] fp32).

        log_probs are log softmax(logits / T) of the chosen tokens over the full vocabulary
        (T = 1 when greedy), whatever top-k / top-p kept.
        """
        if self.greedy:
            top, tok = logits.max(dim=-1)
            return tok, -(logits - top.unsqueeze(-1)).exp_().sum(-1).log_()  # logits[tok] - logsumexp
        scaled = logits / self.temperature if self.temperature != 1.0 else logits
        top = scaled.max(dim=-1, keepdim=True).values
        weights = (scaled - top).exp_()  # unnormalized probabilities, the largest is 1
        log_z = weights.sum(-1).log_()
        if 0 < self.top_k < logits.shape[-1] or self.top_p < 1.0:
            weights.masked_fill_(~torch.isfinite(_filter_top_k_top_p(scaled, self.top_k, self.top_p)), 0.0)
        cdf = weights.cumsum_(-1)
        u = self.uniforms[:, step : step + 1] * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
        lp = scaled.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - top.squeeze(-1) - log_z
        return tok, lp


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to -inf (HF order: k then p). logits: [B, V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_l, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_l.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _gather_vocab(local: torch.Tensor, group) -> torch.Tensor:
    """[B, V/tp] shards -> [B, V] on every rank (tp-rank order = vocabulary order)."""
    parts = [torch.empty_like(local) for _ in range(comm.group_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _fusable(model: nn.Module) -> bool:
    """True when every decoder layer is aligner's own (q/k/v, o, gate/up, down as Column/Row
    ParallelLinear, RMSNorm norms) without sequence parallelism: the layers :func:`_pack_weights` can pack."""
    for layer in model.model.layers.values():
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        cols = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj")] + [getattr(m, n, None) for n in ("gate_proj", "up_proj")]
        rows = [getattr(a, "o_proj", None), getattr(m, "down_proj", None)]
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        if not (
            all(type(c) is ColumnParallelLinear for c in cols)
            and all(type(r) is RowParallelLinear for r in rows)
            and all(isinstance(n, RMSNorm) for n in norms)
        ):
            return False
        if any(l.sequence_parallel for l in cols + rows):
            return False
    return True


def _pack_weights(model: nn.Module, device: torch.device, *, transposed: bool, fuse: bool) -> None:
    """Lay the engine's weights out for decode on `device`, in place (the Parameter objects stay).

    - fuse: each layer's q/k/v weights (and biases) become the row blocks of one tensor
      [(h + 2 kvh) * hd / tp, H], and gate/up those of one [2 I / tp, H] (the local shards under
      TP); the parameters are views into it, so refit's ``copy_`` into ``q_proj.weight`` writes
      the fused tensor that decode multiplies by (one GEMM instead of three, vLLM's
      QKVParallelLinear idea; :func:`aligner.nn.layers.pack_linears`). The grouping is kept on
      the modules, so engines sharing a model agree.
    - transposed (the CPU): every linear weight [out, in] is the transposed view of contiguous
      [in, out] storage, so ``F.linear(x, W)`` runs the GEMM x @ W^T in MKL's no-transpose form,
      up to 2x faster at decode batch sizes (development CPU, lm_head 32000 x 256 at batch 8:
      0.91 vs 1.84 ms). Weights shared with another module (a tied lm_head / embedding) keep
      their layout.
    Every other parameter and buffer moves to `device`. Calling it again (another engine on
    the same model, offload / onload) re-packs from the current values.
    """
    linear = (ColumnParallelLinear, RowParallelLinear)
    shared = {id(p) for m in model.modules() if not isinstance(m, linear) for p in m._parameters.values() if p is not None}
    done: set[int] = set()
    with torch.no_grad():
        unpack_linears(model)
        if fuse:
            for layer in model.model.layers.values():
                a, m = layer.self_attn, layer.mlp
                for group in ((a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)):
                    pack_linears(group, device, transposed)
                    done |= {id(l.weight) for l in group} | {id(l.bias) for l in group if l.bias is not None}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None or id(p) in done:
                    continue
                done.add(id(p))
                if transposed and name == "weight" and isinstance(module, linear) and id(p) not in shared:
                    p.data = p.data.to(device).t().contiguous().t()
                else:
                    p.data = p.data.to(device)
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)


def _param_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """HF name -> (owning module, attribute), tied parameters under both names."""
    slots = {}
    for mname, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is not None:
                slots[f"{mname}.{pname}" if mname else pname] = (module, pname)
    return slots


def _to_local(module: nn.Module, pname: str, full: torch.Tensor) -> torch.Tensor:
    """Slice a full tensor down to this rank's shard with the layer's own rule."""
    if isinstance(module, ParallelLayer):
        return module.full_to_local(pname, full)
    return full
