"""The training console: a live panel led by reward, accuracy, length and mismatch (not the loss,
which is ~0 by construction in GRPO), with a progress bar, the phase running now and the run's ETA.
Plain lines when not a terminal: one as each step's rollout and update start, one per finished step.

The first line says how long the run is expected to take: before a step has run, from a preset's measured
seconds per step (MEASURED_STEP_S, scaled by the sequences per step) where one applies; from the first
finished step on, from this run's own mean step time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qerl_cli.train.config import TrainConfig
from qerl_cli.train.phases import RECOMPUTE, ROLLOUT, SETUP, STEP_PHASES, timing_key
from qerl_cli.train.presets import PresetChoice

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




@dataclass(frozen=True)
class MeasuredStep:
    """A preset's measured seconds per RL step, with what it was measured on."""

    seconds: float
    sequences: int  # sequences per step it was measured with: the estimate scales by this
    where: str
    on_cuda: bool  # measured on a GPU (applies to GPU runs only) or on CPU cores


# The default presets' measured steps on the embedded SmolLM2-135M NVFP4 (the README's main job): the estimate the
# first line gives before this run has timed a step of its own.
MEASURED_STEP_S = {
    "quick_cpu": MeasuredStep(63.0, 64, "2 CPU cores, 2026-11-26: 8 steps in 503 s", on_cuda=False),
    "gpu_arith": MeasuredStep(3.7, 512, "one H100, 2026-11-27: 40 steps in 148 s", on_cuda=True),
}
# the phases a step reports on the console: rollout, then the update (recompute + forward/backward + optimizer)
PHASE_LABELS = {ROLLOUT: "rollout", RECOMPUTE: "update"}
# a phase's progress (micro-batches, tool calls) is printed at most this often on a plain console
PROGRESS_EVERY_S = 10.0


def reference_step(preset: str | None, on_cuda: bool, episodes: bool = False) -> MeasuredStep | None:
    """The measured step time that applies to this run before it has timed one (None: none applies). The figures
    are single-turn steps: with ``episodes`` (--tools/--env) the prompts carry the tool's worked examples and the
    turns add tokens (a 2-step CPU calculator run took 10x the single-turn figure), so none applies."""
    ref = MEASURED_STEP_S.get(preset) if preset is not None and not episodes else None
    return ref if ref is not None and ref.on_cuda == on_cuda else None


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _fmt(metrics: dict[str, Any], key: str, fmt: str) -> str:
    v = metrics.get(key)
    if v is None:
        return "-"
    try:
        return fmt.format(v)
    except (TypeError, ValueError):
        return str(v)


class TrainConsole:
    def __init__(self, console: Console, cfg: TrainConfig, reference: MeasuredStep | None = None,
                 start_step: int = 0, preset: PresetChoice | None = None) -> None:
        self.console = console
        self.preset = preset
        self.cfg = cfg
        self.live: Live | None = None
        self.progress = Progress(TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[phase]}"), TextColumn("ETA {task.fields[eta]}"),
                                 console=console)
        self.task_id = self.progress.add_task("train", total=cfg.steps, phase=SETUP, eta="-")
        self.first = self.last = None  # type: dict[str, Any] | None
        self.t0 = time.perf_counter()
        # before this run has timed a step: the preset's measured step, scaled by the sequences per step
        self.reference_s = (reference.seconds * cfg.batch_prompts * cfg.num_generations / reference.sequences
                            if reference is not None else None)
        self.reference = reference
        self.start_step = start_step  # the step this process starts at (a resumed run's checkpoint)
        self.step_times: list[float] = []  # this process's finished steps, seconds
        self.step_t0: float | None = None
        self.label = ""  # the phase shown now, since when, and when a progress line was last printed
        self.label_t0 = self.printed_t = 0.0

    def expected_line(self) -> str:
        """How long the run should take, and where that figure comes from."""
        n = max(0, self.cfg.steps - self.start_step)
        if self.reference_s is None:
            return f"{_steps(n)}; expected time: from the first step's (no measured figure for this setup)"
        ref = self.reference
        assert ref is not None
        return (f"{_steps(n)}, expected ~{duration(n * self.reference_s)} ({ref.seconds:.0f} s per step of "
                f"{ref.sequences} sequences measured on {ref.where}; the ETA is re-estimated from each step)")

    def preset_line(self) -> str:
        """Which preset runs and why, when none was named (a default the user should see)."""
        p = self.preset
        return f"preset {p.name} ({p.reason}); " if p is not None and p.chosen_by_default else ""

    def __enter__(self) -> TrainConsole:
        parts = [self.cfg.algo, self.cfg.task, self.cfg.precision]
        parts += ["AQN"] if self.cfg.aqn else []
        parts += [self.cfg.correction] if self.cfg.correction != "none" else []
        title = "qerl train · " + " · ".join(parts)
        self.console.print(f"[bold]{escape(title)}[/] · {escape(self.preset_line())}{escape(self.expected_line())}",
                           highlight=False, soft_wrap=True)
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

    # ---- progress: the trainer calls `phase` as each phase starts (trainer.phases.on_phase) -----------------------
    def attach(self, trainer: Any) -> None:
        """`train(on_setup=...)`: follow the trainer's phases from here on; a resumed run starts at its step."""
        self.start_step = int(trainer.step)
        trainer.phases.on_phase = self.phase
        trainer.phases.on_progress = self.phase_progress
        self.progress.update(self.task_id, completed=self.start_step)

    def eta(self, now: float) -> str:
        """The run's remaining time: steps left times the mean step (this run's, else the reference), minus
        what the running step has already taken."""
        per_step = sum(self.step_times) / len(self.step_times) if self.step_times else self.reference_s
        if per_step is None:
            return "after the first step"
        left = self.cfg.steps - self.start_step - len(self.step_times)
        running = now - self.step_t0 if self.step_t0 is not None else 0.0
        source = f"mean of {_steps(len(self.step_times))}" if self.step_times else "measured preset"
        return f"{duration(max(0.0, left * per_step - running))} ({source})"

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        if name == STEP_PHASES[0] and self.step_t0 is None:  # the first step's first phase
            self.step_t0 = now
        label = PHASE_LABELS.get(name)
        if label is None:
            return
        step = self.start_step + len(self.step_times) + 1
        eta = self.eta(now)
        last = self._last_phase_s(label)
        took = f" (last step's took {duration(last)})" if last is not None else ""
        self.label, self.label_t0, self.printed_t = label, now, now
        self.progress.update(self.task_id, phase=label, eta=eta)
        if self.live is None:
            self.console.print(f"step {step}/{self.cfg.steps} {label}{took}; run ETA {eta}", highlight=False)

    def phase_progress(self, text: str) -> None:
        """What the running phase has done so far (the trainer's micro-batches, tool calls): in the live panel at
        once, as a plain line at most every PROGRESS_EVERY_S, so a long CPU phase is never silent for minutes."""
        now = time.perf_counter()
        self.progress.update(self.task_id, phase=f"{self.label}: {text}")
        if self.live is None and now - self.printed_t >= PROGRESS_EVERY_S:
            self.printed_t = now
            step = self.start_step + len(self.step_times) + 1
            self.console.print(f"step {step}/{self.cfg.steps} {self.label}: {text} "
                               f"({duration(now - self.label_t0)} in)", highlight=False)

    def _last_phase_s(self, label: str) -> float | None:
        m = self.last
        if m is None:
            return None
        if label == "rollout":
            return m.get(timing_key(ROLLOUT))
        return (m.get(timing_key(RECOMPUTE)) or 0.0) + (m.get("timing/train_s") or 0.0)

    def update(self, metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        if self.step_t0 is not None:
            self.step_times.append(now - self.step_t0)
        self.step_t0 = now  # the next step's time includes this one's checkpoint write
        if self.first is None:
            self.first = metrics
        self.last = metrics
        eta = self.eta(now)
        self.progress.update(self.task_id, completed=metrics.get("step", 0), phase="", eta=eta)
        if self.live is not None:
            self.live.update(self._render())
        else:
            parts = " ".join(f"{label}={_fmt(metrics, k, f)}" for k, label, f in LEAD[:6])
            took = ""
            if self.step_times:
                took = (f"; {duration(self.step_times[-1])} (rollout {duration(self._last_phase_s('rollout') or 0)}, "
                        f"update {duration(self._last_phase_s('update') or 0)})")
            self.console.print(f"step {metrics.get('step')}/{self.cfg.steps} {parts}{took}; run ETA {eta}",
                               highlight=False)

    def summary(self, result: Any) -> None:
        done = int(result.steps_done)
        ran = done - self.start_step  # this process's steps only: a resumed run started at its checkpoint
        resumed = f" (resumed at step {self.start_step}; the run is at step {done})" if self.start_step else ""
        self.console.print(
            f"trained {_steps(ran)}{resumed} in {time.perf_counter() - self.t0:.0f}s; checkpoint "
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
