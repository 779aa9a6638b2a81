"""What `qerl train` prints: its first line says how long the run should take and how that was derived, each
step's rollout and update announce themselves with the run's ETA, and after `--resume` the summary counts the
steps this process ran, not the run's total."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# one step of a tiny model: 2 prompts x 2 samples of <= 2 tokens, zero-shot prompts (the output is checked, not
# the timing)
TINY = ["--config", "quick_cpu", "--batch-prompts", "2", "--num-generations", "2", "--max-completion-length", "2",
        "--shots", "0", "--lora-rank", "4", "--micro-batch-size", "4", "--save-steps", "1"]


def qerl(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "qerl_cli", *args], capture_output=True, text=True, env=env,
                          timeout=900, cwd=tempfile.gettempdir())


def test_progress_lines_eta_and_steps_of_this_run(tiny_run: Path) -> None:
    run_dir = tiny_run
    first = qerl("train", "--run", str(run_dir), "--steps", "1", *TINY)
    assert first.returncode == 0, first.stderr[-2000:]
    lines = first.stdout.splitlines()
    # line 1: the expectation and where it comes from (quick_cpu's measured step on a CPU, scaled to 4 sequences)
    assert lines[0].startswith("qerl train · grpo · arith · fp32 · AQN · 1 step, expected ~4s (63 s per step of "
                               "64 sequences measured on 2 CPU cores"), lines[0]
    assert "the ETA is re-estimated from each step" in lines[0]
    # the phases of step 1 as they start, then the step with its time and the ETA from this run's own steps
    rollout = next(i for i, line in enumerate(lines) if line.startswith("step 1/1 rollout; run ETA "))
    update = next(i for i, line in enumerate(lines) if line.startswith("step 1/1 update; run ETA "))
    done = next(i for i, line in enumerate(lines) if line.startswith("step 1/1 reward="))
    assert 0 < rollout < update < done
    assert "(measured preset)" in lines[rollout] and lines[done].endswith("run ETA 0s (mean of 1 step)")
    assert "trained 1 step in" in first.stdout

    again = qerl("train", "--run", str(run_dir), "--steps", "2", "--resume", *TINY)
    assert again.returncode == 0, again.stderr[-2000:]
    # resumed at step 1 of 2: one step left, and this process's summary counts that one
    assert again.stdout.splitlines()[0].startswith("qerl train · grpo · arith · fp32 · AQN · 1 step, expected")
    assert any(line.startswith("step 2/2 rollout; run ETA ") for line in again.stdout.splitlines())
    assert "trained 1 step (resumed at step 1; the run is at step 2) in" in again.stdout
