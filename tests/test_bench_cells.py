"""The bench cell grammar (qerl_cli/bench/cells.py) on hand-written names."""

from __future__ import annotations

import pytest

from qerl_cli.bench.cells import Cell, check_cell, parse_cell
from qerl_cli.errors import QerlError


@pytest.mark.parametrize(("text", "want"), [
    ("nvfp4", Cell("nvfp4", "nvfp4")),
    ("bf16", Cell("bf16", "bf16")),
    ("bf16+nvfp4", Cell("bf16+nvfp4", "bf16", rollout="nvfp4")),
    ("bf16+int8", Cell("bf16+int8", "bf16", rollout="int8")),
    ("nvfp4@vllm", Cell("nvfp4@vllm", "nvfp4", engine="vllm")),
    ("trl", Cell("trl", "trl", peer=True)),
])
def test_parse_cell(text, want):
    assert parse_cell(text, peers=("trl",)) == want


def test_cell_kinds_and_keys():
    assert parse_cell("nvfp4").builtin and parse_cell("bf16+int8").builtin
    assert not parse_cell("nvfp4@vllm").builtin and not parse_cell("trl", ("trl",)).builtin
    assert parse_cell("nvfp4@vllm").key == "nvfp4_vllm" and parse_cell("trl", ("trl",)).key == "trl"
    assert parse_cell("trl") == Cell("trl", "trl")  # not named as a peer: a (probably unknown) format


@pytest.mark.parametrize(("text", "msg"), [
    ("", "no base format"),
    ("+int8", "no base format"),
    ("@vllm", "no base format"),
    ("bf16+", "no rollout format"),
    ("bf16+int8+fp8", "bad rollout format"),
    ("nvfp4@sglang", "unknown engine 'sglang'"),
    ("nvfp4@", "unknown engine ''"),
    ("nvfp4@vllm@vllm", "unknown engine"),
    ("bf16+int8@vllm", "a rollout format and an engine together"),
    ("NV FP4", "bad base format"),
    (None, "a bench cell is a name"),
])
def test_parse_cell_refuses(text, msg):
    with pytest.raises(QerlError, match=msg):
        parse_cell(text)


def test_check_cell_against_the_registry():
    bases, rollouts = ("bf16", "nvfp4"), ("int8", "fp8")
    assert check_cell(parse_cell("nvfp4@vllm"), bases, rollouts)
    assert check_cell(parse_cell("bf16+fp8"), bases, rollouts)
    assert not check_cell(parse_cell("nvfp5"), bases, rollouts)
    assert not check_cell(parse_cell("bf16+nvfp4"), bases, rollouts)
    assert check_cell(parse_cell("trl", ("trl",)), bases, rollouts)
