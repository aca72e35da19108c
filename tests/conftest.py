"""Shared pytest fixtures and the test environment; the fixtures themselves live in tests/toolkit/.

- ``shared``: :func:`tests.toolkit.paths.shared_path` (../shared, skip where it is absent);
- ``ray_cluster``: the session's local Ray instance, ``cluster_env``: a CLI subprocess's environment that joins it (:mod:`tests.toolkit.ray`).
"""

from __future__ import annotations

import os

import pytest

from tests.toolkit.paths import REPO, shared_path
from tests.toolkit.ray import cluster_env, ray_cluster  # noqa: F401 (session fixtures, shared by every module)

# Local Ray tests: no token auth files, no usage stats; DeepSpeed's JIT cache inside the repo.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def shared():
    return shared_path


# The demo acceptance runs first, on a machine nothing has used yet. It is a third of the suite, and
# it took 617 s after the rest of the suite against 396 s alone on the same machine (2026-11-26; the
# cause was not found: no leftover process was busy, the session's Ray instance and the pooled gloo
# ranks sat idle).
RUN_FIRST = ("tests/test_sft_rm.py::test_tiny_demo_acceptance",)


def pytest_collection_modifyitems(config, items):
    """Move the tests of RUN_FIRST to the front of the run, in RUN_FIRST's order; the rest keep theirs."""
    rank = {nodeid: i for i, nodeid in enumerate(RUN_FIRST)}
    first = sorted((it for it in items if it.nodeid in rank), key=lambda it: rank[it.nodeid])
    items[:] = first + [it for it in items if it.nodeid not in rank]
