"""Progress beats for the hang watchdog (``trainer.hang_timeout_s``).

A worker call is hung when it makes no progress for ``hang_timeout_s`` seconds, not when it runs
long: a generation phase of 1,024 samples on a shared CPU, or of long reasoning traces on a large
model, can take longer than any fixed limit while every decode step finishes. The loops that do a
call's work (the engines' decode steps, the actor's micro-batches) call :func:`beat`; the worker
shell (:class:`aligner.workers.group.WorkerShell`) installs a hook that restarts its watchdog's
countdown, so the watchdog fires only after ``hang_timeout_s`` seconds without a beat.

Outside a watched call (no hook installed: tests, single-process runs, the driver) :func:`beat`
is one global read. With a hook it reads the monotonic clock and calls the hook at most once per
``every_s`` seconds (the shell uses a tenth of the limit, at most 5 s), so a decode step costs
nanoseconds, not a thread restart.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

_hook: Optional[Callable[[], None]] = None
_every_s = 1.0
_last = 0.0
_lock = threading.Lock()


def beat() -> None:
    """Record that the call in flight made progress (one decode step, one micro-batch, ...).

    Safe from any thread of the process; a no-op when no watchdog is armed."""
    global _last
    hook = _hook
    if hook is None:
        return
    now = time.monotonic()
    if now - _last < _every_s:
        return
    with _lock:
        if now - _last < _every_s or _hook is not hook:
            return
        _last = now
        hook()


def install(hook: Callable[[], None], every_s: float) -> None:
    """Call `hook` (which restarts the watchdog's countdown) on a beat, at most once per `every_s` seconds.

    Raises ValueError for `every_s` <= 0."""
    global _hook, _every_s, _last
    if every_s <= 0:
        raise ValueError(f"every_s={every_s} is invalid: must be > 0 seconds")
    with _lock:
        _hook, _every_s, _last = hook, float(every_s), time.monotonic()


def uninstall() -> None:
    """Stop calling the hook (the watched call ended)."""
    global _hook
    with _lock:
        _hook = None
