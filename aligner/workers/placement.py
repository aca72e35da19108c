"""Placement of roles on the Ray cluster: node groups (placement groups) built from config.

Owns: turning each role's ``RoleConfig.resources`` and ``RoleConfig.parallel`` into a
Ray placement group ("node group"), the split / colocated layouts, the up-front check
of what is asked against what the cluster has, and the removal of placement groups.

Layout of a node group: one bundle per node, holding all of that node's workers
(``{"GPU": gpus_per_node, "CPU": cpus_per_worker * gpus_per_node}`` on GPU, or
``{"CPU": cpus_per_worker * workers_per_node}`` on CPU). Bundles of a multi-node group
are placed with STRICT_SPREAD (one per node), a single bundle with PACK. Rank r lives in
bundle ``r // workers_per_node``, so the contiguous ranks of a TP group share a node.

- split: every role gets its own node group (NeMo-Aligner's actor and critic on separate
  halves of the nodes); ``RoleConfig.colocate_with`` moves a role into another's group.
- colocated: all roles share one node group; each actor asks ``1/k`` of a GPU and
  ``cpus_per_worker/k`` CPUs, where k roles share the bundles (time-sliced).
- rollout.backend=trtllm: each actor rank asks ``TRTLLM_WORKER_GPU_SHARE`` less of its GPU,
  and the TensorRT-LLM engine workers its replica owner starts ask that share in the same
  node bundle (aligner.rollout.trtllm_engine), so one engine worker sits on each actor GPU.

Simplification: one GPU per worker; colocated roles must use the same num_nodes and
gpus_per_node. A cluster that lacks the resources is refused with :class:`PlacementError`
before any actor starts; ``placement_group.ready()`` with a timeout is a second guard
(it also catches resources held by other jobs).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

from aligner.config import ParallelConfig, ResourceConfig, RoleConfig
from aligner.errors import PlacementError
from aligner.workers.ray_runtime import local_num_cpus

log = logging.getLogger("aligner")

PLACEMENTS = ("split", "colocated")
ROLLOUT_GROUP = "rollout"  # the engines' worker group of rollout.placement=split (a role name in placements)
# GPU share each TensorRT-LLM engine worker asks (RayPlacementConfig.per_worker_gpu_share); the actor
# worker on that GPU asks this much less, so exactly one engine worker fits beside each actor rank
TRTLLM_WORKER_GPU_SHARE = 0.1


@dataclass(frozen=True, kw_only=True)
class RoleRequest:
    """What one role asks of the cluster: its world size and resources per node.

    Raises ValueError naming the field when the world size does not fit the node layout.
    """

    role: str  # role name (actor, critic, reward, ref, or any label)
    world_size: int  # workers (tp * pp * dp)
    num_nodes: int = 1  # nodes in the role's node group
    gpus_per_node: int = 0  # GPUs per node; 0 = CPU workers
    cpus_per_worker: int = 1  # CPUs per worker
    # share of each of its GPUs a worker leaves free in the bundle for processes it starts there
    # itself (the TensorRT-LLM engine workers of rollout.backend=trtllm, TRTLLM_WORKER_GPU_SHARE)
    engine_gpu_share: float = 0.0

    def __post_init__(self) -> None:
        p = f"{self.role}.resources"
        for name in ("world_size", "num_nodes", "cpus_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"{p}.{name}={getattr(self, name)} is invalid: must be >= 1")
        if not 0.0 <= self.engine_gpu_share < 1.0:
            raise ValueError(f"engine_gpu_share={self.engine_gpu_share} is invalid: must be in [0, 1)")
        if self.gpus_per_node < 0:
            raise ValueError(f"{p}.gpus_per_node={self.gpus_per_node} is invalid: must be >= 0 (0 = CPU workers)")
        if self.gpus_per_node > 0 and self.world_size != self.num_nodes * self.gpus_per_node:
            raise ValueError(
                f"{p}.gpus_per_node={self.gpus_per_node} with num_nodes={self.num_nodes} gives "
                f"{self.num_nodes * self.gpus_per_node} GPUs, but {self.role}.parallel world_size "
                f"(tp*pp*dp) is {self.world_size}: one worker per GPU, make them equal"
            )
        if self.world_size % self.num_nodes:
            raise ValueError(
                f"{p}.num_nodes={self.num_nodes} does not divide {self.role}.parallel world_size "
                f"{self.world_size}: use a divisor of the world size"
            )

    @classmethod
    def from_role(cls, role: str, cfg: RoleConfig) -> RoleRequest:
        """The request of a RoleConfig (its parallel world size and resources)."""
        return cls.from_parts(role, cfg.parallel, cfg.resources)

    @classmethod
    def from_parts(cls, role: str, parallel: ParallelConfig, resources: ResourceConfig) -> RoleRequest:
        """The request of a ParallelConfig and a ResourceConfig."""
        return cls(
            role=role,
            world_size=parallel.world_size,
            num_nodes=resources.num_nodes,
            gpus_per_node=resources.gpus_per_node,
            cpus_per_worker=resources.cpus_per_worker,
        )

    def gpus_per_worker(self, k: int = 1) -> float:
        """GPUs one worker asks when `k` roles share its bundles: 1/k less engine_gpu_share (0 on CPU)."""
        return (1.0 / k - self.engine_gpu_share) if self.gpus_per_node else 0.0

    @property
    def workers_per_node(self) -> int:
        return self.world_size // self.num_nodes

    @property
    def node_bundle(self) -> dict[str, float]:
        """The resources of one node's bundle."""
        bundle: dict[str, float] = {"CPU": float(self.cpus_per_worker * self.workers_per_node)}
        if self.gpus_per_node:
            bundle["GPU"] = float(self.gpus_per_node)
        return bundle

    def describe(self) -> str:
        unit = f"{self.gpus_per_node} GPU + " if self.gpus_per_node else ""
        return (
            f"{self.role}: {self.num_nodes} node(s) x {self.workers_per_node} worker(s) x "
            f"({unit}{self.cpus_per_worker} CPU per worker) [resources.num_nodes={self.num_nodes}, "
            f"gpus_per_node={self.gpus_per_node}, cpus_per_worker={self.cpus_per_worker}]"
        )


@dataclass(kw_only=True)
class NodeGroupSpec:
    """One placement group to create and the roles that share it."""

    name: str  # label (the first role's name)
    requests: list[RoleRequest]  # roles sharing these bundles (k = len(requests))

    @property
    def num_nodes(self) -> int:
        return self.requests[0].num_nodes

    @property
    def bundles(self) -> list[dict[str, float]]:
        """One bundle per node: the largest per-node ask among the sharing roles."""
        keys = sorted({k for r in self.requests for k in r.node_bundle})
        per_node = {k: max(r.node_bundle.get(k, 0.0) for r in self.requests) for k in keys}
        return [dict(per_node) for _ in range(self.num_nodes)]

    @property
    def strategy(self) -> str:
        return "STRICT_SPREAD" if self.num_nodes > 1 else "PACK"

    def total(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                out[k] = out.get(k, 0.0) + v
        return out


def _owner(name: str, roles: Mapping[str, RoleRequest], colocate_with: Mapping[str, str]) -> str:
    """The role whose node group `name` joins, following colocate_with links."""
    seen, cur = [name], name
    while colocate_with.get(cur):
        nxt = colocate_with[cur]
        if nxt not in roles:
            raise ValueError(f"{cur}.colocate_with={nxt!r} is invalid: valid roles here are {', '.join(roles)}")
        if nxt in seen:
            raise ValueError(
                f"{cur}.colocate_with={nxt!r} forms a cycle ({' -> '.join(seen + [nxt])}): point it at a role with its own node group"
            )
        seen.append(nxt)
        cur = nxt
    return cur


def plan_node_groups(
    roles: Mapping[str, RoleRequest], placement: str = "split", colocate_with: Optional[Mapping[str, str]] = None
) -> list[NodeGroupSpec]:
    """Group role requests into node groups.

    roles: role name -> request, in the order groups are created.
    placement: "split" (own group per role, except roles named in `colocate_with`)
        or "colocated" (one group for all roles); the rollout group of ``rollout.placement=split``
        (:data:`ROLLOUT_GROUP`) gets its own group either way.
    colocate_with: role -> the role whose bundles it shares (split placement only).
    Raises ValueError for an unknown placement, an unknown colocate target, or
    colocated roles with different num_nodes / gpus_per_node.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"cluster.placement={placement!r} is invalid: valid choices are {', '.join(PLACEMENTS)}")
    colocate_with = dict(colocate_with or {})
    owner: dict[str, str] = {}
    for name in roles:
        if name == ROLLOUT_GROUP:  # the split rollout placement: always a node group of its own
            owner[name] = name
            continue
        if placement == "colocated":
            owner[name] = next(iter(roles))
            continue
        owner[name] = _owner(name, roles, colocate_with)
    groups: dict[str, NodeGroupSpec] = {}
    for name, req in roles.items():
        spec = groups.setdefault(owner[name], NodeGroupSpec(name=owner[name], requests=[]))
        first = spec.requests[0] if spec.requests else req
        if (req.num_nodes, req.gpus_per_node) != (first.num_nodes, first.gpus_per_node):
            raise ValueError(
                f"{name}.resources (num_nodes={req.num_nodes}, gpus_per_node={req.gpus_per_node}) must equal "
                f"{first.role}.resources (num_nodes={first.num_nodes}, gpus_per_node={first.gpus_per_node}) "
                "to share its bundles: make them equal or use split placement"
            )
        spec.requests.append(req)
    return list(groups.values())


def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def _fmt(res: Mapping[str, float]) -> str:
    keys = ["CPU", "GPU"] + sorted(
        k for k in res if k not in ("CPU", "GPU") and not k.startswith(("node:", "accelerator_type")) and "memory" not in k
    )
    return ", ".join(f"{k}={res.get(k, 0):g}" for k in keys if k in res or k in ("CPU", "GPU"))


def _shortfall(specs: Sequence[NodeGroupSpec], nodes: list[dict[str, float]]) -> Optional[str]:
    asked: dict[str, float] = {}
    for spec in specs:
        for k, v in spec.total().items():
            asked[k] = asked.get(k, 0.0) + v
    have: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            have[k] = have.get(k, 0.0) + v
    for k, v in asked.items():
        if v > have.get(k, 0.0) + 1e-9:
            return f"{v:g} {k} in total, the cluster has {have.get(k, 0.0):g}"
    for spec in specs:
        bundle = spec.bundles[0]
        fits = sum(all(n.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for n in nodes)
        if fits < spec.num_nodes:
            return f"node group {spec.name!r} needs {spec.num_nodes} node(s) each with {_fmt(bundle)}; {fits} alive node(s) can hold that"
    return None


def describe_request(specs: Sequence[NodeGroupSpec]) -> str:
    """What the node groups ask, one line per role plus totals per node group."""
    lines = []
    for spec in specs:
        roles = ", ".join(r.role for r in spec.requests)
        lines.append(f"  node group {spec.name!r} (roles: {roles}): {spec.num_nodes} bundle(s) of {_fmt(spec.bundles[0])}")
        lines.extend(f"    {r.describe()}" for r in spec.requests)
    return "\n".join(lines)


def check_cluster(specs: Sequence[NodeGroupSpec]) -> None:
    """Raise PlacementError when the cluster's totals or nodes cannot hold `specs`.

    Compares against ``ray.cluster_resources()`` and the alive nodes of ``ray.nodes()``
    (needs ``ray.init``). Resources already in use by others are caught later by the
    ``ready()`` timeout in :func:`create_placement`.
    """
    import ray

    nodes = _alive_nodes()
    why = _shortfall(specs, nodes)
    if why:
        raise PlacementError(
            f"the cluster cannot hold the requested placement ({why}).\n"
            f"asked:\n{describe_request(specs)}\n"
            f"the cluster has: {_fmt(ray.cluster_resources())} over {len(nodes)} alive node(s) (ray.cluster_resources()).\n"
            "fix: lower <role>.resources.cpus_per_worker / gpus_per_node / num_nodes or the roles' "
            "parallel sizes, use cluster.placement=colocated, or add nodes"
        )


def wait_for_cluster(specs: Sequence[NodeGroupSpec], wait_s: float, poll_s: float = 2.0) -> float:
    """:func:`check_cluster` until it passes or `wait_s` seconds have gone (0: check once); returns the
    seconds waited. A lost node's replacement joining (Kubernetes, an autoscaler) ends the wait; the
    PlacementError of a cluster still too small says how long it waited."""
    t0, warned = time.monotonic(), False
    while True:
        try:
            check_cluster(specs)
        except PlacementError as e:
            waited = time.monotonic() - t0
            if waited + poll_s > wait_s:
                if wait_s > 0:
                    e.args = (f"{e.args[0]}\n(waited {waited:.0f} s for it: trainer.restart_wait_s={wait_s:g})",)
                raise
            if not warned:
                log.warning("the cluster cannot hold the worker groups now (a lost node?): waiting up to %g s for it", wait_s)
                warned = True
            time.sleep(poll_s)
            continue
        waited = time.monotonic() - t0
        if warned:
            log.warning("the cluster holds the worker groups again after %.0f s", waited)
        return waited


class _SharedPG:
    """A placement group with a count of the worker groups using it; removed at zero."""

    def __init__(self, pg: Any, users: int) -> None:
        self.pg = pg
        self.users = users
        self.removed = False

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.remove()

    def remove(self) -> None:
        if self.removed:
            return
        self.removed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            try:
                remove_placement_group(self.pg)
            except Exception:  # the cluster may already be gone at teardown
                pass


@dataclass(kw_only=True)
class RolePlacement:
    """Where one role's workers go: a placement group, a bundle per rank, and each actor's ask."""

    role: str  # role name
    request: RoleRequest  # what the role asked
    num_cpus: float  # CPUs each actor reserves from its bundle
    num_gpus: float  # GPUs each actor reserves (1, 1/k when k roles share, 0 on CPU)
    shared: Optional[_SharedPG] = field(default=None, repr=False)  # None: no placement group (tests)

    @property
    def placement_group(self) -> Any:
        return self.shared.pg if self.shared else None

    @property
    def world_size(self) -> int:
        return self.request.world_size

    def bundle_index(self, rank: int) -> int:
        """The bundle (node) index of global `rank`."""
        return rank // self.request.workers_per_node

    def local_rank(self, rank: int) -> int:
        """Position of `rank` among this role's workers on its node."""
        return rank % self.request.workers_per_node

    def release(self) -> None:
        """Drop this role's hold on its placement group; the last holder removes it."""
        if self.shared is not None:
            self.shared.release()
            self.shared = None


@dataclass(kw_only=True)
class Placement:
    """The node groups of a run and each role's share of them."""

    roles: dict[str, RolePlacement]
    specs: list[NodeGroupSpec]

    def role(self, name: str) -> RolePlacement:
        """The RolePlacement of `name`; ValueError naming the placed roles otherwise."""
        if name not in self.roles:
            raise ValueError(f"role {name!r} was not placed: placed roles are {', '.join(self.roles)}")
        return self.roles[name]

    def remove(self) -> None:
        """Remove every placement group (actors in them are killed by Ray)."""
        for rp in self.roles.values():
            if rp.shared is not None:
                rp.shared.remove()
                rp.shared = None


def create_placement(
    roles: Mapping[str, RoleRequest],
    placement: str = "split",
    colocate_with: Optional[Mapping[str, str]] = None,
    timeout_s: float = 60.0,
    wait_for_nodes_s: float = 0.0,
) -> Placement:
    """Check the cluster, then create and wait for one placement group per node group.

    wait_for_nodes_s: a restart after a lost node (``trainer.restart_wait_s``): how long the
        cluster may lack the resources before that is an error (polled every 2 s; the groups'
        ``ready()`` then waits up to the larger of `timeout_s` and what is left of it).
    Raises PlacementError when the cluster lacks the resources (checked before anything
    is created; after `wait_for_nodes_s`) or a group is not ready within `timeout_s`
    (resources in use elsewhere); in the second case every group created so far is removed.
    """
    import ray
    from ray.util.placement_group import placement_group

    specs = plan_node_groups(roles, placement, colocate_with)
    deadline = time.monotonic() + wait_for_nodes_s
    wait_for_cluster(specs, wait_for_nodes_s)
    timeout_s = max(timeout_s, deadline - time.monotonic())
    created: list[_SharedPG] = []
    out: dict[str, RolePlacement] = {}
    try:
        for spec in specs:
            pg = placement_group(spec.bundles, strategy=spec.strategy)
            shared = _SharedPG(pg, users=len(spec.requests))
            created.append(shared)
            if not pg.wait(timeout_seconds=timeout_s):
                raise PlacementError(
                    f"node group {spec.name!r} was not placed within {timeout_s:g} s "
                    "(the resources exist but are in use, or nodes are missing).\n"
                    f"asked:\n{describe_request(specs)}\n"
                    f"the cluster has: {_fmt(ray.cluster_resources())} (ray.cluster_resources()), "
                    f"available now: {_fmt(ray.available_resources())}.\n"
                    "fix: free the resources (other jobs), lower the roles' resources, or add nodes"
                )
            k = len(spec.requests)
            for req in spec.requests:
                out[req.role] = RolePlacement(
                    role=req.role,
                    request=req,
                    num_cpus=req.cpus_per_worker / k,
                    num_gpus=req.gpus_per_worker(k),
                    shared=shared,
                )
    except BaseException:
        for shared in created:
            shared.remove()
        raise
    return Placement(roles=out, specs=specs)


def _config_requests(cfg: Any, roles: Sequence[str]) -> tuple[dict[str, RoleRequest], dict[str, str]]:
    requests = {name: RoleRequest.from_role(name, cfg.role(name)) for name in roles if name != ROLLOUT_GROUP}
    if ROLLOUT_GROUP in roles:  # rollout.placement=split: the engines' own worker group
        requests[ROLLOUT_GROUP] = RoleRequest.from_parts(ROLLOUT_GROUP, cfg.rollout.parallel, cfg.rollout.resources)
    # the ranks that start TensorRT-LLM engines (the actor's, or the split placement's rollout group's)
    # leave TRTLLM_WORKER_GPU_SHARE of their GPUs to the engine workers they start
    owner = ROLLOUT_GROUP if cfg.rollout.placement == "split" else "actor"
    if cfg.stage == "ppo" and cfg.rollout.backend == "trtllm" and owner in requests and requests[owner].gpus_per_node:
        requests[owner] = replace(requests[owner], engine_gpu_share=TRTLLM_WORKER_GPU_SHARE)
    colocate = {name: cfg.role(name).colocate_with for name in roles if name != ROLLOUT_GROUP and cfg.role(name).colocate_with}
    return requests, colocate


def plan_from_config(cfg: Any, roles: Sequence[str]) -> list[NodeGroupSpec]:
    """The node groups of `roles` (RoleConfig names on an AlignerConfig), without Ray.

    Uses ``cfg.cluster.placement`` and each role's ``colocate_with``; raises ValueError
    as :func:`plan_node_groups`.
    """
    requests, colocate = _config_requests(cfg, roles)
    return plan_node_groups(requests, cfg.cluster.placement, colocate)


def placement_from_config(cfg: Any, roles: Sequence[str], timeout_s: float = 60.0, restarting: bool = False) -> Placement:
    """Create the placement of `roles` (names of RoleConfigs on an AlignerConfig `cfg`).

    Uses ``cfg.cluster.placement`` and each role's ``colocate_with``; `restarting` (an automatic
    restart): waits up to ``trainer.restart_wait_s`` for the cluster to hold the groups again.
    Raises ValueError/PlacementError as :func:`create_placement`.
    """
    requests, colocate = _config_requests(cfg, roles)
    wait = cfg.trainer.restart_wait_s if restarting else 0.0
    return create_placement(requests, cfg.cluster.placement, colocate, timeout_s, wait_for_nodes_s=wait)


def threads_per_worker(num_threads: int, cpus_per_worker: float) -> int:
    """Torch threads for a CPU worker: `num_threads` when set (> 0), else its CPUs (at least 1)."""
    return num_threads if num_threads > 0 else max(1, int(math.floor(cpus_per_worker)))


def local_shortfall(cfg, roles: Sequence[str]) -> Optional[str]:
    """What this machine lacks to hold `roles` of `cfg` when the run starts its own local Ray
    instance (no cluster.address, no RAY_ADDRESS), as one sentence; None when it fits or when
    the run joins an existing cluster (Ray's placement then says what is missing). Needs no Ray."""
    import os

    if cfg.cluster.address or os.environ.get("RAY_ADDRESS"):
        return None

    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        gpus = 0
    return cluster_shortfall(plan_from_config(cfg, list(roles)), [{"CPU": float(local_num_cpus(cfg.cluster)), "GPU": float(gpus)}])


def cluster_shortfall(specs: Sequence[NodeGroupSpec], nodes: list[dict[str, float]]) -> Optional[str]:
    """What `nodes` (resource dicts, e.g. ``[{"CPU": 8, "GPU": 0}]`` for this machine) lack to hold
    `specs`, as one sentence; None when they fit. Needs no Ray (used before starting it)."""
    return _shortfall(specs, nodes)
