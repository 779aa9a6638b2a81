"""Reference quantize/dequantize for every qerl weight format (one place, plain torch)."""

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
from qerl_cli.formats.reference import (
    FORMATS,
    NF4_CODE,
    FormatSpec,
    QuantizedWeight,
    dequantize,
    int4_group_size,
    nvfp4_global_scale,
    quantize,
    unpack_int4,
)

__all__ = [
    "E2M1_VALUES", "FORMATS", "NF4_CODE", "FormatSpec", "QuantizedWeight", "dequantize", "e2m1_decode",
    "e2m1_encode", "e8m0_from_amax", "e8m0_to_float", "int4_group_size", "nvfp4_global_scale", "pack_fp4",
    "quantize", "to_e4m3", "unpack_fp4", "unpack_int4",
]
