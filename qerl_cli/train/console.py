"""The training console: a live panel led by reward, accuracy, length and mismatch (not the loss,
which is ~0 by construction in GRPO), with a progress bar and ETA. Plain lines when not a terminal."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from qerl_cli.train.config import TrainConfig

LEAD = (
    ("reward", "reward", "{:.3f}"),
    ("accuracy", "accuracy", "{:.1%}"),
    ("completions/mean_length", "length", "{:.1f}"),
    ("sampling/k3", "mismatch k3", "{:.2e}"),
    ("entropy", "entropy", "{:.3f}"),
    ("aqn/sigma", "AQN sigma", "{:.1e}"),
    ("clip_ratio", "clip ratio", "{:.3f}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    ("timing/rollout_tokens_per_s", "rollout tok/s", "{:.0f}"),
)


def _fmt(metrics: dict[str, Any], key: str, fmt: str) -> str:
    v = metrics.get(key)
    if v is None:
        return "-"
    try:
        return fmt.format(v)
    except (TypeError, ValueError):
        return str(v)


class TrainConsole:
    def __init__(self, console: Console, cfg: TrainConfig) -> None:
        self.console = console
        self.cfg = cfg
        self.live: Live | None = None
        self.progress = Progress(TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), console=console)
        self.task_id = self.progress.add_task("train", total=cfg.steps)
        self.first = self.last = None  # type: dict[str, Any] | None
        self.t0 = time.perf_counter()

    def __enter__(self) -> TrainConsole:
        parts = [self.cfg.algo, self.cfg.task, self.cfg.precision]
        parts += ["AQN"] if self.cfg.aqn else []
        parts += [self.cfg.correction] if self.cfg.correction != "none" else []
        title = "qerl train · " + " · ".join(parts)
        self.console.print(f"[bold]{title}[/]")
        if self.console.is_terminal:
            self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def _render(self) -> Group:
        # one row per metric (first step, latest step): ~45 columns whatever the terminal, where one column per
        # metric needed ~130 and rich cut it to "…" at 80
        table = Table(show_header=True, header_style="bold", expand=False)
        table.add_column("metric")
        rows = [(name, m) for name, m in (("first", self.first), ("now", self.last)) if m is not None]
        for name, _ in rows:
            table.add_column(name, justify="right")
        for key, label, fmt in LEAD:
            table.add_row(label, *(_fmt(m, key, fmt) for _, m in rows))
        return Group(Panel(table, title="metrics", expand=False), self.progress)

    def update(self, metrics: dict[str, Any]) -> None:
        if self.first is None:
            self.first = metrics
        self.last = metrics
        self.progress.update(self.task_id, completed=metrics.get("step", 0))
        if self.live is not None:
            self.live.update(self._render())
        else:
            parts = " ".join(f"{label}={_fmt(metrics, k, f)}" for k, label, f in LEAD[:6])
            self.console.print(f"step {metrics.get('step')}/{self.cfg.steps} {parts}", highlight=False)

    def summary(self, result: Any) -> None:
        self.console.print(
            f"trained {result.steps_done} steps in {time.perf_counter() - self.t0:.0f}s; checkpoint "
            f"[bold]{escape(str(result.checkpoint))}[/]; metrics in {escape(str(result.run))}/train/metrics.jsonl")
        note = training_scope_note(self.cfg)
        if note:
            self.console.print(note, highlight=False)


def training_scope_note(cfg: TrainConfig) -> str | None:
    """Say when training covered less than `qerl eval` scores (the quick preset trains on arith level 1 only)."""
    if not cfg.task.startswith("arith") or cfg.task_level in (None, "mixed"):
        return None
    from qerl_cli.tasks.arith import MEASURED_LEVELS

    levels = f"{MEASURED_LEVELS[0]}-{MEASURED_LEVELS[-1]}"
    return (f"note: trained on arith level {cfg.task_level} only; `qerl eval arith` scores levels {levels}, "
            "so most of what it measures is harder than what was trained")
