"""W4A8 (kernels/w4a8.py) under the Triton interpreter: the kernel equals its torch emulation, the emulation stays
inside the stated error bound of the exact product, and the pieces (per-token scale, per-channel exponent, E4M3
rounding, bias, ragged M, K tails) are what the docstring says.

The interpreter runs the kernel's F32 path: integer FP4 decode, E4M3 rounding by `round_e4m3` (the interpreter's
own fp32->fp8 cast drops the rounding carry), and an fp8 `tl.dot` that widens both operands exactly and multiplies
in fp32. Every fp8 x fp8 product is exact in fp32, so the kernel and the emulation (exact sum, one rounding to
fp32) differ only by the order of fp32 additions: |diff| <= K * 2**-24 * sum |q w8| * |cs sx|, the tolerance used.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from qerl_kernels import INTERPRET, TileConfig
from qerl_kernels.fp4 import kernel_scales, repack_fp4
from qerl_kernels.w4a8 import (
    channel_exponents,
    quantize_rows,
    quantize_rows_emulated,
    w4a8_emulate,
    w4a8_error_bound,
    w4a8_matmul,
    w4a8_scales,
    widened_weight,
)
from qerl_kernels.w8 import round_e4m3

from qerl_cli.formats import dequantize, quantize


def _weights(fmt: str, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qw = quantize(torch.randn(n, k, generator=g) * 0.05, fmt, dtype=torch.float16)
    t = qw.tensors
    return t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), qw, g


def _run(x: torch.Tensor, fmt: str, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
         cfg: TileConfig, *, tiled: bool = True, bias: torch.Tensor | None = None, swap: bool = False) -> torch.Tensor:
    sc = w4a8_scales(scale, gs, fmt)
    ks = kernel_scales(scale, fmt, torch.float32, 0, tiled=tiled)
    return w4a8_matmul(x, repack_fp4(packed, tiled), ks, sc, fmt, tiled=tiled, bias=bias, cfg=cfg, swap=swap)


def _accumulation_tol(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, fmt: str, sc) -> torch.Tensor:
    q, sx = quantize_rows_emulated(x)
    w8 = widened_weight(packed, scale, sc, fmt)
    mag = (q.abs().double() @ w8.abs().double().T) * sx.double()[:, None] * sc.cscale.double()[None, :]
    return mag * (x.shape[1] * 2.0**-24) + 1e-30


def test_interpreter_is_on() -> None:
    assert INTERPRET


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("m", "n", "k", "cfg", "tiled"), [
    (5, 64, 256, TileConfig(16, 32, 128), True),  # M below the tile (masked rows)
    (37, 64, 384, TileConfig(32, 64, 128, split_k=2), True),  # M not a multiple of BM, two K slices
    (20, 40, 256, TileConfig(16, 32, 256), False),  # N not a multiple of BN, checkpoint-row repack (not tiled)
])
def test_kernel_equals_emulation(fmt: str, m: int, n: int, k: int, cfg: TileConfig, tiled: bool, swap: bool) -> None:
    packed, scale, gs, _, g = _weights(fmt, n, k, seed=m)
    x = torch.randn(m, k, generator=g) * 3.0
    bias = torch.randn(n, generator=g)
    y = _run(x, fmt, packed, scale, gs, cfg, tiled=tiled, bias=bias, swap=swap)
    sc = w4a8_scales(scale, gs, fmt)
    em = w4a8_emulate(x, packed, scale, sc, fmt, bias=bias)
    assert y.shape == (m, n) and torch.isfinite(y).all()
    diff = (y.double() - em.double()).abs()
    assert (diff <= _accumulation_tol(x, packed, scale, fmt, sc) + 2.0**-22 * bias.abs().double()).all()
    # the bias is in there: without it the result is far off
    assert (y.double() - (em - bias).double()).abs().max() > 0.1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_emulation_within_stated_bound_of_exact_product(fmt: str) -> None:
    packed, scale, gs, qw, g = _weights(fmt, 96, 512, seed=1)
    x = torch.randn(24, 512, generator=g) * torch.logspace(-3, 2, 24)[:, None]  # rows of very different size
    x[3, 7] = 1e-7  # a subnormal-range element next to normal ones
    w = dequantize(qw, torch.float32)
    sc = w4a8_scales(scale, gs, fmt)
    em = w4a8_emulate(x, packed, scale, sc, fmt).double()
    ref = x.double() @ w.double().T
    assert ((em - ref).abs() <= w4a8_error_bound(x, w, sc)).all()
    rel = ((em - ref).norm() / ref.norm()).item()
    # measured ~2.7e-2 (NVFP4) / ~2.2e-2 (MXFP4); the W4A16 kernels are ~1e-6 here
    assert 5e-3 < rel < 4e-2


def test_mxfp4_weights_widen_exactly_nvfp4_round_once() -> None:
    # MXFP4: code * 2**E * 2**e is on the E4M3 grid whenever the channel spans <= 14 binades -> exact
    packed, scale, _, qw, _ = _weights("mxfp4", 64, 256, seed=2)
    sc = w4a8_scales(scale, None, "mxfp4")
    w8 = widened_weight(packed, scale, sc, "mxfp4")
    exact = dequantize(qw, torch.float32) * torch.exp2(sc.exponent.float())[:, None]
    assert torch.equal(w8, exact)
    # NVFP4: 1.5 * 1.125 = 1.6875 has 5 significant bits -> rounds (ties to even) to 1.625; 1.5 * 1.25 exact
    packed, scale, gs, qw, _ = _weights("nvfp4", 64, 256, seed=3)
    sc = w4a8_scales(scale, gs, "nvfp4")
    w8 = widened_weight(packed, scale, sc, "nvfp4").double()
    exact = dequantize(qw, torch.float64) * gs.double() * torch.exp2(sc.exponent.double())[:, None]
    err = (w8 - exact).abs()
    assert (err <= exact.abs() * 2.0**-4 + 2.0**-10).all()
    assert (err > 0).float().mean() > 0.05  # some weights do round: the bound is not vacuous
    assert w8.abs().max() <= 448.0


def test_channel_exponent_is_the_largest_that_fits() -> None:
    # NVFP4 scales 448 (max): 6 * 448 = 2688, 2688 * 2**-3 = 336 <= 448 < 672; scale 2: 12 * 2**5 = 384
    s = torch.tensor([[448.0, 1.0], [2.0, 0.5], [0.0, 0.0]]).to(torch.float8_e4m3fn)
    assert channel_exponents(s, "nvfp4").tolist() == [-3, 5, 0]
    # MXFP4 E = 127 (scale 1): 6 * 2**6 = 384 fits, 2**7 would not
    e = torch.tensor([[127, 120], [130, 100]], dtype=torch.uint8)
    assert channel_exponents(e, "mxfp4").tolist() == [6, 3]


def test_per_token_activation_scale_by_hand() -> None:
    # row 0: amax 2 -> sx = 2/448; 1.0 / sx = 224 (exact in E4M3), 0.35 / sx = 78.4 -> 80 (spacing 8 in
    # [64, 128)), 0.555 / sx = 124.3 -> 128 (the rounding carries into the exponent)
    # row 1: amax 448 -> sx = 1; 5.3 -> 5.5 (spacing 0.5 in [4, 8)); row 2: zeros -> sx = 1e-12 / 448, q = 0
    x = torch.tensor([[1.0, -2.0, 0.35, 0.555], [448.0, 5.3, -0.01, 3.0], [0.0, 0.0, 0.0, 0.0]])
    q, sx = quantize_rows(x)
    qv = q.view(torch.float8_e4m3fn).float()
    assert torch.equal(sx, torch.tensor([2.0 / 448.0, 1.0, 1e-12 / 448.0], dtype=torch.float32))
    assert qv[0].tolist() == [224.0, -448.0, 80.0, 128.0]
    assert qv[1, :2].tolist() == [448.0, 5.5] and qv[1, 3] == 3.0
    assert qv[1, 2] == -0.009765625  # -0.01 -> subnormal grid 2**-9 * 5 = 0.009765625
    assert (qv[2] == 0).all()
    qe, sxe = quantize_rows_emulated(x)
    assert torch.equal(qe, qv) and torch.equal(sxe, sx)


@triton.jit
def _round_kernel(x_ptr, y_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y_ptr + o, round_e4m3(tl.load(x_ptr + o)))


def test_round_e4m3_matches_torch_rne() -> None:
    # every E4M3 value, the midpoints between neighbours (ties to even) and random values, both signs
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    rnd = torch.exp2(torch.rand(2000, generator=g) * 20 - 12) * (1 + torch.rand(2000, generator=g))
    v = torch.cat([grid, mids, rnd.clamp(max=448.0), torch.tensor([2.0**-10, 2.0**-10 * 1.0001, 3 * 2.0**-11])])
    v = torch.cat([v, -v])
    n = triton.next_power_of_2(v.numel())
    xp = torch.zeros(n)
    xp[: v.numel()] = v
    out = torch.empty(n)
    _round_kernel[(1,)](xp, out, N=n)
    assert torch.equal(out[: v.numel()], v.to(torch.float8_e4m3fn).float())


def test_k_tail_is_refused() -> None:
    packed, scale, gs, _, _ = _weights("nvfp4", 64, 192, seed=4)  # K = 192: not a multiple of 128
    sc = w4a8_scales(scale, gs, "nvfp4")
    with pytest.raises(ValueError, match="K % 128 == 0"):
        w4a8_matmul(torch.randn(4, 192), packed, kernel_scales(scale, "nvfp4", torch.float32), sc, "nvfp4")


def test_nvfp4_needs_global_scale() -> None:
    _, scale, _, _, _ = _weights("nvfp4", 64, 128, seed=5)
    with pytest.raises(ValueError, match="global_scale"):
        w4a8_scales(scale, None, "nvfp4")


def test_dispatch_asks_humming_only_for_mxfp4_and_per_bucket(monkeypatch, use_options) -> None:  # noqa: ANN001
    """The W4A8 choice (kernels/dispatch.py): NVFP4 never reaches humming (its 16-weight scale groups are below
    the FP8 MMA's K of 32, which humming's W4A8 refuses); MXFP4 follows the measured plan per M bucket, and with
    humming installed the memory plan counts its W4A8 copy beside its W4A16 one (by hand: N x K / 2 nibble bytes
    + one scale byte per 32 weights, twice)."""
    from qerl_kernels import dispatch, humming_peer
    from torch import nn

    from qerl_cli.qlinear import QuantLinear

    assert humming_peer.W4A8_FORMATS == ("mxfp4",)
    monkeypatch.setattr(humming_peer, "available", lambda: True)
    use_options(w4a8=True)
    dispatch.reset()
    lin = nn.Linear(512, 256, bias=False)
    mx, nv = QuantLinear.from_linear(lin, "mxfp4"), QuantLinear.from_linear(lin, "nvfp4")
    x64, x100 = torch.zeros(64, 512), torch.zeros(100, 512)
    assert dispatch.w4a8_backend(nv, x64) == "qerl"  # decided without a plan
    dispatch._plans[("w4a8",) + dispatch.shape_key(mx, x64.dtype)] = {64: "humming", 128: "qerl", 256: "humming"}
    assert [dispatch.w4a8_backend(mx, x) for x in (x64, x100, torch.zeros(200, 512))] == ["humming", "qerl",
                                                                                         "humming"]
    use_options(dispatch_candidates="triton,cublas")  # humming kept out of auto: qerl's kernel everywhere
    assert dispatch.w4a8_backend(mx, x64) == "qerl"
    use_options(dispatch_candidates="")
    one = 256 * 512 // 2 + 256 * (512 // 32)
    assert dispatch.extra_copy_bytes("mxfp4", 256, 512) == 2 * one == 139264
    assert dispatch.extra_copy_bytes("nvfp4", 256, 512) == 256 * 512 // 2 + 256 * (512 // 16)
    use_options(w4a8=False)
    assert dispatch.extra_copy_bytes("mxfp4", 256, 512) == one
    dispatch.reset()
