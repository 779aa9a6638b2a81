"""bench/evidence.py on hand-made sanity rows: cell matching, paired intervals, best-of, verdicts, files."""

from __future__ import annotations

import json

import pytest

from qerl_cli.bench import evidence
from qerl_cli.errors import QerlError


def _row(cell, seed, *, entropy, acc, k3=None, status="ok", heldout=None):
    return {"cell": cell, "label": ", ".join(f"{k}={v}" for k, v in cell.items()), "seed": seed, "status": status,
            "accuracy": acc, "reward": acc, "entropy": entropy, "k3": k3 or [1e-4] * len(acc),
            "applied_noise_norm": [None] * len(acc), "steps_run": len(acc),
            "steps_to_threshold": next((i + 1 for i, a in enumerate(acc) if a > 0.95), None),
            "final": sum(acc[-3:]) / 3, "collapsed": False, "heldout": heldout}


def _sanity(rows, key="k"):
    return {"config": {"subset": {"key": {"k": key}}}, "results": rows, "wall_s": 1.0}


def _qerl_rows():
    rows = []
    for seed in range(4):
        base = 0.5 + 0.1 * seed  # seed-to-seed spread shared by every cell: pairing removes it
        rows += [
            _row({"format": "bf16", "aqn": False}, seed, entropy=[base] * 3, acc=[0.5, 0.8, 0.96, 1, 1], heldout=0.5),
            _row({"format": "nvfp4", "aqn": False}, seed, entropy=[base + 0.1] * 3, acc=[0.5, 0.97, 1, 1, 1],
                 heldout=0.5 + 0.01 * seed),
            _row({"format": "bf16", "aqn": True}, seed, entropy=[base + (0.05 if seed % 2 else -0.05)] * 3,
                 acc=[0.5, 0.8, 0.96, 1, 1]),
            _row({"format": "nvfp4", "aqn": True}, seed, entropy=[base + 0.1] * 3, acc=[0.5, 0.97, 1, 1, 1]),
        ]
    return rows


def test_claims_1_and_2_verdicts_by_hand():
    ev = evidence.build_evidence({"qerl": [_sanity(_qerl_rows())]}, n_boot=2000)
    parts = {p["name"]: p for p in ev["parts"]}
    p = parts["early entropy: nvfp4 vs bf16 (AQN off)"]
    # paired differences are exactly 0.1 for every seed: the interval is the point
    assert p["paired"] and p["diff"] == pytest.approx(0.1) and p["lo"] == pytest.approx(0.1)
    assert p["verdict"] == "supported" and p["n_a"] == p["n_b"] == 4
    s = parts["steps to > 95%: nvfp4 vs bf16 (AQN off)"]
    assert s["a_stats"]["mean"] == 2 and s["b_stats"]["mean"] == 3
    assert s["diff"] == pytest.approx(1.0) and s["verdict"] == "supported"  # oriented: fewer steps is better
    h = parts["held-out accuracy: nvfp4 vs bf16 (AQN off)"]
    assert h["diff"] == pytest.approx(0.015) and h["verdict"] == "supported"  # non-inferior within 5 points
    # AQN on nvfp4: identical entropy -> [0, 0], below the 0.02 margin: not supported
    assert parts["noisy-window entropy: AQN on vs off (nvfp4)"]["verdict"] == "not supported"
    # AQN on bf16: +-0.05 by seed parity -> an interval across 0 and past the margin: inconclusive
    b = parts["noisy-window entropy: AQN on vs off (bf16)"]
    assert b["lo"] < 0 < b["hi"] and b["hi"] > evidence.ENTROPY_MARGIN and b["verdict"].startswith("inconclusive")
    claims = {c["claim"]: c["verdict"] for c in ev["claims"]}
    assert claims == {1: "supported", 2: "not supported", 3: "not run", 4: "not run"}
    md = evidence.markdown(ev)
    assert "| 1: QeRL" in md and "**supported**" in md
    cur = ev["groups"]["qerl"]["curves"]["format=bf16, aqn=False"]["accuracy"]
    assert cur["mean"] == [0.5, 0.8, 0.96, 1.0, 1.0] and cur["n"] == [4] * 5


def test_claim4_best_of_and_one_sample():
    rows = []
    for seed in range(3):
        rows += [
            _row({"algo": "grpo", "precision": "bf16"}, seed, entropy=[1.0], acc=[0.6] * 4,
                 k3=[1e-3, 1e-3, 2e-3, 3e-3]),
            _row({"algo": "grpo", "precision": "fp16"}, seed, entropy=[1.0], acc=[0.5] * 4, k3=[1e-5] * 4),
            _row({"algo": "pg_seq_is", "precision": "bf16"}, seed, entropy=[1.0], acc=[0.8] * 4),
            _row({"algo": "pg_seq_is", "precision": "fp16"}, seed, entropy=[1.0], acc=[0.79] * 4),
        ]
    ev = evidence.build_evidence({"fp16": [_sanity(rows)]}, n_boot=500)
    parts = {p["name"]: p for p in ev["parts"]}
    best = parts["final: fp16 PG-Seq-IS vs the better bf16 method"]
    assert best["b"] == {"precision": "bf16", "algo": "pg_seq_is"}  # 0.8 beats grpo's 0.6
    assert best["diff"] == pytest.approx(-0.01) and best["verdict"] == "supported"
    g = parts["k3 growth (last - first quarter), bf16 GRPO, vs 0"]
    assert g["n_b"] is None and g["diff"] == pytest.approx(2e-3) and g["verdict"] == "supported"
    assert parts["late k3: bf16 vs fp16 (GRPO)"]["verdict"] == "supported"
    # nobody collapsed: [0, 0] with margin 0 says nothing either way
    assert parts["collapse rate: bf16 vs fp16 (GRPO)"]["verdict"].startswith("inconclusive")


def test_one_seed_a_side_gives_no_verdict():
    rows = [r for r in _qerl_rows() if r["seed"] == 0 or r["cell"]["format"] == "bf16"]  # nvfp4: seed 0 only
    parts = {p["name"]: p for p in evidence.build_evidence({"qerl": [_sanity(rows)]}, n_boot=200)["parts"]}
    p = parts["early entropy: nvfp4 vs bf16 (AQN off)"]
    assert p["n_a"] == 1 and p["n_b"] == 4 and not p["paired"]  # one common seed: no pairing
    assert p["diff"] == pytest.approx(0.6 - 0.65) and p["verdict"].startswith("inconclusive")


def test_merge_and_inputs(tmp_path):
    a = _sanity(_qerl_rows()[:4])
    with pytest.raises(QerlError, match="different perfectible subsets"):
        evidence.merge_group([a, _sanity([], key="other")])
    m = evidence.merge_group([a, a])
    assert len(m["results"]) == 4  # the same (cell, seed) twice is kept once
    with pytest.raises(QerlError, match="GROUP=PATH"):
        evidence.parse_inputs(["nope=x.json"])
    p = tmp_path / "sanity.json"
    p.write_text(json.dumps(_sanity(_qerl_rows())))
    run = tmp_path / "run"
    ev = evidence.write_evidence(inputs=evidence.parse_inputs([f"qerl={p}"]), out_dir=run / "bench" / "evidence",
                                 run_dir=run, n_boot=200, log=lambda _m: None)
    assert json.loads((run / "bench" / "evidence" / "evidence.json").read_text())["claims"] == ev["claims"]
    assert (run / "bench" / "evidence" / "evidence.png").read_bytes()[:4] == b"\x89PNG"
    man = json.loads((run / "manifest.json").read_text())
    assert man["stages"]["bench/evidence"]["status"] == "completed"
