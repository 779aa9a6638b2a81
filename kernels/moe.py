"""Grouped GEMMs for mixture-of-experts layers: every expert's rows of one projection in one launch.

A token routed to k experts makes k assignments; assignment ``a`` is token ``a // k`` and its expert is
``expert_ids[a]``. ``align_blocks`` sorts the assignments by expert and pads each expert's run to a multiple of
``block_rows(M)`` rows, all in fixed-size device tensors (no host sync, so a CUDA graph can hold it): ``rows`` names
the assignment in each padded slot (``M`` for padding) and ``block_expert`` the expert of each block of those
slots (``num_experts`` for the unused blocks at the end, which return at once). ``grouped_linear`` runs one program
per (block, N tile): it reads the block's activation rows by index (``rows // x_div``: the token for the first
projection, the assignment itself for the second), streams that expert's weight tile (dense, or NVFP4/MXFP4 in the
checkpoint's byte order through ``fp4.fp4_tile``) and writes its outputs in assignment order. An optional LoRA
expand ``h[a] @ B_e^T`` (h from a dense grouped call with N = rank) is added in the epilogue, so the adapter costs
one small launch and no pass over the output.

The backward runs on the same layout: ``grouped_linear_t`` is the transpose (``dx[a] = dy[a] @ W_e``, one program
per (block, K tile) reducing over N through the same weight tiles, a LoRA ``u[a] @ A_e`` in the epilogue) and
``segment_outer`` the per-expert sums ``sum_a L[a]^T R[a]`` over each expert's blocks in order (the LoRA factors'
gradients), both deterministic: every output tile has one program and one summation order, no atomics.

Weights: dense ``[E, N, K]``; FP4 ``packed [E, N, K/2]`` uint8 (element 2j in the low nibble), ``scale [E, N, K/G]``
(E4M3 for NVFP4, E8M0 for MXFP4), NVFP4's ``global_scale [E]`` float32. Accumulation is fp32; under the
interpreter everything is fp32 (see ``_common``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl_kernels._common import INTERPRET, f32_path
from qerl_kernels.fp4 import NVFP4_F, e2m1_lut, fp4_tile, launch_fp4
from qerl_kernels.options import kernel_options

DENSE, NVFP4, MXFP4 = 0, 1, 2
BLOCK_M = 16
LARGE_BLOCK_M = 64  # from LARGE_M assignments on: an expert's weight tile is read once per block of rows
LARGE_M = 4096
KINDS = {"dense": DENSE, "nvfp4": NVFP4, "mxfp4": MXFP4}


def block_rows(assignments: int) -> int:
    """Rows per block: 16 at decode sizes (a few rows per expert, little padding), 64 for prefill and training."""
    return LARGE_BLOCK_M if assignments >= LARGE_M else BLOCK_M


def num_blocks(assignments: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Blocks of ``block_m`` rows that any routing of ``assignments`` rows can need: every expert that is hit pads
    its run by fewer than ``block_m`` rows, and at most ``min(E, M)`` experts are hit."""
    return triton.cdiv(assignments, block_m) + min(num_experts, assignments)


def align_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int | None = None,
                 spare_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int32 [blocks * block_m], block_expert int32 [blocks]) for assignments routed to ``expert_ids``;
    ``block_m`` default: ``block_rows``; ``spare_blocks`` more unused blocks at the end (all padding). One Triton
    launch on CUDA (:func:`align_blocks_triton`, within :func:`align_fits`), else :func:`align_blocks_torch`."""
    if _align_on_triton(expert_ids, num_experts):
        rows, block_expert, _ = align_blocks_triton(expert_ids, num_experts, block_m, spare_blocks)
        return rows, block_expert
    return align_blocks_torch(expert_ids, num_experts, block_m, spare_blocks)


def align_blocks_torch(expert_ids: torch.Tensor, num_experts: int, block_m: int | None = None,
                       spare_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align_blocks` in torch (~12 launches: histogram, scans, a stable sort, gathers, a scatter, a search):
    the reference, and the path off CUDA and past the Triton kernel's limits."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    m, dev = flat.numel(), flat.device
    block_m = block_m or block_rows(m)
    blocks = num_blocks(m, num_experts, block_m) + spare_blocks
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    first = torch.cumsum(counts, 0) - counts
    dest = (pend - padded)[sorted_e] + torch.arange(m, device=dev) - first[sorted_e]
    rows = torch.full((blocks * block_m,), m, dtype=torch.int32, device=dev)
    rows.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(blocks, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(pend, starts, right=True).to(torch.int32)
    return rows, block_expert


# ---- the layout in one launch ------------------------------------------------------------------------------------
# At decode the torch layout is ~12 tiny launches twice per MoE layer (qerl's block rows and humming's): most of the
# ~7 ms of routing bookkeeping in a 24.5 ms Qwen3-30B-A3B step at batch 64 on an H200 (its stable radix sort alone
# ~2.5 ms). One program does it all: the routing is a few hundred assignments, so one CTA looping over them in chunks
# beats a grid plus the launches.
# The serial chunk loop grows with assignments x experts, so past ALIGN_MAX_WORK (prefill, training, where the
# GEMMs dwarf the layout) torch's bandwidth-parallel kernels take over again.
ALIGN_TILE = 16384  # elements of the [chunk, expert lanes] one-hot tile: 32 int32 per thread at ALIGN_WARPS
ALIGN_WARPS = 16
ALIGN_MAX_EXPERTS = 1024  # the tile still holds 16 assignments per chunk
# assignments x expert lanes: <= 64 chunks per pass (8,192 assignments at 128 experts, 4,096 at 256); a guess at
# the crossover from ~1 us per chunk on one SM against torch's ~12 launches, to be measured on the H200
ALIGN_MAX_WORK = 1 << 20


def _expert_lanes(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


def align_fits(assignments: int, num_experts: int) -> bool:
    """Whether :func:`align_blocks_triton` takes this size on CUDA (registers do not grow with the assignments,
    only the serial chunk loop does; see ``ALIGN_MAX_WORK``)."""
    return 0 < num_experts <= ALIGN_MAX_EXPERTS and assignments * _expert_lanes(num_experts) <= ALIGN_MAX_WORK


def _align_on_triton(expert_ids: torch.Tensor, num_experts: int) -> bool:
    return (expert_ids.is_cuda and kernel_options().moe_align == "triton"
            and align_fits(expert_ids.numel(), num_experts))


@triton.jit
def _layout_runs(counts, lane_ok, rows_ptr, bexp_ptr, ntp_ptr, M, BLOCK_M, SLOTS, BLOCKS, CB: tl.constexpr,
                 FILL: tl.constexpr):
    """One layout from the experts' counts: every slot set to padding (the sentinel M; the caller's barrier orders
    these stores before the scatter that overwrites the slots in use, which two threads of one CTA may share), the
    padded slots in use, each block's expert; returns each expert's first slot."""
    for s0 in range(0, SLOTS, FILL):
        s = s0 + tl.arange(0, FILL)
        tl.store(rows_ptr + s, tl.zeros([FILL], tl.int32) + M, mask=s < SLOTS)
    padded = tl.where(lane_ok, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pend = tl.cumsum(padded, 0)
    tl.store(ntp_ptr, tl.sum(padded, 0))
    # block b belongs to the expert whose padded run holds its first slot: the number of runs that end at or
    # before it (torch.searchsorted(pend, b * BLOCK_M, right=True)); E past the last run
    for b0 in range(0, BLOCKS, CB):
        b = b0 + tl.arange(0, CB)
        ended = (pend[None, :] <= (b * BLOCK_M)[:, None]) & lane_ok[None, :]
        tl.store(bexp_ptr + b, tl.sum(ended.to(tl.int32), 1), mask=b < BLOCKS)
    return pend - padded


@triton.jit
def _moe_align_kernel(ids_ptr, rows_ptr, bexp_ptr, ntp_ptr, rows2_ptr, bexp2_ptr, ntp2_ptr, M, E, BLOCK_M, SLOTS,
                      BLOCKS, BLOCK_M2, SLOTS2, BLOCKS2, E_PAD: tl.constexpr, C: tl.constexpr, CB: tl.constexpr,
                      FILL: tl.constexpr, TWO: tl.constexpr):
    lanes = tl.arange(0, E_PAD)
    lane_ok = lanes < E
    chunk = tl.arange(0, C)
    # pass 1: the per-expert histogram, as one-hot rows summed per chunk (an id outside 0..E-1 hits no lane)
    counts = tl.zeros([E_PAD], tl.int32)
    for a0 in range(0, M, C):
        a = a0 + chunk
        ids = tl.load(ids_ptr + a, mask=a < M, other=-1).to(tl.int32)
        hit = ((ids[:, None] == lanes[None, :]) & lane_ok[None, :]).to(tl.int32)
        counts += tl.sum(hit, 0)
    base = _layout_runs(counts, lane_ok, rows_ptr, bexp_ptr, ntp_ptr, M, BLOCK_M, SLOTS, BLOCKS, CB, FILL)
    base2 = base  # the second layout's run starts (TWO): the same counts, padded to BLOCK_M2
    if TWO:
        base2 = _layout_runs(counts, lane_ok, rows2_ptr, bexp2_ptr, ntp2_ptr, M, BLOCK_M2, SLOTS2, BLOCKS2, CB, FILL)
    tl.debug_barrier()
    # pass 2: each assignment's slot = its expert's first slot + the expert's assignments before it. Earlier
    # chunks are in the bases (advanced per chunk), the chunk's own through an exclusive scan of the one-hot rows
    # down the chunk: assignment order within an expert is kept, as a stable sort keeps it. That rank is the same in
    # both layouts; only where each expert's run starts differs
    for a0 in range(0, M, C):
        a = a0 + chunk
        ids = tl.load(ids_ptr + a, mask=a < M, other=-1).to(tl.int32)
        hit = ((ids[:, None] == lanes[None, :]) & lane_ok[None, :]).to(tl.int32)
        before = tl.cumsum(hit, 0) - hit
        ok = (a < M) & (ids >= 0) & (ids < E)
        tl.store(rows_ptr + tl.sum(hit * (base[None, :] + before), 1), a, mask=ok)
        if TWO:
            tl.store(rows2_ptr + tl.sum(hit * (base2[None, :] + before), 1), a, mask=ok)
        step = tl.sum(hit, 0)
        base += step
        base2 += step


Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, block_expert, num_tokens_padded (int32 [1])


def align_blocks_triton(expert_ids: torch.Tensor, num_experts: int, block_m: int | None = None,
                        spare_blocks: int = 0) -> Layout:
    """:func:`align_blocks`'s (rows, block_expert) plus num_tokens_padded (int32 [1], the padded slots in use) in
    one launch of one program: output sizes fixed by (assignments, experts, block_m), no host sync, so a CUDA graph
    holds it. Any device (the tests run it under ``TRITON_INTERPRET=1``); ``align_blocks`` calls it on CUDA within
    :func:`align_fits`. An id outside ``0..num_experts-1`` is left out (its assignment gets no slot)."""
    block_m = block_m or block_rows(expert_ids.numel())
    return align_layouts(expert_ids, num_experts, ((block_m, spare_blocks),))[0]


def align_layouts(expert_ids: torch.Tensor, num_experts: int,
                  specs: tuple[tuple[int, int], ...]) -> list[Layout]:
    """:func:`align_blocks_triton` at one or two (block rows, spare blocks) in ONE launch: the layouts share the
    histogram and each assignment's rank within its expert and differ only in how each expert's run is padded, so
    the second costs a few stores. A decode step that runs humming's expert GEMM (its block rows) beside qerl's
    LoRA kernels (16) needs both per layer."""
    if not 1 <= len(specs) <= 2:
        raise ValueError(f"one or two layouts per launch, not {len(specs)}")
    flat = expert_ids.reshape(-1).contiguous()  # a strided 1-D view stays one under reshape; the kernel reads a[i]
    m, dev = flat.numel(), flat.device
    out: list[Layout] = []
    for block_m, spare in specs:
        blocks = num_blocks(m, num_experts, block_m) + spare
        out.append((torch.empty(blocks * block_m, dtype=torch.int32, device=dev),
                    torch.empty(blocks, dtype=torch.int32, device=dev), torch.empty(1, dtype=torch.int32, device=dev)))
    if m == 0:  # nothing to lay out, and an empty input may have no device address to hand the kernel
        for rows, bexp, padded in out:
            rows.fill_(0)
            bexp.fill_(num_experts)
            padded.zero_()
        return out
    lanes = _expert_lanes(num_experts)
    tile = ALIGN_TILE // lanes
    (r1, b1, n1), (r2, b2, n2) = out[0], out[-1]  # one layout: the second's arguments are the first's, unused
    _moe_align_kernel[(1,)](flat, r1, b1, n1, r2, b2, n2, m, num_experts, specs[0][0], r1.numel(), b1.numel(),
                            specs[-1][0], r2.numel(), b2.numel(), E_PAD=lanes, C=tile, CB=tile, FILL=1024,
                            TWO=len(specs) == 2, num_warps=ALIGN_WARPS)
    return out


INDEXED_SPARE = 1  # humming may round its block count up to a pair of CTAs along M: one spare block (indexed_layout)


def routing_layouts(expert_ids: torch.Tensor, num_experts: int,
                    peer_rows: int | None) -> tuple[torch.Tensor, torch.Tensor, Layout | None]:
    """qerl's (rows, block_expert) at :func:`block_rows` and, when ``peer_rows`` is given and the one-launch path
    applies, :func:`indexed_layout` at those rows from the same launch (else None: the peer's layout is made where
    it is needed)."""
    if peer_rows and _align_on_triton(expert_ids, num_experts):
        ours, peer = align_layouts(expert_ids, num_experts,
                                   ((block_rows(expert_ids.numel()), 0), (peer_rows, INDEXED_SPARE)))
        return ours[0], ours[1], peer
    rows, block_expert = align_blocks(expert_ids, num_experts)
    return rows, block_expert, None


def indexed_layout(expert_ids: torch.Tensor, num_experts: int,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing as vLLM's ``moe_align_block_size`` lays it out, which humming's indexed MoE GEMM reads:
    (sorted_ids int32 [blocks * block_m], expert_ids int32 [blocks], num_tokens_padded int32 [1]).

    It is ``align_blocks`` at humming's block size: ``sorted_ids`` names the assignment in each padded slot (the
    assignment count for padding, vLLM's sentinel too), ``expert_ids`` the expert of each block, and
    ``num_tokens_padded`` the slots in use (the kernel runs ``num_tokens_padded / block_m`` blocks and never reads
    past them, so the unused blocks' expert ``num_experts`` is never looked up). One spare block at the end:
    humming may round its block count up to a pair of CTAs along M and read one block past the last used one.
    Device tensors of a size fixed by (assignments, experts, block_m), no host sync: a CUDA graph can hold it."""
    if _align_on_triton(expert_ids, num_experts):
        return align_blocks_triton(expert_ids, num_experts, block_m, spare_blocks=INDEXED_SPARE)
    rows, block_expert = align_blocks_torch(expert_ids, num_experts, block_m, spare_blocks=INDEXED_SPARE)
    used = (block_expert < num_experts).sum(dtype=torch.int32)
    return rows, block_expert, (used * block_m).reshape(1)


@triton.jit
def _moe_grouped_kernel(x_ptr, rows_ptr, bexp_ptr, w_ptr, s_ptr, gs_ptr, lut_ptr, h_ptr, b_ptr, y_ptr,
                    M, N, K, R, E, x_div, stride_xm, stride_we, stride_se, stride_ym, stride_hm, alpha, F,
                    KIND: tl.constexpr, HAS_LORA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, BR: tl.constexpr, DECODE: tl.constexpr, F32: tl.constexpr,
                    F16: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ACCUM: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e >= E:
        return
    r = tl.load(rows_ptr + pid_b * BM + tl.arange(0, BM))
    valid = r < M
    xr = tl.where(valid, r // x_div, 0).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_mask = offs_n < N
    e64 = e.to(tl.int64)
    gs = 1.0
    if KIND == 1:
        gs = tl.load(gs_ptr + e64)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kx = k0 + offs_k
        if KIND == 0:
            w = tl.load(w_ptr + e64 * stride_we + offs_n[:, None] * K + kx[None, :],
                        mask=n_mask[:, None] & (kx[None, :] < K), other=0.0)
            if F32:
                w = w.to(tl.float32)
        else:
            w = fp4_tile(w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, lut_ptr, gs, offs_n, k0, N, K, F, BN, BK,
                         KIND == 1, DECODE, F32, F16, False, EVEN_N, EVEN_K)
        x = tl.load(x_ptr + xr[:, None] * stride_xm + kx[None, :], mask=valid[:, None] & (kx[None, :] < K), other=0.0)
        if F32:
            acc = tl.dot(w, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if KIND == 1:
        acc = acc * (alpha / gs)
    elif KIND == 2:
        acc = acc * alpha
    r64 = tl.where(valid, r, 0).to(tl.int64)
    if HAS_LORA:
        offs_r = tl.arange(0, BR)
        r_mask = offs_r < R
        h = tl.load(h_ptr + r64[:, None] * stride_hm + offs_r[None, :], mask=valid[:, None] & r_mask[None, :],
                    other=0.0)
        bt = tl.load(b_ptr + e64 * N * R + offs_n[:, None] * R + offs_r[None, :],
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if F32:
            acc = tl.dot(bt.to(tl.float32), tl.trans(h.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(bt, tl.trans(h), acc)
    if ACCUM:  # y += product: every assignment row sits in one block and every N tile has one program (no race)
        acc += tl.load(y_ptr + r64[None, :] * stride_ym + offs_n[:, None], mask=valid[None, :] & n_mask[:, None],
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + r64[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=valid[None, :] & n_mask[:, None])


def _tile_sizes(n: int, k: int, kind: int) -> tuple[int, int]:
    bn = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    bk = min(128, max(32 if kind == MXFP4 else 16, triton.next_power_of_2(k)))
    return bn, bk


def grouped_linear(x: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor, *, kind: str,
                   weight: torch.Tensor, scale: torch.Tensor | None = None, global_scale: torch.Tensor | None = None,
                   shift: int = 0, out_rows: int, x_div: int = 1, lora_h: torch.Tensor | None = None,
                   lora_b: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [out_rows, N] in x's dtype: ``y[a] = x[a // x_div] @ W_{e(a)}^T (+ lora_h[a] @ lora_b[e(a)]^T)`` for every
    assignment ``a`` that ``rows`` names. ``weight`` is ``[E, N, K]`` (dense) or ``[E, N, K/2]`` (FP4, with ``scale``,
    NVFP4's ``global_scale`` [E] and MXFP4's exponent ``shift`` from ``fp4.mxfp4_shift`` over all experts);
    ``lora_b`` is ``[E, N, R]`` in x's dtype. ``out`` [out_rows, N] (row stride free, last dim contiguous): the
    product is added to it in place and it is returned (a peer GEMM's output taking the LoRA expand ``h @ B_e^T``
    as one dense grouped launch with ``x = h``, ``weight = B``)."""
    code = KINDS[kind]
    e, n = weight.shape[0], weight.shape[1]
    k = x.shape[1]
    f32 = f32_path(x)
    bn, bk = _tile_sizes(n, k, code)
    accum = out is not None
    if accum and (out.shape != (out_rows, n) or out.stride(1) != 1):
        raise ValueError(f"grouped_linear: out must be [{out_rows}, {n}] with contiguous rows, not {tuple(out.shape)}")
    y = out if accum else torch.empty((out_rows, n), dtype=x.dtype, device=x.device)
    if out_rows == 0:
        return y
    has_lora = lora_h is not None and lora_b is not None
    r = lora_h.shape[1] if has_lora else 0
    h = lora_h if has_lora else y
    b = lora_b.contiguous() if has_lora else y
    s = scale.view(torch.uint8) if scale is not None else weight
    gs = global_scale.reshape(-1).float() if global_scale is not None else s
    f = NVFP4_F if code == NVFP4 else shift
    bm = rows.numel() // block_expert.numel()
    grid = (block_expert.numel(), triton.cdiv(n, bn))
    args = (x, rows, block_expert, weight, s, gs, e2m1_lut(x.device), h, b, y, out_rows, n, k, r, e, x_div,
            x.stride(0), weight.stride(0), s.stride(0) if scale is not None else 0, y.stride(0),
            h.stride(0), 2.0 ** (-f), f)
    meta = dict(KIND=code, HAS_LORA=has_lora, BM=bm, BN=bn, BK=bk, BR=max(16, triton.next_power_of_2(max(r, 1))),
                F32=f32, F16=x.dtype == torch.float16, EVEN_N=n % bn == 0, EVEN_K=k % bk == 0, ACCUM=accum,
                num_warps=4, num_stages=1 if INTERPRET else 3)
    launch_fp4(_moe_grouped_kernel, grid, args, None, **meta)
    return y


# ---- the backward: dX through the frozen experts, the LoRA factors' gradients ------------------------------------
# Same padded sorted-rows layout as the forward (``rows``, ``block_expert`` from ``align_blocks``), so the backward
# needs no sort, gather or scatter of its own and no host sync. Each program owns whole output tiles and sums in a
# fixed order (no atomics): a rerun is bit-identical.
@triton.jit
def _moe_grouped_t_kernel(dy_ptr, rows_ptr, bexp_ptr, w_ptr, s_ptr, gs_ptr, lut_ptr, u_ptr, a_ptr, dx_ptr,
                          M, N, K, R, E, stride_dym, stride_we, stride_se, stride_dxm, stride_um, alpha, F,
                          KIND: tl.constexpr, HAS_LORA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, BR: tl.constexpr, DECODE: tl.constexpr, F32: tl.constexpr,
                          F16: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    # one program per (block of one expert's rows, K tile); it reduces over N, reading the weight tiles
    # W_e[n0:n0+BN, k-tile] exactly as the forward reads them (checkpoint byte order), only iterated along N
    pid_b = tl.program_id(0)
    pid_k = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e >= E:
        return
    r = tl.load(rows_ptr + pid_b * BM + tl.arange(0, BM))
    valid = r < M
    r64 = tl.where(valid, r, 0).to(tl.int64)
    k0 = pid_k * BK
    offs_k = k0 + tl.arange(0, BK)
    k_mask = offs_k < K
    e64 = e.to(tl.int64)
    gs = 1.0
    if KIND == 1:
        gs = tl.load(gs_ptr + e64)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_mask = offs_n < N
        if KIND == 0:
            w = tl.load(w_ptr + e64 * stride_we + offs_n[:, None] * K + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if F32:
                w = w.to(tl.float32)
        else:
            w = fp4_tile(w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, lut_ptr, gs, offs_n, k0, N, K, F, BN, BK,
                         KIND == 1, DECODE, F32, F16, False, EVEN_N, EVEN_K)
        g = tl.load(dy_ptr + r64[:, None] * stride_dym + offs_n[None, :], mask=valid[:, None] & n_mask[None, :],
                    other=0.0)
        if F32:
            acc = tl.dot(g.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(g, w.to(g.dtype), acc)
    if KIND == 1:
        acc = acc * (alpha / gs)
    else:
        acc = acc * alpha  # 2**-F for MXFP4; for dense the caller's output scale (1.0 for dX)
    if HAS_LORA:  # + u[a] @ A_e (u = s * dy @ B_e, made by a dense call of this kernel with N = out features)
        offs_r = tl.arange(0, BR)
        r_mask = offs_r < R
        u = tl.load(u_ptr + r64[:, None] * stride_um + offs_r[None, :], mask=valid[:, None] & r_mask[None, :],
                    other=0.0)
        at = tl.load(a_ptr + e64 * R * K + offs_r[:, None] * K + offs_k[None, :],
                     mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        if F32:
            acc = tl.dot(u.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(u, at, acc)
    tl.store(dx_ptr + r64[:, None] * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=valid[:, None] & k_mask[None, :])


@triton.jit
def _moe_segment_outer_kernel(l_ptr, r_ptr, rows_ptr, bstart_ptr, out_ptr, M, P, Q, l_div, r_div, stride_lm,
                              stride_rm, alpha, BM: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr,
                              F32: tl.constexpr):
    # out[e] = alpha * sum over expert e's assignments a of L[a // l_div]^T R[a // r_div]: one program per
    # (expert, P tile, Q tile) walks that expert's blocks in order, so every sum has one fixed order (no atomics)
    e = tl.program_id(0)
    offs_p = tl.program_id(1) * BP + tl.arange(0, BP)
    offs_q = tl.program_id(2) * BQ + tl.arange(0, BQ)
    p_mask = offs_p < P
    q_mask = offs_q < Q
    b0 = tl.load(bstart_ptr + e)
    b1 = tl.load(bstart_ptr + e + 1)
    acc = tl.zeros((BP, BQ), dtype=tl.float32)
    for blk in range(b0, b1):
        r = tl.load(rows_ptr + blk * BM + tl.arange(0, BM))
        valid = r < M
        lr = tl.where(valid, r // l_div, 0).to(tl.int64)
        rr = tl.where(valid, r // r_div, 0).to(tl.int64)
        lt = tl.load(l_ptr + lr[:, None] * stride_lm + offs_p[None, :], mask=valid[:, None] & p_mask[None, :],
                     other=0.0)
        rt = tl.load(r_ptr + rr[:, None] * stride_rm + offs_q[None, :], mask=valid[:, None] & q_mask[None, :],
                     other=0.0)
        if F32:
            acc = tl.dot(tl.trans(lt.to(tl.float32)), rt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(lt), rt, acc)
    acc = acc * alpha
    out = out_ptr + e.to(tl.int64) * P * Q
    tl.store(out + offs_p[:, None] * Q + offs_q[None, :], acc, mask=p_mask[:, None] & q_mask[None, :])


def _pow2_tile(n: int, cap: int, floor: int = 16) -> int:
    return min(cap, max(floor, triton.next_power_of_2(max(n, 1))))


def grouped_linear_t(dy: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor, *, kind: str,
                     weight: torch.Tensor, scale: torch.Tensor | None = None,
                     global_scale: torch.Tensor | None = None, shift: int = 0, out_scale: float = 1.0,
                     lora_u: torch.Tensor | None = None, lora_a: torch.Tensor | None = None) -> torch.Tensor:
    """dx [M, K] in dy's dtype (M = dy's rows, assignment order): ``dx[a] = dy[a] @ W_{e(a)} (+ lora_u[a] @
    lora_a[e(a)])``, the transpose of :func:`grouped_linear` (its input gradient per assignment; rows of several
    assignments of one token are summed by the caller). ``weight`` as :func:`grouped_linear` reads it (``[E, N, K]``
    dense or ``[E, N, K/2]`` FP4 with its scales), here reduced over N. ``out_scale`` multiplies the dense product
    (the LoRA scaling when this makes ``u = s * dy @ B_e`` from ``weight = B [E, N, R]``); ``lora_a`` ``[E, R, K]``
    in dy's dtype."""
    code = KINDS[kind]
    e, n = weight.shape[0], weight.shape[1]
    k = weight.shape[2] * (2 if code != DENSE else 1)
    m = dy.shape[0]
    f32 = f32_path(dy)
    dy = dy.contiguous()
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
    if m == 0:
        return dx
    bn = _pow2_tile(n, 64)
    bk = _pow2_tile(k, 128, 32 if code == MXFP4 else 16)
    has_lora = lora_u is not None and lora_a is not None
    r = lora_u.shape[1] if has_lora else 0
    u = lora_u.contiguous() if has_lora else dx
    a = lora_a.contiguous() if has_lora else dx
    s = scale.view(torch.uint8) if scale is not None else weight
    gs = global_scale.reshape(-1).float() if global_scale is not None else s
    f = NVFP4_F if code == NVFP4 else shift
    alpha = out_scale if code == DENSE else 2.0 ** (-f)
    bm = rows.numel() // block_expert.numel()
    grid = (block_expert.numel(), triton.cdiv(k, bk))
    args = (dy, rows, block_expert, weight, s, gs, e2m1_lut(dy.device), u, a, dx, m, n, k, r, e,
            dy.stride(0), weight.stride(0), s.stride(0) if scale is not None else 0, dx.stride(0), u.stride(0),
            alpha, f)
    meta = dict(KIND=code, HAS_LORA=has_lora, BM=bm, BN=bn, BK=bk, BR=_pow2_tile(r, 1 << 30), F32=f32,
                F16=dy.dtype == torch.float16, EVEN_N=n % bn == 0, EVEN_K=k % bk == 0, num_warps=4,
                num_stages=1 if INTERPRET else 3)
    launch_fp4(_moe_grouped_t_kernel, grid, args, None, **meta)
    return dx


def expert_block_starts(block_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E + 1]: expert e's blocks are ``block_starts[e] .. block_starts[e+1] - 1`` (``block_expert`` is sorted;
    an expert with no rows has an empty range). On the device, no host sync."""
    want = torch.arange(num_experts + 1, device=block_expert.device, dtype=block_expert.dtype)
    return torch.searchsorted(block_expert, want).to(torch.int32)


def segment_outer(left: torch.Tensor, right: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor,
                  num_experts: int, *, assignments: int, left_div: int = 1, right_div: int = 1,
                  scale: float = 1.0, block_starts: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [E, P, Q]: ``out[e] = scale * sum_{a routed to e} left[a // left_div]^T right[a // right_div]`` (left
    [*, P], right [*, Q]) summed over expert e's sorted rows in block order; zeros for an expert with no rows. The
    LoRA factors' gradients: ``dA_e = u_e^T x_e`` and ``dB_e = s * dy_e^T h_e``."""
    p, q = left.shape[1], right.shape[1]
    out = torch.empty((num_experts, p, q), dtype=torch.float32, device=left.device)
    if assignments == 0 or block_expert.numel() == 0:
        return out.zero_()
    left, right = left.contiguous(), right.contiguous()
    starts = block_starts if block_starts is not None else expert_block_starts(block_expert, num_experts)
    bm = rows.numel() // block_expert.numel()
    bp, bq = _pow2_tile(p, 64), _pow2_tile(q, 64)
    grid = (num_experts, triton.cdiv(p, bp), triton.cdiv(q, bq))
    _moe_segment_outer_kernel[grid](left, right, rows, starts, out, assignments, p, q, left_div, right_div,
                                    left.stride(0), right.stride(0), scale, BM=bm, BP=bp, BQ=bq,
                                    F32=f32_path(left) or left.dtype != right.dtype, num_warps=4,
                                    num_stages=1 if INTERPRET else 2)
    return out
