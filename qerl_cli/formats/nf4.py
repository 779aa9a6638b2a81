"""NF4: bitsandbytes' 4-bit NormalFloat, blocks of 64 over the flattened weight, float32 absmax per block.

Stored in bitsandbytes' own serialisation (`weight` packed two codes per byte with the FIRST element in the
HIGH nibble, `weight.absmax`, `weight.quant_map`, `weight.quant_state.bitsandbytes__nf4`) with a
`bitsandbytes` `quantization_config`, so transformers loads it with bitsandbytes. On CUDA with bitsandbytes
installed its linears run through `bitsandbytes.matmul_4bit` (`qerl_cli.kernel_dispatch`), elsewhere
through the reference dequantize below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.formats.base import (
    BITSANDBYTES,
    QuantizedWeight,
    WeightFormat,
    write_json_quantization_config,
)

BLOCK = 64
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# bitsandbytes' name of the serialised quant state (it also names the quant type)
_STATE_SUFFIX = ".weight.quant_state.bitsandbytes__nf4"


def quantize_nf4(w: torch.Tensor, blocksize: int = BLOCK) -> dict[str, torch.Tensor]:
    flat = w.float().flatten()
    if flat.numel() % blocksize:
        raise ValueError(f"NF4 needs numel divisible by {blocksize}, got {flat.numel()}")
    blk = flat.reshape(-1, blocksize)
    absmax = blk.abs().amax(-1)
    normed = blk / absmax.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    code = torch.tensor(NF4_CODE, device=w.device)
    # nearest codebook entry; argmin takes the lower index on an exact tie
    idx = (normed.unsqueeze(-1) - code).abs().argmin(-1).to(torch.uint8).flatten()
    packed = (idx[0::2] << 4) | idx[1::2]  # FIRST element in the HIGH nibble (bitsandbytes order)
    return {"weight": packed.reshape(-1, 1), "absmax": absmax, "quant_map": code.clone()}


def dequantize_nf4(t: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype,
                   blocksize: int = BLOCK) -> torch.Tensor:
    p = t["weight"].flatten()
    idx = torch.stack([p >> 4, p & 0x0F], dim=-1).flatten().long()
    vals = t["quant_map"].float()[idx].reshape(-1, blocksize) * t["absmax"].float().unsqueeze(-1)
    return vals.reshape(shape).to(dtype)


class NF4(WeightFormat):
    name = "nf4"
    description = "bitsandbytes NF4, blocks of 64 over the flat tensor"
    bits = 4.5
    group_size = BLOCK
    scale_dtype = "float32 absmax per block"
    cuda_backend = BITSANDBYTES  # qerl_cli.kernel_dispatch.bnb_nf4_linear
    requires = "bitsandbytes"

    def check_layer(self, name: str, n: int, k: int) -> None:
        if (n * k) % BLOCK:
            raise QerlError(f"layer {name} has {n * k} weights, not a multiple of {BLOCK}: add it to --ignore")

    def _quantize(self, w, *, global_scale, group_size, dtype):  # noqa: ANN001, ANN202
        return quantize_nf4(w), BLOCK

    def _dequantize(self, t, shape, dtype):  # noqa: ANN001, ANN202
        return dequantize_nf4(t, shape, dtype)

    # ---- checkpoint (bitsandbytes serialisation) -----------------------------------------------------------
    def checkpoint_tensors(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        t = qw.tensors
        state = {"quant_type": self.name, "blocksize": BLOCK, "dtype": str(qw.dtype).removeprefix("torch."),
                 "shape": list(qw.shape)}
        blob = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
        return {
            f"{prefix}.weight": t["weight"],
            f"{prefix}.weight.absmax": t["absmax"],
            f"{prefix}.weight.quant_map": t["quant_map"],
            f"{prefix}{_STATE_SUFFIX}": blob,
        }

    def quantized_layers(self, state: dict[str, torch.Tensor]) -> set[str]:
        return {k[: -len(".weight.absmax")] for k in state if k.endswith(".weight.absmax")}

    def pop_layer_tensors(self, name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = {"weight": state.pop(f"{name}.weight"), "absmax": state.pop(f"{name}.weight.absmax"),
                   "quant_map": state.pop(f"{name}.weight.quant_map")}
        state.pop(f"{name}{_STATE_SUFFIX}", None)
        return tensors

    def write_quantization_config(self, out_dir: Path, ignore: list[str], group_size: int | None,
                                  dtype: torch.dtype) -> None:
        write_json_quantization_config(out_dir, {
            "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": self.name, "bnb_4bit_use_double_quant": False,
            "bnb_4bit_compute_dtype": str(dtype).removeprefix("torch."), "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": ignore,
        })

    def matches_config(self, qc: dict[str, Any] | None) -> bool:
        return bool(qc) and qc.get("quant_method") == "bitsandbytes"

    def read_config(self, qc: dict[str, Any] | None) -> tuple[int | None, str | None]:
        return BLOCK, None
