"""Running the user's agent program against the OpenAI-compatible endpoint (docs/agents.md).

:func:`run_agents` starts the agent command once per task, at most ``parallel`` at a time, each in its
own process group with the endpoint in its environment:

- ``OPENAI_BASE_URL`` (the endpoint's ``/v1`` URL) and ``OPENAI_API_KEY`` (the run's token), which the
  ``openai`` client reads by itself;
- ``ALIGNER_EPISODE_ID`` (send it as the ``X-Episode-Id`` header or ``user`` on every call),
  ``ALIGNER_MODEL`` (the served model name), ``ALIGNER_PROMPT`` (the task's prompt text) and
  ``ALIGNER_METADATA`` (its data row's metadata, JSON).

The episode's reward is the one the agent reports (``POST /v1/episodes/{id}/reward``), else
``reward_fn(prompt, final completion text, metadata)`` when given (a rule's signature, as
:class:`aligner.envs.base.EnvSpec` takes). An agent that exits non-zero, runs past ``deadline_s``
(its process group is killed), makes no call, or ends without a reward when there is no
``reward_fn`` is dropped: its records are discarded and the episode is counted with the reason (for a
non-zero exit: the code and the last line of its output, with a traceback's innermost file:line; the
``aligner.agent`` logger warns with the last 20 lines of its stdout and stderr). More
than ``max_dropped_frac`` of the tasks dropped raises :class:`AgentRunError` (one line).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from aligner.rollout.agent.record import AgentSample

RewardFn = Callable[[str, str, dict], float]
logger = logging.getLogger("aligner.agent")


class AgentRunError(RuntimeError):
    """Too many agent episodes of one batch were dropped; the message says how many and the first reason."""


@dataclass
class AgentEpisode:
    """One run of the agent on one task.

    episode_id: the id the agent was given. index: the task's index. samples: its training samples
    (:func:`aligner.rollout.agent.record.build_samples`; [] when dropped). reward: the episode's reward
    (None when dropped); reward_source: "agent" (reported) or "rule" (``reward_fn``). dropped / reason:
    whether and why it was dropped (one line). returncode: the process's exit code (None if killed at
    the deadline). seconds: wall time of the process. calls: endpoint calls recorded.
    """

    episode_id: str
    index: int
    samples: list[AgentSample] = field(default_factory=list)
    reward: Optional[float] = None
    reward_source: str = ""
    dropped: bool = False
    reason: str = ""
    returncode: Optional[int] = None
    seconds: float = 0.0
    calls: int = 0


def agent_argv(command: Union[str, Sequence[str]], field_name: str = "agent.command") -> list[str]:
    """The command as argv (a string is split as a shell would, without running a shell).

    Raises ValueError naming `field_name`, the command and the fix when it is empty or its program is
    neither on PATH nor an executable file."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise ValueError(f"{field_name} is empty: give the agent's command, e.g. {field_name}='python examples/calculator_agent.py'")
    prog = argv[0]
    if shutil.which(prog) is None and not (os.path.isfile(prog) and os.access(prog, os.X_OK)):
        raise ValueError(f"{field_name}={' '.join(argv)!r} is invalid: the program {prog!r} is not on PATH nor an executable file")
    return argv


def run_agents(
    endpoint,
    command: Union[str, Sequence[str]],
    tasks: Sequence[tuple[str, dict]],
    *,
    parallel: int = 8,
    deadline_s: float = 300.0,
    max_dropped_frac: float = 0.5,
    reward_fn: Optional[RewardFn] = None,
    env: Optional[dict] = None,
    field_name: str = "agent.command",
    use_reported: bool = True,
) -> list[AgentEpisode]:
    """Run the agent once per task (prompt text, metadata) against `endpoint` (a started
    :class:`aligner.rollout.agent.openai_server.OpenAIEndpoint`); the episodes in task order.

    parallel: agents running at once (>= 1). deadline_s: wall-clock limit per agent process, seconds.
    max_dropped_frac: the fraction of dropped episodes above which :class:`AgentRunError` is raised.
    env: extra environment variables for the agent. use_reported: False ignores the returns agents
    report (then `reward_fn` scores every episode). Raises ValueError for a bad command (before any
    agent starts) or bad limits."""
    argv = agent_argv(command, field_name)
    if parallel < 1 or not deadline_s > 0 or not 0 <= max_dropped_frac <= 1:
        raise ValueError(f"parallel={parallel} must be >= 1, deadline_s={deadline_s} > 0 and max_dropped_frac={max_dropped_frac} in [0, 1]")
    run = uuid.uuid4().hex[:8]
    episodes = [AgentEpisode(f"{run}-{i}", i) for i in range(len(tasks))]
    base_env = {
        **os.environ,
        **(env or {}),
        "OPENAI_BASE_URL": endpoint.url,
        "OPENAI_API_KEY": endpoint.http.token or "no-token",
        "ALIGNER_MODEL": endpoint.model_name,
    }
    pending = list(range(len(tasks)))
    running: dict[int, tuple[subprocess.Popen, float, object]] = {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                i = pending.pop(0)
                prompt, metadata = tasks[i]
                log = tempfile.TemporaryFile()
                proc = subprocess.Popen(
                    argv,
                    env={
                        **base_env,
                        "ALIGNER_EPISODE_ID": episodes[i].episode_id,
                        "ALIGNER_PROMPT": prompt,
                        "ALIGNER_METADATA": json.dumps(metadata),
                    },
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: the deadline kills its children too
                )
                running[i] = (proc, time.monotonic(), log)
            for i in list(running):
                proc, start, log = running[i]
                rc = proc.poll()
                late = rc is None and time.monotonic() - start > deadline_s
                if rc is None and not late:
                    continue
                ep = episodes[i]
                if late:
                    _kill(proc)
                    ep.dropped, ep.reason = True, f"ran past the deadline of {deadline_s:g} s and was killed"
                elif rc != 0:
                    lines = _output_lines(log)
                    ep.dropped, ep.reason = True, f"exited with code {rc}: {_last_line(lines)}"
                    logger.warning(
                        "agent episode %s %s; the last %d lines of its output (stdout and stderr):\n%s",
                        ep.episode_id,
                        ep.reason,
                        min(len(lines), 20),
                        "\n".join(lines[-20:]) or "(none)",
                    )
                ep.returncode, ep.seconds = (None if late else rc), time.monotonic() - start
                log.close()
                del running[i]
                _finish(endpoint, ep, tasks[i], reward_fn, use_reported)
            if running:
                time.sleep(0.02)
    finally:
        for proc, _, log in running.values():
            _kill(proc)
            log.close()
    dropped = [e for e in episodes if e.dropped]
    if episodes and len(dropped) > max_dropped_frac * len(episodes):
        first = dropped[0]
        raise AgentRunError(
            f"{len(dropped)} of {len(episodes)} agent episodes were dropped, over agent.max_dropped_frac={max_dropped_frac:g}; "
            f"the first: {' '.join(argv)!r} episode {first.episode_id}: {first.reason}"
        )
    return episodes


def _finish(endpoint, ep: AgentEpisode, task: tuple[str, dict], reward_fn: Optional[RewardFn], use_reported: bool = True) -> None:
    """Take the episode's records and its reward; drop it when it made no call or has no reward."""
    records = endpoint.recorder.records(ep.episode_id)
    reported = endpoint.recorder.reward(ep.episode_id) if use_reported else None
    samples = endpoint.take_samples(ep.episode_id)
    ep.calls = len(records)
    if ep.dropped:
        return
    if not records:
        ep.dropped, ep.reason = True, "made no call to the endpoint with its episode id"
        return
    if reported is not None:
        ep.reward, ep.reward_source = reported, "agent"
    elif reward_fn is not None:
        last = records[-1]
        text = endpoint.tok.decode(last.completion_ids, skip_special_tokens=True)
        r = float(reward_fn(task[0], text, task[1]))
        if not math.isfinite(r):
            ep.dropped, ep.reason = True, f"the reward function returned {r}"
            return
        ep.reward, ep.reward_source = r, "rule"
    else:
        ep.dropped, ep.reason = True, "never reported its reward (POST /v1/episodes/{id}/reward) and no reward function is set"
        return
    ep.samples = samples


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _output_lines(log, limit: int = 16384) -> list[str]:
    """The non-empty lines of the last `limit` bytes of the agent's output (stdout and stderr together)."""
    log.seek(0, os.SEEK_END)
    size = log.tell()
    log.seek(max(0, size - limit))
    return [ln.rstrip() for ln in log.read().decode("utf-8", "replace").splitlines() if ln.strip()]


def _last_line(lines: list[str]) -> str:
    """One line for the drop reason: the output's last non-empty line (at most 300 characters), with the
    innermost frame's file:line when the output holds a Python traceback ("KeyError: 'x' (at agent.py:12)"; the
    innermost frame outside the standard library and site-packages when there is one);
    "(no output on stdout or stderr)" when the agent wrote nothing."""
    if not lines:
        return "(no output on stdout or stderr)"
    last = lines[-1].strip()[:300]
    if any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        frames = [m for m in (_FRAME.match(ln) for ln in lines) if m]
        own = [m for m in frames if not m["file"].startswith("<") and not _LIBRARY.search(m["file"])]  # the agent's code
        if own or frames:
            at = (own or frames)[-1]
            return f"{last} (at {at['file']}:{at['line']})"
    return last


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
_LIBRARY = re.compile(r"[/\\]lib[/\\]python[0-9.]*[/\\]")  # the standard library and site-packages
