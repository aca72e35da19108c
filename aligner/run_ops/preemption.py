"""Preemption: SIGTERM ends a run at a step boundary with a checkpoint, within a bounded time.

Slurm, Kubernetes and Ray (job stop) send SIGTERM before they kill. The driver's handler
(:func:`install`, called after Ray is up, since Ray's own failure handler would otherwise
turn SIGTERM into a crash dump) only records the request and starts a watchdog. The
training loop checks :func:`requested` after every step: it writes a checkpoint when the
last complete one is older than the step just finished and raises :class:`Preempted`,
which the entry point prints as one line and turns into exit code 143 (128 + SIGTERM),
after the worker groups and Ray are shut down and the output_dir lock is released.

If the current step and that checkpoint have not finished ``trainer.preempt_grace_s``
seconds after the signal (set it a few seconds below the scheduler's grace period:
Kubernetes ``terminationGracePeriodSeconds``, Slurm ``KillWait``, both 30 s by default), the
watchdog prints one line and exits 143 at once: the step is abandoned, and a checkpoint save
in flight is abandoned too (saves are atomic: the last complete checkpoint stays intact).
A second SIGTERM changes nothing; SIGKILL is what ends the process early.

A scheduler signals every process of the job, so after SIGTERM Ray's workers and raylet end
under the driver, and Ray's own code in the driver may log an error with a traceback while it
reads their deaths (Ray 2.60 logs an ``AssertionError`` from ``serialization.py`` when an actor's
death record is incomplete). From the signal on, such records from Ray's loggers (``ray.*``) are
printed as one line: the message and the exception's type and text, without the traceback. The
run's own line (which checkpoint is intact, rerun with resume=true) stays the last word.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from aligner.errors import Preempted

log = logging.getLogger("aligner")

EXIT_CODE = 128 + signal.SIGTERM  # 143: the shell's code for "ended by SIGTERM"


class _State:
    def __init__(self, stage: str, grace_s: float):
        self.stage, self.grace_s = stage, grace_s
        self.requested_at: Optional[float] = None
        self.done = threading.Event()
        self.previous = None


_STATE: Optional[_State] = None
_SIGTERM_SEEN = False  # SIGTERM arrived during this process's run (kept after uninstall, for the exit code)


def install(stage: str, grace_s: float) -> None:
    """Handle SIGTERM in this (driver) process for the rest of the run (see module docstring).

    Call from the main thread after Ray is initialized; :func:`uninstall` restores the
    previous handler.
    """
    global _STATE, _SIGTERM_SEEN
    _STATE = _State(stage, grace_s)
    _SIGTERM_SEEN = False  # a new run (in-process callers run several)
    _STATE.previous = signal.signal(signal.SIGTERM, _on_sigterm)


class RayTracebackToOneLine(logging.Filter):
    """A handler filter: a record from Ray's loggers (name ``ray`` or ``ray.*``) that carries an
    exception is rewritten in place to one line, ``<message> [<ExceptionType>: <text>; Ray's traceback
    not shown: the run was stopped by SIGTERM]``; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.name == "ray" or record.name.startswith("ray.")) and record.exc_info:
            exc = record.exc_info[1]
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            record.msg = f"{record.getMessage()} [{what}; Ray's traceback not shown: the run was stopped by SIGTERM]"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


_ONE_LINE = RayTracebackToOneLine()


def _ray_log_handlers() -> list:
    # Ray's "ray" logger prints through its own handler (propagate off); the root's, where Ray's config leaves
    # its records propagating
    return [*logging.getLogger("ray").handlers, *logging.getLogger().handlers]


def uninstall() -> None:
    """Restore the handler :func:`install` replaced and stop a running watchdog."""
    global _STATE
    if _STATE is None:
        return
    _STATE.done.set()
    signal.signal(signal.SIGTERM, _STATE.previous if _STATE.previous is not None else signal.SIG_DFL)
    for handler in _ray_log_handlers():
        handler.removeFilter(_ONE_LINE)
    _STATE = None


def requested() -> bool:
    """Whether SIGTERM has arrived since :func:`install`."""
    return _STATE is not None and _STATE.requested_at is not None


def was_requested() -> bool:
    """Whether SIGTERM arrived while the handler was installed, also after :func:`uninstall`: a worker
    that failed after it (a scheduler signals every process, and a Ray worker dies of it before the
    driver's step ends) ended a preempted run, not a broken one (the entry point exits 143)."""
    return _SIGTERM_SEEN


def stop_at_step_boundary(step: int, last_saved: int, save: Callable[[], object], where: str) -> None:
    """Called by a training loop after step `step`: when SIGTERM has arrived, save (unless the
    checkpoint of `step` exists, i.e. ``last_saved == step``) and raise :class:`Preempted`.

    Args:
        step: the step just finished (0 = before the first).
        last_saved: the step of the newest checkpoint this run wrote or resumed from (-1: none).
        save: writes the checkpoint of `step`.
        where: the checkpoints directory, for the message.
    """
    if not requested():
        return
    if step > max(last_saved, 0):
        save()
        what = f"saved the checkpoint of step {step} in {where}"
    elif step == 0 and last_saved < 0:
        what = "no step had finished, so there is nothing to save"
    else:
        what = f"the checkpoint of step {last_saved} in {where} is current"
    _STATE.done.set()
    secs = time.monotonic() - _STATE.requested_at
    raise Preempted(f"stopped by SIGTERM after step {step} ({secs:.1f} s after the signal): {what}; rerun with resume=true to continue")


def _on_sigterm(signum, frame) -> None:
    global _SIGTERM_SEEN
    state = _STATE
    if state is None or state.requested_at is not None:
        return
    _SIGTERM_SEEN = True
    state.requested_at = time.monotonic()
    for handler in _ray_log_handlers():  # Ray's processes end under the driver from now on (module docstring)
        handler.addFilter(_ONE_LINE)
    log.warning("SIGTERM: finishing the current step and writing a checkpoint (within trainer.preempt_grace_s=%g s)", state.grace_s)
    threading.Thread(target=_watchdog, args=(state,), name="aligner-preempt-watchdog", daemon=True).start()


def _watchdog(state: _State) -> None:
    if state.done.wait(state.grace_s):
        return
    print(
        f"aligner {state.stage}: error: stopped by SIGTERM: the current step and its checkpoint did not finish within "
        f"trainer.preempt_grace_s={state.grace_s:g} s, so both were abandoned; the last complete checkpoint in "
        "output_dir is intact: rerun with resume=true (raise trainer.preempt_grace_s if the scheduler allows)",
        file=sys.stderr,
        flush=True,
    )
    kill_descendants()
    os._exit(EXIT_CODE)


def kill_descendants() -> int:
    """SIGKILL every descendant process of this one; returns how many were signalled.

    The driver's descendants are the Ray instance it started (GCS, raylet, the role workers);
    a driver joined to an existing cluster has none of the cluster's processes below it.
    """
    import psutil  # a Ray dependency

    procs = psutil.Process().children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:  # already gone
            pass
    psutil.wait_procs(procs, timeout=5)
    return len(procs)
