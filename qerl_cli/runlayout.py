"""Where each stage keeps its outputs inside a run directory (paths only; the manifest says what is valid).

What is inside `train/checkpoints/` (kinds, files, `latest`, pruning) is qerl_cli/train/checkpointing.py's.
Every path here is confined to the run (`RunDir.inside`): a folder that is a symbolic link leading out of the
run is refused before anything is read from it or written into it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir

MODEL_DIRNAME = "model"


def model_dir(run: RunDir) -> Path:
    """Where `qerl quantize` writes the run's model."""
    return run.inside(MODEL_DIRNAME)


def quantized_model_dir(run: RunDir) -> Path:
    """The model `qerl quantize` wrote, as the manifest records it: inside the run, with every file in it and every
    weight file the manifest names."""
    rec = run.require("quantize")
    model = rec["outputs"]["model"]
    path = run.abs(model.get("path"), "quantize outputs.model.path")
    if not (path / "config.json").is_file():
        raise QerlError(f"{path} is missing though the manifest lists it: run `qerl quantize --run {run.path}` again")
    run.inside_tree(path)
    for name in model.get("files") or {}:
        run.inside(path / name, named_by=f"{run.manifest_path} (quantize outputs.model.files)")
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


def _fixed_path(name: str, rel: str, doc: str) -> Callable[[RunDir], Path]:
    """`name(run)`: RUN/rel, confined to the run (`RunDir.inside`)."""
    def path(run: RunDir) -> Path:
        return run.inside(rel)

    path.__name__ = path.__qualname__ = name
    path.__doc__ = doc
    return path


# the stages' fixed places: name, path inside the run, what it is
train_dir = _fixed_path("train_dir", "train", "What `qerl train` writes.")
checkpoints_dir = _fixed_path("checkpoints_dir", "train/checkpoints", "The trainer's checkpoints.")
metrics_path = _fixed_path("metrics_path", "train/metrics.jsonl",
                           "The trainer's metrics.jsonl (appended to, so it must not be a link leading out).")
rollouts_dir = _fixed_path("rollouts_dir", "train/rollouts", "The trainer's rollout records.")
eval_dir = _fixed_path("eval_dir", "eval", "What `qerl eval` writes.")
bench_dir = _fixed_path("bench_dir", "bench", "Where the benches write unless --out says otherwise (and bench sanity "
                        "keeps its perfectible subset).")

