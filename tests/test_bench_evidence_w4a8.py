"""Claim 6 of bench/evidence.py, W4A8 rollouts against W4A16 ones (docs/evidence.md), on hand-made sanity rows with
known per-seed values: its group's cells, curves and parts (verdicts and intervals computed by hand), listed only
when its files are given."""

from __future__ import annotations

import math

import pytest

from qerl_cli.bench import evidence
from qerl_cli.bench.sanity import seed_scalars
from tests.test_bench_evidence import _row, _sanity

T_975_5 = 2.570581836614739  # Student t, 97.5% quantile, 5 degrees of freedom (6 paired seeds)
SEEDS = 6


def _w4a8_rows(acc_drop: float = 0.01, k3_on=lambda s: [1e-3 * (2 + s % 2)] * 6) -> list[dict]:
    """Per seed s: W4A16 accuracy (= reward) base + 0.05 i over 6 steps, held-out 0.4 -> 0.5, k3 1e-3; W4A8 the same
    curve ``acc_drop`` lower at every step, a held-out gain 0.1 + 0.01 (s % 3 - 1), k3 ``k3_on(s)``."""
    rows = []
    for s in range(SEEDS):
        base = 0.3 + 0.04 * s
        acc = [base + 0.05 * i for i in range(6)]
        rows.append(_row({"rollout_w4a8": False}, s, entropy=[1.0] * 6, acc=acc, k3=[1e-3] * 6, before=0.4,
                         after=0.5))
        rows.append(_row({"rollout_w4a8": True}, s, entropy=[1.0] * 6, acc=[a - acc_drop for a in acc],
                         k3=k3_on(s), before=0.4, after=0.5 + 0.01 * (s % 3 - 1)))
    return rows


def test_claim_6_by_hand_listed_only_with_its_group():
    rows = _w4a8_rows()
    on = seed_scalars(rows[3])  # seed 1, W4A8
    assert on["mean_k3"] == pytest.approx(3e-3) and on["mean_reward"] == pytest.approx(0.34 + 0.125 - 0.01)
    ev = evidence.build_evidence({"w4a8": [_sanity(rows)]}, n_boot=200)
    parts = {p["name"]: p for p in ev["parts"]}
    assert [p["claim"] for p in ev["parts"]] == [6] * 4
    # k3: +1e-3 on even seeds, +2e-3 on odd ones: mean 1.5e-3, sd sqrt(6 * 0.5e-3**2 / 5), interval above 0
    k = parts["mean mismatch k3: W4A8 vs W4A16 rollouts"]
    half = T_975_5 * math.sqrt(6 * 0.5e-3**2 / 5) / math.sqrt(6)
    assert k["diff"] == pytest.approx(1.5e-3) and k["lo"] == pytest.approx(1.5e-3 - half)
    assert k["verdict"] == "supported" and k["n"] == 6 and k["kind"] == "better"
    # reward and late accuracy: every seed 1 point lower, so the interval is the point -0.01, above -0.05
    for name in ("mean training reward: W4A8 vs W4A16 rollouts", "late accuracy: W4A8 vs W4A16 rollouts"):
        p = parts[name]
        assert (p["diff"], p["lo"], p["hi"]) == (pytest.approx(-0.01), pytest.approx(-0.01), pytest.approx(-0.01))
        assert p["verdict"] == "supported" and p["kind"] == "noninferior" and p["margin"] == evidence.ACC_MARGIN
    # held-out gain: differences -0.01, 0, +0.01 twice over: mean 0, sd sqrt(4e-4 / 5)
    h = parts["held-out gain: W4A8 vs W4A16 rollouts"]
    half = T_975_5 * math.sqrt(4e-4 / 5) / math.sqrt(6)
    assert h["diff"] == pytest.approx(0.0, abs=1e-12) and h["lo"] == pytest.approx(-half)
    assert h["hi"] == pytest.approx(half) and h["verdict"] == "supported"
    assert h["levels"]["heldout_before"]["a"]["mean"] == pytest.approx(0.4)
    assert [c["claim"] for c in ev["claims"]] == [1, 2, 3, 4, 6] and ev["claims"][-1]["verdict"] == "supported"
    assert set(ev["groups"]["w4a8"]["curves"]["rollout_w4a8=True"]) >= {"reward", "k3", "accuracy"}
    md = evidence.markdown(ev)
    assert "| rollout_w4a8=True |" in md and "6: W4A8 rollouts learn no worse than W4A16 rollouts" in md
    # the other studies alone: no claim 6 line
    assert 6 not in {c["claim"] for c in evidence.build_evidence({"moe": [_sanity(rows)]}, n_boot=50)["claims"]}


def test_claim_6_fails_when_w4a8_learns_10_points_worse_and_says_when_w4a8_never_ran():
    worse = evidence.build_evidence({"w4a8": [_sanity(_w4a8_rows(acc_drop=0.10))]}, n_boot=200)
    parts = {p["name"]: p for p in worse["parts"]}
    late = parts["late accuracy: W4A8 vs W4A16 rollouts"]
    assert late["hi"] == pytest.approx(-0.10) and late["verdict"] == "not supported"  # below -0.05
    assert worse["claims"][-1]["claim"] == 6 and worse["claims"][-1]["verdict"] == "not supported"
    # a CPU run (the W4A8 kernel needs FP8 tensor cores): both arms ran the same numbers, k3 ties on every seed
    tie = evidence.build_evidence({"w4a8": [_sanity(_w4a8_rows(acc_drop=0.0, k3_on=lambda s: [1e-3] * 6))]},
                                  n_boot=200)
    k = next(p for p in tie["parts"] if p["metric"] == "mean_k3")
    assert k["diff"] == 0 and k["verdict"].startswith("inconclusive") and "every seed gave the same" in k["power"]
    assert tie["claims"][-1]["verdict"].startswith("inconclusive")
