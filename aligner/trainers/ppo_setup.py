"""What a PPO run does around its steps: the checks and inputs before the first step, the report after the last.

Used by :class:`aligner.trainers.ppo.PPOTrainer`'s phases (``check``: :func:`plan_phase`; ``inputs``:
:func:`load_prompts`; ``start``: :func:`placed_groups`, :func:`load_reward_stats`; ``finish``:
:data:`REPORT_KEYS`, :func:`summary_table`). Nothing here talks to a worker.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from aligner.config import AlignerConfig
from aligner.data.pipeline import load_data, resolve_tokenizer
from aligner.errors import UserError
from aligner.planner import PlanError, check_fits, format_plan, make_plan
from aligner.reward.rules import check_rule_rows
from aligner.runtime.role import check_tokenizer_fits, resolve_init
from aligner.workers.placement import ROLLOUT_GROUP, describe_request, local_shortfall, plan_from_config

log = logging.getLogger("aligner.ppo")

# the curves of the run's PNG report (aligner.tracking.plot_curves)
REPORT_KEYS = (
    "score_mean",
    "kl_mean",
    "eval_accuracy",
    "eval_format_rate",  # GSM8K-style data only (plot_curves skips a key no row has)
    "eval_prompt_strict",  # IFEval-style data only
    "eval_instruction_strict",
    "train_accuracy",
    "kl_loss",  # a KL loss term only (GRPO's k3)
    "policy_loss",
    "value_loss",
    "entropy",
    "time/refit",
    "time/generate",
    "time/inference",
    "time/train",
)


def load_reward_stats(cfg: AlignerConfig) -> dict[str, float]:
    """mean/std of RM scores saved by the RM stage (reward_stats.json beside the RM's HF export)."""

    if cfg.reward.type != "model" or not cfg.reward.init:
        return {"mean": 0.0, "std": 1.0}
    path = resolve_init(cfg.reward.init) / "reward_stats.json"
    if not path.exists():
        log.warning("no %s: RM scores are used unstandardized", path)
        return {"mean": 0.0, "std": 1.0}
    stats = json.loads(path.read_text())
    return {"mean": float(stats["mean"]), "std": max(float(stats["std"]), 1e-6)}


def plan_phase(cfg: AlignerConfig) -> Optional[int]:
    """Print the plan; return 0 for plan_only, raise UserError when the layout or machine cannot hold the run."""

    try:
        if cfg.plan_only:
            print(format_plan(make_plan(cfg)))
            return 0
        estimates = check_fits(cfg)
    except PlanError as e:
        raise UserError(str(e)) from None
    check_hang_timeout(cfg, {role: est.time.total_s for role, est in estimates.items()})
    roles = placed_groups(cfg)
    why = local_shortfall(cfg, roles)
    if why:
        try:
            plan_text = format_plan(make_plan(cfg))
        except PlanError as e:
            plan_text = str(e)
        raise UserError(
            f"this machine cannot hold the run ({why}).\nplan for cluster.num_nodes={cfg.cluster.num_nodes} x "
            f"gpus_per_node={cfg.cluster.gpus_per_node}:\n{plan_text}\nnode groups asked:\n"
            f"{describe_request(plan_from_config(cfg, roles))}\n"
            "fix: submit to a Ray cluster that has them (ray job submit ... / cluster.address=auto), "
            "or use conf=tiny on a CPU machine"
        )
    return None


def check_hang_timeout(cfg: AlignerConfig, phase_seconds: dict[str, float]) -> None:
    """Refuse a ``trainer.hang_timeout_s`` that the planner expects a healthy phase to outlast.

    `phase_seconds`: each role's estimated share of one step (seconds; the planner's step-time model,
    :func:`aligner.planner.check_fits`), which bounds one of its calls. Only on a GPU cluster: the
    step-time model has no CPU figures. Raises UserError (exit 2, before Ray) naming the longest phase.
    """
    limit = cfg.trainer.hang_timeout_s
    if limit <= 0 or cfg.cluster.gpus_per_node <= 0 or not phase_seconds:
        return
    role, secs = max(phase_seconds.items(), key=lambda kv: kv[1])
    if secs > limit:
        raise UserError(
            f"trainer.hang_timeout_s={limit:g} is shorter than the planner's estimate of one {role} phase "
            f"({secs:.0f} s at cluster.gpu_peak_tflops={cfg.cluster.gpu_peak_tflops:g}): the watchdog would end a healthy run as hung; "
            f"set trainer.hang_timeout_s to at least {max(2 * secs, 60):.0f} (twice the estimate), or 0 to turn the watchdog off"
        )


def placed_groups(cfg: AlignerConfig) -> tuple[str, ...]:
    """The worker groups a PPO run places: its roles, and the rollout group with rollout.placement=split."""
    return cfg.roles_used() + ((ROLLOUT_GROUP,) if cfg.rollout.placement == "split" else ())


def load_prompts(cfg: AlignerConfig):
    """(tokenizer, prompt splits): the tokenizer checked against the actor's vocabulary; with no held-out
    prompts, evaluation runs on the first task.num_eval training prompts (warned)."""

    tok = resolve_tokenizer(cfg.tokenizer, cfg.task, cfg.output_dir)
    check_tokenizer_fits(len(tok), cfg.actor.init, cfg.model, "actor")
    splits = load_data("prompt", cfg.data, cfg.task, tok, cfg.output_dir)
    if cfg.reward.type == "rule":  # rows the rule cannot score stop the run here, before any worker starts
        check_rule_rows(cfg.reward.rule, splits.train + splits.eval)
    if not splits.eval:  # no held-out prompts (warned by load_data): evaluation runs on training prompts
        log.warning(
            "ppo: evaluating on the first %d training prompts: the eval_* metrics are not held-out figures",
            min(cfg.task.num_eval, len(splits.train)),
        )
        splits.eval = splits.train[: cfg.task.num_eval]
    return tok, splits


def summary_table(summary: dict) -> str:
    """The run's before/after table: held-out accuracy, mean RM score and KL to the reference, initial vs final eval."""
    i, f = summary.get("initial", {}), summary.get("final", {})

    def fmt(d, k, pct=False):
        return "-" if k not in d else (f"{100 * d[k]:.1f}%" if pct else f"{d[k]:.3f}")

    rows = [
        ("held-out accuracy (greedy, rule-checked)", fmt(i, "eval_accuracy", True), fmt(f, "eval_accuracy", True)),
        ("mean RM score (greedy responses)", fmt(i, "eval_rm_score"), fmt(f, "eval_rm_score")),
        ("KL to reference (nats/sequence)", fmt(i, "eval_kl_to_ref"), fmt(f, "eval_kl_to_ref")),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':{w}}  {'SFT policy':>12}  {'PPO policy':>12}"] + [f"{a:{w}}  {b:>12}  {c:>12}" for a, b, c in rows]
    return "\n".join(lines)
