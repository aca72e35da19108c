"""The SFT trainer behind `python -m aligner.sft`: supervised fine-tuning of the policy (the actor role).

Owns the SFT stage on top of :mod:`aligner.trainers.supervised` (and its loop, :mod:`aligner.trainers.loop`):
the loss is next-token NLL on response
tokens only (prompt + response rows, or chat rows with loss on assistant turns), optional
sequence packing (``data.packing``), the actor's tp/pp/dp layout (``actor.parallel``),
gradient accumulation to trainer.global_batch_size, warmup + cosine LR (``actor.optim``),
periodic validation loss, and at the end the held-out greedy accuracy on the built-in task
(:func:`aligner.trainers.evaluation.evaluate_greedy`, the evaluator PPO uses too; logged in the
last step's row as ``task_accuracy``, ``task_n``, ``task_mean_response_len``,
``task_accuracy_carry``, ``task_accuracy_no_carry`` and ``task_dropped_carry``), an aligner checkpoint and an HF export
(with the tokenizer) in ``output_dir/hf``.

With ``actor.prompt_learning.type`` = prompt_tuning | p_tuning (:mod:`aligner.model.prompt`) the
base is frozen and only the virtual prompt trains; checkpoints hold the prompt (and its optimizer
state) only, the export is ``output_dir/prompt`` (prompt.safetensors + prompt.json), and the
greedy accuracy runs through the policy's forward with the virtual tokens (not the rollout engine).

Only the actor role's worker group is placed (ActorWorker: training and, for the accuracy,
its rollout engine).
"""

from __future__ import annotations

import logging

from aligner.config import AlignerConfig, prompt_learning_of
from aligner.data.collate import collate_sft, pack_sft
from aligner.data.pipeline import load_data
from aligner.runtime.role import resolve_init
from aligner.trainers.evaluation import evaluate_greedy
from aligner.trainers.supervised import SupervisedTrainer, first
from aligner.workers.actor import ActorWorker

log = logging.getLogger("aligner")


class SFTTrainer(SupervisedTrainer):
    """Response-only NLL on the actor role; see the module docstring."""

    name, role, data_kind = "sft", "actor", "sft"
    train_method, eval_method = "sft_step", "sft_eval"
    eval_keys = ("loss",)
    plot_keys = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "task_accuracy")

    def worker_cls(self) -> type:

        return ActorWorker

    def worker_kwargs(self) -> dict:
        kw = {"cfg": self.cfg, "role": "actor", "total_steps": self.cfg.trainer.max_steps, "eos_token_id": self.tokenizer.eos_token_id}
        pl = prompt_learning_of(self.cfg)
        if pl is not None and pl.enabled and pl.init == "text":
            # the tokenizer's ids of init_text, special tokens included, as PEFT's PromptTuningInit.TEXT takes them
            kw["prompt_init_ids"] = list(self.tokenizer(pl.init_text)["input_ids"])
        return kw

    def export(self) -> None:
        """The HF export; with prompt learning the prompt export instead (:meth:`export_prompt`)."""
        pl = prompt_learning_of(self.cfg)
        if pl is None or not pl.enabled:
            super().export()
            return
        self.export_prompt()

    def export_prompt(self) -> None:
        """output_dir/prompt: prompt.safetensors + prompt.json naming the base model. The frozen base is
        exported to output_dir/hf only when it has no init (a seeded random base), so the prompt has a
        base to reload against; with actor.init the base is that dir, unchanged, and not copied."""
        base = self.init_path()
        if not base:
            super().export()
            base = str(self.out / "hf")
        else:
            base = str(resolve_init(base).resolve())
        extra = {"tokenizer": self.tok_path, "steps": self.step}
        path = first([p for p in self.group.export_prompt(str(self.out / "prompt"), base, extra).get() if p])
        log.info("sft: prompt export at %s (base model %s)", path, base)

    def collate(self, examples: list[dict]) -> dict:
        """input_ids, attention_mask, loss_mask [B, T] (plus segment_ids, position_ids when packing)."""

        if self.cfg.data.packing:
            return pack_sft(examples, self.cfg.data.max_seq_len, self.pad_id)
        return collate_sft(examples, self.pad_id)

    def final_results(self) -> tuple[dict, dict]:
        """Held-out greedy accuracy on the built-in task (logged as task_*); no export extras."""
        return task_accuracy_results(self), {}


def task_accuracy_results(trainer: SupervisedTrainer) -> dict[str, float]:
    """The held-out greedy accuracy of an actor-role stage's current policy on the built-in task
    (:func:`aligner.trainers.evaluation.evaluate_greedy` on trainer.group): task_accuracy, task_n,
    task_mean_response_len, task_accuracy_carry, task_accuracy_no_carry, task_dropped_carry;
    {} (and a log line) when data.train_path is set."""
    cfg = trainer.cfg
    if cfg.data.train_path:
        log.info("%s: data.train_path is set: skipping the built-in task's greedy accuracy", trainer.name)
        return {}

    prompts = load_data("prompt", cfg.data, cfg.task, trainer.tokenizer, str(trainer.out)).eval
    res = evaluate_greedy(trainer.group, prompts, trainer.tokenizer, cfg).metrics
    log.info(
        "%s: held-out greedy accuracy %.3f on %d problems (%.3f without a carry, %.3f with one; mean response %.1f tokens)",
        trainer.name,
        res["accuracy"],
        int(res["n"]),
        res.get("accuracy_no_carry", float("nan")),
        res.get("accuracy_carry", float("nan")),
        res["mean_response_len"],
    )
    keys = ("accuracy", "n", "mean_response_len", "accuracy_carry", "accuracy_no_carry", "dropped_carry")
    return {f"task_{k}": res[k] for k in keys if k in res}


def run_sft(cfg: AlignerConfig) -> int:
    """Run the SFT stage for a validated config; returns the exit code."""
    return SFTTrainer(cfg).run()
