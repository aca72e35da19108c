"""Refit: stream the actor's weights from the trainer layout into a rollout engine.

Owns: the export walk (gather TP shards, walk PP stages, map to HF names), bucketing by
``RolloutConfig.refit_bucket_mb``, the timed :func:`refit` driver, and the engine layout
(:func:`rollout_dims`) including NeMo-Aligner's reshard of freed PP stages into replicas.

Method (one simple scheme covers every (tp_train, pp_train) -> (tp_infer, pp_infer) pair):
every trainer rank rebuilds each full HF tensor one parameter at a time (all-gather over
its tp group, then a broadcast from the owning pipeline stage over its pp group), collects them into
buckets of at most ``bucket_mb`` MiB and hands each bucket to its colocated engine's
``update_weights``, which slices the full tensor down to the engine's own shard. Peak extra
memory is one bucket of full tensors; the cost is that every rank receives every tensor.

Engine layout (colocated, same world): the engine mesh is (dp_infer, pp_infer, tp_infer)
over the same ranks, dp_infer = world / (tp_infer * pp_infer)
= dp_train * (pp_train / pp_infer) * (tp_train / tp_infer). With pp_train = 2 and
pp_infer = 1 the two pipeline stage groups each become a full engine replica (NeMo-Aligner's
reshard); pp_infer = pp_train keeps pipeline-parallel engines.

Simplifications: trainer parameters must be plain tensors (TP-sharded aligner layers);
FSDP2/DeepSpeed-sharded (DTensor / flat) parameters must be unsharded by the caller first.
Wrapper prefixes (``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``) are stripped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.model.llama import build_model
from aligner.nn import comm, lora
from aligner.nn.layers import ParallelLayer
from aligner.parallel.dims import ParallelDims
from aligner.rollout.base import RolloutEngine


@dataclass
class RefitStats:
    """What one refit did: seconds (wall, float), bytes (full tensors handed over), buckets, weight_version after."""

    seconds: float
    bytes: int
    buckets: int
    tensors: int
    weight_version: int


def to_hf_name(name: str) -> str:
    """Our parameter name with wrapper prefixes removed (aligner names equal HF Llama's)."""
    parts = [p for p in name.split(".") if p not in ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")]
    return ".".join(parts)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_name, _, pname = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), pname


def _gather_tp(module: nn.Module, pname: str, local: torch.Tensor, tp_group) -> torch.Tensor:
    """This rank's shard of parameter `pname` of `module` -> the full tensor (collective over tp_group)."""
    n = comm.group_size(tp_group)
    if not isinstance(module, ParallelLayer):
        return local
    dim, row_index = module.local_to_full_spec(pname)
    if dim is None or n == 1:
        return local
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(parts, local, group=tp_group)
    if row_index is None:
        return torch.cat(parts, dim=dim)
    idx = [torch.empty_like(row_index) for _ in range(n)]
    dist.all_gather(idx, row_index.contiguous(), group=tp_group)
    rows = int(max(i.max() for i in idx)) + 1
    full = local.new_empty((rows, *local.shape[1:]))
    for i, p in zip(idx, parts):
        full[i] = p  # replicated rows (GQA kv heads with kv < tp) are written with equal values
    return full


def _full_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """HF name -> full (unsharded, unpruned) shape, from a meta-device copy of the whole model
    (LoRA adapters too: A [r, in], B [out, r] of every linear, r from this pipeline stage's adapters)."""

    meta = build_model(model.cfg, device="meta")
    shapes = {n: p.shape for n, p in meta.named_parameters(remove_duplicate=False)}
    ad = next(lora.adapters(model), None)
    if ad is not None:
        for n, s in list(shapes.items()):
            if n.endswith("_proj.weight"):
                layer = n.removesuffix(".weight")
                shapes[f"{layer}.{lora.ADAPTER}.A"] = torch.Size([ad.rank, s[1]])
                shapes[f"{layer}.{lora.ADAPTER}.B"] = torch.Size([s[0], ad.rank])
    return shapes


def _adapted_only(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The weights of the LoRA-adapted linears and their adapters, out of `named` (name, parameter)."""
    layers = {to_hf_name(n).removesuffix(f".{lora.ADAPTER}.A") for n, _ in named if n.endswith(f".{lora.ADAPTER}.A")}
    return [(n, p) for n, p in named if to_hf_name(n).removesuffix(".weight") in layers or lora.is_adapter_key(n)]


def merge_stream(named: Iterable[tuple[str, torch.Tensor]], scaling: float, targets) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) pairs with LoRA adapters folded in.

    targets: the adapted linears' names (``q_proj`` ...; every such linear has an adapter, as
    :func:`aligner.nn.lora.apply_lora` makes them). Their ``.weight`` is held back until its
    ``.lora.A`` [r, in] and ``.lora.B`` [out, r] arrive (they follow it in parameter order) and is
    yielded as W + scaling * B A (fp32 math, W's dtype); adapter tensors are not yielded, others pass.
    Raises ValueError: a held weight never got both adapter halves.
    """
    targets = set(targets)
    held: dict[str, torch.Tensor] = {}
    for name, t in named:
        if lora.is_adapter_key(name):
            held[name] = t
            layer = name[: -len(".A")].removesuffix(f".{lora.ADAPTER}")
            ka, kb = f"{layer}.{lora.ADAPTER}.A", f"{layer}.{lora.ADAPTER}.B"
            if ka in held and kb in held:
                w, a, b = held.pop(f"{layer}.weight"), held.pop(ka), held.pop(kb)
                yield f"{layer}.weight", (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
        elif name.endswith(".weight") and name.removesuffix(".weight").rpartition(".")[2] in targets:
            held[name] = t
        else:
            yield name, t
    if held:
        raise ValueError(f"merge_stream: weights without both adapter halves: {sorted(held)[:4]}")


def iter_full_tensors(
    model: nn.Module,
    tp_group: Optional[dist.ProcessGroup] = None,
    pp_group: Optional[dist.ProcessGroup] = None,
    adapted_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every parameter of the whole model, on every rank.

    Pipeline stages are walked in order (pp rank 0's parameters first); each pipeline stage's names and dtypes
    are broadcast over the pp group, full shapes come from the model config. Collective:
    every rank of the tp and pp groups must iterate to the end. Tensors are detached, in
    the parameter dtype, on the parameter device; with tp = pp = 1 they alias the parameters
    (read them before the next optimizer step). adapted_only: only the LoRA-adapted linears'
    weights and their adapters (``.lora.A`` / ``.lora.B``), the tensors a LoRA step changes.
    """
    pp_size, pp_rank = comm.group_size(pp_group), comm.group_rank(pp_group)
    mine = list(model.named_parameters())
    if adapted_only:
        mine = _adapted_only(mine)
    device = mine[0][1].device
    shapes = _full_shapes(model) if pp_size > 1 else {}
    with torch.no_grad():
        for pp_stage in range(pp_size):
            src = dist.get_global_rank(pp_group, pp_stage) if pp_size > 1 else 0
            if pp_size > 1:
                box = [[(to_hf_name(n), str(p.dtype).removeprefix("torch.")) for n, p in mine] if pp_stage == pp_rank else None]
                dist.broadcast_object_list(box, src=src, group=pp_group)
                specs = box[0]
            if pp_stage == pp_rank:
                for name, p in mine:
                    module, pname = _owner(model, name)
                    full = _gather_tp(module, pname, p.detach(), tp_group).contiguous()
                    if pp_size > 1:
                        dist.broadcast(full, src=src, group=pp_group)
                    yield to_hf_name(name), full
            else:
                for hf_name, dtype in specs:
                    full = torch.empty(shapes[hf_name], dtype=getattr(torch, dtype), device=device)
                    dist.broadcast(full, src=src, group=pp_group)
                    yield hf_name, full


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_mb: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most `bucket_mb` MiB (a larger tensor gets its own bucket).

    Raises ValueError when bucket_mb <= 0.
    """
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} is invalid: must be > 0 (rollout.refit_bucket_mb, e.g. 256)")
    limit = bucket_mb * 2**20
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def refit(
    model: nn.Module,
    engine: RolloutEngine,
    *,
    bucket_mb: float = 256,
    tp_group: Optional[dist.ProcessGroup] = None,
    pp_group: Optional[dist.ProcessGroup] = None,
    adapted_only: bool = False,
) -> RefitStats:
    """Export `model` (trainer layout: this rank's tp shard of its pp stage) into `engine`.

    Calls ``engine.update_weights`` once per bucket and ``engine.finish_weight_update`` once;
    collective over tp_group and pp_group. Returns RefitStats (wall seconds on this rank).
    A model with LoRA adapters (:mod:`aligner.nn.lora`) sends merged weights W + (alpha/r) B A and
    no adapter tensors; with `adapted_only` only the adapted linears' merged weights (the refits
    after the first full one: nothing else changes while the base is frozen).
    """
    t0 = time.perf_counter()
    nbytes = buckets = tensors = 0
    stream = iter_full_tensors(model, tp_group, pp_group, adapted_only=adapted_only)
    ad = next(lora.adapters(model), None)
    if ad is not None:
        stream = merge_stream(stream, ad.scaling, getattr(model, "lora_targets", ()))
    for bucket in iter_buckets(stream, bucket_mb):
        engine.update_weights(bucket)
        buckets += 1
        tensors += len(bucket)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    engine.finish_weight_update()
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return RefitStats(time.perf_counter() - t0, nbytes, buckets, tensors, engine.weight_version)


def dp_infer_size(world_size: int, tp_infer: int, pp_infer: int) -> int:
    """Engine replicas over the same ranks: world / (tp_infer * pp_infer); ValueError when it does not divide."""
    if tp_infer < 1 or pp_infer < 1 or world_size % (tp_infer * pp_infer):
        raise ValueError(
            f"rollout.parallel tp_size={tp_infer} x pp_size={pp_infer} must divide the actor's world size "
            f"{world_size}: pick sizes whose product divides it"
        )
    return world_size // (tp_infer * pp_infer)


def rollout_dims(world_size: int, rank: int, tp_infer: int, pp_infer: int):
    """The engine's ParallelDims (tp_infer, pp_infer, dp_infer) over the actor's ranks, groups built.

    Collective (creates process groups): every rank must call it. With pp_train = 2,
    pp_infer = 1 and tp_infer = tp_train the freed pipeline stage groups become extra replicas.
    """

    dp = dp_infer_size(world_size, tp_infer, pp_infer)
    return ParallelDims(tp_size=tp_infer, pp_size=pp_infer, dp_size=dp, world_size=world_size, rank=rank).build()
