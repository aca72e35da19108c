"""CPU kernel autotuning: the measured weight layout and decode attention are kept per machine.

The engine-level checks (every layout gives the same tokens, ``auto`` reports its timings) are in
tests/rollout/test_torch_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aligner.model.llama import build_model
from aligner.nn.layers import onednn_available
from tests.toolkit.engine import ENGINE_CFG, VARLEN, engine_model

CFG = ENGINE_CFG
CANDIDATES = {"out_in", "out_in+fused", "in_out", "in_out+fused"} | ({"onednn", "onednn+fused"} if onednn_available() else set())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return engine_model()


def test_the_measured_layout_is_kept_per_machine(model, tmp_path):
    """cached_cpu_layout times once, then every engine on the machine gets the same choice from the
    file (a resumed run rounds like the uninterrupted one); a corrupt file only costs the timing."""
    from aligner.rollout.torch_engine.cpu_tuning import cached_cpu_layout

    path = tmp_path / "cpu_layout.json"
    first = cached_cpu_layout(model, 4, True, path)
    assert first.info["cached"] is False and set(first.info["timings_ms"]) == CANDIDATES
    timings = first.info["timings_ms"]  # rounded to the microsecond: two candidates can tie there
    assert timings[first.name] == min(timings.values())  # the fastest (CI chose in_out+fused over a tied out_in+fused)
    again = cached_cpu_layout(model, 4, True, path)
    assert (again.kernel, again.transposed, again.fused) == (first.kernel, first.transposed, first.fused)
    assert again.info["cached"] == str(path) and again.info["timings_ms"] == first.info["timings_ms"]
    other = cached_cpu_layout(model, 8, True, path)  # another decode batch is another entry
    assert other.info["cached"] is False and len(__import__("json").loads(path.read_text())) == 2
    path.write_text("{not json")
    assert cached_cpu_layout(model, 4, True, path).info["cached"] is False


@VARLEN
def test_the_measured_decode_attention_is_kept_per_machine(model, tmp_path):
    from aligner.rollout.torch_engine.cpu_tuning import cached_decode_attention

    path = tmp_path / "cpu_layout.json"
    first = cached_decode_attention(model, 4, path)
    assert first["cached"] is False and set(first["timings_ms"]) == {"sdpa", "varlen"} and first["context"] == CFG.max_seq_len
    again = cached_decode_attention(model, 4, path)
    assert again["cached"] == str(path) and again["choice"] == first["choice"] and again["timings_ms"] == first["timings_ms"]
    assert cached_decode_attention(model, 8, path)["cached"] is False  # another decode batch: another entry
    assert len(json.loads(path.read_text())) == 2


def _layout_in_child(path: str, start, q) -> None:
    from aligner.rollout.torch_engine.cpu_tuning import cached_cpu_layout

    torch.set_num_threads(1)
    model = build_model(CFG, seed=0).eval()
    start.wait()
    lay = cached_cpu_layout(model, 4, True, Path(path))
    q.put((lay.name, lay.info["cached"] is False))


def test_processes_building_engines_at_once_agree_on_the_layout(tmp_path):
    """Tensor-parallel ranks build their engines at the same moment: one times, the others wait on
    the lock and read its choice (the CI replica's resumed tp=2 run rounded differently when the
    two ranks timed and chose independently)."""
    ctx = torch.multiprocessing.get_context("spawn")
    start, q = ctx.Event(), ctx.Queue()
    path = tmp_path / "cpu_layout.json"
    procs = [ctx.Process(target=_layout_in_child, args=(str(path), start, q)) for _ in range(3)]
    for p in procs:
        p.start()
    start.set()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert len({name for name, _ in got}) == 1, got
    assert sum(timed for _, timed in got) == 1, got  # exactly one process timed
    assert len(json.loads(path.read_text())) == 1


def test_an_isa_cap_is_its_own_entry_and_a_kernel_that_raises_is_no_candidate(model, tmp_path, monkeypatch):
    """A choice measured uncapped is never reused under ALIGNER_CPU_ISA=avx2 (or oneDNN's cap): the key
    holds the caps, so an AVX-512 machine emulating an AVX2 one times again. A candidate whose kernel
    raises on this CPU is left out of the timing with its reason (the others still decide)."""
    from aligner.rollout.torch_engine import cpu_tuning
    from aligner.rollout.torch_engine.cpu_tuning import cached_cpu_layout, choose_cpu_layout

    for name in ("ALIGNER_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # uncapped first (make test-avx2 caps all)
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "cpu_layout.json"
    cached_cpu_layout(model, 4, True, path)
    monkeypatch.setenv("ALIGNER_CPU_ISA", "avx2")
    assert cached_cpu_layout(model, 4, True, path).info["cached"] is False
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cached_cpu_layout(model, 4, True, path).info["cached"] is False
    assert len(json.loads(path.read_text())) == 3
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("ALIGNER_CPU_ISA")
    if not onednn_available():
        return

    def refuse(x, packed, bias):
        raise RuntimeError("this CPU does not run it")

    monkeypatch.setattr(cpu_tuning, "onednn_linear", refuse)
    lay = choose_cpu_layout(model, 4, True, rounds=1)
    assert lay.kernel == "aten" and set(lay.info["timings_ms"]) == CANDIDATES - {"onednn", "onednn+fused"}
    assert lay.info["refused"] == {"onednn": "this CPU does not run it", "onednn+fused": "this CPU does not run it"}
