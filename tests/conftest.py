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
