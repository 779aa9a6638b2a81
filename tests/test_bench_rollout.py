"""`bench_rollout` on CPU with the tiny random Llama shape: files, fields, roofline off CUDA, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_cli.bench.rollout import _roofline, bench_rollout, bench_stop_ids, model_bytes, render_table, short_summary
from qerl_cli.bench.shapes import SHAPES, build_random_model, get_shape
from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.qlinear import QuantLinear

CELL_FIELDS = ("prefill_tok_s", "decode_tok_s", "e2e_tok_s", "ttft_s", "peak_mem_gib", "roofline_tok_s",
               "pct_roofline", "num_slots", "tokens", "mean_new_tokens", "status", "backend")


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = bench_rollout(shape="tiny", formats=("bf16", "nvfp4"), batches=(2, 1), prompt_len=5, new_tokens=4,
                        out_dir=out, warmup=False, log=lambda _msg: None)
    return res, out


def test_tiny_bench_writes_json_and_plot(tiny_result):
    res, out = tiny_result
    assert (out / "rollout.png").stat().st_size > 1000
    on_disk = json.loads((out / "rollout.json").read_text())
    assert on_disk["kind"] == "bench/rollout" and on_disk["shape"] == "tiny"
    assert on_disk["config"]["batches"] == [1, 2]
    cells = on_disk["results"]
    assert [(c["format"], c["batch"]) for c in cells] == [("bf16", 1), ("bf16", 2), ("nvfp4", 1), ("nvfp4", 2)]
    for c in cells:
        assert set(CELL_FIELDS) <= set(c)
        assert c["status"] == "ok" and c["mode"] == "fixed"
        # fixed length: every sequence generates exactly new_tokens (stop tokens ignored)
        assert c["tokens"] == 4 * c["batch"] and c["mean_new_tokens"] == 4
        assert c["decode_tok_s"] > 0 and c["e2e_tok_s"] > 0 and c["prefill_tok_s"] > 0 and c["ttft_s"] > 0
        # no CUDA: no copy bandwidth, so no roofline and no GPU memory figure
        assert c["roofline_tok_s"] is None and c["pct_roofline"] is None and c["peak_mem_gib"] is None
    assert on_disk["copy_GBps"] is None
    # the column names the kernels that ran: on CPU no qerl kernel counts a forward (the torch reference runs)
    assert {c["backend"] for c in cells if c["format"] == "nvfp4"} == {"reference"}
    assert all(c["linears"] == {} for c in cells)
    assert "targets" not in res  # the bench reports measurements; the targets are in docs/benchmarks.md
    rows = {(c["format"], c["batch"]): c for c in cells}
    for b in (1, 2):  # the measured decode ratio over qerl's bf16 at the same batch
        assert rows[("bf16", b)]["speedup_vs_bf16"] == pytest.approx(1.0)
        assert rows[("nvfp4", b)]["speedup_vs_bf16"] == pytest.approx(
            rows[("nvfp4", b)]["decode_tok_s"] / rows[("bf16", b)]["decode_tok_s"])


def test_tiny_bench_model_bytes(tiny_result):
    res, _ = tiny_result
    spec = SHAPES["tiny"]
    # LoRA r=32 in fp32 on all 7 linears of both layers: (in + out) * r * 4 bytes each
    lora = spec.layers * sum(n + k for _, n, k in spec.linear_shapes()) * 32 * 4
    assert res["models"]["bf16"]["lora_bytes"] == lora == res["models"]["nvfp4"]["lora_bytes"]
    # bf16 step reads every linear in bf16, the lm_head (256 x 64), 5 norms of 64; no embedding table
    bf16 = spec.linear_params() * 2 + 256 * 64 * 2 + 5 * 64 * 2
    assert res["models"]["bf16"]["weight_bytes"] == bf16
    # NVFP4: 4-bit codes + one E4M3 scale per 16 + a float32 global scale per linear
    nv = spec.linear_params() // 2 + spec.linear_params() // 16 + 4 * 7 * spec.layers
    assert res["models"]["nvfp4"]["weight_bytes"] == nv + 256 * 64 * 2 + 5 * 64 * 2


def test_random_model_is_quantized_per_layer_with_fused_global_scales():
    model = build_random_model("tiny", "nvfp4", "cpu", seed=3)
    layer = model.model.layers[1]
    q, k, v = (getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    gate, up, down = layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj
    assert all(isinstance(m, QuantLinear) and m.fmt == "nvfp4" for m in (q, k, v, gate, up, down))
    assert torch.equal(q.weight_global_scale, k.weight_global_scale)
    assert torch.equal(q.weight_global_scale, v.weight_global_scale)
    assert torch.equal(gate.weight_global_scale, up.weight_global_scale)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    w = q.dequantized_weight(torch.float32)
    assert 0.015 < w.std().item() < 0.025  # N(0, 0.02) survives 4-bit quantization roughly
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    # same seed, same weights
    again = build_random_model("tiny", "nvfp4", "cpu", seed=3)
    assert torch.equal(again.model.layers[1].self_attn.q_proj.weight_packed, q.weight_packed)


def test_real_shapes_match_the_published_sizes():
    # Parameter counts of Qwen2.5 7B / 32B (embedding + untied lm_head + layers)
    for name, total in (("qwen2.5-7b", 7.62e9), ("qwen2.5-32b", 32.76e9)):
        s = get_shape(name)
        params = s.linear_params() + 2 * s.vocab * s.hidden
        assert abs(params - total) / total < 0.01, (name, params)
    assert SHAPES["qwen2.5-7b"].kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2


def test_roofline_arithmetic():
    # 1 GB of weights, no LoRA, 1000 B of KV per token, batch 4 at mean context 100 + 50 = 150 tokens
    cell = {"status": "ok", "mode": "fixed", "mean_new_tokens": 100, "decode_tok_s": 1000.0}
    _roofline(cell, batch=4, bytes_={"weights": 10**9, "lora": 0}, kv_per_token=1000, prompt_len=100, bw_gbps=1000.0)
    step_bytes = 10**9 + 4 * 1000 * 150
    assert cell["step_bytes"] == step_bytes
    assert cell["roofline_tok_s"] == pytest.approx(4 * 1e12 / step_bytes)
    assert cell["pct_roofline"] == pytest.approx(100 * 1000.0 / (4 * 1e12 / step_bytes))
    eos_cell = {"status": "ok", "mode": "eos", "mean_new_tokens": 10, "decode_tok_s": 5.0}
    _roofline(eos_cell, batch=1, bytes_={"weights": 1, "lora": 0}, kv_per_token=1, prompt_len=1, bw_gbps=1.0)
    assert eos_cell["roofline_tok_s"] is None


def test_compute_aware_roofline_takes_the_larger_floor_per_category():
    """Batch 256: the GEMM needs 1 GB (0.25 ms at 4000 GB/s) but 3 TFLOP (4 ms at 750 TFLOP/s), attention 2 GB
    (0.5 ms) and 10 GFLOP: step floor 4.5 ms -> 256 / 4.5 ms = 56,889 tok/s; at 20,000 tok/s that is 35.2%."""
    from qerl_cli.bench.rollout import _compute_aware_roofline
    from qerl_cli.bench.roofline import floors, step_floor_ms

    fl = floors({"quantized GEMM": 1e9, "attention": 2e9}, {"quantized GEMM": 6.0, "attention": 1.0}, 4000.0,
                {"quantized GEMM": 3e12, "attention": 1e10}, 750.0)
    assert fl["quantized GEMM"]["bound"] == "FLOPs" and fl["attention"]["bound"] == "bytes"
    cell = {"status": "ok", "mode": "fixed", "batch": 256, "decode_tok_s": 20_000.0,
            "profile": {"step_floor_ms": step_floor_ms(fl)}}
    _compute_aware_roofline(cell)
    assert cell["profile"]["step_floor_ms"] == pytest.approx(4.5)
    assert cell["roofline_ca_tok_s"] == pytest.approx(256 / 4.5e-3)
    assert cell["pct_roofline_ca"] == pytest.approx(100 * 20_000 * 4.5e-3 / 256)
    unprofiled = {"status": "ok", "mode": "fixed", "batch": 8, "decode_tok_s": 1.0}
    _compute_aware_roofline(unprofiled)
    assert unprofiled["pct_roofline_ca"] is None


def test_w4a8_share_runs_its_flops_at_the_fp8_rate():
    """What ran W4A8 counts at the FP8 rate: the 4096 x 4096 linear (16.8 M MACs x 2 forwards) on humming's W4A8,
    the 1024 x 4096 one (4.2 M x 2) on W4A16 -> FP8 share 0.8; at 750 (BF16) and 1500 (FP8) TFLOP/s the category's
    rate is 1 / (0.8 / 1500 + 0.2 / 750) = 1250 TFLOP/s, and 3 TFLOP of it need 2.4 ms, not the 4 ms at BF16."""
    from qerl_cli.bench.decode_profile import _ran_since
    from qerl_cli.bench.roofline import floors, path_rate, w4a8_flop_share

    before = {(4096, 4096): {"humming-w4a8": 5}}
    after = {(4096, 4096): {"humming-w4a8": 7}, (1024, 4096): {"humming": 2}}
    ran = _ran_since(before, after)
    assert ran == {(4096, 4096): {"humming-w4a8": 2}, (1024, 4096): {"humming": 2}}
    assert w4a8_flop_share(ran) == pytest.approx(0.8) and w4a8_flop_share({}) == 0.0
    rate = path_rate(750.0, 1500.0, 0.8)
    assert rate == pytest.approx(1250.0)
    assert path_rate(750.0, None, 0.8) == 750.0 and path_rate(750.0, 1500.0, 0.0) == 750.0
    fl = floors({"quantized GEMM": 1e9, "dense GEMM": 1e9}, {}, 4000.0, {"quantized GEMM": 3e12, "dense GEMM": 3e12},
                750.0, {"quantized GEMM": rate})
    assert fl["quantized GEMM"]["floor_ms"] == pytest.approx(2.4) and fl["quantized GEMM"]["mma_TFLOPs"] == 1250.0
    assert fl["dense GEMM"]["floor_ms"] == pytest.approx(4.0)  # the rest stays at the BF16 rate


def test_eos_stop_set_gives_realistic_lengths():
    assert bench_stop_ids("fixed", 1000, 100, [7], from_shape=True) == []
    assert bench_stop_ids("eos", 1000, 100, [7], from_shape=False) == [7]
    stop = bench_stop_ids("eos", 1000, 100, None, from_shape=True)
    assert len(stop) == 20 and stop[-1] == 999  # vocab / (new_tokens / 2) ids: mean length ~50 of 100


def test_model_bytes_counts_tied_lm_head_once():
    model = build_random_model("tiny", "bf16", "cpu")
    model.lm_head.weight = model.model.embed_tokens.weight
    spec = SHAPES["tiny"]
    assert model_bytes(model)["weights"] == spec.linear_params() * 2 + 256 * 64 * 2 + 5 * 64 * 2


def test_rendering(tiny_result):
    res, out = tiny_result
    assert render_table(res).row_count == 4
    lines = short_summary(res)
    assert lines[0] == "copy bandwidth: not measured (no CUDA)"
    assert str(out / "rollout.json") in lines[-2] and str(out / "rollout.png") in lines[-1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shape": "llama-9000b"}, "unknown model shape 'llama-9000b'"),
        ({}, "give exactly one of --shape"),
        ({"shape": "tiny", "formats": ("nvfp5",)}, "unknown format(s) nvfp5"),
        ({"shape": "tiny", "batches": (0,)}, "batch sizes must be positive"),
        ({"shape": "tiny", "eos_mode": "sometimes"}, "eos_mode must be one of"),
        ({"shape": "tiny", "prompt_len": 4000, "new_tokens": 200}, "exceeds the tiny shape's 4096 positions"),
        ({"shape": "tiny", "prompts": 0}, "--prompts must be >= 1"),
        ({"shape": "tiny", "num_generations": 4}, "--num-generations needs --prompts"),
        ({"shape": "tiny", "lora_modes": ("sometimes",)}, "LoRA modes must be among on, off"),
        ({"shape": "tiny", "linear_backend": "no-such-backend"}, "--linear-backend"),
        ({"shape": "tiny", "linear_backend": "humming"}, "--linear-backend humming: the backends are CUDA kernels"),
    ],
)
def test_bad_input_is_one_line(kwargs, message, tmp_path):
    with pytest.raises(QerlError) as info:
        bench_rollout(out_dir=tmp_path, log=lambda _msg: None, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_run_dir_without_quantize_stage(tmp_path):
    RunDir(tmp_path / "r")  # an empty run directory
    with pytest.raises(QerlError, match=r"has no quantize stage: run `qerl quantize --run .*` first"):
        bench_rollout(run_dir=tmp_path / "r", formats=(), log=lambda _msg: None)  # as the CLI passes it
    with pytest.raises(QerlError, match="does not exist"):
        bench_rollout(run_dir=tmp_path / "missing", log=lambda _msg: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU refusal")
def test_large_shape_needs_cuda(tmp_path):
    with pytest.raises(QerlError, match="needs a CUDA GPU"):
        bench_rollout(shape="qwen2.5-7b", out_dir=tmp_path, log=lambda _msg: None)


def test_run_dir_bench_records_stage(quantized_runs):
    """With --run: the run's own model and format, files under RUN/bench, a completed bench/rollout stage."""
    run = quantized_runs["nvfp4"].run  # shared with the quantize/train tests: no extra quantization
    res = bench_rollout(run_dir=run, formats=(), batches=(1,), prompt_len=4, new_tokens=2, warmup=False,
                        log=lambda _msg: None)
    assert [(c["format"], c["status"], c["tokens"]) for c in res["results"]] == [("nvfp4", "ok", 2)]
    assert (run / "bench" / "rollout.json").is_file() and (run / "bench" / "rollout.png").is_file()
    rec = RunDir(run).record("bench/rollout")
    assert rec["status"] == "completed" and rec["stage"] == "bench"
    assert rec["outputs"]["json"]["path"] == "bench/rollout.json" and rec["inputs"]["model"] == "model"
    assert rec["metrics"]["nvfp4/b1/fixed/decode_tok_s"] > 0


def test_queue_workload_and_adapters_on_off(tmp_path):
    """3 prompts x 4 samples through 4 slots: 12 sequences, the queue refills slots; each cell again with
    the adapters disabled; no roofline for a queued workload (the batch is not fixed)."""
    res = bench_rollout(shape="tiny", formats=("bf16",), batches=(4,), prompt_len=5, new_tokens=3, out_dir=tmp_path,
                        warmup=False, log=lambda _msg: None, prompts=3, num_generations=4, lora_modes=("on", "off"))
    cells = res["results"]
    assert [(c["lora"], c["status"]) for c in cells] == [("off", "ok"), ("on", "ok")]
    for c in cells:
        assert c["sequences"] == 12 and c["tokens"] == 12 * 3 and c["num_slots"] == 4
        # 12 sequences of 3 tokens through 4 slots: at least 3 waves of 2 decode steps each
        assert c["decode_steps"] >= 6
        assert c["roofline_tok_s"] is None and c["profile"] is None
    assert res["config"]["lora_modes"] == ["on", "off"] and res["config"]["num_generations"] == 4
    assert res["lora_shares"] == []  # shares need fixed-length cells with one sequence per slot
    assert render_table(res).row_count == 2


def test_lora_share_and_targets_arithmetic():
    """LoRA share from graph step times when profiled (else decode ms/step); the speed-up over bf16."""
    from qerl_cli.bench.rollout import lora_shares, speedups_vs_bf16

    def cell(fmt, batch, lora, ms, tok_s, pct=None, graph=None, lora_ms=0.0):
        prof = None if graph is None else {"graph_step_ms": graph, "kernel_ms_per_step": 4.0,
                                           "ms_per_step": {"LoRA": lora_ms}}
        return {"format": fmt, "batch": batch, "mode": "fixed", "lora": lora, "status": "ok", "sequences": batch,
                "decode_ms_per_step": ms, "decode_tok_s": tok_s, "pct_roofline": pct, "profile": prof}

    res = {"results": [
        cell("nvfp4", 8, "on", 5.0, 1600.0, pct=61.0, graph=4.0, lora_ms=0.3),
        cell("nvfp4", 8, "off", 4.8, 1700.0, graph=3.8),
        cell("nvfp4", 64, "on", 10.0, 6400.0, pct=40.0),
        cell("nvfp4", 64, "off", 8.0, 8000.0),
        cell("bf16", 64, "on", 16.0, 4000.0),
    ]}
    shares = {(s["format"], s["batch"]): s for s in lora_shares(res)}
    assert shares[("nvfp4", 8)]["source"] == "graph step"
    assert shares[("nvfp4", 8)]["share_pct"] == pytest.approx(5.0)  # (4.0 - 3.8) / 4.0
    assert shares[("nvfp4", 8)]["profile_lora_pct"] == pytest.approx(7.5)  # 0.3 / 4.0
    assert shares[("nvfp4", 64)]["share_pct"] == pytest.approx(20.0)  # (10 - 8) / 10, decode ms/step
    speedups_vs_bf16(res)
    got = {(c["format"], c["batch"], c["lora"]): c["speedup_vs_bf16"] for c in res["results"]}
    assert got[("nvfp4", 64, "on")] == pytest.approx(1.6)  # 6400 / 4000 decode tok/s
    assert got[("bf16", 64, "on")] == pytest.approx(1.0)
    assert got[("nvfp4", 8, "on")] is None and got[("nvfp4", 64, "off")] is None  # no bf16 cell to compare with


def test_floor_table_renders_each_category_against_its_floor():
    """`--profile`'s byte-floor table: floor ms and the % of it the measured category time reaches."""
    from rich.console import Console

    from qerl_cli.bench.rollout import render_floor_table, tables
    from qerl_cli.bench.roofline import floors

    ms = {"quantized GEMM": 3.0, "attention": 1.0, "sampling": 0.05}
    need = {"quantized GEMM": 3.0e9, "attention": 1.5e9, "sampling": 0.1e9}  # at 3000 GB/s: 1.0, 0.5, 0.033 ms
    prof = {"graph_step_ms": 6.0, "kernel_ms_per_step": 5.0, "ms_per_step": ms, "floors": floors(need, ms, 3000.0),
            "step_bytes": sum(need.values()), "attention_read_bytes": 2.5e9, "copy_GBps": 3000.0}
    res = {"copy_GBps": 3000.0, "results": [{"format": "nvfp4", "batch": 64, "lora": "on", "profile": prof}]}
    table = render_floor_table(res)
    assert table is not None and table.row_count == 1
    console = Console(width=300, record=True)
    console.print(table)
    text = console.export_text()
    assert "1.000 (33%)" in text and "0.500 (50%)" in text and "0.033 (67%)" in text  # per category
    assert "2,500" in text and "1.533 (26%)" in text  # SDPA's bucketed KV MB; the whole step's floor vs 6 ms
    assert render_floor_table({"results": [{"profile": None}]}) is None
    assert len(tables({"results": [], "config": {"prompt_len": 1, "new_tokens": 1, "lora_rank": 0},
                       "env": {"device": {}}})) == 1


def test_kernels_ran_label_names_one_kernel_or_the_split():
    from qerl_cli.bench.kernels_ran import projection_classes, summarize

    class Cfg:  # a 7B-like layer: q/k/v and gate/up fused, as the decode step runs them
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size = 3584, 28, 4, 128, 18944

    classes = projection_classes(Cfg())
    assert classes[(4608, 3584)] == "qkv" and classes[(37888, 3584)] == "gate_up" and classes[(3584, 18944)] == "down"
    assert classes[(3584, 3584)] == "q|o"  # q and o share a shape: both named
    one = {(4608, 3584): {"humming": 28}, (3584, 18944): {"humming": 28}}
    assert summarize(one, classes, "triton") == ("humming", {"qkv": {"humming": 28}, "down": {"humming": 28}})
    mixed = {(4608, 3584): {"humming": 28}, (3584, 18944): {"cuda+lora": 20, "cublas": 8}}
    label, split = summarize(mixed, classes, "triton")
    assert label == "mixed (qkv humming, down cublas+cuda+lora)" and split["down"] == {"cuda+lora": 20, "cublas": 8}
    assert summarize({}, classes, "cublas") == ("cublas", {})  # nothing counted: the format's own path


def test_kernels_ran_names_the_persistent_layer_and_the_routed_experts():
    """The 32B decode of 2026-11-29 said `humming` while the persistent MLP-half kernel ran o, gate/up and down:
    kernels launched outside the dispatcher count their GEMMs by shape too, and a mixture of experts' routed
    projections are classes of their own."""
    from qerl_kernels import dispatch

    from qerl_cli.bench.kernels_ran import projection_classes, read, reset
    from qerl_cli.moe import DOWN, GATE_UP, _record_ran, quantize_experts

    class Dense:  # Qwen2.5-32B's layer
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size = 5120, 40, 8, 128, 27648

    reset()
    dispatch.record_shape(7168, 5120, "humming")  # q/k/v fused, through the dispatcher
    for n, k in ((5120, 5120), (55296, 5120), (5120, 27648)):  # what decode_layer.mlp_half records per launch
        dispatch.record_shape(n, k, "decode-layer")
    label, split = read(Dense(), "triton")
    assert label == "mixed (qkv humming, q|o decode-layer, gate_up decode-layer, down decode-layer)", label

    class Moe:  # Qwen3-30B-A3B's layer: 128 experts of 768
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size = 2048, 32, 4, 128, 6144
        moe_intermediate_size, num_experts = 768, 128

    classes = projection_classes(Moe())
    assert classes[(1536, 2048)] == "experts gate_up" and classes[(2048, 768)] == "experts down"
    experts = quantize_experts(torch.randn(4, 2 * 8, 16), torch.randn(4, 16, 8), "bf16", dtype=torch.float32)
    reset()
    _record_ran(experts, GATE_UP, "qerl-grouped")
    _record_ran(experts, DOWN, "qerl-grouped")
    assert dispatch.ran() == {(16, 16): {"qerl-grouped": 1}, (16, 8): {"qerl-grouped": 1}}
    reset()


def test_the_kernels_count_the_forwards_they_run():
    """What `bench rollout`'s linears column reads: each forward counted where its kernel launches, by GEMM shape."""
    from qerl_kernels import dispatch
    from qerl_kernels import linear as klinear

    from qerl_cli.bench import kernels_ran

    mod = QuantLinear.from_linear(torch.nn.Linear(64, 96, bias=False), "nvfp4")
    kernels_ran.reset()
    for _ in range(3):
        klinear.quant_linear(torch.randn(2, 64), mod)  # the interpreter runs qerl's fused Triton kernel
    assert dispatch.ran() == {(96, 64): {"triton": 3}}
    kernels_ran.reset()
    assert dispatch.ran() == {}
