"""qerl_kernels under the Triton interpreter (TRITON_INTERPRET=1, set in conftest before any import).

The interpreter runs the kernels' fp32 path (F32 constexpr): integer FP4 decoding, fp32 scales, fp32
dot. Every output is NaN-poisoned before the call where the API allows it, so an unwritten element
fails, and compared with float64 `x @ dequantize(W)^T` from the torch reference.
"""

from __future__ import annotations

import pytest
import torch
from qerl_kernels import (
    DECODE_LUT,
    INTERPRET,
    TileConfig,
    fp4_dequantize,
    fp4_matmul,
    fp4_matmul_t,
    kernel_state,
    mxfp4_shift,
    quant_linear,
    quantize_rows_fp8,
    w8_matmul,
    w8_matmul_t,
)
from qerl_kernels._common import split_k_for
from qerl_kernels.fp4 import fp4_matmul_v2, kernel_scales, repack_fp4, tile_counters, unrepack_fp4
from qerl_kernels.linear import KernelState, fp4_config

from qerl_cli.errors import QerlError
from qerl_cli.formats import dequantize, quantize
from qerl_cli.formats.fp4 import to_e4m3
from qerl_cli.qlinear import QuantLinear

# fp32 activations: only accumulation-order rounding; fp16: one output rounding (2**-11) on top
TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3}
# ragged edges: M below/above the 16-row tile, N not a multiple of BN, K not a multiple of BK
SHAPES = [(1, 40, 96), (3, 64, 160), (17, 33, 224)]
CONFIGS = {
    "decode-splitk": TileConfig(16, 32, 64, split_k=2),
    "tiled": TileConfig(32, 32, 64),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _weights(fmt: str, n: int, k: int, seed: int, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    qw = quantize(torch.randn(n, k, generator=g) * scale, fmt, dtype=torch.float16)
    return qw, dequantize(qw, torch.float32).double(), g


def test_interpreter_is_on() -> None:
    assert INTERPRET, "tests/conftest.py must set TRITON_INTERPRET=1 before qerl_kernels is imported"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("path", list(CONFIGS))
def test_fp4_forward(fmt: str, dtype: torch.dtype, path: str) -> None:
    for i, (m, n, k) in enumerate(SHAPES):
        qw, wd, g = _weights(fmt, n, k, seed=i)
        t = qw.tensors
        x = torch.randn(m, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        y = torch.full((m, n), float("nan"), dtype=dtype)
        fp4_matmul(x, t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt, CONFIGS[path],
                   bias=bias, out=y)
        ref = x.double() @ wd.T + bias.double()
        assert _rel(y, ref) < TOL[dtype], (fmt, m, n, k)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_lookup_decoder_matches(fmt: str) -> None:
    qw, wd, g = _weights(fmt, 48, 128, seed=7)
    t = qw.tensors
    x = torch.randn(5, 128, generator=g)
    args = (x, t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt, TileConfig(16, 32, 64))
    y_lut = fp4_matmul(*args, decode=DECODE_LUT)
    assert torch.equal(y_lut, fp4_matmul(*args))
    assert _rel(y_lut, x.double() @ wd.T) < TOL[torch.float32]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp4_backward_dx(fmt: str, dtype: torch.dtype) -> None:
    for i, (m, n, k) in enumerate(SHAPES[1:]):
        qw, wd, g = _weights(fmt, n, k, seed=10 + i)
        t = qw.tensors
        dy = torch.randn(m, n, generator=g).to(dtype)
        dx = fp4_matmul_t(dy, t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt,
                          TileConfig(16, 32, 64))
        assert dx.shape == (m, k)
        assert _rel(dx, dy.double() @ wd) < TOL[dtype]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp4_dequant_kernel_is_bit_exact(fmt: str, dtype: torch.dtype) -> None:
    # bf16 is left out only because the interpreter truncates fp32->bf16 casts; the GPU selfcheck covers it
    qw, _, _ = _weights(fmt, 40, 160, seed=3)
    t = qw.tensors
    out = fp4_dequantize(t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt, dtype, bk=64)
    assert torch.equal(out, dequantize(qw, dtype))


def test_mxfp4_shift_keeps_large_weights_exact() -> None:
    # |w| ~ 3e4 pushes the E8M0 exponent above 128, so the kernels shift the scales by F < 0 and undo it after
    qw, wd, g = _weights("mxfp4", 32, 64, seed=5, scale=3e4)
    t = qw.tensors
    shift = mxfp4_shift(t["weight_scale"])
    assert shift < 0
    x = torch.randn(2, 64, generator=g)
    y = fp4_matmul(x, t["weight_packed"], t["weight_scale"], None, "mxfp4", TileConfig(16, 32, 64), shift=shift)
    assert _rel(y, x.double() @ wd.T) < TOL[torch.float32]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_w8_forward_and_dx(fmt: str, dtype: torch.dtype) -> None:
    for i, (m, n, k) in enumerate(SHAPES):
        qw, wd, g = _weights(fmt, n, k, seed=20 + i)
        t = qw.tensors
        x = torch.randn(m, k, generator=g).to(dtype)
        for cfg in CONFIGS.values():
            y = w8_matmul(x, t["weight"], t["weight_scale"], cfg)
            assert _rel(y, x.double() @ wd.T) < TOL[dtype], (fmt, m, n, k, cfg)
        dy = torch.randn(m, n, generator=g).to(dtype)
        assert _rel(w8_matmul_t(dy, t["weight"], t["weight_scale"], TileConfig(16, 32, 64)), dy.double() @ wd) \
            < TOL[dtype]


def test_fp8_activation_quantization() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, generator=g) * torch.tensor([1.0, 300.0, 1e-3, 5.0])[:, None]
    q, s = quantize_rows_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 1)
    ref_s = x.abs().amax(1, keepdim=True) / 448.0
    assert torch.allclose(s, ref_s, rtol=1e-6)
    assert q.float().abs().max() <= 448.0
    # The GPU's conversion is exact saturating RNE (checked by the GPU selfcheck); the interpreter's own
    # fp32->fp8 cast is not, so here the codes only have to agree mostly and dequantize close to x.
    ref_q = to_e4m3(x / ref_s).float()
    assert (q.float() == ref_q).float().mean() > 0.9
    assert _rel(q.float() * s, x) < 2 * _rel(ref_q * ref_s, x)


@pytest.mark.parametrize(("fmt", "k", "n"), [("nvfp4", 96, 40), ("mxfp4", 96, 40), ("int8", 96, 40),
                                            ("fp8", 96, 40), ("nvfp4", 256, 64), ("mxfp4", 128, 128)])
def test_quant_linear_forward_backward(fmt: str, k: int, n: int) -> None:
    # K % 128 == 0 and N % 64 == 0 take the repacked, tiled FP4 kernel; the others the checkpoint layout
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=True)
    mod = QuantLinear.from_linear(lin, fmt, dtype=torch.float32)
    wd = mod.dequantized_weight(torch.float32).double()
    x = torch.randn(2, 3, k, requires_grad=True)
    y = quant_linear(x, mod)
    assert y is not None and y.shape == (2, 3, n)
    assert isinstance(mod.kernel_layout_state, KernelState) and kernel_state(mod) is mod.kernel_layout_state
    assert mod.kernel_layout_state.tiled == (fmt in ("nvfp4", "mxfp4") and k % 128 == 0 and n % 64 == 0)
    assert _rel(y, x.double() @ wd.T + mod.bias.double()) < TOL[torch.float32]
    node = y.grad_fn.next_functions[0][0]  # below the reshape back to [2, 3, n]
    assert type(node).__name__ == "QuantLinearFunctionBackward"
    assert node.saved_tensors == ()  # no activation and no bf16 weight kept for backward
    dy = torch.randn_like(y)
    y.backward(dy)
    assert _rel(x.grad, dy.double() @ wd) < TOL[torch.float32]
    assert all(p.grad is None for p in mod.parameters())
    with torch.no_grad():
        assert torch.equal(quant_linear(x, mod), y.detach())


def test_quant_linear_declines_what_it_does_not_cover() -> None:
    mod = QuantLinear.from_linear(torch.nn.Linear(64, 32), "int4")
    assert quant_linear(torch.randn(2, 64), mod) is None
    mod = QuantLinear.from_linear(torch.nn.Linear(64, 32), "nvfp4")
    assert quant_linear(torch.randn(2, 64, dtype=torch.float64), mod) is None
    assert quant_linear(torch.randn(0, 64), mod).shape == (0, 32)


def test_dispatch_splits_k_only_when_tiles_are_few() -> None:
    assert split_k_for(tiles=300, k=4096, bk=256, sms=132) == 1
    assert split_k_for(tiles=28, k=18944, bk=256, sms=132) == 16  # 448 CTAs: every SM streams weights
    assert split_k_for(tiles=28, k=512, bk=256, sms=132) == 1  # never below two K-tiles per split
    decode, mid = fp4_config(1, 3584, 18944), fp4_config(128, 37888, 3584)
    assert decode.bm == 16 and decode.split_k == 16 and decode.bk % 128 == 0
    assert fp4_config(1, 37888, 3584).split_k == 2  # 592 tiles: two K halves reach ~6 CTAs per SM
    assert mid.bm >= 64 and mid.split_k == 1


def test_bench_kernels_needs_a_gpu() -> None:
    from qerl_cli.bench.kernels import bench_kernels, layer_linears

    assert layer_linears("qwen2.5-7b") == [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584),
                                           ("down", 3584, 18944)]
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(QerlError, match="needs a CUDA GPU"):
        bench_kernels(("qwen2.5-7b",), (1,), None)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tiled", [False, True])
def test_fp4_repacked_kernel(fmt: str, dtype: torch.dtype, tiled: bool) -> None:
    # the load-time repack is a bijection of the checkpoint bytes; the v2 kernel reads it with 16-bit scales
    for i, (m, n, k) in enumerate([(1, 64, 256), (17, 128, 384)] if tiled else [(1, 40, 256), (17, 33, 384)]):
        qw, wd, g = _weights(fmt, n, k, seed=30 + i)
        t = qw.tensors
        wr = repack_fp4(t["weight_packed"], tiled=tiled)
        assert torch.equal(unrepack_fp4(wr, tiled=tiled), t["weight_packed"])
        assert not torch.equal(wr, t["weight_packed"])
        shift = mxfp4_shift(t["weight_scale"]) if fmt == "mxfp4" else 0
        ks = kernel_scales(t["weight_scale"], fmt, dtype, shift, tiled=tiled)
        x = torch.randn(m, k, generator=g).to(dtype)
        for cfg, serial in ((TileConfig(16, 64, 128), None), (TileConfig(32, 64, 256, split_k=2), True),
                            (TileConfig(16, 64, 128, split_k=3), False)):
            y = torch.full((m, n), float("nan"), dtype=dtype)
            fp4_matmul_v2(x, wr, ks, t.get("weight_global_scale"), fmt, cfg, shift=shift, out=y, tiled=tiled,
                          serial=serial)
            assert _rel(y, x.double() @ wd.T) < TOL[dtype], (fmt, m, n, k, cfg, serial)
    # serial split-K leaves its arrival counters at zero for the next call
    assert not tile_counters(torch.device("cpu"), 1).any()
