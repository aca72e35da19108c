"""Shared-prompt packing (aligner.actor.shared_prompt) equals the padded layout.

A batch of 3 prompts x 3 samples with ragged prompts, ragged responses (one empty, one with a
masked token inside) runs through Policy.log_probs and Policy.ppo_update once padded (pack_len 0)
and once packed (the prompt once per group); log-probs, metrics and gradients must agree within
fp32 rounding, on the logits path and on the chunked log-prob path. The packed rows must hold
fewer tokens than the padded ones, and the fallbacks (no groups, a row over pack_len, a
micro-batch smaller than a group) must run the padded layout.
"""

from __future__ import annotations

import pytest
import torch

from aligner import algorithms as alg
from aligner.actor.policy import Policy
from aligner.actor.shared_prompt import pack_shared_prompts, prompt_groups, response_lengths
from aligner.config import AlgorithmConfig, OptimConfig, ParallelConfig
from aligner.model.llama import shared_prompt_mask
from aligner.parallel.dims import ParallelDims
from aligner.protocol import build_sequences
from tests.toolkit.models import tiny_model_config

CFG = tiny_model_config(max_seq_len=64, init_std=0.2)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
G = 3


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    prompts, responses = [], []
    for plen, rlens in ((4, (5, 0, 3)), (7, (2, 6, 6)), (2, (1, 4, 2))):
        p = torch.randint(4, 64, (plen,), generator=g).tolist()
        for n in rlens:
            prompts.append(p)
            responses.append(torch.randint(4, 64, (n,), generator=g).tolist())
    seq = build_sequences(prompts, responses, pad_id=0)
    mask = seq["response_mask"].clone()
    mask[4, 2] = 0  # a masked token inside a response (it stays context for the tokens after it)
    shape = mask.shape
    return {
        "input_ids": seq["input_ids"],
        "prompt_lens": seq["prompt_lens"],
        "response_mask": mask,
        "advantages": torch.randn(shape, generator=g) * mask,
        "ref_offset": torch.randn(shape, generator=g) * 0.5,
        "old_offset": torch.randn(shape, generator=g) * 0.3,
    }


def test_groups_are_detected_from_the_prompt_ids():
    b = _batch()
    assert prompt_groups(b["input_ids"], b["prompt_lens"]) == G
    ids, pl = b["input_ids"].clone(), b["prompt_lens"]
    ids[4, 1] += 1  # one sample of group 2 with another prompt: the groups are no longer equal
    assert prompt_groups(ids, pl) == 1
    assert prompt_groups(b["input_ids"][:1], pl[:1]) == 1
    assert prompt_groups(b["input_ids"][[0, 3, 6]], pl[[0, 3, 6]]) == 1  # all different prompts
    assert response_lengths(b["response_mask"]).tolist() == [5, 0, 3, 2, 6, 6, 1, 4, 2]


def test_packed_rows_hold_the_prompt_once_and_mask_across_samples():
    b = _batch()
    packed = pack_shared_prompts(b, G, ("response_mask",))
    # group 0: prompt 4 + responses 5 + 0 + 3 = 12 tokens; the longest row is 7 + 2 + 6 + 6 = 21
    assert packed["input_ids"].shape == (3, 21)
    assert packed["input_ids"].numel() < b["input_ids"].numel()
    assert torch.equal(packed["input_ids"][0, :4], b["input_ids"][0, :4])
    assert torch.equal(packed["input_ids"][0, 4:9], b["input_ids"][0, 4:9])  # sample 0's response
    assert torch.equal(packed["input_ids"][0, 9:12], b["input_ids"][2, 4:7])  # sample 2's (sample 1 is empty)
    assert packed["position_ids"][0, 9:12].tolist() == [4, 5, 6]  # each response at its own row's positions
    m = shared_prompt_mask(packed["prompt_segments"])[0, 0]
    assert m[9, :4].all() and not m[9, 4:9].any() and m[9, 9]  # sample 2 sees the prompt and itself, not sample 0
    assert packed["head_index"][0, 2 * b["response_mask"].shape[1]].item() == 3  # token 0 is predicted at the last prompt position
    assert pack_shared_prompts(b, G, ("response_mask",), max_len=20) is None
    assert pack_shared_prompts(b, G, ("response_mask",), multiple=4)["input_ids"].shape[1] == 24


@pytest.mark.parametrize("chunk", [0, 16], ids=["logits", "chunked"])
def test_packed_log_probs_equal_padded(chunk):
    pol = Policy(CFG, ParallelConfig(logprob_chunk_size=chunk), OPTIM, ParallelDims(device_type="cpu"), seed=0)
    b = _batch()
    with torch.no_grad():
        want = pol.log_probs(b, micro_batch_size=3, temperature=0.8)
        got = pol.log_probs(b, micro_batch_size=6, temperature=0.8, pack_len=4096)  # 2 packed rows per micro-batch
        small = pol.log_probs(b, micro_batch_size=2, temperature=0.8, pack_len=4096)  # under G: padded
    assert (want != 0).sum() == int(b["response_mask"].sum())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # fp32 rounding of log-probs near -8
    torch.testing.assert_close(small, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("loss_agg", alg.LOSS_AGG_MODES)
@pytest.mark.parametrize("chunk", [0, 16], ids=["logits", "chunked"])
def test_packed_ppo_update_equals_padded(loss_agg, chunk):
    algo = AlgorithmConfig(
        advantage="grpo", kl_coef=0.0, kl_loss_coef=0.3, entropy_coef=0.05, clip_eps=0.1, clip_eps_high=0.3, loss_agg=loss_agg
    )
    b = _batch()
    grads, metrics = [], []
    for pack_len in (0, 4096):
        pol = Policy(CFG, ParallelConfig(logprob_chunk_size=chunk), OPTIM, ParallelDims(device_type="cpu"), seed=0)
        mb = dict(b)
        with torch.no_grad():
            current = pol.log_probs(mb, micro_batch_size=3, temperature=0.9)
        mask = mb["response_mask"]
        mb["old_log_probs"] = (current - mb.pop("old_offset")) * mask
        mb["ref_log_probs"] = (current - mb.pop("ref_offset")) * mask
        metrics.append(pol.ppo_update(mb, algo, micro_batch_size=3, temperature=0.9, pack_len=pack_len))
        grads.append({n: p.grad.clone() for n, p in pol.runtime.module.named_parameters()})
    assert metrics[0]["clipfrac"] > 0 and metrics[0]["kl_loss"] > 0
    for k in ("policy_loss", "kl_loss", "entropy", "clipfrac", "approx_kl", "grad_norm"):
        assert metrics[1][k] == pytest.approx(metrics[0][k], rel=1e-5, abs=1e-7), k
    for name, want in grads[0].items():
        # fp32 rounding relative to the tensor's scale (token-sum gradients are ~R times the token-mean ones)
        err = float((grads[1][name] - want).abs().max()) / max(float(want.abs().max()), 1e-12)
        assert err < 1e-5, (name, err)
