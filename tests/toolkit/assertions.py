"""The layout-comparison assertion and its per-layout tolerances.

A layout test runs the same seeded model under a sharded layout (tp / pp / dp / ep) and as one
process, and records, per rank, ``{check name: max abs error}``. The GEMMs of the two differ in
shape and summation order, so the errors are rounding, never zero, and never compared bitwise:

LAYOUT_TOL: fp32 logits, log-probs, gradients and the parameters after 3 AdamW steps of the
    in-process layout batteries (test_tensor_parallel, test_pipeline, test_moe): 1e-5.
STAGE_METRIC_TOL: the per-step losses a whole stage run logs to metrics.jsonl (6 significant
    digits, after gradient accumulation over micro-batches and a data-parallel mean): 1e-4.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import pytest

LAYOUT_TOL = 1e-5
STAGE_METRIC_TOL = 1e-4


def max_abs_diff(got: Mapping, want: Mapping) -> float:
    """Largest |got[k] - want[k]| over the tensors of `want` (compared in fp32); KeyError for a missing key."""
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


def assert_layout_matches(errors_by_rank: Sequence[Mapping[str, float]], layout: str, tol: float = LAYOUT_TOL) -> None:
    """Every check of every rank below `tol`; the message names the rank, the layout and each failing check."""
    for rank, errs in enumerate(errors_by_rank):
        bad = {k: v for k, v in errs.items() if not v < tol}  # `not <` also catches NaN
        assert not bad, f"rank {rank}, {layout}: errors above {tol}: {bad}"


def assert_metrics_match(got: Sequence[Mapping], want: Sequence[Mapping], keys: Iterable[str], layout: str, tol: float = STAGE_METRIC_TOL):
    """The rows of two metrics.jsonl files agree in every `key` (rows that have it), within `tol`."""
    for key in keys:
        a = [r[key] for r in want if key in r]
        b = [r[key] for r in got if key in r]
        assert len(b) == len(a) > 0, (layout, key)
        assert b == pytest.approx(a, abs=tol), f"{layout}: {key} {b} vs single worker {a}"
