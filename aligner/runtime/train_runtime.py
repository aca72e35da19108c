"""TrainRuntime: one role's model + optimizer + LR schedule on a TP x PP x DP layout.

Owns building the role's model (from a seed, or the caller's full model) and handing it to
:func:`aligner.parallel.parallelize.parallelize` (pipeline split, TP/SP, recomputation, Transformer
Engine, data parallelism: the one place their order is written), the optimizer (AdamW, fp32 or bf16
moments: :mod:`aligner.runtime.adamw`), the learning-rate schedule
(linear warmup then cosine to ``min_lr_ratio * lr``, or constant), and one optimizer step:
finish TP/SP gradients, global-norm clipping over tp/pp/dp, AdamW, schedule. Checkpoints
go through :mod:`aligner.runtime.checkpoint` (torch.distributed.checkpoint, resharding).

Simplifications (stated, not hidden):
- The model is built at full size on every rank (on its device) from the same seed, or passed in
  full (``model=``), and then split and sharded in place; ``parallelize(full_state_dict=...)`` on a
  meta-device build is the path for large models.
- DeepSpeed: one ``backward`` per ``step`` (gradient_accumulation_steps = 1); clipping is
  DeepSpeed's own global-norm clipping; tp = pp = 1.
- Loss scaling is the caller's: each dp rank passes the mean loss of its local batch, and
  the dp reduction averages (FSDP2, DDP, DeepSpeed all divide by dp_size).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from aligner.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from aligner.model.llama import build_model
from aligner.model.moe import set_aux_loss_scale
from aligner.nn import comm
from aligner.nn.layers import frozen_weight_casts
from aligner.parallel import data_parallel as dpmod
from aligner.parallel.context_parallel import sync_cp_grads
from aligner.parallel.dims import ParallelDims
from aligner.parallel.parallelize import chunk_views, parallelize
from aligner.parallel.pipeline import model_kwargs, pipeline_train_step
from aligner.parallel.tensor_parallel import sync_tp_grads
from aligner.runtime import progress
from aligner.runtime.adamw import build_adamw
from aligner.runtime.checkpoint import gather_full_state_dict_any, load_checkpoint, save_checkpoint
from aligner.runtime.host import keep_freed_host_memory


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of ``optim.lr`` at optimizer step `step` (0-based), for LambdaLR.

    Warmup: (step + 1) / warmup_steps for step < warmup_steps (the first step is not at lr 0).
    Then cosine from 1 to min_lr_ratio over the remaining ``total_steps - warmup_steps``
    steps, flat at min_lr_ratio after; ``schedule="constant"`` stays at 1 after warmup.
    """
    warm, floor = optim.warmup_steps, optim.min_lr_ratio
    decay = max(1, total_steps - warm)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / decay)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `optimizer` with :func:`lr_lambda` (call ``.step()`` after each optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, total_steps))


def adamw_kwargs(optim: OptimConfig) -> dict:
    """AdamW keyword arguments from OptimConfig (lr is the peak; the schedule scales it)."""
    return {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}


def _check_dims(parallel: ParallelConfig, dims: ParallelDims) -> None:
    for name in ("tp_size", "pp_size", "dp_size", "ep_size", "cp_size"):
        if getattr(parallel, name) != getattr(dims, name):
            raise ValueError(
                f"parallel.{name}={getattr(parallel, name)} but ParallelDims.{name}={getattr(dims, name)}: "
                "build ParallelDims from the same ParallelConfig"
            )


def _sync_tied_grads(model: nn.Module, dims) -> None:
    """Sum the tied embedding / lm_head grads between the first and last pipeline stage (local shards:
    works for plain and FSDP2 DTensor grads, both ends hold the same dp shard)."""
    if not model.cfg.tie_word_embeddings or not (dims.is_first_pp_stage or dims.is_last_pp_stage):
        return
    import torch.distributed as dist

    p = model.model.embed_tokens.weight if dims.is_first_pp_stage else model.lm_head.weight
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    g = dpmod._local_grad(p)
    other = torch.empty_like(g)
    peer = dims.pp_size - 1 if dims.is_first_pp_stage else 0
    ops = [
        dist.P2POp(dist.isend, g.contiguous(), group=dims.pp_group, group_peer=peer),
        dist.P2POp(dist.irecv, other, group=dims.pp_group, group_peer=peer),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    g.add_(other)


def _all_reduce_mean_grads(model: nn.Module, dp_group, skip: Optional[set[int]] = None) -> None:
    """Average every gradient over `dp_group` (DDP semantics), one flat all-reduce per dtype.
    skip: ids of parameters left alone (expert-parallel experts)."""
    n = comm.group_size(dp_group)
    if n == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in (skip or ())]
    dpmod.flat_all_reduce_(grads, dp_group, n)


class TrainRuntime:
    """A role's trainable model on `dims`, wrapped for `parallel.dp_backend`.

    Args:
        model_cfg: the model dimensions. kind: "lm" (policy / SFT) or "score" (critic / RM).
        parallel_cfg: layout and dp backend; its sizes must equal `dims`' (ValueError otherwise).
        optim_cfg: AdamW (``state_dtype``: its moments' dtype) + schedule. dims: built ParallelDims (groups exist).
        total_steps: optimizer steps the schedule spans (>= 1).
        seed: init seed (the same on every rank, so replicas start equal).
        model: an already-built full (unsharded, unpruned) model to use instead of a fresh one.
        lora: LoRA adapters (rank > 0): base weights frozen, only trainable parameters (the adapters)
            in the optimizer, checkpoints and gradient reductions (:mod:`aligner.nn.lora`).
    Attributes:
        module: the unwrapped model (HF parameter names; TP-local / PP-stage / FSDP DTensor params).
        model: what forward runs (DDP or DeepSpeed wrapper, else ``module``).
        optimizer, lr_scheduler, step_count (optimizer steps taken).
    Raises:
        ValueError: bad config values, sizes differing from `dims`, total_steps < 1.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        kind: str,
        parallel_cfg: ParallelConfig,
        optim_cfg: OptimConfig,
        dims: ParallelDims,
        total_steps: int,
        *,
        seed: int = 0,
        model: Optional[nn.Module] = None,
        lora: Optional[LoraConfig] = None,
    ):
        model_cfg.validate("model")
        parallel_cfg.validate("parallel", model_cfg)
        optim_cfg.validate("optim")
        optim_cfg.validate_with("optim", parallel_cfg, model_cfg)
        if lora is not None:
            lora.validate("lora", parallel_cfg, model_cfg)
        self.lora = lora if lora is not None and lora.rank > 0 else None
        _check_dims(parallel_cfg, dims)
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1 (optimizer steps the LR schedule spans)")
        self.model_cfg, self.kind, self.parallel, self.optim_cfg, self.dims = model_cfg, kind, parallel_cfg, optim_cfg, dims
        self.total_steps = total_steps
        self.step_count = 0
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient norm
        self.checkpoint_trainable_only = False  # True: checkpoints hold only requires_grad parameters (prompt learning)
        self.backend = parallel_cfg.dp_backend
        self.bf16 = parallel_cfg.mixed_precision == "bf16"
        full = model if model is not None else build_model(model_cfg, kind, seed=seed, device=dims.device)
        self.module = full  # parallelized in place below: this rank's pipeline stage and shards (HF parameter names)
        wrapped = parallelize(
            full, dims, parallel_cfg, data_parallel=self.backend != "deepspeed", lora=self.lora, lora_seed=seed, cp_group=dims.cp_group
        )
        # interleaved 1F1B: the rank's model chunks (views sharing self.module's parameters), else None
        self.chunks = chunk_views(self.module, dims, parallel_cfg.virtual_pp_size) if parallel_cfg.virtual_pp_size > 1 else None
        self.device = next(self.module.parameters()).device  # where batches must be (ModelRunner moves them)
        self.device_type = self.device.type
        if self.device_type == "cpu":
            keep_freed_host_memory()  # logits-sized temporaries reuse freed heap (see aligner.runtime.host)
        self._build_optimizer(wrapped)
        # parallel.fsdp_reduce=step: FSDP2's all-gather and reduce-scatter once per forward_backward, not per micro-batch
        self._step_reduce = (
            dpmod.FsdpStepReduce(self.module, self.chunks or [self.module]) if self.fsdp and parallel_cfg.fsdp_reduce == "step" else None
        )

    @property
    def fsdp(self) -> bool:
        """True when parameters are FSDP2 DTensors sharded over dp."""
        return self.backend == "fsdp2" and self.dims.dp_size > 1

    def _build_optimizer(self, wrapped: nn.Module) -> None:
        """AdamW + schedule over the parallelized model; DeepSpeed wraps model and optimizer together."""
        kw = adamw_kwargs(self.optim_cfg)
        if self.backend == "deepspeed":
            cfg = dpmod.deepspeed_config(
                self.parallel.zero_stage, self.parallel.mixed_precision, self.optim_cfg.grad_clip, self.parallel.offload_optimizer
            )
            self.model, self.optimizer = dpmod.init_deepspeed(self.module, kw, cfg)
        else:
            self.model = wrapped
            params = [p for p in self.module.parameters() if p.requires_grad]
            self.optimizer = build_adamw(params, self.optim_cfg)  # torch's fused AdamW, or bf16 moments
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optim_cfg, self.total_steps)

    @property
    def pp_stages(self):
        """What the pipeline schedules run: the rank's chunks (interleaved 1F1B) or the model."""
        return self.chunks if self.chunks is not None else self.model

    @property
    def uses_autocast(self) -> bool:
        """bf16 through torch.autocast: DDP or an unwrapped model (FSDP2/DeepSpeed cast themselves)."""
        return self.bf16 and not self.fsdp and self.backend != "deepspeed"

    @property
    def shares_frozen_casts(self) -> bool:
        """True when a training step shares its frozen weights' bf16 casts between micro-batches
        (:func:`aligner.nn.layers.frozen_weight_casts`): under autocast, unless recompute is "full"
        (there each recomputed layer holds only its own casts, which the shared cache would keep alive)."""
        return self.uses_autocast and self.parallel.recompute != "full"

    # ---- one step ----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run the (wrapped) model: input_ids [B, T] int64 (first pipeline stage) -> logits [B, T, V/tp]
        (policy; (log_probs, entropy) [B, R] fp32 with a ``logprob`` input) or scores [B, T] fp32
        (score model). bf16 logits under bf16 mixed precision."""
        progress.beat()  # one forward (a micro-batch) is progress for the hang watchdog
        with dpmod.autocast_context(self.uses_autocast, self.device_type):
            return self.model(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate a scalar `loss` (this rank's mean over its local batch)."""
        if self.backend == "deepspeed":
            self.model.backward(loss)
        else:
            loss.backward()

    def forward_backward(
        self, micro_batches: list[dict], loss_fn: Callable[[torch.Tensor, dict], torch.Tensor], loss_reduction: str = "mean"
    ) -> torch.Tensor:
        """Forward + backward over micro-batches (1F1B across pipeline stages when pp_size > 1).

        micro_batches: dicts with ``input_ids`` [b, T] int64, the optional model inputs of
        ``pipeline.MODEL_INPUT_KEYS`` (position_ids / segment_ids / prompt_segments [b, T], head_index [b, R]),
        plus whatever `loss_fn` (output, mb) -> scalar reads; the same
        on every pp rank of a dp replica. loss_reduction: "mean" scales each loss by
        1/num_micro_batches, "sum" leaves it (see aligner.parallel.pipeline).
        Returns: [num_micro_batches] fp32 unscaled losses (on every pp rank).
        Under autocast the frozen weights (a LoRA base) are cast to bf16 once for the whole step and
        shared by every micro-batch (:attr:`shares_frozen_casts`): a pipeline stage holds one copy of those
        casts, as autocast's own cache does for trainable weights, not one per micro-batch in flight.
        With ``parallel.fsdp_reduce=step`` (FSDP2, more than one micro-batch) each FSDP2 unit is
        all-gathered once and its gradient reduce-scattered once per call, at the last micro-batch
        (:class:`aligner.parallel.data_parallel.FsdpStepReduce`).
        """
        reduce = self._step_reduce if len(micro_batches) > 1 else None
        if reduce is not None:
            reduce.begin()
        try:
            with frozen_weight_casts(self.shares_frozen_casts):
                if self.dims.pp_size > 1:
                    with dpmod.autocast_context(self.uses_autocast, self.device_type):
                        return pipeline_train_step(
                            self.pp_stages,
                            self.dims,
                            micro_batches,
                            loss_fn,
                            loss_reduction=loss_reduction,
                            finalize=False,
                            before_last_backward=reduce and reduce.last_backward,
                        )
                if loss_reduction not in ("mean", "sum"):
                    raise ValueError(f"loss_reduction={loss_reduction!r}: valid choices are mean, sum")
                scale = 1.0 / len(micro_batches) if loss_reduction == "mean" else 1.0
                set_aux_loss_scale(self.model, 1.0 / len(micro_batches))
                losses = []
                for i, mb in enumerate(micro_batches):
                    if reduce is not None and i == len(micro_batches) - 1:
                        reduce.last_backward(0)
                    with self._accumulating(i < len(micro_batches) - 1):
                        loss = loss_fn(self.forward(mb["input_ids"], **model_kwargs(mb)), mb)
                        self.backward(loss * scale)
                    losses.append(loss.detach().float())
                return torch.stack(losses)
        finally:
            if reduce is not None:
                reduce.end()

    @contextlib.contextmanager
    def forward_only(self, num_micro_batches: int):
        """Around a forward-only pass (under ``torch.no_grad``) over `num_micro_batches` micro-batches: with
        ``parallel.fsdp_reduce=step`` and more than one, each FSDP2 unit is all-gathered by the first
        micro-batch's forward and kept unsharded through the pass, then freed
        (:meth:`aligner.parallel.data_parallel.FsdpStepReduce.hold` / ``release``), one all-gather per unit
        instead of one per micro-batch, within the memory the step's training already holds; else nothing."""
        reduce = self._step_reduce if num_micro_batches > 1 else None
        if reduce is None:
            yield
            return
        reduce.hold()
        try:
            yield
        finally:
            reduce.release()

    def _accumulating(self, skip_sync: bool):
        """DDP's ``no_sync()`` for a micro-batch that is not the step's last: its gradients accumulate
        locally and the last micro-batch's backward all-reduces their sum, one dp all-reduce per
        optimizer step instead of one per micro-batch (as Megatron's and torchtitan's DDP gradient
        accumulation; the mean over dp of the summed gradients is the same up to the order of the fp32
        additions). FSDP2 reduces per micro-batch unless ``parallel.fsdp_reduce=step``
        (:attr:`_step_reduce`, switched in :meth:`forward_backward`, holds the unsharded gradients) and
        DeepSpeed accumulates itself; pp > 1 all-reduces once in :meth:`finalize_grads`."""
        if skip_sync and self.backend == "ddp" and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def finalize_grads(self) -> None:
        """Gradient reductions left after backward: TP/SP (norms, replicated kv rows), tied
        embeddings across the first/last pp stages, and the dp all-reduce for DDP with pp > 1
        (DDP's wrapper cannot see 1F1B's interleaved forwards, so the averaged all-reduce over
        dp is issued here, one flat buffer per dtype), and the sum over cp (each cp rank's
        gradient covers its own tokens: :func:`aligner.parallel.context_parallel.sync_cp_grads`)."""
        d = self.dims
        if d.ep_size > 1 and d.cp_size > 1:  # a cp rank whose experts got no token has no grad: zeros, as its cp peers'
            dpmod.fill_expert_grads(self.module)
        sync_cp_grads(self.module, d.cp_group)
        if self.fsdp:
            dpmod.sync_tp_grads_local(self.module, d.tp_group, d.dp_rank, d.dp_size)
        elif d.tp_size > 1:
            sync_tp_grads(self.module, d.tp_group)
        if d.pp_size > 1:
            _sync_tied_grads(self.module, d)
            if self.backend == "ddp":
                _all_reduce_mean_grads(self.module, d.dp_group, skip=dpmod.expert_param_ids(self.module))
        if d.ep_size > 1:  # expert grads to the dp mean (FSDP2 on the edp mesh has averaged them over edp)
            edp_fsdp = self.fsdp and d.edp_group is not None
            dpmod.reduce_expert_grads(self.module, d.edp_group, d.dp_size, averaged_over=d.dp_size // d.ep_size if edp_fsdp else 1)

    def clip_grads(self) -> float:
        """Finish the gradients (:meth:`finalize_grads`) and clip to optim.grad_clip by the
        global norm over tp, pp and dp; returns the norm before clipping."""
        d = self.dims
        self.finalize_grads()
        exclude = None
        if (
            self.model_cfg.tie_word_embeddings
            and d.pp_size > 1
            and d.is_last_pp_stage
            and getattr(self.module, "lm_head", None) is not None
        ):
            exclude = {id(self.module.lm_head.weight)}  # counted on the first pipeline stage
        return dpmod.clip_grad_norm_(
            self.module,
            self.optim_cfg.grad_clip,
            d.tp_group,
            d.pp_group,
            d.dp_group,
            grads_sharded_over_dp=self.fsdp,
            exclude=exclude,
            ep_group=d.ep_group,
        )

    def step(self) -> dict[str, float]:
        """One optimizer step after backward: clip, AdamW, advance the LR schedule.

        Returns {"grad_norm": global norm before clipping, "lr": the lr this step used, "skipped": 1.0
        when the norm was NaN/Inf and the update was skipped (gradients dropped, schedule not advanced)}.
        """
        lr = self.optimizer.param_groups[0]["lr"]
        if self.backend == "deepspeed":
            self.model.step()
            norm = self.model.get_global_grad_norm()
            norm = float(norm) if norm is not None else float("nan")
        else:
            norm = self.clip_grads()
            if not math.isfinite(norm):
                # global norm: every rank sees the same value and skips together
                self.zero_grad()
                self.skipped_steps += 1
                return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
            self.optimizer.step()
        self.lr_scheduler.step()
        self.step_count += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    def zero_grad(self) -> None:
        """Drop gradients (set to None)."""
        if self.backend == "deepspeed":
            self.model.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> TrainRuntime:
        self.model.train(mode)
        return self

    def eval(self) -> TrainRuntime:
        return self.train(False)

    # ---- state -----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every HF-named full parameter tensor (fp32 master values) on every rank.

        Collective over the whole role (dp all-gather for FSDP2 / ZeRO-3, tp all-gather,
        pp broadcast). Tied embeddings appear under both names, as ``state_dict()`` does.
        """

        return gather_full_state_dict_any(self)

    def save(self, role_dir: str, extra: Optional[dict] = None) -> str:
        """This role's checkpoint (sharded model + optimizer + step) into `role_dir`, atomically
        (:func:`aligner.runtime.checkpoint.save_checkpoint`). Returns the path."""

        return save_checkpoint(self, role_dir, extra=extra)

    def load(self, role_dir: str) -> dict:
        """Load a role checkpoint saved under any tp/pp/dp layout; returns its metadata (meta.json)."""

        return load_checkpoint(self, role_dir)

    def set_step(self, step: int) -> None:
        """Set the optimizer step counter and the LR schedule to `step` (after loading)."""
        self.step_count = step
        self.lr_scheduler.last_epoch = step
        factor = lr_lambda(self.optim_cfg, self.total_steps)(step)
        for g in self.optimizer.param_groups:
            g["lr"] = g["initial_lr"] * factor
