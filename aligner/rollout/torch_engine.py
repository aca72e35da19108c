"""TorchEngine: generation with aligner's own Llama, continuous batching over a slot pool.

Owns: the two schedulers' execution, greedy / temperature / top-k / top-p sampling with
per-request seeds, stop tokens, rollout log-probs, the HF-named weight update, tensor- and
pipeline-parallel generation in the engine's own layout, the CPU weight layout chosen by
measurement (:func:`choose_cpu_layout`), and CUDA-graph decode on GPU for the static scheduler
(run on an H100, 2026-11-22: tests/rollout/test_trtllm_engine_gpu.py and benchmarks/generation.py
--gpu; TP/PP engines and the continuous scheduler have not run on a GPU, only on the CPU / gloo).

The continuous scheduler (default; Orca-style iteration-level scheduling, scheduling in
:mod:`aligner.rollout.scheduler`): every request of a generate() call waits in one queue; a
pool of ``max_batch_size`` KV-cache rows (:class:`SlotKVCache`, no padding: a row's position
is its cache slot) decodes the live requests one token per step; a row that stops (stop token
or its own max_new_tokens) is refilled with the next request between two decode steps: its
prompt minus the last token is prefilled (batched with the other new prompts, right-padded)
or, when a live row already holds the same prompt, copied from it; the last prompt token
then runs in the next decode step with everybody else's. With pp > 1 the pool is split into
``micro_batches`` blocks and stage 0 keeps one block's step in flight per stage
(:class:`_StageLink`): while stage 1 runs block 0, stage 0 runs block 1.

Determinism: a request's uniforms come from its own seed (:class:`_Sampler`), so its tokens
depend on its prompt, seed and the weights only: not on the other requests, their order, its
slot or when it was admitted, up to GEMM rounding. The GEMMs of a decode step see a batch
whose size and composition depend on the schedule, and CPU BLAS kernels may round the last
bits differently with M: log-probs agree within 1e-5 (fp32) across schedules (tests), and a
token could differ only where two candidates' probabilities are within that rounding (never
seen in the tests nor on the real-model benchmark). Batch-invariant kernels were not built.

The static scheduler (``scheduler="static"``, the first engine) runs batches of
max_batch_size prompts:
How a batch runs:
- prompts are left-padded to the longest P; one cache of P + max_new_tokens slots is
  preallocated; slot j holds the same column j for every row.
- positions per row are ``cumsum(valid) - 1`` (so padding never shifts RoPE); the mask is
  causal AND key-valid, built once per forward (not per layer). Padding queries attend to
  themselves only, so no softmax row is empty (no NaN leaks through 0 * NaN into real rows).
- decode reads the cache sliced to the slots written so far (CPU) or the whole cache with a
  key mask (CUDA graphs, static shapes).

Both schedulers run the model's own modules (:mod:`aligner.model.llama` with a KVCache or a
SlotKVCache): there is one decoder forward in aligner. Its inference fast paths live in the
building blocks: packed q/k/v and gate/up GEMMs (:func:`aligner.nn.layers.pack_linears`), the
residual add inside the o / down GEMM, fp32 RMSNorm in one kernel, GQA decode without repeated
k/v. On the CPU, the GEMM kernel (``F.linear``, i.e. MKL, or oneDNN on weights prepacked for the
decode batch), whether weights are stored [in, out] and whether q/k/v and gate/up are packed is
timed on the machine at engine build (``cpu_layout="auto"``; see :func:`choose_cpu_layout`). The
packed parameters are views, so refit is unchanged; the oneDNN copies are re-packed at every
``finish_weight_update``.

Compiled decode (``compile``, :func:`compile_decode`): each decoder layer is torch.compile'd in
place (torchtitan's per-block compile), so prefill and decode run inductor's kernels for the
same modules; weights stay graph inputs, so refit's in-place copies reach it. "on" compiles (on
CUDA with inductor's CUDA graphs, except inside the static scheduler's own: that path has not
run, no GPU was available); "auto" (the default) does not compile yet on either device: on the
development CPU compiled decode was no faster than this eager path (1.0x on the tiny benchmark
model, 0.74-0.90x on SmolLM2 after 215-509 s of compiling; benchmarks/RESULTS.md), so the
hand-written fused paths above stay, and on CUDA it stays eager until the gpu-marked test has
run. No per-machine compile timing was built.

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

Mixture of Experts: for a model with :class:`aligner.model.moe.SparseMoE` layers every
Generation carries ``routed_experts`` [R, L, k] int16: for response token i, the top-k experts
(sorted) each MoE layer chose at the position whose logits produced it (prompt_len + i - 1: the
decode row that consumed the previous token, or, in the static scheduler, the last prompt
token's prefill row for i = 0), read from the layers' ``last_experts`` after each forward. The
continuous scheduler writes them into a [requests, max budget, L_local, k] buffer indexed by the
decode rows' (request, step); with pp > 1 each stage records its own layers and the stages'
parts are all-gathered over the pp group at the end of the call (layer order). Dense models skip
all of it. The trainer's side and the metric: :meth:`aligner.actor.policy.Policy.log_probs_with_routing`,
:func:`aligner.model.moe.routing_mismatch`.

PP (static): stage s receives hidden states [B, T, H] from stage s-1 (``dist.recv`` on the pp
group), runs its layers and sends to s+1; the last stage samples and broadcasts the tokens and
log-probs to every stage, so all ranks return the same Generations. PP (continuous): see
:class:`_StageLink`; stage 0 broadcasts the finished Generations at the end of the call.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from aligner.model.llama import KVCache, build_model
from aligner.model.moe import moe_layers, stack_routing
from aligner.nn import comm
from aligner.nn.layers import (
    ColumnParallelLinear,
    ParallelLayer,
    RMSNorm,
    RowParallelLinear,
    drop_onednn,
    onednn_available,
    onednn_linear,
    onednn_pack,
    pack_linears,
    prepack_onednn,
    unpack_linears,
)
from aligner.parallel.parallelize import emulate_eager_rounding
from aligner.rollout import cpu_kernels
from aligner.rollout.base import Generation, RolloutEngine, check_budgets, check_prompts, check_sampling
from aligner.rollout.cpu_kernels import check_decode_lengths, decode_attention, load_decode_attention
from aligner.rollout.scheduler import SlotScheduler, StepPlan
from aligner.runtime.host import keep_freed_host_memory

SCHEDULERS = ("continuous", "static")
CPU_LAYOUTS = ("auto", "in_out", "out_in", "onednn")
COMPILE_MODES = ("auto", "on", "off")
DECODE_ATTENTION = ("auto", "sdpa", "varlen")


class TorchEngine(RolloutEngine):
    """Generation with a (possibly TP-sharded, possibly PP-pruned) aligner LlamaForCausalLM.

    Args:
        model: aligner LlamaForCausalLM; already sharded with apply_tensor_parallel over
            `tp_group` and/or pruned to this pp stage when those groups are given.
        eos_token_id: stop token besides sampling.stop_token_ids (None: none).
        tp_group: the engine's tensor-parallel group (None: no TP).
        pp_group: the engine's pipeline group; stage index = rank in it (None: no PP).
        max_batch_size: prompts per batch (static); KV-cache slots (continuous): each of the
            ``micro_batches`` blocks gets max_batch_size // micro_batches of them (at least 1).
        cuda_graphs: capture the decode step in CUDA graphs (static scheduler, on cuda, pp = 1).
        seed: seed of the engine RNG used when generate() gets no seeds.
        fused_decode: pack each layer's q/k/v and gate/up weights so each group runs as one GEMM
            (:func:`aligner.nn.layers.pack_linears`). None (default): on CUDA off (packing and
            CUDA graphs of it have not run there: tests/rollout/test_trtllm_engine_gpu.py checks
            it); on the CPU chosen with the weight layout by measurement (``cpu_layout``).
            Ignored for models whose layers are not aligner's own (e.g. Transformer Engine
            modules) or that use sequence parallelism.
        scheduler: "continuous" (default): a pool of max_batch_size KV-cache slots refilled as
            responses stop, shared prompt prefixes, pipelined PP decode
            (:mod:`aligner.rollout.scheduler`); "static": batches of max_batch_size prompts
            left-padded and decoded until their longest response ends (the first engine, kept
            for comparison and for CUDA-graph decode).
        micro_batches: continuous scheduler only: blocks the slot pool is split into; with
            pp > 1 every stage works on one block while the next stage works on another
            (None: pp_size; 1 with pp > 1 runs the stages one after the other).
        cpu_layout: on the CPU, how linear weights are stored and multiplied for decode:
            "auto" (default) times a decode step's GEMMs with every (kernel, layout, fused)
            combination on this machine and keeps the fastest, once per machine and model
            shape (:func:`cached_cpu_layout`; ``self.layout`` holds the timings);
            "in_out" stores every weight [in, out] (transposed view, MKL's no-transpose GEMM),
            "out_in" keeps PyTorch's [out, in]; "onednn" multiplies by oneDNN-prepacked copies
            of the weights (:func:`aligner.nn.layers.prepack_onednn`: twice the bytes of the
            linear weights; re-packed at every ``finish_weight_update``).
        compile: torch.compile each decoder layer's forward for prefill and decode
            (:func:`compile_decode`): "on", "off", or "auto" (default): eager for now on both
            devices: measured no faster than eager on the CPU (benchmarks/RESULTS.md, "Compiled
            decode and training"), and not yet run on CUDA; no per-machine timing is done for it.
        decode_attention: the continuous scheduler's one-token attention: "sdpa" (PyTorch's,
            every row reads the keys up to the block's longest context under a mask), "varlen"
            (fp32 on the CPU: :func:`aligner.rollout.cpu_kernels.decode_attention`, a C kernel built
            on this machine at first use, each row reading its own keys only) or "auto"
            (default): on the CPU in fp32 the faster of the two, timed once per machine and
            shape (:func:`cached_decode_attention`; ``self.layout["attention"]`` holds the
            timings), "sdpa" elsewhere and where the kernel cannot be built (no C compiler).
            The static scheduler always runs SDPA.
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
        scheduler: str = "continuous",
        micro_batches: Optional[int] = None,
        cpu_layout: str = "auto",
        compile: str = "auto",
        decode_attention: str = "auto",
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} is invalid: must be >= 1")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={scheduler!r} is invalid: valid are {', '.join(SCHEDULERS)}")
        if cpu_layout not in CPU_LAYOUTS:
            raise ValueError(f"cpu_layout={cpu_layout!r} is invalid: valid are {', '.join(CPU_LAYOUTS)}")
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile={compile!r} is invalid: valid are {', '.join(COMPILE_MODES)}")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r} is invalid: valid are {', '.join(DECODE_ATTENTION)}")
        self.model = model.eval()
        self.cfg = model.cfg
        self.eos_token_id = eos_token_id
        self.tp_group, self.pp_group = tp_group, pp_group
        self.tp_size, self.tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.pp_size, self.pp_rank = comm.group_size(pp_group), comm.group_rank(pp_group)
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.max_batch_size = max_batch_size
        self.scheduler = scheduler
        self.micro_batches = self.pp_size if micro_batches is None else micro_batches
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches} is invalid: must be >= 1")
        self.weight_version = 0
        self.cuda_graphs = cuda_graphs
        self._rng_seed = seed
        self._calls = 0
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self.last_stats: dict[str, float] = {}
        if self.device.type == "cpu":
            keep_freed_host_memory()
        fusable = _fusable(model)
        on_cpu = self.device.type == "cpu"
        transposed = on_cpu and cpu_layout == "in_out"
        kernel = "onednn" if on_cpu and cpu_layout == "onednn" else "aten"
        if kernel == "onednn" and not onednn_available():
            raise ValueError("cpu_layout='onednn' is invalid here: this torch build has no oneDNN linear ops; use auto, in_out or out_in")
        self.layout: dict[str, Any] = {}
        self._pack_batch = max(1, max_batch_size // self.micro_batches)  # the decode batch each step runs
        if on_cpu and cpu_layout == "auto":
            chosen = cached_cpu_layout(model, self._pack_batch, fusable)
            kernel, transposed, self.layout = chosen.kernel, chosen.transposed, dict(chosen.info)
            fused_decode = chosen.fused if fused_decode is None else fused_decode
        if fused_decode is None:
            fused_decode = on_cpu
        self.fused_decode = fused_decode and fusable
        self.transposed = transposed
        self.kernel = kernel
        self.layout.update(kernel=kernel, transposed=transposed, fused=self.fused_decode)
        varlen_here = on_cpu and self.dtype == torch.float32
        if decode_attention == "varlen":
            if not varlen_here:
                raise ValueError("decode_attention='varlen' is invalid here: the kernel takes fp32 on the CPU; use auto or sdpa")
            if load_decode_attention() is None:
                raise ValueError(f"decode_attention='varlen' is unavailable here ({cpu_kernels.LOAD_ERROR}); use auto or sdpa")
        elif decode_attention == "auto":
            decode_attention = "sdpa"
            if varlen_here and load_decode_attention() is not None:
                timed = cached_decode_attention(model, self._pack_batch)
                decode_attention, self.layout["attention"] = timed["choice"], timed
        self.decode_attention = decode_attention
        _pack_weights(model, self.device, transposed=transposed, fuse=self.fused_decode)  # before the slots
        self._repack()
        self._params = _param_slots(model)
        self.compiled = compile == "on"  # "auto": eager until compiled decode is measured faster (module docstring)
        if self.compiled:
            # the static scheduler's own CUDA graphs capture the compiled kernels; elsewhere on CUDA
            # inductor's CUDA graphs (reduce-overhead) replay them
            own_graphs = scheduler == "static" and self._use_graphs()
            compile_decode(model, cuda_graphs=self.device.type == "cuda" and not own_graphs)
        self._full_names = {n for n, _ in build_model(self.cfg, device="meta").named_parameters(remove_duplicate=False)}
        self._received: set[str] = set()
        self._offloaded: list[torch.Tensor] = []
        # Mixture of Experts: every response token's top-k experts per MoE layer (Generation.routed_experts)
        self._moe = moe_layers(model)
        self._routing: Optional[torch.Tensor] = None  # the continuous call's [requests, max budget, L_local, k]

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
                self._stale = True

    def _repack(self) -> None:
        """Refresh the oneDNN-prepacked weight copies from the parameters (kernel "onednn"), or
        drop any copies an earlier engine on the same model left (kernel "aten")."""
        if self.kernel == "onednn":
            prepack_onednn(self.model, self._pack_batch)
        else:
            drop_onednn(self.model)
        self._stale = False

    def finish_weight_update(self) -> None:
        """Bump weight_version; re-pack the oneDNN weight copies (kernel "onednn"; the parameters
        themselves are copied in place, so CUDA graphs and compiled layers stay valid)."""
        self._repack()
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
    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: Any,
        seeds: Optional[list[int]] = None,
        max_new_tokens: Optional[Sequence[int]] = None,
    ) -> list[Generation]:
        """Sample one response per prompt (see the module docstring for the sampling semantics).

        Args:
            prompt_ids: list[list[int]], B non-empty prompts of ragged length.
            sampling: SamplingConfig-like (temperature >= 0, top_k >= 0, top_p in (0, 1],
                max_new_tokens >= 1, stop_token_ids).
            seeds: list[int] of length B (per-request generators) or None (engine RNG).
            max_new_tokens: list[int] of length B, each request's own budget (None: every
                request gets sampling.max_new_tokens).
        Returns:
            list[Generation] of length B, in prompt order; rollout_log_probs fp32 per response
            token. ``self.last_stats`` then holds the call's counters (prompt tokens, tokens
            prefilled, shared-prefix tokens, decode steps and rows, generated tokens).
        Raises:
            ValueError: bad sampling parameters, empty prompt, token id outside the vocabulary,
                a budget < 1, or a prompt + its budget > model.max_seq_len.
        """
        check_sampling(sampling)
        check_prompts(prompt_ids, seeds, self.cfg.vocab_size)
        budgets = check_budgets(prompt_ids, sampling, max_new_tokens, self.cfg.max_seq_len)
        self._calls += 1
        fallback = self._rng_seed * 1_000_003 + self._calls * 7919
        sampler = _Sampler(sampling, seeds, budgets, self.device, fallback)
        stop = sorted({*sampling.stop_token_ids, *([] if self.eos_token_id is None else [self.eos_token_id])})
        if self._stale:  # update_weights without finish_weight_update: the prepacked copies would be old
            self._repack()
        with torch.inference_mode():
            if self.scheduler == "continuous":
                return self._generate_continuous(prompt_ids, budgets, sampler, stop)
            out: list[Generation] = []
            for s in range(0, len(prompt_ids), self.max_batch_size):
                chunk = range(s, min(len(prompt_ids), s + self.max_batch_size))
                out.extend(self._generate_batch([prompt_ids[i] for i in chunk], [budgets[i] for i in chunk], sampler, chunk, stop))
            n_prompt = sum(len(p) for p in prompt_ids)
            self.last_stats = {
                "prompt_tokens": n_prompt,
                "prefilled_tokens": n_prompt,
                "generated_tokens": sum(len(g.token_ids) for g in out),
            }
            return out

    # ---- the static scheduler -----------------------------------------------------------
    def _generate_batch(self, prompts, budgets: list[int], sampler: _Sampler, requests: range, stop: list[int]) -> list[Generation]:
        dev = self.device
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
        # MoE: the experts of the position that produces each token (the last prompt token's row here);
        # not with CUDA graphs (an MoE decode step syncs with the host, so it is never captured)
        routing = [self._stage_routing().view(b, p, len(self._moe), -1)[:, -1]] if self._moe and graph is None else None
        step_t = torch.zeros(b, dtype=torch.long, device=dev)
        tok, lp = self._sample(logits, sampler, req, step_t)
        tokens, log_probs = [tok], [lp]
        finished = torch.isin(tok, stop_t) | (budget_t <= 1)
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
            if routing is not None:
                routing.append(self._stage_routing())
            tok, lp = self._sample(logits, sampler, req, step_t + step)  # draws past a budget are cut below
            tokens.append(tok)
            log_probs.append(lp)
            finished = finished | torch.isin(tok, stop_t) | (budget_t <= step + 1)
        gens = self._to_generations(torch.stack(tokens, 1).cpu(), torch.stack(log_probs, 1).float().cpu(), stop)
        for g, n in zip(gens, budgets):
            if len(g.token_ids) > n:
                g.token_ids, g.rollout_log_probs, g.finish_reason = g.token_ids[:n], g.rollout_log_probs[:n], "length"
        if routing is not None:
            self._attach_routing(gens, torch.stack(routing, 1))
        return gens

    # ---- the continuous scheduler -------------------------------------------------------
    def _generate_continuous(self, prompts: list[list[int]], budgets: list[int], sampler: _Sampler, stop: list[int]) -> list[Generation]:
        """Iteration-level scheduling over a slot pool (:class:`SlotScheduler`); with pp > 1 the
        first stage schedules and sends each step down the pipeline with its hidden states, the
        last stage samples and sends the tokens back, and ``micro_batches`` steps are in flight."""
        m = self.micro_batches
        capacity = max(1, min(self.max_batch_size // m, -(-len(prompts) // m)))  # no more slots than requests
        max_len = max(len(p) + n for p, n in zip(prompts, budgets))
        # allocated per call and freed at its end: the actor trains in the same process between calls
        pool = SlotKVCache(
            self._local_layers(),
            capacity * m,
            self._kv_heads_local(),
            max_len,
            self.cfg.resolved_head_dim,
            self.dtype,
            self.device,
            varlen=self.decode_attention == "varlen",
        )
        self._routing = None
        if self._moe:
            k = self._moe[0].top_k
            self._routing = torch.full((len(prompts), max(budgets), len(self._moe), k), -1, dtype=torch.int16, device=self.device)
        if not self.is_first:
            self._serve_stage(pool, sampler)
            self._attach_routing(None, self._routing)
            self._routing = None
            return self._broadcast_generations(None)  # sets last_stats too
        sched = SlotScheduler(prompts, budgets, capacity, m, stop)
        link = _StageLink(self) if self.pp_size > 1 else None
        in_flight: deque[tuple[int, int]] = deque()  # (micro-batch, rows) sent down the pipeline
        mb = 0
        while True:
            if in_flight and in_flight[0][0] == mb:
                _, n = in_flight.popleft()
                sched.apply(mb, *link.recv_tokens(n))
            if sched.done():
                break
            plan = sched.plan(mb)
            if plan is not None:
                if link is None:
                    tok, lp = self._run_plan(plan, pool, sampler, None)
                    sched.apply(mb, tok.tolist(), lp.tolist())
                else:
                    self._run_plan(plan, pool, sampler, link)
                    in_flight.append((mb, plan.n))
            mb = (mb + 1) % m
        if link is not None:
            link.send_stop()
            link.wait()
        stop_set = set(stop)
        gens = [Generation(t, lp, "stop" if t and t[-1] in stop_set else "length", self.weight_version) for t, lp in sched.outputs]
        self._attach_routing(gens, self._routing)
        self._routing = None
        self.last_stats = {**sched.stats(), "generated_tokens": sum(len(g.token_ids) for g in gens)}
        return self._broadcast_generations(gens) if self.pp_size > 1 else gens

    def _run_plan(self, plan: StepPlan, pool: SlotKVCache, sampler: _Sampler, link: Optional[_StageLink]):
        """Stage 0: run one StepPlan on this stage and send it on (pp > 1), or sample (pp = 1):
        (tokens [n], log_probs [n]) when this stage is also the last."""
        dev = self.device
        prefill_x = None
        if plan.prefill_rows:
            t = max(len(x) for x in plan.prefill_ids)
            prefill_x = torch.zeros(len(plan.prefill_ids), t, dtype=torch.long)
            for i, x in enumerate(plan.prefill_ids):
                prefill_x[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            prefill_x = prefill_x.to(dev)
        decode_x = torch.tensor(plan.tokens, dtype=torch.long, device=dev).unsqueeze(1)
        meta = _plan_meta(plan, prefill_x.shape[1] if prefill_x is not None else 0)
        return self._stage_step(meta, prefill_x, decode_x, pool, sampler, link)

    def _serve_stage(self, pool: SlotKVCache, sampler: _Sampler) -> None:
        """Stages after the first: run every plan the previous stage sends until it sends stop."""
        link = _StageLink(self)
        while True:
            got = link.recv_plan()
            if got is None:
                break
            self._stage_step(*got, pool, sampler, link)
        link.send_stop()
        link.wait()

    def _stage_step(self, meta: _PlanMeta, prefill_x, decode_x, pool: SlotKVCache, sampler: _Sampler, link: Optional[_StageLink]):
        """Execute a plan on this stage: prefill, copies, moves, decode (scheduler.py's order)."""
        dev = self.device
        trunk = self.model.model
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
        positions = meta.positions.to(dev)
        length = int(meta.positions.max()) + 1
        mask = None  # the varlen kernel reads each row's own length from the pool: no mask to build
        if not pool.varlen and not bool((meta.positions == length - 1).all()):
            mask = (torch.arange(length, device=dev) <= positions.unsqueeze(1))[:, None, None, :]
        pool.plan_decode(meta.start, positions, length)
        h = trunk(decode_x, position_ids=positions.unsqueeze(1), attn_mask=mask, kv_cache=pool)
        if self._routing is not None:  # decode row j produced token steps[j] of request requests[j]
            self._routing[meta.requests.to(dev), meta.steps.to(dev)] = self._stage_routing()
        if not self.is_last:
            link.send_plan(meta, prefill_h, h)
            return None
        logits = self.model.lm_head(h[:, -1]).float()
        tok, lp = self._sample_last_stage(logits, sampler, meta.requests.to(dev), meta.steps.to(dev))
        if link is not None:
            link.send_tokens(tok, lp)
            return None
        return tok.cpu(), lp.float().cpu()

    def _stage_routing(self) -> torch.Tensor:
        """This stage's MoE layers' experts in the last forward: [N, L_local, k] int16, sorted along k."""
        return stack_routing([m.last_experts for m in self._moe])

    def _attach_routing(self, gens: Optional[list[Generation]], routing: Optional[torch.Tensor]) -> None:
        """Set each Generation's routed_experts [R, L, k] from routing [B, >= R, L_local, k] (request
        order, this stage's layers). With pp > 1 every stage calls it (a collective): the stages'
        layers are gathered over the pp group and concatenated in stage (= layer) order; gens may be
        None on a stage that does not build them."""
        if routing is None:
            return
        routing = routing.cpu()
        if self.pp_size > 1:
            parts: list = [None] * self.pp_size
            dist.all_gather_object(parts, routing, group=self.pp_group)
            routing = torch.cat(parts, dim=2)
        for g, r in zip(gens or [], routing):
            g.routed_experts = r[: len(g.token_ids)].clone()

    def _broadcast_generations(self, gens: Optional[list[Generation]]) -> list[Generation]:
        """Stage 0's Generations and last_stats on every pipeline stage (one object broadcast over the pp group)."""
        box = [(gens, self.last_stats)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
        gens, self.last_stats = box[0]
        return gens

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

    def _sample_last_stage(self, logits: torch.Tensor, sampler: _Sampler, requests: torch.Tensor, steps: torch.Tensor):
        """Local logits [n, V/tp] fp32 of requests [n] at response steps [n] -> (tokens [n] int64,
        log_probs [n] fp32), the same on every tp rank (the vocabulary is gathered first)."""
        full = logits if self.tp_size == 1 else _gather_vocab(logits, self.tp_group)
        return sampler.sample(full, sampler.draws(requests, steps))

    def _sample(self, logits: Optional[torch.Tensor], sampler: _Sampler, requests: torch.Tensor, steps: torch.Tensor):
        """Local logits [B, V/tp] on the last stage -> (tokens [B] int64, log_probs [B] fp32) on every rank."""
        if self.is_last:
            tok, lp = self._sample_last_stage(logits, sampler, requests, steps)
        else:
            tok = torch.empty(requests.shape[0], dtype=torch.long, device=self.device)
            lp = torch.empty(requests.shape[0], dtype=torch.float32, device=self.device)
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


class SlotKVCache:
    """The continuous scheduler's KV cache: per local layer k, v [slots, kv_heads_local, max_len, hd].

    Row r holds one request at cache positions [0, its length) (no padding, position = slot).
    The engine sets what the next forward writes, then the model's attention calls
    :meth:`update` once per layer (the ``cache_positions`` it passes are ignored):
    - :meth:`plan_prefill` (rows [U]): write the new prompts' k/v [U, kvh, T, hd] at positions
      [0, T) of those rows; attention uses the prompts' own k/v (causal, right padding).
    - :meth:`plan_decode` (start, positions [n], length): write each row's one new k/v at its own
      position in rows [start, start + n); attention reads those rows' positions [0, length).
    Unwritten slots are zeros (finite), so masked keys never turn into NaN (with ``varlen`` they
    are left uninitialized: nothing reads them).
    varlen: a decode step runs :func:`aligner.rollout.cpu_kernels.decode_attention` (:meth:`attend`),
    which rotates q and k, stores k and v and reads each row's keys up to its own position only,
    instead of RoPE, :meth:`update` and SDPA over [0, length) with the engine's mask (fp32 CPU
    caches only).
    """

    def __init__(self, layers: list[int], slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device, varlen: bool = False):
        shape = (slots, kv_heads, max_len, head_dim)
        self.varlen = varlen and dtype == torch.float32 and torch.device(device).type == "cpu"
        alloc = torch.empty if self.varlen else torch.zeros  # varlen reads written positions only
        self.k = {i: alloc(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: alloc(shape, dtype=dtype, device=device) for i in layers}
        self.slots, self.max_len = slots, max_len
        self._decode = False
        self._rows = self._flat = self._lengths = None
        self._start = self._end = self._length = 0

    def plan_prefill(self, rows: torch.Tensor) -> None:
        self._decode, self._rows = False, rows

    def plan_decode(self, start: int, positions: torch.Tensor, length: int) -> None:
        n = positions.shape[0]
        self._decode, self._start, self._end, self._length = True, start, start + n, length
        if self.varlen:  # the kernel writes the new k/v itself, at lengths - 1
            self._lengths = (positions + 1).to(torch.int64).contiguous()
            check_decode_lengths(self._lengths, length)
            return
        kvh = next(iter(self.k.values())).shape[1]
        # each new k/v row's place in the cache seen as [slots * kvh * max_len, hd]: one index_copy_
        # per layer instead of advanced indexing over dims 0 and 2 (measured 99 us -> a few us a call)
        rows = torch.arange(start, start + n, device=positions.device).unsqueeze(1) * kvh + torch.arange(kvh, device=positions.device)
        self._flat = (rows * self.max_len + positions.unsqueeze(1)).reshape(-1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, _positions=None) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [rows, kvh, T, hd] -> the keys and values attention reads (see the class docstring).
        A decode step with ``varlen`` never gets here: :meth:`attend` stores its k, v."""
        ck, cv = self.k[layer], self.v[layer]
        if not self._decode:
            t = k.shape[2]
            ck[self._rows, :, :t] = k
            cv[self._rows, :, :t] = v
            return k, v
        hd = k.shape[-1]
        ck.view(-1, hd).index_copy_(0, self._flat, k.reshape(-1, hd))
        cv.view(-1, hd).index_copy_(0, self._flat, v.reshape(-1, hd))
        return ck[self._start : self._end, :, : self._length], cv[self._start : self._end, :, : self._length]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """A decode step with ``varlen`` (:class:`aligner.model.llama.KVCache`'s hook): the un-rotated
        q [n, 1, h, hd], k, v [n, 1, kvh, hd] and RoPE tables cos, sin [n, 1, hd] -> [n, 1, h, hd].
        One kernel call (:func:`aligner.rollout.cpu_kernels.decode_attention`) rotates q and k,
        writes k and v at each row's position and attends to its positions [0, position]. None
        otherwise (prefill, or varlen off: the model rotates, calls :meth:`update` and runs SDPA
        with the engine's mask)."""
        if not (self._decode and self.varlen):
            return None
        n, _, h, hd = q.shape
        kvh = k.shape[2]
        out = decode_attention(
            q.view(n, kvh, h // kvh, hd),
            self.k[layer][self._start : self._end, :, : self._length],
            self.v[layer][self._start : self._end, :, : self._length],
            self._lengths, hd**-0.5, checked=True, k_new=k[:, 0], v_new=v[:, 0], cos=cos[:, 0], sin=sin[:, 0],
        )  # fmt: skip
        return out.view(n, 1, h, hd)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Row dst's positions [0, length) := row src's, in every local layer."""
        for ck, cv in zip(self.k.values(), self.v.values()):
            ck[dst, :, :length] = ck[src, :, :length]
            cv[dst, :, :length] = cv[src, :, :length]


@dataclass
class _PlanMeta:
    """A StepPlan as tensors (what later pipeline stages need): int64 prefill_rows [U], copies and
    moves [k, 3] (src, dst, length), positions / requests / steps [n]; prefill_len T."""

    start: int
    prefill_len: int
    prefill_rows: torch.Tensor
    copies: torch.Tensor
    moves: torch.Tensor
    positions: torch.Tensor
    requests: torch.Tensor
    steps: torch.Tensor

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(header int64 [8], body int64 [...]) for the wire."""
        u, c, m, n = self.prefill_rows.numel(), self.copies.shape[0], self.moves.shape[0], self.positions.numel()
        header = torch.tensor([1, self.start, self.prefill_len, u, c, m, n, 0], dtype=torch.long)
        body = torch.cat([self.prefill_rows, self.copies.flatten(), self.moves.flatten(), self.positions, self.requests, self.steps])
        return header, body

    @staticmethod
    def decode(header: torch.Tensor, body: torch.Tensor) -> _PlanMeta:
        _, start, t, u, c, m, n, _ = header.tolist()
        parts = body.split([u, 3 * c, 3 * m, n, n, n])
        return _PlanMeta(start, t, parts[0], parts[1].view(c, 3), parts[2].view(m, 3), parts[3], parts[4], parts[5])


def _plan_meta(plan: StepPlan, prefill_len: int) -> _PlanMeta:
    def triples(x):
        return torch.tensor(x, dtype=torch.long).view(-1, 3)

    return _PlanMeta(
        plan.start,
        prefill_len,
        torch.tensor(plan.prefill_rows, dtype=torch.long),
        triples(plan.copies),
        triples(plan.moves),
        torch.tensor(plan.positions, dtype=torch.long),
        torch.tensor(plan.requests, dtype=torch.long),
        torch.tensor(plan.steps, dtype=torch.long),
    )


class _StageLink:
    """Point-to-point messages of the pipelined continuous engine over the pp group.

    Plans flow stage s -> s + 1 as (header [8], body, prefill hidden [U, T, H] when U > 0,
    decode hidden [n, 1, H]); the last stage sends (tokens [n] int64, log_probs [n] fp32) back
    to stage 0. Sends are non-blocking; a stage waits for its previous message before sending
    the next (so at most one message per link is unreceived, and no send cycle can deadlock).
    A header of zeros ends the call.
    """

    def __init__(self, engine: TorchEngine):
        self.group, self.dev = engine.pp_group, engine.device
        self.dtype, self.hidden = engine.dtype, engine.cfg.hidden_size
        rank, size = engine.pp_rank, engine.pp_size
        self.prev = dist.get_global_rank(self.group, rank - 1) if rank > 0 else None
        self.next = dist.get_global_rank(self.group, rank + 1) if rank < size - 1 else None
        self.first, self.last = dist.get_global_rank(self.group, 0), dist.get_global_rank(self.group, size - 1)
        self._sent: list = []

    def wait(self) -> None:
        for work, _ in self._sent:
            work.wait()
        self._sent = []

    def _send(self, tensors: list[torch.Tensor], dst: int) -> None:
        self.wait()
        self._sent = [(dist.isend(t.contiguous(), dst=dst, group=self.group), t) for t in tensors]

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.dev)
        dist.recv(t, src=src, group=self.group)
        return t

    def send_plan(self, meta: _PlanMeta, prefill_h: Optional[torch.Tensor], decode_h: torch.Tensor) -> None:
        header, body = meta.encode()
        self._send([header.to(self.dev), body.to(self.dev)] + ([prefill_h] if prefill_h is not None else []) + [decode_h], self.next)

    def recv_plan(self):
        """(meta, prefill hidden or None, decode hidden) from the previous stage, or None at the end."""
        header = self._recv((8,), torch.long, self.prev).cpu()
        if int(header[0]) == 0:
            return None
        u, c, m, n = (int(x) for x in header[3:7])
        body = self._recv((u + 3 * c + 3 * m + 3 * n,), torch.long, self.prev).cpu()
        meta = _PlanMeta.decode(header, body)
        prefill_h = self._recv((u, meta.prefill_len, self.hidden), self.dtype, self.prev) if u else None
        return meta, prefill_h, self._recv((n, 1, self.hidden), self.dtype, self.prev)

    def send_tokens(self, tok: torch.Tensor, lp: torch.Tensor) -> None:
        self._send([tok, lp.float()], self.first)

    def recv_tokens(self, n: int) -> tuple[list[int], list[float]]:
        tok = self._recv((n,), torch.long, self.last)
        lp = self._recv((n,), torch.float32, self.last)
        return tok.tolist(), lp.tolist()

    def send_stop(self) -> None:
        if self.next is not None:
            self._send([torch.zeros(8, dtype=torch.long, device=self.dev)], self.next)


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
        sampling: SamplingConfig-like. seeds: one seed per request, or None (one engine generator).
        lengths: draws per request (its max_new_tokens). fallback_seed: the engine generator's seed.
    Seeded request i draws its lengths[i] uniforms from its own torch.Generator up front, so its
    draws do not depend on the batch, slot or step at which it runs; unseeded requests take rows
    of one [B, max(lengths)] draw from the engine generator seeded per call.
    """

    def __init__(self, sampling, seeds: Optional[list[int]], lengths: list[int], device, fallback_seed: int):
        self.temperature = float(sampling.temperature)
        self.top_k, self.top_p = int(sampling.top_k), float(sampling.top_p)
        self.device = device
        self.greedy = self.temperature == 0
        self.uniforms: Optional[torch.Tensor] = None  # [B, max(lengths)] fp32 in [0, 1)
        if not self.greedy:
            width = max(lengths)
            if seeds is None:
                u = torch.rand(len(lengths), width, generator=torch.Generator().manual_seed(fallback_seed % (2**63)))
            else:
                u = torch.zeros(len(lengths), width)
                for i, (s, n) in enumerate(zip(seeds, lengths)):
                    u[i, :n] = torch.rand(n, generator=torch.Generator().manual_seed(int(s) % (2**63)))
            self.uniforms = u.to(device)

    def draws(self, requests: torch.Tensor, steps: torch.Tensor) -> Optional[torch.Tensor]:
        """requests, steps: [n] int64 -> each row's uniform [n] (None when greedy)."""
        return None if self.greedy else self.uniforms[requests, steps]

    def sample(self, logits: torch.Tensor, u: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, V] fp32 (full vocabulary), u: [B] uniforms (ignored when greedy) ->
        (tokens [B] int64, log_probs [B] fp32).

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
        tok = torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
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


def _dense_mlp(layer: nn.Module) -> tuple:
    """(gate_proj, up_proj, down_proj) of a dense SwiGLU layer; () for an MoE layer."""
    m = layer.mlp
    return (m.gate_proj, m.up_proj, m.down_proj) if hasattr(m, "gate_proj") else ()


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


LAYOUT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aligner" / "cpu_layout.json"


@dataclass(frozen=True)
class CpuLayout:
    """How the CPU engine multiplies by its linear weights (:func:`choose_cpu_layout`).

    kernel: "aten" (``F.linear``: MKL on x86 builds) or "onednn" (oneDNN's linear on a copy of
    each weight prepacked for the decode batch, :func:`aligner.nn.layers.prepack_onednn`).
    transposed: aten only: weights stored [in, out] (MKL's no-transpose GEMM).
    fused: q/k/v and gate/up packed into one GEMM each. info: {"batch", "timings_ms", ...}.
    """

    kernel: str
    transposed: bool
    fused: bool
    info: dict

    @property
    def name(self) -> str:
        base = "onednn" if self.kernel == "onednn" else ("in_out" if self.transposed else "out_in")
        return base + ("+fused" if self.fused else "")


def cached_cpu_layout(model: nn.Module, batch: int, fusable: bool, path: Path = LAYOUT_CACHE) -> CpuLayout:
    """:func:`choose_cpu_layout`, timed once per machine and kept in `path` (JSON, keyed by the CPU
    model and ISA, torch version, dtype, decode batch, the candidate kernels and the GEMM
    shapes), so every run on a machine multiplies with the same kernels: a resumed run rounds
    exactly as the uninterrupted one. Processes that build engines at once (tensor-parallel
    ranks, replicas) take an exclusive lock on ``<path>.lock`` around look-up, timing and
    write, so the first one times and the others read its choice: every rank of a machine uses
    the same kernels (ranks timing independently could pick different ones, which a resume
    would then change). An unreadable or unwritable cache (or lock) only costs the timing
    (info["cached"] says which)."""
    from aligner.runtime.host import cpu_signature

    layer = next(iter(model.model.layers.values()))
    shapes = [tuple(l.weight.shape) for l in (layer.self_attn.q_proj, layer.self_attn.k_proj, *_dense_mlp(layer)[::2])]
    head = None if model.lm_head is None else tuple(model.lm_head.weight.shape)
    dtype = str(next(model.parameters()).dtype)
    kernels = "aten+onednn" if onednn_available() else "aten"
    key = f"{cpu_signature()} | torch {torch.__version__} | {dtype} | batch {batch} | kernels {kernels} | fusable {fusable} | {len(model.model.layers)} x {shapes} | head {head}"
    entry = _machine_cached(path, key, lambda: _layout_entry(choose_cpu_layout(model, batch, fusable)), valid=lambda e: len(e) == 4)
    k, t, f, info = entry
    return CpuLayout(k, t, f, info)


def _layout_entry(lay: CpuLayout) -> list:
    return [lay.kernel, lay.transposed, lay.fused, lay.info]


def _machine_cached(path: Path, key: str, compute, valid) -> Any:
    """table[key] of the JSON file `path`, computed by ``compute()`` and written there when absent
    (or not ``valid(entry)``), under an exclusive lock on ``<path>.lock``: the processes of a
    machine that ask at once get the first one's entry. The returned entry's last item is a dict
    to which ``"cached"`` is added: the path it was read from, or False when computed here.
    An unreadable or unwritable cache (or lock) only costs the computation."""
    lock = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(f"{path.name}.lock"), "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError:  # no lock (read-only cache dir): this process times on its own, as documented
        if lock is not None:
            lock.close()
        lock = None
    try:
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        if key in table and valid(table[key]):
            entry = table[key]
            return [*entry[:-1], {**entry[-1], "cached": str(path)}]
        entry = compute()
        try:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**table, key: entry}, indent=1))
            os.replace(tmp, path)
        except OSError:  # unwritable cache: the next build times again (info["cached"] is False)
            pass
        return [*entry[:-1], {**entry[-1], "cached": False}]
    finally:
        if lock is not None:
            lock.close()  # releases the flock


def cached_decode_attention(model: nn.Module, batch: int, path: Path = LAYOUT_CACHE) -> dict:
    """:func:`choose_decode_attention`, timed once per machine and kept in `path` beside the
    weight layouts (keyed by the CPU model and ISA, torch version, decode batch, the local kv
    heads, query heads per kv head and head_dim, and the kernel's source), under the same lock
    as :func:`cached_cpu_layout`, so every engine of a machine attends with the same kernel.
    Returns {"choice": "sdpa" | "varlen", "timings_ms": {...}, "context": L, "cached": ...}."""
    from aligner.runtime.host import cpu_signature

    kvh, rep, hd = _attention_shape(model)
    source = hashlib.sha256(cpu_kernels.SOURCE.read_bytes()).hexdigest()[:12]
    key = (
        f"decode attention | {cpu_signature()} | torch {torch.__version__} | batch {batch} | kvh {kvh} rep {rep} hd {hd} | kernel {source}"
    )
    return _machine_cached(path, key, lambda: [choose_decode_attention(model, batch)], valid=lambda e: len(e) == 1)[0]


def _attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(local kv heads, query heads per kv head, head_dim) of the model's attention layers."""
    a = next(iter(model.model.layers.values())).self_attn
    hd = a.head_dim
    kvh, h = a.k_proj.weight.shape[0] // hd, a.q_proj.weight.shape[0] // hd
    return kvh, h // kvh, hd


def choose_decode_attention(model: nn.Module, batch: int, context: int = 256, rounds: int = 5) -> dict:
    """Time one decode step's attention with SDPA and with the varlen kernel on this CPU; keep the faster.

    The work is what the continuous scheduler runs: `batch` one-token rows of the model's local
    attention shape over fp32 caches of `context` positions (at most the model's max_seq_len),
    each row at a seeded random length in [context / 2, context] (continuous batching keeps
    rows of every age in the pool), SDPA under the engine's prefix mask, the kernel up to each
    row's length. Several layers' caches (up to 256 MiB) are visited in turn, so each call reads
    its keys from memory as decode does. Candidates alternate over `rounds` rounds; medians
    decide. Measured (benchmarks/RESULTS.md): SmolLM2-135M's shape, 64 rows, 2-core AMD EPYC.
    Returns {"choice", "timings_ms": {"sdpa", "varlen"} (ms per cache visited), "context"}.
    """
    kvh, rep, hd = _attention_shape(model)
    context = max(2, min(context, model.cfg.max_seq_len))
    g = torch.Generator().manual_seed(0)
    per_layer = 2 * batch * kvh * context * hd * 4
    caches = [
        (torch.randn(batch, kvh, context, hd, generator=g), torch.randn(batch, kvh, context, hd, generator=g))
        for _ in range(max(1, min(4, (256 << 20) // per_layer)))
    ]
    q = torch.randn(batch, kvh, rep, hd, generator=g)
    lengths = torch.randint(context // 2, context + 1, (batch,), generator=g)
    lengths[0] = context
    mask = (torch.arange(context) < lengths.unsqueeze(1))[:, None, None, :]

    def sdpa(k, v):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def varlen(k, v):
        decode_attention(q, k, v, lengths, hd**-0.5)

    runs = {"sdpa": sdpa, "varlen": varlen}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                for k, v in caches:
                    fn(k, v)
                if r:  # round 0 warms up
                    times[name].append((time.perf_counter() - t0) / len(caches))
    med = {name: round(1e3 * statistics.median(v), 4) for name, v in times.items()}
    return {"choice": min(med, key=med.get), "timings_ms": med, "context": context}


def choose_cpu_layout(model: nn.Module, batch: int, fusable: bool, rounds: int = 5) -> CpuLayout:
    """Time a decode step's GEMMs on this CPU with every weight layout and kernel; keep the fastest.

    Candidates: ``F.linear`` (MKL) with weights stored [out, in] (PyTorch's) or [in, out]
    (``transposed``), and oneDNN's linear on weights prepacked for `batch` rows (where the
    torch build has it); each with q/k/v and gate/up packed into one GEMM (``fused``, only when
    `fusable`) or not. Each candidate runs the GEMMs of up to 4 of the model's own local layers
    (their weight shapes, so each reads fresh weights from memory as decode does) on a
    [batch, in] input, scaled to every local layer, plus the lm_head (a tied head keeps the
    embedding's [out, in] layout under F.linear; oneDNN multiplies by a prepacked copy of it).
    Candidates alternate over `rounds` rounds; the median decides. Collective-free:
    :func:`cached_cpu_layout` makes the processes of one machine agree through a file lock;
    ranks on different machines time (and may choose) independently.

    Measured (benchmarks/RESULTS.md): on a 2-core AMD EPYC, MKL's small-batch GEMMs stream
    weights at 5-7 GB/s, oneDNN's prepacked ones at 20-35 GB/s (SmolLM2's head at 16 rows: 157
    vs 53 GFLOP/s). Returns a :class:`CpuLayout`; info["timings_ms"] {candidate: ms per step}.
    """
    layers = list(model.model.layers.values())
    sample = layers[: min(4, len(layers))]
    head = model.lm_head
    tied = head is not None and model.model.embed_tokens is not None and head.weight is model.model.embed_tokens.weight
    dtype = next(model.parameters()).dtype
    kernels = ("aten", "onednn") if onednn_available() else ("aten",)
    candidates = [
        CpuLayout(k, t, f, {})
        for k in kernels
        for t in ((False, True) if k == "aten" else (False,))
        for f in ((False, True) if fusable else (False,))
    ]

    def gemms(c: CpuLayout) -> list[torch.Tensor]:
        out = []
        for layer in sample:
            a, mlp = layer.self_attn, _dense_mlp(layer)
            for group in ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), mlp[:2], mlp[2:]):
                if not group:  # an MoE layer: its experts are not nn.Linear weights and keep their layout
                    continue
                ws = [l.weight.detach() for l in group]
                out += [
                    w.t().contiguous().t() if c.transposed else w.contiguous() for w in ([torch.cat(ws)] if c.fused and len(ws) > 1 else ws)
                ]
        if head is not None:
            w = head.weight.detach()
            out.append(w.t().contiguous().t() if c.transposed and not tied else w)
        if c.kernel == "onednn":
            out = [(w.shape[1], onednn_pack(w, batch)) for w in out]
        return out

    def run(c: CpuLayout, w) -> None:
        if c.kernel == "onednn":
            onednn_linear(inputs[w[0]], w[1], None)
        else:
            F.linear(inputs[w.shape[1]], w)

    with torch.inference_mode():
        weights = {c.name: gemms(c) for c in candidates}
        inputs = {k: torch.randn(batch, k).to(dtype) for k in {w.shape[1] for w in weights[candidates[0].name]}}
        n_head = 0 if head is None else 1
        scale = len(layers) / len(sample)
        times: dict[str, list[float]] = {c.name: [] for c in candidates}
        for r in range(rounds + 1):
            for c in candidates:
                ws = weights[c.name]
                t0 = time.perf_counter()
                for w in ws[: len(ws) - n_head]:
                    run(c, w)
                t_layers = (time.perf_counter() - t0) * scale
                t0 = time.perf_counter()
                for w in ws[len(ws) - n_head :]:
                    run(c, w)
                if r:  # round 0 warms up
                    times[c.name].append(t_layers + time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    best = min(candidates, key=lambda c: med[c.name])
    return CpuLayout(
        best.kernel, best.transposed, best.fused, {"batch": batch, "timings_ms": {n: round(1e3 * v, 3) for n, v in med.items()}}
    )


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


def compile_decode(model: nn.Module, cuda_graphs: bool = False) -> None:
    """torch.compile every local decoder layer's forward in place (``nn.Module.compile``: parameter
    names, state dict and refit unchanged), as torchtitan compiles per transformer block.

    Shapes: the layer runs prefill [U, T, H] and decode [n, 1, H] with the engine's KV caches;
    ``dynamic=None`` (automatic dynamic shapes) compiles each layer once static, then once with
    the batch, lengths and cache positions symbolic after the first change, so a generate()
    call recompiles at most twice per layer whatever the continuous scheduler's batch sizes
    (3 graphs per layer measured on the tiny test model). Raises Dynamo's recompile limits
    (process-wide) to 4 (accumulated: 8) per layer. The weights are graph inputs, not
    constants (inductor's ``freezing`` is off), so refit's in-place ``copy_`` is what the next
    step reads: the stale-weights pitfall NeMo-RL hit with captured graphs is tested on the CPU
    (tests/rollout/test_torch_engine.py). cuda_graphs: inductor's mode "reduce-overhead"
    (CUDA graph trees) - unrun, no GPU here; after offload/onload moves the weights, CUDA graph
    trees see new parameter addresses and re-record (unverified). Sets inductor's
    ``emulate_precision_casts`` (process-wide, :func:`emulate_eager_rounding`).
    """
    mode = "reduce-overhead" if cuda_graphs else None
    emulate_eager_rounding()
    layers = list(model.model.layers.values())
    # every layer shares DecoderLayer.forward's code but is specialized on its layer_idx (the KV
    # cache's key), so it needs its own graphs (static, then dynamic; prefill and decode): Dynamo's
    # per-code limit (8) would silently fall back to eager after 2-4 layers
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16 * len(layers))
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 32 * len(layers))
    for layer in layers:
        layer.compile(dynamic=None, mode=mode)


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
