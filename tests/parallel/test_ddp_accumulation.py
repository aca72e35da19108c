"""DDP with gradient accumulation: one dp all-reduce per optimizer step, not one per micro-batch.

TrainRuntime.forward_backward runs every micro-batch but the step's last under DDP's ``no_sync()``, so
the gradients accumulate locally and the last backward all-reduces their sum (Megatron's and
torchtitan's DDP accumulation). Checked on 2 gloo ranks: the reducer's buckets are communicated as
often with 4 micro-batches as with 1 (a counting comm hook), and 4 micro-batches still train like the
single-process full-batch reference (tests/toolkit/assertions' 1e-4 after 3 clipped AdamW steps).
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import OptimConfig, ParallelConfig
from tests.toolkit.assertions import max_abs_diff
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed
from tests.toolkit.training import OPTIM, batches, engine_run, make_engine, reference_run

pytestmark = pytest.mark.distributed


def _counted(engine) -> list[int]:
    """Register a DDP comm hook on `engine.model` that all-reduces (the default) and counts its calls."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    engine.model.register_comm_hook(engine.dims.dp_group, hook)
    return calls


def ddp_battery(rank: int, world: int) -> dict:
    cfg, optim, data = tiny_model_config(), OptimConfig(**OPTIM), batches(batch=8)  # 4 rows a dp rank
    out = {}
    for m in (1, 4):
        eng = make_engine(cfg, ParallelConfig(dp_size=2, dp_backend="ddp"), optim, world)
        calls = _counted(eng)
        losses, _ = engine_run(eng, data, num_micro_batches=m)
        out[m] = {"calls": calls[0], "losses": losses, "state": {k: v.clone() for k, v in eng.full_state_dict().items()}}
    return out


def test_ddp_all_reduces_once_per_step_with_four_micro_batches():
    res = run_distributed(ddp_battery, 2)
    ref_losses, _, ref_sd = reference_run(tiny_model_config(), OptimConfig(**OPTIM), batches(batch=8))
    for r in res:
        one, four = r[1], r[4]
        assert one["calls"] > 0 and four["calls"] == one["calls"], (one["calls"], four["calls"])  # not 4x
        for run in (one, four):
            assert run["losses"] == pytest.approx(ref_losses, abs=1e-5)
            assert max_abs_diff(run["state"], ref_sd) < 1e-4
    assert all(torch.equal(res[0][4]["state"][k], res[1][4]["state"][k]) for k in res[0][4]["state"])  # replicas stay equal
