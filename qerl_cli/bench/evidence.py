"""The evidence study: the four seed claims, each a set of comparisons fixed before the run, with verdicts.

Inputs are ``qerl bench sanity --seeds ...`` results (``sanity.json``), grouped by the study that produced
them (several files per group when the seeds ran as parallel processes; they must share one perfectible
subset). Groups and their grids (`scripts/gpu.sh evidence` runs them; docs/evidence.md states the hypotheses
and the rules):

- ``qerl``:    format = bf16, nvfp4  x  aqn = false, true                      (claims 1 and 2)
- ``flashrl``: bf16 base, rollout_quant = none, int8, fp8  x  correction = none, token_tis   (claim 3)
- ``fp16``:    precision = bf16, fp16  x  algo = grpo, pg_seq_is, completions run to max length (claim 4)
- ``moe``:     routing_replay = true, false on a mixture of experts whose rollout and update routings can differ
               (the upcycled Mixtral, async rollout with staleness; claim 5, docs/moe.md "The replay A/B")
- ``w4a8``:    rollout_w4a8 = true, false on the NVFP4 model, token TIS in both arms (claim 6, docs/evidence.md)

Each comparison (a :class:`Part`) takes one per-seed scalar (bench/sanity.py ``seed_scalars``) of cell A
and of cell B (or of the best B among several, or zero), orients the difference so that > 0 favours the
claim, and hands it to ``stats.compare``: paired by seed on the seeds both cells ran (a paired t interval, an
exact sign-flip p, the percentile bootstrap only from ``stats.BOOTSTRAP_MIN_N`` pairs), Welch's interval and a
Mann-Whitney p when they share fewer than two seeds. Beside the verdict stand the seeds that would decide the
part. A claim's verdict combines its parts (``stats.combine``). The same sanity files always give the same
tables (every random draw is seeded); evidence.md names the files with their sha256 and the command that
re-runs it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.bench import harness
from qerl_cli.bench.harness import save_figure
from qerl_cli.errors import QerlError
from qerl_cli.plots import plot_curves
from qerl_cli.tables import (
    CELL_COLUMNS,
    ci_text,
    num,
    part_interval_text,
    seeds_text,
    verdict_text,
)

SCHEMA = 2
GROUPS = ("qerl", "flashrl", "fp16", "moe", "w4a8")
CURVE_METRICS = ("accuracy", "entropy", "sampling_entropy", "k3")
# a group's curves beyond CURVE_METRICS
GROUP_CURVES = {"moe": ("reward", "replay_disagreement"), "w4a8": ("reward",)}
# claims of a study of their own (not the four seed claims): listed only when their group's files were given
OWN_STUDY = {5: "moe", 6: "w4a8"}
TARGET_PAIRS = 8  # the study's target: every part from at least this many paired seeds (or a power argument)

# Smallest differences that matter (the margins of the verdicts): 5 accuracy points, one step, 0.02 nats.
ACC_MARGIN = 0.05
STEP_MARGIN = 1.0
ENTROPY_MARGIN = 0.02

# the modules whose code decides the tables: their sha256 is the analysis version in every evidence file (tables.py
# formats their intervals and verdicts, shared with the run report)
ANALYSIS_MODULES = ("bench/stats.py", "bench/evidence.py", "bench/sanity.py", "tables.py")


@dataclass(frozen=True)
class Part:
    claim: int
    name: str
    group: str
    a: dict[str, Any]
    b: dict[str, Any] | None  # None: A's value is compared with zero
    metric: str
    sign: int  # +1: A above B favours the claim; -1: A below B does
    kind: str  # stats.verdict kinds: better | noninferior | equivalent
    margin: float
    best_of: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # B = the best of these by mean (sign-wise)
    levels: tuple[str, ...] = ()  # per-seed scalars reported beside a gain (the levels it is the difference of)


def _nv(fmt: str, aqn: bool) -> dict[str, Any]:
    return {"format": fmt, "aqn": aqn}


def _fr(rq: str, corr: str) -> dict[str, Any]:
    return {"rollout_quant": rq, "correction": corr}


def _fp(prec: str, algo: str) -> dict[str, Any]:
    return {"precision": prec, "algo": algo}


REPLAY_ON, REPLAY_OFF = {"routing_replay": True}, {"routing_replay": False}
W4A8_ON, W4A8_OFF = {"rollout_w4a8": True}, {"rollout_w4a8": False}


HELDOUT_LEVELS = ("heldout_before", "heldout")

CLAIMS: dict[int, dict[str, str]] = {
    1: {"title": "QeRL: NVFP4 + LoRA learns at least as fast as BF16 + LoRA; quantization raises the initial "
                 "entropy",
        "hypothesis": "With AQN off, on a training set fair to both (every problem 10-90% solved by both models "
                      "before training), NVFP4 needs at most one step more than BF16 to pass 95% training "
                      "accuracy, gains at least as much held-out accuracy (within 5 points) from the same run, "
                      "and its rollouts at step 1 (no update yet) have a higher policy entropy."},
    2: {"title": "QeRL: AQN raises the sampling policy's entropy, and then reward and held-out gain, for NVFP4 "
                 "and for BF16 weights",
        "hypothesis": "For each base format, AQN on (sigma 1e-2 -> 5e-4 in stages; stage 0 has none) gives a higher "
                      "entropy of the noisy rollout policy over the first 4 noisy steps, a higher training reward "
                      "over the steps after them, and a larger held-out gain than AQN off."},
    3: {"title": "FlashRL: INT8/FP8 rollouts with token TIS (C = 2) match BF16 rollouts; without TIS they fall "
                 "behind",
        "hypothesis": "On a BF16 base and a task the BF16 arm does not saturate, INT8 and FP8 rollouts with token "
                      "TIS end (training accuracy over the last quarter of the steps) within 5 points of BF16 "
                      "rollouts; without TIS they end at least 5 points below BF16 rollouts."},
    4: {"title": "FP16 study: BF16 mismatch grows and precedes collapse, FP16 stays stable; PG-Seq-IS in FP16 "
                 "matches the best BF16 method",
        "hypothesis": "With completions of max_completion_length tokens, GRPO in BF16 has a larger late mismatch "
                      "(k3) than in FP16, its k3 grows from the first to the last quarter of the run, it collapses "
                      "more often than FP16, and FP16 PG-Seq-IS ends within 5 points of the better BF16 method."},
    5: {"title": "Routing replay: with replay on, a mixture of experts' reward curve is no worse than with it off",
        "hypothesis": "On the upcycled Mixtral (SmolLM2-135M, 4 experts, top-2) trained where the rollout's and the "
                      "update's routings differ (a stale async rollout, bf16 kernels), the update's own routers "
                      "pick other experts than the rollout recorded for a share of the tokens above 0 (replay off), "
                      "and routing replay on gives a mean training reward over the run, a late training accuracy "
                      "and a held-out gain each no more than 5 points below replay off."},
    6: {"title": "W4A8 rollouts learn no worse than W4A16 rollouts",
        "hypothesis": "On the embedded model in NVFP4 (SmolLM2-135M: only the down projections, K = 1536, meet the "
                      "W4A8 kernel's K % 128 == 0; every other projection stays W4A16), with token TIS (C = 2) in "
                      "both arms, W4A8 rollouts raise the mean mismatch k3 over the run above W4A16's (the rollouts "
                      "ran other numbers), and give a mean training reward over the run, a late training accuracy "
                      "and a held-out gain each no more than 5 points below W4A16 rollouts."},
}


def _no_worse(claim: int, group: str, a: dict[str, Any], b: dict[str, Any], versus: str) -> tuple[Part, ...]:
    """A switch's learning no worse than without it: mean training reward, late accuracy and held-out gain each
    non-inferior by the accuracy margin (claims 5 and 6)."""
    return (Part(claim, f"mean training reward: {versus}", group, a, b, "mean_reward", +1, "noninferior", ACC_MARGIN),
            Part(claim, f"late accuracy: {versus}", group, a, b, "late_accuracy", +1, "noninferior", ACC_MARGIN),
            Part(claim, f"held-out gain: {versus}", group, a, b, "heldout_gain", +1, "noninferior", ACC_MARGIN,
                 levels=HELDOUT_LEVELS))


PARTS: tuple[Part, ...] = (
    Part(1, "steps to > 95%: nvfp4 vs bf16 (AQN off)", "qerl", _nv("nvfp4", False), _nv("bf16", False),
         "steps_to_threshold", -1, "noninferior", STEP_MARGIN),
    Part(1, "held-out gain: nvfp4 vs bf16 (AQN off)", "qerl", _nv("nvfp4", False), _nv("bf16", False),
         "heldout_gain", +1, "noninferior", ACC_MARGIN, levels=HELDOUT_LEVELS),
    Part(1, "initial entropy (step 1): nvfp4 vs bf16 (AQN off)", "qerl", _nv("nvfp4", False), _nv("bf16", False),
         "initial_entropy", +1, "better", ENTROPY_MARGIN),
    # hypothesis 2, the same three comparisons for nvfp4 and for bf16: (what, scalar, margin, held-out levels)
    *(Part(2, f"{what}: AQN on vs off ({fmt})", "qerl", _nv(fmt, True), _nv(fmt, False), scalar, +1, "better",
           margin, levels=levels)
      for fmt in ("nvfp4", "bf16")
      for what, scalar, margin, levels in (
          ("sampling entropy, noisy window", "noisy_sampling_entropy", ENTROPY_MARGIN, ()),
          ("reward after the noisy window", "post_noise_reward", ACC_MARGIN, ()),
          ("held-out gain", "heldout_gain", ACC_MARGIN, HELDOUT_LEVELS))),
    Part(3, "late accuracy: int8 + TIS vs bf16 rollouts", "flashrl", _fr("int8", "token_tis"), _fr("none", "none"),
         "late_accuracy", +1, "equivalent", ACC_MARGIN),
    Part(3, "late accuracy: fp8 + TIS vs bf16 rollouts", "flashrl", _fr("fp8", "token_tis"), _fr("none", "none"),
         "late_accuracy", +1, "equivalent", ACC_MARGIN),
    Part(3, "late accuracy: int8 without TIS below bf16 rollouts", "flashrl", _fr("int8", "none"),
         _fr("none", "none"), "late_accuracy", -1, "better", ACC_MARGIN),
    Part(3, "late accuracy: fp8 without TIS below bf16 rollouts", "flashrl", _fr("fp8", "none"), _fr("none", "none"),
         "late_accuracy", -1, "better", ACC_MARGIN),
    Part(4, "late k3: bf16 vs fp16 (GRPO)", "fp16", _fp("bf16", "grpo"), _fp("fp16", "grpo"),
         "k3_last", +1, "better", 0.0),
    Part(4, "k3 growth (last - first quarter), bf16 GRPO, vs 0", "fp16", _fp("bf16", "grpo"), None,
         "k3_growth", +1, "better", 0.0),
    Part(4, "collapse rate: bf16 vs fp16 (GRPO)", "fp16", _fp("bf16", "grpo"), _fp("fp16", "grpo"),
         "collapsed", +1, "better", 0.0),
    Part(4, "late accuracy: fp16 PG-Seq-IS vs the better bf16 method", "fp16", _fp("fp16", "pg_seq_is"), None,
         "late_accuracy", +1, "equivalent", ACC_MARGIN, best_of=(_fp("bf16", "grpo"), _fp("bf16", "pg_seq_is"))),
    # claim 5 needs a setting where replay has something to prevent: the first part says whether the run had one
    Part(5, "routing disagreement with replay off, vs 0", "moe", REPLAY_OFF, None, "replay_disagreement", +1,
         "better", 0.0),
    *_no_worse(5, "moe", REPLAY_ON, REPLAY_OFF, "replay on vs off"),
    # claim 6 needs rollouts W4A8 actually changed (a GPU with FP8 tensor cores, rows >= QERL_W4A8_MIN_M): the first
    # part says whether they did
    Part(6, "mean mismatch k3: W4A8 vs W4A16 rollouts", "w4a8", W4A8_ON, W4A8_OFF, "mean_k3", +1, "better", 0.0),
    *_no_worse(6, "w4a8", W4A8_ON, W4A8_OFF, "W4A8 vs W4A16 rollouts"),
)


def analysis_version() -> dict[str, Any]:
    """What produced the tables: qerl's git commit (when run from a checkout) and the sha256 of the analysis
    modules' source (ANALYSIS_MODULES), which pins the rules even without git."""
    from qerl_cli.env_info import git_commit

    root = Path(__file__).resolve().parent.parent
    return {"schema": SCHEMA, "git_commit": git_commit(),
            "sources_sha256": {m: hashlib.sha256((root / m).read_bytes()).hexdigest()[:16] for m in ANALYSIS_MODULES}}


def merge_group(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One group's sanity.json files as one: rows concatenated (a seed run twice for a cell is kept once)."""
    if not results:
        raise QerlError("an evidence group has no sanity.json: give each group at least one file")
    keys = {json.dumps(r["config"]["subset"]["key"], sort_keys=True) for r in results}
    if len(keys) != 1:
        raise QerlError("the sanity.json files of one evidence group were trained on different perfectible subsets: "
                        "build the subset once and copy perfectible.json into every process's --out")
    seen: set[tuple[str, Any]] = set()
    rows = []
    for r in results:
        for row in r["results"]:
            k = (row["label"], row.get("seed"))
            if k not in seen:
                seen.add(k)
                rows.append(row)
    first = results[0]
    return {"config": first["config"], "env": first.get("env"), "results": rows,
            "wall_s": sum(r.get("wall_s", 0.0) for r in results)}


def _seed_values(rows: Sequence[dict[str, Any]], sel: dict[str, Any], metric: str) -> dict[Any, float]:
    from qerl_cli.bench.sanity import cell_matches, is_outcome, seed_scalars

    out: dict[Any, float] = {}
    for r in rows:
        if cell_matches(r["cell"], sel) and is_outcome(r):
            v = seed_scalars(r).get(metric)
            if v is not None:
                out[r.get("seed")] = float(v)
    return out


def power_line(row: dict[str, Any]) -> str:
    """What the spread says about the seeds this part needs, in one line."""
    n, need, width = row["n_used"], row.get("seeds_to_decide"), row.get("seeds_for_margin")
    if row["diff"] is None:
        return "no data"
    if row["lo"] is None:
        have = f"{row['n_a']} seed(s)" if row["n_b"] is None else f"{row['n_a']} seed(s) of A, {row['n_b']} of B"
        return f"{have}: no interval without two values a side"
    if row.get("sd_diff") == 0 and row["verdict"].startswith("inconclusive"):
        return "every seed gave the same difference: no number of seeds decides it (see docs/evidence.md)"
    parts = []
    if row["verdict"].startswith("inconclusive"):
        from qerl_cli.bench.stats import MAX_SEEDS, decision_gap

        if need:
            parts.append(f"{need} seeds would decide it at the observed difference")
        elif decision_gap(row["diff"], row["kind"], row["margin"]):
            parts.append(f"more than {MAX_SEEDS} seeds would be needed at the observed difference")
        else:
            parts.append("no number of seeds decides it at the observed difference (it sits on the boundary)")
    else:
        parts.append(f"decided with {n}" + (f" (this spread needs {need})" if need else ""))
    if width:
        parts.append(f"{width} give a 95% interval narrower than the {_margin_text(row)} margin")
    return "; ".join(parts)


def _margin_text(row: dict[str, Any]) -> str:
    m = row["margin"]
    if row["metric"] == "steps_to_threshold":
        return f"{m:g}-step"
    if "entropy" in row["metric"]:
        return f"{m:g}-nat"
    return f"{m * 100:g}-point"


def evaluate_part(part: Part, rows: Sequence[dict[str, Any]], n_boot: int = 10000) -> dict[str, Any]:
    from qerl_cli.bench.stats import VERDICTS, compare, mean_ci

    a = _seed_values(rows, part.a, part.metric)
    b_sel = part.b
    if part.best_of:
        means = {i: mean_ci(list(_seed_values(rows, s, part.metric).values()))["mean"]
                 for i, s in enumerate(part.best_of)}
        known = {i: m for i, m in means.items() if m is not None}
        b_sel = part.best_of[max(known, key=lambda i: part.sign * known[i])] if known else part.best_of[0]
    b = _seed_values(rows, b_sel, part.metric) if b_sel is not None else None
    row: dict[str, Any] = {"claim": part.claim, "name": part.name, "group": part.group, "metric": part.metric,
                           "a": part.a, "b": b_sel, "kind": part.kind, "margin": part.margin, "sign": part.sign,
                           "a_stats": mean_ci(list(a.values())), "b_stats": mean_ci(list(b.values())) if b else None,
                           "n_a": len(a), "n_b": len(b) if b is not None else None,
                           "levels": {m: {"a": mean_ci(list(_seed_values(rows, part.a, m).values())),
                                          "b": mean_ci(list(_seed_values(rows, b_sel, m).values())) if b_sel else None}
                                      for m in part.levels}}
    # pair on the seeds both cells ran (cells run as separate processes may finish different numbers)
    common = sorted(set(a) & set(b), key=str) if b is not None else sorted(a, key=str)
    paired = b is None or len(common) >= 2
    if paired:
        av = [part.sign * a[s] for s in common]
        bv = None if b is None else [part.sign * b[s] for s in common]
    else:
        av, bv = [part.sign * v for v in a.values()], [part.sign * v for v in b.values()]
    # one value a side says nothing about the spread: no interval, no verdict
    if len(av) >= 2 and (bv is None or len(bv) >= 2):
        row.update(compare(av, bv, paired=paired, kind=part.kind, margin=part.margin, n_boot=n_boot))
    else:
        diff = None
        if av and (bv is None or bv):
            diff = sum(av) / len(av) - (sum(bv) / len(bv) if bv else 0.0)
        row.update({"paired": paired and bv is not None, "n": len(av) if paired else None, "method": None,
                    "diff": diff, "lo": None, "hi": None, "sd_diff": None, "p_sign_flip": None,
                    "p_mann_whitney": None, "p_flip_verdict": None, "flip_agrees": None, "seeds_for_margin": None,
                    "seeds_to_decide": None, "verdict": VERDICTS[2]})
    row["seeds"] = list(common) if paired else None
    decided = not row["verdict"].startswith("inconclusive")
    # seeds behind the verdict: the pairs, or (unpaired) the smaller cell
    row["n_used"] = n_used = row["n"] if row["n"] is not None else min(len(a), len(b or a))
    # the study's target: >= TARGET_PAIRS paired seeds, or a verdict this spread shows needs no more
    row["meets_target"] = n_used >= TARGET_PAIRS or (decided and row["seeds_to_decide"] is not None
                                                     and row["seeds_to_decide"] <= n_used)
    row["power"] = power_line(row)
    return row


def curves(rows: Sequence[dict[str, Any]], metrics: Sequence[str] = CURVE_METRICS) -> dict[str, dict[str, Any]]:
    """Per cell label and metric: per step the mean and 95% interval over the seeds that reached that step."""
    from qerl_cli.bench.stats import mean_ci

    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["label"], []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for label, rs in by.items():
        out[label] = {"seeds": len(rs)}
        for m in metrics:
            n = max((len(r.get(m) or []) for r in rs), default=0)
            cis = [mean_ci([(r.get(m) or [])[i] if i < len(r.get(m) or []) else None for r in rs]) for i in range(n)]
            out[label][m] = {k: [c[k] for c in cis] for k in ("mean", "lo", "hi", "n")}
    return out


def build_evidence(groups: dict[str, Sequence[dict[str, Any]]], *, n_boot: int = 10000,
                   meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The evidence document: per group its cells (mean and 95% interval per seed scalar), curves and subset
    rule; per part its interval, tests, verdict and seeds needed; per claim the combined verdict."""
    from qerl_cli.bench.sanity import subset_rule, summarize_cells
    from qerl_cli.bench.stats import BOOTSTRAP_MIN_N, combine

    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise QerlError(f"unknown evidence group(s) {', '.join(unknown)}: use {', '.join(GROUPS)}")
    merged = {g: merge_group(rs) for g, rs in groups.items() if rs}
    parts = [evaluate_part(p, merged[p.group]["results"], n_boot) for p in PARTS if p.group in merged]
    claims = []
    for cid, c in CLAIMS.items():
        ps = [p for p in parts if p["claim"] == cid]
        if cid in OWN_STUDY and not ps:
            continue
        undecided = [p["seeds_to_decide"] for p in ps if p["verdict"].startswith("inconclusive")]
        claims.append({"claim": cid, **c, "verdict": combine([p["verdict"] for p in ps]) if ps else "not run",
                       "parts": len(ps), "min_pairs": min((p["n"] or 0 for p in ps), default=None),
                       "all_meet_target": all(p["meets_target"] for p in ps) if ps else None,
                       # a decided part whose exact sign-flip test does not reach the same conclusion
                       "t_only": [p["name"] for p in ps if p["flip_agrees"] is False],
                       "seeds_to_decide_rest": (None if not undecided or None in undecided else max(undecided))})

    def rule(cfg: dict[str, Any]) -> str | None:
        sub = cfg.get("subset") or {}
        if sub.get("rule"):
            return sub["rule"]
        try:  # a v1 study file recorded the rule's settings only
            return subset_rule({**sub, "problems": [None] * sub["key"]["candidates"]})
        except (KeyError, TypeError):
            return None

    return {
        "schema": SCHEMA, "kind": "bench/evidence",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "meta": dict(meta or {}), "analysis": analysis_version(),
        "rules": {"target_pairs": TARGET_PAIRS, "bootstrap_min_pairs": BOOTSTRAP_MIN_N, "interval": "95%",
                  "margins": {"accuracy": ACC_MARGIN, "steps": STEP_MARGIN, "entropy": ENTROPY_MARGIN}},
        "groups": {g: {"config": m["config"], "env": m.get("env"), "wall_s": m["wall_s"],
                       "selection_rule": rule(m["config"]),
                       "cells": summarize_cells(m["results"]),
                       "curves": curves(m["results"], CURVE_METRICS + GROUP_CURVES.get(g, ()))}
                   for g, m in merged.items()},
        "parts": parts, "claims": claims,
        "margins": {"accuracy": ACC_MARGIN, "steps": STEP_MARGIN, "entropy": ENTROPY_MARGIN},
    }


def markdown(ev: dict[str, Any]) -> str:
    """The selection rules, cell tables, the verdict table and the claims as Markdown (docs/benchmarks.md, the
    terminal). Nothing in it depends on when or where it was computed: re-running on the same files gives it."""
    lines: list[str] = []
    a = ev.get("analysis") or {}
    src = ", ".join(f"{m} {h}" for m, h in (a.get("sources_sha256") or {}).items())
    lines += [f"Analysis: qerl evidence schema {ev['schema']}" + (f"; sources sha256 {src}" if src else ""), ""]
    inputs = (ev.get("meta") or {}).get("inputs") or {}
    if inputs:
        lines += ["Raw files (sha256):", ""]
        for g, files in inputs.items():
            for f in files:
                lines.append(f"- {g}: `{f['path']}` {f.get('sha256', '')}" if isinstance(f, dict) else f"- {g}: `{f}`")
        cmd = " ".join(f"--input {g}={f['path'] if isinstance(f, dict) else f}"
                       for g, files in inputs.items() for f in files)
        lines += ["", f"Re-run: `qerl bench evidence {cmd}`", ""]
    for g, grp in ev["groups"].items():
        cols = CELL_COLUMNS.get(g, CELL_COLUMNS["qerl"])
        lines += [f"**{g}**: training set = {grp.get('selection_rule') or 'unrecorded'}", "",
                  "(mean [95% t interval] over seeds)", "",
                  "| cell | seeds | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
        for label, c in grp["cells"].items():
            lines.append(f"| {label} | {seeds_text(c)} | " + " | ".join(ci_text(c["metrics"].get(k)) for k in cols)
                         + " |")
        lines.append("")
    lines += ["| claim | comparison (A vs B) | A | B | A - B, oriented [95%] | method | pairs | sign-flip p | verdict "
              "| seeds needed |",
              "|---:|---|---|---|---|---|---:|---:|---|---|"]
    for p in ev["parts"]:
        lines.append(f"| {p['claim']} | {p['name']} | {ci_text(p['a_stats'])} | {ci_text(p['b_stats'])} | "
                     f"{part_interval_text(p)} | {p.get('method') or '-'} | {p['n'] if p['n'] is not None else '-'} | "
                     f"{num(p.get('p_sign_flip'), '{:.3g}')} | {verdict_text(p)} | {p['power']} |")
        for m, lv in (p.get("levels") or {}).items():
            lines.append(f"| | level beside it: {m} | {ci_text(lv['a'])} | {ci_text(lv['b'])} | | | | | | |")
    lines += ["", "| claim | verdict | fewest pairs | target met | seeds to decide the undecided parts |",
              "|---|---|---:|---|---|"]
    for c in ev["claims"]:
        rest = c.get("seeds_to_decide_rest")
        lines.append(f"| {c['claim']}: {c['title']} | **{c['verdict']}**"
                     + (" (t only: " + "; ".join(c["t_only"]) + ")" if c.get("t_only") else "")
                     + f" | {c.get('min_pairs') if c.get('min_pairs') is not None else '-'} | "
                     + {True: "yes", False: "no", None: "-"}[c.get("all_meet_target")] + " | "
                     + (str(rest) if rest else "-" if c["verdict"] != "inconclusive at this size" else "unknown")
                     + " |")
    return "\n".join(lines) + "\n"


def parse_inputs(items: Sequence[str]) -> dict[str, list[Path]]:
    """``["qerl=a/sanity.json", "qerl=b/sanity.json"]`` -> {"qerl": [a, b]} (groups checked)."""
    out: dict[str, list[Path]] = {}
    for item in items:
        g, sep, path = item.partition("=")
        if not sep or not path or g not in GROUPS:
            raise QerlError(f"--input {item!r}: use GROUP=PATH with GROUP one of {', '.join(GROUPS)}")
        out.setdefault(g, []).append(Path(path))
    return out


def write_evidence(*, inputs: dict[str, Sequence[Path]], out_dir: Path, run_dir: Path | None = None,
                   meta: dict[str, Any] | None = None, n_boot: int = 10000,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Read the groups' sanity.json files, write evidence.json, evidence.md and evidence.png (atomically; the
    JSON last) and, with a run directory, record them under ``bench/evidence`` in its manifest: the raw files
    (path and sha256), each group's selection rule and the analysis version."""
    from qerl_cli.manifest import RunDir, atomic_write_json, atomic_write_text, jsonable

    groups: dict[str, list[dict[str, Any]]] = {}
    files: dict[str, list[dict[str, str]]] = {}
    for g, paths in inputs.items():
        for p in paths:
            p = Path(p)
            if not p.is_file():
                raise QerlError(f"evidence input {p} does not exist: give the sanity.json of a finished bench")
            raw = p.read_bytes()
            try:
                groups.setdefault(g, []).append(json.loads(raw))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise QerlError(f"evidence input {p} is not JSON ({exc}): give a sanity.json") from None
            files.setdefault(g, []).append({"path": str(p), "sha256": hashlib.sha256(raw).hexdigest()})
    for g, rs in groups.items():
        if any(not isinstance(r, dict) or "results" not in r or "subset" not in (r.get("config") or {}) for r in rs):
            raise QerlError(f"an evidence input of group {g} is not a `qerl bench sanity` result (no results or "
                            "subset): give the sanity.json files the bench wrote")
    ev = build_evidence(groups, n_boot=n_boot, meta={**(meta or {}), "inputs": files})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = plot_curves(ev)
    if fig is not None:
        save_figure(fig, out / "evidence.png")
    atomic_write_text(out / "evidence.md", markdown(ev))
    atomic_write_json(out / "evidence.json", jsonable(ev))
    if run_dir is not None:
        harness.record(RunDir(run_dir), "evidence",
                       config={"inputs": files, "analysis": ev["analysis"],
                               "selection": {g: grp["selection_rule"] for g, grp in ev["groups"].items()},
                               "rules": ev["rules"]},
                       outputs={"json": out / "evidence.json", "markdown": out / "evidence.md"},
                       metrics={f"claim{c['claim']}": c["verdict"] for c in ev["claims"]})
    for c in ev["claims"]:
        log(f"claim {c['claim']}: {c['verdict']}")
    return ev
