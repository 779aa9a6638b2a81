"""The memory plan: hand-computed parts and phases, the order of its choices, the 72B step on an 80 GB card,
the one-line advice when nothing fits (before any weight is built), the weight estimate against built models,
and (CPU, fp32) that neither the plan, the chunked log-probs nor the host-offloaded optimizer change a run."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.train.memory_plan import (
    GIB,
    PHASES,
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


def test_choices_follow_the_memory() -> None:
    roomy = _plan(139.0)  # an H200: no checkpointing, the largest micro-batch, AdamW on the GPU
    assert (roomy.gradient_checkpointing, roomy.micro_batch_size, roomy.optimizer_offload) == (False, 8, False)
    assert roomy.gpu_memory_utilization == 1.0 and roomy.kv_slots == 32
    # 8 x 512 tokens without checkpointing is ~29 GiB of activations: on 30 GiB the plan halves the micro-batch
    # while it still feeds the GEMMs >= 2048 tokens (4 x 512), then moves AdamW's moments to the host
    tight = _plan(30.0)
    assert tight.activations_no_gc * 2 == pytest.approx(_plan(139.0).activations_no_gc, rel=0.05)
    assert (tight.gradient_checkpointing, tight.micro_batch_size, tight.optimizer_offload) == (False, 4, False)
    assert (_plan(22.5).micro_batch_size, _plan(22.5).optimizer_offload) == (4, True)
    # memory short: checkpointing, the moments in host memory, the smallest micro-batch of >= 1024 rows (2 x 512)
    short = _plan(20.0)
    assert (short.gradient_checkpointing, short.micro_batch_size, short.optimizer_offload) == (True, 2, True)
    assert short.peak + short.reserve <= 20 * GIB and short.optimizer_state == 0
    assert short.optimizer_host == 8 * Q7.lora_params(32, ALL)
    assert short.gpu_memory_utilization == pytest.approx(20 / 80)
    assert [t.split(":")[0] for t in short.tried] == [
        "gc=false mb=8 copies=false offload=false", "gc=false mb=8 copies=false offload=true",
        "gc=false mb=4 copies=false offload=false", "gc=false mb=4 copies=false offload=true",
        "gc=true mb=2 copies=false offload=true"]
    # a peer kernel's weight copies are kept only where they fit
    copies = WeightBytes(stored=int(6 * GIB), kernel_derived=int(0.5 * GIB), extra_copies=int(4 * GIB))
    assert _plan(139.0, weights=copies).extra_weight_copies is True
    assert _plan(139.0, weights=copies).weights == int(10.5 * GIB)
    no_room = _plan(14.0, weights=copies)
    assert no_room.extra_weight_copies is False and no_room.weights == int(6.5 * GIB)
    # settings given explicitly are kept
    fixed = _plan(139.0, micro_batch_size=2, gradient_checkpointing=True, gpu_memory_utilization=0.4,
                  optimizer_offload=False)
    assert (fixed.micro_batch_size, fixed.gradient_checkpointing, fixed.gpu_memory_utilization) == (2, True, 0.4)
    assert fixed.optimizer_offload is False


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


# ---- Qwen2.5-72B NVFP4 LoRA r32 GRPO 1 x 8 x (256 + 1024) on one 80 GB card (issue 27) -----------------------
H100_GIB = 79.19  # torch.cuda.get_device_properties(...).total_memory of an 80 GB H100


def _cfg_72b(**kw):
    from qerl_cli.train.config import TrainConfig

    return TrainConfig(batch_prompts=1, num_generations=8, max_completion_length=1024, lora_rank=32, **kw)


def _plan_72b(cap_gib: float, **kw):
    from qerl_cli.bench.shapes import get_shape

    # off CUDA a cap plans for a GPU of that size (the CUDA kernels' data counted), enforcing nothing
    return plan_before_build(_cfg_72b(gpu_memory_gib=cap_gib, **kw), get_shape("qwen2.5-72b").config(), "nvfp4",
                             device="cpu", prompt_tokens=256)


def test_72b_default_settings_fit_an_80gb_card_under_60_gib() -> None:
    p = _plan_72b(H100_GIB)
    # packed FP4 + FP8 scales of 70.2 G linear weights (0.5625 B each), bf16 embeddings + lm_head (2 x 152064 x 8192),
    # norms and q/k/v biases; the kernels' 16-bit block scales (0.125 B per weight)
    linear = 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 29568 * 8192)
    assert linear == 70_212_648_960
    dense = 2 * 152064 * 8192 * 2 + (80 * (2 * 8192 + 10240) + 8192) * 2 + 128 * 4  # + the rotary buffers
    assert p.weight_parts.stored == linear * 9 // 16 + 80 * 7 * 4 + dense  # + each linear's FP32 global scale
    assert p.weight_parts.kernel_derived == linear // 8 + 80 * 10240 * 4  # + the CUDA kernel's fp32 q/k/v biases
    assert (p.micro_batch_size, p.gradient_checkpointing, p.optimizer_offload) == (1, True, True)
    assert p.kv_slots == 8 and p.optimizer_state == 0
    est = p.phase_estimates()
    assert set(est) == set(PHASES)
    assert max(est.values()) <= 60 * GIB and p.peak + p.reserve <= H100_GIB * GIB
    assert p.lora_params == 4 * 421_068_800  # LoRA r32 on all seven projections: 0.42 G parameters
    # a whole H200 takes the same memory-short settings: the card's size is not what the step needs
    assert _plan_72b(139.8).phase_estimates() == est
    # with a peer kernel's copies on offer (humming importable) the plan refuses them at this size
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.train.memory_plan import plan_for_config

    wb = weight_bytes(get_shape("qwen2.5-72b").config(), "nvfp4", 2, kernels=True)
    humming = WeightBytes(wb.stored, wb.kernel_derived, extra_copies=int((linear + 45.5e9) * 0.5625))
    p2 = plan_for_config(_cfg_72b(gpu_memory_gib=H100_GIB).resolved(), get_shape("qwen2.5-72b").config(),
                         weights=humming, device="cpu", prompt_tokens=256, elem=2)
    assert p2.extra_weight_copies is False and p2.phase_estimates() == est


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
    from qerl_cli.train.trainer import train

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
    assert planned_t.cfg.micro_batch_size == 8 and planned_t.cfg.gradient_checkpointing is False
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
    assert isinstance(t.optimizer, HostOffloadAdamW) and t.memory_plan.optimizer_offload is True
    assert ref[0]["loss"] != 0 and ref[1]["grad_norm"] > 0
    _same(ref, off, ref_p, off_p)
    for k in ref_p:  # bit for bit, not only to the tolerance _same allows
        assert torch.equal(ref_p[k], off_p[k]), k
