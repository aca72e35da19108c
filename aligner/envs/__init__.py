"""Environments for multi-turn and agentic RL (issue 38 part 1): the interface and trajectory types
(:mod:`~aligner.envs.base`), the tool registry with the built-in calculator (:mod:`~aligner.envs.tools`)
and the tool-calling environment (:mod:`~aligner.envs.tool_env`). docs/environments.md says what
exists and what is not built yet: the engine and the trainer do not run episodes yet (issue 38 parts 2-3).
"""

from __future__ import annotations

from aligner.envs.base import (
    ENVIRONMENTS,
    Environment,
    EnvSpec,
    Episode,
    Message,
    StepResult,
    Turn,
    episode_metrics,
    get_env,
    make_env,
    register_env,
    run_episode,
    run_episodes,
)
from aligner.envs.tool_env import ToolCall, ToolEnv, parse_tool_calls, template_defines_tool_calls, tool_instructions
from aligner.envs.tools import TOOLS, Tool, calculate, get_tool, make_tool, register_tool

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "EnvSpec",
    "Episode",
    "Message",
    "StepResult",
    "Turn",
    "episode_metrics",
    "get_env",
    "make_env",
    "register_env",
    "run_episode",
    "run_episodes",
    "ToolCall",
    "ToolEnv",
    "parse_tool_calls",
    "template_defines_tool_calls",
    "tool_instructions",
    "TOOLS",
    "Tool",
    "calculate",
    "get_tool",
    "make_tool",
    "register_tool",
]
