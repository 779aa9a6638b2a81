"""MXFP4: FP4 E2M1 values in blocks of 32 along K with E8M0 (power-of-two) block scales.

compressed-tensors `mxfp4-pack-quantized` (preset MXFP4A16); the scale is stored as its E8M0 code (uint8).
"""

from __future__ import annotations

import torch

from qerl_cli.formats.base import TRITON, CompressedTensorsFormat, blocks
from qerl_cli.formats.fp4 import (
    E2M1_MAX,
    dequantize_fp4_blocks,
    e2m1_encode,
    e8m0_from_amax,
    e8m0_to_float,
    pack_fp4,
)

BLOCK = 32


def quantize_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    blk = blocks(w.float(), BLOCK)
    code = e8m0_from_amax(blk.abs().amax(-1))
    scale = e8m0_to_float(code)
    codes = e2m1_encode((blk / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)).reshape(w.shape)
    return {"weight_packed": pack_fp4(codes), "weight_scale": code}


def dequantize_mxfp4(t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp4_blocks(t["weight_packed"], e8m0_to_float(t["weight_scale"]), BLOCK, dtype)


class MXFP4(CompressedTensorsFormat):
    name = "mxfp4"
    description = "FP4 E2M1, blocks of 32 with E8M0 power-of-two scales"
    bits = 4.25
    group_size = BLOCK
    scale_dtype = "E8M0 (uint8 exponent code)"
    ct_format = "mxfp4-pack-quantized"
    ct_preset = "MXFP4A16"
    rollout_quant = True
    kernel = "fp4"
    cuda_backend = TRITON
    requires = "qerl_kernels"
    power_of_two_scales = True
    # the FP4 kernels' load-time repacked copy (+0.5 byte/weight) when it is not made in place
    resident_extra_bytes = 0.5

    def _quantize(self, w, *, global_scale, group_size, dtype):  # noqa: ANN001, ANN202
        return quantize_mxfp4(w), BLOCK

    def _dequantize(self, t, shape, dtype):  # noqa: ANN001, ANN202
        return dequantize_mxfp4(t, dtype)
