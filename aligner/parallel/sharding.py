"""State-dict sharding and gathering for TP x PP models with HF parameter names.

Owns: :func:`load_full_state_dict` (each rank copies the slice of a full HF-named state
dict it owns: its tp shard of the layers of its pp stage), :func:`gather_full_state_dict`
(TP shards all-gathered, PP stages walked, so a rank gets every HF-named tensor: used by
refit into the rollout engine and by HF export) and :func:`shard_specs` (how each local
tensor assembles into the full one).

Layout rules come from the layers themselves (``ParallelLayer.full_to_local`` and
``local_to_full_spec``), so a new layer type needs no change here. Tied embeddings
(``lm_head.weight`` is ``model.embed_tokens.weight``) load from whichever of the two names
the state dict has; gathering returns both names, as ``nn.Module.state_dict`` does.
Collectives are bucketed: one all-gather per tp group per ``bucket_mb`` of shards and
one broadcast per pp stage per dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.nn import comm
from aligner.nn.layers import ParallelLayer

_TIED = {"lm_head.weight": "model.embed_tokens.weight", "model.embed_tokens.weight": "lm_head.weight"}


@dataclass(frozen=True)
class ShardSpec:
    """How this rank's tensor `name` relates to the full one.

    dim: None (replicated) or the split dimension. row_index: None (equal contiguous
    chunks in tp-rank order) or LongTensor of the full rows along `dim` held here
    (replicated GQA kv heads).
    """

    dim: Optional[int]
    row_index: Optional[torch.Tensor]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_name, _, pname = name.rpartition(".")
    return model.get_submodule(mod_name), pname


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """ShardSpec of every entry of ``model.state_dict()`` (tied duplicates included)."""
    specs = {}
    for name in model.state_dict(keep_vars=True):
        module, pname = _owner(model, name)
        if isinstance(module, ParallelLayer) and comm.group_size(module.tp_group) > 1:
            specs[name] = ShardSpec(*module.local_to_full_spec(pname))
        elif isinstance(module, ParallelLayer) and getattr(module, "row_index", None) is not None:
            specs[name] = ShardSpec(*module.local_to_full_spec(pname))
        else:
            specs[name] = ShardSpec(None, None)
    return specs


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full_sd: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy this rank's slice of the full HF-named state dict `full_sd` into `model`.

    model: a (possibly TP-sharded, PP-pruned) LlamaForCausalLM / LlamaForScore with
    materialized parameters (after ``to_empty`` when built on meta). Each parameter takes
    ``full_to_local`` of its full tensor, cast to the parameter's dtype. Keys of `full_sd`
    that this pipeline stage does not own are ignored.
    Raises ValueError: a parameter is missing from `full_sd` (strict), a full tensor has the
    wrong shape, or the model is still on the meta device.
    """
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: call model.to_empty(device=...) before load_full_state_dict")
        key = name if name in full_sd else _TIED.get(name)
        if key not in full_sd:
            if strict:
                raise ValueError(f"load_full_state_dict: {name!r} missing from the state dict (has {len(full_sd)} keys)")
            continue
        module, pname = _owner(model, name)
        full = full_sd[key]
        local = module.full_to_local(pname, full) if isinstance(module, ParallelLayer) else full
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(
                f"load_full_state_dict: {key!r} of shape {tuple(full.shape)} gives a shard of {tuple(local.shape)}, "
                f"but {name} is {tuple(p.shape)}: the checkpoint's model config differs from this model's"
            )
        p.copy_(local.to(p.dtype))


def _gather_tp(model: nn.Module, tp_group, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """This pipeline stage's full tensors: sharded ones all-gathered over `tp_group` in buckets."""
    local_sd = model.state_dict(keep_vars=True)
    specs = shard_specs(model)
    out: dict[str, torch.Tensor] = {}
    sharded, seen = [], {}
    for name, t in local_sd.items():
        if id(t) in seen:  # tied duplicate: same full tensor
            continue
        seen[id(t)] = name
        if specs[name].dim is None:
            out[name] = t.detach().clone()
        else:
            sharded.append((name, t.detach()))
    n = comm.group_size(tp_group)
    buckets, cur, size = [], [], 0
    for item in sharded:
        cur.append(item)
        size += item[1].numel() * item[1].element_size()
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    for bucket in buckets:
        for dtype in {t.dtype for _, t in bucket}:
            items = [(nm, t) for nm, t in bucket if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for _, t in items])
            gathered = torch.empty(n * flat.numel(), dtype=dtype, device=flat.device)
            if n > 1:
                comm.record("all_gather", gathered.numel())
                _all_gather_flat(gathered, flat, tp_group)
            else:
                gathered.copy_(flat)
            per_rank = gathered.view(n, -1)
            offset = 0
            for nm, t in items:
                parts = [per_rank[r, offset : offset + t.numel()].view(t.shape) for r in range(n)]
                out[nm] = _assemble(model, nm, specs[nm], parts, tp_group)
                offset += t.numel()
    for name, t in local_sd.items():
        if name not in out:
            out[name] = out[seen[id(t)]]
    return {name: out[name] for name in local_sd}


def _all_gather_flat(out: torch.Tensor, flat: torch.Tensor, group) -> None:
    """out: [n * k] <- the [k] `flat` tensors of the n ranks of `group`, in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, flat, group=group)


def _assemble(model: nn.Module, name: str, spec: ShardSpec, parts: list[torch.Tensor], tp_group) -> torch.Tensor:
    if spec.row_index is None:
        return torch.cat(parts, dim=spec.dim)
    module, _ = _owner(model, name)
    n = len(parts)
    rows = spec.row_index
    all_rows = [torch.empty_like(rows) for _ in range(n)]
    if n > 1:
        dist.all_gather(all_rows, rows, group=tp_group)
    else:
        all_rows = [rows]
    full = parts[0].new_empty((module.out_features, *parts[0].shape[1:]))
    for r in range(n):
        full[all_rows[r]] = parts[r]
    return full


def _flatten(sd: dict[str, torch.Tensor]) -> tuple[list, dict[torch.dtype, torch.Tensor]]:
    meta, flats, seen = [], {}, {}
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for name, t in sd.items():
        if id(t) in seen:
            meta.append((name, None, None, seen[id(t)]))
            continue
        seen[id(t)] = name
        meta.append((name, tuple(t.shape), t.dtype, None))
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    for dtype, ts in by_dtype.items():
        flats[dtype] = torch.cat(ts)
    return meta, flats


def _unflatten(meta: list, flats: dict[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offsets = {}, {d: 0 for d in flats}
    for name, shape, dtype, alias in meta:
        if alias is not None:
            out[name] = out[alias]
            continue
        n = int(torch.Size(shape).numel())
        out[name] = flats[dtype][offsets[dtype] : offsets[dtype] + n].view(shape).clone()
        offsets[dtype] += n
    return out


@torch.no_grad()
def gather_full_state_dict(
    model: nn.Module,
    tp_group: Optional[dist.ProcessGroup],
    pp_group: Optional[dist.ProcessGroup] = None,
    dst_pp_rank: Optional[int] = None,
    bucket_mb: int = 256,
) -> dict[str, torch.Tensor]:
    """Every HF-named full tensor of a TP x PP model, keyed and ordered like the unsharded
    model's ``state_dict()`` (pipeline stages in pp order; tied embeddings under both names).

    Collective over `tp_group` and `pp_group`: every rank of both must call it.
    Args:
        tp_group: this pipeline stage's tensor-parallel group (None: unsharded).
        pp_group: the pipeline group (None: one pipeline stage).
        dst_pp_rank: None gives the whole dict on every rank; an int gives it on that pp
            rank only (point-to-point, cheaper), the others return their own pipeline stage's tensors.
        bucket_mb: upper size of one TP all-gather, MiB.
    Returns:
        {name: full tensor} (fresh tensors, detached from the model).
    """
    local = _gather_tp(model, tp_group, bucket_mb * 2**20)
    pp = comm.group_size(pp_group)
    if pp == 1:
        return local
    me = comm.group_rank(pp_group)
    meta, flats = _flatten(local)
    metas: list = [None] * pp
    dist.all_gather_object(metas, (meta, {d: f.numel() for d, f in flats.items()}), group=pp_group)
    result: dict[str, torch.Tensor] = {}
    for s in range(pp):
        if s == me:
            result.update(local)
            if dst_pp_rank is None:
                for f in flats.values():
                    dist.broadcast(f, group_src=s, group=pp_group)
            elif s != dst_pp_rank:
                for f in flats.values():
                    dist.send(f, group_dst=dst_pp_rank, group=pp_group)
            continue
        if dst_pp_rank is not None and me != dst_pp_rank:
            continue
        s_meta, sizes = metas[s]
        device = next(iter(local.values())).device
        recv = {d: torch.empty(n, dtype=d, device=device) for d, n in sizes.items()}
        for f in recv.values():
            if dst_pp_rank is None:
                dist.broadcast(f, group_src=s, group=pp_group)
            else:
                dist.recv(f, group_src=s, group=pp_group)
        result.update(_unflatten(s_meta, recv))
    order = [name for s in range(pp) for name, *_ in metas[s][0]] if (dst_pp_rank is None or me == dst_pp_rank) else list(local)
    return {name: result[name] for name in order}
