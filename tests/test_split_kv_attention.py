"""qerl's split-KV decode attention (kernels/decode_attention.py) under the Triton interpreter: equal to a torch
softmax over each row's live keys and to today's SDPA path, whatever the split; the split plan by hand; the engine's
`decode_attn=split` backend wired to it."""

from __future__ import annotations

import os

import pytest
import torch
from qerl_kernels import decode_attention as da

from qerl_cli.rollout.attention import DecodeAttention, sdpa_decode
from qerl_cli.rollout.model_runner import decode_mask

# compiled kernels where the GPU tests run them (TRITON_INTERPRET=0), the interpreter on CPU otherwise
DEV = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def _cache(slots: int, max_len: int, kvh: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, max_len, kvh, d, generator=g).to(DEV, dtype)
    v = torch.randn(slots, max_len, kvh, d, generator=g).to(DEV, dtype)
    return k, v, g


def test_split_plan_by_hand() -> None:
    """264 programs wanted: batch 8 x 4 KV heads over a 512 bucket (8 blocks of 64) -> 8 splits of one block;
    batch 256 needs no split; a 4096 bucket at batch 8 -> 9 splits wanted, 64 blocks cut into 8 of 8 blocks."""
    assert da.splits(8, 4, 512) == (8, 64)
    assert da.splits(256, 4, 512) == (1, 512)
    assert da.splits(8, 4, 4096) == (8, 512)
    assert da.splits(1, 1, 40) == (1, 64)  # one block, shorter than BLOCK_N


@pytest.mark.parametrize(("heads", "kvh", "d", "dtype"), [(14, 2, 64, torch.float32), (7, 1, 32, torch.bfloat16),
                                                           (4, 4, 16, torch.float16)])
def test_equals_softmax_over_live_keys(heads: int, kvh: int, d: int, dtype: torch.dtype) -> None:
    k, v, g = _cache(6, 384, kvh, d, dtype, 1)
    pos = torch.tensor([0, 63, 64, 200, 255], device=DEV)  # one key; a block's edge; the bucket's last position
    q = torch.randn(5, heads, d, generator=g).to(DEV, dtype)
    out = da.split_kv_decode(q, k, v, pos, 256, d**-0.5)
    ref = da.reference(q, k, v, pos, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.allclose(out[0].float(), v[0, 0].float().repeat_interleave(heads // kvh, 0), atol=tol, rtol=tol)
    # keys past a row's position do not count: poisoning them changes nothing
    k2, v2 = k.clone(), v.clone()
    for i, p in enumerate(pos.tolist()):
        k2[i, p + 1:] = 1e4
        v2[i, p + 1:] = float("nan")
    assert torch.equal(da.split_kv_decode(q, k2, v2, pos, 256, d**-0.5), out)


def test_same_result_for_any_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """One split per row or one per 64-key block (most of them empty for a short row): the merge gives the same."""
    k, v, g = _cache(3, 512, 2, 32, torch.float32, 2)
    pos = torch.tensor([5, 300, 511], device=DEV)
    q = torch.randn(3, 4, 32, generator=g).to(DEV)
    monkeypatch.setattr(da, "TARGET_PROGRAMS", 1)
    one = da.split_kv_decode(q, k, v, pos, 512, 0.2)
    monkeypatch.setattr(da, "TARGET_PROGRAMS", 10_000)
    assert da.splits(3, 2, 512) == (8, 64)
    many = da.split_kv_decode(q, k, v, pos, 512, 0.2)
    assert torch.allclose(one, many, atol=1e-6, rtol=1e-6)
    assert torch.allclose(one, da.reference(q, k, v, pos, 0.2), atol=1e-5, rtol=1e-5)


def test_engine_backend_matches_sdpa() -> None:
    """`decode_attn=split` in the runner's DecodeAttention: what today's SDPA path returns for the step's mask."""
    k, v, g = _cache(4, 256, 2, 64, torch.float32, 3)
    pos = torch.tensor([3, 100, 127, 64], device=DEV)
    q = torch.randn(4, 8, 64, generator=g).to(DEV)
    att = DecodeAttention(num_heads=8, num_kv_heads=2, head_dim=64, scale=0.125, max_len=256, dtype=torch.float32,
                          device=DEV, backend="split")
    assert att.backend == "split" and not att.needs_host_positions
    got = att(q, k, v, 128, None, pos)
    want = sdpa_decode(q, k, v, 128, decode_mask(pos, 128, torch.float32), 0.125)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEV.type == "cuda", reason="the CUDA engine's split backend: tests/test_rollout_cuda.py")
def test_engine_greedy_tokens_equal_sdpa_on_cpu(use_options, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The builtin engine on CPU (the Triton interpreter runs the split kernels): a tiny fp32 Llama's greedy tokens
    and log-probs with `decode_attn=split` are today's SDPA engine's, and the split kernels really ran."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from tests.helpers import random_decoder

    model = random_decoder(LlamaConfig, LlamaForCausalLM, vocab_size=97, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=128, tie_word_embeddings=False)
    prompts = [[5, 17, 3], [9, 9, 40, 2, 77, 13, 8], [60]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
    want = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64).generate(prompts, greedy).samples
    use_options(decode_attn="split")
    calls = []
    run_split = da.split_kv_decode
    monkeypatch.setattr(da, "split_kv_decode", lambda *a, **k: calls.append(a[3].tolist()) or run_split(*a, **k))
    engine = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64)
    got = engine.generate(prompts, greedy).samples
    assert engine.runner.attention.backend == "split"
    assert len(calls) >= 2 * 7  # two layers per decode step, seven steps after the prefill's token
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_auto_is_sdpa_off_cuda() -> None:
    """The default (`auto`) never runs the split kernels in the interpreter: SDPA on a CPU engine."""
    att = DecodeAttention(num_heads=8, num_kv_heads=2, head_dim=64, scale=0.125, max_len=256, dtype=torch.float32,
                          device=torch.device("cpu"), backend="auto")
    assert att.backend == att.current == "sdpa" and not att.needs_host_positions


@pytest.mark.skipif(DEV.type != "cuda", reason="CUDA")
def test_auto_is_split_on_cuda_without_flashinfer() -> None:
    """`auto` on CUDA: the split kernels, with no host plan where FlashInfer is absent (timed against it when not)."""
    import importlib.util

    att = DecodeAttention(num_heads=8, num_kv_heads=2, head_dim=128, scale=0.125, max_len=256, dtype=torch.bfloat16,
                          device=DEV, backend="auto")
    assert att.current == "split"
    assert att.backend == ("auto" if importlib.util.find_spec("flashinfer") else "split")
