"""McNemar's exact test (aligner.eval.mcnemar_exact) against binomial tails computed by hand, and
against scipy's binomtest where scipy is installed."""

from __future__ import annotations

import pytest

from aligner.eval import mcnemar_exact


def pairs(b: int, c: int, same_pass: int = 3, same_fail: int = 5):
    before = [False] * b + [True] * c + [True] * same_pass + [False] * same_fail
    after = [True] * b + [False] * c + [True] * same_pass + [False] * same_fail
    return before, after


def test_hand_computed_tails():
    # b=1, c=5: n=6, P(X<=1) = (1 + 6) / 64, two-sided 14/64
    r = mcnemar_exact(*pairs(1, 5))
    assert (r["b"], r["c"], r["n"]) == (1, 5, 14) and r["p_value"] == pytest.approx(14 / 64, abs=1e-15)
    # b=0, c=4: 2 * 1/16
    assert mcnemar_exact(*pairs(4, 0))["p_value"] == pytest.approx(2 / 16, abs=1e-15)
    # b=c: the two-sided p is capped at 1
    assert mcnemar_exact(*pairs(3, 3))["p_value"] == 1.0
    # no discordant pair
    assert mcnemar_exact(*pairs(0, 0))["p_value"] == 1.0
    # b=38, c=28 (n=66): 2 * sum_{k<=28} C(66, k) / 2^66, computed here independently by the recurrence C(n, k+1) = C(n, k) (n-k)/(k+1)
    term, total = 1.0, 0.0
    for k in range(29):
        total += term
        term = term * (66 - k) / (k + 1)
    assert mcnemar_exact(*pairs(38, 28))["p_value"] == pytest.approx(2 * total / 2**66, rel=1e-12)


def test_against_scipy():
    stats = pytest.importorskip("scipy.stats", reason="scipy is not installed: the hand-computed tails above cover the formula")
    for b, c in ((1, 5), (38, 28), (60, 20), (0, 9), (17, 17)):
        want = stats.binomtest(b, b + c, 0.5).pvalue
        assert mcnemar_exact(*pairs(b, c))["p_value"] == pytest.approx(want, rel=1e-9)


def test_refuses_unpaired():
    with pytest.raises(ValueError, match="one pair per item"):
        mcnemar_exact([True], [True, False])
