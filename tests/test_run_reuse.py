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


# the module trains 5 tiny steps on the embedded model: 39 s in all on 2 cores (one intra-op thread; with two
# threads on shared cores it took 6 minutes)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """Decode-sized CPU matmuls gain nothing from a second thread, and on shared cores they lose a lot."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def trained(quantized_runs, tmp_path_factory) -> Path:
    """A finished 3-step AQN run (3 stages: noise-free, sigma_start, sigma_end)."""
    from qerl_cli.train.config import build_config
    from qerl_cli.train.trainer import train

    run = tmp_path_factory.mktemp("reuse") / "run"
    shutil.copytree(quantized_runs["nvfp4"].run, run, ignore=shutil.ignore_patterns(".lock", "train", "eval", "bench"))
    res = train(run, build_config("quick_cpu", {**TINY, "steps": 3}))
    assert res.steps_done == 3
    return run


def test_resume_of_a_finished_run_is_refused_and_changes_nothing(trained: Path) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.trainer import train

    before = _manifest(trained)["stages"]["train"]
    with pytest.raises(QerlError, match=r"already finished: pass --steps N with N > 3 to extend it"):
        train(trained, build_config("quick_cpu", {**TINY, "steps": 3}), resume=True)
    with pytest.raises(QerlError, match=r"is at step 3, past --steps 2"):
        train(trained, build_config("quick_cpu", {**TINY, "steps": 2}), resume=True)
    assert _manifest(trained)["stages"]["train"] == before  # refused before the stage was entered


def test_larger_steps_extends_a_finished_run_keeping_the_aqn_schedule(trained: Path, tmp_path: Path) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.trainer import train

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


def test_resume_on_a_requantized_base_is_refused(trained: Path, embedded, tmp_path: Path) -> None:
    from qerl_cli.quantize import quantize_model
    from qerl_cli.train.config import build_config
    from qerl_cli.train.trainer import train

    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(".lock"))
    # re-quantizing moves train/ aside (--force); a user who moves it back has an adapter beside a new base
    moved = quantize_model(run, None, fmt="int8", loaded=embedded, force=True).replaced_train
    (run / moved["moved_to"]).rename(run / "train")
    before = _manifest(run)["stages"]["train"]
    with pytest.raises(QerlError, match="trained on another base model"):
        train(run, build_config("quick_cpu", {**TINY, "steps": 5}), resume=True)
    assert _manifest(run)["stages"]["train"] == before
