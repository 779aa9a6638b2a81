"""The decode attention backends' data layout (qerl_cli/rollout/attention.py) on the CPU.

FlashInfer cannot run here; what qerl hands it can be checked: the paged view of qerl's KV cache and the
per-step page table (indptr / indices / last_page_len). ``paged_decode_reference`` computes, in torch, what
FlashInfer's batch decode computes from exactly those arguments, and must equal the SDPA path the engine runs
today (bucketed KV length, additive mask, GQA folded onto SDPA's query axis)."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.rollout.attention import (
    FLASHINFER_HEAD_DIMS,
    PAGE_SIZE,
    cache_pages,
    flashinfer_tensor_cores,
    paged_decode_reference,
    paged_layout,
    sdpa_decode,
)
from qerl_cli.rollout.model_runner import decode_mask


def test_paged_layout_by_hand() -> None:
    """Slots of 64 positions, pages of 16 (4 per slot): lengths 1, 16, 17 and 64."""
    indptr, indices, last = paged_layout([1, 16, 17, 64], max_len=64, page_size=16)
    assert indptr.tolist() == [0, 1, 2, 4, 8]
    assert indices.tolist() == [0, 4, 8, 9, 12, 13, 14, 15]
    assert last.tolist() == [1, 16, 1, 16]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    with pytest.raises(ValueError):
        paged_layout([0], max_len=64)
    with pytest.raises(ValueError):
        paged_layout([65], max_len=64)


def test_cache_pages_is_a_view_with_the_slot_positions_where_the_table_says() -> None:
    slots, max_len, kvh, d = 3, 64, 2, 4
    cache = torch.randn(slots, max_len, kvh, d)
    pages = cache_pages(cache)
    assert pages.data_ptr() == cache.data_ptr() and pages.shape == (slots * max_len // PAGE_SIZE, PAGE_SIZE, kvh, d)
    for b, p in ((0, 0), (1, 17), (2, 63)):
        assert torch.equal(pages[b * (max_len // PAGE_SIZE) + p // PAGE_SIZE, p % PAGE_SIZE], cache[b, p])
    with pytest.raises(ValueError):
        cache_pages(torch.zeros(2, 40, kvh, d))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (7, 1), (3, 3)])
def test_flashinfer_arguments_attend_what_sdpa_attends(heads: int, kv_heads: int) -> None:
    """Rows at positions 0, 15, 16, 40 and 63 of a 64-position cache (pages of 16; a KV bucket of 64 for SDPA),
    NaN-free garbage past each row's position: the page table handed to FlashInfer selects exactly the keys
    SDPA's mask keeps."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    slots, max_len, d = 6, 64, 8
    k_cache = torch.randn(slots, max_len, kv_heads, d, generator=g)
    v_cache = torch.randn(slots, max_len, kv_heads, d, generator=g)
    positions = torch.tensor([0, 15, 16, 40, 63])
    b = positions.numel()
    q = torch.randn(b, heads, d, generator=g)
    scale = d**-0.5
    want = sdpa_decode(q, k_cache, v_cache, max_len, decode_mask(positions, max_len, torch.float32), scale)
    indptr, indices, last = paged_layout((positions + 1).tolist(), max_len)
    got = paged_decode_reference(q, cache_pages(k_cache), cache_pages(v_cache), indptr, indices, last, scale)
    assert (got - want).abs().max().item() < 1e-5
    # a wrong page table (one page too few for the row at 16) changes that row only
    indptr = torch.tensor([0, 1, 2, 3, 6, 10])
    indices = torch.tensor([0, 4, 8, 12, 13, 14, 16, 17, 18, 19])
    short = paged_decode_reference(q, cache_pages(k_cache), cache_pages(v_cache), indptr, indices,
                                   torch.tensor([1, 16, 16, 9, 16]), scale)
    assert (short[2] - want[2]).abs().max().item() > 1e-3
    assert (short[[0, 1]] - want[[0, 1]]).abs().max().item() < 1e-5


def test_flashinfer_is_asked_only_for_head_sizes_it_takes(caplog) -> None:
    """head_dim 32 failed inside FlashInfer on the GPU (both decode paths): such a model gets SDPA with one line
    that says why, before any import is tried; tensor cores from GQA group 4 (the 7B's 7, the 32B's 5)."""
    from qerl_cli.rollout.attention import DecodeAttention

    with caplog.at_level("WARNING", logger="qerl.rollout"):
        att = DecodeAttention(num_heads=8, num_kv_heads=2, head_dim=32, scale=0.2, max_len=64, dtype=torch.float32,
                              device=torch.device("cpu"), backend="flashinfer")
    assert att.backend == "sdpa" and att.current == "sdpa"
    assert [r.message for r in caplog.records if "head_dim" in r.message] == [
        "FlashInfer decode takes head_dim 64/128/256 only, this model has 32; decode attention uses SDPA"]
    assert 128 in FLASHINFER_HEAD_DIMS and 32 not in FLASHINFER_HEAD_DIMS
    assert flashinfer_tensor_cores(7) and flashinfer_tensor_cores(5) and flashinfer_tensor_cores(4)
    assert not any(flashinfer_tensor_cores(g) for g in (1, 2, 3))
