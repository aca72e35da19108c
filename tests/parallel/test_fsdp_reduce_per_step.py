"""``parallel.fsdp_reduce=step``: FSDP2 gradient accumulation that communicates once per optimizer step.

With 4 micro-batches a dp rank, the default (``micro_batch``) all-gathers every FSDP2 unit (each
decoder layer and the root: embedding, final norm, head) in forward and again in backward and
reduce-scatters its gradient for every micro-batch; ``step`` (aligner.parallel.data_parallel.FsdpStepReduce)
all-gathers each unit once and reduce-scatters it once per step. Checked on gloo ranks, fp32, 3 clipped
AdamW steps: one step's reduced gradient shards equal the ``micro_batch`` run's within 1e-6, the
parameters after 3 steps equal it and the single-process full-batch reference within the bound
tests/toolkit/assertions.py derives for fp32 summation-order differences through AdamW
(:func:`adamw_param_tol`: 9.2e-5 at pp=2's 4 layers, 5.7e-5 at dp=2's 2; measured at pp=2 on a
2-core AMD EPYC, 2026-11-29: 5.0e-6 against the reference, 1.44e-5 as an AVX2-only CPU, the
``make test-avx2`` emulation, which is what a real AVX2-only EPYC measured), and the
collectives FSDP2 issues (torch 2.13 calls ``torch.distributed.all_gather_single`` /
``reduce_scatter_single``; both are counted) are one all-gather and one reduce-scatter per unit per
step, against m reduce-scatters and 2m all-gathers per unit per step. Layouts: dp=2 (pp=1), and
pp=2 x dp=2 with plain and interleaved (virtual_pp_size=2) 1F1B.
"""

from __future__ import annotations

import contextlib

import pytest

from aligner.config import OptimConfig, ParallelConfig
from aligner.errors import ConfigError
from tests.toolkit.assertions import adamw_param_tol, max_abs_diff
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed
from tests.toolkit.training import OPTIM, STEPS, batches, engine_run, make_engine, reference_run

pytestmark = pytest.mark.distributed

M = 4  # micro-batches per dp rank and step (8 rows a batch, 4 a dp rank, 1 a micro-batch)


@contextlib.contextmanager
def _counting():
    """Count the calls of the collectives FSDP2 issues (all-gather, reduce-scatter) while inside; restores them."""
    import torch.distributed as dist

    counts = {"all_gather": 0, "reduce_scatter": 0}
    names = {
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
    }
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[names[name]] += 1
            return fn(*args, **kwargs)

        return counted

    try:
        for n, fn in saved.items():
            setattr(dist, n, wrap(n, fn))
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _fsdp_units(eng) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in eng.module.modules())


def _loss(eng):
    from aligner.parallel.tensor_parallel import vocab_start
    from tests.toolkit.training import lm_loss

    start = vocab_start(eng.module) if eng.dims.is_last_pp_stage else 0
    return lambda out, mb: lm_loss(out, mb["input_ids"], eng.dims.tp_group, start)


def _battery(rank: int, world: int, layouts: list[dict], num_layers: int) -> dict:
    cfg, optim, data = tiny_model_config(num_layers=num_layers), OptimConfig(**OPTIM), batches(batch=8)
    _, _, ref_sd = reference_run(cfg, optim, data)
    out = {}
    for layout in layouts:
        for mode in ("micro_batch", "step"):
            eng = make_engine(cfg, ParallelConfig(**layout, dp_backend="fsdp2", fsdp_reduce=mode), optim, world)
            # the first batch's reduced gradients (this rank's shards), before any step
            eng.forward_backward([{"input_ids": m} for m in data[0].chunk(eng.dims.dp_size)[eng.dims.dp_rank].chunk(M)], _loss(eng))
            grads = {n: p.grad.to_local().clone() for n, p in eng.module.named_parameters()}
            eng.zero_grad()
            with _counting() as counts:
                losses, _ = engine_run(eng, data, num_micro_batches=M)
            state = {k: v.clone() for k, v in eng.full_state_dict().items()}
            out[(tuple(layout.items()), mode)] = {
                "tol": adamw_param_tol(OPTIM["lr"], STEPS, data[0].numel(), cfg),
                "grads": grads,
                "counts": dict(counts),
                "units": _fsdp_units(eng),
                "losses": losses,
                "state": state,
                "ref_diff": max_abs_diff(state, ref_sd),
            }
    return out


def _check(results: list[dict], layouts: list[dict]) -> None:
    for r in results:
        for layout in layouts:
            key = tuple(layout.items())
            mb, st = r[(key, "micro_batch")], r[(key, "step")]
            units = st["units"]
            assert units >= 2, layout
            # step: each unit all-gathered once and reduce-scattered once per step
            assert st["counts"] == {"all_gather": units * STEPS, "reduce_scatter": units * STEPS}, (layout, st["counts"], units)
            # micro_batch: a reduce-scatter per unit and micro-batch, an all-gather in forward and one in backward
            assert mb["counts"]["reduce_scatter"] == M * units * STEPS, (layout, mb["counts"], units)
            assert mb["counts"]["all_gather"] >= 2 * M * (units - 1) * STEPS, (layout, mb["counts"], units)
            assert max_abs_diff(st["grads"], mb["grads"]) < 1e-6, layout  # one step's reduced gradient shards
            # after 3 AdamW steps: the two reduction schedules, and each against the full-batch reference, sum the
            # same gradients in other orders; the bound is the one AdamW's arithmetic gives (adamw_param_tol)
            tol = st["tol"]
            assert max_abs_diff(st["state"], mb["state"]) < tol, (layout, max_abs_diff(st["state"], mb["state"]), tol)
            assert st["losses"] == pytest.approx(mb["losses"], abs=1e-6), layout
            assert st["ref_diff"] < tol and mb["ref_diff"] < tol, (layout, st["ref_diff"], mb["ref_diff"], tol)
    print({str(k): (v["counts"], v["units"], v["ref_diff"], v["tol"]) for k, v in results[0].items()})
    for layout in layouts:
        key = tuple(layout.items())
        print(layout, "grad diff", max_abs_diff(results[0][(key, "step")]["grads"], results[0][(key, "micro_batch")]["grads"]))


def test_fsdp_reduce_step_dp2_matches_micro_batch_with_one_reduce_per_step():
    layouts = [dict(dp_size=2)]
    _check(run_distributed(_battery, 2, args=(layouts, 2)), layouts)


@pytest.mark.slow
def test_fsdp_reduce_step_pp2_dp2_plain_and_interleaved_1f1b():
    layouts = [dict(pp_size=2, dp_size=2), dict(pp_size=2, dp_size=2, virtual_pp_size=2)]
    _check(run_distributed(_battery, 4, args=(layouts, 4), timeout_s=600), layouts)


def _forward_battery(rank: int, world: int, layouts: list[dict], num_layers: int) -> dict:
    """Forward-only passes (no autograd: PPO's old log-probs and values) over M micro-batches inside
    ``TrainRuntime.forward_only``: outputs, FSDP2 all-gathers, and whether every parameter is a sharded DTensor after."""
    import torch
    from torch.distributed.tensor import DTensor

    from aligner.parallel.pipeline import pipeline_forward

    cfg, optim, data = tiny_model_config(num_layers=num_layers), OptimConfig(**OPTIM), batches(batch=8)
    out = {}
    for layout in layouts:
        for mode in ("micro_batch", "step"):
            eng = make_engine(cfg, ParallelConfig(**layout, dp_backend="fsdp2", fsdp_reduce=mode), optim, world)
            mbs = [{"input_ids": m} for m in data[0].chunk(eng.dims.dp_size)[eng.dims.dp_rank].chunk(M)]
            with _counting() as counts, torch.no_grad(), eng.forward_only(len(mbs)):
                if eng.dims.pp_size > 1:
                    logits = pipeline_forward(eng.pp_stages, eng.dims, mbs, lambda o, mb: o.float(), broadcast=True)
                else:
                    logits = torch.cat([eng(mb["input_ids"]).float() for mb in mbs])
            out[(tuple(layout.items()), mode)] = {
                "logits": logits,
                "counts": dict(counts),
                "units": _fsdp_units(eng),
                "sharded": all(isinstance(p, DTensor) for p in eng.module.parameters()),
            }
    return out


def _check_forward(results: list[dict], layouts: list[dict]) -> None:
    for r in results:
        for layout in layouts:
            key = tuple(layout.items())
            mb, st = r[(key, "micro_batch")], r[(key, "step")]
            units = st["units"]
            assert st["counts"] == {"all_gather": units, "reduce_scatter": 0}, (layout, st["counts"], units)  # once per pass
            assert mb["counts"]["all_gather"] >= M * (units - 1), (layout, mb["counts"], units)  # once per micro-batch
            assert max_abs_diff({"l": st["logits"]}, {"l": mb["logits"]}) < 1e-6, layout
            assert st["sharded"] and mb["sharded"], "the held units are freed after the pass"


def test_fsdp_reduce_step_forward_only_pass_gathers_each_unit_once():
    """With fsdp_reduce=step a forward-only pass gathers each unit once and frees it at the end (the
    same logits as per-micro-batch gathers); dp=2 and pp=2 x dp=2."""
    layouts = [dict(dp_size=2)]
    _check_forward(run_distributed(_forward_battery, 2, args=(layouts, 2)), layouts)
    layouts = [dict(pp_size=2, dp_size=2)]
    _check_forward(run_distributed(_forward_battery, 4, args=(layouts, 4), timeout_s=300), layouts)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(fsdp_reduce="once"), "parallel.fsdp_reduce='once' is invalid: valid choices are micro_batch, step"),
        (dict(fsdp_reduce="step", dp_backend="ddp"), "parallel.fsdp_reduce='step' is invalid: needs parallel.dp_backend=fsdp2"),
        (dict(fsdp_reduce="step", dp_backend="deepspeed"), "needs parallel.dp_backend=fsdp2, not deepspeed"),
        (dict(fsdp_reduce="step", dp_size=2, ep_size=2), "with expert parallelism (parallel.ep_size=2) is untested"),
    ],
)
def test_fsdp_reduce_bad_values_refused_in_one_line(fields, words):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**fields).validate("parallel")
    assert words in str(e.value) and "\n" not in str(e.value)
