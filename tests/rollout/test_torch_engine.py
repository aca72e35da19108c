"""TorchEngine exactness against a no-cache full-forward reference, sampling, refit, registry.

Reference for every check: the same aligner model run on each unpadded sequence with no KV
cache (full forward), greedy by argmax and log-probs by vocab_parallel_log_probs.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from aligner.config import SamplingConfig
from aligner.model.llama import build_model
from aligner.nn.layers import ColumnParallelLinear, RowParallelLinear, onednn_available
from aligner.nn.vocab import vocab_parallel_log_probs
from aligner.rollout import build_engine, engine_class
from aligner.rollout.base import Generation, generations_to_padded, mismatch_metrics
from aligner.rollout.torch_engine.cpu_kernels import load_decode_attention
from aligner.rollout.torch_engine.engine import TorchEngine
from aligner.rollout.torch_engine.sampling import filter_top_k_top_p
from aligner.rollout.weight_sync.refit import iter_buckets, refit
from tests.toolkit.engine import ENGINE_CFG, VARLEN, engine_model
from tests.toolkit.generation import greedy_reference
from tests.toolkit.models import tiny_model_config

CFG = ENGINE_CFG
PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [3, 3]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return engine_model()


@pytest.fixture(scope="module")
def engine(model):
    return TorchEngine(model)


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
    with pytest.raises(ValueError, match="torch, trtllm, vllm"):
        build_engine("sglang", model)
    assert isinstance(build_engine("torch", model), TorchEngine)
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install aligner\\[trtllm\\]"):
            build_engine("trtllm", "/nonexistent", None)
    assert engine_class("trtllm").__name__ == "TrtllmEngine"


def test_the_registry_names_its_engine_modules_in_import_statements():
    """Static tools (tests/project/test_layering.py, IDEs) see rollout -> torch_engine / trtllm_engine as
    import statements, not strings; the imports run only when a backend is asked for."""
    import ast
    import subprocess
    import sys

    import aligner.rollout

    tree = ast.parse(Path(aligner.rollout.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {"aligner.rollout.torch_engine.engine", "aligner.rollout.trtllm_engine"} <= imported
    code = "import sys, aligner.rollout; print(sorted(m for m in sys.modules if m.endswith('_engine')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-500:])


def test_generation_dataclass_fields():
    g = Generation([1, 2], [-0.1, -0.2], "stop", 3)
    assert (g.token_ids, g.finish_reason, g.weight_version) == ([1, 2], "stop", 3)


FUSED_CFGS = {
    "gqa": CFG,
    "mha_biases": tiny_model_config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
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


# ---- the continuous scheduler (aligner/rollout/torch_engine/scheduler.py) ------------------------------------------
# ragged prompts and per-request budgets; more requests than slots in most tests below, so slots are
# refilled as rows stop and the last live rows move into the holes once the queue is empty
MIXED = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [3, 3], [4, 4, 4, 4, 4], [9, 1], [2], [6, 5, 4, 3]]
BUDGETS = [10, 3, 7, 12, 1, 9, 6, 11]
SAMPLED = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=12)
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


def cut(tokens: list[int], budget: int, eos) -> list[int]:
    """A no-stop response cut to its budget and after its first eos."""
    tokens = tokens[:budget]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def pick_eos(refs: list[list[int]], budgets: list[int]) -> int:
    """The token that, as eos, stops the most responses before their budget while leaving at least one
    response that never samples it (smallest id on ties)."""

    def early(t):
        return sum(t in r[: n - 1] for r, n in zip(refs, budgets))

    cands = sorted({t for r, n in zip(refs, budgets) for t in r[:n]})
    cands = [t for t in cands if any(t not in r[:n] for r, n in zip(refs, budgets))]
    return max(cands, key=lambda t: (early(t), -t))


def outputs(gens) -> tuple[list[list[int]], list[torch.Tensor]]:
    return [g.token_ids for g in gens], [torch.tensor(g.rollout_log_probs) for g in gens]


def assert_same_generations(got, want) -> None:
    """Token ids equal; log-probs within 1e-5 (different batch shapes take different GEMM blockings)."""
    (gt, gl), (wt, wl) = outputs(got), outputs(want)
    assert gt == wt
    for a, b in zip(gl, wl):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def mixed_refs(model):
    """Greedy no-cache references of MIXED to the longest budget, and the eos that stops some early."""
    refs = [greedy_reference(model, p, max(BUDGETS)) for p in MIXED]
    eos = pick_eos(refs, BUDGETS)
    return refs, eos


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("varlen", marks=VARLEN)])
def test_continuous_greedy_matches_the_reference_with_refills_stops_and_budgets(model, mixed_refs, attention):
    refs, eos = mixed_refs
    want = [cut(r, n, eos) for r, n in zip(refs, BUDGETS)]
    # the test's premise: some responses stop early on eos, others run to their own budgets
    assert sum(w[-1] == eos and len(w) < n for w, n in zip(want, BUDGETS)) >= 2
    assert any(len(w) == n and eos not in w for w, n in zip(want, BUDGETS))
    eng = TorchEngine(model, eos_token_id=eos, max_batch_size=3, decode_attention=attention)
    assert eng.scheduler == "continuous" and eng.decode_attention == attention
    gens = eng.generate(MIXED, GREEDY, max_new_tokens=BUDGETS)
    for i, (p, g, w) in enumerate(zip(MIXED, gens, want)):
        assert g.token_ids == w, f"request {i}"
        assert g.finish_reason == ("stop" if w[-1] == eos else "length"), f"request {i}"
        torch.testing.assert_close(torch.tensor(g.rollout_log_probs), reference_log_probs(model, p, w, 1.0), atol=1e-5, rtol=0)
    st = eng.last_stats
    generated = sum(len(w) for w in want)
    assert st["generated_tokens"] == st["decode_rows"] == generated
    assert st["prompt_tokens"] == sum(len(p) for p in MIXED) and st["prefilled_tokens"] == sum(len(p) - 1 for p in MIXED)
    assert st["shared_prefix_tokens"] == 0 and st["moved_rows"] > 0
    assert generated / 3 <= st["decode_steps"] < generated  # never more than 3 rows a step, but batched


def _permuted(items, order):
    return [items[i] for i in order]


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("varlen", marks=VARLEN)])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_continuous_tokens_do_not_depend_on_the_schedule(model, sampling, attention):
    """Order, pool size (1, 2, 3, 16 slots), micro-batches and other requests in the batch leave every
    request's tokens unchanged and its log-probs within 1e-5."""
    seeds = [100 + i for i in range(len(MIXED))]
    kw = dict(cpu_layout="in_out", fused_decode=True, decode_attention=attention)
    base = TorchEngine(model, max_batch_size=16, **kw)
    want = base.generate(MIXED, sampling, seeds=seeds, max_new_tokens=BUDGETS)
    if sampling.temperature > 0:  # the seeds matter: another seed changes some response
        other = base.generate(MIXED, sampling, seeds=[s + 1 for s in seeds], max_new_tokens=BUDGETS)
        assert outputs(other)[0] != outputs(want)[0]
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    got = base.generate(_permuted(MIXED, order), sampling, seeds=_permuted(seeds, order), max_new_tokens=_permuted(BUDGETS, order))
    assert_same_generations([got[order.index(i)] for i in range(len(MIXED))], want)
    for size, micro in ((1, 1), (2, 1), (3, 1), (6, 2), (6, 3), (3, 3)):
        eng = TorchEngine(model, max_batch_size=size, micro_batches=micro, **kw)
        assert_same_generations(eng.generate(MIXED, sampling, seeds=seeds, max_new_tokens=BUDGETS), want)
        assert eng.last_stats["decode_rows"] == sum(len(g.token_ids) for g in want)
    # mixed in among other requests (one with the prompt of request 0 and another seed, so it shares its prefix)
    others = [[8, 8, 1], [1, 2, 3], [2, 2, 2, 2], [11]]
    prompts, s2, b2, where = [], [], [], []
    for i, (p, s, n) in enumerate(zip(MIXED, seeds, BUDGETS)):
        if i % 2 == 0:
            prompts.append(others[i // 2])
            s2.append(900 + i)
            b2.append(2 + i)
        where.append(len(prompts))
        prompts.append(p)
        s2.append(s)
        b2.append(n)
    mixed = TorchEngine(model, max_batch_size=4, **kw).generate(prompts, sampling, seeds=s2, max_new_tokens=b2)
    assert_same_generations([mixed[j] for j in where], want)


def test_samples_of_one_prompt_share_its_prefill_and_equal_independent_requests(model):
    """3 prompts x 4 samples (4 seeds each): the same tokens and log-probs as each request alone,
    with each prompt prefilled once instead of 4 times."""
    prompts = [[1, 2, 3, 4], [7, 8, 9], [5, 6, 7, 8, 9, 10]]
    batch = [p for p in prompts for _ in range(4)]
    seeds = [31 * i + 7 for i in range(len(batch))]
    eng = TorchEngine(model, max_batch_size=16)
    for sampling in (SAMPLED, GREEDY):
        gens = eng.generate(batch, sampling, seeds=seeds)
        st = dict(eng.last_stats)
        alone, prefilled_alone = [], 0
        for p, s in zip(batch, seeds):
            alone += eng.generate([p], sampling, seeds=[s])
            prefilled_alone += eng.last_stats["prefilled_tokens"]
        assert_same_generations(gens, alone)
        distinct = sum(len(p) - 1 for p in prompts)
        assert st["prefilled_tokens"] == distinct and prefilled_alone == 4 * distinct
        assert st["shared_prefix_tokens"] == 3 * distinct and st["prompt_tokens"] == 4 * sum(len(p) for p in prompts)
    # the samples differ from each other (the shared prefix did not make the seeds collide)
    sampled = [g.token_ids for g in eng.generate(batch, SAMPLED, seeds=seeds)]
    assert all(len({str(t) for t in sampled[4 * k : 4 * k + 4]}) > 1 for k in range(3))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_static_and_continuous_schedulers_agree(model, mixed_refs, sampling):
    _, eos = mixed_refs
    seeds = [7 * i + 1 for i in range(len(MIXED))]
    static = TorchEngine(model, scheduler="static", max_batch_size=3, eos_token_id=eos)
    cont = TorchEngine(model, scheduler="continuous", max_batch_size=3, eos_token_id=eos)
    want = static.generate(MIXED, sampling, seeds=seeds, max_new_tokens=BUDGETS)
    got = cont.generate(MIXED, sampling, seeds=seeds, max_new_tokens=BUDGETS)
    assert_same_generations(got, want)
    assert [g.finish_reason for g in got] == [g.finish_reason for g in want]
    assert [len(g.token_ids) for g in want] != BUDGETS  # eos cut some responses
    assert all(len(g.token_ids) <= n for g, n in zip(want, BUDGETS))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_continuous_graph_step_equals_the_per_step_decode(model, mixed_refs, sampling, monkeypatch):
    """The continuous scheduler's CUDA-graph decode step (SlotDecodeGraph: every slot, the whole
    cache under a mask, free rows at position 0) run eagerly on the CPU: the same tokens, stops and
    log-probs (1e-5) as the per-step path, through refills, moves, shared prefixes and two calls
    that share one graph (the capture itself needs a GPU: tests/rollout/test_trtllm_engine_gpu.py)."""
    from aligner.rollout.torch_engine.continuous_batching import GRAPH_LEN_BLOCK, ContinuousBatching

    _, eos = mixed_refs
    prompts = MIXED + [MIXED[2]] * 3 + [MIXED[0]] * 2  # samples of one prompt share its prefill
    budgets = BUDGETS + [12, 5, 9, 8, 12]
    seeds = [11 * i + 3 for i in range(len(prompts))]
    kw = dict(max_batch_size=4, eos_token_id=eos, decode_attention="sdpa", cpu_layout="out_in", compile="off")
    eager = TorchEngine(model, **kw)
    want = eager.generate(prompts, sampling, seeds=seeds, max_new_tokens=budgets)
    monkeypatch.setattr(ContinuousBatching, "uses_graphs", property(lambda self: True))
    graphed = TorchEngine(model, **kw)
    for n in (len(prompts), len(prompts) - 1):  # the second call: other lengths, the same (slots, rounded length)
        got = graphed.generate(prompts[:n], sampling, seeds=seeds[:n], max_new_tokens=budgets[:n])
        assert_same_generations(got, want[:n])
        assert [g.finish_reason for g in got] == [g.finish_reason for g in want[:n]]
    assert eager.last_stats["moved_rows"] > 0 and eager.last_stats["shared_prefix_tokens"] > 0  # the premise
    assert list(graphed.batching.graphs) == [(4, GRAPH_LEN_BLOCK)] and eager.batching.graphs == {}


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_bad_per_request_budgets_are_refused_naming_the_request(model, scheduler):
    eng = TorchEngine(model, scheduler=scheduler, cpu_layout="out_in")
    s = SamplingConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\]=0"):
        eng.generate(PROMPTS, s, max_new_tokens=[4, 0, 4, 4])
    with pytest.raises(ValueError, match=r"max_new_tokens\[3\]=-2"):
        eng.generate(PROMPTS, s, max_new_tokens=[4, 4, 4, -2])
    with pytest.raises(ValueError, match=r"max_new_tokens\[2\]=42 .*prompt 2 .*max_seq_len"):
        eng.generate(PROMPTS, s, max_new_tokens=[4, 4, 42, 4])  # 7 + 42 > 48
    with pytest.raises(ValueError, match="max_new_tokens has 2 entries for 4 prompts"):
        eng.generate(PROMPTS, s, max_new_tokens=[4, 4])
    assert [len(g.token_ids) for g in eng.generate(PROMPTS, s, max_new_tokens=[4, 1, 41, 2])] == [4, 1, 41, 2]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(scheduler="dynamic"), "scheduler='dynamic'.*continuous, static"),
        (dict(cpu_layout="rows"), "cpu_layout='rows'.*auto, in_out, out_in, onednn"),
        (dict(micro_batches=0), "micro_batches=0"),
        (dict(micro_batches=-1), "micro_batches=-1"),
        (dict(max_batch_size=0), "max_batch_size=0"),
        (dict(decode_attention="paged"), "decode_attention='paged'.*auto, sdpa, varlen"),
    ],
)
def test_bad_engine_options_are_refused(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TorchEngine(model, **kwargs)


def test_varlen_attention_is_refused_where_the_kernel_does_not_run():
    bf16 = build_model(CFG, seed=1).eval().to(torch.bfloat16)
    with pytest.raises(ValueError, match="decode_attention='varlen' is invalid here: the kernel takes fp32 on the CPU"):
        TorchEngine(bf16, decode_attention="varlen")
    assert TorchEngine(bf16).decode_attention == "sdpa"  # auto: SDPA where the kernel does not apply


ATEN_LAYOUTS = {"out_in", "out_in+fused", "in_out", "in_out+fused"}


def test_a_bf16_engine_under_an_avx2_cap_measures_the_kernels_that_run_there(monkeypatch):
    """ALIGNER_CPU_ISA=avx2: oneDNN's bf16 linear (it needs AVX-512 or AVX-NE-CONVERT) is no candidate,
    whatever this CPU has; auto times the aten layouts and keeps the fastest, says why oneDNN was left
    out, and the engine generates what the aten layout does. Asking for oneDNN is refused in one line."""
    monkeypatch.setenv("ALIGNER_CPU_ISA", "avx2")
    bf16 = build_model(CFG, seed=1).eval().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"cpu_layout='onednn' is invalid here: oneDNN's bf16 linear needs AVX-512.*ALIGNER_CPU_ISA=avx2"):
        TorchEngine(bf16, cpu_layout="onednn")
    eng = TorchEngine(bf16, max_batch_size=3)
    timings = eng.layout["timings_ms"]
    assert eng.kernel == "aten" and set(timings) == ATEN_LAYOUTS
    assert timings[min(timings, key=timings.get)] == min(timings.values()) and "ALIGNER_CPU_ISA=avx2" in eng.layout["refused"]["onednn"]
    assert not any(k in m.__dict__ for m in eng.model.modules() for k in ("onednn", "onednn_group"))
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6)
    got = eng.generate(PROMPTS, sampling)
    layout = "in_out" if eng.transposed else "out_in"
    want = TorchEngine(
        build_model(CFG, seed=1).eval().to(torch.bfloat16), max_batch_size=3, cpu_layout=layout, fused_decode=eng.fused_decode
    )
    assert [g.token_ids for g in got] == [g.token_ids for g in want.generate(PROMPTS, sampling)]
    monkeypatch.setenv("ALIGNER_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="ALIGNER_CPU_ISA='avx3' is invalid: valid are default, avx2, avx512 or native"):
        TorchEngine(build_model(CFG, seed=1).eval().to(torch.bfloat16))


@pytest.mark.skipif(__import__("platform").machine().lower() not in ("x86_64", "amd64"), reason="the AVX2 emulation caps x86 ISAs")
def test_a_bf16_engine_runs_as_an_avx2_only_cpu_would(tmp_path):
    """Under the AVX2 emulation of docs/hardware.md oneDNN itself refuses bf16 weights (as on a real
    AVX2-only CPU: "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"),
    and torch's kernels are AVX2's; a bf16 engine built there (rollout.dtype=bfloat16) must choose a
    kernel that runs and generate, not crash in the choice. Its own process: the caps are read at start."""
    import json
    import os
    import subprocess
    import sys

    from tests.toolkit.engine import AVX2_ENV
    from tests.toolkit.paths import REPO

    code = (
        "import json, torch\n"
        "from aligner.config import SamplingConfig\n"
        "from aligner.rollout.torch_engine.engine import TorchEngine\n"
        "from tests.toolkit.engine import engine_model\n"
        "eng = TorchEngine(engine_model().to(torch.bfloat16), max_batch_size=3)\n"
        "gens = eng.generate([[1, 2, 3], [5]], SamplingConfig(temperature=0.0, max_new_tokens=4))\n"
        "print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(), 'kernel': eng.kernel,\n"
        "                  'refused': eng.layout.get('refused', {}), 'tokens': [len(g.token_ids) for g in gens]}))\n"
    )
    env = {**os.environ, **AVX2_ENV, "ALIGNER_CPU_ISA": "", "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["capability"] in ("AVX2", "DEFAULT") and out["tokens"] == [4, 4]
    assert out["kernel"] == "aten" and "bf16" in out["refused"]["onednn"], out  # oneDNN's own refusal, not our cap (unset here)


ONEDNN = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear ops (x86 CPU builds do)")
CANDIDATES = {"out_in", "out_in+fused", "in_out", "in_out+fused"} | ({"onednn", "onednn+fused"} if onednn_available() else set())


def test_cpu_layouts_give_the_same_tokens_and_auto_reports_its_timings():
    gens, engines = {}, {}
    layouts = ("in_out", "out_in", "auto") + (("onednn",) if onednn_available() else ())
    for layout in layouts:
        eng = engines[layout] = TorchEngine(build_model(CFG, seed=1).eval(), cpu_layout=layout, max_batch_size=3)
        gens[layout] = eng.generate(MIXED, GREEDY, max_new_tokens=BUDGETS)
        for g, p in zip(gens[layout], MIXED):  # every kernel: the full-forward reference's log-probs
            torch.testing.assert_close(
                torch.tensor(g.rollout_log_probs), reference_log_probs(engines[layout].model, p, g.token_ids, 1.0), atol=1e-5, rtol=0
            )
    down = {k: e.model.model.layers["0"].mlp.down_proj.weight for k, e in engines.items()}
    assert engines["in_out"].transposed and down["in_out"].t().is_contiguous() and not down["in_out"].is_contiguous()
    assert not engines["out_in"].transposed and down["out_in"].is_contiguous()
    assert engines["out_in"].kernel == "aten" and not any("onednn" in m.__dict__ for m in engines["out_in"].model.modules())
    auto = engines["auto"]
    assert set(auto.layout["timings_ms"]) == CANDIDATES
    assert all(isinstance(v, float) and v >= 0 for v in auto.layout["timings_ms"].values())
    assert (auto.layout["kernel"], auto.layout["transposed"], auto.layout["fused"]) == (auto.kernel, auto.transposed, auto.fused_decode)
    if load_decode_attention() is not None:  # auto also timed the decode attention and took the faster
        att = auto.layout["attention"]
        assert set(att["timings_ms"]) == {"sdpa", "varlen"} and auto.decode_attention == att["choice"]
        assert att["choice"] == min(att["timings_ms"], key=att["timings_ms"].get)
    assert_same_generations(gens["out_in"], gens["in_out"])
    assert_same_generations(gens["auto"], gens["in_out"])
    if "onednn" in engines:
        eng = engines["onednn"]
        lin = [m for m in eng.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        packed = [m for m in lin if "onednn" in m.__dict__ or "onednn_group" in m.__dict__]
        assert eng.kernel == "onednn" and packed and eng.model.lm_head in packed  # the tied head too
        assert_same_generations(gens["onednn"], gens["in_out"])
        # an MKL engine built later on the same model must not multiply by the first one's copies
        again = TorchEngine(eng.model, cpu_layout="out_in", max_batch_size=3)
        assert not any(k in m.__dict__ for m in again.model.modules() for k in ("onednn", "onednn_group"))


@pytest.mark.parametrize("layout", ["auto", "out_in", pytest.param("onednn", marks=ONEDNN)])
def test_refit_between_calls_changes_the_continuous_engines_output(layout):
    """Refit reaches every kernel, the oneDNN-prepacked copies too (re-packed at finish_weight_update,
    or at the next generate when a caller forgot it)."""
    old, target = build_model(CFG, seed=4).eval(), build_model(CFG, seed=5).eval()
    old_ref = [cut(greedy_reference(old, p, 12), n, None) for p, n in zip(MIXED, BUDGETS)]
    want = [cut(greedy_reference(target, p, 12), n, None) for p, n in zip(MIXED, BUDGETS)]
    eng = TorchEngine(build_model(CFG, seed=4).eval(), max_batch_size=3, cpu_layout=layout)
    assert [g.token_ids for g in eng.generate(MIXED, GREEDY, max_new_tokens=BUDGETS)] == old_ref
    eng.update_weights((n, t.clone()) for n, t in target.state_dict().items())
    eng.finish_weight_update()
    gens = eng.generate(MIXED, GREEDY, max_new_tokens=BUDGETS)
    assert want != old_ref and [g.token_ids for g in gens] == want
    assert all(g.weight_version == 1 for g in gens)
    for p, g in zip(MIXED, gens):
        torch.testing.assert_close(torch.tensor(g.rollout_log_probs), reference_log_probs(target, p, g.token_ids, 1.0), atol=1e-5, rtol=0)
    eng.update_weights((n, t.clone()) for n, t in old.state_dict().items())  # no finish_weight_update
    assert [g.token_ids for g in eng.generate(MIXED, GREEDY, max_new_tokens=BUDGETS)] == old_ref


@torch.no_grad()
def sampled_reference(model, prompt: list[int], n: int, seed: int, s: SamplingConfig) -> list[int]:
    """No-cache inverse-CDF sampling: step j takes uniform j of torch.Generator(seed) and the first token
    whose cumulative top-k / top-p filtered probability exceeds it (the engine's documented method)."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    ids = list(prompt)
    for j in range(n):
        logits = model(torch.tensor([ids]))[0, -1:] / s.temperature
        probs = filter_top_k_top_p(logits, s.top_k, s.top_p).softmax(-1)[0]
        cdf = probs.cumsum(-1)
        ids.append(min(int(torch.searchsorted(cdf, u[j] * cdf[-1], right=True)), len(cdf) - 1))
    return ids[len(prompt) :]


def test_continuous_sampling_matches_the_reference_draw_for_draw(model):
    """Seeded sampling with refills: each request's tokens are those of the no-cache reference drawing
    the request's own uniforms in step order, and its log-probs the full-forward ones at temperature T."""
    seeds = [50 + i for i in range(len(MIXED))]
    gens = TorchEngine(model, max_batch_size=3).generate(MIXED, SAMPLED, seeds=seeds, max_new_tokens=BUDGETS)
    for i, (p, g, n, s) in enumerate(zip(MIXED, gens, BUDGETS, seeds)):
        assert g.token_ids == sampled_reference(model, p, n, s, SAMPLED), f"request {i}"
        ref = reference_log_probs(model, p, g.token_ids, SAMPLED.temperature)
        torch.testing.assert_close(torch.tensor(g.rollout_log_probs), ref, atol=1e-5, rtol=0)


def test_a_short_call_then_a_longer_one(model):
    eng = TorchEngine(model, max_batch_size=3)
    short = eng.generate(MIXED, GREEDY, max_new_tokens=[1] * len(MIXED))
    assert [g.token_ids for g in short] == [greedy_reference(model, p, 1) for p in MIXED]
    long = eng.generate(MIXED, GREEDY, max_new_tokens=BUDGETS)
    assert [g.token_ids for g in long] == [greedy_reference(model, p, n) for p, n in zip(MIXED, BUDGETS)]


# ---- pipelined continuous decode (pp = 2 on gloo) against a single-process engine ---------------------
PP_PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [1, 2, 3], [3, 3], [9, 1], [1, 2, 3], [4, 4, 4, 4, 4], [3, 3]]
PP_BUDGETS = [8, 3, 6, 9, 5, 7, 2, 8, 4]
PP_SEEDS = [5, 6, 7, 8, 9, 10, 11, 12, 13]
PP_MICRO_BATCHES = (1, 2, 3)


def pp_eos() -> int:
    model = build_model(CFG, seed=1).eval()
    return pick_eos([greedy_reference(model, p, max(PP_BUDGETS)) for p in PP_PROMPTS], PP_BUDGETS)


def pipelined_battery(rank: int, world_size: int, eos: int) -> dict:
    """Rank r is stage r of a pp = 2 engine (seed-1 weights); every micro-batch count, greedy and sampled."""
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.rollout.weight_sync.refit import rollout_dims

    dims = rollout_dims(world_size, rank, 1, 2)
    model = build_parallel_model(CFG, "lm", dims, seed=1)
    out = {"layers": sorted(model.model.layers.keys())}
    for attention in pp_attentions():
        for micro in PP_MICRO_BATCHES:
            kw = dict(max_batch_size=4, micro_batches=micro, cpu_layout="in_out", decode_attention=attention)
            eng = TorchEngine(model, pp_group=dims.pp_group, eos_token_id=eos, **kw)
            assert eng.pp_size == 2 and eng.micro_batches == micro and eng.decode_attention == attention
            for name, sampling, seeds in (("greedy", GREEDY, None), ("sampled", SAMPLED, PP_SEEDS)):
                gens = eng.generate(PP_PROMPTS, sampling, seeds=seeds, max_new_tokens=PP_BUDGETS)
                out[(attention, micro, name)] = (gens, dict(eng.last_stats))
    return out


def pp_attentions() -> tuple[str, ...]:
    """The decode attentions the pipelined battery runs: SDPA, and the varlen kernel where it builds."""
    return ("sdpa", "varlen") if load_decode_attention() is not None else ("sdpa",)


@pytest.mark.distributed
def test_pipelined_continuous_engine_matches_a_single_process_engine():
    """pp = 2 with 1, 2 and 3 micro-batches over 4 slots (refills, moves, duplicate prompts shared across
    micro-batches, eos stops), with SDPA and with the varlen kernel (RoPE and the k/v write in it): the tokens of a pp = 1 engine on the same weights, log-probs within 1e-5,
    and both stages return the same Generations."""
    from tests.toolkit.spawn import run_distributed

    eos = pp_eos()
    model = build_model(CFG, seed=1).eval()
    single = TorchEngine(model, eos_token_id=eos, max_batch_size=4, cpu_layout="in_out")
    want = {
        "greedy": single.generate(PP_PROMPTS, GREEDY, max_new_tokens=PP_BUDGETS),
        "sampled": single.generate(PP_PROMPTS, SAMPLED, seeds=PP_SEEDS, max_new_tokens=PP_BUDGETS),
    }
    assert any(g.finish_reason == "stop" for g in want["greedy"]) and any(g.finish_reason == "length" for g in want["greedy"])
    for name, gens in want.items():  # the single-process engine is itself exact
        for p, g in zip(PP_PROMPTS, gens):
            ref = reference_log_probs(model, p, g.token_ids, 1.0 if name == "greedy" else SAMPLED.temperature)
            torch.testing.assert_close(torch.tensor(g.rollout_log_probs), ref, atol=1e-5, rtol=0)
    results = run_distributed(pipelined_battery, world_size=2, args=(eos,))
    assert results[0]["layers"] == ["0"] and results[1]["layers"] == ["1"]
    for attention, micro in itertools.product(pp_attentions(), PP_MICRO_BATCHES):
        for name in ("greedy", "sampled"):
            (gens0, stats0), (gens1, _) = results[0][(attention, micro, name)], results[1][(attention, micro, name)]
            assert gens0 == gens1, (attention, micro, name)  # stage 0's Generations, broadcast to stage 1
            assert_same_generations(gens0, want[name])
            assert [g.finish_reason for g in gens0] == [g.finish_reason for g in want[name]], (attention, micro, name)
            assert stats0["decode_rows"] == stats0["generated_tokens"] == sum(len(g.token_ids) for g in want[name])
            assert stats0["shared_prefix_tokens"] > 0, (attention, micro, name)  # the duplicates copied a live row's prompt
            assert stats0["moved_rows"] > 0 or micro == 3, (attention, micro, name)  # one slot per micro-batch: nothing to move


# ---- compiled decode (torch.compile per decoder layer) ------------------------------------


@pytest.fixture
def no_eager_fallback():
    """A layer that would exceed Dynamo's recompile limit raises instead of silently running eager."""
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_compiled_decode_equals_eager_and_sees_refit_weights(scheduler, no_eager_fallback):
    """compile="on": greedy tokens equal the eager engine's and log-probs within 1e-5 (fp32; the
    compiled kernels round differently), greedy and sampled, in the default CPU layout (in place
    refit goes through packed views). Then a refit to other weights: the compiled engine's next
    tokens and log-probs equal a fresh eager engine's on those weights (NeMo-RL's stale-weights
    pitfall: a graph that captured the old weights would still give the old tokens)."""
    old, new = build_model(CFG, seed=4).eval(), build_model(CFG, seed=5).eval()
    seeds = [3 * i + 2 for i in range(len(MIXED))]
    kw = dict(scheduler=scheduler, max_batch_size=3, cpu_layout="in_out", fused_decode=True)
    comp = TorchEngine(build_model(CFG, seed=4).eval(), compile="on", **kw)
    eager = TorchEngine(old, compile="off", **kw)
    assert comp.compiled and not eager.compiled
    assert TorchEngine(build_model(CFG, seed=4).eval(), max_batch_size=3).compiled is False  # auto: eager on the CPU
    for sampling in (GREEDY, SAMPLED):
        want = eager.generate(MIXED, sampling, seeds=seeds, max_new_tokens=BUDGETS)
        assert_same_generations(comp.generate(MIXED, sampling, seeds=seeds, max_new_tokens=BUDGETS), want)
    old_tokens = [g.token_ids for g in want]
    comp.update_weights((n, t.clone()) for n, t in new.state_dict().items())
    comp.finish_weight_update()
    fresh = TorchEngine(new, compile="off", **kw)
    for sampling in (GREEDY, SAMPLED):
        want = fresh.generate(MIXED, sampling, seeds=seeds, max_new_tokens=BUDGETS)
        assert_same_generations(comp.generate(MIXED, sampling, seeds=seeds, max_new_tokens=BUDGETS), want)
    assert [g.token_ids for g in want] != old_tokens  # the refit changed the output


@pytest.mark.slow
def test_compiled_decode_bf16_rounds_as_eager(no_eager_fallback):
    """bf16 weights and KV cache: the compiled engine rounds intermediates as eager does
    (emulate_eager_rounding). Measured (2026-11-24, AMD): log-probs within 1.7e-4 and 8 of 8 greedy
    rows identical; without the emulation 1.5e-2 (as much as eager bf16 vs fp32) and 6 of 8, one
    row taking another token at step 5. Asserted: the first 5 tokens of every row equal, and
    log-probs within 1e-3 up to each row's first differing token (the issue's target is 1e-4)."""
    import torch._inductor.config as inductor_config

    kw = dict(max_batch_size=4, cpu_layout="out_in", fused_decode=False)
    eager = TorchEngine(build_model(CFG, seed=1).eval().to(torch.bfloat16), compile="off", **kw)
    comp = TorchEngine(build_model(CFG, seed=1).eval().to(torch.bfloat16), compile="on", **kw)
    assert inductor_config.emulate_precision_casts
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=10)
    for a, b in zip(comp.generate(MIXED, sampling), eager.generate(MIXED, sampling)):
        assert a.token_ids[:5] == b.token_ids[:5]
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        torch.testing.assert_close(torch.tensor(a.rollout_log_probs[:n]), torch.tensor(b.rollout_log_probs[:n]), atol=1e-3, rtol=0)


def test_bad_compile_option_is_refused(model):
    with pytest.raises(ValueError, match="compile='max' is invalid: valid are auto, on, off"):
        TorchEngine(model, compile="max")


def test_a_long_generate_call_logs_its_progress(model, mixed_refs, monkeypatch, caplog):
    """Past PROGRESS_LOG_S a continuous-batching call logs how many requests finished and tokens so far
    (a 541-prompt evaluation or a rejection-sampling round otherwise says nothing for half an hour)."""
    import logging

    from aligner.rollout.torch_engine import continuous_batching

    _, eos = mixed_refs
    monkeypatch.setattr(continuous_batching, "PROGRESS_LOG_S", 0.0)
    eng = TorchEngine(model, eos_token_id=eos, max_batch_size=3)
    with caplog.at_level(logging.INFO, logger="aligner.rollout"):
        gens = eng.generate(MIXED, GREEDY, max_new_tokens=BUDGETS)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generate: ")]
    assert lines and f"/{len(MIXED)} requests finished" in lines[-1]
    finished = [int(x.split()[1].split("/")[0]) for x in lines]
    assert finished == sorted(finished) and finished[0] < len(gens) == finished[-1]  # logged while requests were decoding
