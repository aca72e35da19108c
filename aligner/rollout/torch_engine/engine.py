"""TorchEngine: generation with aligner's own Llama (the ``torch`` rollout backend).

The engine runs the model's own modules (:mod:`aligner.model.llama`): there is one decoder
forward in aligner, for training, prefill and decode. It owns the HF-named weight update
(refit), tensor- and pipeline-parallel generation in the engine's own layout, stop tokens and
rollout log-probs, and hands each generate() call to one of two schedulers:
- continuous (default; :mod:`aligner.rollout.torch_engine.continuous_batching`, plans by
  :mod:`aligner.rollout.torch_engine.scheduler`, pipeline messages by :mod:`aligner.rollout.torch_engine.pipeline_link`): a
  pool of KV-cache slots (:mod:`aligner.rollout.torch_engine.kv_cache`) refilled as responses stop, shared
  prompt prefixes, pipelined decode with pp > 1;
- static (:mod:`aligner.rollout.torch_engine.static_batching`): left-padded batches, with CUDA-graph decode on GPU.
Sampling (greedy / temperature / top-k / top-p, per-request seeds): :mod:`aligner.rollout.torch_engine.sampling`.

Weights: the inference fast paths live in the building blocks: packed q/k/v and gate/up GEMMs
(:func:`aligner.nn.layers.pack_linears`), the residual add inside the o / down GEMM, fp32
RMSNorm in one kernel, GQA decode without repeated k/v. On the CPU, the GEMM kernel
(``F.linear``, i.e. MKL, or oneDNN on weights prepacked for the decode batch), whether weights
are stored [in, out] and whether q/k/v and gate/up are packed is timed on the machine at engine
build (``cpu_layout="auto"``, :mod:`aligner.rollout.torch_engine.cpu_tuning`). The packed parameters are
views, so refit is unchanged; the oneDNN copies are re-packed at every ``finish_weight_update``.
Compiled decode (``compile``, :func:`compile_decode`): each decoder layer torch.compile'd in
place. What ran on which device, and the measurements behind the defaults: benchmarks/RESULTS.md.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.model.llama import build_model
from aligner.model.moe import moe_layers, stack_routing
from aligner.nn import comm
from aligner.nn.layers import (
    ColumnParallelLinear,
    ParallelLayer,
    RMSNorm,
    RowParallelLinear,
    drop_onednn,
    onednn_available,
    onednn_supports,
    pack_linears,
    prepack_onednn,
    unpack_linears,
)
from aligner.parallel.parallelize import emulate_eager_rounding
from aligner.rollout.base import Generation, RolloutEngine, check_budgets, check_prompts, check_sampling
from aligner.rollout.torch_engine import cpu_kernels
from aligner.rollout.torch_engine.continuous_batching import ContinuousBatching
from aligner.rollout.torch_engine.cpu_kernels import load_decode_attention
from aligner.rollout.torch_engine.cpu_tuning import cached_cpu_layout, cached_decode_attention
from aligner.rollout.torch_engine.sampling import Sampler
from aligner.rollout.torch_engine.scheduler import OnFinish, TurnEnd
from aligner.rollout.torch_engine.shard import ModelShard
from aligner.rollout.torch_engine.static_batching import StaticBatching
from aligner.rollout.weight_sync.staging import Bucket, WeightStaging
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
        pp_group: the engine's pipeline group; pipeline stage index = rank in it (None: no PP).
        max_batch_size: prompts per batch (static); KV-cache slots (continuous): each of the
            ``micro_batches`` blocks gets max_batch_size // micro_batches of them (at least 1).
        cuda_graphs: capture the decode step in CUDA graphs (on cuda, pp = 1; the continuous
            scheduler also needs one micro-batch and a dense model: ``batching.uses_graphs``).
        seed: seed of the engine RNG used when generate() gets no seeds.
        fused_decode: pack each layer's q/k/v and gate/up weights so each group runs as one GEMM
            (:func:`aligner.nn.layers.pack_linears`). None (default): on CUDA on (equal to the module
            path eager and in CUDA graphs on an H100, 1.06-1.13x its tokens/s on an H200 at batch
            1-64, 2026-11-26: benchmarks/RESULTS.md); on the CPU chosen with the weight layout by
            measurement (``cpu_layout``).
            Ignored for models whose layers are not aligner's own (e.g. Transformer Engine
            modules) or that use sequence parallelism.
        scheduler: "continuous" (default): a pool of max_batch_size KV-cache slots refilled as
            responses stop, shared prompt prefixes, pipelined PP decode
            (:mod:`aligner.rollout.torch_engine.continuous_batching`); "static": batches of max_batch_size
            prompts left-padded and decoded until their longest response ends (the first engine,
            kept for comparison and for CUDA-graph decode; :mod:`aligner.rollout.torch_engine.static_batching`).
        micro_batches: continuous scheduler only: blocks the slot pool is split into; with
            pp > 1 every pipeline stage works on one block while the next one works on another
            (None: pp_size; 1 with pp > 1 runs the pipeline stages one after the other).
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
            decode and training"); on CUDA equal to eager (tests/rollout/test_trtllm_engine_gpu.py)
            but its speed not yet measured; no per-machine timing is done for it.
        decode_attention: the continuous scheduler's one-token attention: "sdpa" (PyTorch's,
            every row reads the keys up to the block's longest context under a mask), "varlen"
            (fp32 on the CPU: :func:`aligner.rollout.torch_engine.cpu_kernels.decode_attention`, a C kernel built
            on this machine at first use, each row reading its own keys only) or "auto"
            (default): on the CPU in fp32 the faster of the two, timed once per machine and
            shape (:func:`cached_decode_attention`; ``self.layout["attention"]`` holds the
            timings), "sdpa" elsewhere and where the kernel cannot be built (no C compiler).
            The static scheduler always runs SDPA.
        interruptible: weight syncs may land between decode steps (the split placement's
            ``rollout.interruptible``, docs/rollout.md; continuous scheduler, pp = 1): a sync handed to
            :meth:`offer_weights` while a call decodes is applied at the call's next step boundary
            (:class:`aligner.rollout.weight_sync.staging.WeightStaging`), the requests in flight keep their KV
            cache and go on with the new weights, and every Generation carries ``token_versions``.
    The engine owns `model`: it re-lays its linear weights out in place (see :func:`_pack_weights`).

    Attributes: ``batching`` runs the calls (:class:`StaticBatching` or :class:`ContinuousBatching`) on
    ``shard``, the engine's :class:`ModelShard` (:meth:`model_shard`: the schedulers never see the engine);
    ``layout`` the CPU kernel choices and their timings; ``last_stats`` the last call's counters;
    ``moe_layers`` the local :class:`aligner.model.moe.SparseMoE` layers (empty for a dense model).

    Mixture of Experts: for a model with :class:`aligner.model.moe.SparseMoE` layers every
    Generation carries ``routed_experts`` [R, L, k] int16: for response token i, the top-k experts
    (sorted) each MoE layer chose at the position whose logits produced it (prompt_len + i - 1: the
    decode row that consumed the previous token, or, in the static scheduler, the last prompt
    token's prefill row for i = 0), read from the layers' ``last_experts`` after each forward. The
    continuous scheduler writes them into a [requests, max budget, L_local, k] buffer indexed by the
    decode rows' (request, step); with pp > 1 each pipeline stage records its own layers and the pipeline stages'
    parts are all-gathered over the pp group at the end of the call (layer order). Dense models skip
    all of it. The trainer's side and the metric: :meth:`aligner.actor.policy.Policy.log_probs_with_routing`,
    :func:`aligner.algorithms.routing_mismatch`.
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
        interruptible: bool = False,
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
        if interruptible and (scheduler != "continuous" or self.pp_size > 1):
            raise ValueError(
                f"interruptible=True needs the continuous scheduler on one pipeline stage, not scheduler={scheduler!r} with "
                f"pp_size={self.pp_size}: set scheduler='continuous' and pp_size=1, or interruptible=False"
            )
        self.interruptible = interruptible
        self.weight_staging = WeightStaging()  # interruptible: syncs received while a call decodes
        self.weight_version = 0
        self.cuda_graphs = cuda_graphs
        self._rng_seed = seed
        self._calls = 0
        self.last_stats: dict[str, float] = {}
        if self.device.type == "cpu":
            keep_freed_host_memory()
        fusable = _fusable(model)
        on_cpu = self.device.type == "cpu"
        transposed = on_cpu and cpu_layout == "in_out"
        kernel = "onednn" if on_cpu and cpu_layout == "onednn" else "aten"
        if kernel == "onednn" and not onednn_available():
            raise ValueError("cpu_layout='onednn' is invalid here: this torch build has no oneDNN linear ops; use auto, in_out or out_in")
        if kernel == "onednn" and not onednn_supports(self.dtype)[0]:
            raise ValueError(f"cpu_layout='onednn' is invalid here: {onednn_supports(self.dtype)[1]}; use auto, in_out or out_in")
        self.layout: dict[str, Any] = {}
        self._pack_batch = max(1, max_batch_size // self.micro_batches)  # the decode batch each step runs
        if on_cpu and cpu_layout == "auto":
            chosen = cached_cpu_layout(model, self._pack_batch, fusable)
            kernel, transposed, self.layout = chosen.kernel, chosen.transposed, dict(chosen.info)
            fused_decode = chosen.fused if fused_decode is None else fused_decode
        if fused_decode is None:
            fused_decode = True  # CUDA (the CPU's choice is measured above)
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
        # Mixture of Experts: every response token's top-k experts per MoE layer (Generation.routed_experts)
        self.moe_layers = moe_layers(model)
        self.shard = self.model_shard()
        if scheduler == "static":
            self.batching = StaticBatching(self.shard, max_batch_size=max_batch_size, cuda_graphs=cuda_graphs)
        else:
            self.batching = ContinuousBatching(
                self.shard,
                max_batch_size=max_batch_size,
                micro_batches=self.micro_batches,
                cuda_graphs=cuda_graphs,
                varlen=decode_attention == "varlen",
                interruptible=interruptible,
            )
        self.compiled = compile == "on"  # "auto": eager until compiled decode is measured faster (compile_decode)
        if self.compiled:
            # the scheduler's own CUDA graphs capture the compiled kernels; elsewhere on CUDA
            # inductor's CUDA graphs (reduce-overhead) replay them
            compile_decode(model, cuda_graphs=self.device.type == "cuda" and not self.batching.uses_graphs)
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

    def local_layers(self) -> list[int]:
        """This pipeline stage's decoder layer indices, ascending (the KV caches' keys)."""
        return sorted(int(k) for k in self.model.model.layers.keys())

    def kv_heads_local(self) -> int:
        """Key/value heads on this tp rank (num_kv_heads / tp)."""
        attn = next(iter(self.model.model.layers.values())).self_attn
        return attn.k_proj.weight.shape[0] // attn.head_dim

    def model_shard(self) -> ModelShard:
        """The view of this rank's model shard that the scheduler drives (:class:`ModelShard`): the decoder
        stack and head, the layout, the KV caches' shapes, and hooks for routing and weight versions."""
        return ModelShard(
            trunk=self.model.model,
            lm_head=self.model.lm_head,
            layers=tuple(self.local_layers()),
            kv_heads=self.kv_heads_local(),
            head_dim=self.cfg.resolved_head_dim,
            hidden_size=self.cfg.hidden_size,
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            pp_size=self.pp_size,
            pp_rank=self.pp_rank,
            moe_layers=len(self.moe_layers),
            moe_top_k=self.moe_layers[0].top_k if self.moe_layers else 0,
            pp_stage_routing=self.pp_stage_routing,
            attach_routing=self.attach_routing,
            weight_version=lambda: self.weight_version,
            step_boundary=lambda: self.weight_staging.step_boundary(self),
        )

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

    def offer_weights(self, sync: list[Bucket]) -> bool:
        """One whole sync (its buckets of (hf_name, tensor) pairs, as :meth:`update_weights` takes them,
        the tensors owned by the engine from now on), from another thread than the one that generates:
        applied now when no generate() call runs (returns True); else, with ``interruptible``, applied at
        the running call's next decode step boundary (returns False; :class:`WeightStaging`). A sync is
        applied whole, with :meth:`update_weights` per bucket and one :meth:`finish_weight_update`.
        Without ``interruptible`` no call is marked as decoding, so the sync is applied at once: the
        caller must then not generate at the same time (the worker's calls run one at a time)."""
        return self.weight_staging.offer(self, sync)

    def offload(self) -> None:
        """Move parameters to host memory and drop graphs/caches (no-op on CPU)."""
        if self.device.type != "cuda":
            return
        self.batching.graphs.clear()  # either scheduler's captured decode steps and their caches
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
        turn_end: Optional[TurnEnd] = None,
        on_finish: Optional[OnFinish] = None,
    ) -> list[Generation]:
        """Sample one response per prompt (sampling semantics: :mod:`aligner.rollout.torch_engine.sampling`).

        Args:
            prompt_ids: list[list[int]], B non-empty prompts of ragged length.
            sampling: SamplingConfig-like (temperature >= 0, top_k >= 0, top_p in (0, 1],
                max_new_tokens >= 1, stop_token_ids).
            seeds: list[int] of length B (per-request generators) or None (engine RNG).
            max_new_tokens: list[int] of length B, each request's own budget (None: every
                request gets sampling.max_new_tokens).
            turn_end: None, or each request is an episode (multi-turn, continuous scheduler only):
                the callback (:data:`aligner.rollout.torch_engine.scheduler.TurnEnd`) that gets each model turn
                and returns the observation tokens to continue with from the cached prefix; the
                Generations then carry ``own_mask`` and their budget counts observation tokens.
            on_finish: None, or ``on_finish(index, token_ids)`` called once per request as soon as it
                ends (continuous scheduler: when its row frees its slot; static: when its batch ends;
                on the first pipeline stage): lets a caller use finished responses, e.g. send them to a
                remote reward, while the other rows decode (:data:`aligner.rollout.torch_engine.scheduler.OnFinish`).
        Returns:
            list[Generation] of length B, in prompt order; rollout_log_probs fp32 per response
            token; with ``interruptible``, token_versions (the weight_version of each token).
            ``self.last_stats`` then holds the call's counters (prompt tokens, tokens
            prefilled, shared-prefix tokens, decode steps and rows, generated tokens).
        Raises:
            ValueError: bad sampling parameters, empty prompt, token id outside the vocabulary,
                a budget < 1, a prompt + its budget > model.max_seq_len, or turn_end with the
                static scheduler.
        """
        if turn_end is not None and self.scheduler != "continuous":
            raise ValueError(
                f"episodes (turn_end) need rollout.scheduler=continuous, not {self.scheduler!r}: it keeps each episode's slot between turns"
            )
        check_sampling(sampling)
        check_prompts(prompt_ids, seeds, self.cfg.vocab_size)
        budgets = check_budgets(prompt_ids, sampling, max_new_tokens, self.cfg.max_seq_len)
        self._calls += 1
        fallback = self._rng_seed * 1_000_003 + self._calls * 7919
        sampler = Sampler(sampling, seeds, budgets, self.device, fallback)
        stop = self.stop_ids(sampling)
        if self._stale:  # update_weights without finish_weight_update: the prepacked copies would be old
            self._repack()
        with torch.inference_mode(), self.weight_staging.decoding(self) if self.interruptible else nullcontext():
            if turn_end is not None:
                gens = self.batching.generate(prompt_ids, budgets, sampler, stop, turn_end, on_finish)
            else:
                gens = self.batching.generate(prompt_ids, budgets, sampler, stop, on_finish=on_finish)
        self.last_stats = self.batching.last_stats
        return gens

    def stop_ids(self, sampling: Any) -> list[int]:
        """The token ids that end a response (or an episode's turn): sampling.stop_token_ids and eos, sorted."""
        return sorted({*sampling.stop_token_ids, *([] if self.eos_token_id is None else [self.eos_token_id])})

    def pp_stage_routing(self) -> torch.Tensor:
        """This pipeline stage's MoE layers' experts in the last forward: [N, L_local, k] int16, sorted along k."""
        return stack_routing([m.last_experts for m in self.moe_layers])

    def attach_routing(self, gens: Optional[list[Generation]], routing: Optional[torch.Tensor]) -> None:
        """Set each Generation's routed_experts [R, L, k] from routing [B, >= R, L_local, k] (request
        order, this pipeline stage's layers). With pp > 1 every pipeline stage calls it (a collective): their
        layers are gathered over the pp group and concatenated in pp rank (= layer) order; gens may be
        None on a pipeline stage that does not build them."""
        if routing is None:
            return
        routing = routing.cpu()
        if self.pp_size > 1:
            parts: list = [None] * self.pp_size
            dist.all_gather_object(parts, routing, group=self.pp_group)
            routing = torch.cat(parts, dim=2)
        for g, r in zip(gens or [], routing):
            g.routed_experts = r[: len(g.token_ids)].clone()


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
    (tests/rollout/test_torch_engine.py). cuda_graphs: inductor's mode "reduce-overhead" (CUDA
    graph trees), used only where the scheduler captures no graphs of its own; on an H200 inductor
    skipped them for the continuous scheduler's step ("mutated inputs": the KV-cache writes), which
    now captures its own; after offload/onload moves the weights, CUDA graph trees see new
    parameter addresses and re-record (unverified). Sets inductor's
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
