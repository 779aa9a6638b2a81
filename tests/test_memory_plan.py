"""The memory plan: hand-computed parts and phases, the order of its choices, the 72B step on an 80 GB card,
the one-line advice when nothing fits (before any weight is built), the weight estimate against built models,
and (CPU, fp32) that neither the plan, the chunked log-probs nor the host-offloaded optimizer change a run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from qerl_cli.train.memory_plan import (
    FRAGMENTATION_SHARE,
    GIB,
    NEAR_TIE,
    PHASES,
    MemoryPlan,
    MemoryPlanError,
    ModelDims,
    WeightBytes,
    plan_before_build,
    plan_memory,
    rollout_reserve,
    weight_bytes,
)

Q7 = ModelDims(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# a small model whose numbers are easy to follow by hand
SMALL = ModelDims(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)


def test_parts_and_phases_by_hand() -> None:
    # Qwen2.5-7B, LoRA r32 on all seven projections: per layer 32 x (7168 + 4096 + 4096 + 7168 + 3 x 22528)
    assert Q7.lora_params(32, ALL) == 28 * 32 * 90112 == 80_740_352  # peft prints the same count
    assert Q7.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2 == 57_344  # docs/benchmarks.md's 7B figure
    assert SMALL.act_bytes_per_token_layer(4) == (11 * 64 + 4 * 128) * 4 == 4864
    p = plan_memory(SMALL, weights=1000, capacity=None, device_total=None, elem=4, sequences=4, prompt_tokens=10,
                    completion_tokens=6, lora_rank=2, lora_targets=["q_proj", "down_proj"], logprob_chunk=4)
    # CPU: no limit known, the defaults as before (micro-batch min(8, 4), no checkpointing, AdamW on the device)
    assert (p.micro_batch_size, p.gradient_checkpointing, p.optimizer_offload, p.capacity, p.reserve) == \
        (4, False, False, None, 0)
    lora = 2 * ((64 + 64) + (128 + 64)) * 2  # q: 64 -> 64, down: 128 -> 64; rank 2, two layers
    assert (p.lora_params, p.grads, p.optimizer_state, p.optimizer_host) == (4 * lora, 4 * lora, 8 * lora, 0)
    # the engine's shadows: per group the concatenated A [r, in] and the block-diagonal B [sum out, r]
    assert p.shadows == 2 * ((2 * 64 + (64 + 32 + 32) * 2) + (2 * 128 + 64 * 2)) * 4 == 6144
    tokens = 4 * 16  # micro-batch 4 of 10 + 6 tokens
    assert p.activations == tokens * 2 * 4864 and p.layer_backward == tokens * (3 * 128 + 2 * 64) * 4
    assert p.activations_gc == tokens * 2 * 64 * 4 + tokens * (4864 + 2 * 64 * 4)
    assert p.recompute == tokens * (4 * 128 + 10 * 64) * 4
    assert p.logprob_chunk == 4 * 256 * (4 + 16)  # one chunk of 4 rows
    assert p.logprob_kept == (tokens + 2 * 4 * 6) * 64 * 4  # final hidden states, kept rows and their Jacobian
    assert p.dequant == 64 * 128 * 4  # the largest linear (gate/up) dequantized once
    cache_len = 64  # 10 + 6 + 1 tokens, rounded up to the engine's 64
    assert p.kv_slots == 4 and p.kv_cache == 4 * cache_len * (2 * 2 * 2 * 16 * 4)
    # the engine's activation reserve at the real prefill (4 prompts x 10 tokens)
    assert p.rollout == rollout_reserve(SMALL, 4, 4, 40) == int(1.5 * 40 * (256 + 384 + 128 + 128) * 4) + \
        4 * 256 * 48 + (512 << 20)
    static = 1000 + 4 * lora + 8 * lora
    assert p.phase_estimates() == {
        "setup": 1000 + 4 * lora,
        "aqn": static + 2 * 5 * 64 * 4,
        "rollout": static + 6144 + p.kv_cache + p.rollout,
        "recompute": static + p.logprob_kept + p.recompute + p.dequant,
        "fwd_bwd": static + 4 * lora + p.activations + p.logprob_kept + p.layer_backward + p.dequant,
        "optimizer": static + 4 * lora + 4 * lora,  # + foreach AdamW's square root of the second moment
        "checkpoint": static,
    }
    assert tuple(p.phase_estimates()) == PHASES and p.peak == p.phase_estimates()["rollout"]
    lines = p.lines()
    assert "memory plan" in lines[0] and any("chosen: micro_batch_size 4" in s for s in lines)
    assert any(s.startswith("  peak per phase (GiB): setup") for s in lines)


def _plan(capacity_gib: float, **kw):
    args = dict(weights=int(6 * GIB), capacity=int(capacity_gib * GIB), device_total=int(80 * GIB), elem=2,
                sequences=32, prompt_tokens=256, completion_tokens=256, lora_rank=32, lora_targets=ALL, prompts=8)
    args.update(kw)
    return plan_memory(Q7, **args)


def _fixed(cap_gib: float, s: dict) -> MemoryPlan | None:
    """The plan with every setting of ``s`` given (None: it does not fit)."""
    try:
        return _plan(cap_gib, advise=False, **{k: s[k] for k in ("micro_batch_size", "gradient_checkpointing",
                                                                 "optimizer_offload", "keep_rollout_cache")})
    except MemoryPlanError:
        return None


@pytest.mark.parametrize("cap_gib", [139.0, 40.0, 20.0, 11.0])
def test_the_plan_takes_the_fastest_setting_that_fits(cap_gib: float) -> None:
    """Every setting is estimated (micro-batch 1..32 x checkpointing x offload x resident cache = 48); the plan takes
    one that fits, no setting that fits is more than NEAR_TIE faster, and of those within NEAR_TIE of the fastest
    it needs the least memory. Checked against every setting planned on its own."""
    p = _plan(cap_gib)
    assert p.considered == 6 * 2 * 2 * 2 and p.fits() and p.peak + p.reserve <= cap_gib * GIB
    others = [o for o in (_fixed(cap_gib, {**p.setting(), "micro_batch_size": mb, "gradient_checkpointing": gc,
                                           "optimizer_offload": off, "keep_rollout_cache": keep})
                          for mb in (1, 2, 4, 8, 16, 32) for gc in (False, True) for off in (False, True)
                          for keep in (False, True)) if o is not None]
    assert len(others) == p.fitting > 1
    fastest = min(o.est_step_s for o in others)
    assert p.est_step_s <= fastest * (1 + NEAR_TIE)
    near = [o for o in others if o.est_step_s <= fastest * (1 + NEAR_TIE)]
    assert p.peak + p.reserve == min(o.peak + o.reserve for o in near)
    assert p.candidates and all(c["est_step_s"] >= fastest for c in p.candidates if c["fits"])


def test_choices_follow_the_memory() -> None:
    # an H200: no checkpointing and a micro-batch above the old cap of 8 (fewer micro-batches, less host time)
    roomy = _plan(139.0)
    assert roomy.gradient_checkpointing is False and roomy.micro_batch_size > 8
    assert roomy.gpu_memory_utilization == 1.0 and roomy.kv_slots == 32
    # moments in host memory: they were already taken as a near tie (less memory, within 3%); since the checkpoint
    # lends them to its writer instead of copying them, offloading is the fastest setting outright
    assert roomy.optimizer_offload is True and "the fastest of the 48 settings" in roomy.reason
    mid = _plan(40.0)  # 16 sequences' activations do not fit: 8 of them, still without checkpointing
    assert (mid.gradient_checkpointing, mid.micro_batch_size) == (False, 8)
    # memory short: checkpointing with the whole batch in one micro-batch, never micro-batch 1
    short = _plan(20.0)
    assert (short.gradient_checkpointing, short.micro_batch_size, short.optimizer_offload) == (True, 32, True)
    assert short.optimizer_state == 0 and short.optimizer_host == 8 * Q7.lora_params(32, ALL)
    assert short.gpu_memory_utilization == pytest.approx(20 / 80)
    assert _plan(11.0).micro_batch_size < 32  # the layer-input activations of 32 x 512 tokens no longer fit
    mb1 = _plan(20.0, micro_batch_size=1)
    assert mb1.est_step_s > 1.1 * short.est_step_s  # what micro-batch 1 would have cost
    # a peer kernel's weight copies: estimated, refused where they make the step slower (its training path)
    copies = WeightBytes(stored=int(6 * GIB), kernel_derived=int(0.5 * GIB), extra_copies=int(4 * GIB))
    assert _plan(139.0, weights=copies).extra_weight_copies is False
    forced = _plan(139.0, weights=copies, extra_weight_copies=True)
    assert forced.extra_weight_copies is True and forced.weights == int(10.5 * GIB)
    assert forced.est_step_s > _plan(139.0, weights=copies).est_step_s
    # settings given explicitly are kept
    fixed = _plan(139.0, micro_batch_size=2, gradient_checkpointing=True, gpu_memory_utilization=0.4,
                  optimizer_offload=False)
    assert (fixed.micro_batch_size, fixed.gradient_checkpointing, fixed.gpu_memory_utilization) == (2, True, 0.4)
    assert fixed.optimizer_offload is False and fixed.considered == 2  # the resident cache is all that was left


def test_fewer_kv_slots_when_a_resident_cache_must_fit_beside_the_update() -> None:
    """A resident cache is sized to fit beside every phase; where that leaves fewer slots than sequences the
    rollout decodes in waves, which the estimate counts, and a released cache (all slots) can win."""
    kw = dict(micro_batch_size=8, gradient_checkpointing=True, optimizer_offload=True)
    kept, released = _plan(11.3, keep_rollout_cache=True, **kw), _plan(11.3, keep_rollout_cache=False, **kw)
    assert released.kv_slots == 32 and 1 <= kept.kv_slots < 32 and kept.peak + kept.reserve <= 11.3 * GIB
    waves = -(-32 // kept.kv_slots)
    assert waves == 4 and kept.estimate["rollout"] > 2 * released.estimate["rollout"]  # a smaller batch per wave
    chosen = _plan(11.3, **kw)  # recapturing the graphs every step costs less than decoding in waves
    assert chosen.resident_cache is False and chosen.kv_slots == 32


def test_nothing_fits_says_what_to_change() -> None:
    with pytest.raises(MemoryPlanError) as exc:
        _plan(11.0, completion_tokens=8192)
    msg = str(exc.value)
    assert "\n" not in msg and "lower --max-completion-length to" in msg
    suggested = int(msg.split("lower --max-completion-length to ")[1].split()[0])
    assert 0 < suggested < 8192
    _plan(11.0, completion_tokens=suggested)  # the suggestion fits, one token more does not
    with pytest.raises(MemoryPlanError):
        _plan(11.0, completion_tokens=suggested + 1)
    with pytest.raises(MemoryPlanError, match="weights and adapter state alone .*qerl quantize --format nvfp4"):
        _plan(7.0, weights=WeightBytes(stored=int(6 * GIB), low_bit=False))
    with pytest.raises(MemoryPlanError, match=r"use --micro-batch-size \d+ --gradient-checkpointing"):
        _plan(20.0, micro_batch_size=8, gradient_checkpointing=False)


# ---- Qwen2.5 14B / 32B / 72B on one 80 GB card ---------------------------------------------------------------
H100_GIB = 79.19  # torch.cuda.get_device_properties(...).total_memory of an 80 GB H100
# the published config.json values of the Qwen2.5 models (vocab 152064, untied embeddings, q/k/v biases)
QWEN25 = {"7b": (3584, 18944, 28, 28, 4), "14b": (5120, 13824, 48, 40, 8), "32b": (5120, 27648, 64, 40, 8),
          "72b": (8192, 29568, 80, 64, 8)}


def qwen25(size: str):
    from transformers import Qwen2Config

    hidden, inter, layers, heads, kv = QWEN25[size]
    return Qwen2Config(vocab_size=152064, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                       tie_word_embeddings=False)


def _plan_qwen(size: str, fmt: str, cap_gib: float, **kw):
    from qerl_cli.train.config import TrainConfig

    shape = dict(batch_prompts=1, num_generations=8, max_completion_length=1024) if size in ("32b", "72b") else \
        dict(batch_prompts=8, num_generations=4, max_completion_length=256)  # the tracker's bench step cells
    # off CUDA a cap plans for a GPU of that size (the CUDA kernels' data counted), enforcing nothing
    return plan_before_build(TrainConfig(lora_rank=32, gpu_memory_gib=cap_gib, **shape, **kw), qwen25(size), fmt,
                             device="cpu", prompt_tokens=256)


def _plan_72b(cap_gib: float, **kw):
    return _plan_qwen("72b", "nvfp4", cap_gib, **kw)


def test_72b_default_settings_fit_an_80gb_card() -> None:
    p = _plan_72b(H100_GIB)
    # packed FP4 + FP8 scales of 70.2 G linear weights (0.5625 B each), bf16 embeddings + lm_head (2 x 152064 x 8192),
    # norms and q/k/v biases; the kernels' 16-bit block scales (0.125 B per weight)
    linear = 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 29568 * 8192)
    assert linear == 70_212_648_960
    dense = 2 * 152064 * 8192 * 2 + (80 * (2 * 8192 + 10240) + 8192) * 2 + 128 * 4  # + the rotary buffers
    assert p.weight_parts.stored == linear * 9 // 16 + 80 * 7 * 4 + dense  # + each linear's FP32 global scale
    assert p.weight_parts.kernel_derived == linear // 8 + 80 * 10240 * 4  # + the CUDA kernel's fp32 q/k/v biases
    # checkpointing with 4 sequences a micro-batch (micro-batch 8 is within 3% and 9 GiB larger): a quarter of
    # micro-batch 1's host time and dequantize passes, ~10% of the step
    assert (p.micro_batch_size, p.gradient_checkpointing, p.optimizer_offload) == (4, True, True)
    assert p.kv_slots == 8 and p.optimizer_state == 0 and p.peak + p.reserve <= H100_GIB * GIB
    mb1 = _plan_72b(H100_GIB, micro_batch_size=1)
    assert p.est_step_s < 0.93 * mb1.est_step_s and "within 3% of the fastest" in p.reason
    assert max(mb1.phase_estimates().values()) <= 60 * GIB  # issue 27's setting, for the 60 GiB target
    est = p.phase_estimates()
    assert set(est) == set(PHASES)
    assert p.lora_params == 4 * 421_068_800  # LoRA r32 on all seven projections: 0.42 G parameters
    # a whole H200 takes the same settings: the card's size is not what makes the step fast
    assert _plan_72b(139.8).phase_estimates() == est
    # with a peer kernel's copies on offer (humming importable) the plan refuses them: its training passes are slower
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.memory_plan import plan_for_config

    wb = weight_bytes(qwen25("72b"), "nvfp4", 2, kernels=True)
    humming = WeightBytes(wb.stored, wb.kernel_derived, extra_copies=int((linear + 45.5e9) * 0.5625), linear=wb.linear)
    cfg = TrainConfig(batch_prompts=1, num_generations=8, max_completion_length=1024, lora_rank=32,
                      gpu_memory_gib=H100_GIB).resolved()
    p2 = plan_for_config(cfg, qwen25("72b"), weights=humming, device="cpu", prompt_tokens=256, elem=2)
    assert p2.extra_weight_copies is False and p2.phase_estimates() == est


@pytest.mark.parametrize(("size", "fmt"), [("7b", "bf16"), ("7b", "nvfp4"), ("14b", "bf16"), ("14b", "nvfp4"),
                                         ("32b", "bf16"), ("32b", "nvfp4"), ("72b", "nvfp4")])
def test_every_bench_step_cell_fits_an_80gb_card(size: str, fmt: str) -> None:
    """The default plan of every `qerl bench step` cell of the tracker (8 x 4 x (256 + 256) at 7B and 14B, 1 x 8 x
    (256 + 1024) at 32B and 72B) fits 79.19 GiB with its reserve, at the longest completions."""
    p = _plan_qwen(size, fmt, H100_GIB)
    assert p.fits() and p.peak + p.reserve <= H100_GIB * GIB
    assert p.reserve >= GIB + int(H100_GIB * GIB) // 20 + int(FRAGMENTATION_SHARE * p.transient)
    assert p.est_step_s > 0 and p.kv_slots == p.sequences


def test_32b_nvfp4_takes_a_large_micro_batch_with_checkpointing() -> None:
    """Qwen2.5-32B NVFP4 1 x 8 x (256 + 1024) on an 80 GB card: the plan took micro-batch 1 (and humming's copies)
    and fwd+bwd ran at 14% MFU; micro-batch 8 with checkpointing ran it 2.2x faster (tests/test_step_cost.py). Now
    the cost model ranks them: micro-batch 4 or 8 with checkpointing, never 1."""
    p = _plan_qwen("32b", "nvfp4", H100_GIB)
    assert p.gradient_checkpointing and p.micro_batch_size in (4, 8) and p.fits()
    mb1 = _plan_qwen("32b", "nvfp4", H100_GIB, micro_batch_size=1, gradient_checkpointing=True)  # the old choice
    mb8 = _plan_qwen("32b", "nvfp4", H100_GIB, micro_batch_size=8)
    assert p.est_step_s < 0.85 * mb1.est_step_s
    assert p.estimate["fwd_bwd"] < 0.6 * mb1.estimate["fwd_bwd"]
    # micro-batch 8 is the fastest; 4 is within NEAR_TIE of it and smaller, so it wins the near-tie
    assert mb8.est_step_s <= p.est_step_s <= mb8.est_step_s * (1 + NEAR_TIE)
    assert p.peak + p.reserve <= mb8.peak + mb8.reserve
    assert p.reason.startswith(("the fastest", "within 3% of the fastest"))
    assert any(c["setting"]["micro_batch_size"] == 8 for c in p.candidates)


def test_14b_bf16_out_of_memory_explained_and_planned_around() -> None:
    """14B BF16 8 x 4 x (256 + <= 256) with defaults ran out of memory in fwd_bwd on an 80 GB card (tracker,
    2026-11-27): micro-batch 8 without checkpointing, planned at 72.0 GiB, 75.3 GiB allocated at the failure. The
    term that was short: peft's LoRA layer over an unquantized nn.Linear casts each adapted projection's input to
    the fp32 adapters' dtype, and autograd keeps those copies (q, k and v one each); qerl's own layer over a
    quantized base does not (tests/test_step_cost.py counts them with autograd's hooks)."""
    dims = ModelDims.from_config(qwen25("14b"))
    # per token and layer: 4 B x (3 H + H + 2 H + I) of fp32 inputs and 4 B x 7 r of fp32 LoRA products, less the
    # bf16 inputs they replace (2 B x (H + H + H + I) and 2 B x 7 r)
    assert dims.fp32_input_bytes_per_token_layer(32, ALL, 2) == 18 * 5120 + 2 * 13824 + 14 * 32 == 120_256
    wb = weight_bytes(qwen25("14b"), "bf16", 2, kernels=True)
    kw = dict(weights=wb, capacity=None, device_total=None, elem=2, sequences=32, prompt_tokens=256, lora_rank=32,
              lora_targets=ALL, micro_batch_size=8, gradient_checkpointing=False, prompts=8,
              peft_lora=True)  # that run's LoRA layer: peft's (qerl's own training path came later)
    # the failing setting at that run's lengths (the EOS stop set's mean completion in the 7B runs of the same
    # bench: 3797 tokens / 32 = 119): now estimated above what was allocated when it failed
    failing = plan_memory(dims, completion_tokens=119, **kw).phase_estimates()["fwd_bwd"]
    assert failing >= 75.3 * GIB
    assert failing - 8 * (256 + 119) * 48 * 120_256 < 72.0 * GIB  # the term missing, the old estimate's side
    p = _plan_qwen("14b", "bf16", H100_GIB)
    assert not (p.micro_batch_size == 8 and not p.gradient_checkpointing)
    # headroom: what the estimate leaves is at least the reserve: 1 GiB + 5% of the card + 10% of what a step
    # allocates and frees (fragmentation), here > 5.5 GiB
    assert H100_GIB * GIB - p.peak >= p.reserve > 5.5 * GIB
    assert p.reserve == GIB + int(H100_GIB * GIB) // 20 + int(FRAGMENTATION_SHARE * p.transient)


RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _cell(name: str, fmt: str) -> dict:
    return next(r for r in json.loads((RESULTS / name).read_text())["results"] if r["format"] == fmt)


def _fixed_plan(size: str, fmt: str, cap_gib: float, *, measured: int | None = None, completion: int = 1024,
                sequences: int = 8, prompts: int = 1, **settings):
    cfg = qwen25(size)
    wb = weight_bytes(cfg, fmt, 2, kernels=True)
    if measured is not None:
        wb = dataclasses.replace(wb, measured=measured)
    return plan_memory(ModelDims.from_config(cfg), weights=wb, capacity=int(cap_gib * GIB),
                       device_total=int(cap_gib * GIB), elem=2, sequences=sequences, prompt_tokens=256,
                       completion_tokens=completion, lora_rank=32, lora_targets=ALL, prompts=prompts, **settings)


def test_peaks_within_5_percent_of_the_measured_steps() -> None:
    """The fixed-length step cells (1 x 8 x (256 + 1024), so the estimate sees the real tokens): the 72B step of
    issue 27 per phase (its weights measured after the 1-token forward, before the kernels' block scales: those
    count on top), and the tracker's 2026-11-27 peaks (`qerl bench step`, max over phases)."""
    row = _cell("2026-11-26/i27_72b_step_cap79.json", "nvfp4")  # H200 capped at 79.2 GiB
    p = _fixed_plan("72b", "nvfp4", 79.2, measured=row["memory_plan"]["weight_parts"]["measured"],
                    micro_batch_size=1, gradient_checkpointing=True, optimizer_offload=True, keep_rollout_cache=False)
    est = p.phase_estimates()
    for phase in ("aqn", "rollout", "recompute", "fwd_bwd", "optimizer", "checkpoint"):
        assert est[phase] / GIB == pytest.approx(row[f"mem_{phase}_gb"], rel=0.05), phase
    assert est["fwd_bwd"] / GIB == pytest.approx(row["mem_fwd_bwd_gb"], rel=0.01)  # was 1.0 GiB short
    # the tracker's table: (size, micro-batch, checkpointing, capacity, measured peak GiB); the moments in host
    # memory and the cache released as those runs had them
    for size, mb, cap, peak in (("32b", 1, 79.19, 28.8), ("32b", 8, 79.2, 35.6), ("72b", 1, 79.19, 57.3)):
        p = _fixed_plan(size, "nvfp4", cap, micro_batch_size=mb, gradient_checkpointing=True,
                        optimizer_offload=True, keep_rollout_cache=False)
        assert p.peak / GIB == pytest.approx(peak, rel=0.05), (size, mb)


@pytest.mark.parametrize(("name", "fmt"), [("2026-11-27/i35_baseline_step7b_profile_h100.json", "bf16"),
                                           ("2026-11-27/i35_baseline_step7b_profile_h100.json", "nvfp4"),
                                           ("2026-11-26/i26_step_peers_h100.json", "nvfp4")])
def test_7b_eos_peaks_between_mean_and_longest_lengths(name: str, fmt: str) -> None:
    """7B 8 x 4 x (256 + <= 256) with EOS (packed micro-batches of 8 sequences whose lengths vary): the measured
    fwd_bwd peak lies between the estimate at the batch's mean length and at the longest; the BF16 one (peft's fp32
    input copies) was above even the longest before those were counted."""
    row = _cell(name, fmt)
    mean_new = int(row["batch_tokens"] / row["sequences"]) - 256
    kw = dict(measured=row["memory_plan"]["weight_parts"]["measured"], sequences=32, prompts=8, micro_batch_size=8,
              gradient_checkpointing=False, optimizer_offload=False, keep_rollout_cache=True,
              peft_lora=fmt == "bf16")  # those runs' LoRA layer over BF16: peft's
    lo = _fixed_plan("7b", fmt, 79.19, completion=mean_new, **kw).phase_estimates()["fwd_bwd"] / GIB
    hi = _fixed_plan("7b", fmt, 79.19, completion=256, **kw).phase_estimates()["fwd_bwd"] / GIB
    assert lo <= row["mem_fwd_bwd_gb"] <= hi


def test_the_run_records_request_and_resolved_settings(tiny_run) -> None:
    """`qerl train` leaves its TrainConfig as asked: the manifest's config is the request and extra['resolved'] the
    settings the run took (planned for an 8 GiB GPU, which a cap does off CUDA); every metrics line carries the
    plan's step estimate."""
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.run import train

    cfg = TrainConfig(steps=1, batch_prompts=2, num_generations=2, max_completion_length=4, precision="fp32",
                      lora_rank=2, gpu_memory_gib=8.0, aqn=False, log_rollouts=False)
    res = train(tiny_run, cfg)
    rec = RunDir(tiny_run, create=False).record("train")
    assert rec["config"]["micro_batch_size"] is None and rec["config"]["optimizer_offload"] is None
    assert cfg.micro_batch_size is None and cfg.gradient_checkpointing is None
    plan, resolved = rec["extra"]["memory_plan"], rec["extra"]["resolved"]
    assert set(resolved) == {"micro_batch_size", "gradient_checkpointing", "optimizer_offload", "kernel_weight_copies",
                             "gpu_memory_utilization", "kv_slots", "keep_rollout_cache", "sharding"}
    assert resolved["micro_batch_size"] == plan["micro_batch_size"] and 1 <= resolved["micro_batch_size"] <= 4
    assert resolved["gradient_checkpointing"] == plan["gradient_checkpointing"]
    assert resolved["kv_slots"] == plan["kv_slots"] == 4 and resolved["gpu_memory_utilization"] == 1.0
    assert plan["est_step_s"] > 0 and plan["reason"] and plan["estimate"]["rollout"] > 0
    assert res.metrics[0]["plan/est_step_s"] == pytest.approx(plan["est_step_s"])


def test_dry_run_shows_the_time_estimate_and_why(tiny_run) -> None:
    """`qerl train --dry-run` with --gpu-memory-gib on a machine without CUDA plans for a GPU of that size: the
    per-phase time estimate, the device rates it assumed, why this setting, and the runner-ups."""
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.memory_plan import dry_run_lines

    lines = dry_run_lines(tiny_run, TrainConfig(gpu_memory_gib=8.0, batch_prompts=2, num_generations=2,
                                                max_completion_length=8))
    est = next(line for line in lines if line.startswith("  step time estimate (s): aqn "))
    assert "rollout" in est and "fwd_bwd" in est and "H100 assumed (planned without a GPU)" in est
    why = next(line for line in lines if line.startswith("  why: "))
    assert "the fastest" in why and "s per step" in why
    assert any(line.startswith("    fits: mb ") for line in lines)


def test_72b_under_a_48_gib_cap_is_refused_naming_the_setting() -> None:
    with pytest.raises(MemoryPlanError) as exc:
        _plan_72b(48.0)
    msg = str(exc.value)
    assert "\n" not in msg and "the weights and adapter state alone need" in msg and "--gpu-memory-gib" in msg
    assert "quantize the base" not in msg  # it already is 4-bit
    need = float(msg.split("at least ")[1].split()[0])
    assert 50 < need < 62
    _plan_72b(need)  # the named size fits, a smaller one does not
    with pytest.raises(MemoryPlanError):
        _plan_72b(need - 0.1)


def test_bench_cell_refused_before_any_weight_is_built(tmp_path) -> None:
    """`qerl bench step --memory-cap` below what the weights need: the cell is refused by the plan and no weight is
    built (the run must fail fast: its peak resident memory grows by less than the embeddings alone would take).
    The shape is Qwen2.5-0.5B, the largest a CPU bench builds; the 72B case is the plan's own test above."""
    import json
    import subprocess
    import sys

    code = (
        "import json, resource, sys\n"
        "from qerl_cli.bench.step import bench_step\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "res = bench_step(shape='qwen2.5-0.5b', formats=['nvfp4'], memory_cap_gib=0.5, prompt_len=64, warmup=0,\n"
        "                 measure=1, overrides={'batch_prompts': 1, 'num_generations': 2,\n"
        "                 'max_completion_length': 64}, out_dir=sys.argv[1], log=lambda m: None)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'status': res['results'][0]['status'], 'grew_kib': after - before}))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["status"].startswith("error: memory plan: the weights and adapter state alone"), res["status"]
    assert "--memory-cap" in res["status"]
    embeddings_kib = 151936 * 896 * 4 // 1024  # fp32 on CPU: 0.5 GiB
    assert res["grew_kib"] < embeddings_kib // 4
    on_disk = json.loads((tmp_path / "step.json").read_text())
    assert on_disk["results"][0]["status"] == res["status"]


def test_train_refuses_before_the_stage_and_the_load(run_dir) -> None:
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.run import train

    cfg = TrainConfig(steps=1, batch_prompts=1, num_generations=2, max_completion_length=8, gpu_memory_gib=0.05)
    with pytest.raises(MemoryPlanError, match=r"--gpu-memory-gib"):
        train(run_dir, cfg)
    assert RunDir(run_dir, create=False).record("train") is None  # refused before the stage record


# ---- the weight estimate against models that were really built ------------------------------------------------
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4", "int8", "fp8", "nf4", "bf16"])
def test_weight_estimate_is_the_built_models_bytes(fmt: str) -> None:
    """The estimate from the config alone equals the bytes of the model built from it, exactly; for FP4 the
    kernels' block-scale layout too, as the kernels build it (TRITON_INTERPRET on CPU)."""
    from qerl_cli.bench.shapes import ModelShape, build_random_model
    from qerl_cli.qlinear import quant_linears
    from qerl_cli.train.memory_plan import module_bytes

    shape = ModelShape("tiny-qwen2", "qwen2", 128, 256, 2, 4, 2, 512, False, max_positions=512)
    model = build_random_model(shape, fmt, "cpu", dtype=torch.float32, seed=0)
    est = weight_bytes(shape.config(), fmt, 4, kernels=True)
    assert est.stored == module_bytes(model)
    assert est.extra_copies == 0  # no peer kernel on this machine
    if fmt not in ("nvfp4", "mxfp4"):
        return
    from qerl_kernels.linear import kernel_state, quant_linear

    derived = 0
    for m in quant_linears(model).values():
        quant_linear(torch.randn(2, m.in_features), m)
        st = kernel_state(m)
        derived += sum(t.numel() * t.element_size() for t in st.kscales.values())
    # all of it but the CUDA kernel's fp32 copy of the q/k/v biases (built on a GPU only)
    assert derived == est.kernel_derived - shape.layers * (128 + 64 + 64) * 4 > 0


def test_weight_estimate_of_a_real_checkpoint(run_dir) -> None:
    """The embedded SmolLM2 run: the config's estimate is its safetensors files' size to within their headers;
    only down_proj (K = 1536) gets the repacked layout's block scales (K = 576 is not a multiple of 128)."""
    from transformers import AutoConfig

    from qerl_cli.manifest import RunDir
    from qerl_cli.runlayout import quantized_model_dir
    from qerl_cli.train.memory_plan import model_dir_format, stored_bytes

    model_dir = quantized_model_dir(RunDir(run_dir, create=False))
    fmt = model_dir_format(model_dir)
    est = weight_bytes(AutoConfig.from_pretrained(str(model_dir)), fmt, 2, kernels=True)  # stored in bf16
    files = stored_bytes(model_dir)
    assert fmt == "nvfp4" and est.kernel_derived == 30 * 576 * (1536 // 16) * 2
    assert 0 < files - est.stored < 0.005 * files


# ---- CPU training: the plan and the chunked log-probs leave every number as it was -----------------------------
def _run(tmp_path, name: str, steps: int = 2, **cfg_kw):
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.bench.step import _synthetic_task, build_shape_model, synthetic_prompts, synthetic_reward
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.trainer import Trainer

    spec = get_shape("tiny")
    cfg = TrainConfig(batch_prompts=4, num_generations=4, max_completion_length=6, lora_rank=4, precision="fp32",
                      lr=1e-2, steps=steps, aqn=False, log_rollouts=False, seed=1, **cfg_kw)
    trainer = Trainer(RunDir(tmp_path / name), cfg, device="cpu")
    model = build_shape_model(spec, "bf16", torch.device("cpu"), torch.float32, seed=0)
    n = cfg.batch_prompts * steps
    trainer.setup(model=model, tokenizer=None, task=_synthetic_task(n, 5, 6),
                  prompt_ids=synthetic_prompts(n, 5, spec.vocab, 0), reward_fn=synthetic_reward(0))
    ms = [trainer.train_step() for _ in range(steps)]
    params = {k: p.detach().clone() for k, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer, ms, params


def _same(a: list[dict], b: list[dict], pa: dict, pb: dict, tol: float = 1e-6) -> None:
    for x, y in zip(a, b, strict=True):
        keys = {k for k in x if not k.startswith(("timing/", "memory/"))}
        assert keys == {k for k in y if not k.startswith(("timing/", "memory/"))}
        for k in keys:
            assert x[k] == pytest.approx(y[k], abs=tol, rel=0), k
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=tol)


def test_chunked_logprobs_and_plan_leave_cpu_training_unchanged(tmp_path) -> None:
    # reference: the direct log-prob path with the old fixed defaults (micro-batch 8, no checkpointing)
    ref_t, ref, ref_p = _run(tmp_path, "ref", logprob_chunk_tokens=0, micro_batch_size=8, gradient_checkpointing=False,
                             pack_sequences=False)
    # plan picks, 5-row chunks; padded forwards (packing, compared below, changes the attention's rounding)
    planned_t, planned, planned_p = _run(tmp_path, "planned", logprob_chunk_tokens=5, pack_sequences=False)
    assert planned_t.settings.micro_batch_size == 8 and planned_t.settings.gradient_checkpointing is False
    assert planned_t.cfg.micro_batch_size is None  # the request stays as it was asked
    assert planned_t.memory_plan.capacity is None  # CPU
    assert ref[0]["loss"] != 0 and ref[0]["grad_norm"] > 0 and ref[1]["entropy"] > 0
    # to rounding: chunked and direct log-probs sum the same terms in another order, and AdamW's normalized step
    # turns a gradient's last-bit difference into up to ~2e-6 on a parameter after 2 steps
    _same(ref, planned, ref_p, planned_p, tol=5e-6)
    # packed training forwards (the default; train/packing.py): the same run to rounding (per-sequence attention)
    packed_t, packed, packed_p = _run(tmp_path, "packed", logprob_chunk_tokens=5)
    assert packed_t.cfg.pack_sequences
    _same(ref, packed, ref_p, packed_p, tol=1e-5)


def test_training_with_offloaded_optimizer_state_is_unchanged(tmp_path) -> None:
    from qerl_cli.train.host_offload import HostOffloadAdamW

    _, ref, ref_p = _run(tmp_path, "gpu_state", optimizer_offload=False)
    t, off, off_p = _run(tmp_path, "host_state", optimizer_offload=True)
    assert isinstance(t.optimizer, HostOffloadAdamW) and t.settings.optimizer_offload is True
    assert ref[0]["loss"] != 0 and ref[1]["grad_norm"] > 0
    _same(ref, off, ref_p, off_p)
    for k in ref_p:  # bit for bit, not only to the tolerance _same allows
        assert torch.equal(ref_p[k], off_p[k]), k


def test_cpu_dry_run_is_sized_by_the_tasks_prompts_and_says_why_no_time(run_dir) -> None:
    """On the CPU the plan counts the task's real prompts (arith's few-shot prompts, not --max-prompt-length 1024),
    the dequantized copies the CPU keeps, host-memory wording, and says why it has no time estimate. The
    hand-computed training peak of the embedded SmolLM2-135M (quick_cpu: micro-batch 32, fp32, no checkpointing):
    every layer keeps (11 H + 4 I) fp32 values per token, and every decoder linear a dequantized fp32 copy."""
    import re

    from qerl_cli.train.config import build_config
    from qerl_cli.train.memory_plan import dry_run_lines

    lines = dry_run_lines(run_dir, build_config("quick_cpu", {}))
    text = "\n".join(lines)
    assert "on the GPU" not in text and "GPU memory" not in text and "host memory (CPU run; not capped)" in text
    assert "step time estimate: none on the CPU" in text
    prompt = int(re.search(r"prompts counted at the task's longest, (\d+) tokens", text).group(1))
    assert 20 < prompt < 100  # four worked sums and the question
    hidden, inter, layers = 576, 1536, 30
    tokens = 32 * (prompt + 6)
    activations = tokens * layers * (11 * hidden + 4 * inter) * 4
    dequantized = layers * hidden * (2 * hidden + 2 * 192 + 3 * inter) * 4  # q, o 576 x 576; k, v 192 x 576
    assert f"dequantized copies {dequantized / GIB:.2f}" in text
    hand = (activations + dequantized) / GIB
    fwd_bwd = float(re.search(r"fwd_bwd ([\d.]+)", text).group(1))
    assert hand < fwd_bwd < 1.5 * hand  # gradients, the stored weights and one layer's backward on top


def test_engine_shares_are_of_the_capped_memory_on_a_larger_gpu() -> None:
    """Under a 79.2 GiB cap on a 140 GiB GPU the engines' fractions (of the physical device) shrink with it: a share
    the user gives, and vLLM's default half, are of the 79.2 GiB the run may use; the builtin engine's own share
    is the plan's (the cap's fraction). Before, vLLM took 0.35 x 140 GiB = 49 GiB beside a 30B trainer and the
    step ran out of memory in setup."""
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.memory_plan import resolve_settings

    total = 140 * GIB
    plan = plan_memory(Q7, weights=int(6 * GIB), capacity=int(79.2 * GIB), device_total=total, elem=2, sequences=64,
                       prompt_tokens=256, completion_tokens=1024, lora_rank=32, lora_targets=ALL, prompts=8)
    assert plan.device_total == total and plan.gpu_memory_utilization == pytest.approx(79.2 / 140)

    def share(**kw) -> float:
        return resolve_settings(TrainConfig(gpu_memory_gib=79.2, **kw).resolved(), plan).gpu_memory_utilization

    assert share(rollout_engine="vllm", gpu_memory_utilization=0.35) * 140 == pytest.approx(0.35 * 79.2)  # 27.7 GiB
    assert share(rollout_engine="vllm") * 140 == pytest.approx(0.5 * 79.2)
    assert share(gpu_memory_utilization=0.9) * 140 == pytest.approx(0.9 * 79.2)
    assert share() == pytest.approx(79.2 / 140)
    # uncapped (the cap is the whole device): the fractions as given
    whole = dataclasses.replace(plan, capacity=total)
    assert resolve_settings(TrainConfig(rollout_engine="vllm", gpu_memory_utilization=0.35).resolved(),
                            whole).gpu_memory_utilization == pytest.approx(0.35)
