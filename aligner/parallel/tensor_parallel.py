"""Apply Megatron-style tensor and sequence parallelism to a built Llama model, and sync its grads.

Owns: :func:`apply_tensor_parallel` (shard every :class:`ParallelLayer` in place over a
tp group, GQA key/value head placement, re-tying tied embeddings, sequence-parallel
hidden states), :func:`sync_tp_grads` (the gradient reductions TP/SP leave to the
caller after backward) and :func:`vocab_start` (first vocabulary id of a rank's shard).

Scheme (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism): q/k/v,
gate/up and lm_head are column-parallel, o/down row-parallel, the embedding is
vocab-parallel; norms are replicated. With sequence parallelism the hidden states
between layers are [B, T/tp, H] and the callers must give T divisible by tp_size.

GQA (Ainslie et al. 2023): with num_kv_heads % tp_size == 0 the kv heads are split
like the query heads. With num_kv_heads < tp_size (tp_size % num_kv_heads == 0) each kv
head is replicated on tp_size / num_kv_heads ranks: rank r holds kv head
r * num_kv_heads // tp_size, which is exactly the head its query heads use. The
replicas' gradients are partial (each from its own query heads) and are summed by
:func:`sync_tp_grads`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.nn import comm
from aligner.nn.layers import ColumnParallelLinear, ParallelLayer, RMSNorm, RowParallelLinear
from aligner.nn.lora import adapters


def check_tp_compatible(cfg, tp_size: int) -> None:
    """Raise ValueError naming the model dimension that tp_size does not divide.

    cfg: ModelConfig. Checks num_heads, num_kv_heads (divides or is divided by tp_size),
    intermediate_size and vocab_size.
    """
    kv = cfg.num_kv_heads
    for name in ("num_heads", "intermediate_size", "vocab_size"):
        value = getattr(cfg, name)
        if value % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide model.{name}={value}: choose a tp_size that divides it")
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"tp_size={tp_size} must divide or be a multiple of model.num_kv_heads={kv}: "
            "choose such a tp_size (kv heads are split or replicated)"
        )


def kv_head_rows(cfg, tp_size: int, tp_rank: int) -> Optional[torch.Tensor]:
    """Rows of the full k_proj/v_proj weight [num_kv_heads * head_dim, H] that `tp_rank` holds.

    None when kv heads are split evenly (num_kv_heads % tp_size == 0: contiguous chunks);
    otherwise LongTensor [head_dim] of kv head tp_rank * num_kv_heads // tp_size.
    """
    kv, hd = cfg.num_kv_heads, cfg.resolved_head_dim
    if kv % tp_size == 0:
        return None
    head = tp_rank * kv // tp_size
    return torch.arange(head * hd, (head + 1) * hd)


def apply_tensor_parallel(model: nn.Module, tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool = False) -> nn.Module:
    """Shard `model` (LlamaForCausalLM / LlamaForScore, full or a PP stage) in place over `tp_group`.

    Works on meta-device models (shapes only; load weights afterwards with
    ``aligner.parallel.sharding.load_full_state_dict``). Call once, before building the
    optimizer (parameters are replaced). Returns the model.

    Args:
        model: built with ``aligner.model.llama.build_model`` (optionally pruned to a pipeline stage).
        tp_group: tensor-parallel group; None or size 1 leaves the model single-process.
        sequence_parallel: hidden states between layers become [B, T/tp, H]; inputs must then
            have T divisible by tp_size (the embedding's reduce-scatter raises ValueError otherwise).
    Raises:
        ValueError: tp_size incompatible with the model dimensions (see :func:`check_tp_compatible`).
    """
    cfg = model.cfg
    tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    check_tp_compatible(cfg, tp)
    kv_rows = kv_head_rows(cfg, tp, rank)
    for name, module in model.named_modules():
        if not isinstance(module, ParallelLayer):
            continue
        if kv_rows is not None and name.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            module.shard_(tp_group, sequence_parallel, row_index=kv_rows.clone())
        else:
            module.shard_(tp_group, sequence_parallel)
    retie_embeddings(model)
    return model


def seq_shards(model: nn.Module) -> int:
    """Positions between layers are split this many ways: tp_size with sequence parallelism, else 1."""
    for module in model.modules():
        if isinstance(module, ParallelLayer):
            return comm.group_size(module.tp_group) if module.sequence_parallel else 1
    return 1


def retie_embeddings(model: nn.Module) -> None:
    """Point lm_head.weight at model.embed_tokens.weight when tie_word_embeddings and both exist.

    Column-parallel lm_head rows and vocab-parallel embedding rows are the same
    contiguous chunk of the vocabulary, so the shards coincide.
    """
    if not getattr(model.cfg, "tie_word_embeddings", False):
        return
    head, embed = getattr(model, "lm_head", None), model.model.embed_tokens
    if head is not None and embed is not None:
        head.weight = embed.weight


def vocab_start(model: nn.Module) -> int:
    """First vocabulary id of this rank's lm_head / embedding shard (0 when unsharded)."""
    head = getattr(model, "lm_head", None)
    if head is not None:
        return int(head._rows()[0]) if comm.group_size(head.tp_group) > 1 else 0
    embed = model.model.embed_tokens
    return embed.vocab_start if embed is not None else 0


def _partial_replicated_params(model: nn.Module) -> list[torch.Tensor]:
    """Replicated parameters whose grads are partial sums under sequence parallelism."""
    out = []
    for module in model.modules():
        if not (isinstance(module, ParallelLayer) and module.sequence_parallel):
            continue
        if isinstance(module, RMSNorm):
            out.append(module.weight)
        elif isinstance(module, RowParallelLinear) and module.bias is not None:
            out.append(module.bias)
    return out


def _replicated_kv_layers(model: nn.Module) -> list[ColumnParallelLinear]:
    return [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.row_index is not None and comm.group_size(m.tp_group) > 1
    ]


def sync_tp_grads(model: nn.Module, tp_group: Optional[dist.ProcessGroup]) -> None:
    """Finish TP/SP gradients after backward (before clipping and the optimizer step).

    1. Sequence parallelism: norm weights (and row-parallel biases) see only T/tp positions
       per rank, so their grads are all-reduced (summed) over `tp_group` (Korthikanti et al.).
    2. Replicated GQA kv heads (num_kv_heads < tp_size): each replica's k_proj/v_proj grad
       holds only its own query heads' share; the shares of ranks holding the same head
       are summed: each rank scatters its grad into a zero [num_kv_heads * head_dim, H]
       buffer at its rows, one all-reduce over `tp_group`, each keeps its rows.
    3. LoRA adapters (:mod:`aligner.nn.lora`): the replicated A of a column-parallel layer and B of a
       row-parallel one hold partial sums per rank and are summed (B on replicated kv rows as in 2).
    All reductions go into one flat buffer (one all-reduce). No-op for tp_size 1.
    Parameters without a grad are skipped on every rank alike (grads are None together).
    """
    if comm.group_size(tp_group) == 1:
        return
    items = [(p.grad, None, None) for p in _partial_replicated_params(model) if p.grad is not None]
    for layer in _replicated_kv_layers(model):
        for p in (layer.weight, layer.bias):
            if p is not None and p.grad is not None:
                items.append((p.grad, layer.row_index, layer.out_features))
    for adapter in adapters(model):
        items += [(p.grad, rows, full) for p, rows, full in adapter.tp_partial_grads() if p.grad is not None]
    all_reduce_grad_pieces(items, tp_group)


def all_reduce_grad_pieces(items: list[tuple[torch.Tensor, Optional[torch.Tensor], Optional[int]]], tp_group) -> None:
    """Sum gradient pieces over `tp_group` in place, with one flat all-reduce.

    items: (grad, rows, full_rows). rows None: the whole `grad` is summed. Otherwise `grad` holds
    rows `rows` (LongTensor) of a [full_rows, ...] tensor: it is scattered into zeros of that
    shape, the full buffers are summed, and each rank reads its rows back (replicated GQA kv
    heads: ranks sharing a head add their shares). Used for plain and FSDP-local gradients.
    """
    if not items:
        return
    pieces = []
    for g, rows, full_rows in items:
        if rows is None:
            pieces.append(g.reshape(-1))
        else:
            full = g.new_zeros((full_rows, *g.shape[1:]))
            full[rows] = g
            pieces.append(full.reshape(-1))
    flat = torch.cat(pieces)
    comm.all_reduce_no_grad(flat, tp_group)
    offset = 0
    for (g, rows, _), piece in zip(items, pieces):
        chunk = flat[offset : offset + piece.numel()]
        g.copy_(chunk.view_as(g) if rows is None else chunk.view(-1, *g.shape[1:])[rows])
        offset += piece.numel()
