"""Reference quantize/dequantize for every qerl weight format, in plain torch (CPU and CUDA).

Bit-exact to REFERENCE.md sections 1-2 and to compressed-tensors' own arithmetic (same rounding,
same order of operations: the effective scale `S_blk / G` is formed first, as compressed-tensors
and vLLM do). Kernels are tested against these functions. Weights are [N = out, K = in]; blocks run
along K. Tensor names are the compressed-tensors (or bitsandbytes) checkpoint names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qerl_cli.formats.fp4 import (
    E2M1_MAX,
    E4M3_EPS,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e8m0_from_amax,
    e8m0_to_float,
    pack_fp4,
    to_e4m3,
    unpack_fp4,
)

NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


@dataclass(frozen=True)
class FormatSpec:
    name: str
    bits: float  # storage bits per weight including scales (for the size table)
    group_size: int | None  # block along K (None: per channel / not blocked)
    ct_format: str | None  # compressed-tensors format string; None for non-c-t formats
    ct_preset: str | None  # compressed-tensors preset scheme name
    fused_global_scale: bool = False  # q/k/v and gate/up share one global scale
    description: str = ""


FORMATS: dict[str, FormatSpec] = {
    "nvfp4": FormatSpec("nvfp4", 4.5, 16, "nvfp4-pack-quantized", "NVFP4A16", True,
                        "FP4 E2M1, blocks of 16 with FP8 E4M3 scales and an FP32 global scale"),
    "mxfp4": FormatSpec("mxfp4", 4.25, 32, "mxfp4-pack-quantized", "MXFP4A16", False,
                        "FP4 E2M1, blocks of 32 with E8M0 power-of-two scales"),
    "int4": FormatSpec("int4", 4.125, 128, "pack-quantized", "W4A16", False,
                       "symmetric INT4, groups of 128 (64/32 where K needs it), 16-bit scales"),
    "int8": FormatSpec("int8", 8.0, None, "int-quantized", "W8A8", False, "symmetric INT8, per-channel scales"),
    "fp8": FormatSpec("fp8", 8.0, None, "float-quantized", "FP8_DYNAMIC", False,
                      "FP8 E4M3, per-channel scales"),
    "nf4": FormatSpec("nf4", 4.5, 64, None, None, False, "bitsandbytes NF4, blocks of 64 over the flat tensor"),
    "bf16": FormatSpec("bf16", 16.0, None, None, None, False, "unquantized bfloat16"),
}


@dataclass
class QuantizedWeight:
    """A quantized [N, K] weight: its checkpoint tensors plus what is needed to read them back."""

    fmt: str
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor]
    dtype: torch.dtype = torch.bfloat16  # dtype the weight dequantizes to (the model's)
    group_size: int | None = None
    meta: dict[str, object] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    n, k = w.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    return w.reshape(n, k // block, block)


# ---- NVFP4 --------------------------------------------------------------------------------------
def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """G = 448*6/amax as float32 [1] (compressed-tensors' weight_global_scale); amax 0 -> G 1."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    g = (E4M3_MAX * E2M1_MAX) / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    wf = w.float()
    if global_scale is None:
        global_scale = nvfp4_global_scale(wf.abs().max())
    g = global_scale.float().reshape(1).to(w.device)
    blk = _blocks(wf, 16)
    amax_blk = blk.abs().amax(-1)
    scale = to_e4m3(amax_blk / E2M1_MAX * g).float()
    scale = torch.where(scale == 0, torch.full_like(scale, E4M3_EPS), scale)
    eff = scale / g
    codes = e2m1_encode((blk / eff.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)).reshape(w.shape)
    return {
        "weight_packed": pack_fp4(codes),
        "weight_scale": scale.to(torch.float8_e4m3fn),
        "weight_global_scale": g.clone(),
    }


def dequantize_nvfp4(t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    q = e2m1_decode(unpack_fp4(t["weight_packed"]))
    n, k = q.shape
    eff = t["weight_scale"].float() / t["weight_global_scale"].float()
    return (q.reshape(n, k // 16, 16) * eff.unsqueeze(-1)).reshape(n, k).to(dtype)


# ---- MXFP4 --------------------------------------------------------------------------------------
def quantize_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    blk = _blocks(w.float(), 32)
    code = e8m0_from_amax(blk.abs().amax(-1))
    scale = e8m0_to_float(code)
    codes = e2m1_encode((blk / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)).reshape(w.shape)
    return {"weight_packed": pack_fp4(codes), "weight_scale": code}


def dequantize_mxfp4(t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    q = e2m1_decode(unpack_fp4(t["weight_packed"]))
    n, k = q.shape
    scale = e8m0_to_float(t["weight_scale"])
    return (q.reshape(n, k // 32, 32) * scale.unsqueeze(-1)).reshape(n, k).to(dtype)


# ---- INT4 (compressed-tensors pack-quantized) -----------------------------------------------------
def int4_group_size(k: int, preferred: int = 128) -> int:
    """Group 128 as the spec says; 64 or 32 only where K is not a multiple of 128 (e.g. SmolLM2's 576)."""
    for g in (preferred, 64, 32):
        if k % g == 0:
            return g
    raise ValueError(f"K={k} is not a multiple of 32; INT4 groups need it")


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    n, k = w.shape
    blk = _blocks(w.float(), group_size)
    scale = (blk.abs().amax(-1) / 7.5).to(scale_dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, _eps(scale_dtype)), scale)
    q = torch.round((blk / scale.float().unsqueeze(-1)).clamp(-8, 7)).to(torch.int32).reshape(n, k)
    u = (q + 8).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int64)
    packed = (u.to(torch.int64) << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement view
    return {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] int8 values in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    u = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (u - 8).to(torch.int8).flatten(-2)


def dequantize_int4(t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(t["weight_packed"]).float()
    n, k = q.shape
    scale = t["weight_scale"]
    g = k // scale.shape[1]
    return (q.reshape(n, k // g, g) * scale.float().unsqueeze(-1)).reshape(n, k).to(dtype)


# ---- INT8 / FP8 per channel ----------------------------------------------------------------------
def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().amax(-1, keepdim=True) / 127.5).to(scale_dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, _eps(scale_dtype)), scale)
    q = torch.round((w.float() / scale.float()).clamp(-128, 127)).to(torch.int8)
    return {"weight": q, "weight_scale": scale}


def quantize_fp8(w: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().amax(-1, keepdim=True) / E4M3_MAX).to(scale_dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, _eps(scale_dtype)), scale)
    return {"weight": to_e4m3(w.float() / scale.float()), "weight_scale": scale}


def dequantize_per_channel(t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return (t["weight"].float() * t["weight_scale"].float()).to(dtype)


# ---- NF4 (bitsandbytes) ---------------------------------------------------------------------------
def quantize_nf4(w: torch.Tensor, blocksize: int = 64) -> dict[str, torch.Tensor]:
    flat = w.float().flatten()
    if flat.numel() % blocksize:
        raise ValueError(f"NF4 needs numel divisible by {blocksize}, got {flat.numel()}")
    blk = flat.reshape(-1, blocksize)
    absmax = blk.abs().amax(-1)
    normed = blk / absmax.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    code = torch.tensor(NF4_CODE, device=w.device)
    # nearest codebook entry; argmin takes the lower index on an exact tie
    idx = (normed.unsqueeze(-1) - code).abs().argmin(-1).to(torch.uint8).flatten()
    packed = (idx[0::2] << 4) | idx[1::2]  # FIRST element in the HIGH nibble (bitsandbytes order)
    return {"weight": packed.reshape(-1, 1), "absmax": absmax, "quant_map": code.clone()}


def dequantize_nf4(t: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype,
                   blocksize: int = 64) -> torch.Tensor:
    p = t["weight"].flatten()
    idx = torch.stack([p >> 4, p & 0x0F], dim=-1).flatten().long()
    vals = t["quant_map"].float()[idx].reshape(-1, blocksize) * t["absmax"].float().unsqueeze(-1)
    return vals.reshape(shape).to(dtype)


# ---- dispatch -------------------------------------------------------------------------------------
def quantize(
    w: torch.Tensor,
    fmt: str,
    *,
    global_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> QuantizedWeight:
    """Quantize an [N, K] weight. `dtype` is the model dtype the weight dequantizes to (and, for
    INT4/INT8/FP8, the dtype of the stored scales)."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    shape = (int(w.shape[0]), int(w.shape[1]))
    if fmt == "nvfp4":
        t, gs = quantize_nvfp4(w, global_scale), 16
    elif fmt == "mxfp4":
        t, gs = quantize_mxfp4(w), 32
    elif fmt == "int4":
        gs = group_size or int4_group_size(shape[1])
        t = quantize_int4(w, gs, dtype)
    elif fmt == "int8":
        t, gs = quantize_int8(w, dtype), None
    elif fmt == "fp8":
        t, gs = quantize_fp8(w, dtype), None
    elif fmt == "nf4":
        t, gs = quantize_nf4(w), 64
    elif fmt == "bf16":
        t, gs = {"weight": w.to(torch.bfloat16)}, None
    else:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return QuantizedWeight(fmt, shape, t, dtype, gs)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = dtype or qw.dtype
    t = qw.tensors
    if qw.fmt == "nvfp4":
        return dequantize_nvfp4(t, dtype)
    if qw.fmt == "mxfp4":
        return dequantize_mxfp4(t, dtype)
    if qw.fmt == "int4":
        return dequantize_int4(t, dtype)
    if qw.fmt in ("int8", "fp8"):
        return dequantize_per_channel(t, dtype)
    if qw.fmt == "nf4":
        return dequantize_nf4(t, qw.shape, dtype)
    if qw.fmt == "bf16":
        return t["weight"].to(dtype)
    raise ValueError(f"unknown format {qw.fmt!r}")
