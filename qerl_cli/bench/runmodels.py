"""The run's model in other weight formats, for benches that compare formats on one run.

A format other than the run's is quantized by ``qerl quantize``'s own library function from the run's
source model (same ignore list, same dtype) into ``<bench dir>/models/<format>``, a run directory of
its own with its quantize stage recorded; a later bench reuses it when it was made from the same
source files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.runlayout import quantized_model_dir


def run_format(run: RunDir) -> str:
    """The run's weight format as `qerl quantize` recorded it (StageMissingError when not quantized)."""
    return str(run.require("quantize")["config"]["format"])


def source_arg(source: dict[str, Any]) -> str | None:
    """The `qerl quantize MODEL` argument that names a recorded ModelSource again."""
    if source.get("kind") == "embedded":
        return None
    if source.get("gguf_file"):
        return str(Path(source["location"]) / source["gguf_file"])
    return str(source["location"])


def model_hash(run: RunDir) -> str:
    """A short identity of the run's quantized weights (sha256 of its file list with hashes)."""
    import hashlib
    import json

    rec = run.require("quantize")
    files = rec.get("outputs", {}).get("model", {}).get("files", {})
    blob = json.dumps({"format": rec["config"]["format"], "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def format_model_dir(run: RunDir, fmt: str, bench_dir: Path, log: Callable[[str], None] = print) -> Path:
    """The directory of the run's model in ``fmt``: the run's own, or a copy quantized for the bench."""
    rec = run.require("quantize")
    if rec["config"]["format"] == fmt:
        return quantized_model_dir(run)
    from qerl_cli.quantize import quantize_model

    copy_dir = RunDir(bench_dir).inside(f"models/{fmt}")  # kept inside the bench's folder, links included
    src_hashes = rec.get("inputs", {}).get("model", {}).get("sha256")
    if (copy_dir / "manifest.json").is_file():
        copy = RunDir(copy_dir, create=False)
        old = copy.record("quantize")
        if old and old.get("status") == "completed" and old["config"].get("format") == fmt and \
                old.get("inputs", {}).get("model", {}).get("sha256") == src_hashes:
            return quantized_model_dir(copy)
    cfg = rec["config"]
    kind = rec.get("inputs", {}).get("model", {}).get("kind")
    if kind not in ("embedded", "hub"):
        # a path read from the run directory is never followed out of it: the source must come from the user
        raise QerlError(f"the bench needs the run's model in {fmt}, but {run.path} was quantized from a local "
                        f"{kind or 'source'}; quantize it yourself (`qerl quantize SOURCE --run NEW_DIR --format "
                        f"{fmt}`) and bench that run, or bench the run's own format ({rec['config']['format']})")
    log(f"quantizing the run's source to {fmt} into {copy_dir} ...")
    quantize_model(copy_dir, source_arg(cfg["model"]), fmt=fmt, ignore=cfg.get("ignore"),
                   dtype=cfg.get("dtype", "bf16"), seed=rec.get("seeds", {}).get("torch", 0))
    return quantized_model_dir(RunDir(copy_dir, create=False))


def run_model(run_dir: Path) -> tuple[RunDir, Path, str]:
    """The run (it must exist), its quantized model's directory and that model's format (from its config.json)."""
    from qerl_cli.checkpoint import detect_format
    from qerl_cli.model_config import read_config_dict

    run = RunDir(run_dir, create=False)
    model_dir = quantized_model_dir(run)
    return run, model_dir, detect_format(read_config_dict(model_dir))[0]
