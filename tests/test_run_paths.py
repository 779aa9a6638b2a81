"""A relative --run behaves as an absolute one: `qerl eval` writes into a run that has no eval/ yet, finds the
trained checkpoints, and `qerl train --resume` continues them. An empty --run, and a --checkpoint or --resume-from
path that leads out of the run's checkpoints, are refused in one line. Each case runs the real commands in this
process, from the folder above a copy of one trained tiny-model run (2 steps, checkpoints step_1 and step_2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import qerl_in_process

TRAIN = {"steps": 2, "save_steps": 1, "task_level": "1", "batch_prompts": 2, "num_generations": 2,
         "max_completion_length": 3, "shots": 0, "lora_rank": 4, "precision": "fp32", "micro_batch_size": 8,
         "seed": 1, "log_rollouts": False}
TRAIN_ARGS = ["--config", "quick_cpu", "--no-log-rollouts",
              *[a for k, v in TRAIN.items() if k not in ("steps", "log_rollouts")
                for a in (f"--{k.replace('_', '-')}", str(v))]]
EVAL = ["--limit", "1", "--max-tokens", "2", "--shots", "0"]
SUFFIX = "-limit1-max2-shots0"  # the settings above that differ from the default


@pytest.fixture(scope="module")
def trained(tiny_source, tmp_path_factory) -> Path:
    from qerl_cli.quantize import quantize_model
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path_factory.mktemp("paths") / "run"
    quantize_model(run, str(tiny_source), fmt="nvfp4")
    assert train(run, build_config("quick_cpu", TRAIN)).steps_done == 2
    assert not (run / "eval").exists()
    return run


@pytest.fixture
def work(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, holding a copy of the trained run as `r` (relative paths below start here)."""
    shutil.copytree(trained, tmp_path / "work" / "r", symlinks=True, ignore=shutil.ignore_patterns(".lock"))
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "work"


def refused(code: int, err: str, *needles: str) -> None:
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_eval_with_a_relative_run_writes_into_a_fresh_eval_dir(work: Path, capsys) -> None:
    for ckpt in ("base", "latest"):
        code, _, err = qerl_in_process(capsys, "eval", "arith:1", "--run", "r", "--checkpoint", ckpt, *EVAL)
        assert code == 0, err
    base = json.loads((work / f"r/eval/arith-1-base{SUFFIX}.json").read_text())
    trained = json.loads((work / f"r/eval/arith-1-step_2{SUFFIX}.json").read_text())
    assert base["checkpoint"]["name"] == "base" and base["checkpoint"]["adapter_sha256"] is None
    assert trained["checkpoint"]["name"] == "step_2" and trained["checkpoint"]["path"] == "train/checkpoints/step_2"
    assert trained["files"]["result"] == f"eval/arith-1-step_2{SUFFIX}.json"
    assert (work / f"r/eval/arith-1-step_2{SUFFIX}.samples.jsonl").is_file()
    assert not (work / "r" / "r").exists()  # nothing under the run joined to itself a second time
    manifest = json.loads((work / "r/manifest.json").read_text())
    assert manifest["stages"][f"eval/arith-1-step_2{SUFFIX}"]["status"] == "completed"


def test_train_resume_with_a_relative_run_continues_its_checkpoints(work: Path, capsys) -> None:
    ckpts = work / "r/train/checkpoints"
    step_2 = (ckpts / "step_2/adapter/adapter_model.safetensors").read_bytes()
    metrics = (work / "r/train/metrics.jsonl").read_text().splitlines()
    code, _, err = qerl_in_process(capsys, "train", "--run", "r", "--resume", "--steps", "3", *TRAIN_ARGS)
    assert code == 0, err
    after = (work / "r/train/metrics.jsonl").read_text().splitlines()
    assert after[:2] == metrics and [json.loads(line)["step"] for line in after] == [1, 2, 3]
    assert (ckpts / "step_2/adapter/adapter_model.safetensors").read_bytes() == step_2  # not trained again
    assert (ckpts / "latest").read_text().strip() == "step_3"
    assert json.loads((work / "r/manifest.json").read_text())["stages"]["train"]["metrics"]["steps_done"] == 3


def test_an_empty_run_is_refused(work: Path, capsys) -> None:
    before = sorted(p.name for p in work.iterdir())
    for args in (["eval", "arith:1", *EVAL], ["train", "--steps", "1", *TRAIN_ARGS], ["quantize"], ["report"]):
        refused(*qerl_in_process(capsys, *args[:1], "--run", "", *args[1:])[::2], "--run is empty")
    assert sorted(p.name for p in work.iterdir()) == before  # nothing written into the working directory


def test_checkpoint_paths_must_lead_into_the_runs_checkpoints(work: Path, capsys) -> None:
    elsewhere = work / "elsewhere"
    shutil.copytree(work / "r/train/checkpoints/step_1", elsewhere / "step_2")  # intact, but another run's place
    code, _, err = qerl_in_process(capsys, "eval", "arith:1", "--run", "r", "--checkpoint", str(elsewhere / "step_2"),
                                   *EVAL)
    refused(code, err, "--checkpoint", "is not in this run's checkpoints", "--checkpoint step_2")
    code, _, err = qerl_in_process(capsys, "eval", "arith:1", "--run", str(work / "r"), "--checkpoint",
                                   str(elsewhere / "step_2"), *EVAL)  # never this run's step_2 in its place
    refused(code, err, "is not in this run's checkpoints")
    assert not (work / "r/eval").exists()
    # a path into this run's checkpoints (relative to the working directory, or absolute) is that checkpoint
    code, _, err = qerl_in_process(capsys, "eval", "arith:1", "--run", "r", "--checkpoint",
                                   "r/train/checkpoints/step_1", *EVAL)
    assert code == 0, err
    result = json.loads((work / f"r/eval/arith-1-step_1{SUFFIX}.json").read_text())
    assert result["checkpoint"]["path"] == "train/checkpoints/step_1"

    metrics = (work / "r/train/metrics.jsonl").read_bytes()
    code, _, err = qerl_in_process(capsys, "train", "--run", "r", "--resume-from", str(elsewhere / "step_2"),
                                   "--steps", "3", *TRAIN_ARGS)
    refused(code, err, "--resume-from", "is not in this run's checkpoints")
    assert (work / "r/train/metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in (work / "r/train/checkpoints").iterdir()) == ["latest", "step_1", "step_2"]
