"""Ray worker shell of the SPIN stage: the DPO stage's actor and frozen reference (:class:`DPOWorker`), the
reference reset to the policy at each self-play round's start, and the DPO step with SPIN's loss (DPO's sigmoid
with beta = spin.lam, :func:`aligner.algorithms.spin_loss`)."""

from __future__ import annotations

import torch

from aligner.config import DPOConfig
from aligner.workers.dispatch import dispatch
from aligner.workers.dpo import DPOWorker


class SPINWorker(DPOWorker):
    """The SPIN actor: a trainable policy, its rollout engine (the round's generations) and the previous iterate."""

    def spin_dpo(self) -> DPOConfig:
        """SPIN's loss as the DPO step's: sigmoid, beta = spin.lam, no label smoothing, no NLL term."""
        return DPOConfig(beta=self.cfg.spin.lam, loss_type="sigmoid")

    @dispatch("broadcast")
    def reset_reference(self) -> None:
        """p_theta_t := the current policy: its weights copied into the reference (same layout and ranks)."""
        if self.reference is None:
            raise RuntimeError("SPIN needs a reference copy of the policy (actor.lora.rank=0)")
        with torch.no_grad():
            self.reference.runtime.module.load_state_dict(self.policy.runtime.module.state_dict())

    @dispatch("dp_split")
    def spin_step(self, batch: dict) -> dict:
        batch = {**batch, **self.reference_log_probs(batch)}
        return self.policy.dpo_step(batch, self.spin_dpo(), self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def spin_eval(self, batch: dict) -> dict:
        batch = {**batch, **self.reference_log_probs(batch)}
        return self.policy.dpo_eval(batch, self.spin_dpo(), self.cfg.trainer.micro_batch_size)
