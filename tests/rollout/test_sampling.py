"""Sampler: the token choice of both schedulers, checked against the distribution it should draw.

The engine-level checks (sampled log-probs against a full forward, seeds independent of the
batch, draw-for-draw against a reference) are in tests/rollout/test_torch_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import SamplingConfig
from aligner.rollout.torch_engine.sampling import Sampler, filter_top_k_top_p


def test_filter_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_top_k_top_p(logits, 0, 0.8))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = torch.isfinite(filter_top_k_top_p(logits, 0, 0.81))
    assert kept.tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (2.0, 4, 0.9)])
def test_sampler_draws_the_filtered_softmax_distribution(temperature, top_k, top_p):
    """20,000 rows of the same logits, one step: token frequencies match softmax(logits / T) renormalized
    over the top-k / top-p set (3.5 sigma at most), and log-probs are over the full vocabulary."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 20_000
    s = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    sampler = Sampler(s, None, [1] * n, torch.device("cpu"), fallback_seed=5)
    tok, lp = sampler.sample(logits.expand(n, -1).clone(), sampler.uniforms[:, 0])
    full = torch.log_softmax(logits / temperature, -1)
    torch.testing.assert_close(lp, full[tok], atol=1e-6, rtol=0)
    keep = torch.isfinite(filter_top_k_top_p((logits / temperature)[None], top_k, top_p))[0]
    want = full.exp() * keep
    want = want / want.sum()
    freq = torch.bincount(tok, minlength=len(logits)).double() / n
    sigma = (want * (1 - want) / n).sqrt().double()
    assert (freq[~keep] == 0).all(), "a filtered-out token was sampled"
    assert ((freq - want.double()).abs() <= 3.5 * sigma + 1e-12).all(), (freq.tolist(), want.tolist())


def test_seeded_draws_do_not_depend_on_the_other_requests():
    """Request i's uniforms come from its own seed: the same in a call of one request or of three,
    at any index, and cut at its own budget (zeros past it)."""
    s = SamplingConfig(temperature=1.0, max_new_tokens=5)
    alone = Sampler(s, [11], [5], torch.device("cpu"), fallback_seed=0).uniforms[0]
    batch = Sampler(s, [3, 11, 7], [2, 5, 4], torch.device("cpu"), fallback_seed=0)
    assert torch.equal(batch.uniforms[1], alone)
    assert batch.uniforms[0, 2:].eq(0).all() and batch.uniforms[0, :2].gt(0).all()
    got = batch.draws(torch.tensor([1, 1, 2]), torch.tensor([0, 4, 3]))
    assert torch.equal(got, torch.stack([alone[0], alone[4], batch.uniforms[2, 3]]))
    greedy = Sampler(SamplingConfig(temperature=0.0, max_new_tokens=5), [11], [5], torch.device("cpu"), fallback_seed=0)
    assert greedy.uniforms is None and greedy.draws(torch.tensor([0]), torch.tensor([0])) is None


def test_greedy_takes_the_max_and_reports_the_full_vocabulary_log_prob():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 1.0, 2.9, -4.0]])
    sampler = Sampler(SamplingConfig(temperature=0.0, top_k=2, max_new_tokens=1), None, [1, 1], torch.device("cpu"), fallback_seed=0)
    tok, lp = sampler.sample_requests(logits, torch.tensor([0, 1]), torch.tensor([0, 0]))
    assert tok.tolist() == [1, 0]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]], atol=1e-6, rtol=0)
