"""Resharding checkpoints: save under one tp/pp/dp layout, load under another, same logits and
the same continued training; HF export from a sharded layout; atomic writes."""

from __future__ import annotations

import os

import pytest
import torch

from aligner.config import OptimConfig, ParallelConfig
from aligner.parallel.dims import ParallelDims
from aligner.runtime.train_runtime import TrainRuntime
from tests.toolkit.models import tiny_model_config as model_cfg
from tests.toolkit.spawn import run_distributed
from tests.toolkit.training import OPTIM, batches, engine_run, make_engine

pytestmark = pytest.mark.distributed


def full_logits(engine: TrainRuntime, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of `ids` on every rank, from any tp/pp layout (dp replicas agree)."""
    from aligner.parallel.pipeline import pipeline_forward

    d = engine.dims

    def gather_vocab(out, mb):
        if d.tp_group is None:
            return out.detach().float()
        parts = [torch.empty_like(out) for _ in range(d.tp_size)]
        torch.distributed.all_gather(parts, out.contiguous(), group=d.tp_group)
        return torch.cat(parts, dim=-1).detach().float()

    if d.pp_size == 1:
        with torch.no_grad():
            return gather_vocab(engine(ids), None)
    return pipeline_forward(engine.module, d, [{"input_ids": ids}], gather_vocab)


def save_tp2_battery(rank: int, world: int, root: str) -> dict:
    """tp=2, pp=1, dp=1: train 2 steps, save, then record logits and 2 more steps' losses."""
    cfg, optim, data = model_cfg(), OptimConfig(**OPTIM), batches(6)
    eng = make_engine(cfg, ParallelConfig(tp_size=2), optim, world)
    engine_run(eng, data[:2])
    eng.save(f"{root}/ckpt", extra={"note": "tp2"})
    listing = sorted(os.listdir(root))
    logits = full_logits(eng, data[5])
    full = eng.full_state_dict()
    losses, _ = engine_run(eng, data[2:4])
    if rank == 0:  # tensors go through a file: queue-shared tensor storage dies with the child
        torch.save({"logits": logits, "full": full}, f"{root}/expected.pt")
    return {"losses": losses, "listing": listing}


def load_pp2_dp2_battery(rank: int, world: int, root: str) -> dict:
    """tp=1, pp=2, dp=2 (FSDP2) and tp=2 x dp=2 (DDP): load the tp=2 checkpoint and continue."""
    expected = torch.load(f"{root}/expected.pt")
    cfg, optim, data = model_cfg(), OptimConfig(**OPTIM), batches(6)
    out = {}
    for name, par in {
        "pp2_dp2_fsdp2": ParallelConfig(pp_size=2, dp_size=2),
        "tp2_dp2_ddp": ParallelConfig(tp_size=2, dp_size=2, dp_backend="ddp"),
    }.items():
        eng = make_engine(cfg, par, optim, world)
        meta = eng.load(f"{root}/ckpt")
        full = eng.full_state_dict()
        res = {
            "meta": (meta["step"], meta["layout"], meta["extra"]),
            "step": eng.step_count,
            "param_diff": max(float((full[k] - expected["full"][k]).abs().max()) for k in expected["full"]),
            "logits_diff": float((full_logits(eng, data[5]) - expected["logits"]).abs().max()),
            "losses": engine_run(eng, data[2:4], num_micro_batches=2 if par.pp_size > 1 else 1)[0],
        }
        if name == "pp2_dp2_fsdp2":
            from aligner.runtime.checkpoint import export_hf

            path = export_hf(eng, f"{root}/hf")
            if rank == 0:
                from aligner.model.hf import load_hf_state_dict

                hf = load_hf_state_dict(path)
                now = eng.full_state_dict()
                res["hf_diff"] = max(float((hf[k] - now[k]).abs().max()) for k in now)
            else:
                eng.full_state_dict()  # collective: every rank takes part
        out[name] = res
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_tp2_loads_at_pp2_dp2(tmp_path):
    saved = run_distributed(save_tp2_battery, world_size=2, args=(str(tmp_path),), timeout_s=600)[0]
    assert saved["listing"] == ["ckpt"]  # atomic: no .tmp / .old left behind
    assert os.path.isfile(tmp_path / "ckpt" / "meta.json")
    got = run_distributed(load_pp2_dp2_battery, world_size=4, args=(str(tmp_path),), timeout_s=900)
    for name, res in got[0].items():
        assert res["meta"][0] == 2 and res["meta"][1]["tp_size"] == 2 and res["meta"][2] == {"note": "tp2"}, name
        assert res["step"] == 2, name
        assert res["param_diff"] == 0.0, name
        assert res["logits_diff"] < 1e-5, name
        assert res["losses"] == pytest.approx(saved["losses"], abs=1e-5), name
    assert got[0]["pp2_dp2_fsdp2"]["hf_diff"] == 0.0
    # read in one process, without the role: the tp=2 shards make the full weights saved at step 2
    from aligner.runtime.checkpoint import read_model_state_dict

    sd, meta = read_model_state_dict(str(tmp_path / "ckpt"))
    want = torch.load(tmp_path / "expected.pt")["full"]
    assert meta["step"] == 2 and set(sd) == set(want)
    assert all(torch.equal(sd[k].float(), want[k].float()) for k in want)  # the same values, stored and read back
    assert got[3]["pp2_dp2_fsdp2"]["losses"] == got[0]["pp2_dp2_fsdp2"]["losses"]


def test_single_process_roundtrip_and_errors(tmp_path):
    """No process group: save, reload into a fresh engine, continue identically; bad dirs raise."""
    cfg, optim, data = model_cfg(), OptimConfig(**OPTIM), batches(4)
    a = TrainRuntime(cfg, "lm", ParallelConfig(), optim, ParallelDims(), total_steps=10)
    engine_run(a, data[:2])
    a.save(str(tmp_path / "c"))
    b = TrainRuntime(cfg, "lm", ParallelConfig(), optim, ParallelDims(), total_steps=10, seed=1)
    b.load(str(tmp_path / "c"))
    assert b.step_count == 2 and b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert engine_run(b, data[2:])[0] == pytest.approx(engine_run(a, data[2:])[0], abs=1e-7)
    a.save(str(tmp_path / "c"))  # overwrite in place
    assert sorted(os.listdir(tmp_path)) == ["c"]
    with pytest.raises(ValueError, match="no meta.json"):
        b.load(str(tmp_path / "missing"))
    other = TrainRuntime(model_cfg(hidden_size=64), "lm", ParallelConfig(), optim, ParallelDims(), total_steps=10)
    with pytest.raises(ValueError, match="model.hidden_size=32"):
        other.load(str(tmp_path / "c"))


def test_single_process_save_and_load_warn_nothing(tmp_path, recwarn):
    """A one-process save and load print no warning: torch.distributed.checkpoint's "assuming the
    intent is to save (load) in a single process" is the expected case here, nothing a user can act on."""
    cfg, optim = model_cfg(), OptimConfig(**OPTIM)
    a = TrainRuntime(cfg, "lm", ParallelConfig(), optim, ParallelDims(), total_steps=10)
    engine_run(a, batches(1))
    recwarn.clear()
    a.save(str(tmp_path / "c"))
    a.load(str(tmp_path / "c"))
    assert [f"{w.category.__name__}: {w.message}" for w in recwarn] == []
