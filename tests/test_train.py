"""`qerl train` end to end on the embedded model (CPU): reward rises on arith, AQN proves itself,
resume after SIGKILL reproduces the uninterrupted run exactly, and bad input fails cleanly."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from qerl_cli.errors import QerlError
from tests.helpers import qerl_in_process

SMALL = ["--task-level", "1", "--batch-prompts", "4", "--num-generations", "4", "--max-completion-length", "4",
         "--lora-rank", "8", "--lr", "3e-4", "--precision", "fp32", "--micro-batch-size", "16", "--seed", "3"]


def qerl(*args: str, wait: bool = True) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "qerl_cli", *args]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=tempfile.gettempdir())
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tempfile.gettempdir())


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`qerl ARGS` in this process: exit code, stdout, stderr. For what is not about the process itself (a real
    signal to a real process is): a `qerl train` subprocess pays ~12 s of imports before it reads its options."""
    return qerl_in_process(capsys, *args)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}


def test_dry_run_prints_resolved_config(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "train", "--run", str(run_dir), "--config", "quick_cpu", "--algo", "dapo", "--dry-run")
    assert code == 0, err
    assert "algo: dapo" in out and "epsilon_high: 0.28" in out and "dynamic_sampling: true" in out
    # the memory plan for the run's model (CPU: host memory, no cap; the preset's micro-batch 32 is kept)
    assert "memory plan (64 sequences x" in out and "host memory (CPU run; not capped)" in out
    assert "on the GPU" not in out and "step time estimate: none on the CPU" in out
    assert "chosen: micro_batch_size 32, gradient_checkpointing false" in out
    assert not (run_dir / "train").exists()


def test_quick_run_raises_arith_reward_and_logs_aqn(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # one-shot prompts (13 tokens where the preset's 4 shots take 43): a step's forward and backward passes cost what
    # its tokens do, and the reward still climbs (seed 0: 0.34 -> 1.0; seeds 1-3 rose by 0.31-0.50, as much as with
    # 4 shots), in ~55 s instead of ~95 s on 2 cores. In this process: a subprocess pays ~12 s of imports first
    code, _, err = cli(capsys, "train", "--run", str(run_dir), "--config", "quick_cpu", "--steps", "5",
                       "--aqn-stages", "3", "--task-level", "1", "--shots", "1", "--batch-prompts", "8",
                       "--num-generations", "4", "--max-completion-length", "4", "--lora-rank", "8", "--lr", "5e-4",
                       "--precision", "fp32", "--micro-batch-size", "32", "--seed", "0")
    assert code == 0, err[-2000:]
    ms = metrics(run_dir)
    assert [m["step"] for m in ms] == [1, 2, 3, 4, 5]
    first, last = ms[0]["accuracy"], max(m["accuracy"] for m in ms[-2:])
    assert last >= first + 0.15, [m["accuracy"] for m in ms]
    # AQN: stage 0 noise-free, later stages noisy with a decaying sigma, and the noise reached the rollout
    sig = [m["aqn/sigma"] for m in ms]
    # 5 steps in 3 stages (stage = step*3 // 5): stage 0 noise-free, stage 1 sigma_start, stage 2 sigma_end
    assert sig[:2] == [0.0, 0.0] and sig[2:4] == pytest.approx([1e-2, 1e-2]) and sig[4] == pytest.approx(5e-4)
    assert ms[0]["aqn/noise_norm"] == 0.0 and ms[2]["aqn/noise_norm"] > 0.1 and ms[2]["aqn/applied_noise_norm"] > 0
    # no noise: rollout and training forward agree to rounding; noise in the rollout policy only shows up as mismatch
    assert ms[0]["sampling/k3"] < 1e-6 and ms[2]["sampling/k3"] > 1e-4
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
                "entropy", "clip_ratio", "grad_norm", "lr", "sampling/k1", "sampling/max_abs_dprob",
                "timing/rollout_s", "timing/train_s"):
        assert key in ms[-1], key
    rollouts = (run_dir / "train" / "rollouts" / "step_00005.jsonl").read_text().splitlines()
    row = json.loads(rollouts[0])
    assert {"prompt", "completion", "reward", "advantage", "logprob_sum"} <= set(row)
    ckpt = run_dir / "train" / "checkpoints" / "step_5"
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file()
    assert (run_dir / "train" / "checkpoints" / "latest").read_text().strip() == "step_5"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["train"]["status"] == "completed"
    assert manifest["stages"]["train"]["config"]["aqn"] is True


def test_resume_after_sigkill_reproduces_metrics_exactly(tiny_run: Path, text_hash_reward: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # the tiny model (the test is about state, not learning: the embedded model took 95 s), 8 sequences of up to
    # 32 tokens a step (~1.3 s on 2 cores: the kill lands mid-run), a reward that moves the adapter every step.
    # Only the killed run is a process of its own (the kill is the point); the reference, the refusal and the resume
    # run the same CLI in this process (three more processes cost ~50 s of imports)
    run_dir = tiny_run
    args = ["--config", "quick_cpu", "--steps", "6", "--save-steps", "1", "--aqn-stages", "2", *SMALL,
            "--batch-prompts", "2", "--max-completion-length", "32", "--reward", text_hash_reward]
    reference = tmp_path / "reference"
    shutil.copytree(run_dir, reference)
    code, _, err = cli(capsys, "train", "--run", str(reference), *args)
    assert code == 0, err[-2000:]

    proc = qerl("train", "--run", str(run_dir), *args, wait=False)
    metrics_file = run_dir / "train" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once step 2 is logged: mid-run, after the step_1 checkpoint
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 2:
            break
        if proc.poll() is not None:
            pytest.fail(f"training ended early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]["status"] == "running"
    # step_2's checkpoint is written in the background while step 3 runs: the kill may land before or after it
    latest = (run_dir / "train" / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step_1", "step_2", "step_3", "step_4", "step_5"), latest

    code, _, err = cli(capsys, "train", "--run", str(run_dir), *args)
    assert code == 2 and "--resume" in err
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]["status"] == "running"  # untouched
    code, _, err = cli(capsys, "train", "--run", str(run_dir), *args, "--resume")
    assert code == 0, err[-2000:]
    got, want = metrics(run_dir), metrics(reference)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5, 6]
    assert [comparable(m) for m in got] == [comparable(m) for m in want]
    assert min(m["grad_norm"] for m in want) > 1e-4  # every step moved the adapter: the state resumed is not trivial


def test_missing_and_unquantized_run_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "train", "--run", str(tmp_path / "nope"), "--config", "quick_cpu")
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, "train", "--run", str(tmp_path / "empty"), "--config", "quick_cpu")
    assert code == 2 and "qerl quantize" in err


def test_bad_options_are_refused(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "train", "--run", str(run_dir), "--algo", "ppo", "--dry-run")
    assert code == 2 and "--algo must be one of" in err
    code, _, err = cli(capsys, "train", "--run", str(run_dir), "--config", "no_such_preset", "--dry-run")
    assert code == 2 and "presets:" in err


def bad_reward_raises(prompts, completions, **kwargs):  # noqa: ANN001, ANN201
    raise RuntimeError("reward server down")


def bad_reward_nan(prompts, completions, **kwargs):  # noqa: ANN001, ANN201
    return [float("nan")] * len(completions)


@pytest.mark.parametrize("reward, needle", [("raises", "reward server down"), ("nan", "(?i)nan.*finite")])
def test_bad_reward_functions_fail_cleanly(run_dir: Path, reward: str, needle: str) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    path = Path(__file__).resolve()
    cfg = build_config("quick_cpu", {"steps": 1, "batch_prompts": 2, "num_generations": 2,
                                     "reward": f"{path}:bad_reward_{reward}"})
    with pytest.raises(QerlError, match=needle):
        train(run_dir, cfg)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["train"]["status"] == "failed"
    assert not (run_dir / "train" / "checkpoints").exists()


def test_task_file_with_missing_column(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "solution": "2"}\n')
    code, _, err = cli(capsys, "train", "--run", str(run_dir), "--config", "quick_cpu", "--task", f"jsonl:{bad}",
                       "--steps", "1")
    assert code == 2 and "answer" in err and "Traceback" not in err


def test_ctrl_c_checkpoints_and_exits_cleanly(tiny_run: Path) -> None:
    run_dir = tiny_run  # the tiny model: the test is about the signal path, not the model (embedded: 38 s)
    args = ["--config", "quick_cpu", "--steps", "50", "--save-steps", "50", *SMALL]
    proc = qerl("train", "--run", str(run_dir), *args, wait=False)
    metrics_file = run_dir / "train" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and not (metrics_file.exists() and metrics_file.read_text().strip()):
        if proc.poll() is not None:
            pytest.fail(f"training ended early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted" in err
    done = len(metrics(run_dir))
    assert done < 50
    latest = (run_dir / "train" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{done}"  # the step in flight finished, then a checkpoint was written
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]["status"] == "interrupted"


def test_fp16_uses_loss_scaling_and_mismatches_less_than_bf16(tiny_run: Path) -> None:
    """Both 16-bit precisions train; fp16 runs the GradScaler, and its rollout/training mismatch (k3) is
    below bf16's, the FP16-vs-BF16 paper's finding. On the tiny random Llama (the property is rounding, not the
    model: ~65x there, ~10x on the embedded model, whose 16-bit training costs ~50 s a step on 2 CPU cores)."""
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run_dir = tiny_run
    k3 = {}
    for precision in ("fp16", "bf16"):
        shutil.rmtree(run_dir / "train", ignore_errors=True)
        cfg = build_config("quick_cpu", {"steps": 2, "batch_prompts": 4, "num_generations": 4, "aqn": False,
                                         "precision": precision})
        ms = train(run_dir, cfg).metrics
        assert all(math.isfinite(m["grad_norm"]) and math.isfinite(m["loss"]) for m in ms)
        if precision == "fp16":
            assert ms[0]["fp16/loss_scale"] == 65536.0 and ms[0]["fp16/step_skipped"] == 0.0
        else:
            assert "fp16/loss_scale" not in ms[0]
        k3[precision] = sum(m["sampling/k3"] for m in ms) / len(ms)
    assert 0 < k3["fp16"] < k3["bf16"] / 3, k3
