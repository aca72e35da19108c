"""ParallelDims: a role's TP x CP x PP x DP layout and its process groups, built from one device mesh.

Owns: the only reads of RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in
aligner (docs/design.md, "Process groups are passed explicitly"), process-group initialization (gloo on CPU, NCCL on GPU), and the
mapping from a global rank to (dp_rank, pp_rank, tp_rank) and cp_rank.

Rank order follows Megatron: tp varies fastest, then cp, then pp, then dp, so a tp group is
contiguous ranks (one node's GPUs), a cp group the next closest (context parallelism exchanges
K/V in every layer: aligner.parallel.context_parallel), and the mesh is ``(dp, pp, cp, tp)``.
The cp ranks of one (dp, pp, tp) coordinate hold the same weights and the same rows (each a
share of every row's tokens), so data is dispatched by dp rank exactly as without cp.

Expert parallelism (MoE)
splits the dp axis into (edp, ep): the ep group is ep_size consecutive dp ranks, which hold
disjoint experts and exchange tokens by all-to-all; the edp group holds the same experts and
averages their gradients (Megatron-LM's expert-data-parallel group).

With context parallelism too, the ep and edp groups stay inside one cp rank (same pp, cp, tp
coordinate): the expert mesh is ``(edp, ep, pp, cp, tp)``. Routing and the experts are per token,
so an all-to-all among the ep ranks of one cp rank sends each token to its expert exactly as
without cp (the cp shares of a row are simply more rows). The experts are then replicated over
edp x cp, like every dense parameter over dp x cp, and their gradients take the two reductions the
dense ones already take: the sum over cp (:func:`aligner.parallel.context_parallel.sync_cp_grads`,
every parameter) and the mean over edp (:func:`aligner.parallel.data_parallel.reduce_expert_grads`,
or FSDP2 on the ``edp`` mesh). Megatron-LM instead folds cp into the expert-data-parallel group
(ep x edp = dp x cp), which lets ep span cp ranks but needs the expert grads kept out of the cp sum;
keeping ep within a cp rank needs no second code path. cp with ep is compared with one process at
tp 1, pp 1, dp = ep (tests/parallel/test_context_parallel_ep.py) and refused elsewhere until tested.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from aligner.config.parallel import cp_runs_with_ep


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """What the launcher told this process (torchrun-style variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (defaults: single process)."""
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )


def init_process_group(env: Optional[DistEnv] = None, backend: Optional[str] = None, timeout_s: float = 300.0) -> DistEnv:
    """Initialize the default process group from `env` (or the environment); no-op if already up.

    backend: "gloo" or "nccl"; default NCCL when CUDA is available, else gloo.
    """
    env = env or DistEnv.from_environ()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return env


@dataclass(kw_only=True)
class ParallelDims:
    """tp_size x cp_size x pp_size x dp_size = world_size, and the groups along each axis.

    Raises ValueError naming the three sizes when their product is not the world size.
    Call :meth:`build` after the default process group exists to create the groups.
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1  # expert parallelism inside dp: dp rank = edp_rank * ep_size + ep_rank
    cp_size: int = 1  # context parallelism: each sequence split over cp ranks (zigzag chunks)
    world_size: int = 1
    rank: int = 0
    tp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    pp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    dp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    cp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    ep_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)  # ep_size consecutive dp ranks (same pp, cp, tp)
    edp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)  # dp ranks holding the same experts
    mesh: object = field(default=None, repr=False)  # torch DeviceMesh ("dp", "pp", "cp", "tp")
    expert_mesh: object = field(default=None, repr=False)  # DeviceMesh ("edp", "ep", "pp", "cp", "tp") when ep_size > 1
    device_type: Optional[str] = None  # "cpu" or "cuda" to pin a single-process role; None: see `device`

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "cp_size", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.device_type not in (None, "cpu", "cuda"):
            raise ValueError(f"device_type={self.device_type!r} is invalid: use 'cpu', 'cuda' or None (automatic)")
        if self.ep_size < 1 or self.dp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide dp_size={self.dp_size}")
        if self.cp_size > 1 and not cp_runs_with_ep(self.tp_size, self.pp_size, self.dp_size, self.ep_size):
            raise ValueError(
                f"cp_size={self.cp_size} with ep_size={self.ep_size} runs at tp_size=1, pp_size=1, dp_size=ep_size only (tested), not "
                f"tp_size={self.tp_size}, pp_size={self.pp_size}, dp_size={self.dp_size}: set ep_size=1 or those sizes"
            )
        product = self.tp_size * self.cp_size * self.pp_size * self.dp_size
        if product != self.world_size:
            cp = f" x cp_size={self.cp_size}" if self.cp_size > 1 else ""
            raise ValueError(
                f"tp_size={self.tp_size}{cp} x pp_size={self.pp_size} x dp_size={self.dp_size} = "
                f"{product}, but world_size={self.world_size}: "
                "change one of them so their product equals the number of processes"
            )

    # ---- coordinates -------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def pp_rank(self) -> int:
        return (self.rank // (self.tp_size * self.cp_size)) % self.pp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size * self.pp_size)

    @property
    def ep_rank(self) -> int:
        """Position in this rank's expert-parallel group (which slice of the experts it holds)."""
        return self.dp_rank % self.ep_size

    @property
    def edp_rank(self) -> int:
        """Position among the dp ranks holding the same experts (expert-data-parallel)."""
        return self.dp_rank // self.ep_size

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """Global rank of the process at mesh coordinates (dp, pp, cp, tp)."""
        return ((dp_rank * self.pp_size + pp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of global `rank` (its cp rank: ``rank // tp_size % cp_size``)."""
        tc = self.tp_size * self.cp_size
        return rank // (tc * self.pp_size), (rank // tc) % self.pp_size, rank % self.tp_size

    @property
    def device(self) -> torch.device:
        """Where this rank's model and batches live: `device_type` when set; else the current CUDA
        device when the default group uses NCCL or, in a single process, when CUDA is available
        (``CUDA_VISIBLE_DEVICES=`` forces the CPU); else the CPU (gloo)."""
        if self.device_type is not None:
            on_gpu = self.device_type == "cuda"
        elif dist.is_initialized():
            on_gpu = dist.get_backend() == "nccl"
        else:
            on_gpu = torch.cuda.is_available()
        return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    # ---- groups ------------------------------------------------------------------
    def build(self) -> ParallelDims:
        """Create the device mesh and tp/cp/pp/dp groups (collective: every rank must call it)."""
        if self.world_size == 1:
            return self
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.mesh = init_device_mesh(
            device, (self.dp_size, self.pp_size, self.cp_size, self.tp_size), mesh_dim_names=("dp", "pp", "cp", "tp")
        )
        self.tp_group = self.mesh.get_group("tp") if self.tp_size > 1 else None
        self.cp_group = self.mesh.get_group("cp") if self.cp_size > 1 else None
        self.pp_group = self.mesh.get_group("pp") if self.pp_size > 1 else None
        self.dp_group = self.mesh.get_group("dp") if self.dp_size > 1 else None
        if self.ep_size > 1:
            edp = self.dp_size // self.ep_size
            self.expert_mesh = init_device_mesh(  # dp = edp * ep_size + ep splits the mesh's dp axis in place
                device, (edp, self.ep_size, self.pp_size, self.cp_size, self.tp_size), mesh_dim_names=("edp", "ep", "pp", "cp", "tp")
            )
            self.ep_group = self.expert_mesh.get_group("ep")
            self.edp_group = self.expert_mesh.get_group("edp") if edp > 1 else None
        return self

    @classmethod
    def from_env(
        cls,
        tp_size: int = 1,
        pp_size: int = 1,
        dp_size: Optional[int] = None,
        backend: Optional[str] = None,
        ep_size: int = 1,
        cp_size: int = 1,
    ) -> ParallelDims:
        """Initialize the default group from the environment and build the groups.

        dp_size None: world_size // (tp_size * cp_size * pp_size).
        """
        env = init_process_group(backend=backend) if int(os.environ.get("WORLD_SIZE", 1)) > 1 else DistEnv.from_environ()
        if dp_size is None:
            dp_size = max(1, env.world_size // (tp_size * cp_size * pp_size))
        dims = cls(
            tp_size=tp_size, pp_size=pp_size, dp_size=dp_size, ep_size=ep_size, cp_size=cp_size, world_size=env.world_size, rank=env.rank
        )
        return dims.build()
