"""`qerl bench kernels`' bookkeeping on CPU: layer sums and speed-ups, errors, weight copies, tables, summary lines.

The timing itself needs a CUDA GPU (`scripts/gpu.sh kernels`); here the result dict is made by hand."""

from __future__ import annotations

from qerl_cli.bench import harness
from qerl_cli.bench.kernels import _failed, short_summary, summarize, tables, weight_copies

GEMMS = ("qkv", "o", "gate_up", "down")


def _result() -> dict:
    res = {"kind": "bench/kernels", "device": "test GPU", "shapes": ["qwen2.5-7b", "qwen2.5-32b"], "ms": [1, 64],
           "ceilings": {"copy_GBps": 4000.0, "bf16_matmul_TFLOPs": 800.0}, "results": [], "backward": [],
           "errors": []}
    for model in res["shapes"]:
        for m in res["ms"]:
            for i, g in enumerate(GEMMS):
                res["results"].append({"model": model, "gemm": g, "M": m, "method": "bf16", "ms": 0.01 * (i + 1)})
                res["results"].append({"model": model, "gemm": g, "M": m, "method": "nvfp4", "ms": 0.004 * (i + 1)})
            # a method timed on 3 of the 4 GEMMs has no layer sum
            for g in GEMMS[:3]:
                res["results"].append({"model": model, "gemm": g, "M": m, "method": "int8", "ms": 0.001})
    for g in GEMMS:
        res["backward"].append({"model": "qwen2.5-7b", "gemm": g, "M": 2048, "method": "bf16", "ms": 0.1})
        res["backward"].append({"model": "qwen2.5-7b", "gemm": g, "M": 2048, "method": "nvfp4", "ms": 0.125})
    return res


def test_layer_sums_and_speedups_by_hand():
    res = _result()
    summarize(res)
    layer = {(r["model"], r["M"], r["method"]): r for r in res["layer"]}
    assert len(layer) == 8  # 2 shapes x 2 M x (bf16, nvfp4); int8 ran on 3 GEMMs only
    r = layer[("qwen2.5-7b", 64, "nvfp4")]
    assert abs(r["ms"] - 0.04) < 1e-12 and abs(r["speedup"] - 2.5) < 1e-12  # 0.1 ms / 0.04 ms
    assert layer[("qwen2.5-7b", 64, "bf16")]["speedup"] == 1.0
    (bw,) = [r for r in res["backward_layer"] if r["method"] == "nvfp4"]
    assert abs(bw["ms"] - 0.5) < 1e-12 and abs(bw["speedup"] - 0.8) < 1e-12


def test_summary_lines_for_every_shape_and_tables():
    res = _result()
    summarize(res)
    lines = short_summary(res)
    assert len(lines) == 5  # 2 M per shape, and the 7B backward line
    assert lines[0] == "qwen2.5-7b nvfp4 M=1: 40.0 us, 2.50x BF16"  # the measured ratio, no verdict
    assert lines[1] == "qwen2.5-7b nvfp4 M=64: 40.0 us, 2.50x BF16"
    assert lines[2] == "qwen2.5-7b nvfp4 dx M=2048: 500.0 us, 0.80x BF16"
    assert lines[3].startswith("qwen2.5-32b nvfp4 M=1:")
    assert short_summary(res, "qwen2.5-32b") == lines[3:]
    ts, summary = harness.report(res)
    assert len(ts) == len(tables(res)) == 2 and summary == lines
    assert ts[0].row_count == 3  # M = 1, 64 and the dx row


def test_errors_and_weight_copies():
    res = {"errors": []}
    _failed(res, "qwen2.5-7b", "qkv", 64, "gemlite-mxfp4", ImportError("No module named 'gemlite'"))
    assert res["errors"] == [{"model": "qwen2.5-7b", "gemm": "qkv", "M": 64, "method": "gemlite-mxfp4",
                              "error": "ImportError(\"No module named 'gemlite'\")"}]
    l2 = 50 * 2**20
    assert weight_copies(l2, l2) == 3  # three L2s of weights rotate out of the cache
    assert weight_copies(10 * l2, l2) == 1 and weight_copies(1, l2) == 48  # at least one, at most the cap


def test_decode_sweep_plans_and_table() -> None:
    from qerl_kernels import cuda_fp4

    from qerl_cli.bench.kernels import DECODE_MS, decode_plan_variants, decode_table, layer_linears

    for m in DECODE_MS:  # the legacy plan, the rule, then distinct built variants, on every decode GEMM
        for model in ("qwen2.5-7b", "qwen2.5-32b"):
            for _, n, k in layer_linears(model):
                got = decode_plan_variants(m, n, k, 132)
                assert [name for name, _ in got[:2]] == ["legacy", "stream"] and got[0][1].kind == "legacy"
                assert len({p.key() for _, p in got}) == len(got)
                for _, p in got:
                    cuda_fp4.check_plan(p)
    res = {"device": "test GPU", "sms": 132, "copy_GBps": 3000.0, "shapes": ["qwen2.5-7b"], "ms": [8], "results": []}
    for i, g in enumerate(GEMMS):  # per GEMM: bf16 100 us, legacy 40, stream 30 (at 1500 GB/s), fused LoRA 31
        for method, us in (("bf16", 100), ("cuda-legacy", 40), ("cuda-stream", 30), ("cuda-stream+lora32", 31),
                           ("cuda-stream+addmm32", 36)):
            res["results"].append({"model": "qwen2.5-7b", "gemm": g, "M": 8, "method": method,
                                   "ms": us * 1e-3 * (i + 1), "GBps": 1500.0})
    lines = decode_table(res)
    row = lines[-1].split("|")
    assert [c.strip() for c in row[1:4]] == ["1000.0", "400.0", "300.0"]  # layer sums: 10x each GEMM's us
    assert "1500 (50.0%)" in lines[-1] and "310.0 /  360.0" in lines[-1]
