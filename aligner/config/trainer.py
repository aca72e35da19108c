"""The training loop's section (``trainer.*``): steps, batch sizes, seeds, logging, checkpoint cadence,
staleness and the restart and hang watchdog settings; it validates its own fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from aligner.config.common import LOGGERS, _check


@dataclass(kw_only=True)
class TrainerConfig:
    """The training loop: steps, batch sizes, seeds, logging and checkpoint cadence."""

    max_steps: int = 100  # optimizer steps (SFT/RM) or PPO steps
    seed: int = 42  # global seed (model init, data order, sampling)
    save_every: int = 0  # checkpoint every N steps; 0 = only at the end
    eval_every: int = 0  # evaluate every N steps; 0 = only at the end
    log_every: int = 1  # log metrics every N steps
    global_batch_size: int = 32  # SFT/RM: samples per optimizer step (over all dp ranks)
    micro_batch_size: int = 8  # samples per forward/backward per dp rank
    micro_batch_tokens: int = 0  # > 0: micro-batches by a token budget (rows x the micro-batch's longest row <= this; sorted first-fit) instead of micro_batch_size, for every role's training and forward passes; 0 = micro_batch_size rows (aligner.runtime.runner)
    rollout_batch_size: int = 32  # PPO: prompts per step
    n_samples_per_prompt: int = 1  # PPO: responses per prompt (>= 2 for grpo, rloo, reinforce_pp_baseline)
    mini_batch_size: int = 32  # PPO: samples per optimizer step
    shared_prompt_pack_len: int = 4096  # PPO with n_samples_per_prompt > 1: the actor and reference run a prompt's samples as one packed row, the prompt's positions once (aligner.actor.shared_prompt), when the row has at most this many tokens; 0 = padded rows
    eval_batch_size: int = 64  # prompts per evaluation batch
    max_nonfinite: int = 3  # consecutive non-finite updates before the run stops
    num_threads: int = 0  # torch threads per CPU worker; 0 = follow the work: the workers busy in a phase share their node's cores (a role running alone gets them all)
    progress: bool = True  # show a progress bar
    preempt_grace_s: float = 25.0  # after SIGTERM: seconds to finish the step and checkpoint (below the scheduler's grace, 30 s by default)
    # PPO with rollout.placement=split: batches the rollout group may generate ahead of the update (each
    # sample is at most this many weight versions old when trained); 0 = synchronous
    max_staleness: int = 0
    # max_staleness >= 1 with a reference role: its log-probs of a queued batch are computed as soon as the
    # batch is generated, beside the actor's update, instead of in the next step's inference phase (the
    # reference is fixed, so they need only the batch); None = on exactly where the reference has devices
    # of its own (no ref.colocate_with, cluster.placement=split): beside the update it would hold memory on
    # the actor's devices otherwise
    ref_ahead: Optional[bool] = None
    # a worker call with no result for this long is a hang: its stacks are dumped and it is handled as a
    # death (the automatic restart); counted from the call's submission; 0 = no watchdog
    hang_timeout_s: float = 1800.0
    # per-rank busy seconds of each worker group are in every step's metrics (ranks/<role>/busy_s_*); a rank busy this many
    # times its group's median in a step (of at least 1 s) is logged as a straggler; 0 = no straggler line
    straggler_factor: float = 1.5
    max_restarts: int = 2  # a worker process that dies: stop and restart the groups, resume from the latest checkpoint, at most this many times a run; 0 = end the run (resume=true by hand)
    # a restart waits this long for the cluster to hold the worker groups again (a lost node replaced, as
    # Kubernetes or an autoscaler does), then ends the run naming the cluster it needs; 0 = no wait
    restart_wait_s: float = 300.0
    # where metrics go (aligner.tracking.MetricsLogger): jsonl | tensorboard | wandb | mlflow. output_dir/metrics.jsonl is
    # always written (resume, the plots and the summary read it), named here or not; wandb and mlflow follow their
    # own environment variables (WANDB_MODE=offline, WANDB_API_KEY, MLFLOW_TRACKING_URI, ...)
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    logger_project: str = ""  # the W&B project and MLflow experiment; "" = WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else "aligner"

    def validate(self, prefix: str = "trainer") -> None:
        for name in (
            "max_steps",
            "global_batch_size",
            "micro_batch_size",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "mini_batch_size",
            "eval_batch_size",
            "max_nonfinite",
        ):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        for name in (
            "save_every",
            "eval_every",
            "num_threads",
            "shared_prompt_pack_len",
            "max_restarts",
            "micro_batch_tokens",
            "max_staleness",
        ):
            _check(getattr(self, name) >= 0, f"{prefix}.{name}", getattr(self, name), "must be >= 0")
        unknown = [n for n in self.loggers if n not in LOGGERS]
        _check(
            not unknown,
            f"{prefix}.loggers",
            list(self.loggers),
            f"unknown loggers {unknown}: valid loggers are {', '.join(LOGGERS)} (e.g. {prefix}.loggers=[jsonl,tensorboard,wandb])",
        )
        _check(len(set(self.loggers)) == len(self.loggers), f"{prefix}.loggers", list(self.loggers), "name each logger once")
        _check(self.hang_timeout_s >= 0, f"{prefix}.hang_timeout_s", self.hang_timeout_s, "must be >= 0 seconds (0 = no hang watchdog)")
        _check(
            self.restart_wait_s >= 0, f"{prefix}.restart_wait_s", self.restart_wait_s, "must be >= 0 seconds (0 = no wait for lost nodes)"
        )
        _check(
            self.straggler_factor == 0 or self.straggler_factor > 1,
            f"{prefix}.straggler_factor",
            self.straggler_factor,
            "must be > 1 (times the group's median busy time) or 0 for no straggler line",
        )
        _check(
            self.preempt_grace_s > 0,
            f"{prefix}.preempt_grace_s",
            self.preempt_grace_s,
            "must be > 0 seconds (a few below the scheduler's grace period, e.g. 25)",
        )
        _check(
            self.global_batch_size % self.micro_batch_size == 0,
            f"{prefix}.global_batch_size",
            self.global_batch_size,
            f"must be a multiple of {prefix}.micro_batch_size={self.micro_batch_size}",
        )
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        _check(
            samples % self.mini_batch_size == 0,
            f"{prefix}.mini_batch_size",
            self.mini_batch_size,
            f"must divide rollout_batch_size * n_samples_per_prompt = {samples}",
        )
