"""TorchEngine: batched generation with aligner's own Llama and a static KV cache.

Owns: left-padded batched prefill + decode over :class:`aligner.model.llama.KVCache`,
greedy / temperature / top-k / top-p sampling with per-request seeds, stop tokens,
rollout log-probs, the HF-named weight update, tensor- and pipeline-parallel generation
in the engine's own layout, and CUDA-graph decode on GPU.

How a batch runs:
- prompts are left-padded to the longest P; one cache of P + max_new_tokens slots is
  preallocated; slot j holds the same column j for every row.
- positions per row are ``cumsum(valid) - 1`` (so padding never shifts RoPE); the mask is
  causal AND key-valid, built once per forward (not per layer). Padding queries attend to
  themselves only, so no softmax row is empty (no NaN leaks through 0 * NaN into real rows).
- decode reads the cache sliced to the slots written so far (CPU) or the whole cache with a
  key mask (CUDA graphs, static shapes).

Sampling choices (documented simplifications):
- Under TP the last position's logits [B, V/tp] are all-gathered to [B, V] on every tp rank
  (only the last position, once per step: B * V floats), and every rank samples the same
  token with identically seeded generators. This keeps tokens independent of the tp layout
  (tp 1 and tp 2 give the same tokens for the same seeds). Log-probs never need the gather:
  they come from :func:`aligner.parallel.vocab.vocab_parallel_log_probs` on the local shard,
  the same function the trainer uses.
- Sampling is Gumbel-max: token = argmax(logits / T + Gumbel noise) over the tokens top-k /
  top-p keep. Each seeded row draws its own V uniforms per step from its own
  ``torch.Generator``, so a row's tokens depend on its seed and the weights only, not on the
  other rows of the batch.
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
from aligner.parallel import comm
from aligner.parallel.layers import ParallelLayer
from aligner.parallel.vocab import vocab_parallel_log_probs
from aligner.rollout.base import Generation, RolloutEngine, check_prompts, check_sampling


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
        self.vocab_start = self.tp_rank * (self.cfg.vocab_size // self.tp_size)
        self.weight_version = 0
        self.cuda_graphs = cuda_graphs
        self._rng_seed = seed
        self._calls = 0
        self._graphs: dict[tuple[int, int], "_DecodeGraph"] = {}
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
                    raise ValueError(f"update_weights: unknown parameter name {name!r}; expected HF Llama names such as 'model.layers.0.self_attn.q_proj.weight'")
                slot = self._params.get(name)
                if slot is None:
                    continue  # another pipeline stage owns it
                module, pname = slot
                param = getattr(module, pname)
                local = tensor if tensor.shape == param.shape else _to_local(module, pname, tensor)
                if local.shape != param.shape:
                    raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}; expected the full shape or this rank's shard {tuple(param.shape)}")
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
        for p in self.model.parameters():
            p.data = p.data.to("cpu")
        torch.cuda.empty_cache()
        self._offloaded_device = torch.device("cuda", torch.cuda.current_device())

    def onload(self) -> None:
        """Move parameters back to the device they were offloaded from (no-op otherwise)."""
        dev = getattr(self, "_offloaded_device", None)
        if dev is None:
            return
        for p in self.model.parameters():
            p.data = p.data.to(dev)
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
        sampler = _Sampler(sampling, seeds, b, self.cfg.vocab_size, dev, self._rng_seed * 1_000_003 + self._calls * 7919 + offset)
        stop = sorted({*sampling.stop_token_ids, *([] if self.eos_token_id is None else [self.eos_token_id])})
        stop_t = torch.tensor(stop, dtype=torch.long, device=dev)
        graph = self._graph_for(b, total) if self._use_graphs() else None
        cache = graph.cache if graph is not None else self.new_cache(b, total)

        # prefill
        pos = (valid[:, :p].long().cumsum(-1) - 1).clamp(min=0)
        eye = torch.eye(p, dtype=torch.bool, device=dev)
        mask = ((torch.ones(p, p, dtype=torch.bool, device=dev).tril() & valid[:, None, :p]) | eye).unsqueeze(1)
        cache.length = p
        logits = self._forward(ids, pos, mask, cache, torch.arange(p, device=dev))
        tok, lp = self._sample(logits, sampler)
        tokens, log_probs = [tok], [lp]
        finished = torch.isin(tok, stop_t)
        for step in range(1, n_new):
            if bool(finished.all()):
                break
            slot = p + step - 1
            pos = (lens + step - 1).unsqueeze(1)
            if graph is not None:
                logits = graph.run(tok, pos, valid, slot)
            else:
                cache.length = slot + 1
                logits = self._forward(tok.unsqueeze(1), pos, valid[:, None, None, : slot + 1], cache, torch.tensor([slot], device=dev))
            tok, lp = self._sample(logits, sampler)
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

    def _sample(self, logits: Optional[torch.Tensor], sampler: "_Sampler") -> tuple[torch.Tensor, torch.Tensor]:
        """Local logits [B, V/tp] on the last stage -> (tokens [B] int64, log_probs [B] fp32) on every rank."""
        if self.is_last:
            full = logits if self.tp_size == 1 else _gather_vocab(logits, self.tp_group)
            tok = sampler.sample(full)
            temp = sampler.temperature if sampler.temperature > 0 else 1.0
            lp = vocab_parallel_log_probs(logits.unsqueeze(1), tok.unsqueeze(1), self.tp_group, self.vocab_start, temp).squeeze(1)
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

    def _graph_for(self, batch: int, total: int) -> "_DecodeGraph":
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
        self.mask = torch.zeros(batch, 1, 1, total, dtype=torch.bool, device=dev)
        self.mask[..., -1] = True
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
        return self.engine._forward(self.tok, self.pos, self.mask, self.cache, self.slot)

    def run(self, tok: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, slot: int) -> torch.Tensor:
        """tok [B], pos [B, 1], valid [B, total] bool, slot int -> local logits [B, V/tp] (a copy)."""
        self.tok.copy_(tok.unsqueeze(1))
        self.pos.copy_(pos)
        self.slot.fill_(slot)
        m = valid.clone()
        m[:, slot + 1 :] = False
        self.mask.copy_(m[:, None, None, :])
        self.graph.replay()
        return self.out.clone()


class _Sampler:
    """Per-step token choice: greedy, or Gumbel-max under temperature / top-k / top-p.

    Seeded rows each own a torch.Generator and draw V uniforms per step whatever the batch.
    """

    def __init__(self, sampling, seeds: Optional[list[int]], batch: int, vocab: int, device, fallback_seed: int):
        self.temperature = float(sampling.temperature)
        self.top_k, self.top_p = int(sampling.top_k), float(sampling.top_p)
        self.batch, self.vocab, self.device = batch, vocab, device
        self.greedy = self.temperature == 0
        if seeds is None:
            self.gens = [torch.Generator(device=device).manual_seed(fallback_seed % (2**63))]
        else:
            self.gens = [torch.Generator(device=device).manual_seed(int(s) % (2**63)) for s in seeds]
        self.noise = torch.empty(batch, vocab, device=device)

    def skip(self) -> torch.Tensor:
        """Off the last stage: no token yet (filled by the broadcast)."""
        return torch.empty(self.batch, dtype=torch.long, device=self.device)

    def _draw(self) -> torch.Tensor:
        if len(self.gens) == 1 and self.batch != 1:
            self.noise.uniform_(generator=self.gens[0])
        else:
            for i, g in enumerate(self.gens):
                self.noise[i].uniform_(generator=g)
        return -torch.log(-torch.log(self.noise.clamp_min(torch.finfo(torch.float32).tiny)))

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] fp32 (full vocabulary) -> tokens [B] int64."""
        if self.greedy:
            return logits.argmax(-1)
        scaled = logits / self.temperature
        scaled = _filter_top_k_top_p(scaled, self.top_k, self.top_p)
        return (scaled + self._draw()).argmax(-1)


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
