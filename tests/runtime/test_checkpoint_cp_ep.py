"""Checkpoints of an MoE policy at context parallelism x expert parallelism reshard across cp and ep.

cp=2 x ep=2 (dp=2, world 4) on gloo, FSDP2 and DDP: the tiny Mixtral-style model (4 experts,
top-2, load-balancing loss and router z-loss) in fp32 trains 2 AdamW steps of SFT on ragged
right-padded rows (each dp rank its two rows, one micro-batch split over its cp pair), and is saved
through the runtime's save path (``Policy.save``: experts on the ("cp", "tp", "ep", "edp") mesh, cp
replicated). The checkpoint loads (a) into one process (cp=1, ep=1: all 4 experts on one rank) and
(b) back into cp=2 x ep=2, into a policy built from another seed. Checked: every parameter equals
the saved model's (exactly: dcp copies fp32 tensors), the step counter resumes, and one more AdamW
step from each load (Adam moments and step resharded by the same path) gives the parameters of the
uninterrupted cp=2 x ep=2 run within 1e-5 (one process: the same dp slices as micro-batches of two
rows, so the per-micro-batch router losses are the same).
"""

from __future__ import annotations

import pytest
import torch

from aligner.actor.policy import Policy
from aligner.config import OptimConfig, ParallelConfig
from aligner.parallel.dims import ParallelDims
from tests.toolkit.assertions import LAYOUT_TOL, max_abs_diff
from tests.toolkit.models import tiny_model_config
from tests.toolkit.roles import rl_batch
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

CFG = tiny_model_config(
    init_std=0.2, intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01
)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0, weight_decay=0.01)
STEPS, ROWS = 2, 2  # optimizer steps before the save; rows per dp rank (= the one-process micro-batch)
BACKENDS = ("fsdp2", "ddp")


def _sft_batch() -> dict:
    ids = rl_batch()["input_ids"]
    return {"input_ids": ids, "loss_mask": (ids != 0).long()}  # pad id 0; tokens are drawn from 4..63


def _battery(rank: int, world_size: int, root: str) -> dict:
    """{backend: saved params, params one step after the save (uninterrupted), after loading into a
    fresh cp2 x ep2 policy, and one step after that load} (full HF-named tensors)."""
    dims = ParallelDims(dp_size=2, ep_size=2, cp_size=2, world_size=world_size, rank=rank).build()
    batch = {k: v[ROWS * dims.dp_rank : ROWS * dims.dp_rank + ROWS] for k, v in _sft_batch().items()}
    out = {}
    for backend in BACKENDS:
        par = ParallelConfig(dp_size=2, ep_size=2, cp_size=2, dp_backend=backend)
        pol = Policy(CFG, par, OPTIM, dims, seed=0)
        for _ in range(STEPS):
            pol.sft_step(batch, micro_batch_size=ROWS)
        pol.save(f"{root}/{backend}")
        saved = pol.full_state_dict()
        pol.sft_step(batch, micro_batch_size=ROWS)
        back = Policy(CFG, par, OPTIM, dims, seed=5)
        fresh = back.full_state_dict()
        back.load(f"{root}/{backend}")
        loaded, step = back.full_state_dict(), back.runtime.step_count
        local = _local_experts(back)
        back.sft_step(batch, micro_batch_size=ROWS)
        out[backend] = {
            "saved": saved,
            "continued": pol.full_state_dict(),
            "fresh vs saved": max_abs_diff(fresh, saved),
            "loaded": loaded,
            "step": step,
            "local experts": local,
            "ep": dims.ep_rank,
            "resumed": back.full_state_dict(),
        }
    return out


def _local_experts(pol: Policy) -> dict[str, tuple[int, torch.Tensor]]:
    """{HF name: (expert offset, this rank's [E/ep, ...] tensor)} of every expert weight, read from
    the module itself (not through the checkpoint's gather)."""
    from aligner.model.moe import GroupedExperts

    out = {}
    for name, mod in pol.runtime.module.named_modules():
        if isinstance(mod, GroupedExperts):
            for pname, p in mod.named_parameters(recurse=False):
                t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 at edp 1: one shard
                out[f"{name}.{pname}".removeprefix("module.")] = (mod.expert_offset, t.detach().clone())
    return out


def test_checkpoint_saved_at_cp2_ep2_loads_at_cp1_ep1_and_cp2_ep2(tmp_path):
    # fresh processes: FSDP2's DTensors are gathered in fresh ones (tests/runtime/test_context_parallel_runtime.py)
    res = run_distributed(_battery, world_size=4, args=(str(tmp_path),), timeout_s=240, fresh=True)
    for backend in BACKENDS:
        runs = [r[backend] for r in res]
        saved, continued = runs[0]["saved"], runs[0]["continued"]
        assert runs[0]["fresh vs saved"] > 1e-2, backend  # the loading policy starts elsewhere
        one = Policy(CFG, ParallelConfig(), OPTIM, ParallelDims(device_type="cpu"), seed=5)
        one.load(str(tmp_path / backend))
        errs = {"(a) cp1 ep1 load": max_abs_diff(one.full_state_dict(), saved)}
        assert one.runtime.step_count == STEPS
        one.sft_step(_sft_batch(), micro_batch_size=ROWS)
        errs["(a) cp1 ep1 next step"] = max_abs_diff(one.full_state_dict(), continued)
        assert sorted(r["ep"] for r in runs) == [0, 0, 1, 1], backend
        for rank, r in enumerate(runs):
            assert r["step"] == STEPS, (backend, rank)
            errs[f"rank {rank} saved"] = max_abs_diff(r["saved"], saved)
            errs[f"rank {rank} (b) cp2 ep2 load"] = max_abs_diff(r["loaded"], saved)
            assert len(r["local experts"]) == 3 * CFG.num_layers, (backend, sorted(r["local experts"]))
            assert {(o, t.shape[0]) for o, t in r["local experts"].values()} == {(2 * r["ep"], 2)}, backend  # its 2 of the 4
            errs[f"rank {rank} (b) local experts"] = max_abs_diff(
                {n: t for n, (_, t) in r["local experts"].items()}, {n: saved[n][o : o + 2] for n, (o, _) in r["local experts"].items()}
            )
            errs[f"rank {rank} (b) cp2 ep2 next step"] = max_abs_diff(r["resumed"], continued)
        print(backend, {k: f"{v:.1e}" for k, v in errs.items()})
        assert max(errs[k] for k in errs if "next step" not in k) == 0.0, (backend, errs)
        assert max(errs.values()) < LAYOUT_TOL, (backend, errs)
        assert max_abs_diff(continued, saved) > 1e-5, backend  # the compared step moves the weights
