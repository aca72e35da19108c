"""The DPO trainer behind `python -m aligner.dpo`: direct preference optimization of the policy (the actor role).

Owns the DPO stage on top of :mod:`aligner.trainers.supervised` (and its loop, :mod:`aligner.trainers.loop`):
preference pairs in every format the loader accepts (``data_kind`` "pairs", the RM stage's
data), the losses of :func:`aligner.algorithms.dpo_loss` (``dpo.loss_type`` sigmoid | ipo,
``dpo.label_smoothing``, ``dpo.beta``) plus RPO's NLL term (``dpo.rpo_alpha``), the reference
log-probs from a frozen copy of the initial policy in the actor's workers
(:class:`aligner.workers.dpo.DPOWorker`), metrics loss, dpo_loss, nll, rewards_chosen,
rewards_rejected, reward_accuracy, reward_margin, logps_chosen / logps_rejected (train and
held out), and at the end, on the built-in task, the held-out greedy accuracy as the SFT
stage reports it (``task_*``). Checkpoints, resume, HF export, TensorBoard and the curves PNG
are the supervised stages'.

Initialization: ``actor.init`` (an SFT run dir or an HF model dir). With conf=tiny on the
built-in task and actor.init empty, DPO starts from the tiny SFT run (``outputs/tiny/sft``,
relative to the working directory) when that run has exported its model, else from random
weights; the log says which. The reference starts from the same weights.
"""

from __future__ import annotations

import logging

from aligner.config import AlignerConfig
from aligner.data.collate import collate_pairs
from aligner.trainers.sft import task_accuracy_results
from aligner.trainers.supervised import SupervisedTrainer, log_init, tiny_sft_init
from aligner.workers.dpo import DPOWorker

log = logging.getLogger("aligner")


def default_init(cfg: AlignerConfig) -> str:
    """actor.init, or for conf=tiny on the built-in task the tiny SFT run (:func:`tiny_sft_init`)."""
    return tiny_sft_init(cfg, cfg.actor.init)


class DPOTrainer(SupervisedTrainer):
    """DPO-family training of the actor role against a frozen reference; see the module docstring."""

    name, role, data_kind = "dpo", "actor", "pairs"
    train_method, eval_method = "dpo_step", "dpo_eval"
    eval_keys = ("loss", "reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected")
    bar_keys = ("loss", "reward_accuracy", "tokens_per_s")
    plot_keys = (
        "loss",
        "eval_loss",
        "reward_accuracy",
        "eval_reward_accuracy",
        "rewards_chosen",
        "rewards_rejected",
        "eval_reward_margin",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "task_accuracy",
    )

    def __init__(self, cfg: AlignerConfig):
        super().__init__(cfg)
        self.init = default_init(cfg)

    def init_path(self) -> str:
        return self.init

    def worker_cls(self) -> type:
        return DPOWorker

    def worker_kwargs(self) -> dict:
        log_init(self.cfg, "the policy and the reference", self.init, "actor.init")
        return {"cfg": self.cfg, "total_steps": self.cfg.trainer.max_steps, "init": self.init, "eos_token_id": self.tokenizer.eos_token_id}

    def collate(self, examples: list[dict]) -> dict:
        """chosen_/rejected_ input_ids and attention_mask [B, T], prompt_lens [B]."""
        return collate_pairs(examples, self.pad_id)

    def final_results(self) -> tuple[dict, dict]:
        """Held-out greedy accuracy on the built-in task (task_*), as the SFT stage reports it."""
        return task_accuracy_results(self), {}


def run_dpo(cfg: AlignerConfig) -> int:
    """Run the DPO stage for a validated config; returns the exit code."""
    return DPOTrainer(cfg).run()
