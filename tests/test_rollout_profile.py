"""The decode-step profile's trace categorisation (qerl_cli/bench/decode_profile.py) on hand-built traces."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.bench.decode_profile import CATEGORIES, categorize_trace, classify_name, profiling, region


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


def test_decode_step_bytes_by_hand() -> None:
    """The byte floor of one decode step of a tiny fp32 Qwen2 (2 layers, hidden 64, intermediate 96, 4 heads of
    16 over 2 KV heads, vocab 101) with LoRA r = 4 on all 7 linears, on the CPU path (fused q/k/v and
    gate/up, shrinks as GEMMs, in-place expands), counted by hand per category."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qerl_cli.bench.roofline import decode_step_bytes, floors
    from qerl_cli.rollout import BuiltinEngine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    model = get_peft_model(Qwen2ForCausalLM(cfg).eval(), lora).eval()
    for p in model.parameters():
        p.requires_grad_(False)  # frozen bases fuse (q/k/v, gate/up)
    engine = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64)
    engine.runner.prepare()  # the projection plan (what generate() builds first)
    assert engine.num_slots == 3 and engine.runner.plan is not None  # the KV cache
    b, ctx, kv_len, e = 3, 10, 64, 4
    need = decode_step_bytes(engine.runner, b, ctx, kv_len)
    got = need["bytes"]
    h, i, d, hq, hk, v, r, layers = 64, 96, 16, 4, 2, 101, 4, 2
    qkv_n = (hq + 2 * hk) * d  # 128
    per_layer_dense = (
        (h * qkv_n + qkv_n) + b * (h + qkv_n)  # q/k/v weight + biases, x in, q/k/v out
        + h * h + b * 2 * h  # o
        + h * 2 * i + b * (h + 2 * i)  # gate/up
        + i * h + b * (i + h)  # down
    ) * e
    assert got["dense GEMM"] == layers * per_layer_dense + (v * h + b * (h + v)) * e  # + lm_head and its logits
    # LoRA per layer: A_cat + h for each shrink GEMM; block-diagonal B_blk + h + the base output read and written
    shrink = (3 * r * h + b * 3 * r) + (r * h + b * r) + (2 * r * h + b * 2 * r) + (r * i + b * r)
    expand = ((qkv_n * 3 * r) + b * 3 * r + 2 * b * qkv_n) + (h * r + b * r + 2 * b * h) \
        + (2 * i * 2 * r + b * 2 * r + 2 * b * 2 * i) + (h * r + b * r + 2 * b * h)
    assert got["LoRA"] == layers * (shrink + expand) * e
    assert got["attention"] == layers * (2 * b * (ctx + 1) * hk * d + 2 * b * hq * d) * e
    norms = (7 + 8) * b * h + 2 * 2 * h + 4 * b * h + h  # 2 layers' adds + norms (no residual at layer 0), final
    rope = layers * (b * (qkv_n + hq * d) + 2 * b * hk * d)
    assert got["norm/RoPE/activation"] == (norms + layers * 3 * b * i + rope) * e
    assert got["sampling"] == b * v * e
    f = floors(got, {"sampling": 0.002, "attention": 0.0}, 1000.0)  # 1000 GB/s
    assert f["sampling"]["floor_ms"] == pytest.approx(b * v * e / 1e9)
    assert f["sampling"]["pct_of_floor"] == pytest.approx(100 * b * v * e / 1e9 / 0.002)
    assert f["attention"]["pct_of_floor"] is None and floors(got, {}, None)["LoRA"]["floor_ms"] is None
    # FLOPs: 2 x rows x in x out per GEMM that runs (block-diagonal B_blk with its zeros), 4 x rows x live keys x
    # heads x head_dim per layer of attention
    fl = need["flops"]
    assert fl["dense GEMM"] == layers * 2 * b * (h * qkv_n + h * h + h * 2 * i + i * h) + 2 * b * h * v
    assert fl["LoRA"] == layers * 2 * b * ((h * 3 * r + h * r + h * 2 * r + i * r)
                                           + (3 * r * qkv_n + r * h + 2 * r * 2 * i + r * h))
    assert fl["attention"] == layers * 4 * b * (ctx + 1) * hq * d
    assert need["total_flops"] == sum(fl.values()) and "sampling" not in fl
    # at 1 GFLOP/s the FLOPs bind every GEMM category; at 1e6 TFLOP/s none does
    slow = floors(got, {"dense GEMM": 1.0}, 1000.0, fl, 1e-3)
    assert slow["dense GEMM"]["bound"] == "FLOPs"
    assert slow["dense GEMM"]["floor_ms"] == pytest.approx(fl["dense GEMM"] / 1e9 * 1e3)
    assert slow["sampling"]["bound"] == "bytes" and slow["sampling"]["flop_floor_ms"] == 0.0
    fast = floors(got, {"dense GEMM": 1.0}, 1000.0, fl, 1e6)
    assert fast["dense GEMM"]["bound"] == "bytes"
    assert fast["dense GEMM"]["floor_ms"] == pytest.approx(got["dense GEMM"] / 1e12 * 1e3)
