"""The memory plan per role under --rollout-gpus (train/memory_plan.py, train/disagg.py): a rollout rank's plan holds
no optimizer, gradients or activations and gives that memory to KV slots; a trainer rank's holds no KV cache and
gives it to the micro-batch; each is timed by its own phases. Hand-computed on a small model, against the
single-process plan of the same request, through plan_for_config (a rollout rank plans for its chunk), the
dry run, and a gloo run whose manifest records both roles' plans and that the trainer never allocated a KV cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from qerl_cli.rollout.kv_cache import activation_reserve
from qerl_cli.train.async_queue import chunk_prompts
from qerl_cli.train.config import TrainConfig
from qerl_cli.train.memory_plan import (
    GIB,
    MemoryPlan,
    ModelDims,
    WeightBytes,
    cost_base,
    dry_run_lines,
    plan_for_config,
    plan_memory,
    resolve_settings,
    role_summary,
)
from qerl_cli.train.step_cost import Setting, Workload, default_rates, estimate_step
from tests.helpers import qerl_in_process

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALL = ModelDims(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)
Q7 = ModelDims(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064)
# 32 prompts x 8 samples of 64 + 4031 tokens: with the one token the engine adds, 4096 cache positions per slot
SMALL_REQ = dict(weights=1_000_000, device_total=int(80 * GIB), elem=2, sequences=256, prompts=32, prompt_tokens=64,
                 completion_tokens=4031, lora_rank=2, lora_targets=ALL)


def small(cap_gib: float, role: str = "both", **kw) -> MemoryPlan:
    return plan_memory(SMALL, capacity=int(cap_gib * GIB), role=role, **{**SMALL_REQ, **kw})


def q7(cap_gib: float, role: str = "both", **kw) -> MemoryPlan:
    args = dict(weights=int(6 * GIB), capacity=int(cap_gib * GIB), device_total=int(80 * GIB), elem=2, sequences=64,
                prompt_tokens=256, completion_tokens=1024, lora_rank=32, lora_targets=ALL, prompts=8, role=role)
    return plan_memory(Q7, **{**args, **kw})


def test_rollout_role_by_hand() -> None:
    cap = int(1.8 * GIB)
    p = small(1.8, "rollout")
    # K and V, 2 layers, 2 KV heads of 16, bf16: 256 bytes per token; 4096 positions per slot = 1 MiB
    per_token = 2 * 2 * 2 * 16 * 2
    assert SMALL.kv_bytes_per_token(2) == per_token == 256
    per_slot = 4096 * per_token
    # nothing of the update: no gradients, AdamW moments (on the GPU or off), activations, log-prob rows or
    # dequantized weights; the fp32 LoRA factors the trainers' adapters are copied into stay
    assert (p.grads, p.optimizer_state, p.optimizer_host, p.optimizer_step) == (0, 0, 0, 0)
    assert (p.activations, p.layer_backward, p.activations_gc, p.activations_no_gc, p.recompute) == (0, 0, 0, 0, 0)
    assert (p.logprob_chunk, p.logprob_kept, p.dequant, p.transient) == (0, 0, 0, 0)
    lora = 2 * 2 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))  # 2 layers, rank 2
    assert SMALL.lora_params(2, ALL) == lora == 4096 and p.lora_params == 4 * lora
    # the room: the card less the reserve (1 GiB + 5%: nothing transient to fragment) and what the rollout holds
    # beside its cache (weights, factors, shadows, the engine's activations at 256 slots and a 32 x 64 prefill)
    assert p.reserve == GIB + cap // 20
    engine = int(1.5 * 2048 * (4 * 64 + 3 * 128 + (4 + 2 * 2) * 16 + 2 * 2 * 2 * 16) * 2) + 256 * 256 * 48 + (512 << 20)
    shadows = SMALL.shadow_elems(2, ALL) * 2
    slots = (cap - p.reserve - (1_000_000 + 4 * lora + shadows + engine)) // per_slot
    assert 1 <= slots < 256 and p.kv_slots == slots and p.kv_cache == slots * per_slot
    # the estimated peak is the rollout's: weights, factors, shadows, cache and the engine at the slots it has
    rollout = int(1.5 * 2048 * 896 * 2) + slots * 256 * 48 + (512 << 20)
    assert p.rollout == rollout == activation_reserve(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                                                      layers=2, vocab=256, elem=2, prefill_tokens=2048, slots=slots)
    assert p.peak == p.phase_estimates()["rollout"] == 1_000_000 + 4 * lora + shadows + p.kv_cache + rollout
    assert p.fits() and p.peak + p.reserve <= cap
    # timed by its own phases: the AQN draw and the rollout
    assert set(p.estimate) == {"aqn", "rollout"} and p.resident_cache is True
    # the same request on one process: its optimizer, update and fragmentation reserve leave fewer slots
    both = small(1.8)
    assert 1 <= both.kv_slots < p.kv_slots


def test_train_role_holds_no_kv_cache_by_hand() -> None:
    p = small(1.8, "train")
    assert (p.kv_slots, p.kv_cache, p.shadows, p.rollout, p.aqn, p.resident_cache) == (0, 0, 0, 0, 0, False)
    assert p.fits() and set(p.estimate) == {"recompute", "fwd_bwd", "optimizer", "checkpoint", "other"}
    lora = 4096
    static = 1_000_000 + 4 * lora + p.optimizer_state
    e = p.phase_estimates()
    assert e["fwd_bwd"] == static + 4 * lora + p.activations + p.logprob_kept + max(p.logprob_chunk,
                                                                                    p.layer_backward + p.dequant)
    assert e["rollout"] == e["checkpoint"] == static  # nothing of the engine on top of what stays
    assert p.peak == max(e["recompute"], e["fwd_bwd"], e["optimizer"])
    assert p.micro_batch_size >= small(1.8).micro_batch_size


@pytest.mark.parametrize("cap_gib", [11.3, 14.0, 20.0, 40.0, 139.0])
def test_roles_against_the_single_process_plan(cap_gib: float) -> None:
    """Qwen2.5-7B's shapes, 64 sequences of 256 + 1024 tokens: at every card size the rollout role decodes at least
    as many sequences at once and the train role takes at least the same micro-batch, each fitting."""
    both, train, rollout = q7(cap_gib), q7(cap_gib, "train"), q7(cap_gib, "rollout")
    assert rollout.kv_slots >= both.kv_slots and train.micro_batch_size >= both.micro_batch_size
    assert train.kv_cache == 0 and rollout.grads == rollout.optimizer_state == rollout.activations == 0
    for p in (train, rollout):
        assert p.fits() and p.peak + p.reserve <= cap_gib * GIB


def test_memory_the_cache_took_goes_to_the_update_and_back() -> None:
    """At 14 GiB the single process keeps a 36-slot cache beside micro-batch 4; alone, the trainer doubles the
    micro-batch and the rollout rank decodes 59 of the 64 sequences at once."""
    both, train, rollout = q7(14.0), q7(14.0, "train"), q7(14.0, "rollout")
    assert (both.kv_slots, both.micro_batch_size, both.resident_cache) == (36, 4, True)
    assert (train.micro_batch_size, train.kv_slots) == (8, 0) and rollout.kv_slots == 59
    # where the cache holds all sequences (15 GiB) the single process releases it every step and pays the
    # recapture; the rollout rank keeps it, so its rollout is estimated faster
    both, rollout = q7(15.0), q7(15.0, "rollout")
    assert both.kv_slots == rollout.kv_slots == 64 and not both.resident_cache and rollout.resident_cache
    assert rollout.estimate["rollout"] < both.estimate["rollout"]


def test_step_cost_by_role() -> None:
    """The cost model times a role by its own phases, with the same seconds per phase as the whole step."""
    base = cost_base(Q7, WeightBytes(stored=int(6 * GIB)), 2)
    work = Workload(64, 256, 1024, 32, tuple(ALL))
    s = Setting(8, True, kv_slots=32)
    rates = default_rates(None)
    whole = estimate_step(base, work, s, rates).phases
    train = estimate_step(base, work, s, rates, role="train").phases
    rollout = estimate_step(base, work, s, rates, role="rollout").phases
    assert tuple(train) == ("recompute", "fwd_bwd", "optimizer", "checkpoint", "other")
    assert tuple(rollout) == ("aqn", "rollout")
    assert all(whole[k] == v for k, v in {**train, **rollout}.items())
    with pytest.raises(ValueError, match="unknown role"):
        estimate_step(base, work, s, rates, role="decode")


def tiny_config() -> transformers.Qwen2Config:
    return transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)


def test_plan_for_config_plans_a_rollout_rank_for_its_chunk() -> None:
    """Two rollout ranks: the hub hands each at most half a step's prompts, so a rollout rank's plan (and the
    engine's slots) are for 4 prompts x 4 samples; trainers plan for the step's 32 sequences."""
    cfg = TrainConfig(rollout_gpus=2, batch_prompts=8, num_generations=4, max_completion_length=64,
                      gpu_memory_gib=4.0, precision="bf16").resolved()
    assert chunk_prompts(8, 2) == 4 and chunk_prompts(7, 2) == 4 and chunk_prompts(1, 3) == 1
    kw = dict(weights=1_000_000, device="cpu", prompt_tokens=32, elem=2)
    rollout = plan_for_config(cfg, tiny_config(), role="rollout", **kw)
    train = plan_for_config(cfg, tiny_config(), role="train", **kw)
    assert rollout.sequences == 16 and train.sequences == 32 and rollout.role == "rollout"
    r, t = resolve_settings(cfg, rollout), resolve_settings(cfg, train)
    assert r.kv_slots == 16 and r.keep_rollout_cache  # one chunk's samples at once, in one wave
    assert not t.keep_rollout_cache and 1 <= t.micro_batch_size <= 32
    rs, ts = role_summary(rollout, r), role_summary(train, t)
    assert rs["micro_batch_size"] is None and rs["optimizer_offload"] is None and rs["kv_slots"] == 16
    assert ts["kv_slots"] is None and ts["gpu_memory_utilization"] is None and ts["micro_batch_size"] >= 1
    assert rs["est_peak_gib"] <= 4.0 and ts["est_peak_gib"] <= 4.0 and rs["capacity_gib"] == 4.0
    # without the split the plan is the single process's, sized for the whole step
    single = plan_for_config(TrainConfig(batch_prompts=8, num_generations=4, max_completion_length=64,
                                         gpu_memory_gib=4.0, precision="bf16").resolved(), tiny_config(), **kw)
    assert single.role == "both" and single.sequences == 32


def test_dry_run_shows_both_roles(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qerl train --dry-run --gpus 2 --rollout-gpus 1` (no torchrun, no GPU needed) plans both roles from the
    config; without --rollout-gpus it shows the one plan as before."""
    lines = dry_run_lines(tiny_run, TrainConfig(gpu_memory_gib=8.0, batch_prompts=2, num_generations=2,
                                                max_completion_length=8, rollout_gpus=1))
    text = "\n".join(lines)
    assert lines[0].startswith("--rollout-gpus 1: one plan per role")
    assert "memory plan of a trainer rank" in text and "memory plan of a rollout rank" in text
    assert "kv cache, rollout, shadows      none (a trainer rank's engine never runs)" in text
    assert "gradients, AdamW, activations   none (a rollout rank never runs the update)" in text
    assert "step time estimate (s): recompute " in text and "step time estimate (s): aqn " in text
    single = dry_run_lines(tiny_run, TrainConfig(gpu_memory_gib=8.0, batch_prompts=2, num_generations=2,
                                                 max_completion_length=8))
    assert single[0].startswith("memory plan (") and "trainer rank" not in "\n".join(single)
    code, out, err = qerl_in_process(capsys, "train", "--run", str(tiny_run), "--config", "quick_cpu", "--gpus", "2",
                                     "--rollout-gpus", "1", "--gpu-memory-gib", "8", "--dry-run")
    assert code == 0, err
    assert "# memory plan of a trainer rank" in out and "# memory plan of a rollout rank" in out


@pytest.mark.slow
def test_gloo_run_records_each_roles_plan(tiny_run: Path, text_hash_reward: str) -> None:
    """1 trainer + 1 rollout rank on gloo, planned for an 8 GiB GPU (a cap plans for one off CUDA): the manifest
    records each role's own plan, the rollout rank's as it reported it, and the trainer's engine never allocated
    a KV cache."""
    from tests.test_disagg import async_record, torchrun
    from tests.test_distributed import ARGS

    res = torchrun(2, "train", "--run", str(tiny_run), *ARGS, "--reward", text_hash_reward, "--steps", "2",
                   "--rollout-gpus", "1", "--gpu-memory-gib", "8")
    assert res.returncode == 0, res.stderr[-3000:]
    rec = async_record(tiny_run)
    roles = rec["extra"]["async"]["roles"]
    train, rollout = roles["train"], roles["rollout"]
    assert train["role"] == "train" and train["micro_batch_size"] == 2 and train["kv_slots"] is None
    assert train["engine_kv_cache_bytes"] == 0 and train["capacity_gib"] == 8.0
    assert rollout["role"] == "rollout" and rollout["reported_by"] == [1] and "differs" not in rollout
    assert rollout["micro_batch_size"] is None and rollout["optimizer_offload"] is None
    assert rollout["kv_slots"] == 4 and rollout["keep_rollout_cache"] is True  # 2 prompts x 2 samples, one chunk
    assert 0 < rollout["est_peak_gib"] <= 8.0 and 0 < train["est_peak_gib"] <= 8.0
    assert rec["extra"]["memory_plan"]["role"] == "train"  # rank 0's own plan, as recorded before
    assert json.dumps(roles)  # plain JSON, as the manifest holds it
