"""`python -m aligner.ppo conf=...`: the main job (PPO, or GRPO/RLOO/REINFORCE++ by algorithm.advantage).

Owns the run around :class:`aligner.trainers.ppo.PPOTrainer`, as named phases:

    plan        the placement/memory plan (aligner.planner); plan_only=true prints it and exits 0.
                A layout that cannot fit the configured cluster, or a local machine that lacks
                the node groups' GPUs/CPUs, stops here within seconds, before Ray or any weights.
    output_dir  aligner.trainers.run_dir: refuse a previous run's dir unless resume=true / overwrite=true, refuse
                resuming another stage's run, take the dir's lock (held to the end of the run)
    data        tokenizer + RL prompts (built-in task by default), paths checked
    start       Ray, node groups, worker groups (weights load in the workers)
    resume      latest complete checkpoint in output_dir when resume=true
    loop        PPO steps; metrics every step, eval every eval_every, checkpoint every save_every
    finish      final eval, HF export of the policy to output_dir/hf, PNG report, summary table
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from aligner.cli import UserError, config_yaml, run
from aligner.config import AlignerConfig, ConfigError
from aligner.trainers import preemption

log = logging.getLogger("aligner.ppo")

REPORT_KEYS = ("score_mean", "kl_mean", "eval_accuracy", "train_accuracy", "policy_loss", "value_loss", "entropy",
               "time/refit", "time/generate", "time/inference", "time/train")


def plan_phase(cfg: AlignerConfig) -> Optional[int]:
    """Print the plan; return 0 for plan_only, raise UserError when the layout or machine cannot hold the run."""
    from aligner.planner import PlanError, check_fits, format_plan, make_plan
    from aligner.workers.placement import describe_request, local_shortfall, plan_from_config

    try:
        if cfg.plan_only:
            print(format_plan(make_plan(cfg)))
            return 0
        check_fits(cfg)
    except PlanError as e:
        raise UserError(str(e)) from None
    roles = cfg.roles_used()
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


def load_prompts(cfg: AlignerConfig):
    from aligner.data.pipeline import load_data, resolve_tokenizer
    from aligner.runtime.role import check_tokenizer_fits

    tok = resolve_tokenizer(cfg.tokenizer, cfg.task, cfg.output_dir)
    check_tokenizer_fits(len(tok), cfg.actor.init, cfg.model, "actor")
    splits = load_data("prompt", cfg.data, cfg.task, tok, cfg.output_dir)
    if not splits.eval:  # no held-out prompts (warned by load_data): evaluation runs on training prompts
        log.warning("ppo: evaluating on the first %d training prompts: the eval_* metrics are not held-out figures",
                    min(cfg.task.num_eval, len(splits.train)))
        splits.eval = splits.train[: cfg.task.num_eval]
    return tok, splits


def run_ppo(cfg: AlignerConfig) -> int:
    """The whole PPO run; returns the exit code."""
    code = plan_phase(cfg)
    if code is not None:
        return code
    cfg.check_paths()
    from aligner.trainers.run_dir import claim_output_dir

    with claim_output_dir(cfg):  # fresh / resume / overwrite checked, and locked until the end
        (Path(cfg.output_dir) / "config.yaml").write_text(config_yaml(cfg))
        try:
            tok, splits = load_prompts(cfg)
        except ConfigError:
            raise
        except (ValueError, FileNotFoundError) as e:
            raise UserError(str(e)) from None
        from aligner.trainers.ppo import PPOTrainer
        from aligner.workers.ray_runtime import init_ray, shutdown_ray

        init_ray(cfg.cluster)
        preemption.install("ppo", cfg.trainer.preempt_grace_s)  # after Ray: its handler would crash on SIGTERM
        trainer = PPOTrainer(cfg, tok, splits.train, splits.eval)
        try:
            trainer.start()
            summary = train_loop(cfg, trainer)
            finish(cfg, trainer, tok, summary)
        finally:
            preemption.uninstall()
            trainer.shutdown()
            shutdown_ray()
    return 0


def train_loop(cfg: AlignerConfig, trainer) -> dict:
    """Resume, step, log, evaluate, checkpoint. Returns {"initial": eval before training, "final": last eval}."""
    from aligner.tracking import MetricsLogger
    from aligner.trainers.checkpointing import CheckpointManager

    manager = CheckpointManager(cfg.output_dir, stage="ppo")  # records stage + run id; resume checks them (run_dir)
    last_saved = -1
    if cfg.resume and (ckpt := manager.latest()) is not None:
        trainer.load(ckpt)
        manager.adopt(ckpt)
        last_saved = trainer.step
        log.info("resumed from %s (step %d)", ckpt, trainer.step)
    elif cfg.resume:
        log.info("ppo: resume=true but %s holds no complete checkpoint: starting from step 0", manager.root)
    t = cfg.trainer
    where = str(manager.root)
    preemption.stop_at_step_boundary(trainer.step, last_saved, lambda: None, where)
    logger = MetricsLogger(cfg.output_dir, "ppo", t.max_steps, start_step=trainer.step, progress=t.progress,
                           bar_keys=("score_mean", "kl_mean", "eval_accuracy"))
    try:
        if trainer.step == 0:
            initial = trainer.evaluate()
            trainer.history.append({"step": 0, **initial})
            logger.log(0, initial, advance=False)
        while trainer.step < t.max_steps:
            metrics = trainer.train_step()
            trainer.step += 1
            if t.eval_every and trainer.step % t.eval_every == 0 or trainer.step == t.max_steps:
                ev = trainer.evaluate()
                metrics.update(ev)
                trainer.history.append({"step": trainer.step, **ev})
            logger.log(trainer.step, metrics)
            if t.save_every and trainer.step % t.save_every == 0 or trainer.step == t.max_steps:
                trainer.save(manager)
                last_saved = trainer.step
            preemption.stop_at_step_boundary(trainer.step, last_saved, lambda: trainer.save(manager), where)
    finally:
        logger.close()
    return {"initial": trainer.history[0] if trainer.history else {}, "final": trainer.history[-1] if trainer.history else {}}


def finish(cfg: AlignerConfig, trainer, tok, summary: dict) -> None:
    """HF export of the policy, a PNG report and the summary table."""
    from aligner.tracking import plot_curves

    out = Path(cfg.output_dir)
    tok_dir = out / "tokenizer"
    tok.save_pretrained(str(tok_dir))
    trainer.groups["actor"].export_hf(str(out / "hf"), str(tok_dir)).get()
    plot_curves(out / "metrics.jsonl", out / "ppo_report.png", REPORT_KEYS, title=f"aligner PPO ({cfg.preset})")
    print(summary_table(summary))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


def summary_table(summary: dict) -> str:
    i, f = summary.get("initial", {}), summary.get("final", {})

    def fmt(d, k, pct=False):
        return "-" if k not in d else (f"{100 * d[k]:.1f}%" if pct else f"{d[k]:.3f}")

    rows = [("held-out accuracy (greedy, rule-checked)", fmt(i, "eval_accuracy", True), fmt(f, "eval_accuracy", True)),
            ("mean RM score (greedy responses)", fmt(i, "eval_rm_score"), fmt(f, "eval_rm_score")),
            ("KL to reference (nats/sequence)", fmt(i, "eval_kl_to_ref"), fmt(f, "eval_kl_to_ref"))]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':{w}}  {'SFT policy':>12}  {'PPO policy':>12}"] + [f"{a:{w}}  {b:>12}  {c:>12}" for a, b, c in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    return run("ppo", run_ppo, argv)


if __name__ == "__main__":
    raise SystemExit(main())
