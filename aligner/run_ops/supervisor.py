"""The driver's supervisor: a parent process that outlives a driver which Ray ends itself.

Why it exists (docs/reliability.md, "SIGTERM"). When a scheduler signals every process of a
job (Slurm's ``scancel``, a Ray head pod's shutdown), the raylet of the local Ray instance ends
too. Ray's core worker inside the driver connects to the raylet's object store with
``exit_on_connection_failure=true`` (``CoreWorker``'s plasma client), so the driver's next
object-store read or write after that fails in ``plasma::StoreConn::ExitIfErrorStatus``, which
calls ``ray::QuickExit()``: ``_Exit(1)``. No Python handler, ``atexit`` hook or thread of the
driver runs after it, so the driver cannot turn that into aligner's preemption contract (exit
143, one line, the last complete checkpoint named). Whether it happens depends on which of the
driver's handler and the raylet's shutdown wins: about half of the full-suite runs of the
every-process SIGTERM test did.

The fix is outside the process Ray can end: ``python -m aligner.<stage>`` forks before anything
else (:func:`fork`); the child is the driver and runs the stage as before, the parent imports
no Ray and only

- forwards SIGTERM, SIGINT and SIGHUP to the child (a scheduler that signals only the job's
  first process still reaches the driver, whose own handler saves at the step boundary);
- waits for the child and returns its exit code, except that a child which ends in any other
  way than 0, 2 or 143 after a SIGTERM reached either process is reported as the preemption it
  was: one line naming the signal, the child's own exit and the last complete checkpoint, and
  exit 143 (torchrun's elastic agent and Slurm's ``srun`` supervise their workers the same way);
- names a child killed by a signal nobody forwarded (the OOM killer's SIGKILL) in one line;
- is the child's subreaper (``PR_SET_CHILD_SUBREAPER``) and, once the child has ended, SIGKILLs
  the processes it left (a local Ray instance whose driver was ended by ``_Exit``), so no raylet
  or worker outlives the run.

The child dies with the parent (``PR_SET_PDEATHSIG`` = SIGKILL): a scheduler's SIGKILL of the
parent ends the driver as it did before the supervisor existed. In-process callers
(``aligner.sft.main([...])``, the tests, the demo) are not supervised; ``ALIGNER_SUPERVISOR=0``
turns it off on the command line too (a debugger or ``py-spy`` attached to the driver).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from aligner.run_ops import preemption

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # linux/prctl.h
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PREEMPTED = preemption.EXIT_CODE  # 143
CLEAN_EXITS = (0, 2, PREEMPTED)  # done, bad input, preempted at a step boundary: the child said why
_SUPERVISOR_PID: Optional[int] = None  # in a supervised driver: its parent's pid


def run_pid() -> int:
    """The pid that stands for this run: the supervisor's in a supervised driver (the process a user
    or scheduler started and signals), else this process's. Lock files and messages name it."""
    return _SUPERVISOR_PID if _SUPERVISOR_PID is not None else os.getpid()


def enabled(argv: Optional[Sequence[str]]) -> bool:
    """Whether this call of an entry point supervises itself: only on the command line (`argv`
    None, i.e. ``python -m aligner.<stage>``), on Linux, unless ``ALIGNER_SUPERVISOR=0``."""
    return argv is None and sys.platform.startswith("linux") and os.environ.get("ALIGNER_SUPERVISOR", "1") != "0"


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


def fork(stage: str, output_dir_of: Callable[[], Optional[str]]) -> Optional[int]:
    """Split into supervisor and driver. Returns None in the child (the driver: go on with the
    run), the exit code in the parent once the child has ended.

    Args:
        stage: the entry point's stage (sft, rm, ppo, dpo, plan), for the one-line messages.
        output_dir_of: called by the parent after the child has ended: the run's output_dir, or
            None when the command line does not give a valid config; the line after a
            preemption names its newest complete checkpoint.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    pid = os.fork()
    if pid == 0:
        global _SUPERVISOR_PID
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(PREEMPTED)
        _SUPERVISOR_PID = parent
        return None
    return _supervise(stage, pid, output_dir_of)


def _supervise(stage: str, child: int, output_dir_of: Callable[[], Optional[str]]) -> int:
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    _, status = os.waitpid(child, 0)  # PEP 475: retried after each forwarded signal
    code = os.waitstatus_to_exitcode(status)
    for sig in FORWARDED:  # from here on a signal ends the supervisor as it would any process
        signal.signal(sig, signal.SIG_DFL)
    preemption.kill_descendants()  # what the driver left, re-parented to this subreaper
    sigterm = signal.SIGTERM in received or code == -signal.SIGTERM
    if code in CLEAN_EXITS:
        return code
    if sigterm:
        how = f"was ended by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
        print(
            f"aligner {stage}: stopped by SIGTERM: the driver (pid {child}) {how} before the step finished (a scheduler "
            f"signalled the run's Ray processes too, and Ray ends a driver whose object store is gone); "
            f"{_last_checkpoint(output_dir_of)}: rerun with resume=true",
            file=sys.stderr,
            flush=True,
        )
        return PREEMPTED
    if code < 0:
        name = signal.Signals(-code).name
        why = " (the kernel's OOM killer sends SIGKILL: see `dmesg`)" if -code == signal.SIGKILL else ""
        print(
            f"aligner {stage}: error: the driver (pid {child}) was killed by {name}{why}; "
            f"{_last_checkpoint(output_dir_of)}: rerun with resume=true",
            file=sys.stderr,
            flush=True,
        )
        return 128 - code
    return code


def _last_checkpoint(output_dir_of: Callable[[], Optional[str]]) -> str:
    """Where the run stands: the newest complete checkpoint (read without changing anything)."""
    from aligner.run_ops.checkpointing import latest_checkpoint

    try:
        out = output_dir_of()
        latest = latest_checkpoint(Path(out) / "checkpoints") if out else None
    except Exception:  # noqa: BLE001 - the message goes on without the checkpoint's name
        latest = None
    if latest is None:
        return "no complete checkpoint is in output_dir (saves are atomic: nothing half-written counts)"
    return f"the newest complete checkpoint, {latest}, is intact (saves are atomic)"
