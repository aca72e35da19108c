"""Greedy held-out task accuracy of the actor: refit, generate, decode, check.

Owns :func:`evaluate_task_accuracy`, used at the end of SFT (and by the PPO trainer): the
actor group's current policy weights are refit into its rollout engine
(:meth:`aligner.workers.actor.ActorWorker.refit`), every eval prompt gets one greedy
response (temperature 0), and each decoded response is scored by a rule reward
(:mod:`aligner.reward.rules`; ``"task_accuracy"`` is the built-in task's
:func:`aligner.data.task.check_answer`).

Simplification: the response budget is ``rollout.sampling.max_new_tokens``, clipped so
that the longest prompt plus its response fits ``data.max_seq_len``; a response cut by
that budget counts as whatever its text scores (usually wrong).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from aligner.config import AlignerConfig, SamplingConfig
from aligner.reward.rules import score


def greedy_sampling(cfg: AlignerConfig, longest_prompt: int) -> SamplingConfig:
    """Greedy SamplingConfig with a response budget that keeps prompt + response within data.max_seq_len.

    Raises ValueError when the longest prompt (tokens) leaves no room for a response.
    """
    room = cfg.data.max_seq_len - longest_prompt
    if room < 1:
        raise ValueError(f"eval prompts of {longest_prompt} tokens leave no room for a response within "
                         f"data.max_seq_len={cfg.data.max_seq_len}: raise data.max_seq_len")
    base = cfg.rollout.sampling
    return dataclasses.replace(base, temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=min(base.max_new_tokens, room))


def gather_generations(results: Sequence[Any]) -> list:
    """Concatenate ActorWorker.generate's per-rank results ((replica, generations) or None) in replica order."""
    shares = sorted((r for r in results if r is not None), key=lambda r: r[0])
    return [g for _, gens in shares for g in gens]


def evaluate_task_accuracy(actor_group, eval_examples: list[dict], tokenizer, cfg: AlignerConfig,
                           rule: str = "task_accuracy", groups: Optional[Sequence[str]] = None) -> dict[str, float]:
    """Greedy accuracy of the actor group's current policy on held-out prompts.

    actor_group: a WorkerGroup of :class:`aligner.workers.actor.ActorWorker` (refit + generate).
    eval_examples: prompt examples from ``aligner.data.load_data("prompt", ...)``: each has
        "prompt_ids" (list[int]), "prompt" (str) and "metadata" (dict, e.g. the gsm8k answer).
    tokenizer: decodes response ids (special tokens dropped).
    rule: a name in :data:`aligner.reward.rules.RULES` that scores (prompt, response, metadata).
    groups: optional label per example (e.g. "carry" / "no_carry"); adds "accuracy_<label>" per label.
    Returns {"accuracy": fraction of responses the rule scores 1 (in [0, 1]), "n": prompts,
    "mean_response_len": mean response length, tokens (stop token included)}.
    Raises ValueError for an empty eval set, an unknown rule or groups of the wrong length.
    """
    if not eval_examples:
        raise ValueError("evaluate_task_accuracy: no eval prompts (the eval split is empty): set data.eval_path or task.num_eval")
    if groups is not None and len(groups) != len(eval_examples):
        raise ValueError(f"groups has {len(groups)} labels for {len(eval_examples)} eval examples: give one label per example")
    prompts = [list(e["prompt_ids"]) for e in eval_examples]
    sampling = greedy_sampling(cfg, max(len(p) for p in prompts))
    actor_group.refit().get()
    gens = gather_generations(actor_group.generate(prompts, sampling, list(range(len(prompts)))).get())
    if len(gens) != len(prompts):
        raise RuntimeError(f"the actor returned {len(gens)} generations for {len(prompts)} prompts")
    responses = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens]
    scores = score(rule, [e["prompt"] for e in eval_examples], responses, [dict(e.get("metadata") or {}) for e in eval_examples])
    out = {"accuracy": float(scores.mean()), "n": float(len(prompts)),
           "mean_response_len": sum(len(g.token_ids) for g in gens) / len(gens)}
    for label in sorted(set(groups or ())):
        picked = [float(x) for x, g in zip(scores, groups) if g == label]
        out[f"accuracy_{label}"] = sum(picked) / len(picked)
    return out
