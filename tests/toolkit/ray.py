"""One local Ray instance for the whole test session (fixture ``ray_cluster``, via tests/conftest.py).

Starting Ray costs seconds and each stopped instance leaves its processes to be reaped, so the
in-process stage runs (``Trainer(cfg).run()``, ``aligner.ppo.main``) share one instance: a trainer
joins a Ray instance that is already up and leaves it running (``Trainer.shutdown_ray``). It is
started by the first test that asks for it and stopped at the end of the session.

NUM_CPUS logical CPUs (not cores: Ray only counts them) cover the largest placement a test asks
for: PPO's default split placement and the dp=2 x tp=2 layouts.
"""

from __future__ import annotations

import os

import pytest

from tests.toolkit.paths import REPO

NUM_CPUS = 8


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray instance (a :class:`aligner.workers.ray_runtime.RayInfo`)."""
    from aligner.workers.ray_runtime import init_ray, shutdown_ray

    # Ray's processes take the environment at start: its workers import this checkout's aligner
    # (not an installed one), as the stage subprocesses of the e2e tests do.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *([before] if before else [])])
    try:
        info = init_ray(num_cpus=NUM_CPUS)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    yield info
    shutdown_ray()


@pytest.fixture(scope="session")
def cluster_env(ray_cluster) -> dict[str, str]:
    """The environment for a `python -m aligner.*` subprocess that joins the session's Ray instance
    (RAY_ADDRESS, as a job submitted to a running cluster does) instead of starting and stopping its
    own, which costs seconds per run; this checkout first on PYTHONPATH. For runs whose processes the
    test does not kill: a run whose driver is killed leaves its Ray workers to the shared instance."""
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray_cluster.address}
