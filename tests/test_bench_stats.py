"""bench/stats.py against scipy and hand-computed values: t quantiles and intervals (paired, one-sample, Welch),
the exact sign-flip test, the bootstrap, Mann-Whitney U, verdicts, and the seeds that would decide a comparison."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as sp

from qerl_cli.bench import stats


def test_t_crit_matches_scipy():
    for df in [*range(1, 41), 50, 80, 120, 500]:
        assert stats.t_crit95(df) == pytest.approx(sp.t.ppf(0.975, df), abs=1e-4), df
    # non-integer df (Welch's): the root of the t tail through the incomplete beta function
    for df in (1.01, 1.5, 2.3, 3.65, 7.2, 12.5, 29.9):
        assert stats.t_crit95(df) == pytest.approx(sp.t.ppf(0.975, df), rel=1e-9), df
    assert stats.t_crit95(33.3) == pytest.approx(sp.t.ppf(0.975, 33.3), abs=1e-4)
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
    x = [0.42, 0.55, 0.61, 0.38, 0.7, 0.52]
    lo, hi = sp.t.interval(0.95, len(x) - 1, loc=sum(x) / len(x), scale=sp.sem(x))
    ci = stats.mean_ci(x)
    assert ci["lo"] == pytest.approx(lo, abs=1e-6) and ci["hi"] == pytest.approx(hi, abs=1e-6)


def test_paired_t_and_welch_match_scipy():
    a = [0.61, 0.72, 0.55, 0.80, 0.66, 0.70, 0.59, 0.74]
    b = [0.50, 0.62, 0.48, 0.57, 0.66, 0.52, 0.45, 0.60]
    c = stats.compare(a, b, paired=True, kind="better", margin=0.05)
    ref = sp.ttest_rel(a, b).confidence_interval(0.95)
    assert c["method"] == "paired t" and c["n"] == 8 and c["paired"]
    assert (c["lo"], c["hi"]) == (pytest.approx(ref.low, abs=1e-6), pytest.approx(ref.high, abs=1e-6))
    one = stats.compare([x - y for x, y in zip(a, b, strict=True)], None, paired=True, kind="better", margin=0.05)
    assert one["method"] == "one-sample t" and (one["lo"], one["hi"]) == (c["lo"], c["hi"])
    # Welch: unequal sizes and spreads, non-integer df
    x, y = [1.0, 2.0, 3.0, 4.5], [0.2, 0.1, 0.9]
    w = stats.welch_ci(x, y)
    ref = sp.ttest_ind(x, y, equal_var=False)
    assert w["df"] == pytest.approx(ref.df)
    ci = ref.confidence_interval(0.95)
    assert (w["lo"], w["hi"]) == (pytest.approx(ci.low, abs=1e-9), pytest.approx(ci.high, abs=1e-9))
    u = stats.compare(x, y, paired=False, kind="better", margin=0.5)
    assert u["method"] == "Welch t" and u["n"] is None and u["lo"] == w["lo"]
    assert u["p_mann_whitney"] == pytest.approx(sp.mannwhitneyu(x, y, alternative="two-sided").pvalue)
    assert u["p_sign_flip"] is None and u["flip_agrees"] is None


def test_sign_flip_hand_computed():
    # d = 1, 2, 3: the 8 sign patterns sum to +-6, +-4, +-2, 0, 0; the observed 6 is the most extreme of each side
    assert stats.sign_flip_p([1, 2, 3]) == pytest.approx(2 / 8)
    assert stats.sign_flip_p([1, 2, 3], alternative="greater") == pytest.approx(1 / 8)
    assert stats.sign_flip_p([1, 2, 3], alternative="less") == pytest.approx(1.0)
    # centre 2: x = -1, 0, 1 (sum 0): every pattern is at least as extreme two-sided
    assert stats.sign_flip_p([1, 2, 3], center=2.0) == 1.0
    # 5 pairs all one way: the smallest two-sided p there is, 2/2^5 = 0.0625 (never below 0.05)
    assert stats.sign_flip_p([0.3, 0.2, 0.5, 0.1, 0.4]) == pytest.approx(0.0625)
    assert stats.sign_flip_p([]) is None
    with pytest.raises(ValueError):
        stats.sign_flip_p([1.0], alternative="bigger")


@pytest.mark.parametrize("d", [
    [0.3, -0.1, 0.5, 0.2, 0.4],
    [0.05, -0.02, 0.11, 0.04, -0.06, 0.09, 0.01, 0.07],
    [1e-3, 2e-3, -5e-4, 3e-3, 1.5e-3, 2.5e-3, -1e-3, 4e-3, 2e-3, 5e-4, 1e-3, 3e-3],
])
@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
def test_sign_flip_matches_scipy_exact(d, alternative):
    ref = sp.permutation_test((np.array(d),), np.sum, permutation_type="samples", n_resamples=np.inf,
                              alternative=alternative).pvalue
    assert stats.sign_flip_p(d, alternative=alternative) == pytest.approx(ref, abs=1e-12)
    shifted = [v - 0.01 for v in d]  # a shifted centre is the same test on d - centre
    ref_c = sp.permutation_test((np.array(shifted),), np.sum, permutation_type="samples", n_resamples=np.inf,
                                alternative=alternative).pvalue
    assert stats.sign_flip_p(d, center=0.01, alternative=alternative) == pytest.approx(ref_c, abs=1e-12)


def test_sign_flip_monte_carlo_beyond_the_exact_limit(monkeypatch):
    # the exact limit lowered to 10 so that scipy's exact answer for 12 values is cheap to get
    monkeypatch.setattr(stats, "EXACT_FLIP_MAX_N", 10)
    monkeypatch.setattr(stats, "FLIP_DRAWS", 50_000)
    rng = np.random.default_rng(3)
    d = list(rng.normal(0.3, 1.0, 12))
    ref = sp.permutation_test((np.array(d),), np.sum, permutation_type="samples", n_resamples=np.inf,
                              alternative="greater").pvalue
    ours = stats.sign_flip_p(d, alternative="greater")
    # 50,000 draws: the Monte Carlo standard error at p ~ 0.2 is ~1.8e-3
    assert ours == pytest.approx(ref, abs=8e-3) and ours == stats.sign_flip_p(d, alternative="greater")
    assert ours != stats.sign_flip_p(d, alternative="greater", seed=1)  # a draw, seeded


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
    a = [0.61, 0.72, 0.55, 0.80, 0.66, 0.70, 0.59, 0.74]
    b = [0.50, 0.62, 0.48, 0.57, 0.66, 0.52, 0.45, 0.60]
    ours = stats.bootstrap_diff(a, b, n_boot=20000, seed=0)
    ref = sp.bootstrap((np.array(a), np.array(b)), lambda x, y, axis=-1: x.mean(axis) - y.mean(axis),
                       method="percentile", n_resamples=20000, random_state=0, vectorized=True)
    assert ours["lo"] == pytest.approx(ref.confidence_interval.low, abs=0.01)
    assert ours["hi"] == pytest.approx(ref.confidence_interval.high, abs=0.01)


def test_bootstrap_only_from_the_threshold(monkeypatch):
    monkeypatch.setattr(stats, "FLIP_DRAWS", 2000)  # 30 values: the sign-flip p is a Monte Carlo (not tested here)
    rng = np.random.default_rng(0)
    d = list(rng.normal(0.1, 0.05, stats.BOOTSTRAP_MIN_N))
    big = stats.compare(d, None, paired=True, kind="better", margin=0.05, n_boot=2000)
    small = stats.compare(d[:-1], None, paired=True, kind="better", margin=0.05)
    assert big["method"] == "bootstrap" and small["method"] == "one-sample t"
    # with 30 normal values the percentile bootstrap and the t interval nearly agree
    t = stats.mean_ci(d)
    assert big["lo"] == pytest.approx(t["lo"], abs=0.008) and big["hi"] == pytest.approx(t["hi"], abs=0.008)


@pytest.mark.parametrize("a,b", [
    ([1.2, 3.4, 2.2, 5.1], [0.3, 0.9, 1.1]),            # exact, U = 12 of 12: the most extreme ordering
    ([1.0, 4.0, 6.0, 7.5, 9.0], [2.0, 3.0, 5.0, 8.0, 10.0, 11.0]),
    ([0.1, 0.5, 0.5, 0.9], [0.5, 0.7, 0.2, 0.2, 1.0]),  # ties: asymptotic with tie and continuity corrections
    ([3.0, 3.0, 3.0], [3.0, 3.0]),
])
def test_mann_whitney_matches_scipy(a, b):
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


def test_decision_gap_and_seeds_needed():
    g = stats.decision_gap
    assert g(0.03, "better", 0.05) == pytest.approx(0.03)      # lo > 0 needs h < 0.03; hi < 0.05 needs h < 0.02
    assert g(0.01, "better", 0.05) == pytest.approx(0.04)      # the "not supported" side is nearer to reach
    assert g(0.0, "better", 0.0) == 0.0                        # margin 0, nothing seen: no interval decides it
    assert g(-0.02, "noninferior", 0.05) == pytest.approx(0.03)
    assert g(0.04, "equivalent", 0.05) == pytest.approx(0.01) and g(-0.08, "equivalent", 0.05) == pytest.approx(0.03)
    assert g(None, "better", 0.05) is None
    # sd 1, half-width 1: t(5)/sqrt(6) = 1.0497 > 1, t(6)/sqrt(7) = 0.9249 < 1 -> 7
    assert stats.seeds_needed(1.0, 1.0) == 7
    for sd, h in ((0.05, 0.025), (0.12, 0.03), (2.0, 0.5)):
        n = stats.seeds_needed(sd, h)
        assert sp.t.ppf(0.975, n - 1) * sd / math.sqrt(n) < h <= sp.t.ppf(0.975, n - 2) * sd / math.sqrt(n - 1)
    assert stats.seeds_needed(0.0, 0.01) == 2 and stats.seeds_needed(1.0, 0.0) is None
    assert stats.seeds_needed(None, 0.1) is None and stats.seeds_needed(1.0, 1e-9) is None  # beyond MAX_SEEDS


def test_compare_flip_agreement_needs_six_pairs():
    """The t interval may decide with 5 pairs; the exact sign-flip test at the same boundary cannot (2^-5 =
    0.031 > 0.025 one-sided), with 6 it can (2^-6 = 0.016)."""
    five = stats.compare([0.31, 0.28, 0.33, 0.3, 0.29], [0.0] * 5, paired=True, kind="better", margin=0.05)
    assert five["verdict"] == "supported" and five["p_flip_verdict"] == pytest.approx(1 / 32)
    assert five["flip_agrees"] is False
    six = stats.compare([0.31, 0.28, 0.33, 0.3, 0.29, 0.32], [0.0] * 6, paired=True, kind="better", margin=0.05)
    assert six["verdict"] == "supported" and six["flip_agrees"] is True
    # not supported (every difference below the margin): the test is "centre < margin"
    ns = stats.compare([0.01, 0.0, 0.02, -0.01, 0.01, 0.0, 0.01], None, paired=True, kind="better", margin=0.05)
    assert ns["verdict"] == "not supported" and stats.flip_tests("better", 0.05, ns["verdict"], ns["lo"], ns["hi"]) \
        == [(0.05, "less")]
    assert ns["flip_agrees"] is True and ns["p_flip_verdict"] == pytest.approx(1 / 128)
    assert ns["seeds_to_decide"] <= 7 and ns["seeds_for_margin"] == stats.seeds_needed(ns["sd_diff"], 0.025)
    # equivalence rests on two one-sided tests
    assert stats.flip_tests("equivalent", 0.05, "supported", -0.01, 0.02) == [(-0.05, "greater"), (0.05, "less")]
    assert stats.flip_tests("equivalent", 0.05, "not supported", 0.06, 0.1) == [(0.05, "greater")]
    assert stats.flip_tests("noninferior", 1.0, "inconclusive at this size", -2.0, 1.0) == []
    with pytest.raises(ValueError):
        stats.compare([1.0, 2.0], [1.0], paired=True, kind="better", margin=0.0)
