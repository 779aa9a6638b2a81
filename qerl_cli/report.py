"""`qerl report`: one self-contained HTML page (and its PNGs) from a run directory's manifest and outputs.

The page is the evidence a user looks at: training curves (reward, entropy, length, mismatch, AQN),
eval scores base vs trained with confidence intervals, and rollout throughput and memory. Every PNG
is embedded as a base64 data URI and the CSS is inline, so `index.html` opens offline and can be
mailed around alone. A stage the run does not have is an absent section with the command that
produces it. Every file is written atomically, the page last, so a killed report leaves no
half-written file.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.manifest import MANIFEST_NAME, RunDir, atomic_write_bytes, atomic_write_text, now_iso, read_regular_text
from qerl_cli.runlayout import eval_dir

REPORT_DIRNAME = "report"
INDEX_NAME = "index.html"

# Which command produces each section, shown where the section is absent.
PRODUCERS = {
    "quantize": "qerl quantize --run {run}",
    "train": "qerl train --run {run}",
    "eval": "qerl eval arith --run {run} --checkpoint base, then qerl eval arith --run {run} after training "
            "(or gsm8k, math500 for TASK)",
    "bench/rollout": "qerl bench rollout --run {run}",
    "bench/evidence": "qerl bench sanity --run {run} --seeds N ...  then  qerl bench evidence --run {run} "
                      "--input GROUP=SANITY_JSON (docs/evidence.md)",
}

_STEP_RE = re.compile(r"^step_(\d+)$")


# ------------------------------------------------------------------------------------------ reading


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of metrics.jsonl by step (metricsfile.read_metrics: a torn last line is skipped, damage refused)."""
    from qerl_cli.metricsfile import read_metrics

    # A resumed run may log a step twice; the later line is the one the run continued from.
    by_step = {int(r["step"]): r for r in read_metrics(path)}
    return [by_step[s] for s in sorted(by_step)]


def _number(v: Any) -> bool:
    """A finite int or float (not a bool, not NaN or inf): a value the page can draw and print."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict[str, Any]], key: str, positive: bool = False) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if _number(v) and (not positive or v > 0):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(read_regular_text(path))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _checkpoint_order(name: str) -> tuple[int, int, str]:
    if name == "base":
        return (0, 0, name)
    m = _STEP_RE.match(name)
    return (1, int(m.group(1)), name) if m else (2, 0, name)


def _eval_variant(data: dict[str, Any]) -> tuple[str, str]:
    """How a result was made beyond its task and checkpoint, as (label for the page, key suffix): the harness, the
    tool or environment, and the settings that differ from the default. Results are compared (base vs trained)
    only within one variant."""
    from qerl_cli.eval.harness import settings_suffix

    protocol = data.get("protocol") if isinstance(data.get("protocol"), dict) else {}
    settings = data.get("settings")
    if not isinstance(settings, dict):  # a result written before results named their settings
        sampling = protocol.get("sampling") if isinstance(protocol.get("sampling"), dict) else {}
        n = sampling.get("n", 1)
        settings = {"limit": protocol.get("limit"), "samples": n if n != 1 else None,
                    "temperature": sampling.get("temperature") if sampling.get("temperature", 0.0)
                    != (0.0 if n == 1 else 1.0) else None}
    settings = {k: v for k, v in settings.items() if v is not None and (_number(v) or v is True)}
    episodes = protocol.get("episodes") if isinstance(protocol.get("episodes"), dict) else {}
    harness = data.get("harness") if data.get("harness") not in (None, "builtin") else None
    parts = [str(x) for x in (harness, episodes.get("kind")) if x]
    suffix = "".join(f"-{x}" for x in parts)
    try:
        suffix += settings_suffix(settings)
    except (KeyError, TypeError, ValueError):  # a setting this qerl does not know: its own variant all the same
        suffix += "-" + "-".join(f"{k}{v}" for k, v in settings.items())
    parts += [k if v is True else f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in settings.items()]
    return ", ".join(parts), suffix


def _read_evals(run: RunDir, manifest: dict[str, Any], notes: list[str] | None = None) -> list[dict[str, Any]]:
    """Eval results: every parseable DIR/eval/*.json with scores, plus any a manifest record points at. A result
    whose accuracy is not a number in [0, 1] is left out, with a line in ``notes`` saying so."""
    paths: dict[Path, Path] = {}  # resolved (one entry per file) -> the path in the run
    for key, rec in manifest["stages"].items():
        if key.startswith("eval/") and rec.get("status") == "completed":
            rel = (rec.get("outputs") or {}).get("result")
            if isinstance(rel, str):
                p = run.abs(rel, f"{key} outputs.result")
                paths[p.resolve()] = p
    edir = eval_dir(run)
    if edir.is_dir():
        for p in sorted(edir.glob("*.json")):
            paths.setdefault(p.resolve(), run.inside(p))
    out = []
    for p in (paths[k] for k in sorted(paths)):
        data = _load_json(p)
        if not data or not isinstance(data.get("scores"), dict) or not data["scores"]:
            continue
        ckpt = data.get("checkpoint")
        name = ckpt.get("name") if isinstance(ckpt, dict) else ckpt
        primary = data.get("primary") or next(iter(data["scores"]))
        score = data["scores"].get(primary) if isinstance(primary, str) else None
        acc = score.get("accuracy") if isinstance(score, dict) else None
        if not isinstance(acc, dict) or "mean" not in acc:
            continue
        bad = [k for k in ("mean", "low", "high") if k in acc and not (_number(acc[k]) and 0 <= acc[k] <= 1)]
        if bad:
            if notes is not None:
                notes.append(f"{run.rel(p)} left out: its accuracy {bad[0]} is {acc[bad[0]]!r}, not a number "
                             "between 0 and 1 (a damaged or hand-edited result: run its `qerl eval` again)")
            continue
        label, suffix = _eval_variant(data)
        out.append({"task": str(data.get("task", "?")), "checkpoint": str(name or "?"), "primary": primary,
                    "accuracy": acc, "file": run.rel(p), "harness": data.get("harness"), "variant": label,
                    "group": f"{data.get('task', '?')}" + (f" ({label})" if label else ""),
                    "key": f"{data.get('task', '?')}-{name or '?'}{suffix}"})
    out.sort(key=lambda e: (e["task"], e["group"], _checkpoint_order(e["checkpoint"])))
    return out


# ------------------------------------------------------------------------------------------ plots


def _figure(nrows: int = 1, ncols: int = 1, width: float = 6.4, height: float = 3.6):
    # The object API with an Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols if ncols > 1 else width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _png(fig) -> bytes:  # noqa: ANN001 - matplotlib.figure.Figure
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _line_plot(ax, rows, keys: list[tuple[str, str]], ylabel: str, log: bool = False) -> bool:  # noqa: ANN001
    drawn = False
    for i, (key, label) in enumerate(keys):
        xs, ys = _series(rows, key, positive=log)
        if xs:
            # Dashed later series, so one that equals the first (reward == accuracy) stays visible.
            ax.plot(xs, ys, marker="o", markersize=3, label=label, linestyle="-" if i == 0 else "--")
            drawn = True
    if not drawn:
        return False
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if len(keys) > 1:
        ax.legend(fontsize=8)
    return True


def _train_plots(rows: list[dict[str, Any]]) -> dict[str, tuple[str, Callable[[], bytes | None]]]:
    """name -> (caption, draw). Each draw returns PNG bytes, or None when the metrics lack that series."""

    def simple(keys: list[tuple[str, str]], ylabel: str, title: str, log: bool = False):
        def draw() -> bytes | None:
            fig, (ax,) = _figure()
            if not _line_plot(ax, rows, keys, ylabel, log=log):
                return None
            ax.set_title(title)
            return _png(fig)
        return draw

    def aqn() -> bytes | None:
        fig, (a1, a2) = _figure(1, 2, width=4.2)
        ok1 = _line_plot(a1, rows, [("aqn/sigma", "sigma")], "AQN sigma")
        ok2 = _line_plot(a2, rows, [("aqn/noise_norm", "noise norm")], "AQN noise norm")
        if not (ok1 or ok2):
            return None
        a1.set_title("AQN noise scale")
        a2.set_title("AQN noise norm")
        return _png(fig)

    def throughput() -> bytes | None:
        has_mem = bool(_series(rows, "memory/peak_gb")[0])
        fig, axes = _figure(1, 2 if has_mem else 1, width=4.2 if has_mem else 6.4)
        if not _line_plot(axes[0], rows, [("timing/rollout_tokens_per_s", "rollout tokens/s")], "tokens/s"):
            return None
        axes[0].set_title("Rollout throughput during training")
        if has_mem:
            _line_plot(axes[1], rows, [("memory/peak_gb", "peak GB")], "peak memory (GB)")
            axes[1].set_title("Peak GPU memory")
        return _png(fig)

    # with a 0/1 correctness reward the two series coincide: one line, said so, instead of one hidden under the other
    pairs = [(r["reward"], r["accuracy"]) for r in rows if "reward" in r and "accuracy" in r]
    same = bool(pairs) and all(a == b for a, b in pairs)
    reward_keys = [("reward", "reward = accuracy")] if same else [("reward", "reward"), ("accuracy", "accuracy")]
    reward_caption = ("Reward and accuracy vs step (identical here: the reward is 1 for a correct answer, else 0)"
                      if same else "Reward and accuracy vs step")
    aqn_on = any(_number(r.get("aqn/sigma")) and r["aqn/sigma"] > 0 for r in rows)
    k3_caption = "Training-inference mismatch k3 vs step (log scale)" + (
        ". With AQN the rollout policy carries the noise and the training forward does not, so k3 jumps when the "
        "noise switches on (AQN stage 1) and follows sigma after" if aqn_on else "")
    return {
        "train_reward": (reward_caption, simple(reward_keys, "mean over batch", "Reward and accuracy")),
        "train_entropy": ("Entropy vs step (exploration)",
                          simple([("entropy", "entropy")], "mean token entropy (nats)", "Policy entropy")),
        "train_length": ("Response length vs step",
                         simple([("completions/mean_length", "mean"), ("completions/max_length", "max")],
                                "tokens", "Completion length")),
        "train_mismatch": (k3_caption, simple([("sampling/k3", "k3")], "k3 (log)", "Mismatch k3", log=True)),
        "train_aqn": ("AQN sigma and noise norm vs step", aqn),
        "train_episodes": ("Episodes with a tool or environment: model turns per episode and the share of tool calls "
                           "that failed, vs step",
                           simple([("episodes/turns_mean", "turns per episode"),
                                   ("episodes/tool_error_rate", "tool error rate")], "per episode / fraction",
                                  "Turns and tool errors")),
        "train_throughput": ("Rollout tokens/s (and peak memory) vs step", throughput),
    }


def _episode_pairs(rows: list[dict[str, Any]], numbers: dict[str, Any]) -> list[tuple[str, Any]]:
    """Turns per episode (last step) and tool errors (all steps) of a run that used a tool or an environment."""
    turns = [r["episodes/turns_mean"] for r in rows if _number(r.get("episodes/turns_mean"))]
    if not turns:
        return []
    errors = sum(float(r["episodes/tool_errors"]) for r in rows if _number(r.get("episodes/tool_errors")))
    numbers["train/episodes/turns_mean"] = turns[-1]
    numbers["train/episodes/tool_errors"] = errors
    return [("last turns per episode", turns[-1]), ("tool errors (all steps)", int(errors))]


def _eval_plot(evals: list[dict[str, Any]]) -> bytes:
    import numpy as np

    # one group of bars per task and variant: results made with other settings never stand side by side
    tasks = sorted({e["group"] for e in evals})
    ckpts = sorted({e["checkpoint"] for e in evals}, key=_checkpoint_order)
    fig, (ax,) = _figure(width=max(5.0, 1.6 + 1.4 * len(tasks) * max(1, len(ckpts)) * 0.6))
    width = 0.8 / len(ckpts)
    x = np.arange(len(tasks))
    for i, ck in enumerate(ckpts):
        means, lo, hi, pos = [], [], [], []
        for j, task in enumerate(tasks):
            for e in evals:
                if e["group"] == task and e["checkpoint"] == ck:
                    a = e["accuracy"]
                    m = 100 * a["mean"]
                    means.append(m)
                    lo.append(max(0.0, m - 100 * a.get("low", a["mean"])))
                    hi.append(max(0.0, 100 * a.get("high", a["mean"]) - m))
                    pos.append(x[j] + (i - (len(ckpts) - 1) / 2) * width)
        if not pos:
            continue
        bars = ax.bar(pos, means, width * 0.95, yerr=[lo, hi], capsize=4, label=ck)
        ax.bar_label(bars, labels=[f"{m:.1f}" for m in means], fontsize=8, padding=2, label_type="center")
    ax.set_xticks(x, tasks)
    ax.set_ylabel("accuracy % (95% CI)")
    ax.set_ylim(0, 105)
    ax.set_title("Eval: base vs trained")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _png(fig)


def _bench_plot(bench: dict[str, Any]) -> bytes | None:
    results = [r for r in bench.get("results", []) if isinstance(r, dict) and r.get("status", "ok") == "ok"]
    if not results:
        return None
    labels = [f"{r.get('format', '?')}\nb{r.get('batch', '?')}" for r in results]
    fig, (a1, a2) = _figure(1, 2, width=4.2)
    x = list(range(len(results)))
    w = 0.4
    dec = [float(r.get("decode_tok_s") or 0) for r in results]
    e2e = [float(r.get("e2e_tok_s") or 0) for r in results]
    a1.bar([i - w / 2 for i in x], dec, w, label="decode")
    a1.bar([i + w / 2 for i in x], e2e, w, label="end-to-end")
    a1.set_xticks(x, labels)
    a1.set_ylabel("tokens/s")
    a1.set_title("Rollout throughput")
    a1.legend(fontsize=8)
    a1.grid(True, axis="y", alpha=0.3)
    # Peak memory where measured (GPU); on CPU only the resident weight size is known.
    peak = [r.get("peak_mem_gib") for r in results]
    if any(isinstance(p, (int, float)) for p in peak):
        a2.bar(x, [float(p or 0) for p in peak], 0.6, color="tab:red")
        a2.set_xticks(x, labels)
        a2.set_ylabel("peak memory (GiB)")
        a2.set_title("Rollout peak memory")
    else:
        models = bench.get("models") or {}
        names = list(models)
        a2.bar(range(len(names)), [float((models[n] or {}).get("resident_gib") or 0) for n in names], 0.6,
               color="tab:red")
        a2.set_xticks(range(len(names)), names)
        a2.set_ylabel("resident weights + LoRA (GiB)")
        a2.set_title("Model memory (no peak measured)")
    a2.grid(True, axis="y", alpha=0.3)
    return _png(fig)


def _quantize_plot(layers: list[dict[str, Any]]) -> bytes | None:
    vals = [float(x["rel_fro"]) for x in layers if isinstance(x, dict) and isinstance(x.get("rel_fro"), (int, float))]
    if not vals:
        return None
    fig, (ax,) = _figure(height=3.0)
    ax.hist(vals, bins=min(40, max(5, len(vals) // 4)), color="tab:purple")
    ax.set_xlabel("relative Frobenius error ||W - Q(W)|| / ||W||")
    ax.set_ylabel("layers")
    ax.set_title(f"Quantization error over {len(vals)} layers")
    return _png(fig)


# ------------------------------------------------------------------------------------------ html

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#1c1e21}
header{background:#1f3a5f;color:#fff;padding:16px 28px}
header h1{margin:0;font-size:22px} header p{margin:4px 0 0;opacity:.85;font-size:13px}
main{max-width:1100px;margin:0 auto;padding:12px 28px 40px}
section{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:14px 20px;margin:16px 0}
h2{font-size:18px;margin:4px 0 10px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border-bottom:1px solid #e6e8eb;padding:4px 10px;text-align:left}
th{background:#f0f2f5} td.num{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:8px 0;display:inline-block;vertical-align:top;width:49%} figure.wide{width:98%}
figure img{width:100%;border:1px solid #eee}
figcaption{font-size:12px;color:#555}
.missing{color:#8a5a00;background:#fff7e0;border-color:#f0d58a}
.status-completed{color:#17803d;font-weight:600} .status-failed,.status-interrupted{color:#b42318;font-weight:600}
.status-running{color:#8a5a00;font-weight:600}
code{background:#f0f2f5;padding:1px 4px;border-radius:3px}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _kv_table(pairs: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{_esc(k)}</th><td class='num'>{_esc(_fmt(v))}</td></tr>" for k, v in pairs)
    return f"<table>{body}</table>"


def _img(png: bytes, caption: str, name: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    # Two single-panel plots per row; a multi-panel one (wider PNG, width in the IHDR chunk) gets a row.
    wide = " class='wide'" if int.from_bytes(png[16:20], "big") > 700 else ""
    return (f"<figure{wide}><img alt='{_esc(caption)}' data-plot='{_esc(name)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{_esc(caption)} &middot; {_esc(name)}.png</figcaption></figure>")


def _missing(title: str, stage: str, run: Path) -> str:
    cmd = PRODUCERS[stage].format(run=run)
    return (f"<section class='missing' id='{_esc(stage.replace('/', '-'))}'><h2>{_esc(title)}</h2>"
            f"<p>Not in this run: <code>{_esc(cmd)}</code> produces it.</p></section>")


# ------------------------------------------------------------------------------------------ build


def _evidence_section(run: RunDir, stages: dict[str, Any], pngs: dict[str, bytes],
                      numbers: dict[str, Any]) -> str | None:
    """The Evidence section from the ``bench/evidence`` record: what the arms start from, the verdict table (with
    the fewest pairs and the seeds that would decide what is undecided), the compared pairs (interval, method,
    sign-flip p, verdict, seeds needed; levels beside gains), each group's training-set rule and cells (mean and 95%
    interval over seeds), and the curves with 95% bands; None when the run has none."""
    rec = stages.get("bench/evidence")
    if not rec or rec.get("status") != "completed":
        return None
    rel = ((rec.get("outputs") or {}).get("json") or {}).get("path")
    ev = _load_json(run.abs(rel, "bench/evidence outputs.json.path")) if rel else None
    if not ev or not isinstance(ev.get("claims"), list):
        return None
    from qerl_cli.plots import plot_curves
    from qerl_cli.tables import CELL_COLUMNS, ci_text, part_interval_text, seeds_text, verdict_text

    def cell(v: Any) -> str:
        return f"<td>{_esc(v)}</td>"

    def num_cell(v: Any) -> str:
        return f"<td class='num'>{_esc('-' if v is None else v)}</td>"

    body = ("<p>Both arms start from the embedded model, a Q4_1 GGUF: &quot;bf16&quot; is Q4_1 dequantized to bf16, "
            "&quot;nvfp4&quot; is Q4_1 re-quantized to NVFP4 (docs/evidence.md). Intervals are 95%: paired t "
            "intervals over seeds (the bootstrap only from 30 pairs), the exact sign-flip p beside them; "
            "&quot;(t only)&quot; marks a verdict the sign-flip test does not reach at that number of pairs.</p>")
    claims = "".join(
        f"<tr><td class='num'>{_esc(c['claim'])}</td>{cell(c['title'])}{cell(c['hypothesis'])}"
        f"<td><b>{_esc(c['verdict'])}</b>{_esc(' (t only: ' + '; '.join(c['t_only']) + ')' if c.get('t_only') else '')}"
        f"</td>{num_cell(c.get('min_pairs'))}"
        f"{cell({True: 'yes', False: 'no', None: '-'}[c.get('all_meet_target')])}"
        f"{num_cell(c.get('seeds_to_decide_rest'))}</tr>" for c in ev["claims"])
    body += ("<table><tr><th>claim</th><th>what</th><th>hypothesis (stated before the run)</th><th>verdict</th>"
             "<th>fewest pairs</th><th>every part: 8 pairs or enough by its spread</th>"
             f"<th>seeds to decide the undecided parts</th></tr>{claims}</table>")
    trs = ""
    for p in ev.get("parts", []):
        trs += (f"<tr><td class='num'>{_esc(p['claim'])}</td>{cell(p['name'])}{cell(ci_text(p.get('a_stats')))}"
                f"{cell(ci_text(p.get('b_stats')))}<td class='num'>{_esc(part_interval_text(p))}</td>"
                f"{cell(p.get('method') or '-')}{num_cell(p.get('n'))}"
                f"{num_cell(None if p.get('p_sign_flip') is None else _fmt(p['p_sign_flip']))}{cell(verdict_text(p))}"
                f"{cell(p.get('power', ''))}</tr>")
        for m, lv in (p.get("levels") or {}).items():
            trs += (f"<tr><td></td>{cell('level beside it: ' + m)}{cell(ci_text(lv.get('a')))}"
                    f"{cell(ci_text(lv.get('b')))}<td colspan='6'></td></tr>")
    body += ("<h3>Compared pairs</h3><table><tr><th>claim</th><th>comparison</th><th>A: mean [95%]</th>"
             "<th>B: mean [95%]</th><th>A - B, oriented [95%]</th><th>method</th><th>pairs</th><th>sign-flip p</th>"
             f"<th>verdict</th><th>seeds needed</th></tr>{trs}</table>")
    for g, grp in (ev.get("groups") or {}).items():
        cols = CELL_COLUMNS.get(g, CELL_COLUMNS["qerl"])
        head = "".join(f"<th>{_esc(c)}</th>" for c in cols)
        rows = "".join(f"<tr>{cell(label)}<td class='num'>{_esc(seeds_text(c))}</td>"
                       + "".join(cell(ci_text((c.get('metrics') or {}).get(k))) for k in cols) + "</tr>"
                       for label, c in (grp.get("cells") or {}).items())
        rule = grp.get("selection_rule")
        body += (f"<h3>Cells: {_esc(g)}</h3>" + (f"<p>Training set: {_esc(rule)}.</p>" if rule else "")
                 + f"<table><tr><th>cell</th><th>seeds</th>{head}</tr>{rows}</table>")
    fig = plot_curves(ev)
    if fig is not None:
        import matplotlib.pyplot as plt

        pngs["evidence_curves"] = _png(fig)
        plt.close(fig)
        body += _img(pngs["evidence_curves"], "Curves per cell: mean and 95% band over seeds", "evidence_curves")
    src = ((ev.get("analysis") or {}).get("sources_sha256") or {})
    if src:
        body += f"<p>Analysis sources (sha256): {_esc(', '.join(f'{m} {h}' for m, h in src.items()))}.</p>"
    for c in ev["claims"]:
        numbers[f"evidence/claim{c['claim']}"] = c["verdict"]
    return f"<section id='bench-evidence'><h2>Evidence</h2>{body}</section>"


@dataclass
class _Page:
    """What the report sections build up: HTML parts in page order, PNGs by name, each section's state (present,
    or the command that produces it) and the headline numbers."""

    run: RunDir
    parts: list[str] = field(default_factory=list)
    pngs: dict[str, bytes] = field(default_factory=dict)
    sections: dict[str, str] = field(default_factory=dict)
    numbers: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the page left out, and why

    def present(self, stage: str, html_: str) -> None:
        self.parts.append(html_)
        self.sections[stage] = "present"

    def missing(self, title: str, stage: str) -> None:
        self.parts.append(_missing(title, stage, self.run.path))
        self.sections[stage] = PRODUCERS[stage].format(run=self.run.path)

    def add_png(self, name: str, png: bytes, caption: str) -> str:
        self.pngs[name] = png
        return _img(png, caption, name)


def _open_run(run_dir: Path) -> RunDir:
    """The run directory, or a QerlError saying why it is not a qerl run."""
    run_path = Path(run_dir).expanduser()
    if not run_path.is_dir():
        raise QerlError(f"run directory {run_path} does not exist: pass the --run directory of a qerl run")
    if not (run_path / MANIFEST_NAME).is_file():
        raise QerlError(f"{run_path} has no {MANIFEST_NAME}: it is not a qerl run; run `qerl quantize --run "
                        f"{run_path}` first")
    return RunDir(run_path, create=False)


def _report_dir(run: RunDir, out_dir: Path | None) -> Path:
    out = Path(out_dir).expanduser() if out_dir is not None else run.inside(REPORT_DIRNAME)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QerlError(f"cannot create report directory {out}: {exc.strerror or exc}") from exc
    return out


def _stages_section(page: _Page, stages: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The table of stages; returns each stage's status, duration and finish time."""
    stage_status = {}
    for key, rec in stages.items():
        # `record` turns a stale 'running' (its process is gone) into 'interrupted'.
        status = (page.run.record(key) or rec).get("status", "?")
        stage_status[key] = {"status": status, "duration_s": rec.get("duration_s"), "finished": rec.get("finished")}
    rows_html = "".join(
        f"<tr><td>{_esc(k)}</td><td class='status-{_esc(v['status'])}'>{_esc(v['status'])}</td>"
        f"<td class='num'>{_esc(_fmt(v['duration_s']))}</td><td>{_esc(v['finished'] or '')}</td></tr>"
        for k, v in stage_status.items())
    page.parts.append("<section id='stages'><h2>Stages</h2><table><tr><th>stage</th><th>status</th>"
                      f"<th>duration (s)</th><th>finished</th></tr>{rows_html}</table></section>")
    return stage_status


def _quantize_section(page: _Page, q: dict[str, Any] | None) -> None:
    if not q:
        page.missing("Quantization", "quantize")
        return
    m = q.get("metrics") or {}
    pairs = [(k, m[k]) for k in ("format", "layers_quantized", "group_size", "rel_fro_mean", "rel_fro_max",
                                 "bytes_before_bf16", "bytes_after", "compression") if k in m]
    page.numbers.update({f"quantize/{k}": v for k, v in pairs})
    body = _kv_table(pairs)
    png = _quantize_plot((q.get("extra") or {}).get("layers") or [])
    if png:
        body += page.add_png("quantize_error", png, "Per-layer quantization error")
    page.present("quantize", f"<section id='quantize'><h2>Quantization</h2>{body}</section>")


def _train_pairs(cfg: dict[str, Any], rows: list[dict[str, Any]], numbers: dict[str, Any]) -> list[tuple[str, Any]]:
    """The training table: the config's main options, then the last logged step's metrics."""
    pairs = [(k, cfg[k]) for k in ("algo", "task", "steps", "batch_prompts", "num_generations",
                                   "max_completion_length", "lr", "lora_rank", "precision", "correction")
             if k in cfg]
    pairs += [(k, cfg[k]) for k in ("tools", "env", "max_turns", "max_episode_tokens") if cfg.get(k) and
              (cfg.get("tools") or cfg.get("env"))]
    if rows:
        last = rows[-1]
        pairs += [("steps logged", len(rows))]
        for k in ("reward", "accuracy", "entropy", "completions/mean_length", "sampling/k3"):
            if _number(last.get(k)):
                pairs.append((f"last {k}", last[k]))
                numbers[f"train/{k}"] = last[k]
        numbers["train/steps"] = len(rows)
        pairs += _episode_pairs(rows, numbers)
    return pairs


def _checkpoints_table(checkpoints: list[dict[str, Any]]) -> str:
    trs = "".join(
        f"<tr><td>step_{c['step']}</td><td>{_esc(c['kind'])}</td><td class='num'>{c['files']}</td>"
        f"<td class='num'>{c['bytes'] / 2**20:.1f}</td>"
        f"<td>{'sha256 of every file' if c['sha256_verified'] else 'older layout: weights only'}</td></tr>"
        for c in checkpoints)
    return ("<h3>Checkpoints (verified)</h3><table><tr><th>checkpoint</th><th>kind</th><th>files</th>"
            f"<th>MiB</th><th>verified</th></tr>{trs}</table>")


def _train_section(page: _Page, t: dict[str, Any] | None) -> None:
    from qerl_cli.train.checkpointing import verify_all

    metrics_rel = ((t or {}).get("outputs") or {}).get("metrics") or "train/metrics.jsonl"
    rows = _read_metrics(page.run.abs(metrics_rel, "train outputs.metrics"))
    checkpoints = verify_all(page.run)  # every file against its recorded sha256; a damaged one stops the report
    if not (t or rows):
        page.missing("Training", "train")
        return
    body = _kv_table(_train_pairs((t or {}).get("config") or {}, rows, page.numbers))
    if rows:
        for name, (caption, draw) in _train_plots(rows).items():
            png = draw()
            if png:
                body += page.add_png(name, png, caption)
    else:
        body += f"<p>No metrics in <code>{_esc(metrics_rel)}</code> yet.</p>"
    if checkpoints:
        body += _checkpoints_table(checkpoints)
        page.numbers["train/checkpoints_verified"] = len(checkpoints)
    page.present("train", f"<section id='train'><h2>Training</h2>{body}</section>")


def _eval_section(page: _Page, manifest: dict[str, Any]) -> None:
    notes: list[str] = []
    evals = _read_evals(page.run, manifest, notes)
    page.notes += notes
    if not evals:
        page.missing("Evaluation", "eval")
        return
    trs = "".join(
        f"<tr><td>{_esc(e['task'])}</td><td>{_esc(e['variant'] or 'default')}</td><td>{_esc(e['checkpoint'])}</td>"
        f"<td>{_esc(e['primary'])}</td>"
        f"<td class='num'>{100 * e['accuracy']['mean']:.1f}</td>"
        f"<td class='num'>[{100 * e['accuracy'].get('low', 0):.1f}, {100 * e['accuracy'].get('high', 0):.1f}]"
        f"</td><td class='num'>{_esc(e['accuracy'].get('n', ''))}</td><td>{_esc(e['file'])}</td></tr>"
        for e in evals)
    body = ("<table><tr><th>task</th><th>settings</th><th>checkpoint</th><th>scorer</th><th>accuracy %</th>"
            f"<th>95% CI</th><th>n</th><th>file</th></tr>{trs}</table>")
    body += "".join(f"<p class='missing'>{_esc(n)}</p>" for n in notes)
    body += page.add_png("eval_scores", _eval_plot(evals), "Eval accuracy per checkpoint with 95% CI; results made "
                         "with other settings (a --limit, samples, a tool) are a group of their own")
    for e in evals:
        page.numbers[f"eval/{e['key']}"] = e["accuracy"]["mean"]
    page.present("eval", f"<section id='eval'><h2>Evaluation</h2>{body}</section>")


def _bench_rollout_section(page: _Page, b: dict[str, Any] | None) -> None:
    bench_rel = (((b or {}).get("outputs") or {}).get("json") or {}).get("path") or "bench/rollout.json"
    bench = _load_json(page.run.abs(bench_rel, "bench/rollout outputs.json.path")) \
        if (b is None or b.get("status") == "completed") else None
    png = _bench_plot(bench) if bench else None
    if not (bench and png):
        page.missing("Rollout benchmark", "bench/rollout")
        return
    trs = "".join(
        f"<tr><td>{_esc(r.get('format'))}</td><td class='num'>{_esc(r.get('batch'))}</td>"
        f"<td class='num'>{_esc(_fmt(r.get('decode_tok_s')))}</td><td class='num'>{_esc(_fmt(r.get('e2e_tok_s')))}"
        f"</td><td class='num'>{_esc(_fmt(r.get('peak_mem_gib')))}</td></tr>"
        for r in bench.get("results", []) if isinstance(r, dict))
    body = ("<table><tr><th>format</th><th>batch</th><th>decode tok/s</th><th>e2e tok/s</th>"
            f"<th>peak GiB</th></tr>{trs}</table>")
    body += page.add_png("bench_rollout", png, "Rollout tokens/s and memory (qerl bench rollout)")
    for r in bench.get("results", []):
        if isinstance(r, dict) and isinstance(r.get("decode_tok_s"), (int, float)):
            page.numbers[f"bench/{r.get('format')}/b{r.get('batch')}/decode_tok_s"] = r["decode_tok_s"]
    page.present("bench/rollout", f"<section id='bench-rollout'><h2>Rollout benchmark</h2>{body}</section>")


def _evidence(page: _Page, stages: dict[str, Any]) -> None:
    ev_html = _evidence_section(page.run, stages, page.pngs, page.numbers)
    if ev_html:
        page.present("bench/evidence", ev_html)
    else:
        page.missing("Evidence", "bench/evidence")


def _write_page(page: _Page, out: Path, created: str) -> tuple[Path, dict[str, Path]]:
    """Write the PNGs, then index.html (last: a page only exists once every picture it names does)."""
    run = page.run
    html_page = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width,initial-scale=1'><title>qerl report: {_esc(run.path.name)}"
        f"</title><style>{_CSS}</style></head><body><header><h1>qerl report &mdash; {_esc(run.path.name)}</h1>"
        f"<p>{_esc(run.path.resolve())} &middot; generated {_esc(created)}</p></header><main>"
        + "".join(page.parts) + "</main></body></html>\n"
    )
    plots = {}
    for name, data in page.pngs.items():
        path = out / f"{name}.png"
        atomic_write_bytes(path, data)
        plots[name] = path
    index = out / INDEX_NAME
    atomic_write_text(index, html_page)
    return index, plots


def build_report(run_dir: Path, out_dir: Path | None = None) -> dict[str, Any]:
    """Write `out_dir/index.html` (default DIR/report) and its PNGs; return what was found and written.

    The result: run, out_dir, html (path), plots (name -> path), stages (key -> status, duration_s),
    sections (name -> present, or the command that produces it), numbers (label -> value).
    """
    run = _open_run(run_dir)
    manifest = run.read()
    stages = manifest["stages"]
    out = _report_dir(run, out_dir)
    page = _Page(run)
    stage_status = _stages_section(page, stages)
    _quantize_section(page, stages.get("quantize"))
    _train_section(page, stages.get("train"))
    _eval_section(page, manifest)
    _bench_rollout_section(page, stages.get("bench/rollout"))
    _evidence(page, stages)
    created = now_iso()
    index, plots = _write_page(page, out, created)
    return {"run": run.path, "out_dir": out, "html": index, "plots": plots, "stages": stage_status,
            "sections": page.sections, "numbers": page.numbers, "notes": page.notes, "created": created}


def render_summary(result: dict[str, Any]):  # noqa: ANN201 - rich.console.Group
    """Terminal summary of a build_report result: stages with status, key numbers, absent sections, paths."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    stages = Table(title=f"qerl report · {result['run']}")
    stages.add_column("stage")
    stages.add_column("status")
    stages.add_column("duration s", justify="right")
    colors = {"completed": "green", "failed": "red", "interrupted": "red", "running": "yellow"}
    for key, st in result["stages"].items():
        c = colors.get(st["status"], "white")
        stages.add_row(key, f"[{c}]{st['status']}[/{c}]", _fmt(st["duration_s"]) if st["duration_s"] is not None
                       else "")
    nums = Table(title="key numbers")
    nums.add_column("metric")
    nums.add_column("value", justify="right")
    for k, v in result["numbers"].items():
        pct = k.startswith("eval/") or k.endswith(("/reward", "/accuracy"))
        nums.add_row(k, f"{100 * v:.1f}%" if pct and isinstance(v, float) else _fmt(v))
    missing = Table(title="absent sections", show_header=False)
    missing.add_column("section")
    missing.add_column("produce with")
    for name, what in result["sections"].items():
        if what != "present":
            missing.add_row(name, what)
    items: list[Any] = [stages, nums]
    if missing.row_count:
        items.append(missing)
    items += [Text(f"note: {n}") for n in result.get("notes", ())]
    items.append(f"[bold]report[/bold] {result['html']}  ({len(result['plots'])} plots)")
    return Group(*items)
