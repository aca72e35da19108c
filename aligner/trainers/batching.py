"""The one place a rollout batch is assembled: prompt rows and their engines' Generations -> a
:class:`aligner.protocol.RolloutBatch` (used by the PPO trainer's colocated and split rollouts, the
reference sent ahead, DAPO's dynamic sampling and the evaluation), and the generation requests it
starts from (each sample's seed a function of (trainer.seed, step, index), so a resumed run draws the
same samples).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from aligner.protocol import RolloutBatch, build_sequences
from aligner.reward.remote import RemoteRewardError
from aligner.rollout.base import generations_to_padded, own_tokens_mask, routed_experts_to_padded

# what a sample's "meta" row carries over from its Generation's extra, when the engine set it: the episode it
# played (env.name), a streamed judge's unparsed flag, whether the remote reward scored it while generating
GENERATION_META = ("episode", "judge_unparsed", "scored_while_generating")


def sample_seed(seed: int, step: int, index: int) -> int:
    """Per-sample generation seed: a fixed function of (trainer.seed, step, sample index), in [0, 2**31 - 1)."""
    return (seed * 1_000_003 + step * 10_007 + index * 7_919) % (2**31 - 1)


def requests(prompts: list[dict], seed: int, step: int, n: int, first_index: int = 0) -> tuple[list[dict], list, list[int]]:
    """(rows: each prompt row n times in a row, their prompt ids, their seeds): sample i of step `step`
    seeded by ``sample_seed(seed, step, first_index + i)``.

    prompts: encoded prompt rows, each with "prompt_ids" (list[int]), "prompt" (str), "metadata" (dict)."""
    rows = [p for p in prompts for _ in range(n)]
    seeds = [sample_seed(seed, step, first_index + i) for i in range(len(rows))]
    return rows, [r["prompt_ids"] for r in rows], seeds


def assemble_batch(
    rows: list[dict],
    gens: list,
    n: int,
    pad_id: int,
    decode: Callable[[list[int]], str],
    responses: Optional[list[str]] = None,
) -> RolloutBatch:
    """The RolloutBatch of B prompt rows (each prompt n times in a row) and their B Generations.

    Args:
        rows: prompt rows ("prompt_ids", "prompt", "metadata"), B = len(rows), a multiple of n.
        gens: the engines' :class:`aligner.rollout.base.Generation` per row, in row order.
        n: samples per prompt: ``group_ids`` [B] int64 numbers the prompts (0, 0, .., 1, 1, ..).
        pad_id: the tokenizer's pad id (right padding of the [B, T] sequences).
        decode: token ids -> response text (special tokens dropped), used when `responses` is None.
        responses: the decoded responses when already at hand.

    Returns a RolloutBatch with input_ids / attention_mask [B, T], prompt_lens / response_lens [B],
    response_mask [B, R] float32 (0 on the tokens the model did not write: an episode's observations),
    rollout_log_probs [B, R] float32 (the engine's), rollout_experts [B, R, L, k] (MoE policies only,
    else None), ``scores`` [B] float32 when the engines scored every sample while generating
    (:func:`streamed_scores`, else None), weight_version and one ``meta`` dict per sample ("prompt",
    "response", "metadata", "finish_reason" and the keys of :data:`GENERATION_META` the engine set).
    Raises :class:`~aligner.reward.remote.RemoteRewardError` when a streamed remote score failed.
    """
    ids = [g.extra.get("prompt_ids", r["prompt_ids"]) for r, g in zip(rows, gens)]  # an agent's own prompt
    seq = build_sequences(ids, [g.token_ids for g in gens], pad_id)
    _, rollout_lp, _ = generations_to_padded(gens)  # [B, R], the same R as seq["response_mask"]
    seq["response_mask"] = seq["response_mask"] * own_tokens_mask(gens, seq["response_mask"].shape[1])
    if responses is None:
        responses = [decode(g.token_ids) for g in gens]
    meta = [
        {"prompt": row["prompt"], "response": text, "metadata": row.get("metadata", {}), "finish_reason": g.finish_reason}
        | {k: g.extra[k] for k in GENERATION_META if k in g.extra}
        for row, g, text in zip(rows, gens, responses)
    ]
    return RolloutBatch(
        scores=streamed_scores(gens),
        **seq,
        group_ids=torch.arange(len(rows) // n).repeat_interleave(n),
        rollout_log_probs=rollout_lp,
        rollout_experts=routed_experts_to_padded(gens),  # MoE policies only (else None)
        weight_version=gens[0].weight_version if gens else 0,
        meta=meta,
    )


def streamed_scores(gens: list) -> Optional[torch.Tensor]:
    """The remote reward's scores [B] float32 that the engines attached while generating (``reward.stream``),
    or None when some Generation has none (the driver scores the batch). Raises
    :class:`~aligner.reward.remote.RemoteRewardError` with the engine's message when the endpoint gave no
    valid answer after the retries."""
    for g in gens:
        if "score_error" in g.extra:
            raise RemoteRewardError(g.extra["score_error"])
    if not gens or any("score" not in g.extra for g in gens):
        return None
    return torch.tensor([g.extra["score"] for g in gens], dtype=torch.float32)
