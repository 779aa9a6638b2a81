"""The persistent decode kernels inside the builtin engine on CUDA (Hopper): with both halves on, a LoRA model's
greedy decode equals the per-GEMM path's up to near-ties, for NVFP4 and for INT4 (whose per-GEMM path dequantizes
each weight per call), with log-probs within bf16 tolerance, and the kernels really ran. Skipped without an sm_90
GPU (CI has none): `scripts/gpu.sh gputests` with QERL_GPU_TESTS=tests/test_decode_layer_cuda.py."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.bench.shapes import ModelShape, build_random_model
from qerl_cli.rollout import BuiltinEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU")

PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 77, 13, 8], [60], list(range(1, 40)), [300, 301, 302, 303, 304]]
# Qwen2 (q/k/v bias), hidden 256 = 8 heads x 32, 2 KV heads, intermediate 512: every K a multiple of 128
SHAPE = ModelShape("decode-layer-test", "qwen2", 256, 512, 2, 8, 2, 1000, False, max_positions=1024,
                   rope_theta=10000.0)


def _engine(model: torch.nn.Module) -> BuiltinEngine:
    return BuiltinEngine(model, None, max_batch_slots=8, max_model_len=256)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4", "int8"])
def test_engine_decode_with_both_halves_equals_the_per_gemm_path(use_options, fmt: str) -> None:  # noqa: ANN001
    from qerl_kernels import decode_layer

    from qerl_cli.lora import attach_lora, make_lora_config

    model = build_random_model(SHAPE, fmt, "cuda", dtype=torch.bfloat16, seed=3)
    peft_model = attach_lora(model, make_lora_config(rank=8), seed=0).eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():  # B != 0, so that the LoRA terms count
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=gen)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])
    use_options(fused_lora=True, fast_decode=True, decode_layer=True, decode_layer_attn="1")
    fast = _engine(peft_model)
    result = fast.generate(PROMPTS, greedy)
    runner = fast.runner
    assert runner.decode_layer and runner.decode_layer_attn
    assert all(a is not None for a in runner._mlp_args.values()) and len(runner._mlp_args) == SHAPE.layers
    assert len(runner._attn_args) == SHAPE.layers  # the attention half takes the 4-bit formats
    assert all((a is not None) == (fmt != "int8") for a in runner._attn_args.values())
    assert {a[0].fmt for a in runner._mlp_args.values()} == {fmt}
    assert decode_layer.engine_max_m(fmt) >= len(PROMPTS)  # every decode step of this batch ran the kernels
    use_options(decode_layer=False, decode_layer_attn="0")
    slow = _engine(peft_model)
    base = slow.generate(PROMPTS, greedy)
    assert not slow.runner._mlp_args and not slow.runner._attn_args
    for i, (a, b) in enumerate(zip(result.samples, base.samples, strict=True)):
        ta, tb = a.token_ids, b.token_ids
        step = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        assert torch.allclose(a.logprobs[:step].float(), b.logprobs[:step].float(), atol=5e-2)
        if step < len(ta):
            # the paths sum in different orders, so bf16 greedy may part at a near-tie: the two choices' logits (the
            # model's own forward on the shared prefix) must be within bf16 rounding of each other, where a wiring
            # bug (a wrong weight, layer or cache row) parts at once and by far
            ids = torch.tensor([PROMPTS[i] + tb[:step]], device="cuda")
            with torch.no_grad():
                logits = peft_model(input_ids=ids).logits[0, -1].float()
            gap = abs(logits[ta[step]] - logits[tb[step]]).item()
            assert gap < 0.1, (i, step, gap, logits.topk(3))
