"""Eval statistics: pass@k, means with 95% intervals, and per-group breakdowns.

A 500-problem benchmark has a 95% interval of about +-4 points at 50% accuracy, so every accuracy
qerl reports carries its interval; comparing two runs without one invites reading noise as progress.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

Z95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. 2021 for one problem: n samples, c correct.

    1 - C(n-c, k) / C(n, k), computed as the product prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials,
    no cancellation.
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(samples: Sequence[Sequence[bool | float]], k: int) -> float:
    """Mean pass@k over problems, each given as its list of per-sample correctness."""
    if not samples:
        raise ValueError("mean_pass_at_k needs at least one problem")
    scores = [pass_at_k(len(s), sum(1 for x in s if x), k) for s in samples]
    return sum(scores) / len(scores)


@dataclass(frozen=True)
class MeanCI:
    """A mean with its 95% interval. method: "wilson" (binary values) or "normal" (t-free normal approx)."""

    mean: float
    low: float
    high: float
    n: int
    method: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion: unlike the normal one it stays inside [0, 1]
    and keeps sensible width at 0% or 100% accuracy."""
    if n <= 0:
        raise ValueError("wilson_interval needs n >= 1")
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_and_ci95(values: Iterable[float | bool], binary: bool | None = None) -> MeanCI:
    """Mean and 95% interval.

    Binary values (all 0/1; or binary=True) get the Wilson score interval, the right one for an
    accuracy. Anything else gets the normal approximation mean +- 1.96 * s / sqrt(n) with the sample
    standard deviation (n-1); with n = 1 the interval is the point itself.
    """
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        raise ValueError("mean_and_ci95 needs at least one value")
    if any(math.isnan(v) for v in vals):
        raise ValueError("mean_and_ci95 got NaN")
    is_binary = all(v in (0.0, 1.0) for v in vals) if binary is None else binary
    mean = sum(vals) / n
    if is_binary:
        if not all(v in (0.0, 1.0) for v in vals):
            raise ValueError("binary=True but values other than 0 and 1 were given")
        lo, hi = wilson_interval(int(sum(vals)), n)
        return MeanCI(mean, lo, hi, n, "wilson")
    if n == 1:
        return MeanCI(mean, mean, mean, 1, "normal")
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    half = Z95 * math.sqrt(var / n)
    return MeanCI(mean, mean - half, mean + half, n, "normal")


def group_by(
    records: Iterable[Mapping[str, Any]], key: str | Callable[[Mapping[str, Any]], Hashable]
) -> dict[Hashable, list[Mapping[str, Any]]]:
    """Records grouped by a field name or a key function, groups in sorted key order."""
    groups: dict[Hashable, list[Mapping[str, Any]]] = defaultdict(list)
    for r in records:
        groups[key(r) if callable(key) else r[key]].append(r)
    return {k: groups[k] for k in sorted(groups, key=lambda x: (str(type(x)), x))}


def breakdown(
    records: Iterable[Mapping[str, Any]],
    key: str | Callable[[Mapping[str, Any]], Hashable],
    value: str = "correct",
) -> dict[Hashable, MeanCI]:
    """Mean and 95% interval of `value` per group, e.g. MATH-500 accuracy per subject or per level."""
    return {k: mean_and_ci95(float(r[value]) for r in rs) for k, rs in group_by(records, key).items()}


def summarize(
    records: Sequence[Mapping[str, Any]], keys: Sequence[str] = (), value: str = "correct"
) -> dict[str, Any]:
    """Overall mean/CI plus one breakdown per key, as plain dicts ready for a JSON report."""
    out: dict[str, Any] = {"overall": mean_and_ci95(float(r[value]) for r in records).as_dict()}
    for k in keys:
        out[f"by_{k}"] = {str(g): ci.as_dict() for g, ci in breakdown(records, k, value).items()}
    return out
