"""Interleaved 1F1B (``parallel.virtual_pp_size=2``) with FSDP2 data parallelism (dp=2 sharded).

4 gloo ranks (pp=2 x dp=2) train a 4-layer tiny Llama (fp32) for 3 AdamW steps with active
global-norm clipping, each rank holding 2 non-contiguous model chunks whose layers are FSDP2 units
(the root unit, embedding / norm / head, shared by a rank's chunks); the losses, grad norms and every
parameter must equal the single-process full-batch reference (losses 1e-5, parameters within
tests/toolkit's AdamW rounding bound, :func:`tests.toolkit.assertions.adamw_param_tol`) and the plain (v=1) FSDP2 1F1B
run in the same processes. A checkpoint saved by the interleaved run and loaded into a plain
pp=2 x dp=2 FSDP2 runtime gives the same next-step loss. Under bf16 mixed precision (the stages'
activations sent in bf16, FSDP2's compute dtype) the interleaved run equals plain 1F1B and stays
within bf16 error of the reference.
"""

from __future__ import annotations

import pytest

from aligner.config import OptimConfig, ParallelConfig
from tests.toolkit.assertions import adamw_param_tol, max_abs_diff
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed
from tests.toolkit.training import OPTIM, STEPS, batches, engine_run, make_engine, reference_run

pytestmark = pytest.mark.distributed


def _battery(rank: int, world: int, ckpt_root: str) -> dict:
    cfg, optim, data = tiny_model_config(num_layers=4), OptimConfig(**OPTIM), batches()
    ref_losses, ref_norms, ref_sd = reference_run(cfg, optim, data)
    out: dict = {"ref_losses": ref_losses, "ref_norms": ref_norms}
    nxt = batches(STEPS + 1)[-1]
    for v in (1, 2):
        eng = make_engine(cfg, ParallelConfig(pp_size=2, dp_size=2, dp_backend="fsdp2", virtual_pp_size=v), optim, world)
        losses, norms = engine_run(eng, data, num_micro_batches=2)
        out[v] = {
            "losses": losses,
            "norms": norms,
            "param_diff": max_abs_diff(eng.full_state_dict(), ref_sd),
            "sharded": all(hasattr(p, "to_local") for p in eng.module.parameters()),
        }
        if v == 2:
            eng.save(f"{ckpt_root}/interleaved")
            out[v]["next"] = engine_run(eng, [nxt], num_micro_batches=2)[0][0]
            plain = make_engine(cfg, ParallelConfig(pp_size=2, dp_size=2, dp_backend="fsdp2"), optim, world)
            out[v]["load_step"] = plain.load(f"{ckpt_root}/interleaved")["step"]
            out[v]["next_after_load"] = engine_run(plain, [nxt], num_micro_batches=2)[0][0]
    for v in (1, 2):  # bf16 compute: the stages' activations travel in bf16
        par = ParallelConfig(pp_size=2, dp_size=2, dp_backend="fsdp2", virtual_pp_size=v, mixed_precision="bf16")
        eng = make_engine(cfg, par, optim, world)
        losses, _ = engine_run(eng, data, num_micro_batches=2)
        out[f"bf16_{v}"] = {"losses": losses, "param_diff": max_abs_diff(eng.full_state_dict(), ref_sd)}
    return out


@pytest.mark.slow
def test_interleaved_fsdp2_dp2_matches_single_process_and_plain_1f1b(tmp_path):
    results = run_distributed(_battery, world_size=4, args=(str(tmp_path),), timeout_s=600)
    tol = adamw_param_tol(OPTIM["lr"], STEPS, batches()[0].numel(), tiny_model_config(num_layers=4))
    for r in results:
        assert min(r["ref_norms"]) > OPTIM["grad_clip"]  # clipping is active
        for v in (1, 2):
            assert r[v]["sharded"], v
            assert r[v]["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), v
            assert r[v]["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), v
            assert r[v]["param_diff"] < tol, (v, r[v]["param_diff"], tol)
        assert r[2]["losses"] == pytest.approx(r[1]["losses"], abs=1e-6)
        assert r[2]["load_step"] == STEPS
        assert r[2]["next_after_load"] == pytest.approx(r[2]["next"], abs=1e-6)
        assert r["bf16_2"]["losses"] == pytest.approx(r["bf16_1"]["losses"], abs=1e-5)
        assert r["bf16_2"]["losses"] == pytest.approx(r["ref_losses"], rel=2e-2)
        assert r["bf16_2"]["param_diff"] < 5e-2
    print(
        {
            v: (results[0][v]["param_diff"], max(abs(a - b) for a, b in zip(results[0][v]["losses"], results[0]["ref_losses"])))
            for v in (1, 2)
        }
    )
