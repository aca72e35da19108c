"""A run's processes from /proc (Linux): the fault-injection tests and benchmarks find the Ray worker
processes of a driver they started, to kill or stop one."""

from __future__ import annotations

import os
from pathlib import Path


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


def worker_shells(pid: int) -> list[int]:
    """The ray::WorkerShell processes below driver `pid` (a local Ray instance is the driver's child,
    its workers the raylet's children), by pid: the group started first comes first."""
    return sorted(p for p in descendants(pid) if cmdline(p).startswith("ray::WorkerShell"))
