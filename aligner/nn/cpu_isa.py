"""The CPU instruction set aligner's own CPU fast paths may assume, and the cap that lowers it.

Four settings cap what the CPU paths use, each its own layer's (docs/hardware.md, "Running as
another CPU"):

- ``ATEN_CPU_CAPABILITY`` (torch: ``default``, ``avx2``, ``avx512``): the vectorized ATen kernels
  torch dispatches to, and inductor's vector ISA; ``torch.backends.cpu.get_cpu_capability()`` reports it.
- ``ONEDNN_MAX_CPU_ISA`` (oneDNN: ``AVX2``, ``AVX512_CORE``, ``AVX512_CORE_BF16``, ``ALL``, ...):
  oneDNN's kernels; under ``AVX2`` its bf16 linears refuse to run, as on a real AVX2-only CPU.
- ``MKL_ENABLE_INSTRUCTIONS`` (MKL: ``AVX2``, ``AVX512``, ...): MKL's GEMMs on Intel CPUs (on AMD
  CPUs MKL runs its AVX2 code already).
- ``ALIGNER_CPU_ISA`` (:data:`ISA_ENV`: ``default``, ``avx2``, ``avx512``; unset or ``native``: no
  cap): aligner's own decisions, :func:`cpu_isa` being the lower of it and torch's capability: the
  ``-march`` its C kernels are compiled with (:func:`march_flags`), whether oneDNN's bf16 linears may
  be used (:func:`onednn_bf16_allowed`), and the key of every per-machine cache of compiled kernels
  and measured choices (:func:`isa_signature`), so a build or a choice made for AVX-512 is never
  reused under an AVX2 cap.

Setting all four to the AVX2 level makes an AVX-512 machine choose, compile and round as an
AVX2-only CPU (Haswell, Zen 1-3, most laptops) would.
"""

from __future__ import annotations

import os
import platform

from aligner.errors import ConfigError

ISA_ENV = "ALIGNER_CPU_ISA"
LEVELS = ("default", "avx2", "avx512")  # lowest first; torch's x86 capabilities, lower-cased
_NO_CAP = ("", "native")
# gcc / clang micro-architecture levels (x86-64 psABI): v3 is AVX2 + FMA + BMI1/2 (every AVX2 CPU),
# v4 adds AVX-512 F/BW/CD/DQ/VL
_MARCH = {"default": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}


def isa_cap() -> str | None:
    """The cap :data:`ISA_ENV` sets: one of :data:`LEVELS`, or None when it is unset, empty or
    ``native``. Raises ConfigError (one line: the variable, the value, the valid ones) on any other value."""
    raw = os.environ.get(ISA_ENV, "").strip().lower()
    if raw in _NO_CAP:
        return None
    if raw not in LEVELS:
        raise ConfigError(
            f"{ISA_ENV}={os.environ[ISA_ENV]!r} is invalid: valid are {', '.join(LEVELS)} or native (no cap); "
            f"unset it to use every instruction this CPU has"
        )
    return raw


def torch_capability() -> str:
    """torch's CPU capability, lower-cased ("avx512", "avx2", "default"; "sve256", "zvector", ... off x86),
    after ``ATEN_CPU_CAPABILITY``."""
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def cpu_isa() -> str:
    """The instruction set aligner's CPU paths assume: the lower of torch's capability and the cap
    (:func:`isa_cap`); off x86 (a capability outside :data:`LEVELS`) torch's capability as it is."""
    have, cap = torch_capability(), isa_cap()
    if have not in LEVELS or cap is None:
        return have
    return LEVELS[min(LEVELS.index(have), LEVELS.index(cap))]


def capped() -> bool:
    """True when a setting asks for less than the machine has: :data:`ISA_ENV` or ``ATEN_CPU_CAPABILITY`` set."""
    return isa_cap() is not None or bool(os.environ.get("ATEN_CPU_CAPABILITY", "").strip())


def march_flags() -> list[str]:
    """The C compiler's target flags for aligner's own kernels: ``-march=native`` uncapped (or off
    x86); under a cap the x86-64 level of :func:`cpu_isa` (``-march=x86-64-v3`` for avx2), tuned
    for this CPU, so the build runs on any CPU of that level."""
    isa = cpu_isa()
    if not capped() or isa not in LEVELS or platform.machine().lower() not in ("x86_64", "amd64"):
        return ["-march=native"]
    return [f"-march={_MARCH[isa]}", "-mtune=native"]


def onednn_bf16_allowed() -> bool:
    """Whether the cap lets aligner use oneDNN's bf16 linears: they need AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, so an avx2 (or lower) cap refuses them; uncapped, only whether they run decides
    (:func:`aligner.nn.layers.onednn_supports`)."""
    cap = isa_cap()
    return cap is None or LEVELS.index(cap) >= LEVELS.index("avx512")


def isa_signature() -> str:
    """What the CPU paths may use here, for the keys of per-machine caches: "isa avx2 cap avx2 onednn AVX2
    mkl AVX2" (aligner's :func:`cpu_isa`, its cap, oneDNN's ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``
    and MKL's ``MKL_ENABLE_INSTRUCTIONS``)."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "all"
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS") or "all"
    return f"isa {cpu_isa()} cap {isa_cap() or 'none'} onednn {onednn.upper()} mkl {mkl.upper()}"
