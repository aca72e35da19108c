"""The memory-lean backward of RMSNorm and SwiGLU (aligner.nn.layers) against the op-by-op graph.

Each saves less for backward (RMSNorm: its input and one fp32 statistic per row; SwiGLU: gate and
up) and recomputes the rest; the forward and every gradient must equal autograd's op-by-op graph
bit for bit, in fp32, bf16 and bf16 activations with an fp32 weight (autocast's residual stream), and
the saved bytes must be what the memory model counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aligner.nn.layers import RMSNorm, swiglu
from aligner.parallel.memory import saved_bytes


def _op_by_op_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize(
    "x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_rmsnorm_equals_the_op_by_op_graph_bit_for_bit(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(x_dtype).requires_grad_()
    norm = RMSNorm(64, eps=1e-5).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    grad = torch.randn(3, 5, 64, generator=g)
    want = _op_by_op_norm(x, norm.weight, 1e-5)
    want.backward(grad.to(want.dtype))
    gx, gw = x.grad.clone(), norm.weight.grad.clone()
    x.grad, norm.weight.grad = None, None
    got = norm(x)
    got.backward(grad.to(got.dtype))
    assert torch.equal(got, want) and torch.equal(x.grad, gx) and torch.equal(norm.weight.grad, gw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_the_op_by_op_graph_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(4, 32, generator=g).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(4, 32, generator=g).to(dtype)
    (F.silu(gate) * up).backward(grad)
    want = gate.grad.clone(), up.grad.clone()
    gate.grad, up.grad = None, None
    out = swiglu(gate, up)
    out.backward(grad)
    assert torch.equal(out, F.silu(gate) * up) and torch.equal(gate.grad, want[0]) and torch.equal(up.grad, want[1])


def test_what_they_save():
    x = torch.randn(2, 8, 64, requires_grad=True)
    norm = RMSNorm(64)
    # the input (shared storage, counted once) and the [2, 8, 1] fp32 rsqrt; the op-by-op graph adds the normalized rows
    assert saved_bytes(norm, x, exclude=[norm.weight]) == x.numel() * 4 + 16 * 4
    assert saved_bytes(_op_by_op_norm, x, norm.weight, 1e-5, exclude=[norm.weight]) == x.numel() * 4 * 2 + 16 * 4
    gate, up = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    assert saved_bytes(swiglu, gate, up) == 2 * 4 * 32 * 4
    assert saved_bytes(lambda a, b: F.silu(a) * b, gate, up) == 3 * 4 * 32 * 4
