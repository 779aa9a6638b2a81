"""`qerl train` options are generated from TrainConfig: every field has its flag, and flags named in
messages exist."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from qerl_cli.train.config import TrainConfig, train_flags

ROOT = Path(__file__).resolve().parents[1]


def train_option_names() -> set[str]:
    import typer.main

    from qerl_cli.cli import app

    group = typer.main.get_command(app)
    train = group.commands["train"]  # type: ignore[attr-defined]
    return {opt for p in train.params for opt in (*p.opts, *p.secondary_opts)}


def test_every_config_field_has_a_flag() -> None:
    names = train_option_names()
    for f in dataclasses.fields(TrainConfig):
        dash = f.name.replace("_", "-")
        assert f"--{dash}" in names, f.name
        if f.type in ("bool", "bool | None"):
            assert f"--no-{dash}" in names, f.name
    assert len([f for f in train_flags()]) == len(dataclasses.fields(TrainConfig))


def test_flags_named_in_train_messages_exist() -> None:
    """The trainer once recommended --gradient-checkpointing and --max-refill-rounds, which had no flag."""
    other_commands = {"--debug", "--help", "--format", "--nproc-per-node", "--standalone", "--run-path", "--no",
                      "--checkpoint",  # `qerl eval --checkpoint`: train/checkpointing.py also serves eval
                      "--memory-cap",  # `qerl bench step --memory-cap`: the memory plan's advice serves that bench
                      "--formats"}  # `qerl bench step --formats`: so does its advice after an out-of-memory cell
    names = train_option_names() | other_commands
    for path in (ROOT / "qerl_cli" / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for flag in re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", node.value):
                    assert flag in names, f"{path.name} mentions {flag}, which `qerl train` does not have"


def test_generated_flags_yaml_and_set_combine(tmp_path: Path) -> None:
    """Preset first, then --set, then flags; list flags split on commas; booleans have --no-."""
    env = {**os.environ, "COLUMNS": "200"}
    res = subprocess.run(
        [sys.executable, "-m", "qerl_cli", "train", "--run", str(tmp_path / "r"), "--config", "gpu_arith",
         "--dry-run", "--gradient-checkpointing", "--max-refill-rounds", "5", "--no-aqn", "--no-log-rollouts",
         "--lora-targets", "q_proj, v_proj", "--set", "lr=1e-3", "--lr", "5e-4", "--set", "warmup_steps=2"],
        capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    assert cfg["gradient_checkpointing"] is True and cfg["max_refill_rounds"] == 5
    assert cfg["aqn"] is False and cfg["log_rollouts"] is False  # gpu_arith has aqn: true
    assert cfg["lora_targets"] == ["q_proj", "v_proj"]
    assert cfg["lr"] == 5e-4 and cfg["warmup_steps"] == 2
    assert cfg["algo"] == "dapo" and cfg["task"] == "arith"  # from the preset (the mission's recipe: DAPO + AQN)
