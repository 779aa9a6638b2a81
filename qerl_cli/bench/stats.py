"""Statistics over seeds for the evidence study: intervals and tests that fit a handful of seeds, verdicts, and
how many seeds would settle a comparison.

Seeds are few (3-16), so (docs/evidence.md, "How a claim is tested"):

- a cell's mean gets a Student-t interval;
- a compared pair run on the same seeds (same adapter init, prompt order and rollout seeds) is a set of paired
  differences d_i: their mean gets the paired Student-t interval, and beside it the exact sign-flip
  (permutation) p-value, which assumes only that d is symmetric about its centre under the null: all 2^n sign
  patterns are counted for n <= ``EXACT_FLIP_MAX_N``, a seeded Monte Carlo of them beyond. With n pairs the
  smallest two-sided p it can give is 2 / 2^n (0.0625 at n = 5), so it also says when n is too small for any
  distribution-free decision;
- the percentile bootstrap is used only from ``BOOTSTRAP_MIN_N`` pairs on (below that it is too narrow: a
  bootstrap of 4 values cannot see the tails it needs);
- cells without common seeds are compared with Welch's t interval and the Mann-Whitney U test;
- every comparison carries the seeds that would decide it: the smallest n whose 95% t interval, at the
  observed spread, is narrower than the margin (``seeds_for_margin``), and the smallest n at which an interval
  around the observed difference would clear the nearest decision boundary (``seeds_to_decide``).

No scipy at run time (it is not a qerl dependency): the t quantile is a table plus a Cornish-Fisher tail, the U
test's exact null distribution and the sign-flip distribution are counted directly; tests check all of them
against scipy.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

# two-sided 95% Student-t critical values t_{0.975, df}, df = 1..30
_T975 = (12.7062047, 4.30265273, 3.18244631, 2.77644511, 2.57058184, 2.44691185, 2.36462425, 2.30600414,
         2.26215716, 2.22813885, 2.20098516, 2.17881283, 2.16036866, 2.14478669, 2.13144955, 2.11990530,
         2.10981558, 2.10092204, 2.09302405, 2.08596345, 2.07961384, 2.07387307, 2.06865761, 2.06389856,
         2.05953855, 2.05552944, 2.05183052, 2.04840714, 2.04522964, 2.04227246)
_Z975 = 1.959963984540054

VERDICTS = ("supported", "not supported", "inconclusive at this size")
BOOTSTRAP_MIN_N = 30  # pairs from which the percentile bootstrap replaces the paired t interval
EXACT_FLIP_MAX_N = 20  # 2^20 sign patterns; beyond, a seeded Monte Carlo of FLIP_DRAWS patterns
FLIP_DRAWS = 200_000
MAX_SEEDS = 100_000  # seeds_needed gives up beyond this (reported as None: "no number of seeds")


def t_crit95(df: float) -> float:
    """t_{0.975}(df): the exact table to df = 30, the Cornish-Fisher expansion beyond (error < 1e-4), and for a
    non-integer df below 30 (Welch's) the root of the t distribution's tail, 0.025 = I_x(df/2, 1/2) / 2 with
    x = df / (df + t^2), found by bisection."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975) and df == int(df):
        return _T975[int(df) - 1]
    if df <= len(_T975):
        lo, hi = _Z975, _T975[0] + 1.0  # t_{0.975} falls from 12.7 (df 1) towards z as df grows
        for _ in range(100):
            mid = (lo + hi) / 2
            if _betainc(df / 2, 0.5, df / (df + mid * mid)) / 2 > 0.025:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2
    z = _Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Lentz's method)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point: use the symmetry
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f / a


def clean(values: Sequence[float | None]) -> list[float]:
    """The finite values, as floats (None and NaN dropped)."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_ci(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample sd and the 95% Student-t interval of the mean (None/NaN values dropped; n = 1: no interval)."""
    x = clean(values)
    n = len(x)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "lo": None, "hi": None}
    m = sum(x) / n
    if n == 1:
        return {"n": 1, "mean": m, "sd": None, "lo": None, "hi": None}
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    h = t_crit95(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": m, "sd": sd, "lo": m - h, "hi": m + h}


def welch_ci(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """mean(a) - mean(b) with Welch's 95% t interval (unequal variances, Welch-Satterthwaite df)."""
    a, b = clean(a), clean(b)
    if len(a) < 2 or len(b) < 2:
        diff = sum(a) / len(a) - sum(b) / len(b) if a and b else None
        return {"diff": diff, "lo": None, "hi": None, "df": None}
    sa, sb = mean_ci(a), mean_ci(b)
    va, vb = sa["sd"] ** 2 / len(a), sb["sd"] ** 2 / len(b)
    diff = sa["mean"] - sb["mean"]
    se = math.sqrt(va + vb)
    if se == 0:
        return {"diff": diff, "lo": diff, "hi": diff, "df": float(len(a) + len(b) - 2)}
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    h = t_crit95(max(1.0, df)) * se
    return {"diff": diff, "lo": diff - h, "hi": diff + h, "df": df}


def _percentile(sorted_x: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 1]."""
    pos = q * (len(sorted_x) - 1)
    i = int(math.floor(pos))
    j = min(i + 1, len(sorted_x) - 1)
    return sorted_x[i] + (sorted_x[j] - sorted_x[i]) * (pos - i)


def bootstrap_diff(a: Sequence[float], b: Sequence[float], *, paired: bool = False, n_boot: int = 10000,
                   seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """Percentile bootstrap interval of mean(a) - mean(b) (for n >= BOOTSTRAP_MIN_N; see the module docstring).

    paired=True resamples indices shared by a and b (equal lengths: seed i of a goes with seed i of b);
    otherwise each group is resampled on its own. Deterministic in ``seed``.
    """
    a, b = [float(v) for v in a], [float(v) for v in b]
    if not a or not b:
        return {"diff": None, "lo": None, "hi": None, "paired": paired, "n_boot": 0}
    if paired and len(a) != len(b):
        raise ValueError(f"a paired bootstrap needs equal lengths, got {len(a)} and {len(b)}")
    rng = random.Random(seed)
    diff = sum(a) / len(a) - sum(b) / len(b)
    stats: list[float] = []
    if paired:
        d = [x - y for x, y in zip(a, b, strict=True)]
        n = len(d)
        for _ in range(n_boot):
            stats.append(sum(d[rng.randrange(n)] for _ in range(n)) / n)
    else:
        na, nb = len(a), len(b)
        for _ in range(n_boot):
            stats.append(sum(a[rng.randrange(na)] for _ in range(na)) / na
                         - sum(b[rng.randrange(nb)] for _ in range(nb)) / nb)
    stats.sort()
    alpha = (1.0 - level) / 2
    return {"diff": diff, "lo": _percentile(stats, alpha), "hi": _percentile(stats, 1.0 - alpha),
            "paired": paired, "n_boot": n_boot}


def sign_flip_p(d: Sequence[float], center: float = 0.0, alternative: str = "two-sided", *,
                seed: int = 0) -> float | None:
    """Exact sign-flip (permutation) p-value for the centre of paired differences ``d``.

    Under H0 the differences are symmetric about ``center``, so each x_i = d_i - center keeps or flips its sign
    with probability 1/2 independently; the statistic is sum(x). "two-sided": P(|S| >= |S_obs|); "greater"
    (H1: centre above ``center``): P(S >= S_obs); "less": P(S <= S_obs). Exact over all 2^n patterns for
    n <= EXACT_FLIP_MAX_N (the observed pattern counts, so p >= 2^-n); beyond that a seeded Monte Carlo with
    the observed pattern added ((k + 1) / (N + 1)). None for an empty sample.
    """
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"unknown alternative {alternative!r}: use two-sided, greater or less")
    x = [v - center for v in clean(d)]
    n = len(x)
    if n == 0:
        return None
    obs = sum(x)
    tol = 1e-9 * max(1.0, sum(abs(v) for v in x))  # equal sums computed in another order count as equal

    def extreme(s: float) -> bool:
        if alternative == "greater":
            return s >= obs - tol
        if alternative == "less":
            return s <= obs + tol
        return abs(s) >= abs(obs) - tol

    if n <= EXACT_FLIP_MAX_N:
        sums = [0.0]
        for v in x:
            sums = [s + v for s in sums] + [s - v for s in sums]
        return sum(1 for s in sums if extreme(s)) / len(sums)
    rng = random.Random(seed)
    hits = sum(1 for _ in range(FLIP_DRAWS) if extreme(sum(v if rng.random() < 0.5 else -v for v in x)))
    return (hits + 1) / (FLIP_DRAWS + 1)


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _u_null_counts(n1: int, n2: int) -> list[int]:
    """Number of orderings giving each U = 0..n1*n2 under H0 (no ties): c(m, n, u) = c(m-1, n, u-n) + c(m, n-1, u)."""
    # table[n][u] for the current m, built up from m = 0
    table = [[1] + [0] * (n1 * n2) for _ in range(n2 + 1)]
    for m in range(1, n1 + 1):
        new = [[0] * (n1 * n2 + 1) for _ in range(n2 + 1)]
        new[0][0] = 1
        for n in range(1, n2 + 1):
            for u in range(m * n + 1):
                new[n][u] = (table[n][u - n] if u >= n else 0) + new[n - 1][u]
        table = new
    return table[n2]


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Two-sided Mann-Whitney U test of a vs b: U of a, and the p-value.

    Exact (the counted null distribution) when there are no ties and both groups have <= 20 values, as
    scipy's method="auto" does; otherwise the normal approximation with the tie correction and a 0.5
    continuity correction.
    """
    a, b = clean(a), clean(b)
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return {"u": None, "p": None, "method": None}
    ranks = _ranks(a + b)
    u1 = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    ties = len(set(a + b)) < n1 + n2
    if not ties and max(n1, n2) <= 20:
        counts = _u_null_counts(n1, n2)
        total = sum(counts)
        u_big = max(u1, n1 * n2 - u1)
        k = int(round(u_big))
        p = min(1.0, 2.0 * sum(counts[k:]) / total)
        return {"u": u1, "p": p, "method": "exact"}
    n = n1 + n2
    tie_sizes: dict[float, int] = {}
    for v in a + b:
        tie_sizes[v] = tie_sizes.get(v, 0) + 1
    tie_term = sum(t**3 - t for t in tie_sizes.values())
    var = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0:  # every value equal: no evidence either way
        return {"u": u1, "p": 1.0, "method": "asymptotic"}
    mu = n1 * n2 / 2
    z = (abs(u1 - mu) - 0.5) / math.sqrt(var)
    p = min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))
    return {"u": u1, "p": p, "method": "asymptotic"}


def verdict(lo: float | None, hi: float | None, kind: str, margin: float) -> str:
    """One verdict from the 95% interval [lo, hi] of a difference oriented so that > 0 favours the claim.

    kind "better": supported if lo > 0; not supported if hi < margin (any effect is smaller than the least
    that matters, or points the other way); otherwise inconclusive.
    kind "noninferior" (at least as good, within margin): supported if lo > -margin; not supported if
    hi < -margin; otherwise inconclusive.
    kind "equivalent" (match within +-margin): supported if -margin < lo and hi < margin; not supported if
    lo > margin or hi < -margin; otherwise inconclusive.
    """
    if lo is None or hi is None:
        return VERDICTS[2]
    if kind == "better":
        return VERDICTS[0] if lo > 0 else VERDICTS[1] if hi < margin else VERDICTS[2]
    if kind == "noninferior":
        return VERDICTS[0] if lo > -margin else VERDICTS[1] if hi < -margin else VERDICTS[2]
    if kind == "equivalent":
        if -margin < lo and hi < margin:
            return VERDICTS[0]
        return VERDICTS[1] if lo > margin or hi < -margin else VERDICTS[2]
    raise ValueError(f"unknown verdict kind {kind!r}: use better, noninferior or equivalent")


def decision_gap(diff: float | None, kind: str, margin: float) -> float | None:
    """How far the observed difference lies from the nearest boundary an interval around it could clear: an
    interval of half-width below this gap, centred on ``diff``, gives a conclusive verdict (module docstring).

    better: supported needs lo > 0 (gap diff), not supported hi < margin (gap margin - diff): the larger.
    noninferior: |diff + margin|. equivalent: |margin - |diff||. 0 (or None): no interval decides it.
    """
    if diff is None:
        return None
    if kind == "better":
        return max(diff, margin - diff, 0.0)
    if kind == "noninferior":
        return abs(diff + margin)
    if kind == "equivalent":
        return abs(margin - abs(diff))
    raise ValueError(f"unknown verdict kind {kind!r}: use better, noninferior or equivalent")


def seeds_needed(sd: float | None, half_width: float | None) -> int | None:
    """The smallest n >= 2 whose 95% t interval of a mean, t_{0.975}(n-1) * sd / sqrt(n), is below ``half_width``
    (1 when sd is 0 and the width positive; None when no n up to MAX_SEEDS does, or the inputs are missing)."""
    if sd is None or half_width is None or half_width <= 0 or not math.isfinite(sd):
        return None
    if sd == 0:
        return 2
    n = max(2, math.ceil((_Z975 * sd / half_width) ** 2))  # the normal bound: t is wider, so start here
    while n <= MAX_SEEDS:
        if t_crit95(n - 1) * sd / math.sqrt(n) < half_width:
            return n
        n += 1
    return None


def flip_tests(kind: str, margin: float, verdict_: str, lo: float | None, hi: float | None) -> list[tuple[float, str]]:
    """The one-sided sign-flip tests (centre, alternative) that the interval's verdict amounts to: the boundary
    it cleared and the side it cleared it on. Empty for an inconclusive verdict."""
    if verdict_ == VERDICTS[2] or lo is None or hi is None:
        return []
    sup = verdict_ == VERDICTS[0]
    if kind == "better":
        return [(0.0, "greater")] if sup else [(margin, "less")]
    if kind == "noninferior":
        return [(-margin, "greater")] if sup else [(-margin, "less")]
    if sup:
        return [(-margin, "greater"), (margin, "less")]
    return [(margin, "greater")] if lo > margin else [(-margin, "less")]


def compare(a: Sequence[float], b: Sequence[float] | None, *, paired: bool, kind: str, margin: float,
            n_boot: int = 10000) -> dict[str, Any]:
    """One oriented comparison (> 0 favours the claim): A vs B paired by seed (equal lengths, seed i with seed i),
    A vs B unpaired, or A vs 0 (``b`` None). The interval, the tests beside it, the verdict and the seeds that
    would decide it (module docstring says which interval when)."""
    a = [float(v) for v in a]
    if b is None:
        d: list[float] | None = a
    elif paired:
        if len(a) != len(b):
            raise ValueError(f"paired comparison needs equal lengths, got {len(a)} and {len(b)}")
        d = [x - float(y) for x, y in zip(a, b, strict=True)]
    else:
        d = None
    out: dict[str, Any] = {"paired": d is not None and b is not None, "n": len(d) if d is not None else None,
                           "p_sign_flip": None, "p_mann_whitney": None, "sd_diff": None}
    if d is not None:
        ci = mean_ci(d)
        out.update(diff=ci["mean"], sd_diff=ci["sd"])
        if len(d) >= BOOTSTRAP_MIN_N:
            bs = bootstrap_diff(d, [0.0] * len(d), paired=True, n_boot=n_boot)
            out.update(method="paired bootstrap" if b is not None else "bootstrap", lo=bs["lo"], hi=bs["hi"])
        else:
            out.update(method="paired t" if b is not None else "one-sample t", lo=ci["lo"], hi=ci["hi"])
        out["p_sign_flip"] = sign_flip_p(d)
        sd = ci["sd"]
    else:
        assert b is not None
        w = welch_ci(a, b)
        out.update(method="Welch t", diff=w["diff"], lo=w["lo"], hi=w["hi"])
        out["p_mann_whitney"] = mann_whitney(a, b)["p"]
        sa, sb = mean_ci(a)["sd"], mean_ci(list(b))["sd"]
        # the spread of a paired difference if the two cells were independent: sqrt(2) x the pooled sd
        sd = math.sqrt(sa**2 + sb**2) if sa is not None and sb is not None else None
    v = verdict(out["lo"], out["hi"], kind, margin)
    tests = flip_tests(kind, margin, v, out["lo"], out["hi"]) if d is not None else []
    flip = max((sign_flip_p(d, c, alt) or 1.0 for c, alt in tests), default=None) if d is not None else None
    gap = decision_gap(out["diff"], kind, margin)
    out.update(verdict=v, p_flip_verdict=flip,
               # the 2.5% one-sided level of a 95% two-sided interval
               flip_agrees=None if flip is None else flip < 0.025,
               seeds_for_margin=seeds_needed(sd, margin / 2) if margin > 0 else None,
               seeds_to_decide=seeds_needed(sd, gap))
    return out


def combine(verdicts: Sequence[str]) -> str:
    """A claim made of several parts: supported only if every part is, not supported if any part is not."""
    if not verdicts:
        return VERDICTS[2]
    if all(v == VERDICTS[0] for v in verdicts):
        return VERDICTS[0]
    return VERDICTS[1] if any(v == VERDICTS[1] for v in verdicts) else VERDICTS[2]
