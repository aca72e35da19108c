"""The RM trainer behind `python -m aligner.rm`: a Bradley-Terry reward model on preference pairs (the reward role).

Owns the RM stage on top of :mod:`aligner.trainers.supervised` (and its loop, :mod:`aligner.trainers.loop`):
loss -log sigmoid(r(chosen) - r(rejected)) with the scalar head on the last token of each
sequence (:mod:`aligner.reward.reward_model`), metrics loss, pairwise accuracy and mean margin
(train and held out), and at the end the reward normalization statistics (mean and std of the
RM's scores over the training pairs' responses, chosen and rejected), logged in the last
step's row as ``reward_mean`` / ``reward_std`` and written as ``reward_stats.json`` in the HF
export, so PPO can standardize scores.

Initialization: ``reward.init`` (an SFT run dir, an RM dir or an HF model dir). With
conf=tiny on the built-in task and reward.init empty, the RM starts from the tiny SFT run
(``outputs/tiny/sft``, relative to the working directory) when that run has exported its
model, else from random weights; the log says which.

Only the reward role's worker group is placed (RewardWorker).
"""

from __future__ import annotations

import logging
import math

from aligner.config import AlignerConfig
from aligner.data.collate import collate_pairs
from aligner.reward.reward_model import interleave_pairs
from aligner.trainers.supervised import SupervisedTrainer, eval_chunks, log_init, tiny_sft_init
from aligner.workers.reward import RewardWorker

log = logging.getLogger("aligner")

MAX_STATS_PAIRS = 4096  # training pairs scored for reward_stats.json (2 responses each)


def default_init(cfg: AlignerConfig) -> str:
    """reward.init, or for conf=tiny on the built-in task the tiny SFT run (:func:`tiny_sft_init`)."""
    return tiny_sft_init(cfg, cfg.reward.init)


class RMTrainer(SupervisedTrainer):
    """Bradley-Terry training of the reward role; see the module docstring."""

    name, role, data_kind = "rm", "reward", "pairs"
    train_method, eval_method = "bt_step", "bt_eval"
    eval_keys = ("loss", "accuracy", "margin")
    bar_keys = ("loss", "accuracy", "tokens_per_s")
    plot_keys = ("loss", "eval_loss", "accuracy", "eval_accuracy", "margin", "eval_margin", "lr", "grad_norm", "tokens_per_s")

    def __init__(self, cfg: AlignerConfig):
        super().__init__(cfg)
        self.init = default_init(cfg)

    def init_path(self) -> str:
        return self.init

    def worker_cls(self) -> type:

        return RewardWorker

    def worker_kwargs(self) -> dict:
        log_init(self.cfg, "the reward model", self.init, "reward.init")
        return {"cfg": self.cfg, "total_steps": self.cfg.trainer.max_steps, "init": self.init}

    def collate(self, examples: list[dict]) -> dict:
        """chosen_/rejected_ input_ids and attention_mask [B, T]."""

        return collate_pairs(examples, self.pad_id)

    def reward_stats(self) -> dict:
        """Mean and std of the RM's scores over the responses (chosen and rejected) of the first
        MAX_STATS_PAIRS training pairs: {"mean", "std", "num_scores"}."""

        dp = self.cfg.reward.parallel.dp_size
        pairs = self.data.train[:MAX_STATS_PAIRS]
        total = sq = 0.0
        n = 0
        for chunk in eval_chunks(pairs, self.cfg.trainer.eval_batch_size, dp):
            flat = interleave_pairs(self.collate(chunk), self.pad_id)
            s = self.group.scores(flat).get().double()
            total, sq, n = total + float(s.sum()), sq + float((s * s).sum()), n + s.numel()
        mean = total / n
        std = math.sqrt(max(sq / n - mean * mean, 0.0))
        return {"mean": mean, "std": std, "num_scores": n}

    def final_results(self) -> tuple[dict, dict]:
        """Reward stats of the trained RM: logged as reward_mean / reward_std, exported as reward_stats.json."""
        stats = self.reward_stats()
        log.info("rm: reward stats over %d training responses: mean %.4f std %.4f", stats["num_scores"], stats["mean"], stats["std"])
        return {"reward_mean": stats["mean"], "reward_std": stats["std"]}, {"stats": stats}


def run_rm(cfg: AlignerConfig) -> int:
    """Run the RM stage for a validated config; returns the exit code."""
    return RMTrainer(cfg).run()
