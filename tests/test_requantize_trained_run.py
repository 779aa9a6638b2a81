"""`qerl quantize` on a run that holds a trained adapter: refused in one line (the new base would orphan the
adapter), and with --force the old train/ moves aside and the manifest says where."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def qerl(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "qerl_cli", *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tempfile.gettempdir())


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained_tiny(tiny_source: Path, tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny model directory, a run quantized from it with one trained step)."""
    from qerl_cli.quantize import quantize_model
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path_factory.mktemp("tiny_trained") / "run"
    quantize_model(run, str(tiny_source), fmt="nvfp4")
    train(run, build_config("quick_cpu", {"steps": 1, "batch_prompts": 2, "num_generations": 2,
                                          "max_completion_length": 2, "shots": 0, "lora_rank": 4,
                                          "micro_batch_size": 4, "aqn": False, "log_rollouts": False}))
    return tiny_source, run


def test_requantizing_a_trained_run_is_refused_in_one_line(trained_tiny: tuple[Path, Path]) -> None:
    src, run = trained_tiny
    manifest, model, train = (run / "manifest.json").read_text(), _digest(run / "model"), _digest(run / "train")
    res = qerl("quantize", str(src), "--run", str(run), "--format", "int8")
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = res.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err == (f"error: {run / 'train'} holds an adapter trained on this run's current base (checkpoints "
                   "step_1); a new base would not match it: quantize into a new --run directory, or pass --force "
                   "to move train/ aside")
    # nothing touched: manifest, model and adapter exactly as they were
    assert (run / "manifest.json").read_text() == manifest
    assert _digest(run / "model") == model and _digest(run / "train") == train


def test_force_moves_the_old_train_aside_and_records_it(trained_tiny: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    src, trained = trained_tiny
    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(".lock"))
    old_train = _digest(run / "train")
    old_files = json.loads((run / "manifest.json").read_text())["stages"]["train"]["inputs"]["model"]["files"]
    res = qerl("quantize", str(src), "--run", str(run), "--format", "int8", "--force")
    assert res.returncode == 0, res.stderr[-2000:]
    (aside,) = [p for p in run.iterdir() if p.name.startswith("train.replaced-")]
    assert not (run / "train").exists()
    assert _digest(aside) == old_train  # moved whole, not rewritten
    rec = json.loads((run / "manifest.json").read_text())["stages"]["quantize"]
    assert rec["status"] == "completed" and rec["outputs"]["model"]["format"] == "int8"
    assert rec["extra"]["replaced_train"] == {"moved_to": aside.name, "held": "checkpoints step_1",
                                              "trained_on_files": old_files}
    assert f"moved to {aside}" in " ".join(res.stdout.split())
