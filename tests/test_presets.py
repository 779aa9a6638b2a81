"""Which preset `qerl train` runs when none is named: on a GPU the mission's recipe (DAPO + AQN), sized for the
embedded model or QeRL's LoRA settings for any other; on a CPU the quick arith run."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.train.config import build_config
from qerl_cli.train.presets import choose_preset
from tests.helpers import qerl_in_process


def test_gpu_default_for_the_embedded_model_is_dapo_with_aqn(run_dir: Path) -> None:
    choice = choose_preset(None, run_dir, on_cuda=True)
    assert (choice.name, choice.chosen_by_default) == ("gpu_arith", True)
    cfg = build_config(choice.name, {}).resolved()
    assert (cfg.algo, cfg.aqn, cfg.task) == ("dapo", True, "arith")
    # DAPO's own parts are on: clip-higher and dynamic sampling
    assert (cfg.epsilon, cfg.epsilon_high, cfg.dynamic_sampling) == (0.2, 0.28, True)
    assert cfg.batch_prompts * cfg.num_generations == 512 and cfg.steps == 40


def test_gpu_default_for_another_model_follows_qerl_lora_settings(tiny_run: Path) -> None:
    choice = choose_preset(None, tiny_run, on_cuda=True)
    assert choice.name == "gsm8k_dapo_paper" and "QeRL" in choice.reason
    cfg = build_config(choice.name, {}).resolved()
    assert (cfg.algo, cfg.aqn, cfg.lora_rank, cfg.lora_alpha, cfg.lr) == ("dapo", True, 32, 64, 1e-5)
    assert (cfg.aqn_sigma_start, cfg.aqn_sigma_end, cfg.aqn_stages) == (1e-2, 5e-4, 10)


def test_cpu_default_and_a_named_preset(run_dir: Path) -> None:
    assert choose_preset(None, run_dir, on_cuda=False).name == "quick_cpu"
    named = choose_preset("gsm8k_grpo_paper", run_dir, on_cuda=True)
    assert (named.name, named.chosen_by_default) == ("gsm8k_grpo_paper", False)


def test_dry_run_on_a_gpu_machine_states_the_preset(run_dir: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_cli import cli as qerl_cli

    # the CLI's one question about the machine, answered as a GPU machine would
    monkeypatch.setattr(qerl_cli, "_has_cuda", lambda: True)
    code, out, _ = qerl_in_process(capsys, "train", "--run", str(run_dir), "--dry-run")
    assert code == 0
    assert "algo: dapo" in out and "aqn: true" in out
    assert "# preset: gpu_arith (a CUDA device and the embedded SmolLM2-135M" in out
