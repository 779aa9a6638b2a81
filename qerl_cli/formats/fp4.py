"""FP4 E2M1 codes, their packing, and the FP8 E4M3 / E8M0 scale encodings (docs/formats.md).

Code bits are `s e e m`; magnitudes by code 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6. Rounding is
round-to-nearest-even with saturation at +-6; the boundaries below are exactly those of
compressed-tensors' `cast_to_fp4` (ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
"""

from __future__ import annotations

import functools

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# compressed-tensors replaces a zero FP8 block scale by the E4M3 epsilon (2**-3) so dequant never divides by 0.
E4M3_EPS = float(torch.finfo(torch.float8_e4m3fn).eps)

# Upper bounds of each magnitude bin, and whether the bound itself belongs to the lower bin (RNE ties).
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
# Ties at 0.25, 1.25, 2.5 and 5.0 round down (to the even code); ties at 0.75, 1.75 and 3.5 round up.
_TIE_DOWN = torch.tensor([True, False, True, False, True, False, True])


def e2m1_table(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 values of FP4 E2M1 indexed by code (sign in bit 3). Cached per (device, dtype): building it
    copies from the host, which a CUDA graph capture (the rollout engine's decode) forbids. Read-only."""
    return _e2m1_table(str(torch.device(device)), dtype)


@functools.cache
def _e2m1_table(device: str, dtype: torch.dtype) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round x (already divided by its scale) to E2M1 codes (uint8 0..15), RNE, saturating at +-6.

    The sign bit follows the sign of x, so a small negative value that rounds to zero gets code 8
    (negative zero), exactly as compressed-tensors packs it.
    """
    x = x.float()
    mag = x.abs().clamp(max=E2M1_MAX)
    bounds = _BOUNDS.to(x.device)
    tie_down = _TIE_DOWN.to(x.device)
    # code = number of bin boundaries strictly below mag (or at-or-below for tie-up boundaries)
    above = (mag.unsqueeze(-1) > bounds) | ((mag.unsqueeze(-1) == bounds) & ~tie_down)
    code = above.sum(-1).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return e2m1_table(codes.device, dtype)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K/2] uint8; element 2j in the LOW nibble, 2j+1 in the HIGH nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even to float8_e4m3fn (`.to(float8)` alone does not saturate)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """OCP-MX E8M0 block exponent for FP4 elements, as compressed-tensors computes it.

    amax is first rounded to the E2M1 mantissa grid (up to the next power of two when its mantissa
    fraction is >= 0.75), then exponent = floor(log2(amax_r)) - 2 (2 = floor(log2(6))), biased by 127.
    A zero block gets code 0 (scale 2**-127).
    """
    amax = amax.float()
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    floor_log2 = exp.to(torch.int32) - 1 + (mant >= 0.875).to(torch.int32)
    code = (floor_log2 - 2 + 127).clamp(0, 255)
    code = torch.where(amax > 0, code, torch.zeros_like(code))
    return code.to(torch.uint8)


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    return torch.exp2(code.to(torch.float32) - 127.0)


def dequantize_fp4_blocks(packed: torch.Tensor, block_scale: torch.Tensor, block: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """[N, K] weight from packed E2M1 codes and one fp32 scale per block of ``block`` along K (NVFP4 passes its
    effective scale S_blk / G, MXFP4 its power of two)."""
    q = e2m1_decode(unpack_fp4(packed))
    n, k = q.shape
    return (q.reshape(n, k // block, block) * block_scale.unsqueeze(-1)).reshape(n, k).to(dtype)
