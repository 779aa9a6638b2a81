"""Statistics over seeds for the evidence study: 95% intervals, bootstrap differences, a rank test, verdicts.

Seeds are few (4-8), so a cell's mean gets a Student-t interval (a bootstrap of 4 values is far too narrow).
A compared pair gets a percentile bootstrap interval of the difference of means: paired by seed when both
cells ran the same seeds (they start from the same adapter and draw the same rollout seeds, so pairing removes
the seed-to-seed spread they share), independent resampling otherwise. The Mann-Whitney U test is reported
beside it as a distribution-free check that does not lean on the bootstrap's small-sample behaviour.

No scipy at run time (it is not a qerl dependency): the t quantile is a table plus a Cornish-Fisher tail, and
the U test's exact null distribution is counted directly; tests check both against scipy.
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


def t_crit95(df: int) -> float:
    """t_{0.975}(df): exact table to df = 30, then the Cornish-Fisher expansion (error < 1e-4)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def _clean(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_ci(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample sd and the 95% Student-t interval of the mean (None/NaN values dropped; n = 1: no interval)."""
    x = _clean(values)
    n = len(x)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "lo": None, "hi": None}
    m = sum(x) / n
    if n == 1:
        return {"n": 1, "mean": m, "sd": None, "lo": None, "hi": None}
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    h = t_crit95(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": m, "sd": sd, "lo": m - h, "hi": m + h}


def _percentile(sorted_x: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 1]."""
    pos = q * (len(sorted_x) - 1)
    i = int(math.floor(pos))
    j = min(i + 1, len(sorted_x) - 1)
    return sorted_x[i] + (sorted_x[j] - sorted_x[i]) * (pos - i)


def bootstrap_diff(a: Sequence[float], b: Sequence[float], *, paired: bool = False, n_boot: int = 10000,
                   seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """Percentile bootstrap interval of mean(a) - mean(b).

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
    a, b = _clean(a), _clean(b)
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


def combine(verdicts: Sequence[str]) -> str:
    """A claim made of several parts: supported only if every part is, not supported if any part is not."""
    if not verdicts:
        return VERDICTS[2]
    if all(v == VERDICTS[0] for v in verdicts):
        return VERDICTS[0]
    return VERDICTS[1] if any(v == VERDICTS[1] for v in verdicts) else VERDICTS[2]
