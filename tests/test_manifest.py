"""Run directory and manifest: atomic writes, the run lock, stage status, refusals."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qerl_cli.errors import QerlError, RunLockedError, StageMissingError
from qerl_cli.manifest import SCHEMA_VERSION, RunDir, atomic_write_json, staged_directory


def test_stage_lifecycle_and_require(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    with pytest.raises(StageMissingError, match="qerl quantize --run"):
        run.require("quantize")
    with run.stage("quantize", config={"format": "nvfp4"}, seeds={"torch": 1}) as rec:
        assert json.loads(run.manifest_path.read_text())["stages"]["quantize"]["status"] == "running"
        rec.outputs = {"model": {"path": "model"}}
    data = json.loads(run.manifest_path.read_text())
    entry = data["stages"]["quantize"]
    assert data["schema_version"] == SCHEMA_VERSION
    assert entry["status"] == "completed" and entry["outputs"] == {"model": {"path": "model"}}
    assert entry["duration_s"] >= 0 and entry["finished"] and entry["seeds"] == {"torch": 1}
    assert run.require("quantize")["config"] == {"format": "nvfp4"}
    assert [h["status"] for h in data["history"]] == ["completed"]


def test_failed_and_interrupted_stages_are_recorded(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    with pytest.raises(ValueError), run.stage("quantize"):
        raise ValueError("boom")
    assert run.record("quantize")["status"] == "failed" and run.record("quantize")["error"] == "boom"
    with pytest.raises(StageMissingError, match="failed, not completed"):
        run.require("quantize")
    with pytest.raises(KeyboardInterrupt), run.stage("quantize"):
        raise KeyboardInterrupt
    assert run.record("quantize")["status"] == "interrupted"
    assert [h["status"] for h in run.read()["history"]] == ["failed", "interrupted"]


HOLD_LOCK = """
import sys, time
from qerl_cli.manifest import RunDir
with RunDir(sys.argv[1]).lock():
    print("locked", flush=True)
    sys.stdin.readline()
"""

KILLED_MID_STAGE = """
import os, signal, sys
from qerl_cli.manifest import RunDir
with RunDir(sys.argv[1]).stage("train"):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_second_writer_is_refused(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=r"another qerl process \(pid \d+\) is writing"):
            with RunDir(tmp_path).stage("quantize"):
                pass
    finally:
        holder.communicate("\n", timeout=60)
    with RunDir(tmp_path).stage("quantize"):  # free again once the holder exits
        pass


def test_sigkill_mid_stage_reads_as_interrupted(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_STAGE, str(tmp_path)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["stages"]["train"]["status"] == "running"  # what the killed process left
    assert RunDir(tmp_path).record("train")["status"] == "interrupted"  # what readers are told


def test_corrupted_manifest_is_reported_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text('{"schema_version": 1, "stages": {')
    before = (tmp_path / "manifest.json").read_bytes()
    with pytest.raises(QerlError, match="corrupted"):
        with RunDir(tmp_path).stage("quantize"):
            pass
    assert (tmp_path / "manifest.json").read_bytes() == before


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    atomic_write_json(tmp_path / "manifest.json", {"schema_version": SCHEMA_VERSION + 1, "stages": {}})
    with pytest.raises(QerlError, match="newer than this qerl"):
        RunDir(tmp_path).read()


def test_run_dir_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(QerlError, match="is a file"):
        RunDir(f)


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    for i in range(3):
        atomic_write_json(tmp_path / "m.json", {"i": i})
    assert json.loads((tmp_path / "m.json").read_text()) == {"i": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_staged_directory_is_all_or_nothing(tmp_path: Path) -> None:
    final = tmp_path / "model"
    with staged_directory(final) as tmp:
        (tmp / "a").write_text("1")
    assert (final / "a").read_text() == "1"
    with pytest.raises(RuntimeError), staged_directory(final) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("crash mid-write")
    assert (final / "a").read_text() == "1"  # the old output is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_out_of_disk_space_maps_to_clear_error(tmp_path: Path) -> None:
    import errno

    def full(*_a, **_k):  # noqa: ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    final = tmp_path / "model"
    with pytest.raises(QerlError, match="out of disk space"), staged_directory(final) as tmp:
        (tmp / "x").write_text("partial")
        full()
    assert not final.exists() and list(tmp_path.iterdir()) == []
