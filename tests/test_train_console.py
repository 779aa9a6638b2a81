"""What `qerl train` prints: its first line says how long the run should take and how that was derived, each
step's rollout and update announce themselves with the run's ETA, and after `--resume` the summary counts the
steps this process ran, not the run's total."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from tests.helpers import qerl_in_process

# one step of a tiny model: 2 prompts x 2 samples of <= 2 tokens, zero-shot prompts (the output is checked, not
# the timing)
TINY = ["--config", "quick_cpu", "--batch-prompts", "2", "--num-generations", "2", "--max-completion-length", "2",
        "--shots", "0", "--lora-rank", "4", "--micro-batch-size", "4", "--save-steps", "1"]


def qerl(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`qerl ARGS` in this process (a `qerl train` subprocess pays ~12 s of imports before it reads its options):
    exit code, stdout, stderr."""
    return qerl_in_process(capsys, *args)


@pytest.fixture
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's stdout console 200 columns wide (as COLUMNS=200 gives a process), writing to the captured stdout."""
    from qerl_cli import cli

    monkeypatch.setattr(cli, "console", Console(width=200))


def test_progress_lines_eta_and_steps_of_this_run(tiny_run: Path, capsys: pytest.CaptureFixture[str],
                                                  wide_console: None) -> None:
    run_dir = tiny_run
    code, out, err = qerl(capsys, "train", "--run", str(run_dir), "--steps", "1", *TINY)
    assert code == 0, err[-2000:]
    lines = out.splitlines()
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
    assert "trained 1 step in" in out

    code, out, err = qerl(capsys, "train", "--run", str(run_dir), "--steps", "2", "--resume", *TINY)
    assert code == 0, err[-2000:]
    # resumed at step 1 of 2: one step left, and this process's summary counts that one
    assert out.splitlines()[0].startswith("qerl train · grpo · arith · fp32 · AQN · 1 step, expected")
    assert any(line.startswith("step 2/2 rollout; run ETA ") for line in out.splitlines())
    assert "trained 1 step (resumed at step 1; the run is at step 2) in" in out


ENV = '''
class TwoSteps:
    turn_tokens = 2

    def reset(self, prompt):
        self.n = 0
        return ""

    def step(self, action):
        self.n += 1
        return " ok.", self.n >= 2, 0.5
'''


def test_episode_runs_report_progress_inside_rollout_and_update(tiny_run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 wide_console: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # a CPU update of an episode run takes minutes: the console says what each phase has done so far (here every
    # time, the interval set to 0), and no single-turn measured figure is offered as the run's expected time
    from qerl_cli.train import console

    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.0)
    (tmp_path / "two_steps.py").write_text(ENV)
    code, out, err = qerl(capsys, "train", "--run", str(tiny_run), "--steps", "1", *TINY, "--micro-batch-size", "2",
                          "--env", f"{tmp_path / 'two_steps.py'}:TwoSteps", "--max-completion-length", "8")
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    assert "1 step; expected time: from the first step's (no measured figure for this setup)" in lines[0]
    # 4 episodes of 2 turns: a step after each turn
    steps = [line for line in lines if line.startswith("step 1/1 rollout: ") and "environment steps done" in line]
    assert [line.split(": ")[1].split(" (")[0] for line in steps] == [f"{n} environment steps done"
                                                                      for n in range(1, 9)]
    micro = [line.split(": ")[1].split(" (")[0] for line in lines if line.startswith("step 1/1 update: ")]
    assert micro == ["forward+backward, micro-batch 1/2 done", "forward+backward, micro-batch 2/2 done"]
