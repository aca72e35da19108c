"""The one evaluator of the actor's policy: greedy responses to held-out prompts, rule-checked.

Owns :func:`evaluate_greedy`, used by SFT (at its last step, logged as ``task_*``:
:class:`aligner.trainers.sft.SFTTrainer`) and by PPO (before the first step, every
``trainer.eval_every`` steps and at the last one, logged as ``eval_*`` together with the RM
score and the KL to the reference of the same responses: :meth:`aligner.trainers.ppo.PPOTrainer.evaluate`):

    refit     the actor group's current policy weights -> its rollout engine
              (:meth:`aligner.workers.actor.ActorWorker.refit`)
    generate  one greedy response (temperature 0) per prompt, replicas' shares in replica order
    score     each decoded response (special tokens dropped) by a rule reward (:mod:`aligner.reward.rules`):
              ``"task_accuracy"`` (:func:`aligner.data.task.check_answer`) on the built-in task,
              ``reward.rule`` on other data (:func:`accuracy_rule`)
    breakdown on the built-in task, accuracy with and without a carry and the dropped-carry
              rate (:func:`aligner.data.task.mistake_breakdown`)

Simplification: the response budget is ``rollout.sampling.max_new_tokens``, clipped so that
the longest prompt plus its response fits ``data.max_seq_len``; a response cut by that budget
counts as whatever its text scores (usually wrong).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from aligner.config import AlignerConfig, SamplingConfig
from aligner.data.task import has_carry, mistake_breakdown, parse_prompt
from aligner.envs import episode_metrics
from aligner.reward import ifeval
from aligner.reward.rules import gsm8k_formatted, score

# what the evaluation reports of its episodes (env.name set)
EPISODE_EVAL_METRICS = ("turns", "tool_call_rate", "tool_call_rate_carry", "tool_call_rate_no_carry", "tool_errors")
# the metrics of :func:`evaluate_greedy` beyond accuracy and response length that a trainer logs where the data has them:
# the built-in task's carry breakdown, GSM8K's format rate, IFEval's four numbers, the episodes'
EVAL_METRICS = ("accuracy_carry", "accuracy_no_carry", "dropped_carry", "format_rate", *ifeval.SCALAR_METRICS, *EPISODE_EVAL_METRICS)


@dataclasses.dataclass
class GreedyEval:
    """What :func:`evaluate_greedy` saw and measured, in eval-prompt order.

    prompt_ids: each prompt's token ids; generations: the engine's Generation per prompt
    (``token_ids``, ``finish_reason``, ...); responses: decoded response texts; scores: [N] float
    rule scores; metrics: {"accuracy", "n", "mean_response_len"} plus "format_rate" on GSM8K-style
    data and, on the built-in task,
    "accuracy_carry", "accuracy_no_carry" and "dropped_carry" (a group without problems is left out).
    """

    prompt_ids: list[list[int]]
    generations: list
    responses: list[str]
    scores: torch.Tensor
    metrics: dict[str, float]


def on_builtin_task(cfg: AlignerConfig) -> bool:
    """True when the run's data is the built-in addition task (no data.train_path)."""
    return not cfg.data.train_path


def accuracy_rule(cfg: AlignerConfig) -> str:
    """The rule that decides whether a response is right: the built-in task's exact sum, else reward.rule
    (gsm8k for gsm8k_format: the answer's correctness; the format is reported as format_rate; ifeval_all for
    the IFEval rules: every constraint satisfied, strict)."""
    if on_builtin_task(cfg):
        return "task_accuracy"
    # gsm8k_format -> the answer's correctness; an IFEval rule -> all constraints satisfied (IFEval's prompt-level strict)
    return {"gsm8k_format": "gsm8k", "ifeval": "ifeval_all", "ifeval_loose": "ifeval_all"}.get(cfg.reward.rule, cfg.reward.rule)


def greedy_sampling(cfg: AlignerConfig, longest_prompt: int) -> SamplingConfig:
    """Greedy SamplingConfig with a response budget that keeps prompt + response within data.max_seq_len.

    Raises ValueError when the longest prompt (tokens) leaves no room for a response.
    """
    room = cfg.data.max_seq_len - longest_prompt
    if room < 1:
        raise ValueError(
            f"eval prompts of {longest_prompt} tokens leave no room for a response within "
            f"data.max_seq_len={cfg.data.max_seq_len}: raise data.max_seq_len"
        )
    base = cfg.rollout.sampling
    return dataclasses.replace(base, temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=min(base.max_new_tokens, room))


def gather_generations(results: Sequence[Any]) -> list:
    """Concatenate ActorWorker.generate's per-rank results ((replica, generations) or None) in replica order."""
    shares = sorted((r for r in results if r is not None), key=lambda r: r[0])
    return [g for _, gens in shares for g in gens]


def evaluate_greedy(actor_group, eval_examples: list[dict], tokenizer, cfg: AlignerConfig) -> GreedyEval:
    """Greedy accuracy of the actor group's current policy on held-out prompts.

    actor_group: a WorkerGroup of :class:`aligner.workers.actor.ActorWorker` (refit + generate).
    eval_examples: prompt examples from ``aligner.data.load_data("prompt", ...)``: each has
        "prompt_ids" (list[int]), "prompt" (str) and "metadata" (dict, e.g. the gsm8k answer).
    tokenizer: decodes response ids (special tokens dropped).
    cfg: the run's config: the response budget (:func:`greedy_sampling`) and the rule (:func:`accuracy_rule`).
    Returns a :class:`GreedyEval`; its metrics' "accuracy" is the fraction of responses the rule
    scores 1 (in [0, 1]), "n" the number of prompts, "mean_response_len" the mean response length
    in tokens (stop token included); on GSM8K-style data (metadata "answer") "format_rate", the
    fraction ending in a ``#### <number>`` line (:func:`aligner.reward.rules.gsm8k_formatted`); on IFEval-style
    data (metadata "instruction_id_list") IFEval's "prompt_strict", "instruction_strict", "prompt_loose",
    "instruction_loose" and "cut_rows" (responses that ran to the token budget) (:func:`aligner.reward.ifeval.ifeval_metrics`).
    With episodes (``env.name``) each prompt plays one greedily, the rule scores its last model turn,
    "mean_response_len" counts the model's own tokens, and the keys of :func:`aligner.envs.episode_metrics` are added
    (on the built-in task also "tool_call_rate_carry" and "tool_call_rate_no_carry").
    Raises ValueError for an empty eval set or an unknown rule.
    """
    if not eval_examples:
        raise ValueError("evaluate_greedy: no eval prompts (the eval split is empty): set data.eval_path or task.num_eval")
    prompts = [list(e["prompt_ids"]) for e in eval_examples]
    sampling = greedy_sampling(cfg, max(len(p) for p in prompts))
    actor_group.refit().get()
    rows = episode_rows(cfg, eval_examples)
    gens = gather_generations(actor_group.generate(prompts, sampling, list(range(len(prompts))), *([rows] if rows else [])).get())
    if len(gens) != len(prompts):
        raise RuntimeError(f"the actor returned {len(gens)} generations for {len(prompts)} prompts")
    texts = [e["prompt"] for e in eval_examples]
    if rows:  # episodes: the answer is the model's last turn (what the environment's reward scores)
        responses = [g.extra["episode"].model_turns[-1].text if g.extra["episode"].model_turns else "" for g in gens]
    else:
        responses = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens]
    scores = score(accuracy_rule(cfg), texts, responses, [dict(e.get("metadata") or {}) for e in eval_examples])
    metrics = {
        "accuracy": float(scores.mean()),
        "n": float(len(prompts)),
        "mean_response_len": sum(len(g.token_ids) for g in gens) / len(gens),
    }
    if not on_builtin_task(cfg) and any("answer" in (e.get("metadata") or {}) for e in eval_examples):  # GSM8K-style data
        metrics["format_rate"] = sum(gsm8k_formatted(r) is not None for r in responses) / len(responses)
    if any(ifeval.ID_FIELD in (e.get("metadata") or {}) for e in eval_examples):  # IFEval-style rows: IFEval's four numbers
        metas = [dict(e.get("metadata") or {}) for e in eval_examples]
        res = ifeval.ifeval_metrics(texts, responses, metas, [g.finish_reason == "length" for g in gens])
        metrics.update({k: float(res[k]) for k in ifeval.SCALAR_METRICS})
    if on_builtin_task(cfg):  # which mistakes the policy makes: carries dropped (what PPO must fix) or not
        metrics.update(mistake_breakdown(texts, responses))
    if rows:
        episodes = [g.extra["episode"] for g in gens]
        metrics.update(episode_metrics(episodes, prefix=""))
        metrics["mean_response_len"] = sum(sum(g.own_mask) for g in gens) / len(gens)
        if on_builtin_task(cfg):  # where the tool is called: on the problems with a carry (where it helps) or not
            carry = [has_carry(*parse_prompt(t)) for t in texts]
            for name, want in (("carry", True), ("no_carry", False)):
                group = [e for e, c in zip(episodes, carry) if c == want]
                if group:
                    metrics[f"tool_call_rate_{name}"] = sum(e.counts.get("tool_calls", 0) > 0 for e in group) / len(group)
    return GreedyEval(prompts, gens, responses, scores, metrics)


def episode_rows(cfg: AlignerConfig, examples: Sequence[dict]):
    """(prompt text, metadata) per prompt row when the run plays episodes (``env.name`` set), else None."""
    if not cfg.env.name:
        return None
    return [(e["prompt"], dict(e.get("metadata") or {})) for e in examples]
