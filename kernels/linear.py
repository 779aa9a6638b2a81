"""`quant_linear(x, module)`: run a `QuantLinear` through qerl's kernels, forward and backward.

FP4 (NVFP4/MXFP4) dispatch by M, the rows of activations (thresholds from the H200 runs in
docs/benchmarks.md):
- M <= 16 (decode): fused dequantize-GEMM on the load-time repacked weight (`fp4.repack_fp4`, tiled),
  16-row activation tile, split-K to ~6 CTAs per SM, reduced in the same launch in fixed order;
- 16 < M < `fp4_dequant_m` (512): the same kernel with 64/128/256-row activation tiles, split-K with a
  second fixed-order reduction pass when tiles are few;
- M >= 512: the exact Triton dequantizer into a transient bf16 weight, then cuBLAS (it measured faster).
- on Hopper, qerl's CUDA C++ kernel (`cuda_fp4`, backend `cuda`) on the same repacked bytes, a candidate
  that `dispatch` measures next to these.
Both reductions are deterministic (no float atomics). INT8/FP8 use the W8A16 kernels at every M, so
decode, prefill and the training forward compute one function (rollout-vs-training mismatch stays at the
BF16 level). `QERL_FP8_ACT=auto` opts in to the FP8xFP8 tensor-core path for bf16 activations at
M >= `fp8_act_min_m` (per-token activation scales: the FP8_DYNAMIC scheme, 1.1-1.5x faster there), at the
price of a training forward that differs from the decode path (k3 2.6e-2 measured on the embedded model).

Backward is `QuantLinearFunction`: it saves no tensor (the frozen weight has no gradient and dx does
not need x) and computes dx = dy @ dequant(W) with the transposed fused kernel; from `fp4_dequant_t_m`
rows (1024, QERL_FP4_DEQUANT_T_M) it dequantizes one layer's weight transiently and calls cuBLAS, which was
1.8x faster at M = 2048 (set QERL_FP4_DEQUANT_T_M very high to never build that transient copy).
The FP4 weight is repacked at load IN PLACE (`module._layout`, see `qerl_cli.qlinear.PackedLayout`), so
the GPU holds one copy of it: the fused kernel reads it, and the large-M forward and every backward
dequantize it with `fp4_dequantize_v2` (bit-identical to the reference) into a transient bf16 weight for
cuBLAS. State dicts, `quantized_weight` and `.to()` still see the checkpoint order. QERL_FP4_REPACK=0 keeps
the checkpoint order (slower checkpoint-layout kernels). Which kernel runs at each M is `dispatch.choose`.
"""

from __future__ import annotations

from typing import Any

import torch
from qerl_kernels import backends, dispatch
from qerl_kernels._common import INTERPRET, num_sms
from qerl_kernels.backends import (
    FP4_FORMATS,
    SUPPORTED,
    cuda_fused,
    cuda_lora_supported,
    dequant_linear,
    fp4_fused,
    kernel_state,
    linear_backward_dx,
    use_fp8_activations,
    use_w4a8,
    w4a8_forward,
    w8_config,
)
from qerl_kernels.dispatch import BACKENDS, get_backend, set_backend  # noqa: F401 - the override API
from qerl_kernels.options import kernel_options
from qerl_kernels.w8 import fp8_scaled_matmul, w8_matmul
from torch import nn


def __getattr__(name: str) -> Any:
    """The backends' names (`kernel_state`, `fp4_config`, `block_scales`, ...) stay reachable as `linear.<name>`."""
    return getattr(backends, name)


def linear_forward(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """y = x @ dequant(W)^T + b for 2-D contiguous-rows x [M, K] (no autograd)."""
    st = kernel_state(module)
    if st.fmt in FP4_FORMATS:
        return forward_by("triton" if INTERPRET else dispatch.choose(module, x), x, module)
    t = st.tensors
    bias = module.bias
    if use_fp8_activations(x, st):
        dispatch.record_ran(module, "fp8xfp8")
        return fp8_scaled_matmul(x, t["weight"], st.fp8_scale_row, None if bias is None else bias.to(x.dtype))
    dispatch.record_ran(module, "triton")
    return w8_matmul(x, t["weight"], t["weight_scale"], w8_config(x.shape[0], st.n, st.k, num_sms(x.device)),
                     bias=bias)


def forward_by(backend: str, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """An FP4 forward through one backend ('triton' | 'cuda' | 'cublas' | 'humming')."""
    dispatch.record_ran(module, backend)
    if backend == "cublas":
        return dequant_linear(x, module)
    if backend == "humming":
        return dispatch.humming_forward(module, x)
    if backend == "cuda":
        return cuda_fused(x, module)
    return fp4_fused(x, module)


def w4a8(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """The W4A8 forward of 2-D x (bias included): humming's where the dispatcher measured it faster for this shape
    and M bucket (MXFP4 only), qerl's kernel otherwise."""
    if dispatch.w4a8_backend(module, x) == "humming":
        dispatch.record_ran(module, "humming-w4a8")
        return dispatch.humming_forward(module, x, act="fp8")
    dispatch.record_ran(module, "w4a8")
    return w4a8_forward(x, module)


def forward_with_lora(x: torch.Tensor, module: nn.Module, lora_h: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """y = module(x) + lora_h @ lora_b^T for 2-D contiguous-rows x [M, K] (no autograd: the rollout's decode step).
    `lora_h` [M, R] is the shrink (x A^T, computed where x was made), `lora_b` [N, R] the expand already scaled
    (block-diagonal for a fused q/k/v or gate/up group), both in x's dtype. The backend is the dispatcher's choice
    for (shape, M bucket, R) (`dispatch.choose(module, x, lora_rank=R)`): qerl's CUDA kernel with the expand in
    its epilogue (one launch, one rounding) or another backend followed by one in-place addmm."""
    if module.fmt not in FP4_FORMATS or INTERPRET or not x.is_cuda:
        y = module(x)
        return y.addmm_(lora_h, lora_b.t())
    if kernel_options().w4a8 and use_w4a8(x, kernel_state(module)):
        return w4a8(x, module).addmm_(lora_h, lora_b.t())
    backend = dispatch.choose(module, x, lora_rank=lora_h.shape[1])
    if backend == "cuda" and cuda_lora_supported(module, x, lora_h.shape[1]):
        dispatch.record_ran(module, "cuda+lora")
        return cuda_fused(x if x.stride(1) == 1 else x.contiguous(), module, lora_h, lora_b)
    y = forward_by(backend, x, module)
    return y.addmm_(lora_h, lora_b.t())


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


_ALLOWED = (torch.bfloat16, torch.float16, torch.float32) if INTERPRET else (torch.bfloat16, torch.float16)


def covers(x: torch.Tensor, module: nn.Module) -> bool:
    """Whether qerl's kernels run `module` for activations `x`: a supported format, CUDA (or the interpreter),
    16-bit activations (fp32 too under the interpreter) and a frozen bias. Then `linear_forward` and
    `linear_backward_dx` are its forward and dx."""
    if module.fmt not in SUPPORTED or x.shape[-1] != module.in_features:
        return False
    if not (x.is_cuda or INTERPRET) or x.dtype not in _ALLOWED:
        return False
    return module.bias is None or not module.bias.requires_grad


def quant_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor | None:
    """`QuantLinear.forward` on qerl's kernels, or None when no kernel covers the case (caller falls back)."""
    if not covers(x, module):
        return None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, module.in_features)
    if x2.shape[0] == 0:
        return x.new_zeros(*lead, module.out_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        y = QuantLinearFunction.apply(x2, module)
    elif kernel_options().w4a8 and module.fmt in FP4_FORMATS and use_w4a8(x2, kernel_state(module)):
        # W4A8 only where no gradient flows (the rollout): the training forward keeps W4A16's exactness
        y = w4a8(x2, module)
    else:
        y = linear_forward(x2, module)
    return y.reshape(*lead, module.out_features)
