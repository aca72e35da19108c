"""Tensor/sequence parallelism against the single-process model (2 gloo ranks, one spawn).

Every layout runs :func:`run_layout` in each child: the sharded model's gathered logits,
vocab-parallel log_probs and entropy, the loss, EVERY gathered parameter gradient and
the parameters after 3 AdamW steps are compared with the unsharded model built from the
same seed (fp32, tolerance 1e-5). Layouts cover GQA kv heads sharded and replicated,
QKV bias, tied embeddings, SP on/off, each recomputation mode, the score model and
micro-batch accumulation. ``run_layout`` is reused by test_pipeline.py for TP x PP.
"""

from __future__ import annotations

import pytest
import torch

from tests._spawn import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-5
B, T = 4, 8


def tiny_cfg(**kw):
    from aligner.config import ModelConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def make_batch(cfg, seed: int = 7) -> dict:
    """input_ids [B, T] and the RL loss inputs: advantages, old_log_probs, mask [B, T-1], returns [B, T]."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T - 1, generator=g) > 0.3).float()
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (B, T), generator=g),
        "advantages": torch.randn(B, T - 1, generator=g),
        "old_log_probs": -torch.rand(B, T - 1, generator=g) * 4 - 2,
        "mask": mask,
        "returns": torch.randn(B, T, generator=g),
        "num_tokens": mask.sum(),  # whole-batch normalizer (0-dim: shared by every micro-batch)
    }


def make_loss_fn(kind: str, tp_group, vocab_start: int):
    """PPO-style policy loss with entropy bonus (lm) or squared value error (score), token-summed
    and divided by the whole-batch token count, so micro-batch losses add up to the batch loss."""
    from aligner.nn.vocab import vocab_parallel_entropy, vocab_parallel_log_probs

    def lm_loss(logits, mb):
        lp = vocab_parallel_log_probs(logits[:, :-1], mb["input_ids"][:, 1:], tp_group, vocab_start)
        ent = vocab_parallel_entropy(logits[:, :-1], tp_group)
        ratio = torch.exp(lp - mb["old_log_probs"])
        per_token = -mb["advantages"] * ratio - 0.01 * ent
        return (per_token * mb["mask"]).sum() / mb["num_tokens"]

    def score_loss(values, mb):
        return ((values - mb["returns"]) ** 2)[:, 1:].mul(mb["mask"]).sum() / mb["num_tokens"]

    return lm_loss if kind == "lm" else score_loss


def _swap_grads(model):
    for p in model.parameters():
        p.data, p.grad = p.grad, p.data


def _max_err(full: dict, ref: dict) -> float:
    assert set(full) == set(ref), sorted(set(full) ^ set(ref))
    return max(float((full[k] - ref[k]).abs().max()) for k in ref)


def worst_key(full: dict, ref: dict) -> str:
    return max(ref, key=lambda k: float((full[k] - ref[k]).abs().max()))


def run_layout(
    dims, cfg, kind: str = "lm", *, sp: bool = False, recompute: str = "none", layer_split=None, num_microbatches: int = 1, steps: int = 3
) -> dict[str, float]:
    """Run one TP x PP layout against the single-process reference; return {check: max abs error}."""
    import torch.distributed as dist

    from aligner.model.llama import build_model
    from aligner.nn.vocab import vocab_parallel_entropy, vocab_parallel_log_probs
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.parallel.pipeline import pipeline_forward, pipeline_train_step, split_microbatches
    from aligner.parallel.sharding import gather_full_state_dict
    from aligner.parallel.tensor_parallel import vocab_start

    ref = build_model(cfg, kind, seed=11)
    stage = build_parallel_model(cfg, kind, dims, layer_split=layer_split, sequence_parallel=sp, recompute=recompute, seed=11)
    tp_group, vstart = dims.tp_group, vocab_start(stage)
    batch = make_batch(cfg)
    mbs = split_microbatches(batch, num_microbatches)
    errs: dict[str, float] = {}
    ref_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    errs["load/gather weights"] = _max_err(gather_full_state_dict(stage, tp_group, dims.pp_group), ref_sd)

    # forward-only: gathered logits (test-side only), log_probs and entropy per token
    with torch.no_grad():
        ref_out = ref(batch["input_ids"])
    if kind == "lm":

        def outputs(logits, mb):
            parts = [torch.empty_like(logits) for _ in range(dims.tp_size)]
            if dims.tp_size > 1:
                dist.all_gather(parts, logits.contiguous(), group=tp_group)
            else:
                parts = [logits]
            lp = vocab_parallel_log_probs(logits[:, :-1], mb["input_ids"][:, 1:], tp_group, vstart)
            ent = vocab_parallel_entropy(logits[:, :-1], tp_group)
            return torch.cat([torch.cat(parts, -1)[:, :-1], lp.unsqueeze(-1), ent.unsqueeze(-1)], -1)

        got = pipeline_forward(stage, dims, mbs, outputs)
        v = cfg.vocab_size
        ref_lp = vocab_parallel_log_probs(ref_out[:, :-1], batch["input_ids"][:, 1:])
        ref_ent = vocab_parallel_entropy(ref_out[:, :-1])
        errs["forward logits (gathered)"] = float((got[..., :v] - ref_out[:, :-1]).abs().max())
        errs["forward log_probs"] = float((got[..., v] - ref_lp).abs().max())
        errs["forward entropy"] = float((got[..., v + 1] - ref_ent).abs().max())
    else:
        got = pipeline_forward(stage, dims, mbs, lambda values, mb: values)
        errs["forward values"] = float((got - ref_out).abs().max())

    # training: loss, every gradient (step 0) and parameters after `steps` AdamW steps
    ref_loss_fn = make_loss_fn(kind, None, 0)
    loss_fn = make_loss_fn(kind, tp_group, vstart)
    # eps=1e-6: some grads are ~0 in exact arithmetic (k_proj bias: softmax is shift-invariant),
    # and Adam with eps=1e-8 would turn their fp32 rounding noise into +-lr steps.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    for step in range(steps):
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_loss = ref_loss_fn(ref(batch["input_ids"]), batch)
        ref_loss.backward()
        losses = pipeline_train_step(stage, dims, mbs, loss_fn, loss_reduction="sum")
        if step == 0:
            errs["loss"] = float((losses.sum() - ref_loss.detach()).abs())
            _swap_grads(stage)
            grads = gather_full_state_dict(stage, tp_group, dims.pp_group)
            _swap_grads(stage)
            ref_grads = {
                k: ref.get_parameter(k).grad if k != "lm_head.weight" or not cfg.tie_word_embeddings else ref.model.embed_tokens.weight.grad
                for k in ref_sd
            }
            errs["grads (every parameter)"] = _max_err(grads, ref_grads)
        ref_opt.step()
        opt.step()
    errs[f"params after {steps} AdamW steps"] = _max_err(
        gather_full_state_dict(stage, tp_group, dims.pp_group), {k: v.detach() for k, v in ref.state_dict().items()}
    )
    return errs


def make_dims(tp: int, pp: int, dp: int = 1):
    import torch.distributed as dist

    from aligner.parallel.dims import ParallelDims

    return ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp, world_size=dist.get_world_size(), rank=dist.get_rank()).build()


TP_LAYOUTS = {
    # name: (model config overrides, kind, run_layout keywords)
    "kv sharded, qkv bias, no SP": (dict(num_kv_heads=2, attention_bias=True), "lm", dict()),
    "kv replicated (kv=1), SP, selective": (dict(num_kv_heads=1), "lm", dict(sp=True, recompute="selective")),
    "kv replicated, SP, full, 2 micro-batches": (
        dict(num_kv_heads=1, attention_bias=True),
        "lm",
        dict(sp=True, recompute="full", num_microbatches=2),
    ),
    "tied embeddings, SP, none": (dict(tie_word_embeddings=True), "lm", dict(sp=True)),
    "MHA, no SP, full": (dict(num_kv_heads=4), "lm", dict(recompute="full")),
    "score model, kv replicated, SP": (dict(num_kv_heads=1), "score", dict(sp=True)),
    "score model, no SP, selective": (dict(), "score", dict(recompute="selective")),
}


def tp_battery(rank: int, world_size: int) -> dict:
    """Every TP layout on tp=2, plus input-validation and collective-count checks."""
    from aligner.model.llama import build_model
    from aligner.parallel.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    dims = make_dims(tp=2, pp=1)
    out = {"layouts": {}, "errors": {}, "comm": {}}
    for name, (overrides, kind, kw) in TP_LAYOUTS.items():
        out["layouts"][name] = run_layout(dims, tiny_cfg(**overrides), kind, **kw)

    # bad inputs raise ValueError naming the value
    try:
        apply_tensor_parallel(build_model(tiny_cfg(vocab_size=63), seed=0), dims.tp_group)
    except ValueError as e:
        out["errors"]["vocab"] = str(e)
    sp_model = apply_tensor_parallel(build_model(tiny_cfg(), seed=0), dims.tp_group, sequence_parallel=True)
    try:
        sp_model(torch.zeros(1, 7, dtype=torch.long))
    except ValueError as e:
        out["errors"]["odd T"] = str(e)

    # collectives per layer forward: 2 all-reduces of B*T*H (no SP), or all-gather +
    # reduce-scatter of the same volume (SP); and saved bytes vs the adjusted formula
    from aligner.parallel.memory import LayerDims, layer_activation_bytes, layer_comm, layer_saved_bytes
    from aligner.parallel.parallelize import apply_recompute

    out["memory"] = {}
    for sp in (False, True):
        m = apply_tensor_parallel(build_model(tiny_cfg(), seed=0), dims.tp_group, sequence_parallel=sp)
        c = layer_comm(m, B, T)
        out["comm"][sp] = (dict(c.calls), dict(c.elements))
        for kv in (4, 1):
            cfg = tiny_cfg(hidden_size=64, intermediate_size=160, num_kv_heads=kv, num_layers=1, max_seq_len=32)
            m = apply_tensor_parallel(build_model(cfg, seed=0), dims.tp_group, sequence_parallel=sp)
            for mode in ("none", "selective", "full"):
                apply_recompute(m, mode)
                formula = layer_activation_bytes(LayerDims(s=32, b=2, h=64, a=4, i=160, t=2, kv=kv), "fp32", sp, mode)
                out["memory"][(kv, sp, mode)] = (layer_saved_bytes(m, 2, 32), formula)
    return out


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(tp_battery, world_size=2)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_tp_layout_matches_single_process(tp_results, layout):
    for rank, res in enumerate(tp_results):
        errs = res["layouts"][layout]
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}, {layout}: errors above {TOL}: {bad}"


@pytest.mark.distributed
def test_tp_bad_inputs_raise_value_error(tp_results):
    errors = tp_results[0]["errors"]
    assert "vocab_size=63" in errors["vocab"]
    assert "tp_size=2" in errors["odd T"] and "pad" in errors["odd T"]


@pytest.mark.distributed
def test_tp_layer_collectives(tp_results):
    """Shoeybi et al.: 2 all-reduces of B*T*H per layer forward; Korthikanti et al.: with SP,
    all-gather + reduce-scatter of the same total volume."""
    calls, elems = tp_results[0]["comm"][False]
    assert calls == {"all_reduce": 2} and elems == {"all_reduce": 2 * B * T * 32}
    calls, elems = tp_results[0]["comm"][True]
    assert calls == {"all_gather": 2, "reduce_scatter": 2}
    assert elems == {"all_gather": 2 * B * T * 32, "reduce_scatter": 2 * B * T * 32}


@pytest.mark.distributed
def test_tp_sp_activation_memory_matches_formula(tp_results):
    """Saved bytes per layer with tp=2 (SP off/on, each recompute mode, kv split/replicated) equal
    the Llama-adjusted Korthikanti et al. formula (aligner.parallel.memory)."""
    for rank, res in enumerate(tp_results):
        bad = {k: v for k, v in res["memory"].items() if v[0] != v[1]}
        assert not bad, f"rank {rank}: (measured, formula) differ: {bad}"
