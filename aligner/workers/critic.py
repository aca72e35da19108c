"""Ray worker shell of the critic role: values and the value update (logic in Critic)."""

from __future__ import annotations

from typing import Optional

import torch

from aligner.config import AlignerConfig
from aligner.critic.critic import Critic
from aligner.parallel.dims import ParallelDims
from aligner.workers.dispatch import dispatch


class CriticWorker:
    """Critic on the critic role's layout; initialized from critic.init (by default the RM)."""

    def __init__(self, cfg: AlignerConfig, total_steps: int = 1, init: str = "", dims: Optional[ParallelDims] = None):
        self.cfg = cfg
        self.dims = dims or ParallelDims()
        torch.manual_seed(cfg.trainer.seed)
        rc = cfg.critic
        self.critic = Critic(
            cfg.model,
            rc.parallel,
            rc.optim,
            self.dims,
            total_steps,
            init=init or rc.init,
            seed=cfg.trainer.seed + 1,
            lora=rc.lora,
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        )

    @dispatch("dp_split")
    def values(self, batch: dict) -> torch.Tensor:
        return self.critic.values(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def value_step(self, batch: dict) -> dict:
        return self.critic.value_step(batch, self.cfg.algorithm, self.cfg.trainer.micro_batch_size)

    @dispatch("broadcast")
    def save(self, role_dir: str) -> None:
        self.critic.save(role_dir)

    @dispatch("broadcast")
    def load(self, role_dir: str) -> None:
        self.critic.load(role_dir)
