"""TrtllmEngine: TensorRT-LLM 1.2 ``LLM`` (PyTorch backend, Ray orchestrator) as a rollout engine.

Owns: the mapping from aligner's RolloutConfig / SamplingConfig to TensorRT-LLM's ``LLM``
and ``SamplingParams`` keywords (:func:`build_llm_kwargs`, :func:`build_sampling_kwargs`:
pure functions, contract-tested on CPU against the recorded 1.2.1 API in
shared/data/apis/tensorrt_llm.json), refit through ``WorkerExtension.update_weights`` and
sleep/wakeup around training.

What the adapter uses (names checked against the 1.2.1 source unless marked):
- ``LLM(model=..., tensor_parallel_size=rollout.parallel.tp_size,
  pipeline_parallel_size=rollout.parallel.pp_size, orchestrator_type="ray",
  ray_worker_extension_cls="tensorrt_llm.llmapi.rlhf_utils.WorkerExtension", enable_sleep,
  kv_cache_config=KvCacheConfig(...), cuda_graph_config=CudaGraphConfig(...) | None,
  sampler_type="TorchSampler", skip_tokenizer_init=True, max_batch_size, max_seq_len, dtype)``.
- refit: ``llm._collective_rpc("update_weights", args=(ipc_handles,))`` once per bucket, where
  ``ipc_handles = {device_uuid: [(hf_name, torch.multiprocessing.reductions.reduce_tensor(t)), ...]}``
  (the worker rebuilds each tensor on its own device and calls the model loader's
  ``reload(..., allow_partial_loading=True)``), then ``args=(None,)`` to finalize (post-load
  hooks, prefix-cache reset). Device UUIDs come from ``tensorrt_llm._torch.utils.get_device_uuid``,
  the function the worker itself uses (imported from that module by rlhf_utils.py at main
  revisions 04762f3b / 65b31db1; NOT in the recorded 1.2.1 API).
- sleep / wakeup: ``llm._collective_rpc("sleep" | "wakeup", args=(tags,))`` with
  ``tags`` = ExecutorMemoryType members (``tensorrt_llm._torch.virtual_memory``; taken from a
  TensorRT-LLM unit test, NOT in the recorded API). Needs ``enable_sleep=True``; that test
  turns CUDA graphs off with sleep ("CUDA Graph unsupported yet"), and so do we.
- log-probs: ``SamplingParams(logprobs=0)`` returns only the sampled token's log-prob
  (documented in TensorRT-LLM's ray example). 1.2.1 has NO ``logprobs_mode`` (vLLM's name;
  absent from the recorded SamplingParams), so whether the returned values are taken before
  or after temperature / top-k / top-p processing is not settled by the API; the trainer
  recomputes ``old_log_probs`` anyway and the mismatch metric exposes any difference.

Status: NOTHING in this module has run on a GPU or against an installed tensorrt_llm (it
cannot be installed on the CPU development machine, and the H100 lent on 2026-11-22 had no
tensorrt_llm and no network to fetch it from NVIDIA's index; its wheels exceed what can be
carried there). build_llm_kwargs / build_sampling_kwargs
and the call sites are checked statically by tests/rollout/test_trtllm_engine.py; the end-to-end
behaviour is exercised only by tests/rollout/test_trtllm_engine_gpu.py where the package imports.
Simplification: one Python process owns the LLM; tensors handed to update_weights must live
on that process's current CUDA device, and with tp/pp > 1 the caller must gather handles for
every engine GPU (``update_weights_from_handles``).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

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
) -> dict:
    """Keywords for ``tensorrt_llm.LLM(**kw)`` from a RolloutConfig.

    Args:
        cfg: RolloutConfig (parallel.tp_size, parallel.pp_size, max_batch_size, cuda_graphs).
        model_dir: HF checkpoint directory the engine starts from (weights are refit later).
        max_seq_len: prompt + response tokens.
        dtype: "bfloat16" | "float16" | "float32" (aligner's ModelConfig.dtype names).
        enable_sleep: allow sleep/wakeup around training (turns CUDA graphs off, see module doc).
        free_gpu_memory_fraction: KV cache share of the free GPU memory, in (0, 1].
    Returns:
        dict; ``kv_cache_config`` / ``cuda_graph_config`` are dicts of KvCacheConfig /
        CudaGraphConfig fields (or None), turned into those objects by TrtllmEngine.
    Raises:
        ValueError: bad dtype or memory fraction.
    """
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype={dtype!r} is invalid: valid choices are bfloat16, float16, float32")
    if not 0 < free_gpu_memory_fraction <= 1:
        raise ValueError(f"free_gpu_memory_fraction={free_gpu_memory_fraction!r} is invalid: must be in (0, 1]")
    graphs = bool(cfg.cuda_graphs) and not enable_sleep
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
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return LLM, SamplingParams, KvCacheConfig, CudaGraphConfig


class TrtllmEngine(RolloutEngine):
    """RolloutEngine over a TensorRT-LLM ``LLM`` with the Ray orchestrator (GPU only).

    Args:
        model_dir: HF checkpoint dir to start from.
        cfg: RolloutConfig.
        max_seq_len: prompt + response tokens.
        eos_token_id: stop token (SamplingParams.end_id).
        dtype: engine dtype name.
        enable_sleep: enable sleep/wakeup (offload/onload).
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
    ):
        LLM, self._SamplingParams, KvCacheConfig, CudaGraphConfig = _import_trtllm()
        kw = build_llm_kwargs(cfg, model_dir, max_seq_len=max_seq_len, dtype=dtype, enable_sleep=enable_sleep)
        kv, graphs = kw.pop("kv_cache_config"), kw.pop("cuda_graph_config")
        self.llm = LLM(
            model=kw["model"],
            tensor_parallel_size=kw["tensor_parallel_size"],
            pipeline_parallel_size=kw["pipeline_parallel_size"],
            orchestrator_type=kw["orchestrator_type"],
            ray_worker_extension_cls=kw["ray_worker_extension_cls"],
            enable_sleep=kw["enable_sleep"],
            skip_tokenizer_init=kw["skip_tokenizer_init"],
            dtype=kw["dtype"],
            max_batch_size=kw["max_batch_size"],
            max_seq_len=kw["max_seq_len"],
            sampler_type=kw["sampler_type"],
            kv_cache_config=KvCacheConfig(**kv),
            cuda_graph_config=CudaGraphConfig(**graphs) if graphs is not None else None,
        )
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
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], sampling_params=params, use_tqdm=False)
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
        """One bucket of full HF-named CUDA tensors -> ``_collective_rpc("update_weights", (handles,))``."""
        bucket = [(n, t.detach().contiguous()) for n, t in named_tensors]
        self._pinned.extend(t for _, t in bucket)  # keep the memory alive until the workers copied it
        self.update_weights_from_handles(self.ipc_handles(bucket))
        self._pinned.clear()

    def update_weights_from_handles(self, ipc_handles: dict[str, list]) -> None:
        """Send prebuilt handles {device_uuid: [(hf_name, handle)]} (one entry per engine GPU)."""
        self.llm._collective_rpc("update_weights", args=(ipc_handles,))

    def finish_weight_update(self) -> None:
        """Finalize (``update_weights(None)``: post-load hooks, prefix-cache reset) and bump weight_version."""
        self.llm._collective_rpc("update_weights", args=(None,))
        self.weight_version += 1

    def _memory_tags(self) -> list:
        from tensorrt_llm._torch.virtual_memory import ExecutorMemoryType

        return list(ExecutorMemoryType)

    def offload(self) -> None:
        """Release weights and KV cache memory (worker RPC "sleep")."""
        if not self._asleep:
            self.llm._collective_rpc("sleep", args=(self._memory_tags(),))
            self._asleep = True

    def onload(self) -> None:
        """Restore memory released by offload (worker RPC "wakeup")."""
        if self._asleep:
            self.llm._collective_rpc("wakeup", args=(self._memory_tags(),))
            self._asleep = False

    def shutdown(self) -> None:
        self.llm.shutdown()
