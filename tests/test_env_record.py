"""Every environment variable qerl reads that changes what a stage computes is recorded in that stage's manifest
record (`env.qerl_env` for the QERL_ prefix, `env.other_env` for qerl_cli.env_info.RECORDED_ENV).

The code is scanned (ast) for reads: ``os.environ.get(X)``, ``os.getenv(X)``, ``os.environ[X]``, ``X in
os.environ``, with X a literal or a module-level string constant. A new read fails here until it is recorded
(QERL_ names are, by prefix) or listed below as not changing results, with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qerl_cli.env_info import RECORDED_ENV
from tests.helpers import environ_uses

ROOT = Path(__file__).resolve().parents[1]
SCANNED = [ROOT / "qerl_cli", ROOT / "kernels"]

# Read, but they change no result; each with why.
NOT_BEHAVIOUR = {
    "RANK": "this process's rank under torchrun: differs per process by design; the train record's dist entry "
            "holds the world size and every rank's pid",
    "LOCAL_RANK": "as RANK (picks cuda:LOCAL_RANK; the rank's device)",
    "COLUMNS": "the console's line width where the output is not a terminal: how the output is laid out, no result",
}

# Functions that touch the environment generically, by variable (no read of a named switch).
GENERIC = {
    ("qerl_cli/env_info.py", "temporary_env"): "saves and restores the variables it is told to set",
    ("qerl_cli/env_info.py", "recorded_env"): "the recorder itself",
}


def env_reads(path: Path, skip: tuple[str, ...] = ()) -> list[tuple[int, str | None]]:
    """(line, variable name) of every environment read in a file (outside the functions named in `skip`);
    name None when it is not a constant."""
    return environ_uses(path, skip=skip)


def _all_reads() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, var in env_reads(path, tuple(f for (file, f) in GENERIC if file == rel)):
                where = f"{rel}:{line}"
                assert var is not None, f"{where} reads an environment variable whose name is not a literal or a " \
                                        "module constant: name it, so this test can check it is recorded"
                found.setdefault(var, []).append(where)
    return found


def test_the_scanner_finds_reads_in_every_form(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import os\nENV = 'QERL_A'\nos.environ.get(ENV)\nos.getenv('B')\nx = os.environ['C']\n"
                   "'D' in os.environ\nos.environ['E'] = '1'\nos.environ.get(name)\n")
    assert env_reads(src) == [(3, "QERL_A"), (4, "B"), (5, "C"), (6, "D"), (8, None)]
    src.write_text("import os\ndef save(ks):\n    return {k: os.environ.get(k) for k in ks}\nos.getenv('B')\n")
    assert env_reads(src, ("save",)) == [(4, "B")]


def test_every_variable_the_code_reads_is_recorded_or_explained() -> None:
    reads = _all_reads()
    # the known switches are really found (else the scan itself is broken)
    assert {"QERL_FAST_DECODE", "QERL_LINEAR_BACKEND", "QERL_FP4_REPACK", "TRITON_INTERPRET"} <= set(reads)
    unrecorded = {v: w for v, w in reads.items()
                  if not v.startswith("QERL_") and v not in RECORDED_ENV and v not in NOT_BEHAVIOUR}
    assert not unrecorded, (f"environment variables read but not recorded in the manifest: {unrecorded}; add them "
                            "to qerl_cli.env_info.RECORDED_ENV (or to NOT_BEHAVIOUR here, with the reason)")


def test_a_stage_record_holds_every_variable_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_cli.manifest import RunDir

    reads = [v for v in _all_reads() if v not in NOT_BEHAVIOUR]
    values = {v: f"value-of-{v}" for v in reads}
    for v, x in values.items():
        monkeypatch.setenv(v, x)
    monkeypatch.setenv("QERL_NOT_READ_ANYWHERE", "1")  # the prefix is the contract: recorded all the same
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    run = RunDir(tmp_path / "r")
    with run.stage("quantize"):
        pass
    env = json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]["quantize"]["env"]
    recorded = {**env["qerl_env"], **env["other_env"]}
    for v, x in values.items():
        if v != "VLLM_CPU_KVCACHE_SPACE":
            assert recorded.get(v) == x, v
    assert env["qerl_env"]["QERL_NOT_READ_ANYWHERE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env["other_env"]  # unset: not recorded as anything
