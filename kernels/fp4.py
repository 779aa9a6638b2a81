"""NVFP4 / MXFP4 W4A16 kernels: fused dequantize-GEMM, its transpose for backward, and a dequantizer.

Inputs are the compressed-tensors tensors: `weight_packed` uint8 [N, K/2]
with element 2j in the low nibble, `weight_scale` [N, K/G] (E4M3 for NVFP4, G = 16; E8M0 for MXFP4,
G = 32) and, for NVFP4, `weight_global_scale` float32 [1]. `fp4_matmul`, `fp4_matmul_t` and
`fp4_dequantize` read that layout directly (a K-tile of bytes decodes into a low-nibble and a
high-nibble tile that `tl.join` interleaves back). `fp4_matmul_v2`, the fast forward, reads a load-time
repack (`repack_fp4`, same size, a bijection): bytes permuted so each MMA thread's bytes are one
16-byte run, optionally in 4 KB tile-major chunks, with 16-bit pre-scaled block scales (`kernel_scales`).

Scaling. Every kernel dequantizes to `w' = code * scale * 2**F` and multiplies the fp32 result by
`alpha = 2**-F` (MXFP4) or `2**-F / G` (NVFP4, so the per-tensor division happens once). With
F = -8 for NVFP4, and F = min(0, 128 - max exponent) for MXFP4, every `code * scale * 2**F`
is exact in fp16 and bf16 (<= 6 significant bits, inside the normal/subnormal range), so the tensor
cores see the exact dequantized weight and only the final scaling rounds.

The FP4 decode on the GPU is one inline-PTX block per 4 bytes: `prmt` spreads two bytes into the
high byte of each 16-bit half, shifts move the 3 magnitude bits of a nibble into the low exponent bits
and the top mantissa bit of an fp16/bf16 (which reads the value times 2**-14 / 2**-126, subnormal
included) and the sign to bit 15; one packed `fma`/`mul` applies the block scale, pre-multiplied by
2**14 / 2**126. The interpreter and `DECODE_ARITH` build the fp32 bit pattern with integer ops
instead; `DECODE_LUT` reads a 16-entry table.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl
from qerl_kernels._common import (
    DECODE_ARITH,
    DECODE_ASM,
    DECODE_LUT,
    INTERPRET,
    TileConfig,
    cdiv,
    f32_path,
    launch_config,
)

NVFP4_F = -8
_P118 = tl.constexpr(2.0**118)

_LUT: dict[torch.device, torch.Tensor] = {}


def e2m1_lut(device: torch.device) -> torch.Tensor:
    if device not in _LUT:
        mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        _LUT[device] = torch.tensor(mags + [-m for m in mags], dtype=torch.float32, device=device)
    return _LUT[device]


# ---- element decoders ------------------------------------------------------------------------------
@triton.jit
def _e2m1_f32(c):
    """E2M1 code (uint32 0..15) -> fp32 value, by building its bit pattern (no subnormals involved)."""
    mag = c & 7
    # codes >= 2 are normal: exponent e-1+127, top mantissa bit m; code 1 is 0.5; code 0 is 0
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 126 << 23, 0))
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


def _fp4x2_asm(bf16: bool) -> str:
    """PTX for `_fp4x2_bf16` / `_fp4x2_f16`: 4 bytes ($4) and two packed scales ($5, $6) -> outputs $0..$3.

    Each half handles two bytes (`prmt` 0x1404: bytes 0, 1; 0x3424: bytes 2, 3): the high nibble gives $2 / $3,
    the low nibble $0 / $1. bf16 moves the 3 magnitude bits to bits 6..8 and scales with an `fma` whose addend
    is -0 (so the result is the exact product); fp16 moves them to bits 9..11 and scales with a `mul`.
    """
    if bf16:
        hi_bits, lo_bits, field = "shr.b32 t, x, 6", "shr.b32 t, x, 2", "0x01C001C0"
        regs, init = "x, t, u, h, z", "\n        mov.b32 z, 0x80008000;"
        scale = "fma.rn.bf16x2 {out}, {v}, {s}, z;"
    else:
        hi_bits, lo_bits, field = "shr.b32 t, x, 3", "shl.b32 t, x, 1", "0x0E000E00"
        regs, init = "x, t, u, h", ""
        scale = "mul.rn.f16x2 {out}, {v}, {s};"

    def half(sel: str, out_hi: str, out_lo: str, s: str) -> str:
        return f"""
        prmt.b32 x, $4, 0, {sel};
        {hi_bits};
        and.b32 t, t, {field};
        and.b32 h, x, 0x80008000;
        or.b32 h, h, t;
        {scale.format(out=out_hi, v="h", s=s)}
        shl.b32 u, x, 4;
        and.b32 u, u, 0x80008000;
        {lo_bits};
        and.b32 t, t, {field};
        or.b32 u, u, t;
        {scale.format(out=out_lo, v="u", s=s)}"""

    return (f"""
        {{
        .reg .b32 {regs};{init}""" + half("0x1404", "$2", "$0", "$5") + half("0x3424", "$3", "$1", "$6") + """
        }
        """)


_FP4X2_BF16_ASM = tl.constexpr(_fp4x2_asm(bf16=True))
_FP4X2_F16_ASM = tl.constexpr(_fp4x2_asm(bf16=False))


@triton.jit
def _fp4x2_bf16(b, s):
    """bytes b (uint8) and per-byte scales s (bf16, pre-multiplied by 2**126) -> (low, high) nibble values."""
    return tl.inline_asm_elementwise(asm=_FP4X2_BF16_ASM, constraints="=r,=r,=r,=r,r,r,r", args=[b, s],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _fp4x2_f16(b, s):
    """bytes b (uint8) and per-byte scales s (fp16, pre-multiplied by 2**14) -> (low, high) nibble values."""
    return tl.inline_asm_elementwise(asm=_FP4X2_F16_ASM, constraints="=r,=r,=r,=r,r,r,r", args=[b, s],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


# ---- block scales --------------------------------------------------------------------------------
@triton.jit
def _scale_f32(s, gs, F, NVFP4: tl.constexpr, EXACT: tl.constexpr):
    """Block scale as fp32: times 2**F, or (EXACT, NVFP4) the reference's own `scale / global_scale`."""
    if NVFP4:
        sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if EXACT:
            return sf / gs
        else:
            return sf * 0.00390625  # 2**NVFP4_F
    else:
        e = tl.minimum(tl.maximum(s.to(tl.int32) + F, 0), 254)
        return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_16(s, F, NVFP4: tl.constexpr, F16: tl.constexpr):
    """Block scale for the asm decoder (which yields value * 2**-14 in fp16, value * 2**-126 in bf16)."""
    if NVFP4:
        sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if F16:
            return (sf * 64.0).to(tl.float16)  # 2**(14 + F)
        else:
            return (sf * _P118).to(tl.bfloat16)  # 2**(126 + F)
    else:
        if F16:
            e = tl.minimum(tl.maximum(s.to(tl.int32) - 98 + F, 0), 30)  # 2**(e - 127 + F + 14) in fp16 bits
            return (e << 10).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            e = tl.minimum(tl.maximum(s.to(tl.int32) + 126 + F, 0), 254)
            return (e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp4_tile(w_ptr, s_ptr, lut_ptr, gs, offs_n, k0, N, K, F,
              BN: tl.constexpr, BK: tl.constexpr, NVFP4: tl.constexpr, DECODE: tl.constexpr,
              F32: tl.constexpr, F16: tl.constexpr, EXACT: tl.constexpr, EVEN_N: tl.constexpr,
              EVEN_K: tl.constexpr):
    """Dequantized tile W[offs_n, k0:k0+BK] (times 2**F unless EXACT) in fp32 (F32) or fp16/bf16."""
    GS: tl.constexpr = 16 if NVFP4 else 32
    kb = k0 // 2 + tl.arange(0, BK // 2)
    ks = k0 // GS + tl.arange(0, BK // GS)
    w_ptrs = w_ptr + offs_n[:, None] * (K // 2) + kb[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * (K // GS) + ks[None, :]
    if EVEN_N and EVEN_K:
        b = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
    else:
        nm = offs_n[:, None] < N
        b = tl.load(w_ptrs, mask=nm & (kb[None, :] < K // 2), other=0)
        s = tl.load(s_ptrs, mask=nm & (ks[None, :] < K // GS), other=0)
    if DECODE == 0 and not F32 and not EXACT:
        sc = _scale_16(s, F, NVFP4, F16)
        sb = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, BK // GS, GS // 2)), (BN, BK // 2))
        if F16:
            lo, hi = _fp4x2_f16(b, sb)
        else:
            lo, hi = _fp4x2_bf16(b, sb)
    else:
        sc = _scale_f32(s, gs, F, NVFP4, EXACT)
        sb = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, BK // GS, GS // 2)), (BN, BK // 2))
        c = b.to(tl.uint32)
        if DECODE == 2:
            lo = tl.load(lut_ptr + (c & 15))
            hi = tl.load(lut_ptr + (c >> 4))
        else:
            lo = _e2m1_f32(c & 15)
            hi = _e2m1_f32(c >> 4)
        lo = lo * sb
        hi = hi * sb
        if not F32:
            if F16:
                lo = lo.to(tl.float16)
                hi = hi.to(tl.float16)
            else:
                lo = lo.to(tl.bfloat16)
                hi = hi.to(tl.bfloat16)
    return tl.reshape(tl.join(lo, hi), (BN, BK))


@triton.jit
def grouped_pid(pid, num_a, num_b, GROUP: tl.constexpr):
    """Grouped launch order: GROUP consecutive CTAs share one B tile, so each W tile leaves HBM once."""
    per_group = GROUP * num_b
    first_a = (pid // per_group) * GROUP
    size_a = tl.minimum(num_a - first_a, GROUP)
    pid_a = first_a + (pid % per_group) % size_a
    pid_b = (pid % per_group) // size_a
    return pid_a, pid_b


@triton.jit
def swapped_tile(M, N, K, k_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile of a swap-AB split-K GEMM (grid: grouped M x N tiles, K slices):
    (pid_m, pid_n, pid_k, offs_m, offs_n, offs_k (0..BK), m_mask, k_start, k_end)."""
    pid_m, pid_n = grouped_pid(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    k_start = pid_k * k_split
    return pid_m, pid_n, pid_k, offs_m, offs_n, offs_k, m_mask, k_start, tl.minimum(k_start + k_split, K)


@triton.jit
def _gscale(gs_ptr, NVFP4: tl.constexpr):
    """NVFP4's per-tensor global scale (1.0 for MXFP4, whose pointer is unused)."""
    if NVFP4:
        return tl.load(gs_ptr)
    else:
        return 1.0


@triton.jit
def _apply_alpha(acc, alpha, gs, NVFP4: tl.constexpr):
    """The final fp32 scaling: alpha (2**-F), and for NVFP4 the one division by the global scale."""
    if NVFP4:
        return acc * (alpha / gs)
    else:
        return acc * alpha


@triton.jit
def _act_tile(ptr, offs_m, m_mask, offs_c, stride_m, C, EVEN_C: tl.constexpr):
    """Activation tile a[offs_m, offs_c] of a row-major [M, C] tensor; rows past M, columns past C read 0."""
    ptrs = ptr + offs_m[:, None] * stride_m + offs_c[None, :]
    if EVEN_C:
        return tl.load(ptrs, mask=m_mask[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=m_mask[:, None] & (offs_c[None, :] < C), other=0.0)


@triton.jit
def x_tile_dot(acc, w, x_ptr, offs_m, m_mask, kx, stride_xm, K, EVEN_K: tl.constexpr, F32: tl.constexpr):
    """Swap-AB step: acc[BN, BM] += w[BN, BK] @ x[offs_m, kx]^T."""
    x = _act_tile(x_ptr, offs_m, m_mask, kx, stride_xm, K, EVEN_K)
    if F32:
        return tl.dot(w, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(x), acc)


@triton.jit
def dy_tile_dot(acc, w, dy_ptr, offs_m, m_mask, offs_n, stride_dym, N, EVEN_N: tl.constexpr, F32: tl.constexpr):
    """Backward step: acc[BM, BK] += dy[offs_m, offs_n] @ w[BN, BK] (w cast to dy's dtype unless F32)."""
    dy = _act_tile(dy_ptr, offs_m, m_mask, offs_n, stride_dym, N, EVEN_N)
    if F32:
        return tl.dot(dy.to(tl.float32), w, acc, input_precision="ieee")
    else:
        return tl.dot(dy, w.to(dy.dtype), acc)


@triton.jit
def store_swapped(acc, y_ptr, ws_ptr, bias_ptr, pid_k, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym,
                  HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Store acc[BN, BM] (rows of W x rows of x): the fp32 split-K partial of slice pid_k, or y (+ bias)."""
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        base = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(base + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---- repacked layout (load-time, kept in the module's kernel state) --------------------------------
# Within every 64-byte unit of a row (128 elements), byte q*16 + g holds original byte 4g + q. A thread
# of the Hopper MMA that owns K-pair column q of the A fragment then finds all its bytes of the unit in
# one contiguous 16-byte run, so the tile loads with 16-byte vectors and decodes straight into the
# fragment's registers. Block scales are pre-converted to the 16-bit factor the asm decoder multiplies
# by (the same exact `scale * 2**(F + 14 or 126)` as `_scale_16`) and read as int32 pairs.
@triton.jit
def fp4_tile_v2(w_ptr, s_ptr, offs_n, k0, N, K,
                 BN: tl.constexpr, BK: tl.constexpr, NVFP4: tl.constexpr, F32: tl.constexpr,
                 F16: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TILED: tl.constexpr):
    GS: tl.constexpr = 16 if NVFP4 else 32
    UN: tl.constexpr = BK // 128
    BPU: tl.constexpr = 128 // GS
    WPU: tl.constexpr = 64 // GS  # int32 scale words per row and unit
    u = tl.arange(0, UN)
    q = tl.arange(0, 4)
    g = tl.arange(0, 16)
    kw = k0 // (2 * GS) + tl.arange(0, BK // (2 * GS))
    if TILED:  # [N/64, K/128, 64 rows, 64 bytes]: every (64-row block, unit) is one contiguous 4 KB chunk
        chunk = (offs_n // 64) * (K // 128) + k0 // 128
        w_ptrs = (w_ptr + (chunk * 4096 + (offs_n % 64) * 64)[:, None, None, None]
                  + (u[:, None, None] * 4096 + q[None, :, None] * 16 + g[None, None, :])[None, :, :, :])
        kl = tl.arange(0, BK // (2 * GS))
        s_ptrs = (s_ptr + (chunk * (64 * WPU) + (offs_n % 64) * WPU)[:, None]
                  + ((kl // WPU) * (64 * WPU) + kl % WPU)[None, :])
    else:
        off = k0 // 2 + u[:, None, None] * 64 + q[None, :, None] * 16 + g[None, None, :]
        w_ptrs = w_ptr + offs_n[:, None, None, None] * (K // 2) + off[None, :, :, :]
        s_ptrs = s_ptr + offs_n[:, None] * (K // (2 * GS)) + kw[None, :]
    if EVEN_N and EVEN_K:
        b = tl.load(w_ptrs)
        sw = tl.load(s_ptrs)
    else:
        nm = offs_n < N
        um = (k0 + u * 128) < K
        b = tl.load(w_ptrs, mask=nm[:, None, None, None] & um[None, :, None, None], other=0)
        sw = tl.load(s_ptrs, mask=nm[:, None] & (kw[None, :] < K // (2 * GS)), other=0)
    s_lo = (sw & 0xFFFF).to(tl.int16)
    s_hi = (sw >> 16).to(tl.int16)
    if F32:  # interpreter / fp32 activations: fp16-format scales, integer decode, fp32 products
        sc = tl.join(s_lo.to(tl.float16, bitcast=True).to(tl.float32) * 0.00006103515625,  # * 2**-14
                     s_hi.to(tl.float16, bitcast=True).to(tl.float32) * 0.00006103515625)
        sc = tl.reshape(sc, (BN, UN, 1, BPU, 1))
        sb = tl.reshape(tl.broadcast_to(sc, (BN, UN, 4, BPU, 16 // BPU)), (BN, UN, 4, 16))
        c = b.to(tl.uint32)
        lo = _e2m1_f32(c & 15) * sb
        hi = _e2m1_f32(c >> 4) * sb
    else:
        if F16:
            sc = tl.join(s_lo.to(tl.float16, bitcast=True), s_hi.to(tl.float16, bitcast=True))
        else:
            sc = tl.join(s_lo.to(tl.bfloat16, bitcast=True), s_hi.to(tl.bfloat16, bitcast=True))
        sc = tl.reshape(sc, (BN, UN, 1, BPU, 1))
        sb = tl.reshape(tl.broadcast_to(sc, (BN, UN, 4, BPU, 16 // BPU)), (BN, UN, 4, 16))
        if F16:
            lo, hi = _fp4x2_f16(b, sb)
        else:
            lo, hi = _fp4x2_bf16(b, sb)
    w = tl.permute(tl.join(lo, hi), (0, 1, 3, 2, 4))  # [BN, UN, 16(g), 4(q), 2(nibble)] = k order
    return tl.reshape(w, (BN, BK))


@triton.jit
def _fp4_mm_v2_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                      M, N, K, stride_xm, stride_ym, k_split, alpha, S,
                      NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                      F32: tl.constexpr, F16: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                      TILED: tl.constexpr, SERIAL: tl.constexpr):
    pid_m, pid_n, pid_k, offs_m, offs_n, offs_k, m_mask, k_start, k_end = swapped_tile(M, N, K, k_split, BM, BN, BK,
                                                                                     GROUP_M)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        w = fp4_tile_v2(w_ptr, s_ptr, offs_n, k0, N, K, BN, BK, NVFP4, F32, F16, EVEN_N, EVEN_K, TILED)
        acc = x_tile_dot(acc, w, x_ptr, offs_m, m_mask, k0 + offs_k, stride_xm, K, EVEN_K, F32)
    acc = _apply_alpha(acc, alpha, _gscale(gs_ptr, NVFP4), NVFP4)
    n_mask = offs_n < N
    store_swapped(acc, y_ptr, ws_ptr, bias_ptr, pid_k, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym,
                  HAS_BIAS, SPLIT)
    if SPLIT and SERIAL:
        # Serial split-K: the last CTA of this output tile to arrive sums the S partials in the fixed
        # order s = 0..S-1 (bit-identical whichever CTA that is), adds bias, stores, resets the counter.
        tl.debug_barrier()
        mask = n_mask[:, None] & m_mask[None, :]
        tile = pid_m * tl.cdiv(N, BN) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == S - 1:
            out = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(0, S):
                out += tl.load(ws_ptr + s * M * N + offs_m[None, :] * N + offs_n[:, None], mask=mask,
                               other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], out.to(y_ptr.dtype.element_ty),
                     mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


# ---- y = x @ dequant(W)^T ------------------------------------------------------------------------
@triton.jit
def _fp4_mm_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, lut_ptr, bias_ptr, y_ptr, ws_ptr,
                   M, N, K, stride_xm, stride_ym, k_split, alpha, F,
                   NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   DECODE: tl.constexpr, F32: tl.constexpr, F16: tl.constexpr,
                   EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    # swap-AB: the weight tile is the MMA's M side (>= 64 rows) and the few activation rows its N side
    pid_m, pid_n, pid_k, offs_m, offs_n, offs_k, m_mask, k_start, k_end = swapped_tile(M, N, K, k_split, BM, BN, BK,
                                                                                     GROUP_M)
    gs = _gscale(gs_ptr, NVFP4)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        w = _fp4_tile(w_ptr, s_ptr, lut_ptr, gs, offs_n, k0, N, K, F, BN, BK, NVFP4, DECODE, F32, F16, False,
                      EVEN_N, EVEN_K)
        acc = x_tile_dot(acc, w, x_ptr, offs_m, m_mask, k0 + offs_k, stride_xm, K, EVEN_K, F32)
    acc = _apply_alpha(acc, alpha, gs, NVFP4)
    store_swapped(acc, y_ptr, ws_ptr, bias_ptr, pid_k, offs_m, offs_n, m_mask, offs_n < N, M, N, stride_ym,
                  HAS_BIAS, SPLIT)


@triton.jit
def splitk_reduce_kernel(ws_ptr, bias_ptr, y_ptr, M, N, stride_ym, S, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Second pass of split-K: sum the S fp32 partials in a fixed order (deterministic), add bias, cast."""
    pid_m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = ws_ptr + pid_m * N + offs
    for s in range(0, S):
        acc += tl.load(base + s * M * N, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + pid_m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def splitk_plan(m: int, n: int, k: int, cfg: TileConfig, y: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(slices, K per slice, fp32 workspace [slices, M, N]) for `cfg.split_k`; y stands in when not split."""
    split = max(1, min(cfg.split_k, cdiv(k, cfg.bk)))
    k_split = cdiv(cdiv(k, split), cfg.bk) * cfg.bk
    split = cdiv(k, k_split)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=y.device) if split > 1 else y
    return split, k_split, ws


def splitk_reduce(ws: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, split: int) -> None:
    """The second pass of split-K into y [M, N] (adds bias)."""
    m, n = y.shape
    block = 1024
    splitk_reduce_kernel[(m, cdiv(n, block))](
        ws, bias if bias is not None else y, y, m, n, y.stride(0), split, HAS_BIAS=bias is not None, BLOCK=block,
        num_warps=4)


# ---- dx = dy @ dequant(W) ------------------------------------------------------------------------
@triton.jit
def _fp4_mm_t_kernel(dy_ptr, w_ptr, s_ptr, gs_ptr, lut_ptr, dx_ptr,
                     M, N, K, stride_dym, stride_dxm, alpha, F,
                     NVFP4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, DECODE: tl.constexpr, F32: tl.constexpr, F16: tl.constexpr,
                     EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_k = grouped_pid(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(K, BK), GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    m_mask = offs_m < M
    gs = _gscale(gs_ptr, NVFP4)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        w = _fp4_tile(w_ptr, s_ptr, lut_ptr, gs, offs_n, pid_k * BK, N, K, F, BN, BK, NVFP4, DECODE, F32, F16,
                      False, EVEN_N, EVEN_K)
        acc = dy_tile_dot(acc, w, dy_ptr, offs_m, m_mask, offs_n, stride_dym, N, EVEN_N, F32)
    acc = _apply_alpha(acc, alpha, gs, NVFP4)
    mask = m_mask[:, None] & (offs_k[None, :] < K)
    tl.store(dx_ptr + offs_m[:, None] * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mask)


# ---- W = dequant(packed) -------------------------------------------------------------------------
@triton.jit
def _fp4_dequant_kernel(w_ptr, s_ptr, gs_ptr, lut_ptr, out_ptr, N, K, F,
                        NVFP4: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DECODE: tl.constexpr,
                        F32: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    # EXACT: the reference's own arithmetic (`code * (scale / global_scale)` in fp32, one rounding)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    gs = _gscale(gs_ptr, NVFP4)
    w = _fp4_tile(w_ptr, s_ptr, lut_ptr, gs, offs_n, k0, N, K, 0, BN, BK, NVFP4, DECODE, True, False, True,
                  EVEN_N, EVEN_K)
    offs_k = k0 + tl.arange(0, BK)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


# W = dequant(repacked): the exact dequantizer on the load-time layout (one program per 64 rows x UN units),
# so the module needs no checkpoint-layout copy for large-M forward and backward. Decodes like
# `fp4_tile_v2` (same byte addresses, same permute back to k order) but scales with the checkpoint block
# scales in fp32, as the reference does, so the result is bit-identical to `dequantize`.
@triton.jit
def _fp4_dequant_v2_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, N, K,
                           NVFP4: tl.constexpr, BN: tl.constexpr, UN: tl.constexpr, TILED: tl.constexpr):
    GS: tl.constexpr = 16 if NVFP4 else 32
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * (UN * 128)
    u = tl.arange(0, UN)
    q = tl.arange(0, 4)
    g = tl.arange(0, 16)
    if TILED:
        chunk = (offs_n // 64) * (K // 128) + k0 // 128
        w_ptrs = (w_ptr + (chunk.to(tl.int64) * 4096 + (offs_n % 64) * 64)[:, None, None, None]
                  + (u[:, None, None] * 4096 + q[None, :, None] * 16 + g[None, None, :])[None, :, :, :])
    else:
        off = k0 // 2 + u[:, None, None] * 64 + q[None, :, None] * 16 + g[None, None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None, None, None] * (K // 2) + off[None, :, :, :]
    # byte q*16 + g of a unit holds original byte 4g + q: elements k0 + u*128 + 8g + 2q (+1), one block
    kk = k0 + u[:, None, None] * 128 + g[None, None, :] * 8 + q[None, :, None] * 2
    s_ptrs = s_ptr + offs_n.to(tl.int64)[:, None, None, None] * (K // GS) + (kk // GS)[None, :, :, :]
    um = (k0 + u * 128) < K
    nm = offs_n < N
    mask = nm[:, None, None, None] & um[None, :, None, None]
    b = tl.load(w_ptrs, mask=mask, other=0)
    s = tl.load(s_ptrs, mask=mask, other=0)
    sc = _scale_f32(s, _gscale(gs_ptr, NVFP4), 0, NVFP4, True)
    c = b.to(tl.uint32)
    lo = (_e2m1_f32(c & 15) * sc).to(out_ptr.dtype.element_ty)
    hi = (_e2m1_f32(c >> 4) * sc).to(out_ptr.dtype.element_ty)
    w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2, 4)), (BN, UN * 128))  # [BN, UN, g, q, 2] = k order
    offs_k = k0 + tl.arange(0, UN * 128)
    omask = nm[:, None] & (offs_k[None, :] < K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], w, mask=omask)


# ---- host side -----------------------------------------------------------------------------------
def group_size(fmt: str) -> int:
    if fmt == "nvfp4":
        return 16
    if fmt == "mxfp4":
        return 32
    raise ValueError(f"not an FP4 format: {fmt!r}")


def mxfp4_shift(scale: torch.Tensor) -> int:
    """F for MXFP4: the largest shift <= 0 that keeps `6 * 2**(e-127+F)` and its 16-bit scale finite."""
    return min(0, 128 - int(scale.max().item())) if scale.numel() else 0


_ASM_FAILED: list[str] = []  # set when the inline-PTX decoder failed to build; default dispatch then uses ARITH


def _decode_mode(decode: int | None) -> int:
    if INTERPRET:
        return DECODE_LUT if decode == DECODE_LUT else DECODE_ARITH
    if decode is None:
        return DECODE_ARITH if _ASM_FAILED else DECODE_ASM
    return decode


def _launch(kernel, grid, args: tuple, decode: int | None, **meta) -> None:  # noqa: ANN001
    """Launch; if the default asm decoder fails to compile on this GPU/toolchain, warn once and use ARITH."""
    dec = _decode_mode(decode)
    try:
        kernel[grid](*args, DECODE=dec, **meta)
    except Exception as exc:
        if decode is not None or dec != DECODE_ASM:
            raise
        import warnings

        _ASM_FAILED.append(repr(exc)[:500])
        warnings.warn(f"qerl_kernels: inline-asm FP4 decoder failed ({exc!r:.200}); using the arithmetic decoder",
                      stacklevel=3)
        kernel[grid](*args, DECODE=DECODE_ARITH, **meta)


# What the grouped expert GEMM (moe.py) shares with these kernels: the checkpoint-order tile decoder and the launch
# with its inline-asm fallback.
fp4_tile = _fp4_tile
launch_fp4 = _launch


def _launch_args(fmt: str, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                 shift: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
    nv = fmt == "nvfp4"
    group_size(fmt)
    if nv and global_scale is None:
        raise ValueError("NVFP4 needs weight_global_scale")
    s = scale.view(torch.uint8)
    gs = global_scale if nv else s  # unused pointer for MXFP4
    F = NVFP4_F if nv else (mxfp4_shift(scale) if shift is None else shift)
    return packed, s, gs, F, 2.0 ** (-F)


def fp4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
               fmt: str, cfg: TileConfig, *, bias: torch.Tensor | None = None, shift: int | None = None,
               decode: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequant(W)^T (+ bias), fp32 accumulation, y in x's dtype.

    `cfg.split_k` > 1 writes fp32 partials and sums them in a second, fixed-order pass.
    `shift` (MXFP4 only) is `mxfp4_shift(scale)`; pass it cached to avoid a device sync per call.
    """
    n, k = packed.shape[0], packed.shape[1] * 2
    m, f32, cfg = x.shape[0], f32_path(x), launch_config(cfg)
    packed, s, gs, F, alpha = _launch_args(fmt, packed, scale, global_scale, shift)
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, k_split, ws = splitk_plan(m, n, k, cfg, y)
    bias_arg = bias if bias is not None else y
    grid = (cdiv(m, cfg.bm) * cdiv(n, cfg.bn), split)
    _launch(
        _fp4_mm_kernel, grid,
        (x, packed, s, gs, e2m1_lut(x.device), bias_arg, y, ws, m, n, k, x.stride(0), y.stride(0), k_split, alpha, F),
        decode,
        NVFP4=fmt == "nvfp4", HAS_BIAS=bias is not None and split == 1, SPLIT=split > 1,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=8, F32=f32,
        F16=x.dtype == torch.float16, EVEN_N=n % cfg.bn == 0, EVEN_K=k % cfg.bk == 0,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if split > 1:
        splitk_reduce(ws, bias, y, split)
    return y


def fp4_matmul_t(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                 fmt: str, cfg: TileConfig, *, shift: int | None = None, decode: int | None = None) -> torch.Tensor:
    """dx[M, K] = dy[M, N] @ dequant(W) (the input gradient of y = x @ W^T), fp32 accumulation."""
    n, k = packed.shape[0], packed.shape[1] * 2
    m, f32, cfg = dy.shape[0], f32_path(dy), launch_config(cfg)
    packed, s, gs, F, alpha = _launch_args(fmt, packed, scale, global_scale, shift)
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
    grid = (cdiv(m, cfg.bm) * cdiv(k, cfg.bk),)
    _launch(
        _fp4_mm_t_kernel, grid,
        (dy, packed, s, gs, e2m1_lut(dy.device), dx, m, n, k, dy.stride(0), dx.stride(0), alpha, F), decode,
        NVFP4=fmt == "nvfp4", BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=8, F32=f32,
        F16=dy.dtype == torch.float16, EVEN_N=n % cfg.bn == 0, EVEN_K=k % cfg.bk == 0,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return dx


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None, fmt: str,
                   dtype: torch.dtype, *, bn: int = 32, bk: int = 256, decode: int | None = None) -> torch.Tensor:
    """dequant(W) [N, K] in `dtype`, with the reference's exact arithmetic (bit-identical to `dequantize`)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    packed, s, gs, _, _ = _launch_args(fmt, packed, scale, global_scale, 0)
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    bk = min(bk, triton.next_power_of_2(k))
    dec = DECODE_LUT if decode == DECODE_LUT else DECODE_ARITH
    _fp4_dequant_kernel[(cdiv(n, bn), cdiv(k, bk))](
        packed, s, gs, e2m1_lut(packed.device), out, n, k, 0,
        NVFP4=fmt == "nvfp4", BN=bn, BK=bk, DECODE=dec, F32=True, EVEN_N=n % bn == 0, EVEN_K=k % bk == 0,
        num_warps=4, num_stages=1 if INTERPRET else 2,
    )
    return out


# Elementwise, so every configuration writes the same bytes: tuned per shape by timing (once per process).
_DEQUANT_V2_CONFIGS = [triton.Config({"UN": un}, num_warps=w) for un in (1, 2, 4) for w in (2, 4, 8)]
_fp4_dequant_v2_tuned = triton.autotune(_DEQUANT_V2_CONFIGS, key=["N", "K", "NVFP4", "TILED"])(_fp4_dequant_v2_kernel)
# Triton's autotuner keeps a launch's arguments on the shared kernel object while it runs: two threads launching it
# at once (a rollout thread's prefill beside a training forward, --async-rollout) would read each other's
_TUNED_LAUNCH = threading.Lock()


def fp4_dequantize_v2(repacked: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None, fmt: str,
                      dtype: torch.dtype, *, tiled: bool = False, units: int | None = None) -> torch.Tensor:
    """`fp4_dequantize` reading the repacked layout (`repack_fp4(packed, tiled)`) and the checkpoint block
    scales: bit-identical to the reference `dequantize` of the unrepacked weight. `units` (128-column
    units per program) fixes the tile; by default it is autotuned on the GPU."""
    n, k = repacked.shape[0], repacked.shape[1] * 2
    if k % 128 or (tiled and n % 64):
        raise ValueError(f"not a repacked FP4 shape: N={n}, K={k} (tiled={tiled})")
    gs = global_scale if global_scale is not None else scale  # unused for MXFP4
    out = torch.empty((n, k), dtype=dtype, device=repacked.device)
    args = (repacked, scale.view(torch.uint8), gs, out, n, k)
    if units is None and not INTERPRET:
        with _TUNED_LAUNCH:
            _fp4_dequant_v2_tuned[lambda meta: (cdiv(n, 64), cdiv(k, meta["UN"] * 128))](
                *args, NVFP4=fmt == "nvfp4", BN=64, TILED=tiled)
        return out
    units = units or 2  # a power of two; the last program of a row masks columns past K
    _fp4_dequant_v2_kernel[(cdiv(n, 64), cdiv(k, units * 128))](
        *args, NVFP4=fmt == "nvfp4", BN=64, UN=units, TILED=tiled, num_warps=4)
    return out


# ---- repacked (v2) host side -------------------------------------------------------------------------
def repack_fp4(packed: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """[N, K/2] compressed-tensors bytes -> the v2 layout (needs K % 128 == 0): a bijection, same size.

    `tiled` (needs N % 64 == 0) also orders the 64-byte row units as [N/64, K/128, 64, 64], so the
    kernel's weight tile of every K step is whole 4 KB chunks instead of 64-byte pieces of 64+ rows.
    """
    n, kb = packed.shape
    if kb % 64:
        raise ValueError(f"the repacked FP4 layout needs K % 128 == 0, got K={2 * kb}")
    out = packed.reshape(n, kb // 64, 16, 4).transpose(-1, -2)
    if tiled:
        if n % 64:
            raise ValueError(f"the tiled FP4 layout needs N % 64 == 0, got N={n}")
        out = out.reshape(n // 64, 64, kb // 64, 64).transpose(1, 2)
    return out.contiguous().reshape(n, kb)


def unrepack_fp4(repacked: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    n, kb = repacked.shape
    t = repacked
    if tiled:
        t = t.reshape(n // 64, kb // 64, 64, 64).transpose(1, 2).contiguous()
    return t.reshape(n, kb // 64, 4, 16).transpose(-1, -2).contiguous().reshape(n, kb)


def kernel_scales(scale: torch.Tensor, fmt: str, dtype: torch.dtype, shift: int = 0,
                  tiled: bool = False) -> torch.Tensor:
    """Block scales as the 16-bit factor the v2 decoder multiplies by, viewed as int32 pairs [N, K/(2G)].

    bf16: scale * 2**(126 + F); fp16 (also the fp32/interpreter path): scale * 2**(14 + F). Exact.
    """
    bf16 = dtype == torch.bfloat16 and not INTERPRET
    if fmt == "nvfp4":
        s = scale.float() * (2.0 ** (126 + NVFP4_F) if bf16 else 2.0 ** (14 + NVFP4_F))
        out = s.to(torch.bfloat16 if bf16 else torch.float16)
    else:
        e = scale.to(torch.int32) + shift
        bits = ((e + 126).clamp(0, 254) << 7) if bf16 else ((e - 98).clamp(0, 30) << 10)
        out = bits.to(torch.int16)
    if out.shape[1] % 2:
        raise ValueError("the repacked FP4 layout needs an even number of scale blocks per row")
    if tiled:  # [N/64, K/128, 64, 128/G], like the tiled weight
        n, nb = out.shape
        spu = 128 // group_size(fmt)
        out = out.reshape(n // 64, 64, nb // spu, spu).transpose(1, 2).reshape(n, nb)
    return out.contiguous().view(torch.int32)


def fp4_matmul_v2(x: torch.Tensor, repacked: torch.Tensor, kscales: torch.Tensor,
                  global_scale: torch.Tensor | None, fmt: str, cfg: TileConfig, *, shift: int = 0,
                  bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  tiled: bool = False, serial: bool | None = None) -> torch.Tensor:
    """`fp4_matmul` on the repacked layout (`repack_fp4`) with `kernel_scales(scale, fmt, x.dtype, shift)`;
    `tiled` must match how both were made.

    With split-K, `serial` (default: M <= 16) reduces inside the same launch (the last CTA of a tile sums
    the partials in fixed order); otherwise a second kernel does. Both are deterministic. The in-kernel
    reduction saves a launch at decode sizes but costs registers, which hurt the larger tiles on an H200.
    """
    n, k = repacked.shape[0], repacked.shape[1] * 2
    m, f32, cfg = x.shape[0], f32_path(x), launch_config(cfg)
    if cfg.bk % 128:
        raise ValueError("the repacked FP4 kernel needs BK % 128 == 0")
    nv = fmt == "nvfp4"
    F = NVFP4_F if nv else shift
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, k_split, ws = splitk_plan(m, n, k, cfg, y)
    bias_arg = bias if bias is not None else y
    gs = global_scale if nv else kscales
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    serial = split > 1 and (m <= 16 if serial is None else serial)
    cnt = tile_counters(x.device, tiles) if serial else ws
    _fp4_mm_v2_kernel[(tiles, split)](
        x, repacked, kscales, gs, bias_arg, y, ws, cnt, m, n, k, x.stride(0), y.stride(0), k_split, 2.0 ** (-F), split,
        NVFP4=nv, HAS_BIAS=bias is not None and (split == 1 or serial), SPLIT=split > 1,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=8, F32=f32, F16=x.dtype == torch.float16,
        EVEN_N=n % cfg.bn == 0, EVEN_K=k % cfg.bk == 0, TILED=tiled, SERIAL=serial,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if split > 1 and not serial:
        splitk_reduce(ws, bias, y, split)
    return y


_COUNTERS: dict[tuple, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for serial split-K, one buffer per (device, stream).

    The kernels leave every counter at 0 again, so one buffer serves all calls on a stream, CUDA-graph
    replays included; a second stream gets its own so concurrent GEMMs never share a counter.
    """
    sid = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, sid)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = _COUNTERS[key] = torch.zeros(max(4096, tiles), dtype=torch.int32, device=device)
    return buf
