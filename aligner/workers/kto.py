"""Ray worker shell of the KTO stage: the DPO stage's actor with its frozen reference (:class:`DPOWorker`),
declaring the KTO step and eval (:mod:`aligner.actor.kto`).

Per step, before the update: the reference's sequence log-probs of the matched rows and of the mismatched
(KL) rows, the policy's of the KL rows (no gradient, as TRL's ``KTOTrainer``), and from the last two the
reference point z0 over the global batch (a dp all-reduce)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from aligner.actor.kto import kto_eval, kto_reference_point, kto_sequence_log_probs, kto_step
from aligner.nn.lora import disable_adapters
from aligner.workers.dispatch import dispatch
from aligner.workers.dpo import DPOWorker


class KTOWorker(DPOWorker):
    """The KTO actor: a trainable policy, its rollout engine (greedy eval) and a frozen reference copy."""

    def _with_reference_point(self, batch: dict) -> dict:
        mbs = self.cfg.trainer.micro_batch_size
        ref = self.reference if self.reference is not None else self.policy
        scope = disable_adapters(self.policy.runtime.module) if self.reference is None else nullcontext()
        with scope:
            ref_logps = kto_sequence_log_probs(ref, batch, mbs)
            ref_kl = kto_sequence_log_probs(ref, batch, mbs, kl=True)
        kl = kto_sequence_log_probs(self.policy, batch, mbs, kl=True)
        z0 = kto_reference_point(self.policy, kl, ref_kl)
        return {**batch, "ref_logps": ref_logps, "z0": z0.to(torch.float32)}

    @dispatch("dp_split")
    def kto_step(self, batch: dict) -> dict:
        return kto_step(self.policy, self._with_reference_point(batch), self.cfg.kto, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def kto_eval(self, batch: dict) -> dict:
        return kto_eval(self.policy, self._with_reference_point(batch), self.cfg.kto, self.cfg.trainer.micro_batch_size)
