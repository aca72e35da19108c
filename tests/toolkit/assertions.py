"""The layout-comparison assertion and its per-layout tolerances.

A layout test runs the same seeded model under a sharded layout (tp / pp / dp / ep) and as one
process, and records, per rank, ``{check name: max abs error}``. The GEMMs of the two differ in
shape and summation order, so the errors are rounding, never zero, and never compared bitwise:

LAYOUT_TOL: fp32 logits, log-probs, gradients and the parameters after 3 AdamW steps of the
    in-process layout batteries (test_tensor_parallel, test_pipeline, test_moe): 1e-5.
STAGE_METRIC_TOL: the per-step losses a whole stage run logs to metrics.jsonl (6 significant
    digits, after gradient accumulation over micro-batches and a data-parallel mean): 1e-4.
adamw_param_tol(): the parameters after a few AdamW steps under two layouts (or reduction
    schedules) of the gloo tests: derived from the arithmetic, not from one CPU's result.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import pytest

LAYOUT_TOL = 1e-5
STAGE_METRIC_TOL = 1e-4
FP32_UNIT_ROUNDOFF = 2.0**-24  # u: fp32's relative rounding error (half its machine epsilon 2^-23)
CANCELLATION = 100  # kappa: how far below the sum of its terms' magnitudes a gradient entry may fall


def adamw_param_tol(lr: float, steps: int, tokens: int, cfg) -> float:
    """Bound on max |theta_a - theta_b| after `steps` AdamW steps at peak `lr` of two runs whose
    gradients differ only in fp32 summation order (layouts, micro-batching, GEMM kernels: AVX2
    and AVX-512 block their sums differently), `tokens` the tokens of one step's batch, `cfg` the
    model (num_layers, hidden_size, intermediate_size).

    Derivation. An AdamW step moves an entry by lr_t * (m_hat / (sqrt(v_hat) + eps) + wd * theta)
    (Loshchilov & Hutter 2019); the decay term is the same in both runs, and the direction
    r = m_hat / sqrt(v_hat) is scale-free in the gradients (a common factor, such as the
    global-norm clip's, cancels), so an entry's direction changes by its gradient's relative error
    |dr| ~ |dg| / |g|. A sum of n fp32 terms in two orders differs by at most about n * u times the
    sum of the terms' magnitudes (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2),
    i.e. by kappa * n * u relative to the sum itself, kappa the entry's cancellation factor
    (sum |terms| / |sum|). An entry of a weight gradient is a sum over the step's tokens, of terms
    that went through each layer's backward GEMMs (reductions over hidden_size or
    intermediate_size): n = tokens + num_layers * (hidden_size + intermediate_size) roundings in
    all. Over `steps` steps at lr_t <= lr the entries then differ by at most
        steps * lr * kappa * n * u,
    with kappa = :data:`CANCELLATION` (100). Entries whose gradient cancels to the rounding level
    (kappa unbounded: their direction is noise, up to 2 lr a step) are what this kappa covers;
    a real fault (a lost or doubled micro-batch, a missed reduction or step) changes the
    direction of most entries by O(1), i.e. the parameters by O(lr), 1000 times this bound at
    the tests' sizes. E.g. lr 1e-2, 3 steps, 128 tokens, 4 layers of 32 / 64: n = 512, 9.2e-5 (the
    fsdp_reduce=step check at pp=2 measured 5.0e-6 on an AVX-512 EPYC and 1.44e-5 as an AVX2-only
    CPU, emulated there and on a real one).
    """
    n = tokens + cfg.num_layers * (cfg.hidden_size + cfg.intermediate_size)
    return steps * lr * CANCELLATION * n * FP32_UNIT_ROUNDOFF


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
