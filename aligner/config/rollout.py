"""The rollout role's schema: the generation engine, its layout and sampling."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from aligner.config.common import _check, _choice
from aligner.config.model import ModelConfig
from aligner.config.parallel import ParallelConfig, ResourceConfig


@dataclass(kw_only=True)
class SamplingConfig:
    """Rollout sampling parameters."""

    temperature: float = 1.0  # softmax temperature; 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus mass in (0, 1]
    max_new_tokens: int = 16  # response tokens per prompt
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS

    def validate(self, prefix: str) -> None:
        _check(self.temperature >= 0, f"{prefix}.temperature", self.temperature, "must be >= 0 (0 = greedy)")
        _check(self.top_k >= 0, f"{prefix}.top_k", self.top_k, "must be >= 0 (0 = off)")
        _check(0 < self.top_p <= 1, f"{prefix}.top_p", self.top_p, "must be in (0, 1]")
        _check(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", self.max_new_tokens, "must be >= 1")


@dataclass(kw_only=True)
class RolloutConfig:
    """The actor's rollout engine and refit."""

    backend: str = "torch"  # torch (aligner's engine, CPU or CUDA) | trtllm (TensorRT-LLM 1.2 on the actor's GPUs; bf16/fp16) | vllm (vLLM in the worker's process, CPU: docs/vllm.md)
    # colocated: the engines live in the actor's processes, refit in place (NeMo-Aligner); split: the engines
    # form their own worker group on their own node group (rollout.resources), rollout.parallel.dp_size
    # replicas of tp = pp = 1, and receive the actor's weights by broadcast after each update (aligner.rollout.weight_sync.broadcast)
    placement: str = "colocated"
    resources: ResourceConfig = field(default_factory=ResourceConfig)  # split: the rollout group's node group
    # split, max_staleness >= 1: a weight sync lands between decode steps of the generations in flight (their
    # KV cache kept, every token records its version: AReaL's interruptible generation) instead of after them
    interruptible: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # engine tp/pp layout (dp = replicas)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how responses are sampled
    refit_bucket_mb: int = 256  # refit sends weights in buckets of this size, MiB
    max_batch_size: int = 256  # continuous: KV-cache slots (requests decoding at once); static: sequences per batch
    scheduler: str = "continuous"  # continuous (slots refilled as responses stop, shared prompt prefixes) | static
    micro_batches: int = 0  # continuous: slot-pool blocks in flight through the engine's pipeline (0 = its pp_size)
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (GPU; the continuous scheduler with pp = 1, one micro-batch)
    compile: str = (
        "auto"  # torch.compile each decoder layer for generation: on | off | auto (= off for now: no faster on CPU, unrun on CUDA)
    )
    dtype: str = "float32"  # engine weights and KV cache: float32 | bfloat16 | float16 (refit casts)
    # rollout.backend=vllm: vLLM's gpu_memory_utilization. On CPU workers it is the share of the MACHINE's memory
    # each engine reserves (its process's resident memory included; the rest is its KV cache), refused up front
    # when the engines on a machine would need more than is available
    gpu_memory_utilization: float = 0.2
    # the planner's response lengths (tokens; read by nothing else): the mean, and the longest of a batch
    # (static batches decode until it stops; a continuous pool drains for it). 0 = sampling.max_new_tokens,
    # the conservative bound (a plan cannot know how long responses run)
    expected_response_len: float = 0.0
    expected_response_len_max: float = 0.0
    # planner: a previous PPO run's metrics.jsonl; the means of its rows' response_len and response_len_max
    # are the mean and the longest (expected_response_len_max, when set, stays the longest)
    expected_response_len_from: str = ""

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        _choice(f"{prefix}.backend", self.backend, ("torch", "trtllm", "vllm"))
        _choice(f"{prefix}.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _choice(f"{prefix}.scheduler", self.scheduler, ("continuous", "static"))
        _choice(f"{prefix}.placement", self.placement, ("colocated", "split"))
        _choice(f"{prefix}.compile", self.compile, ("auto", "on", "off"))
        _check(self.max_batch_size >= 1, f"{prefix}.max_batch_size", self.max_batch_size, "must be >= 1")
        _check(self.micro_batches >= 0, f"{prefix}.micro_batches", self.micro_batches, f"must be >= 0 (0 = {prefix}.parallel.pp_size)")
        self.parallel.validate(f"{prefix}.parallel", model)
        self.sampling.validate(f"{prefix}.sampling")
        _check(0 < self.gpu_memory_utilization <= 1, f"{prefix}.gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        _check(self.refit_bucket_mb > 0, f"{prefix}.refit_bucket_mb", self.refit_bucket_mb, "must be positive")
        self.validate_expected_lengths(prefix)

    def validate_expected_lengths(self, prefix: str) -> None:
        """The planner's response lengths: each 0 (= max_new_tokens) or in [1, max_new_tokens], the mean
        at most the longest, a mean given once (a number or a metrics file that exists)."""
        new = self.sampling.max_new_tokens
        for name in ("expected_response_len", "expected_response_len_max"):
            v = getattr(self, name)
            _check(
                v == 0 or 1 <= v <= new,
                f"{prefix}.{name}",
                v,
                f"give response tokens in [1, {prefix}.sampling.max_new_tokens={new}], or 0 for max_new_tokens",
            )
        mean, tail = self.expected_response_len, self.expected_response_len_max
        _check(
            not (mean and tail and mean > tail),
            f"{prefix}.expected_response_len",
            mean,
            f"the mean cannot exceed {prefix}.expected_response_len_max={tail}: lower it or raise the max",
        )
        path = self.expected_response_len_from
        _check(
            not (path and mean),
            f"{prefix}.expected_response_len_from",
            path,
            f"give the mean once: clear it or {prefix}.expected_response_len={mean}",
        )
        _check(
            not path or os.path.isfile(path),
            f"{prefix}.expected_response_len_from",
            path,
            "no such file: give a previous PPO run's metrics.jsonl (output_dir/metrics.jsonl), or clear it",
        )
