"""Shared pytest fixtures and the test environment; the fixtures themselves live in tests/toolkit/.

- ``shared``: :func:`tests.toolkit.paths.shared_path` (../shared, skip where it is absent);
- ``ray_cluster``: the session's local Ray instance, ``cluster_env``: a CLI subprocess's environment that joins it (:mod:`tests.toolkit.ray`).

Every test ends the processes it started: after its teardown, the processes below pytest that
were not there when its body began (and are not a shared service or a pooled gloo rank,
:func:`tests.toolkit.processes.left_running`) get SIGKILL, with their subtrees, whether it passed,
failed or timed out (pytest-timeout's default signal method fails the test; its teardown runs).
They are listed at the end of the run ("processes left running by tests").
"""

from __future__ import annotations

import getpass
import os
import sys
import tempfile

import pytest

from tests.toolkit.paths import REPO, shared_path
from tests.toolkit.ray import cluster_env, ray_cluster  # noqa: F401 (session fixtures, shared by every module)

# Local Ray tests: no token auth files, no usage stats; DeepSpeed's JIT cache inside the repo.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
# Inductor's kernel cache, one per CPU capability: torch 2.13's cache key ignores ATEN_CPU_CAPABILITY, so kernels
# compiled under `make test-avx2` (or any capped run) and loaded natively abort the process, and the reverse
# gives wrong tokens or a segfault (docs/hardware.md). The default /tmp/torchinductor_$USER is shared by every run.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"aligner_inductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY') or 'native'}"),
)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def shared():
    return shared_path


# The demo acceptance runs first, on a machine nothing has used yet. It is a third of the suite, and
# it took 617 s after the rest of the suite against 396 s alone on the same machine (2026-11-26; the
# cause was not found: no leftover process was busy, the session's Ray instance and the pooled gloo
# ranks sat idle).
RUN_FIRST = ("tests/trainers/test_sft_rm.py::test_tiny_demo_acceptance",)


def pytest_collection_modifyitems(config, items):
    """Move the tests of RUN_FIRST to the front of the run, in RUN_FIRST's order; the rest keep theirs."""
    rank = {nodeid: i for i, nodeid in enumerate(RUN_FIRST)}
    first = sorted((it for it in items if it.nodeid in rank), key=lambda it: rank[it.nodeid])
    items[:] = first + [it for it in items if it.nodeid not in rank]


LEFT_RUNNING: list[tuple[str, list[str]]] = []  # (test id, ["pid command line", ...]) ended after the test
_BEFORE = pytest.StashKey[set]()  # the pids below pytest when a test's body began


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    from tests.toolkit.processes import descendants

    if sys.platform.startswith("linux"):
        item.stash[_BEFORE] = set(descendants(os.getpid()))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    before = item.stash.get(_BEFORE, None)
    if before is None:
        return
    from tests.toolkit.processes import cmdline, end_trees, is_shared_service, left_running
    from tests.toolkit.spawn import pooled_pids

    pooled = pooled_pids()
    left = left_running(os.getpid(), before, lambda pid: pid in pooled or is_shared_service(pid))
    if left:
        LEFT_RUNNING.append((item.nodeid, [f"{pid} {cmdline(pid)[:160]}" for pid in left]))
        end_trees(left)


def pytest_terminal_summary(terminalreporter):
    if LEFT_RUNNING:
        terminalreporter.section("processes left running by tests (ended after the test with SIGKILL)")
        for nodeid, procs in LEFT_RUNNING:
            terminalreporter.write_line(f"{nodeid}: {len(procs)}")
            for line in procs:
                terminalreporter.write_line(f"    {line}")
