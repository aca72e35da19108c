"""Run a function on N gloo ranks (torch.multiprocessing spawn) and collect per-rank results.

Owns the test harness every multi-process test reuses. One spawn costs ~8 s (each child
imports torch), so run a whole battery of checks in one call and return their results:

    def battery(rank, world_size, arg):      # module-level (picklable) function
        ...                                   # process group is up: gloo on 127.0.0.1
        return {"check": value}               # anything picklable

    results = run_distributed(battery, world_size=4, args=(arg,))   # [result of rank 0, 1, ...]

A child's exception is re-raised in the parent as RuntimeError with the rank and the
child's traceback. Children get OMP_NUM_THREADS=1 and RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT / LOCAL_RANK set, so code reading the environment (ParallelDims.from_env) works.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: Sequence, results) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # report every failure to the parent, whatever it is
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, args: Sequence = (), timeout_s: float = 300.0) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` gloo processes; return results by rank.

    fn must be importable (a module-level function) and return something picklable.
    Raises RuntimeError: a rank raised (message has its traceback) or exited without a result
    within `timeout_s` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, tuple(args), results), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors = []
    try:
        while len(got) + len(errors) < world_size:
            try:
                rank, ok, out = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(got) - {e[0] for e in errors})
                raise RuntimeError(f"run_distributed: ranks {missing} gave no result within {timeout_s} s") from None
            if ok:
                got[rank] = out
            else:
                errors.append((rank, out))
                break  # peers of a failed rank may hang in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        rank, tb = errors[0]
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
    return [got[r] for r in range(world_size)]
