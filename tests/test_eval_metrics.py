"""pass@k, intervals and breakdowns against hand-computed values."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from qerl_cli.eval.metrics import (
    breakdown,
    mean_and_ci95,
    mean_pass_at_k,
    pass_at_k,
    summarize,
    wilson_interval,
)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c/n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # n - c < k: every draw of 4 holds a correct one
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (10, 1, 5, 0.5),  # 1 - C(9,5)/C(10,5) = 1 - 126/252
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_enumeration_and_stays_stable_for_large_n() -> None:
    # Brute force: the fraction of k-subsets of n samples (c of them correct) that hold a correct one.
    n, c = 8, 3
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    # C(1000, 500) overflows a float; the product form does not need it.
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)
    assert pass_at_k(1000, 10, 1) == pytest.approx(0.01)
    assert 0.0 < pass_at_k(2000, 1, 1) < 1e-3


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (5, 6, 1), (5, 2, 0), (5, 2, 6), (5, -1, 1)])
def test_pass_at_k_rejects_bad_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_pass_at_k() -> None:
    # Problem A: 2 of 5 right; problem B: 0 of 5 -> pass@1 = (0.4 + 0) / 2, pass@2 = (0.7 + 0) / 2.
    samples = [[1, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert mean_pass_at_k(samples, 1) == pytest.approx(0.2)
    assert mean_pass_at_k(samples, 2) == pytest.approx(0.35)


def test_wilson_interval_by_hand() -> None:
    # 8 of 10 at z = 1.96: centre (p + z^2/2n) / (1 + z^2/n), half-width z*sqrt(p(1-p)/n + z^2/4n^2) / (...)
    lo, hi = wilson_interval(8, 10)
    z = 1.959963984540054
    p, n = 0.8, 10
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (lo, hi) == pytest.approx((centre - half, centre + half))
    assert (lo, hi) == pytest.approx((0.4901625, 0.9433178), abs=1e-6)  # standard table value
    lo0, hi0 = wilson_interval(0, 20)
    assert lo0 == 0.0 and hi0 == pytest.approx(0.1611252, abs=1e-6)  # non-degenerate at 0%


def test_mean_and_ci95_picks_the_interval() -> None:
    acc = mean_and_ci95([1, 1, 1, 1, 1, 1, 1, 1, 0, 0])
    assert (acc.mean, acc.n, acc.method) == (0.8, 10, "wilson")
    assert (acc.low, acc.high) == pytest.approx(wilson_interval(8, 10))
    cont = mean_and_ci95([1.0, 2.0, 3.0, 4.0])
    # mean 2.5, sample sd sqrt(5/3) = 1.2909944, half-width 1.959964 * 1.2909944 / 2 = 1.2651513
    assert cont.method == "normal" and cont.mean == 2.5
    assert (cont.low, cont.high) == pytest.approx((2.5 - 1.2651513, 2.5 + 1.2651513), abs=1e-6)
    one = mean_and_ci95([0.3])
    assert (one.low, one.mean, one.high) == (0.3, 0.3, 0.3)
    with pytest.raises(ValueError):
        mean_and_ci95([])
    with pytest.raises(ValueError):
        mean_and_ci95([0.5, 1.0], binary=True)


def test_breakdown_and_summary() -> None:
    records = [
        {"subject": "Algebra", "level": 1, "correct": True},
        {"subject": "Algebra", "level": 2, "correct": False},
        {"subject": "Geometry", "level": 1, "correct": True},
        {"subject": "Algebra", "level": 1, "correct": True},
    ]
    by_subject = breakdown(records, "subject")
    assert list(by_subject) == ["Algebra", "Geometry"]
    assert by_subject["Algebra"].mean == pytest.approx(2 / 3) and by_subject["Algebra"].n == 3
    assert by_subject["Geometry"].method == "wilson"
    by_level = breakdown(records, lambda r: r["level"])
    assert {k: v.mean for k, v in by_level.items()} == {1: 1.0, 2: 0.0}
    summary = summarize(records, keys=("subject", "level"))
    assert summary["overall"]["mean"] == 0.75 and summary["overall"]["n"] == 4
    assert summary["by_level"]["2"]["mean"] == 0.0
