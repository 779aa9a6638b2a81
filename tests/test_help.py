"""Every `qerl` command's --help, rendered at 80 columns as a user sees it: every option name whole (a flag the
help cuts cannot be typed) and every help text as written (no `[...]` eaten as rich markup)."""

from __future__ import annotations

import re
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
