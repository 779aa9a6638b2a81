"""INT8 and FP8 (E4M3): 8-bit weights with per-output-channel scales in the model dtype, W8A8.

compressed-tensors `int-quantized` (preset W8A8) and `float-quantized` (preset FP8_DYNAMIC). Both schemes
quantize activations per token at run time (`act_quant`); vLLM runs these checkpoints W8A8, so qerl does too
(`fake_quantize_activations` off the kernels). Tensors: `weight` (int8 / float8_e4m3fn) and `weight_scale`
[N, 1].
"""

from __future__ import annotations

import torch

from qerl_cli.formats.base import TRITON, CompressedTensorsFormat, scale_eps
from qerl_cli.formats.fp4 import E4M3_MAX, to_e4m3


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().amax(-1, keepdim=True) / 127.5).to(scale_dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, scale_eps(scale_dtype)), scale)
    q = torch.round((w.float() / scale.float()).clamp(-128, 127)).to(torch.int8)
    return {"weight": q, "weight_scale": scale}


def quantize_fp8(w: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().amax(-1, keepdim=True) / E4M3_MAX).to(scale_dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, scale_eps(scale_dtype)), scale)
    return {"weight": to_e4m3(w.float() / scale.float()), "weight_scale": scale}


def dequantize_per_channel(t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return (t["weight"].float() * t["weight_scale"].float()).to(dtype)


def _int8_act(xf: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (amax / 127.5).clamp(min=torch.finfo(torch.float32).eps)
    return torch.round((xf / scale).clamp(-128, 127)), scale


def _fp8_act(xf: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (amax / 448.0).clamp(min=torch.finfo(torch.float32).eps)
    return (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float(), scale


# activation quantization kind (a W8 format's `act_quant`, a checkpoint's input_activations) -> its arithmetic
_ACT_QUANT = {"int8": _int8_act, "fp8": _fp8_act}


def fake_quantize_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Dynamic symmetric per-token quantize-dequantize, with compressed-tensors' arithmetic.

    int8: scale = amax/127.5, q = round(clamp(x/scale, -128, 127)); fp8: scale = amax/448,
    q = e4m3(clamp(x/scale, +-448)). A straight-through estimator passes gradients unchanged.
    """
    fn = _ACT_QUANT.get(kind)
    if fn is None:
        raise ValueError(f"unknown activation quantization {kind!r}")
    xf = x.detach().float()
    q, scale = fn(xf, xf.abs().amax(-1, keepdim=True))
    xq = (q * scale).to(x.dtype)
    return x + (xq - x).detach() if x.requires_grad else xq


class _W8(CompressedTensorsFormat):
    bits = 8.0
    group_size = None
    scale_dtype = "model dtype (bf16/fp16), one per output channel"
    scales_follow_dtype = True
    rollout_quant = True
    kernel = "w8"
    cuda_backend = TRITON
    requires = "qerl_kernels"

    def _dequantize(self, t, shape, dtype):  # noqa: ANN001, ANN202
        return dequantize_per_channel(t, dtype)


class INT8(_W8):
    name = "int8"
    description = "symmetric INT8, per-channel scales"
    ct_format = "int-quantized"
    ct_preset = "W8A8"
    act_quant = "int8"
    fixed_scales = True  # FlashRL calibrates INT8 scales once and keeps them

    def _quantize(self, w, *, global_scale, group_size, dtype):  # noqa: ANN001, ANN202
        return quantize_int8(w, dtype), None


class FP8(_W8):
    name = "fp8"
    description = "FP8 E4M3, per-channel scales"
    ct_format = "float-quantized"
    ct_preset = "FP8_DYNAMIC"
    act_quant = "fp8"
    act_quant_kernel = True

    def _quantize(self, w, *, global_scale, group_size, dtype):  # noqa: ANN001, ANN202
        return quantize_fp8(w, dtype), None
