"""Prompt learning on tp / dp layouts equals the single-process Policy (CPU, gloo).

The virtual prompt is replicated over tp ranks (and sharded over dp by FSDP2 like any other
parameter); the base is frozen. On tp=2 (DDP) and dp=2 (FSDP2) two SFT steps must give the
single-process losses and prompt tensors within 1e-5, leave every base parameter bitwise
unchanged, and greedy decoding through the forward (tp shards of the logits gathered) must pick
the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (4, 10), generator=g)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 4:] = 1
    loss_mask[1, 7:] = 0
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


PROMPTS = [[5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]


def _run(tp: int, dp: int, backend: str, dims):
    from aligner.actor.policy import Policy
    from aligner.config import OptimConfig, ParallelConfig, PromptLearningConfig

    cfg = tiny_model_config(max_seq_len=48, init_std=0.2)
    par = ParallelConfig(tp_size=tp, dp_size=dp, dp_backend=backend)
    optim = OptimConfig(lr=1e-2, eps=1.0, warmup_steps=0, schedule="constant")  # eps=1: see test_policy_layouts
    pl = PromptLearningConfig(type="p_tuning", num_virtual_tokens=4, encoder="mlp", encoder_hidden_size=16)
    pol = Policy(cfg, par, optim, dims, total_steps=5, seed=7, prompt_learning=pl)
    frozen = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in pol.runtime.module.named_parameters()}
    batch = _batch()
    rows = slice(dims.dp_rank * 4 // dp, (dims.dp_rank + 1) * 4 // dp)
    local = {k: v[rows] for k, v in batch.items()}
    losses = [pol.sft_step(local, 1)["loss"] for _ in range(2)]
    unchanged = all(
        torch.equal((p.to_local() if hasattr(p, "to_local") else p).detach(), frozen[n])
        for n, p in pol.runtime.module.named_parameters()
        if not n.startswith("model.prompt.")
    )
    gens = [ids for ids, _, _ in pol.greedy(PROMPTS, 4, [])]
    return losses, {k: v.tolist() for k, v in pol.prompt_tensors().items()}, unchanged, gens


def _battery(rank: int, world_size: int, tp: int, dp: int, backend: str):
    from aligner.parallel.dims import ParallelDims

    dims = ParallelDims(tp_size=tp, pp_size=1, dp_size=dp, world_size=world_size, rank=rank).build()
    return _run(tp, dp, backend, dims)


@pytest.mark.parametrize("tp,dp,backend", [(2, 1, "ddp"), (1, 2, "fsdp2")], ids=["tp2-ddp", "dp2-fsdp2"])
def test_prompt_learning_matches_single_process(tp, dp, backend):
    from aligner.parallel.dims import ParallelDims

    want_loss, want_prompt, ok, want_gens = _run(1, 1, "fsdp2", ParallelDims(device_type="cpu"))
    assert ok
    for rank, (losses, prompt, unchanged, gens) in enumerate(run_distributed(_battery, world_size=tp * dp, args=(tp, dp, backend))):
        assert losses == pytest.approx(want_loss, abs=1e-5), rank
        for k, v in want_prompt.items():
            torch.testing.assert_close(torch.tensor(prompt[k]), torch.tensor(v), atol=1e-5, rtol=0, msg=f"rank {rank}: {k}")
        assert unchanged, f"rank {rank}: a frozen base parameter changed"
        assert gens == want_gens, rank
