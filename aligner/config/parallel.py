"""One role's layout (TP x PP x DP x EP, how it trains) and what it asks of the cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from aligner.config.common import _check, _choice
from aligner.config.model import ModelConfig


def cp_runs_with_ep(tp_size: int, pp_size: int, dp_size: int, ep_size: int) -> bool:
    """Whether context parallelism (cp_size > 1) runs with this expert parallelism: ep_size = 1, or ep_size =
    dp_size at tp_size = pp_size = 1, the layout compared with one process
    (tests/parallel/test_context_parallel_ep.py). The one rule :meth:`ParallelConfig.validate_cp`,
    :class:`aligner.parallel.dims.ParallelDims` and the planner's layout search apply."""
    return ep_size == 1 or (tp_size, pp_size, dp_size) == (1, 1, ep_size)


FSDP_REDUCE = ("micro_batch", "step")  # ParallelConfig.fsdp_reduce: when FSDP2 reduce-scatters gradients


@dataclass(kw_only=True)
class ParallelConfig:
    """One role's TP x PP x DP layout and how it trains (Megatron-style TP/SP, 1F1B PP)."""

    tp_size: int = 1  # tensor-parallel ranks
    pp_size: int = 1  # pipeline stages
    dp_size: int = 1  # data-parallel replicas
    ep_size: int = 1  # expert parallelism (MoE): each group of ep_size dp ranks splits the experts (divides dp_size)
    # context parallelism (training roles): each sequence split over cp_size ranks in 2 * cp_size zigzag chunks,
    # attention by all-gather of K/V (aligner.parallel.context_parallel); per-token outputs gathered for the loss
    cp_size: int = 1
    sequence_parallel: bool = False  # split norm regions along the sequence (needs tp_size > 1 to matter)
    recompute: str = "none"  # activation recomputation per layer: none | selective | full
    dp_backend: str = "fsdp2"  # fsdp2 | ddp | deepspeed
    zero_stage: int = 1  # DeepSpeed ZeRO stage 1-3 (dp_backend=deepspeed only)
    offload_optimizer: bool = False  # DeepSpeed CPU-offloaded Adam (dp_backend=deepspeed only)
    mixed_precision: str = "fp32"  # fp32 | bf16 (bf16 compute, fp32 master weights and grad reduction)
    # FSDP2 gradient accumulation over a step's micro-batches (dp_backend=fsdp2): micro_batch = each layer is
    # all-gathered in forward and backward and its gradient reduce-scattered for every micro-batch (least memory);
    # step = each layer all-gathered once and reduce-scattered once per optimizer step, at the last micro-batch,
    # holding every layer's unsharded parameters and fp32 gradients through the step, like DDP (Megatron's
    # distributed optimizer; ep_size=1 only); aligner.parallel.data_parallel.FsdpStepReduce
    fsdp_reduce: str = "micro_batch"
    pp_layer_split: Optional[list[int]] = None  # layers per pipeline stage (uneven splits); None = even
    # interleaved 1F1B (Narayanan et al. 2021): model chunks per pipeline rank, each rank holding v
    # non-contiguous virtual pipeline stages of num_layers / (pp_size * v) layers; the bubble shrinks v-fold
    virtual_pp_size: int = 1
    # policy log-probs / entropy: positions per chunk of the fused head + softmax (aligner.nn.chunked),
    # so no [B, R, V/tp] fp32 logits exist; 0 = the unchunked path (the head's logits, then aligner.nn.vocab);
    # -1 = as many positions as keep one chunk's fp32 logits within 256 MiB (aligner.nn.chunked.auto_chunk_size)
    logprob_chunk_size: int = -1
    # torch.compile each decoder block for training (torchtitan's per-block compile, applied by
    # aligner.parallel.parallelize); off by default: on the CPU it was measured no faster (benchmarks/RESULTS.md)
    compile: bool = False

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.pp_size * self.dp_size

    def validate(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "cp_size"):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        _choice(f"{prefix}.recompute", self.recompute, ("none", "selective", "full"))
        _choice(f"{prefix}.dp_backend", self.dp_backend, ("fsdp2", "ddp", "deepspeed"))
        _choice(f"{prefix}.mixed_precision", self.mixed_precision, ("fp32", "bf16"))
        _choice(f"{prefix}.zero_stage", self.zero_stage, (0, 1, 2, 3))
        _choice(f"{prefix}.fsdp_reduce", self.fsdp_reduce, FSDP_REDUCE)
        if self.fsdp_reduce == "step":
            _check(
                self.dp_backend == "fsdp2",
                f"{prefix}.fsdp_reduce",
                self.fsdp_reduce,
                f"needs {prefix}.dp_backend=fsdp2, not {self.dp_backend} (DDP already all-reduces once per step; DeepSpeed "
                f"accumulates itself): set {prefix}.fsdp_reduce=micro_batch",
            )
            _check(
                self.ep_size == 1,
                f"{prefix}.fsdp_reduce",
                self.fsdp_reduce,
                f"with expert parallelism ({prefix}.ep_size={self.ep_size}) is untested: set {prefix}.fsdp_reduce=micro_batch or ep_size=1",
            )
        _check(
            self.logprob_chunk_size >= -1,
            f"{prefix}.logprob_chunk_size",
            self.logprob_chunk_size,
            "must be >= -1 (positions per chunk, e.g. 512; 0 = unchunked logits; -1 = chunks of 256 MiB of logits)",
        )
        _check(
            self.ep_size >= 1 and self.dp_size % self.ep_size == 0,
            f"{prefix}.ep_size",
            self.ep_size,
            f"must divide {prefix}.dp_size={self.dp_size} (experts are split over groups of ep_size data-parallel ranks)",
        )
        if self.ep_size > 1:
            _check(
                self.dp_backend != "deepspeed",
                f"{prefix}.ep_size",
                self.ep_size,
                "expert parallelism runs with dp_backend=fsdp2 or ddp, not deepspeed; set ep_size=1 or another dp_backend",
            )
        if self.dp_backend == "deepspeed":
            _check(
                self.tp_size == 1 and self.pp_size == 1,
                f"{prefix}.dp_backend",
                self.dp_backend,
                "DeepSpeed ZeRO is supported only where tp_size = pp_size = 1; use fsdp2 or ddp",
            )
        self.validate_cp(prefix, model)
        self.validate_virtual_pp(prefix, model)
        if model is None:
            return
        _check(
            model.num_heads % self.tp_size == 0,
            f"{prefix}.tp_size",
            self.tp_size,
            f"must divide model.num_heads={model.num_heads}; valid: "
            + ", ".join(str(d) for d in range(1, model.num_heads + 1) if model.num_heads % d == 0),
        )
        kv, tp = model.num_kv_heads, self.tp_size
        _check(
            kv % tp == 0 or tp % kv == 0,
            f"{prefix}.tp_size",
            tp,
            f"must divide or be a multiple of model.num_kv_heads={kv}",
        )
        _check(
            model.intermediate_size % tp == 0,
            f"{prefix}.tp_size",
            tp,
            f"must divide model.intermediate_size={model.intermediate_size}",
        )
        _check(
            self.pp_size <= model.num_layers,
            f"{prefix}.pp_size",
            self.pp_size,
            f"cannot exceed model.num_layers={model.num_layers}",
        )
        if self.ep_size > 1:
            _check(
                model.num_experts > 0 and model.num_experts % self.ep_size == 0,
                f"{prefix}.ep_size",
                self.ep_size,
                f"needs an MoE model whose model.num_experts={model.num_experts} it divides; set ep_size=1 for a dense model",
            )
        if self.pp_layer_split is not None:
            split = list(self.pp_layer_split)
            _check(
                len(split) == self.pp_size and sum(split) == model.num_layers and min(split) >= 1,
                f"{prefix}.pp_layer_split",
                split,
                f"needs {self.pp_size} positive entries summing to model.num_layers={model.num_layers}",
            )

    def validate_virtual_pp(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        """virtual_pp_size: >= 1; above 1, a training layout the interleaved schedule runs."""
        v, field = self.virtual_pp_size, f"{prefix}.virtual_pp_size"
        _check(v >= 1, field, v, "must be >= 1 (model chunks per pipeline rank; 1 = plain 1F1B)")
        if v == 1:
            return
        _check(not prefix.startswith("rollout"), field, v, "the interleaved schedule is for training: set virtual_pp_size=1")
        _check(self.pp_size > 1, field, v, f"needs {prefix}.pp_size > 1 (chunks of a pipeline)")
        _check(self.pp_layer_split is None, field, v, f"splits the layers evenly: set {prefix}.pp_layer_split=null")
        _check(
            self.dp_backend in ("ddp", "fsdp2") or self.dp_size == 1,
            field,
            v,
            f"runs with dp_backend=ddp or fsdp2 or dp_size=1 (DeepSpeed wraps the whole pipeline stage): set {prefix}.dp_backend=fsdp2",
        )
        _check(
            model is None or self.pp_size * v <= model.num_layers,
            field,
            v,
            f"pp_size x virtual_pp_size = {self.pp_size * v} virtual pipeline stages exceed model.num_layers={model and model.num_layers}",
        )

    def validate_cp(self, prefix: str, model: Optional[ModelConfig] = None) -> None:
        """cp_size: a training role's layout the context-parallel runtime supports (the rollout engine
        never splits a sequence), with the zigzag split of the longest sequence fitting the model's positions."""
        cp = self.cp_size
        if cp == 1:
            return
        field = f"{prefix}.cp_size"
        _check(
            not prefix.startswith("rollout"),
            field,
            cp,
            "context parallelism is for training: the rollout engine decodes with a per-sequence KV cache; set cp_size=1",
        )
        _check(
            model is None or model.max_seq_len % (2 * cp) == 0,
            field,
            cp,
            f"must let 2 * cp_size = {2 * cp} divide model.max_seq_len={model and model.max_seq_len} (sequences are padded to a "
            f"multiple of 2 * cp_size for the zigzag split): choose a cp_size with 2 * cp_size dividing it",
        )
        _check(self.dp_backend != "deepspeed", field, cp, "context parallelism runs with dp_backend=fsdp2 or ddp, not deepspeed")
        _check(not self.compile, field, cp, f"context parallelism with {prefix}.compile=true is untested: set compile=false")
        _check(
            self.logprob_chunk_size != 0,
            field,
            cp,
            f"context parallelism gathers per-token outputs across cp ranks, not [B, T, V] logits: set {prefix}.logprob_chunk_size=-1 "
            "(or a positive chunk)",
        )
        if not cp_runs_with_ep(self.tp_size, self.pp_size, self.dp_size, self.ep_size):  # name the first field off the rule
            for name, value, want in (("tp_size", self.tp_size, 1), ("pp_size", self.pp_size, 1), ("dp_size", self.dp_size, self.ep_size)):
                _check(
                    value == want,
                    field,
                    cp,
                    f"context parallelism with expert parallelism is tested only at tp_size=1, pp_size=1, dp_size=ep_size, "
                    f"not {prefix}.{name}={value}: set {prefix}.{name}={want} or {prefix}.ep_size=1",
                )
        if model is not None:
            if model.num_experts:  # the auxiliary losses are reduced over cp; what routes a rank's tokens alone is refused
                _check(
                    model.moe_router == "topk_softmax",
                    field,
                    cp,
                    f"context parallelism with model.moe_router={model.moe_router} is not supported: Sinkhorn balances each cp rank's "
                    "tokens alone; set model.moe_router=topk_softmax or cp_size=1",
                )
                _check(
                    model.moe_capacity_factor is None,
                    field,
                    cp,
                    f"context parallelism with model.moe_capacity_factor={model.moe_capacity_factor} is not supported: the capacity "
                    "would cut each cp rank's tokens alone; set model.moe_capacity_factor=null (dropless) or cp_size=1",
                )
            _check(model.backend == "torch", field, cp, f"context parallelism needs model.backend=torch, not {model.backend!r}")


@dataclass(kw_only=True)
class ResourceConfig:
    """What one role asks of the cluster (its node group)."""

    num_nodes: int = 1  # nodes in this role's node group
    gpus_per_node: int = 0  # GPUs per node this role uses; 0 = CPU workers
    cpus_per_worker: int = 1  # CPUs per Ray worker (on CPU runs also torch threads per worker)
