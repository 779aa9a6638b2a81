"""qerl's weight formats: one module per format family, one `WeightFormat` object per format, one registry.

`FORMATS` maps a format's name to its object (the order is the CLI's and the docs'); `get_format(name)`
is the lookup with a one-line error, done once where a name is read; `as_format` lets a public function take
a name or the object. Code outside this package asks the object and never compares a
format's name (tests/test_format_registry.py checks that). `quantize`/`dequantize` are the dispatchers
every caller uses. How to add a format: docs/formats.md.
"""

from __future__ import annotations

from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.formats.base import (
    BITSANDBYTES,
    CUBLAS,
    REFERENCE,
    TORCH,
    TRITON,
    CompressedTensorsFormat,
    QuantizedWeight,
    WeightFormat,
)
from qerl_cli.formats.bf16 import BF16
from qerl_cli.formats.fp4 import (
    E2M1_VALUES,
    e2m1_decode,
    e2m1_encode,
    e8m0_from_amax,
    e8m0_to_float,
    pack_fp4,
    to_e4m3,
    unpack_fp4,
)
from qerl_cli.formats.int4 import INT4, int4_group_size, unpack_int4
from qerl_cli.formats.mxfp4 import MXFP4
from qerl_cli.formats.nf4 import NF4, NF4_CODE
from qerl_cli.formats.nvfp4 import NVFP4, nvfp4_global_scale
from qerl_cli.formats.w8 import FP8, INT8, fake_quantize_activations

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (NVFP4(), MXFP4(), INT4(), INT8(), FP8(), NF4(), BF16())}


def get_format(name: str) -> WeightFormat:
    """The format called `name`, where a name is read (a CLI option, a checkpoint's or a manifest's config); a
    one-line QerlError naming the choices. Past that edge the object travels, not the name."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise QerlError(f"unknown format {name!r}: choose one of {', '.join(FORMATS)}")
    return fmt


def as_format(fmt: str | WeightFormat) -> WeightFormat:
    """`fmt` as its object, for a public function that takes a name too (the CLI, tests and notebooks pass names):
    called once where such a function starts, which then passes the object on."""
    return fmt if isinstance(fmt, WeightFormat) else get_format(fmt)


def rollout_formats() -> tuple[str, ...]:
    """Formats a FlashRL rollout copy can use (`--rollout-quant`), the 8-bit ones first (FlashRL's own)."""
    names = [n for n, f in FORMATS.items() if f.rollout_quant]
    return tuple(sorted(names, key=lambda n: -FORMATS[n].bits))


def detect(config: dict[str, Any]) -> tuple[WeightFormat, int | None, str | None]:
    """(format, group size, activation quantization) of a checkpoint's config.json."""
    qc = config.get("quantization_config") or None
    for fmt in FORMATS.values():
        if fmt.matches_config(qc):
            gs, act_quant = fmt.read_config(qc)
            return fmt, gs, act_quant
    if qc.get("quant_method") != "compressed-tensors":
        raise QerlError(f"unsupported quantization method {qc.get('quant_method')!r}: qerl reads compressed-tensors")
    known = sorted(f.ct_format for f in FORMATS.values() if f.ct_format)
    raise QerlError(f"unsupported compressed-tensors format {qc.get('format')!r}; qerl reads {known}")


def quantize(
    w: torch.Tensor,
    fmt: str | WeightFormat,
    *,
    global_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> QuantizedWeight:
    """Quantize an [N, K] weight. `dtype` is the model dtype the weight dequantizes to (and, for
    INT4/INT8/FP8, the dtype of the stored scales)."""
    spec = FORMATS.get(fmt) if isinstance(fmt, str) else fmt
    if spec is None:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return spec.quantize(w, global_scale=global_scale, group_size=group_size, dtype=dtype)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    spec = FORMATS.get(qw.fmt)
    if spec is None:
        raise ValueError(f"unknown format {qw.fmt!r}")
    return spec.dequantize(qw, dtype)


__all__ = [
    "BITSANDBYTES", "CUBLAS", "E2M1_VALUES", "FORMATS", "NF4_CODE", "REFERENCE", "TORCH", "TRITON",
    "CompressedTensorsFormat", "QuantizedWeight", "WeightFormat", "as_format", "dequantize", "detect",
    "e2m1_decode", "e2m1_encode", "e8m0_from_amax", "e8m0_to_float", "fake_quantize_activations", "get_format",
    "int4_group_size", "nvfp4_global_scale", "pack_fp4", "quantize", "rollout_formats", "to_e4m3",
    "unpack_fp4", "unpack_int4",
]
