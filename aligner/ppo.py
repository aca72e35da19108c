"""`python -m aligner.ppo conf=...`: the main job (PPO, or GRPO/RLOO/REINFORCE++ by algorithm.advantage).

Runs :class:`aligner.trainers.ppo.PPOTrainer` on the one training loop
(:mod:`aligner.trainers.loop`), whose phases are:

    check       the placement/memory plan (aligner.planner); plan_only=true prints it and exits 0.
                A layout that cannot fit the configured cluster, or a local machine that lacks
                the node groups' GPUs/CPUs, stops here within seconds, before Ray or any weights;
                then the configured paths are checked
    claim       aligner.run_ops.run_dir: refuse a previous run's dir unless resume=true / overwrite=true, refuse
                resuming another stage's run, take the dir's lock (held to the end of the run)
    config      output_dir/config.yaml
    inputs      tokenizer + RL prompts (built-in task by default)
    start       Ray, node groups, worker groups (weights load in the workers)
    resume      latest complete checkpoint in output_dir when resume=true
    steps       greedy eval at step 0, then PPO steps; metrics every step, eval every eval_every,
                checkpoint every save_every (both also at the last step)
    finish      HF export of the policy to output_dir/hf, PNG report, summary table, summary.json
"""

from __future__ import annotations

from aligner.cli import run
from aligner.config import AlignerConfig
from aligner.trainers.ppo import PPOTrainer
from aligner.trainers.ppo_setup import REPORT_KEYS, summary_table

__all__ = ["REPORT_KEYS", "main", "run_ppo", "summary_table"]


def run_ppo(cfg: AlignerConfig) -> int:
    """The whole PPO run for a validated config; returns the exit code."""
    return PPOTrainer(cfg).run()


def main(argv=None) -> int:
    """`python -m aligner.ppo [conf=PRESET] [key=value ...]` -> exit code (2 for config/user errors, 143 after SIGTERM)."""
    return run("ppo", run_ppo, argv)


if __name__ == "__main__":
    raise SystemExit(main())
