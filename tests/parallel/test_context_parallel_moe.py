"""Context parallelism with an MoE model (aligner.parallel.context_parallel + aligner.model.moe).

cp=2 on gloo against one process: the tiny Mixtral-style model (4 experts, top-2, load-balancing
loss and router z-loss) in fp32 from the same seed, on a ragged right-padded batch whose length
needs padding to 2 * cp. The padding is masked out of the router's losses by ``token_mask`` (the
runtime's, split by ``cp_micro_batch``). Compared within 1e-5: the token-mean LM loss, each MoE
layer's aux loss, z-loss and max load (reduced over cp by ``cp_router_losses``), every parameter's
gradient after the cp gradient sum, every parameter after 3 AdamW steps. A control run without the
cp reduction (each rank's tokens alone) must miss, so the comparison can fail. Also: the Sinkhorn
router and a capacity factor are refused under cp, and the config accepts cp with a dropless
top-k MoE.
"""

from __future__ import annotations

import pytest
import torch

from tests.toolkit.assertions import assert_layout_matches, max_abs_diff
from tests.toolkit.models import tiny_model_config
from tests.toolkit.spawn import run_distributed

B, S0 = 3, 13  # padded to 16 for cp=2
LENGTHS = (13, 9, 5)
MOE = dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01)


def _batch(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, S0] (rows of 13, 9, 5 tokens, then pad 0), token_mask [B, S0] bool, loss mask [B, S0 - 1]."""
    ids = torch.randint(1, cfg.vocab_size, (B, S0), generator=torch.Generator().manual_seed(3))
    token_mask = torch.zeros(B, S0, dtype=torch.bool)
    mask = torch.ones(B, S0 - 1)
    for row, n in enumerate(LENGTHS):
        ids[row, n:] = 0
        token_mask[row, :n] = True
        mask[row, n - 1 :] = 0
    return ids, token_mask, mask


def _moe_stats(model) -> dict[str, torch.Tensor]:
    from aligner.model.moe import moe_layers

    return {f"layer {i} {k}": m.stats[k] for i, m in enumerate(moe_layers(model)) for k in ("aux_loss", "z_loss", "max_load")}


def _swap_grads(model):
    for p in model.parameters():
        p.data, p.grad = p.grad, p.data


def run_moe_cp(rank: int, world_size: int, reduce: bool, steps: int = 3) -> dict:
    """cp=`world_size` MoE model against one process: {check: max abs error}; reduce=False clears the
    MoE blocks' cp group (the control: each rank's router losses count its own tokens)."""
    import torch.distributed as dist

    from aligner.model.llama import build_model
    from aligner.model.moe import moe_layers
    from aligner.nn.vocab import vocab_parallel_log_probs
    from aligner.parallel.context_parallel import cp_micro_batch, cp_token_mean, shift_labels, split_shifted, sync_cp_grads
    from aligner.parallel.dims import ParallelDims
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.parallel.sharding import gather_full_state_dict

    torch.manual_seed(0)
    cp_group = dist.new_group(list(range(world_size)))
    dims = ParallelDims(tp_size=1, world_size=1, rank=0)
    cfg = tiny_model_config(**MOE)
    ref = build_model(cfg, "lm", seed=11)
    model = build_parallel_model(cfg, "lm", dims, seed=11, cp_group=cp_group)
    assert all(m.cp_group is cp_group for m in moe_layers(model))
    if not reduce:
        for m in moe_layers(model):
            m.cp_group = None
    ref.train()
    model.train()
    ids, token_mask, mask = _batch(cfg)
    mb = cp_micro_batch({"input_ids": ids, "token_mask": token_mask}, cp_group)
    labels = split_shifted(shift_labels(ids)[:, :-1], cp_group)
    local_mask = split_shifted(mask, cp_group)

    def ref_loss():
        lp = vocab_parallel_log_probs(ref(ids, token_mask=token_mask)[:, :-1], ids[:, 1:])
        return -(lp * mask).sum() / mask.sum()

    def cp_loss():
        lp = vocab_parallel_log_probs(model(mb["input_ids"], position_ids=mb["position_ids"], token_mask=mb["token_mask"]), labels)
        return cp_token_mean(-lp, local_mask, cp_group)

    errs: dict[str, float] = {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        want = ref_loss()
        want.backward()
        got = cp_loss()
        got.backward()
        sync_cp_grads(model, cp_group)
        if step == 0:
            errs["LM loss"] = float((got.detach() - want.detach()).abs())
            ref_stats, stats = _moe_stats(ref), _moe_stats(model)
            for k in ref_stats:
                errs[k] = float((stats[k] - ref_stats[k]).abs())
            errs["aux loss is not trivial"] = float(abs(float(ref_stats["layer 0 aux_loss"]) - 1.0) < 1e-3)
            _swap_grads(model)
            grads = gather_full_state_dict(model, None)
            _swap_grads(model)
            ref_grads = {k: p.grad for k, p in ref.named_parameters()}
            errs["grads (every parameter)"] = max_abs_diff(grads, ref_grads)
            errs["router grads"] = max_abs_diff(grads, {k: g for k, g in ref_grads.items() if k.endswith("mlp.gate.weight")})
            errs["every parameter has a grad"] = float(len(set(ref_grads) - set(grads)))
        opt.step()
        ref_opt.step()
    errs[f"params after {steps} AdamW steps"] = max_abs_diff(gather_full_state_dict(model, None), dict(ref.state_dict()))
    refused = {}
    for override in (dict(moe_router="sinkhorn"), dict(moe_capacity_factor=1.5)):
        try:
            build_parallel_model(tiny_model_config(**MOE, **override), "lm", dims, seed=11, cp_group=cp_group)
            refused[str(override)] = ""
        except ValueError as e:
            refused[str(override)] = str(e)
    return {"errs": errs, "refused": refused}


@pytest.mark.distributed
def test_moe_cp2_matches_one_process():
    results = run_distributed(run_moe_cp, world_size=2, args=(True,))
    assert_layout_matches([r["errs"] for r in results], "MoE, cp=2")
    for r in results:
        for override, msg in r["refused"].items():
            assert "context parallelism with an MoE model" in msg, (override, msg)


@pytest.mark.distributed
def test_moe_cp2_without_the_reduction_misses():
    """The control: router losses over each rank's tokens alone differ from one process (the check can fail)."""
    results = run_distributed(run_moe_cp, world_size=2, args=(False, 1))
    for r in results:
        e = r["errs"]
        assert max(v for k, v in e.items() if k.endswith("aux_loss")) > 1e-4, e
        assert max(v for k, v in e.items() if k.endswith("z_loss")) > 1e-4, e
        assert e["router grads"] > 1e-5, e


def test_config_accepts_cp_with_a_dropless_topk_moe(tmp_path, monkeypatch):
    from aligner.cli import load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config("ppo", ["model.num_experts=4", "actor.parallel.cp_size=2"])
    assert cfg.actor.parallel.cp_size == 2 and cfg.model.num_experts == 4
