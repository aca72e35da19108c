"""Run a function on N gloo ranks (torch.multiprocessing spawn) and collect per-rank results.

Owns the harness every multi-process test reuses. Spawning costs ~8 s (each child imports
torch), so the ranks are spawned once per world size and kept for the session: each call sends
its function to the waiting ranks, which open a fresh gloo process group on a new port, run it,
close the group and wait for the next call. Run a whole battery of checks in one call:

    def battery(rank, world_size, arg):      # module-level (picklable) function
        ...                                   # process group is up: gloo on 127.0.0.1
        return {"check": value}               # anything picklable

    results = run_distributed(battery, world_size=4, args=(arg,))   # [result of rank 0, 1, ...]

A rank's exception is re-raised in the parent as RuntimeError with the rank and the child's
traceback; the ranks of that call are then killed (a peer may wait in a collective forever, and a
battery may have installed a SIGTERM handler, as aligner's preemption handling does, so they get
SIGKILL, each to its whole process group) and the next call spawns new ones, as does
``fresh=True`` (for a battery that must not share a process with earlier ones). Each rank leads
its own process group (what it starts dies with it) and dies with the test process
(``PR_SET_PDEATHSIG``: also when pytest-timeout ends the session with ``os._exit``);
:func:`pooled_pids` names the pooled ranks, which tests/conftest.py lets outlive a test.
Before each call a rank resets what a battery may change in the
process: torch's RNG seeds, default dtype, thread count, grad mode and the environment. Children
get OMP_NUM_THREADS=1 and RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK set, so
code reading the environment (ParallelDims.from_env) works.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import signal
import sys
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

from aligner.runtime import ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call (:func:`aligner.runtime.ports.free_port`)."""
    return ports.free_port("127.0.0.1")


def _run_one(rank: int, world_size: int, port: int, fn: Callable, args: Sequence, env: dict, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.manual_seed(0)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # report every failure to the parent, whatever it is
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _tie_to_parent() -> None:
    """Lead a process group of its own and get SIGKILL when the parent dies (Linux)."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _rank_loop(rank: int, world_size: int, tasks, results, parent: int) -> None:
    """A pooled rank: run each (port, fn, args, env) from `tasks` until None arrives."""
    _tie_to_parent()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return
    while True:
        task = tasks.get()
        if task is None:
            return
        port, fn, args, env = task
        _run_one(rank, world_size, port, fn, args, env, results)


class _Ranks:
    """world_size spawned processes waiting for batteries, each with its own task queue."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_rank_loop, args=(r, world_size, self.tasks[r], self.results, os.getpid()), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: Sequence, timeout_s: float) -> list[Any]:
        port, env = free_port(), dict(os.environ)
        for q in self.tasks:
            q.put((port, fn, tuple(args), env))
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            try:
                rank, ok, out = self.results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(got))
                dead = [r for r in missing if not self.procs[r].is_alive()]
                raise RuntimeError(
                    f"run_distributed: ranks {missing} gave no result within {timeout_s} s" + (f" (ranks {dead} died)" if dead else "")
                ) from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {self.world_size} failed:\n{out}")
            got[rank] = out
        return [got[r] for r in range(self.world_size)]

    def stop(self, graceful: bool = True) -> None:
        """End the ranks: graceful, each finishes its loop (5 s at most); otherwise, or past that,
        SIGKILL to each rank's process group (the rank and whatever it started)."""
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # gone, or not yet its own group leader
                    p.kill()
            p.join(timeout=30)
        for q in (self.results, *self.tasks):
            q.close()
            q.cancel_join_thread()  # a killed rank's half-read queue must not block this process's exit


_POOL: dict[int, _Ranks] = {}


def pooled_pids() -> set[int]:
    """The pids of the pooled ranks (kept for the next call, so alive after a test on purpose)."""
    return {p.pid for ranks in _POOL.values() for p in ranks.procs if p.pid is not None}


@atexit.register
def _stop_all() -> None:
    while _POOL:
        _POOL.popitem()[1].stop()


def run_distributed(fn: Callable, world_size: int, args: Sequence = (), timeout_s: float = 300.0, fresh: bool = False) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` gloo processes; return results by rank.

    fn must be importable (a module-level function); it and `args` are pickled, and it must return
    something picklable. The ranks are the session's pooled processes of this world size (spawned
    on first use); fresh=True spawns new ones for this call and stops them after it.
    Raises RuntimeError: a rank raised (message has its traceback) or a rank gave no result
    within `timeout_s` seconds; the ranks are killed either way (also on any exception in this
    process, such as pytest-timeout's).
    """
    ranks = _POOL.pop(world_size, None)
    if ranks is not None and (fresh or not ranks.alive()):
        ranks.stop(graceful=ranks.alive())
        ranks = None
    ranks = ranks or _Ranks(world_size)
    try:
        out = ranks.run(fn, args, timeout_s)
    except BaseException:
        ranks.stop(graceful=False)  # peers of a failed rank may wait in a collective forever
        raise
    if fresh:
        ranks.stop()
    else:
        _POOL[world_size] = ranks
    return out
