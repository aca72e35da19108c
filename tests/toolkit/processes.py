"""A run's processes from /proc (Linux): the fault-injection tests and benchmarks find the Ray worker
processes of a driver they started, to kill or stop one; tests/conftest.py finds and ends the
processes a test left running (:func:`left_running`, :func:`end_trees`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterable


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    return _subtree(_children(), pid)


def cmdline(pid: int) -> str:
    """The command line of `pid` ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def alive_after(pids: Iterable[int], seconds: float, poll_s: float = 0.1) -> list[int]:
    """The processes of `pids` still alive `seconds` from now; returns [] as soon as none is (a fixed
    wait of `seconds` would check the same thing later)."""
    pids = list(pids)
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(poll_s)


def worker_shells(pid: int) -> list[int]:
    """The ray::WorkerShell processes below driver `pid` (a local Ray instance is the driver's child,
    its workers the raylet's children), by pid: the group started first comes first."""
    return sorted(p for p in descendants(pid) if cmdline(p).startswith("ray::WorkerShell"))


# Processes a test may start and leave running on purpose, shared by the later tests of the session:
# the session's Ray instance (its raylet / gcs_server / dashboard / workers), multiprocessing's resource
# tracker and forkserver, inductor's compile-worker pool, W&B's service (one per process).
SHARED_SERVICES = ("/ray/", "ray::", "raylet", "gcs_server", "resource_tracker", "forkserver", "compile_worker", "wandb")


def left_running(root: int, before: set[int], keep: Callable[[int], bool]) -> list[int]:
    """The living processes below `root` that a test left: every process not in `before` (the tree
    when the test began) and not kept (``keep(pid)``: a shared service, a pooled rank), with its
    whole subtree. The subtrees of processes in `before` or kept are not searched (a Ray worker
    the raylet started belongs to Ray). Roots first, each followed by its descendants."""
    kids, out = _children(), []
    todo = list(kids.get(root, []))
    while todo:
        pid = todo.pop(0)
        if pid in before or keep(pid) or not alive(pid):
            continue
        out += [q for q in (pid, *_subtree(kids, pid)) if alive(q)]
    return out


def _subtree(kids: dict[int, list[int]], pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def end_trees(pids: Iterable[int], grace_s: float = 10.0) -> list[int]:
    """SIGKILL each of `pids` (and its process group where it leads one); returns those still alive
    `grace_s` later (a process in uninterruptible sleep), [] once all are gone."""
    pids = list(pids)
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:  # a group leader (a spawned rank): what it started goes with it
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return alive_after(pids, grace_s)


def is_shared_service(pid: int) -> bool:
    """True for a process of :data:`SHARED_SERVICES` (by its command line)."""
    line = cmdline(pid)
    return any(s in line for s in SHARED_SERVICES)
