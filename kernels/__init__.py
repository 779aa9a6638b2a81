"""qerl's Triton kernels (import name `qerl_kernels`): W4A16 NVFP4/MXFP4 and W8A16 INT8/FP8 GEMMs.

`qerl_kernels.linear.quant_linear(x, module)` is what `QuantLinear.forward` calls on CUDA; the
lower-level entry points live in `fp4` and `w8`.
"""

from qerl_kernels._common import DECODE_ARITH, DECODE_ASM, DECODE_LUT, INTERPRET, TileConfig
from qerl_kernels.fp4 import fp4_dequantize, fp4_matmul, fp4_matmul_t, mxfp4_shift
from qerl_kernels.linear import QuantLinearFunction, kernel_state, linear_backward_dx, linear_forward, quant_linear
from qerl_kernels.w8 import fp8_scaled_matmul, quantize_rows_fp8, w8_matmul, w8_matmul_t

__all__ = [
    "DECODE_ARITH", "DECODE_ASM", "DECODE_LUT", "INTERPRET", "QuantLinearFunction", "TileConfig",
    "fp4_dequantize", "fp4_matmul", "fp4_matmul_t", "fp8_scaled_matmul", "kernel_state", "linear_backward_dx",
    "linear_forward", "mxfp4_shift", "quant_linear", "quantize_rows_fp8", "w8_matmul", "w8_matmul_t",
]
