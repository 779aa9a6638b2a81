"""Where each stage keeps its outputs inside a run directory (paths only; the manifest says what is valid)."""

from __future__ import annotations

import re
from pathlib import Path

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir, atomic_write_text

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")


def quantized_model_dir(run: RunDir) -> Path:
    """The model `qerl quantize` wrote, as the manifest records it."""
    rec = run.require("quantize")
    path = run.abs(rec["outputs"]["model"]["path"])
    if not (path / "config.json").is_file():
        raise QerlError(f"{path} is missing though the manifest lists it: run `qerl quantize --run {run.path}` again")
    return path


def train_dir(run: RunDir) -> Path:
    return run.path / "train"


def checkpoints_dir(run: RunDir) -> Path:
    return train_dir(run) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


def write_latest(run: RunDir, step: int) -> None:
    """Point `latest` at a complete checkpoint; written last, after the checkpoint itself."""
    atomic_write_text(checkpoints_dir(run) / "latest", checkpoint_name(step) + "\n")


def list_checkpoints(run: RunDir) -> dict[int, Path]:
    root = checkpoints_dir(run)
    if not root.is_dir():
        return {}
    out = {}
    for p in root.iterdir():
        m = CHECKPOINT_RE.match(p.name)
        if m and p.is_dir() and (p / "adapter" / "adapter_config.json").is_file():
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def resolve_checkpoint(run: RunDir, name: str) -> Path | None:
    """`latest`, `step_N` or `base` (None: no adapter). Raises a clear error for a missing one."""
    if name == "base":
        return None
    ckpts = list_checkpoints(run)
    if name == "latest":
        pointer = checkpoints_dir(run) / "latest"
        if pointer.is_file():
            target = checkpoints_dir(run) / pointer.read_text().strip()
            if (target / "adapter" / "adapter_config.json").is_file():
                return target
        if ckpts:
            return ckpts[max(ckpts)]
        raise QerlError(f"run {run.path} has no training checkpoint: run `qerl train --run {run.path}` first "
                        "or pass --checkpoint base")
    m = CHECKPOINT_RE.match(name)
    if not m:
        raise QerlError(f"--checkpoint must be latest, base or step_N, not {name!r}")
    step = int(m.group(1))
    if step not in ckpts:
        have = ", ".join(checkpoint_name(s) for s in ckpts) or "none"
        raise QerlError(f"checkpoint {name} does not exist in {checkpoints_dir(run)} (have: {have})")
    return ckpts[step]


def eval_dir(run: RunDir) -> Path:
    return run.path / "eval"
