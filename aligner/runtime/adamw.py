"""AdamW with its moments stored in bf16 next to fp32 master weights, and the role's optimizer builder.

Owns :class:`MixedPrecisionAdamW` (``optim.state_dtype=bfloat16``) and :func:`build_adamw`,
which picks it or torch's own AdamW (``state_dtype=float32``, the path unchanged).

Why: torch's AdamW keeps ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype, 8 bytes per
fp32 parameter; with fp32 weights (4) and grads (4) that is 16 bytes of training state per
parameter. Storing the two moments in bf16 makes it 12 (what NeMo gets from Megatron-core's
precision-aware optimizer, ``OptimizerConfig.exp_avg_dtype`` / ``exp_avg_sq_dtype`` = bf16,
with Transformer Engine's FusedAdam).

The update is torch's AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay
Regularization", Algorithm 2, with Adam's bias correction, Kingma & Ba 2015) executed by
torch's own functional ``adamw`` (its fused kernel on CPU/CUDA, else foreach) on fp32
copies of the moments: per bucket of at most ``chunk_numel`` elements the bf16 moments are
upcast, the fp32 update runs, and the new moments are rounded back to bf16 (round to nearest
even, ``Tensor.copy_``). The parameter step uses the fp32 moments before rounding, so one
step from given stored moments is torch's AdamW step (the same kernel); the only departure is
the rounding of the stored moments (relative error <= 2^-9 per step). Stochastic rounding is not
used: on the tiny SFT stage it brought the loss curve no closer to fp32 moments' than round to
nearest does. tests/runtime/test_adamw.py holds the tiny SFT stage's loss within 1% of the fp32
moments' at every logged step; the measured figures are in benchmarks/RESULTS.md ("Optimizer
state: bf16 Adam moments").

Simplifications (stated): the upcast-update-downcast passes read and write more bytes than
one fused kernel over bf16 state would, so the step is slower than torch's fused fp32 AdamW
(benchmarks/optimizer_state.py; figures in benchmarks/RESULTS.md): it saves memory, not time; a
dedicated kernel, as NeMo's, is what turns the 4 saved bytes into bandwidth. The fp32 workspace
is at most ``2 * chunk_numel * 4`` bytes (8 MiB by default on CPU, 128 MiB on CUDA) while a
bucket is updated. No amsgrad, maximize, differentiable or capturable modes.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
from torch.optim.adamw import adamw as functional_adamw

from aligner.config import OptimConfig

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# elements per fp32 workspace bucket: on CPU 2 x 4 MiB of workspace (measured on the 2-core dev CPU,
# 20M parameters: 2^18 to 2^22 within noise, 2^16 twice as slow from per-bucket overhead); on CUDA
# 2 x 64 MiB, so that a 7B model takes ~420 buckets (kernel launches and Python per bucket)
CHUNK_NUMEL = {"cpu": 1 << 20, "cuda": 1 << 24}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 DTensor (shares its storage), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _fused_ok(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW kernel exists for CPU and CUDA tensors of these dtypes."""
    return all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16) for p in params)


class MixedPrecisionAdamW(torch.optim.Optimizer):
    """AdamW whose ``exp_avg`` / ``exp_avg_sq`` are stored in `state_dtype`, updated in fp32.

    Args:
        params: fp32 parameters (plain tensors or FSDP2 DTensors; their ``.grad`` in the same
            dtype, or it is upcast) or param groups, as for torch.optim.AdamW.
        lr: learning rate; betas: (beta1, beta2); eps: added to sqrt(v_hat); weight_decay:
            decoupled decay, multiplies the parameter by (1 - lr * weight_decay) each step.
        state_dtype: dtype of the two moments (torch.bfloat16; torch.float32 gives torch's AdamW
            up to its kernel's rounding, useful as a reference).
        chunk_numel: largest number of elements updated at once (bounds the fp32 workspace,
            ``2 * chunk_numel * 4`` bytes); None: CHUNK_NUMEL of the parameter's device (2^20 on
            CPU, 2^24 on CUDA).
    State per parameter (the keys torch's AdamW uses, so checkpoints read them alike):
        ``step``: float32 scalar tensor on CPU (optimizer steps taken by this parameter);
        ``exp_avg``, ``exp_avg_sq``: like the parameter (DTensor for a DTensor), dtype `state_dtype`.
    Raises:
        ValueError: a non-fp32 parameter (bf16 moments are for fp32 master weights), a bad
            hyperparameter, chunk_numel < 1; RuntimeError from step(): a sparse gradient.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.bfloat16,
        chunk_numel: Optional[int] = None,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"MixedPrecisionAdamW: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}: need >= 0, betas in [0, 1)"
            )
        if chunk_numel is not None and chunk_numel < 1:
            raise ValueError(f"MixedPrecisionAdamW: chunk_numel={chunk_numel} must be >= 1")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"MixedPrecisionAdamW keeps fp32 master weights; got a {p.dtype} parameter of shape {tuple(p.shape)} "
                        "(build the model in float32, or use optim.state_dtype=float32)"
                    )
        self.state_dtype = state_dtype
        self.chunk_numel = chunk_numel
        self.register_load_state_dict_post_hook(MixedPrecisionAdamW._cast_loaded_state)

    @staticmethod
    def _cast_loaded_state(optimizer: MixedPrecisionAdamW) -> None:
        """torch's load_state_dict casts every floating state to the parameter's dtype; cast the
        moments back to `state_dtype` (also converts a state dict saved by torch's AdamW)."""
        for st in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    st[key] = st[key].to(optimizer.state_dtype)
            if "step" in st:
                st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu()

    def _state_of(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return st

    def _chunk(self, device: torch.device) -> int:
        return self.chunk_numel or CHUNK_NUMEL.get(device.type, CHUNK_NUMEL["cpu"])

    def _pieces(self, group: dict) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]]:
        """(param, grad, exp_avg, exp_avg_sq, step before this one) slices of at most chunk_numel
        elements each: 1-D views of the local shards, or a whole tensor when one is not contiguous."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("MixedPrecisionAdamW does not support sparse gradients")
            st = self._state_of(p)
            g = _local(p.grad)
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
            ts = [_local(p.detach()), g, _local(st["exp_avg"]), _local(st["exp_avg_sq"])]
            step = float(st["step"])
            if not all(t.is_contiguous() for t in ts):
                yield (*ts, step)
                continue
            flat, n = [t.view(-1) for t in ts], self._chunk(p.device)
            for start in range(0, flat[0].numel(), n):
                yield (*(t[start : start + n] for t in flat), step)

    def _buckets(self, group: dict) -> Iterator[list[tuple]]:
        """Pieces grouped so that each bucket holds at most chunk_numel elements (or one larger piece)
        and one device."""
        bucket: list[tuple] = []
        size = 0
        for piece in self._pieces(group):
            n, dev = piece[0].numel(), piece[0].device
            if bucket and (size + n > self._chunk(dev) or bucket[0][0].device != dev):
                yield bucket
                bucket, size = [], 0
            bucket.append(piece)
            size += n
        if bucket:
            yield bucket

    def _update_bucket(self, group: dict, bucket: list[tuple]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = (list(x) for x in zip(*bucket))
        sizes = [p.numel() for p in params]
        work = torch.empty(2 * sum(sizes), dtype=torch.float32, device=params[0].device)
        m32 = [t.view_as(p) for t, p in zip(work[: sum(sizes)].split(sizes), params)]
        v32 = [t.view_as(p) for t, p in zip(work[sum(sizes) :].split(sizes), params)]
        torch._foreach_copy_(m32, exp_avgs)
        torch._foreach_copy_(v32, exp_avg_sqs)
        # one step tensor per piece (the functional API increments each): the step before this one
        step_t = list(torch.tensor(steps, dtype=torch.float32).to(params[0].device).unbind(0))
        fused = _fused_ok(params)
        beta1, beta2 = group["betas"]
        functional_adamw(
            params,
            grads,
            m32,
            v32,
            [],
            step_t,
            foreach=not fused,
            fused=fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        torch._foreach_copy_(exp_avgs, m32)  # fp32 -> bf16: round to nearest even
        torch._foreach_copy_(exp_avg_sqs, v32)

    @torch.no_grad()
    def step(self, closure: Optional[callable] = None) -> Optional[torch.Tensor]:
        """One AdamW step for every parameter with a gradient (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for bucket in self._buckets(group):
                self._update_bucket(group, bucket)
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["step"] += 1
        return loss


def state_bytes_per_parameter(optimizer: torch.optim.Optimizer) -> float:
    """Measured bytes of the optimizer's tensor state (this rank's local shards) per parameter
    element that has state: (exp_avg + exp_avg_sq + step bytes) / parameter elements. 8.0 plus the
    step tensors' share for torch's AdamW on fp32 parameters, 4.0 plus it for bf16 moments."""
    total, params = 0, 0
    for p, st in optimizer.state.items():
        params += _local(p).numel()
        total += sum(_local(t).numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
    return total / max(1, params)


def build_adamw(params: list[torch.Tensor], optim: OptimConfig) -> torch.optim.Optimizer:
    """The AdamW of a role from its OptimConfig (lr is the peak; the LR schedule scales it).

    ``state_dtype=float32``: torch.optim.AdamW, fused (one multi-tensor kernel per step, CPU and
    CUDA; about 4x faster than the default foreach path on CPU) where every parameter allows it.
    ``state_dtype=bfloat16``: :class:`MixedPrecisionAdamW`. Raises ValueError: non-fp32
    parameters with bfloat16 state (see MixedPrecisionAdamW).
    """
    kw = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}
    if optim.state_dtype == "float32":
        dt = [p for p in params if hasattr(p, "to_local")]
        if dt and len(dt) < len(params):  # FSDP2 DTensors beside plain tensors (experts kept out of FSDP2):
            plain = [p for p in params if not hasattr(p, "to_local")]  # one param group each, the fused kernel takes one kind
            return torch.optim.AdamW([{"params": dt}, {"params": plain}], **kw, fused=_fused_ok(params))
        return torch.optim.AdamW(params, **kw, fused=_fused_ok(params))
    return MixedPrecisionAdamW(params, **kw, state_dtype=STATE_DTYPES[optim.state_dtype])
