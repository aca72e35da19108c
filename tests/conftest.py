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


# Under pytest-xdist (`make test` runs two processes, `--dist loadgroup`) each test file is one group, so
# a module's fixtures are built once; these files share one group because their sandboxed programs run as
# the same uid (65534), whose process count the sandbox's tests assert.
SAME_WORKER = {"tests/reward/test_sandbox.py": "sandbox", "tests/envs/test_base_episodes.py": "sandbox"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Move the tests of RUN_FIRST to the front of the run, in RUN_FIRST's order; the rest keep theirs.
    In an xdist worker, give every test its group (RUN_FIRST's alone, else SAME_WORKER's or its file's)."""
    rank = {nodeid: i for i, nodeid in enumerate(RUN_FIRST)}
    first = sorted((it for it in items if it.nodeid in rank), key=lambda it: rank[it.nodeid])
    items[:] = first + [it for it in items if it.nodeid not in rank]
    if hasattr(config, "workerinput"):
        for it in items:
            path = it.nodeid.split("::", 1)[0]
            group = "run_first" if it.nodeid in rank else SAME_WORKER.get(path, path)
            it.add_marker(pytest.mark.xdist_group(group))
