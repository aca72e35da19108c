"""Every exception type aligner raises on purpose, in one module.

Each message is meant for the user as is: it names the file:line or config field, the bad
value and the fix (ConfigError, RowError, CheckpointError, PlanError, PlacementError), or the
role, rank and method of a failed worker (WorkerError). The entry points
(:func:`aligner.cli.run`) print the input errors as one line and exit 2.

Hierarchy: the input errors are ``ValueError`` subclasses, so library callers that catch
ValueError keep working; UserError is the driver's catch-all for bad input found while a run
starts; Preempted ends a run at a step boundary after SIGTERM.
"""

from __future__ import annotations

import errno
from typing import Optional


class ConfigError(ValueError):
    """A config value is invalid. The message names the field, the value and the fix."""


class UserError(Exception):
    """A problem with the user's input (data, checkpoint, cluster) that ends the run with a message."""


class RowError(ValueError):
    """One invalid data row; the message is "<file>:<line>: <what>: <fix>"."""


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupted or does not match the model. The message says which file."""


class PlanError(ValueError):
    """No layout fits (or a configured layout does not fit); the message says what is missing."""


class PlacementError(ValueError):
    """The cluster cannot hold what the roles ask; the message says what was asked and what exists."""


class WorkerError(RuntimeError):
    """A worker of a group failed: its role, rank, the method and the worker's traceback.

    ``disk_full`` is the path whose write failed with "No space left on device" when that
    is what ended the call ("" otherwise), so the driver can say so in one line.
    """

    def __init__(self, role: str, rank: int, traceback_text: str, method: str = "", disk_full: str = "") -> None:
        self.role, self.rank, self.traceback_text, self.method = role, rank, traceback_text, method
        self.disk_full = disk_full
        where = f" in {method}()" if method else ""
        super().__init__(f"{role} rank {rank} failed{where}:\n{traceback_text}")

    def __reduce__(self):
        return (type(self), (self.role, self.rank, self.traceback_text, self.method, self.disk_full))


class WorkerDiedError(WorkerError):
    """A worker process of a group died (killed, crashed, out of memory)."""


class WorkerHungError(WorkerDiedError):
    """A worker made no progress in a call for ``trainer.hang_timeout_s`` (a stalled process, a peer lost
    in a collective, an engine that stopped producing): handled as a death, so the automatic restart
    heals it; the message carries the worker's Python stack where the driver can read it."""


class ToolSchemaError(ValueError):
    """A tool's JSON schema for its arguments is invalid (found when the tool is registered); the message names the tool and the fix."""


class ToolCallError(ValueError):
    """One tool call the model made cannot run (unknown tool, arguments failing the schema, a bad
    expression): the message is what the model reads in its error observation (aligner.envs.tool_env)."""


class Preempted(Exception):
    """The run stopped at a step boundary after SIGTERM; the message says what was saved."""


def disk_full_path(exc: BaseException) -> Optional[str]:
    """The path of a "No space left on device" (ENOSPC) error in `exc` or its causes; None when
    there is none ("?" when the error names no path)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, WorkerError) and exc.disk_full:
            return exc.disk_full
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return str(exc.filename) if exc.filename else "?"
        exc = exc.__cause__ or exc.__context__
    return None
