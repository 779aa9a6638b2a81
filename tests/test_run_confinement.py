"""The run directory is untrusted input: every path read from it stays inside it, and no file in it names code
that runs. Each case tampers with a copy of one trained tiny-model run (2 steps, checkpoints step_1 and step_2,
one eval result) and runs the real commands in this process: the refusal is one line, exit 2, and nothing outside
the run is read as the run's or written."""

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
OUT = "outside the run directory"


@pytest.fixture(scope="module")
def trained(tiny_source, tmp_path_factory) -> Path:
    """A finished 2-step run of the tiny random model (NVFP4) with one eval result of its base."""
    from qerl_cli.eval.harness import run_eval
    from qerl_cli.quantize import quantize_model
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = tmp_path_factory.mktemp("confine") / "run"
    quantize_model(run, str(tiny_source), fmt="nvfp4")
    assert train(run, build_config("quick_cpu", TRAIN)).steps_done == 2
    run_eval(run, "arith:1", checkpoint="base", limit=1, max_tokens=2, shots=0, device="cpu")
    return run


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(trained, dst, symlinks=True, ignore=shutil.ignore_patterns(".lock"))
    return dst


def run_cli(capsys, *args: str) -> tuple[int, str]:  # noqa: ANN001
    """`qerl ARGS` in this process: exit code and stderr."""
    code, _, err = qerl_in_process(capsys, *args)
    return code, err


def refused(code: int, err: str, *needles: str) -> None:
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def eval_args(run: Path, *more: str) -> list[str]:
    return ["eval", "arith:1", "--run", str(run), "--limit", "1", "--max-tokens", "2", "--shots", "0",
            *more]


@pytest.mark.parametrize("form", ["absolute", "dotdot"])
def test_latest_naming_a_checkpoint_outside_is_refused_by_eval_and_resume(run: Path, tmp_path: Path, capsys,
                                                                         form: str) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(run / "train/checkpoints/step_2", outside / "step_2")  # intact: only its place is wrong
    (run / "train/checkpoints/latest").write_text(str(outside / "step_2") if form == "absolute"
                                                 else "../../../outside/step_2\n")
    before, outside_before = manifest(run), tree(outside)
    refused(*run_cli(capsys, *eval_args(run)), "train/checkpoints/latest holds", OUT)
    refused(*run_cli(capsys, "train", "--run", str(run), *TRAIN_ARGS, "--steps", "3", "--resume"),
            "train/checkpoints/latest holds", OUT)
    assert manifest(run) == before and tree(outside) == outside_before


def test_a_checkpoint_linked_outside_is_refused(run: Path, tmp_path: Path, capsys) -> None:
    outside = tmp_path / "outside"
    step = run / "train/checkpoints/step_2"
    shutil.move(step, outside / "step_2")
    step.symlink_to(outside / "step_2", target_is_directory=True)
    before = manifest(run)
    for args in (eval_args(run, "--checkpoint", "step_2"), eval_args(run, "--checkpoint", "step_1"), eval_args(run),
                 ["report", "--run", str(run)],
                 ["train", "--run", str(run), *TRAIN_ARGS, "--steps", "3", "--resume"]):
        refused(*run_cli(capsys, *args), "step_2 is a symbolic link to", OUT)
    assert manifest(run) == before


def test_an_eval_folder_linked_outside_is_refused_and_nothing_is_written_there(run: Path, tmp_path: Path,
                                                                              capsys) -> None:
    outside = tmp_path / "outside_eval"
    shutil.move(run / "eval", outside)
    (run / "eval").symlink_to(outside, target_is_directory=True)
    before, outside_before = manifest(run), tree(outside)
    refused(*run_cli(capsys, *eval_args(run, "--checkpoint", "base")), "eval is a symbolic link to", OUT)
    assert tree(outside) == outside_before and manifest(run) == before


def test_manifest_paths_leading_outside_are_refused(run: Path, tmp_path: Path, capsys) -> None:
    """The model (eval and train read it), the metrics and an eval result (report reads them), each moved out of
    the run intact, so only the path in the manifest is wrong."""
    outside = tmp_path / "outside"
    outside.mkdir()
    data = manifest(run)
    original = json.dumps(data)
    shutil.copytree(run / "model", outside / "model")
    data["stages"]["quantize"]["outputs"]["model"]["path"] = "../outside/model"
    (run / "manifest.json").write_text(json.dumps(data))
    refused(*run_cli(capsys, *eval_args(run, "--checkpoint", "base")), "quantize outputs.model.path", OUT)
    refused(*run_cli(capsys, "train", "--run", str(run), *TRAIN_ARGS, "--steps", "3", "--resume"),
            "quantize outputs.model.path", OUT)

    data = json.loads(original)
    shutil.copy(run / "train/metrics.jsonl", outside / "metrics.jsonl")
    data["stages"]["train"]["outputs"]["metrics"] = str(outside / "metrics.jsonl")
    (run / "manifest.json").write_text(json.dumps(data))
    refused(*run_cli(capsys, "report", "--run", str(run)), "train outputs.metrics", OUT)

    data = json.loads(original)
    key = next(k for k in data["stages"] if k.startswith("eval/"))
    result = data["stages"][key]["outputs"]["result"]
    shutil.copy(run / result, outside / "result.json")
    data["stages"][key]["outputs"]["result"] = "../outside/result.json"
    (run / "manifest.json").write_text(json.dumps(data))
    refused(*run_cli(capsys, "report", "--run", str(run)), f"{key} outputs.result", OUT)
    assert not (run / "report" / "index.html").exists()


def test_a_lock_linked_to_an_outside_file_is_refused_and_the_file_is_unchanged(run: Path, tmp_path: Path,
                                                                              capsys) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (run / ".lock").symlink_to(victim)
    before = manifest(run)
    refused(*run_cli(capsys, *eval_args(run, "--checkpoint", "base")), ".lock is a symbolic link")
    refused(*run_cli(capsys, "train", "--run", str(run), *TRAIN_ARGS, "--steps", "3", "--resume"),
            ".lock is a symbolic link")
    assert victim.read_text() == "keep me\n" and manifest(run) == before


def test_links_that_stay_inside_the_run_are_followed(run: Path) -> None:
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.checkpointing import latest_step

    ckpts = run / "train/checkpoints"
    shutil.move(ckpts / "step_2", run / "kept_step_2")
    (ckpts / "step_2").symlink_to(Path("../../kept_step_2"), target_is_directory=True)
    rd = RunDir(run, create=False)
    assert latest_step(rd) == 2
    assert rd.inside("train/checkpoints/step_2/config.json") == run / "train/checkpoints/step_2/config.json"
    assert rd.inside("train/../eval") == run / "eval"


# ---- bench sanity's saved subset ------------------------------------------------------------------------------
SANITY = {"steps": 1, "batch_prompts": 1, "num_generations": 2, "max_completion_length": 3, "task_level": "1",
          "lora_rank": 4, "shots": 0}


def sanity(run: Path, overrides: dict, log: list[str]) -> dict:
    from qerl_cli.bench.sanity import bench_sanity

    return bench_sanity(run_dir=run, grid={}, overrides={**SANITY, **overrides}, candidates=2, samples=2, lo=0.0,
                        hi=1.0, log=log.append)


def test_a_reward_named_in_the_saved_subset_is_never_imported(run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    sanity(run, {}, [])
    subset_path = run / "bench" / "perfectible.json"
    evil = run / "bench" / "reward.py"
    evil.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n\n\n"
                    "def reward(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    subset = json.loads(subset_path.read_text())
    subset["reward"] = f"{evil}:reward"
    subset_path.write_text(json.dumps(subset))
    log: list[str] = []
    res = sanity(run, {}, log)
    assert any(m.startswith("reusing the perfectible subset") for m in log), log
    assert not marker.exists()
    assert res["results"][0]["status"] == "ok" and res["results"][0]["steps_run"] == 1


def test_a_saved_subset_built_for_another_reward_is_rebuilt(run: Path, tmp_path: Path) -> None:
    always = tmp_path / "always.py"
    always.write_text("def right(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    sanity(run, {"reward": f"{always}:right"}, [])
    first = json.loads((run / "bench" / "perfectible.json").read_text())
    assert [p["pass_rate"] for p in first["problems"]] == [1.0, 1.0]  # measured with the command's reward
    log: list[str] = []
    sanity(run, {}, log)  # the task's own reward (arith): the random model solves nothing
    assert not any(m.startswith("reusing") for m in log) and any("building a new one" in m and "reward" in m
                                                                 for m in log), log
    again = json.loads((run / "bench" / "perfectible.json").read_text())
    assert again["key"]["reward"] is None and [p["pass_rate"] for p in again["problems"]] == [0.0, 0.0]
