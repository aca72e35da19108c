"""Critic: the Ray-free value model on its parallel layout.

Owns per-token values V(s_t) for PPO with GAE (Schulman et al. 2016) and the clipped
value loss (PPO2 / NeMo-Aligner): 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2),
token-mean over the global mini-batch. The value of response token j is read at the
position whose hidden state produces token j (prompt_len + j - 1).
"""

from __future__ import annotations

import torch

from aligner import algorithms as alg
from aligner.config import AlgorithmConfig
from aligner.protocol import values_to_response
from aligner.runtime.role import RoleModel
from aligner.runtime.runner import from_last_pp_stage


class Critic(RoleModel):
    """A scalar-head role (kind "score") used as the value function."""

    kind = "score"

    def values(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> torch.Tensor:
        """batch: input_ids [B, T], prompt_lens [B], response_mask [B, R] -> values [B, R] fp32."""
        keys = ("input_ids", "prompt_lens", "response_mask")
        return self.runner.forward(
            {k: batch[k] for k in keys}, lambda v, mb: values_to_response(v, mb["prompt_lens"], mb["response_mask"]), micro_batch_size
        )

    def value_step(self, batch: dict[str, torch.Tensor], algo: AlgorithmConfig, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of the clipped value loss.

        batch: input_ids, prompt_lens, response_mask, values (old, [B, R]), returns [B, R].
        Returns value_loss, value_clipfrac (global token means), grad_norm, lr, pad_tokens and
        pad_fraction (:meth:`aligner.runtime.runner.ModelRunner.padding_metrics`).
        """
        norm = self.normalizer(batch["response_mask"].sum())
        sums: dict[str, float] = {}

        def loss_fn(v, mb):
            mask = mb["response_mask"]
            vals = values_to_response(v, mb["prompt_lens"], mask)
            loss, m = alg.value_loss(vals, mb["values"], mb["returns"], mask, algo.value_clip_eps, loss_agg="token-mean")
            n = mask.sum()
            for k, x in (("value_loss", loss * n), ("value_clipfrac", m["value_clipfrac"] * n)):
                sums[k] = sums.get(k, 0.0) + float(x.detach())
            return algo.vf_coef * loss * n / norm

        stats = self.runner.optimizer_step(batch, loss_fn, micro_batch_size)
        sums = from_last_pp_stage(sums, self.dims)
        count = float(batch["response_mask"].sum())
        return {
            **{k: self.dp_mean(v, count) for k, v in sorted(sums.items())},
            **self.runner.padding_metrics(),
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "skipped": stats.get("skipped", 0.0),
            **{k: v for k, v in stats.items() if k.startswith("moe_")},  # router statistics of an MoE model
        }
