"""One resident FP4 copy: the in-place repack, the dequantizer that reads it, fused views over it, and the
backend override/plan cache of `qerl_kernels.dispatch` (CPU; Triton kernels under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from qerl_kernels import dispatch
from qerl_kernels._common import KernelSettingError
from qerl_kernels.fp4 import fp4_dequantize_v2, repack_fp4, unrepack_fp4
from qerl_kernels.linear import kernel_state, linear_backward_dx, quant_linear

from qerl_cli.formats import dequantize, nvfp4_global_scale, quantize
from qerl_cli.qlinear import QuantLinear, fuse_quant_linears


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a few large outliers so block scales (and the MXFP4 shift) vary across the matrix
    return torch.randn(n, k, generator=g) * 0.05 * (1 + 20 * (torch.rand(n, k, generator=g) > 0.995))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("n", "k", "tiled"), [(128, 256, True), (96, 384, False), (64, 128, True)])
def test_dequantize_v2_reads_the_repack_bit_for_bit(fmt: str, n: int, k: int, tiled: bool) -> None:
    qw = quantize(_weight(n, k), fmt)
    t = qw.tensors
    rep = repack_fp4(t["weight_packed"], tiled=tiled)
    assert torch.equal(unrepack_fp4(rep, tiled=tiled), t["weight_packed"])  # round trip is the identity
    assert not torch.equal(rep, t["weight_packed"])  # and the repack really permutes bytes
    # fp32 output: the reference's own arithmetic (scale / G, then code * that), bit for bit, whatever the tile
    for units in (1, 2, 4):
        out = fp4_dequantize_v2(rep, t["weight_scale"], t.get("weight_global_scale"), fmt, torch.float32,
                                tiled=tiled, units=units)
        assert torch.equal(out, dequantize(qw, torch.float32)), units


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_in_place_repack_keeps_one_copy_and_checkpoint_views(fmt: str) -> None:
    lin = torch.nn.Linear(256, 128)
    with torch.no_grad():
        lin.weight.copy_(_weight(128, 256, 1))
    mod = QuantLinear.from_linear(lin, fmt, dtype=torch.float32)
    orig = {n: t.clone() for n, t in mod.quantized_weight.tensors.items()}
    ptr = mod.weight_packed.data_ptr()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ dequantize(mod.quantized_weight, torch.float64).T + lin.bias.double()
    y = quant_linear(x, mod)
    st = kernel_state(mod)
    # the module's own buffer now holds the tiled repack: same storage, no second copy in the kernel state
    assert mod._layout.kind == "tiled" and st.tiled and st.repacked is mod.weight_packed
    assert mod.weight_packed.data_ptr() == ptr
    assert torch.equal(mod.weight_packed, repack_fp4(orig["weight_packed"], tiled=True))
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5
    # everything that hands bytes out sees the checkpoint order
    for name, t in mod.quantized_weight.tensors.items():
        assert torch.equal(t, orig[name]), name
    assert torch.equal(mod.state_dict()["weight_packed"], orig["weight_packed"])
    # backward reads the repack through the exact dequantizer
    dy = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    assert torch.equal(linear_backward_dx(dy, mod), dy @ dequantize(QuantLinearRef.of(orig, mod), torch.float32))
    # loading a checkpoint-order state dict, and .to(), go back to checkpoint order first
    mod.load_state_dict({**{n: t.clone() for n, t in orig.items()}, "bias": lin.bias.detach()})
    assert mod._layout.kind is None and torch.equal(mod.weight_packed, orig["weight_packed"])
    quant_linear(x, mod)
    assert mod._layout.kind == "tiled"
    mod.cpu()
    assert mod._layout.kind is None and torch.equal(mod.weight_packed, orig["weight_packed"])


class QuantLinearRef:
    @staticmethod
    def of(tensors: dict, mod: QuantLinear):  # noqa: ANN205
        from qerl_cli.formats import QuantizedWeight

        return QuantizedWeight(mod.fmt, (mod.out_features, mod.in_features), tensors, mod.dtype, mod.group_size)


def _nvfp4_parts(seed: int, sizes: tuple[int, ...] = (128, 64, 64), k: int = 256) -> list[QuantLinear]:
    """NVFP4 QuantLinears [n, k] for n in sizes, random weights (seeds seed, seed + 1, ...) under one global scale,
    as the parts of a fused projection have."""
    ws = [_weight(n, k, seed + i) for i, n in enumerate(sizes)]
    gs = nvfp4_global_scale(max(w.abs().max() for w in ws))
    return [QuantLinear.from_quantized(quantize(w, "nvfp4", global_scale=gs, dtype=torch.float32)) for w in ws]


def test_fused_parts_share_the_in_place_repack() -> None:
    k = 256
    parts = _nvfp4_parts(10, k=k)
    before = [p.weight_packed.clone() for p in parts]
    fused = fuse_quant_linears(parts)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    y_part = quant_linear(x, parts[1])  # the first kernel use, through a part, repacks the whole storage
    assert fused._layout is parts[1]._layout and fused._layout.kind == "tiled"
    for p, b in zip(parts, before, strict=True):
        # each part's row view is exactly its own tiled repack: split points on 64-row blocks
        assert torch.equal(p.weight_packed, repack_fp4(b, tiled=True))
    assert torch.equal(fused.weight_packed, repack_fp4(torch.cat(before), tiled=True))
    y = quant_linear(x, fused)
    ref = torch.cat([x.double() @ dequantize(p.quantized_weight, torch.float64).T for p in parts], -1)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert ((y[:, 128:192].double() - y_part.double()).norm() / y_part.double().norm()).item() < 1e-5
    for p, b in zip(parts, before, strict=True):
        assert torch.equal(p.quantized_weight.tensors["weight_packed"], b)


@pytest.mark.parametrize("part_first", [False, True])
def test_fused_parts_share_one_block_scale_layout(part_first: bool) -> None:
    from qerl_kernels.fp4 import kernel_scales
    from qerl_kernels.linear import block_scales

    parts = _nvfp4_parts(30)
    own = [p.weight_scale.clone() for p in parts]
    fused = fuse_quant_linears(parts)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    order = [parts[2], fused, parts[0]] if part_first else [fused, parts[0], parts[2]]
    ys = {id(m): quant_linear(x, m) for m in order}  # the forward builds the scale layout on first use
    fks = kernel_state(fused).kscales[x.dtype]
    row = 0
    for p, scale in zip(parts, own, strict=True):
        if id(p) in ys:
            ks = kernel_state(p).kscales[x.dtype]
            # the part's scales are its rows of the fused module's set (one set per storage), and they are
            # exactly what the part would have built for itself
            assert ks.untyped_storage().data_ptr() == fks.untyped_storage().data_ptr()
            assert ks.data_ptr() == fks[row].data_ptr()
            assert torch.equal(ks, kernel_scales(scale, "nvfp4", x.dtype, tiled=True))
            assert block_scales(p, kernel_state(p), x.dtype) is ks
            assert torch.equal(ys[id(p)], ys[id(fused)][:, row:row + p.out_features])
        row += p.out_features


def test_parts_off_64_row_boundaries_use_the_row_local_repack() -> None:
    sizes, k = (96, 32), 128
    ws = [_weight(n, k, 20 + i) for i, n in enumerate(sizes)]
    parts = [QuantLinear.from_quantized(quantize(w, "mxfp4", dtype=torch.float32)) for w in ws]
    before = [p.weight_packed.clone() for p in parts]
    fused = fuse_quant_linears(parts)
    quant_linear(torch.randn(2, k), fused)
    assert fused._layout.kind == "rows"
    for p, b in zip(parts, before, strict=True):
        assert torch.equal(p.weight_packed, repack_fp4(b, tiled=False))


def test_backend_override_and_buckets(use_options) -> None:  # noqa: ANN001
    use_options(linear_backend="auto")  # restored after the test
    assert dispatch.get_backend() == "auto"
    dispatch.set_backend("cublas")
    assert dispatch.get_backend() == "cublas"
    from qerl_cli.env_info import resolved_options

    assert resolved_options()["kernels"]["linear_backend"] == "cublas"  # what the manifest records
    with pytest.raises(KernelSettingError, match="choose one of auto, qerl, triton, humming, cublas"):
        dispatch.set_backend("fastest")
    use_options(linear_backend="auto")
    assert [dispatch.bucket(m) for m in (1, 2, 9, 16, 200, 256, 257, 5000)] == [1, 8, 16, 16, 256, 256, 512, 2048]


def test_plan_cache_round_trip(use_options, tmp_path) -> None:  # noqa: ANN001
    use_options(kernel_cache=tmp_path)
    dispatch.reset()
    key = ("nvfp4", 4608, 3584, "bfloat16", True)
    plan = {1: "triton", 256: "cublas"}
    assert dispatch._load_cached(key) is None
    dispatch._store_cached(key, plan)
    dispatch.reset()  # a new process: read back from disk
    assert dispatch._load_cached(key) == plan
    assert dispatch.cache_path().parent == tmp_path and dispatch.cache_path().exists()
    dispatch.reset()


def test_dispatch_candidates_follow_the_option(use_options) -> None:  # noqa: ANN001
    use_options(dispatch_candidates="cublas")
    assert dispatch.candidates() == ["cublas"]
    use_options(dispatch_candidates="triton, cublas")
    assert dispatch.candidates() == ["triton", "cublas"]
    with pytest.raises(KernelSettingError, match="QERL_DISPATCH_CANDIDATES"):
        use_options(dispatch_candidates="marlin")


def test_fastest_candidate_rule(monkeypatch) -> None:  # noqa: ANN001
    """`dispatch._fastest`, the rule every plan (linears, routed experts, W4A8) is measured by: the fastest of the
    candidates within the tolerance of the reference; a wrong one, a failing one and one that declines (None) are
    never chosen, and only the timed ones are reported."""
    from qerl_kernels import dispatch

    ref = torch.ones(4, 4)
    times = {"slow": 2.0, "fast_wrong": 0.5, "fast": 1.0}
    monkeypatch.setattr(dispatch, "_time_gpu", lambda f, rep_ms: times[f.__name__])

    def named(name: str, out):  # noqa: ANN001, ANN202
        def f():  # noqa: ANN202
            if isinstance(out, Exception):
                raise out
            return out
        f.__name__ = name
        return f

    funcs = {"slow": named("slow", ref * 1.001), "fast_wrong": named("fast_wrong", ref * 1.1),
             "fast": named("fast", ref), "fails": named("fails", RuntimeError("refused")),
             "declines": named("declines", None)}
    best, row = dispatch._fastest(funcs, ref, 2e-2, 8, "a test shape")
    assert best == "fast" and row == {"slow": 2000.0, "fast": 1000.0}
    assert dispatch._fastest({"fails": funcs["fails"]}, ref, 2e-2, 8, "a test shape") == (None, {})
