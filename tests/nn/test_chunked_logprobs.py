"""Chunked log-probs and entropy (aligner.nn.chunked) equal the unchunked path, gradients included.

Reference: the head's logits materialized (``F.linear(h, W)`` or the model's ``lm_head``) and
:func:`aligner.nn.vocab.vocab_parallel_log_probs_entropy` with ``entropy_grad=True``; both paths
are fp32, so they agree within 1e-5 (different GEMM shapes round differently: no bitwise checks).
Upstream gradients are random per position for the log-probs *and* the entropy, so a wrong
entropy gradient (or a missing 1/temperature) shows in grad h and grad W. Chunk sizes cover
chunks that divide N, that do not, and N <= chunk_size (the one chunk kept for backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aligner.actor.policy import Policy
from aligner.config import AlgorithmConfig, ConfigError, ModelConfig, OptimConfig, ParallelConfig
from aligner.model.llama import build_model
from aligner.nn.chunked import LogProbSpec, chunked_log_probs_entropy
from aligner.nn.vocab import vocab_parallel_log_probs_entropy
from aligner.parallel.dims import ParallelDims
from aligner.protocol import build_sequences
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

N, H, V = 12, 16, 40
CHUNKS = (1, 4, 5, 12, 64)  # 4 divides N = 12, 1 and 5 do not, 12 and 64 keep the one chunk


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.7  # logits of a few units: a peaked, non-trivial softmax
    labels = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return h, w, labels, g_lp, g_ent


def _grads(fn, h, w, labels, g_lp, g_ent, temperature):
    """(log_probs, entropy, grad h, grad W) of fn(h, W) -> (lp, ent) under the loss sum(g_lp lp + g_ent ent)."""
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fn(h, w, labels, temperature)
    loss = 0.0
    if g_lp is not None:
        loss = loss + (g_lp * lp).sum()
    if g_ent is not None:
        loss = loss + (g_ent * ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _reference(h, w, labels, temperature):
    return vocab_parallel_log_probs_entropy(F.linear(h, w), labels, temperature=temperature, entropy_grad=True)


def _chunked(chunk):
    return lambda h, w, labels, temperature: chunked_log_probs_entropy(h, w, labels, temperature, chunk_size=chunk)


def _assert_all_close(got, want, what):
    for name, a, b in zip(("log_probs", "entropy", "grad h", "grad W"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{what}: {name}")


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_materialized_logits(chunk, temperature):
    h, w, labels, g_lp, g_ent = _inputs()
    want = _grads(_reference, h, w, labels, g_lp, g_ent, temperature)
    got = _grads(_chunked(chunk), h, w, labels, g_lp, g_ent, temperature)
    _assert_all_close(got, want, f"chunk {chunk}, T {temperature}")
    assert want[3].abs().max() > 1e-2 and want[2].abs().max() > 1e-2  # the comparison has something to compare


@pytest.mark.parametrize("chunk", [5, 64])
def test_only_log_probs_or_only_entropy_in_the_loss(chunk):
    """Either output may be left out of the loss (its upstream gradient is None)."""
    h, w, labels, g_lp, g_ent = _inputs(1)
    for a, b in ((g_lp, None), (None, g_ent)):
        want = _grads(_reference, h, w, labels, a, b, 1.3)
        _assert_all_close(_grads(_chunked(chunk), h, w, labels, a, b, 1.3), want, f"chunk {chunk}")


def test_no_grad_and_bad_arguments():
    h, w, labels, _, _ = _inputs(2)
    with torch.no_grad():
        lp, ent = chunked_log_probs_entropy(h, w, labels, 0.9, chunk_size=5)
        want_lp, want_ent = _reference(h, w, labels, 0.9)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    assert not lp.requires_grad
    with pytest.raises(ValueError, match="temperature=0"):
        chunked_log_probs_entropy(h, w, labels, 0.0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_log_probs_entropy(h, w, labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"h \(12, 16\) must be \[N, H\]"):
        chunked_log_probs_entropy(h, w[:, :8], labels)


def test_kept_chunk_refuses_a_second_backward():
    h, w, labels, _, _ = _inputs(3)
    h.requires_grad_(True)
    lp, _ = chunked_log_probs_entropy(h, w, labels, chunk_size=64)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        lp.sum().backward()


# ---- the model's head: tied and untied ---------------------------------------------------
def _model_cfg(tied: bool) -> ModelConfig:
    return tiny_model_config(vocab_size=48, init_std=0.2, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_head_chunked_equals_logits_path(tied):
    """LlamaForCausalLM with ``logprob`` equals its logits through vocab.py: values and every
    parameter gradient (the tied embedding gets the head's gradient plus the lookup's)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 48, (3, 9), generator=g)
    index = torch.randint(0, 9, (3, 5), generator=g)
    labels = torch.randint(0, 48, (3, 5), generator=g)
    g_lp, g_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    results = []
    for chunk in (0, 4, 64):
        model = build_model(_model_cfg(tied), seed=0)
        if chunk:
            lp, ent = model(ids, head_index=index, labels=labels, logprob=LogProbSpec(temperature=0.8, chunk_size=chunk))
        else:
            lp, ent = vocab_parallel_log_probs_entropy(model(ids, head_index=index), labels, temperature=0.8, entropy_grad=True)
        ((g_lp * lp).sum() + (g_ent * ent).sum()).backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want_lp, want_ent, want_g), *rest = results
    assert tied == ("lm_head.weight" not in want_g)  # a tied head shares the embedding's Parameter
    for lp, ent, grads in rest:
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
        for name, grad in want_g.items():
            # gradients reach |16| here and the tied embedding's sums them with the lookup's: fp32 rounding
            # of other GEMM splits scales with the tensor's largest entries, not with each element
            # (1.3e-5 on an Intel Xeon for an entry of 0.04 beside entries of 16.6)
            scale = grad.abs().max().item()
            torch.testing.assert_close(grads[name], grad, atol=4e-6 * max(scale, 1.0), rtol=1e-5, msg=name)


# ---- the Policy: PPO loss, log-probs, SFT ------------------------------------------------
def _batch():
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(4, 48, (n,), generator=g).tolist() for n in (3, 6, 2, 4)]
    responses = [torch.randint(4, 48, (n,), generator=g).tolist() for n in (5, 2, 4, 3)]
    seq = build_sequences(prompts, responses, pad_id=0)
    mask = seq["response_mask"]
    batch = {k: seq[k] for k in ("input_ids", "prompt_lens", "response_mask")}
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["old_log_probs"] = (torch.randn(mask.shape, generator=g) * 0.2 - 3.5) * mask
    batch["ref_log_probs"] = (torch.randn(mask.shape, generator=g) * 0.2 - 3.5) * mask
    return batch


def _policy(chunk: int) -> Policy:
    optim = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
    return Policy(_model_cfg(True), ParallelConfig(logprob_chunk_size=chunk), optim, ParallelDims(device_type="cpu"), seed=0)


def _policy_run(chunk: int):
    """log-probs at T = 0.7, one PPO step (entropy bonus and KL loss on) and one SFT step: outputs and grads."""
    batch = _batch()
    pol = _policy(chunk)
    lp = pol.log_probs(batch, micro_batch_size=3, temperature=0.7)
    algo = AlgorithmConfig(entropy_coef=0.05, kl_loss_coef=0.2, clip_eps=0.1)
    metrics = pol.ppo_update(batch, algo, micro_batch_size=2, temperature=0.7)
    ppo_grads = {n: p.grad.clone() for n, p in pol.runtime.module.named_parameters()}
    sft_batch = {"input_ids": batch["input_ids"], "loss_mask": (batch["input_ids"] > 0).long()}
    sft = _policy(chunk).sft_step(sft_batch, micro_batch_size=3)
    return lp, metrics, ppo_grads, sft


def test_policy_chunked_equals_unchunked():
    want_lp, want_m, want_g, want_sft = _policy_run(0)
    for chunk in (3, 1024):  # several chunks per micro-batch (recomputed in backward), and one kept chunk
        lp, m, grads, sft = _policy_run(chunk)
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0, msg=f"chunk {chunk}: log_probs")
        for k in ("policy_loss", "entropy", "kl_loss", "clipfrac", "approx_kl"):
            assert m[k] == pytest.approx(want_m[k], abs=1e-5), (chunk, k)
        for name, g in want_g.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=0, msg=f"chunk {chunk}: {name}")
        assert sft["loss"] == pytest.approx(want_sft["loss"], abs=1e-5)
        assert sft["grad_norm"] == pytest.approx(want_sft["grad_norm"], abs=1e-5)


def test_logprob_chunk_size_is_validated_and_auto_fits_its_budget():
    from aligner.nn.chunked import AUTO_CHUNK_BYTES, auto_chunk_size

    with pytest.raises(ConfigError, match=r"actor.parallel.logprob_chunk_size=-2 is invalid: must be >= -1"):
        ParallelConfig(logprob_chunk_size=-2).validate("actor.parallel")
    for v in (32000, 128256, 64):
        c = auto_chunk_size(v)
        assert c * v * 4 <= AUTO_CHUNK_BYTES < (c + 1) * v * 4
    assert auto_chunk_size(128256) == 523 and auto_chunk_size(32000) == 2097


# ---- vocab-parallel tp = 2 on gloo -------------------------------------------------------
def _tp_battery(rank: int, world_size: int) -> dict[str, float]:
    """Max abs differences to the single-process reference of: the chunked function on this
    rank's vocabulary shard (several chunk sizes and temperatures), and a sharded LMHead's
    log-prob forward with and without sequence parallelism (grad h through the tp reduction of
    copy_to_tp / gather_from_sp, grad of this rank's weight rows)."""
    import torch.distributed as dist

    from aligner.nn import comm
    from aligner.nn.layers import LMHead

    group = dist.group.WORLD
    out: dict[str, float] = {}
    h, w, labels, g_lp, g_ent = _inputs(7)
    rows = slice(rank * V // world_size, (rank + 1) * V // world_size)
    for chunk in (5, 64):
        for t in (1.0, 0.7):
            want = _grads(_reference, h, w, labels, g_lp, g_ent, t)

            def fn(hh, ww, lab, temp, chunk=chunk):
                return chunked_log_probs_entropy(comm.copy_to_tp(hh, group), ww[rows], lab, temp, group, rows.start, chunk)

            got = _grads(fn, h, w, labels, g_lp, g_ent, t)
            got, want = (*got[:3], got[3][rows]), (*want[:3], want[3][rows])  # this rank's weight rows
            for name, a, b in zip(("lp", "ent", "grad_h", "grad_w"), got, want):
                out[f"fn c{chunk} T{t} {name}"] = float((a - b).abs().max())
    b, t, r = 2, 6, 4
    g = torch.Generator().manual_seed(8)
    hs = torch.randn(b, t, H, generator=g)
    index = torch.randint(0, t, (b, r), generator=g)
    lab = torch.randint(0, V, (b, r), generator=g)
    gl, ge = torch.randn(b, r, generator=g), torch.randn(b, r, generator=g)
    ref_h, w_ref = hs.clone().requires_grad_(True), w.clone().requires_grad_(True)
    sel = ref_h.gather(1, index.unsqueeze(-1).expand(-1, -1, H))
    lp, ent = vocab_parallel_log_probs_entropy(F.linear(sel, w_ref), lab, temperature=0.9, entropy_grad=True)
    ((gl * lp).sum() + (ge * ent).sum()).backward()
    for sp in (False, True):
        for chunk in (3, 64):
            head = LMHead(H, V)
            with torch.no_grad():
                head.weight.copy_(w)
            head.shard_(group, sequence_parallel=sp)
            x = (hs.chunk(world_size, dim=1)[rank] if sp else hs).clone().requires_grad_(True)
            lp2, ent2 = head(x, labels=lab, logprob=LogProbSpec(temperature=0.9, chunk_size=chunk), head_index=index)
            ((gl * lp2).sum() + (ge * ent2).sum()).backward()
            want_xg = ref_h.grad.chunk(world_size, dim=1)[rank] if sp else ref_h.grad
            key = f"head sp={sp} c{chunk}"
            out[f"{key} lp"] = float((lp2 - lp).abs().max())
            out[f"{key} ent"] = float((ent2 - ent).abs().max())
            out[f"{key} grad_h"] = float((x.grad - want_xg).abs().max())
            out[f"{key} grad_w"] = float((head.weight.grad - w_ref.grad[rows]).abs().max())
    return out


@pytest.mark.distributed
def test_tp2_vocab_parallel_equals_single_process():
    results = run_distributed(_tp_battery, world_size=2)
    for rank, diffs in enumerate(results):
        assert len(diffs) == 32
        bad = {k: v for k, v in diffs.items() if not v <= 1e-5}
        assert not bad, (rank, bad)
