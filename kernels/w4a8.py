"""W4A8: NVFP4 / MXFP4 weights times FP8 activations on the FP8 tensor cores (issue 44).

y[M, N] = x[M, K] @ dequant(W)^T (+ bias), computed as

    y[m, n] = sx[m] * cs[n] * sum_k q(x)[m, k] * w8[n, k]

* activations: one E4M3 row per token, `sx = max(amax_row, 1e-12) / 448`, `q(x) = RNE(x / sx)` (the FP8_DYNAMIC
  scheme; `quantize_rows`, a small Triton pass before the GEMM);
* weights: widened to E4M3 in registers from the resident repacked FP4 bytes (`fp4.repack_fp4`) and the module's
  16-bit block scales (`fp4.kernel_scales`, the same set the W4A16 kernel reads, so nothing new stays resident
  except two fp32 numbers per output channel):  `w8[n, k] = E4M3_RNE(code * s_blk * 2**e[n])`;
* `e[n]` is a per-channel power of two chosen at load so that `6 * max_blk s_blk * 2**e[n] <= 448`, and
  `cs[n] = 2**-e[n] / G` (NVFP4, G the global scale) or `2**-e[n]` (MXFP4) undoes it in the epilogue;
* the dot is fp8 x fp8 -> fp32 (`tl.dot` on float8e4nv lowers to the FP8 wgmma on sm_90). Products of two E4M3
  values have <= 8 significant bits, so every product is exact in fp32; only the fp32 accumulation rounds.
  Hopper's FP8 wgmma keeps fewer accumulator bits than fp32 over long chains, so by default (`precise=True`) the
  kernel promotes the wgmma partial into the fp32 accumulator once per K tile (`max_num_imprecise_acc=BK`).

Exactness (the choice: fold the block scale into the weight and round once, option (a) of issue 44; exact
per-group handling is impossible here because NVFP4's scale changes every 16 along K and the FP8 MMA's K step is
32). `code * s_blk` has up to 5 significant bits (E2M1: 2, E4M3 scale: 4) and E4M3 keeps 4, so:
* NVFP4: one RNE rounding per weight, |w8 * 2**-e - code * s| <= 2**-4 |code * s| while the scaled value is a
  normal E4M3 (>= 2**-6), else <= 2**-10 * 2**-e[n] absolute (E4M3 subnormal spacing 2**-9, half of it).
  About 3/14 of the nonzero codes times half of the scales need the rounding; the rest are exact.
* MXFP4 (E8M0 power-of-two scales): `code * 2**E` has 2 significant bits, so w8 is EXACT whenever the scaled
  value is >= 2**-9, i.e. when a channel's block exponents span <= 14 binades; blocks further below the channel's
  largest flush towards the E4M3 subnormal grid (same 2**-10 * 2**-e[n] absolute bound).
* activations: |q(x) * sx - x| <= 2**-4 |x| (normal) or <= 2**-10 * sx (subnormal, |x| < 2**-6 * sx).
Per output, with both roundings: |y - y_ref| <= (2**-3 + 2**-8) * sum_k |x_k| |w_k| + (subnormal terms)
+ fp32 accumulation. Measured relative Frobenius error against the exact BF16-dequant product on Gaussian data
(CPU emulation, tests/test_w4a8.py): ~2.7e-2 NVFP4, ~2.2e-2 MXFP4 (activation rounding alone ~1.9e-2); the
W4A16 kernels are exact up to fp32 accumulation and the bf16 output. That is the price of the FP8 rate; whether
the rollout may pay it is measured (the kernel is off by default, QERL_W4A8).

`w4a8_emulate` is a torch model of exactly these roundings; the CPU tests check the Triton kernel (under
TRITON_INTERPRET=1, whose fp8 dot widens the operands exactly and multiplies in fp32) against it.
INT4 (qerl_cli.formats.int4: integers -8..7, exact in E4M3, 16-bit scales per 128) could be exact per group
(scale the fp32 partial of each 128-wide group), but no qerl kernel serves INT4 yet, so it is not covered here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from qerl_kernels._common import INTERPRET, TileConfig, cdiv, f32_path, launch_config, split_k_for
from qerl_kernels.fp4 import (
    NVFP4_F,
    e2m1_lut,
    fp4_tile_v2,
    group_size,
    grouped_pid,
    splitk_plan,
    splitk_reduce,
    store_swapped,
)
from qerl_kernels.w8 import E4M3_MAX, quantize_rows_fp8, to_e4m3

# ceil of the channel exponent so the 2**e multipliers stay finite in fp32 however odd a channel's scales are
_E_LIMIT = 120


@dataclass(frozen=True)
class W4A8Scales:
    """The per-channel numbers W4A8 derives from a module's block scales (8 bytes per output channel)."""

    exponent: torch.Tensor  # int32 [N]: e[n]
    wmul: torch.Tensor  # fp32 [N]: 2**(e[n] - F), turns the decoder's code * s * 2**F into code * s * 2**e[n]
    cscale: torch.Tensor  # fp32 [N]: 2**-e[n] / G (NVFP4) or 2**-e[n] (MXFP4), applied to the fp32 accumulator


def block_scale_values(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Block scales as fp32 values: E4M3 (NVFP4, without the global scale) or 2**(E - 127) (MXFP4)."""
    if fmt == "nvfp4":
        return scale.view(torch.float8_e4m3fn).float() if scale.dtype == torch.uint8 else scale.float()
    return torch.exp2(scale.view(torch.uint8).float() - 127.0)


def channel_exponents(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """e[n]: the largest power of two with 6 * max_blk s_blk * 2**e[n] <= 448 (0 for an all-zero channel)."""
    group_size(fmt)
    s_max = block_scale_values(scale, fmt).amax(dim=1).double() * 6.0
    pos = s_max > 0
    e = torch.floor(torch.log2(E4M3_MAX / torch.where(pos, s_max, 1.0)))
    # log2 of a ratio may land a hair off an integer: fix the floor exactly
    e = torch.where(s_max * torch.exp2(e) > E4M3_MAX, e - 1, e)
    e = torch.where(s_max * torch.exp2(e + 1) <= E4M3_MAX, e + 1, e)
    e = torch.where(pos, e, torch.zeros_like(e))
    return e.clamp(-_E_LIMIT, _E_LIMIT).to(torch.int32)


def w4a8_scales(scale: torch.Tensor, global_scale: torch.Tensor | None, fmt: str, shift: int = 0) -> W4A8Scales:
    """The load-time per-channel data for `w4a8_matmul` (`shift`: MXFP4's F, as the block scales were made with)."""
    nv = fmt == "nvfp4"
    if nv and global_scale is None:
        raise ValueError("NVFP4 needs weight_global_scale")
    F = NVFP4_F if nv else shift
    e = channel_exponents(scale, fmt)
    wmul = torch.exp2((e - F).double()).float()
    cs = torch.exp2((-e).double()).float()
    if nv:
        cs = cs / global_scale.float().reshape(1).to(cs.device)
    return W4A8Scales(e, wmul.contiguous(), cs.contiguous())


# ---- the kernels ---------------------------------------------------------------------------------
def quantize_rows(x: torch.Tensor, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8: (q(x) as E4M3 bits uint8 [M, K], sx fp32 [M]), q(x) * sx ~ x (w8's row quantizer)."""
    q, sx = quantize_rows_fp8(x, block)
    return q.view(torch.uint8), sx.view(-1)


@triton.jit
def _w4a8_kernel(xq_ptr, sx_ptr, w_ptr, ks_ptr, wmul_ptr, cs_ptr, bias_ptr, y_ptr, ws_ptr,
                 M, N, K, stride_xm, stride_ym, k_split,
                 NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 F32: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TILED: tl.constexpr,
                 PRECISE: tl.constexpr, SWAP: tl.constexpr):
    # SWAP (swap-AB): the decoded weight tile is the wgmma's A operand from registers; otherwise the activations
    # are A and the widened weight goes through shared memory as B (both K-major, as FP8 wgmma requires)
    pid_m, pid_n = grouped_pid(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, K)
    wmul = tl.load(wmul_ptr + offs_n, mask=n_mask, other=0.0)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        # code * s * 2**F, exact in fp32 (F32) or bf16; times 2**(e - F) is exact too; the cast is the one rounding
        w = fp4_tile_v2(w_ptr, ks_ptr, offs_n, k0, N, K, BN, BK, NVFP4, F32, False, EVEN_N, EVEN_K, TILED)
        w8 = to_e4m3(w.to(tl.float32) * wmul[:, None], F32)
        offs_k = k0 + tl.arange(0, BK)
        x_ptrs = xq_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        if EVEN_K:
            xb = tl.load(x_ptrs, mask=m_mask[:, None], other=0)
        else:
            xb = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < K), other=0)
        x8 = xb.to(tl.float8e4nv, bitcast=True)
        if SWAP:
            a, b = w8, tl.trans(x8)
        else:
            a, b = x8, tl.trans(w8)
        if PRECISE:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
        else:
            acc = tl.dot(a, b, acc)
    if not SWAP:
        acc = tl.trans(acc)
    cs = tl.load(cs_ptr + offs_n, mask=n_mask, other=0.0)
    sx = tl.load(sx_ptr + offs_m, mask=m_mask, other=0.0)
    acc = (acc * cs[:, None]) * sx[None, :]
    store_swapped(acc, y_ptr, ws_ptr, bias_ptr, pid_k, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym,
                  HAS_BIAS, SPLIT)


# ---- tile configs: a heuristic per M bucket, optionally timed among a few ------------------------
M_BUCKETS = (64, 128, 256)


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def _with_split(bm: int, bn: int, bk: int, warps: int, stages: int, m: int, n: int, k: int, sms: int) -> TileConfig:
    # one wave is enough at these sizes: every CTA already runs >= 64 x 128 x K of MMA
    tiles = cdiv(m, bm) * cdiv(n, bn)
    return TileConfig(bm, bn, bk, warps, stages, split_k_for(tiles, k, bk, sms, max_split=4, waves=1))


def candidate_configs(m: int, n: int, k: int, sms: int = 132) -> list[TileConfig]:
    """The few tile shapes worth timing at M rows; the first is the untimed default (BM covers M up to 256, so
    each weight tile leaves HBM once per M tile)."""
    b = m_bucket(m)
    if b == 64:
        shapes = [(64, 128, 128, 4, 4), (64, 128, 128, 4, 3), (64, 64, 128, 4, 4)]
    elif b == 128:
        shapes = [(128, 128, 128, 8, 3), (128, 128, 128, 4, 4), (128, 64, 128, 4, 4)]
    else:
        shapes = [(256, 128, 128, 8, 3), (128, 128, 128, 8, 3), (256, 64, 128, 8, 3)]
    return [_with_split(*s, m, n, k, sms) for s in shapes]


_TUNED: dict[tuple, TileConfig] = {}
_TUNE_LOCK = threading.Lock()


def tuned_config(run, m: int, n: int, k: int, sms: int, tune: bool, tag: tuple = ()) -> TileConfig:  # noqa: ANN001
    """The config for (M bucket, N, K): the default, or (tune, on the GPU) the fastest candidate by
    `triton.testing.do_bench`, measured once per process (`run(cfg)` launches one)."""
    cands = candidate_configs(m, n, k, sms)
    if not tune or INTERPRET or torch.cuda.is_current_stream_capturing():
        return _TUNED.get((m_bucket(m), n, k, tag), cands[0])
    key = (m_bucket(m), n, k, tag)
    with _TUNE_LOCK:
        if key not in _TUNED:
            times = [triton.testing.do_bench(lambda c=c: run(c), warmup=5, rep=20, return_mode="median")
                     for c in cands]
            _TUNED[key] = cands[min(range(len(cands)), key=times.__getitem__)]
    return _TUNED[key]


# ---- host side -----------------------------------------------------------------------------------
def w4a8_matmul(x: torch.Tensor, repacked: torch.Tensor, kscales: torch.Tensor, scales: W4A8Scales, fmt: str,
                *, tiled: bool = False, bias: torch.Tensor | None = None, cfg: TileConfig | None = None,
                tune: bool = False, precise: bool = True, swap: bool = False, sms: int = 132) -> torch.Tensor:
    """y[M, N] = x @ dequant(W)^T (+ bias) on the FP8 tensor cores, y in x's dtype.

    `repacked` is `fp4.repack_fp4(packed, tiled)`, `kscales` the matching `fp4.kernel_scales(scale, fmt, bf16,
    shift, tiled)` (the set the W4A16 kernel reads for bf16 activations), `scales` is `w4a8_scales(...)`.
    Needs K % 128 == 0 (the repacked layout's unit); the activations are quantized per token first.
    """
    n, k = repacked.shape[0], repacked.shape[1] * 2
    if k % 128:
        raise ValueError(f"W4A8 reads the repacked FP4 layout, which needs K % 128 == 0; got K={k}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight K={k}")
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"W4A8 covers nvfp4 and mxfp4, not {fmt!r}")
    m = x.shape[0]
    xb, sx = quantize_rows(x if x.stride(1) == 1 else x.contiguous())
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def run(c: TileConfig) -> torch.Tensor:
        c = launch_config(c)
        split, k_split, ws = splitk_plan(m, n, k, c, y)
        _w4a8_kernel[(cdiv(m, c.bm) * cdiv(n, c.bn), split)](
            xb, sx, repacked, kscales, scales.wmul, scales.cscale, bias if bias is not None else y, y, ws,
            m, n, k, xb.stride(0), y.stride(0), k_split,
            NVFP4=fmt == "nvfp4", HAS_BIAS=bias is not None and split == 1, SPLIT=split > 1,
            BM=c.bm, BN=c.bn, BK=c.bk, GROUP_M=8, F32=f32_path(x), EVEN_N=n % c.bn == 0, EVEN_K=k % c.bk == 0,
            TILED=tiled, PRECISE=precise, SWAP=swap, num_warps=c.warps, num_stages=c.stages)
        if split > 1:
            splitk_reduce(ws, bias, y, split)
        return y

    return run(cfg if cfg is not None else tuned_config(run, m, n, k, sms, tune, (precise, swap)))


# ---- the torch model of the kernel's arithmetic ----------------------------------------------------
def fp4_codes_times_scales(packed: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """code * s_blk [N, K] in fp32 (exact) from checkpoint-order tensors; the NVFP4 global scale is not applied."""
    g = group_size(fmt)
    lut = e2m1_lut(packed.device)
    b = packed.to(torch.int64)
    codes = torch.stack((lut[b & 15], lut[b >> 4]), dim=-1).reshape(packed.shape[0], -1)
    n, k = codes.shape
    s = block_scale_values(scale, fmt)
    return (codes.reshape(n, k // g, g) * s.unsqueeze(-1)).reshape(n, k)


def quantize_rows_emulated(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch: (q(x) as fp32 values [M, K], sx fp32 [M])."""
    xf = x.float()
    sx = xf.abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
    q = (xf / sx[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return q, sx


def widened_weight(packed: torch.Tensor, scale: torch.Tensor, scales: W4A8Scales, fmt: str) -> torch.Tensor:
    """w8 [N, K] as fp32 values: E4M3_RNE(code * s * 2**e[n]), what the kernel feeds the tensor cores."""
    cs = fp4_codes_times_scales(packed, scale, fmt)
    return (cs * torch.exp2(scales.exponent.float())[:, None]).to(torch.float8_e4m3fn).float()


def w4a8_emulate(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scales: W4A8Scales, fmt: str,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's result with its roundings (activation and weight to E4M3, the epilogue's fp32 products),
    the dot summed exactly (float64 of exact fp8 products) then rounded once to fp32; fp32 out."""
    q, sx = quantize_rows_emulated(x)
    w8 = widened_weight(packed, scale, scales, fmt)
    acc = (q.double() @ w8.double().T).float()
    y = (acc * scales.cscale[None, :]) * sx[:, None]
    if bias is not None:
        y = y + bias.float()[None, :]
    return y


def w4a8_error_bound(x: torch.Tensor, w_ref: torch.Tensor, scales: W4A8Scales) -> torch.Tensor:
    """Elementwise bound on |w4a8 - x @ w_ref^T| for the exact dequantized weight `w_ref` [N, K] (fp32 model):
    both E4M3 roundings (relative 2**-4 each, or the subnormal absolute terms) and the fp32 accumulation."""
    xf, wf = x.double(), w_ref.double()
    sx = xf.abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
    # absolute error of one element: relative 2**-4 or half the subnormal spacing, whichever is larger
    dx = torch.maximum(xf.abs() * 2.0**-4, sx[:, None] * 2.0**-10)
    # a w8 unit is cscale[n] in the weight's own units (2**-e[n] / G)
    dw = torch.maximum(wf.abs() * 2.0**-4, scales.cscale.double()[:, None] * 2.0**-10)
    k = x.shape[1]
    first = dx @ wf.abs().T + xf.abs() @ dw.T + dx @ dw.T
    return first + (xf.abs() + dx) @ (wf.abs() + dw).T * (k * 2.0**-23)
