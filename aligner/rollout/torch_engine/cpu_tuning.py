"""CPU kernel autotuning for the rollout engine: timed once per machine, kept in a file-locked cache.

At engine build on the CPU (``cpu_layout="auto"``, ``decode_attention="auto"``), a decode
step's work is timed with every candidate on this machine and the fastest is kept:
:func:`choose_cpu_layout` times the linear weights' GEMMs (MKL's ``F.linear`` on [out, in] or
[in, out] storage, oneDNN on prepacked copies; q/k/v and gate/up packed into one GEMM or not)
and :func:`choose_decode_attention` times one-token attention (SDPA against the varlen kernel of
:mod:`aligner.rollout.torch_engine.cpu_kernels`). :func:`cached_cpu_layout` and :func:`cached_decode_attention`
keep each choice in one JSON file (:data:`LAYOUT_CACHE`) keyed by the CPU, torch version and
shapes, under an exclusive file lock, so every process of a machine (tensor-parallel ranks,
replicas, a resumed run) multiplies and attends with the same kernels. Measurements:
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from aligner.nn.cpu_isa import isa_signature
from aligner.nn.layers import onednn_linear, onednn_pack, onednn_supports
from aligner.rollout.torch_engine import cpu_kernels
from aligner.rollout.torch_engine.cpu_kernels import decode_attention

LAYOUT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aligner" / "cpu_layout.json"


@dataclass(frozen=True)
class CpuLayout:
    """How the CPU engine multiplies by its linear weights (:func:`choose_cpu_layout`).

    kernel: "aten" (``F.linear``: MKL on x86 builds) or "onednn" (oneDNN's linear on a copy of
    each weight prepacked for the decode batch, :func:`aligner.nn.layers.prepack_onednn`).
    transposed: aten only: weights stored [in, out] (MKL's no-transpose GEMM).
    fused: q/k/v and gate/up packed into one GEMM each. info: {"batch", "timings_ms", ...}.
    """

    kernel: str
    transposed: bool
    fused: bool
    info: dict

    @property
    def name(self) -> str:
        base = "onednn" if self.kernel == "onednn" else ("in_out" if self.transposed else "out_in")
        return base + ("+fused" if self.fused else "")


def cached_cpu_layout(model: nn.Module, batch: int, fusable: bool, path: Path = LAYOUT_CACHE) -> CpuLayout:
    """:func:`choose_cpu_layout`, timed once per machine and kept in `path` (JSON, keyed by the CPU
    model and ISA, the ISA caps in force (:func:`aligner.nn.cpu_isa.isa_signature`), torch version,
    dtype, decode batch, the candidate kernels that run here and the GEMM shapes), so every run on
    a machine multiplies with the same kernels: a resumed run rounds exactly as the uninterrupted
    one. Processes that build engines at once (tensor-parallel ranks, replicas) take an exclusive
    lock on ``<path>.lock`` around look-up, timing and write, so the first one times and the others read its choice: every rank of a machine uses
    the same kernels (ranks timing independently could pick different ones, which a resume
    would then change). An unreadable or unwritable cache (or lock) only costs the timing
    (info["cached"] says which)."""
    from aligner.runtime.host import cpu_signature

    layer = next(iter(model.model.layers.values()))
    shapes = [tuple(l.weight.shape) for l in (layer.self_attn.q_proj, layer.self_attn.k_proj, *_dense_mlp(layer)[::2])]
    head = None if model.lm_head is None else tuple(model.lm_head.weight.shape)
    dtype = next(model.parameters()).dtype
    kernels = "aten+onednn" if onednn_supports(dtype)[0] else "aten"
    key = f"{cpu_signature()} | {isa_signature()} | torch {torch.__version__} | {dtype} | batch {batch} | kernels {kernels} | fusable {fusable} | {len(model.model.layers)} x {shapes} | head {head}"
    entry = _machine_cached(path, key, lambda: _layout_entry(choose_cpu_layout(model, batch, fusable)), valid=lambda e: len(e) == 4)
    k, t, f, info = entry
    return CpuLayout(k, t, f, info)


def _layout_entry(lay: CpuLayout) -> list:
    return [lay.kernel, lay.transposed, lay.fused, lay.info]


def _machine_cached(path: Path, key: str, compute, valid) -> Any:
    """table[key] of the JSON file `path`, computed by ``compute()`` and written there when absent
    (or not ``valid(entry)``), under an exclusive lock on ``<path>.lock``: the processes of a
    machine that ask at once get the first one's entry. The returned entry's last item is a dict
    to which ``"cached"`` is added: the path it was read from, or False when computed here.
    An unreadable or unwritable cache (or lock) only costs the computation."""
    lock = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(f"{path.name}.lock"), "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError:  # no lock (read-only cache dir): this process times on its own, as documented
        if lock is not None:
            lock.close()
        lock = None
    try:
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        if key in table and valid(table[key]):
            entry = table[key]
            return [*entry[:-1], {**entry[-1], "cached": str(path)}]
        entry = compute()
        try:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**table, key: entry}, indent=1))
            os.replace(tmp, path)
        except OSError:  # unwritable cache: the next build times again (info["cached"] is False)
            pass
        return [*entry[:-1], {**entry[-1], "cached": False}]
    finally:
        if lock is not None:
            lock.close()  # releases the flock


def cached_decode_attention(model: nn.Module, batch: int, path: Path = LAYOUT_CACHE) -> dict:
    """:func:`choose_decode_attention`, timed once per machine and kept in `path` beside the
    weight layouts (keyed by the CPU model and ISA, torch version, decode batch, the local kv
    heads, query heads per kv head and head_dim, and the kernel's source), under the same lock
    as :func:`cached_cpu_layout` (and the ISA caps in force), so every engine of a machine attends
    with the same kernel.
    Returns {"choice": "sdpa" | "varlen", "timings_ms": {...}, "context": L, "cached": ...}."""
    from aligner.runtime.host import cpu_signature

    kvh, rep, hd = _attention_shape(model)
    source = hashlib.sha256(cpu_kernels.SOURCE.read_bytes()).hexdigest()[:12]
    key = (
        f"decode attention | {cpu_signature()} | {isa_signature()} | torch {torch.__version__} | batch {batch} "
        f"| kvh {kvh} rep {rep} hd {hd} | kernel {source}"
    )
    return _machine_cached(path, key, lambda: [choose_decode_attention(model, batch)], valid=lambda e: len(e) == 1)[0]


def _attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(local kv heads, query heads per kv head, head_dim) of the model's attention layers."""
    a = next(iter(model.model.layers.values())).self_attn
    hd = a.head_dim
    kvh, h = a.k_proj.weight.shape[0] // hd, a.q_proj.weight.shape[0] // hd
    return kvh, h // kvh, hd


def choose_decode_attention(model: nn.Module, batch: int, context: int = 256, rounds: int = 5) -> dict:
    """Time one decode step's attention with SDPA and with the varlen kernel on this CPU; keep the faster.

    The work is what the continuous scheduler runs: `batch` one-token rows of the model's local
    attention shape over fp32 caches of `context` positions (at most the model's max_seq_len),
    each row at a seeded random length in [context / 2, context] (continuous batching keeps
    rows of every age in the pool), SDPA under the engine's prefix mask, the kernel up to each
    row's length. Several layers' caches (up to 256 MiB) are visited in turn, so each call reads
    its keys from memory as decode does. Candidates alternate over `rounds` rounds; medians
    decide. Measured (benchmarks/RESULTS.md): SmolLM2-135M's shape, 64 rows, 2-core AMD EPYC.
    Returns {"choice", "timings_ms": {"sdpa", "varlen"} (ms per cache visited), "context"}.
    """
    kvh, rep, hd = _attention_shape(model)
    context = max(2, min(context, model.cfg.max_seq_len))
    g = torch.Generator().manual_seed(0)
    per_layer = 2 * batch * kvh * context * hd * 4
    caches = [
        (torch.randn(batch, kvh, context, hd, generator=g), torch.randn(batch, kvh, context, hd, generator=g))
        for _ in range(max(1, min(4, (256 << 20) // per_layer)))
    ]
    q = torch.randn(batch, kvh, rep, hd, generator=g)
    lengths = torch.randint(context // 2, context + 1, (batch,), generator=g)
    lengths[0] = context
    mask = (torch.arange(context) < lengths.unsqueeze(1))[:, None, None, :]

    def sdpa(k, v):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def varlen(k, v):
        decode_attention(q, k, v, lengths, hd**-0.5)

    runs = {"sdpa": sdpa, "varlen": varlen}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                for k, v in caches:
                    fn(k, v)
                if r:  # round 0 warms up
                    times[name].append((time.perf_counter() - t0) / len(caches))
    med = {name: round(1e3 * statistics.median(v), 4) for name, v in times.items()}
    return {"choice": min(med, key=med.get), "timings_ms": med, "context": context}


def choose_cpu_layout(model: nn.Module, batch: int, fusable: bool, rounds: int = 5) -> CpuLayout:
    """Time a decode step's GEMMs on this CPU with every weight layout and kernel; keep the fastest.

    Candidates: ``F.linear`` (MKL) with weights stored [out, in] (PyTorch's) or [in, out]
    (``transposed``), and oneDNN's linear on weights prepacked for `batch` rows (where the
    torch build has it and it runs for the model's dtype on this CPU under the ISA caps,
    :func:`aligner.nn.layers.onednn_supports`: bf16 needs AVX-512 or AVX-NE-CONVERT); each with
    q/k/v and gate/up packed into one GEMM (``fused``, only when `fusable`) or not. Each candidate
    runs the GEMMs of up to 4 of the model's own local layers (their weight shapes, so each reads
    fresh weights from memory as decode does) on a [batch, in] input, scaled to every local layer, plus the lm_head (a tied head keeps the
    embedding's [out, in] layout under F.linear; oneDNN multiplies by a prepacked copy of it).
    Candidates alternate over `rounds` rounds; the median decides. Collective-free:
    :func:`cached_cpu_layout` makes the processes of one machine agree through a file lock;
    ranks on different machines time (and may choose) independently.

    Measured (benchmarks/RESULTS.md): on a 2-core AMD EPYC, MKL's small-batch GEMMs stream
    weights at 5-7 GB/s, oneDNN's prepacked ones at 20-35 GB/s (SmolLM2's head at 16 rows: 157
    vs 53 GFLOP/s). Only candidates that run here are timed: a kernel refused by the checks above, or
    whose first call raises, is left out with its reason in info["refused"] {candidate: reason}.
    Returns a :class:`CpuLayout`; info["timings_ms"] {candidate: ms per step}.
    """
    layers = list(model.model.layers.values())
    sample = layers[: min(4, len(layers))]
    head = model.lm_head
    tied = head is not None and model.model.embed_tokens is not None and head.weight is model.model.embed_tokens.weight
    dtype = next(model.parameters()).dtype
    onednn_ok, onednn_why = onednn_supports(dtype)
    kernels = ("aten", "onednn") if onednn_ok else ("aten",)
    refused: dict[str, str] = {} if onednn_ok else {"onednn": onednn_why}
    candidates = [
        CpuLayout(k, t, f, {})
        for k in kernels
        for t in ((False, True) if k == "aten" else (False,))
        for f in ((False, True) if fusable else (False,))
    ]

    def gemms(c: CpuLayout) -> list[torch.Tensor]:
        out = []
        for layer in sample:
            a, mlp = layer.self_attn, _dense_mlp(layer)
            for group in ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), mlp[:2], mlp[2:]):
                if not group:  # an MoE layer: its experts are not nn.Linear weights and keep their layout
                    continue
                ws = [l.weight.detach() for l in group]
                out += [
                    w.t().contiguous().t() if c.transposed else w.contiguous() for w in ([torch.cat(ws)] if c.fused and len(ws) > 1 else ws)
                ]
        if head is not None:
            w = head.weight.detach()
            out.append(w.t().contiguous().t() if c.transposed and not tied else w)
        if c.kernel == "onednn":
            out = [(w.shape[1], onednn_pack(w, batch)) for w in out]
        return out

    def run(c: CpuLayout, w) -> None:
        if c.kernel == "onednn":
            onednn_linear(inputs[w[0]], w[1], None)
        else:
            F.linear(inputs[w.shape[1]], w)

    with torch.inference_mode():
        first = gemms(candidates[0])  # aten on [out, in]: runs everywhere
        inputs = {k: torch.randn(batch, k).to(dtype) for k in {w.shape[1] for w in first}}
        weights = {candidates[0].name: first}
        for c in candidates[1:]:  # a kernel that raises here (packing or a first call) is not a candidate
            try:
                weights[c.name] = gemms(c)
                for w in weights[c.name]:
                    run(c, w)
            except RuntimeError as e:
                refused[c.name] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                weights.pop(c.name, None)
        candidates = [c for c in candidates if c.name not in refused]
        n_head = 0 if head is None else 1
        scale = len(layers) / len(sample)
        times: dict[str, list[float]] = {c.name: [] for c in candidates}
        for r in range(rounds + 1):
            for c in candidates:
                ws = weights[c.name]
                t0 = time.perf_counter()
                for w in ws[: len(ws) - n_head]:
                    run(c, w)
                t_layers = (time.perf_counter() - t0) * scale
                t0 = time.perf_counter()
                for w in ws[len(ws) - n_head :]:
                    run(c, w)
                if r:  # round 0 warms up
                    times[c.name].append(t_layers + time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    best = min(candidates, key=lambda c: med[c.name])
    info = {"batch": batch, "timings_ms": {n: round(1e3 * v, 3) for n, v in med.items()}}
    if refused:
        info["refused"] = refused
    return CpuLayout(best.kernel, best.transposed, best.fused, info)


def _dense_mlp(layer: nn.Module) -> tuple:
    """(gate_proj, up_proj, down_proj) of a dense SwiGLU layer; () for an MoE layer."""
    m = layer.mlp
    return (m.gate_proj, m.up_proj, m.down_proj) if hasattr(m, "gate_proj") else ()
