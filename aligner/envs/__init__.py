"""Environments for multi-turn and agentic RL (docs/environments.md): the interface and trajectory types
(:mod:`~aligner.envs.base`), the tool registry with the built-in calculator (:mod:`~aligner.envs.tools`),
the tool-calling and retry environments (:mod:`~aligner.envs.tool_env`, :mod:`~aligner.envs.retry_env`)
and the token-level episodes the rollout engine plays (:mod:`~aligner.envs.episodes`, the engine's
``turn_end`` callback). docs/environments.md is the guide.
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
from aligner.envs.episodes import TokenEpisodes
from aligner.envs.retry_env import RetryEnv
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
    "TokenEpisodes",
    "RetryEnv",
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
