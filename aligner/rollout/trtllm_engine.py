"""TrtllmEngine: TensorRT-LLM 1.2 ``AsyncLLM`` (PyTorch backend, Ray orchestrator) as a rollout engine.

Owns: the mapping from aligner's RolloutConfig / SamplingConfig to TensorRT-LLM's ``LLM``
and ``SamplingParams`` keywords (:func:`build_llm_kwargs`, :func:`build_sampling_kwargs`:
pure functions, contract-tested on CPU against the recorded 1.2.1 API in
shared/data/apis/tensorrt_llm.json), refit through ``WorkerExtension.update_weights``,
release/resume around training, and the PPO loop's layout of it (rollout.backend=trtllm):
:func:`trtllm_replica` (which actor rank owns which replica, pure), :func:`ray_placement`
and :class:`ColocatedTrtllmEngine` (one actor rank's side of the refit and sleep protocol).

Layout in the PPO loop (aligner.workers.actor.ActorWorker): the actor's ranks form
world / (tp * pp) replicas of tp * pp contiguous ranks (rollout.parallel); each replica's
first rank writes the policy's config.json and builds the engine with dummy weights, its Ray
workers placed in that rank's node bundle of the actor's placement group with
TRTLLM_WORKER_GPU_SHARE of a GPU each (the actor ranks ask that much less,
aligner.workers.placement). Refit per bucket: every rank makes CUDA IPC handles of its full
HF-named tensors (cast to rollout.dtype) keyed by its GPU's UUID, the handles are all-gathered,
each owner sends the merged dict, each engine worker rebuilds the tensors of its own GPU's
UUID; then a barrier. The engine sleeps from the end of generate to the start of the next refit.

Public and private: every call into TensorRT-LLM is a public method of ``AsyncLLM``
(tensorrt_llm.llmapi.AsyncLLM, recorded for 1.2.1 with public_methods collective_rpc,
generate_async, release, resume, setup_async, shutdown, update_weights). The synchronous
``LLM`` of 1.2.1 has NO public sleep/wake or weight-update method (its recorded public methods
are generate, generate_async, get_kv_cache_events(_async), get_stats(_async), shutdown), which
is why this adapter used the private ``LLM._collective_rpc`` before and uses AsyncLLM now, as
NeMo-RL's TensorRT-LLM backend does (NVIDIA-NeMo/RL nemo_rl/models/generation/trtllm/
trtllm_worker_async.py, revision 7ea279ab: ``await llm.release(tags)`` / ``await llm.resume(tags)``,
CUDA graphs on; its synchronous LLM path was removed). AsyncLLM's methods are coroutines; the
engine runs them on a private event loop thread. What the adapter uses (names checked against
the recorded 1.2.1 API unless marked):
- ``AsyncLLM(placement_groups, placement_bundle_indices, per_worker_gpu_share, model=...,
  tensor_parallel_size=rollout.parallel.tp_size, pipeline_parallel_size=rollout.parallel.pp_size,
  pp_partition=rollout.parallel.pp_layer_split, orchestrator_type="ray",
  ray_worker_extension_cls="tensorrt_llm.llmapi.rlhf_utils.WorkerExtension", enable_sleep,
  load_format=LoadFormat.DUMMY | AUTO, kv_cache_config=KvCacheConfig(...),
  cuda_graph_config=CudaGraphConfig(...) | None, sampler_type="TorchSampler",
  skip_tokenizer_init=True, max_batch_size, max_seq_len, dtype)``, then ``await setup_async()``.
  1.2.1's AsyncLLM.__init__ builds ``ray_placement_config=RayPlacementConfig(defer_workers_init=True,
  <its three keywords>)`` itself (replacing any given one), so the Ray workers start in
  setup_async; the placement goes in as those three keywords (None each without a placement group).
  dtype is bfloat16 or float16: TensorRT-LLM's kernels do not dispatch float32
  (NVIDIA/TensorRT-LLM#5260), so float32 is refused here and at config validation.
  That RayPlacementConfig places a 1.2.1 engine's workers in the actor's bundles is NOT verified.
- engine start inside an actor rank: CUDA_VISIBLE_DEVICES is hidden while the engine starts
  (AsyncLLM() and setup_async), because the RayExecutor copies this process's environment into
  its workers and sets RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, and
  RayWorkerWrapper.physical_to_local_id looks the worker's GPU up in that variable (main
  revisions 0777969 / 0acd798, NOT 1.2.1; NeMo-RL's worker pops the variable before AsyncLLM too).
  The same copy hands the actor rank's MASTER_ADDR / MASTER_PORT / RANK to the workers; whether
  1.2.1's workers take their rendezvous from there or from their leader is NOT verified.
- generation: ``generate_async(inputs, sampling_params=...)`` per prompt, awaited together
  through ``RequestOutput.aresult()``.
- refit: ``await AsyncLLM.update_weights(ipc_handles)`` once per bucket (1.2.1 body: the workers'
  "update_weights" RPC with ``args=(ipc_handles,)``; annotated ``dict[str, str]``, the handles
  are passed through untouched), where
  ``ipc_handles = {device_uuid: [(hf_name, torch.multiprocessing.reductions.reduce_tensor(t)), ...]}``
  (the worker rebuilds each tensor of its own UUID on its own device and calls the model loader's
  ``reload(..., allow_partial_loading=True)``), then ``await AsyncLLM.collective_rpc("update_weights",
  args=(None,))`` to finalize (post-load hooks, prefix-cache reset): update_weights' annotation does
  not admit None, the public collective_rpc sends the same RPC. Device UUIDs come from
  ``tensorrt_llm._torch.utils.get_device_uuid``, the function the worker itself uses (imported
  from that module by rlhf_utils.py at main revisions 04762f3b / 65b31db1; NOT in the recorded
  1.2.1 API).
- sleep / wake: ``await AsyncLLM.release(tags)`` / ``await AsyncLLM.resume(tags)`` (1.2.1:
  ``tags: list[str]``; bodies: the workers' "sleep" / "wakeup" RPCs), ``tags`` the string values
  of ``tensorrt_llm._torch.virtual_memory.ExecutorMemoryType`` (NOT in the recorded API; the
  module TensorRT-LLM's own release/resume tests import it from) except the "_no_capture_*"
  start-up scopes, which NeMo-RL leaves out too (:func:`memory_tags`). Needs ``enable_sleep=True``.
  Refit follows resume, so weights whose memory comes back without its contents are overwritten
  before use; KV-cache block reuse is off, so no prefix cache outlives a release (NeMo-RL resets
  its prefix cache before release because it keeps reuse on).
- CUDA graphs follow rollout.cuda_graphs with or without sleep. TensorRT-LLM's own sleep and
  release/resume tests turn them off ("CUDA Graph unsupported yet"); NeMo-RL runs them with
  release/resume (on tensorrt-llm 1.3.0rc21, with a SleepConfig that drops only the KV cache's contents).
  Graphs stay valid only if release/resume give memory back at the same virtual addresses and
  refit writes into the captured tensors: NOT verified on 1.2.1. The gpu test
  test_trtllm_cuda_graphs_see_every_refit checks the tokens against eager decode after two
  refits with and after two without release/resume; rollout.cuda_graphs=false turns them off.
- log-probs: ``SamplingParams(logprobs=0)`` returns only the sampled token's log-prob
  (documented in TensorRT-LLM's ray example). 1.2.1 has NO ``logprobs_mode`` (vLLM's name;
  absent from the recorded SamplingParams), so whether the returned values are taken before
  or after temperature / top-k / top-p processing is not settled by the API; the trainer
  recomputes ``old_log_probs`` anyway and the mismatch metric exposes any difference.

Status: NOTHING in this module, and none of the PPO-loop wiring of rollout.backend=trtllm
(aligner.workers.actor, the placement share), has run on a GPU or against an installed
tensorrt_llm: it cannot be installed on the CPU development machine, and no GPU machine with
tensorrt_llm was available (docs/hardware.md). What has run, on CPU only: the pure functions
(build_llm_kwargs, build_sampling_kwargs, sampled_log_probs, memory_tags, trtllm_replica,
ray_placement, write_engine_model_dir), the engine's calls into a recording stand-in for
AsyncLLM (their names and keywords bound against the recorded signatures), the config
validation of rollout.backend=trtllm, and the static contract checks of every keyword, field,
import path and method used here against the recorded API (tests/rollout/test_trtllm_engine.py,
tests/config/test_validation.py). The end-to-end behaviour is exercised only by gpu-marked tests
(tests/rollout/test_trtllm_engine_gpu.py, tests/trainers/test_ppo_trtllm_gpu.py), which skip
unless CUDA and tensorrt_llm are present.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from aligner.rollout.base import Generation, RolloutEngine, check_budgets, check_prompts, check_sampling

INSTALL_HINT = (
    "TensorRT-LLM is not installed: `pip install aligner[trtllm]` (tensorrt-llm>=1.2,<2 from NVIDIA's index: "
    "pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com) on a CUDA machine"
)
WORKER_EXTENSION = "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"


def build_llm_kwargs(
    cfg: Any,
    model_dir: str,
    *,
    max_seq_len: int,
    dtype: str = "bfloat16",
    enable_sleep: bool = True,
    free_gpu_memory_fraction: float = 0.5,
    dummy_weights: bool = False,
    placement: Optional[dict] = None,
) -> dict:
    """Keywords for ``tensorrt_llm.llmapi.AsyncLLM`` (LLM's keywords; AsyncLLM passes them on) from a RolloutConfig.

    Args:
        cfg: RolloutConfig (parallel.tp_size, parallel.pp_size, parallel.pp_layer_split,
            max_batch_size, cuda_graphs).
        model_dir: HF model directory the engine starts from (config.json; weights unless
            `dummy_weights`); the weights are replaced by every refit.
        max_seq_len: prompt + response tokens.
        dtype: "bfloat16" | "float16". float32 is refused: TensorRT-LLM's kernels do not
            dispatch it (NVIDIA/TensorRT-LLM#5260).
        enable_sleep: allow release/resume around training (CUDA graphs stay as cfg.cuda_graphs says).
        free_gpu_memory_fraction: KV cache share of the free GPU memory, in (0, 1].
        dummy_weights: start from config.json alone (``load_format=LoadFormat.DUMMY``, given
            here as "dummy"): the first refit brings the weights.
        placement: {"placement_groups": [pg], "placement_bundle_indices": [[bundle] * workers],
            "per_worker_gpu_share": share} (RayPlacementConfig fields) to put the engine's Ray
            workers beside the trainer; None lets TensorRT-LLM create its own placement group.
    Returns:
        dict; ``kv_cache_config`` / ``cuda_graph_config`` are dicts of KvCacheConfig /
        CudaGraphConfig fields (or None), turned into those objects by TrtllmEngine, which also
        maps ``load_format`` "dummy" / "auto" to LoadFormat. ``ray_placement_config`` (a dict of
        RayPlacementConfig fields, or None) goes to AsyncLLM as its own keywords of the same
        names: AsyncLLM builds the RayPlacementConfig itself and replaces any given one.
    Raises:
        ValueError: bad dtype or memory fraction.
    """
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is invalid: valid choices are bfloat16, float16 (TensorRT-LLM's kernels do not run float32)")
    if not 0 < free_gpu_memory_fraction <= 1:
        raise ValueError(f"free_gpu_memory_fraction={free_gpu_memory_fraction!r} is invalid: must be in (0, 1]")
    graphs = bool(cfg.cuda_graphs)  # with or without sleep (module docstring: what is and is not verified)
    split = cfg.parallel.pp_layer_split
    return {
        "model": model_dir,
        "tensor_parallel_size": cfg.parallel.tp_size,
        "pipeline_parallel_size": cfg.parallel.pp_size,
        "orchestrator_type": "ray",
        "ray_worker_extension_cls": WORKER_EXTENSION,
        "enable_sleep": enable_sleep,
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "max_batch_size": cfg.max_batch_size,
        "max_seq_len": max_seq_len,
        "sampler_type": "TorchSampler",
        "kv_cache_config": {"free_gpu_memory_fraction": free_gpu_memory_fraction, "enable_block_reuse": False},
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": cfg.max_batch_size} if graphs else None,
        "pp_partition": list(split) if split else None,  # layers per pipeline stage; None = TensorRT-LLM's even split
        "load_format": "dummy" if dummy_weights else "auto",
        "ray_placement_config": dict(placement) if placement is not None else None,
    }


def build_sampling_kwargs(
    sampling: Any, *, eos_token_id: Optional[int], seed: Optional[int] = None, max_new_tokens: Optional[int] = None
) -> dict:
    """Keywords for ``tensorrt_llm.SamplingParams(**kw)`` from a SamplingConfig.

    max_new_tokens: this request's own budget (``max_tokens``); None takes sampling.max_new_tokens.

    temperature 0 is greedy in TensorRT-LLM too; top_k 0 (off) maps to None; logprobs=0
    asks for the sampled token's log-prob only; detokenize off (token ids in, token ids out).
    Raises ValueError for bad sampling values (same checks as TorchEngine).
    """
    check_sampling(sampling)
    stop = sorted(set(sampling.stop_token_ids))
    return {
        "max_tokens": sampling.max_new_tokens if max_new_tokens is None else int(max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_k": sampling.top_k or None,
        "top_p": float(sampling.top_p),
        "end_id": eos_token_id,
        "stop_token_ids": stop or None,
        "seed": seed,
        "logprobs": 0,
        "detokenize": False,
        "exclude_input_from_output": True,
    }


def sampled_log_probs(token_ids: list[int], logprobs: Any) -> list[float]:
    """CompletionOutput.logprobs (TokenLogprobs = list[dict[int, Logprob]], or list[float]) -> list[float] per token."""
    out = []
    for tok, entry in zip(token_ids, logprobs):
        if isinstance(entry, dict):
            out.append(float(entry[tok].logprob))
        else:
            out.append(float(entry))
    if len(out) != len(token_ids):
        raise ValueError(f"TensorRT-LLM returned {len(out)} log-probs for {len(token_ids)} tokens: request logprobs=0")
    return out


def _import_trtllm():
    try:
        import tensorrt_llm  # noqa: F401
        from tensorrt_llm import SamplingParams
        from tensorrt_llm.llmapi import AsyncLLM, CudaGraphConfig, KvCacheConfig
        from tensorrt_llm.llmapi.llm_args import LoadFormat
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return AsyncLLM, SamplingParams, KvCacheConfig, CudaGraphConfig, LoadFormat


@contextmanager
def _env_without(name: str) -> Iterator[None]:
    """Hide one environment variable while the engine starts, then restore it.

    TensorRT-LLM's RayExecutor copies this process's environment into its workers and sets
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1; RayWorkerWrapper then looks its physical
    GPU up in CUDA_VISIBLE_DEVICES. An actor rank's CUDA_VISIBLE_DEVICES names only its own
    GPU, so an engine worker placed on another GPU of the node would not find its own.
    This process's CUDA context exists already, so hiding it does not move this process.
    """
    import os

    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


class _LoopThread:
    """A private asyncio event loop on a daemon thread; :meth:`run` blocks the caller until a coroutine ends.

    AsyncLLM's methods are coroutines, and the result queues ``generate_async`` makes bind to the
    loop running when it is called, so every AsyncLLM call of one engine goes through this one
    loop. A thread of its own lets the synchronous RolloutEngine methods run them whether or not
    the calling thread already runs a loop (an async Ray actor, pytest-asyncio).
    """

    def __init__(self) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aligner-trtllm-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        """Run `coro` on the loop; return its result or raise its exception."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def memory_tags(members: Iterable[Any]) -> list[str]:
    """The release / resume tags: the string value of every ExecutorMemoryType member, except the
    ``_no_capture_*`` scopes that exist only while the executor starts (NeMo-RL leaves out the
    same "_"-prefixed values). Weights ("model_weights" where the member exists), the rest of the
    model engine ("model"), KV cache, sampler and executor buffers are all released."""
    return [m.value for m in members if not m.value.startswith("_")]


class TrtllmEngine(RolloutEngine):
    """RolloutEngine over a TensorRT-LLM ``AsyncLLM`` with the Ray orchestrator (GPU only).

    The synchronous RolloutEngine methods run AsyncLLM's coroutines on a private event loop
    thread (:class:`_LoopThread`). Sleep and wake are AsyncLLM's public ``release(tags)`` /
    ``resume(tags)``, refit its public ``update_weights`` and ``collective_rpc`` (module docstring).

    Args:
        model_dir: HF checkpoint dir to start from.
        cfg: RolloutConfig (cuda_graphs: decode in CUDA graphs, with or without sleep).
        max_seq_len: prompt + response tokens.
        eos_token_id: stop token (SamplingParams.end_id).
        dtype: engine dtype name ("bfloat16" | "float16").
        enable_sleep: enable release/resume (offload/onload).
        dummy_weights: start from `model_dir`'s config.json alone (LoadFormat.DUMMY); refit
            brings the weights.
        placement: RayPlacementConfig fields (see :func:`build_llm_kwargs`), or None; given to
            AsyncLLM as its own ``placement_groups`` / ``placement_bundle_indices`` /
            ``per_worker_gpu_share`` keywords.
    Raises:
        ImportError: tensorrt_llm missing (message says what to install).
    """

    def __init__(
        self,
        model_dir: str,
        cfg: Any,
        *,
        max_seq_len: int = 4096,
        eos_token_id: Optional[int] = None,
        dtype: str = "bfloat16",
        enable_sleep: bool = True,
        dummy_weights: bool = False,
        placement: Optional[dict] = None,
    ):
        AsyncLLM, SamplingParams, KvCacheConfig, CudaGraphConfig, LoadFormat = _import_trtllm()
        kw = build_llm_kwargs(
            cfg,
            model_dir,
            max_seq_len=max_seq_len,
            dtype=dtype,
            enable_sleep=enable_sleep,
            dummy_weights=dummy_weights,
            placement=placement,
        )
        kv, graphs, place = kw.pop("kv_cache_config"), kw.pop("cuda_graph_config"), kw.pop("ray_placement_config") or {}

        async def start() -> Any:
            # AsyncLLM defers its Ray workers to setup_async (defer_workers_init=True): both run
            # on the engine's loop, inside the CUDA_VISIBLE_DEVICES hiding below
            llm = AsyncLLM(
                placement_groups=place.get("placement_groups"),
                placement_bundle_indices=place.get("placement_bundle_indices"),
                per_worker_gpu_share=place.get("per_worker_gpu_share"),
                model=kw["model"],
                tensor_parallel_size=kw["tensor_parallel_size"],
                pipeline_parallel_size=kw["pipeline_parallel_size"],
                pp_partition=kw["pp_partition"],
                orchestrator_type=kw["orchestrator_type"],
                ray_worker_extension_cls=kw["ray_worker_extension_cls"],
                enable_sleep=kw["enable_sleep"],
                skip_tokenizer_init=kw["skip_tokenizer_init"],
                load_format=LoadFormat.DUMMY if kw["load_format"] == "dummy" else LoadFormat.AUTO,
                dtype=kw["dtype"],
                max_batch_size=kw["max_batch_size"],
                max_seq_len=kw["max_seq_len"],
                sampler_type=kw["sampler_type"],
                kv_cache_config=KvCacheConfig(**kv),
                cuda_graph_config=CudaGraphConfig(**graphs) if graphs is not None else None,
            )
            await llm.setup_async()
            return llm

        runner = _LoopThread()
        try:
            with _env_without("CUDA_VISIBLE_DEVICES") if place else nullcontext():
                llm = runner.run(start())
        except BaseException:
            runner.close()
            raise
        self._init_state(llm, runner, SamplingParams, cfg=cfg, eos_token_id=eos_token_id, max_seq_len=max_seq_len)

    def _init_state(
        self, llm: Any, runner: _LoopThread, sampling_params_cls: Any, *, cfg: Any, eos_token_id: Optional[int], max_seq_len: int
    ) -> None:
        """Everything but the engine start (also how the CPU contract tests attach a recording stand-in)."""
        self.llm, self._loop, self._SamplingParams = llm, runner, sampling_params_cls
        self.cfg, self.eos_token_id, self.max_seq_len = cfg, eos_token_id, max_seq_len
        self.vocab_size = None
        self.weight_version = 0
        self._pinned: list[torch.Tensor] = []
        self._asleep = False

    def generate(
        self, prompt_ids: list[list[int]], sampling: Any, seeds: Optional[list[int]] = None, max_new_tokens: Optional[list[int]] = None
    ) -> list[Generation]:
        """See RolloutEngine.generate; one SamplingParams per request so each has its own seed and budget."""
        check_sampling(sampling)
        check_prompts(prompt_ids, seeds, 2**62)
        budgets = check_budgets(prompt_ids, sampling, max_new_tokens, self.max_seq_len)
        params = [
            self._SamplingParams(
                **build_sampling_kwargs(
                    sampling, eos_token_id=self.eos_token_id, seed=None if seeds is None else int(seeds[i]), max_new_tokens=budgets[i]
                )
            )
            for i in range(len(prompt_ids))
        ]

        async def requests() -> list:
            import asyncio

            # submitted on the engine's loop (their result queues bind to it); in flight together
            pending = [self.llm.generate_async({"prompt_token_ids": list(p)}, sampling_params=sp) for p, sp in zip(prompt_ids, params)]
            return list(await asyncio.gather(*(r.aresult() for r in pending)))

        outs = self._loop.run(requests())
        gens = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            reason = "stop" if c.finish_reason == "stop" else "length"
            gens.append(
                Generation(ids, sampled_log_probs(ids, c.logprobs), reason, self.weight_version, {"trtllm_finish_reason": c.finish_reason})
            )
        return gens

    @staticmethod
    def ipc_handles(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list]:
        """{device_uuid: [(hf_name, (rebuild_fn, args)), ...]} for CUDA tensors on the current device."""
        from torch.multiprocessing.reductions import reduce_tensor

        try:
            from tensorrt_llm._torch.utils import get_device_uuid
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        handles = []
        for name, t in named_tensors:
            if not t.is_cuda:
                raise ValueError(f"update_weights: {name} is on {t.device}; TrtllmEngine needs CUDA tensors on the current device")
            handles.append((name, reduce_tensor(t.detach().contiguous())))
        return {get_device_uuid(torch.cuda.current_device()): handles}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of full HF-named CUDA tensors -> ``AsyncLLM.update_weights(handles)``."""
        bucket = [(n, t.detach().contiguous()) for n, t in named_tensors]
        self._pinned.extend(t for _, t in bucket)  # keep the memory alive until the workers copied it
        self.update_weights_from_handles(self.ipc_handles(bucket))
        self._pinned.clear()

    def update_weights_from_handles(self, ipc_handles: dict[str, list]) -> None:
        """Send prebuilt handles {device_uuid: [(hf_name, handle)]} (one entry per engine GPU): public
        ``AsyncLLM.update_weights``, which sends the workers' "update_weights" RPC."""
        self._loop.run(self.llm.update_weights(ipc_handles))

    def finish_weight_update(self) -> None:
        """Finalize (worker ``update_weights(None)``: post-load hooks, prefix-cache reset) through the public
        ``AsyncLLM.collective_rpc``, and bump weight_version."""
        self._loop.run(self.llm.collective_rpc("update_weights", args=(None,)))
        self.weight_version += 1

    def _memory_tags(self) -> list[str]:
        """:func:`memory_tags` of the installed TensorRT-LLM's ExecutorMemoryType."""
        from tensorrt_llm._torch.virtual_memory import ExecutorMemoryType

        return memory_tags(ExecutorMemoryType)

    def offload(self) -> None:
        """Release weights, KV cache and the executor's other GPU memory (``AsyncLLM.release(tags)``)."""
        if not self._asleep:
            self._loop.run(self.llm.release(self._memory_tags()))
            self._asleep = True

    def onload(self) -> None:
        """Restore the memory offload released (``AsyncLLM.resume(tags)``); a refit follows."""
        if self._asleep:
            self._loop.run(self.llm.resume(self._memory_tags()))
            self._asleep = False

    def shutdown(self) -> None:
        """Shut the workers down (``AsyncLLM.shutdown``, called on the engine's loop), then stop the loop."""

        async def stop() -> None:
            self.llm.shutdown()

        try:
            self._loop.run(stop())
        finally:
            self._loop.close()


@dataclass(frozen=True)
class TrtllmReplica:
    """Where one actor rank stands in the TensorRT-LLM engine layout over the actor group.

    The actor's ``world`` ranks form ``replicas = world / (tp * pp)`` engine replicas of
    ``workers = tp * pp`` contiguous ranks (rollout.parallel). The first rank of each replica
    (``owner``) builds that replica's ``LLM``, whose ``workers`` Ray workers go into the node
    bundle ``bundle_index`` of the actor's placement group (the owner's node, one worker per
    actor GPU there, see aligner.workers.placement.TRTLLM_WORKER_GPU_SHARE).
    ``engine_kwargs`` are the keywords of ``TrtllmEngine(model_dir, rollout_cfg, **engine_kwargs)``
    except ``placement``, which needs the live placement group (:func:`ray_placement`).
    """

    replicas: int
    replica: int
    owner: bool
    workers: int
    bundle_index: int
    engine_kwargs: dict


def trtllm_replica(
    cfg: Any, world_size: int, rank: int, eos_token_id: Optional[int], num_nodes: Optional[int] = None, sleep: bool = True
) -> TrtllmReplica:
    """The TrtllmReplica of `rank` of a worker group of `world_size` ranks on `num_nodes` nodes (default
    the actor's, ``actor.resources.num_nodes``; the split placement's rollout group passes
    ``rollout.resources.num_nodes``) for an AlignerConfig `cfg` (pure: no Ray, no CUDA, no tensorrt_llm).
    sleep: the engine may sleep (``enable_sleep``; colocated with a trainer), or keeps its GPUs (split).

    Raises ValueError naming rollout.parallel when tp * pp does not divide the group's ranks on
    one node (AlignerConfig validation refuses that before this is reached).
    """
    rp = cfg.rollout.parallel
    workers = rp.tp_size * rp.pp_size
    per_node = world_size // max(1, cfg.actor.resources.num_nodes if num_nodes is None else num_nodes)
    if workers < 1 or per_node % workers or world_size % workers:
        raise ValueError(
            f"rollout.parallel tp_size={rp.tp_size} x pp_size={rp.pp_size} must divide the group's {per_node} "
            "ranks per node: a TensorRT-LLM engine replica lives on one node"
        )
    return TrtllmReplica(
        replicas=world_size // workers,
        replica=rank // workers,
        owner=rank % workers == 0,
        workers=workers,
        bundle_index=rank // per_node,
        engine_kwargs={
            "max_seq_len": cfg.model.max_seq_len,
            "eos_token_id": eos_token_id,
            "dtype": cfg.rollout.dtype,
            "enable_sleep": sleep,
            "dummy_weights": True,
        },
    )


def ray_placement(replica: TrtllmReplica, placement_group: Any, gpu_share: float) -> Optional[dict]:
    """RayPlacementConfig fields putting the replica's workers in `placement_group`'s bundle
    ``replica.bundle_index`` with `gpu_share` of a GPU each; None without a placement group
    (a process outside Ray worker groups: TensorRT-LLM then makes its own)."""
    if placement_group is None:
        return None
    return {
        "placement_groups": [placement_group],
        "placement_bundle_indices": [[replica.bundle_index] * replica.workers],
        "per_worker_gpu_share": gpu_share,
    }


def write_engine_model_dir(model_cfg: Any, directory: str) -> str:
    """Write the HF config.json of aligner ModelConfig `model_cfg` into `directory`; return it.

    The engine starts from it with dummy weights (LoadFormat.DUMMY); the first refit loads
    the policy. Llama, or Qwen2 for q/k/v biases without an o_proj bias (model_config_to_hf).
    """
    import json
    from pathlib import Path

    from aligner.model.hf import model_config_to_hf

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config_to_hf(model_cfg, "lm"), indent=2))
    return str(path)


WAIT_S = 7200.0  # how long a rank may wait at the replica protocol's barriers (engine start, generation), seconds


def cpu_wait_group(timeout_s: float = WAIT_S) -> Any:
    """A gloo group over the actor's ranks for the handle gather and the barriers (None in one process).

    Non-owner ranks wait there while owners start the engine or generate: minutes, past the
    NCCL groups' timeout (aligner.parallel.dims.init_process_group, 300 s), so they wait on
    the CPU with `timeout_s`. Collective: every rank must call it, in the same order.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from datetime import timedelta

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class ColocatedTrtllmEngine(RolloutEngine):
    """One actor rank's side of a TensorRT-LLM replica colocated with the trainer (rollout.backend=trtllm).

    Every actor rank holds one; the replica owner's also holds the :class:`TrtllmEngine`
    (``engine``), the others None. Refit follows TensorRT-LLM's WorkerExtension.update_weights
    contract: per bucket, every rank casts its full HF-named tensors to the engine dtype on its
    own GPU and makes CUDA IPC handles of them keyed by its GPU's UUID; the handles of all ranks
    are all-gathered over `group` (the actor's default group when None), and each owner sends
    the merged dict with ``AsyncLLM.update_weights(handles)``; each engine worker
    rebuilds the tensors of its own GPU's UUID (that GPU's actor rank). A barrier then keeps
    every rank's bucket alive until all owners' RPCs returned. `group` should be
    :func:`cpu_wait_group`'s (the barriers last as long as an engine start or a generation). ``finish_weight_update``
    finalizes on the owners (``update_weights(None)``) and bumps ``weight_version`` on every rank.
    offload / onload are the owners' ``AsyncLLM.release`` / ``resume`` followed by a barrier.

    Collective: every rank of `group` must call update_weights, finish_weight_update, offload
    and onload the same number of times. generate runs on owners only (RuntimeError elsewhere).
    Nothing here has run on a GPU (see the module docstring).
    """

    def __init__(self, engine: Optional[TrtllmEngine], *, dtype: str = "bfloat16", group: Any = None):
        self.engine, self.group = engine, group
        self.dtype = getattr(torch, dtype)
        self.weight_version = 0

    @property
    def owner(self) -> bool:
        return self.engine is not None

    def _barrier(self) -> None:
        if _world(self.group) > 1:
            dist.barrier(group=self.group)

    def gather_handles(self, local: dict[str, list]) -> dict[str, list]:
        """{device_uuid: handles} of every rank of the group, merged (the first rank's entry wins a repeated UUID)."""
        n = _world(self.group)
        if n == 1:
            return dict(local)
        parts: list = [None] * n
        dist.all_gather_object(parts, local, group=self.group)
        merged: dict[str, list] = {}
        for part in parts:
            for uuid, handles in part.items():
                merged.setdefault(uuid, handles)
        return merged

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of full HF-named tensors (any device/dtype: copied to this rank's GPU in the engine dtype)."""
        device = torch.device("cuda", torch.cuda.current_device())
        bucket = [(n, t.detach().to(device=device, dtype=self.dtype).contiguous()) for n, t in named_tensors]
        merged = self.gather_handles(TrtllmEngine.ipc_handles(bucket))
        if self.owner:
            self.engine.update_weights_from_handles(merged)
        self._barrier()  # the workers copied every rank's tensors before any rank drops its bucket
        del bucket

    def finish_weight_update(self) -> None:
        if self.owner:
            self.engine.finish_weight_update()
        self._barrier()
        self.weight_version += 1

    def generate(
        self, prompt_ids: list[list[int]], sampling: Any, seeds: Optional[list[int]] = None, max_new_tokens: Optional[list[int]] = None
    ) -> list[Generation]:
        """See RolloutEngine.generate; on the replica owner only."""
        if not self.owner:
            raise RuntimeError("ColocatedTrtllmEngine.generate runs on the replica owner (the rank holding the LLM) only")
        return self.engine.generate(prompt_ids, sampling, seeds=seeds, max_new_tokens=max_new_tokens)

    def offload(self) -> None:
        """Sleep the replica (owners' ``AsyncLLM.release``), then wait for every owner."""
        if self.owner:
            self.engine.offload()
        self._barrier()

    def onload(self) -> None:
        """Wake the replica (owners' ``AsyncLLM.resume``), then wait for every owner."""
        if self.owner:
            self.engine.onload()
        self._barrier()

    def shutdown(self) -> None:
        if self.owner:
            self.engine.shutdown()
