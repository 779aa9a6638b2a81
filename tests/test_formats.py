"""Exhaustive checks of the reference formats against hand-written values and independent code.

Independent implementations used: compressed-tensors' own compressors (decompress and its
quantization arithmetic) and bitsandbytes' NF4 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from qerl_cli.formats import (
    E2M1_VALUES,
    NF4_CODE,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    e8m0_from_amax,
    e8m0_to_float,
    nvfp4_global_scale,
    pack_fp4,
    quantize,
    to_e4m3,
    unpack_fp4,
    unpack_int4,
)


# ---- E2M1 -----------------------------------------------------------------------------------------
def test_every_e2m1_code_round_trips() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    expected = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    assert values.tolist() == expected
    # each representable value encodes back to its own code (except -0.0 -> 8, +0.0 -> 0)
    assert e2m1_encode(values).tolist() == list(range(16))


@pytest.mark.parametrize(
    "x, code",
    [
        # RNE ties: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0
        (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
        # just either side of each boundary
        (0.2500001, 1), (0.7499999, 1), (1.2500001, 3), (1.7499999, 3), (2.5000002, 5), (3.4999998, 5),
        (5.0000005, 7),
        # saturation at +-6
        (6.0, 7), (7.0, 7), (1e9, 7), (-1e9, 15), (-6.5, 15),
        # zero, negative zero, and a small negative that rounds to (negative) zero like compressed-tensors
        (0.0, 0), (-0.0, 8), (-0.1, 8), (0.1, 0),
        (-0.75, 10), (-2.5, 12), (-3.5, 14),
    ],
)
def test_e2m1_rounding_table(x: float, code: int) -> None:
    assert e2m1_encode(torch.tensor([x])).item() == code


def test_e2m1_matches_compressed_tensors_cast_everywhere() -> None:
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    cast = getattr(FP4_E2M1_DATA.cast_to_fp4, "__wrapped__", FP4_E2M1_DATA.cast_to_fp4)
    x = torch.cat([torch.linspace(-6, 6, 48001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    ours = e2m1_decode(e2m1_encode(x))
    assert torch.equal(ours.abs(), cast(x.clone()).abs())


def test_fp4_nibble_order() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    # element 2j in the LOW nibble, 2j+1 in the HIGH nibble
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_fp4_packing_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    vals = e2m1_decode(torch.randint(0, 16, (8, 32), dtype=torch.uint8))
    vals[vals == 0] = 0.0  # c-t takes the sign bit from the value; use +0 where both agree
    assert torch.equal(pack_fp4(e2m1_encode(vals)), pack_fp4_to_uint8(vals))


# ---- scales ---------------------------------------------------------------------------------------
def test_e4m3_saturates_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([448.0, 500.0, 1e6, -1e6, 0.0, 17.0, 19.0, 2.0**-9, 2.0**-10])
    got = to_e4m3(x).float().tolist()
    # 17 lies between 16 and 18 (spacing 2 in [16,32)) -> tie to even mantissa (16); 19 -> tie to 20
    assert got == [448.0, 448.0, 448.0, -448.0, 0.0, 16.0, 20.0, 2.0**-9, 0.0]


@pytest.mark.parametrize(
    "amax, exponent",
    [
        (6.0, 0),  # 6 = 1.5 * 2^2 -> floor(log2)=2 -> 2-2 = 0
        (1.0, -2),
        (1.74, -2),  # mantissa fraction 0.74 < 0.75 stays
        (1.75, -1),  # rounds up to 2 -> 1-2 = -1
        (3.5, 0),  # 3.5 = 1.75*2 -> rounds to 4 -> 2-2 = 0
        (0.5, -3),
        (448.0, 7),  # 448 = 1.75 * 2^8 -> rounds up to 2^9 -> 9-2 = 7
        (416.0, 6),  # 1.625 * 2^8 stays -> 8-2 = 6
        (2.0**-120, -122),
    ],
)
def test_e8m0_exponent_from_amax(amax: float, exponent: int) -> None:
    code = e8m0_from_amax(torch.tensor([amax]))
    assert code.item() == exponent + 127
    assert e8m0_to_float(code).item() == 2.0**exponent


def test_e8m0_edges() -> None:
    assert e8m0_from_amax(torch.tensor([0.0])).item() == 0  # zero block
    # 3e38 = 1.76 * 2^127: mantissa fraction >= 0.75 rounds amax up to 2^128 -> 128 - 2 + 127
    assert e8m0_from_amax(torch.tensor([3.0e38])).item() == 253


def test_mx_scales_match_compressed_tensors() -> None:
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    amax = torch.rand(4096) * torch.exp2(torch.randint(-20, 20, (4096,)).float())
    for dtype in (torch.float32, torch.bfloat16):
        a = amax.to(dtype)
        expected = generate_mx_scales(a, 4).float().clamp(0, 255).to(torch.uint8)
        assert torch.equal(e8m0_from_amax(a.float()), expected)


# ---- NVFP4 ----------------------------------------------------------------------------------------
def test_nvfp4_by_hand() -> None:
    # one row, one block of 16; amax 6 -> G = 448, block scale e4m3(6/6*448)=448, effective scale 1
    w = torch.tensor([[6.0, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 0.0, 4.0, -3.0, 2.0, 1.5, 0.5]])
    qw = quantize(w, "nvfp4")
    t = qw.tensors
    assert t["weight_global_scale"].item() == 448.0
    assert t["weight_scale"].float().item() == 448.0
    expect = [6.0, -6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 0.0, 4.0, -3.0, 2.0, 1.5, 0.5]
    assert dequantize(qw, torch.float32).tolist() == [expect]
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (1, 8)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (1, 1)
    assert t["weight_global_scale"].dtype == torch.float32 and t["weight_global_scale"].shape == (1,)


def test_nvfp4_zero_block_gets_eps_scale() -> None:
    w = torch.zeros(2, 32)
    w[0, :16] = torch.linspace(-3, 3, 16)
    qw = quantize(w, "nvfp4")
    scales = qw.tensors["weight_scale"].float()
    assert scales[0, 1].item() == 0.125 and scales[1, 0].item() == 0.125  # E4M3 eps for zero blocks
    assert torch.equal(dequantize(qw, torch.float32)[1], torch.zeros(32))


def test_nvfp4_fused_global_scale_is_shared() -> None:
    from torch import nn

    from qerl_cli.checkpoint import fused_global_scales

    torch.manual_seed(0)
    layers = {f"l.self_attn.{n}": nn.Linear(32, 16, bias=False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    layers |= {f"l.mlp.{n}": nn.Linear(32, 16, bias=False) for n in ("gate_proj", "up_proj", "down_proj")}
    with torch.no_grad():
        layers["l.self_attn.k_proj"].weight[0, 0] = 10.0
        layers["l.mlp.up_proj"].weight[0, 0] = -7.0
    g = fused_global_scales(layers)
    assert g["l.self_attn.q_proj"].item() == g["l.self_attn.k_proj"].item() == g["l.self_attn.v_proj"].item()
    assert g["l.self_attn.q_proj"].item() == pytest.approx(448 * 6 / 10.0)
    assert g["l.mlp.gate_proj"].item() == g["l.mlp.up_proj"].item() == pytest.approx(448 * 6 / 7.0)
    o_amax = layers["l.self_attn.o_proj"].weight.abs().max()
    assert g["l.self_attn.o_proj"].item() == pytest.approx((448 * 6 / o_amax).item())


def test_nvfp4_global_scale_zero_tensor() -> None:
    assert nvfp4_global_scale(0.0).item() == 1.0


# ---- cross-check against compressed-tensors -------------------------------------------------------
def _ct_scheme(preset: str):  # noqa: ANN202
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


@pytest.mark.parametrize("fmt, preset", [("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16"), ("int4", "W4A16"),
                                         ("int8", "W8A8"), ("fp8", "FP8_DYNAMIC")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compressed_tensors_decompressor_reproduces_ours(fmt: str, preset: str, dtype: torch.dtype) -> None:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.config import CompressionFormat  # noqa: F401 - registers formats

    from qerl_cli.formats import FORMATS

    torch.manual_seed(1)
    w = torch.randn(96, 256) * torch.rand(96, 1) * 3
    w[5, 32:64] = 0  # a zero block
    qw = quantize(w.to(dtype), fmt, dtype=dtype)
    compressor = BaseCompressor.get_value_from_registry(FORMATS[fmt].ct_format)
    state = dict(qw.tensors)
    ct = compressor.decompress(state, _ct_scheme(preset))["weight"]
    # compressed-tensors unpacks FP4 to bf16 whatever the model dtype, so compare in its dtype
    assert torch.equal(ct, dequantize(qw, ct.dtype))


@pytest.mark.parametrize("fmt, preset", [("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16"), ("int4", "W4A16"),
                                         ("int8", "W8A8")])
def test_our_codes_equal_compressed_tensors_quantization(fmt: str, preset: str) -> None:
    """compressed-tensors' own observer arithmetic + quantize gives the same codes as ours.

    On fp32 weights the codes are identical. (On bf16 weights compressed-tensors divides in bf16,
    a double rounding that moves ~0.5-10% of codes by one step; qerl divides in fp32, the exact RNE.)
    """
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    torch.manual_seed(2)
    w = torch.randn(64, 256) * 0.05
    args = _ct_scheme(preset).weights
    gs = args.group_size
    if gs:
        blk = w.reshape(64, 256 // gs, gs)
        mn, mx = blk.amin(-1), blk.amax(-1)
    else:
        mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    g = generate_gparam(w.amin(), w.amax()) if fmt == "nvfp4" else None
    scale, zp = calculate_qparams(mn, mx, args, global_scale=g)
    q_ct = ct_quantize(w, scale, zp, args, global_scale=g)
    qw = quantize(w, fmt, dtype=torch.float32)
    if fmt in ("nvfp4", "mxfp4"):
        ours = e2m1_decode(unpack_fp4(qw.tensors["weight_packed"]))
    elif fmt == "int4":
        ours = unpack_int4(qw.tensors["weight_packed"]).float()
    else:
        ours = qw.tensors["weight"].float()
    assert torch.equal(ours, q_ct.float())


# ---- INT4 / INT8 / FP8 ----------------------------------------------------------------------------
def test_int4_packing_order_and_values() -> None:
    # group 128 of one row: amax 7.5 -> scale 1.0; values -8..7 map to stored nibbles 0..15
    row = torch.tensor(([-7.5] + [float(v) for v in range(-7, 8)]) * 8)  # amax 7.5 -> scale exactly 1
    # -7.5 rounds half to even -> -8
    qw = quantize(row.reshape(1, 128), "int4", dtype=torch.bfloat16)
    t = qw.tensors
    assert t["weight_scale"].item() == 1.0 and t["weight_shape"].tolist() == [1, 128]
    first = t["weight_packed"][0, 0].item() & 0xFFFFFFFF
    # element i at bits 4i, stored as q+8: [-8,-7,...,-1] -> nibbles 0..7
    assert first == sum(i << (4 * i) for i in range(8))
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = unpack_int4(t["weight_packed"])
    assert torch.equal(pack_to_int32(q, 4), t["weight_packed"])


def test_int4_group_fallback_for_smollm_k() -> None:
    qw = quantize(torch.randn(8, 576), "int4")
    assert qw.group_size == 64 and qw.tensors["weight_scale"].shape == (8, 9)


def test_int8_and_fp8_per_channel() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5, 255.0], [0.0, 0.0, 0.0, 0.0]])
    q8 = quantize(w, "int8", dtype=torch.float32)
    assert q8.tensors["weight_scale"][0, 0].item() == pytest.approx(2.0)  # 255/127.5
    assert q8.tensors["weight"][0].tolist() == [0, -1, 0, 127]  # 0.5 and -1 round half-even / exact
    assert q8.tensors["weight_scale"][1, 0].item() == torch.finfo(torch.float32).eps
    f8 = quantize(w, "fp8", dtype=torch.float32)
    assert f8.tensors["weight"].dtype == torch.float8_e4m3fn
    assert f8.tensors["weight"][0, 3].float().item() == 448.0


# ---- NF4 against bitsandbytes ---------------------------------------------------------------------
def test_nf4_codebook_and_nibble_order() -> None:
    w = torch.tensor(NF4_CODE).repeat(4).reshape(1, 64)
    qw = quantize(w, "nf4")
    packed = qw.tensors["weight"].flatten()
    assert packed[0].item() == (0 << 4) | 1  # FIRST element (code 0) in the HIGH nibble
    assert torch.equal(dequantize(qw, torch.float32), w)


def test_nf4_matches_bitsandbytes() -> None:
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(3)
    w = torch.randn(128, 256)
    qw = quantize(w, "nf4")
    packed, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(qw.tensors["absmax"], state.absmax)
    mismatch = (qw.tensors["weight"].flatten() != packed.flatten()).float().mean().item()
    assert mismatch == 0.0
    ref = bnb_f.dequantize_4bit(packed, state, blocksize=64, quant_type="nf4")
    assert torch.allclose(dequantize(qw, torch.float32), ref, atol=0, rtol=1e-6)
