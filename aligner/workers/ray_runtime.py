"""Starting and stopping Ray for aligner: the embedded local instance or an existing cluster.

Owns: :func:`init_ray` / :func:`shutdown_ray` and the choice between them.

- Existing cluster: ``cluster.address`` ("auto" or "host:port") or the ``RAY_ADDRESS``
  environment variable (set by ``ray job submit`` for the job's driver). Nothing about
  the cluster is changed (auth mode, resources, dashboard are the cluster's).
- Embedded default (no address): a new local instance with the dashboard off, usage stats off, quiet driver logging, ``num_cpus`` large enough for
  the CPU-worker plans (``cluster.cpus_per_node``, else at least 8), and token auth
  disabled (``RAY_AUTH_MODE=disabled``) unless the caller set RAY_AUTH_MODE: the
  instance accepts connections only from this machine, and token auth would write
  a token under ~/.ray.

Thread counts inside workers are set by the worker group (see
:func:`aligner.workers.placement.threads_per_worker`); Ray itself gives actors
OMP_NUM_THREADS=1 unless told otherwise.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from aligner.config import ClusterConfig

MIN_LOCAL_CPUS = 8


@dataclass(frozen=True, kw_only=True)
class RayInfo:
    """How Ray was started (or joined) by :func:`init_ray`."""

    address: str  # GCS address of the cluster
    local: bool  # True when init_ray started a new local instance
    started: bool  # False when Ray was already initialized in this process
    resources: dict  # ray.cluster_resources() at start


def resolve_address(cluster: Optional[ClusterConfig] = None) -> str:
    """The address to connect to: cluster.address, else RAY_ADDRESS, else "" (new local instance)."""
    if cluster is not None and cluster.address:
        return cluster.address
    return os.environ.get("RAY_ADDRESS", "")


def local_num_cpus(cluster: Optional[ClusterConfig] = None, num_cpus: Optional[int] = None) -> int:
    """CPUs to declare for a new local instance (may exceed the machine's cores)."""
    if num_cpus is not None:
        if num_cpus < 1:
            raise ValueError(f"num_cpus={num_cpus} is invalid: must be >= 1")
        return num_cpus
    if cluster is not None and cluster.cpus_per_node > 0:
        return cluster.cpus_per_node
    return max(MIN_LOCAL_CPUS, os.cpu_count() or 1)


def init_ray(
    cluster: Optional[ClusterConfig] = None,
    *,
    num_cpus: Optional[int] = None,
    runtime_env: Optional[dict] = None,
    log_to_driver: bool = True,
    logging_level: int = logging.WARNING,
) -> RayInfo:
    """Connect to the configured cluster, or start the embedded local instance.

    cluster: its ``address`` picks an existing cluster ("auto" or host:port); "" falls
        back to RAY_ADDRESS, then to a new local instance.
    num_cpus: CPUs of a new local instance (default: cluster.cpus_per_node, else max(8, cores)).
    runtime_env: passed to ray.init (e.g. env_vars for every worker).
    Returns a RayInfo; if Ray is already initialized in this process, nothing is started.
    Raises ValueError for a bad num_cpus; Ray's ConnectionError when the address is unreachable.
    """
    import ray

    if ray.is_initialized():
        return RayInfo(address=_gcs_address(), local=False, started=False, resources=dict(ray.cluster_resources()))
    address = resolve_address(cluster)
    common: dict[str, Any] = dict(logging_level=logging_level, log_to_driver=log_to_driver)
    if runtime_env:
        common["runtime_env"] = runtime_env
    if address:
        ray.init(address=address, **common)
        return RayInfo(address=_gcs_address(), local=False, started=True, resources=dict(ray.cluster_resources()))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts worker processes at nice 15 (its raylet's worker_niceness): on a machine that also runs
    # other work, the workers, where all of a run's compute happens, lost the CPU to any process at nice 0
    # (a rollout worker got 10% of a core beside an evaluation). The local instance runs them at the
    # driver's priority; a user's own setting of the variable wins.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(
        address="local",  # None would join any cluster started on this machine by `ray start`
        num_cpus=local_num_cpus(cluster, num_cpus),
        include_dashboard=False,
        **common,
    )
    return RayInfo(address=_gcs_address(), local=True, started=True, resources=dict(ray.cluster_resources()))


def _gcs_address() -> str:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        return ""


def shutdown_ray() -> None:
    """Disconnect from Ray (and stop the embedded local instance if this process started it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
