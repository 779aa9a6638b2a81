"""The CUDA FP4 kernel's data layout, checked on the CPU through its exact emulation (`qerl_kernels.cuda_fp4`):
which bytes each lane loads, how they decode, which scales they meet and which activation each tensor-core
operand slot is paired with. The kernel itself runs only on a Hopper GPU
(`python -m qerl_cli.bench.kernel_selfcheck`)."""

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


def test_legacy_plan_is_a_fixed_rule_over_built_kernels() -> None:
    def tup(p: cuda_fp4.Plan) -> tuple:
        return p.mt, p.wn, p.wk, p.perm, p.splits, p.cps

    # decode: CTAs of 8 warps on one 16-row block, K never split across CTAs (it measured slower)
    assert tup(cuda_fp4.legacy_plan(1, 3584, 3584, 132)) == (1, 1, 8, False, 1, 28)
    assert tup(cuda_fp4.legacy_plan(1, 3584, 18944, 132)) == (1, 1, 8, False, 1, 148)
    assert tup(cuda_fp4.legacy_plan(1, 37888, 3584, 132)) == (1, 1, 8, False, 1, 28)
    # above M = 2 the activations come from the permuted copy; 64-token tiles for large M
    assert tup(cuda_fp4.legacy_plan(16, 37888, 3584, 132))[:4] == (2, 1, 8, True)
    # one 64-token tile on 7B o_proj: 224 warps -> K split 4 ways; several tiles: no split
    assert tup(cuda_fp4.legacy_plan(64, 3584, 3584, 132)) == (8, 4, 1, True, 4, 7)
    assert tup(cuda_fp4.legacy_plan(256, 4608, 3584, 132))[:5] == (8, 4, 1, True, 1)
    # legacy arguments force the legacy rule through launch_plan (what the self-check's per-config runs use)
    assert cuda_fp4.launch_plan(8, 3584, 3584, 132, mt=1, wn=1, wk=8, perm=True).kind == "legacy"
    for m in (1, 3, 8, 16, 17, 32, 64, 256, 2048):  # every plan is a built configuration covering all of K
        for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (208, 384)):
            p = cuda_fp4.legacy_plan(m, n, k, 132)
            assert (p.mt, p.wn, p.wk, p.perm) in cuda_fp4.CONFIGS
            assert p.splits * p.cps >= k // 128 > (p.splits - 1) * p.cps
    assert cuda_fp4.supports(4608, 3584) and not cuda_fp4.supports(4608, 3520) and not cuda_fp4.supports(72, 384)


_DECODE_SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944),  # Qwen2.5-7B qkv, o, gate_up, down
                  (7168, 5120), (5120, 5120), (55296, 5120), (5120, 27648)]  # Qwen2.5-32B


def test_launch_plan_picks_the_stream_kernels_at_decode_sizes(use_options) -> None:  # noqa: ANN001
    use_options(cuda_fp4_plans="stream")  # the default, whatever the process was started with
    kinds = {m: cuda_fp4.launch_plan(m, 4608, 3584, 132).kind for m in (1, 8, 16, 17, 32, 64, 65, 256)}
    assert kinds == {1: "decode", 8: "decode", 16: "decode", 17: "wide", 32: "wide", 64: "wide", 65: "legacy",
                     256: "legacy"}
    # 7B gate_up at M = 8: 2368 row blocks on 3 x 132 CTAs (5.98 each: the busiest holds 6, +0.3%) -> whole row
    # blocks per CTA, no fix-up
    p = cuda_fp4.launch_plan(8, 37888, 3584, 132)
    assert (p.kind, p.mt, p.perm, p.stages, p.ctas, p.nseg, p.pmode, p.fixup) == \
        ("decode", 1, True, 4, 396, 1, True, False)
    # 7B o at M = 1: 224 row blocks on 2 x 132 CTAs -> unit ranges cut row blocks; gathered activations, 8 stages
    p = cuda_fp4.launch_plan(1, 3584, 3584, 132)
    assert (p.perm, p.stages, p.ctas, p.pmode, p.fixup) == (False, 8, 264, False, True)
    # 32B q/k/v at M = 8: 448 row blocks on 396 CTAs would leave the busiest CTA with 2 (+77%): unit ranges
    assert not cuda_fp4.launch_plan(8, 7168, 5120, 132).pmode
    # 7B down at M = 8: the permuted activations of K = 18944 (303 KB) in 4 segments of 37 chunks for the L1
    p = cuda_fp4.launch_plan(8, 3584, 18944, 132)
    assert (p.nseg, p.kcs) == (4, 37)
    # the SM count read off the device sizes the grid; QERL_CUDA_FP4_PLANS=legacy switches back
    assert cuda_fp4.launch_plan(8, 37888, 3584, 78).ctas == 234
    use_options(cuda_fp4_plans="legacy")
    assert cuda_fp4.launch_plan(8, 37888, 3584, 132).kind == "legacy"


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16, 17, 32, 33, 64])
def test_stream_plans_cover_every_unit_once_and_fit_32_bit(m: int, use_options) -> None:  # noqa: ANN001
    use_options(cuda_fp4_plans="stream")
    for n, k in _DECODE_SHAPES:
        for sms in (132, 78):
            p = cuda_fp4.launch_plan(m, n, k, sms)
            cuda_fp4.check_plan(p)
            sp = p.split(n, k)
            assert p.ctas <= sp.units and sp.units * p.ctas < 2**31 and p.ctas <= cuda_fp4.ctas_per_sm(p) * sms
            ranges = [sp.range(c, p.ctas, p.pmode) for c in range(p.ctas)]
            assert ranges[0][0] == 0 and ranges[-1][1] == sp.units and all(a < b for a, b in ranges)
            assert all(ranges[c][1] == ranges[c + 1][0] for c in range(p.ctas - 1))
            if not p.pmode:  # the fix-up finds a unit's CTA by formula
                for c in (0, 1, p.ctas // 2, p.ctas - 1):
                    a, b = ranges[c]
                    assert {sp.owner(a, p.ctas), sp.owner(b - 1, p.ctas)} == {c}
            assert p.fixup == (sp.nseg > 1 or sp.any_cut(p.ctas, p.pmode))


def test_stream_split_portions_partition_the_units() -> None:
    sp = cuda_fp4.StreamSplit(kc=37, kcs=10, nseg=4, rg=5)  # segments of 10, 10, 10, 7 chunks
    units = [(sp.portion(u), sp.chunk(u)) for u in range(sp.units)]
    assert sp.units == 185 and sp.pstart(sp.nseg * sp.rg) == 185
    for pi in range(sp.nseg * sp.rg):  # each portion: consecutive units, its segment's chunks once each
        s = pi // sp.rg
        got = [ch for u, (q, ch) in enumerate(units) if q == pi]
        assert got == list(range(10 * s, 10 * s + sp.seg_len(s)))
        assert [u for u, (q, _) in enumerate(units) if q == pi] == list(range(sp.pstart(pi), sp.pstart(pi + 1)))


def _chunks(m: int, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k // 128, m, n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("kind", "m", "n", "k", "kw"), [
    ("decode", 5, 208, 1152, {"ctas": 7}),  # unit ranges: row blocks cut between CTAs
    ("decode", 5, 208, 1152, {"ctas": 5, "nseg": 3}),  # K segments (9 chunks: 3 + 3 + 3) and cuts
    ("decode", 3, 208, 1280, {"ctas": 6, "nseg": 3}),  # segments of 4, 4, 2 chunks
    ("decode", 8, 208, 1152, {"ctas": 3, "nseg": 2, "pmode": True}),  # whole portions per CTA, two segments
    ("decode", 8, 208, 1152, {"ctas": 13, "pmode": True}),  # whole row blocks: y written directly, no fix-up
    ("decode", 20, 64, 1152, {"ctas": 4}),  # two M groups of 16 tokens share the CTAs' ranges
    ("wide", 40, 208, 1152, {"ctas": 5}),  # 128-row groups, the last one half dead
    ("wide", 20, 512, 768, {"ctas": 3, "pmode": True}),
    ("wide", 70, 256, 768, {"ctas": 4}),  # two M groups of 64
])
def test_emulated_stream_plan_sums_every_unit_once(kind: str, m: int, n: int, k: int, kw: dict) -> None:
    mk = cuda_fp4.decode_plan if kind == "decode" else cuda_fp4.wide_plan
    plan = mk(m, n, k, 132, **kw)
    chunks = _chunks(m, n, k, 7)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    lora = torch.randn(m, n, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    y = cuda_fp4.emulate_plan(plan, chunks, alpha=0.25, bias=bias, lora=lora)
    want = chunks.sum(0) * 0.25 + lora + bias.double()
    assert torch.isfinite(y).all()  # every output written (by its CTA or by the fix-up)
    assert torch.allclose(y, want, rtol=0, atol=1e-12)
    # counting: every chunk once, the LoRA term once (in the part holding the row group's first chunk)
    ones = cuda_fp4.emulate_plan(plan, torch.ones(k // 128, m, n, dtype=torch.float64),
                                 lora=torch.full((m, n), 1000.0, dtype=torch.float64))
    assert torch.equal(ones, torch.full((m, n), 1000.0 + k // 128, dtype=torch.float64))


@pytest.mark.parametrize("r", [8, 16, 24, 32, 136])
def test_emulated_lora_epilogue_matches_fp32(r: int) -> None:
    g = torch.Generator().manual_seed(r)
    m, n = 11, 48
    h = torch.randn(m, r, generator=g).to(torch.bfloat16)
    b = (torch.randn(n, r, generator=g) * 0.1).to(torch.bfloat16)
    got = cuda_fp4.emulate_lora(h, b)
    want = h.float() @ b.float().T  # a plain fp32 reference
    assert ((got - want.double()).norm() / want.double().norm()).item() < 1e-6


def test_emulated_lora_pairing_is_what_makes_it_right(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    h = torch.randn(8, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    want = h.double() @ b.double().T
    assert torch.allclose(cuda_fp4.emulate_lora(h, b), want, rtol=1e-12, atol=1e-12)
    # a B register loading the wrong r half (r0 + 2q instead of r0 + 8 + 2q) pairs wrong elements
    monkeypatch.setattr(cuda_fp4, "LORA_B_LOADS", {0: 0, 1: 0})
    assert not torch.allclose(cuda_fp4.emulate_lora(h, b), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_gemm_with_bias_and_lora_matches_fp32(fmt: str, dtype: torch.dtype) -> None:
    n, k, m, r = 32, 256, 5, 24
    g = torch.Generator().manual_seed(11)
    qw = quantize(_weight(n, k, 12), fmt)
    t = qw.tensors
    shift = mxfp4_shift(t["weight_scale"]) if fmt == "mxfp4" else 0
    x = torch.randn(m, k, generator=g).to(dtype)
    h = torch.randn(m, r, generator=g).to(dtype)
    b = (torch.randn(n, r, generator=g) * 0.05).to(dtype)
    bias = torch.randn(n, generator=g)
    y = cuda_fp4.emulate_gemm(x, repack_fp4(t["weight_packed"], tiled=False), t["weight_scale"],
                              t.get("weight_global_scale"), fmt, tiled=False, shift=shift, bias=bias, lora_h=h,
                              lora_b=b)
    ref = x.float() @ dequantize(qw, torch.float32).T + bias + h.float() @ b.float().T  # plain fp32
    assert ((y - ref.double()).norm() / ref.double().norm()).item() < 1e-5


def test_epilogue_rounds_once_in_fp32() -> None:
    # acc * alpha + lora + bias in fp32, one rounding: 1 + 2**-8 + 2**-8 is 1 + 2**-7 in fp32 (a bf16 value),
    # where rounding to bf16 after each add would lose both halves (ties to even)
    acc = torch.tensor([[1.0]])
    got = cuda_fp4.emulate_epilogue(acc, 1.0, torch.bfloat16, bias=torch.tensor([2.0**-8]),
                                    lora=torch.tensor([[2.0**-8]]))
    assert got.item() == 1.0 + 2.0**-7
    twice = ((acc.to(torch.bfloat16) + 2.0**-8).to(torch.bfloat16) + 2.0**-8).to(torch.bfloat16)
    assert twice.item() == 1.0
    assert cuda_fp4.output_alpha("mxfp4", None, 3) == 0.125


def test_lora_epilogue_support_and_argument_checks() -> None:
    assert cuda_fp4.supports_lora_epilogue(4608, 3584, 96) and cuda_fp4.supports_lora_epilogue(3584, 3584, 8)
    assert not cuda_fp4.supports_lora_epilogue(4608, 3584, 12)  # R % 8
    assert not cuda_fp4.supports_lora_epilogue(4608, 3584, 264)  # above MAX_LORA_RANK
    assert not cuda_fp4.supports_lora_epilogue(72, 3584, 32)  # N % 16
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="R % 8"):
        cuda_fp4.check_lora_args(torch.zeros(4, 12, dtype=torch.bfloat16), torch.zeros(32, 12, dtype=torch.bfloat16),
                             x, 4, 32)
    with pytest.raises(ValueError, match="activation dtype"):
        cuda_fp4.check_lora_args(torch.zeros(4, 16), torch.zeros(32, 16), x, 4, 32)
    with pytest.raises(ValueError, match="lora_b \\[N=32"):
        cuda_fp4.check_lora_args(torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(16, 16, dtype=torch.bfloat16),
                             x, 4, 32)


def test_cuda_backend_is_refused_clearly_without_a_hopper_gpu(use_options) -> None:  # noqa: ANN001
    from qerl_kernels import dispatch
    from qerl_kernels._common import KernelSettingError

    use_options(linear_backend="auto")
    if cuda_fp4.available():
        pytest.skip("a Hopper GPU with nvcc is present")
    with pytest.raises(KernelSettingError, match="needs a Hopper"):
        dispatch.set_backend("cuda")
    use_options(dispatch_candidates="triton,cuda")
    assert "cuda" not in dispatch.candidates()  # named but not buildable here: measured without it
    with pytest.raises(KernelSettingError, match="cuda"):
        use_options(dispatch_candidates="triton,cuda,bogus")


def test_lora_plans_are_keyed_apart_and_forward_with_lora_runs_off_gpu(use_options) -> None:  # noqa: ANN001
    from qerl_kernels import dispatch
    from qerl_kernels import linear as ql

    from qerl_cli.qlinear import QuantLinear

    torch.manual_seed(0)
    mod = QuantLinear.from_linear(torch.nn.Linear(256, 64, bias=True), "nvfp4")
    use_options(dispatch_candidates="triton,cublas")
    plain, lora = dispatch.shape_key(mod, torch.bfloat16), dispatch.shape_key(mod, torch.bfloat16, 32)
    assert lora[:-1] == plain and lora[-1] == "lora32"  # a plan per rank; the plain key is unchanged
    x, h, b = torch.randn(3, 256), torch.randn(3, 16), torch.randn(64, 16) * 0.1
    use_options(linear_backend="cublas")
    assert dispatch.choose(mod, x, lora_rank=16) == "cublas"  # a forced backend answers for LoRA plans too
    y = ql.forward_with_lora(x, mod, h, b)  # off the GPU: the module, then one addmm
    ref = x @ mod.dequantized_weight(torch.float32).T + mod.bias + h @ b.T
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
