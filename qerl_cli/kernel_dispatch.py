"""Route `QuantLinear.forward` on CUDA to qerl's Triton kernels (`qerl_kernels`).

Returns None when no kernel covers the case, and the caller falls back to the torch reference
(dequantize, then matmul). The kernels package owns dispatch by M and the backward product.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qerl_cli.qlinear import QuantLinear


@functools.cache
def _kernels():  # noqa: ANN202 - a module or None
    try:
        import qerl_kernels.linear as linear
    except ImportError:
        return None
    return linear


def quant_linear(x: torch.Tensor, module: QuantLinear) -> torch.Tensor | None:
    k = _kernels()
    if k is None or not hasattr(k, "quant_linear"):
        return None
    return k.quant_linear(x, module)
