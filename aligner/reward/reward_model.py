"""RewardModel: the Ray-free Bradley-Terry reward model on its parallel layout.

Owns scoring (the scalar head at the last real token of each sequence) and Bradley-Terry
training on preference pairs (Bradley & Terry 1952; Ouyang et al. 2022, eq. 1):
loss = -log sigmoid(r(chosen) - r(rejected)), mean over the global batch of pairs, with
pairwise accuracy and mean margin as metrics. Chosen and rejected rows of a pair are
interleaved (2i, 2i+1) so they always share a micro-batch and a pipeline pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aligner.model.llama import last_token_scores
from aligner.runtime.role import RoleModel
from aligner.runtime.runner import from_last_pp_stage


def interleave_pairs(batch: dict[str, torch.Tensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """chosen_/rejected_ input_ids and attention_mask [B, Tc], [B, Tr] -> input_ids/attention_mask [2B, T]
    with row 2i = chosen i and row 2i+1 = rejected i (right padded to the longer length)."""
    c, r = batch["chosen_input_ids"], batch["rejected_input_ids"]
    t = max(c.shape[1], r.shape[1])

    def pad(x, fill):
        return torch.cat([x, x.new_full((x.shape[0], t - x.shape[1]), fill)], dim=1)

    ids = torch.stack([pad(c, pad_id), pad(r, pad_id)], dim=1).reshape(-1, t)
    attn = torch.stack([pad(batch["chosen_attention_mask"], 0), pad(batch["rejected_attention_mask"], 0)], dim=1).reshape(-1, t)
    return {"input_ids": ids, "attention_mask": attn}


class RewardModel(RoleModel):
    """A scalar-head role (kind "score") trained as a Bradley-Terry reward model."""

    kind = "score"

    def scores(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> torch.Tensor:
        """batch: input_ids [B, T], attention_mask [B, T] (right padded) -> scores [B] fp32."""
        keys = ("input_ids", "attention_mask")
        return self.runner.forward({k: batch[k] for k in keys}, lambda v, mb: last_token_scores(v, mb["attention_mask"]), micro_batch_size)

    def bt_step(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of the Bradley-Terry loss.

        batch: chosen_input_ids, chosen_attention_mask, rejected_input_ids, rejected_attention_mask
        ([B, T*] each). micro_batch_size counts pairs. Returns loss, accuracy, margin (global means
        over pairs), grad_norm, lr, pad_tokens and pad_fraction (:meth:`ModelRunner.padding_metrics`).
        """
        flat = interleave_pairs(batch)
        pairs = float(batch["chosen_input_ids"].shape[0])
        norm = self.normalizer(pairs)
        sums: dict[str, float] = {}

        def loss_fn(v, mb):
            s = last_token_scores(v, mb["attention_mask"]).view(-1, 2)
            margin = s[:, 0] - s[:, 1]
            loss = -F.logsigmoid(margin).sum()
            for k, x in (("loss", loss), ("accuracy", (margin > 0).float().sum()), ("margin", margin.sum())):
                sums[k] = sums.get(k, 0.0) + float(x.detach())
            return loss / norm

        stats = self.runner.optimizer_step(flat, loss_fn, 2 * micro_batch_size, unit=2)
        sums = from_last_pp_stage(sums, self.dims)
        return {
            **self.runner.padding_metrics(),
            **{k: self.dp_mean(v, pairs) for k, v in sorted(sums.items())},
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "skipped": stats.get("skipped", 0.0),
            **{k: v for k, v in stats.items() if k.startswith("moe_")},  # router statistics of an MoE model
        }

    @torch.no_grad()
    def bt_eval(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> dict[str, float]:
        """Held-out loss, pairwise accuracy and mean margin over this call's global batch of pairs."""
        flat = interleave_pairs(batch)
        s = self.scores(flat, 2 * micro_batch_size).view(-1, 2)
        margin = s[:, 0] - s[:, 1]
        n = float(margin.shape[0])
        return {
            "loss": self.dp_mean(float(-F.logsigmoid(margin).sum()), n),
            "accuracy": self.dp_mean(float((margin > 0).float().sum()), n),
            "margin": self.dp_mean(float(margin.sum()), n),
        }
