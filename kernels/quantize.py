"""In-place weight quantization into qerl's per-channel INT8 / FP8 layouts (FlashRL re-quantization).

After every optimizer step the rollout copy's packed weights are refreshed from the trained weights.
One fused pass reads the 16/32-bit weight once and writes the 8-bit codes straight into the existing
buffer: no fp32 temporary of the whole weight (the torch reference makes three), and the buffer's
address never changes, so captured CUDA graphs keep reading the right memory.

Arithmetic is the reference's (qerl_cli/formats/reference.py), bit for bit:
- the per-channel scale is computed on the host side with torch (an exact max-abs reduction, then
  `amax / 127.5` or `amax / 448` rounded to the scale dtype), or kept fixed (FlashRL's INT8 calibration);
- INT8: q = RNE(clamp(w / s, -128, 127)), with IEEE division (`div_rn`) and RNE done by the
  1.5 * 2**23 magic-number add (exact for |y| < 2**22; y is clamped first);
- FP8 E4M3: saturate to +-448, then RNE to 3 mantissa bits on the fp32 bit pattern, written as raw
  E4M3 bits. Integer arithmetic, because the interpreter's fp32->fp8 cast neither saturates nor keeps
  subnormals; the same code runs on the GPU (the pass is memory-bound, so it costs nothing there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
INT8_DIV = 127.5
_RNE_MAGIC = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds an fp32 to the nearest even integer


@triton.jit
def _e4m3_bits(y):
    """fp32 -> E4M3 (fn) bit pattern as int32 in [0, 255]: saturating round-to-nearest-even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.minimum(tl.abs(y), 448.0)
    # subnormals (|a| < 2**-6) sit on a grid of 2**-9: code = RNE(a * 512), which reaches 8 (the first
    # normal, exponent field 1, mantissa 0) continuously
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
    ab = a.to(tl.int32, bitcast=True)
    rounded = (ab + 0x7FFFF + ((ab >> 20) & 1)) & ~0xFFFFF  # RNE of the fp32 mantissa to 3 bits
    normal = ((((rounded >> 23) & 0xFF) - 120) << 3) | ((rounded >> 20) & 7)
    code = tl.where(a < 0.015625, sub, normal)
    return (sign << 7) | code


@triton.jit
def _quant_w8_kernel(w_ptr, s_ptr, q_ptr, N, K, stride_w, stride_q,
                     IS_FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=1.0).to(tl.float32)
    y = tl.math.div_rn(w, tl.broadcast_to(s[:, None], (BN, BK)))
    if IS_FP8:
        q = _e4m3_bits(y).to(tl.uint8)
    else:
        y = tl.minimum(tl.maximum(y, -128.0), 127.0)
        q = ((y + 12582912.0) - 12582912.0).to(tl.int8)
    tl.store(q_ptr + offs_n[:, None] * stride_q + offs_k[None, :], q, mask=mask)


def per_channel_scale(w: torch.Tensor, fmt: str, scale_dtype: torch.dtype) -> torch.Tensor:
    """The reference's per-channel scale [N, 1] (amax / 127.5 or / 448 in `scale_dtype`; zero rows -> eps).

    The inf-norm reduction is exact in any dtype and allocates only [N, 1], never a copy of `w`.
    """
    amax = torch.linalg.vector_norm(w, float("inf"), dim=-1, keepdim=True).float()
    scale = (amax / (E4M3_MAX if fmt == "fp8" else INT8_DIV)).to(scale_dtype)
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).eps), scale)


def quantize_w8_(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: str, *,
                 recompute_scale: bool = True, bn: int = 32, bk: int = 256) -> None:
    """Quantize `w` [N, K] into the existing buffers `q` (int8 or float8_e4m3fn [N, K]) and `scale` [N, 1].

    `recompute_scale=False` keeps `scale` as it is (FlashRL's fixed INT8 calibration): values beyond
    127.5 * scale clamp. Works on CUDA and under TRITON_INTERPRET=1.
    """
    if fmt not in ("int8", "fp8"):
        raise ValueError(f"quantize_w8_ handles int8 and fp8, not {fmt!r}")
    want = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
    if q.dtype != want or tuple(q.shape) != tuple(w.shape) or scale.numel() != w.shape[0]:
        raise ValueError(f"buffers do not fit: q {q.dtype} {tuple(q.shape)}, scale {tuple(scale.shape)} for "
                         f"{fmt} weight {tuple(w.shape)}")
    if w.stride(1) != 1:
        w = w.contiguous()
    if recompute_scale:
        scale.copy_(per_channel_scale(w, fmt, scale.dtype))
    n, k = w.shape
    out = q.view(torch.uint8) if fmt == "fp8" else q
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _quant_w8_kernel[grid](w, scale, out, n, k, w.stride(0), out.stride(0), IS_FP8=fmt == "fp8",
                           BN=bn, BK=bk, num_warps=4)
