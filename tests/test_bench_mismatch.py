"""`bench_mismatch` on CPU on the tiny random shape: fields, fp32 ~ exact, fp16 < bf16, files, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qerl_cli.bench.mismatch import _abs_slope, _ratios, bench_mismatch, render_table, short_summary
from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir

ROW_FIELDS = ("k1", "k3", "max_abs_dprob", "seq_log_ratio_mean", "seq_log_ratio_std", "seq_log_ratio_min",
              "seq_log_ratio_max", "seq_abs_log_ratio_len_slope", "seq_log_ratio_len_slope", "tokens",
              "sequences", "seq_points", "status", "wall_s")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    # the tiny random shape in NVFP4 (the property is rounding, not the model; the embedded model's 16-bit compute on
    # 2 CPU cores cost this fixture ~60 s): 2 prompts x 2 samples x 4 tokens, EOS ignored
    res = bench_mismatch(shape="tiny", formats=("nvfp4",), precisions=("bf16", "fp16", "fp32"), prompts=2, samples=2,
                         max_tokens=4, prompt_len=5, out_dir=out, log=lambda _msg: None)
    return res, out


def test_cells_fields_and_precision_ordering(small):
    res, out = small
    on_disk = json.loads((out / "mismatch.json").read_text())
    assert on_disk["kind"] == "bench/mismatch" and on_disk["config"]["formats"] == ["nvfp4"]
    cells = {(c["format"], c["precision"]): c for c in on_disk["results"]}
    assert set(cells) == {("nvfp4", p) for p in ("bf16", "fp16", "fp32")}
    for c in cells.values():
        assert set(ROW_FIELDS) <= set(c) and c["status"] == "ok"
        assert c["sequences"] == 4 and c["tokens"] == 16 and len(c["seq_points"]) == 4
        assert c["k3"] >= 0.0 and 0.0 <= c["max_abs_dprob"] <= 1.0
        assert c["seq_log_ratio_min"] <= c["seq_log_ratio_mean"] <= c["seq_log_ratio_max"]
        # the per-sequence points sum to the reported mean
        mean = sum(s for _, s in c["seq_points"]) / len(c["seq_points"])
        assert math.isclose(mean, c["seq_log_ratio_mean"], rel_tol=1e-9, abs_tol=1e-12)
    for fmt in ("nvfp4",):
        # fp32: the two engines differ only by fp32 reduction order
        assert cells[(fmt, "fp32")]["k3"] < 1e-6 and cells[(fmt, "fp32")]["max_abs_dprob"] < 1e-3
        # 10 mantissa bits instead of 7: fp16 mismatches less than bf16
        assert cells[(fmt, "fp16")]["k3"] < cells[(fmt, "bf16")]["k3"]
    ratios = {r["format"]: r for r in on_disk["k3_ratios"]}
    assert set(ratios) == {"nvfp4"}
    for fmt, r in ratios.items():
        assert r["bf16_over_fp16"] == pytest.approx(cells[(fmt, "bf16")]["k3"] / cells[(fmt, "fp16")]["k3"])
        assert "met" not in r and "target" not in r  # the measured ratio only; the target is in the docs


def test_files_written_atomically(small):
    res, out = small
    assert sorted(p.name for p in out.iterdir()) == ["mismatch.json", "mismatch_scatter.png", "mismatch_seq.png"]
    for name in ("mismatch_scatter.png", "mismatch_seq.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert render_table(res).row_count == 3
    assert any("k3 bf16/fp16" in line for line in short_summary(res))


def test_interrupted_bench_leaves_no_json(tmp_path):
    def stop_after_first_cell(msg: str) -> None:
        if "k3" in msg:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the tiny random shape: what is written is the point, not the model
        bench_mismatch(shape="tiny", formats=("bf16",), precisions=("fp32", "bf16"), prompts=1, samples=1,
                       max_tokens=2, prompt_len=4, out_dir=tmp_path / "b", log=stop_after_first_cell)
    assert not (tmp_path / "b").exists() or list((tmp_path / "b").iterdir()) == []


@pytest.mark.parametrize(("kwargs", "msg"), [
    ({"precisions": ("bf16", "fp8")}, "unknown precision"),
    ({"precisions": ()}, "unknown precision"),
    ({"formats": ("nvfp5",)}, "unknown format"),
    ({"formats": ()}, "no format given"),
    ({"task": "math"}, "unknown task"),
    ({"prompts": 0}, "prompts must be"),
    ({"samples": -1}, "samples must be"),
    ({"max_tokens": 0}, "max_tokens must be"),
    ({"temperature": 0.0}, "temperature must be > 0"),
])
def test_bad_input_is_one_line_qerl_error(kwargs, msg, tmp_path):
    with pytest.raises(QerlError, match=msg) as exc:
        bench_mismatch(out_dir=tmp_path, log=lambda _msg: None, **kwargs)
    assert "\n" not in str(exc.value)


def test_run_without_quantize_stage_names_the_command(tmp_path):
    RunDir(tmp_path / "run")
    with pytest.raises(QerlError, match="qerl quantize"):
        bench_mismatch(run_dir=tmp_path / "run", log=lambda _msg: None)
    assert not (tmp_path / "run" / "bench").exists()


def test_abs_slope_and_ratios_by_hand():
    # |lr| = 0.5 * length exactly -> slope 0.5; constant length -> undefined -> 0.0
    assert _abs_slope(torch.tensor([2.0, 4.0, 6.0]), torch.tensor([-1.0, 2.0, -3.0])) == pytest.approx(0.5)
    assert _abs_slope(torch.tensor([3.0, 3.0]), torch.tensor([1.0, 2.0])) == 0.0
    rows = [{"format": "int8", "precision": "bf16", "status": "ok", "k3": 2e-3},
            {"format": "int8", "precision": "fp16", "status": "ok", "k3": 1e-4},
            {"format": "fp8", "precision": "bf16", "status": "ok", "k3": 1e-3}]
    (r,) = _ratios(rows, ["int8", "fp8"])  # fp8 has no fp16 cell: no ratio
    assert r["format"] == "int8" and r["bf16_over_fp16"] == pytest.approx(20.0) and "note" not in r
    # a NaN fp16 cell (seen on the GPU for fp8 in fp16) gives no ratio, and says why
    nan_rows = [{"format": "fp8", "precision": "bf16", "status": "ok", "k3": 1e-3},
                {"format": "fp8", "precision": "fp16", "status": "ok", "k3": math.nan}]
    (r,) = _ratios(nan_rows, ["fp8"])
    assert r["note"] == "non-finite k3" and math.isnan(r["bf16_over_fp16"])


def test_shape_model_fixed_length(tmp_path):
    """--shape: a random model, random prompts, EOS ignored so every completion has max_tokens tokens."""
    res = bench_mismatch(shape="tiny", precisions=("bf16", "fp32"), formats=("bf16", "nvfp4"), prompts=3, samples=2,
                         max_tokens=8, prompt_len=5, out_dir=tmp_path, log=lambda _: None)
    assert res["model"] == "random tiny" and res["config"]["fixed_length"]
    for row in res["results"]:
        assert row["status"] == "ok"
        assert row["tokens"] == 3 * 2 * 8 and row["mean_length"] == 8
        assert all(n == 8 for n, _ in row["seq_points"])
    fp32 = {r["format"]: r["k3"] for r in res["results"] if r["precision"] == "fp32"}
    bf16 = {r["format"]: r["k3"] for r in res["results"] if r["precision"] == "bf16"}
    assert all(fp32[f] < bf16[f] for f in fp32)  # fp32 engines agree better than bf16 ones
    with pytest.raises(QerlError, match="exclusive"):
        bench_mismatch(shape="tiny", run_dir=tmp_path, out_dir=tmp_path, log=lambda _: None)
