"""Samples a rollout could not produce, left out of the batch (docs/agents.md, "Training through the endpoint").

An agent episode that crashed, hung past ``agent.deadline_s``, made no call or never reported its reward
comes back from the engine's worker as a one-token placeholder Generation with ``extra["dropped"]``
(:mod:`aligner.workers.agent_episodes`). :func:`without_dropped` removes those rows from the assembled
batch, so nothing of them enters the loss, the KL or the advantages: a group estimator's baseline
(GRPO, RLOO) is the mean over the samples of the prompt that remain (``group_ids`` are kept per row; a
prompt left with one sample is left out too), and
the batch's ``dropped`` counts them (logged as ``env/dropped``). A share of the batch over
``agent.max_dropped_frac`` comes back with ``extra["agent_error"]`` on its placeholders: the run stops
with that line (:class:`AgentEpisodesError`, a UserError: exit 2).
"""

from __future__ import annotations

from typing import Sequence

import torch

from aligner.errors import UserError
from aligner.protocol import RolloutBatch


class AgentEpisodesError(UserError):
    """Too many agent episodes of a batch were dropped (one line: how many, the first reason, the field)."""


def without_dropped(batch: RolloutBatch, gens: Sequence, grouped: bool = False) -> RolloutBatch:
    """`batch` (B rows, built from `gens` in order) without the rows whose Generation is a dropped
    placeholder; ``batch.dropped`` = how many rows were left out. Returns `batch` itself when none was.
    grouped: a group estimator (GRPO, RLOO) trains the batch: a prompt left with one sample (its
    advantage against its own mean would be 0, and the estimators need two) is left out too.

    Raises AgentEpisodesError when a generation carries ``extra["agent_error"]`` (a share over
    agent.max_dropped_frac) or every row was dropped."""
    errors = [g.extra["agent_error"] for g in gens if "agent_error" in g.extra]
    if errors:
        raise AgentEpisodesError(errors[0])
    keep = [i for i, g in enumerate(gens) if "dropped" not in g.extra]
    if grouped and len(keep) < len(gens):
        groups = batch.group_ids[keep].tolist()
        keep = [i for i, gid in zip(keep, groups) if groups.count(gid) > 1]
    if len(keep) == len(gens):
        return batch
    if not keep:
        first = next(g.extra["dropped"] for g in gens if "dropped" in g.extra)
        raise AgentEpisodesError(
            f"no agent episode of the batch of {len(gens)} can be trained (dropped, or alone in its group); the first dropped: {first}"
        )
    out = batch.select(torch.tensor(keep, dtype=torch.long))
    out.dropped = len(gens) - len(keep)
    return out
