"""On-policy distillation's teacher role on its own layout equals one process (CPU, gloo).

The teacher is a frozen PolicyWorker (role "teacher") loaded from an HF checkpoint (``teacher.init``) with its own
``teacher.parallel``: tp=2 (sequence parallel), pp=2 and dp=2 (its rows split over two ranks, as the driver's
dp_split dispatch does). Each scores the student's sampled tokens of a ragged batch; the per-token teacher
log-probs and the distillation signal the PPO stage builds from them (:func:`aligner.trainers.distill.teacher_kl_estimate`:
the per-token reverse-KL estimate and its ``teacher_kl`` metric) must equal the one-process teacher's within
TOKEN_TOL / SEQ_TOL, derived below from fp32 rounding (the layouts sum in other orders: never bitwise).
"""

from __future__ import annotations

import pytest
import torch

from tests.toolkit.assertions import FP32_UNIT_ROUNDOFF
from tests.toolkit.models import tiny_model_config
from tests.toolkit.roles import rl_batch
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

MODEL = tiny_model_config(init_std=0.2)
LAYOUTS = {"tp2-sp": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}
# One token's log-prob goes through num_layers blocks of reductions over hidden and intermediate sizes and a
# log-softmax over the vocabulary: n roundings; its magnitude is at most ~8 nats here (init_std=0.2), so two summation
# orders differ by at most |log p| * n * u per token (Higham 4.2, worst case), a sequence's sum of up to 12 tokens by
# 12 times that. A teacher on the wrong rows, a missing shard or an unloaded weight is off by O(1) nats.
_N = MODEL.num_layers * (MODEL.hidden_size + MODEL.intermediate_size) + MODEL.vocab_size
TOKEN_TOL = 8 * _N * FP32_UNIT_ROUNDOFF  # ~1.2e-4
SEQ_TOL = 12 * TOKEN_TOL


def save_teacher(path) -> str:
    """A tiny HF checkpoint (seed 5), the teacher every layout loads."""
    from aligner.model.hf import save_hf
    from aligner.model.llama import build_model

    return str(save_hf(build_model(MODEL, "lm", seed=5).state_dict(), MODEL, path, max_shard_bytes=2**30))


def _cfg(init: str, tp: int, pp: int, dp: int):
    from aligner.config import AlgorithmConfig, AlignerConfig, DataConfig, ParallelConfig, RefRoleConfig, TrainerConfig

    par = ParallelConfig(tp_size=tp, pp_size=pp, dp_size=dp, sequence_parallel=tp > 1, dp_backend="fsdp2" if dp > 1 else "ddp")
    return AlignerConfig(
        model=MODEL,
        algorithm=AlgorithmConfig(distill_coef=1.0 if init else 0.0),
        data=DataConfig(max_prompt_len=8, max_seq_len=32),
        trainer=TrainerConfig(micro_batch_size=2, seed=3, progress=False),
        teacher=RefRoleConfig(init=init, parallel=par),
    )


def _inputs() -> dict:
    b = rl_batch(seed=6)
    return {k: b[k] for k in ("input_ids", "prompt_lens", "response_mask")}


def _teacher_log_probs(init: str, tp: int, pp: int, dp: int, dims) -> torch.Tensor:
    from aligner.workers.actor import PolicyWorker
    from aligner.workers.dispatch import split_batch

    worker = PolicyWorker(_cfg(init, tp, pp, dp), "teacher", init=init, dims=dims)
    return worker.log_probs(split_batch(_inputs(), dp)[dims.dp_rank])


def _battery(rank: int, world_size: int, init: str):
    from aligner.parallel.dims import ParallelDims

    out = {}
    for name, (tp, pp, dp) in LAYOUTS.items():
        dims = ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp, world_size=world_size, rank=rank).build()
        out[name] = (dims.dp_rank, _teacher_log_probs(init, tp, pp, dp, dims).tolist())
    return out


def _distill(teacher_lp: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The PPO stage's distillation signal for a fixed student: (per-token kl [B, R], teacher_kl metric)."""
    from aligner.protocol import RolloutBatch
    from aligner.trainers.distill import teacher_kl_estimate

    x = _inputs()
    mask = x["response_mask"]
    g = torch.Generator().manual_seed(8)
    student = -torch.rand(mask.shape, generator=g) * 4 * mask
    batch = RolloutBatch(
        input_ids=x["input_ids"],
        attention_mask=(x["input_ids"] != 0).long(),
        prompt_lens=x["prompt_lens"],
        response_lens=mask.sum(-1).long(),
        response_mask=mask,
        group_ids=torch.arange(mask.shape[0]),
    )
    batch.kl = torch.zeros_like(mask)
    batch.teacher_log_probs = teacher_lp * mask
    metrics: dict = {}
    kl = teacher_kl_estimate(batch, student, metrics)
    return kl, metrics["teacher_kl"]


def test_teacher_layouts_match_one_process(tmp_path):
    from aligner.parallel.dims import ParallelDims

    init = save_teacher(tmp_path / "teacher")
    want = _teacher_log_probs(init, 1, 1, 1, ParallelDims(device_type="cpu"))
    mask = _inputs()["response_mask"]
    assert want.shape == mask.shape and bool((want[mask > 0] < 0).all()) and bool((want[mask == 0] == 0).all())
    # the checkpoint was loaded: a teacher of other weights (the seeded init) scores the tokens differently
    other = _teacher_log_probs("", 1, 1, 1, ParallelDims(device_type="cpu"))
    assert float((other - want).abs().max()) > 0.1
    want_kl, want_metric = _distill(want)
    results = run_distributed(_battery, world_size=2, args=(init,), timeout_s=900)
    for name in LAYOUTS:
        shares = {}
        for res in results:
            dp_rank, lp = res[name]
            shares[dp_rank] = torch.tensor(lp)
        got = torch.cat([shares[r] for r in sorted(shares)])  # the driver's dp_split gather: rows in dp order
        torch.testing.assert_close(got, want, atol=TOKEN_TOL, rtol=0, msg=f"{name}: teacher log-probs")
        kl, metric = _distill(got)
        torch.testing.assert_close(kl, want_kl, atol=TOKEN_TOL, rtol=0, msg=f"{name}: per-token reverse-KL estimate")
        assert metric == pytest.approx(want_metric, abs=SEQ_TOL), name
