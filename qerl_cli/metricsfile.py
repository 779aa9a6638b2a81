"""`train/metrics.jsonl`: one JSON object per training step, appended as each step ends. The one writer and the one
reader, shared by the trainer (`--resume` drops the lines after its checkpoint, `--resume-from` sets them aside)
and `qerl report` (the curves).

A process killed while appending leaves a torn last line (no newline, not JSON): the reader skips it, since the
step it belonged to was never checkpointed and is recomputed on resume. A torn last line of a step a checkpoint
already covers was not left by a kill (the line is appended before its step's checkpoint) and is not recomputed:
resume still drops it, with a warning naming the file and the line. Any other line that is not a metrics
record is damage nothing should silently drop or rewrite: it is refused in one line naming the file and the line.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.manifest import atomic_write_text, jsonable, read_regular, write_errors

log = logging.getLogger("qerl.metrics")
_STEP_RE = re.compile(r'^\s*\{\s*"step"\s*:\s*(\d+)')  # a record's first key: what a torn line still shows


def _record(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    # a step is a whole number (json reads NaN and Infinity too, which no step is)
    whole = isinstance(step, int) or (isinstance(step, float) and step.is_integer())
    return row if whole and not isinstance(step, bool) else None


def read_metrics(path: Path, covered: int | None = None) -> list[dict[str, Any]]:
    """The records of a metrics file in file order ([] when there is none); a torn last line is skipped, with a
    warning where ``covered`` (the step of the checkpoint a resume continues from) says its step is not recomputed."""
    path = Path(path)
    try:
        text = read_regular(path).decode("utf-8", errors="replace")  # a FIFO there is refused, not waited on
    except FileNotFoundError:
        return []
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        row = _record(line)
        if row is not None:
            rows.append(row)
        elif i < len(lines) - 1 or text.endswith("\n"):  # a whole line, so not the torn end of an append
            raise QerlError(f"{path} line {i + 1} is not a metrics record (a JSON object with a whole-number step): "
                            "remove or repair that line, or move the file aside, and run the command again")
        elif covered is not None:
            _warn_torn(path, i + 1, line, covered)
    return rows


def _warn_torn(path: Path, number: int, line: str, covered: int) -> None:
    found = _STEP_RE.match(line)
    step = int(found.group(1)) if found else None
    if step is not None and step > covered:
        return  # a kill mid-append: the step is recomputed on resume
    held = f"step {step}, which the checkpoint of step {covered} covers" if step is not None \
        else "no step qerl can read"
    log.warning("warning: %s line %d is cut short (not a whole JSON record) and is dropped: it held %s, so those "
                "metrics are lost (restore the line from a copy to keep them)", path, number, held)


def append_metrics(path: Path, metrics: dict[str, Any]) -> None:
    """Append one step's record (NaN/inf written as null: strict JSON has neither)."""
    path = Path(path)
    with write_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(jsonable(metrics)) + "\n")
            f.flush()


def write_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace the file with ``rows`` (atomically: a reader sees the old file or the whole new one)."""
    atomic_write_text(Path(path), "".join(json.dumps(jsonable(r)) + "\n" for r in rows))
