"""Seeded training of the tiny model on a gloo layout: the dp, ep and checkpoint-resharding tests.

OPTIM: AdamW whose global-norm clipping is active on every step (grad_clip below the grad norms),
with one warmup step; batches(): the seeded token batches every layout and its reference train on;
engine_run(): a TrainRuntime trained on this dp rank's slice of each batch; reference_run(): the
single-process full-batch reference they are compared with.
"""

from __future__ import annotations

import torch

OPTIM = dict(lr=1e-2, warmup_steps=1, grad_clip=0.05, weight_decay=0.01)
STEPS = 3


def batches(n_steps: int = STEPS, batch: int = 4, t: int = 16, vocab: int = 64) -> list[torch.Tensor]:
    """`n_steps` token batches [batch, t] (int64, uniform in [0, vocab)), the same on every rank (seed 7)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (batch, t), generator=g) for _ in range(n_steps)]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, tp_group=None, vocab_start: int = 0) -> torch.Tensor:
    """Mean next-token NLL over all positions (fp32); logits [B, T, V / tp] of a vocab shard from `vocab_start`."""
    from aligner.nn.vocab import shifted_log_probs

    return -shifted_log_probs(logits, ids, tp_group, vocab_start).mean()


def engine_run(engine, data: list[torch.Tensor], num_micro_batches: int = 1) -> tuple[list[float], list[float]]:
    """Train `engine` (a TrainRuntime) on this dp rank's slice of each batch; (dp-mean losses, grad norms) per step."""
    from aligner.parallel.tensor_parallel import vocab_start

    d = engine.dims
    start = vocab_start(engine.module) if d.is_last_pp_stage else 0
    loss_fn = lambda out, mb: lm_loss(out, mb["input_ids"], d.tp_group, start)  # noqa: E731
    losses, norms = [], []
    for ids in data:
        local = ids.chunk(d.dp_size)[d.dp_rank]
        mbs = list({"input_ids": m} for m in local.chunk(num_micro_batches))
        loss = engine.forward_backward(mbs, loss_fn).mean()
        out = engine.step()
        engine.zero_grad()
        l = loss.detach().float().clone()
        if d.dp_group is not None:
            torch.distributed.all_reduce(l, group=d.dp_group)
            l /= d.dp_size
        losses.append(float(l))
        norms.append(out["grad_norm"])
    return losses, norms


def make_engine(cfg, parallel, optim, world: int):
    """A TrainRuntime ("lm", 10 scheduled steps) of `cfg` under `parallel` (tp x pp x dp x ep) on this gloo rank."""
    from aligner.parallel.dims import ParallelDims
    from aligner.runtime.train_runtime import TrainRuntime

    dims = ParallelDims(
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        dp_size=parallel.dp_size,
        ep_size=parallel.ep_size,
        world_size=world,
        rank=torch.distributed.get_rank(),
    ).build()
    return TrainRuntime(cfg, "lm", parallel, optim, dims, total_steps=10)


def reference_run(cfg, optim, data: list[torch.Tensor], seed: int = 0):
    """Single-process full-batch training: (losses, grad norms, final state dict)."""
    from aligner.model.llama import build_model
    from aligner.runtime.train_runtime import adamw_kwargs, build_lr_scheduler

    model = build_model(cfg, "lm", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(optim))
    sched = build_lr_scheduler(opt, optim, total_steps=10)
    losses, norms = [], []
    for ids in data:
        loss = lm_loss(model(ids), ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
