"""The schedulers' narrow view of the engine: the model shard of one rank and its hooks.

A scheduler (:mod:`aligner.rollout.torch_engine.continuous_batching`,
:mod:`aligner.rollout.torch_engine.static_batching`) runs forwards, caches and collectives; it
needs the rank's decoder stack and head, its place in the engine's tensor / pipeline layout, the
shapes of its KV caches and four hooks, never the engine itself (as vLLM's and SGLang's
schedulers hand batches to a model runner instead of holding the engine). The engine builds one
:class:`ModelShard` (:meth:`aligner.rollout.torch_engine.engine.TorchEngine.model_shard`) and
gives it to its scheduler, so the schedulers import neither the engine nor the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.rollout.base import Generation


@dataclass(frozen=True)
class ModelShard:
    """One engine rank's model shard, as its scheduler drives it.

    Model:
        trunk: the decoder stack of this pipeline stage (``LlamaForCausalLM.model``):
            ``trunk(x, position_ids=[B, T] int64, attn_mask=bool or None, kv_cache=cache,
            cache_positions=[T] int64 or None) -> hidden [B, T, H]`` in ``dtype``; x is token ids
            [B, T] int64 on the first pipeline stage, the previous pipeline stage's hidden states [B, T, H] on the others.
        lm_head: hidden [n, H] -> this tp rank's logits [n, V/tp] (called on the last pipeline stage only).
        layers: this pipeline stage's decoder layer indices, ascending (the KV caches' keys).
        kv_heads: key/value heads on this tp rank (num_kv_heads / tp); head_dim, hidden_size: the model's.
    Layout:
        tp_group: the engine's tensor-parallel group (None: tp = 1; sampling reduces over it).
        pp_group, pp_size, pp_rank: the engine's pipeline group (None: pp = 1), its size and this pipeline stage's index.
    Mixture of Experts:
        moe_layers: local SparseMoE layers (0: a dense model, no routing recorded); moe_top_k: their k.
        pp_stage_routing: ``() -> [N, moe_layers, k] int16``, the experts of the last forward's N positions.
        attach_routing: ``(gens or None, routing [B, >= R, moe_layers, k] or None) -> None``: sets each
            Generation's routed_experts (with pp > 1 a collective over the pp group, on every pipeline stage).
    Weights:
        weight_version: ``() -> int``, the version of the weights now in the shard (read at each step:
            an interruptible engine's version changes during a call).
        step_boundary: ``() -> None``, applies the weight syncs staged since the last step (interruptible
            engines; the continuous scheduler calls it before each step's plan).
    """

    trunk: nn.Module
    lm_head: nn.Module
    layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    hidden_size: int
    tp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup]
    pp_size: int
    pp_rank: int
    moe_layers: int
    moe_top_k: int
    pp_stage_routing: Callable[[], torch.Tensor]
    attach_routing: Callable[[Optional[list[Generation]], Optional[torch.Tensor]], None]
    weight_version: Callable[[], int]
    step_boundary: Callable[[], None]

    @property
    def device(self) -> torch.device:
        """Where the shard's parameters are now (read per call: offload / onload move them)."""
        return next(self.trunk.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype: the KV caches' and the hidden states'."""
        return next(self.trunk.parameters()).dtype

    @property
    def is_first(self) -> bool:
        """This rank runs the first pipeline stage (it embeds token ids and, in the continuous scheduler, plans)."""
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        """This rank runs the last pipeline stage (it owns the logits and samples)."""
        return self.pp_rank == self.pp_size - 1
