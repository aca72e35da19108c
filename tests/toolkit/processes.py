"""A run's processes from /proc (Linux): the fault-injection tests and benchmarks find the Ray worker
processes of a driver they started, to kill or stop one."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable


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
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


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
