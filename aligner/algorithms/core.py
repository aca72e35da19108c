"""Argument checks and masked reductions shared by the RL math (shape conventions: aligner.algorithms)."""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

_LOG_RATIO_CLAMP = 20.0  # |log ratio| clamp before exp (verl), keeps exp finite in fp32
_K3_CLAMP = 10.0  # k3 output clamp, as verl's "low_var_kl" (biases the estimate low beyond it)


# ----------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------


def _check_same_shape(ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    for name, t in others.items():
        if t is not None and tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(ref.shape)} (the shape of {ref_name})")


def _check_ndim(name: str, t: Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {layout}")


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} is invalid: must be in [{lo}, {hi}]")


def _unknown(kind: str, name: object, valid) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}: valid choices are {', '.join(sorted(valid))}")


def _float_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(like.dtype)


# ----------------------------------------------------------------------------------------
# masked reductions
# ----------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` over entries where ``mask`` is nonzero.

    Args:
        x: [...] any float tensor, e.g. ``[B, R]``.
        mask: same shape as ``x``; 1.0 (or True) keeps an entry, 0 drops it.
        dim: reduce over this dimension only; None reduces over all entries.

    Returns:
        0-dim tensor (``dim=None``) or ``x`` reduced over ``dim``.
    """
    _check_same_shape("x", x, mask=mask)
    prod = x * _float_mask(mask, x)
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is nonzero (0 where nothing is kept).

    As NeMo-Aligner ``masked_mean`` / verl ``masked_mean``.

    Args:
        x: [...] any float tensor, e.g. ``[B, R]``.
        mask: same shape as ``x``; 1.0 (or True) keeps an entry.
        dim: reduce over this dimension only (``[B, R]`` -> ``[B]`` for ``dim=-1``);
            None reduces over all entries.

    Returns:
        0-dim tensor (``dim=None``) or ``x`` reduced over ``dim``.
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all entries where ``mask`` is nonzero (TRL ``masked_var``).

    Args:
        x: [...] float tensor, e.g. ``[B, R]``.
        mask: same shape as ``x``.
        unbiased: apply Bessel's correction n / (n - 1).

    Returns:
        0-dim tensor.

    Raises:
        ValueError: the mask keeps no entry, or one entry with ``unbiased=True``.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return var
    n = float(_float_mask(mask, x).sum())
    if n < 2:
        raise ValueError(f"mask keeps {n:g} entries: the unbiased variance needs at least 2 (or pass unbiased=False)")
    return var * (n / (n - 1))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize ``x`` to mean 0 and unit (unbiased) variance over the masked entries.

    As TRL ``masked_whiten``: ``(x - mean) / sqrt(var + eps)`` with the unbiased
    (Bessel-corrected) variance. NeMo-Aligner's ``masked_whiten`` divides by the biased
    variance instead, so its result is ours times ``sqrt((n - 1) / n)`` for n masked
    entries. With ``shift_mean=False`` the mean is added back (only the scale changes).
    Entries outside the mask are set to 0.

    Args:
        x: [B, R] float tensor (e.g. advantages).
        mask: [B, R] response mask.
        shift_mean: subtract the masked mean.
        eps: added to the variance.

    Returns:
        [B, R] tensor, same dtype as ``x``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * _float_mask(mask, x)
