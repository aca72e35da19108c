"""GSPO and CISPO on the training layouts against one process (CPU, gloo).

GSPO's ratio is a mean over every response token of a sequence: on context parallelism (each rank
holds a zigzag share of every row's tokens), tensor parallelism with sequence parallelism, the
pipeline and data parallelism, the actor's loss must still see whole rows. From the same seed, the
update's policy_loss and clipfrac and EVERY parameter's gradient equal one process (fp32: metrics
within 1e-5, gradients within 1e-6 + 1e-5 relative), so a ratio computed over part of a sequence
(a cp rank's share) would fail.
"""

from __future__ import annotations

import pytest
import torch

from aligner.actor.policy import Policy
from aligner.config import AlgorithmConfig, ParallelConfig
from aligner.parallel.dims import ParallelDims
from tests.toolkit.models import tiny_model_config
from tests.toolkit.roles import OPTIM, full_grads, rl_batch
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

CFG = tiny_model_config(init_std=0.2)


def _algo(policy_loss: str) -> AlgorithmConfig:
    agg = "seq-mean-token-mean" if policy_loss == "gspo" else "token-mean"
    return AlgorithmConfig(
        advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, clip_eps=0.05, clip_eps_high=0.08, loss_agg=agg, policy_loss=policy_loss
    )


def _step(par: ParallelConfig, dims: ParallelDims, batch: dict, policy_loss: str, budget: int = 0):
    pol = Policy(CFG, par, OPTIM, dims, seed=0, micro_batch_tokens=budget)
    lp = pol.log_probs(batch, micro_batch_size=2)
    full = {k: v for k, v in batch.items() if k not in ("offset", "returns")}
    full["old_log_probs"] = (lp - batch["offset"]) * batch["response_mask"]
    out = pol.ppo_update(full, _algo(policy_loss), micro_batch_size=2)
    return out, full_grads(pol.runtime)


LAYOUTS = {  # name: (world size, ParallelConfig fields)
    "cp2": (2, {"cp_size": 2}),
    "tp2 pp2 sp": (4, {"tp_size": 2, "pp_size": 2, "sequence_parallel": True}),
    "cp2 dp2 ddp": (4, {"cp_size": 2, "dp_size": 2, "dp_backend": "ddp"}),
}


def _battery(rank, world_size, fields, policy_loss, budget):
    par = ParallelConfig(**fields)
    dims = ParallelDims(
        tp_size=par.tp_size, pp_size=par.pp_size, dp_size=par.dp_size, cp_size=par.cp_size, world_size=world_size, rank=rank
    ).build()
    batch = rl_batch()
    rows = slice(2 * dims.dp_rank, 2 * dims.dp_rank + 2) if dims.dp_size == 2 else slice(None)
    out, grads = _step(par, dims, {k: v[rows] for k, v in batch.items()}, policy_loss, budget)
    return out, grads


@pytest.mark.parametrize(
    "layout, policy_loss, budget",
    [("cp2", "gspo", 0), ("cp2", "gspo", 24), ("tp2 pp2 sp", "gspo", 0), ("cp2 dp2 ddp", "gspo", 0), ("cp2", "cispo", 0)],
)
def test_layouts_equal_one_process(layout, policy_loss, budget):
    world, fields = LAYOUTS[layout]
    want, want_grads = _step(ParallelConfig(), ParallelDims(device_type="cpu"), rl_batch(), policy_loss, budget)
    assert want["policy_loss"] != 0 and 0 < want["clipfrac"] < 1, want
    for rank, (out, grads) in enumerate(run_distributed(_battery, world_size=world, args=(fields, policy_loss, budget), timeout_s=240)):
        for k in ("policy_loss", "clipfrac"):
            assert out[k] == pytest.approx(want[k], abs=1e-5), (layout, rank, k)
        for n, g in want_grads.items():
            torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=f"{layout} rank {rank}: grad of {n}")
