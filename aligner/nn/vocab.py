"""Vocab-parallel per-token log-probs and entropy: no rank ever holds full-vocabulary logits.

Owns the fused softmax statistics of Megatron's ``vocab_parallel_cross_entropy``
(Shoeybi et al. 2019), extended to entropy as NeMo-Aligner's
``from_parallel_logits_to_logprobs`` and verl's vocab-parallel entropy do:

    m        = max_v logits              (all-reduce MAX over tp, no gradient)
    Z        = sum_v exp(logits - m)     (all-reduce SUM over tp)
    log p(y) = logits[y] - m - log Z     (logits[y] from the rank owning y, all-reduce SUM)
    H        = m + log Z - sum_v p_v * logits_v

All math is fp32 whatever the logits dtype. With ``tp_group=None`` the same quantities come
from fused single-process kernels (cross-entropy, log-softmax); the distributed tests compare
the sharded path against them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aligner.nn import comm


def _stats(logits: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = logits.float()
    m = logits.detach().max(dim=-1, keepdim=True).values
    comm.all_reduce_no_grad(m, tp_group, op=dist.ReduceOp.MAX)
    shifted = logits - m
    exp = shifted.exp()
    z = comm.reduce_from_tp(exp.sum(dim=-1, keepdim=True), tp_group)
    return shifted, exp, z


def _label_logit(shifted: torch.Tensor, labels: torch.Tensor, vocab_start: int, tp_group) -> torch.Tensor:
    """(logits - m) at each label [B, T], from the rank whose shard holds it (all-reduce SUM over tp)."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < shifted.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, shifted.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return comm.reduce_from_tp(picked * inside, tp_group)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in fp32 (logits unchanged, any dtype, at temperature 1).
    Raises ValueError for temperature <= 0 (greedy rollouts report log-probs at 1.0)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for log-probs and entropy (greedy uses 1.0)")
    return logits if temperature == 1.0 else logits.float() / temperature


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: int = 0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probabilities of `labels` under softmax(logits / temperature).

    Args:
        logits: [B, T, V/tp] this rank's vocabulary shard (any float dtype).
        labels: [B, T] int64 token ids in the full vocabulary.
        tp_group: tensor-parallel group the vocabulary is split over (None: single process).
        vocab_start: first vocabulary id of this rank's shard.
        temperature: > 0; logits are divided by it (the rollout sampling temperature).
    Returns:
        log_probs: [B, T] fp32, differentiable w.r.t. logits.
    Raises:
        ValueError: temperature <= 0.
    """
    logits = _tempered(logits, temperature)
    if comm.group_size(tp_group) == 1 and vocab_start == 0:
        # one fused kernel (log-softmax + gather) when the vocabulary is not split
        return -F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    shifted, _, z = _stats(logits, tp_group)
    return _label_logit(shifted, labels, vocab_start, tp_group) - z.squeeze(-1).log()


def vocab_parallel_entropy(logits: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position.

    Args:
        logits: [B, T, V/tp] this rank's vocabulary shard.
    Returns:
        entropy: [B, T] fp32 nats, differentiable.
    """
    logits = _tempered(logits, temperature)
    if comm.group_size(tp_group) == 1:
        lp = torch.log_softmax(logits.float(), dim=-1)
        return -(lp.exp() * lp).sum(dim=-1)
    shifted, exp, z = _stats(logits, tp_group)
    weighted = comm.reduce_from_tp((exp * shifted).sum(dim=-1, keepdim=True), tp_group)
    return (z.log() - weighted / z).squeeze(-1)


def vocab_parallel_log_probs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: int = 0,
    temperature: float = 1.0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `labels` and the entropy, from one pass of softmax statistics.

    The same quantities as :func:`vocab_parallel_log_probs` and :func:`vocab_parallel_entropy`
    (formulas in the module docstring), sharing the normalization: one log-softmax over the
    vocabulary (single process) or one max / sum-exp all-reduce pair (vocab-parallel) instead of
    two. The PPO actor loss needs the log-probs with gradient and the entropy as a metric.

    Args:
        logits: [B, T, V/tp] this rank's vocabulary shard (any float dtype).
        labels: [B, T] int64 token ids in the full vocabulary.
        tp_group, vocab_start, temperature: as for :func:`vocab_parallel_log_probs`.
        entropy_grad: keep the entropy in the autograd graph (an entropy bonus); else it is
            computed without one (a metric: no [B, T, V] tensor saved for it).
    Returns:
        (log_probs [B, T] fp32, differentiable; entropy [B, T] fp32 nats).
    Raises:
        ValueError: temperature <= 0.
    """
    logits = _tempered(logits, temperature).float()
    if comm.group_size(tp_group) == 1 and vocab_start == 0:
        lsm = torch.log_softmax(logits, dim=-1)
        log_probs = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            src = lsm if entropy_grad else lsm.detach()
            entropy = -(src.exp() * src).sum(dim=-1)
        return log_probs, entropy
    shifted, exp, z = _stats(logits, tp_group)
    log_z = z.squeeze(-1).log()
    log_probs = _label_logit(shifted, labels, vocab_start, tp_group) - log_z
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        e, s, lz, zz = (exp, shifted, log_z, z) if entropy_grad else (exp.detach(), shifted.detach(), log_z.detach(), z.detach())
        weighted = comm.reduce_from_tp((e * s).sum(dim=-1, keepdim=True), tp_group)
        entropy = lz - (weighted / zz).squeeze(-1)
    return log_probs, entropy


def shifted_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, tp_group=None, vocab_start: int = 0, temperature: float = 1.0
) -> torch.Tensor:
    """Next-token log-probs: logits [B, T, V/tp], input_ids [B, T] -> [B, T-1] (position t scores token t+1)."""
    return vocab_parallel_log_probs(logits[:, :-1], input_ids[:, 1:], tp_group, vocab_start, temperature)
