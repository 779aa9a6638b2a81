"""The CUDA FP4 kernel's data layout, checked on the CPU through its exact emulation (`qerl_kernels.cuda_fp4`):
which bytes each lane loads, how they decode, which scales they meet and which activation each tensor-core
operand slot is paired with. The kernel itself runs only on a Hopper GPU (`python -m qerl_kernels.selfcheck`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from qerl_kernels import cuda_fp4
from qerl_kernels.fp4 import mxfp4_shift, repack_fp4

from qerl_cli.formats import dequantize, quantize


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05 * (1 + 20 * (torch.rand(n, k, generator=g) > 0.99))


@pytest.mark.parametrize(("n", "k", "tiled"), [(64, 256, True), (48, 384, False), (128, 128, True)])
def test_lane_view_round_trips_to_the_checkpoint_bytes(n: int, k: int, tiled: bool) -> None:
    packed = torch.randint(0, 256, (n, k // 2), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    words = cuda_fp4.lane_words(repack_fp4(packed, tiled=tiled), tiled)
    assert words.shape == (n, k // 128, 4, 4)
    assert torch.equal(cuda_fp4.checkpoint_from_lanes(words), packed)
    # every K position of a chunk is owned by exactly one (lane, word, shift, half)
    ks = sorted(kk for q in range(4) for i in range(4) for s in cuda_fp4.SHIFTS for kk in cuda_fp4.k_of(q, i, s))
    assert ks == list(range(128))


def test_lane_words_are_what_the_checkpoint_says() -> None:
    # hand-checked: lane q's word i of row r, chunk c holds checkpoint bytes 4g+q for g = 4i..4i+3
    packed = torch.arange(64 * 128, dtype=torch.int64).reshape(64, 128).remainder(251).to(torch.uint8)
    words = cuda_fp4.lane_words(repack_fp4(packed, tiled=True), True)
    r, c, q, i = 5, 1, 2, 3
    want = [int(packed[r, c * 64 + 4 * g + q]) for g in range(4 * i, 4 * i + 4)]
    got = [(int(words[r, c, q, i]) >> (8 * b)) & 0xFF for b in range(4)]
    assert got == want


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tiled", [True, False])
def test_emulated_decode_is_the_reference_dequant_bit_for_bit(fmt: str, dtype: torch.dtype, tiled: bool) -> None:
    n, k = 64, 512
    qw = quantize(_weight(n, k, 3), fmt)
    t = qw.tensors
    shift = mxfp4_shift(t["weight_scale"]) if fmt == "mxfp4" else 0
    rep = repack_fp4(t["weight_packed"], tiled=tiled)
    got = cuda_fp4.emulate_decode(rep, t["weight_scale"], fmt, dtype, tiled=tiled, shift=shift).float()
    # the reference without the per-tensor factor: code * scale (NVFP4 with G = 1), code * 2**(e-127) (MXFP4)
    tens = dict(t)
    if fmt == "nvfp4":
        tens["weight_global_scale"] = torch.ones(1)
        want = dequantize(dataclasses.replace(qw, tensors=tens), torch.float32) * 2.0**cuda_fp4.F_NVFP4
    else:
        want = dequantize(qw, torch.float32) * 2.0**shift
    assert torch.equal(got, want)


_LUT = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _all_bytes(n: int) -> torch.Tensor:
    """[n, 64] checkpoint bytes (K = 128) in which every 4 rows hold all 256 byte values: every code as low and
    as high nibble."""
    return (torch.arange(n * 64) % 256).reshape(n, 64).to(torch.uint8)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_code_and_every_e4m3_scale(dtype: torch.dtype) -> None:
    # scale bytes 0..126: every finite non-negative E4M3 value, subnormals and zero included (8 per row)
    n = 16
    packed = _all_bytes(n)
    sc = (torch.arange(n * 8) % 127).reshape(n, 8).to(torch.uint8).view(torch.float8_e4m3fn)
    got = cuda_fp4.emulate_decode(repack_fp4(packed), sc, "nvfp4", dtype, tiled=False).double()
    want = _LUT[_codes(packed)] * sc.double().repeat_interleave(16, 1) * 2.0**cuda_fp4.F_NVFP4
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # signed zeros too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("emax", [127, 140, 254])
def test_every_e8m0_scale_exponent_under_the_shift(dtype: torch.dtype, emax: int) -> None:
    # MXFP4: the per-tensor shift F brings the largest exponent in range; the 11 binades below it are exact
    n = 16
    packed = _all_bytes(n)
    e = (emax - torch.arange(n * 4) % 11).reshape(n, 4).to(torch.uint8)
    shift = mxfp4_shift(e)
    got = cuda_fp4.emulate_decode(repack_fp4(packed), e, "mxfp4", dtype, tiled=False, shift=shift).double()
    want = _LUT[_codes(packed)] * torch.pow(2.0, e.double() - 127 + shift).repeat_interleave(32, 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_gemm_matches_float64(fmt: str, dtype: torch.dtype) -> None:
    n, k, m = 32, 256, 5
    qw = quantize(_weight(n, k, 5), fmt)
    t = qw.tensors
    shift = mxfp4_shift(t["weight_scale"]) if fmt == "mxfp4" else 0
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    y = cuda_fp4.emulate_gemm(x, repack_fp4(t["weight_packed"], tiled=False), t["weight_scale"],
                              t.get("weight_global_scale"), fmt, tiled=False, shift=shift)
    ref = x.double() @ dequantize(qw, torch.float64).T
    assert ((y - ref).norm() / ref.norm()).item() < 1e-6
    # the pairing is what makes it right: the activations in plain K order give a wrong answer
    wrong = cuda_fp4.emulate_gemm(x.reshape(m, k // 32, 32).flip(-1).reshape(m, k),
                                  repack_fp4(t["weight_packed"], tiled=False), t["weight_scale"],
                                  t.get("weight_global_scale"), fmt, tiled=False, shift=shift)
    assert ((wrong - ref).norm() / ref.norm()).item() > 0.1


def test_launch_plan_is_a_fixed_rule_over_built_kernels() -> None:
    # decode: CTAs of 8 warps on one 16-row block, K never split across CTAs (it measured slower)
    assert cuda_fp4.launch_plan(1, 3584, 3584, 132) == (1, 1, 8, False, 1, 28)
    assert cuda_fp4.launch_plan(1, 3584, 18944, 132) == (1, 1, 8, False, 1, 148)
    assert cuda_fp4.launch_plan(1, 37888, 3584, 132) == (1, 1, 8, False, 1, 28)
    # above M = 2 the activations come from the permuted copy; 64-token tiles for large M
    assert cuda_fp4.launch_plan(16, 37888, 3584, 132)[:4] == (2, 1, 8, True)
    # one 64-token tile on 7B o_proj: 224 warps -> K split 4 ways; several tiles: no split
    assert cuda_fp4.launch_plan(64, 3584, 3584, 132) == (8, 4, 1, True, 4, 7)
    assert cuda_fp4.launch_plan(256, 4608, 3584, 132)[:5] == (8, 4, 1, True, 1)
    for m in (1, 3, 8, 16, 17, 32, 64, 256, 2048):  # every plan is a built configuration covering all of K
        for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (208, 384)):
            mt, wn, wk, perm, splits, cps = cuda_fp4.launch_plan(m, n, k, 132)
            assert (mt, wn, wk, perm) in cuda_fp4.CONFIGS and splits * cps >= k // 128 > (splits - 1) * cps
    assert cuda_fp4.supports(4608, 3584) and not cuda_fp4.supports(4608, 3520) and not cuda_fp4.supports(72, 384)


def test_cuda_backend_is_refused_clearly_without_a_hopper_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_kernels import dispatch

    from qerl_cli.errors import QerlError

    monkeypatch.setenv(dispatch.ENV, "auto")
    if cuda_fp4.available():
        pytest.skip("a Hopper GPU with nvcc is present")
    with pytest.raises(QerlError, match="needs a Hopper"):
        dispatch.set_backend("cuda")
    monkeypatch.setenv(dispatch.CANDIDATES_ENV, "triton,cuda")
    assert "cuda" not in dispatch.candidates()  # named but not buildable here: measured without it
    monkeypatch.setenv(dispatch.CANDIDATES_ENV, "triton,cuda,bogus")
    with pytest.raises(QerlError, match="cuda"):
        dispatch.candidates()
