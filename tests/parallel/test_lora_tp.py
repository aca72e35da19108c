"""LoRA on tensor-parallel layouts equals the single-process LoRA policy (CPU, gloo).

On 2 ranks: tp=2 (kv heads split), pp=2, tp=2 with sequence parallelism, tp=2 with one kv head
(replicated kv rows, whose adapter B rows are replicated too), dp=2 FSDP2 (frozen base params
in the sharded groups) and dp=2 DDP. Each builds a Policy with adapters on every linear and the same random
B (B = 0 at init would make the forward check trivial); the response log-probs, the losses of 3
AdamW steps (grad clipping on) and the gathered adapters after them must equal a single-process
Policy within 1e-5, and the base weights must be unchanged. A missing tp reduction of the
replicated A (column) or B (row) gradients makes the tp=2 adapters differ by ~1e-3.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name: (tp, dp, sequence_parallel, num_kv_heads, dp_backend); pp = 2 / (tp * dp)
    "tp2": (2, 1, False, 2, "ddp"),
    "pp2": (1, 1, False, 2, "ddp"),
    "tp2-sp": (2, 1, True, 2, "ddp"),
    "tp2-kv1": (2, 1, False, 1, "ddp"),
    "dp2-fsdp2": (1, 2, False, 2, "fsdp2"),
    "dp2-ddp": (1, 2, False, 2, "ddp"),
}


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 64, (4, 8), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 3:] = 1
    return {"input_ids": ids, "loss_mask": mask, "prompt_lens": torch.full((4,), 3), "response_mask": mask[:, 3:].clone()}


def _policy(tp, dp, sp, kv, backend, dims):
    from aligner.actor.policy import Policy
    from aligner.config import LoraConfig, OptimConfig, ParallelConfig
    from aligner.nn import lora

    cfg = tiny_model_config(num_kv_heads=kv, init_std=0.2)
    pp = 1 if dims.world_size == 1 else dims.world_size // (tp * dp)
    par = ParallelConfig(tp_size=tp, pp_size=pp, dp_size=dp, sequence_parallel=sp, dp_backend=backend)
    optim = OptimConfig(lr=1e-2, eps=1.0, warmup_steps=0, schedule="constant", grad_clip=0.5)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pol = Policy(cfg, par, optim, dims, total_steps=5, seed=7, lora=LoraConfig(rank=4, alpha=8.0, target_modules=targets))
    with torch.no_grad():
        for name, m in pol.runtime.module.named_modules():
            if isinstance(m, lora.LoraAdapter):
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                full = torch.randn(m.out_features, m.rank, generator=g) * 0.2
                local = m.full_to_local("B", full)
                b = m.B.to_local() if hasattr(m.B, "to_local") else m.B
                if dp > 1 and backend == "fsdp2":  # FSDP2 keeps dim-0 chunks of the tp-local tensor
                    local = local.chunk(dp)[dims.dp_rank]
                b.copy_(local)
    return pol


def _run(pol, dp_rank=0, dp=1):
    batch = _batch()
    if dp > 1:
        batch = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    lp = pol.log_probs(batch, 2)
    losses = [pol.sft_step(batch, 2)["loss"] for _ in range(3)]
    return lp, losses, pol.full_state_dict()


def _battery(rank, world_size):
    from aligner.parallel.dims import ParallelDims

    out = {}
    for name, (tp, dp, sp, kv, backend) in LAYOUTS.items():
        pp = world_size // (tp * dp)
        dims = ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp, world_size=world_size, rank=rank).build()
        lp, losses, sd = _run(_policy(tp, dp, sp, kv, backend, dims), dims.dp_rank, dp)
        out[name] = (lp.tolist(), losses, {k: v.tolist() for k, v in sd.items()})
    return out


def test_lora_layouts_match_single_process():
    from aligner.parallel.dims import ParallelDims

    refs = {}
    for kv in (2, 1):
        pol = _policy(1, 1, False, kv, "ddp", ParallelDims(device_type="cpu"))
        init = {k: v.clone() for k, v in pol.full_state_dict().items()}
        refs[kv] = (*_run(pol), init)
    results = run_distributed(_battery, world_size=2)
    for name, (_, dp, _, kv, _) in LAYOUTS.items():
        want_lp, want_losses, want_sd, init = refs[kv]
        moved = max(float((want_sd[k] - init[k]).abs().max()) for k in want_sd if ".lora." in k)
        assert moved > 1e-3, "the steps must move the adapters"
        for rank, res in enumerate(results):
            lp, losses, sd = res[name]
            want = want_lp.chunk(dp)[rank] if dp > 1 else want_lp  # each dp rank scored its share of the batch
            torch.testing.assert_close(torch.tensor(lp), want, atol=1e-5, rtol=0, msg=f"{name} rank {rank}: log_probs")
            assert losses == pytest.approx(want_losses, abs=1e-5), (name, rank)
            for k, v in want_sd.items():
                got = torch.tensor(sd[k])
                if ".lora." in k:
                    torch.testing.assert_close(got, v, atol=1e-5, rtol=0, msg=f"{name} rank {rank}: {k}")
                else:
                    assert torch.equal(got, init[k]), f"{name} rank {rank}: frozen {k} changed"
