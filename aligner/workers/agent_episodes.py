"""Agent episodes on a worker's engine (docs/agents.md): ``env.name=agent`` plays each prompt's episode
with the user's agent program through the OpenAI-compatible endpoint over the engine of the actor.

The endpoint (:class:`aligner.rollout.agent.openai_server.OpenAIEndpoint`) is started once per engine, in the
worker process that holds it, on a free loopback port (``agent.host``) with a per-run token. Each generate
call runs ``agent.command`` once per request (:func:`aligner.rollout.agent.runner.run_agents`, at most
``agent.parallel`` at a time), waits for the agents, and returns one Generation per request in the
shape :func:`aligner.workers.episodes.generate_episodes` returns:

- ``token_ids`` / ``rollout_log_probs`` / ``own_mask`` / ``token_versions``: the episode's recorded
  sample (:func:`aligner.rollout.agent.record.build_samples`): every completion as the engine sampled it
  and, between them, the tokens the agent added (masked: own_mask False, log-prob 0);
- ``extra["prompt_ids"]``: the prompt the engine read for the episode's first call (the agent renders its
  own conversation, so it may differ from the data row's prompt ids; the trainer builds the sequence
  from it);
- ``extra["episode"]``: an :class:`aligner.envs.base.Episode` (the model's turns and the agent's
  additions as text, the reward as ``final_reward``, counts ``tool_calls`` (Hermes calls in the model's
  turns), ``agent_calls`` (endpoint calls) and ``agent_segments_left_out``), so the trainer's rule
  scores, ``env/*`` metrics and the evaluation read it as they read an environment's episode.

An episode split into several segments (the agent edited its history; docs/agents.md, "What is
recorded") contributes its last segment, the one that holds the final answer; the others are counted in
``agent_segments_left_out``. A dropped episode (the agent crashed, hung past ``agent.deadline_s``, made no
call or never reported its reward) comes back as a one-token placeholder with ``extra["dropped"]`` (the
reason), which the trainer leaves out of the batch (:func:`aligner.trainers.agent_samples.without_dropped`)
and counts. More than ``agent.max_dropped_frac`` of a share dropped: every placeholder carries
``extra["agent_error"]`` (one line) and the trainer stops the run with it.

Sampling: the run's (``rollout.sampling``, or the evaluation's greedy one) applies to every call; what a
request sets for temperature, top_p and top_k is ignored, so the engine's log-probs are the ones the
trainer recomputes. Calls without a seed get a random one: a run with agents is not reproducible token for
token from ``trainer.seed``.
"""

from __future__ import annotations

import dataclasses
import secrets
import shlex
import sys
import weakref
from typing import Optional, Sequence

from aligner.config import AlignerConfig
from aligner.envs.base import Episode, Turn
from aligner.envs.tool_env import parse_tool_calls
from aligner.reward.rules import get_rule
from aligner.rollout.agent.openai_server import OpenAIEndpoint
from aligner.rollout.agent.runner import AgentEpisode, AgentRunError, run_agents
from aligner.rollout.base import Generation

_ENDPOINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its endpoint (one per engine, for the process's life)


def agent_command(command: str) -> list[str]:
    """``agent.command`` as argv; a command whose program is ``python`` or ``python3`` runs with this
    process's interpreter (``sys.executable``: the run's environment, where ``openai`` and aligner are)."""
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def endpoint_for(engine, cfg: AlignerConfig, tokenizer) -> OpenAIEndpoint:
    """The engine's endpoint, started on first use (a free port on ``agent.host``, a per-run token)."""
    ep = _ENDPOINTS.get(engine)
    if ep is None:
        a = cfg.agent
        ep = OpenAIEndpoint(
            engine,
            tokenizer,
            max_seq_len=cfg.model.max_seq_len,
            model_name=a.model_name,
            host=a.host,
            token=secrets.token_urlsafe(24),
            request_timeout_s=a.request_timeout_s,
            teach_tools=a.teach_tools,
            base_sampling=cfg.rollout.sampling,
        ).start()
        ep.fixed_sampling = True
        _ENDPOINTS[engine] = ep
    return ep


def generate_agent_episodes(
    engine, cfg: AlignerConfig, tokenizer, prompt_ids: list, sampling, seeds, rows: Sequence[tuple[str, dict]]
) -> list[Generation]:
    """One agent episode per request on `engine` (see the module docstring).

    prompt_ids: B prompts' ids (unused: each agent renders its own prompt); rows: their
    (prompt text, metadata); seeds: unused (the agents' calls are seeded per call by the endpoint).
    sampling: the engine sampling every call gets; its max_new_tokens is each call's default budget.
    Returns B Generations. Raises what the endpoint's start raises (OSError for a port)."""
    ep = endpoint_for(engine, cfg, tokenizer)
    ep.base_sampling = sampling
    ep.default_max_tokens = sampling.max_new_tokens
    reward_fn = get_rule(cfg.reward.rule) if cfg.agent.reward == "rule" else None
    a = cfg.agent
    try:
        episodes = run_agents(
            ep,
            agent_command(a.command),
            list(rows),
            parallel=a.parallel,
            deadline_s=a.deadline_s,
            max_dropped_frac=a.max_dropped_frac,
            reward_fn=reward_fn,
            use_reported=a.reward == "agent",
        )
    except AgentRunError as e:
        return [_placeholder(row, tokenizer, engine.weight_version, str(e), error=str(e)) for row in rows]
    return [_generation(e, row, tokenizer, engine.stop_ids(sampling), engine.weight_version) for e, row in zip(episodes, rows)]


def _generation(e: AgentEpisode, row: tuple[str, dict], tokenizer, stop_ids, version: int) -> Generation:
    """The episode's Generation: its last segment's sample with the Episode, or a dropped placeholder."""
    if e.dropped or not e.samples:
        return _placeholder(row, tokenizer, version, e.reason or "no sample was recorded")
    sample = max(e.samples, key=lambda s: max(s.generation.extra["records"]))  # the segment with the episode's last call
    g = sample.generation
    episode = _episode(g, row, tokenizer, frozenset(int(t) for t in stop_ids))
    episode.final_reward = float(e.reward)
    episode.counts.update({"agent_calls": float(e.calls), "agent_segments_left_out": float(len(e.samples) - 1)})
    extra = {**g.extra, "episode": episode, "prompt_ids": list(sample.prompt_ids), "agent_episode_id": e.episode_id}
    return dataclasses.replace(g, extra=extra)


def _episode(g: Generation, row: tuple[str, dict], tokenizer, stop_ids: frozenset) -> Episode:
    """The sample as an Episode: the model's completions (decoded without their stop token) and the
    agent's additions between them, in order; ``tool_calls`` counts the Hermes calls of the model's turns."""
    prompt, metadata = row
    ep = Episode(prompt=prompt, metadata=dict(metadata), turns=[Turn("user", prompt, own=False)], done=True)
    runs: list[tuple[bool, list[int]]] = []
    for t, own in zip(g.token_ids, g.own_mask):
        if runs and runs[-1][0] == own:
            runs[-1][1].append(t)
        else:
            runs.append((own, [t]))
    calls = 0
    for own, ids in runs:
        if own:
            text = tokenizer.decode(ids[:-1] if ids[-1] in stop_ids else ids, skip_special_tokens=True)
            calls += sum(not c.error for c in parse_tool_calls(text))
            ep.turns.append(Turn("assistant", text, own=True))
        else:
            ep.turns.append(Turn("user", tokenizer.decode(ids, skip_special_tokens=True), own=False))
    ep.counts["tool_calls"] = float(calls)
    return ep


def _placeholder(row: tuple[str, dict], tokenizer, version: int, reason: str, error: Optional[str] = None) -> Generation:
    """A dropped episode's stand-in: one masked token (the trainer leaves the row out of the batch)."""
    prompt, metadata = row
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ep = Episode(prompt=prompt, metadata=dict(metadata), turns=[Turn("user", prompt, own=False)], failed=True, failure=reason)
    extra = {"episode": ep, "dropped": reason, **({"agent_error": error} if error else {})}
    return Generation(
        token_ids=[int(pad)], rollout_log_probs=[0.0], finish_reason="stop", weight_version=version, own_mask=[False], extra=extra
    )
