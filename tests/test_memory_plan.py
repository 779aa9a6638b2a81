"""The memory plan: hand-computed parts, the order of its choices, the one-line advice when nothing fits,
and (CPU, fp32) that neither the plan nor the chunked log-probs change a training run's numbers."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.train.memory_plan import GIB, MemoryPlanError, ModelDims, plan_memory, rollout_reserve

Q7 = ModelDims(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# a small model whose numbers are easy to follow by hand
SMALL = ModelDims(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)


def test_parts_by_hand() -> None:
    # Qwen2.5-7B, LoRA r32 on all seven projections: per layer 32 x (7168 + 4096 + 4096 + 7168 + 3 x 22528)
    assert Q7.lora_params(32, ALL) == 28 * 32 * 90112 == 80_740_352  # peft prints the same count
    assert Q7.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2 == 57_344  # docs/benchmarks.md's 7B figure
    assert SMALL.act_bytes_per_token_layer(4) == (15 * 64 + 4 * 128) * 4 == 5888
    p = plan_memory(SMALL, weights=1000, capacity=None, device_total=None, elem=4, sequences=4, prompt_tokens=10,
                    completion_tokens=6, lora_rank=2, lora_targets=["q_proj", "down_proj"], logprob_chunk=4)
    # CPU: no limit known, the defaults as before (micro-batch min(8, 4), no checkpointing), nothing reserved
    assert (p.micro_batch_size, p.gradient_checkpointing, p.capacity, p.reserve) == (4, False, None, 0)
    assert p.adapters == 2 * 2 * ((64 + 64) + (128 + 64)) * (16 + 4) == 25_600
    assert p.activations == p.activations_no_gc == 4 * 16 * 2 * 5888
    assert p.activations_gc == 4 * 16 * (2 * 64 * 4 + 5888 + 2 * 64 * 4)
    assert p.logprobs == 4 * 256 * (4 + 12) + 2 * (4 * 6) * 64 * 4  # one chunk of 4 rows + kept rows/Jacobian
    cache_len = 64  # 10 + 6 + 1 tokens, rounded up to the engine's 64
    assert p.kv_cache == 4 * cache_len * (2 * 2 * 2 * 16 * 4)
    assert p.rollout == rollout_reserve(SMALL, 4, 4) == int(1.5 * 8192 * (256 + 384 + 128 + 128) * 4) + \
        4 * 256 * 48 + (512 << 20)
    assert p.peak == max(p.train_peak, p.rollout_peak)
    assert "memory plan" in p.lines()[0] and any("chosen: micro_batch_size 4" in s for s in p.lines())


def _plan(capacity_gib: float, **kw):
    args = dict(weights=int(6 * GIB), capacity=int(capacity_gib * GIB), device_total=int(80 * GIB), elem=2,
                sequences=32, prompt_tokens=256, completion_tokens=256, lora_rank=32, lora_targets=ALL)
    args.update(kw)
    return plan_memory(Q7, **args)


def test_choices_follow_the_memory() -> None:
    roomy = _plan(139.0)  # an H200: no checkpointing, the largest micro-batch
    assert (roomy.gradient_checkpointing, roomy.micro_batch_size) == (False, 8)
    assert roomy.gpu_memory_utilization == 1.0 and roomy.kv_slots == 32
    # 8 x 512 tokens without checkpointing is ~28 GiB of activations: on 30 GiB the plan halves the micro-batch
    # while it still feeds the GEMMs >= 2048 tokens (4 x 512), then turns checkpointing on at micro-batch 8
    assert _plan(40.0).micro_batch_size == 8
    tight = _plan(30.0)
    assert tight.activations_no_gc * 2 == _plan(139.0).activations_no_gc > 25 * GIB  # at micro-batch 4 vs 8
    assert (tight.gradient_checkpointing, tight.micro_batch_size) == (False, 4)
    tighter = _plan(20.0)
    assert (tighter.gradient_checkpointing, tighter.micro_batch_size) == (True, 8)
    assert tighter.train_peak <= 20 * GIB < _plan(139.0).train_peak
    assert tighter.gpu_memory_utilization == pytest.approx(20 / 80)
    assert [t.split(":")[0] for t in tighter.tried] == ["gc=false mb=8", "gc=false mb=4", "gc=true mb=8"]
    # settings given explicitly are kept
    fixed = _plan(139.0, micro_batch_size=2, gradient_checkpointing=True, gpu_memory_utilization=0.4)
    assert (fixed.micro_batch_size, fixed.gradient_checkpointing, fixed.gpu_memory_utilization) == (2, True, 0.4)


def test_nothing_fits_says_what_to_change() -> None:
    with pytest.raises(MemoryPlanError) as exc:
        _plan(13.0, completion_tokens=8192)
    msg = str(exc.value)
    assert "\n" not in msg and "lower --max-completion-length to" in msg
    suggested = int(msg.split("lower --max-completion-length to ")[1].split()[0])
    assert 0 < suggested < 8192
    _plan(13.0, completion_tokens=suggested)  # the suggestion fits, one token more does not
    with pytest.raises(MemoryPlanError):
        _plan(13.0, completion_tokens=suggested + 1)
    with pytest.raises(MemoryPlanError, match="weights and adapter state alone .*qerl quantize --format nvfp4"):
        _plan(7.0)
    with pytest.raises(MemoryPlanError, match=r"use --micro-batch-size \d+ --gradient-checkpointing"):
        _plan(20.0, micro_batch_size=8, gradient_checkpointing=False)


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
    ref_t, ref, ref_p = _run(tmp_path, "ref", logprob_chunk_tokens=0, micro_batch_size=8, gradient_checkpointing=False)
    # plan picks, 5-row chunks; padded forwards (packing, compared below, changes the attention's rounding)
    planned_t, planned, planned_p = _run(tmp_path, "planned", logprob_chunk_tokens=5, pack_sequences=False)
    assert planned_t.cfg.micro_batch_size == 8 and planned_t.cfg.gradient_checkpointing is False
    assert planned_t.memory_plan.capacity is None  # CPU
    assert ref[0]["loss"] != 0 and ref[0]["grad_norm"] > 0 and ref[1]["entropy"] > 0
    _same(ref, planned, ref_p, planned_p)
    # packed training forwards (the default; train/packing.py): the same run to rounding (per-sequence attention)
    packed_t, packed, packed_p = _run(tmp_path, "packed", logprob_chunk_tokens=5)
    assert packed_t.cfg.pack_sequences
    _same(ref, packed, ref_p, packed_p, tol=1e-5)
