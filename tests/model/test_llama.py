"""The response-only LM head and the shared log-prob/entropy pass equal the full-sequence reference.

Reference: logits at every position, shifted next-token log-probs gathered at the response
positions (``protocol.to_response``), entropy from a separate ``vocab_parallel_entropy``.
"""

from __future__ import annotations

import torch

from aligner.actor.policy import Policy
from aligner.config import OptimConfig, ParallelConfig
from aligner.model.llama import build_model, select_positions
from aligner.nn.vocab import shifted_log_probs, vocab_parallel_entropy, vocab_parallel_log_probs, vocab_parallel_log_probs_entropy
from aligner.parallel.dims import ParallelDims
from aligner.protocol import build_sequences, response_index, to_response
from tests.toolkit.models import tiny_model_config

CFG = tiny_model_config(vocab_size=96, init_std=0.2)


def _seq():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (2, 7, 4)]
    responses = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (5, 1, 3)]
    return build_sequences(prompts, responses, pad_id=0)


def test_head_index_selects_positions_before_the_head():
    model = build_model(CFG, seed=0).eval()
    seq = _seq()
    idx = response_index(seq["prompt_lens"], seq["response_mask"].shape[1], seq["input_ids"].shape[1] - 1)
    with torch.no_grad():
        full = model(seq["input_ids"])
        part = model(seq["input_ids"], head_index=idx)
    assert part.shape == (3, seq["response_mask"].shape[1], CFG.vocab_size)
    torch.testing.assert_close(part, select_positions(full, idx), atol=1e-6, rtol=0)


def test_policy_log_probs_equal_full_sequence_reference():
    pol = Policy(CFG, ParallelConfig(), OptimConfig(), ParallelDims(device_type="cpu"), seed=0)
    seq = _seq()
    got = pol.log_probs(seq, micro_batch_size=2, temperature=0.8)
    with torch.no_grad():
        logits = pol.runtime.module(seq["input_ids"])
    want = to_response(shifted_log_probs(logits, seq["input_ids"], temperature=0.8), seq["prompt_lens"], seq["response_mask"])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (got[seq["response_mask"] == 0] == 0).all()


def test_log_probs_entropy_share_one_pass_and_match_separate_functions():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 5, 40, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, 40, (2, 5), generator=g)
    lp, ent = vocab_parallel_log_probs_entropy(logits, labels, temperature=1.3, entropy_grad=True)
    torch.testing.assert_close(lp, vocab_parallel_log_probs(logits, labels, temperature=1.3), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, vocab_parallel_entropy(logits, temperature=1.3), atol=1e-6, rtol=0)
    (lp.sum() + ent.sum()).backward()
    ref = logits.detach().clone().requires_grad_(True)
    (vocab_parallel_log_probs(ref, labels, temperature=1.3).sum() + vocab_parallel_entropy(ref, temperature=1.3).sum()).backward()
    torch.testing.assert_close(logits.grad, ref.grad, atol=1e-6, rtol=0)
    # as a metric the entropy keeps no graph: only the log-probs carry gradient
    lp2, ent2 = vocab_parallel_log_probs_entropy(logits, labels)
    assert lp2.requires_grad and not ent2.requires_grad
