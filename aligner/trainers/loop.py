"""The one training loop of every stage (SFT, RM, DPO, PPO), as named phases.

Owns :class:`Trainer` (the interface a stage implements), :func:`run` (the phases, in this
order) and :func:`train` (the step loop, written once):

    check     paths, init weights, the plan: plan_only=true prints it and returns its exit code
              before anything is written; a layout or machine that cannot hold the run is a
              UserError here, before Ray or any weights
    claim     output_dir (:func:`aligner.run_ops.run_dir.claim_output_dir`: fresh, resume or
              overwrite, and the dir's lock, held to the end of the run)
    inputs    tokenizer + data (bad inputs are UserErrors; nothing of this run is written yet)
    config    output_dir/config.yaml
    start     Ray, then the SIGTERM handler (:func:`aligner.run_ops.preemption.install`: after Ray,
              whose own handler would turn SIGTERM into a crash dump), then the worker groups
    resume    when resume=true: the latest complete checkpoint (:class:`Checkpoints`), or a log
              line saying there is none and the run starts from step 0
    restarts  (:func:`train_with_restarts`) a worker process that dies during the steps: the groups
              are stopped and started again and the steps resume from the latest complete
              checkpoint (or step 0's state), at most trainer.max_restarts times a run
    steps     (:func:`train`) a stop if SIGTERM arrived already (nothing to save), an optional eval
              before the first step (``Trainer.eval_before_training``, PPO), then per step: run_step -> eval every trainer.eval_every steps and at the last
              step (plus ``Trainer.final_metrics`` at the last step) -> metrics -> checkpoint every
              trainer.save_every steps and at the last step -> stop here if SIGTERM arrived
              (checkpoint first unless this step's exists)
    finish    export, plots, summary (the final eval ran with the last step: its metrics are in
              the last step's row of metrics.jsonl)

and whatever happens, in this order: the SIGTERM handler removed, the worker groups stopped,
Ray shut down (when this run started or joined it), the output_dir lock released.

The loop has one set of hooks: :class:`Checkpoints` (resume, periodic and last saves and the
preemption save, through one :class:`aligner.run_ops.checkpointing.CheckpointManager` that
records the stage name and run id), and :class:`aligner.tracking.MetricsLogger` (metrics.jsonl,
the progress bar and the loggers of trainer.loggers: TensorBoard, W&B, MLflow). A trainer only
says how to take one step, evaluate, save and load its roles and state, and finish.
"""

from __future__ import annotations

import abc
import copy
import logging
import re
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from aligner.config import AlignerConfig, config_dict, config_yaml
from aligner.errors import Preempted, UserError, WorkerDiedError, WorkerHungError
from aligner.run_ops import preemption
from aligner.run_ops.checkpointing import CheckpointManager, load_trainer_state, rng_state, set_rng_state
from aligner.run_ops.run_dir import claim_output_dir
from aligner.tracking import MetricsLogger
from aligner.workers.group import rank_busy_metrics
from aligner.workers.ray_runtime import init_ray, shutdown_ray

log = logging.getLogger("aligner")
RESTART_SETTLE_S = 1.0  # after a worker death, seconds to wait for a SIGTERM that may be on its way before restarting


class Trainer(abc.ABC):
    """What a stage implements to run on the loop (see the module docstring for the phases).

    Attributes:
        name: the stage (sft | rm | dpo | ppo, equal to ``cfg.stage``): log prefix, progress bar,
            the ``stage`` recorded in checkpoints, the SIGTERM message.
        bar_keys: metrics shown on the progress bar.
        eval_before_training: evaluate once before the first step of a fresh run (logged as step 0).
        step: steps finished so far (run_step runs step ``step + 1``; the loop advances it).
        history: ``{"step", **eval metrics}`` of every evaluation this run made (PPO keeps it in
            its checkpoints for the summary's initial/final columns).
    """

    name: str = ""
    bar_keys: tuple[str, ...] = ("loss", "tokens_per_s")
    eval_before_training: bool = False

    def __init__(self, cfg: AlignerConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.step = 0
        self.history: list[dict] = []
        self.partial_restarts = 0  # restarts of one worker group alone (PPO's split rollout group); same budget as the loop's
        self.restart_state: Optional[Restarts] = None  # the run's whole-group restarts (train() sets it)
        self._ray = None

    def run(self) -> int:
        """The whole stage (:func:`run`); returns the exit code."""
        return run(self)

    def restarts_spent(self) -> int:
        """Automatic restarts this run so far, of every group (the loop's) and of one group alone
        (``partial_restarts``); ``trainer.max_restarts`` bounds their sum."""
        return self.partial_restarts + (self.restart_state.count if self.restart_state is not None else 0)

    def worker_groups(self) -> dict:
        """{role: WorkerGroup} of the running stage (their per-rank busy seconds go in each step's
        metrics); none by default."""
        return {}

    # ---- phases ------------------------------------------------------------------------------
    @abc.abstractmethod
    def check(self) -> Optional[int]:
        """Validate before anything is written: None to go on, or the exit code to stop with (plan_only).

        Raises UserError / ConfigError for a run that cannot start."""

    def claim_inputs(self) -> Optional[dict[str, str]]:
        """field -> path of what the run reads, which overwrite=true must not delete (None: every
        configured input, :func:`aligner.run_ops.run_dir.input_paths`)."""
        return None

    def claim_output_dir(self) -> AbstractContextManager:
        """Check and lock output_dir until the block ends (:func:`aligner.run_ops.run_dir.claim_output_dir`)."""

        return claim_output_dir(self.cfg, self.claim_inputs())

    def write_config(self) -> None:
        """output_dir/config.yaml: the resolved config of this run."""

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(config_yaml(self.cfg))

    @abc.abstractmethod
    def load_inputs(self) -> None:
        """Tokenizer and data (UserError for bad inputs)."""

    def init_ray(self) -> None:
        """Start or join Ray (:func:`aligner.workers.ray_runtime.init_ray` with ``cfg.cluster``)."""

        self._ray = init_ray(self.cfg.cluster)

    def shutdown_ray(self) -> None:
        """Shut Ray down when :meth:`init_ray` started or joined it (a caller's Ray instance is left running)."""

        if self._ray is not None and self._ray.started:
            shutdown_ray()
        self._ray = None

    @abc.abstractmethod
    def start(self) -> None:
        """Place and start the worker groups (Ray is up)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Shut the worker groups down and free their placement (also after a failed start)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """After the last step: export, plots, summary."""

    # ---- one step ----------------------------------------------------------------------------
    @abc.abstractmethod
    def run_step(self) -> dict[str, float]:
        """Run trainer step ``self.step + 1`` (do not advance ``self.step``); return its metrics.

        A trainer step is the unit ``trainer.max_steps`` counts: for SFT, RM and DPO one global
        batch (one optimizer step of each trained role); for PPO one rollout plus
        ``ppo_epochs`` x mini-batch updates (several optimizer steps per role). One optimizer
        step is :meth:`aligner.runtime.runner.ModelRunner.optimizer_step`."""

    @abc.abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current weights ({} when there is nothing to evaluate on)."""

    def final_metrics(self) -> dict[str, float]:
        """End-of-run metrics, computed once after the last step's eval and logged in its row."""
        return {}

    # ---- checkpoints -------------------------------------------------------------------------
    @abc.abstractmethod
    def save_roles(self, tmp: Path) -> None:
        """Each trained role's workers write its role checkpoint (model + optimizer + schedule) into ``tmp/<role>``."""

    @abc.abstractmethod
    def load_roles(self, ckpt: Path) -> None:
        """Each trained role's workers load its role checkpoint ``ckpt/<role>``."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The driver's state (JSON-safe): at least {"step"}, and the data position."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (ValueError when it does not fit this run's data)."""

    def save(self, manager) -> Path:
        """The checkpoint of step ``self.step``, atomically: the role checkpoints, then the trainer state (driver state
        and RNG) through the CheckpointManager."""
        tmp = manager.begin(self.step)
        self.save_roles(tmp)
        return manager.commit(tmp, self.step, self.state_dict())

    def load(self, ckpt: Path) -> None:
        """Restore a checkpoint written by :meth:`save`: the role checkpoints, then the trainer state (driver state, RNG).

        Raises UserError naming the checkpoint when its state does not fit this run (other data)."""

        self.load_roles(ckpt)
        state = load_trainer_state(ckpt)
        try:
            self.load_state_dict(state)
        except ValueError as e:
            raise UserError(f"resume from {ckpt}: {e}") from None


# ---- the hooks ---------------------------------------------------------------------------------
class Checkpoints:
    """The loop's checkpoint hook: resume, saves and the stop at a step boundary after SIGTERM (checkpoint, role
    checkpoint and trainer state as :mod:`aligner.run_ops.checkpointing` defines them).

    One :class:`aligner.run_ops.checkpointing.CheckpointManager` under output_dir/checkpoints,
    recording ``trainer.name`` as the checkpoints' stage. ``last_saved`` is the step of the newest
    checkpoint this run wrote or resumed from (-1: none).
    """

    def __init__(self, trainer: Trainer):

        self.trainer = trainer
        self.manager = CheckpointManager(trainer.out, stage=trainer.name)  # records stage + run id; resume checks them
        self.last_saved = -1

    def resume(self, restart: Optional[Restarts] = None) -> None:
        """When resume=true, or after an automatic restart: load the latest complete checkpoint and
        continue its run (its checkpoints become this run's to prune); with none, log that the run
        starts from step 0 (after a restart: from the state step 0 began with, ``restart.initial``)."""
        t = self.trainer
        restarted = restart is not None and restart.count > 0
        if not (t.cfg.resume or restarted):
            return
        ckpt = self.manager.latest()
        if ckpt is None:
            if restarted and restart.initial is not None:
                state, rng = copy.deepcopy(restart.initial)
                t.load_state_dict(state)
                set_rng_state(rng)
                log.info("%s: restart %d: no complete checkpoint yet: starting again from step %d", t.name, restart.count, t.step)
                return
            log.info("%s: resume=true but %s holds no complete checkpoint: starting from step 0", t.name, self.manager.root)
            return
        t.load(ckpt)
        self.manager.adopt(ckpt)
        self.last_saved = t.step
        log.info("%s: resumed from %s (step %d)", t.name, ckpt, t.step)

    def save(self) -> None:
        """Checkpoint the step just finished."""
        self.trainer.save(self.manager)
        self.last_saved = self.trainer.step

    def stop_if_preempted(self) -> None:
        """After SIGTERM: checkpoint the step just finished (unless saved) and raise Preempted."""
        preemption.stop_at_step_boundary(self.trainer.step, self.last_saved, self.save, str(self.manager.root))


def _every(n: int, step: int) -> bool:
    return bool(n) and step % n == 0


# ---- the loop ----------------------------------------------------------------------------------
def run(trainer: Trainer) -> int:
    """All phases of a stage, in order (module docstring); returns the exit code.

    Raises UserError / ConfigError for a run that cannot start, Preempted after SIGTERM (with the
    step's checkpoint written), and whatever a worker raised.
    """
    code = trainer.check()
    if code is not None:
        return code
    cfg = trainer.cfg
    with trainer.claim_output_dir():  # checked and locked until the end
        trainer.load_inputs()  # before anything is written: bad data leaves a fresh output_dir reusable
        trainer.write_config()
        trainer.init_ray()
        preemption.install(trainer.name, cfg.trainer.preempt_grace_s)  # after Ray: its handler would crash on SIGTERM
        try:
            trainer.start()
            train_with_restarts(trainer)
            trainer.finish()
        finally:
            preemption.uninstall()
            trainer.stop()
            trainer.shutdown_ray()
    return 0


@dataclass
class Restarts:
    """The automatic restarts of one run: how many so far, and the driver's state (state_dict, RNG)
    as step 1 began, for a restart that finds no checkpoint; ``evaluated`` once the eval before
    training is logged (a restart does not repeat it)."""

    count: int = 0
    initial: Optional[tuple[dict, dict]] = None
    evaluated: bool = False
    last: str = ""  # the latest restart's cause: "<role> rank <r> died during <where> (<first line of the error>)"
    where: str = "the start"  # what the loop was doing: "step N", "the eval after step N", "the checkpoint of step N"


def train_with_restarts(trainer: Trainer) -> None:
    """:func:`train`, started again after a worker process dies (:class:`aligner.errors.WorkerDiedError`),
    at most ``trainer.max_restarts`` times a run, restarts of one group alone included
    (``trainer.partial_restarts``: PPO's split rollout group) (the self-healing of MegaScale's and NeMo-RL's
    launchers, in-process): the worker groups are stopped and started again (placement waits for the
    resources as at the start, and refuses a cluster that can no longer hold them), and the steps
    resume from the latest complete checkpoint, or from step 0's state when none was written yet.
    The steps past that checkpoint are run again (their metrics rows are rewritten once). Each restart
    is logged (the dead worker's role and rank, the error's first line, the step it resumes from)
    and every later metrics row carries ``restarts``; the loggers that keep text record its cause
    (:meth:`aligner.tracking.MetricsLogger.restarted`). Not after SIGTERM (the workers ending then is
    the preemption). A worker that dies while the groups are rebuilt or the checkpoint is read
    costs one more restart of the same budget. Raises the WorkerDiedError once the budget is spent,
    its message saying so.
    """
    budget = trainer.cfg.trainer.max_restarts
    restart = Restarts()
    rebuild = False
    while True:
        try:
            if rebuild:  # a death while the groups are rebuilt is one more restart, within the same budget
                restart.where = "the restart (stopping and starting the worker groups)"
                trainer.stop()
                trainer.start()
            return train(trainer, restart)
        except WorkerDiedError as e:
            spent = trainer.restarts_spent()
            if spent < budget and not preemption.was_requested():
                time.sleep(RESTART_SETTLE_S)  # a SIGTERM sent to every process may reach the driver after a worker died of it
            if preemption.was_requested() or spent >= budget:
                if budget and not preemption.was_requested():
                    e.args = (f"{e.args[0]}\n(trainer.max_restarts={budget}: every automatic restart was spent)",)
                raise
            restart.count += 1
            restart.last = f"{e.role} rank {e.rank} died during {restart.where} ({death_summary(e.traceback_text)})"
            log.warning(
                "%s: %s: restart %d of %d: stopping and starting the worker groups",
                trainer.name,
                restart.last,
                trainer.restarts_spent(),
                budget,
            )
            if isinstance(e, WorkerHungError):  # the stacks the hung worker wrote
                log.warning("%s", e.traceback_text)
            rebuild = True


def death_summary(text: str) -> str:
    """The first line of a dead worker's error and the ``pid:`` / ``ip:`` fields Ray's ActorDiedError lists."""
    lines = text.strip().splitlines()
    fields = re.findall(r"^\s*(pid|ip): *(\S+)", text, flags=re.MULTILINE)
    return "; ".join([lines[0][:300] if lines else "", *(f"{k}: {v}" for k, v in fields)])


def train(trainer: Trainer, restart: Optional[Restarts] = None) -> None:
    """Resume, then step to trainer.max_steps: eval, metrics, checkpoints, SIGTERM stops (module docstring).

    Metrics go to output_dir/metrics.jsonl one row per step (step 0: the eval before training);
    a resumed run continues the file from its checkpoint's step. ``restart``: the run's
    :class:`Restarts` when :func:`train_with_restarts` calls (None: a run without restarts).
    """

    t = trainer.cfg.trainer
    restart = restart if restart is not None else Restarts()
    trainer.restart_state = restart
    ckpts = Checkpoints(trainer)
    ckpts.resume(restart)
    metrics = MetricsLogger(
        trainer.out,
        trainer.name,
        t.max_steps,
        start_step=trainer.step,
        progress=t.progress,
        bar_keys=trainer.bar_keys,
        loggers=t.loggers,
        config=config_dict(trainer.cfg),
        project=t.logger_project,
    )
    status = "failed"
    try:
        if restart.count:
            metrics.restarted(restart.count, restart.last, trainer.step)
        ckpts.stop_if_preempted()
        if trainer.eval_before_training and trainer.step == 0 and not restart.evaluated:
            initial = trainer.evaluate()
            trainer.history.append({"step": 0, **initial})
            metrics.log(0, initial, advance=False)
        restart.evaluated = True
        if restart.initial is None and trainer.step == 0:
            restart.initial = copy.deepcopy((trainer.state_dict(), rng_state()))
        while trainer.step < t.max_steps:
            restart.where = f"step {trainer.step + 1}"
            row = trainer.run_step()
            if not preemption.was_requested():  # after SIGTERM no call but the checkpoint's
                row.update(rank_busy_metrics(trainer.worker_groups(), t.straggler_factor, log.warning))
            if restart.count:
                row["restarts"] = float(restart.count)
            trainer.step += 1
            last = trainer.step == t.max_steps
            if last or _every(t.eval_every, trainer.step):
                restart.where = f"the eval after step {trainer.step}"
                ev = trainer.evaluate()
                row.update(ev)
                trainer.history.append({"step": trainer.step, **ev})
            if last:
                row.update(trainer.final_metrics())
            metrics.log(trainer.step, row)
            if last or _every(t.save_every, trainer.step):
                restart.where = f"the checkpoint of step {trainer.step}"
                ckpts.save()
            ckpts.stop_if_preempted()
        status = "finished"
    except Preempted:
        status = "killed"
        raise
    finally:
        metrics.close(status)
