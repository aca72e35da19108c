"""Context parallelism with expert parallelism (``cp_size`` > 1 and ``ep_size`` > 1) for an MoE model.

cp=2 x ep=2 (dp=2, world 4) on gloo against one process, through the training runtime (a Policy):
the tiny Mixtral-style model (4 experts, top-2, load-balancing loss and router z-loss) in fp32 from
the same seed, on ragged right-padded rows (12, 7, 5, 16 tokens; padding masked from the router's
losses by the runtime's ``token_mask``, split with the sequence). Each dp rank trains on its two
rows as one micro-batch (split over its cp pair; its ep pair exchanges tokens by all-to-all); the
reference runs the whole batch in micro-batches of two rows, the same dp slices, so its auxiliary
losses are the same per-micro-batch ones. Compared within 1e-5: the log-probs, each step's LM loss
(global token mean) and grad norm (relative), each MoE layer's aux loss and z-loss of every
micro-batch, every parameter's gradient of the first step (experts included: AdamW alone would not
see a gradient off by a constant factor) and every parameter after 3 AdamW steps, with FSDP2 and
with DDP. Also: the config accepts this layout and refuses the
untested ones (tp, pp, edp > 1) naming the field.
"""

from __future__ import annotations

import pytest
import torch

from aligner.config import ConfigError, OptimConfig, ParallelConfig
from aligner.parallel.dims import ParallelDims
from tests.toolkit.assertions import assert_layout_matches, max_abs_diff
from tests.toolkit.models import tiny_model_config
from tests.toolkit.roles import rl_batch
from tests.toolkit.spawn import run_distributed

CFG = tiny_model_config(
    init_std=0.2, intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01
)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0, weight_decay=0.01)
STEPS, ROWS = 3, 2  # optimizer steps; rows per dp rank (= the reference's micro-batch)


def _sft_batch(batch: dict) -> dict:
    ids = batch["input_ids"]
    return {"input_ids": ids, "loss_mask": (ids != 0).long()}  # pad id 0; tokens are drawn from 4..63


def _train(par: ParallelConfig, dims: ParallelDims, batch: dict) -> dict:
    """log-probs [B, R], per-step LM loss and grad norm, the first step's full gradients, per-forward
    router losses {layer: [(aux, z), ...]} and the full parameters after STEPS optimizer steps of a
    Policy on `batch` (this rank's dp rows)."""
    from aligner.actor.policy import Policy
    from aligner.model.moe import GroupedExperts, moe_layers

    pol = Policy(CFG, par, OPTIM, dims, seed=0)
    lp = pol.log_probs(batch, micro_batch_size=ROWS)
    layers = moe_layers(pol.runtime.module)
    router: dict[int, list] = {i: [] for i in range(len(layers))}
    hooks = [
        m.register_forward_hook(lambda mod, a, o, i=i: router[i].append((float(mod.stats["aux_loss"]), float(mod.stats["z_loss"]))))
        for i, m in enumerate(layers)
    ]
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        out = pol.sft_step(_sft_batch(batch), micro_batch_size=ROWS)
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
        if step == 0:  # AdamW is blind to a gradient's scale: the first step's gradients are compared too
            grads = _full_grads(pol.runtime)
    for h in hooks:
        h.remove()
    experts = sorted({(m.expert_offset, m.num_local_experts) for m in pol.runtime.module.modules() if isinstance(m, GroupedExperts)})
    params = pol.runtime.full_state_dict()
    return {"lp": lp, "losses": losses, "norms": norms, "grads": grads, "router": router, "params": params, "experts": experts}


def _full_grads(runtime) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (HF names): the ep-split experts (plain tensors) through the
    runtime's gather of the full weights, the gradients swapped into the parameters' place; FSDP2's
    sharded gradients (DTensors, which the swap does not reach) by their own ``full_tensor``."""
    named = list(runtime.module.named_parameters())
    sharded = {n.removeprefix("module."): p.grad.full_tensor() for n, p in named if hasattr(p.grad, "full_tensor")}
    plain = [p for _, p in named if not hasattr(p.grad, "full_tensor")]
    for p in plain:
        p.data, p.grad = p.grad, p.data
    try:
        out = runtime.full_state_dict()
    finally:
        for p in plain:
            p.data, p.grad = p.grad, p.data
    return {**out, **sharded}


def _battery(rank: int, world_size: int, backends: tuple[str, ...]) -> dict:
    """{backend: this rank's run} for each dp backend, on one set of groups."""
    dims = ParallelDims(dp_size=2, ep_size=2, cp_size=2, world_size=world_size, rank=rank).build()
    rows = slice(ROWS * dims.dp_rank, ROWS * dims.dp_rank + ROWS)
    out = {}
    for backend in backends:
        par = ParallelConfig(dp_size=2, ep_size=2, cp_size=2, dp_backend=backend)
        par.validate("actor.parallel", CFG)
        run = _train(par, dims, {k: v[rows] for k, v in rl_batch().items()})
        out[backend] = {**run, "dp": dims.dp_rank, "cp": dims.cp_rank, "ep": dims.ep_rank}
    return out


def _errors(r: dict, ref: dict) -> dict[str, float]:
    """{check: max abs error} of one rank's run against the one-process reference."""
    dp = r["dp"]
    errs = {
        "log-probs": float((r["lp"] - ref["lp"][ROWS * dp : ROWS * dp + ROWS]).abs().max()),
        "LM loss": max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])),
        "grad norm (relative)": max(abs(a - b) / b for a, b in zip(r["norms"], ref["norms"])),
        "grads of step 1 (every parameter)": max_abs_diff(r["grads"], ref["grads"]),
        f"params after {STEPS} AdamW steps": max_abs_diff(r["params"], ref["params"]),
    }
    for layer, got in r["router"].items():
        want = ref["router"][layer][dp::2]  # the reference's micro-batch `dp` of every step
        assert len(got) == len(want) == STEPS, (layer, len(got), len(want))
        errs[f"layer {layer} aux loss"] = max(abs(a[0] - b[0]) for a, b in zip(got, want))
        errs[f"layer {layer} z-loss"] = max(abs(a[1] - b[1]) for a, b in zip(got, want))
    return errs


@pytest.mark.distributed
def test_cp2_ep2_moe_matches_one_process():
    # one set of fresh processes for both backends: FSDP2's DTensors are gathered in fresh ones
    # (tests/runtime/test_context_parallel_runtime.py)
    backends = ("fsdp2", "ddp")
    res = run_distributed(_battery, world_size=4, args=(backends,), timeout_s=240, fresh=True)
    ref = _train(ParallelConfig(), ParallelDims(device_type="cpu"), rl_batch())
    assert min(a for v in ref["router"].values() for a, _ in v) > 0 and ref["losses"][0] != ref["losses"][-1]
    for backend in backends:
        runs = [r[backend] for r in res]
        assert sorted((r["dp"], r["cp"]) for r in runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [r["experts"] for r in runs] == [[(2 * r["ep"], 2)] for r in runs]  # each ep rank holds its 2 of the 4 experts
        errs = [_errors(r, ref) for r in runs]
        print(backend, {k: f"{max(e[k] for e in errs):.1e}" for k in errs[0]})
        assert_layout_matches(errs, f"MoE cp2 x ep2 (dp2, {backend})")


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tp_size": 2, "dp_size": 2, "ep_size": 2}, "not actor.parallel.tp_size=2: set actor.parallel.tp_size=1"),
        ({"pp_size": 2, "dp_size": 2, "ep_size": 2}, "not actor.parallel.pp_size=2: set actor.parallel.pp_size=1"),
        ({"dp_size": 4, "ep_size": 2}, "not actor.parallel.dp_size=4: set actor.parallel.dp_size=2"),
    ],
)
def test_untested_cp_ep_layouts_are_refused(fields, match):
    par = ParallelConfig(cp_size=2, **fields)
    with pytest.raises(ConfigError, match=match) as e:
        par.validate("actor.parallel", CFG)
    assert str(e.value).startswith("actor.parallel.cp_size=2 is invalid") and "\n" not in str(e.value)
    ParallelConfig(cp_size=2, dp_size=2, ep_size=2).validate("actor.parallel", CFG)  # the tested layout passes
    with pytest.raises(ValueError, match="tp_size=1, pp_size=1, dp_size=ep_size only"):
        ParallelDims(cp_size=2, world_size=16, **fields)
