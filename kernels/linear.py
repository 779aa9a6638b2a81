"""`quant_linear(x, module)`: run a `QuantLinear` through qerl's kernels, forward and backward.

FP4 (NVFP4/MXFP4) dispatch by M, the rows of activations (thresholds from the H200 runs in
docs/benchmarks.md):
- M <= 16 (decode): fused dequantize-GEMM on the load-time repacked weight (`fp4.repack_fp4`, tiled),
  16-row activation tile, split-K to ~6 CTAs per SM, reduced in the same launch in fixed order;
- 16 < M < `LARGE_M_DEQUANT` (512): the same kernel with 64/128/256-row activation tiles, split-K with a
  second fixed-order reduction pass when tiles are few;
- M >= 512: the exact Triton dequantizer into a transient bf16 weight, then cuBLAS (it measured faster).
- on Hopper, qerl's CUDA C++ kernel (`cuda_fp4`, backend `cuda`) on the same repacked bytes, a candidate
  that `dispatch` measures next to these.
Both reductions are deterministic (no float atomics). INT8/FP8 use the W8A16 kernels at every M, so
decode, prefill and the training forward compute one function (rollout-vs-training mismatch stays at the
BF16 level). `QERL_FP8_ACT=auto` opts in to the FP8xFP8 tensor-core path for bf16 activations at
M >= `FP8_ACT_MIN_M` (per-token activation scales: the FP8_DYNAMIC scheme, 1.1-1.5x faster there), at the
price of a training forward that differs from the decode path (k3 2.6e-2 measured on the embedded model).

Backward is `QuantLinearFunction`: it saves no tensor (the frozen weight has no gradient and dx does
not need x) and computes dx = dy @ dequant(W) with the transposed fused kernel; from
`LARGE_M_DEQUANT_T` rows (1024) it dequantizes one layer's weight transiently and calls cuBLAS, which
was 1.8x faster at M = 2048 (set QERL_FP4_DEQUANT_T_M very high to never build that transient copy).
The FP4 weight is repacked at load IN PLACE (`module._layout`, see `qerl_cli.qlinear.PackedLayout`), so
the GPU holds one copy of it: the fused kernel reads it, and the large-M forward and every backward
dequantize it with `fp4_dequantize_v2` (bit-identical to the reference) into a transient bf16 weight for
cuBLAS. State dicts, `quantized_weight` and `.to()` still see the checkpoint order. QERL_FP4_REPACK=0 keeps
the checkpoint order (slower checkpoint-layout kernels). Which kernel runs at each M is `dispatch.choose`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import triton
from qerl_kernels._common import INTERPRET, TileConfig, num_sms, split_k_for
from qerl_kernels.dispatch import BACKENDS, get_backend, set_backend  # noqa: F401 - the override API
from qerl_kernels.fp4 import (
    fp4_dequantize,
    fp4_dequantize_v2,
    fp4_matmul,
    fp4_matmul_t,
    fp4_matmul_v2,
    kernel_scales,
    mxfp4_shift,
)
from qerl_kernels.w8 import fp8_scaled_matmul, w8_matmul, w8_matmul_t

if TYPE_CHECKING:
    from torch import nn

FP4_FORMATS = ("nvfp4", "mxfp4")
W8_FORMATS = ("int8", "fp8")
SUPPORTED = FP4_FORMATS + W8_FORMATS

# Rows from which a transient dequantized weight + cuBLAS beats the fused kernel (H100/H200, measured by
# `qerl bench kernels`); the backward product switches at its own threshold.
LARGE_M_DEQUANT = int(os.environ.get("QERL_FP4_DEQUANT_M", "512"))
LARGE_M_DEQUANT_T = int(os.environ.get("QERL_FP4_DEQUANT_T_M", "1024"))
FP8_ACT_MIN_M = int(os.environ.get("QERL_FP8_ACT_MIN_M", "64"))

# The repacked FP4 layout (fp4.repack_fp4) replaces the checkpoint byte order in place at load;
# QERL_FP4_REPACK=0 keeps the checkpoint order (slower kernel, no repack).
REPACK = os.environ.get("QERL_FP4_REPACK", "1") != "0"


def _fp8_act_mode() -> str:
    return os.environ.get("QERL_FP8_ACT", "0")


# ---- launch configurations -----------------------------------------------------------------------
def fp4_config(m: int, n: int, k: int, sms: int = 132, repacked: bool = True) -> TileConfig:
    """Tile shape for the fused FP4 kernel at M rows (from `python -m qerl_kernels.tune` on an H200)."""
    if not repacked:  # checkpoint-layout kernel (fp4_matmul)
        if m <= 16:
            bm, bn, bk, warps, stages = 16, 64, 256, 4, 4
        elif m <= 64:
            bm, bn, bk, warps, stages = 64, 128, 128, 4, 4
        else:
            bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        return TileConfig(bm, bn, bk, warps, stages, split_k_for(tiles, k, bk, sms))
    # repacked (tiled) kernel, from the sweep of one Qwen2.5-7B layer on an H200 (docs/benchmarks.md)
    waves, max_split = 2, 16
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
        waves = 6  # decode is latency-bound: ~6 CTAs per SM keep enough weight loads in flight
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 128, 128, 4, 3
        max_split = 8
    elif m <= 128:
        bm, bn, bk, warps, stages = 128, 128, 128, 8, 3
        max_split = 8
    else:
        bm, bn, bk, warps, stages = 256, 128, 128, 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    return TileConfig(bm, bn, bk, warps, stages, split_k_for(tiles, k, bk, sms, max_split, waves))


def fp4_t_config(m: int, n: int, k: int) -> TileConfig:
    """Tile shape for dx = dy @ dequant(W) (output tile [bm, bk], reduction over N in steps of bn)."""
    if m <= 64:
        return TileConfig(64, 128, 64, 4, 4)
    return TileConfig(128, 64, 128, 8, 3)


def w8_config(m: int, n: int, k: int, sms: int = 132) -> TileConfig:
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 128, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = max(16, triton.next_power_of_2(m)), 128, 128, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    return TileConfig(bm, bn, bk, warps, stages, split_k_for(tiles, k, bk, sms))


def w8_t_config(m: int, n: int, k: int) -> TileConfig:
    return TileConfig(64, 64, 64, 4, 3) if m <= 64 else TileConfig(128, 64, 128, 8, 3)


# ---- per-module state (load-time, cached in module.kernel_layout_state) ----------------------------------
@dataclass
class KernelState:
    key: tuple
    fmt: str
    n: int
    k: int
    shift: int = 0  # MXFP4 exponent shift F (see fp4.py)
    repacked: torch.Tensor | None = None  # the module's own weight_packed, repacked in place (fp4.repack_fp4)
    tiled: bool = False  # repacked in 4 KB chunks (N % 64 == 0 too)
    kscales: dict = field(default_factory=dict)  # activation dtype -> fp4.kernel_scales(...) (`block_scales`)
    fp8_scale_row: torch.Tensor | None = None  # FP8 weight scale as fp32 [1, N] for torch._scaled_mm
    extra: dict = field(default_factory=dict)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: getattr(module, name) for name in module.tensor_names}


def _key(module: nn.Module) -> tuple:
    return tuple((name, t.data_ptr(), t.device, t.dtype) for name, t in _tensors(module).items())


def kernel_state(module: nn.Module) -> KernelState:
    """Derived, load-time data for `module` (rebuilt when its buffers move or change)."""
    key = _key(module)
    st = getattr(module, "kernel_layout_state", None)
    if isinstance(st, KernelState) and st.key == key:
        return st
    t = _tensors(module)
    st = KernelState(key, module.fmt, module.out_features, module.in_features)
    if module.fmt == "mxfp4":
        st.shift = mxfp4_shift(t["weight_scale"])
    layout = getattr(module, "_layout", None)
    if module.fmt in FP4_FORMATS and REPACK and module.in_features % 128 == 0 and layout is not None:
        layout.repack_in_place(tiled=module.out_features % 64 == 0)
        st.tiled = layout.kind == "tiled"
        st.repacked = t["weight_packed"]
    if module.fmt == "fp8":
        st.fp8_scale_row = t["weight_scale"].float().reshape(1, -1).contiguous()
    module.kernel_layout_state = st
    return st


def block_scales(module: nn.Module, st: KernelState, dtype: torch.dtype) -> torch.Tensor:
    """`fp4.kernel_scales` of a repacked module for activations of `dtype`, made once per storage: a part of a
    fused q/k/v or gate/up (`QuantLinear.fused_rows`) takes its rows of the fused module's set, so the training
    forward (parts) and the rollout (fused) do not each keep one (0.125 byte per NVFP4 weight). Valid because the
    tiled scale layout, like the tiled weight, only reorders within 64-row blocks, and parts start on them."""
    ks = st.kscales.get(dtype)
    if ks is not None:
        return ks
    fused_rows = getattr(module, "fused_rows", None)
    owner = fused_rows() if callable(fused_rows) else None
    if owner is not None:
        fused, row = owner
        fst = kernel_state(fused)
        aligned = not st.tiled or row % 64 == 0
        if fst.repacked is not None and (fst.tiled, fst.shift) == (st.tiled, st.shift) and aligned:
            ks = block_scales(fused, fst, dtype)[row:row + st.n]
    if ks is None:
        ks = kernel_scales(_tensors(module)["weight_scale"], st.fmt, dtype, st.shift, tiled=st.tiled)
    st.kscales[dtype] = ks
    return ks


# ---- forward / backward on 2-D activations ---------------------------------------------------------
def _use_fp8_act(x: torch.Tensor, st: KernelState) -> bool:
    mode = _fp8_act_mode()
    if st.fmt != "fp8" or mode == "0" or INTERPRET or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9) or st.k % 16 or st.n % 16:
        return False
    return mode == "1" or x.shape[0] >= FP8_ACT_MIN_M


def fp4_fused(x: torch.Tensor, module: nn.Module, cfg: TileConfig | None = None) -> torch.Tensor:
    """The fused FP4 kernel (repacked layout when the state has it), bias included."""
    st = kernel_state(module)
    t = _tensors(module)
    gs = t.get("weight_global_scale")
    m = x.shape[0]
    if st.repacked is not None:
        cfg = cfg or fp4_config(m, st.n, st.k, num_sms(x.device))
        ks = block_scales(module, st, x.dtype)
        return fp4_matmul_v2(x, st.repacked, ks, gs, st.fmt, cfg, shift=st.shift, bias=module.bias, tiled=st.tiled)
    cfg = cfg or fp4_config(m, st.n, st.k, num_sms(x.device), repacked=False)
    return fp4_matmul(x, t["weight_packed"], t["weight_scale"], gs, st.fmt, cfg, bias=module.bias, shift=st.shift)


def cuda_supported(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether qerl's CUDA C++ kernel (`cuda_fp4`) can run this forward: Hopper, the library builds, the
    weight holds the in-place repack, N % 16 == 0 and K % 128 == 0, 16-bit activations."""
    from qerl_kernels import cuda_fp4

    if INTERPRET or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if module.fmt not in FP4_FORMATS or not cuda_fp4.supports(module.out_features, module.in_features):
        return False
    return kernel_state(module).repacked is not None and cuda_fp4.available(x.device)


def cuda_fused(x: torch.Tensor, module: nn.Module, lora_h: torch.Tensor | None = None,
               lora_b: torch.Tensor | None = None) -> torch.Tensor:
    """qerl's CUDA C++ FP4 kernel on the module's resident repack and checkpoint block scales (no extra
    weight copy; the fp32 bias is the one derived tensor, cached); with `lora_h` [M, R] and `lora_b` [N, R] the
    LoRA expand lora_h @ lora_b^T is added in the kernel's epilogue."""
    from qerl_kernels import cuda_fp4

    st = kernel_state(module)
    if st.repacked is None:
        raise ValueError("the CUDA FP4 kernel reads the repacked layout (K % 128 == 0, QERL_FP4_REPACK=1)")
    t = _tensors(module)
    bias = None
    if module.bias is not None:
        bias = st.extra.get("bias_f32")
        if bias is None:
            bias = st.extra["bias_f32"] = module.bias.detach().float().contiguous()
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    return cuda_fp4.fp4_gemm(x, st.repacked, t["weight_scale"], t.get("weight_global_scale"), st.fmt,
                             tiled=st.tiled, shift=st.shift, bias=bias, lora_h=lora_h, lora_b=lora_b)


def cuda_lora_supported(module: nn.Module, x: torch.Tensor, rank: int) -> bool:
    """Whether `cuda_fused(x, module, lora_h, lora_b)` can fuse a rank-`rank` expand into this forward."""
    from qerl_kernels import cuda_fp4

    return cuda_supported(module, x) and cuda_fp4.supports_lora_epilogue(module.out_features, module.in_features,
                                                                         rank)


def dequantized(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """dequant(W) [N, K] from whichever byte order the module holds (transient; exact)."""
    st = kernel_state(module)
    t = _tensors(module)
    gs = t.get("weight_global_scale")
    if st.repacked is not None:
        return fp4_dequantize_v2(st.repacked, t["weight_scale"], gs, st.fmt, dtype, tiled=st.tiled)
    return fp4_dequantize(t["weight_packed"], t["weight_scale"], gs, st.fmt, dtype)


def dequant_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """The large-M path: a transient dequantized weight, then cuBLAS."""
    bias = module.bias
    return torch.nn.functional.linear(x, dequantized(module, x.dtype), None if bias is None else bias.to(x.dtype))


def linear_forward(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """y = x @ dequant(W)^T + b for 2-D contiguous-rows x [M, K] (no autograd)."""
    st = kernel_state(module)
    t = _tensors(module)
    m = x.shape[0]
    bias = module.bias
    sms = num_sms(x.device)
    if st.fmt in FP4_FORMATS:
        if INTERPRET:
            return fp4_fused(x, module)
        from qerl_kernels import dispatch

        return forward_by(dispatch.choose(module, x), x, module)
    if _use_fp8_act(x, st):
        return fp8_scaled_matmul(x, t["weight"], st.fp8_scale_row, None if bias is None else bias.to(x.dtype))
    return w8_matmul(x, t["weight"], t["weight_scale"], w8_config(m, st.n, st.k, sms), bias=bias)


def forward_by(backend: str, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """An FP4 forward through one backend ('triton' | 'cuda' | 'cublas' | 'humming')."""
    from qerl_kernels import dispatch

    if backend == "cublas":
        return dequant_linear(x, module)
    if backend == "humming":
        return dispatch.humming_forward(module, x)
    if backend == "cuda":
        return cuda_fused(x, module)
    return fp4_fused(x, module)


def forward_with_lora(x: torch.Tensor, module: nn.Module, lora_h: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """y = module(x) + lora_h @ lora_b^T for 2-D contiguous-rows x [M, K] (no autograd: the rollout's decode step).
    `lora_h` [M, R] is the shrink (x A^T, computed where x was made), `lora_b` [N, R] the expand already scaled
    (block-diagonal for a fused q/k/v or gate/up group), both in x's dtype. The backend is the dispatcher's choice
    for (shape, M bucket, R) (`dispatch.choose(module, x, lora_rank=R)`): qerl's CUDA kernel with the expand in
    its epilogue (one launch, one rounding) or another backend followed by one in-place addmm."""
    from qerl_kernels import dispatch

    if module.fmt not in FP4_FORMATS or INTERPRET or not x.is_cuda:
        y = module(x)
        return y.addmm_(lora_h, lora_b.t())
    backend = dispatch.choose(module, x, lora_rank=lora_h.shape[1])
    if backend == "cuda" and cuda_lora_supported(module, x, lora_h.shape[1]):
        return cuda_fused(x if x.stride(1) == 1 else x.contiguous(), module, lora_h, lora_b)
    y = forward_by(backend, x, module)
    return y.addmm_(lora_h, lora_b.t())


def linear_backward_dx(dy: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """dx = dy @ dequant(W) for 2-D dy [M, N]."""
    st = kernel_state(module)
    t = _tensors(module)
    m = dy.shape[0]
    if st.fmt in FP4_FORMATS:
        gs = t.get("weight_global_scale")
        # the transposed fused kernel reads checkpoint order only: a repacked module always dequantizes
        if st.repacked is not None or (m >= LARGE_M_DEQUANT_T and not INTERPRET):
            return dy @ dequantized(module, dy.dtype)
        return fp4_matmul_t(dy, t["weight_packed"], t["weight_scale"], gs, st.fmt, fp4_t_config(m, st.n, st.k),
                            shift=st.shift)
    return w8_matmul_t(dy, t["weight"], t["weight_scale"], w8_t_config(m, st.n, st.k))


class QuantLinearFunction(torch.autograd.Function):
    """y = x @ dequant(W)^T + b with a frozen quantized W: backward returns dx only.

    Nothing is saved for backward: the weight gradient is never needed, and dx = dy @ dequant(W) reads
    the packed weight straight from the module, so no bf16 copy of W outlives a kernel.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module) -> torch.Tensor:  # noqa: ANN001
        ctx.module = module
        return linear_forward(x, module)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return linear_backward_dx(dy.contiguous(), ctx.module), None


def quant_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor | None:
    """`QuantLinear.forward` on qerl's kernels, or None when no kernel covers the case (caller falls back)."""
    if module.fmt not in SUPPORTED or x.shape[-1] != module.in_features:
        return None
    if not (x.is_cuda or INTERPRET):
        return None
    allowed = (torch.bfloat16, torch.float16, torch.float32) if INTERPRET else (torch.bfloat16, torch.float16)
    if x.dtype not in allowed:
        return None
    if module.bias is not None and module.bias.requires_grad:
        return None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, module.in_features)
    if x2.shape[0] == 0:
        return x.new_zeros(*lead, module.out_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        y = QuantLinearFunction.apply(x2, module)
    else:
        y = linear_forward(x2, module)
    return y.reshape(*lead, module.out_features)
