"""The DPO worker (policy + frozen reference) on tp=2 (sequence parallel, selective recomputation), pp=2 (full
recomputation), dp=2 (FSDP2, the default; the reference sharded too) and cp=2 (each pair's sequences split
over two ranks) equals one process (CPU, gloo).

Two DPOWorker.dpo_step calls (sigmoid DPO with RPO's NLL term; the second step has nonzero
implicit rewards, the reference staying at the initial weights) on four preference pairs of
different lengths in micro-batches of one pair, then dpo_eval: every metric must equal the
single-process worker's within 1e-5, and the full policy weights after the steps within 2e-7
(Adam eps = 1 makes the update smooth in the gradient, as in tests/actor/test_policy_layouts.py).
The four layouts run one after another in one spawned pair of processes.
"""

from __future__ import annotations

import pytest
import torch

from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

LAYOUTS = {"tp2-sp": (2, 1, 1, 1), "pp2": (1, 2, 1, 1), "dp2": (1, 1, 2, 1), "cp2": (1, 1, 1, 2)}
RECOMPUTE = {(2, 1, 1): "selective", (1, 2, 1): "full", (1, 1, 2): "none", (1, 1, 1): "none"}  # the reference runs without
KEYS = ("loss", "dpo_loss", "nll", "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "logps_chosen")


def _cfg(tp: int, pp: int, dp: int, cp: int = 1):
    from aligner.config import (
        AlignerConfig,
        DataConfig,
        DPOConfig,
        OptimConfig,
        ParallelConfig,
        TrainableRoleConfig,
        TrainerConfig,
    )

    model = tiny_model_config(init_std=0.2)
    par = ParallelConfig(
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        cp_size=cp,
        sequence_parallel=tp > 1,
        dp_backend="fsdp2" if dp > 1 else "ddp",
        recompute=RECOMPUTE[(tp, pp, dp)],
    )
    optim = OptimConfig(lr=1e-2, eps=1.0, warmup_steps=0, schedule="constant")
    return AlignerConfig(
        stage="dpo",
        model=model,
        data=DataConfig(max_prompt_len=8, max_seq_len=32),
        trainer=TrainerConfig(global_batch_size=4, micro_batch_size=1, seed=3, progress=False),
        actor=TrainableRoleConfig(parallel=par, optim=optim),
        dpo=DPOConfig(beta=0.5, rpo_alpha=0.3),
    )


def _batch() -> dict:
    from aligner.data.collate import collate_pairs

    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(4, 64, (n,), generator=g).tolist()

    ex = []
    for p, c, r in ((3, 4, 2), (5, 1, 3), (2, 6, 5), (4, 2, 2)):  # dp ranks: 5 and 8 chosen tokens
        prompt = ids(p)
        ex.append({"chosen_ids": prompt + ids(c), "rejected_ids": prompt + ids(r), "prompt_len": p})
    return collate_pairs(ex, pad_id=0)


def _run(worker, dp_size: int, dp_rank: int) -> tuple[list[dict], dict]:
    from aligner.workers.dispatch import split_batch

    share = split_batch(_batch(), dp_size)[dp_rank]
    metrics = [worker.dpo_step(share) for _ in range(2)]
    metrics.append(worker.dpo_eval(share))
    return [{k: m[k] for k in KEYS} for m in metrics], worker.policy.full_state_dict()


def _battery(rank: int, world_size: int):
    from aligner.parallel.dims import ParallelDims
    from aligner.workers.dpo import DPOWorker

    out = {}
    for name, (tp, pp, dp, cp) in LAYOUTS.items():
        dims = ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp, cp_size=cp, world_size=world_size, rank=rank).build()
        metrics, sd = _run(DPOWorker(_cfg(tp, pp, dp, cp), total_steps=5, dims=dims), dp, dims.dp_rank)
        out[name] = (metrics, {k: v.tolist() for k, v in sd.items()})
    return out


def test_dpo_worker_layouts_match_single_process():
    from aligner.parallel.dims import ParallelDims
    from aligner.workers.dpo import DPOWorker

    want_m, want_sd = _run(DPOWorker(_cfg(1, 1, 1), total_steps=5, dims=ParallelDims(device_type="cpu")), 1, 0)
    assert want_m[0]["dpo_loss"] == pytest.approx(0.6931472, abs=1e-6)  # step 1: the policy is the reference
    assert abs(want_m[1]["reward_margin"]) > 1e-3 and abs(want_m[2]["rewards_chosen"]) > 1e-3, "the steps must move the policy"
    for rank, results in enumerate(run_distributed(_battery, world_size=2)):
        for name, (metrics, sd) in results.items():
            for step, (got, want) in enumerate(zip(metrics, want_m)):
                for k in KEYS:
                    assert got[k] == pytest.approx(want[k], abs=1e-5), (name, rank, step, k)
            diff = max(float((torch.tensor(sd[k]) - want_sd[k]).abs().max()) for k in want_sd)
            assert diff < 2e-7, (name, rank, diff)


def test_lora_dpo_reference_is_the_policy_with_adapters_off():
    """actor.lora.rank > 0: no second copy of the weights; the reference log-probs are the frozen
    base's (the same before and after the steps, and equal to a full-weight reference worker's on
    the same init), the first step's loss is log 2 (B = 0), and only the adapters move."""
    from aligner.config import LoraConfig
    from aligner.parallel.dims import ParallelDims
    from aligner.workers.dpo import DPOWorker

    cfg = _cfg(1, 1, 1)
    cfg.actor.lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    worker = DPOWorker(cfg, total_steps=5, dims=ParallelDims(device_type="cpu"))
    assert worker.reference is None
    full = DPOWorker(_cfg(1, 1, 1), total_steps=5, dims=ParallelDims(device_type="cpu"))
    batch = _batch()
    before = worker.reference_log_probs(batch)
    want = full.reference_log_probs(batch)
    for k in before:
        torch.testing.assert_close(before[k], want[k], atol=1e-5, rtol=0)
    base = {k: v.clone() for k, v in worker.policy.runtime.module.state_dict().items() if ".lora." not in k}
    metrics = [worker.dpo_step(batch) for _ in range(2)]
    assert metrics[0]["dpo_loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert abs(metrics[1]["reward_margin"]) > 1e-4
    after = worker.reference_log_probs(batch)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    for k, v in worker.policy.runtime.module.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k]), k
