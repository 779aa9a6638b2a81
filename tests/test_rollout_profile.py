"""The decode-step profile's trace categorisation (qerl_cli/rollout/profile.py) on hand-built traces."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.rollout.profile import CATEGORIES, categorize_trace, classify_name, profiling, region


def _x(cat, name, ts, dur, tid=1, corr=None):  # noqa: ANN001, ANN202
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_kernels_go_to_the_innermost_region_of_their_launch() -> None:
    trace = {"traceEvents": [
        # host: a qgemm region holding one launch; a lora region nested in a dense region (innermost wins)
        _x("user_annotation", "qerl.qgemm", 0, 10),
        _x("cuda_driver", "cuLaunchKernel", 2, 1, corr=1),
        _x("user_annotation", "qerl.dense", 20, 30),
        _x("user_annotation", "qerl.lora", 25, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 27, 1, corr=2),
        _x("cuda_runtime", "cudaLaunchKernel", 40, 1, corr=3),  # in dense, outside lora
        _x("user_annotation", "qerl.sampling", 60, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 61, 1, corr=4),
        # a launch on another thread at a time inside the qgemm range must not take that range
        _x("cuda_runtime", "cudaLaunchKernel", 3, 1, tid=2, corr=5),
        _x("cuda_runtime", "cudaMemcpyAsync", 80, 1, corr=6),
        # GPU side
        _x("kernel", "_fp4_gemm_kernel", 100, 40.0, tid=7, corr=1),
        _x("kernel", "nvjet_hsh_64x8_splitK", 150, 3.0, tid=7, corr=2),
        _x("kernel", "nvjet_hsh_256x128", 160, 25.0, tid=7, corr=3),
        _x("kernel", "at::native::argmax_kernel", 200, 2.0, tid=7, corr=4),
        _x("kernel", "_add_rmsnorm_kernel", 210, 1.5, tid=7, corr=5),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 220, 0.5, tid=7, corr=6),
        _x("kernel", "void at::native::vectorized_elementwise_kernel<mul>", 230, 0.25, tid=7),  # no correlation
    ]}
    got = categorize_trace(trace)
    assert got["kernels"] == 7
    want = dict.fromkeys(CATEGORIES, 0.0)
    want.update({"quantized GEMM": 40.0, "LoRA": 3.0, "dense GEMM": 25.0, "sampling": 2.0,
                 "norm/RoPE/activation": 1.5, "copies": 0.5, "other": 0.25})
    assert got["us"] == want
    assert got["top"][0] == ("_fp4_gemm_kernel", "quantized GEMM", 40.0)


@pytest.mark.parametrize("name, cat, want", [
    ("Memset (Device)", "gpu_memset", "copies"),
    ("_fp4_mm_v2_kernel", "kernel", "quantized GEMM"),
    ("splitk_reduce_kernel", "kernel", "quantized GEMM"),  # qerl's FP4 split-K reduce, not cuBLAS's
    ("void cublasLt::splitKreduce_kernel<32, 16>", "kernel", "dense GEMM"),
    ("void at::native::direct_copy_kernel_cuda", "kernel", "copies"),
    ("_rope_kv_kernel", "kernel", "norm/RoPE/activation"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "kernel", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", "dense GEMM"),
    ("void at::native::reduce_kernel<512, 1>", "kernel", "other"),
])
def test_names_outside_regions(name: str, cat: str, want: str) -> None:
    assert classify_name(name, cat) == want


def test_regions_are_free_unless_profiling() -> None:
    with region("lora") as r:
        assert r is None  # nullcontext
    with profiling(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with region("lora"):
            torch.ones(3).sum()
    assert any(e.name == "qerl.lora" for e in prof.events())
