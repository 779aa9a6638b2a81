"""Where each stage keeps its outputs inside a run directory (paths only; the manifest says what is valid)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir, atomic_write_text

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")

# What a complete `train/checkpoints/step_N/` holds, by kind; the one place resume, `latest`, pruning
# (keep_checkpoints) and `qerl eval` learn it from. Every kind also holds TRAINER_STATE_FILE (optimizer,
# scheduler, RNG, data, AQN and, with --rollout-quant int8 --requant-scales fixed, the FlashRL fixed INT8
# scales under its "rollout_quant" key: they are calibration state, not weights, so they add no kind).
ADAPTER_DIR = "adapter"  # --finetune lora: peft's adapter_config.json + adapter_model.safetensors
FULL_WEIGHTS_FILE = "weights.safetensors"  # --finetune full: every trained (non-embedding) weight, fp32
TRAINER_STATE_FILE = "trainer_state.pt"


def checkpoint_kind(ckpt: Path) -> str | None:
    """"adapter", "full", or None when `ckpt` is not a complete checkpoint (a staged write leaves none:
    the directory is renamed into place whole)."""
    if (ckpt / ADAPTER_DIR / "adapter_config.json").is_file():
        return "adapter"
    if (ckpt / FULL_WEIGHTS_FILE).is_file():
        return "full"
    return None


def quantized_model_dir(run: RunDir) -> Path:
    """The model `qerl quantize` wrote, as the manifest records it."""
    rec = run.require("quantize")
    path = run.abs(rec["outputs"]["model"]["path"])
    if not (path / "config.json").is_file():
        raise QerlError(f"{path} is missing though the manifest lists it: run `qerl quantize --run {run.path}` again")
    return path


def model_files(run: RunDir) -> dict[str, str]:
    """File name -> sha256 of the run's quantized model, as `qerl quantize` recorded them."""
    return dict(run.require("quantize")["outputs"]["model"].get("files", {}))


def base_fingerprint(model: dict[str, Any]) -> str:
    """One identity for a quantized base: sha256 over its format and its files' sha256.

    `model` is a manifest entry with "format" and "files" (quantize's outputs, train's inputs), so an
    adapter's record and the run's current model can be compared without reading any weights."""
    blob = json.dumps({"format": model.get("format"), "files": model.get("files", {})}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_adapter_base(run: RunDir, checkpoint: Path) -> str:
    """Refuse an adapter that was trained on another base than the run's current model; its fingerprint."""
    current = base_fingerprint(run.require("quantize")["outputs"]["model"])
    train = run.record("train")
    trained_on = (train or {}).get("inputs", {}).get("model")
    if not trained_on or not trained_on.get("files"):
        raise QerlError(f"the manifest of {run.path} does not record which base {checkpoint.name} was trained on, "
                        "so its adapter cannot be checked against the model: evaluate with --checkpoint base or "
                        "train again")
    if base_fingerprint(trained_on) != current:
        raise QerlError(f"{checkpoint.name} was trained on another base model than {run.path}'s "
                        "current one (re-quantized since): train again in a new --run directory, or evaluate with "
                        "--checkpoint base")
    return current


def latest_step(run: RunDir) -> int | None:
    """The step of the checkpoint `--resume` continues from (None: no checkpoint yet)."""
    try:
        ckpt = resolve_checkpoint(run, "latest")
    except QerlError:
        return None
    m = CHECKPOINT_RE.match(ckpt.name) if ckpt is not None else None
    return int(m.group(1)) if m else None


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
        if m and p.is_dir() and checkpoint_kind(p) is not None:
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def resolve_checkpoint(run: RunDir, name: str) -> Path | None:
    """`latest`, `step_N` or `base` (None: the base model alone). Raises a clear error for a missing one."""
    if name == "base":
        return None
    ckpts = list_checkpoints(run)
    if name == "latest":
        pointer = checkpoints_dir(run) / "latest"
        if pointer.is_file():
            target = checkpoints_dir(run) / pointer.read_text().strip()
            if checkpoint_kind(target) is not None:
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
