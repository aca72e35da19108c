"""Weight sync across worker groups: the actor's weights broadcast to rollout engines on other processes.

The split placement (``rollout.placement=split``, docs/rollout.md) puts the rollout engines in their own
worker group, so the refit of the colocated placement (the engine in the actor's own process,
:mod:`aligner.rollout.weight_sync.refit`) cannot reach them. After each update the actor's rank 0 sends the
full tensors of the policy, in the same buckets as a refit, over a process group of its own that
spans it and every engine rank (verl's and OpenRLHF's weight-sync group; NeMo-RL's
``update_weights_from_collective``): one broadcast per bucket, so each tensor leaves the sender
once for all replicas, not once per replica.

Owns: the sync group (a store and a gloo or NCCL process group made apart from the default one:
the actor's ranks already belong to their training world), the bucket's wire form (a header with
names, shapes and dtypes, then one flat buffer, each tensor at an aligned offset) and the two ends, :class:`WeightSender` (an
object with a rollout engine's ``update_weights`` / ``finish_weight_update``, so the refit walk of
:func:`aligner.rollout.weight_sync.refit.refit` drives it unchanged) and :func:`receive_weights`.

Sizes: bytes on the wire per sync = the policy's full tensors in the engine's dtype, plus a
header of about 100 bytes per tensor; the receivers hold one bucket at a time besides the engine
(:func:`receive_weights`), or the whole sync when it is staged for an interruptible engine
(:func:`receive_weights_staged`: received while the engine generates, applied between decode steps).

Simplification: the engines' own layout is tp = pp = 1 (each engine rank a full replica); gloo
on CPU has run, NCCL on GPU is written against torch's ``ProcessGroupNCCL`` and has not run.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from aligner.rollout.base import RolloutEngine

HEADER_LEN_DTYPE = torch.int64
END = 0  # a header length of 0: the sync is over


@dataclass
class SyncGroup:
    """One member of a weight-sync group: rank 0 sends, ranks 1.. receive.

    pg: the process group (gloo or NCCL), apart from the default group. device: where the wire
    buffers live (CPU for gloo, the member's GPU for NCCL). store: kept alive with the group.
    """

    pg: object
    rank: int
    world_size: int
    device: torch.device
    store: object

    def broadcast(self, t: torch.Tensor) -> None:
        """Broadcast `t` (contiguous, on :attr:`device`) from rank 0 to every member, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([t], opts).wait()

    def close(self) -> None:
        """Release the group (the store goes with the last reference)."""
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 (best effort at teardown)
            pass


def join_sync_group(
    host: str, port: int, rank: int, world_size: int, *, bind_host: str = "", backend: str = "gloo", timeout_s: float = 300.0
) -> SyncGroup:
    """Join the weight-sync group whose store rank 0 serves on host:port (rank 0 serves it).

    Every member calls this at the same time (it blocks until all world_size have joined).
    bind_host: the address this member's gloo device binds (default `host`: one node).
    backend: "gloo" (CPU tensors) or "nccl" (this member's current CUDA device).
    Raises ValueError for a bad rank or backend; torch's DistStoreError after timeout_s.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid for a sync group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
    store = dist.PrefixStore("aligner-weight-sync", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host or host)]
        pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
        device = torch.device("cpu")
    elif backend == "nccl":
        pg = dist.ProcessGroupNCCL(store, rank, world_size)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise ValueError(f"backend={backend!r} is invalid: gloo or nccl")
    return SyncGroup(pg=pg, rank=rank, world_size=world_size, device=device, store=store)


# ---- the wire form of a bucket -----------------------------------------------------------
ALIGN = 16  # bytes: each tensor starts at a multiple of this in the flat buffer (a view of it needs an aligned offset)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[bytes, torch.Tensor]:
    """A bucket of (name, tensor) as (header, flat): the header is JSON [[name, shape, dtype], ...] in
    UTF-8; flat is one uint8 tensor on `device` holding every tensor's bytes in order, each padded
    to a multiple of ALIGN bytes so that a receiver can view it in place whatever the dtypes."""
    head = json.dumps([[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in bucket]).encode()
    parts = []
    for _, t in bucket:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = _padded(raw.numel()) - raw.numel()
        parts += [raw, raw.new_zeros(pad)] if pad else [raw]
    flat = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return head, flat


def bucket_spec(head: bytes) -> tuple[list, int]:
    """(the header's [[name, shape, dtype], ...], the flat buffer's size in bytes) of :func:`pack_bucket`."""
    spec = json.loads(head.decode())
    size = sum(_padded(torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dt)).element_size()) for _, shape, dt in spec)
    return spec, size


def unpack_bucket(spec: list, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a packed bucket, as views of `flat` (no copy). Inverse of :func:`pack_bucket`."""
    out, off = [], 0
    for name, shape, dt in spec:
        dtype = getattr(torch, dt)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append((name, flat[off : off + n].view(dtype).reshape(shape)))
        off += _padded(n)
    return out


class WeightSender:
    """Rank 0's end: a rollout-engine-shaped sink that broadcasts each bucket to the receivers.

    :func:`aligner.rollout.weight_sync.refit.refit` (or any caller) hands it buckets of full HF-named tensors
    through :meth:`update_weights` and ends with :meth:`finish_weight_update`, as it would a local
    engine; ``weight_version`` counts finished syncs. Only rank 0 of the sync group sends;
    ``group=None`` (an actor rank that is not the sender) makes every call a no-op, so every rank
    of the actor can run the same collective refit walk.
    """

    def __init__(self, group: Optional[SyncGroup], dtype: Optional[torch.dtype] = None) -> None:
        if group is not None and group.rank != 0:
            raise ValueError(f"the sender is rank 0 of the sync group, not rank {group.rank}")
        self.group, self.dtype = group, dtype
        self.weight_version = 0
        self.bytes_sent = 0
        self.buckets_sent = 0

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one bucket (:func:`pack_bucket`): the header's length, the header, then the flat buffer
        (three broadcasts). Floating tensors are cast to the sender's dtype first."""
        if self.group is None:
            return
        bucket = [(n, t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t) for n, t in named]
        head_bytes, flat = pack_bucket(bucket, self.group.device)
        head = torch.frombuffer(bytearray(head_bytes), dtype=torch.uint8).to(self.group.device)
        self.group.broadcast(torch.tensor([head.numel()], dtype=HEADER_LEN_DTYPE, device=self.group.device))
        self.group.broadcast(head)
        self.group.broadcast(flat)
        self.bytes_sent += flat.numel()
        self.buckets_sent += 1

    def finish_weight_update(self) -> None:
        """End the sync (the receivers' :func:`receive_weights` returns)."""
        if self.group is not None:
            self.group.broadcast(torch.tensor([END], dtype=HEADER_LEN_DTYPE, device=self.group.device))
        self.weight_version += 1


def iter_received_buckets(group: SyncGroup) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A receiver's end: yields each bucket [(name, tensor)] as the sender broadcasts it, until the end mark."""
    if group.rank == 0:
        raise ValueError("rank 0 of the sync group sends; receivers are ranks 1..")
    while True:
        n = torch.zeros(1, dtype=HEADER_LEN_DTYPE, device=group.device)
        group.broadcast(n)
        if int(n.item()) == END:
            return
        head = torch.empty(int(n.item()), dtype=torch.uint8, device=group.device)
        group.broadcast(head)
        spec, size = bucket_spec(head.cpu().numpy().tobytes())
        flat = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(flat)
        yield unpack_bucket(spec, flat)


def receive_weights(group: SyncGroup, engine: RolloutEngine) -> dict:
    """Receive one sync into `engine` (its ``update_weights`` per bucket, then ``finish_weight_update``).

    Returns {"bytes": received buffer bytes, "buckets": n, "tensors": n, "weight_version": the engine's}.
    """
    nbytes = buckets = tensors = 0
    for bucket in iter_received_buckets(group):
        engine.update_weights(bucket)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        buckets += 1
        tensors += len(bucket)
    engine.finish_weight_update()
    return {"bytes": nbytes, "buckets": buckets, "tensors": tensors, "weight_version": engine.weight_version}


def receive_weights_staged(group: SyncGroup, engine) -> dict:
    """Receive one whole sync into buffers of its own, then hand it to ``engine.offer_weights`` (a
    :class:`~aligner.rollout.torch_engine.engine.TorchEngine` built with ``interruptible=True``): applied at once
    when the engine is idle, else at the running generate() call's next decode step boundary
    (:mod:`aligner.rollout.weight_sync.staging`). Runs on a thread beside the one that generates; the receiver
    holds the whole sync (the policy's tensors) until it is applied, not one bucket.

    Returns {"bytes", "buckets", "tensors"} as :func:`receive_weights`, and "applied": True when the sync
    was applied before returning (the engine was idle), False when it waits for a step boundary.
    """
    sync = list(iter_received_buckets(group))  # each bucket's tensors are views of its own flat buffer
    applied = engine.offer_weights(sync)
    nbytes = sum(t.numel() * t.element_size() for b in sync for _, t in b)
    return {"bytes": nbytes, "buckets": len(sync), "tensors": sum(len(b) for b in sync), "applied": applied}
