"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2) for the PPO trainer's rollout phase: groups whose
scores are all equal are dropped and more prompts are generated until the batch is full.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from aligner.protocol import RolloutBatch

log = logging.getLogger("aligner.ppo")


def dynamic_rollout(trainer, first: Optional[tuple[list[dict], list]] = None) -> tuple[Optional[RolloutBatch], dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, section 3.2): generate rollout_batch_size prompts x n,
    score them, drop every group whose n scores are all equal (its group-relative advantages are all
    zero: no policy gradient, only the KL term), and generate further rounds of prompts (each round's
    samples seeded after the previous round's) until rollout_batch_size groups are kept or
    ``algorithm.dynamic_sampling_max_rounds`` rounds ran; kept groups past rollout_batch_size are
    cut, in order. Groups are judged on the raw scores (the verifier's or reward model's), as DAPO
    filters on accuracy: the overlong term and the KL do not count.

    trainer: the :class:`aligner.trainers.ppo.PPOTrainer` whose step this is (its config, step, producer,
    ``generate``, ``next_prompts``, ``assemble`` and ``score``).
    first: (rows, generations) of a first round generated ahead (the split placement at
    ``trainer.max_staleness=1``: the queued batch); the further rounds are generated now, by the
    engines' current weights, and the kept batch carries every token's policy version
    (``token_versions``, for the per-token staleness).

    Returns (the kept batch with ``scores`` set, or None when no group varied in any round, and the
    metrics ``dynamic_sampling/rounds``, ``/dropped_groups`` (all-equal groups generated this step),
    ``/kept_groups`` (trained on; fewer than rollout_batch_size when the rounds ran out))."""
    t, a = trainer.cfg.trainer, trainer.cfg.algorithm
    n, target = t.n_samples_per_prompt, t.rollout_batch_size
    rows: list[dict] = []
    gens: list = []
    responses: list[str] = []
    scores: list[torch.Tensor] = []
    dropped = rounds = 0
    while len(rows) < target * n and rounds < a.dynamic_sampling_max_rounds:
        if first is not None:
            (got_rows, got_gens), first = first, None
        else:
            got_rows, got_gens = trainer.generate(
                trainer.next_prompts(), trainer.cfg.rollout.sampling, trainer.step, n, rounds * target * n
            )
        batch = trainer.assemble(got_rows, got_gens, n)
        rounds += 1
        s = trainer.score(batch).float()
        groups = s.view(-1, n)
        varied = (groups != groups[:, :1]).any(dim=1)  # NaN != NaN: a non-finite score is kept for the check after
        dropped += int((~varied).sum())
        for g in varied.nonzero().flatten().tolist():
            idx = range(g * n, (g + 1) * n)
            rows += [got_rows[i] for i in idx]
            gens += [got_gens[i] for i in idx]
            responses += [batch.meta[i]["response"] for i in idx]
            scores.append(s[g * n : (g + 1) * n])
    rows, gens, responses = rows[: target * n], gens[: target * n], responses[: target * n]
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/dropped_groups": float(dropped),
        "dynamic_sampling/kept_groups": float(len(rows) // n),
    }
    if not rows:
        log.warning(
            "step %d: dynamic sampling kept no group in %d rounds (every group's scores were equal): no update", trainer.step + 1, rounds
        )
        return None, metrics
    kept = trainer.assemble(rows, gens, n, responses)
    kept.scores = torch.cat(scores)[: len(rows)]
    if trainer.producer is not None and trainer.cfg.trainer.max_staleness > 0:  # rounds from more than one version
        kept.token_versions = trainer.producer.token_versions(gens, kept.response_mask.shape[1])
    return kept, metrics
