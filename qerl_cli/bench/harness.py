"""The skeleton every `qerl bench` command shares; a bench module supplies only its cells and its tables.

A bench is: a device (:func:`device`), optionally a process memory cap (:func:`cap_memory`) and a time
budget (:class:`Budget`), a result dict that starts with the common header (:func:`header`), a list of
:class:`Cell` run by :func:`run_cells` (a cell that runs out of memory, or fails, becomes a row with its
status and the bench goes on; a cell that would start past the budget becomes a ``skipped (time budget)``
row), then :func:`write_results` (the plots, then the JSON, each written atomically: a JSON on disk means a
finished bench) and, with a run directory, :func:`record` (the manifest entry ``bench/<name>``). The CLI
prints the module's rich tables through :func:`show`, split to the terminal's width.

Nothing here imports torch at module level: the CLI imports this module for :func:`show`.
docs/benches.md says how to add a bench.
"""

from __future__ import annotations

import datetime
import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.plots import figure as figure  # re-exported: the benches draw through the harness
from qerl_cli.tables import SIG as SIG  # re-exported: the benches format through the harness
from qerl_cli.tables import num as num

SCHEMA = 1
SKIPPED_BUDGET = "skipped (time budget)"
# Shapes small enough to build and run on a CPU (the others need a CUDA GPU).
CPU_SHAPES = ("tiny", "tiny-moe", "qwen2.5-0.5b")

Log = Callable[[str], None]


# ---- numbers ---------------------------------------------------------------------------------------
COUNT = "{:,.0f}"  # tokens/s, token counts: thousands separated, no decimals
SCI = "{:.2e}"  # quantities spanning decades (mismatch k1, k3)
# SIG and num (a table cell) are qerl_cli/tables.py's, shared with the run report


# ---- device, memory, time ----------------------------------------------------------------------------
def device(requested: str | None = None, *, cuda_only: str | None = None) -> Any:
    """The bench's device: ``cuda_only`` names GPU-only work (one line where there is no GPU); else
    ``requested`` when given, CUDA where visible, CPU otherwise (qerl_cli.device decides)."""
    from qerl_cli import device as dev

    return dev.require_cuda(cuda_only) if cuda_only else dev.pick(requested)


def int_list(text: str, flag: str, lowest: int = 1) -> tuple[int, ...]:
    """A comma-separated list of whole numbers from the command line (``--m 1,16,64``), each >= ``lowest``."""
    out = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            value = None
        if value is None or value < lowest:
            raise QerlError(f"{flag} takes comma-separated whole numbers >= {lowest} (e.g. {flag} 1,8), got "
                            f"{item.strip()!r} in {text!r}")
        out.append(value)
    return tuple(out)


def gpu_total_gib(dev: Any) -> float | None:
    import torch

    return torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda" else None


def cap_memory(dev: Any, cap_gib: float | None) -> float | None:
    """Cap this process's GPU memory at ``cap_gib`` (e.g. 79.6 to check a fit on an 80 GB card while running
    on a larger one); returns the fraction of the device set, None when uncapped or off CUDA."""
    if cap_gib is None or dev.type != "cuda":
        return None
    import torch

    frac = min(1.0, cap_gib / gpu_total_gib(dev))
    torch.cuda.set_per_process_memory_fraction(frac)
    return frac


def free_memory() -> None:
    """Drop what the last cell left behind before the next one allocates."""
    from qerl_cli.device import empty_cache

    gc.collect()
    empty_cache()


@dataclass
class Budget:
    """A bench's time budget (None: unlimited), counted from its creation."""

    seconds: float | None = None
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def exceeded(self, guess: float = 0.0) -> bool:
        """Whether work expected to take ``guess`` seconds, started now, would end past the budget."""
        return self.seconds is not None and self.elapsed() + guess > self.seconds


def shape_for(shape: str, dev: Any) -> Any:
    """The :class:`~qerl_cli.bench.shapes.ModelShape` named ``shape``, refused off CUDA unless it is CPU-sized."""
    from qerl_cli.bench.shapes import get_shape

    spec = get_shape(shape)
    if dev.type != "cuda" and shape not in CPU_SHAPES:
        raise QerlError(f"shape {shape} needs a CUDA GPU; on CPU use --shape {' or '.join(CPU_SHAPES)}")
    return spec


def copy_bandwidth_gbps(dev: Any) -> float | None:
    """Device-to-device copy GB/s (bytes read + written; median of triton's do_bench), None off CUDA."""
    if dev.type != "cuda":
        return None
    from functools import partial

    import torch
    import triton

    n = 1 << 28
    src = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(partial(dst.copy_, src), warmup=10, rep=100, return_mode="median")
    del src, dst
    free_memory()
    return 2 * n * 2 / (ms * 1e-3) / 1e9


# ---- cells -------------------------------------------------------------------------------------------
def is_oom(exc: BaseException) -> bool:
    """An allocation failure (CUDA or host), or the rollout engine finding no room for one KV-cache slot."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    msg = str(exc)
    # the host allocator's refusal (a CPU bench) is a RuntimeError saying "can't allocate memory"
    return ("out of memory" in msg.lower() or "can't allocate memory" in msg
            or "no room for even one KV-cache slot" in msg)


def failure_status(exc: BaseException, oom: str = "OOM") -> str:
    """What a failed cell records: ``oom`` for out-of-memory, else ``error: <its first line>``."""
    if is_oom(exc):
        return oom
    text = str(exc)
    return f"error: {text.splitlines()[0][:160] if text.strip() else type(exc).__name__}"


def failure_note(exc: BaseException) -> str:
    """Why a cell failed, in full (the status keeps it short): the exception's first line, or, for one raised
    without a message (a bare StopIteration, say), its type and where it was raised."""
    text = str(exc).strip()
    if text:
        return text.splitlines()[0][:400]
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return f"{type(exc).__name__} raised without a message"
    f = frames[-1]
    where = "/".join(Path(f.filename).parts[-2:])
    return f"{type(exc).__name__} raised without a message at {where}:{f.lineno} ({f.name})"


def raised_at(exc: BaseException) -> str:
    """`` (raised at FILE:LINE in FUNC)`` for an internal error (neither a QerlError nor an out-of-memory): where
    to look, in one line."""
    import traceback

    from qerl_cli.errors import QerlError

    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, QerlError) or is_oom(exc) or not frames:
        return ""
    f = frames[-1]
    return f" (raised at {'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} in {f.name})"


def row_label(row: dict[str, Any]) -> str:
    """A row's key fields (those before ``status``) as ``name=value`` words."""
    words = []
    for k, v in row.items():
        if k == "status":
            break
        words.append(f"{k}={v}")
    return " ".join(words)


def note_lines(res: dict[str, Any]) -> list[str]:
    """One line per result row that carries a ``note`` (why it failed, or why it ran differently than asked)."""
    return [f"{row_label(r)}: {r.get('status')}: {r['note']}" for r in res.get("results", []) if r.get("note")]


@dataclass
class Cell:
    """One measurement: ``key`` names it (the first fields of its row), ``measure`` returns its numbers (a
    ``status`` among them replaces "ok"); ``seconds`` is filled in by :func:`run_cell`."""

    key: dict[str, Any]
    measure: Callable[[], dict[str, Any]]
    label: str = ""
    seconds: float | None = None


def run_cell(cell: Cell, *, oom: str = "OOM", fatal: Callable[[Exception], bool] | None = None,
             log: Log | None = None) -> dict[str, Any]:
    """Run one cell; any failure (except those ``fatal(exc)`` says must stop the bench) becomes its status.

    Only ``Exception`` is caught: an interrupt still stops the bench before anything is written."""
    t0 = time.perf_counter()
    try:
        row = {**cell.key, "status": "ok", **cell.measure()}
    except Exception as exc:  # noqa: BLE001 - recorded per cell, the bench goes on
        if fatal is not None and fatal(exc):
            raise
        row = {**cell.key, "status": failure_status(exc, oom), "note": failure_note(exc)}
        if log is not None:
            log(f"{cell.label or cell.key}: {row['status']}: {row['note']}{raised_at(exc)}")
        free_memory()
    cell.seconds = time.perf_counter() - t0
    return row


def run_cells(cells: Iterable[Cell], *, budget: Budget | None = None, oom: str = "OOM",
              guess: Callable[[Cell], float] | None = None, fatal: Callable[[Exception], bool] | None = None,
              on_row: Callable[[Cell, dict[str, Any]], None] | None = None,
              log: Log | None = None) -> list[dict[str, Any]]:
    """Run ``cells`` in order; one that would start past ``budget`` (with ``guess`` seconds of its own, e.g.
    the longest cell so far) is recorded as skipped instead, and so is every later one that would.

    ``on_row(cell, row)`` sees each row as it is made (progress lines, numbers derived from the row)."""
    rows = []
    for cell in cells:
        if budget is not None and budget.exceeded(guess(cell) if guess else 0.0):
            row = {**cell.key, "status": SKIPPED_BUDGET}
            if log is not None:
                log(f"{cell.label or cell.key}: {SKIPPED_BUDGET}")
        else:
            row = run_cell(cell, oom=oom, fatal=fatal, log=log)
        if on_row is not None:
            on_row(cell, row)
        rows.append(row)
    return rows


# ---- the result document -----------------------------------------------------------------------------
def stamp() -> dict[str, Any]:
    """When and on what a result was made: ``date`` (UTC) and ``env`` (versions, git commit, device,
    behaviour-changing options)."""
    from qerl_cli.env_info import environment
    from qerl_cli.manifest import now_iso

    return {"date": now_iso(), "env": environment()}


def header(kind: str, **fields: Any) -> dict[str, Any]:
    """The fields every bench result starts with: schema, kind (``bench/<name>``), date (UTC), the bench's
    own leading fields, then ``env`` (versions, git commit, device), and an empty ``results`` list."""
    made = stamp()
    return {"schema": SCHEMA, "kind": kind, "date": made["date"], **fields, "env": made["env"], "results": []}


DEFAULT_ROOT = Path("qerl-bench")  # where a bench writes without --out or --run, under the working directory


def default_out(bench: str, now: datetime.datetime | None = None) -> Path:
    """``./qerl-bench/<bench>-<YYYYMMDD-HHMMSS>`` (local time): a new folder per bench run, so an earlier result
    is never overwritten (a second run within the same second gets ``-2``, ``-3``, ...)."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    path = base = DEFAULT_ROOT / f"{bench}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def out_dir(out: Path | None, run: Any, bench: str) -> Path:
    """Where a bench writes: ``out``, else the run's ``bench/`` folder (confined to the run), else
    :func:`default_out`."""
    if out is not None:
        return Path(out)
    if run is not None:
        from qerl_cli.runlayout import bench_dir

        return bench_dir(run)
    return default_out(bench)


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    from qerl_cli.manifest import atomic_write_png

    fig.tight_layout()
    atomic_write_png(path, fig)
    plt.close(fig)


def write_results(res: dict[str, Any], out: Path, json_name: str,
                  plots: dict[str, tuple[str, Callable[[Path], None]]] | None = None,
                  extra_files: dict[str, Path] | None = None) -> dict[str, Path]:
    """Write ``res`` as ``out/json_name`` after its plots (``{files key: (file name, draw(path))}``); the paths
    go into ``res["files"]`` (``json`` first, then the plots, then ``extra_files``) and are returned."""
    from qerl_cli.manifest import atomic_write_json, jsonable, write_errors

    out = Path(out)
    with write_errors(out):
        out.mkdir(parents=True, exist_ok=True)
    plots = plots or {}
    paths = {"json": out / json_name, **{k: out / name for k, (name, _) in plots.items()}, **(extra_files or {})}
    res["files"] = {k: str(p) for k, p in paths.items()}
    for k, (_, draw) in plots.items():
        draw(paths[k])
    atomic_write_json(paths["json"], jsonable(res))  # last: a JSON on disk means a finished bench
    return paths


def record(run: Any, name: str, *, config: dict[str, Any], outputs: dict[str, Path], metrics: dict[str, Any],
           inputs: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> None:
    """Record a finished bench in the run's manifest under ``bench/<name>`` (after the fact: one short write)."""
    from qerl_cli.manifest import jsonable

    with run.stage("bench", config=config, inputs=inputs or {}, key=f"bench/{name}") as rec:
        rec.outputs = {k: {"path": run.rel(p)} for k, p in outputs.items()}
        rec.metrics = metrics
        if extra is not None:
            rec.extra = jsonable(extra)


# ---- the terminal ------------------------------------------------------------------------------------
def fit_table(table: Any, out: Any) -> list[Any]:
    """A table wider than the terminal, split into several that fit, each led by the first (key) column.

    rich would squeeze every column of a too-wide table and cut names and numbers to "…"."""
    from rich.measure import Measurement
    from rich.table import Table

    wide = out.options.update(max_width=100_000)  # natural widths, not clamped to the terminal
    columns = list(table.columns)
    if len(columns) < 3 or Measurement.get(out, wide, table).maximum <= out.width:
        return [table]

    def width(col: Any) -> int:
        cells = [col.header, *col._cells]
        return max(Measurement.get(out, wide, c).maximum for c in cells) + 3  # padding and border

    key, rest = columns[0], columns[1:]
    groups: list[list[Any]] = [[]]
    used = width(key) + 1
    for col in rest:
        w = width(col)
        if groups[-1] and used + w > out.width:
            groups.append([])
            used = width(key) + 1
        groups[-1].append(col)
        used += w
    parts = []
    for i, group in enumerate(groups):
        part = Table(title=table.title if i == 0 else None, caption=table.caption if i == len(groups) - 1 else None,
                     show_lines=table.show_lines, header_style=table.header_style)
        for col in (key, *group):
            part.add_column(col.header, justify=col.justify, style=col.style, no_wrap=col.no_wrap)
        for r in range(len(key._cells)):
            part.add_row(*(col._cells[r] for col in (key, *group)))
        parts.append(part)
    return parts


def report(res: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """A bench result's rich tables and summary lines, as its module draws them (``tables`` and
    ``short_summary`` of ``qerl_cli.bench.<name>`` for kind ``bench/<name>``)."""
    import importlib

    kind = str(res.get("kind", ""))
    name = kind.partition("/")[2]
    try:
        mod = importlib.import_module(f"qerl_cli.bench.{name}") if kind.startswith("bench/") and name else None
    except ImportError:
        mod = None
    if mod is None or not hasattr(mod, "tables"):
        raise QerlError(f"not a bench result with tables (kind {kind!r}): give a JSON written by `qerl bench ...`")
    return mod.tables(res), [*note_lines(res), *mod.short_summary(res)]


def show(console: Any, tables: Sequence[Any], lines: Sequence[str]) -> None:
    """Print a bench's tables (each split to the terminal's width) and then its summary lines."""
    for table in tables:
        for part in fit_table(table, console):
            console.print(part)
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)  # a note may hold `qerl[vllm]`


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m qerl_cli.bench.harness RESULT.json ...``: print saved bench results as the bench printed them
    (what the GPU job scripts show at their end), wide enough that no table splits."""
    import json
    import sys

    from rich.console import Console

    console = Console(width=220)
    for path in (sys.argv[1:] if argv is None else argv):
        res = json.loads(Path(path).read_text())
        console.print(f"== {path}", highlight=False)
        show(console, *report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
