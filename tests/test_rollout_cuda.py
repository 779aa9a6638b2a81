"""The builtin rollout engine on CUDA: CUDA-graph decode equals eager decode and transformers.

Skipped without a GPU (CI has none); run on a GPU machine with ``pytest tests/test_rollout_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from qerl_cli.rollout import BuiltinEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 77, 13, 8], [60], list(range(1, 40)), [300, 301, 302, 303, 304]]


def random_model(kind: str, dtype: torch.dtype) -> nn.Module:
    common = dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.08,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, tie_word_embeddings=False, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model.to("cuda", dtype).eval()


def hf_greedy(model: nn.Module, ids: list[int], new: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids], device="cuda"),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
        do_sample=False,
        max_new_tokens=new,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def run(engine: BuiltinEngine, sampling: SamplingParams, prompts: list[list[int]] | None = None,
        **kw) -> tuple[list[list[int]], list[torch.Tensor]]:
    result = engine.generate(prompts or PROMPTS, sampling, **kw)
    return [s.token_ids for s in result.samples], [s.logprobs for s in result.samples]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graph_decode_equals_eager_and_transformers(kind: str) -> None:
    model = random_model(kind, torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])
    graphs = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=256, gpu_memory_utilization=0.9)
    eager = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=256, cuda_graphs=False)
    assert graphs.use_graphs and not eager.use_graphs
    g_tokens, g_lps = run(graphs, greedy)
    assert graphs._graphs is not None and graphs._graphs.graphs  # decode really replayed graphs
    e_tokens, e_lps = run(eager, greedy)
    assert g_tokens == e_tokens
    for ids, tokens in zip(PROMPTS, g_tokens, strict=True):
        assert tokens == hf_greedy(model, ids, 24)
    for a, b in zip(g_lps, e_lps, strict=True):
        assert torch.allclose(a, b, atol=1e-4)

    sampled = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=20, seed=5, stop_token_ids=[7])
    g_tokens, _ = run(graphs, sampled)
    e_tokens, _ = run(eager, sampled)
    assert g_tokens == e_tokens
    # After release() the cache has a new address: graphs must be recaptured, results unchanged.
    graphs.release()
    assert run(graphs, sampled)[0] == g_tokens


def test_graphs_see_norm_swaps_and_overrides() -> None:
    model = random_model("qwen3", torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    graphs = BuiltinEngine(model, None, max_batch_slots=4, max_model_len=128)
    eager = BuiltinEngine(model, None, max_batch_slots=4, max_model_len=128, cuda_graphs=False)
    base = run(graphs, greedy)[0]
    norm = model.model.layers[1].post_attention_layernorm
    noisy = norm.weight.detach() + 0.5 * torch.randn_like(norm.weight)
    overrides = {"model.layers.1.post_attention_layernorm": noisy}
    over = run(graphs, greedy, norm_overrides=overrides)[0]
    assert over == run(eager, greedy, norm_overrides=overrides)[0]
    assert over != base
    original = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.copy_(noisy)
    assert run(graphs, greedy)[0] == over  # in-place swap seen by the captured graphs
    with torch.no_grad():
        norm.weight.copy_(original)
    assert run(graphs, greedy)[0] == base


def lora_graph_and_eager_engines():  # noqa: ANN201 - (peft model, greedy params, graph engine, eager engine)
    """A bf16 random Llama with a non-zero LoRA, and the CUDA-graph and eager engines over it (also used by
    scripts/rollout_tie_check.py)."""
    from peft import LoraConfig, get_peft_model

    model = random_model("llama", torch.bfloat16)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    graphs = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=128)
    eager = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=128, cuda_graphs=False)
    return peft_model, greedy, graphs, eager


def test_graphs_follow_lora_toggles_and_bf16() -> None:
    peft_model, greedy, graphs, eager = lora_graph_and_eager_engines()
    # 8 prompts = a graph batch bucket, so both engines run the same GEMM shapes (bf16 rounding depends on M).
    # On an H200 (2026-11-24, scripts/rollout_tie_check.py) greedy runs parted at fp32 logit gaps of 0.017 and
    # 0.021 (near-ties), with fused projections on and off alike, and with 8 prompts too, until the fused
    # RoPE/KV-write first-use check stopped leaving torch-rounded K/V rows in the eager engine's cache.
    prompts = PROMPTS + [[7, 8, 9], [400, 12], [33] * 6]
    with_lora = run(graphs, greedy, prompts=prompts)[0]
    with peft_model.disable_adapter():
        without = run(graphs, greedy, prompts=prompts)[0]
        assert without == run(eager, greedy, prompts=prompts)[0]
    assert without != with_lora
    assert run(graphs, greedy, prompts=prompts)[0] == with_lora == run(eager, greedy, prompts=prompts)[0]


def test_fast_decode_path_on_cuda(monkeypatch) -> None:
    """The fused Triton kernels build, pass their first-use check and, with LoRA shadows, give the module
    path's greedy tokens (fp32) inside CUDA graphs; QERL_FAST_DECODE=0 turns the whole path off."""
    from peft import LoraConfig, get_peft_model
    from qerl_kernels import decode as decode_kernels

    model = random_model("qwen3", torch.float32)
    lora = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])
    before = sum(decode_kernels.LAUNCHES.values())
    fast = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=256)
    f_tokens, f_lps = run(fast, greedy)
    assert fast.runner.ops.triton and all(fast.runner.ops.enabled.values()), fast.runner.ops.enabled
    assert sum(decode_kernels.LAUNCHES.values()) > before and fast._graphs is not None and fast._graphs.graphs
    slow = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=256, fast_lora=False,
                         fused_kernels=False)
    s_tokens, s_lps = run(slow, greedy)
    assert f_tokens == s_tokens
    for a, b in zip(f_lps, s_lps, strict=True):
        assert torch.allclose(a, b, atol=1e-4)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5, stop_token_ids=[])
    assert run(fast, sampled)[0] == run(slow, sampled)[0]
    assert fast.noise.fused  # the Triton sampling noise passed its bit-exact first-use check
    monkeypatch.setenv("QERL_FAST_DECODE", "0")
    off = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=256)
    assert not off.runner.fast_lora and not off.runner.ops.triton and not off.noise.fused
    assert run(off, greedy)[0] == s_tokens
