"""`qerl report` text a user reads: the missing-eval hint names a task, reward = accuracy is said once, and the
k3 jump under AQN is explained."""

from __future__ import annotations

import json
from pathlib import Path

from qerl_cli.manifest import RunDir
from qerl_cli.report import build_report


def _run(root: Path, *, reward_is_accuracy: bool, aqn: bool) -> Path:
    run = RunDir(root / "run")
    with run.stage("quantize", config={"format": "nvfp4"}) as rec:
        rec.metrics.update({"format": "nvfp4"})
    (run.path / "train").mkdir()
    rows = [{"step": s, "accuracy": 0.25 * s, "reward": 0.25 * s + (0 if reward_is_accuracy else 0.1),
             "sampling/k3": 1e-7 if s == 1 else 1e-3, "aqn/sigma": (0.0 if s == 1 else 1e-2) if aqn else 0.0}
            for s in (1, 2, 3)]
    (run.path / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with run.stage("train", config={"algo": "grpo", "task": "arith", "steps": 3}) as rec:
        rec.outputs["metrics"] = "train/metrics.jsonl"
    return run.path


def test_identical_reward_and_accuracy_is_one_line_and_k3_is_explained(tmp_path: Path) -> None:
    page = build_report(_run(tmp_path, reward_is_accuracy=True, aqn=True))["html"].read_text()
    assert "identical here: the reward is 1 for a correct answer" in page
    assert "the rollout policy carries the noise" in page
    # the missing eval names the command with its task argument
    assert f"qerl eval arith --run {tmp_path / 'run'} --checkpoint base" in page


def test_distinct_reward_and_no_aqn_keep_the_plain_captions(tmp_path: Path) -> None:
    page = build_report(_run(tmp_path, reward_is_accuracy=False, aqn=False))["html"].read_text()
    assert "identical here" not in page and "carries the noise" not in page
    assert "Reward and accuracy vs step" in page
