"""NVFP4: FP4 E2M1 values in blocks of 16 along K, FP8 E4M3 block scales, one FP32 global scale per tensor.

compressed-tensors `nvfp4-pack-quantized` (preset NVFP4A16). The effective scale `S_blk / G` is formed
first, as compressed-tensors and vLLM do, so codes and dequantized values are bit-exact to theirs.
q/k/v and gate/up share one global scale (`global_scale`): vLLM fuses them into one GEMM over one tensor.
"""

from __future__ import annotations

import torch

from qerl_cli.formats.base import TRITON, CompressedTensorsFormat, blocks
from qerl_cli.formats.fp4 import (
    E2M1_MAX,
    E4M3_EPS,
    E4M3_MAX,
    dequantize_fp4_blocks,
    e2m1_encode,
    pack_fp4,
    to_e4m3,
)

BLOCK = 16


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
    blk = blocks(wf, BLOCK)
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
    eff = t["weight_scale"].float() / t["weight_global_scale"].float()
    return dequantize_fp4_blocks(t["weight_packed"], eff, BLOCK, dtype)


class NVFP4(CompressedTensorsFormat):
    name = "nvfp4"
    description = "FP4 E2M1, blocks of 16 with FP8 E4M3 scales and an FP32 global scale"
    bits = 4.5
    group_size = BLOCK
    scale_dtype = "float8_e4m3fn (+ float32 global)"
    global_scale = True
    ct_format = "nvfp4-pack-quantized"
    ct_preset = "NVFP4A16"
    rollout_quant = True
    kernel = "fp4"
    cuda_backend = TRITON
    requires = "qerl_kernels"
    # the FP4 kernels' load-time repacked copy (+0.5 byte/weight) when it is not made in place
    resident_extra_bytes = 0.5

    def _quantize(self, w, *, global_scale, group_size, dtype):  # noqa: ANN001, ANN202
        return quantize_nvfp4(w, global_scale), BLOCK

    def _dequantize(self, t, shape, dtype):  # noqa: ANN001, ANN202
        return dequantize_nvfp4(t, dtype)
