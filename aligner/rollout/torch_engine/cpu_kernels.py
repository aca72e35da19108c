"""CPU kernels of our own, built on this machine at first use: the rollout engine's decode attention.

PyTorch's CPU ``scaled_dot_product_attention`` runs a one-token decode query as small GEMMs per
(row, head) and reads every key up to the batch's longest context: with SmolLM2-135M's shapes it
took two to four times as long as merely reading the keys and values once (benchmarks/RESULTS.md,
"Generation on a real model"). :func:`decode_attention` runs
``aligner/rollout/torch_engine/csrc/decode_attention.c`` instead: each (row, kv head) reads its keys and values
once, for all its query heads, and only up to that row's own length (as vLLM's paged-attention
kernels do on GPU and CPU); in fixed order, so a row's result does not depend on the batch.

The C source is compiled with the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native
-ffast-math -fopenmp``, or under an ISA cap that level's ``-march``, e.g. ``x86-64-v3`` for
``ALIGNER_CPU_ISA=avx2``: :func:`aligner.nn.cpu_isa.march_flags`) into
``$XDG_CACHE_HOME/aligner/kernels/`` under a name keyed by the source, the compiler, its flags,
the CPU (:func:`aligner.runtime.host.cpu_signature`) and the caps in force
(:func:`aligner.nn.cpu_isa.isa_signature`), so a build for AVX-512 is never loaded under an AVX2
cap; and loaded with ctypes. Its OpenMP calls resolve to the libgomp torch has already loaded (same soname), so it
shares torch's thread pool. Where no compiler is found or the build fails,
:func:`load_decode_attention` returns None with the reason in :data:`LOAD_ERROR`, and the engine
keeps SDPA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_attention.c"
KERNEL_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aligner" / "kernels"
FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]  # plus the target of aligner.nn.cpu_isa.march_flags()

_lock = threading.Lock()
_fn = None
LOAD_ERROR: Optional[str] = None  # why load_decode_attention() returned None (None when it loaded or was not tried)


def flags() -> list[str]:
    """The compiler flags: :data:`FLAGS` and the target, ``-march=native`` or, under an ISA cap
    (``ALIGNER_CPU_ISA`` / ``ATEN_CPU_CAPABILITY``), that level's (:func:`aligner.nn.cpu_isa.march_flags`)."""
    from aligner.nn.cpu_isa import march_flags

    return [FLAGS[0], *march_flags(), *FLAGS[1:]]


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        subprocess.run([cc, *flags(), str(SOURCE), "-o", str(tmp), "-lm"], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)  # atomic: a concurrent builder of the same key writes the same bytes
    finally:
        tmp.unlink(missing_ok=True)


def load_decode_attention():
    """The compiled kernel (a ctypes function), building it on first use; None where it cannot be
    built or loaded here (:data:`LOAD_ERROR` says why). Thread-safe; the result is kept."""
    global _fn, LOAD_ERROR
    with _lock:
        if _fn is not None or LOAD_ERROR is not None:
            return _fn
        from aligner.nn.cpu_isa import isa_signature
        from aligner.runtime.host import cpu_signature

        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            LOAD_ERROR = "no C compiler found (set CC or install gcc)"
            return None
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
            key = hashlib.sha256(
                "\n".join([SOURCE.read_text(), cc, *version, *flags(), cpu_signature(), isa_signature()]).encode()
            ).hexdigest()[:16]
            path = KERNEL_DIR / f"decode_attention-{key}.so"
            if not path.exists():
                _build(cc, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            LOAD_ERROR = f"building {SOURCE.name} with {cc} failed: {detail.strip().splitlines()[-1] if detail.strip() else e}"
            return None
        fn = lib.decode_attention_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int]
        _fn = fn
        return _fn


def check_decode_lengths(lengths: torch.Tensor, keys: int) -> None:
    """Raise ValueError unless `lengths` is int64 [n] contiguous with 1 <= lengths <= keys."""
    if lengths.dtype != torch.int64 or lengths.dim() != 1 or not lengths.is_contiguous():
        raise ValueError(f"decode_attention: lengths must be int64 [n] contiguous, got {lengths.dtype} {tuple(lengths.shape)}")
    if lengths.numel():
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 1 or hi > keys:
            raise ValueError(f"decode_attention: lengths must be in [1, {keys}] (the keys k holds), got {lo}..{hi}")


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    checked: bool = False,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One-token grouped-query attention over a KV cache, each row up to its own length.

    Args:
        q: [n, kvh, rep, hd] fp32 CPU: query head h * rep + j of row r is q[r, h, j]. Any row
            stride; each row's heads contiguous (a view of a fused q|k|v projection output is taken
            as it is, other layouts are copied).
        k, v: [n, kvh, >= max(lengths), hd] fp32 CPU views of the cache (any row and head strides,
            the head_dim contiguous and one position hd elements after the last, as a slice
            ``cache[a:b, :, :L]`` of a contiguous [slots, kvh, max_len, hd] cache is); the same strides.
        lengths: [n] int64: row r attends to key positions [0, lengths[r]); 1 <= lengths[r] <= k.shape[2].
        scale: the logit scale (1 / sqrt(hd) for Llama).
        k_new, v_new: [n, kvh, hd] fp32 or None (any row stride, each row's heads contiguous, the
            same strides): the step's own key and value, written into k and v at position
            lengths[r] - 1 of each row before it attends (in place: k and v must be writable views
            of the cache). Fused here because a separate scattered copy into a cold cache ran at
            about 100 us per layer in the engine (SmolLM2, 64 rows), the kernel reads those rows
            right after.
        cos, sin: [n, hd] fp32 or None: RoPE tables (Su et al. 2021) at each row's position, as
            :func:`aligner.model.llama.rope_cos_sin` gives them; when given, q and k_new are the
            un-rotated projections and are rotated here (HF's rotate-half convention, as
            :func:`aligner.model.llama.apply_rope`), and the rotated key is what the cache keeps.
            Needs k_new (the cache's own keys are rotated already) and an even hd.
        checked: the caller already ran :func:`check_decode_lengths` on `lengths` against
            k.shape[2] (the engine does once per decode step, not once per layer).
    Returns [n, kvh, rep, hd] fp32: softmax(q k^T * scale) v per query head, equal to
    ``F.scaled_dot_product_attention`` with the prefix mask of `lengths` up to fp32 rounding.
    Raises RuntimeError where the kernel cannot be loaded (:func:`load_decode_attention`) or ran
    out of memory, ValueError on inputs it does not take (checked here, before the call).
    """
    fn = load_decode_attention()
    if fn is None:
        raise RuntimeError(f"aligner's decode attention kernel is unavailable: {LOAD_ERROR}")
    n, kvh, rep, hd = q.shape
    if not (q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == k.device.type == v.device.type == "cpu"):
        raise ValueError(f"decode_attention takes fp32 CPU tensors, got q {q.dtype} {q.device}, k {k.dtype}, v {v.dtype}")
    if k.shape[:2] != (n, kvh) or k.shape[3] != hd or v.shape != k.shape or k.stride() != v.stride() or k.stride()[2:] != (hd, 1):
        raise ValueError(f"decode_attention: k/v {tuple(k.shape)} strides {k.stride()} do not fit q {tuple(q.shape)}")
    if lengths.shape != (n,):
        raise ValueError(f"decode_attention: lengths must be int64 [{n}] contiguous, got {lengths.dtype} {tuple(lengths.shape)}")
    if not checked:
        check_decode_lengths(lengths, k.shape[2])
    if (k_new is None) != (v_new is None):
        raise ValueError("decode_attention: give both k_new and v_new or neither")
    if (cos is None) != (sin is None) or (cos is not None and k_new is None):
        raise ValueError("decode_attention: give both cos and sin, and k_new / v_new with them, or no RoPE tables")
    out = torch.empty(q.shape, dtype=q.dtype)
    if n == 0:
        return out
    if q.stride()[1:] != (rep * hd, hd, 1):
        q = q.contiguous()
    new_row = 0
    if k_new is not None:
        if k_new.shape != (n, kvh, hd) or v_new.shape != k_new.shape or k_new.dtype != torch.float32 or v_new.dtype != torch.float32:
            raise ValueError(
                f"decode_attention: k_new/v_new must be fp32 [{n}, {kvh}, {hd}], got {tuple(k_new.shape)} {tuple(v_new.shape)}"
            )
        if k_new.stride()[1:] != (hd, 1) or v_new.stride() != k_new.stride():
            k_new, v_new = k_new.contiguous(), v_new.contiguous()
        new_row = k_new.stride(0)
    if cos is not None:
        if hd % 2:
            raise ValueError(f"decode_attention: RoPE rotates pairs of the head dimension, which must be even; got head_dim {hd}")
        if cos.shape != (n, hd) or sin.shape != (n, hd) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError(
                f"decode_attention: cos/sin must be fp32 [{n}, {hd}], got {tuple(cos.shape)} {cos.dtype}, {tuple(sin.shape)} {sin.dtype}"
            )
        cos, sin = cos.contiguous(), sin.contiguous()
    failed = fn(
        q.data_ptr(), k.data_ptr(), v.data_ptr(),
        None if k_new is None else k_new.data_ptr(), None if v_new is None else v_new.data_ptr(),
        lengths.data_ptr(), out.data_ptr(),
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
        n, kvh, rep, hd, q.stride(0), new_row, k.stride(0), k.stride(1), k.shape[2], float(scale), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise RuntimeError("decode_attention: the kernel could not allocate its score buffer")
    return out
