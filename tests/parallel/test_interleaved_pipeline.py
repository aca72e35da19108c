"""Interleaved 1F1B (``parallel.virtual_pp_size``) against plain 1F1B and one process.

The schedule's order is checked in-process (every forward and backward once, Megatron's warm-up
counts, micro-batches in order within a chunk, the layers of each virtual stage); on gloo ranks
the policy (a 4-layer tiny GQA Llama, fp32) at pp=2 with v=2 chunks per rank, and with tp=2 and
with dp=2 (DDP), must give one process's log-probs, PPO metrics (within 1e-5) and every parameter's
gradient (1e-6 + 1e-5 relative; the plain pp=2 schedule runs in the same processes), and the critic's values and
value loss likewise; the bubble a rank spends waiting on its neighbours is timed. A layout the
schedule cannot run is refused by the config, and a micro-batch count that is not a multiple of
pp_size by the schedule, naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from aligner.actor.policy import Policy
from aligner.config import ConfigError, ParallelConfig
from aligner.critic.critic import Critic
from aligner.parallel.dims import ParallelDims
from aligner.parallel.parallelize import virtual_pp_stage_layer_ids
from aligner.parallel.pipeline import interleaved_order
from tests.toolkit.models import tiny_model_config
from tests.toolkit.roles import OPTIM, full_grads, ppo_algo, rl_batch
from tests.toolkit.spawn import run_distributed

CFG = tiny_model_config(init_std=0.2, num_layers=4)


@pytest.mark.parametrize("m, p, v", [(4, 2, 2), (8, 2, 2), (4, 4, 2), (8, 4, 3), (2, 2, 2)])
def test_order_runs_every_forward_once_in_megatron_order(m, p, v):
    for r in range(p):
        order, warmup = interleaved_order(m, p, v, r)
        assert sorted(order) == [(i, c) for i in range(m) for c in range(v)]
        for c in range(v):  # within a chunk, micro-batches in order
            mbs = [i for i, cc in order if cc == c]
            assert mbs == sorted(mbs)
        want = m * v if m == p else min(m * v, (p - r - 1) * 2 + (v - 1) * p)
        assert warmup == want
        # chunk c's forward of micro-batch i never precedes chunk c - 1's (the ring's data dependency)
        pos = {x: k for k, x in enumerate(order)}
        assert all(pos[(i, c)] > pos[(i, c - 1)] for i in range(m) for c in range(1, v))


def test_a_micro_batch_count_not_a_multiple_of_pp_is_refused():
    with pytest.raises(ValueError, match="multiple of pp_size=2, got 3: change trainer.micro_batch_size"):
        interleaved_order(3, 2, 2, 0)


def test_virtual_stages_are_not_contiguous():
    assert virtual_pp_stage_layer_ids(8, 2, 2, 0) == [[0, 1], [4, 5]]
    assert virtual_pp_stage_layer_ids(8, 2, 2, 1) == [[2, 3], [6, 7]]
    assert virtual_pp_stage_layer_ids(4, 2, 2, 1) == [[1], [3]]
    with pytest.raises(ValueError, match="pp_size x virtual_pp_size = 8 exceeds num_layers=4"):
        virtual_pp_stage_layer_ids(4, 2, 4, 0)


def _step(par: ParallelConfig, dims: ParallelDims, batch: dict):
    from aligner.nn.comm import CommCounter

    pol = Policy(CFG, par, OPTIM, dims, seed=0)
    chunks = pol.runtime.chunks
    if par.virtual_pp_size > 1:  # the rank runs v chunk views of its non-contiguous layers
        layers = [sorted(int(i) for i in c.model.layers) for c in chunks]
        assert layers == virtual_pp_stage_layer_ids(4, par.pp_size, par.virtual_pp_size, dims.pp_rank)
    with CommCounter() as counter:
        lp = pol.log_probs(batch, micro_batch_size=1)
        full = {k: v for k, v in batch.items() if k not in ("offset", "returns")}
        full["old_log_probs"] = (lp - batch["offset"]) * batch["response_mask"]
        out = pol.ppo_update(full, ppo_algo(), micro_batch_size=1)
    critic = Critic(CFG, par, OPTIM, dims, seed=1)
    values = critic.values(batch, micro_batch_size=1)
    keys = ("input_ids", "prompt_lens", "response_mask", "returns")
    vout = critic.value_step({**{k: batch[k] for k in keys}, "values": values}, ppo_algo(), micro_batch_size=1)
    return {
        "lp": lp,
        "out": out,
        "grads": full_grads(pol.runtime),
        "values": values,
        "value_loss": vout["value_loss"],
        "wait_s": counter.seconds["pp_wait"],
        "dp": dims.dp_rank,
    }


def _battery(rank, world_size, tp, dp, backend):
    out = {}
    for v in (1, 2):
        par = ParallelConfig(tp_size=tp, pp_size=2, dp_size=dp, virtual_pp_size=v, dp_backend=backend)
        dims = ParallelDims(tp_size=tp, pp_size=2, dp_size=dp, world_size=world_size, rank=rank).build()
        batch = rl_batch()
        if dp == 2:
            batch = {k: x[2 * dims.dp_rank : 2 * dims.dp_rank + 2] for k, x in batch.items()}
        out[v] = _step(par, dims, batch)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("tp, dp, backend", [(1, 1, "fsdp2"), (2, 1, "fsdp2"), (1, 2, "ddp")])
def test_interleaved_equals_plain_1f1b_and_one_process(tp, dp, backend):
    world = 2 * tp * dp
    res = run_distributed(_battery, world_size=world, args=(tp, dp, backend), timeout_s=240)
    ref = _step(ParallelConfig(), ParallelDims(device_type="cpu"), rl_batch())
    r = ref["lp"].shape[1]
    for rank_out in res:
        for v, got in rank_out.items():
            what = f"tp={tp} dp={dp} v={v}"
            rows = slice(2 * got["dp"], 2 * got["dp"] + 2) if dp == 2 else slice(None)
            torch.testing.assert_close(got["lp"][:, :r], ref["lp"][rows], atol=1e-5, rtol=0, msg=what)
            torch.testing.assert_close(got["values"][:, :r], ref["values"][rows], atol=1e-5, rtol=0, msg=what)
            for k in ("policy_loss", "entropy", "clipfrac"):
                assert got["out"][k] == pytest.approx(ref["out"][k], abs=1e-5), (what, k)
            assert got["value_loss"] == pytest.approx(ref["value_loss"], abs=1e-5), what
            for n, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][n], g, atol=1e-6, rtol=1e-5, msg=f"{what}: {n}")
            assert got["wait_s"] > 0, "the ranks wait on each other (the bubble is timed)"


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"virtual_pp_size": 0}, "must be >= 1"),
        ({"virtual_pp_size": 2}, "needs actor.parallel.pp_size > 1"),
        ({"virtual_pp_size": 2, "pp_size": 2, "pp_layer_split": [1, 1]}, "set actor.parallel.pp_layer_split=null"),
        ({"virtual_pp_size": 2, "pp_size": 2}, "4 virtual pipeline stages exceed model.num_layers=2"),
    ],
)
def test_layouts_the_interleaved_schedule_cannot_run_are_refused(fields, match):
    with pytest.raises(ConfigError, match=match) as e:
        ParallelConfig(**fields).validate("actor.parallel", tiny_model_config())
    assert str(e.value).startswith(f"actor.parallel.virtual_pp_size={fields['virtual_pp_size']} is invalid") and "\n" not in str(e.value)
    ParallelConfig(pp_size=2, dp_size=2, virtual_pp_size=2).validate("actor.parallel", tiny_model_config(num_layers=4))  # FSDP2 dp=2 runs
    with pytest.raises(ConfigError, match="interleaved schedule is for training"):
        ParallelConfig(pp_size=2, virtual_pp_size=2).validate("rollout.parallel")
