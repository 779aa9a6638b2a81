"""bench/stats.py against scipy and hand-computed values: t intervals, the bootstrap, Mann-Whitney U, verdicts."""

from __future__ import annotations

import math

import pytest

from qerl_cli.bench import stats


def test_t_crit_matches_scipy():
    sp = pytest.importorskip("scipy.stats")
    for df in [*range(1, 41), 50, 80, 120, 500]:
        assert stats.t_crit95(df) == pytest.approx(sp.t.ppf(0.975, df), abs=1e-4), df
    with pytest.raises(ValueError):
        stats.t_crit95(0)


def test_mean_ci_hand_computed():
    # 1, 2, 3, 4: mean 2.5, sd sqrt(5/3), half-width t(3) * sd / 2
    ci = stats.mean_ci([1, 2, 3, 4])
    h = 3.18244631 * math.sqrt(5 / 3) / 2
    assert ci["n"] == 4 and ci["mean"] == 2.5 and ci["sd"] == pytest.approx(math.sqrt(5 / 3))
    assert (ci["lo"], ci["hi"]) == (pytest.approx(2.5 - h), pytest.approx(2.5 + h))
    assert stats.mean_ci([7.0, None, float("nan")]) == {"n": 1, "mean": 7.0, "sd": None, "lo": None, "hi": None}
    assert stats.mean_ci([])["mean"] is None


def test_mean_ci_matches_scipy_interval():
    sp = pytest.importorskip("scipy.stats")
    x = [0.42, 0.55, 0.61, 0.38, 0.7, 0.52]
    lo, hi = sp.t.interval(0.95, len(x) - 1, loc=sum(x) / len(x), scale=sp.sem(x))
    ci = stats.mean_ci(x)
    assert ci["lo"] == pytest.approx(lo, abs=1e-6) and ci["hi"] == pytest.approx(hi, abs=1e-6)


def test_bootstrap_constant_groups_is_exact():
    b = stats.bootstrap_diff([3, 3, 3], [1, 1], n_boot=200)
    assert b["diff"] == 2 and b["lo"] == 2 and b["hi"] == 2
    # paired: per-seed differences all 0.5 -> the interval is the point
    p = stats.bootstrap_diff([1.5, 2.5, 0.5], [1.0, 2.0, 0.0], paired=True, n_boot=200)
    assert (p["lo"], p["hi"]) == (pytest.approx(0.5), pytest.approx(0.5))
    with pytest.raises(ValueError):
        stats.bootstrap_diff([1, 2], [1], paired=True)


def test_bootstrap_two_point_paired_distribution():
    # paired differences {0, 1}, n = 2: the resampled mean is 0 (p 1/4), 0.5 (1/2) or 1 (1/4), so the
    # 2.5% and 97.5% percentiles are 0 and 1, and the mean of the draws is 0.5
    b = stats.bootstrap_diff([0.0, 1.0], [0.0, 0.0], paired=True, n_boot=4000, seed=1)
    assert b["diff"] == 0.5 and b["lo"] == 0.0 and b["hi"] == 1.0
    assert stats.bootstrap_diff([0.0, 1.0], [0.0, 0.0], paired=True, seed=3) == \
        stats.bootstrap_diff([0.0, 1.0], [0.0, 0.0], paired=True, seed=3)  # deterministic in the seed


def test_bootstrap_matches_scipy_percentile():
    sp = pytest.importorskip("scipy.stats")
    import numpy as np

    a = [0.61, 0.72, 0.55, 0.80, 0.66, 0.70, 0.59, 0.74]
    b = [0.50, 0.62, 0.48, 0.57, 0.66, 0.52, 0.45, 0.60]
    ours = stats.bootstrap_diff(a, b, n_boot=20000, seed=0)
    ref = sp.bootstrap((np.array(a), np.array(b)), lambda x, y, axis=-1: x.mean(axis) - y.mean(axis),
                       method="percentile", n_resamples=20000, random_state=0, vectorized=True)
    assert ours["lo"] == pytest.approx(ref.confidence_interval.low, abs=0.01)
    assert ours["hi"] == pytest.approx(ref.confidence_interval.high, abs=0.01)


@pytest.mark.parametrize("a,b", [
    ([1.2, 3.4, 2.2, 5.1], [0.3, 0.9, 1.1]),            # exact, U = 12 of 12: the most extreme ordering
    ([1.0, 4.0, 6.0, 7.5, 9.0], [2.0, 3.0, 5.0, 8.0, 10.0, 11.0]),
    ([0.1, 0.5, 0.5, 0.9], [0.5, 0.7, 0.2, 0.2, 1.0]),  # ties: asymptotic with tie and continuity corrections
    ([3.0, 3.0, 3.0], [3.0, 3.0]),
])
def test_mann_whitney_matches_scipy(a, b):
    sp = pytest.importorskip("scipy.stats")
    ours = stats.mann_whitney(a, b)
    ref = sp.mannwhitneyu(a, b, alternative="two-sided", method="auto")
    assert ours["u"] == pytest.approx(ref.statistic)
    if ours["method"] == "asymptotic" and len(set(a + b)) == 1:
        assert ours["p"] == 1.0
    else:
        assert ours["p"] == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-12)


def test_mann_whitney_exact_hand_computed():
    # 3 vs 2, all of a above b: U = 6 = n1 n2; 1 of C(5, 2) = 10 orderings is this extreme on each side
    r = stats.mann_whitney([5, 6, 7], [1, 2])
    assert r["u"] == 6 and r["method"] == "exact" and r["p"] == pytest.approx(0.2)


def test_verdicts():
    v = stats.verdict
    assert v(0.1, 0.5, "better", 0.05) == "supported"
    assert v(-0.2, 0.03, "better", 0.05) == "not supported"   # any effect is below the margin
    assert v(-0.2, 0.3, "better", 0.05) == "inconclusive at this size"
    assert v(0.0, 0.0, "better", 0.0) == "inconclusive at this size"  # nothing seen, margin 0: no verdict
    assert v(-1.5, 2.0, "noninferior", 1.0) == "inconclusive at this size"
    assert v(-0.5, 2.0, "noninferior", 1.0) == "supported"
    assert v(-3.0, -1.5, "noninferior", 1.0) == "not supported"
    assert v(-0.02, 0.04, "equivalent", 0.05) == "supported"
    assert v(0.06, 0.2, "equivalent", 0.05) == "not supported"
    assert v(-0.02, 0.2, "equivalent", 0.05) == "inconclusive at this size"
    assert v(None, None, "better", 0.0) == "inconclusive at this size"
    with pytest.raises(ValueError):
        v(0.0, 1.0, "worse", 0.0)
    assert stats.combine(["supported", "supported"]) == "supported"
    assert stats.combine(["supported", "inconclusive at this size"]) == "inconclusive at this size"
    assert stats.combine(["supported", "not supported", "inconclusive at this size"]) == "not supported"
