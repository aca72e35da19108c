"""Context parallelism in the training runtime (``parallel.cp_size``) against one process.

The roles run unchanged on a cp layout: the runner cuts each micro-batch to the rank's zigzag
share of every row's tokens, gathers the per-token outputs back, and the runtime sums the
gradients over cp. On gloo, from the same seed, the policy's log-probs (response layout, the
chunked log-prob head), its PPO update's metrics and EVERY parameter's gradient, and the critic's
values, value loss and gradients, must equal one process (fp32: outputs and metrics within 1e-5, the
issue's bound, gradients within 1e-6 + 1e-5 relative): on cp=2, cp=2 with
tp=2 and sequence parallelism, cp=2 with dp=2 (FSDP2 and DDP), cp=2 with pp=2 (1F1B), with
token-budget micro-batches and a sequence-level loss aggregation, with LoRA adapters, at cp=4, with
packed SFT rows (several documents a row) and with shared-prompt packing (whose rows score other samples' tokens than the next one). A checkpoint saved at cp=2 resumes at cp=1 with equal weights and Adam
moments, and a cp layout the runtime cannot run is refused by the config, naming the field.
"""

from __future__ import annotations

import pytest
import torch

from aligner.actor.policy import Policy
from aligner.config import ConfigError, LoraConfig, ParallelConfig
from aligner.critic.critic import Critic
from aligner.parallel.dims import ParallelDims
from tests.toolkit.models import tiny_model_config
from tests.toolkit.roles import OPTIM, full_grads, ppo_algo, rl_batch
from tests.toolkit.spawn import run_distributed

pytestmark = pytest.mark.distributed

CFG = tiny_model_config(init_std=0.2)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _policy_step(par: ParallelConfig, dims: ParallelDims, batch: dict, budget: int = 0, loss_agg: str = "token-mean", lora: bool = False):
    """(log_probs [B, R], ppo_update metrics, grads) of one policy update on `batch` (this rank's dp shard)."""
    pol = Policy(CFG, par, OPTIM, dims, seed=0, micro_batch_tokens=budget, lora=LORA if lora else None)
    assert getattr(pol.runtime.module, "cp_group", None) is dims.cp_group  # the attention runs across cp
    lp = pol.log_probs(batch, micro_batch_size=2)
    full = {k: v for k, v in batch.items() if k not in ("offset", "returns")}
    full["old_log_probs"] = (lp - batch["offset"]) * batch["response_mask"]
    out = pol.ppo_update(full, ppo_algo(loss_agg), micro_batch_size=2)
    return lp, out, full_grads(pol.runtime)


def _critic_step(par: ParallelConfig, dims: ParallelDims, batch: dict, lora: bool = False):
    critic = Critic(CFG, par, OPTIM, dims, seed=1, lora=LORA if lora else None)
    values = critic.values(batch, micro_batch_size=2)
    keys = ("input_ids", "prompt_lens", "response_mask", "returns")
    out = critic.value_step({**{k: batch[k] for k in keys}, "values": values}, ppo_algo(), micro_batch_size=2)
    return values, out, full_grads(critic.runtime)


LAYOUTS = {  # name: (world size, ParallelConfig fields)
    "cp2": (2, {"cp_size": 2}),
    "cp2 tp2 sp": (4, {"cp_size": 2, "tp_size": 2, "sequence_parallel": True}),
    "cp2 dp2 fsdp2": (4, {"cp_size": 2, "dp_size": 2, "dp_backend": "fsdp2"}),
    "cp2 dp2 ddp": (4, {"cp_size": 2, "dp_size": 2, "dp_backend": "ddp"}),
    "cp2 pp2": (4, {"cp_size": 2, "pp_size": 2}),
    "cp4": (4, {"cp_size": 4}),
}


def _battery(rank, world_size, fields, budget, loss_agg, lora):
    par = ParallelConfig(**fields)
    dims = ParallelDims(
        tp_size=par.tp_size, pp_size=par.pp_size, dp_size=par.dp_size, cp_size=par.cp_size, world_size=world_size, rank=rank
    ).build()
    batch = rl_batch()
    rows = slice(2 * dims.dp_rank, 2 * dims.dp_rank + 2) if dims.dp_size == 2 else slice(None)
    shard = {k: v[rows] for k, v in batch.items()}
    policy = _policy_step(par, dims, shard, budget, loss_agg, lora)
    critic = _critic_step(par, dims, shard, lora)
    return {"dp": dims.dp_rank, "pp": dims.pp_rank, "policy": policy, "critic": critic}


def _reference(budget: int = 0, loss_agg: str = "token-mean", lora: bool = False):
    dims = ParallelDims(device_type="cpu")
    batch = rl_batch()
    return _policy_step(ParallelConfig(), dims, batch, budget, loss_agg, lora), _critic_step(ParallelConfig(), dims, batch, lora)


def _assert_equal(got: tuple, want: tuple, keys: tuple[str, ...], what: str) -> None:
    out, ref_out = got[1], want[1]
    r = want[0].shape[1]
    torch.testing.assert_close(got[0][:, :r], want[0], atol=1e-5, rtol=0, msg=f"{what}: per-token outputs")
    for k in keys:
        assert out[k] == pytest.approx(ref_out[k], abs=1e-5), f"{what}: {k}"
    for n, g in want[2].items():
        torch.testing.assert_close(got[2][n], g, atol=1e-6, rtol=1e-5, msg=f"{what}: grad of {n}")


@pytest.mark.parametrize(
    "layout, budget, loss_agg, lora",
    [
        ("cp2", 0, "token-mean", False),
        ("cp2", 24, "seq-mean-token-mean", False),
        ("cp2", 0, "token-mean", True),
        ("cp2 tp2 sp", 0, "token-mean", False),
        ("cp2 dp2 fsdp2", 0, "token-mean", False),
        ("cp2 dp2 ddp", 0, "token-mean", False),
        ("cp2 pp2", 0, "token-mean", False),
        ("cp4", 0, "token-mean", False),
    ],
)
def test_cp_layouts_equal_one_process(layout, budget, loss_agg, lora):
    world, fields = LAYOUTS[layout]
    # FSDP2's gradient DTensors are gathered in fresh processes: in pooled ones their mesh's process group
    # did not resolve after earlier tests (tests/runtime/test_token_budget.py saw the same)
    fresh = fields.get("dp_backend") == "fsdp2"
    res = run_distributed(_battery, world_size=world, args=(fields, budget, loss_agg, lora), timeout_s=240, fresh=fresh)
    ref_policy, ref_critic = _reference(budget, loss_agg, lora)
    by_dp = {}
    for r in res:  # outputs are returned on every rank of a dp replica: every cp rank must hold the same
        by_dp.setdefault(r["dp"], []).append(r)
    for what, ref, keys in (("policy", ref_policy, ("policy_loss", "entropy", "clipfrac")), ("critic", ref_critic, ("value_loss",))):
        if len(by_dp) == 1:
            for r in by_dp[0]:
                _assert_equal(r[what], ref, keys, f"{layout} {what} rank pp{r['pp']}")
        else:  # dp = 2: each replica's rows, concatenated; the metrics and gradients are the global ones
            for r0, r1 in zip(by_dp[0], by_dp[1]):
                lp = torch.cat([r0[what][0], r1[what][0]])
                _assert_equal((lp, r0[what][1], r0[what][2]), ref, keys, f"{layout} {what}")
    assert ref_policy[1]["policy_loss"] != 0.0 and any(g.abs().sum() > 0 for g in ref_critic[2].values())


def _packed_battery(rank, world_size):
    dims = ParallelDims(cp_size=2, world_size=world_size, rank=rank).build()
    pol = Policy(CFG, ParallelConfig(cp_size=2), OPTIM, dims, seed=0)
    batch = rl_batch(shared_prompt=True)
    return pol.log_probs(batch, micro_batch_size=4, pack_len=64), pol.log_probs(batch, micro_batch_size=4)


def test_cp2_shared_prompt_packing_equals_one_process():
    """Two samples per prompt packed into one row (the shared-prompt mask travels as cp masks with
    keys in global order): the log-probs equal one process's, packed or not."""
    res = run_distributed(_packed_battery, world_size=2, timeout_s=120)
    pol = Policy(CFG, ParallelConfig(), OPTIM, ParallelDims(device_type="cpu"), seed=0)
    ref = pol.log_probs(rl_batch(shared_prompt=True), micro_batch_size=4)
    for packed, plain in res:
        torch.testing.assert_close(packed, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(plain, ref, atol=1e-5, rtol=0)


def _packed_sft(dims: ParallelDims, cp: int) -> tuple[dict, dict]:
    """One SFT step on packed rows (documents of 5, 7 and 4 tokens, then padding: segment_ids restart
    the positions and block attention between documents): (metrics, every parameter's gradient)."""
    g = torch.Generator().manual_seed(9)
    seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 4 + [0] * 3])
    ids = torch.randint(4, 64, seg.shape, generator=g) * (seg > 0)
    loss_mask = (seg > 0).long()
    pol = Policy(CFG, ParallelConfig(cp_size=cp), OPTIM, dims, seed=0)
    out = pol.sft_step({"input_ids": ids, "segment_ids": seg, "loss_mask": loss_mask}, micro_batch_size=1)
    return out, full_grads(pol.runtime)


def _packed_sft_battery(rank, world_size):
    return _packed_sft(ParallelDims(cp_size=2, world_size=world_size, rank=rank).build(), 2)


def test_cp2_packed_sft_rows_equal_one_process():
    """Packed SFT sequences (several documents per row) through the runtime at cp = 2: the mask of the
    documents travels with global keys, the loss and every gradient equal one process's."""
    want, want_grads = _packed_sft(ParallelDims(device_type="cpu"), 1)
    for got, grads in run_distributed(_packed_sft_battery, world_size=2, timeout_s=120):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
        for n, g in want_grads.items():
            torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=n)


def _checkpoint_battery(rank, world_size, path):
    from aligner.runtime.checkpoint import save_checkpoint

    dims = ParallelDims(cp_size=2, dp_size=world_size // 2, world_size=world_size, rank=rank).build()
    par = ParallelConfig(cp_size=2, dp_size=world_size // 2)
    batch = rl_batch()
    shard = {k: v[2 * dims.dp_rank : 2 * dims.dp_rank + 2] for k, v in batch.items()}
    pol = Policy(CFG, par, OPTIM, dims, seed=0)
    lp = pol.log_probs(shard, micro_batch_size=2)
    full = {k: v for k, v in shard.items() if k not in ("offset", "returns")}
    pol.ppo_update({**full, "old_log_probs": (lp - shard["offset"]) * shard["response_mask"]}, ppo_algo(), micro_batch_size=2)
    save_checkpoint(pol.runtime, path)
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in pol.runtime.module.named_parameters()}


def test_checkpoint_saved_at_cp2_dp2_resumes_at_cp1(tmp_path):
    from aligner.runtime.checkpoint import load_checkpoint

    path = str(tmp_path / "ckpt")
    res = run_distributed(_checkpoint_battery, world_size=4, args=(path,), timeout_s=180)
    pol = Policy(CFG, ParallelConfig(), OPTIM, ParallelDims(device_type="cpu"), seed=5)
    load_checkpoint(pol.runtime, path)
    assert pol.runtime.step_count == 1
    for n, p in pol.runtime.module.named_parameters():
        for r in res:
            torch.testing.assert_close(p.detach(), r[n], atol=0, rtol=0, msg=n)
        assert pol.runtime.optimizer.state[p]["exp_avg"].abs().sum() > 0, n
    # the same update at cp = 1 from the same seed lands on the same weights
    ref = Policy(CFG, ParallelConfig(), OPTIM, ParallelDims(device_type="cpu"), seed=0)
    batch = rl_batch()
    lp = ref.log_probs(batch, micro_batch_size=2)
    full = {k: v for k, v in batch.items() if k not in ("offset", "returns")}
    ref.ppo_update({**full, "old_log_probs": (lp - batch["offset"]) * batch["response_mask"]}, ppo_algo(), micro_batch_size=2)
    for n, p in ref.runtime.module.named_parameters():
        torch.testing.assert_close(res[0][n], p.detach(), atol=1e-5, rtol=0, msg=n)


@pytest.mark.parametrize(
    "fields, model, match",
    [
        ({"dp_backend": "deepspeed"}, {}, "not deepspeed"),
        ({"logprob_chunk_size": 0}, {}, "logprob_chunk_size=-1"),
        ({"compile": True}, {}, "compile=false"),
        ({}, {"num_experts": 4, "num_experts_per_tok": 2, "moe_router": "sinkhorn"}, "moe_router=sinkhorn"),
        ({}, {"num_experts": 4, "num_experts_per_tok": 2, "moe_capacity_factor": 1.5}, "moe_capacity_factor=1.5"),
        (
            {"dp_size": 4, "ep_size": 2},
            {"num_experts": 4, "num_experts_per_tok": 2},
            "set actor.parallel.dp_size=2 or actor.parallel.ep_size=1",
        ),
        ({}, {"max_seq_len": 30}, "2 \\* cp_size = 4 divide model.max_seq_len=30"),
    ],
)
def test_cp_layouts_the_runtime_cannot_run_are_refused(fields, model, match):
    par = ParallelConfig(cp_size=2, **fields)
    with pytest.raises(ConfigError, match=match) as e:
        par.validate("actor.parallel", tiny_model_config(**model))
    assert str(e.value).startswith("actor.parallel.cp_size=2 is invalid") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="rollout engine decodes"):
        ParallelConfig(cp_size=2).validate("rollout.parallel")


MOE_CFG = tiny_model_config(
    init_std=0.2, intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01
)


def _moe_policy_step(rank, world_size, cp: int):
    """(log_probs, ppo_update metrics, grads) of an MoE policy at cp=`cp` (one process when 1)."""
    dims = ParallelDims(cp_size=cp, world_size=world_size, rank=rank).build() if cp > 1 else ParallelDims(device_type="cpu")
    pol = Policy(MOE_CFG, ParallelConfig(cp_size=cp), OPTIM, dims, seed=0)
    batch = rl_batch()
    lp = pol.log_probs(batch, micro_batch_size=2)
    full = {k: v for k, v in batch.items() if k not in ("offset", "returns")}
    full["old_log_probs"] = (lp - batch["offset"]) * batch["response_mask"]
    out = pol.ppo_update(full, ppo_algo(), micro_batch_size=2)
    return lp, out, full_grads(pol.runtime)


def test_cp2_moe_policy_equals_one_process():
    """An MoE policy (padded rows, the runtime's token_mask split over cp): log-probs, PPO metrics with
    moe_aux_loss / moe_z_loss / moe_max_load, and every gradient equal one process."""
    ref = _moe_policy_step(0, 1, 1)
    assert ref[1]["moe_aux_loss"] > 0 and ref[1]["moe_z_loss"] > 0
    for r in run_distributed(_moe_policy_step, world_size=2, args=(2,)):
        _assert_equal(r, ref, ("policy_loss", "entropy", "moe_aux_loss", "moe_z_loss", "moe_max_load"), "MoE cp2 policy")
