"""The evidence study: the four seed claims, each a set of pre-stated comparisons over seeds, with verdicts.

Inputs are ``qerl bench sanity --seeds ...`` results (``sanity.json``), grouped by the study that produced
them (several files per group when the seeds ran as parallel processes; they must share one perfectible
subset). Groups and their grids (scripts/gpu_evidence.sh runs them; docs/evidence.md states the hypotheses):

- ``qerl``:    format = bf16, nvfp4  x  aqn = false, true                      (claims 1 and 2)
- ``flashrl``: bf16 base, rollout_quant = none, int8, fp8  x  correction = none, token_tis   (claim 3)
- ``fp16``:    precision = bf16, fp16  x  algo = grpo, pg_seq_is, completions run to max length (claim 4)

Each comparison (a :class:`Part`) takes one per-seed scalar (bench/sanity.py ``seed_scalars``) of cell A
and of cell B (or of the best B among several, or zero), orients the difference so that > 0 favours the
claim, and gives it a bootstrap interval (paired by seed on the seeds both cells ran, when there are at
least two; the others are dropped), a Mann-Whitney p and a verdict (bench/stats.py ``verdict``).
A claim's verdict combines its parts (``stats.combine``).
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.bench import harness
from qerl_cli.bench.harness import SIG, figure, num, save_figure
from qerl_cli.errors import QerlError

SCHEMA = 1
GROUPS = ("qerl", "flashrl", "fp16")
CURVE_METRICS = ("accuracy", "entropy", "k3")

# Smallest differences that matter (the margins of the verdicts): 5 accuracy points, one step, 0.02 nats.
ACC_MARGIN = 0.05
STEP_MARGIN = 1.0
ENTROPY_MARGIN = 0.02


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


def _nv(fmt: str, aqn: bool) -> dict[str, Any]:
    return {"format": fmt, "aqn": aqn}


def _fr(rq: str, corr: str) -> dict[str, Any]:
    return {"rollout_quant": rq, "correction": corr}


def _fp(prec: str, algo: str) -> dict[str, Any]:
    return {"precision": prec, "algo": algo}


CLAIMS: dict[int, dict[str, str]] = {
    1: {"title": "QeRL: NVFP4 + LoRA learns at least as fast as BF16 + LoRA; quantization raises early entropy",
        "hypothesis": "With AQN off, NVFP4 needs no more than one step more than BF16 to pass 95% training "
                      "accuracy, ends within 5 points of it on held-out problems, and has a higher mean policy "
                      "entropy over the first 3 steps."},
    2: {"title": "QeRL: AQN raises early entropy and reward, for NVFP4 and for BF16 weights",
        "hypothesis": "For each base format, AQN on (sigma 1e-2 -> 5e-4 in stages; stage 0 has none) gives a "
                      "higher mean entropy and a higher mean reward than AQN off over the first 4 steps from "
                      "AQN stage 1 (the first noisy steps)."},
    3: {"title": "FlashRL: INT8/FP8 rollouts with token TIS (C = 2) match BF16 rollouts; without TIS they fall "
                 "behind",
        "hypothesis": "On a BF16 base, INT8 and FP8 rollouts with token TIS end (final training accuracy plateau) "
                      "within 5 points of BF16 rollouts; without TIS they end below BF16 rollouts."},
    4: {"title": "FP16 study: BF16 mismatch grows and precedes collapse, FP16 stays stable; PG-Seq-IS in FP16 "
                 "matches the best BF16 method",
        "hypothesis": "With completions of max_completion_length tokens, GRPO in BF16 has a larger late mismatch "
                      "(k3) than in FP16, its k3 grows from the first to the last quarter of the run, it collapses "
                      "more often than FP16, and FP16 PG-Seq-IS ends within 5 points of the better BF16 method."},
}

PARTS: tuple[Part, ...] = (
    Part(1, "steps to > 95%: nvfp4 vs bf16 (AQN off)", "qerl", _nv("nvfp4", False), _nv("bf16", False),
         "steps_to_threshold", -1, "noninferior", STEP_MARGIN),
    Part(1, "held-out accuracy: nvfp4 vs bf16 (AQN off)", "qerl", _nv("nvfp4", False), _nv("bf16", False),
         "heldout", +1, "noninferior", ACC_MARGIN),
    Part(1, "early entropy: nvfp4 vs bf16 (AQN off)", "qerl", _nv("nvfp4", False), _nv("bf16", False),
         "early_entropy", +1, "better", ENTROPY_MARGIN),
    Part(2, "noisy-window entropy: AQN on vs off (nvfp4)", "qerl", _nv("nvfp4", True), _nv("nvfp4", False),
         "noisy_entropy", +1, "better", ENTROPY_MARGIN),
    Part(2, "noisy-window reward: AQN on vs off (nvfp4)", "qerl", _nv("nvfp4", True), _nv("nvfp4", False),
         "noisy_reward", +1, "better", ACC_MARGIN),
    Part(2, "noisy-window entropy: AQN on vs off (bf16)", "qerl", _nv("bf16", True), _nv("bf16", False),
         "noisy_entropy", +1, "better", ENTROPY_MARGIN),
    Part(2, "noisy-window reward: AQN on vs off (bf16)", "qerl", _nv("bf16", True), _nv("bf16", False),
         "noisy_reward", +1, "better", ACC_MARGIN),
    Part(3, "final: int8 + TIS vs bf16 rollouts", "flashrl", _fr("int8", "token_tis"), _fr("none", "none"),
         "final", +1, "equivalent", ACC_MARGIN),
    Part(3, "final: fp8 + TIS vs bf16 rollouts", "flashrl", _fr("fp8", "token_tis"), _fr("none", "none"),
         "final", +1, "equivalent", ACC_MARGIN),
    Part(3, "final: int8 without TIS below bf16 rollouts", "flashrl", _fr("int8", "none"), _fr("none", "none"),
         "final", -1, "better", ACC_MARGIN),
    Part(3, "final: fp8 without TIS below bf16 rollouts", "flashrl", _fr("fp8", "none"), _fr("none", "none"),
         "final", -1, "better", ACC_MARGIN),
    Part(4, "late k3: bf16 vs fp16 (GRPO)", "fp16", _fp("bf16", "grpo"), _fp("fp16", "grpo"),
         "k3_last", +1, "better", 0.0),
    Part(4, "k3 growth (last - first quarter), bf16 GRPO, vs 0", "fp16", _fp("bf16", "grpo"), None,
         "k3_growth", +1, "better", 0.0),
    Part(4, "collapse rate: bf16 vs fp16 (GRPO)", "fp16", _fp("bf16", "grpo"), _fp("fp16", "grpo"),
         "collapsed", +1, "better", 0.0),
    Part(4, "final: fp16 PG-Seq-IS vs the better bf16 method", "fp16", _fp("fp16", "pg_seq_is"), None,
         "final", +1, "equivalent", ACC_MARGIN, best_of=(_fp("bf16", "grpo"), _fp("bf16", "pg_seq_is"))),
)


def _norm(v: Any) -> str:
    return str(v).lower()


def matches(cell: dict[str, Any], sel: dict[str, Any]) -> bool:
    return all(k in cell and _norm(cell[k]) == _norm(v) for k, v in sel.items())


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
    from qerl_cli.bench.sanity import seed_scalars

    out: dict[Any, float] = {}
    for r in rows:
        status = str(r.get("status", "ok"))
        # a non-finite loss is a collapse (data); an error is not a training outcome
        if matches(r["cell"], sel) and (status == "ok" or status.startswith("non-finite")):
            v = seed_scalars(r).get(metric)
            if v is not None:
                out[r.get("seed")] = float(v)
    return out


def evaluate_part(part: Part, rows: Sequence[dict[str, Any]], n_boot: int = 10000) -> dict[str, Any]:
    from qerl_cli.bench.stats import VERDICTS, bootstrap_diff, mann_whitney, mean_ci, verdict

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
                           "a_stats": mean_ci(list(a.values())), "b_stats": mean_ci(list(b.values())) if b else None}
    if b is None:  # one-sample: A against zero
        av = [part.sign * v for v in a.values()]
        bs = bootstrap_diff(av, [0.0] * len(av), paired=True, n_boot=n_boot) if av else {"diff": None, "lo": None,
                                                                                           "hi": None, "paired": True}
        mw = {"u": None, "p": None, "method": None}
        bv: list[float] = []
    else:
        # pair on the seeds both cells ran (cells run as separate processes may finish different numbers)
        common = sorted(set(a) & set(b), key=str)
        paired = len(common) >= 2
        if paired:
            av, bv = [part.sign * a[s] for s in common], [part.sign * b[s] for s in common]
        else:
            av, bv = [part.sign * v for v in a.values()], [part.sign * v for v in b.values()]
        bs = bootstrap_diff(av, bv, paired=paired, n_boot=n_boot) if av and bv else \
            {"diff": None, "lo": None, "hi": None, "paired": paired}
        mw = mann_whitney(av, bv)
    # a bootstrap of one seed only repeats that seed (or the other side's spread): no verdict below two a side
    enough = len(av) >= 2 and (b is None or len(bv) >= 2)
    row.update({"diff": bs["diff"], "lo": bs["lo"], "hi": bs["hi"], "paired": bs["paired"], "p_mann_whitney": mw["p"],
                "n_a": len(a), "n_b": len(b) if b is not None else None,
                "verdict": verdict(bs["lo"], bs["hi"], part.kind, part.margin) if enough else VERDICTS[2]})
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
    """The evidence document: per group its cells (mean and 95% interval per seed scalar) and curves; per part
    its interval and verdict; per claim the combined verdict."""
    from qerl_cli.bench.sanity import summarize_cells
    from qerl_cli.bench.stats import combine

    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise QerlError(f"unknown evidence group(s) {', '.join(unknown)}: use {', '.join(GROUPS)}")
    merged = {g: merge_group(rs) for g, rs in groups.items() if rs}
    parts = [evaluate_part(p, merged[p.group]["results"], n_boot) for p in PARTS if p.group in merged]
    claims = []
    for cid, c in CLAIMS.items():
        ps = [p for p in parts if p["claim"] == cid]
        claims.append({"claim": cid, **c, "verdict": combine([p["verdict"] for p in ps]) if ps else "not run",
                       "parts": len(ps)})
    return {
        "schema": SCHEMA, "kind": "bench/evidence",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "meta": dict(meta or {}),
        "groups": {g: {"config": m["config"], "env": m.get("env"), "wall_s": m["wall_s"],
                       "cells": summarize_cells(m["results"]), "curves": curves(m["results"])}
                   for g, m in merged.items()},
        "parts": parts, "claims": claims,
        "margins": {"accuracy": ACC_MARGIN, "steps": STEP_MARGIN, "entropy": ENTROPY_MARGIN},
    }


def ci_text(s: dict[str, Any] | None, spec: str = SIG) -> str:
    if not s or s.get("mean") is None:
        return "-"
    if s.get("lo") is None:
        return f"{spec.format(s['mean'])} (n={s['n']})"
    return f"{spec.format(s['mean'])} [{spec.format(s['lo'])}, {spec.format(s['hi'])}]"


def markdown(ev: dict[str, Any]) -> str:
    """The cell tables and the verdict table as Markdown (docs/benchmarks.md, the terminal)."""
    lines: list[str] = []
    cols = ("steps_to_threshold", "final", "heldout", "early_entropy", "noisy_entropy", "noisy_reward",
            "noisy_applied_noise_norm", "k3_last", "k3_growth", "collapsed")
    for g, grp in ev["groups"].items():
        lines += [f"**{g}** (mean [95% interval] over seeds)", "",
                  "| cell | seeds | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
        for label, c in grp["cells"].items():
            lines.append(f"| {label} | {len(c['seeds'])} | " + " | ".join(ci_text(c["metrics"].get(k)) for k in cols)
                         + " |")
        lines.append("")
    lines += ["| claim | comparison (A vs B) | A | B | A - B, oriented [95% bootstrap] | paired | MW p | verdict |",
              "|---:|---|---|---|---|---|---:|---|"]
    for p in ev["parts"]:
        lines.append(f"| {p['claim']} | {p['name']} | {ci_text(p['a_stats'])} | {ci_text(p['b_stats'])} | "
                     f"{num(p['diff'], SIG)} [{num(p['lo'], SIG)}, {num(p['hi'], SIG)}] | "
                     f"{'yes' if p['paired'] else 'no'} | {num(p['p_mann_whitney'], '{:.2f}')} | {p['verdict']} |")
    lines += ["", "| claim | verdict |", "|---:|---|"]
    lines += [f"| {c['claim']}: {c['title']} | **{c['verdict']}** |" for c in ev["claims"]]
    return "\n".join(lines) + "\n"


def plot_curves(ev: dict[str, Any]) -> Any:
    """A matplotlib figure: per group, training accuracy (and entropy or k3) vs step, mean with a 95% band."""
    panels = [(g, m) for g in ev["groups"] for m in (("accuracy", "entropy") if g != "fp16" else ("accuracy", "k3"))]
    if not panels:
        return None
    ncols = 2
    nrows = (len(panels) + 1) // 2
    fig, axes = figure(nrows, ncols, figsize=(11, 3.2 * nrows), squeeze=False)
    for ax, (g, m) in zip(axes.flat, panels, strict=False):
        for label, c in ev["groups"][g]["curves"].items():
            s = c.get(m) or {}
            mean = s.get("mean") or []
            xs = [i + 1 for i, v in enumerate(mean) if v is not None]
            ys = [v for v in mean if v is not None]
            if not xs:
                continue
            line, = ax.plot(xs, ys, lw=1.2, label=f"{label} ({c['seeds']})")
            band = [(i + 1, lo, hi) for i, (lo, hi) in enumerate(zip(s["lo"], s["hi"], strict=True))
                    if lo is not None and hi is not None]
            if band:
                ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                                color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(f"{g}: {m} (mean, 95% band over seeds)", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if m == "k3":
            ax.set_yscale("log")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


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
    JSON last) and, with a run directory, record them under ``bench/evidence`` in its manifest."""
    from qerl_cli.manifest import RunDir, atomic_write_json, atomic_write_text, jsonable

    groups: dict[str, list[dict[str, Any]]] = {}
    for g, paths in inputs.items():
        for p in paths:
            p = Path(p)
            if not p.is_file():
                raise QerlError(f"evidence input {p} does not exist: give the sanity.json of a finished bench")
            try:
                groups.setdefault(g, []).append(json.loads(p.read_text()))
            except json.JSONDecodeError as exc:
                raise QerlError(f"evidence input {p} is not JSON ({exc.msg}): give a sanity.json") from None
    ev = build_evidence(groups, n_boot=n_boot, meta={**(meta or {}), "inputs": {g: [str(p) for p in ps]
                                                                                for g, ps in inputs.items()}})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = plot_curves(ev)
    if fig is not None:
        save_figure(fig, out / "evidence.png")
    atomic_write_text(out / "evidence.md", markdown(ev))
    atomic_write_json(out / "evidence.json", jsonable(ev))
    if run_dir is not None:
        harness.record(RunDir(run_dir), "evidence", config={"inputs": ev["meta"]["inputs"]},
                       outputs={"json": out / "evidence.json"},
                       metrics={f"claim{c['claim']}": c["verdict"] for c in ev["claims"]})
    for c in ev["claims"]:
        log(f"claim {c['claim']}: {c['verdict']}")
    return ev
