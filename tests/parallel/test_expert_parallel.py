"""Expert parallelism (MoE experts split over data-parallel ranks, tokens exchanged by all-to-all)
against a single-process reference, on gloo.

Each layout trains the same seeded tiny Mixtral-style model for 3 AdamW steps with active
global-norm clipping and the Switch auxiliary loss on; the reference is one process running each
dp rank's slice of the batch as a micro-batch (the auxiliary loss is per micro-batch, so this is
the loss every layout optimizes: mean over dp slices of LM loss + coef * aux). Checked: losses,
grad norms (1e-5) and every parameter after 3 steps (within the bound AdamW's arithmetic gives
for fp32 summation-order differences, :func:`tests.toolkit.assertions.adamw_param_tol`), that each rank holds only its experts, the
all-to-all count of one forward, and a checkpoint saved at ep=2 loading into ep=1 (same next loss).
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import ModelConfig, OptimConfig, ParallelConfig
from aligner.runtime.train_runtime import adamw_kwargs, build_lr_scheduler
from tests.toolkit.assertions import adamw_param_tol
from tests.toolkit.assertions import max_abs_diff as max_param_diff
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed
from tests.toolkit.training import OPTIM, STEPS, batches, engine_run, lm_loss, make_engine

pytestmark = pytest.mark.distributed

MOE = tiny_model_config(intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.05)
PARAM_TOL = adamw_param_tol(OPTIM["lr"], STEPS, batches(batch=8)[0].numel(), MOE)


def micro_batched_reference_run(cfg: ModelConfig, optim: OptimConfig, data: list[torch.Tensor], dp: int, micro: int = 1):
    """One process; each step runs the dp slices (each cut in `micro` micro-batches) as micro-batches
    (loss and aux weighted 1 / (dp * micro))."""
    from aligner.model.llama import build_model
    from aligner.model.moe import set_aux_loss_scale

    model = build_model(cfg, "lm", seed=0)
    set_aux_loss_scale(model, 1.0 / (dp * micro))
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(optim))
    sched = build_lr_scheduler(opt, optim, total_steps=10)
    losses, norms = [], []
    for ids in data:
        total = 0.0
        for part in [m for s in ids.chunk(dp) for m in s.chunk(micro)]:
            loss = lm_loss(model(part), part) / (dp * micro)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def ep_battery(rank: int, world: int, layouts: dict, ckpt_root: str) -> dict:
    from aligner.model.moe import GroupedExperts
    from aligner.nn import comm

    cfg, optim, data = MOE, OptimConfig(**OPTIM), batches(batch=8)
    out: dict = {}
    refs: dict = {}
    for name, kw in layouts.items():
        par = ParallelConfig(**kw)
        micro = 2 if par.pp_size > 1 else 1
        if (par.dp_size, micro) not in refs:
            refs[par.dp_size, micro] = micro_batched_reference_run(cfg, optim, data, par.dp_size, micro)
        ref_losses, ref_norms, ref_sd = refs[par.dp_size, micro]
        eng = make_engine(cfg, par, optim, world)
        experts = [m for m in eng.module.modules() if isinstance(m, GroupedExperts)]
        local = {(m.expert_offset, m.num_local_experts) for m in experts}
        losses, norms = engine_run(eng, data, num_micro_batches=micro)
        res = {
            "losses": losses,
            "norms": norms,
            "ref_losses": ref_losses,
            "ref_norms": ref_norms,
            "param_diff": max_param_diff(eng.full_state_dict(), ref_sd),
            "local_experts": sorted(local),
        }
        if name == "dp2 ep2 ddp":
            with comm.CommCounter() as c, torch.no_grad():
                eng.module(data[0].chunk(2)[eng.dims.dp_rank])
            res["a2a_calls"] = c.calls["all_to_all"]
            res["a2a_elements"] = c.elements["all_to_all"]
            # checkpoint at ep=2 (DDP) -> load at ep=1 (FSDP2, dp=2): the same next-step loss
            eng.save(f"{ckpt_root}/ep2")
            nxt = batches(4, batch=8)[-1]
            res["next"] = engine_run(eng, [nxt])[0][0]
            other = make_engine(cfg, ParallelConfig(dp_size=2, dp_backend="fsdp2"), optim, world)
            other.load(f"{ckpt_root}/ep2")
            res["next_after_load"] = engine_run(other, [nxt])[0][0]
        out[name] = res
    return out


WORLD2 = {
    "dp2 ep2 ddp": dict(dp_size=2, ep_size=2, dp_backend="ddp"),
    "dp2 ep2 fsdp2": dict(dp_size=2, ep_size=2, dp_backend="fsdp2"),
}
WORLD4 = {
    "dp4 ep2 fsdp2 (experts on the edp mesh)": dict(dp_size=4, ep_size=2, dp_backend="fsdp2"),
    "dp4 ep2 ddp": dict(dp_size=4, ep_size=2, dp_backend="ddp"),
    "tp2 dp2 ep2 fsdp2, SP": dict(tp_size=2, dp_size=2, ep_size=2, dp_backend="fsdp2", sequence_parallel=True),
    "pp2 dp2 ep2 ddp": dict(pp_size=2, dp_size=2, ep_size=2, dp_backend="ddp"),
}


def _check(results: dict) -> None:
    for name, r in results.items():
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), name
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), name
        assert r["param_diff"] < PARAM_TOL, (name, r["param_diff"], PARAM_TOL)


@pytest.mark.slow
def test_ep2_dp2_matches_single_process_and_reshards(tmp_path):
    res = run_distributed(ep_battery, world_size=2, args=(WORLD2, str(tmp_path)), timeout_s=600)
    _check(res[0])
    # each ep rank holds its 2 of the 4 experts in every layer
    assert [r["dp2 ep2 ddp"]["local_experts"] for r in res] == [[(0, 2)], [(2, 2)]]
    # one forward: per MoE layer one all-to-all of the counts (not counted) + rows there and back
    assert res[0]["dp2 ep2 ddp"]["a2a_calls"] == 2 * MOE.num_layers
    # ... of the elements the planner charges: tokens * k * H per all-to-all and rank (4 x 16 tokens per
    # rank), on average: a rank dispatches its tokens' rows and returns the rows its experts ran
    from aligner.planner import a2a_elements_per_layer

    sent = sum(r["dp2 ep2 ddp"]["a2a_elements"] for r in res)
    assert sent == 2 * 2 * MOE.num_layers * a2a_elements_per_layer(MOE, 4 * 16)
    r = res[0]["dp2 ep2 ddp"]
    assert r["next_after_load"] == pytest.approx(r["next"], abs=1e-5)


@pytest.mark.slow
def test_ep2_with_edp_tp_pp_matches_single_process(tmp_path):
    res = run_distributed(ep_battery, world_size=4, args=(WORLD4, str(tmp_path)), timeout_s=900)
    _check(res[0])
    for r in res:  # ranks with the same ep rank hold the same experts
        assert r["dp4 ep2 ddp"]["local_experts"] in ([(0, 2)], [(2, 2)])
