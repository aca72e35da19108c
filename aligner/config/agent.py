"""The agent section (``agent.*``, docs/agents.md): the user's agent program that plays each prompt's
episode through the OpenAI-compatible endpoint over the rollout engine (``env.name=agent``).

The engine's worker starts the endpoint and runs ``agent.command`` once per prompt sample
(``trainer.n_samples_per_prompt`` episodes per prompt), at most ``agent.parallel`` at a time per engine
replica, with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` set (aligner.workers.agent_episodes). The names
follow what users of verl's agent loop and OpenRLHF's agent executor set: a command, a concurrency, a
per-episode timeout and a tolerated failure fraction. :func:`aligner.config.validation.validate_agent` checks them with the
sections they depend on before any worker starts.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
from dataclasses import dataclass

from aligner.config.common import _check, _choice

AGENT_ENV = "agent"  # env.name of episodes played by an agent program (not an aligner.envs environment)
AGENT_REWARDS = ("agent", "rule")


@dataclass(kw_only=True)
class AgentConfig:
    """An agent program trained through the OpenAI-compatible endpoint (``env.name=agent``)."""

    command: str = ""  # the agent's command line, split as a shell would (no shell runs), e.g. "python examples/calculator_agent.py"
    parallel: int = 8  # agent processes running at once per engine replica (>= 1)
    deadline_s: float = 300.0  # wall-clock limit of one agent process, seconds; past it its process group is killed and the episode dropped
    max_dropped_frac: float = 0.5  # a batch share with more dropped episodes than this fraction stops the run (one line); in [0, 1)
    # agent: the return the agent reports (POST /v1/episodes/{id}/reward; an episode without a report is dropped);
    # rule: reward.rule on the final completion's text (reports are ignored)
    reward: str = "agent"
    teach_tools: bool = True  # write the request's tools into the system message when the chat template defines no tool calls
    model_name: str = "aligner-policy"  # the model name the endpoint serves (requests must name it)
    host: str = "127.0.0.1"  # the endpoint's bind address (every run has its own token, which the agents get in OPENAI_API_KEY)
    request_timeout_s: float = 600.0  # how long one call waits for the engine before a 503

    def validate(self, prefix: str = "agent") -> None:
        """The section's own fields (ConfigError naming the field)."""
        _check(self.parallel >= 1, f"{prefix}.parallel", self.parallel, "must be >= 1 agent processes at once")
        _check(math.isfinite(self.deadline_s) and self.deadline_s > 0, f"{prefix}.deadline_s", self.deadline_s, "must be > 0 seconds")
        _check(
            0 <= self.max_dropped_frac < 1,
            f"{prefix}.max_dropped_frac",
            self.max_dropped_frac,
            "must be in [0, 1): the fraction of a batch's episodes that may be dropped before the run stops",
        )
        _choice(f"{prefix}.reward", self.reward, AGENT_REWARDS)
        _check(bool(self.model_name.strip()), f"{prefix}.model_name", self.model_name, "give the served model's name, e.g. aligner-policy")
        _check(bool(self.host.strip()), f"{prefix}.host", self.host, "give a bind address, e.g. 127.0.0.1")
        _check(self.request_timeout_s > 0, f"{prefix}.request_timeout_s", self.request_timeout_s, "must be > 0 seconds")
        if self.command:
            check_command(self.command, f"{prefix}.command")


def check_command(command: str, field_name: str = "agent.command") -> list[str]:
    """The command as argv; ConfigError naming `field_name` when it does not parse, is empty or its
    program is neither on PATH nor an executable file (as :func:`aligner.rollout.agent.runner.agent_argv`,
    whose package sits above the config)."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        _check(False, field_name, command, f"it does not parse as a command line ({e}): quote it as a shell would")
    _check(bool(argv), field_name, command, f"give the agent's command, e.g. {field_name}='python examples/calculator_agent.py'")
    prog = argv[0]
    _check(
        shutil.which(prog) is not None or (os.path.isfile(prog) and os.access(prog, os.X_OK)),
        field_name,
        command,
        f"the program {prog!r} is not on PATH nor an executable file: give its path or install it",
    )
    script = next((x for x in argv[1:] if not x.startswith("-")), "") if os.path.basename(prog).startswith("python") else ""
    if script.endswith(".py") and "-c" not in argv and "-m" not in argv:
        _check(
            os.path.isfile(script),
            field_name,
            command,
            f"the script {script!r} does not exist (paths are relative to the directory the run starts in)",
        )
    return argv
