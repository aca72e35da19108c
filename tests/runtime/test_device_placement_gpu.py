"""GPU checks of device placement: a role on CUDA computes what the same role on the CPU does.

Skipped without CUDA. The CPU reference is the same Ray-free class pinned to the CPU
(``ParallelDims(device_type="cpu")``); TF32 is off so fp32 matmuls agree to rounding.
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import AlignerConfig, DataConfig, OptimConfig, ParallelConfig, RolloutConfig, SamplingConfig
from aligner.parallel.dims import ParallelDims
from tests.toolkit.models import tiny_model_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = tiny_model_config(vocab_size=512, hidden_size=128, intermediate_size=256, max_seq_len=64, init_std=0.1)


def _policy(device_type: str):
    from aligner.actor.policy import Policy

    optim = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant")
    return Policy(CFG, ParallelConfig(), optim, ParallelDims(device_type=device_type), total_steps=10, seed=3)


def test_policy_on_cuda_matches_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu, cpu = _policy("cuda"), _policy("cpu")
    assert gpu.runtime.device.type == "cuda" and cpu.runtime.device.type == "cpu"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, CFG.vocab_size, (4, 24), generator=g)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    for _ in range(3):
        a, b = gpu.sft_step(batch, micro_batch_size=2), cpu.sft_step(batch, micro_batch_size=2)
        assert abs(a["loss"] - b["loss"]) < 1e-4 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * b["grad_norm"]
    lp_batch = {"input_ids": ids, "prompt_lens": torch.tensor([5, 7, 9, 11]), "response_mask": torch.ones(4, 8)}
    lp_gpu, lp_cpu = gpu.log_probs(lp_batch, 2), cpu.log_probs(lp_batch, 2)
    assert lp_gpu.device.type == "cpu"  # results come back to the driver's device
    torch.testing.assert_close(lp_gpu, lp_cpu, atol=1e-4, rtol=0)


def test_actor_worker_bf16_engine_on_cuda():
    """The actor's rollout engine lands on the GPU in rollout.dtype; its log-probs stay near the trainer's."""
    from aligner.workers.actor import ActorWorker

    cfg = AlignerConfig(
        model=CFG,
        data=DataConfig(max_prompt_len=16, max_seq_len=CFG.max_seq_len),
        rollout=RolloutConfig(dtype="bfloat16", max_batch_size=8, sampling=SamplingConfig(temperature=1.0, max_new_tokens=8)),
    )
    worker = ActorWorker(cfg, "actor", total_steps=10)
    worker.refit()
    p = next(worker.engine.model.parameters())
    assert p.device.type == "cuda" and p.dtype == torch.bfloat16
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    gens = worker.generate(prompts, cfg.rollout.sampling, [1, 2])[1]
    assert [len(g.token_ids) for g in gens] == [8, 8] and all(g.weight_version == 1 for g in gens)
    ids = torch.tensor([p + g.token_ids for p, g in zip(prompts[:1], gens[:1])])
    batch = {"input_ids": ids, "prompt_lens": torch.tensor([3]), "response_mask": torch.ones(1, 8)}
    trainer_lp = worker.log_probs(batch)[0]
    # bf16 engine vs fp32 trainer: close, not equal (the mismatch metric measures exactly this)
    assert float((trainer_lp - torch.tensor(gens[0].rollout_log_probs)).abs().max()) < 0.1
