"""SupervisedTrainer: the shared trainer of the standalone supervised stages (SFT, reward model).

Implements :class:`aligner.trainers.loop.Trainer` on one role's worker group; the phases and the
step loop are the loop's (:mod:`aligner.trainers.loop`):

    check     plan_only (print the plan, before any file is read), paths, <role>.init, this machine can hold the role's workers
    claim     output_dir (fresh, resume or overwrite, and the lock, held to the end)
    config    output_dir/config.yaml
    inputs    tokenizer (checked against model.vocab_size) + the encoded train/eval splits
    start     Ray + the role's worker group
    resume    role weights, optimizer and schedule, data position, RNG states
    steps     next global batch -> one dp_split train call -> eval (eval_every, last step; at the last
              step also the stage's final metrics) -> metrics -> checkpoint (save_every, last step)
    finish    HF export (+ tokenizer, + stage extras) -> curves PNG -> summary.json

A stage (``aligner.sft``, ``aligner.rm``) subclasses :class:`SupervisedTrainer` and says which
role and worker class it uses, how a global batch is collated and which worker methods train
and evaluate. The driver sends each step's whole global batch (trainer.global_batch_size
samples) in one dp_split call; the worker splits its share into micro-batches of
trainer.micro_batch_size and normalizes the loss over the global batch (gradient
accumulation).

Checkpoints (every trainer.save_every steps and at the end) go through
:class:`aligner.run_ops.checkpointing.CheckpointManager`: the role's workers write model +
optimizer + schedule into ``<tmp>/<role>``, the driver adds its step, data position and
RNG states, and the directory is renamed into place. ``resume=true`` restores all of it,
so a resumed run repeats the uninterrupted run's losses exactly (fp32 on CPU).

Simplification: evaluation runs on the whole eval split (in batches of
trainer.eval_batch_size) every trainer.eval_every steps and at the end.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from aligner.config import AlignerConfig
from aligner.data.pipeline import load_data
from aligner.data.sampler import DataIterator
from aligner.data.task import build_task_tokenizer
from aligner.data.tokenizer import load_tokenizer
from aligner.errors import UserError
from aligner.planner import print_plan
from aligner.runtime.role import check_tokenizer_fits, resolve_init
from aligner.tracking import plot_curves, read_metrics
from aligner.trainers.loop import Trainer
from aligner.workers.group import CoreSharing, role_worker_group
from aligner.workers.placement import local_shortfall, placement_from_config

log = logging.getLogger("aligner")

TINY_SFT_DIR = "outputs/tiny/sft"  # default init of the RM and DPO stages for the tiny preset on the built-in task


def tiny_sft_init(cfg: AlignerConfig, role_init: str) -> str:
    """`role_init` (the stage's reward.init / actor.init), or for conf=tiny on the built-in task the tiny SFT run
    when its HF export exists (relative to the working directory), else "" (random weights)."""
    if role_init:
        return role_init
    builtin = not cfg.data.train_path and not cfg.tokenizer.path
    if cfg.preset == "tiny" and builtin and (Path(TINY_SFT_DIR) / "hf" / "config.json").is_file():
        return TINY_SFT_DIR
    return ""


def log_init(cfg: AlignerConfig, what: str, init: str, field: str) -> None:
    """Log where `what` starts from: `init`, or random weights (naming the empty `field`)."""
    if init:
        log.info("%s: initializing %s from %s", cfg.stage, what, init)
    else:
        log.info(
            "%s: initializing %s from random weights (%s is empty%s)",
            cfg.stage,
            what,
            field,
            f" and {TINY_SFT_DIR} has no HF export" if cfg.preset == "tiny" else "",
        )


def first(value: Any) -> Any:
    """A dp_split result's scalar: every replica returns the same global value, so take replica 0's."""
    return value[0] if isinstance(value, list) else value


def eval_chunks(examples: list, batch_size: int, min_size: int) -> list[list]:
    """`examples` in batches of `batch_size`; a last batch smaller than `min_size` (dp_size) joins the previous one."""
    chunks = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    if len(chunks) > 1 and len(chunks[-1]) < min_size:
        chunks[-2] = chunks[-2] + chunks.pop()
    return chunks


def tokenizer_path(cfg: AlignerConfig, work_dir: str) -> str:
    """tokenizer.path, or the built-in task's tokenizer.json (trained on first use under work_dir/task)."""

    return cfg.tokenizer.path or build_task_tokenizer(cfg.task, os.path.join(work_dir, "task"))


def shown(metrics: dict) -> dict[str, float]:
    """The float metrics of `metrics` at four significant digits, for a log line: a learning rate of 1e-5
    shows as 1e-05 (rounding to decimal places would show 0.0)."""
    return {k: float(f"{v:.4g}") for k, v in metrics.items() if isinstance(v, float)}


class SupervisedTrainer(Trainer):
    """One standalone supervised stage on one role's worker group.

    Subclasses set ``name`` (sft | rm), ``role`` (a RoleConfig name), ``data_kind`` (sft | pairs),
    ``train_method`` / ``eval_method`` (dp_split worker methods returning metric dicts),
    ``eval_keys``, ``bar_keys`` / ``plot_keys``, and implement :meth:`worker_cls`, :meth:`worker_kwargs`,
    :meth:`collate`; :meth:`final_results` adds end-of-run metrics and export extras.
    """

    role = ""
    data_kind = ""
    train_method = ""
    eval_method = ""
    eval_keys: tuple[str, ...] = ("loss",)
    bar_keys: tuple[str, ...] = ("loss", "tokens_per_s")
    plot_keys: tuple[str, ...] = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s")

    def __init__(self, cfg: AlignerConfig):
        super().__init__(cfg)
        self.group = None
        self.placement = None
        self.tokenizer = None
        self.tok_path = ""
        self.data = None
        self.it = None  # DataIterator over the train split
        self._final: Optional[tuple[dict, dict]] = None

    # ---- stage hooks -------------------------------------------------------------------
    def worker_cls(self) -> type:
        """The role's Ray worker class."""
        raise NotImplementedError

    def worker_kwargs(self) -> dict:
        """Constructor arguments of :meth:`worker_cls` (besides the group's own)."""
        raise NotImplementedError

    def collate(self, examples: list[dict]) -> dict:
        """Encoded examples -> the batch dict the train/eval methods take."""
        raise NotImplementedError

    def num_tokens(self, batch: dict) -> int:
        """Real (non-padding) tokens the step processed, for tokens/s."""
        return int(sum(int(v.sum()) for k, v in batch.items() if k.endswith("attention_mask")))

    def final_results(self) -> tuple[dict, dict]:
        """End-of-run (metrics to log, extra export arguments). Called once, after the final eval."""
        return {}, {}

    @property
    def pad_id(self) -> int:
        """The tokenizer's pad id, else its EOS id, else 0."""
        tok = self.tokenizer
        for cand in (tok.pad_token_id, tok.eos_token_id, 0):
            if cand is not None:
                return int(cand)
        return 0

    # ---- phases ------------------------------------------------------------------------
    def check(self) -> Optional[int]:
        """plan_only (the plan's exit code: it needs no files, as in PPO, so a cluster run can be
        planned where its data and weights are absent), then paths, <role>.init and the machine
        (UserErrors)."""
        cfg = self.cfg
        if cfg.plan_only:
            return print_plan(cfg)
        cfg.check_paths((self.role,))
        self.check_init()
        self.check_machine()
        return None

    def check_machine(self) -> None:
        """UserError (before Ray starts) when this machine cannot hold the role's workers."""

        why = local_shortfall(self.cfg, (self.role,))
        if why:
            r = self.role
            raise UserError(
                f"this machine cannot hold the run ({why}): lower {r}.resources.cpus_per_worker, "
                f"{r}.resources.gpus_per_node or {r}.parallel sizes, or submit to a Ray cluster that has "
                "them (ray job submit ... / cluster.address=auto)"
            )

    def init_path(self) -> str:
        """Where the role's weights start from ("" = random init)."""
        return self.cfg.role(self.role).init

    def check_init(self) -> None:
        """UserError naming <role>.init when it is neither an HF model dir nor a run dir with hf/ inside."""

        try:
            resolve_init(self.init_path())
        except ValueError as e:
            raise UserError(f"{self.role}.{e}") from None

    def claim_inputs(self) -> dict[str, str]:
        """The role's init (overwrite=true must not delete it)."""
        return {f"{self.role}.init": self.init_path()}

    def load_inputs(self) -> None:
        """Tokenizer (checked against model.vocab_size), the encoded train/eval splits and the train iterator."""

        cfg = self.cfg
        try:
            self.tok_path = tokenizer_path(cfg, str(self.out))
            self.tokenizer = load_tokenizer(self.tok_path, cfg.tokenizer.chat_template)
        except (OSError, ValueError) as e:
            raise UserError(f"tokenizer.path={cfg.tokenizer.path!r}: {e}") from None

        check_tokenizer_fits(len(self.tokenizer), self.init_path(), cfg.model, self.role)
        try:
            self.data = load_data(self.data_kind, cfg.data, cfg.task, self.tokenizer, str(self.out))
        except ValueError as e:
            raise UserError(str(e)) from None
        if not self.data.train:
            raise UserError(f"no {self.data_kind} training examples left after loading (see the data: log line above): check data.*")
        self.it = DataIterator(self.data.train, seed=cfg.data.shuffle_seed)

    def worker_groups(self) -> dict:
        return {self.role: self.group} if self.group is not None else {}

    def start(self) -> None:
        """Place and start the role's worker group."""

        self.placement = placement_from_config(self.cfg, (self.role,), restarting=self.restarts_spent() > 0)
        t0 = time.perf_counter()
        self.group = role_worker_group(self.cfg, self.role, self.worker_cls(), self.placement, kwargs=self.worker_kwargs())
        if self.cfg.trainer.num_threads == 0:  # the role runs alone: its CPU workers share the node's cores
            CoreSharing({self.role: self.group}).phase([self.role])
        p = self.cfg.role(self.role).parallel
        log.info(
            "%s: %d %s worker(s) (tp=%d pp=%d dp=%d) ready in %.1f s",
            self.name,
            p.world_size,
            self.role,
            p.tp_size,
            p.pp_size,
            p.dp_size,
            time.perf_counter() - t0,
        )

    def stop(self) -> None:
        """Shut the worker group down and remove its placement."""
        if self.group is not None:
            self.group.shutdown()
        if self.placement is not None:
            self.placement.remove()

    # ---- checkpoints -------------------------------------------------------------------
    def save_roles(self, tmp: Path) -> None:
        """The role's workers write model + optimizer + schedule into tmp/<role>."""
        self.group.save(str(tmp / self.role)).get()

    def load_roles(self, ckpt: Path) -> None:
        """The role's workers load ckpt/<role>."""
        self.group.load(str(ckpt / self.role)).get()

    def state_dict(self) -> dict[str, Any]:
        """{"step", "data": the train iterator's position}."""
        return {"step": self.step, "data": self.it.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step and the data position (ValueError when the train split differs)."""
        self.it.load_state_dict(state["data"])
        self.step = int(state["step"])

    # ---- one step ----------------------------------------------------------------------
    def run_step(self) -> dict:
        """One optimizer step on the next global batch: the worker's metrics, tokens/s, step time, tokens."""
        batch = self.collate(self.it.next_batch(self.cfg.trainer.global_batch_size))
        t0 = time.perf_counter()
        stats = getattr(self.group, self.train_method)(batch).get()
        dt = time.perf_counter() - t0
        metrics = {k: first(v) for k, v in stats.items()}
        n = self.num_tokens(batch)
        metrics.update({"tokens_per_s": n / max(dt, 1e-9), "step_time_s": dt, "seq_tokens": float(n)})
        return metrics

    def evaluate(self) -> dict:
        """Validation metrics over the eval split (weighted by each call's count), as eval_<key>."""
        if not self.data.eval:
            return {}
        dp = self.cfg.role(self.role).parallel.dp_size
        sums: dict[str, float] = {}
        total = 0.0
        for chunk in eval_chunks(self.data.eval, self.cfg.trainer.eval_batch_size, dp):
            stats = {k: first(v) for k, v in getattr(self.group, self.eval_method)(self.collate(chunk)).get().items()}
            weight = float(stats.get("tokens", len(chunk)))
            for k in self.eval_keys:
                sums[k] = sums.get(k, 0.0) + float(stats[k]) * weight
            total += weight
        return {f"eval_{k}": v / max(total, 1e-12) for k, v in sums.items()}

    def final_metrics(self) -> dict:
        """The stage's end-of-run metrics (:meth:`final_results`)."""
        return self._final_results_once()[0]

    def _final_results_once(self) -> tuple[dict, dict]:
        if self._final is None:
            self._final = self.final_results()
        return self._final

    # ---- finish ------------------------------------------------------------------------
    def finish(self) -> None:
        """HF export, curves PNG and summary.json."""
        self.export()
        self.plot()

    def export(self) -> None:
        """HF export (weights, config, tokenizer, stage extras) to output_dir/hf."""
        _, extras = self._final_results_once()
        t0 = time.perf_counter()
        path = first([p for p in self.group.export_hf(str(self.out / "hf"), self.tok_path, **extras).get() if p])
        log.info("%s: HF export at %s (%.1f s)", self.name, path, time.perf_counter() - t0)

    def plot(self) -> None:
        """output_dir/curves.png of plot_keys, and summary.json: {"stage", "steps", **the last metrics row}."""

        png = plot_curves(self.out / "metrics.jsonl", self.out / "curves.png", self.plot_keys, title=f"{self.name} ({self.cfg.preset})")
        rows = read_metrics(self.out / "metrics.jsonl")
        summary = {"stage": self.name, "steps": rows[-1]["step"] if rows else 0, **(rows[-1] if rows else {})}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        log.info("%s: curves %s; final %s", self.name, png, shown(summary))
