"""bench/evidence.py on hand-made sanity rows: cell matching, paired t intervals, gains beside levels, the sampling
policy's entropy, best-of, seeds needed, verdicts, and the same table again from the same raw files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qerl_cli.bench import evidence, stats
from qerl_cli.errors import QerlError


def _row(cell, seed, *, entropy, acc, k3=None, status="ok", before=None, after=None, sampling=None, reward=None,
         first_noisy=0):
    return {"cell": cell, "label": ", ".join(f"{k}={v}" for k, v in cell.items()), "seed": seed, "status": status,
            "accuracy": acc, "reward": reward or acc, "entropy": entropy, "sampling_entropy": sampling or entropy,
            "k3": k3 or [1e-4] * len(acc), "applied_noise_norm": [None] * len(acc), "steps_run": len(acc),
            "steps_to_threshold": next((i + 1 for i, a in enumerate(acc) if a > 0.95), None),
            "final": sum(acc[-3:]) / 3, "collapsed": False, "heldout_before": before, "heldout": after,
            "aqn_first_noisy_step": first_noisy}


def _sanity(rows, key="k", rule="a rule"):
    return {"config": {"subset": {"key": {"k": key}, "rule": rule}}, "results": rows, "wall_s": 1.0}


def _qerl_rows(seeds=8):
    rows = []
    for seed in range(seeds):
        base = 0.5 + 0.05 * seed  # seed-to-seed spread shared by every cell: pairing removes it
        jitter = 0.01 * (seed % 3 - 1)
        off_acc = [0.5, 0.8, 0.96, 1, 1, 1, 1, 1]
        nv_acc = [0.5, 0.97, 1, 1, 1, 1, 1, 1]
        rows += [
            _row({"format": "bf16", "aqn": False}, seed, entropy=[base] * 8, acc=off_acc, before=0.5, after=0.6,
                 first_noisy=2),
            # nvfp4 starts 10 points lower but gains the same +/- a point: non-inferior on gains
            _row({"format": "nvfp4", "aqn": False}, seed, entropy=[base + 0.1] * 8, acc=nv_acc, before=0.4,
                 after=0.5 + jitter, first_noisy=2),
            # AQN on: the noisy policy's entropy is 0.1 higher after step 2 (the clean one is not), reward the same
            _row({"format": "bf16", "aqn": True}, seed, entropy=[base] * 8, sampling=[base] * 2 + [base + 0.1] * 6,
                 acc=off_acc, before=0.5, after=0.6 + jitter, first_noisy=2),
            _row({"format": "nvfp4", "aqn": True}, seed, entropy=[base + 0.1] * 8,
                 sampling=[base + 0.1] * 2 + [base + 0.1 + (0.05 if seed % 2 else -0.05)] * 6, acc=nv_acc,
                 before=0.4, after=0.5, first_noisy=2),
        ]
    return rows


def test_claims_1_and_2_verdicts_by_hand():
    ev = evidence.build_evidence({"qerl": [_sanity(_qerl_rows())]}, n_boot=2000)
    parts = {p["name"]: p for p in ev["parts"]}
    p = parts["initial entropy (step 1): nvfp4 vs bf16 (AQN off)"]
    # paired differences are exactly 0.1 for every seed: the interval is the point
    assert p["paired"] and p["method"] == "paired t" and p["diff"] == pytest.approx(0.1)
    assert p["lo"] == pytest.approx(0.1) and p["verdict"] == "supported" and p["n"] == 8 and p["flip_agrees"]
    assert p["p_sign_flip"] == pytest.approx(2 / 2**8) and p["meets_target"]
    s = parts["steps to > 95%: nvfp4 vs bf16 (AQN off)"]
    assert s["a_stats"]["mean"] == 2 and s["b_stats"]["mean"] == 3
    assert s["diff"] == pytest.approx(1.0) and s["verdict"] == "supported"  # oriented: fewer steps is better
    h = parts["held-out gain: nvfp4 vs bf16 (AQN off)"]
    # gains +0.1 +/- 0.01 vs +0.1: non-inferior within 5 points; the levels (0.4 vs 0.5 before) stand beside
    assert h["diff"] == pytest.approx(sum(0.01 * (s % 3 - 1) for s in range(8)) / 8)
    assert h["verdict"] == "supported"
    assert h["levels"]["heldout_before"]["a"]["mean"] == pytest.approx(0.4)
    assert h["levels"]["heldout_before"]["b"]["mean"] == pytest.approx(0.5)
    # the sampling policy's entropy over the noisy window (steps 3-6): +0.1 on bf16, +0.1 +/- 0.05 on nvfp4
    e = parts["sampling entropy, noisy window: AQN on vs off (bf16)"]
    assert e["metric"] == "noisy_sampling_entropy" and e["diff"] == pytest.approx(0.1) and e["verdict"] == "supported"
    en = parts["sampling entropy, noisy window: AQN on vs off (nvfp4)"]
    d = [0.05 if s % 2 else -0.05 for s in range(8)]  # the window's +-0.05 around the AQN-off entropy
    ref = stats.mean_ci(d)
    assert (en["lo"], en["hi"]) == (pytest.approx(ref["lo"]), pytest.approx(ref["hi"]))
    assert en["lo"] < 0 < evidence.ENTROPY_MARGIN < en["hi"] and en["verdict"].startswith("inconclusive")
    # same training curves: reward after the window is equal -> [0, 0] below the 5-point margin
    assert parts["reward after the noisy window: AQN on vs off (nvfp4)"]["verdict"] == "not supported"
    g = parts["held-out gain: AQN on vs off (bf16)"]
    assert g["verdict"] == "not supported" and g["hi"] < evidence.ACC_MARGIN
    claims = {c["claim"]: c["verdict"] for c in ev["claims"]}
    assert claims == {1: "supported", 2: "not supported", 3: "not run", 4: "not run"}
    md = evidence.markdown(ev)
    assert "| 1: QeRL" in md and "**supported**" in md and "level beside it: heldout_before" in md
    assert "training set = a rule" in md
    cur = ev["groups"]["qerl"]["curves"]["format=bf16, aqn=False"]["accuracy"]
    assert cur["mean"][:3] == pytest.approx([0.5, 0.8, 0.96]) and cur["n"] == [8] * 8


def test_few_seeds_say_how_many_would_decide():
    rows = [r for r in _qerl_rows(seeds=3)]
    # a noisy nvfp4 held-out gain: +-0.06 around the bf16 gain, 3 seeds: the interval crosses -5 points
    for r in rows:
        if r["cell"] == {"format": "nvfp4", "aqn": False}:
            r["heldout"] = 0.5 + (0.06, -0.06, 0.0)[r["seed"]]
    ev = evidence.build_evidence({"qerl": [_sanity(rows)]}, n_boot=200)
    h = {p["name"]: p for p in ev["parts"]}["held-out gain: nvfp4 vs bf16 (AQN off)"]
    assert h["verdict"].startswith("inconclusive") and h["n"] == 3 and not h["meets_target"]
    # sd of the differences 0.06: t(7) 0.06 / sqrt(8) = 0.0502, t(8) 0.06 / 3 = 0.0461 < |0 + 0.05| -> 9
    assert h["seeds_to_decide"] == stats.seeds_needed(0.06, 0.05) == 9
    assert "9 seeds would decide it" in h["power"] and h["seeds_for_margin"] == stats.seeds_needed(0.06, 0.025)
    c1 = next(c for c in ev["claims"] if c["claim"] == 1)
    assert c1["verdict"].startswith("inconclusive") and c1["min_pairs"] == 3 and c1["all_meet_target"] is False


def test_claim4_best_of_and_one_sample():
    rows = []
    for seed in range(3):
        rows += [
            _row({"algo": "grpo", "precision": "bf16"}, seed, entropy=[1.0], acc=[0.6] * 4,
                 k3=[1e-3, 1e-3, 2e-3, 3e-3 + 1e-4 * seed]),
            _row({"algo": "grpo", "precision": "fp16"}, seed, entropy=[1.0], acc=[0.5] * 4, k3=[1e-5] * 4),
            _row({"algo": "pg_seq_is", "precision": "bf16"}, seed, entropy=[1.0], acc=[0.8] * 4),
            _row({"algo": "pg_seq_is", "precision": "fp16"}, seed, entropy=[1.0], acc=[0.79] * 4),
        ]
    ev = evidence.build_evidence({"fp16": [_sanity(rows)]}, n_boot=500)
    parts = {p["name"]: p for p in ev["parts"]}
    best = parts["late accuracy: fp16 PG-Seq-IS vs the better bf16 method"]
    assert best["b"] == {"precision": "bf16", "algo": "pg_seq_is"}  # 0.8 beats grpo's 0.6
    assert best["diff"] == pytest.approx(-0.01) and best["verdict"] == "supported"
    g = parts["k3 growth (last - first quarter), bf16 GRPO, vs 0"]
    assert g["n_b"] is None and g["method"] == "one-sample t" and g["diff"] == pytest.approx(2.1e-3)
    # 3 seeds: the t interval decides, the exact sign-flip test cannot (2^-3 = 0.125 one-sided)
    assert g["verdict"] == "supported" and g["flip_agrees"] is False and "(t only)" in evidence.verdict_text(g)
    assert parts["late k3: bf16 vs fp16 (GRPO)"]["verdict"] == "supported"
    # a huge, steady effect: the spread says 3 seeds were enough (the target's power argument)
    assert parts["late k3: bf16 vs fp16 (GRPO)"]["meets_target"]
    # nobody collapsed: [0, 0] with margin 0 says nothing either way, and no number of seeds changes that
    col = parts["collapse rate: bf16 vs fp16 (GRPO)"]
    assert col["verdict"].startswith("inconclusive") and "same difference" in col["power"]
    assert next(c for c in ev["claims"] if c["claim"] == 4)["t_only"]


def test_unpaired_and_one_seed_a_side():
    rows = [r for r in _qerl_rows(4) if r["seed"] == 0 or r["cell"]["format"] == "bf16"]  # nvfp4: seed 0 only
    parts = {p["name"]: p for p in evidence.build_evidence({"qerl": [_sanity(rows)]}, n_boot=200)["parts"]}
    p = parts["initial entropy (step 1): nvfp4 vs bf16 (AQN off)"]
    assert p["n_a"] == 1 and p["n_b"] == 4 and not p["paired"] and p["lo"] is None  # one common seed: no pairing
    assert p["diff"] == pytest.approx(0.6 - 0.575) and p["verdict"].startswith("inconclusive")
    assert "no interval" in p["power"]
    # no common seeds but two a side: Welch's interval and the Mann-Whitney p
    rows = [r for r in _qerl_rows(4) if (r["cell"]["format"] == "bf16") == (r["seed"] < 2)]
    p = {q["name"]: q for q in evidence.build_evidence({"qerl": [_sanity(rows)]}, n_boot=200)["parts"]}[
        "initial entropy (step 1): nvfp4 vs bf16 (AQN off)"]
    assert p["method"] == "Welch t" and p["p_mann_whitney"] is not None and p["n"] is None


def test_merge_and_inputs(tmp_path):
    a = _sanity(_qerl_rows()[:4])
    with pytest.raises(QerlError, match="different perfectible subsets"):
        evidence.merge_group([a, _sanity([], key="other")])
    m = evidence.merge_group([a, a])
    assert len(m["results"]) == 4  # the same (cell, seed) twice is kept once
    with pytest.raises(QerlError, match="GROUP=PATH"):
        evidence.parse_inputs(["nope=x.json"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": []}))
    with pytest.raises(QerlError, match="not a `qerl bench sanity` result"):
        evidence.write_evidence(inputs={"qerl": [bad]}, out_dir=tmp_path / "x", log=lambda _m: None)


def _raw_files(root):
    """A small synthetic set of raw files, as the GPU study leaves them: one sanity.json per process."""
    rows = _qerl_rows()
    paths = []
    for i in range(2):  # seeds split over two processes
        d = root / "qerl" / f"p{i}"
        d.mkdir(parents=True)
        (d / "sanity.json").write_text(json.dumps(_sanity([r for r in rows if r["seed"] % 2 == i], rule="both arms")))
        paths.append(d / "sanity.json")
    return paths


def test_rerun_on_the_raw_files_gives_the_same_table(tmp_path, monkeypatch):
    """The raw files, the selection rule and the analysis version go into the manifest; running `qerl bench
    evidence` again on the same files (here through the CLI, as a reader would) writes the same evidence.md."""
    import hashlib

    paths = _raw_files(tmp_path)
    monkeypatch.chdir(tmp_path)  # the study records its raw files relative to the folder they are unpacked in
    rel = [str(p.relative_to(tmp_path)) for p in paths]
    run = tmp_path / "run"
    ev = evidence.write_evidence(inputs={"qerl": [Path(r) for r in rel]},
                                 out_dir=run / "bench" / "evidence", run_dir=run, log=lambda _m: None)
    assert json.loads((run / "bench" / "evidence" / "evidence.json").read_text())["claims"] == ev["claims"]
    assert (run / "bench" / "evidence" / "evidence.png").read_bytes()[:4] == b"\x89PNG"
    rec = json.loads((run / "manifest.json").read_text())["stages"]["bench/evidence"]
    assert rec["status"] == "completed" and rec["config"]["selection"] == {"qerl": "both arms"}
    assert [f["sha256"] for f in rec["config"]["inputs"]["qerl"]] == \
        [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert set(rec["config"]["analysis"]["sources_sha256"]) == set(evidence.ANALYSIS_MODULES)
    md = (run / "bench" / "evidence" / "evidence.md").read_text()
    assert "Re-run: `qerl bench evidence --input qerl=qerl/p0/sanity.json --input qerl=qerl/p1/sanity.json`" in md
    assert str(tmp_path) not in md  # nothing of this machine in the table
    # a reader re-runs the recorded command in the same folder: the same table, byte for byte
    res = subprocess.run([sys.executable, "-m", "qerl_cli", "bench", "evidence", *[f"--input=qerl={r}" for r in rel],
                          "--out", "again"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "again" / "evidence.md").read_text() == md


def test_out_of_memory_cells_are_no_seeds():
    """The 2026-11-26 H100 study: cells that ran out of memory were counted as seeds in the cell table (8 where 2
    gave an outcome). Only outcomes count; the failures are listed, and the table says how many."""
    rows = _qerl_rows(4)
    for r in rows:
        if r["seed"] >= 1 and r["cell"] == {"format": "bf16", "aqn": False}:
            r.update(status="OOM", accuracy=[], entropy=[], heldout=None)
    ev = evidence.build_evidence({"qerl": [_sanity(rows)]}, n_boot=200)
    cell = ev["groups"]["qerl"]["cells"]["format=bf16, aqn=False"]
    assert cell["seeds"] == [0] and cell["failed"] == ["1: OOM", "2: OOM", "3: OOM"]
    assert cell["metrics"]["heldout_gain"]["n"] == 1
    assert "| format=bf16, aqn=False | 1 (+3 failed) |" in evidence.markdown(ev)
    p = {q["name"]: q for q in ev["parts"]}["held-out gain: nvfp4 vs bf16 (AQN off)"]
    assert p["n_b"] == 1 and not p["paired"]
