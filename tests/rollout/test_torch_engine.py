"""TorchEngine exactness against a no-cache full-forward reference, sampling, refit, registry.

Reference for every check: the same aligner model run on each unpadded sequence with no KV
cache (full forward), greedy by argmax and log-probs by vocab_parallel_log_probs.
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import ModelConfig, SamplingConfig
from aligner.model.llama import build_model
from aligner.nn.vocab import vocab_parallel_log_probs
from aligner.rollout import build_engine, engine_class
from aligner.rollout.base import Generation, generations_to_padded, mismatch_metrics
from aligner.rollout.refit import iter_buckets, refit
from aligner.rollout.torch_engine import TorchEngine, _filter_top_k_top_p, _Sampler

CFG = ModelConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=48, init_std=0.1
)
PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [3, 3]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(CFG, seed=1).eval()


@pytest.fixture(scope="module")
def engine(model):
    return TorchEngine(model)


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def reference_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    full = torch.tensor([prompt + response])
    logits = model(full)[:, len(prompt) - 1 : -1]
    return vocab_parallel_log_probs(logits, full[:, len(prompt) :], temperature=temperature)[0]


def test_greedy_matches_full_forward_reference_ragged_batch(model, engine):
    gens = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=10))
    for p, g in zip(PROMPTS, gens):
        assert g.token_ids == greedy_reference(model, p, 10)
        assert g.finish_reason == "length" and g.weight_version == engine.weight_version
        # greedy log-probs are reported at temperature 1
        torch.testing.assert_close(torch.tensor(g.rollout_log_probs), reference_log_probs(model, p, g.token_ids, 1.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 5, 1.0)])
def test_sampled_log_probs_match_full_forward(model, engine, temperature, top_k, top_p):
    s = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12)
    gens = engine.generate(PROMPTS, s, seeds=[11, 12, 13, 14])
    for p, g in zip(PROMPTS, gens):
        ref = reference_log_probs(model, p, g.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(g.rollout_log_probs), ref, atol=1e-5, rtol=0)
    ids, lp, mask = generations_to_padded(gens)
    ref = torch.zeros_like(lp)
    for i, (p, g) in enumerate(zip(PROMPTS, gens)):
        ref[i, : len(g.token_ids)] = reference_log_probs(model, p, g.token_ids, temperature)
    m = mismatch_metrics(lp, ref, mask)
    assert m["log_probs_abs_diff_max"] < 1e-5 and m["ratio_out_of_range_frac"] == 0.0


def test_top_k_and_top_p_restrict_the_sampled_tokens(model, engine):
    # top-k: every sampled token is among the k most likely under the reference logits
    s = SamplingConfig(temperature=1.0, top_k=3, max_new_tokens=10)
    for p, g in zip(PROMPTS, engine.generate(PROMPTS, s, seeds=[1, 2, 3, 4])):
        with torch.no_grad():
            logits = model(torch.tensor([p + g.token_ids]))[0, len(p) - 1 : -1]
        top3 = logits.topk(3, dim=-1).indices
        assert all(t in top3[j].tolist() for j, t in enumerate(g.token_ids))
    # top_k=1 and a tiny nucleus both reduce to greedy
    greedy = [g.token_ids for g in engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=8))]
    for s in (SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=8), SamplingConfig(temperature=1.0, top_p=1e-6, max_new_tokens=8)):
        assert [g.token_ids for g in engine.generate(PROMPTS, s, seeds=[5, 6, 7, 8])] == greedy


def test_filter_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(_filter_top_k_top_p(logits, 0, 0.8))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = torch.isfinite(_filter_top_k_top_p(logits, 0, 0.81))
    assert kept.tolist() == [[True, True, True, False]]


def test_seeds_reproduce_tokens_independent_of_batch(engine):
    s = SamplingConfig(temperature=1.0, max_new_tokens=12)
    a = engine.generate(PROMPTS, s, seeds=[1, 2, 3, 4])
    b = engine.generate(PROMPTS, s, seeds=[1, 2, 3, 4])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    alone = engine.generate([PROMPTS[2]], s, seeds=[3])[0]
    assert alone.token_ids == a[2].token_ids  # same seed, different batch composition
    other = engine.generate(PROMPTS, s, seeds=[101, 102, 103, 104])
    assert [g.token_ids for g in other] != [g.token_ids for g in a]
    # unseeded calls draw from the engine RNG: consecutive calls differ
    u1, u2 = engine.generate(PROMPTS, s), engine.generate(PROMPTS, s)
    assert [g.token_ids for g in u1] != [g.token_ids for g in u2]


def test_max_batch_size_chunks_give_the_same_tokens(model):
    s = SamplingConfig(temperature=0.9, max_new_tokens=6)
    big = TorchEngine(model).generate(PROMPTS, s, seeds=[1, 2, 3, 4])
    small = TorchEngine(model, max_batch_size=3).generate(PROMPTS, s, seeds=[1, 2, 3, 4])
    assert [g.token_ids for g in big] == [g.token_ids for g in small]


def test_stop_tokens_cut_the_response(model):
    ref = greedy_reference(model, PROMPTS[0], 10)
    stop = ref[3]
    first = ref.index(stop)
    eng = TorchEngine(model, eos_token_id=stop)
    g = eng.generate([PROMPTS[0]], SamplingConfig(temperature=0.0, max_new_tokens=10))[0]
    assert g.token_ids == ref[: first + 1] and g.finish_reason == "stop"
    assert len(g.rollout_log_probs) == first + 1
    g2 = TorchEngine(model).generate([PROMPTS[0]], SamplingConfig(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop]))[0]
    assert g2.token_ids == g.token_ids and g2.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=45), "max_seq_len"),  # 45 + longest prompt 7 > 48
    ],
)
def test_bad_sampling_parameters_are_refused(engine, kwargs, match):
    s = SamplingConfig()
    for k, v in kwargs.items():
        object.__setattr__(s, k, v)  # bypass the config's own validation: the engine must check too
    with pytest.raises(ValueError, match=match):
        engine.generate(PROMPTS, s)


def test_bad_prompts_are_refused(engine):
    s = SamplingConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        engine.generate([[1], []], s)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.generate([], s)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, CFG.vocab_size]], s)
    with pytest.raises(ValueError, match="seeds"):
        engine.generate([[1], [2]], s, seeds=[1])


def test_refit_after_optimizer_step_gives_the_trainers_logits():
    trainer = build_model(CFG, seed=3)
    eng = TorchEngine(build_model(CFG, seed=4))  # different weights until refit
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    loss = -vocab_parallel_log_probs(trainer(ids)[:, :-1], ids[:, 1:]).mean()
    loss.backward()
    opt.step()
    stats = refit(trainer, eng, bucket_mb=0.01)  # 10 KiB buckets: several update_weights calls
    assert stats.buckets > 1 and stats.tensors == len(list(trainer.parameters())) and stats.weight_version == 1
    assert eng.last_update_names == {n for n, _ in trainer.named_parameters()}
    with torch.no_grad():
        # not torch.equal: the engine stores its linear weights as [in, out] (see _pack_weights), the trainer
        # as [out, in], so the fp32 GEMMs take different kernels/blocking and differ in the last bits (1e-6
        # here, AVX2 and AVX-512); a stale or wrong tensor after refit moves the logits by ~1e-2 or more
        torch.testing.assert_close(eng.model(ids), trainer(ids), atol=1e-5, rtol=0)
    gens = eng.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=5))
    assert all(g.weight_version == 1 for g in gens)
    # token equality across the two layouts is safe: the reference's top-2 logit gap is >= 3.8e-3 on every
    # step, three orders above the 1e-6 layout noise
    assert [g.token_ids for g in gens] == [greedy_reference(trainer.eval(), p, 5) for p in PROMPTS]


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(ValueError, match="unknown parameter name"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_iter_buckets_respects_the_size_limit():
    tensors = [(f"t{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    buckets = list(iter_buckets(tensors, 3 / 1024))  # 3 KiB
    assert [len(b) for b in buckets] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="bucket_mb"):
        list(iter_buckets(tensors, 0))


def test_registry_unknown_backend_and_trtllm_hint(model):
    with pytest.raises(ValueError, match="torch, trtllm"):
        build_engine("vllm", model)
    assert isinstance(build_engine("torch", model), TorchEngine)
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install aligner\\[trtllm\\]"):
            build_engine("trtllm", "/nonexistent", None)
    assert engine_class("trtllm").__name__ == "TrtllmEngine"


def test_generation_dataclass_fields():
    g = Generation([1, 2], [-0.1, -0.2], "stop", 3)
    assert (g.token_ids, g.finish_reason, g.weight_version) == ([1, 2], "stop", 3)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (2.0, 4, 0.9)])
def test_sampler_draws_the_filtered_softmax_distribution(temperature, top_k, top_p):
    """20,000 rows of the same logits, one step: token frequencies match softmax(logits / T) renormalized
    over the top-k / top-p set (3.5 sigma at most), and log-probs are over the full vocabulary."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 20_000
    s = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    sampler = _Sampler(s, None, [1] * n, torch.device("cpu"), fallback_seed=5)
    tok, lp = sampler.sample(logits.expand(n, -1).clone(), sampler.uniforms[:, 0])
    full = torch.log_softmax(logits / temperature, -1)
    torch.testing.assert_close(lp, full[tok], atol=1e-6, rtol=0)
    keep = torch.isfinite(_filter_top_k_top_p((logits / temperature)[None], top_k, top_p))[0]
    want = full.exp() * keep
    want = want / want.sum()
    freq = torch.bincount(tok, minlength=len(logits)).double() / n
    sigma = (want * (1 - want) / n).sqrt().double()
    assert (freq[~keep] == 0).all(), "a filtered-out token was sampled"
    assert ((freq - want.double()).abs() <= 3.5 * sigma + 1e-12).all(), (freq.tolist(), want.tolist())


FUSED_CFGS = {
    "gqa": CFG,
    "mha_biases": ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        max_seq_len=48,
        init_std=0.1,
        attention_bias=True,
        o_proj_bias=True,
    ),
}


@pytest.mark.parametrize("name", sorted(FUSED_CFGS))
@pytest.mark.parametrize("prompts", [PROMPTS, [[1, 2, 3], [4, 5, 6]]], ids=["left_padded", "no_padding"])
def test_fused_decode_equals_the_module_path(name, prompts):
    """Packed q/k/v and gate/up weights (one GEMM per group, aligner.nn.layers.pack_linears) give
    the unpacked modules' tokens and log-probs, greedy and seeded sampling, MHA with biases and GQA."""
    cfg = FUSED_CFGS[name]
    fused = TorchEngine(build_model(cfg, seed=3).eval(), fused_decode=True)
    plain = TorchEngine(build_model(cfg, seed=3).eval(), fused_decode=False)
    assert fused.fused_decode and not plain.fused_decode
    attn = fused.model.model.layers["0"].self_attn
    w, b, group = attn.q_proj.packed
    assert group == (attn.q_proj, attn.k_proj, attn.v_proj)
    assert attn.q_proj.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() and (b is not None) == cfg.attention_bias
    for s in (SamplingConfig(temperature=0.0, max_new_tokens=12), SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=12)):
        seeds = list(range(len(prompts)))
        got, want = fused.generate(prompts, s, seeds=seeds), plain.generate(prompts, s, seeds=seeds)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        for g, w_ in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.rollout_log_probs), torch.tensor(w_.rollout_log_probs), atol=1e-5, rtol=0)


def test_refit_writes_through_the_fused_weights_of_every_engine_on_a_model():
    """update_weights into q/k/v and gate/up (views of the fused tensors) changes what decode
    multiplies by, also for a second engine built on the same model (packing is shared)."""
    target = build_model(CFG, seed=5).eval()
    shared = build_model(CFG, seed=4).eval()
    first, second = TorchEngine(shared), TorchEngine(shared)
    second.update_weights((n, t.clone()) for n, t in target.state_dict().items())
    second.finish_weight_update()
    s = SamplingConfig(temperature=0.0, max_new_tokens=10)
    want = [greedy_reference(target, p, 10) for p in PROMPTS]
    assert [g.token_ids for g in second.generate(PROMPTS, s)] == want
    assert [g.token_ids for g in first.generate(PROMPTS, s)] == want
