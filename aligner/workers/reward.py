"""Ray worker shell of the reward role: scoring (PPO) and Bradley-Terry training (RM stage)."""

from __future__ import annotations

from typing import Optional

import torch

from aligner.config import AlignerConfig
from aligner.parallel.dims import ParallelDims
from aligner.reward.reward_model import RewardModel
from aligner.workers.dispatch import dispatch


class RewardWorker:
    """RewardModel on the reward role's layout; initialized from reward.init (SFT policy or an RM)."""

    def __init__(self, cfg: AlignerConfig, total_steps: int = 1, init: str = "", dims: Optional[ParallelDims] = None):
        self.cfg = cfg
        self.dims = dims or ParallelDims()
        torch.manual_seed(cfg.trainer.seed)
        rc = cfg.reward
        lora = rc.lora if cfg.stage == "rm" else None  # PPO's reward model is frozen (its init is an HF export)
        self.rm = RewardModel(
            cfg.model, rc.parallel, rc.optim, self.dims, total_steps, init=init or rc.init, seed=cfg.trainer.seed + 2, lora=lora
        )

    @dispatch("dp_split")
    def scores(self, batch: dict) -> torch.Tensor:
        return self.rm.scores(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def bt_step(self, batch: dict) -> dict:
        return self.rm.bt_step(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def bt_eval(self, batch: dict) -> dict:
        return self.rm.bt_eval(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("broadcast")
    def save(self, ckpt_dir: str) -> None:
        self.rm.save(ckpt_dir)

    @dispatch("broadcast")
    def load(self, ckpt_dir: str) -> None:
        self.rm.load(ckpt_dir)

    @dispatch("broadcast")
    def export_hf(self, out_dir: str, tokenizer_path: str = "", stats: Optional[dict] = None) -> Optional[str]:
        return self.rm.export_hf(out_dir, tokenizer_path, extra_files={"reward_stats.json": stats} if stats else None)
