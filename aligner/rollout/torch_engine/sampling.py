"""Token choice of the rollout engine: greedy, or temperature / top-k / top-p sampling with per-request seeds.

:class:`Sampler` turns a decode step's logits into tokens and their log-probs; both of
:class:`aligner.rollout.torch_engine.engine.TorchEngine`'s schedulers call it once per step.

Sampling choices (documented simplifications):
- Under TP the last position's logits [B, V/tp] are all-gathered to [B, V] on every tp rank
  (only the last position, once per step: B * V floats), and every rank samples the same
  token and log-prob from the same full logits with identically seeded generators. This keeps
  tokens independent of the tp layout (tp 1 and tp 2 give the same tokens for the same seeds).
- Sampling is inverse-CDF: each row draws one uniform u per step and takes the first token
  whose cumulative (top-k / top-p filtered) probability mass exceeds u times the kept mass, the
  method of ``torch.multinomial``; one random number per row and step instead of V (Gumbel-max)
  keeps sampling a small part of a decode step. Each seeded row's uniforms come from its own
  ``torch.Generator``, drawn for the whole response at the start, so a row's tokens depend on
  its seed and the weights only, not on the other rows of the batch. Greedy takes the max.
- ``rollout_log_probs`` are log softmax(logits / T) over the FULL vocabulary (T = 1 for
  greedy), not renormalized over the top-k / top-p set. That is the quantity the trainer
  recomputes (``old_log_probs``), so the mismatch metric measures engine numerics only; the
  truncated distribution actually sampled differs by -log(kept mass) per token, which the
  engine does not report.

Determinism: a request's uniforms come from its own seed, so its tokens depend on its prompt,
seed and the weights only: not on the other requests, their order, its slot or when it was
admitted, up to GEMM rounding. The GEMMs of a decode step see a batch whose size and
composition depend on the schedule, and CPU BLAS kernels may round the last bits differently
with M: log-probs agree within 1e-5 (fp32) across schedules (tests), and a token could differ
only where two candidates' probabilities are within that rounding (never seen in the tests nor
on the real-model benchmark). Batch-invariant kernels were not built.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from aligner.nn import comm


class Sampler:
    """Per-step token choice of one generate() call: greedy (max), or inverse-CDF sampling under
    temperature / top-k / top-p (top-k then top-p, HF's order; ``torch.multinomial``'s method).

    Args:
        sampling: SamplingConfig-like (temperature >= 0: 0 is greedy; top_k >= 0: 0 keeps every
            token; top_p in (0, 1]). The caller validates it
            (:func:`aligner.rollout.base.check_sampling`).
        seeds: one int seed per request, or None (one generator for the whole call).
        lengths: draws per request (its max_new_tokens), len(lengths) = requests B.
        device: where the uniforms live (the logits' device).
        fallback_seed: the call's generator seed when `seeds` is None.
    Seeded request i draws its lengths[i] uniforms from its own torch.Generator up front, so its
    draws do not depend on the batch, slot or step at which it runs; unseeded requests take rows
    of one [B, max(lengths)] draw from the engine generator seeded per call.
    ``uniforms``: [B, max(lengths)] fp32 in [0, 1) on `device` (None when greedy).
    """

    def __init__(self, sampling, seeds: Optional[list[int]], lengths: list[int], device, fallback_seed: int):
        self.temperature = float(sampling.temperature)
        self.top_k, self.top_p = int(sampling.top_k), float(sampling.top_p)
        self.device = device
        self.greedy = self.temperature == 0
        self.uniforms: Optional[torch.Tensor] = None  # [B, max(lengths)] fp32 in [0, 1)
        if not self.greedy:
            width = max(lengths)
            if seeds is None:
                u = torch.rand(len(lengths), width, generator=torch.Generator().manual_seed(fallback_seed % (2**63)))
            else:
                u = torch.zeros(len(lengths), width)
                for i, (s, n) in enumerate(zip(seeds, lengths)):
                    u[i, :n] = torch.rand(n, generator=torch.Generator().manual_seed(int(s) % (2**63)))
            self.uniforms = u.to(device)

    def draws(self, requests: torch.Tensor, steps: torch.Tensor) -> Optional[torch.Tensor]:
        """requests, steps: [n] int64 -> each row's uniform [n] (None when greedy)."""
        return None if self.greedy else self.uniforms[requests, steps]

    def sample(self, logits: torch.Tensor, u: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, V] fp32 (full vocabulary), u: [B] uniforms (ignored when greedy) ->
        (tokens [B] int64, log_probs [B] fp32).

        log_probs are log softmax(logits / T) of the chosen tokens over the full vocabulary
        (T = 1 when greedy), whatever top-k / top-p kept.
        """
        if self.greedy:
            top, tok = logits.max(dim=-1)
            return tok, -(logits - top.unsqueeze(-1)).exp_().sum(-1).log_()  # logits[tok] - logsumexp
        scaled = logits / self.temperature if self.temperature != 1.0 else logits
        top = scaled.max(dim=-1, keepdim=True).values
        weights = (scaled - top).exp_()  # unnormalized probabilities, the largest is 1
        log_z = weights.sum(-1).log_()
        if 0 < self.top_k < logits.shape[-1] or self.top_p < 1.0:
            weights.masked_fill_(~torch.isfinite(filter_top_k_top_p(scaled, self.top_k, self.top_p)), 0.0)
        cdf = weights.cumsum_(-1)
        tok = torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
        lp = scaled.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - top.squeeze(-1) - log_z
        return tok, lp

    def sample_requests(
        self, logits: torch.Tensor, requests: torch.Tensor, steps: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This tp rank's logits [n, V/tp] fp32 of `requests` [n] int64 at response `steps` [n] int64
        -> (tokens [n] int64, log_probs [n] fp32), the same on every tp rank: the vocabulary is
        all-gathered over `tp_group` first (a collective when it has more than one rank)."""
        full = logits if comm.group_size(tp_group) == 1 else gather_vocab(logits, tp_group)
        return self.sample(full, self.draws(requests, steps))


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, V] -> a copy with the logits outside the top-k and the top-p nucleus set to -inf
    (HF's order: k, then p over what k kept). top_k = 0 or >= V keeps every token; top_p = 1 keeps
    every token; a token is dropped when the probability mass before it (sorted descending) already
    reaches top_p, so the most likely token is always kept."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_l, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_l.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def gather_vocab(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, V/tp] shards -> [B, V] on every rank (tp-rank order = vocabulary order); a collective over `group`."""
    parts = [torch.empty_like(local) for _ in range(comm.group_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
