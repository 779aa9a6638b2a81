"""Claim 5 of bench/evidence.py, the routing-replay A/B (docs/moe.md, "The replay A/B"), on hand-made sanity rows:
its group's cells, curves and parts, listed only when its files are given."""

from __future__ import annotations

from qerl_cli.bench import evidence
from qerl_cli.bench.sanity import seed_scalars
from tests.test_bench_evidence import _row, _sanity


def _moe_rows(seeds: int = 6) -> list[dict]:
    rows = []
    for seed in range(seeds):
        base = 0.3 + 0.04 * seed
        wobble = 0.01 * (seed % 3 - 1)
        for replay, gain, disagree in ((True, 0.10 + wobble, 0.02), (False, 0.10, 0.08 + 0.01 * (seed % 2))):
            r = _row({"routing_replay": replay}, seed, entropy=[1.0] * 6, acc=[base + 0.05 * i for i in range(6)],
                     before=0.4, after=0.4 + gain)
            r["replay_disagreement"] = [disagree] * 6
            rows.append(r)
    return rows


def test_the_replay_ab_is_claim_5_only_when_its_group_is_given() -> None:
    rows = _moe_rows()
    s = seed_scalars(rows[1])
    assert s["replay_disagreement"] == 0.08 and abs(s["mean_reward"] - (0.3 + 0.125)) < 1e-12
    ev = evidence.build_evidence({"moe": [_sanity(rows)]}, n_boot=200)
    parts = {p["name"]: p for p in ev["parts"]}
    assert parts["routing disagreement with replay off, vs 0"]["verdict"] == "supported"
    for name in ("mean training reward: replay on vs off", "held-out gain: replay on vs off"):
        assert parts[name]["verdict"] == "supported" and parts[name]["n"] == 6
    assert [c["claim"] for c in ev["claims"]] == [1, 2, 3, 4, 5] and ev["claims"][-1]["verdict"] == "supported"
    assert set(ev["groups"]["moe"]["curves"]["routing_replay=False"]) >= {"reward", "replay_disagreement"}
    assert "| routing_replay=True |" in evidence.markdown(ev)
    # the seed claims' studies alone (whatever their rows): no claim 5 line
    assert 5 not in {c["claim"] for c in evidence.build_evidence({"qerl": [_sanity(rows)]}, n_boot=50)["claims"]}
