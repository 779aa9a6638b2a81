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
from qerl_cli.train.memory_plan import ModelDims, plan_memory

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
    # no pi_old pass runs by default (the update forward's own log-probs are pi_old): no rate for it
    assert r["recompute_tflops"] is None and r["fwd_bwd_tflops"] > 0 and r["fwd_bwd_mfu"] is None  # no ceiling off CUDA
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
    # the resolved config, not the raw one: TRL fails on lr / scale_rewards None (peft: lora_alpha None / r)
    assert rows["trl"]["trl_settings"]["learning_rate"] == 1e-5
    assert rows["trl"]["trl_settings"]["scale_rewards"] == "group"
    assert rows["trl"]["trl_settings"]["gradient_accumulation_steps"] * \
        rows["trl"]["trl_settings"]["per_device_train_batch_size"] == 4


def test_resident_cache_rule() -> None:
    """The plan keeps the rollout's KV cache (and shadows, graphs) through the update where the cost model says it
    pays (no graphs captured again each step) and every phase still fits with it; the estimates then carry it in
    every phase; the flag overrides."""
    dims = ModelDims(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064)
    kw = {"weights": 6 * 2**30, "device_total": 80 * 2**30, "elem": 2, "sequences": 32, "prompt_tokens": 256,
          "completion_tokens": 256, "lora_rank": 32, "lora_targets": ["q_proj", "v_proj"]}
    roomy = plan_memory(dims, capacity=79 * 2**30, **kw)
    assert roomy.resident_cache_fits and not roomy.gradient_checkpointing
    est = roomy.phase_estimates()
    held = roomy.kv_cache + roomy.shadows
    assert est["checkpoint"] == roomy.weights + roomy.lora_params + roomy.optimizer_state + held
    released = plan_memory(dims, capacity=79 * 2**30, keep_rollout_cache=False, **kw)
    assert not released.resident_cache_fits
    assert released.phase_estimates()["checkpoint"] == released.weights + released.lora_params + \
        released.optimizer_state
    assert released.estimate["rollout"] > roomy.estimate["rollout"]  # its graphs are captured again every step
    assert plan_memory(dims, capacity=None, **kw).resident_cache_fits  # no known limit (CPU)


def test_rows_carry_resolved_settings_and_time_estimates(tmp_path) -> None:
    """A cell planned for a GPU (a cap off CUDA plans for one of that size): its row records the settings it ran
    with (`resolved`), the plan's own step estimate, and per phase the cost model's seconds at the cell's measured
    tokens (`est_<phase>_s`), which the table shows beside the measured step."""
    from rich.console import Console

    from qerl_cli.train.step_cost import PHASES as COST_PHASES

    res = bench_step(shape="tiny", formats=("bf16",), overrides=SMALL, prompt_len=8, warmup=0, measure=1,
                     memory_cap_gib=4.0, out_dir=tmp_path, log=lambda _m: None)
    (row,) = json.loads((tmp_path / "step.json").read_text())["results"]
    assert row["status"] == "ok" and res["device_rates"] is None  # nothing measured on a CPU: the plan's rates
    assert set(row["resolved"]) == {"micro_batch_size", "gradient_checkpointing", "optimizer_offload",
                                    "kernel_weight_copies", "gpu_memory_utilization", "kv_slots",
                                    "keep_rollout_cache"}
    assert row["micro_batch_size"] == row["resolved"]["micro_batch_size"] == row["memory_plan"]["micro_batch_size"]
    assert row["resolved"]["kv_slots"] == 4 and res["config"]["train"]["micro_batch_size"] is None  # the request
    assert row["memory_plan"]["est_step_s"] > 0 and row["memory_plan"]["reason"]
    assert all(row[f"est_{p}_s"] > 0 for p in ("rollout", "fwd_bwd", "optimizer", "checkpoint"))
    assert row["est_recompute_s"] == 0  # no pi_old pass of its own: the update's forward gives pi_old
    assert row["est_step_s"] == pytest.approx(sum(row[f"est_{p}_s"] for p in COST_PHASES))
    out = Console(width=400, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 - closed with the test
    out.print(render_table(res))
    text = out.export_text()
    assert "est step s" in text and f"{row['est_step_s']:.3f}" in text


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
