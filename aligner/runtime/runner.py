"""ModelRunner: forward-only and training passes of one role over micro-batches, on any layout.

Owns the one code path every role (policy, critic, reward model, reference) uses to run
its TrainRuntime: split a rank's local batch into micro-batches, pad the sequence to a
multiple of tp_size under sequence parallelism, and run either a plain loop (pp_size = 1)
or the 1F1B pipeline schedule (:mod:`aligner.parallel.pipeline`). Loss functions are
written once, per micro-batch, against the last stage's output.

Loss scaling: a loss_fn returns the micro-batch's contribution to the *global* loss
(sum over its tokens divided by a global normalizer the caller computed across dp), times
dp_size, because every dp backend averages gradients over dp. Then any split of the batch
over dp ranks and micro-batches gives the single-process gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from aligner.model.moe import global_moe_metrics
from aligner.parallel.dims import ParallelDims
from aligner.parallel.pipeline import model_kwargs, pipeline_forward

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "segment_ids", "loss_mask", "labels")  # [B, T] keys padded
LossFn = Callable[[torch.Tensor, dict], torch.Tensor]
OutputFn = Callable[[torch.Tensor, dict], torch.Tensor]


def split_micro(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Contiguous micro-batches of at most `micro_batch_size` rows (tensors split on dim 0).

    Unlike ``pipeline.split_microbatches`` (an exact count), the last micro-batch may be smaller:
    dp_split hands ranks local batches whose sizes differ by one. Non-tensor values (such as a
    ``LogProbSpec``) are shared by every micro-batch.
    """
    n = next(iter(batch.values())).shape[0]
    if n == 0:
        return []
    mbs = max(1, micro_batch_size)
    return [{k: v[i : i + mbs] if torch.is_tensor(v) else v for k, v in batch.items()} for i in range(0, n, mbs)]


def pad_sequence_dim(batch: dict[str, torch.Tensor], multiple: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad every [B, T] tensor so T is a multiple of `multiple` (sequence parallelism)."""
    t = batch["input_ids"].shape[1]
    extra = (-t) % multiple
    if extra == 0:
        return batch
    out = {}
    for k, v in batch.items():
        if k in SEQUENCE_KEYS and torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == t:
            fill = pad_id if k == "input_ids" else 0
            out[k] = torch.cat([v, v.new_full((v.shape[0], extra) + tuple(v.shape[2:]), fill)], dim=1)
        else:
            out[k] = v
    return out


class ModelRunner:
    """Runs a TrainRuntime (or any module on `dims`) over micro-batches.

    Args:
        runtime: a :class:`aligner.runtime.train_runtime.TrainRuntime` (needs forward/backward/step/zero_grad,
            ``module`` and ``parallel``).
        dims: the role's ParallelDims.
    """

    def __init__(self, runtime, dims: ParallelDims):
        self.runtime, self.dims = runtime, dims
        sp = getattr(runtime.parallel, "sequence_parallel", False) and dims.tp_size > 1
        self.seq_multiple = dims.tp_size if sp else 1

    @property
    def module(self):
        return self.runtime.module

    def _prepare(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
        dev = self.runtime.device
        batch = {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        batch = pad_sequence_dim(batch, self.seq_multiple)
        if getattr(self.runtime, "backend", None) == "deepspeed":
            micro_batch_size = next(iter(batch.values())).shape[0]  # one backward per DeepSpeed step
        return split_micro(batch, micro_batch_size)

    @torch.no_grad()
    def forward(self, batch: dict[str, torch.Tensor], output_fn: OutputFn, micro_batch_size: int) -> torch.Tensor:
        """Forward-only pass; `output_fn(output, mb)` -> [b, ...] on the last stage; returns [B, ...] on every rank.

        Batch tensors may live anywhere: micro-batches are moved to the runtime's device, and the
        result comes back on the CPU (where the driver's batch lives)."""
        mbs = self._prepare(batch, micro_batch_size)
        was_training = self.runtime.module.training
        self.runtime.train(False)
        try:
            if self.dims.pp_size > 1:
                return pipeline_forward(self.runtime.model, self.dims, mbs, output_fn, broadcast=True).cpu()
            return torch.cat([output_fn(self.runtime(mb["input_ids"], **model_kwargs(mb)), mb) for mb in mbs]).cpu()
        finally:
            self.runtime.train(was_training)

    def optimizer_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step on `batch`: zero_grad, forward + backward over its micro-batches
        (gradients accumulate), then :meth:`aligner.runtime.train_runtime.TrainRuntime.step` (clip, AdamW, LR schedule).

        loss_fn(output, mb) -> scalar: the micro-batch's share of the global loss (see module docstring).
        Returns {"loss": sum of loss_fn values over micro-batches (this rank), "grad_norm", "lr"}, and for
        an MoE model the router statistics of the last micro-batch (``moe_aux_loss``, ``moe_z_loss``,
        ``moe_max_load``: layer means; ``moe_dropped``: assignments dropped by the capacity, summed over
        layers; aligner.model.moe.global_moe_metrics).
        """
        self.runtime.train(True)
        self.runtime.zero_grad()
        mbs = self._prepare(batch, micro_batch_size)
        total = float(self.runtime.forward_backward(mbs, loss_fn, loss_reduction="sum").sum())
        stats = self.runtime.step()
        return {"loss": total, **stats, **global_moe_metrics(self.runtime.module, self.dims)}


def dp_sum(value: float | torch.Tensor, dims: ParallelDims) -> float:
    """Sum a number over the dp group (every rank of a dp replica holds the same value)."""
    if dims.dp_size == 1:
        return float(value)
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone().to(dims.device)
    dist.all_reduce(t, group=dims.dp_group)
    return float(t)


def global_normalizer(local_count: float | torch.Tensor, dims: ParallelDims) -> float:
    """Global token (or sample) count over dp, divided by dp_size: the per-rank loss divisor that
    makes dp-averaged gradients equal the single-process mean. Never below 1e-8."""
    return max(dp_sum(local_count, dims) / dims.dp_size, 1e-8)


def from_last_stage(obj, dims: ParallelDims):
    """A picklable object computed on the last pp stage, on every pp rank (identity when pp_size = 1)."""
    if dims.pp_size == 1:
        return obj
    box = [obj if dims.is_last_stage else None]
    dist.broadcast_object_list(box, group_src=dims.pp_size - 1, group=dims.pp_group)
    return box[0]
