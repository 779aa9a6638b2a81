"""INT4: symmetric 4-bit integers in groups along K with 16-bit (model dtype) scales.

compressed-tensors `pack-quantized` (preset W4A16): eight values per int32, value + 8 in each nibble, the
first value in the lowest bits. Group 128 as the preset says; 64 or 32 where a layer's K needs it (e.g.
SmolLM2's 576), one group size for the whole checkpoint because its `quantization_config` holds one.
"""

from __future__ import annotations

import torch

from qerl_cli.errors import QerlError
from qerl_cli.formats.base import CompressedTensorsFormat, blocks, scale_eps


def int4_group_size(k: int, preferred: int = 128) -> int:
    """Group 128 as the spec says; 64 or 32 only where K is not a multiple of 128 (e.g. SmolLM2's 576)."""
    for g in (preferred, 64, 32):
        if k % g == 0:
            return g
    raise ValueError(f"K={k} is not a multiple of 32; INT4 groups need it")


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    n, k = w.shape
    blk = blocks(w.float(), group_size)
    scale = (blk.abs().amax(-1) / 7.5).to(scale_dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, scale_eps(scale_dtype)), scale)
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


class INT4(CompressedTensorsFormat):
    name = "int4"
    description = "symmetric INT4, groups of 128 (64/32 where K needs it), 16-bit scales"
    bits = 4.125
    group_size = 128
    scale_dtype = "model dtype (bf16/fp16)"
    ct_format = "pack-quantized"
    ct_preset = "W4A16"
    scales_follow_dtype = True

    def group_size_for(self, k: int) -> int:
        return int4_group_size(k)

    def common_group_size(self, ks: list[int]) -> int:
        try:
            return min(int4_group_size(k) for k in ks)
        except ValueError as exc:
            raise QerlError(f"INT4 needs every quantized layer's K divisible by 32 ({exc}): add it to --ignore") \
                from exc

    def check_layer(self, name: str, n: int, k: int) -> None:
        pass  # any K divisible by 32 works; `common_group_size` says so for the whole checkpoint

    def _quantize(self, w, *, global_scale, group_size, dtype):  # noqa: ANN001, ANN202
        gs = group_size or int4_group_size(int(w.shape[1]))
        return quantize_int4(w, gs, dtype), gs

    def _dequantize(self, t, shape, dtype):  # noqa: ANN001, ANN202
        return dequantize_int4(t, dtype)
