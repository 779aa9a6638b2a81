"""Numbers as the tables show them: one cell of a number, and the evidence study's intervals, seed counts, verdicts
and the per-group columns of its cell tables. A neutral module: the benches (qerl_cli/bench/) and the run report
(qerl_cli/report.py) both render with it, so the report needs nothing of the benches.
"""

from __future__ import annotations

import numbers
from typing import Any

SIG = "{:.3g}"  # statistics of unknown scale (differences, intervals)


def num(v: Any, spec: str = "{:.3f}") -> str:
    """One table cell: ``-`` for a missing value, ``spec`` for a number, anything else as text."""
    if v is None:
        return "-"
    return spec.format(v) if isinstance(v, numbers.Real) else str(v)  # numpy scalars are Real too


def seeds_text(cell: dict[str, Any]) -> str:
    """A cell's seed count as the tables show it: the seeds that gave an outcome, then how many failed."""
    failed = cell.get("failed") or []
    return f"{len(cell.get('seeds') or [])}" + (f" (+{len(failed)} failed)" if failed else "")


def ci_text(s: dict[str, Any] | None, spec: str = SIG) -> str:
    if not s or s.get("mean") is None:
        return "-"
    if s.get("lo") is None:
        return f"{spec.format(s['mean'])} (n={s['n']})"
    return f"{spec.format(s['mean'])} [{spec.format(s['lo'])}, {spec.format(s['hi'])}]"


# per group: the per-seed scalars its cell table shows (levels and gains)
CELL_COLUMNS = {
    "qerl": ("steps_to_threshold", "late_accuracy", "heldout_before", "heldout", "heldout_gain", "initial_entropy",
             "initial_sampling_entropy", "noisy_entropy", "noisy_sampling_entropy", "post_noise_reward",
             "noisy_applied_noise_norm"),
    "flashrl": ("steps_to_threshold", "late_accuracy", "final", "k3_last", "collapsed"),
    "fp16": ("late_accuracy", "k3_first", "k3_last", "k3_growth", "collapsed"),
    "moe": ("mean_reward", "late_accuracy", "heldout_before", "heldout", "heldout_gain", "replay_disagreement"),
    "w4a8": ("mean_reward", "late_accuracy", "heldout_before", "heldout", "heldout_gain", "mean_k3"),
}


def part_interval_text(p: dict[str, Any]) -> str:
    return f"{num(p['diff'], SIG)} [{num(p['lo'], SIG)}, {num(p['hi'], SIG)}]"


def verdict_text(p: dict[str, Any]) -> str:
    """The verdict, marked when the exact sign-flip test at the same boundary does not reach 2.5% one-sided."""
    return p["verdict"] + (" (t only)" if p.get("flip_agrees") is False else "")
