"""Figures on the file-only backend, and the evidence study's curves (mean and 95% band over seeds). A neutral
module: the benches (qerl_cli/bench/) and the run report (qerl_cli/report.py) both draw with it, so the report needs
nothing of the benches.
"""

from __future__ import annotations

from typing import Any


def figure(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``plt.subplots(...)`` on the file-only backend (benches run on machines without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


PANELS = {"qerl": ("accuracy", "sampling_entropy"), "flashrl": ("accuracy", "k3"), "fp16": ("accuracy", "k3"),
          "moe": ("reward", "replay_disagreement"), "w4a8": ("reward", "k3")}


def plot_curves(ev: dict[str, Any]) -> Any:
    """A matplotlib figure: per group, training accuracy (and sampling entropy or k3) vs step, mean with a 95%
    band."""
    panels = [(g, m) for g in ev["groups"] for m in PANELS.get(g, ("accuracy", "entropy"))]
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
