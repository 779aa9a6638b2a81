"""The bench harness (qerl_cli/bench/harness.py): cells, OOM as a recorded cell, time budget, outputs, manifest."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.table import Table

from qerl_cli.bench import harness
from qerl_cli.bench.harness import SKIPPED_BUDGET, Budget, Cell, run_cells
from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir


def _alloc_too_much() -> dict:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")


def test_oom_in_one_cell_is_recorded_and_the_next_cell_runs():
    ran = []

    def ok(n: int):
        def measure() -> dict:
            ran.append(n)
            return {"value": n * n}
        return measure

    logged: list[str] = []
    rows = run_cells([Cell({"batch": 1}, ok(1)), Cell({"batch": 2}, _alloc_too_much, "batch 2"),
                      Cell({"batch": 3}, ok(3))], oom="OOM/skipped", log=logged.append)
    oom_note = "CUDA out of memory. Tried to allocate 80.00 GiB"
    assert rows == [{"batch": 1, "status": "ok", "value": 1}, {"batch": 2, "status": "OOM/skipped", "note": oom_note},
                    {"batch": 3, "status": "ok", "value": 9}]
    assert ran == [1, 3]
    assert logged == [f"batch 2: OOM/skipped: {oom_note}"]


def test_failures_and_statuses():
    def boom() -> dict:
        raise ValueError("bad shape\nsecond line")

    def empty() -> dict:
        raise RuntimeError()

    def partial_fit() -> dict:
        return {"status": "ok (3 slots fit)", "slots": 3}

    def no_bucket() -> dict:  # what a bare next() over an empty budget-dependent list raised
        return {"bucket": next(iter([]))}

    rows = run_cells([Cell({"c": "a"}, boom), Cell({"c": "b"}, empty), Cell({"c": "c"}, partial_fit),
                      Cell({"c": "d"}, no_bucket)])
    assert [r["status"] for r in rows] == ["error: bad shape", "error: RuntimeError", "ok (3 slots fit)",
                                           "error: StopIteration"]
    assert rows[0]["note"] == "bad shape"
    # a failure without a message still says where it was raised
    assert rows[3]["note"] == ("StopIteration raised without a message at tests/test_bench_harness.py:"
                               f"{no_bucket.__code__.co_firstlineno + 1} (no_bucket)")
    assert list(rows[2]) == ["c", "status", "slots"]  # the key first, then the status, then the numbers
    # the engine's own message for a cache that cannot hold one sequence counts as out of memory
    assert harness.failure_status(QerlError("no room for even one KV-cache slot")) == "OOM"


def test_fatal_errors_and_interrupts_stop_the_bench():
    def missing_run() -> dict:
        raise QerlError("run directory r does not exist")

    with pytest.raises(QerlError, match="run directory"):
        run_cells([Cell({}, missing_run)], fatal=lambda e: "run directory" in str(e))
    with pytest.raises(ZeroDivisionError):
        run_cells([Cell({}, lambda: {"x": 1 / 0})], fatal=lambda e: True)
    assert run_cells([Cell({}, missing_run)])[0]["status"] == "error: run directory r does not exist"

    def interrupted() -> dict:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_cells([Cell({}, interrupted)])


def test_time_budget_skips_the_remaining_cells():
    def slow() -> dict:
        time.sleep(0.2)
        return {}

    cells = [Cell({"i": i}, slow) for i in range(4)]
    rows = run_cells(cells, budget=Budget(0.1))
    assert [r["status"] for r in rows] == ["ok", SKIPPED_BUDGET, SKIPPED_BUDGET, SKIPPED_BUDGET]
    assert cells[0].seconds >= 0.2 and cells[1].seconds is None
    # a guess of the cell's own time: nothing starts that would end past the budget
    rows = run_cells([Cell({"i": 0}, slow)], budget=Budget(10.0), guess=lambda c: 11.0)
    assert rows == [{"i": 0, "status": SKIPPED_BUDGET}]
    assert not Budget(None).exceeded(1e9)


def test_results_written_with_header_plot_and_json(tmp_path):
    res = harness.header("bench/demo", model="m", config={"n": 2})
    assert list(res)[:6] == ["schema", "kind", "date", "model", "config", "env"]
    res["results"] = run_cells([Cell({"n": 1}, lambda: {"x": 0.5}), Cell({"n": 2}, _alloc_too_much)])

    def draw(path):
        fig, ax = harness.figure(figsize=(3, 2))
        ax.plot([1, 2], [3, 4])
        harness.save_figure(fig, path)

    paths = harness.write_results(res, tmp_path / "o", "demo.json", {"plot": ("demo.png", draw)},
                                  extra_files={"subset": tmp_path / "o" / "s.json"})
    on_disk = json.loads(paths["json"].read_text())
    assert on_disk["kind"] == "bench/demo" and on_disk["schema"] == harness.SCHEMA
    assert on_disk["date"].endswith("+00:00") and "device" in on_disk["env"]
    assert on_disk["results"] == [{"n": 1, "status": "ok", "x": 0.5},
                                  {"n": 2, "status": "OOM", "note": "CUDA out of memory. Tried to allocate 80.00 GiB"}]
    assert list(on_disk["files"]) == ["json", "plot", "subset"]
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["demo.json", "demo.png"]  # no temp files


def test_manifest_record_when_a_run_dir_is_given(tmp_path):
    run = RunDir(tmp_path / "run")
    out = tmp_path / "run" / "bench"
    harness.record(run, "demo", config={"n": 2}, outputs={"json": out / "demo.json"},
                   metrics={"a/x": 0.5}, inputs={"model": "model"}, extra={"p": tmp_path})
    rec = RunDir(tmp_path / "run", create=False).record("bench/demo")
    assert rec["status"] == "completed" and rec["stage"] == "bench"
    assert rec["outputs"] == {"json": {"path": "bench/demo.json"}} and rec["metrics"] == {"a/x": 0.5}
    assert rec["extra"] == {"p": str(tmp_path)}
    assert harness.out_dir(None, run, "demo") == out
    assert harness.out_dir(tmp_path / "d", run, "demo") == tmp_path / "d"


def test_default_output_folder_is_new_for_every_run(tmp_path, monkeypatch):
    """Without --out or --run a bench writes to ./qerl-bench/<bench>-<date>-<time>, never into an earlier one."""
    import datetime

    monkeypatch.chdir(tmp_path)
    now = datetime.datetime(2026, 11, 26, 9, 5, 7)
    first = harness.default_out("step", now)
    assert harness.out_dir(None, None, "step").parent == Path("qerl-bench")
    assert first == Path("qerl-bench/step-20261126-090507")
    first.mkdir(parents=True)
    assert harness.default_out("step", now) == Path("qerl-bench/step-20261126-090507-2")
    (tmp_path / "qerl-bench" / "step-20261126-090507-2").mkdir()
    assert harness.default_out("step", now) == Path("qerl-bench/step-20261126-090507-3")
    assert harness.default_out("kernels", now) == Path("qerl-bench/kernels-20261126-090507")


def test_table_split_to_the_terminal_and_number_cells():
    table = Table(title="demo")
    for c in ("format", *(f"column {i}" for i in range(12))):
        table.add_column(c)
    table.add_row("nvfp4", *(harness.num(1234.5678 * i, "{:,.1f}") for i in range(12)))
    buf = io.StringIO()
    console = Console(file=buf, width=80, color_system=None)
    parts = harness.fit_table(table, console)
    assert len(parts) > 1 and all(p.columns[0].header == "format" for p in parts)
    harness.show(console, [table], ["JSON: x.json"])
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "13,580.2" in text and "…" not in text and text.rstrip().endswith("JSON: x.json")
    assert harness.num(None) == "-" and harness.num(0.12345) == "0.123" and harness.num("skipped") == "skipped"


def test_device_and_shapes_on_cpu():
    cpu = harness.device()
    assert cpu.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(QerlError, match="qerl bench kernels needs a CUDA GPU"):
            harness.device(cuda_only="qerl bench kernels")
        with pytest.raises(QerlError, match="shape qwen2.5-7b needs a CUDA GPU; on CPU use --shape tiny or"):
            harness.shape_for("qwen2.5-7b", cpu)
        assert harness.cap_memory(cpu, 10.0) is None and harness.copy_bandwidth_gbps(cpu) is None
    assert harness.shape_for("tiny", cpu).hidden == 64


def test_saved_result_printed_by_its_bench_module(tmp_path, capsys):
    """`python -m qerl_cli.bench.harness X.json` (the GPU scripts' last step) prints the bench's own table."""
    res = {"kind": "bench/sanity", "model": "runs/r",
           "config": {"threshold": 0.95, "subset": {"selected": [1, 4], "source_task": "arith",
                                                    "key": {"lo": 0.2, "hi": 0.8, "samples": 16}}},
           "results": [{"label": "format=nvfp4", "seed": 0, "steps_to_threshold": 3, "final": 0.9123, "best": 0.97,
                        "collapsed": False, "steps_run": 5, "wall_s": 12.0, "status": "ok"}],
           "files": {"json": "san/sanity.json", "plot": "san/sanity.png", "subset": "san/perfectible.json"}}
    path = tmp_path / "sanity.json"
    path.write_text(json.dumps(res))
    assert harness.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 perfectible arith problems" in out and "format=nvfp4" in out and "0.912" in out
    assert "JSON: san/sanity.json" in out
    for kind in ("bench/evidence", "bench/nothing", "train"):
        with pytest.raises(QerlError, match="not a bench result with tables"):
            harness.report({"kind": kind})


def test_notes_are_printed_under_the_tables_as_written():
    """Why a cell failed reaches the terminal, not only the JSON; `[...]` in it is not eaten as rich markup."""
    res = {"kind": "bench/step", "results": [{"format": "bf16", "backend": "torch", "status": "OOM in fwd_bwd",
                                              "note": "out of memory in fwd_bwd; change: pip install 'qerl[x]'"}],
           "targets": [], "files": {"json": "s.json", "plot": "s.png"}, "model": "m", "env": {"device": {}},
           "config": {"measure": 1, "train": {"batch_prompts": 1, "num_generations": 1, "max_completion_length": 1,
                                              "lora_rank": 1, "precision": "fp32", "aqn": False}}}
    assert harness.note_lines(res) == ["format=bf16 backend=torch: OOM in fwd_bwd: out of memory in fwd_bwd; "
                                       "change: pip install 'qerl[x]'"]
    out = Console(width=300, file=io.StringIO(), record=True)
    harness.show(out, [], harness.report(res)[1])
    assert "format=bf16 backend=torch: OOM in fwd_bwd: out of memory in fwd_bwd; change: pip install 'qerl[x]'" \
        in out.export_text()
