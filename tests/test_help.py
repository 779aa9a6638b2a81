"""Every `qerl` command's --help, rendered at 80 columns as a user sees it: every option name whole (a flag the
help cuts cannot be typed) and every help text as written (no `[...]` eaten as rich markup)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from qerl_cli.cli import app


def _commands() -> list[tuple[list[str], Any]]:
    """(argv prefix, click command) for every leaf command, `bench *` included. Duck-typed: typer >= 0.29 builds
    them from its bundled copy of click, whose classes are not the installed click's."""
    out: list[tuple[list[str], Any]] = []

    def walk(prefix: list[str], cmd: Any) -> None:
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk([*prefix, name], sub)
        else:
            out.append((prefix, cmd))

    walk([], typer.main.get_command(app))
    return out


COMMANDS = _commands()


def _render(argv: list[str]) -> str:
    res = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0, res.output
    return res.output


def test_every_subcommand_is_covered() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"quantize", "train", "eval", "report", "bench kernels", "bench rollout", "bench mismatch", "bench step",
            "bench sanity", "bench evidence"} <= names


@pytest.mark.parametrize("argv,cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_at_80_columns_shows_every_option_name_and_help_whole(argv: list[str], cmd: Any) -> None:
    text = _render(argv)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for param in cmd.params:
        if param.param_type_name != "option":
            continue
        for name in [*param.opts, *param.secondary_opts]:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} is not whole in:\n{text}"
        if param.help:  # the help as written, wrapped anywhere but with nothing dropped
            flat = re.sub(r"\s+", "", text)
            assert re.sub(r"\s+", "", param.help) in flat, f"help of {param.opts[0]} altered in:\n{text}"


def test_quantize_help_keeps_the_extra_in_brackets() -> None:
    text = _render(["quantize"])
    assert "qerl[llmcompressor]" in re.sub(r"\s+", "", text)


@pytest.mark.parametrize("argv", [[], ["bench"]], ids=["qerl", "qerl bench"])
def test_command_lists_show_every_description_whole(argv: list[str]) -> None:
    text = _render(argv)
    group = typer.main.get_command(app)
    for name in argv:
        group = group.commands[name]
    listing = text[text.index("Commands:"):]
    assert "..." not in listing, text
    for name, cmd in group.commands.items():
        line = next(line for line in text.splitlines() if line.startswith(f"  {name} "))
        short = cmd.short_help or cmd.help.splitlines()[0]
        assert line.split(None, 1)[1] == short, line


@pytest.mark.parametrize("argv,cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_metavars_read_as_words_not_python_types(argv: list[str], cmd: Any) -> None:
    text = _render(argv)
    assert "list[" not in text, text


def test_train_help_says_presets_replace_the_defaults_and_how_to_run_torchrun() -> None:
    flat = " ".join(_render(["train"]).split())
    assert "a default named in a flag's help below applies only where the preset leaves that field unset" in flat
    assert "--lr FLOAT" not in flat and "Learning rate (1e-5 where the preset sets none; quick_cpu and gpu_arith set " \
        "2e-4)." in flat
    # the README's form: torchrun would read --run as its own --run-path without the `--`
    assert "`torchrun --nproc-per-node N -m qerl_cli -- train --run DIR ...` (gloo)" in flat
    assert "--set KEY=VALUE" in flat and "--lora-targets NAMES" in flat


def test_readme_first_screen_ends_with_the_two_commands() -> None:
    """A newcomer reads what qerl is, how to get it and both commands before scrolling (CI reads both commands
    from under their markers and runs them as written, .ci/run)."""
    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    first = lines[:40]
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        i = first.index(marker)
        assert first[i + 1] == "```" and first[i + 2].startswith("pip install torch==2.13.0 && ")
        assert first[i + 3] == "```"
    assert any(line.startswith("git clone ") for line in first)
    assert any("python -m venv" in line and "activate" in line for line in first)
    assert first[first.index("<!-- test-command -->") + 2].endswith("&& pytest -q --durations=15")
