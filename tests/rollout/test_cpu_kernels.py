"""aligner's own CPU decode attention kernel (aligner/rollout/torch_engine/csrc/decode_attention.c) against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aligner.rollout.torch_engine import cpu_kernels
from aligner.rollout.torch_engine.cpu_kernels import decode_attention, load_decode_attention

needs_kernel = pytest.mark.skipif(
    load_decode_attention() is None, reason=f"the decode attention kernel cannot be built here: {cpu_kernels.LOAD_ERROR}"
)


def _case(slots, kvh, rep, hd, max_len, start, n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(slots, kvh, max_len, hd, generator=g)
    cache_v = torch.randn(slots, kvh, max_len, hd, generator=g)
    q = torch.randn(n, kvh, rep, hd, generator=g)
    length = int(max(lengths))
    k, v = cache_k[start : start + n, :, :length], cache_v[start : start + n, :, :length]  # the slot cache's view
    return q, k, v, torch.tensor(lengths, dtype=torch.int64)


def _sdpa(q, k, v, lengths):
    mask = (torch.arange(k.shape[2]) < lengths.unsqueeze(1))[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@needs_kernel
@pytest.mark.parametrize("kvh,rep,hd", [(3, 3, 64), (2, 2, 16), (1, 8, 32), (4, 1, 8)], ids=["smollm2", "tiny_gqa", "mqa", "mha"])
def test_decode_attention_equals_sdpa_with_the_prefix_mask(kvh, rep, hd):
    """Ragged rows (length 1 to the full view) of a slot range inside a larger cache: each row
    attends to its own prefix only; positions past a row's length hold other data and must not count."""
    lengths = [1, 7, 40, 40, 13, 2, 33]
    q, k, v, lens = _case(slots=12, kvh=kvh, rep=rep, hd=hd, max_len=64, start=3, n=len(lengths), lengths=lengths)
    got = decode_attention(q, k, v, lens, hd**-0.5)
    torch.testing.assert_close(got, _sdpa(q, k, v, lens), atol=2e-6, rtol=1e-5)
    assert got.shape == q.shape and got.dtype == torch.float32
    # the keys past each row's length are never read: changing them changes nothing, bit for bit
    k2, v2 = k.clone(), v.clone()
    for r, n in enumerate(lengths):
        k2[r, :, n:] = float("nan")
        v2[r, :, n:] = float("inf")
    assert torch.equal(decode_attention(q, k2, v2, lens, hd**-0.5), got)


@needs_kernel
def test_the_steps_own_key_and_value_are_written_before_attending():
    """k_new / v_new land at position lengths - 1 of each row (nowhere else), and attention sees them."""
    lengths = [4, 9, 1]
    q, k, v, lens = _case(slots=5, kvh=2, rep=3, hd=16, max_len=12, start=1, n=3, lengths=lengths, seed=2)
    k_new, v_new = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    want_k, want_v = k.clone(), v.clone()
    for r, n in enumerate(lengths):
        want_k[r, :, n - 1], want_v[r, :, n - 1] = k_new[r], v_new[r]
    want = _sdpa(q, want_k, want_v, lens)
    got = decode_attention(q, k, v, lens, 0.25, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # written in place into the cache's view
    with pytest.raises(ValueError, match="both k_new and v_new"):
        decode_attention(q, k, v, lens, 0.25, k_new=k_new)


@needs_kernel
def test_rope_is_applied_to_the_query_and_the_stored_key():
    """With cos/sin the kernel takes the un-rotated projections as strided views of one fused
    q|k|v output (no copies) and equals llama.apply_rope then SDPA; the cache keeps the rotated key."""
    from aligner.model.llama import apply_rope, rope_cos_sin

    kvh, rep, hd, lengths = 2, 3, 16, [4, 9, 1, 12]
    n = len(lengths)
    _, k, v, lens = _case(slots=6, kvh=kvh, rep=rep, hd=hd, max_len=12, start=2, n=n, lengths=lengths, seed=3)
    fused = torch.randn(n, (kvh * rep + 2 * kvh) * hd, generator=torch.Generator().manual_seed(4))  # [n, q | k | v]
    q_raw = fused[:, : kvh * rep * hd].view(n, kvh, rep, hd)
    k_raw = fused[:, kvh * rep * hd : (kvh * rep + kvh) * hd].view(n, kvh, hd)
    v_raw = fused[:, (kvh * rep + kvh) * hd :].view(n, kvh, hd)
    assert not q_raw.is_contiguous() and not k_raw.is_contiguous()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = rope_cos_sin(inv_freq, (lens - 1).unsqueeze(1), torch.float32)  # [n, 1, hd]: each row's position
    q_rot = apply_rope(q_raw.reshape(n, kvh * rep, 1, hd), cos, sin).view(n, kvh, rep, hd)
    k_rot = apply_rope(k_raw.unsqueeze(2), cos, sin)[:, :, 0]
    want_k, want_v = k.clone(), v.clone()
    for r, m in enumerate(lengths):
        want_k[r, :, m - 1], want_v[r, :, m - 1] = k_rot[r], v_raw[r]
    want = _sdpa(q_rot, want_k, want_v, lens)
    got = decode_attention(q_raw, k, v, lens, hd**-0.5, k_new=k_raw, v_new=v_raw, cos=cos[:, 0], sin=sin[:, 0])
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)  # rotated in place (FMA may round the last bit)
    assert torch.equal(v, want_v)
    with pytest.raises(ValueError, match="no RoPE tables"):
        decode_attention(q_raw, k, v, lens, 0.25, cos=cos[:, 0], sin=sin[:, 0])
    odd_q, odd_kv, odd_new, odd_rope = torch.zeros(n, 1, 1, 3), torch.zeros(n, 1, 12, 3), torch.zeros(n, 1, 3), torch.zeros(n, 3)
    with pytest.raises(ValueError, match="must be even"):
        decode_attention(odd_q, odd_kv, odd_kv.clone(), lens, 0.25, k_new=odd_new, v_new=odd_new, cos=odd_rope, sin=odd_rope)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_batch():
    """Each (row, kv head) is computed alone in a fixed order: the same row alone, among others, in
    another order or at another slot gives bitwise the same output (batch invariance)."""
    lengths = [5, 31, 17, 2, 31]
    q, k, v, lens = _case(slots=8, kvh=3, rep=3, hd=64, max_len=32, start=0, n=5, lengths=lengths, seed=1)
    full = decode_attention(q, k, v, lens, 0.125)
    for r in range(5):
        alone = decode_attention(q[r : r + 1], k[r : r + 1], v[r : r + 1], lens[r : r + 1], 0.125)
        assert torch.equal(alone, full[r : r + 1])
    order = [3, 0, 4, 2, 1]
    shuffled = decode_attention(q[order], k[order], v[order], lens[order], 0.125)
    assert torch.equal(shuffled, full[order])


@needs_kernel
def test_decode_attention_refuses_inputs_it_does_not_take():
    q, k, v, lens = _case(slots=4, kvh=2, rep=2, hd=16, max_len=8, start=0, n=3, lengths=[8, 3, 1])
    with pytest.raises(ValueError, match="fp32 CPU"):
        decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lens, 0.25)
    with pytest.raises(ValueError, match="lengths must be int64"):
        decode_attention(q, k, v, lens.int(), 0.25)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 8\]"):
        decode_attention(q, k, v, torch.tensor([9, 3, 1]), 0.25)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 8\]"):
        decode_attention(q, k, v, torch.tensor([8, 0, 1]), 0.25)
    with pytest.raises(ValueError, match="do not fit q"):
        decode_attention(q, k.transpose(2, 3), v.transpose(2, 3), lens, 0.25)


def test_no_compiler_means_no_kernel_and_says_why(monkeypatch, tmp_path):
    """Without a C compiler the loader returns None with the reason (the engine then keeps SDPA)."""
    monkeypatch.setattr(cpu_kernels, "_fn", None)
    monkeypatch.setattr(cpu_kernels, "LOAD_ERROR", None)
    monkeypatch.setattr(cpu_kernels, "KERNEL_DIR", tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert load_decode_attention() is None
    assert "no-such-cc" in cpu_kernels.LOAD_ERROR and "failed" in cpu_kernels.LOAD_ERROR
    with pytest.raises(RuntimeError, match="unavailable: building decode_attention.c"):
        decode_attention(*_case(slots=2, kvh=1, rep=1, hd=4, max_len=2, start=0, n=1, lengths=[2])[:4], 0.5)


@needs_kernel
@pytest.mark.skipif(__import__("platform").machine().lower() not in ("x86_64", "amd64"), reason="the ISA cap names x86 levels")
def test_an_avx2_cap_builds_its_own_kernel_without_avx512(monkeypatch, tmp_path):
    """ALIGNER_CPU_ISA=avx2 compiles for x86-64-v3 into a file of its own (never the -march=native build,
    which may hold AVX-512 instructions an AVX2-only CPU cannot run); the build uses no zmm register
    and still equals SDPA."""
    import shutil
    import subprocess

    monkeypatch.setattr(cpu_kernels, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(cpu_kernels, "_fn", None)
    monkeypatch.setattr(cpu_kernels, "LOAD_ERROR", None)
    monkeypatch.delenv("ALIGNER_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert "-march=native" in cpu_kernels.flags()
    assert load_decode_attention() is not None
    native = set(tmp_path.glob("*.so"))
    monkeypatch.setenv("ALIGNER_CPU_ISA", "avx2")
    monkeypatch.setattr(cpu_kernels, "_fn", None)
    assert "-march=x86-64-v3" in cpu_kernels.flags() and "-march=native" not in cpu_kernels.flags()
    assert load_decode_attention() is not None, cpu_kernels.LOAD_ERROR
    capped = set(tmp_path.glob("*.so")) - native
    assert len(native) == 1 and len(capped) == 1
    if shutil.which("objdump"):
        asm = subprocess.run(["objdump", "-d", str(capped.pop())], capture_output=True, text=True, check=True).stdout
        assert "ymm" in asm and "zmm" not in asm  # AVX2's 256-bit registers, none of AVX-512's
    lengths = [3, 17, 9]
    q, k, v, lens = _case(slots=4, kvh=2, rep=2, hd=32, max_len=20, start=1, n=3, lengths=lengths)
    torch.testing.assert_close(decode_attention(q, k, v, lens, 32**-0.5), _sdpa(q, k, v, lens), atol=2e-6, rtol=1e-5)
