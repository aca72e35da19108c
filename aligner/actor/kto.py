"""KTO on the policy (Ethayarajh et al. 2024): the step and the held-out metrics of the KTO stage, on any
tp/pp/dp layout through the policy's runner, written once per micro-batch like :meth:`Policy.dpo_step`.

A KTO batch (:func:`aligner.trainers.kto.collate_unpaired`, this rank's share of the global batch):
input_ids [B, T] int64, prompt_lens [B] int64, response_mask [B, R] float32 (the completion's tokens),
label [B] bool (true = desirable), and the mismatched rows of the KL reference point, each prompt with
another example's completion: kl_input_ids, kl_prompt_lens, kl_response_mask. The reference's sequence
log-probs (ref_logps [B]) and the reference point (z0, 0-dim, the same on every rank) are added by the
worker before the step.
"""

from __future__ import annotations

import torch

from aligner import algorithms as alg
from aligner.actor.policy import Policy
from aligner.config import KTOConfig
from aligner.runtime.runner import dp_sum, from_last_pp_stage

KL_KEYS = ("kl_input_ids", "kl_prompt_lens", "kl_response_mask")


def kto_sequence_log_probs(policy: Policy, batch: dict, micro_batch_size: int, kl: bool = False) -> torch.Tensor:
    """The policy's sequence log-probs (sums over the completion's tokens, nats), no gradient: [B] fp32 of the
    matched rows, or with `kl` of the mismatched ones. Collective over the policy's ranks."""
    keys = KL_KEYS if kl else ("input_ids", "prompt_lens", "response_mask")
    rows = {k: batch[p] for k, p in zip(("input_ids", "prompt_lens", "response_mask"), keys)}
    return policy.log_probs(rows, micro_batch_size).sum(-1)


def kto_reference_point(policy: Policy, kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z0 of the global batch: ``max(0, mean over every dp rank's mismatched pairs of (policy - reference))``
    (:func:`aligner.algorithms.kto_reference_point` over the whole batch; TRL averages per device, then over
    devices, the same with equal shares). Collective over dp."""
    diff = (kl_logps - ref_kl_logps).detach().double()
    return torch.tensor(max(0.0, policy.dp_mean(float(diff.sum()), float(diff.numel()))))


def _sums(losses: torch.Tensor, rewards: torch.Tensor, logps: torch.Tensor, good: torch.Tensor) -> dict[str, torch.Tensor]:
    g, b = good.to(rewards.dtype), (~good).to(rewards.dtype)
    return {
        "kto_loss": losses.detach().sum(),
        "rewards_chosen": (rewards * g).sum(),
        "rewards_rejected": (rewards * b).sum(),
        "logps_chosen": (logps.detach() * g).sum(),
        "logps_rejected": (logps.detach() * b).sum(),
        "desirable": g.sum(),
    }


def _metrics(policy: Policy, sums: dict[str, float], n: float, z0: float) -> dict[str, float]:
    """Global means: kto_loss per example, rewards and log-probs per desirable (chosen) / undesirable
    (rejected) example, the margin of the two reward means, and kl (z0). Collective over dp."""
    total = {k: dp_sum(v, policy.dims) for k, v in sums.items()}
    n_all = dp_sum(n, policy.dims)
    n_good = total["desirable"]
    n_bad = n_all - n_good
    out = {"kto_loss": total["kto_loss"] / max(n_all, 1e-12)}
    for k in ("rewards_chosen", "logps_chosen"):
        out[k] = total[k] / max(n_good, 1e-12)
    for k in ("rewards_rejected", "logps_rejected"):
        out[k] = total[k] / max(n_bad, 1e-12)
    out["reward_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
    out["loss"], out["kl"] = out["kto_loss"], z0
    return out


def kto_step(policy: Policy, batch: dict, kto: KTOConfig, micro_batch_size: int) -> dict[str, float]:
    """One optimizer step of the KTO loss (:func:`aligner.algorithms.kto_loss`), the mean over the global
    batch of examples (exact across micro-batches and dp ranks: each part's sum over the global count).

    batch: see the module docstring, with ref_logps [B] and z0 (0-dim). Returns loss (= kto_loss),
    rewards_chosen / rewards_rejected (beta times the log-ratio, means over desirable / undesirable
    examples), reward_margin, logps_chosen / logps_rejected, kl (z0), grad_norm, lr, skipped.
    """
    rows = {k: batch[k] for k in ("input_ids", "prompt_lens", "response_mask", "ref_logps")}
    rows["label"] = batch["label"].to(torch.float32)
    n = float(rows["input_ids"].shape[0])
    norm = policy.normalizer(n)
    z0 = batch["z0"].reshape(())
    sums: dict[str, float] = {}

    def loss_fn(output, mb):  # logits [b, R, V/tp] at the response positions, or (log_probs, entropy)
        lp = (policy._label_log_probs(output, mb, 1.0) * mb["response_mask"]).sum(-1)
        good = mb["label"] > 0.5
        losses, rewards = alg.kto_loss(lp, mb["ref_logps"].to(lp.dtype), good, z0, kto.beta, kto.desirable_weight, kto.undesirable_weight)
        for k, v in _sums(losses, rewards, lp, good).items():
            sums[k] = sums.get(k, 0.0) + float(v)
        return losses.sum() / norm

    inputs = policy._response_model_inputs(rows, ("input_ids", "response_mask", "ref_logps", "label"), 1.0)
    stats = policy.runner.optimizer_step(inputs, loss_fn, micro_batch_size)
    sums = from_last_pp_stage(sums, policy.dims)
    out = _metrics(policy, sums, n, float(z0))
    return {
        **out,
        **policy.runner.padding_metrics(),
        "grad_norm": stats["grad_norm"],
        "lr": stats["lr"],
        "skipped": stats.get("skipped", 0.0),
    }


@torch.no_grad()
def kto_eval(policy: Policy, batch: dict, kto: KTOConfig, micro_batch_size: int) -> dict[str, float]:
    """Held-out :func:`kto_step` metrics (no update) over this call's global batch."""
    lp = kto_sequence_log_probs(policy, batch, micro_batch_size)
    good = batch["label"].bool()
    z0 = batch["z0"].reshape(())
    losses, rewards = alg.kto_loss(lp, batch["ref_logps"].to(lp.dtype), good, z0, kto.beta, kto.desirable_weight, kto.undesirable_weight)
    sums = {k: float(v) for k, v in _sums(losses, rewards, lp, good).items()}
    return _metrics(policy, sums, float(lp.shape[0]), float(z0))
