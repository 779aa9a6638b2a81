"""The MoE routing's padded block layout in one Triton launch (``qerl_kernels.moe.align_blocks_triton``) against
torch's (``align_blocks_torch``, the reference) under the Triton interpreter: exactly equal rows, block experts and
padded-slot counts for random, one-sided, sparse and top-k routings at the block rows qerl and humming use.
The CUDA path (and its CUDA-graph replay) is tests/test_moe_cuda.py's."""

from __future__ import annotations

import pytest
import torch
from qerl_kernels.moe import (
    ALIGN_MAX_EXPERTS,
    ALIGN_MAX_WORK,
    align_blocks,
    align_blocks_torch,
    align_blocks_triton,
    align_fits,
    indexed_layout,
)


def _same(ids: torch.Tensor, num_experts: int, block_m: int, spare_blocks: int) -> None:
    rows, bexp, padded = align_blocks_triton(ids, num_experts, block_m, spare_blocks)
    ref_rows, ref_bexp = align_blocks_torch(ids, num_experts, block_m, spare_blocks)
    assert rows.dtype == bexp.dtype == padded.dtype == torch.int32
    assert torch.equal(rows, ref_rows), (ids.tolist(), num_experts, block_m, spare_blocks)
    assert torch.equal(bexp, ref_bexp), (ids.tolist(), num_experts, block_m, spare_blocks)
    assert padded.shape == (1,) and padded.item() == int((ref_bexp < num_experts).sum()) * block_m


def test_a_hand_laid_routing() -> None:
    """E=3, 4 rows per block, assignments 0..5 on experts 2 0 2 2 1 0."""
    ids = torch.tensor([2, 0, 2, 2, 1, 0])
    rows, bexp, padded = align_blocks_triton(ids, 3, block_m=4, spare_blocks=1)
    # expert 0: assignments 1, 5; expert 1: 4; expert 2: 0, 2, 3; each run padded with 6 (= M) to 4 slots; then
    # cdiv(6, 4) + min(3, 6) = 5 blocks any routing may need, + 1 spare, the rest all padding
    assert rows.tolist() == [1, 5, 6, 6, 4, 6, 6, 6, 0, 2, 3, 6] + [6] * 12
    # a block past the last run names expert 3 (= E), as torch.searchsorted(pend, start, right=True) does
    assert bexp.tolist() == [0, 1, 2, 3, 3, 3]
    assert padded.tolist() == [12]
    assert torch.equal(rows, align_blocks_torch(ids, 3, 4, 1)[0])


@pytest.mark.parametrize("num_experts", [4, 8, 60, 128])
def test_random_routings_equal_torch(num_experts: int) -> None:
    g = torch.Generator().manual_seed(num_experts)
    for m in (1, 3, 8, 64, 512, 2048):
        for block_m in (8, 16, 64):
            for spare in (0, 1):
                _same(torch.randint(0, num_experts, (m,), generator=g), num_experts, block_m, spare)


@pytest.mark.parametrize("num_experts", [4, 60, 128])
def test_one_sided_and_sparse_routings_equal_torch(num_experts: int) -> None:
    """Every assignment on one expert (the first, a middle one, the last); only two experts hit, most with no rows."""
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 64, 512):
        for e in (0, num_experts // 2, num_experts - 1):
            _same(torch.full((m,), e), num_experts, 16, 1)
        two = torch.tensor([1, num_experts - 1])[torch.randint(0, 2, (m,), generator=g)]
        for block_m in (8, 64):
            _same(two, num_experts, block_m, 0)


@pytest.mark.parametrize(("tokens", "top_k", "num_experts"), [(1, 8, 128), (64, 8, 128), (7, 4, 60), (33, 2, 8),
                                                              (256, 8, 128)])
def test_top_k_routings_equal_torch(tokens: int, top_k: int, num_experts: int) -> None:
    """The router's shape: each token's k distinct experts, [T, k] int64 as topk gives them (flattened inside)."""
    g = torch.Generator().manual_seed(tokens)
    index = torch.rand(tokens, num_experts, generator=g).topk(top_k, -1).indices
    for block_m in (8, 16, 64):
        _same(index, num_experts, block_m, 1)
    # int32 ids, a strided view and the default block rows give the same layout too
    assert torch.equal(align_blocks_triton(index.int(), num_experts)[0], align_blocks_torch(index, num_experts)[0])
    strided = index.reshape(-1)[::2]
    assert torch.equal(align_blocks_triton(strided, num_experts)[0], align_blocks_torch(strided, num_experts)[0])


def test_indexed_layout_counts_the_padded_slots() -> None:
    """humming's layout: the same slots, one spare block, and the padded count from the same launch."""
    g = torch.Generator().manual_seed(2)
    for tokens, block_m in ((1, 8), (64, 16), (64, 32), (200, 64)):
        index = torch.rand(tokens, 128, generator=g).topk(8, -1).indices
        ref = indexed_layout(index, 128, block_m)  # CPU: the torch path with its own count
        got = align_blocks_triton(index, 128, block_m, spare_blocks=1)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_empty_routing_and_ids_out_of_range() -> None:
    rows, bexp, padded = align_blocks_triton(torch.zeros(0, dtype=torch.long), 8, 16, spare_blocks=1)
    assert rows.tolist() == [0] * 16 and bexp.tolist() == [8] and padded.tolist() == [0]
    # an id outside 0..E-1 gets no slot (torch's path would fail a device assert): the others are laid out as usual
    rows, bexp, padded = align_blocks_triton(torch.tensor([0, 5, 1, -1, 0]), 3, 4)
    assert rows.tolist()[:8] == [0, 4, 5, 5, 2, 5, 5, 5] and bexp.tolist()[:3] == [0, 1, 3] and padded.item() == 8


def test_the_triton_path_is_taken_on_cuda_within_its_limits(use_options) -> None:  # noqa: ANN001
    assert align_fits(512, 128) and align_fits(8192, 128) and align_fits(4096, 256) and align_fits(1, 1)
    assert not align_fits(8193, 128) and not align_fits(16, ALIGN_MAX_EXPERTS + 1) and not align_fits(1, 0)
    assert align_fits(ALIGN_MAX_WORK // 16, 4)  # few experts: 16 lanes at least
    # off CUDA align_blocks is torch's, whatever the option says
    ids = torch.tensor([3, 0, 3, 1, 0, 3])
    use_options(moe_align="triton")
    assert all(torch.equal(a, b) for a, b in zip(align_blocks(ids, 4, 4), align_blocks_torch(ids, 4, 4), strict=True))


@pytest.mark.parametrize("num_experts", [4, 60, 128])
def test_two_layouts_in_one_launch_equal_two_torch_layouts(num_experts: int) -> None:
    """`align_layouts` with (16 rows, no spare) and (8 rows, one spare: humming's indexed layout) in one launch:
    each layout exactly torch's at its own rows, as two separate launches would give."""
    from qerl_kernels.moe import align_layouts, routing_layouts

    g = torch.Generator().manual_seed(7)
    for m in (1, 5, 64, 512, 2048):
        ids = torch.randint(0, num_experts, (m,), generator=g)
        for specs in (((16, 0), (8, 1)), ((64, 0), (8, 1)), ((8, 1), (16, 0))):
            got = align_layouts(ids, num_experts, specs)
            for (block_m, spare), (rows, bexp, padded) in zip(specs, got, strict=True):
                ref_rows, ref_bexp = align_blocks_torch(ids, num_experts, block_m, spare)
                assert torch.equal(rows, ref_rows) and torch.equal(bexp, ref_bexp), (m, specs)
                assert padded.item() == int((ref_bexp < num_experts).sum()) * block_m
    with pytest.raises(ValueError, match="one or two"):
        align_layouts(ids, num_experts, ((8, 0), (16, 0), (64, 0)))
    # off CUDA the routing keeps torch's layout and leaves the peer's to be made where it is needed
    rows, bexp, peer = routing_layouts(ids, num_experts, 8)
    assert peer is None and torch.equal(rows, align_blocks_torch(ids, num_experts)[0])


def test_empty_routing_gives_two_empty_layouts() -> None:
    from qerl_kernels.moe import align_layouts

    (r1, b1, n1), (r2, b2, n2) = align_layouts(torch.zeros(0, dtype=torch.int64), 8, ((16, 0), (8, 1)))
    assert n1.item() == n2.item() == 0 and (b1 == 8).all() and (b2 == 8).all() and b2.numel() == b1.numel() + 1
