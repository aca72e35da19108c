"""Host-memory setting for processes that train or generate on the CPU.

Owns one process-wide setting: glibc's malloc keeps large freed blocks for reuse instead of
returning them to the kernel. By default glibc serves every allocation above 32 MiB with a
fresh ``mmap`` and unmaps it on free, so each [B, T, V] logits-sized tensor of a training
step (tens to hundreds of MiB) is zero-filled page by page by the kernel again at every step
(what that costs, measured: benchmarks/RESULTS.md, "PPO step: aligner vs TRL PPOTrainer").
It is the CPU counterpart of the CUDA caching allocator (Intel's PyTorch CPU guides reach the same
with jemalloc / tcmalloc preloaded). The cost: the process keeps its peak heap (RSS does not
shrink after a large step). GPU processes are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("aligner")

# The same setting for a process started with it (glibc reads these at start-up, before any
# thread has its own arena): aligner's CPU Ray workers get it through their runtime_env, so
# large blocks freed by any thread are reused. One arena: threads share the main heap.
HOST_MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}

M_TRIM_THRESHOLD = -1  # glibc mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
_applied: bool | None = None


def keep_freed_host_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Make glibc serve allocations below `mmap_threshold` bytes from its heap and never trim it,
    and put threads that have no arena yet on the main one (``mallopt`` at run time).

    Threads that already own an arena keep it, so a process started with HOST_MALLOC_ENV gets
    the full effect; this call covers processes that were not (a driver, a test, a notebook).
    Idempotent; a no-op returning False where the C library is not glibc (macOS, musl) or
    refuses the values. Returns True when the setting is in effect for this process.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = (
        mallopt(M_MMAP_THRESHOLD, min(mmap_threshold, 2**31 - 1)) == 1
        and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
        and mallopt(M_ARENA_MAX, 1) == 1
    )
    if not ok:
        log.debug("mallopt refused the host-memory setting; large CPU tensors stay mmap-backed")
    _applied = ok
    return ok


def cpu_signature() -> str:
    """The CPU model and the SIMD extensions CPU kernels choose from ("AMD EPYC avx2 fma avx512f"),
    read from /proc/cpuinfo (the platform's processor name elsewhere): a key for per-machine choices."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name":
                    model = val.strip()
                elif key.strip() == "flags":
                    flags = set(val.split())
                    break
    except OSError:
        pass
    isa = [x for x in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16") if x in flags]
    return " ".join([model, *isa])
