"""The kernels behind `linear.quant_linear`, one backend per function: tile configurations, the per-module kernel
state (repacked FP4 layout, block scales), each FP4 backend's forward (fused Triton, qerl's CUDA kernel, dequantize
+ cuBLAS), the W8 paths and the backward product dx = dy @ dequant(W).

Which FP4 backend runs at each M is `dispatch.choose`, which measures these functions; `linear.py` asks it and
calls the chosen one. Nothing here imports either of them, so the three stand in one order: backends, dispatch,
linear.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import triton
from qerl_kernels._common import INTERPRET, TileConfig, cdiv, num_sms, split_k_for
from qerl_kernels.fp4 import (
    fp4_dequantize,
    fp4_dequantize_v2,
    fp4_matmul,
    fp4_matmul_t,
    fp4_matmul_v2,
    kernel_scales,
    mxfp4_shift,
)
from qerl_kernels.options import kernel_options
from qerl_kernels.w8 import w8_matmul_t

if TYPE_CHECKING:
    from torch import nn

FP4_FORMATS = ("nvfp4", "mxfp4")
W8_FORMATS = ("int8", "fp8")
SUPPORTED = FP4_FORMATS + W8_FORMATS

# The M thresholds (rows from which a transient dequantized weight + cuBLAS beats the fused kernel, H100/H200,
# measured by `qerl bench kernels`; the backward product switches at its own), the FP8-activation switch and
# whether the FP4 weights are repacked at load (fp4.repack_fp4; off keeps the checkpoint byte order: slower
# kernel, no repack) are kernel options (options.py), read where they are used so an override applies.


# ---- launch configurations -----------------------------------------------------------------------
def fp4_config(m: int, n: int, k: int, sms: int = 132, repacked: bool = True) -> TileConfig:
    """Tile shape for the fused FP4 kernel at M rows (from `python -m qerl_cli.bench.kernel_tune` on an H200)."""
    if not repacked:  # checkpoint-layout kernel (fp4_matmul)
        if m <= 16:
            bm, bn, bk, warps, stages = 16, 64, 256, 4, 4
        elif m <= 64:
            bm, bn, bk, warps, stages = 64, 128, 128, 4, 4
        else:
            bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
        tiles = cdiv(m, bm) * cdiv(n, bn)
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
    tiles = cdiv(m, bm) * cdiv(n, bn)
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
    tiles = cdiv(m, bm) * cdiv(n, bn)
    return TileConfig(bm, bn, bk, warps, stages, split_k_for(tiles, k, bk, sms))


def w8_t_config(m: int, n: int, k: int) -> TileConfig:
    return TileConfig(64, 64, 64, 4, 3) if m <= 64 else TileConfig(128, 64, 128, 8, 3)


# ---- per-module state (load-time, cached in module.kernel_layout_state) ----------------------------------
@dataclass
class KernelState:
    key: tuple  # ((name, tensor, data_ptr), ...) of the buffers it was derived from (`kernel_state` checks them)
    fmt: str
    n: int
    k: int
    shift: int = 0  # MXFP4 exponent shift F (see fp4.py)
    repacked: torch.Tensor | None = None  # the module's own weight_packed, repacked in place (fp4.repack_fp4)
    tiled: bool = False  # repacked in 4 KB chunks (N % 64 == 0 too)
    kscales: dict = field(default_factory=dict)  # activation dtype -> fp4.kernel_scales(...) (`block_scales`)
    fp8_scale_row: torch.Tensor | None = None  # FP8 weight scale as fp32 [1, N] for torch._scaled_mm
    extra: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # module_tensors(module) as built: the same objects while valid


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: getattr(module, name) for name in module.tensor_names}


def _current(module: nn.Module, name: str) -> torch.Tensor:
    # a registered buffer straight from the module's dict: nn.Module.__getattr__ costs ~1 us per name per call
    bufs = getattr(module, "_buffers", None)
    t = bufs.get(name) if bufs is not None else None
    return t if t is not None else getattr(module, name)


def _still_valid(st: KernelState, module: nn.Module) -> bool:
    """The state was derived from the buffers the module holds now (same tensors at the same addresses: a
    `.to()`, a fuse or a reassignment replaces them, an in-place update keeps them)."""
    for name, t, ptr in st.key:
        cur = _current(module, name)
        if cur is not t or cur.data_ptr() != ptr:
            return False
    return True


def _repacks(module: nn.Module) -> bool:
    """Whether the kernels read `module` in the repacked layout: FP4, or INT4 in groups of 128 (only the persistent
    decode kernels read INT4, one 16-bit scale per 128-wide chunk; they ask for its state, nothing else does, so an
    INT4 model the decode-layer option leaves alone keeps the checkpoint order)."""
    return module.fmt in FP4_FORMATS or (module.fmt == "int4" and getattr(module, "group_size", None) == 128)


def kernel_state(module: nn.Module) -> KernelState:
    """Derived, load-time data for `module` (rebuilt when its buffers move or change). Checked on every kernel
    call, so the check is a few identity and address compares; `st.tensors` saves the callers a dict per call."""
    st = getattr(module, "kernel_layout_state", None)
    if isinstance(st, KernelState) and _still_valid(st, module):
        return st
    t = {name: _current(module, name) for name in module.tensor_names}
    key = tuple((name, v, v.data_ptr()) for name, v in t.items())
    st = KernelState(key, module.fmt, module.out_features, module.in_features, tensors=t)
    if module.fmt == "mxfp4":
        st.shift = mxfp4_shift(t["weight_scale"])
    layout = getattr(module, "_layout", None)
    repack = kernel_options().fp4_repack
    if _repacks(module) and repack and module.in_features % 128 == 0 and layout is not None:
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
        ks = kernel_scales(st.tensors["weight_scale"], st.fmt, dtype, st.shift, tiled=st.tiled)
    st.kscales[dtype] = ks
    return ks


# ---- forward / backward on 2-D activations ---------------------------------------------------------
def use_fp8_activations(x: torch.Tensor, st: KernelState) -> bool:
    opts = kernel_options()
    mode = opts.fp8_act
    if st.fmt != "fp8" or mode == "0" or INTERPRET or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9) or st.k % 16 or st.n % 16:
        return False
    return mode == "1" or x.shape[0] >= opts.fp8_act_min_m


def use_w4a8(x: torch.Tensor, st: KernelState) -> bool:
    """QERL_W4A8=1, an FP4 module holding the repacked layout, a CUDA sm_89+ GPU, 16-bit activations and M at or
    above QERL_W4A8_MIN_M (callers ask only for forwards without autograd)."""
    opts = kernel_options()
    if not opts.w4a8 or st.fmt not in FP4_FORMATS or st.repacked is None or x.shape[0] < opts.w4a8_min_m:
        return False
    if INTERPRET or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def w4a8_forward(x: torch.Tensor, module: nn.Module, *, precise: bool = True, swap: bool = False,
                 tune: bool = True) -> torch.Tensor:
    """The W4A8 kernel (kernels/w4a8.py) on the module's resident repack and its bf16-format block scales (the
    set the W4A16 kernel reads for bf16 activations; the per-channel W4A8 numbers, 8 bytes per row, are derived
    once and cached). Bias included."""
    from qerl_kernels.w4a8 import w4a8_matmul, w4a8_scales

    st = kernel_state(module)
    if st.repacked is None:
        raise ValueError("W4A8 reads the repacked FP4 layout (K % 128 == 0, QERL_FP4_REPACK=1)")
    t = st.tensors
    sc = st.extra.get("w4a8")
    if sc is None:
        sc = st.extra["w4a8"] = w4a8_scales(t["weight_scale"], t.get("weight_global_scale"), st.fmt, st.shift)
    ks = block_scales(module, st, torch.bfloat16)
    return w4a8_matmul(x, st.repacked, ks, sc, st.fmt, tiled=st.tiled, bias=module.bias, tune=tune,
                       precise=precise, swap=swap, sms=num_sms(x.device))


def fp4_fused(x: torch.Tensor, module: nn.Module, cfg: TileConfig | None = None) -> torch.Tensor:
    """The fused FP4 kernel (repacked layout when the state has it), bias included."""
    st = kernel_state(module)
    t = st.tensors
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
    t = st.tensors
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
    t = st.tensors
    gs = t.get("weight_global_scale")
    if st.repacked is not None:
        return fp4_dequantize_v2(st.repacked, t["weight_scale"], gs, st.fmt, dtype, tiled=st.tiled)
    return fp4_dequantize(t["weight_packed"], t["weight_scale"], gs, st.fmt, dtype)


def dequant_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """The large-M path: a transient dequantized weight, then cuBLAS."""
    bias = module.bias
    return torch.nn.functional.linear(x, dequantized(module, x.dtype), None if bias is None else bias.to(x.dtype))


def linear_backward_dx(dy: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """dx = dy @ dequant(W) for 2-D dy [M, N]."""
    st = kernel_state(module)
    t = st.tensors
    m = dy.shape[0]
    if st.fmt in FP4_FORMATS:
        gs = t.get("weight_global_scale")
        # the transposed fused kernel reads checkpoint order only: a repacked module always dequantizes
        if st.repacked is not None or (m >= kernel_options().fp4_dequant_t_m and not INTERPRET):
            return dy @ dequantized(module, dy.dtype)
        return fp4_matmul_t(dy, t["weight_packed"], t["weight_scale"], gs, st.fmt, fp4_t_config(m, st.n, st.k),
                            shift=st.shift)
    return w8_matmul_t(dy, t["weight"], t["weight_scale"], w8_t_config(m, st.n, st.k))
