"""W8A16 INT8 / FP8 (per-output-channel scale) kernels, and the FP8xFP8 path through torch's scaled matmul.

INT8 and E4M3 values are exact in bf16 and fp16, so the tensor cores multiply the raw 8-bit weights
and the per-channel scale is applied once to the fp32 accumulator. For backward the scale varies
along the reduction, so it is applied to the weight tile (in fp32, one rounding, like the reference).

FP8xFP8 (compressed-tensors FP8_DYNAMIC is W8A8 with dynamic per-token activation scales): one Triton
pass quantizes each activation row (amax, scale = amax/448, saturating RNE to E4M3), then
`torch._scaled_mm` multiplies on the FP8 tensor cores with row-wise scales for both operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl_kernels._common import INTERPRET, TileConfig, cdiv, f32_path, launch_config
from qerl_kernels.fp4 import (
    dy_tile_dot,
    grouped_pid,
    splitk_plan,
    splitk_reduce,
    store_swapped,
    swapped_tile,
    x_tile_dot,
)

E4M3_MAX = 448.0


@triton.jit
def _w8_tile(w_ptr, offs_n, k0, N, K, BK: tl.constexpr, IS_FP8: tl.constexpr, F32: tl.constexpr,
             F16: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BK)
    ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    if EVEN_N and EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0)
    if IS_FP8:
        w = w.to(tl.float8e4nv, bitcast=True)
    if F32:
        return w.to(tl.float32)
    elif F16:
        return w.to(tl.float16)
    else:
        return w.to(tl.bfloat16)


@triton.jit
def _w8_mm_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_ym, k_split,
                  IS_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  F32: tl.constexpr, F16: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    _, _, pid_k, offs_m, offs_n, _, m_mask, k_start, k_end = swapped_tile(M, N, K, k_split, BM, BN, BK, GROUP_M)
    n_mask = offs_n < N
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        w = _w8_tile(w_ptr, offs_n, k0, N, K, BK, IS_FP8, F32, F16, EVEN_N, EVEN_K)
        acc = x_tile_dot(acc, w, x_ptr, offs_m, m_mask, k0 + tl.arange(0, BK), stride_xm, K, EVEN_K, F32)
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    store_swapped(acc, y_ptr, ws_ptr, bias_ptr, pid_k, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym,
                  HAS_BIAS, SPLIT)


@triton.jit
def _w8_mm_t_kernel(dy_ptr, w_ptr, s_ptr, dx_ptr, M, N, K, stride_dym, stride_dxm,
                    IS_FP8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_M: tl.constexpr, F32: tl.constexpr, F16: tl.constexpr,
                    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_k = grouped_pid(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(K, BK), GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    m_mask = offs_m < M
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        w = _w8_tile(w_ptr, offs_n, pid_k * BK, N, K, BK, IS_FP8, True, False, EVEN_N, EVEN_K)
        s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        w = w * s[:, None]
        acc = dy_tile_dot(acc, w, dy_ptr, offs_m, m_mask, offs_n, stride_dym, N, EVEN_N, F32)
    mask = m_mask[:, None] & (offs_k[None, :] < K)
    tl.store(dx_ptr + offs_m[:, None] * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def round_e4m3(v):
    """fp32 -> the nearest E4M3 value (ties to even) as fp32, for |v| <= 448, by integer ops on the bit pattern.

    The interpreter's own fp32->fp8 cast loses the rounding carry (124.3 -> 64), so the F32 path rounds here and
    then casts an exact value; the GPU path casts directly (cvt.rn.satfinite, RNE)."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23) - 127
    # fraction bits to drop: 20 for normal E4M3 (3 kept), one more per binade below 2**-6 (subnormal grid 2**-9)
    drop = 20 + tl.minimum(tl.maximum(-6 - exp, 0), 3)
    one = tl.full(bits.shape, 1, tl.int32)
    # the kept last bit decides ties; at drop 23 (2**-9 <= |v| < 2**-8) it is the implicit leading one
    lsb = tl.where(drop >= 23, 1, (mag >> drop) & 1)
    rounded = (mag + (one << (drop - 1)) - 1 + lsb) & ~((one << drop) - 1)
    # below 2**-9 the grid is {0, 2**-9}: round up past the midpoint 2**-10 (a tie goes to the even 0)
    rounded = tl.where(exp <= -10, tl.where(mag > 0x3A800000, 0x3B000000, 0), rounded)  # 2**-10, 2**-9
    return (rounded | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(v, F32: tl.constexpr):
    if F32:
        return round_e4m3(v).to(tl.float8e4nv)
    else:
        return v.to(tl.float8e4nv)


@triton.jit
def _quant_rows_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr, F32: tl.constexpr):
    """One row per program: scale = max(amax, tiny) / 448, q = RNE(clamp(x / scale, +-448)) as E4M3 bits."""
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = to_e4m3(tl.minimum(tl.maximum(x / scale, -448.0), 448.0), F32)
        tl.store(q_ptr + row * stride_qm + offs, q.to(tl.uint8, bitcast=True), mask=offs < K)


# ---- host side -----------------------------------------------------------------------------------
def _launch_prep(weight: torch.Tensor, cfg: TileConfig) -> tuple[torch.Tensor, bool, TileConfig]:
    """(the weight as the kernels read it: FP8 as its uint8 bits, whether it is FP8, the tile config to use)."""
    is_fp8 = weight.dtype == torch.float8_e4m3fn
    return (weight.view(torch.uint8) if is_fp8 else weight), is_fp8, launch_config(cfg)


def w8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, cfg: TileConfig, *,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ (weight * scale)^T (+ bias) for int8 or float8_e4m3fn weight [N, K] and scale [N, 1]."""
    (n, k), m = weight.shape, x.shape[0]
    w, is_fp8, cfg = _launch_prep(weight, cfg)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, k_split, ws = splitk_plan(m, n, k, cfg, y)
    bias_arg = bias if bias is not None else y
    grid = (cdiv(m, cfg.bm) * cdiv(n, cfg.bn), split)
    _w8_mm_kernel[grid](
        x, w, scale, bias_arg, y, ws, m, n, k, x.stride(0), y.stride(0), k_split,
        IS_FP8=is_fp8, HAS_BIAS=bias is not None and split == 1, SPLIT=split > 1,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=8, F32=f32_path(x), F16=x.dtype == torch.float16,
        EVEN_N=n % cfg.bn == 0, EVEN_K=k % cfg.bk == 0, num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if split > 1:
        splitk_reduce(ws, bias, y, split)
    return y


def w8_matmul_t(dy: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, cfg: TileConfig) -> torch.Tensor:
    """dx = dy @ (weight * scale) for the backward of `w8_matmul`."""
    (n, k), m = weight.shape, dy.shape[0]
    w, is_fp8, cfg = _launch_prep(weight, cfg)
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
    grid = (cdiv(m, cfg.bm) * cdiv(k, cfg.bk),)
    _w8_mm_t_kernel[grid](
        dy, w, scale, dx, m, n, k, dy.stride(0), dx.stride(0), IS_FP8=is_fp8, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
        GROUP_M=8, F32=f32_path(dy), F16=dy.dtype == torch.float16, EVEN_N=n % cfg.bn == 0, EVEN_K=k % cfg.bk == 0,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return dx


def quantize_rows_fp8(x: torch.Tensor, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) dynamic FP8 quantization: (x_fp8 [M, K] float8_e4m3fn, scale [M, 1] fp32)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(block, triton.next_power_of_2(k))
    _quant_rows_fp8_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, F32=INTERPRET, num_warps=4)
    return q.view(torch.float8_e4m3fn), s


def fp8_scaled_matmul(x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8xFP8 on the tensor cores: y = (q(x) * sx) @ (weight * scale)^T, per-token and per-channel scales.

    `scale_row` is the weight scale as fp32 [1, N]. Output bf16 (row-wise scaling needs bf16 out).
    """
    xq, sx = quantize_rows_fp8(x)
    return torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=scale_row, bias=bias, out_dtype=torch.bfloat16)
