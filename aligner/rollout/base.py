"""The rollout-engine interface every backend implements, and the checks they share.

Owns: :class:`Generation` (one response), :class:`RolloutEngine` (generate, the bucketed
weight update protocol, offload/onload), :func:`check_sampling` / :func:`check_prompts`
(bad input raises ValueError naming the parameter, the value and the fix), and
:func:`mismatch_metrics` (rollout vs trainer log-probs, delegating to
:func:`aligner.algorithms.rollout_mismatch_metrics`).

Weight update protocol (docs/design.md, "Rollout engines and refit"): the refit calls
``update_weights`` once per bucket of ``(hf_name, tensor)`` pairs, then
``finish_weight_update`` once, which finalizes, drops caches and bumps
``weight_version``. Every :class:`Generation` carries the ``weight_version`` it was
sampled with, so a trainer can tell stale rollouts from fresh ones.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

from aligner.algorithms import rollout_mismatch_metrics


@dataclass
class Generation:
    """One sampled response.

    token_ids: list[int] of length R, the response only (prompt excluded); ends with the
        stop token when finish_reason == "stop".
    rollout_log_probs: list[float] of length R, natural-log probability of each response
        token under softmax(logits / temperature) over the full vocabulary (temperature 1
        for greedy), as reported by the engine. See the engine for how top-k / top-p
        truncation is treated.
    finish_reason: "stop" (a stop token was sampled) or "length" (max_new_tokens reached).
    weight_version: the engine's weight_version when this response was generated.
    routed_experts: for a Mixture-of-Experts model (torch engine), [R, L, k] int16: the top-k
        experts (sorted along k) each of the L MoE layers chose at the position whose logits
        produced response token i (position prompt_len + i - 1); None for a dense model or an
        engine that does not report them. Compared with the trainer's by
        :func:`aligner.algorithms.routing_mismatch`.
    own_mask: for an episode (multi-turn, ``turn_end`` given to generate), list[bool] of length R:
        True where the model sampled the token, False for the environment's observation tokens
        (their rollout_log_probs are 0.0 and they are masked out of the loss); None for a
        single-turn response (every token is the model's).
    token_versions: for an interruptible engine (``rollout.interruptible``, docs/rollout.md), list[int]
        of length R: the engine's weight_version when each token was sampled (a weight sync may land
        between decode steps, so one response can span versions; an episode's observation tokens get
        the version of the step that ended the turn before them); None otherwise (every token has
        ``weight_version``).
    """

    token_ids: list[int]
    rollout_log_probs: list[float]
    finish_reason: str
    weight_version: int
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific details
    routed_experts: Optional[torch.Tensor] = field(default=None, compare=False)  # a tensor: not in ==
    own_mask: Optional[list[bool]] = None
    token_versions: Optional[list[int]] = field(default=None, compare=False)


class RolloutEngine(abc.ABC):
    """A generation engine the actor refits every PPO step.

    Subclasses keep ``self.weight_version`` (int, starts at 0, +1 per finished update).
    """

    weight_version: int = 0

    @abc.abstractmethod
    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: Any,
        seeds: Optional[list[int]] = None,
        max_new_tokens: Optional[Sequence[int]] = None,
    ) -> list[Generation]:
        """Sample one response per prompt.

        Args:
            prompt_ids: list[list[int]] of B non-empty token-id lists (ragged lengths).
            sampling: a SamplingConfig-like object with temperature, top_k, top_p,
                max_new_tokens, stop_token_ids.
            seeds: list[int] of length B, one RNG seed per request, or None (engine RNG).
            max_new_tokens: list[int] of length B, each request's own budget (None:
                sampling.max_new_tokens for all; checked by :func:`check_budgets`).
        Returns:
            list[Generation] of length B, in prompt order.
        Raises:
            ValueError: bad sampling parameters, empty prompts, or sequences that do not fit.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of ``(hf_name, tensor)`` pairs (full or engine-sharded tensors)."""

    @abc.abstractmethod
    def finish_weight_update(self) -> None:
        """Finalize a weight update: drop caches and bump ``weight_version``."""

    def offload(self) -> None:  # noqa: B027 - optional hook
        """Free device memory (weights and caches) while the trainer runs."""

    def onload(self) -> None:  # noqa: B027 - optional hook
        """Restore what :meth:`offload` freed before generating again."""


def check_sampling(sampling: Any) -> None:
    """Validate a SamplingConfig-like object; ValueError naming the field, value and fix."""
    for name in ("temperature", "top_k", "top_p", "max_new_tokens", "stop_token_ids"):
        if not hasattr(sampling, name):
            raise ValueError(f"sampling has no field {name!r}: pass an aligner.config.SamplingConfig")
    t, k, p, n = sampling.temperature, sampling.top_k, sampling.top_p, sampling.max_new_tokens
    if not (isinstance(t, (int, float)) and t >= 0):
        raise ValueError(f"sampling.temperature={t!r} is invalid: must be >= 0 (0 = greedy)")
    if not (isinstance(k, int) and k >= 0):
        raise ValueError(f"sampling.top_k={k!r} is invalid: must be an int >= 0 (0 = off)")
    if not (isinstance(p, (int, float)) and 0 < p <= 1):
        raise ValueError(f"sampling.top_p={p!r} is invalid: must be in (0, 1] (1 = off)")
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"sampling.max_new_tokens={n!r} is invalid: must be an int >= 1")


def check_prompts(prompt_ids: Sequence[Sequence[int]], seeds: Optional[Sequence[int]], vocab_size: int) -> None:
    """Validate prompts and seeds; ValueError naming the bad row."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids=[] is invalid: pass at least one prompt")
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"prompt_ids[{i}]=[] is empty: every prompt needs at least one token (e.g. BOS)")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"prompt_ids[{i}] has token id {lo if lo < 0 else hi} outside [0, {vocab_size}): check the tokenizer matches the model"
            )
    if seeds is not None and len(seeds) != len(prompt_ids):
        raise ValueError(f"seeds has {len(seeds)} entries for {len(prompt_ids)} prompts: pass one seed per prompt or None")


def check_budgets(
    prompt_ids: Sequence[Sequence[int]], sampling: Any, max_new_tokens: Optional[Sequence[int]], max_seq_len: int
) -> list[int]:
    """Each request's max_new_tokens (sampling.max_new_tokens when None): a list of B ints.

    Raises ValueError naming the request when a budget is < 1 or its prompt + budget exceeds
    `max_seq_len`, or when the list's length is not B.
    """
    if max_new_tokens is None:
        budgets = [int(sampling.max_new_tokens)] * len(prompt_ids)
    else:
        if len(max_new_tokens) != len(prompt_ids):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompt_ids)} prompts: pass one per prompt or None")
        budgets = [int(n) for n in max_new_tokens]
    for i, (p, n) in enumerate(zip(prompt_ids, budgets)):
        what = "sampling.max_new_tokens" if max_new_tokens is None else f"max_new_tokens[{i}]"
        if n < 1:
            raise ValueError(f"{what}={n} is invalid: must be >= 1")
        if len(p) + n > max_seq_len:
            raise ValueError(
                f"{what}={n} with the {len(p)}-token prompt {i} exceeds model.max_seq_len={max_seq_len}: "
                "shorten prompts or lower max_new_tokens"
            )
    return budgets


def generations_to_padded(gens: Sequence[Generation], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad responses: token_ids [B, R] int64, rollout_log_probs [B, R] fp32, response_mask [B, R] bool."""
    r = max(1, max(len(g.token_ids) for g in gens))
    ids = torch.full((len(gens), r), pad_id, dtype=torch.long)
    lp = torch.zeros(len(gens), r)
    mask = torch.zeros(len(gens), r, dtype=torch.bool)
    for i, g in enumerate(gens):
        n = len(g.token_ids)
        ids[i, :n] = torch.tensor(g.token_ids, dtype=torch.long)
        lp[i, :n] = torch.tensor(g.rollout_log_probs, dtype=torch.float32)
        mask[i, :n] = True
    return ids, lp, mask


def own_tokens_mask(gens: Sequence[Generation], r: int) -> torch.Tensor:
    """[B, r] float32: 1.0 where a generation's token is the model's own (every token of a single-turn
    Generation, and past its end), 0.0 at an episode's observation tokens (``own_mask`` False). The
    trainer multiplies its response mask by it, so observations are masked out of the loss, the KL and
    the advantages (docs/environments.md, "Training on trajectories")."""
    out = torch.ones(len(gens), r)
    for i, g in enumerate(gens):
        if g.own_mask is not None:
            out[i, : len(g.own_mask)] = torch.tensor(g.own_mask, dtype=torch.float32)
    return out


def token_versions_to_padded(gens: Sequence[Generation], r: int, versions: Optional[Sequence[int]] = None) -> torch.Tensor:
    """[B, r] int64: the version of each response token, right-padded with each row's last version.

    gens: B Generations; a Generation without ``token_versions`` gives every token its
    ``weight_version``. r: the padded response length (>= every len(token_ids)). versions: None (the
    engine's weight_version numbers), or a lookup from the engine's weight_version to the caller's
    version (e.g. :class:`aligner.trainers.producer.RolloutProducer`'s policy versions): entry v is
    the version of engine weight_version v. Raises ValueError when a row is longer than r.
    """
    out = torch.zeros(len(gens), r, dtype=torch.long)
    for i, g in enumerate(gens):
        n = len(g.token_ids)
        if n > r:
            raise ValueError(f"generation {i} has {n} tokens, more than r={r}: pass the batch's longest response")
        row = g.token_versions if g.token_versions is not None else [g.weight_version] * n
        if versions is not None:
            row = [versions[v] for v in row]
        last = row[-1] if row else (versions[g.weight_version] if versions is not None else g.weight_version)
        out[i] = last
        if row:
            out[i, :n] = torch.tensor(row, dtype=torch.long)
    return out


def routed_experts_to_padded(gens: Sequence[Generation]) -> Optional[torch.Tensor]:
    """The generations' routed_experts right-padded to [B, R, L, k] int16 (-1 on padding), R as in
    :func:`generations_to_padded`; None unless every generation carries them."""
    if not gens or any(g.routed_experts is None for g in gens):
        return None
    r = max(1, max(len(g.token_ids) for g in gens))
    _, n_layers, k = gens[0].routed_experts.shape
    out = torch.full((len(gens), r, n_layers, k), -1, dtype=torch.int16)
    for i, g in enumerate(gens):
        out[i, : g.routed_experts.shape[0]] = g.routed_experts
    return out


def mismatch_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """Mean / max |rollout_log_probs - old_log_probs| and the fraction of tokens with ratio outside [0.9, 1.1].

    rollout_log_probs, old_log_probs: [B, R] float; response_mask: [B, R]. Returns python floats
    keyed "log_probs_abs_diff_mean", "log_probs_abs_diff_max", "ratio_out_of_range_frac"
    (computed by :func:`aligner.algorithms.rollout_mismatch_metrics`).
    """

    return {k: float(v) for k, v in rollout_mismatch_metrics(rollout_log_probs, old_log_probs, response_mask).items()}
