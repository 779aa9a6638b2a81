"""BF16: no quantization. The checkpoint is a plain one (no `quantization_config`) and its linears stay
`nn.Linear`; `quantize`/`dequantize` exist so that code handling every format needs no special case."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qerl_cli.formats.base import CUBLAS, TORCH, QuantizedWeight, WeightFormat


class BF16(WeightFormat):
    name = "bf16"
    description = "unquantized bfloat16"
    bits = 16.0
    group_size = None
    scale_dtype = "none"
    cuda_backend = CUBLAS

    @property
    def quantized(self) -> bool:
        return False

    def _quantize(self, w, *, global_scale, group_size, dtype):  # noqa: ANN001, ANN202
        return {"weight": w.to(torch.bfloat16)}, None

    def _dequantize(self, t, shape, dtype):  # noqa: ANN001, ANN202
        return t["weight"].to(dtype)

    def checkpoint_tensors(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": qw.tensors["weight"]}

    def quantized_layers(self, state: dict[str, torch.Tensor]) -> set[str]:
        return set()  # every layer loads as a plain nn.Linear

    def write_quantization_config(self, out_dir: Path, ignore: list[str], group_size: int | None,
                                  dtype: torch.dtype) -> None:
        pass  # a plain checkpoint

    def matches_config(self, qc: dict[str, Any] | None) -> bool:
        return not qc

    def kernel_backend(self, device: torch.device | str) -> str:
        return CUBLAS if torch.device(device).type == "cuda" else TORCH
