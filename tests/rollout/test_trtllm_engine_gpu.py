"""GPU checks: TorchEngine CUDA-graph decode, and TrtllmEngine end to end (skipped without CUDA / the package).

Neither has run on the development machine (no GPU there). CUDA-graph decode must give the
same greedy tokens as eager decode and as the CPU no-cache reference, and log-probs within
1e-4 (fp32). TrtllmEngine (bfloat16: TensorRT-LLM does not run float32) starts from a tiny HF
checkpoint written from our weights, is refit with different weights through
WorkerExtension.update_weights; the log-probs it reports for its greedy tokens must then be
those of the refit weights (our fp32 model on the same tokens, within a bf16 tolerance that
has never been measured: the TensorRT-LLM test has run nowhere), stamped weight_version 1;
after sleep, wakeup and a second refit (the PPO loop's order) it must give the same tokens.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from aligner.config import RolloutConfig, SamplingConfig
from aligner.model.llama import build_model
from aligner.nn.vocab import vocab_parallel_log_probs
from aligner.rollout.refit import refit
from aligner.rollout.torch_engine import TorchEngine
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
    CUDA graph, against the module path (passed on an H100, 2026-11-26; still off on CUDA: unmeasured)."""
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


@needs_trtllm
def test_trtllm_engine_refit_generate_sleep(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from aligner.rollout import build_engine

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
    hf.save_pretrained(tmp_path)
    engine = build_engine("trtllm", str(tmp_path), RolloutConfig(dtype="bfloat16"), max_seq_len=CFG.max_seq_len, dtype="bfloat16")
    try:
        trained = build_model(CFG, seed=2, device="cuda").eval()
        stats = refit(trained, engine, bucket_mb=1)
        assert stats.weight_version == 1 and stats.buckets >= 1
        s = SamplingConfig(temperature=0.0, max_new_tokens=8)
        got = engine.generate(PROMPTS, s)
        assert all(g.weight_version == 1 and len(g.rollout_log_probs) == len(g.token_ids) for g in got)
        diffs = []
        with torch.no_grad():
            for p, g in zip(PROMPTS, got):
                full = torch.tensor([p + g.token_ids], device="cuda")
                ref = vocab_parallel_log_probs(trained(full)[:, len(p) - 1 : -1].float(), full[:, len(p) :])[0].cpu()
                diffs.append((torch.tensor(g.rollout_log_probs) - ref).abs())
        # the engine sampled with the refit weights, not the checkpoint's (seed 1): bf16-close log-probs
        assert torch.cat(diffs).mean().item() < 0.05, diffs
        engine.offload()
        engine.onload()
        assert refit(trained, engine, bucket_mb=1).weight_version == 2
        assert [g.token_ids for g in engine.generate(PROMPTS, s)] == [g.token_ids for g in got]
    finally:
        engine.shutdown()
