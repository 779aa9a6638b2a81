"""QERL_KV_CACHE=fp8: the builtin engine's K/V stored as E4M3 (rollout/kv_cache.py). The dtype decision and the bytes
it saves, the split-KV kernel (Triton interpreter) and SDPA reading an E4M3 cache exactly as its widened values, the
torch write path rounding and saturating as torch's cast does, and the engine on CPU: an E4M3 cache whose rows are
the bf16 engine's rows rounded, and decoding that follows from them."""

from __future__ import annotations

import pytest
import torch
from qerl_kernels import decode_attention as da

from qerl_cli.rollout.attention import sdpa_decode
from qerl_cli.rollout.kv_cache import FP8_KV, CacheShape, cache_dtype, kv_elem
from qerl_cli.rollout.model_runner import decode_mask


def test_the_option_decides_dtype_and_bytes(use_options) -> None:  # noqa: ANN001
    assert cache_dtype(torch.bfloat16, "auto") is torch.bfloat16 and cache_dtype(torch.float16, "fp8") is FP8_KV
    bf16 = CacheShape(num_layers=2, num_kv_heads=4, head_dim=64, max_len=128, dtype=torch.bfloat16)
    fp8 = CacheShape(num_layers=2, num_kv_heads=4, head_dim=64, max_len=128, dtype=FP8_KV)
    assert bf16.bytes_per_slot() == 2 * 2 * 4 * 64 * 2 * 128 == 2 * fp8.bytes_per_slot()
    assert kv_elem(2) == 2
    use_options(kv_cache="fp8")
    assert kv_elem(2) == 1 and kv_elem(4) == 1


def test_torch_cast_rounds_and_saturates() -> None:
    """What every write path relies on: E4M3 round-to-nearest-even, +-448 for anything beyond, 0 under 2**-10."""
    x = torch.tensor([500.0, -1000.0, 0.3, 1.0625, 1.1875, 2**-11], dtype=torch.bfloat16)
    assert x.to(FP8_KV).float().tolist() == [448.0, -448.0, 0.3125, 1.0, 1.25, 0.0]


def _fp8_cache(slots: int, max_len: int, kvh: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = (3 * torch.randn(slots, max_len, kvh, d, generator=g)).to(FP8_KV)
    v = torch.randn(slots, max_len, kvh, d, generator=g).to(FP8_KV)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kernel_reads_an_fp8_cache_as_its_widened_values(dtype: torch.dtype) -> None:
    k8, v8 = _fp8_cache(4, 256, 2, 32, 1)
    pos = torch.tensor([0, 63, 200, 255])
    q = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = da.split_kv_decode(q, k8, v8, pos, 256, 32**-0.5)
    want = da.split_kv_decode(q, k8.to(dtype), v8.to(dtype), pos, 256, 32**-0.5)
    assert got.dtype == dtype
    assert torch.equal(got, want)  # widening on load is exact: the same kernel math on the same values
    ref = da.reference(q, k8, v8, pos, 32**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)


def test_sdpa_path_widens_an_fp8_cache() -> None:
    k8, v8 = _fp8_cache(3, 128, 2, 16, 3)
    pos = torch.tensor([5, 64, 127])
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(4))
    mask = decode_mask(pos, 128, torch.float32)
    got = sdpa_decode(q, k8, v8, 128, mask, 0.25)
    assert torch.equal(got, sdpa_decode(q, k8.float(), v8.float(), 128, mask, 0.25))


def test_engine_on_cpu_keeps_its_rows_as_e4m3(use_options) -> None:  # noqa: ANN001
    """A tiny fp32 Llama: with QERL_KV_CACHE=fp8 the cache is E4M3, the prompt's K/V rows are exactly the auto
    engine's rows rounded (the prefill does not read the cache), the first token (from the prefill) is the same, and
    the rest decode from the rounded rows with finite log-probs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from tests.helpers import random_decoder

    model = random_decoder(LlamaConfig, LlamaForCausalLM, vocab_size=97, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=128, tie_word_embeddings=False)
    prompt = [[5, 17, 3, 9, 40, 2, 77]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[])
    plain = BuiltinEngine(model, None, max_batch_slots=1, max_model_len=64)
    want = plain.generate(prompt, greedy).samples[0]
    use_options(kv_cache="fp8")
    engine = BuiltinEngine(model, None, max_batch_slots=1, max_model_len=64)
    got = engine.generate(prompt, greedy).samples[0]
    ck, pk = engine.runner.cache.k, plain.runner.cache.k
    assert ck.dtype == FP8_KV and pk.dtype == torch.float32
    n = len(prompt[0])
    assert torch.equal(ck[:, 0, :n].float(), pk[:, 0, :n].to(FP8_KV).float())
    assert torch.equal(engine.runner.cache.v[:, 0, :n].float(), plain.runner.cache.v[:, 0, :n].to(FP8_KV).float())
    assert got.token_ids[0] == want.token_ids[0] and len(got.token_ids) == 6
    assert torch.isfinite(got.logprobs).all()
