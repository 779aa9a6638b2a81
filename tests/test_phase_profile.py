"""The training-phase profile's matching of GPU kernels to phases (bench/phase_profile.py), on a hand-made trace:
a kernel belongs to the phase whose host span holds its launch, whichever thread launched it."""

from __future__ import annotations

from qerl_cli.bench.phase_profile import kernels_by_phase


def _launch(corr: int, ts: float, tid: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2.0, "tid": tid,
            "args": {"correlation": corr}}


def _kernel(corr: int, name: str, dur: float, ts: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_kernels_are_attributed_to_the_phase_of_their_launch() -> None:
    trace = {"traceEvents": [
        _launch(1, 100.0, tid=1), _kernel(1, "nvjet_tst_128x256_gemm", 40.0, 105.0),
        _launch(2, 150.0, tid=1), _kernel(2, "fmha_cutlassF_f16", 10.0, 190.0),  # runs after the span: launch counts
        _launch(3, 250.0, tid=7), _kernel(3, "nvjet_tst_128x256_gemm", 60.0, 260.0),  # autograd's thread
        _launch(4, 260.0, tid=7), _kernel(4, "triton_rmsnorm_bwd", 5.0, 330.0),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 380.0, "dur": 3.0, "args": {}},
    ]}
    out = kernels_by_phase(trace, [("recompute", 90.0, 200.0), ("fwd_bwd", 200.0, 400.0)])
    rec, fb = out["recompute"], out["fwd_bwd"]
    assert (rec["kernels"], rec["kernel_us"]) == (2, 50.0)
    assert rec["by_category"] == {"dense GEMM": 40.0, "attention": 10.0}
    assert (fb["kernels"], fb["kernel_us"]) == (2, 65.0)
    assert fb["top"][0] == {"name": "nvjet_tst_128x256_gemm", "category": "dense GEMM", "calls": 1, "us": 60.0}
    # a copy with no correlation id has no launch to place it by
    assert out["unmatched"]["by_category"] == {"copies": 3.0}
