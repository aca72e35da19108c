"""Ray worker shell of the DPO stage: the actor (policy + rollout engine) plus a frozen reference in the same processes.

Thin (docs/design.md, "Thin Ray shells over Ray-free classes"): the losses are :meth:`aligner.actor.policy.Policy.dpo_step` / ``dpo_eval``; this
module adds the reference and declares how the driver calls them.

The reference is a second :class:`aligner.actor.policy.Policy` built from the policy's initial
weights (``actor.init``, or the same seeded random init) on the same tp/pp/dp layout and
ranks; it never steps and is never checkpointed (a resumed run rebuilds it from the same
init). Its sequence log-probs are computed per batch, under no_grad, behind one method,
:meth:`DPOWorker.reference_log_probs`; a LoRA policy (actor.lora.rank > 0) has no second copy:
its reference is itself with the adapters disabled, as NeMo-Aligner's LoRA DPO. Simplification: no precompute-and-cache over the dataset; the
reference forward costs one forward of 2B sequences per step.
"""

from __future__ import annotations

from typing import Optional

import torch

from aligner.actor.policy import Policy
from aligner.config import AlignerConfig, OptimConfig
from aligner.nn.lora import disable_adapters
from aligner.parallel.dims import ParallelDims
from aligner.workers.actor import ActorWorker
from aligner.workers.dispatch import dispatch


class DPOWorker(ActorWorker):
    """The DPO actor: a trainable policy, its rollout engine (greedy eval) and a frozen reference copy."""

    def __init__(
        self,
        cfg: AlignerConfig,
        total_steps: int = 1,
        init: str = "",
        eos_token_id: Optional[int] = None,
        dims: Optional[ParallelDims] = None,
    ):
        super().__init__(cfg, "actor", total_steps, init, eos_token_id, dims)
        self.reference: Optional[Policy] = None
        if self.policy.lora is None:
            torch.manual_seed(cfg.trainer.seed)
            # the same init and seed as the policy: the reference is the policy before its first step
            self.reference = Policy(
                cfg.model,
                cfg.actor.parallel,
                OptimConfig(),
                self.dims,
                1,
                init=init or cfg.actor.init,
                seed=cfg.trainer.seed,
                micro_batch_tokens=cfg.trainer.micro_batch_tokens,
            )

    def reference_log_probs(self, batch: dict) -> dict[str, torch.Tensor]:
        """The reference's sequence log-probs of this rank's pairs: {"ref_chosen_logps", "ref_rejected_logps": [B] fp32}.
        With LoRA (actor.lora.rank > 0) the reference is the policy itself with its adapters disabled
        (its frozen base: no second copy of the weights)."""
        if self.reference is None:
            with disable_adapters(self.policy.runtime.module):
                return self.policy.pair_sequence_log_probs(batch, self.cfg.trainer.micro_batch_size)
        return self.reference.pair_sequence_log_probs(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def dpo_step(self, batch: dict) -> dict:
        batch = {**batch, **self.reference_log_probs(batch)}
        return self.policy.dpo_step(batch, self.cfg.dpo, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def dpo_eval(self, batch: dict) -> dict:
        batch = {**batch, **self.reference_log_probs(batch)}
        return self.policy.dpo_eval(batch, self.cfg.dpo, self.cfg.trainer.micro_batch_size)
