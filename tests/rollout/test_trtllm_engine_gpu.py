"""GPU checks: TorchEngine CUDA-graph decode, and TrtllmEngine end to end (skipped without CUDA / the package).

Neither has run on the development machine (no GPU there). CUDA-graph decode must give the
same greedy tokens as eager decode and as the CPU no-cache reference, and log-probs within
1e-4 (fp32). TrtllmEngine (bfloat16: TensorRT-LLM does not run float32) starts from a tiny HF
checkpoint written from our weights, is refit with different weights through
WorkerExtension.update_weights; the log-probs it reports for its greedy tokens must then be
those of the refit weights (our fp32 model on the same tokens, within a bf16 tolerance that
has never been measured: the TensorRT-LLM test has run nowhere), stamped weight_version 1;
after sleep, wakeup and a second refit (the PPO loop's order) it must give the same tokens.
TrtllmEngine with CUDA graphs: refit twice without and twice with release/resume between, its
greedy tokens against an eager (graphs off) TrtllmEngine refit with the same weights
(test_trtllm_cuda_graphs_see_every_refit; unrun).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from aligner.config import RolloutConfig, SamplingConfig
from aligner.model.llama import build_model
from aligner.nn.vocab import vocab_parallel_log_probs
from aligner.rollout.torch_engine.engine import TorchEngine
from aligner.rollout.weight_sync.refit import refit
from tests.toolkit.models import tiny_model_config

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_trtllm = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("tensorrt_llm") is None,
    reason="needs CUDA and tensorrt_llm (pip install aligner[trtllm])",
)
CFG = tiny_model_config(vocab_size=512, hidden_size=128, intermediate_size=256, max_seq_len=64, init_std=0.1)
PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [3, 3]]


@needs_cuda
@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_cuda_graph_decode_matches_eager_and_reference(scheduler):
    """Both schedulers' CUDA-graph decode (static: DecodeGraph, passed on an H100 and an H200;
    continuous: SlotDecodeGraph, passed on an H100 2026-11-26) against eager decode and the no-cache
    reference; a refit is seen by the captured graph."""
    model = build_model(CFG, seed=1, device="cuda").eval()
    kw = dict(scheduler=scheduler, compile="off")
    graphed, eager = TorchEngine(model, cuda_graphs=True, **kw), TorchEngine(model, cuda_graphs=False, **kw)
    s = SamplingConfig(temperature=0.0, max_new_tokens=12)
    a, b = graphed.generate(PROMPTS, s), eager.generate(PROMPTS, s)
    assert graphed.batching.graphs, "no CUDA graph was captured"
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    with torch.no_grad():
        for p, g in zip(PROMPTS, a):
            full = torch.tensor([p + g.token_ids], device="cuda")
            ref = vocab_parallel_log_probs(model(full)[:, len(p) - 1 : -1], full[:, len(p) :])[0].cpu()
            torch.testing.assert_close(torch.tensor(g.rollout_log_probs), ref, atol=1e-4, rtol=0)
    seeded = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=12)
    x, y = graphed.generate(PROMPTS, seeded, seeds=[1, 2, 3, 4]), eager.generate(PROMPTS, seeded, seeds=[1, 2, 3, 4])
    assert [g.token_ids for g in x] == [g.token_ids for g in y]
    # refit copies in place: the captured graph sees the new weights
    refit(build_model(CFG, seed=2, device="cuda"), graphed)
    fresh = TorchEngine(build_model(CFG, seed=2, device="cuda"), cuda_graphs=False, **kw).generate(PROMPTS, s)
    assert [g.token_ids for g in graphed.generate(PROMPTS, s)] == [g.token_ids for g in fresh]


@needs_cuda
@pytest.mark.parametrize("scheduler", ["continuous", "static"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)])
def test_compiled_decode_on_cuda_matches_eager_and_sees_refit(scheduler, dtype, atol):
    """compile="on" on CUDA (continuous: inductor's reduce-overhead CUDA graphs; static: the
    engine's own CUDA graphs around the compiled layers) against compile="off": greedy tokens equal,
    log-probs within the issue's target (1e-5 fp32, 1e-4 bf16: on the CPU bf16 missed it, see
    tests/rollout/test_torch_engine.py); after a refit, a fresh eager engine's tokens (NeMo-RL's
    stale-weights pitfall). Unrun: no GPU on the development machine."""
    s = SamplingConfig(temperature=0.0, max_new_tokens=12)
    comp = TorchEngine(build_model(CFG, seed=1, device="cuda").eval().to(dtype), scheduler=scheduler, compile="on")
    eager = TorchEngine(build_model(CFG, seed=1, device="cuda").eval().to(dtype), scheduler=scheduler, compile="off")
    assert comp.compiled and not eager.compiled
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        got, want = comp.generate(PROMPTS, s), eager.generate(PROMPTS, s)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.rollout_log_probs), torch.tensor(w.rollout_log_probs), atol=atol, rtol=0)
        refit(build_model(CFG, seed=2, device="cuda").to(dtype), comp)
        fresh = TorchEngine(build_model(CFG, seed=2, device="cuda").eval().to(dtype), scheduler=scheduler, compile="off")
        after = comp.generate(PROMPTS, s)
        assert [g.token_ids for g in after] == [g.token_ids for g in fresh.generate(PROMPTS, s)]
        assert [g.token_ids for g in after] != [g.token_ids for g in got]


@needs_cuda
def test_fused_decode_on_cuda_matches_the_module_path_eager_and_graphed():
    """The packed-weight decode step (on by default only on the CPU) on CUDA, eager and inside a
    CUDA graph, against the module path (passed on an H100, 2026-11-26; on by default on CUDA since: 1.06-1.13x on an H200)."""
    s = SamplingConfig(temperature=0.0, max_new_tokens=12)
    want = TorchEngine(build_model(CFG, seed=1, device="cuda").eval(), cuda_graphs=False, fused_decode=False, compile="off").generate(
        PROMPTS, s
    )
    for graphs in (False, True):
        engine = TorchEngine(build_model(CFG, seed=1, device="cuda").eval(), cuda_graphs=graphs, fused_decode=True, compile="off")
        assert engine.fused_decode
        got = engine.generate(PROMPTS, s)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.rollout_log_probs), torch.tensor(w.rollout_log_probs), atol=1e-4, rtol=0)


def _write_hf_checkpoint(directory) -> str:
    """A tiny HF Llama checkpoint of our seed-1 weights (float32) for the TensorRT-LLM engine to start from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=CFG.vocab_size,
        hidden_size=CFG.hidden_size,
        intermediate_size=CFG.intermediate_size,
        num_hidden_layers=CFG.num_layers,
        num_attention_heads=CFG.num_heads,
        num_key_value_heads=CFG.num_kv_heads,
        max_position_embeddings=CFG.max_seq_len,
        rope_theta=CFG.rope_theta,
        rms_norm_eps=CFG.rms_norm_eps,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    hf = LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(build_model(CFG, seed=1).state_dict())
    hf.save_pretrained(directory)
    return str(directory)


def _sampled_log_prob_gap(model, prompts, gens) -> float:
    """Mean |engine log-prob - our fp32 `model`'s log-prob| of the engine's sampled tokens."""
    diffs = []
    with torch.no_grad():
        for p, g in zip(prompts, gens):
            full = torch.tensor([p + g.token_ids], device="cuda")
            ref = vocab_parallel_log_probs(model(full)[:, len(p) - 1 : -1].float(), full[:, len(p) :])[0].cpu()
            diffs.append((torch.tensor(g.rollout_log_probs) - ref).abs())
    return torch.cat(diffs).mean().item()


@needs_trtllm
def test_trtllm_engine_refit_generate_sleep(tmp_path):
    from aligner.rollout import build_engine

    model_dir = _write_hf_checkpoint(tmp_path)
    engine = build_engine("trtllm", model_dir, RolloutConfig(dtype="bfloat16"), max_seq_len=CFG.max_seq_len, dtype="bfloat16")
    try:
        trained = build_model(CFG, seed=2, device="cuda").eval()
        stats = refit(trained, engine, bucket_mb=1)
        assert stats.weight_version == 1 and stats.buckets >= 1
        s = SamplingConfig(temperature=0.0, max_new_tokens=8)
        got = engine.generate(PROMPTS, s)
        assert all(g.weight_version == 1 and len(g.rollout_log_probs) == len(g.token_ids) for g in got)
        # the engine sampled with the refit weights, not the checkpoint's (seed 1): bf16-close log-probs
        assert _sampled_log_prob_gap(trained, PROMPTS, got) < 0.05
        engine.offload()
        engine.onload()
        assert refit(trained, engine, bucket_mb=1).weight_version == 2
        assert [g.token_ids for g in engine.generate(PROMPTS, s)] == [g.token_ids for g in got]
    finally:
        engine.shutdown()


@needs_trtllm
def test_trtllm_cuda_graphs_see_every_refit(tmp_path):
    """Stale CUDA graphs after a refit (decode replaying captured kernels that still read the old
    weights, or memory that release/resume moved) give plausible tokens and no error. An engine with
    CUDA graphs on (and release/resume enabled) is refit with weights A, then B without
    offload/onload between, then A and B again each after offload/onload (AsyncLLM.release / resume,
    the PPO loop's order); after every refit its greedy tokens must equal those of an eager engine
    (CUDA graphs off, no sleep) refit with the same weights, and its log-probs be bf16-close to our
    fp32 model's with those weights (which tells a stale graph from a near-tie between kernels).
    A and B must give different tokens, or the check could not see a stale graph. The two engines
    run one after the other (each takes a whole GPU in TensorRT-LLM's own placement group).
    Unrun: no GPU with tensorrt_llm has been available (aligner/rollout/trtllm_engine.py)."""
    from aligner.rollout import build_engine
    from aligner.rollout.trtllm_engine import build_llm_kwargs

    model_dir = _write_hf_checkpoint(tmp_path)
    weights = {"A": build_model(CFG, seed=2, device="cuda").eval(), "B": build_model(CFG, seed=3, device="cuda").eval()}
    s = SamplingConfig(temperature=0.0, max_new_tokens=12)
    graphed_cfg, eager_cfg = RolloutConfig(dtype="bfloat16", cuda_graphs=True), RolloutConfig(dtype="bfloat16", cuda_graphs=False)
    assert build_llm_kwargs(graphed_cfg, model_dir, max_seq_len=CFG.max_seq_len, enable_sleep=True)["cuda_graph_config"] is not None
    assert build_llm_kwargs(eager_cfg, model_dir, max_seq_len=CFG.max_seq_len, enable_sleep=False)["cuda_graph_config"] is None
    kw = dict(max_seq_len=CFG.max_seq_len, dtype="bfloat16")

    eager = build_engine("trtllm", model_dir, eager_cfg, enable_sleep=False, **kw)
    try:
        want = {}
        for name in ("A", "B"):
            refit(weights[name], eager, bucket_mb=1)
            want[name] = [g.token_ids for g in eager.generate(PROMPTS, s)]
    finally:
        eager.shutdown()
    assert want["A"] != want["B"], "weights A and B give the same greedy tokens: a stale graph would go unseen"

    graphed = build_engine("trtllm", model_dir, graphed_cfg, enable_sleep=True, **kw)
    try:
        steps = [("A", False), ("B", False), ("A", True), ("B", True)]  # (weights, offload/onload before the refit)
        for version, (name, offload) in enumerate(steps, start=1):
            if offload:
                graphed.offload()
                graphed.onload()
            assert refit(weights[name], graphed, bucket_mb=1).weight_version == version
            got = graphed.generate(PROMPTS, s)
            gap = _sampled_log_prob_gap(weights[name], PROMPTS, got)
            assert gap < 0.05, f"refit {version} (weights {name}, offload={offload}): log-probs off by {gap:.4f}: stale graph?"
            assert [g.token_ids for g in got] == want[name], (version, name, offload, [g.token_ids for g in got], want[name])
            assert {g.weight_version for g in got} == {version}
    finally:
        graphed.shutdown()
