"""Reusing a run directory: `--resume` on a finished run, extending it with a larger --steps, and a base
re-quantized under a trained adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qerl_cli.errors import QerlError

TINY = {"task_level": "1", "batch_prompts": 2, "num_generations": 2, "max_completion_length": 3, "lora_rank": 4,
        "lr": 3e-4, "precision": "fp32", "micro_batch_size": 8, "seed": 1, "aqn": True, "aqn_stages": 3,
        "save_steps": 3, "log_rollouts": False}


# the module trains 5 steps of the tiny random model (the tests are about the run directory's state, not the model;
# on the embedded model the module took ~40 s on 2 cores)


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def trained(tiny_source, tmp_path_factory) -> Path:
    """A finished 3-step AQN run (3 stages: noise-free, sigma_start, sigma_end) of the tiny model in NVFP4."""
    from qerl_cli.quantize import quantize_model
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path_factory.mktemp("reuse") / "run"
    quantize_model(run, str(tiny_source), fmt="nvfp4")
    res = train(run, build_config("quick_cpu", {**TINY, "steps": 3}))
    assert res.steps_done == 3
    return run


def test_resume_of_a_finished_run_is_refused_and_changes_nothing(trained: Path) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    before = _manifest(trained)["stages"]["train"]
    with pytest.raises(QerlError, match=r"already finished: pass --steps N with N > 3 to extend it"):
        train(trained, build_config("quick_cpu", {**TINY, "steps": 3}), resume=True)
    with pytest.raises(QerlError, match=r"is at step 3, past --steps 2"):
        train(trained, build_config("quick_cpu", {**TINY, "steps": 2}), resume=True)
    assert _manifest(trained)["stages"]["train"] == before  # refused before the stage was entered


def test_larger_steps_extends_a_finished_run_keeping_the_aqn_schedule(trained: Path, tmp_path: Path) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(".lock"))
    res = train(run, build_config("quick_cpu", {**TINY, "steps": 5}), resume=True)
    assert res.steps_done == 5 and [m["step"] for m in res.metrics] == [4, 5]
    ms = _metrics(run)
    assert [m["step"] for m in ms] == [1, 2, 3, 4, 5]
    # the first 3 steps' schedule is kept (a 5-step schedule would put step 4 back at sigma_start = 1e-2)
    assert [m["aqn/sigma"] for m in ms] == pytest.approx([0.0, 1e-2, 5e-4, 5e-4, 5e-4])
    rec = _manifest(run)["stages"]["train"]
    assert rec["status"] == "completed" and rec["config"]["steps"] == 5
    assert rec["extra"]["extended"] == {"from_steps": 3, "to_steps": 5, "aqn_schedule_steps": 3}
    assert rec["outputs"]["checkpoint"] == "train/checkpoints/step_5"


def test_resume_on_a_requantized_base_is_refused(trained: Path, tiny_source, tmp_path: Path) -> None:
    from qerl_cli.quantize import quantize_model
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(".lock"))
    # re-quantizing moves train/ aside (--force); a user who moves it back has an adapter beside a new base
    moved = quantize_model(run, str(tiny_source), fmt="int8", force=True).replaced_train
    (run / moved["moved_to"]).rename(run / "train")
    before = _manifest(run)["stages"]["train"]
    with pytest.raises(QerlError, match="trained on another base model"):
        train(run, build_config("quick_cpu", {**TINY, "steps": 5}), resume=True)
    assert _manifest(run)["stages"]["train"] == before
