"""oneDNN-prepacked linear weights (aligner.nn.layers.prepack_onednn): the CPU rollout engine's
decode kernel where this torch build has oneDNN (chosen by measurement in the engine)."""

import pytest
import torch

from aligner.nn.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linears,
    drop_onednn,
    onednn_available,
    pack_linears,
    prepack_onednn,
)

ONEDNN = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear ops (x86 CPU builds do)")


@ONEDNN
def test_onednn_linears_match_f_linear_and_training_never_uses_them():
    """The prepacked paths (column group, single column, row with and without the fused residual add)
    equal F.linear within fp32 rounding; with grad on, the layers ignore the packed copies."""
    torch.manual_seed(0)
    col = [ColumnParallelLinear(24, n, bias=b) for n, b in ((16, True), (8, True))]
    row = RowParallelLinear(16, 24)
    for m in (*col, row):
        torch.nn.init.normal_(m.weight)
    net = torch.nn.ModuleList([*col, row])
    x, r, h = torch.randn(3, 5, 24), torch.randn(3, 5, 24), torch.randn(3, 5, 16)
    want = [torch.nn.functional.linear(x, l.weight, l.bias) for l in col]
    want_row = torch.nn.functional.linear(h, row.weight)
    assert prepack_onednn(net, 4) == sum(m.weight.numel() * 4 for m in net)
    with torch.no_grad():
        for got, w in zip(column_parallel_linears(x, tuple(col)), want):
            torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(row(h), want_row, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(row(h, residual=r), want_row + r, atol=1e-5, rtol=1e-5)
        pack_linears(col, torch.device("cpu"), transposed=False)
        prepack_onednn(net, 4)
        assert "onednn_group" in col[0].__dict__ and "onednn" not in col[1].__dict__
        for got, w in zip(column_parallel_linears(x, tuple(col)), want):
            torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
        for l in (*col, row):  # a snapshot: the packed copies do not see it, which shows they are used ...
            l.weight.mul_(2)
        for got, w in zip(column_parallel_linears(x, tuple(col)), want):
            torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(row(h), 2 * want_row, atol=1e-3)
    out = row(h)  # ... but training (grad on) multiplies by the parameter itself
    torch.testing.assert_close(out, 2 * want_row, atol=1e-5, rtol=1e-5)
    assert out.requires_grad
    drop_onednn(net)
    assert not any(k in m.__dict__ for m in net for k in ("onednn", "onednn_group"))
