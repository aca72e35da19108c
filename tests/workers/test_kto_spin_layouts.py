"""The KTO and SPIN workers (policy + frozen reference in the same processes) on tp=2 (sequence parallel, selective
recomputation), pp=2 (full recomputation) and dp=2 (FSDP2, the reference sharded too) equal one process (CPU, gloo).

KTO: two KTOWorker.kto_step calls on four unpaired examples (two desirable, two undesirable, of different lengths;
the mismatched KL rows rotate over the GLOBAL batch, so on dp=2 each rank's KL rows hold the other rank's
completions and z0 is a dp all-reduce), micro-batches of one example, then kto_eval. The second step has nonzero
implicit rewards (the reference stays at the initial weights) and its own reference point z0.

SPIN: SPINWorker.spin_step twice on four pairs, then reset_reference (p_theta_t := the policy), a third step (its
loss log 2 again: the policy is its own reference) and spin_eval.

Every metric must equal the single-process worker's within METRIC_TOL and every parameter after the steps within
:func:`tests.toolkit.assertions.adamw_param_tol`, both derived below from fp32 rounding (never bitwise: the layouts
sum in other orders). The three layouts run one after another in one spawned group of two processes.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.toolkit.assertions import FP32_UNIT_ROUNDOFF, adamw_param_tol
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

LAYOUTS = {"tp2-sp": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}
RECOMPUTE = {(2, 1, 1): "selective", (1, 2, 1): "full", (1, 1, 2): "none", (1, 1, 1): "none"}
MODEL = tiny_model_config(init_std=0.2)
LR = 1e-2
MAX_RESPONSE = 6  # the longest completion below (tokens)
MAX_TOKENS = 32  # tokens of one step's batch, at most (4 rows of at most 8 tokens)

# Sequence log-probs are sums of at most MAX_RESPONSE token log-probs, each |log p| <= ~3 log V at init_std=0.2
# (measured below 8 here), computed through reductions over hidden, intermediate and vocab sizes per layer:
# n = num_layers * (hidden + intermediate) + vocab roundings, so two summation orders differ by at most
# MAX_RESPONSE * 8 * n * u (Higham 4.2, worst case). The losses and rewards are beta-scaled sigmoids of
# differences of such sums (slope <= beta <= 0.5, metrics means over examples), log-probs themselves are logged.
_N = MODEL.num_layers * (MODEL.hidden_size + MODEL.intermediate_size) + MODEL.vocab_size
METRIC_TOL = 2 * MAX_RESPONSE * 8 * _N * FP32_UNIT_ROUNDOFF  # ~1.5e-3 worst case; a lost or doubled example is O(0.1)


def _cfg(stage: str, tp: int, pp: int, dp: int):
    from aligner.config import (
        AlignerConfig,
        DataConfig,
        KTOConfig,
        OptimConfig,
        ParallelConfig,
        SPINConfig,
        TrainableRoleConfig,
        TrainerConfig,
    )

    par = ParallelConfig(
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        sequence_parallel=tp > 1,
        dp_backend="fsdp2" if dp > 1 else "ddp",
        recompute=RECOMPUTE[(tp, pp, dp)],
    )
    optim = OptimConfig(lr=LR, eps=1.0, warmup_steps=0, schedule="constant")
    return AlignerConfig(
        stage=stage,
        model=MODEL,
        data=DataConfig(max_prompt_len=8, max_seq_len=32),
        trainer=TrainerConfig(global_batch_size=4, micro_batch_size=1, seed=3, progress=False),
        actor=TrainableRoleConfig(parallel=par, optim=optim),
        kto=KTOConfig(beta=0.5, desirable_weight=1.0, undesirable_weight=1.3),
        spin=SPINConfig(lam=0.5),
    )


def _ids(g, n):
    return torch.randint(4, 64, (n,), generator=g).tolist()


def kto_batch() -> dict:
    from aligner.trainers.kto import collate_unpaired

    g = torch.Generator().manual_seed(1)
    ex = []
    for p, c, label in ((3, 4, True), (5, 1, False), (2, 6, True), (4, 2, False)):  # each dp rank: one of each
        ex.append({"ids": _ids(g, p + c), "prompt_len": p, "label": label})
    return collate_unpaired(ex, pad_id=0, max_seq_len=32)


def spin_batch() -> dict:
    from aligner.data.collate import collate_pairs
    from aligner.trainers.spin import spin_pairs

    g = torch.Generator().manual_seed(2)
    shapes = ((3, 4, 2), (5, 1, 3), (2, 6, 5), (4, 2, 2))
    prompts = [_ids(g, p) for p, _, _ in shapes]
    real = [_ids(g, c) for _, c, _ in shapes]
    generated = [_ids(g, r) for _, _, r in shapes]
    pairs = spin_pairs(prompts, real, generated)
    assert len(pairs) == 4
    return collate_pairs(pairs, pad_id=0)


KTO_KEYS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "kl", "logps_chosen", "logps_rejected")
SPIN_KEYS = ("loss", "dpo_loss", "rewards_chosen", "rewards_rejected", "reward_margin", "logps_chosen")


def _run(stage: str, worker, dp_size: int, dp_rank: int) -> tuple[list[dict], dict]:
    from aligner.workers.dispatch import split_batch

    if stage == "kto":
        share = split_batch(kto_batch(), dp_size)[dp_rank]
        metrics = [worker.kto_step(share) for _ in range(2)] + [worker.kto_eval(share)]
        keys = KTO_KEYS
    else:
        share = split_batch(spin_batch(), dp_size)[dp_rank]
        metrics = [worker.spin_step(share) for _ in range(2)]
        worker.reset_reference()
        metrics += [worker.spin_step(share), worker.spin_eval(share)]
        keys = SPIN_KEYS
    return [{k: m[k] for k in keys} for m in metrics], worker.policy.full_state_dict()


def _worker(stage: str, tp: int, pp: int, dp: int, dims):
    from aligner.workers.kto import KTOWorker
    from aligner.workers.spin import SPINWorker

    cls = KTOWorker if stage == "kto" else SPINWorker
    return cls(_cfg(stage, tp, pp, dp), total_steps=5, dims=dims)


def _battery(rank: int, world_size: int, stage: str):
    from aligner.parallel.dims import ParallelDims

    out = {}
    for name, (tp, pp, dp) in LAYOUTS.items():
        dims = ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp, world_size=world_size, rank=rank).build()
        metrics, sd = _run(stage, _worker(stage, tp, pp, dp, dims), dp, dims.dp_rank)
        out[name] = (metrics, {k: v.tolist() for k, v in sd.items()})
    return out


def _check_single_process(stage: str, want: list[dict]) -> None:
    """The one-process run itself: what the formulas say at the first step, and that the steps move the policy."""
    if stage == "kto":
        # step 1: the policy is the reference, r = z0 = 0: each loss is lambda (1 - sigmoid(0)) = lambda / 2
        assert want[0]["kl"] == 0.0 and want[0]["loss"] == pytest.approx((1.0 + 1.3) / 4, abs=1e-6)
        assert want[1]["kl"] >= 0 and abs(want[1]["reward_margin"]) > 1e-3, "the steps must move the policy"
    else:
        assert want[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)  # step 1: the policy is its reference
        assert abs(want[1]["reward_margin"]) > 1e-3, "the steps must move the policy"
        # after reset_reference the policy is its own reference again: log 2, zero implicit rewards
        assert want[2]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6) and want[2]["rewards_chosen"] == pytest.approx(0, abs=1e-6)
        assert abs(want[3]["reward_margin"]) > 1e-3


@pytest.mark.parametrize("stage", ["kto", "spin"])
def test_worker_layouts_match_single_process(stage):
    from aligner.parallel.dims import ParallelDims

    want_m, want_sd = _run(stage, _worker(stage, 1, 1, 1, ParallelDims(device_type="cpu")), 1, 0)
    _check_single_process(stage, want_m)
    steps = 2 if stage == "kto" else 3
    param_tol = adamw_param_tol(LR, steps, MAX_TOKENS, MODEL)
    for rank, results in enumerate(run_distributed(_battery, world_size=2, args=(stage,), timeout_s=900)):
        for name, (metrics, sd) in results.items():
            for step, (got, want) in enumerate(zip(metrics, want_m)):
                for k in want:
                    assert got[k] == pytest.approx(want[k], abs=METRIC_TOL), (stage, name, rank, step, k, got[k], want[k])
            diff = max(float((torch.tensor(sd[k]) - want_sd[k]).abs().max()) for k in want_sd)
            assert diff < param_tol, (stage, name, rank, diff, param_tol)
    init_sd = _worker(stage, 1, 1, 1, ParallelDims(device_type="cpu")).policy.full_state_dict()
    moved = max(float((want_sd[k] - init_sd[k]).abs().max()) for k in want_sd)
    assert moved > 10 * param_tol, f"the steps moved the parameters by {moved}: the comparison would be vacuous"
