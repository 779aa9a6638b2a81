"""Route `QuantLinear.forward` on CUDA to the kernels that run its format there.

The format object says which backend that is (`WeightFormat.kernel_backend`): qerl's Triton kernels
(`qerl_kernels`, which own dispatch by M and the backward product) or, for NF4, bitsandbytes' 4-bit
matmul over the same packed bytes. Returns None when no kernel covers the case, and the caller falls
back to the torch reference (dequantize, then matmul).
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from qerl_cli.formats import BITSANDBYTES

# The modules passed here are qerl_cli.qlinear.QuantLinear; typed as nn.Module so that this module stays below
# qlinear (which calls it) rather than forming a circle with it.
QuantModule = nn.Module


@functools.cache
def _optional_module(name: str):  # noqa: ANN202 - a module or None
    """`name` imported, or None where it is not installed (qerl_kernels is optional)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _kernels():  # noqa: ANN202 - a module or None
    return _optional_module("qerl_kernels.linear")


def quant_linear(x: torch.Tensor, module: QuantModule) -> torch.Tensor | None:
    if module.format.kernel_backend(x.device) == BITSANDBYTES:
        return bnb_nf4_linear(x, module)
    k = _kernels()
    if k is None or not hasattr(k, "quant_linear"):
        return None
    return k.quant_linear(x, module)


def kernels_cover(x: torch.Tensor, module: QuantModule) -> bool:
    """Whether ``QuantLinear.forward`` runs `module` for `x` on qerl_kernels (CUDA, a format they cover, not
    bitsandbytes' NF4): then `kernel_forward` and `kernel_backward_dx` are its forward and dx without autograd
    (the training LoRA path calls them inside its own autograd function)."""
    if not x.is_cuda or module.format.kernel_backend(x.device) == BITSANDBYTES:
        return False
    k = _kernels()
    return k is not None and hasattr(k, "covers") and k.covers(x, module)


def uses_bitsandbytes(x: torch.Tensor, module: QuantModule) -> bool:
    """Whether ``QuantLinear.forward`` runs `module` for `x` through bitsandbytes (NF4 on CUDA)."""
    return module.format.kernel_backend(x.device) == BITSANDBYTES


def kernel_forward(x: torch.Tensor, module: QuantModule) -> torch.Tensor:
    """y = x @ dequant(W)^T + b on qerl_kernels for 2-D contiguous-rows x (no autograd; `kernels_cover` first)."""
    return _kernels().linear_forward(x, module)


def kernel_backward_dx(dy: torch.Tensor, module: QuantModule) -> torch.Tensor:
    """dx = dy @ dequant(W) on qerl_kernels for 2-D contiguous dy (no autograd; `kernels_cover` first)."""
    return _kernels().linear_backward_dx(dy, module)


def lora_epilogue_linear(x: torch.Tensor, module: QuantModule, lora_h: torch.Tensor,
                         lora_b: torch.Tensor) -> torch.Tensor | None:
    """``x W^T (+ b) + lora_h @ lora_b^T`` in ONE kernel (the LoRA expand in qerl's CUDA FP4 GEMM's epilogue)
    when the dispatcher's LoRA-aware choice for this shape, M bucket and rank is that kernel
    (``qerl_kernels.linear.forward_with_lora``); None otherwise, and the caller runs the base GEMM and an
    in-place expand (so a profile can tell the two apart). Decode only: no autograd."""
    if module.format.kernel_backend(x.device) == BITSANDBYTES or not x.is_cuda or x.dim() != 2:
        return None
    k = _kernels()
    if k is None or not hasattr(k, "forward_with_lora") or module.fmt not in k.FP4_FORMATS:
        return None  # a qerl_kernels without the epilogue API
    from qerl_kernels import dispatch

    r = lora_h.shape[1]
    if dispatch.choose(module, x, lora_rank=r) != "cuda" or not k.cuda_lora_supported(module, x, r):
        return None
    return k.forward_with_lora(x, module, lora_h, lora_b)


def bnb_nf4_linear(x: torch.Tensor, module: QuantModule) -> torch.Tensor:
    """y = x @ W^T + b through `bitsandbytes.matmul_4bit` on the module's own NF4 tensors.

    qerl's NF4 bytes are bitsandbytes' layout (same codebook, blocks of 64 over the flat weight, first
    element in the high nibble), so nothing is converted; the quant state is rebuilt per call because it
    only points at the module's buffers (which `.to()` and fusing replace). bitsandbytes' autograd
    function passes dx back to x, so training forwards run here too.
    """
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    qs = QuantState(absmax=module.absmax.float(), shape=torch.Size([module.out_features, module.in_features]),
                    code=module.quant_map.float(), blocksize=module.format.group_size, quant_type="nf4",
                    dtype=module.dtype)
    bias = None if module.bias is None else module.bias.to(x.dtype)
    return bnb.matmul_4bit(x, module.weight.t(), quant_state=qs, bias=bias)


# ---- what the kernels keep beside the weights, and whether a peer may keep its own copy (the memory plan) ----
def _dispatch():  # noqa: ANN202 - a module or None
    return _optional_module("qerl_kernels.dispatch")


def derived_bytes(fmt: str, n: int, k: int, act_elem: int = 2, bias: bool = False) -> int:
    """What qerl's CUDA kernels derive from an [n, k] layer's tensors and keep (0 without qerl_kernels)."""
    d = _dispatch()
    return 0 if d is None else d.derived_bytes(fmt, n, k, act_elem, bias)


def extra_copy_bytes(fmt: str, n: int, k: int) -> int:
    """The peer kernel's own copy of an [n, k] layer when the dispatcher may choose it (humming), else 0."""
    d = _dispatch()
    return 0 if d is None else d.extra_copy_bytes(fmt, n, k)


def allow_extra_copies(allowed: bool) -> None:
    """Let the FP4 dispatcher choose backends that keep a second copy of a weight (or not)."""
    d = _dispatch()
    if d is not None:
        d.allow_extra_copies(allowed)
