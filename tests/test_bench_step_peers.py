"""Issue 26's additions to `bench step` on CPU: the EOS workload (stop ids reach the engine, padding counted), the
phase FLOP model by hand, the TRL peer's failure recorded as its status, the resident-cache rule, bad input."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

from qerl_cli.bench.flops import phase_flops
from qerl_cli.bench.step import bench_step, render_table
from qerl_cli.errors import QerlError
from qerl_cli.train.memory_plan import MemoryPlan

SMALL = {"batch_prompts": 2, "num_generations": 2, "max_completion_length": 8, "lora_rank": 4}


def test_phase_flops_by_hand() -> None:
    cfg = SimpleNamespace(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=2, vocab_size=10)
    fl = phase_flops(cfg, tokens=3, attention_pairs=6, loss_tokens=2, lora_rank=1, lora_targets=["q_proj"])
    # linears: q 4x4 + k 4x2 + v 4x2 + o 4x4 + gate 4x8 + up 4x8 + down 8x4 = 16+8+8+16+32+32+32 = 144 weights
    # LoRA on q: r (in + out) = 1 * (4 + 4) = 8; attention: 4 * (heads * head_dim = 4) * 6 pairs = 96
    # lm_head: 2 * 4 * 10 * 2 loss tokens = 160
    forward = 2 * 144 * 3 + 2 * 8 * 3 + 96 + 160
    assert fl["recompute"] == forward
    backward = 2 * 144 * 3 + 2 * 96 + 6 * 8 * 3
    assert fl["fwd_bwd"] == forward + 160 + backward


def test_eos_workload_counts_padding_and_flops(tmp_path) -> None:
    res = bench_step(shape="tiny", formats=("bf16",), overrides=SMALL, prompt_len=8, warmup=0, measure=1, eos=True,
                     out_dir=tmp_path, log=lambda _m: None)
    (r,) = json.loads((tmp_path / "step.json").read_text())["results"]
    assert r["status"] == "ok" and res["config"]["eos"] is True
    # the stop set is a quarter of the 256 ids here (bench rollout's vocab / (max / 2)): samples end early
    assert r["generated_tokens"] < 2 * 2 * 8
    assert r["batch_tokens"] == 4 * 8 + r["generated_tokens"]  # prompt + completion of every sequence
    assert r["batch_loss_tokens"] == r["generated_tokens"]
    assert r["batch_padded_tokens"] > r["batch_tokens"] and 0 < r["padding_pct"] < 100
    assert r["pack_sequences"] is True
    assert r["decode_steps"] >= 1 and r["rollout_ms_per_token_step"] > 0
    assert r["recompute_tflops"] > 0 and r["recompute_mfu"] is None  # no ceiling off CUDA
    assert res["matmul_ceiling_tflops"] is None
    assert render_table(res).row_count == 1


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None, reason="TRL is installed: the cell would run it")
def test_trl_peer_without_trl_records_why(tmp_path) -> None:
    res = bench_step(shape="tiny", formats=("bf16",), peers=("trl",), overrides=SMALL, prompt_len=8, warmup=0,
                     measure=1, out_dir=tmp_path, log=lambda _m: None)
    rows = {r["format"]: r for r in res["results"]}
    assert rows["bf16"]["status"] == "ok"
    assert rows["trl"]["status"].startswith("TRL failed: ModuleNotFoundError"), rows["trl"]["status"]
    assert "trl" in rows["trl"]["status"] and (tmp_path / "trl_runner.log").is_file()
    assert rows["trl"]["trl_settings"]["loss_type"] == "grpo"
    assert rows["trl"]["trl_settings"]["gradient_accumulation_steps"] * \
        rows["trl"]["trl_settings"]["per_device_train_batch_size"] == 4


def test_resident_cache_rule() -> None:
    gib = 2**30
    plan = MemoryPlan(capacity=20 * gib, reserve=gib, weights=10 * gib, adapters=gib, activations=4 * gib,
                      activations_no_gc=4 * gib, activations_gc=gib, logprobs=gib, kv_cache=2 * gib, rollout=gib,
                      micro_batch_size=8, gradient_checkpointing=False, kv_slots=32, gpu_memory_utilization=None,
                      sequences=32, seq_tokens=512)
    assert plan.train_peak == 17 * gib and plan.resident_cache_fits  # 17 + 2 <= 20
    plan.kv_cache = 4 * gib
    assert not plan.resident_cache_fits  # 17 + 4 > 20: the engine releases its cache after each rollout
    plan.capacity = None
    assert plan.resident_cache_fits  # no known limit (CPU)


def test_bad_peer_input(tmp_path) -> None:
    kw = {"overrides": SMALL, "out_dir": tmp_path, "log": lambda _m: None}
    run_dir = tmp_path / "run"  # refused before the run is read
    with pytest.raises(QerlError, match="unknown peer"):
        bench_step(shape="tiny", formats=("bf16",), peers=("sglang",), **kw)
    with pytest.raises(QerlError, match="unknown format"):
        bench_step(shape="tiny", formats=("nvfp4@sglang",), **kw)
    with pytest.raises(QerlError, match="unknown format"):
        bench_step(shape="tiny", formats=("bf16+int8@vllm",), **kw)
    with pytest.raises(QerlError, match="--peers runs on a random model shape"):
        bench_step(run_dir=run_dir, peers=("trl",), **kw)
    with pytest.raises(QerlError, match="--eos is for --shape"):
        bench_step(run_dir=run_dir, eos=True, **kw)
    with pytest.raises(QerlError, match="--vllm-memory"):
        bench_step(shape="tiny", formats=("bf16",), vllm_memory=1.5, **kw)
