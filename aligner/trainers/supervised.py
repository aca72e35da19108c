"""The shared driver of the standalone training stages (SFT, reward model).

Owns the loop both stages run on the parallel runtime, as named phases:

    check paths -> (plan_only: print the plan) -> claim output_dir (aligner.trainers.run_dir: fresh,
    resume or overwrite, and the lock, held to the end) -> prepare output_dir (config.yaml)
    -> tokenizer + data -> Ray + the role's worker group -> resume
    -> per step: next global batch -> one dp_split train call -> eval / log / checkpoint
    -> final eval + stage extras -> HF export (+ tokenizer) -> curves PNG

A stage (``aligner.sft``, ``aligner.rm``) subclasses :class:`Stage` and says which role
and worker class it uses, how a global batch is collated and which worker methods train
and evaluate. The driver sends each step's whole global batch (trainer.global_batch_size
samples) in one dp_split call; the worker splits its share into micro-batches of
trainer.micro_batch_size and normalizes the loss over the global batch (gradient
accumulation).

Checkpoints (every trainer.save_every steps and at the end) go through
:class:`aligner.trainers.checkpointing.CheckpointManager`: the role's workers write model +
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
from typing import Any

from aligner.cli import UserError, config_yaml
from aligner.config import AlignerConfig
from aligner.trainers import preemption

log = logging.getLogger("aligner")


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
    from aligner.data.task import build_task_tokenizer

    return cfg.tokenizer.path or build_task_tokenizer(cfg.task, os.path.join(work_dir, "task"))


class Stage:
    """One standalone training stage on one role's worker group.

    Subclasses set ``name`` (sft | rm), ``role`` (a RoleConfig name), ``data_kind`` (sft | pairs),
    ``train_method`` / ``eval_method`` (dp_split worker methods returning metric dicts),
    ``bar_keys`` / ``plot_keys``, and implement :meth:`worker_cls`, :meth:`worker_kwargs`,
    :meth:`collate`; :meth:`finish` adds end-of-run metrics and export extras.
    """

    name = ""
    role = ""
    data_kind = ""
    train_method = ""
    eval_method = ""
    eval_keys: tuple[str, ...] = ("loss",)
    bar_keys: tuple[str, ...] = ("loss", "tokens_per_s")
    plot_keys: tuple[str, ...] = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s")

    def __init__(self, cfg: AlignerConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.group = None
        self.placement = None
        self.tokenizer = None
        self.tok_path = ""
        self.data = None

    # ---- hooks -------------------------------------------------------------------------
    def worker_cls(self) -> type:
        raise NotImplementedError

    def worker_kwargs(self) -> dict:
        raise NotImplementedError

    def collate(self, examples: list[dict]) -> dict:
        """Encoded examples -> the batch dict the train/eval methods take."""
        raise NotImplementedError

    def num_tokens(self, batch: dict) -> int:
        """Real (non-padding) tokens the step processed, for tokens/s."""
        return int(sum(int(v.sum()) for k, v in batch.items() if k.endswith("attention_mask")))

    def finish(self) -> tuple[dict, dict]:
        """End-of-run (metrics to log, extra export arguments). Called after the final eval."""
        return {}, {}

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        for cand in (tok.pad_token_id, tok.eos_token_id, 0):
            if cand is not None:
                return int(cand)
        return 0

    # ---- phases ------------------------------------------------------------------------
    def run(self) -> int:
        """The whole stage; returns the exit code."""
        cfg = self.cfg
        cfg.check_paths((self.role,))
        self.check_init()
        if cfg.plan_only:
            from aligner.plan import main_from_config

            return main_from_config(cfg)
        self.check_machine()
        from aligner.trainers.run_dir import claim_output_dir

        with claim_output_dir(cfg, {f"{self.role}.init": self.init_path()}):  # checked and locked until the end
            self.prepare_output()
            self.load_inputs()
            from aligner.workers.ray_runtime import init_ray, shutdown_ray

            info = init_ray(cfg.cluster)
            preemption.install(self.name, cfg.trainer.preempt_grace_s)  # after Ray: its handler would crash on SIGTERM
            try:
                self.start_group()
                return self.train()
            finally:
                preemption.uninstall()
                self.stop_group()
                if info.started and info.local:
                    shutdown_ray()

    def check_machine(self) -> None:
        """UserError (before Ray starts) when this machine cannot hold the role's workers."""
        from aligner.workers.placement import local_shortfall

        why = local_shortfall(self.cfg, (self.role,))
        if why:
            r = self.role
            raise UserError(f"this machine cannot hold the run ({why}): lower {r}.resources.cpus_per_worker, "
                            f"{r}.resources.gpus_per_node or {r}.parallel sizes, or submit to a Ray cluster that has "
                            "them (ray job submit ... / cluster.address=auto)")

    def init_path(self) -> str:
        """Where the role's weights start from ("" = random init)."""
        return self.cfg.role(self.role).init

    def check_init(self) -> None:
        """UserError naming <role>.init when it is neither an HF model dir nor a run dir with hf/ inside."""
        from aligner.runtime.role import resolve_init

        try:
            resolve_init(self.init_path())
        except ValueError as e:
            raise UserError(f"{self.role}.{e}") from None

    def prepare_output(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(config_yaml(self.cfg))

    def load_inputs(self) -> None:
        """Tokenizer (checked against model.vocab_size) and the encoded train/eval splits."""
        from aligner.data.pipeline import load_data
        from aligner.data.tokenizer import load_tokenizer

        cfg = self.cfg
        try:
            self.tok_path = tokenizer_path(cfg, str(self.out))
            self.tokenizer = load_tokenizer(self.tok_path, cfg.tokenizer.chat_template)
        except (OSError, ValueError) as e:
            raise UserError(f"tokenizer.path={cfg.tokenizer.path!r}: {e}") from None
        from aligner.runtime.role import check_tokenizer_fits

        check_tokenizer_fits(len(self.tokenizer), self.init_path(), cfg.model, self.role)
        try:
            self.data = load_data(self.data_kind, cfg.data, cfg.task, self.tokenizer, str(self.out))
        except ValueError as e:
            raise UserError(str(e)) from None
        if not self.data.train:
            raise UserError(f"no {self.data_kind} training examples left after loading (see the data: log line above): check data.*")

    def start_group(self) -> None:
        from aligner.workers.group import role_worker_group
        from aligner.workers.placement import placement_from_config

        self.placement = placement_from_config(self.cfg, (self.role,))
        t0 = time.perf_counter()
        self.group = role_worker_group(self.cfg, self.role, self.worker_cls(), self.placement, kwargs=self.worker_kwargs())
        p = self.cfg.role(self.role).parallel
        log.info("%s: %d %s worker(s) (tp=%d pp=%d dp=%d) ready in %.1f s", self.name, p.world_size, self.role,
                 p.tp_size, p.pp_size, p.dp_size, time.perf_counter() - t0)

    def stop_group(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        if self.placement is not None:
            self.placement.remove()

    # ---- the loop ------------------------------------------------------------------------
    def resume(self, ckpts, it) -> int:
        """Restore the latest checkpoint when resume=true; returns the step it ends at (0 = fresh start)."""
        from aligner.trainers.checkpointing import load_trainer_state

        if not self.cfg.resume:
            return 0
        latest = ckpts.latest()
        if latest is None:
            log.info("%s: resume=true but %s holds no complete checkpoint: starting from step 0", self.name, ckpts.root)
            return 0
        self.group.load(str(latest / self.role)).get()
        ckpts.adopt(latest)  # this run continues that one: its checkpoints are ours to prune
        state = load_trainer_state(latest)
        try:
            it.load_state_dict(state["data"])
        except ValueError as e:
            raise UserError(f"resume from {latest}: {e}") from None
        log.info("%s: resumed from %s (step %d)", self.name, latest, state["step"])
        return int(state["step"])

    def save(self, ckpts, step: int, it) -> None:
        tmp = ckpts.begin(step)
        self.group.save(str(tmp / self.role)).get()
        ckpts.commit(tmp, step, {"step": step, "stage": self.name, "data": it.state_dict()})

    def train(self) -> int:
        from aligner.data.sampler import DataIterator
        from aligner.tracking import MetricsLogger
        from aligner.trainers.checkpointing import CheckpointManager

        tr = self.cfg.trainer
        ckpts = CheckpointManager(self.out, stage=self.name)
        it = DataIterator(self.data.train, seed=self.cfg.data.shuffle_seed)
        start = self.resume(ckpts, it)
        last_saved = start if start > 0 else -1
        logger = MetricsLogger(self.out, self.name, tr.max_steps, start_step=start, progress=tr.progress, bar_keys=self.bar_keys)
        try:
            preemption.stop_at_step_boundary(start, last_saved, lambda: None, str(ckpts.root))
            for step in range(start + 1, tr.max_steps + 1):
                metrics = self.train_step(it)
                last = step == tr.max_steps
                if last or (tr.eval_every and step % tr.eval_every == 0):
                    metrics.update(self.evaluate())
                if last:
                    extra_metrics, _ = self._finish_once()
                    metrics.update(extra_metrics)
                logger.log(step, metrics)
                if last or (tr.save_every and step % tr.save_every == 0):
                    self.save(ckpts, step, it)
                    last_saved = step
                preemption.stop_at_step_boundary(step, last_saved, lambda: self.save(ckpts, step, it), str(ckpts.root))
            self.export()
        finally:
            logger.close()
        self.plot()
        return 0

    def train_step(self, it) -> dict:
        batch = self.collate(it.next_batch(self.cfg.trainer.global_batch_size))
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

    def _finish_once(self) -> tuple[dict, dict]:
        if not hasattr(self, "_finished"):
            self._finished = self.finish()
        return self._finished

    def export(self) -> None:
        """HF export (weights, config, tokenizer, stage extras) to output_dir/hf, and summary.json."""
        _, extras = self._finish_once()
        t0 = time.perf_counter()
        path = first([p for p in self.group.export_hf(str(self.out / "hf"), self.tok_path, **extras).get() if p])
        log.info("%s: HF export at %s (%.1f s)", self.name, path, time.perf_counter() - t0)

    def plot(self) -> None:
        from aligner.tracking import plot_curves, read_metrics

        png = plot_curves(self.out / "metrics.jsonl", self.out / "curves.png", self.plot_keys, title=f"{self.name} ({self.cfg.preset})")
        rows = read_metrics(self.out / "metrics.jsonl")
        summary = {"stage": self.name, "steps": rows[-1]["step"] if rows else 0, **(rows[-1] if rows else {})}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        log.info("%s: curves %s; final %s", self.name, png, {k: round(v, 4) for k, v in summary.items() if isinstance(v, float)})
