"""Data parallelism (FSDP2, DDP, DeepSpeed ZeRO) and mixed precision against a single-process reference.

Every sharded run trains the same seeded tiny Llama for 3 AdamW steps with active global-norm
clipping; the reference is the unsharded model on the full batch with torch AdamW,
``torch.nn.utils.clip_grad_norm_`` and the same LambdaLR. Each spawn runs a whole battery.
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import OptimConfig, ParallelConfig
from aligner.parallel.dims import ParallelDims
from aligner.runtime.train_runtime import TrainRuntime, lr_lambda
from tests.toolkit.assertions import adamw_param_tol
from tests.toolkit.assertions import max_abs_diff as max_param_diff
from tests.toolkit.models import tiny_model_config as model_cfg
from tests.toolkit.spawn import run_distributed
from tests.toolkit.training import OPTIM, STEPS, batches, engine_run, make_engine, reference_run

pytestmark = pytest.mark.distributed

# the parameters after the 3 AdamW steps of two runs that sum the same gradients in other orders
# (layouts, backends, the CPU's GEMM kernels): the bound AdamW's arithmetic gives (assertions.adamw_param_tol)
PARAM_TOL = adamw_param_tol(OPTIM["lr"], STEPS, batches()[0].numel(), model_cfg())


def dp2_battery(rank: int, world: int, ckpt_root: str) -> dict:
    cfg, optim, data = model_cfg(), OptimConfig(**OPTIM), batches()
    ref_losses, ref_norms, ref_sd = reference_run(cfg, optim, data)
    out: dict = {"ref_losses": ref_losses, "ref_norms": ref_norms}
    for backend in ("fsdp2", "ddp"):
        eng = make_engine(cfg, ParallelConfig(dp_size=2, dp_backend=backend), optim, world)
        losses, norms = engine_run(eng, data)
        full = eng.full_state_dict()
        out[backend] = {"losses": losses, "norms": norms, "param_diff": max_param_diff(full, ref_sd)}
        if backend == "fsdp2":
            out["fsdp2"]["sharded"] = all(hasattr(p, "to_local") for p in eng.module.parameters())
            out["fsdp2"]["adam_sharded"] = all(hasattr(s["exp_avg"], "to_local") for s in eng.optimizer.state.values())
            # checkpoint saved at dp=2 FSDP2, loaded into dp=2 DDP: same next-step loss
            eng.save(f"{ckpt_root}/fsdp2_dp2")
            nxt = batches(STEPS + 1)[-1]
            out["fsdp2"]["next"] = engine_run(eng, [nxt])[0][0]
            ddp = make_engine(cfg, ParallelConfig(dp_size=2, dp_backend="ddp"), optim, world)
            meta = ddp.load(f"{ckpt_root}/fsdp2_dp2")
            out["fsdp2"]["load_step"] = (meta["step"], ddp.step_count, ddp.optimizer.param_groups[0]["lr"])
            out["fsdp2"]["next_after_load"] = engine_run(ddp, [nxt])[0][0]
    for backend in ("fsdp2", "ddp"):
        eng = make_engine(cfg, ParallelConfig(dp_size=2, dp_backend=backend, mixed_precision="bf16"), optim, world)
        before = {k: v.clone() for k, v in eng.full_state_dict().items()}
        losses, _ = engine_run(eng, data)
        after = eng.full_state_dict()
        out[f"{backend}_bf16"] = {
            "losses": losses,
            "master_fp32": all(p.dtype == torch.float32 for p in eng.module.parameters()),
            "updated": all(not torch.equal(before[k], after[k]) for k in before),
            "param_diff": max_param_diff(after, ref_sd),
        }
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_dp2_fsdp2_ddp_bf16_clip_checkpoint(tmp_path):
    results = run_distributed(dp2_battery, world_size=2, args=(str(tmp_path),), timeout_s=600)
    r = results[0]
    for backend in ("fsdp2", "ddp"):
        assert r[backend]["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), backend
        # clipping is active (grad_clip=0.05) and the global norm equals the single-process one
        assert min(r["ref_norms"]) > OPTIM["grad_clip"]
        assert r[backend]["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), backend
        assert r[backend]["param_diff"] < PARAM_TOL, (backend, r[backend]["param_diff"], PARAM_TOL)
    assert r["fsdp2"]["sharded"] and r["fsdp2"]["adam_sharded"]
    assert r["fsdp2"]["load_step"][:2] == (STEPS, STEPS)
    assert r["fsdp2"]["load_step"][2] == pytest.approx(OPTIM["lr"] * lr_lambda(OptimConfig(**OPTIM), 10)(STEPS))
    assert r["fsdp2"]["next_after_load"] == pytest.approx(r["fsdp2"]["next"], abs=1e-6)
    for backend in ("fsdp2_bf16", "ddp_bf16"):
        assert r[backend]["master_fp32"] and r[backend]["updated"], backend
        assert r[backend]["losses"] == pytest.approx(r["ref_losses"], rel=2e-2), backend
        assert r[backend]["param_diff"] < 5e-2, backend
    # every rank saw the same dp-averaged losses
    assert results[1]["fsdp2"]["losses"] == r["fsdp2"]["losses"]


def tp_pp_battery(rank: int, world: int) -> dict:
    """tp=2 x dp=2 and pp=2 x dp=2 (4 ranks), FSDP2 and DDP, against the full-batch reference."""
    cfg, optim, data = model_cfg(), OptimConfig(**OPTIM), batches()
    ref_losses, ref_norms, ref_sd = reference_run(cfg, optim, data)
    out: dict = {"ref_losses": ref_losses, "ref_norms": ref_norms}
    layouts = {
        "tp2_fsdp2": ParallelConfig(tp_size=2, dp_size=2, dp_backend="fsdp2"),
        "tp2sp_ddp": ParallelConfig(tp_size=2, dp_size=2, dp_backend="ddp", sequence_parallel=True),
        "pp2_fsdp2": ParallelConfig(pp_size=2, dp_size=2, dp_backend="fsdp2"),
        "pp2_ddp": ParallelConfig(pp_size=2, dp_size=2, dp_backend="ddp"),
    }
    for name, par in layouts.items():
        eng = make_engine(cfg, par, optim, world)
        losses, norms = engine_run(eng, data, num_micro_batches=2 if par.pp_size > 1 else 1)
        out[name] = {"losses": losses, "norms": norms, "param_diff": max_param_diff(eng.full_state_dict(), ref_sd)}
    # GQA kv heads replicated over tp (num_kv_heads=1 < tp_size=2), FSDP2: replicated-row grads and norm
    cfg1 = model_cfg(num_kv_heads=1)
    ref1 = reference_run(cfg1, optim, data)
    eng = make_engine(cfg1, ParallelConfig(tp_size=2, dp_size=2), optim, world)
    losses, norms = engine_run(eng, data)
    out["tp2_kv1"] = {
        "losses": losses,
        "norms": norms,
        "ref_losses": ref1[0],
        "ref_norms": ref1[1],
        "param_diff": max_param_diff(eng.full_state_dict(), ref1[2]),
    }
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_pp2_times_dp2_match_single_process():
    r = run_distributed(tp_pp_battery, world_size=4, timeout_s=900)[0]
    for name in ("tp2_fsdp2", "tp2sp_ddp", "pp2_fsdp2", "pp2_ddp", "tp2_kv1"):
        ref_l, ref_n = r[name].get("ref_losses", r["ref_losses"]), r[name].get("ref_norms", r["ref_norms"])
        assert r[name]["losses"] == pytest.approx(ref_l, abs=1e-5), name
        assert r[name]["norms"] == pytest.approx(ref_n, rel=1e-5), name
        assert r[name]["param_diff"] < PARAM_TOL, (name, r[name]["param_diff"], PARAM_TOL)


def test_lr_schedule_warmup_cosine():
    opt = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    f = lr_lambda(opt, total_steps=12)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0)
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(12) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert lr_lambda(OptimConfig(lr=1.0, warmup_steps=0, schedule="constant"), 5)(3) == 1.0


def test_engine_rejects_mismatched_dims():
    with pytest.raises(ValueError, match="parallel.dp_size=2 but ParallelDims.dp_size=1"):
        TrainRuntime(model_cfg(), "lm", ParallelConfig(dp_size=2), OptimConfig(), ParallelDims(), total_steps=10)
    with pytest.raises(ValueError, match="total_steps=0"):
        TrainRuntime(model_cfg(), "lm", ParallelConfig(), OptimConfig(), ParallelDims(), total_steps=0)


def test_single_process_engine_matches_reference():
    cfg, optim, data = model_cfg(), OptimConfig(**OPTIM), batches()
    ref_losses, ref_norms, ref_sd = reference_run(cfg, optim, data)
    eng = TrainRuntime(cfg, "lm", ParallelConfig(), optim, ParallelDims(), total_steps=10)
    losses, norms = engine_run(eng, data)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    assert max_param_diff(eng.full_state_dict(), ref_sd) < 1e-6


def deepspeed_battery(rank: int, world: int) -> dict:
    cfg, optim, data = model_cfg(), OptimConfig(**OPTIM), batches()
    ref_losses, ref_norms, ref_sd = reference_run(cfg, optim, data)
    out: dict = {"ref_losses": ref_losses, "ref_norms": ref_norms}
    for stage in (1, 2, 3):
        eng = make_engine(cfg, ParallelConfig(dp_size=2, dp_backend="deepspeed", zero_stage=stage), optim, world)
        losses, norms = engine_run(eng, data)
        out[f"zero{stage}"] = {"losses": losses, "norms": norms, "param_diff": max_param_diff(eng.full_state_dict(), ref_sd)}
    eng = make_engine(cfg, ParallelConfig(dp_size=2, dp_backend="deepspeed", zero_stage=2, mixed_precision="bf16"), optim, world)
    losses, _ = engine_run(eng, data)
    out["zero2_bf16"] = {"losses": losses, "param_diff": max_param_diff(eng.full_state_dict(), ref_sd)}
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_zero_stages_match_adamw():
    """ZeRO 1-3 (fp32) follow plain AdamW with clipping; bf16 ZeRO-2 within bf16 tolerance.
    The first run JIT-compiles DeepSpeed's C++ op into TORCH_EXTENSIONS_DIR (about a minute)."""
    pytest.importorskip("deepspeed")
    r = run_distributed(deepspeed_battery, world_size=2, timeout_s=900)[0]
    for stage in (1, 2, 3):
        res = r[f"zero{stage}"]
        assert res["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), stage
        assert res["norms"] == pytest.approx(r["ref_norms"], rel=1e-4), stage
        assert res["param_diff"] < PARAM_TOL, (stage, res["param_diff"], PARAM_TOL)
    assert r["zero2_bf16"]["losses"] == pytest.approx(r["ref_losses"], rel=2e-2)
    assert r["zero2_bf16"]["param_diff"] < 5e-2
