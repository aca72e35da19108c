"""Role checkpoints: one role's model, optimizer state and step (torch.distributed.checkpoint), resharding on load;
and the gather-to-HF export.

Vocabulary (the same in :mod:`aligner.run_ops.checkpointing` and :class:`aligner.trainers.loop.Checkpoints`): a
*checkpoint* is one step's directory ``output_dir/checkpoints/step_N/``, complete or absent, managed by
:class:`~aligner.run_ops.checkpointing.CheckpointManager`; a *role checkpoint* (`role_dir`) is one trained role's
directory inside it, ``step_N/<role>/``, written and read by every rank of the role with the functions here; the
*trainer state* is the driver's part beside them (``trainer_state.json``, ``rng.pt``).

Owns:

- :func:`save_checkpoint` / :func:`load_checkpoint`: a role checkpoint: model parameters and AdamW state (and the
  step) written with ``dcp.save`` and read with ``dcp.load``. Keys are full HF names
  (``model/<hf name>``, ``optim/<hf name>/{exp_avg,exp_avg_sq,step}``, ``step``). Every
  tensor is described by its *global* (unsharded) shape and this rank's offset in it, so a
  checkpoint saved under one tp/pp/dp layout loads under any other. The Adam moments are saved
  in the optimizer's state dtype (fp32, or bf16 with ``optim.state_dtype=bfloat16``) and load
  into either: read in the saved dtype, then cast to the running optimizer's (bf16 -> fp32 is
  exact; fp32 -> bf16 rounds to nearest even):

  * our TP is manual (plain local tensors), so each local shard is wrapped as a DTensor on a
    ``(tp, dp)`` DeviceMesh of this rank's pipeline stage: ``Shard(d)`` over tp for a
    parameter split along d (``ParallelLayer.local_to_full_spec``), ``Replicate()`` for
    replicated ones; over dp ``Shard(0)`` for FSDP2 (which shards the TP-local tensor along
    dim 0 with torch.chunk sizes: tp outer, dp inner, exactly DTensor's nested Shard order)
    or ``Replicate()`` (DDP). dcp writes each distinct chunk once (replicas deduplicated).
  * GQA key/value rows replicated over tp (num_kv_heads < tp_size) have no Shard form; they
    are gathered and saved as full tensors, and sliced again on load.
  * pipeline stages save disjoint keys; dcp merges them into one metadata file.

  Writes go to ``<role_dir>.tmp`` and are renamed to ``<role_dir>`` after every rank finished (an
  existing ``<role_dir>`` is replaced), so a crash never leaves a half role checkpoint under the final
  name. ``meta.json`` records the layout, step and model config.
  * with LoRA (``runtime.lora``) only the trainable parameters (the adapters, and a scalar head)
    and their moments are saved; the frozen base comes from the role's init again on load.
- :func:`gather_full_state_dict_any`: every HF-named full tensor from any layout (FSDP2
  DTensors, TP shards, PP stages, ZeRO-3 partitions); :func:`export_hf` writes it with
  :func:`aligner.model.hf.save_hf` (safetensors + config.json) from global rank 0.

Simplification: DeepSpeed runtimes checkpoint with DeepSpeed's own ``save_checkpoint`` (ZeRO
partitions, reloadable at the same dp size only); export to HF works for them from any pipeline stage.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from aligner.model.hf import save_hf
from aligner.nn import comm
from aligner.nn.layers import ParallelLayer
from aligner.nn.lora import merged_state_dict

META_FILE = "meta.json"
_TIED = {"lm_head.weight": "model.embed_tokens.weight"}
_MESHES: dict[tuple, Any] = {}  # layout -> DeviceMesh, valid for the process group _MESHES_WORLD
_MESHES_WORLD: Any = None


def _cached_mesh(key: tuple, build) -> Any:
    """The mesh of `key`, built by `build()` once per default process group: a process that closes
    its group and opens another (an in-process restart) gets new meshes, not the closed group's."""
    global _MESHES_WORLD
    world = dist.group.WORLD
    if _MESHES_WORLD is not world:
        _MESHES.clear()
        _MESHES_WORLD = world
    if key not in _MESHES:
        _MESHES[key] = build()
    return _MESHES[key]


# ---- layout helpers -------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


# torch.distributed.checkpoint's UserWarning on every single-process save/load (torch 2.13 warns
# even when the caller passes no_dist=True, so the argument alone does not silence it).
_SINGLE_PROCESS_WARNING = (
    re.escape("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to ")
    + r"(save|load) in a single process"
)


@contextmanager
def _dcp_no_dist(no_dist: bool) -> Iterator[None]:
    """Around a ``dcp.save`` / ``dcp.load`` called with `no_dist`: when True (one process, which
    is what this module asks for), ignore exactly dcp's "assuming the intent is to save/load in a
    single process" UserWarning, which tells a user nothing they can act on; every other warning
    still shows. ``warnings.catch_warnings`` swaps the process-wide filters, so this is for the
    worker's one training thread (as every checkpoint call is)."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield


def _pp_stage_mesh(dims):
    """DeviceMesh ("cp", "tp", "dp") of this rank's pipeline stage, sliced from a ("pp", "cp", "tp", "dp") mesh
    (parameters are replicated over cp).

    Built once per layout (collective: every rank of the role creates the same groups)."""

    def build():
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.tensor(
            [
                [[[dims.rank_of(d, p, t, c) for d in range(dims.dp_size)] for t in range(dims.tp_size)] for c in range(dims.cp_size)]
                for p in range(dims.pp_size)
            ]
        )
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return DeviceMesh(device, ranks, mesh_dim_names=("pp", "cp", "tp", "dp"))["cp", "tp", "dp"]

    return _cached_mesh((dims.tp_size, dims.pp_size, dims.dp_size, dims.cp_size, dims.world_size), build)


def _unique_params(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(hf_name, owner module, attribute name, parameter), tied duplicates once."""
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        mod_name, _, pname = name.rpartition(".")
        yield name, module.get_submodule(mod_name), pname, p


def _checkpoint_params(runtime) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """:func:`_unique_params` of what a checkpoint holds: every parameter, or only the trainable ones
    when ``runtime.checkpoint_trainable_only`` (prompt learning) or with LoRA (the adapters, and a
    score head): the frozen base is rebuilt from the role's init."""
    only = getattr(runtime, "checkpoint_trainable_only", False) or getattr(runtime, "lora", None) is not None
    for item in _unique_params(runtime.module):
        if not only or item[3].requires_grad:
            yield item


def _tp_spec(owner: nn.Module, pname: str) -> tuple[Optional[int], Optional[torch.Tensor]]:
    if isinstance(owner, ParallelLayer) and (comm.group_size(owner.tp_group) > 1 or getattr(owner, "row_index", None) is not None):
        return owner.local_to_full_spec(pname)
    return None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tp_local_shape(p: torch.Tensor) -> torch.Size:
    """Shape of the TP-local tensor (the FSDP2 DTensor's global shape, or the plain shape)."""
    return p.shape


def _dp_rows(n: int, dp_size: int, dp_rank: int) -> slice:
    """Rows of a length-n dim 0 that FSDP2 keeps on dp_rank (torch.chunk sizes)."""
    per = math.ceil(n / dp_size) if n else 0
    start = min(n, per * dp_rank)
    return slice(start, min(n, start + per))


def _expert_mesh(dims):
    """DeviceMesh ("cp", "tp", "ep", "edp") of this rank's pipeline stage (expert parallelism: dp rank =
    edp_rank * ep_size + ep_rank; experts are replicated over cp). Built once per layout (collective)."""

    def build():
        from torch.distributed.device_mesh import DeviceMesh

        ep, edp = dims.ep_size, dims.dp_size // dims.ep_size
        ranks = torch.tensor(
            [
                [
                    [[[dims.rank_of(d * ep + e, p, t, c) for d in range(edp)] for e in range(ep)] for t in range(dims.tp_size)]
                    for c in range(dims.cp_size)
                ]
                for p in range(dims.pp_size)
            ]
        )
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return DeviceMesh(device, ranks, mesh_dim_names=("pp", "cp", "tp", "ep", "edp"))["cp", "tp", "ep", "edp"]

    return _cached_mesh(("ep", dims.tp_size, dims.pp_size, dims.dp_size, dims.ep_size, dims.cp_size, dims.world_size), build)


def _is_ep(owner: nn.Module) -> bool:
    from aligner.model.moe import GroupedExperts

    return isinstance(owner, GroupedExperts) and comm.group_size(owner.ep_group) > 1


class _Layout:
    """How one runtime's tensors map to global tensors (built per save/load).

    Expert-parallel experts ([E/ep, ...] per rank, the ep group holding disjoint experts) live on
    a ("cp", "tp", "ep", "edp") mesh: ``Replicate()`` over cp, ``Shard(tp dim)``, ``Shard(0)`` over ep, and over edp ``Shard(0)``
    when FSDP2 shards them there (nested inside the ep chunk, as DTensor nests) else ``Replicate()``.
    """

    def __init__(self, runtime):
        self.runtime = runtime
        self.dims = runtime.dims
        self.fsdp = runtime.fsdp
        self.mesh = _pp_stage_mesh(self.dims) if _distributed() else None
        self.expert_mesh = _expert_mesh(self.dims) if _distributed() and self.dims.ep_size > 1 else None
        self.experts_fsdp = self.fsdp and self.dims.dp_size > self.dims.ep_size

    def placements(self, dim: Optional[int]):
        from torch.distributed.tensor import Replicate, Shard

        tp = Shard(dim) if dim is not None else Replicate()
        dp = Shard(0) if self.fsdp else Replicate()
        return [Replicate(), tp, dp]

    def global_shape(self, p: torch.Tensor, dim: Optional[int]) -> torch.Size:
        shape = list(_tp_local_shape(p))
        if dim is not None:
            shape[dim] *= self.dims.tp_size
        return torch.Size(shape)

    def wrap(self, local: torch.Tensor, p: torch.Tensor, dim: Optional[int], owner: Optional[nn.Module] = None):
        """DTensor view of this rank's `local` piece of parameter-shaped tensor (p's layout)."""
        if self.mesh is None:
            return local
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if owner is not None and self.expert_mesh is not None and _is_ep(owner):
            shape = self.global_shape(p, dim)
            shape = torch.Size([shape[0] * self.dims.ep_size, *shape[1:]])
            stride = torch.empty(shape, device="meta").stride()
            tp = Shard(dim) if dim is not None else Replicate()
            placements = [Replicate(), tp, Shard(0), Shard(0) if self.experts_fsdp else Replicate()]
            return DTensor.from_local(local, self.expert_mesh, placements, run_check=False, shape=shape, stride=stride)
        shape = self.global_shape(p, dim)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, self.placements(dim), run_check=False, shape=shape, stride=stride)

    def full_replicated(self, t: torch.Tensor, owner: nn.Module, pname: str) -> torch.Tensor:
        """Full tensor of a GQA-replicated-rows parameter-shaped tensor (collective over dp, tp)."""
        tp_local = t.full_tensor() if hasattr(t, "full_tensor") else t
        tp_group = self.dims.tp_group
        n = comm.group_size(tp_group)
        parts = [torch.empty_like(tp_local) for _ in range(n)]
        rows = [torch.empty_like(owner.row_index) for _ in range(n)]
        dist.all_gather(parts, tp_local.contiguous(), group=tp_group)
        dist.all_gather(rows, owner.row_index, group=tp_group)
        full = tp_local.new_empty((owner.out_features, *tp_local.shape[1:]))
        for r in range(n):
            full[rows[r]] = parts[r]
        return full

    def to_global(self, t: torch.Tensor, p: torch.Tensor, owner: nn.Module, pname: str):
        """Save form of parameter-shaped `t` (the parameter or an Adam moment)."""
        dim, row_index = _tp_spec(owner, pname)
        if row_index is not None and comm.group_size(self.dims.tp_group) > 1:
            return self.full_replicated(t, owner, pname)
        return self.wrap(_local(t).detach(), p, dim, owner)

    def empty_global(self, p: torch.Tensor, owner: nn.Module, pname: str, dtype: torch.dtype = torch.float32):
        """A load buffer for parameter-shaped state of `dtype`: (buffer for dcp, function -> local tensor)."""
        dim, row_index = _tp_spec(owner, pname)
        local = _local(p)
        if row_index is not None and comm.group_size(self.dims.tp_group) > 1:
            full = torch.empty((owner.out_features, *p.shape[1:]), dtype=dtype, device=local.device)
            return full, lambda: self._fsdp_slice(owner.full_to_local(pname, full))
        buf = torch.empty(local.shape, dtype=dtype, device=local.device)
        return self.wrap(buf, p, dim, owner), lambda: buf

    def _fsdp_slice(self, tp_local: torch.Tensor) -> torch.Tensor:
        if not self.fsdp:
            return tp_local
        return tp_local[_dp_rows(tp_local.shape[0], self.dims.dp_size, self.dims.dp_rank)]


# ---- state dicts ------------------------------------------------------------------------
def _adam_state(runtime, p: torch.Tensor) -> dict:
    return runtime.optimizer.state.get(p, {})


def moment_dtype(runtime, p: torch.Tensor) -> torch.dtype:
    """dtype of the runtime's Adam moments for parameter `p`: the optimizer's ``state_dtype``
    (aligner.runtime.adamw.MixedPrecisionAdamW), else the parameter's (torch's AdamW)."""
    return getattr(runtime.optimizer, "state_dtype", None) or p.dtype


def sharded_state_dict(runtime) -> dict[str, Any]:
    """{"model": {hf_name: global-view tensor}, "optim": {hf_name: {exp_avg, exp_avg_sq, step}}, "step"}.

    Collective when GQA-replicated rows exist (they are gathered). Moments are saved in their
    own dtype (:func:`moment_dtype`). Parameters without Adam state yet (no step taken) save
    zero moments and step 0.
    """
    lay = _Layout(runtime)
    model, optim = {}, {}
    for name, owner, pname, p in _checkpoint_params(runtime):
        model[name] = lay.to_global(p, p, owner, pname)
        st = _adam_state(runtime, p)
        zeros = torch.zeros_like(p, dtype=moment_dtype(runtime, p)) if not st else None
        optim[name] = {
            "exp_avg": lay.to_global(st.get("exp_avg", zeros), p, owner, pname),
            "exp_avg_sq": lay.to_global(st.get("exp_avg_sq", zeros), p, owner, pname),
            "step": torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).detach().clone().cpu(),
        }
    return {"model": model, "optim": optim, "step": torch.tensor(runtime.step_count, dtype=torch.int64)}


def _meta(runtime, extra: Optional[dict]) -> dict:
    d = runtime.dims
    return {
        "format": "aligner-dcp-v1",
        "step": runtime.step_count,
        "kind": runtime.kind,
        "layout": {"tp_size": d.tp_size, "pp_size": d.pp_size, "dp_size": d.dp_size, "cp_size": d.cp_size, "dp_backend": runtime.backend},
        "optim_state_dtype": runtime.optim_cfg.state_dtype,
        "model": dataclasses.asdict(runtime.model_cfg),
        "lora": dataclasses.asdict(runtime.lora) if getattr(runtime, "lora", None) is not None else None,
        "extra": extra or {},
    }


def _commit(tmp: str, final: str) -> None:
    """Rank 0 renames `tmp` to `final`, replacing an existing `final`; every rank waits."""
    _barrier()
    if _rank() == 0:
        old = final.rstrip("/") + ".old"
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def save_checkpoint(runtime, role_dir: str, extra: Optional[dict] = None) -> str:
    """Save `runtime`'s role checkpoint (model, optimizer and step) to `role_dir`, atomically. Collective; returns role_dir.

    DeepSpeed runtimes use DeepSpeed's ``save_checkpoint`` under the same atomic rename.
    """
    import torch.distributed.checkpoint as dcp

    if runtime.model_cfg.backend == "te":
        raise ValueError(
            "model.backend=te: resharding checkpoints of TE layers are not implemented; "
            "export weights with te_backend.te_layer_to_hf or checkpoint with model.backend=torch"
        )
    _check_finite(runtime)
    role_dir = os.path.abspath(role_dir)
    tmp = role_dir.rstrip("/") + ".tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    if runtime.backend == "deepspeed":
        runtime.model.save_checkpoint(tmp, tag="ds", client_state={"step": runtime.step_count})
    else:
        no_dist = not _distributed()
        with _dcp_no_dist(no_dist):
            dcp.save(sharded_state_dict(runtime), checkpoint_id=tmp, no_dist=no_dist)
    if _rank() == 0:
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(_meta(runtime, extra), f, indent=2)
    _commit(tmp, role_dir)
    return role_dir


def _check_finite(runtime) -> None:
    """Refuse to checkpoint non-finite weights (collective: every rank learns if any rank has them)."""
    import torch
    import torch.distributed as dist

    bad = torch.tensor(0.0)
    for p in runtime.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.is_floating_point() and not torch.isfinite(local.detach()).all():
            bad += 1
    if _distributed():
        dist.all_reduce(bad)
    if bad > 0:
        raise ValueError(
            "refusing to write a checkpoint: the model has NaN/Inf weights "
            "(the previous checkpoint is kept; lower the learning rate and resume from it)"
        )


def read_meta(role_dir: str) -> dict:
    """meta.json of a role checkpoint. Raises ValueError when `role_dir` is not a complete role checkpoint."""
    path = os.path.join(role_dir, META_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint dir {role_dir!r} has no {META_FILE}: not a complete aligner checkpoint (pick another dir)")
    with open(path) as f:
        return json.load(f)


def read_model_state_dict(role_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The full model weights of a checkpoint saved by any layout (tp/pp/dp, FSDP2), read in this one
    process without building the role: ({HF-style parameter name: tensor in its saved dtype}, meta).

    For tools outside a run (converting a step's checkpoint to an HF dir for evaluation); a run
    resumes with :func:`load_checkpoint`. Raises ValueError: not a complete checkpoint
    (:func:`read_meta`), or one holding LoRA adapters only (its model tensors are not the full weights).
    """
    import torch.distributed.checkpoint as dcp

    meta = read_meta(role_dir)
    if meta.get("lora"):
        raise ValueError(f"checkpoint {role_dir!r} holds LoRA adapters only: export its run's hf/ instead (adapters merged)")
    saved = dcp.FileSystemReader(role_dir).read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items() if k.startswith("model.") and hasattr(m, "size")
    }
    with _dcp_no_dist(True):
        dcp.load(sd, checkpoint_id=role_dir, no_dist=True)
    return {k[len("model.") :]: v for k, v in sd.items()}, meta


def _check_compatible(runtime, meta: dict, role_dir: str) -> None:
    saved = meta.get("model", {})
    mine = dataclasses.asdict(runtime.model_cfg)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "tie_word_embeddings"):
        if key in saved and saved[key] != mine[key]:
            raise ValueError(
                f"checkpoint {role_dir!r} has model.{key}={saved[key]} but this model has {mine[key]}: load it with the same model config"
            )
    saved_lora, my_lora = meta.get("lora"), getattr(runtime, "lora", None)
    if (saved_lora is None) != (my_lora is None) or (
        saved_lora and (saved_lora["rank"], saved_lora["target_modules"]) != (my_lora.rank, list(my_lora.target_modules))
    ):
        raise ValueError(
            f"checkpoint {role_dir!r} was saved with lora={saved_lora} but this role has lora={my_lora}: "
            "resume with the same lora settings (rank, target_modules)"
        )
    if meta.get("kind", runtime.kind) != runtime.kind:
        raise ValueError(f"checkpoint {role_dir!r} holds a kind={meta['kind']!r} model, not {runtime.kind!r}")
    saved_ds = meta["layout"]["dp_backend"] == "deepspeed"
    if saved_ds != (runtime.backend == "deepspeed"):
        raise ValueError(
            f"checkpoint {role_dir!r} was saved with dp_backend={meta['layout']['dp_backend']} and cannot load into "
            f"dp_backend={runtime.backend}: DeepSpeed checkpoints load only into DeepSpeed runtimes (export to HF instead)"
        )


def _saved_dtype(saved_meta: dict, key: str) -> torch.dtype:
    """dtype a tensor was saved with (checkpoints before bf16 moments saved fp32)."""
    props = getattr(saved_meta.get(key), "properties", None)
    return getattr(props, "dtype", None) or torch.float32


@torch.no_grad()
def load_checkpoint(runtime, role_dir: str) -> dict:
    """Load a role checkpoint saved under any tp/pp/dp layout into `runtime` (collective); returns meta.

    Parameters and Adam moments are copied into this rank's shards (moments read in their saved
    dtype and cast to :func:`moment_dtype`: fp32 and bf16 moments load into either); the step
    counter and LR schedule resume from the saved step. Raises ValueError for a
    missing/incomplete role checkpoint or a different model config.
    """
    import torch.distributed.checkpoint as dcp

    meta = read_meta(role_dir)
    _check_compatible(runtime, meta, role_dir)
    if runtime.backend == "deepspeed":
        runtime.model.load_checkpoint(role_dir, tag="ds")
        runtime.set_step(int(meta["step"]))
        return meta
    lay = _Layout(runtime)
    saved_meta = dcp.FileSystemReader(role_dir).read_metadata().state_dict_metadata
    saved = set(saved_meta)
    sd: dict[str, Any] = {"model": {}, "optim": {}, "step": torch.zeros((), dtype=torch.int64)}
    finish = []
    for name, owner, pname, p in _checkpoint_params(runtime):
        key = name if f"model.{name}" in saved else _TIED.get(name, name)  # tied lm_head saved once at pp=1
        if f"model.{key}" not in saved:
            raise ValueError(f"checkpoint {role_dir!r} has no tensor for parameter {name!r}: it was saved from a different model")
        bufs = {"param": lay.empty_global(p, owner, pname)}
        for k in ("exp_avg", "exp_avg_sq"):
            bufs[k] = lay.empty_global(p, owner, pname, _saved_dtype(saved_meta, f"optim.{key}.{k}"))
        if key in sd["model"]:  # both tied names on one pipeline stage cannot happen (deduplicated), guard anyway
            raise ValueError(f"checkpoint load: {name!r} and another parameter map to the same tensor {key!r}")
        sd["model"][key] = bufs["param"][0]
        sd["optim"][key] = {
            "exp_avg": bufs["exp_avg"][0],
            "exp_avg_sq": bufs["exp_avg_sq"][0],
            "step": torch.zeros((), dtype=torch.float32),
        }
        finish.append((key, p, bufs))
    no_dist = not _distributed()
    with _dcp_no_dist(no_dist):
        dcp.load(sd, checkpoint_id=role_dir, no_dist=no_dist)
    for name, p, bufs in finish:
        _local(p).copy_(bufs["param"][1]())
        step = sd["optim"][name]["step"]
        if float(step) > 0:
            st = runtime.optimizer.state[p]
            st["step"] = step.clone()
            for key in ("exp_avg", "exp_avg_sq"):
                t = torch.zeros_like(p, dtype=moment_dtype(runtime, p))
                _local(t).copy_(bufs[key][1]())  # fp32 -> bf16 rounds to nearest even
                st[key] = t
    runtime.set_step(int(sd["step"]))
    return meta


# ---- gather / export ------------------------------------------------------------------
def _pp_walk(local: dict[str, torch.Tensor], pp_group) -> dict[str, torch.Tensor]:
    """Every pipeline stage's tensors (`local`: this rank's) on every rank of `pp_group` (one broadcast per tensor), pp order."""
    n = comm.group_size(pp_group)
    if n == 1:
        return local
    metas: list = [None] * n
    dist.all_gather_object(metas, [(k, tuple(v.shape), v.dtype) for k, v in local.items()], group=pp_group)
    me, out = comm.group_rank(pp_group), {}
    for s in range(n):
        for k, shape, dtype in metas[s]:
            t = local[k].contiguous() if s == me else torch.empty(shape, dtype=dtype)
            dist.broadcast(t, group_src=s, group=pp_group)
            out[k] = t
    return out


@torch.no_grad()
def gather_full_state_dict_any(runtime) -> dict[str, torch.Tensor]:
    """Every HF-named full parameter on every rank, from any layout (collective over the role).

    FSDP2 / TP shards are gathered through their DTensor global view, PP stages broadcast in
    order, ZeRO-3 partitions gathered with ``deepspeed.zero.GatheredParameters``. Values are
    the parameters' own (fp32 master weights for FSDP2/DDP; DeepSpeed bf16 keeps bf16 module
    weights). Tied embeddings appear under both names.
    """
    if runtime.backend == "deepspeed":
        return _gather_deepspeed(runtime)
    lay = _Layout(runtime)
    local = {}
    for name, owner, pname, p in _unique_params(runtime.module):
        g = lay.to_global(p, p, owner, pname)
        local[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    out = _pp_walk(local, runtime.dims.pp_group)
    for name in runtime.module.state_dict(keep_vars=True):
        if name not in out and name.endswith("weight"):
            tied = {"lm_head.weight": "model.embed_tokens.weight"}.get(name)
            if tied in out:
                out[name] = out[tied]
    if runtime.model_cfg.tie_word_embeddings and "model.embed_tokens.weight" in out:
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def _gather_deepspeed(runtime) -> dict[str, torch.Tensor]:
    params = dict(runtime.module.named_parameters())
    if runtime.parallel.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in params.items()}
    return {k: v.detach().clone() for k, v in params.items()}


def export_hf(runtime, out_dir: str, tokenizer=None) -> Optional[str]:
    """Write an HF model dir (config.json + safetensors) from any layout; returns the path on rank 0.

    Collective (every rank gathers); global rank 0 writes through ``aligner.model.hf.save_hf``
    (atomic). Other ranks return None.
    """

    full = gather_full_state_dict_any(runtime)
    if getattr(runtime, "lora", None) is not None:
        full = merged_state_dict(full, runtime.lora.alpha / runtime.lora.rank)
    path = None
    if _rank() == 0:
        path = str(save_hf(full, runtime.model_cfg, out_dir, kind=runtime.kind, tokenizer=tokenizer))
    _barrier()
    return path
