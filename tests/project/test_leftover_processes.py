"""A failing or timed-out multi-rank test leaves no process running (tests/conftest.py, tests/toolkit/spawn.py).

A pytest run in a subprocess, on a test file of its own: its first test starts gloo ranks that
ignore SIGTERM (as a rank running aligner's preemption handler does) while one rank waits in a
collective for a peer that failed, a busy multiprocessing child and a sleeping subprocess it never
ends, and fails; its second test checks, in the same session, that none of them is still running;
and after the session no process of either is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.toolkit.paths import REPO
from tests.toolkit.processes import alive_after, cmdline, end_trees

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; prctl(2) is Linux's")

LEAKY = textwrap.dedent(
    """
    import os, signal, subprocess, sys

    import torch.multiprocessing as mp

    from tests.toolkit.processes import alive
    from tests.toolkit.spawn import run_distributed

    PIDS = os.environ["LEAK_PIDS"]


    def _note(pid):
        with open(PIDS, "a") as f:
            f.write(f"{pid}\\n")


    def _battery(rank, world):
        import torch.distributed as dist

        signal.signal(signal.SIGTERM, lambda *a: None)  # a preemption handler: SIGTERM does not end the rank
        _note(os.getpid())
        if rank == 1:
            import time

            deadline = time.monotonic() + 60  # fail only once rank 0 has noted its pid too (a loaded machine starts it late)
            while len(open(PIDS).read().split()) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("rank 1 fails")
        dist.barrier()  # rank 0 waits for rank 1 in a collective, forever


    def _spin():
        while True:
            pass


    def test_a_failing_multi_rank_test():
        busy = mp.get_context("spawn").Process(target=_spin)
        busy.start()
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        _note(busy.pid)
        _note(sleeper.pid)
        run_distributed(_battery, 2, timeout_s=60)


    def test_b_nothing_of_the_failed_test_runs():
        pids = [int(p) for p in open(PIDS).read().split()]
        assert len(pids) == 4
        assert [p for p in pids if alive(p)] == []
    """
)


def test_a_failing_multi_rank_test_leaves_no_process(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LEAK_PIDS": str(pids)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", "-o", "timeout=120", "test_leaky.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,  # a session whose ranks ignore SIGTERM never ended: multiprocessing's exit joins them
        )
        out = proc.stdout + proc.stderr
        assert "1 failed, 1 passed" in out, out[-4000:]
        assert "rank 1 of 2 failed" in out and "RuntimeError: rank 1 fails" in out, out[-4000:]
        noted = [int(p) for p in pids.read_text().split()]
        assert len(noted) == 4, noted
        assert alive_after(noted, 10) == []
        # the busy child and the sleeper were the test's own leftovers: ended and reported (spawn.py killed the ranks)
        assert "processes left running by tests" in out and "test_leaky.py::test_a_failing_multi_rank_test: 2" in out, out[-4000:]
    finally:  # whatever happened, nothing of the inner session outlives this test (orphans escape conftest's reaper)
        noted = [int(p) for p in (pids.read_text().split() if pids.exists() else [])]
        end_trees(p for p in noted if any(s in cmdline(p) for s in ("spawn_main", "time.sleep(600)")))  # not a reused pid
