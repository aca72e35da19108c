"""Frozen weights' autocast casts shared by the micro-batches of a training step.

torch.autocast caches the bf16 cast of a trainable fp32 leaf for its context but casts a frozen
weight (a LoRA base) again at every call, and F.linear saves that cast for backward: each
micro-batch in flight held its own copy. :func:`aligner.nn.layers.frozen_weight_casts` (entered by
``TrainRuntime.forward_backward``) makes each frozen weight's cast once per step. Checked here: the
helper's rules; the losses and every gradient bitwise equal with and without the shared casts on a
tiny LoRA model under CPU autocast (bf16), pp = 1 and pp = 2 (gloo); and the saved bytes: one copy
of the frozen casts for all micro-batches instead of one each.
"""

from __future__ import annotations

import threading
import zlib

import pytest
import torch
import torch.nn as nn

from aligner.nn import layers
from aligner.nn.layers import autocast_weight, frozen_weight_casts
from tests.toolkit.models import tiny_model_config

CFG = tiny_model_config(init_std=0.2)
TARGETS = ["q_proj", "v_proj"]
BF16 = torch.bfloat16


def test_a_frozen_weight_is_cast_once_per_block_and_nothing_else_is():
    w = nn.Parameter(torch.randn(8, 4), requires_grad=False)
    trained = nn.Parameter(torch.randn(8, 4))
    with torch.autocast("cpu", dtype=BF16):
        assert autocast_weight(w) is w  # outside the block: unchanged
    with frozen_weight_casts():
        assert autocast_weight(w) is w  # no autocast
        with torch.autocast("cpu", dtype=BF16):
            cast = autocast_weight(w)
            assert cast.dtype == BF16 and not cast.requires_grad and torch.equal(cast, w.detach().to(BF16))
            assert autocast_weight(w) is cast
            assert autocast_weight(trained) is trained  # autocast caches trainable leaves itself
            assert autocast_weight(w.detach().double()).dtype == torch.float64  # autocast leaves float64
            with torch.no_grad():
                assert autocast_weight(w) is w  # nothing is saved without grad: no reason to hold a cast
            with frozen_weight_casts():  # nested: the same cache, kept after the inner block
                assert autocast_weight(w) is cast
            assert autocast_weight(w) is cast
            with torch.no_grad():
                w.mul_(2)  # an in-place change (merge_adapters, a refit) makes the cast again
            again = autocast_weight(w)
            assert again is not cast and torch.equal(again, w.detach().to(BF16))
            seen = []
            other = threading.Thread(target=lambda: seen.append(_cast_in_autocast(w) is w))
            other.start()
            other.join()
            assert seen == [True], "the cache is per thread"
    assert layers._casts.cache is None  # dropped when the outermost block exits
    with frozen_weight_casts(enabled=False), torch.autocast("cpu", dtype=BF16):
        assert autocast_weight(w) is w


def test_a_compiled_block_ignores_the_cache_and_does_not_recompile_per_step():
    """parallel.compile: inside torch.compile the helper returns the weight (the graph casts it, as
    before) and reads no cache, so a new block each step costs no recompilation."""
    from aligner.nn.layers import ColumnParallelLinear, RowParallelLinear

    col, row = ColumnParallelLinear(16, 32), RowParallelLinear(32, 16)
    for m in (col, row):
        nn.init.normal_(m.weight)
        m.weight.requires_grad_(False)
    x = torch.randn(2, 4, 16, requires_grad=True)
    compiled = torch.compile(lambda x: row(col(x)), backend="eager")
    with torch.autocast("cpu", dtype=BF16):
        want = row(col(x))
        compiled(x)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            with frozen_weight_casts(), torch.autocast("cpu", dtype=BF16):
                assert torch.equal(compiled(x), want)


def _cast_in_autocast(w):
    with torch.autocast("cpu", dtype=BF16):
        return autocast_weight(w)


def _random_b(module: nn.Module) -> None:
    """Random adapter B (B = 0 at init would make the adapters' gradients trivial)."""
    from aligner.nn import lora

    with torch.no_grad():
        for name, m in module.named_modules():
            if isinstance(m, lora.LoraAdapter):
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                m.B.copy_(m.full_to_local("B", torch.randn(m.out_features, m.rank, generator=g) * 0.2))


def _micro_batches(m: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (m, 1, 12), generator=g)  # 12 tokens: no activation has a weight's shape
    return [{"input_ids": x} for x in ids]


def _loss(logits: torch.Tensor, mb: dict) -> torch.Tensor:
    ids = mb["input_ids"]
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _weight_shapes(module: nn.Module) -> set:
    """Shapes (either orientation) of the linear weights: autograd saves W or its transpose."""
    return {tuple(sorted(p.shape)) for n, p in module.named_parameters() if p.dim() == 2 and ".lora." not in n}


def _step(runtime, m: int, shared: bool):
    """forward_backward over m micro-batches with the shared casts on or off. Returns (losses,
    {name: grad}, distinct storages of the bf16 weight casts saved for backward, their bytes); the
    saved tensors are kept alive to the end, so no storage is reused."""
    from aligner.runtime.train_runtime import TrainRuntime

    shapes, kept, storages = _weight_shapes(runtime.module), [], {}

    def pack(t):
        if t.dtype == BF16 and tuple(sorted(t.shape)) in shapes:
            kept.append(t)
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    before = TrainRuntime.shares_frozen_casts
    if not shared:
        TrainRuntime.shares_frozen_casts = property(lambda self: False)
    try:
        runtime.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses = runtime.forward_backward(_micro_batches(m), _loss)
    finally:
        TrainRuntime.shares_frozen_casts = before
    grads = {n: p.grad.clone() for n, p in runtime.module.named_parameters() if p.grad is not None}
    return losses, grads, len(storages), sum(storages.values())


def _lora_runtime(dims, pp: int = 1, recompute: str = "none"):
    from aligner.config import LoraConfig, OptimConfig, ParallelConfig
    from aligner.runtime.train_runtime import TrainRuntime

    par = ParallelConfig(pp_size=pp, mixed_precision="bf16", dp_backend="ddp", recompute=recompute)
    rt = TrainRuntime(CFG, "lm", par, OptimConfig(), dims, 10, seed=1, lora=LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS))
    _random_b(rt.module)
    return rt


def test_shared_casts_give_bitwise_equal_losses_and_gradients_pp1():
    """pp = 1 (one micro-batch at a time): the same losses and gradients bit for bit; the frozen
    casts are made once for the step's 3 micro-batches instead of once each."""
    from aligner.parallel.dims import ParallelDims

    rt = _lora_runtime(ParallelDims(device_type="cpu"))
    assert rt.uses_autocast and rt.shares_frozen_casts
    shared, alone = _step(rt, 3, True), _step(rt, 3, False)
    assert torch.equal(shared[0], alone[0])
    assert shared[1].keys() == alone[1].keys() and len(shared[1]) == 4 * CFG.num_layers  # A and B of q, v
    for name, g in alone[1].items():
        assert torch.equal(shared[1][name], g), name
    assert alone[2] == 3 * shared[2] and shared[2] > 0
    # full recomputation keeps the casts off: each recomputed layer holds only its own
    assert not _lora_runtime(ParallelDims(device_type="cpu"), recompute="full").shares_frozen_casts


def _pp2_battery(rank, world_size):
    from aligner.parallel.dims import ParallelDims

    torch.manual_seed(0)
    rt = _lora_runtime(ParallelDims(pp_size=2, world_size=world_size, rank=rank).build(), pp=2)
    out = {}
    for shared in (True, False):
        losses, grads, n, nbytes = _step(rt, 4, shared)
        out[shared] = (losses.tolist(), {k: v.tolist() for k, v in grads.items()}, n, nbytes)
    return out


@pytest.mark.distributed
def test_shared_casts_give_bitwise_equal_losses_and_gradients_pp2():
    """pp = 2 on 2 gloo ranks, 4 micro-batches in the 1F1B step: the losses and every gradient on
    both stages equal those without the shared casts bit for bit, and each stage saves one copy of
    its frozen casts for the 4 micro-batches (without it, one per micro-batch)."""
    from tests.toolkit.spawn import run_distributed

    for rank, res in enumerate(run_distributed(_pp2_battery, world_size=2)):
        (l_on, g_on, n_on, b_on), (l_off, g_off, n_off, b_off) = res[True], res[False]
        assert l_on == l_off, rank
        assert g_on.keys() == g_off.keys() and g_on, rank
        for name, g in g_off.items():
            assert torch.equal(torch.tensor(g_on[name]), torch.tensor(g)), (rank, name)
        assert n_on > 0 and (n_off, b_off) == (4 * n_on, 4 * b_on), (rank, n_on, n_off)


def _expert_step(experts, xs, shared: bool) -> tuple[list, list, int]:
    """Forward and backward of GroupedExperts on each micro-batch in xs (all forwards first, as 1F1B
    holds them) under CPU bf16 autocast; returns (outputs, input gradients, bytes of the distinct bf16
    storages saved for backward)."""
    saved: dict[int, int] = {}

    def pack(t):
        if t.dtype == BF16:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    counts = [[x.shape[0] // experts.num_local_experts] * experts.num_local_experts for x in xs]
    with frozen_weight_casts(shared), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=BF16):
            outs = [experts(x, [c]) for x, c in zip(xs, counts)]
        for o in outs:
            o.float().square().sum().backward()
    return [o.detach() for o in outs], [x.grad for x in xs], sum(saved.values())


def test_frozen_expert_weights_are_cast_once_per_step():
    """MoE experts of a LoRA base (frozen stacked weights): with the shared casts every expert and
    micro-batch indexes one bf16 copy of each stacked weight; outputs and input gradients bitwise
    equal to autocast's own per-call casts, and the saved bf16 weight bytes one copy, not one per
    micro-batch."""
    from aligner.model.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=4, hidden_size=16, intermediate_size=32)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
        p.requires_grad_(False)
    weight_bytes = sum(p.numel() for p in experts.parameters()) * 2  # one bf16 copy
    runs = {}
    for shared in (False, True):
        xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(3)]
        runs[shared] = _expert_step(experts, xs, shared)
    for a, b in zip(runs[False][0] + runs[False][1], runs[True][0] + runs[True][1]):
        assert torch.equal(a, b)
    activations = runs[True][2] - weight_bytes  # the bf16 activations saved, the same in both runs
    assert runs[False][2] - activations == 3 * weight_bytes  # each micro-batch's own casts of every expert
    assert 0 <= activations < weight_bytes
