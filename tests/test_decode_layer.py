"""The persistent decode layer (kernels/decode_layer.py, kernels/cuda/decode_layer.cu) on the CPU: its emulation equals
the present decode path's math, its schedule covers every weight tile and shrink unit once, the stage counters' values,
and the CUDA source builds for sm_90a without spills (where nvcc is installed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from qerl_kernels import decode_layer as dl

from qerl_cli.formats import dequantize, quantize

gemm = dl.checkpoint_args  # the kernels' view of a quantized weight's checkpoint tensors

H, KO, I = 256, 384, 384  # hidden, o's input (heads * head_dim != hidden), intermediate


def _quant(n: int, k: int, seed: int, fmt: str = "nvfp4",
           dtype: torch.dtype = torch.bfloat16) -> tuple[object, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5
    qw = quantize(w, fmt, dtype=dtype)  # INT4's scales in the activation dtype, as a model's checkpoint holds them
    return qw, dequantize(qw, torch.float32)


def _layer(dtype: torch.dtype, ranks: tuple[int, int, int], seed: int = 0, fmt: str = "nvfp4") -> dict:
    g = torch.Generator().manual_seed(100 + seed)
    shapes = ((H, KO), (2 * I, H), (H, I))  # gate/up quantized as one tensor: one global scale, as fused modules hold
    args, weights, loras = [], [], []
    for gi, ((n, k), r) in enumerate(zip(shapes, ranks, strict=True)):
        qw, wf = _quant(n, k, seed * 10 + gi, fmt, dtype)
        a = b = None
        if r:
            a = (torch.randn(r, k, generator=g) * k**-0.5).to(dtype)
            b = (torch.randn(n, r, generator=g) * 0.3).to(dtype)
        args.append(gemm(qw, a, b))
        weights.append(wf)
        loras.append(None if a is None else (a, b))
    m = 5
    attn = (torch.randn(m, KO, generator=g)).to(dtype)
    h = (torch.randn(m, H, generator=g) * 2).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return dict(attn=attn, h=h, norm_w=norm_w, args=args, weights=weights, loras=loras)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("ranks", "ctas"), [((0, 0, 0), 3), ((16, 40, 24), 1), ((16, 40, 24), 7)])
def test_emulation_equals_the_present_path_math(dtype: torch.dtype, ranks: tuple[int, int, int], ctas: int,
                                                fmt: str) -> None:
    """1 CTA: each warp holds several whole blocks; 3 and 7: blocks cut between up to 5 warps (gate/up pairs cut
    inside their gate or their up half). MXFP4: its E8M0 scales (one per 32 weights) and 2^-F factor. INT4: its code
    decode and one 16-bit scale per 128-wide group. INT8 / FP8: the codes exact, each row's scale after its sums."""
    lay = _layer(dtype, ranks, fmt=fmt)
    o, gu, dn = lay["args"]
    assert dl.check_shapes(o, gu, dn, lay["attn"].shape[0], dtype) is None
    h1, out = dl.emulate_mlp_half(lay["attn"], lay["h"], lay["norm_w"], 1e-6, o, gu, dn, ctas)
    rh1, rout = dl.reference_mlp_half(lay["attn"], lay["h"], lay["norm_w"], 1e-6, tuple(lay["weights"]),
                                      tuple(lay["loras"]))
    assert h1.dtype == out.dtype == dtype and h1.shape == (5, H) and out.shape == (5, H)
    assert torch.isfinite(out.float()).all()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert _rel(h1, rh1) < tol and _rel(out, rout) < tol
    if any(ranks):  # the LoRA terms are really in: without them the result moves by far more than rounding
        bare = dl.reference_mlp_half(lay["attn"], lay["h"], lay["norm_w"], 1e-6, tuple(lay["weights"]),
                                     (None, None, None))[1]
        assert _rel(bare, rout) > 5 * tol


def test_emulation_follows_each_input() -> None:
    """A wrong wire (the norm weight, the residual, the up half) would leave the emulation equal on a symmetric input;
    perturbing each input must move the output."""
    lay = _layer(torch.bfloat16, (8, 16, 8), seed=1)
    base = dl.emulate_mlp_half(lay["attn"], lay["h"], lay["norm_w"], 1e-6, *lay["args"], 5)[1]
    for name in ("attn", "h", "norm_w"):
        moved = dict(lay)
        moved[name] = (lay[name].float() * 1.5).to(torch.bfloat16)
        got = dl.emulate_mlp_half(moved["attn"], moved["h"], moved["norm_w"], 1e-6, *lay["args"], 5)[1]
        assert _rel(got, base) > 1e-2, name


SEVEN_B = dict(h=3584, i=18944, ko=3584)


@pytest.mark.parametrize("ctas", [264, 132, 78, 7])
@pytest.mark.parametrize("m", [1, 16])
def test_schedule_covers_every_weight_tile_once(ctas: int, m: int) -> None:
    sch = dl.Schedule(m=m, ranks=(32, 64, 32), ctas=ctas, **SEVEN_B)
    for gi in range(3):
        n, kc = sch.n(gi), sch.k(gi) // 128
        nb, u, _ = sch.geo(gi)
        # the warps' ranges tile the stage's units, and no warp streams more than one unit above the fair share
        ranges = [sch.range(gi, v) for v in range(sch.warps)]
        assert ranges[0][0] == 0 and ranges[-1][1] == sch.units(gi) == n // 16 * kc
        assert all(ranges[v][1] == ranges[v + 1][0] for v in range(sch.warps - 1))
        assert max(e - f for f, e in ranges) - min(e - f for f, e in ranges) <= 1
        # every (row block, chunk) tile once, and each block's partials are contiguous warps covering its units
        seen = torch.zeros(n // 16, kc, dtype=torch.int64)
        for b in range(nb):
            parts = sch.parts(gi, b)
            assert [p[1] for p in parts][0] == b * u and parts[-1][2] == (b + 1) * u
            assert all(parts[k][2] == parts[k + 1][1] and parts[k][0] + 1 == parts[k + 1][0]
                       for k in range(len(parts) - 1))
            assert all(sch.warp_of(gi, f) == v == sch.warp_of(gi, e - 1) for v, f, e in parts)
            assert len(parts) <= sch.pmax(gi)
            rows = set()
            for x in range(b * u, (b + 1) * u):
                row, ch = sch.unit(gi, x)
                seen[row // 16, ch] += 1
                rows.add(row)
            if gi == 1:  # pair b: gate block b first, then up block I/16 + b
                assert [sch.unit(gi, b * u)[0], sch.unit(gi, b * u + kc)[0]] == [16 * b, 16 * (sch.i // 16 + b)]
        assert bool((seen == 1).all()), f"stage {gi}: tiles missed or doubled"
        units = sch.shrink_units(gi)
        nseg = -(-kc // dl.shrink_chunks(sch.k(gi)))
        want = sorted((rk, s) for s in range(nseg) for rk in range(sch.ranks[gi] // 16))
        assert sorted((rk, s) for _, rk, s in units) == want
        assert nseg <= dl.SHRINK_SEGMENTS


def test_schedule_by_hand() -> None:
    """7B o at 264 CTAs: 224 blocks x 28 chunks = 6272 units over 264 x 7 = 1848 GEMM warps, 3.394 each: warp v
    starts at floor(3.394 v), so block 0's units 0..27 lie in warps 0..8 (warp 8's range [27, 30) ends in block 1)."""
    sch = dl.Schedule(m=8, ranks=(0, 0, 0), ctas=264, **SEVEN_B)
    assert sch.warps == 1848
    assert sch.geo(0) == (224, 28, 28) and sch.geo(1) == (1184, 56, 28) and sch.geo(2) == (224, 148, 148)
    assert sch.range(0, 0) == (0, 3) and sch.range(0, 3) == (10, 13) and sch.range(0, 8) == (27, 30)
    assert sch.parts(0, 0)[0] == (0, 0, 3) and sch.parts(0, 0)[-1] == (8, 27, 28) and len(sch.parts(0, 0)) == 9
    # the scratch's slots per block: the most warps any block spans, by brute force over every unit's owner
    for gi in range(3):
        t, w = sch.units(gi), sch.warps
        owner = [0] * t
        for v in range(w):
            for x in range(v * t // w, (v + 1) * t // w):
                owner[x] = v
        u = sch.geo(gi)[1]
        assert sch.pmax(gi) == max(len(set(owner[b * u:(b + 1) * u])) for b in range(sch.geo(gi)[0]))


def test_fewer_units_than_warps() -> None:
    """A stage with fewer units than GEMM warps shares them one per warp (the rest idle), so that every warp between
    a block's first and last holds one of its units (the finishing warp counts exactly the block's partials)."""
    sch = dl.Schedule(m=5, ranks=(16, 40, 24), ctas=264, h=H, i=I, ko=KO)
    for gi in range(3):
        assert sch.sharing(gi) == min(sch.units(gi), sch.warps) < sch.warps
        for b in range(sch.geo(gi)[0]):
            assert all(e > f for _, f, e in sch.parts(gi, b))
        assert sch.range(gi, sch.warps - 1) == (sch.units(gi), sch.units(gi))


def test_phase_counters_and_lora_shares() -> None:
    sch = dl.Schedule(m=8, ranks=(32, 64, 32), ctas=264, **SEVEN_B)
    assert len(dl.PHASES) == 4 and dl.NCNT == 10
    for s in range(3):  # phase s done: the counters of phases 0..s hold the grid size
        assert sch.counters_after(s) == [264] * (s + 1) + [0] * (2 - s)
    assert sch.counters_after(3) == [0, 0, 0]  # the last CTA reset them: a graph replays with no reset kernel
    for gi in range(3):  # every h value summed by exactly one CTA's LoRA warp
        shares = [sch.h_share(gi, c) for c in range(264)]
        assert shares[0][0] == 0 and shares[-1][1] == 8 * sch.ranks[gi]
        assert all(shares[c][1] == shares[c + 1][0] for c in range(263))
        assert len(sch.shrink_units(gi)) <= 264  # one unit per LoRA warp at most: no warp runs two in series


def _ptxas_report(folder: Path, variant: tuple[int, ...] = dl.DEFAULT_VARIANT) -> str:
    """ptxas' resource report of the source as it is (one build variant), kept beside the kernel cache so a run
    compiles it once (the suite also runs with pytest's own cache turned off)."""
    lib = dl.library(variant)
    path = folder / f"ptxas-{lib.name}-{lib.source_hash()}.txt"
    if not path.exists():
        cubin = path.with_suffix(".cubin")
        res = subprocess.run(lib.compile_command(cubin, cubin=True), capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        path.write_text(res.stdout + res.stderr)
    return path.read_text()


@pytest.mark.parametrize("variant", [dl.DEFAULT_VARIANT, (4, 2, 1)], ids=["default", "x-fragments-ahead"])
def test_cuda_source_builds_for_hopper_without_spills(variant: tuple[int, ...]) -> None:
    if dl._nvcc() is None:
        pytest.skip("nvcc not installed")
    from qerl_kernels.options import kernel_options

    folder = kernel_options().cuda_cache
    folder.mkdir(parents=True, exist_ok=True)
    report = _ptxas_report(folder, variant)
    if len(variant) > 2:  # the knob reached the compiler: the report is this variant's
        assert dl.library(variant).compile_command(folder / "x.cubin", cubin=True).count("-DQERL_DL_XPF=1") == 1
    kernels = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", report)
    assert len(kernels) == 16, report[-2000:]  # MT 1/2 x bf16/fp16 x FP4/INT4/INT8/FP8
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(frames) == 16 and all(f == ("0", "0", "0") for f in frames), frames
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 128  # two CTAs of 256 threads per SM


def test_format_ints_and_alpha_by_hand() -> None:
    """The kernels' only format switch: 8 scale bytes per 128-wide chunk (E4M3 per 16) and 2^8 / global scale for
    NVFP4; 4 (E8M0 per 32) and 2^-F for MXFP4; 2 (one 16-bit scale per 128) and 1 for INT4."""
    nv, _ = _quant(64, 256, 0, "nvfp4")
    mx, _ = _quant(64, 256, 0, "mxfp4")
    i4, _ = _quant(64, 256, 0, "int4")
    gn, gm, gi = gemm(nv, None, None), gemm(mx, None, None), gemm(i4, None, None)
    assert gn.ints() == [8, 0, 0] and gm.ints()[::2] == [4, 0] and gm.global_scale is None
    assert gm.global_scale_ptr() is None
    assert gn.alpha().item() == pytest.approx(256.0 / nv.tensors["weight_global_scale"].float().item(), rel=1e-6)
    assert gm.alpha().item() == 2.0 ** -gm.shift
    assert gi.ints() == [2, 0, 1] and gi.alpha().item() == 1.0 and gi.global_scale is None
    assert (gi.n, gi.k) == (64, 256) and gi.repacked.dtype == torch.uint8  # the int32 words' bytes: K / 2 per row
    assert gn.row_scale() is None and gi.row_scale() is None
    for fmt, code in (("int8", 2), ("fp8", 3)):  # W8: no chunk scales, its decode, the rows' scales after the sums
        q8, _ = _quant(64, 256, 0, fmt)
        g8 = gemm(q8, None, None)
        assert g8.ints() == [0, 0, code] and g8.alpha().item() == 1.0 and (g8.n, g8.k) == (64, 256)
        assert torch.equal(g8.row_scale(), q8.tensors["weight_scale"].float().reshape(-1))
    assert set(dl.ENGINE_FORMATS) == set(dl.KERNEL_FORMATS) == {"nvfp4", "mxfp4", "int4", "int8", "fp8"}


def test_w8_launches_take_one_decode_and_not_the_attention_half() -> None:
    gemms = {f: [gemm(_quant(n, k, i, f)[0], None, None) for i, (n, k) in enumerate(((H, KO), (2 * I, H), (H, I)))]
             for f in ("int8", "fp8")}
    assert dl.check_shapes(*gemms["int8"], 8, torch.bfloat16) is None  # row-major, not tiled: taken
    assert "one tile decode" in dl.check_shapes(*gemms["int8"][:2], gemms["fp8"][2], 8, torch.bfloat16)
    assert "scales in the activation dtype" in dl.check_shapes(*gemms["fp8"], 8, torch.float16)
    qkv = gemm(_quant(384, 256, 0, "int8")[0], None, None)
    assert "4-bit formats" in dl.attn_check_shapes(qkv, 4, 8, 2, 32)
    # W8 reads o's input 16 bytes at a time: a row view 2 bytes in is declined (the engine then runs per GEMM)
    wide = torch.zeros(4, KO + 8, dtype=torch.bfloat16)
    assert dl.input_misfit(gemms["int8"][0], wide[:, :KO]) is None
    assert "16 bytes" in dl.input_misfit(gemms["int8"][0], wide[:, 1:KO + 1])
    assert dl.input_misfit(gemm(_quant(H, KO, 0, "nvfp4")[0], None, None), wide[:, 1:KO + 1]) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_decode_of_the_repack_is_the_checkpoint_dequantize(dtype: torch.dtype) -> None:
    """The kernel's INT4 tile decode, emulated from the resident bytes as the lanes load them (FP4's K permutation,
    the nibble FP4's decode2 reads), is bit for bit the dequantize of the checkpoint's int32 words: (code - 8) x the
    group's 16-bit scale, one rounding. K / 128 = 3 (odd) puts every other row's scales 2 bytes off a word."""
    qw, _ = _quant(128, 384, 3, "int4", dtype)
    g = gemm(qw, None, None)
    got = dl.emulate_int4_decode(g.repacked, g.scale, dtype, tiled=True)
    want = dequantize(qw, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    # not a tautology: the rows' layout matters (the untiled reading of the tiled bytes is another weight)
    assert not torch.equal(dl.emulate_int4_decode(g.repacked, g.scale, dtype, tiled=False), want)


def test_int4_takes_one_launch_of_one_format_and_scales_of_the_activation_dtype() -> None:
    o, _ = _quant(H, KO, 1, "int4")
    gu, _ = _quant(2 * I, H, 2, "int4")
    dn, _ = _quant(H, I, 3, "int4")
    dn_nv, _ = _quant(H, I, 3, "nvfp4")
    args = [gemm(q, None, None) for q in (o, gu, dn)]
    assert dl.check_shapes(*args, 4, torch.bfloat16) is None
    assert "scales in the activation dtype" in dl.check_shapes(*args, 4, torch.float16)
    assert "one tile decode" in dl.check_shapes(*args[:2], gemm(dn_nv, None, None), 4, torch.bfloat16)
    assert dl.engine_max_m("int4") == dl.MAX_M and dl.engine_max_m("nvfp4") == dl.ENGINE_MAX_M


def test_int4_module_repacks_in_place_and_hands_out_checkpoint_bytes() -> None:
    """The decode kernels' state of an INT4 QuantLinear (group 128) repacks its int32 words in place (one copy), while
    everything that hands bytes on (quantized_weight, state_dict, the dequantized forward) still sees the checkpoint's;
    group 64 (a K the kernels cannot take) is left in checkpoint order."""
    from qerl_kernels.backends import kernel_state

    from qerl_cli.qlinear import QuantLinear

    lin = torch.nn.Linear(256, 128, bias=False)
    ql = QuantLinear.from_linear(lin, "int4")
    before = ql.weight_packed.clone()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y0 = ql(x)
    st = kernel_state(ql)
    assert st.tiled and st.repacked.data_ptr() == ql.weight_packed.data_ptr()
    assert not torch.equal(ql.weight_packed, before)  # repacked in place
    assert torch.equal(ql.quantized_weight.tensors["weight_packed"], before)
    assert torch.equal(ql.state_dict()["weight_packed"], before)
    assert torch.equal(ql(x), y0)
    g = dl.gemm_args(ql)
    assert g is not None and torch.equal(dl.emulate_weight(g, torch.bfloat16), ql.dequantized_weight(torch.bfloat16))
    g64 = QuantLinear.from_linear(lin, "int4", group_size=64)
    packed64 = g64.weight_packed.clone()
    assert kernel_state(g64).repacked is None and dl.gemm_args(g64) is None
    assert torch.equal(g64.weight_packed, packed64)
