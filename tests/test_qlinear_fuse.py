"""`fuse_quant_linears`: q/k/v-style parts fused along N, parts rebound as row views (CPU, plain torch)."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.formats import nvfp4_global_scale
from qerl_cli.qlinear import QuantLinear, fuse_quant_linears

SIZES = (128, 64, 64)  # q/k/v-like: a wide part and two narrow ones, splits at multiples of 64 rows
K = 256


def _parts(fmt: str, bias: bool = True, seed: int = 0) -> list[QuantLinear]:
    g = torch.Generator().manual_seed(seed)
    lins = []
    for n in SIZES:
        lin = torch.nn.Linear(K, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, K, generator=g) * 0.05)
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        lins.append(lin)
    gs = None
    if fmt == "nvfp4":  # fused layers share one global scale, as qerl quantize writes them
        gs = nvfp4_global_scale(torch.stack([lin.weight.detach().abs().max() for lin in lins]).max())
    return [QuantLinear.from_linear(lin, fmt, global_scale=gs) for lin in lins]


def _within(view: torch.Tensor, base: torch.Tensor) -> bool:
    lo = base.data_ptr()
    hi = lo + base.numel() * base.element_size()
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and lo <= view.data_ptr() < hi


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4", "int8", "fp8", "nf4", "bf16"])
def test_fused_forward_is_the_concatenation_and_parts_are_views(fmt: str) -> None:
    parts = _parts(fmt)
    before = [{n: t.clone() for n, t in p.quantized_weight.tensors.items()} for p in parts]
    x = torch.randn(5, 3, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    separate = torch.cat([p(x) for p in parts], dim=-1)
    fused = fuse_quant_linears(parts)
    assert fused.out_features == sum(SIZES) and fused.split_sizes == list(SIZES)
    assert torch.equal(fused(x), separate)
    # the parts still compute what they did, from views into the fused module's storage
    assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), separate)
    for p, old in zip(parts, before, strict=True):
        for name, t in p.quantized_weight.tensors.items():
            assert torch.equal(t, old[name]), name
            if name != "weight_shape":
                assert _within(t, getattr(fused, name)), name
        assert _within(p.bias, fused.bias)
    # no weight byte twice: the parts' row tensors tile the fused tensors exactly
    for name in fused.tensor_names:
        if name in ("weight_global_scale", "quant_map", "weight_shape"):
            continue
        ptrs = [getattr(p, name).data_ptr() for p in parts]
        assert ptrs[0] == getattr(fused, name).data_ptr()
        assert sum(getattr(p, name).numel() for p in parts) == getattr(fused, name).numel()
    if fmt == "int4":
        assert fused.weight_shape.tolist() == [sum(SIZES), K]
    # a write through the fused module is seen by the part (shared bytes, not a copy)
    fused.bias.data[SIZES[0]] = 123.0
    assert parts[1].bias[0].item() == 123.0


def test_fuse_refuses_mismatched_parts() -> None:
    a, b, _ = _parts("nvfp4")
    ptrs = (a.weight_packed.data_ptr(), b.weight_packed.data_ptr())
    c = _parts("nvfp4", seed=5)[0]
    c.weight_global_scale.mul_(2)
    with pytest.raises(QerlError, match="weight_global_scale"):
        fuse_quant_linears([a, c])
    with pytest.raises(QerlError, match="fmt"):
        fuse_quant_linears([a, _parts("mxfp4")[1]])
    other_k = QuantLinear.from_linear(torch.nn.Linear(128, 64), "nvfp4", global_scale=a.weight_global_scale)
    with pytest.raises(QerlError, match="in_features"):
        fuse_quant_linears([a, other_k])
    with pytest.raises(QerlError, match="bias"):
        fuse_quant_linears([a, _parts("nvfp4", bias=False)[1]])
    with pytest.raises(QerlError, match="at least one"):
        fuse_quant_linears([])
    # nothing was rebound by a refused call
    assert (a.weight_packed.data_ptr(), b.weight_packed.data_ptr()) == ptrs


def test_fused_modules_deep_copy_and_keep_sharing() -> None:
    import copy

    parts = _parts("nvfp4")
    fused = fuse_quant_linears(parts)
    holder = torch.nn.ModuleDict({"q": parts[0], "k": parts[1], "v": parts[2], "qkv": fused})
    clone = copy.deepcopy(holder)
    assert clone["qkv"]._layout is clone["k"]._layout and clone["qkv"]._layout.owner() is clone["qkv"]
    assert _within(clone["k"].weight_packed, clone["qkv"].weight_packed)
    x = torch.randn(3, K).to(torch.bfloat16)
    assert torch.equal(clone["qkv"](x), fused(x))


def test_fused_module_keeps_its_parts_dequantized_cache_and_sees_in_place_updates(monkeypatch) -> None:
    # CPU decoding runs the fused q/k/v and gate/up GEMMs: with the parts caching their dequantized weights, the
    # fused module must cache too (one dequantize, not one per decode step) and the parts read their rows of it
    import qerl_cli.qlinear as qlinear

    parts = _parts("nvfp4")
    for p in parts:
        p.cache_dequantized = True
    calls = []
    real = qlinear.dequantize
    monkeypatch.setattr(qlinear, "dequantize", lambda qw, dtype: calls.append(tuple(qw.shape)) or real(qw, dtype))
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(1))
    want = torch.cat([p(x) for p in parts], dim=-1)
    fused = fuse_quant_linears(parts)
    calls.clear()
    for _ in range(3):
        assert torch.equal(fused(x), want)
    assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), want)
    assert calls == [(sum(SIZES), K)]  # the fused weight once, the parts none of their own
    assert all(_within(p.dequantized_weight(x.dtype), fused.dequantized_cache) for p in parts)
    # a part's codes rewritten in place through its view (FlashRL's re-quantization): both paths see it
    with torch.no_grad():
        parts[1].weight_packed.zero_()
    zeroed = fused(x)
    assert calls == [(sum(SIZES), K)] * 2
    torch.testing.assert_close(zeroed[:, SIZES[0]:SIZES[0] + SIZES[1]], parts[1].bias.float().expand(2, -1))
    assert torch.equal(zeroed[:, :SIZES[0]], want[:, :SIZES[0]])
    assert torch.equal(parts[1](x), zeroed[:, SIZES[0]:SIZES[0] + SIZES[1]])
