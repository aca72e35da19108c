"""Episodes on a worker's engine (docs/environments.md): the environment of ``env.*`` played turn by turn
by the rollout engine of the actor (colocated) or of the rollout group (split placement).

The environments run in the worker that generates, between the engine's decode steps
(:class:`aligner.envs.episodes.TokenEpisodes` is the engine's ``turn_end`` callback): a fast
environment (the calculator) costs microseconds a turn; a slow one holds that engine's batch while it
runs, up to ``env.step_timeout_s``. Each Generation carries its :class:`~aligner.envs.base.Episode`
in ``extra["episode"]`` (the trajectory, per-turn and final rewards, how it ended, its counts) and
its ``own_mask`` (the model's tokens), which the trainer turns into the loss mask and the scores.
"""

from __future__ import annotations

from typing import Sequence

from aligner.config import AlignerConfig
from aligner.config.agent import AGENT_ENV
from aligner.envs import EnvSpec, make_env
from aligner.envs.episodes import TokenEpisodes
from aligner.reward.rules import get_rule
from aligner.rollout.base import Generation
from aligner.workers.agent_episodes import generate_agent_episodes


def generate_episodes(
    engine, cfg: AlignerConfig, tokenizer, prompt_ids: list, sampling, seeds, rows: Sequence[tuple[str, dict]]
) -> list[Generation]:
    """One episode of ``cfg.env.name`` per prompt on `engine` (a TorchEngine, continuous scheduler).

    prompt_ids: B prompts' token ids; rows: their (prompt text, metadata), in the same order;
    seeds: B sampling seeds or None. The final reward is ``reward.rule`` on the episode (through the
    environment's ``finish``). Returns B Generations with ``own_mask`` and ``extra["episode"]``.
    Raises what the engine's generate raises; an environment's own failures fail its episode only.
    env.name=agent: the episodes are the agent program's (:mod:`aligner.workers.agent_episodes`)."""
    if cfg.env.name == AGENT_ENV:
        return generate_agent_episodes(engine, cfg, tokenizer, prompt_ids, sampling, seeds, rows)
    spec = EnvSpec(reward_fn=get_rule(cfg.reward.rule), tools=tuple(cfg.env.tools), chat_template=tokenizer.chat_template or "")
    episodes = TokenEpisodes(
        lambda: make_env(cfg.env.name, spec),
        tokenizer,
        rows,
        max_turns=cfg.env.max_turns,
        timeout_s=cfg.env.step_timeout_s,
        stop_ids=engine.stop_ids(sampling),
        step_workers=cfg.env.step_workers,
    )
    try:
        gens = engine.generate(prompt_ids, sampling, seeds=seeds, turn_end=episodes)
    finally:
        episodes.close()
    for g, ep in zip(gens, episodes.episodes):
        g.extra["episode"] = ep
    return gens
