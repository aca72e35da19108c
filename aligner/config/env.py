"""The environment section (``env.*``, docs/environments.md): which environment plays a prompt's episode,
for how many model turns, with which tools and how long each environment call may take.

``env.name=""`` (the default) keeps today's single-turn rollout; a name makes every prompt of the PPO
stage an episode, played by the rollout engine (aligner.workers.episodes) and trained with the
observations masked (aligner.trainers.ppo); what a run with episodes needs of the other sections is
checked by aligner.config.validation.validate_episodes. The names are checked against ENV_NAMES and
TOOL_NAMES (aligner.config.common), which list the registries of aligner.envs (a package above the
config, so it is not imported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aligner.config.agent import AGENT_ENV
from aligner.config.common import ENV_NAMES, TOOL_NAMES, _check


@dataclass(kw_only=True)
class EnvConfig:
    """A multi-turn environment (aligner.envs): its name, turn limit, per-call timeout and tools."""

    name: str = ""  # "" = single-turn (today's rollout) | single_turn | retry | tool (aligner.envs.ENVIRONMENTS) | agent (agent.*)
    max_turns: int = 4  # the most model turns of an episode (>= 1)
    step_timeout_s: float = 30.0  # wall-clock limit of each environment call (reset, step, finish), seconds
    step_workers: int = 4  # threads that step environments while the engine decodes the other rows (0: on the engine's thread, in turn)
    tools: list[str] = field(default_factory=list)  # env.name=tool: the tools the model may call (aligner.envs.TOOLS)

    def validate(self, prefix: str = "env") -> None:
        valid = f'valid environments are {", ".join(ENV_NAMES + (AGENT_ENV,))}, or "" for today\'s single-turn rollout'
        _check(self.name in ("", AGENT_ENV) + ENV_NAMES, f"{prefix}.name", self.name, valid)
        _check(self.max_turns >= 1, f"{prefix}.max_turns", self.max_turns, "must be >= 1 (model turns per episode)")
        _check(self.step_timeout_s > 0, f"{prefix}.step_timeout_s", self.step_timeout_s, "must be > 0 seconds")
        _check(
            self.step_workers >= 0, f"{prefix}.step_workers", self.step_workers, "must be >= 0 threads (0: steps on the engine's thread)"
        )
        unknown = [t for t in self.tools if t not in TOOL_NAMES]
        _check(not unknown, f"{prefix}.tools", list(self.tools), f"unknown tools {unknown}: valid tools are {', '.join(TOOL_NAMES)}")
        _check(len(set(self.tools)) == len(self.tools), f"{prefix}.tools", list(self.tools), "name each tool once")
        _check(
            bool(self.tools) == (self.name == "tool"),
            f"{prefix}.tools",
            list(self.tools),
            f"{prefix}.name=tool needs at least one tool (e.g. {prefix}.tools=[calculator]); other environments take none",
        )
