"""ModelRunner: forward-only and training passes of one role over micro-batches, on any layout.

Owns the one code path every role (policy, critic, reward model, reference) uses to run
its TrainRuntime: split a rank's local batch into micro-batches, pad the sequence to a
multiple of tp_size under sequence parallelism, and run either a plain loop (pp_size = 1)
or the 1F1B pipeline schedule (:mod:`aligner.parallel.pipeline`). Loss functions are
written once, per micro-batch, against the last pipeline stage's output.

Loss scaling: a loss_fn returns the micro-batch's contribution to the *global* loss
(sum over its tokens divided by a global normalizer the caller computed across dp), times
dp_size, because every dp backend averages gradients over dp. Then any split of the batch
over dp ranks and micro-batches gives the single-process gradient.

Token-budget micro-batches (``trainer.micro_batch_tokens`` = N > 0; verl's dynamic batch size,
NeMo-RL's dynamic batching): a rank's rows are sorted by length (longest first) and packed
first-fit into micro-batches whose padded size, rows x the micro-batch's longest row, stays
within N tokens (:func:`budget_micro_batches`); each micro-batch is cut to its own longest row
(:func:`trim_micro`) and the outputs of a forward return in the original row order. Because the
loss of every micro-batch is already its share of the global loss, any grouping gives the same
loss and gradient. Across dp the micro-batch count is evened out, for token-budget and row-count
micro-batches alike (dp shards that differ by one row can need different counts, and FSDP2's
per-forward all-gathers and DDP's per-backward all-reduces would then hang): every rank runs the dp maximum,
a rank with fewer adds *filler* micro-batches (one copy of its shortest row, loss ``0 * output``,
so it joins every DDP / FSDP collective and adds nothing); the filler runs first, so the MoE
statistics of the step come from real rows.

Token budgets with pipeline stages (pp_size > 1): every pp rank of a dp replica holds the same rows,
so each computes the same split, the same dp maximum (its dp group's ranks hold the same shards as
the other pipeline stages' dp groups) and the same fillers; the schedules (:mod:`aligner.parallel.pipeline`)
size each point-to-point buffer from the micro-batch's own [b, T] (T already rounded up to the
sequence-parallel multiple), so micro-batches of different widths travel as they are. The
interleaved schedule (``parallel.virtual_pp_size`` > 1) needs a multiple of pp_size micro-batches
per training step: a training pass adds filler micro-batches up to the next multiple (the same on
every dp and pp rank, since the dp maximum is). A forward-only pass pads each micro-batch's output
to the batch width on the last pipeline stage, so the pipeline's outputs concatenate, then drops the fillers
and restores the row order.

Context parallelism (``parallel.cp_size`` > 1, :mod:`aligner.parallel.context_parallel`): the
cp ranks of a dp replica get the same rows; each micro-batch, once formed as above, is cut to this
rank's zigzag share of every row's tokens (:func:`cp_micro_batch`), the model runs on it, and its
per-token outputs are gathered back to the whole micro-batch's (:func:`cp_outputs`) before
`output_fn` / `loss_fn` read them: every role's loss is written once and runs unchanged, each cp
rank computing the same value, and the gradients (partial per rank) are summed over cp by the
runtime's step.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from aligner.errors import ConfigError
from aligner.model.moe import global_moe_metrics
from aligner.parallel.context_parallel import cp_micro_batch, cp_outputs, source_of
from aligner.parallel.dims import ParallelDims
from aligner.parallel.pipeline import model_kwargs, pipeline_forward

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "segment_ids", "loss_mask", "labels")  # [B, T] keys padded
TRIM_KEYS = SEQUENCE_KEYS + ("prompt_segments",)  # [B, T] keys a token-budget micro-batch cuts to its longest row
FILLER = "_filler"  # key marking a filler micro-batch (dp evening-out): it runs, its loss is 0 * output
LossFn = Callable[[torch.Tensor, dict], torch.Tensor]
OutputFn = Callable[[torch.Tensor, dict], torch.Tensor]


def split_micro(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Contiguous micro-batches of at most `micro_batch_size` rows (tensors split on dim 0).

    Unlike ``pipeline.split_micro_batches`` (an exact count), the last micro-batch may be smaller:
    dp_split hands ranks local batches whose sizes differ by one. Non-tensor values (such as a
    ``LogProbSpec``) are shared by every micro-batch.
    """
    n = next(iter(batch.values())).shape[0]
    if n == 0:
        return []
    mbs = max(1, micro_batch_size)
    return [{k: v[i : i + mbs] if torch.is_tensor(v) else v for k, v in batch.items()} for i in range(0, n, mbs)]


def row_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] int64: the tokens of each row that matter (one past the last real token); the rest is padding.

    Read from, in order: ``prompt_segments`` (shared-prompt packing: -1 is padding),
    ``attention_mask`` (1 = real), ``head_index`` with ``response_mask`` (the response layout: one
    past the last unmasked response token, at least the prompt), ``loss_mask``; else every row is T
    long. Right padding is assumed (every layout of :mod:`aligner.protocol` and aligner.data.collate).
    """
    ids = batch["input_ids"]
    b, t = ids.shape[0], ids.shape[1]
    pos = torch.arange(1, t + 1, device=ids.device).expand(b, t)

    def last(mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, pos, torch.zeros_like(pos)).amax(dim=1)

    if "prompt_segments" in batch:
        return last(batch["prompt_segments"] >= 0)
    if "attention_mask" in batch:
        return last(batch["attention_mask"] > 0)
    if "head_index" in batch and "response_mask" in batch:
        head, mask = batch["head_index"].reshape(b, -1), batch["response_mask"].reshape(b, -1) > 0
        resp = torch.where(mask, head + 2, torch.zeros_like(head)).amax(dim=1)  # token j sits at head_index + 1
        return torch.maximum(resp, head[:, 0] + 1).clamp(max=t)
    if "prompt_lens" in batch and "response_mask" in batch:  # the critic's layout
        mask = batch["response_mask"] > 0
        resp = torch.where(mask, pos[:, : mask.shape[1]], torch.zeros_like(mask, dtype=torch.long)).amax(dim=1)
        return (batch["prompt_lens"].long() + resp).clamp(max=t)
    if "loss_mask" in batch:
        return last(batch["loss_mask"] > 0)
    return torch.full((b,), t, dtype=torch.long, device=ids.device)


def budget_micro_batches(lengths: list[int], budget: int, unit: int = 1) -> list[list[int]]:
    """Sorted first-fit: row indices grouped so that len(group) * max(lengths in group) <= budget.

    Rows move in units of `unit` consecutive rows (2 keeps a preference pair's chosen and rejected
    rows together; a unit's length is its longest row's). Units go longest first (ties by index);
    each joins the first open group it fits, where fitting means (rows + unit) * the group's
    longest row (its first unit's) stays within `budget`. Rows keep ascending index order inside
    a group. Raises ValueError when a unit needs more than `budget` (the caller names the field).
    """
    units = [max(lengths[i : i + unit]) for i in range(0, len(lengths), unit)]
    order = sorted(range(len(units)), key=lambda j: (-units[j], j))
    groups: list[list[int]] = []
    for j in order:
        if unit * units[j] > budget:
            raise ValueError(f"rows {j * unit}..{j * unit + unit - 1} need {unit * units[j]} tokens, more than the budget {budget}")
        for g in groups:
            if (len(g) + 1) * unit * max(1, units[g[0]]) <= budget:
                g.append(j)
                break
        else:
            groups.append([j])
    return [[i for j in sorted(g) for i in range(j * unit, min(len(lengths), j * unit + unit))] for g in groups]


def trim_micro(mb: dict, length: int) -> dict:
    """`mb` with its [b, T] sequence tensors (:data:`TRIM_KEYS`) cut to `length` positions and
    ``head_index`` clamped below it (masked response positions point past a row's end). ``labels``
    is cut only in the token layout (without head_index it is [b, T]; with it, [b, R])."""
    t = mb["input_ids"].shape[1]
    if length >= t:
        return mb
    response_layout = "head_index" in mb
    out = {}
    for k, v in mb.items():
        seq = k in TRIM_KEYS and not (k == "labels" and response_layout)
        out[k] = v[:, :length] if seq and torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == t else v
    if response_layout:
        out["head_index"] = mb["head_index"].clamp(max=length - 1)
    return out


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
        micro_batch_tokens: ``trainer.micro_batch_tokens``; > 0 forms micro-batches by that token
            budget instead of a row count (module docstring), 0 keeps row-count micro-batches.

    ``padding`` holds, after every pass, this rank's {"tokens": real tokens (:func:`row_lengths`),
    "slots": token positions the micro-batches ran, fillers included}.
    """

    def __init__(self, runtime, dims: ParallelDims, micro_batch_tokens: int = 0):
        self.runtime, self.dims = runtime, dims
        sp = getattr(runtime.parallel, "sequence_parallel", False) and dims.tp_size > 1
        self.seq_multiple = dims.tp_size if sp else 1
        self.cp_group = dims.cp_group
        self.micro_batch_tokens = micro_batch_tokens
        self.padding = {"tokens": 0.0, "slots": 0.0}

    @property
    def module(self):
        return self.runtime.module

    def _prepare(
        self, batch: dict[str, torch.Tensor], micro_batch_size: int, unit: int = 1, multiple: int = 1
    ) -> tuple[list[dict], Optional[list[int]]]:
        """(micro-batches, row order): order is None for row-count micro-batches without fillers, else
        the batch rows in the order the micro-batches hold them (fillers excluded). unit: rows that
        stay in one micro-batch (2 for the pair losses). multiple: the micro-batch count is padded
        with fillers to a multiple of it (pp_size for the interleaved schedule's training pass)."""
        dev = self.runtime.device
        batch = {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        batch = pad_sequence_dim(batch, self.seq_multiple)
        n = batch["input_ids"].shape[0]
        lengths = row_lengths(batch) if n else torch.zeros(0, dtype=torch.long)
        deepspeed = getattr(self.runtime, "backend", None) == "deepspeed"
        if self.micro_batch_tokens <= 0 or deepspeed or n == 0:
            if deepspeed:
                micro_batch_size = max(1, n)  # one backward per DeepSpeed step
            mbs = split_micro(batch, micro_batch_size)
            if not deepspeed and n > 0:  # dp ranks with different row counts can need different micro-batch counts
                mbs = self._even_out(mbs, batch, lengths, unit, trim=False, multiple=multiple)
            self.padding = {"tokens": float(lengths.sum()), "slots": float(sum(mb["input_ids"].numel() for mb in mbs))}
            evened = any(mb.get(FILLER) for mb in mbs)
            return self._cp(self._token_masks(mbs)), (list(range(n)) if evened else None)
        mbs, groups = self._budget_split(batch, lengths.tolist(), unit)
        mbs = self._even_out(mbs, batch, lengths, unit, multiple=multiple)
        self.padding = {"tokens": float(lengths.sum()), "slots": float(sum(mb["input_ids"].numel() for mb in mbs))}
        return self._cp(self._token_masks(mbs)), [i for g in groups for i in g]

    def _cp(self, mbs: list[dict]) -> list[dict]:
        """Each micro-batch cut to this cp rank's tokens (:func:`cp_micro_batch`; `mbs` itself without cp)."""
        if self.dims.cp_size == 1:
            return mbs
        return [cp_micro_batch(mb, self.cp_group, self.seq_multiple) for mb in mbs]

    def _gathered(self, fn: Callable) -> Callable:
        """`fn(output, mb)` called with the whole micro-batch's output and the source micro-batch
        (:func:`cp_outputs`; `fn` itself without cp)."""
        if self.dims.cp_size == 1:
            return fn
        return lambda out, mb: fn(cp_outputs(out, mb, self.cp_group), source_of(mb))

    def _token_masks(self, mbs: list[dict]) -> list[dict]:
        """For an MoE model, each micro-batch plus ``token_mask`` [b, T] bool (a model input: True on
        the :func:`row_lengths` real tokens, none on a filler), so padding and shared-prompt pad
        segments count in neither the router's auxiliary losses nor its statistics."""
        if not getattr(getattr(self.runtime, "model_cfg", None), "num_experts", 0):
            return mbs
        out = []
        for mb in mbs:
            t = mb["input_ids"].shape[1]
            mask = torch.arange(t, device=mb["input_ids"].device).unsqueeze(0) < row_lengths(mb).unsqueeze(1)
            out.append({**mb, "token_mask": mask & (not mb.get(FILLER, False))})
        return out

    def _budget_split(self, batch: dict, lengths: list[int], unit: int = 1) -> tuple[list[dict], list[list[int]]]:
        """Token-budget micro-batches of `batch` (:func:`budget_micro_batches`), each cut to its longest
        row rounded up to the sequence-parallel multiple. Raises ConfigError for a row over the budget."""
        budget, longest = self.micro_batch_tokens, max(lengths)
        if unit * longest > budget:
            what = f"{unit} rows of {longest} tokens (a pair)" if unit > 1 else f"a row of {longest} tokens"
            raise ConfigError(
                f"trainer.micro_batch_tokens={budget} is invalid: this batch has {what}; set it to at least "
                f"{unit * longest}, or 0 for row-count micro-batches"
            )
        groups = budget_micro_batches(lengths, budget, unit)
        mbs = []
        for g in groups:
            idx = torch.tensor(g, device=batch["input_ids"].device)
            mb = {k: v.index_select(0, idx) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()}
            width = max(lengths[i] for i in g)
            mbs.append(trim_micro(mb, width + (-width) % self.seq_multiple))
        return mbs, groups

    def _even_out(
        self, mbs: list[dict], batch: dict, lengths: torch.Tensor, unit: int = 1, trim: bool = True, multiple: int = 1
    ) -> list[dict]:
        """`mbs` with filler micro-batches in front so every dp rank runs the dp maximum count
        (collective over dp; the DDP / FSDP collectives of each forward and backward then pair up),
        rounded up to a multiple of `multiple` (the interleaved schedule's pp_size).
        A filler is the batch's shortest row (unit rows), cut to its length when `trim`, else at the
        batch's width (row-count micro-batches all have it); its loss is 0 and its outputs are dropped."""
        if self.dims.dp_size == 1 and len(mbs) % multiple == 0:
            return mbs
        count = len(mbs)
        if self.dims.dp_size > 1:
            box = torch.tensor([count], dtype=torch.long, device=self.dims.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.dims.dp_group)
            count = int(box)
        missing = count + (-count) % multiple - len(mbs)
        if missing == 0:
            return mbs
        i = int(lengths.argmin()) // unit * unit
        row = {k: v[i : i + unit] if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()}
        longest = int(lengths[i : i + unit].max())
        width = longest + (-longest) % self.seq_multiple
        filler = {**(trim_micro(row, max(1, width)) if trim else row), FILLER: True}
        return [filler] * missing + mbs

    @torch.no_grad()
    def forward(self, batch: dict[str, torch.Tensor], output_fn: OutputFn, micro_batch_size: int) -> torch.Tensor:
        """Forward-only pass; `output_fn(output, mb)` -> [b, ...] on the last pipeline stage; returns [B, ...] on every rank.

        Batch tensors may live anywhere: micro-batches are moved to the runtime's device, and the
        result comes back on the CPU (where the driver's batch lives), in the batch's row order.
        Token-layout outputs of cut micro-batches ([b, t_mb - c]) are right-padded with zeros to
        [b, T - c]."""
        t = batch["input_ids"].shape[1] + (-batch["input_ids"].shape[1]) % self.seq_multiple
        mbs, order = self._prepare(batch, micro_batch_size)
        output_fn = self._gathered(output_fn)
        was_training = self.runtime.module.training
        self.runtime.train(False)
        forward_only = getattr(self.runtime, "forward_only", None)  # FSDP2 gathers once per pass (fsdp_reduce=step)
        try:
            with forward_only(len(mbs)) if forward_only is not None else contextlib.nullcontext():
                return self._forward_passes(mbs, order, output_fn, t)
        finally:
            self.runtime.train(was_training)

    def _forward_passes(self, mbs: list[dict], order: Optional[list[int]], output_fn: OutputFn, t: int) -> torch.Tensor:
        """:meth:`forward`'s passes over the prepared micro-batches: [B, ...] on the CPU in the batch's row order."""
        if self.dims.pp_size > 1:  # outputs padded to the batch width on the last pipeline stage, so they concatenate

            def padded(o, mb):
                return _pad_output(output_fn(o, mb), source_of(mb), t)

            pp_stages = getattr(self.runtime, "pp_stages", self.runtime.model)
            out = pipeline_forward(pp_stages, self.dims, mbs, padded, broadcast=True).cpu()
            out = out[sum(mb["input_ids"].shape[0] for mb in mbs if mb.get(FILLER)) :]  # fillers come first
            return out if order is None else out[torch.argsort(torch.tensor(order))]
        outs = [output_fn(self.runtime(mb["input_ids"], **model_kwargs(mb)), mb) for mb in mbs]
        if order is None:
            return torch.cat(outs).cpu()
        real = [(o, mb) for o, mb in zip(outs, mbs) if not mb.get(FILLER)]
        out = torch.cat([_pad_output(o, source_of(mb), t) for o, mb in real]).cpu()
        return out[torch.argsort(torch.tensor(order))]

    def optimizer_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn, micro_batch_size: int, unit: int = 1) -> dict[str, float]:
        """One optimizer step on `batch`: zero_grad, forward + backward over its micro-batches
        (gradients accumulate), then :meth:`aligner.runtime.train_runtime.TrainRuntime.step` (clip, AdamW, LR schedule).

        loss_fn(output, mb) -> scalar: the micro-batch's share of the global loss (see module docstring);
        a filler micro-batch (dp evening-out, or the interleaved schedule's multiple of pp_size) gets 0 *
        the output's sum instead. unit:
        consecutive rows a token-budget split keeps together (2 when loss_fn pairs rows 2i, 2i+1).
        Returns {"loss": sum of loss_fn values over micro-batches (this rank), "grad_norm", "lr"}, and for
        an MoE model the router statistics (``moe_aux_loss``, ``moe_z_loss``, ``moe_max_load``: layer
        means; ``moe_dropped``: assignments dropped by the capacity, summed over layers;
        aligner.model.moe.global_moe_metrics).
        """
        self.runtime.train(True)
        self.runtime.zero_grad()
        interleaved = self.dims.pp_size > 1 and getattr(self.runtime, "chunks", None) is not None
        mbs, _ = self._prepare(batch, micro_batch_size, unit, multiple=self.dims.pp_size if interleaved else 1)
        total = float(self.runtime.forward_backward(mbs, self._gathered(_skip_fillers(loss_fn)), loss_reduction="sum").sum())
        stats = self.runtime.step()
        return {"loss": total, **stats, **global_moe_metrics(self.runtime.module, self.dims)}

    def padding_metrics(self) -> dict[str, float]:
        """The last pass's padding over the dp group (collective): {"pad_tokens": token positions run
        that hold no real token (padding and filler rows), "pad_fraction": their share of all positions run}."""
        slots, tokens = dp_sum(self.padding["slots"], self.dims), dp_sum(self.padding["tokens"], self.dims)
        return {"pad_tokens": slots - tokens, "pad_fraction": (slots - tokens) / max(slots, 1.0)}


def _skip_fillers(loss_fn: LossFn) -> LossFn:
    """`loss_fn`, except 0 * sum(output) on filler micro-batches (connected to every parameter the
    forward used, so DDP's and FSDP's backward collectives run, adding nothing)."""

    def run(output, mb: dict) -> torch.Tensor:
        if not mb.get(FILLER):
            return loss_fn(output, mb)
        parts = output if isinstance(output, tuple) else (output,)
        return sum(p.float().sum() for p in parts) * 0.0

    return run


def _pad_output(out: torch.Tensor, mb: dict, t: int) -> torch.Tensor:
    """A forward output of a cut micro-batch -> the width the uncut batch gives: token-layout
    outputs (neither head_index nor response_mask in `mb`) [b, t_mb - c, ...] are right-padded with zeros to [b, t - c]."""
    t_mb = mb["input_ids"].shape[1]
    if "head_index" in mb or "response_mask" in mb or out.dim() < 2 or t_mb == t or not 0 <= t_mb - out.shape[1] <= 1:
        return out
    extra = t - t_mb
    return torch.cat([out, out.new_zeros((out.shape[0], extra) + tuple(out.shape[2:]))], dim=1)


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


def from_last_pp_stage(obj, dims: ParallelDims):
    """A picklable object computed on the last pp stage, on every pp rank (identity when pp_size = 1)."""
    if dims.pp_size == 1:
        return obj
    box = [obj if dims.is_last_pp_stage else None]
    dist.broadcast_object_list(box, group_src=dims.pp_size - 1, group=dims.pp_group)
    return box[0]
