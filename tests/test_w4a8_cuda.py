"""W4A8 dispatch on the GPU (QERL_W4A8=1): per shape and M bucket the faster of qerl's W4A8 kernel and humming's,
where humming's can run (MXFP4: its W4A8 schedules need a scale group of at least the FP8 MMA's K of 32); NVFP4
always runs qerl's. Skipped without a GPU; the humming half also without the humming-kernels package.

Both paths round the activations to E4M3 per token, so each is held to the exact product of the dequantized
weight within 6e-2 relative (measured ~3e-2 on the H200, 2026-11-29); a wrong scale or layout is O(1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N, K = 2048, 1024


def _humming() -> bool:
    from qerl_kernels import humming_peer

    return humming_peer.available()


def _module(fmt: str) -> nn.Module:
    from qerl_cli.qlinear import QuantLinear

    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    nn.init.normal_(lin.weight, std=0.02)
    return QuantLinear.from_linear(lin, fmt, dtype=torch.bfloat16).cuda()


def _exact(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from qerl_kernels import backends

    return backends.dequant_linear(x, module).float()


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_w4a8_forward_names_its_kernel_and_is_within_bound(use_options, fmt: str) -> None:  # noqa: ANN001
    from qerl_kernels import dispatch, humming_peer

    use_options(w4a8=True)
    dispatch.reset()
    module = _module(fmt)
    expect_peer = fmt in humming_peer.W4A8_FORMATS and "humming" in dispatch.candidates()
    with torch.no_grad():
        for m in (64, 256):
            dispatch.reset_ran()
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            y = module(x)
            assert _rel(y, _exact(module, x)) < 6e-2
            ran = dispatch.ran()[(N, K)]
            want = dispatch.w4a8_backend(module, x)
            assert ran == {"humming-w4a8" if want == "humming" else "w4a8": 1}, ran
            if not expect_peer:
                assert want == "qerl"
    plan = dispatch.w4a8_plan(module, torch.bfloat16) if expect_peer else None
    if expect_peer:  # measured once, at every bucket from QERL_W4A8_MIN_M
        assert set(plan) == {b for b in dispatch.M_BUCKETS if b >= 64} and set(plan.values()) <= {"qerl", "humming"}


@pytest.mark.skipif(not torch.cuda.is_available() or not _humming(), reason="needs humming-kernels")
def test_humming_w4a8_on_mxfp4_and_what_it_does_with_nvfp4() -> None:
    from qerl_kernels import dispatch, humming_peer

    module = _module("mxfp4")
    x = torch.randn(128, K, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = dispatch.humming_forward(module, x, act="fp8")
    assert _rel(y, _exact(module, x)) < 6e-2
    # NVFP4: humming builds the layer (2026-11-29: no refusal at build) and decides at its first forward. Its WGMMA
    # W4A8 kernels reject a 16-wide scale group (FP8 MMA K is 32); a fallback that ran and matched would make NVFP4
    # a W4A8 candidate, to be measured and added to W4A8_FORMATS, which names only what passed here
    nv = _module("nvfp4")
    try:
        layer = humming_peer.build(nv.quantized_weight.tensors, "nvfp4", N, K, act="fp8")
        with torch.no_grad():
            y_nv = humming_peer.forward(layer, x)
    except Exception as exc:  # noqa: BLE001 - humming's own refusal is the expected outcome
        assert "group" in str(exc), exc
        assert "nvfp4" not in humming_peer.W4A8_FORMATS
        return
    err = _rel(y_nv, _exact(nv, x))
    assert err >= 6e-2 or "nvfp4" in humming_peer.W4A8_FORMATS, (
        f"humming's W4A8 ran NVFP4 within the bound ({err:.2e}): time it (scripts/w4a8_bench.py) and add it to "
        "humming_peer.W4A8_FORMATS")
