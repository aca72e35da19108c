"""The ISA cap of aligner's own CPU paths (aligner.nn.cpu_isa): ALIGNER_CPU_ISA only lowers what torch reports."""

from __future__ import annotations

import pytest
import torch

from aligner.errors import ConfigError
from aligner.nn import cpu_isa
from aligner.nn.layers import onednn_available, onednn_supports


def test_the_cap_lowers_the_isa_and_never_raises_it(monkeypatch):
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    have = torch.backends.cpu.get_cpu_capability().lower()
    assert cpu_isa.isa_cap() is None and cpu_isa.cpu_isa() == have and cpu_isa.march_flags() == ["-march=native"]
    for cap, below in (("default", "default"), ("avx2", "avx2" if have in ("avx2", "avx512") else have), ("avx512", have)):
        monkeypatch.setenv(cpu_isa.ISA_ENV, cap.upper())
        if have in cpu_isa.LEVELS:
            assert cpu_isa.cpu_isa() == below
            assert f"isa {below} cap {cap}" in cpu_isa.isa_signature()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "native")
    assert cpu_isa.isa_cap() is None and cpu_isa.cpu_isa() == have
    monkeypatch.setenv(cpu_isa.ISA_ENV, "sse9")
    with pytest.raises(ConfigError, match="ALIGNER_CPU_ISA='sse9' is invalid: valid are default, avx2, avx512 or native"):
        cpu_isa.cpu_isa()


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear ops (x86 CPU builds do)")
def test_onednn_bf16_is_refused_under_an_avx2_cap_and_fp32_is_not(monkeypatch):
    """oneDNN's bf16 linear needs AVX-512 or AVX-NE-CONVERT: an avx2 cap refuses it whatever this CPU
    has (torch's own query ignores our cap); fp32 runs on AVX2 and stays."""
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    ok, why = onednn_supports(torch.bfloat16)
    assert not ok and "ALIGNER_CPU_ISA=avx2" in why
    assert onednn_supports(torch.float32) == (True, "")
    assert not onednn_supports(torch.int8)[0]
    from aligner.nn.layers import ColumnParallelLinear, prepack_onednn

    with pytest.raises(ValueError, match="prepack_onednn: oneDNN's bf16 linear needs AVX-512.*with F.linear"):
        prepack_onednn(ColumnParallelLinear(8, 8).to(torch.bfloat16), 2)
