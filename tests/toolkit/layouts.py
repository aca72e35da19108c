"""Tensor x pipeline layouts against the single-process model: ``run_layout`` and what it needs.

Used inside gloo ranks (:func:`tests.toolkit.spawn.run_distributed`) by the tp, pp and MoE
batteries: ``run_layout(make_dims(tp, pp), layout_model_config(...), kind, ...)`` returns
``{check: max abs error}`` for :func:`tests.toolkit.assertions.assert_layout_matches`.
"""

from __future__ import annotations

import torch

from tests.toolkit.assertions import max_abs_diff
from tests.toolkit.models import tiny_model_config

B, T = 4, 8  # the batch of make_batch: 4 sequences of 8 tokens


def layout_model_config(**overrides):
    """The tiny model of the layout batteries (max_seq_len 16 unless overridden)."""
    return tiny_model_config(**{"max_seq_len": 16, **overrides})


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
    return max_abs_diff(full, ref)


def run_layout(
    dims, cfg, kind: str = "lm", *, sp: bool = False, recompute: str = "none", layer_split=None, num_micro_batches: int = 1, steps: int = 3
) -> dict[str, float]:
    """Run one TP x PP layout against the single-process reference; return {check: max abs error}."""
    import torch.distributed as dist

    from aligner.model.llama import build_model
    from aligner.nn.vocab import vocab_parallel_entropy, vocab_parallel_log_probs
    from aligner.parallel.parallelize import build_parallel_model
    from aligner.parallel.pipeline import pipeline_forward, pipeline_train_step, split_micro_batches
    from aligner.parallel.sharding import gather_full_state_dict
    from aligner.parallel.tensor_parallel import vocab_start

    ref = build_model(cfg, kind, seed=11)
    stage = build_parallel_model(cfg, kind, dims, layer_split=layer_split, sequence_parallel=sp, recompute=recompute, seed=11)
    tp_group, vstart = dims.tp_group, vocab_start(stage)
    batch = make_batch(cfg)
    mbs = split_micro_batches(batch, num_micro_batches)
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
    """The built ParallelDims of this gloo rank for a tp x pp x dp layout of the whole world."""
    import torch.distributed as dist

    from aligner.parallel.dims import ParallelDims

    return ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp, world_size=dist.get_world_size(), rank=dist.get_rank()).build()
