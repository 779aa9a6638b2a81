"""GPU correctness check of every kernel path against the torch reference (`python -m qerl_cli.bench.kernel_selfcheck`).

Each check draws fresh random weights and activations, NaN-poisons what it can, and compares with
float64 `x @ dequantize(W)^T` by relative Frobenius error. `bash scripts/gpu.sh selfcheck` runs it on a GPU.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial as bind
from typing import Any

import torch
from qerl_kernels._common import DECODE_ARITH, DECODE_ASM, DECODE_LUT, TileConfig

TOL = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class _Checks:
    """The checks' results so far and how one more is run: ``check(path, fn, ref, tol)`` runs ``fn`` twice (the
    error against ``ref`` and whether it is deterministic) and records it, an exception as a failed check."""

    def __init__(self, device: str, g: torch.Generator) -> None:
        self.device, self.g = device, g
        self.sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        self.out: list[dict] = []

    def __call__(self, path: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor, tol: float, **info) -> None:
        out = self.out
        try:
            got = fn().clone()
            self.sync()
            rel = _rel(got, ref)
            again = fn()
            det = bool(torch.equal(got, again))
            ok = rel <= tol and det
            out.append({"path": path, "rel": rel, "tol": tol, "deterministic": det, "ok": ok, **info})
        except Exception as exc:
            out.append({"path": path, "rel": None, "tol": tol, "ok": False, "error": repr(exc)[:400], **info})
        if len(out) % 40 == 0:  # progress, so a run cut short by its time limit still says how far it got
            print(f"selfcheck: {len(out)} checks, {sum(not r['ok'] for r in out)} failed so far", flush=True)


def run_selfcheck(device: str = "cuda", seed: int = 0,
                  shapes: tuple[tuple[int, int, int], ...] = ((1, 256, 512), (5, 200, 352), (130, 4608, 3584),
                                                              (7, 72, 384)),
                  module_ms: tuple[int, ...] = (1, 16, 100, 1100)) -> list[dict]:
    from qerl_kernels.options import kernel_options
    from qerl_kernels.options import update as update_kernel_options

    # qerl's own kernels only in the timing passes here (unless the run named its candidates): humming
    # JIT-compiles for every shape and M
    if kernel_options().dispatch_candidates is None:
        update_kernel_options(dispatch_candidates=("triton", "cublas"))
    g = torch.Generator(device="cpu").manual_seed(seed)
    check = _Checks(device, g)
    for fmt in ("nvfp4", "mxfp4"):
        _fp4_dequant_checks(check, fmt)
        for m, n, k in shapes:
            if k % 32 == 0:
                _fp4_matmul_checks(check, fmt, m, n, k)
    for fmt in ("int8", "fp8"):
        for m, n, k in shapes:
            _w8_checks(check, fmt, m, n, k)
    out = check.out
    out.append(_act_quant_check(device, g))
    _quant_linear_checks(check, module_ms)
    print(f"selfcheck: {len(out)} checks before the one-copy layout section", flush=True)
    out += _check_resident_layout(device, g)
    out += check_cuda_kernel(device, g)
    return out


def _fp4_dequant_checks(check: _Checks, fmt: str) -> None:
    """The FP4 dequantize kernel is bit-exact with the torch reference."""
    from qerl_kernels.fp4 import fp4_dequantize

    from qerl_cli.formats import dequantize, quantize

    g, device = check.g, check.device
    for n_, k_ in ((200, 352), (256, 512), (1000, 3584)):
        if k_ % 32:
            continue
        w = (torch.randn(n_, k_, generator=g) * 0.05).to(device)
        qw = quantize(w, fmt)
        t = qw.tensors
        gs = t.get("weight_global_scale")
        for dt in (torch.bfloat16, torch.float16):
            ref_w = dequantize(qw, dt)
            check(f"{fmt}-dequant-exact-{dt}",
                  bind(fp4_dequantize, t["weight_packed"], t["weight_scale"], gs, fmt, dt), ref_w, 0.0, N=n_, K=k_)


def _fp4_matmul_checks(check: _Checks, fmt: str, m: int, n: int, k: int) -> None:
    """One FP4 shape: the forward in every decode mode and tile config, the v2/v3 layouts, and dx."""
    from qerl_kernels import linear as ql
    from qerl_kernels.fp4 import fp4_matmul, fp4_matmul_t, mxfp4_shift

    from qerl_cli.formats import dequantize, quantize

    g, device = check.g, check.device
    w = (torch.randn(n, k, generator=g) * 0.05).to(device)
    qw = quantize(w, fmt)
    t = qw.tensors
    gs = t.get("weight_global_scale")
    wd = dequantize(qw, torch.float32).double()
    shift = mxfp4_shift(t["weight_scale"]) if fmt == "mxfp4" else None
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, generator=g).to(device=device, dtype=dt)
        ref = x.double() @ wd.T
        runs = [(DECODE_ASM, "asm", ql.fp4_config(m, n, k)),
                (DECODE_ASM, "asm", TileConfig(16, 64, 128, 4, 3, 3))]
        if m == 5:
            runs += [(DECODE_ARITH, "arith", TileConfig(64, 128, 64, 4, 3)),
                     (DECODE_LUT, "lut", TileConfig(64, 128, 64, 4, 3))]
        for dec, dname, cfg in runs:
            y = torch.full((m, n), float("nan"), dtype=dt, device=device)
            check(f"{fmt}-fwd-{dname}-{cfg.key()}-{dt}",
                  bind(fp4_matmul, x, t["weight_packed"], t["weight_scale"], gs, fmt, cfg, shift=shift,
                       decode=dec, out=y),
                  ref, TOL[dt], M=m, N=n, K=k)
        _fp4_v2_checks(check, fmt, t, gs, shift, x, ref, dt)
        dy = torch.randn(m, n, generator=g).to(device=device, dtype=dt)
        check(f"{fmt}-dx-{dt}", bind(fp4_matmul_t, dy, t["weight_packed"], t["weight_scale"], gs, fmt,
                                     ql.fp4_t_config(m, n, k), shift=shift),
              dy.double() @ wd, TOL[dt], M=m, N=n, K=k)


def _fp4_v2_checks(check: _Checks, fmt: str, t: dict, gs: torch.Tensor | None, shift: int | None, x: torch.Tensor,
                   ref: torch.Tensor, dt: torch.dtype) -> None:
    """The repacked (v2) and tiled (v3) FP4 layouts over a few tile configs, serial and split."""
    from qerl_kernels import linear as ql
    from qerl_kernels.fp4 import fp4_matmul_v2, kernel_scales, repack_fp4

    (m, k), n = x.shape, ref.shape[1]
    for tiled in (False, True):
        if k % 128 or (tiled and n % 64):
            continue
        wr = repack_fp4(t["weight_packed"], tiled=tiled)
        ks = kernel_scales(t["weight_scale"], fmt, dt, shift or 0, tiled=tiled)
        for cfg, serial in ((ql.fp4_config(m, n, k), None), (TileConfig(16, 64, 256, 4, 4, 3), True),
                            (TileConfig(16, 64, 128, 4, 4, 4), False),
                            (TileConfig(128, 128, 128, 8, 3), None),
                            (TileConfig(256, 128, 128, 8, 3, 2), None)):
            y = torch.full((m, n), float("nan"), dtype=dt, device=check.device)
            check(f"{fmt}-fwd-v{3 if tiled else 2}-{cfg.key()}-serial{serial}-{dt}",
                  bind(fp4_matmul_v2, x, wr, ks, gs, fmt, cfg, shift=shift or 0, out=y, tiled=tiled,
                       serial=serial),
                  ref, TOL[dt], M=m, N=n, K=k)


def _w8_checks(check: _Checks, fmt: str, m: int, n: int, k: int) -> None:
    """One INT8 / FP8 shape: forward and dx, and FP8 x FP8 through ``torch._scaled_mm`` on CUDA."""
    from qerl_kernels import linear as ql
    from qerl_kernels.w8 import fp8_scaled_matmul, w8_matmul, w8_matmul_t

    from qerl_cli.formats import dequantize, quantize

    g, device = check.g, check.device
    w = (torch.randn(n, k, generator=g) * 0.05).to(device)
    qw = quantize(w, fmt, dtype=torch.bfloat16)
    t = qw.tensors
    wd = dequantize(qw, torch.float32).double()
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, generator=g).to(device=device, dtype=dt)
        check(f"{fmt}-fwd-{dt}", bind(w8_matmul, x, t["weight"], t["weight_scale"], ql.w8_config(m, n, k)),
              x.double() @ wd.T, TOL[dt], M=m, N=n, K=k)
        dy = torch.randn(m, n, generator=g).to(device=device, dtype=dt)
        check(f"{fmt}-dx-{dt}", bind(w8_matmul_t, dy, t["weight"], t["weight_scale"], ql.w8_t_config(m, n, k)),
              dy.double() @ wd, TOL[dt], M=m, N=n, K=k)
    if fmt == "fp8" and n % 16 == 0 and k % 16 == 0 and torch.device(device).type == "cuda":
        x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
        row = t["weight_scale"].float().reshape(1, -1)
        check("fp8xfp8-scaled_mm", bind(fp8_scaled_matmul, x, t["weight"], row),
              x.double() @ wd.T, 0.06, M=m, N=n, K=k)


def _act_quant_check(device: str, g: torch.Generator) -> dict:
    """Activation quantization is bit-exact with the torch reference on the GPU."""
    from qerl_kernels.w8 import quantize_rows_fp8

    from qerl_cli.formats.fp4 import to_e4m3

    x = torch.randn(7, 1000, generator=g).to(device) * torch.logspace(-3, 3, 7).to(device)[:, None]
    q, s = quantize_rows_fp8(x)
    ref_s = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
    exact = bool(torch.equal(q.float(), to_e4m3(x / ref_s).float())) and torch.allclose(s, ref_s, rtol=1e-6)
    return {"path": "fp8-act-quant-exact", "ok": exact, "rel": 0.0, "tol": 0.0}


def _quant_linear_checks(check: _Checks, module_ms: tuple[int, ...]) -> None:
    """QuantLinear on CUDA: forward dispatch at several M, and autograd dx."""
    from qerl_kernels import linear as ql
    from qerl_kernels.options import kernel_options

    from qerl_cli.qlinear import QuantLinear

    g, device, out = check.g, check.device, check.out
    for fmt in ("nvfp4", "mxfp4", "int8", "fp8"):
        lin = torch.nn.Linear(512, 384, bias=True).to(device)
        mod = QuantLinear.from_linear(lin, fmt).to(device)
        wd = mod.dequantized_weight(torch.float32).double()
        for m in module_ms:  # 1, 16: decode; 100: tiled; 1100: dequantize + cuBLAS
            x = torch.randn(m, 512, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_(True)
            y = mod(x)
            ref = x.double() @ wd.T + mod.bias.double()
            tol = 0.06 if (fmt == "fp8" and m >= kernel_options().fp8_act_min_m) else TOL[torch.bfloat16]
            dy = torch.randn_like(y)
            y.backward(dy)
            used = isinstance(mod.kernel_layout_state, ql.KernelState)
            out.append({"path": f"QuantLinear-{fmt}-fwd", "M": m, "rel": _rel(y, ref), "tol": tol, "kernel": used,
                        "ok": used and _rel(y, ref) <= tol})
            out.append({"path": f"QuantLinear-{fmt}-dx", "M": m, "rel": _rel(x.grad, dy.double() @ wd),
                        "tol": TOL[torch.bfloat16], "ok": _rel(x.grad, dy.double() @ wd) <= TOL[torch.bfloat16]})


def check_cuda_kernel(device: str = "cuda", g: torch.Generator | None = None) -> list[dict]:
    """qerl's CUDA C++ FP4 kernel (`cuda_fp4`): exact on every code and scale, right on odd shapes, bias and
    split-K, deterministic, and through QuantLinear. Empty (one skipped row) where it does not build."""
    from qerl_kernels import cuda_fp4

    if not cuda_fp4.available():
        return [{"path": "cuda-kernel", "ok": True, "skipped": True, "reason": cuda_fp4.unavailable_reason(),
                 "rel": None, "tol": 0.0}]
    g = g or torch.Generator(device="cpu").manual_seed(0)
    out: list[dict] = []
    dev = torch.device(device)
    run = bind(_cuda_run, out)
    _cuda_exact_checks(run, dev)
    print(f"selfcheck: cuda exact section done ({len(out)} checks)", flush=True)
    for fmt in ("nvfp4", "mxfp4"):
        _cuda_random_checks(run, fmt, g, dev)
        print(f"selfcheck: cuda {fmt} random section done ({len(out)} checks)", flush=True)
    out += _cuda_quant_linear_checks(g, dev)
    print(f"selfcheck: cuda legacy plans done ({len(out)} checks)", flush=True)
    return out + check_stream_plans(device, g)


def _cuda_run(out: list[dict], path: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor, tol: float,
              **info) -> None:
    """Run ``fn`` twice and record the check: ``tol`` 0 asks for the reference's bits, else a relative error."""
    try:
        got = fn().clone()
        again = fn()
        torch.cuda.synchronize()
        rel = 0.0 if tol == 0.0 and torch.equal(got.float(), ref.float()) else _rel(got, ref)
        det = bool(torch.equal(got, again))
        ok = (bool(torch.equal(got.float(), ref.float())) if tol == 0.0 else rel <= tol) and det
        out.append({"path": path, "rel": rel, "tol": tol, "deterministic": det, "ok": ok, **info})
    except Exception as exc:
        out.append({"path": path, "rel": None, "tol": tol, "ok": False, "error": repr(exc)[:400], **info})


def _cuda_exact_checks(run: Callable[..., None], dev: torch.device) -> None:
    """One-hot activations read single weights back; with G = 1 (NVFP4) or a shift the output is code * scale,
    exactly representable, so every code under every E4M3 scale / E8M0 exponent must match, in every kernel."""
    from qerl_kernels import cuda_fp4
    from qerl_kernels.fp4 import mxfp4_shift, repack_fp4

    from qerl_cli.formats import QuantizedWeight, dequantize

    n, k = 256, 128
    packed = (torch.arange(n * 64) % 256).reshape(n, 64).to(torch.uint8)
    cases = {"nvfp4": {"weight_packed": packed, "weight_global_scale": torch.ones(1),
                       "weight_scale": (torch.arange(n * 8) % 127).reshape(n, 8).to(torch.uint8)
                       .view(torch.float8_e4m3fn)},
             "mxfp4": {"weight_packed": packed,
                       "weight_scale": (140 - torch.arange(n * 4) % 11).reshape(n, 4).to(torch.uint8)}}
    for fmt, tens in cases.items():
        qw = QuantizedWeight(fmt, (n, k), tens)
        shift = mxfp4_shift(tens["weight_scale"]) if fmt == "mxfp4" else 0
        rep = repack_fp4(tens["weight_packed"], tiled=True).to(dev)
        sc = tens["weight_scale"].to(dev)
        gs = tens["weight_global_scale"].to(dev) if fmt == "nvfp4" else None
        for dt in (torch.bfloat16, torch.float16):
            wref = dequantize(qw, torch.float32)
            eye = torch.eye(k, dtype=dt, device=dev)
            for mt, wn, wk, perm in cuda_fp4.CONFIGS:  # every built kernel
                rows = 8 * mt
                for k0 in range(0, k, rows):
                    x = eye[k0:k0 + rows]
                    run(f"cuda-{fmt}-exact-every-code-mt{mt}-wn{wn}-wk{wk}-perm{perm}-{dt}",
                        bind(cuda_fp4.fp4_gemm, x, rep, sc, gs, fmt, tiled=True, shift=shift, mt=mt, wn=wn, wk=wk,
                             perm=perm),
                        wref[:, k0:k0 + rows].T.to(device=dev, dtype=dt), 0.0, N=n, K=k, k0=k0)


def _cuda_random_checks(run: Callable[..., None], fmt: str, g: torch.Generator, dev: torch.device) -> None:
    """Random weights: shapes, odd M, row and tiled layouts, bias, forced split-K."""
    from qerl_kernels import cuda_fp4
    from qerl_kernels.fp4 import mxfp4_shift, repack_fp4

    from qerl_cli.formats import dequantize, quantize

    for nn, kk, tiled in ((4608, 3584, True), (208, 384, False), (64, 1152, True), (3584, 18944, True)):
        qw = quantize((torch.randn(nn, kk, generator=g) * 0.05).to(dev), fmt)
        t = qw.tensors
        wd = dequantize(qw, torch.float32).double()
        shift = mxfp4_shift(t["weight_scale"]) if fmt == "mxfp4" else 0
        rep = repack_fp4(t["weight_packed"], tiled=tiled)
        bias = torch.randn(nn, generator=g).to(dev)
        ms = (1, 3, 8, 13, 16, 17, 32, 45, 64, 100, 256) if nn < 4000 else (1, 16, 64, 256)
        for dt in (torch.bfloat16, torch.float16):
            for m in ms:
                x = torch.randn(m, kk, generator=g).to(device=dev, dtype=dt)
                ref = x.double() @ wd.T
                for splits in (None, 3):
                    b = bias if splits else None
                    run(f"cuda-{fmt}-fwd-tiled{tiled}-split{splits}-bias{b is not None}-{dt}",
                        bind(cuda_fp4.fp4_gemm, x, rep, t["weight_scale"], t.get("weight_global_scale"), fmt,
                             tiled=tiled, shift=shift, bias=b, splits=splits),
                        ref + (bias.double() if b is not None else 0), TOL[dt], M=m, N=nn, K=kk)
            if nn == 208:  # every built kernel on a row-layout shape whose N is not a multiple of 4 blocks
                for mt, wn, wk, perm in cuda_fp4.CONFIGS:
                    m = 8 * mt - 3 if perm else 2
                    x = torch.randn(m, kk, generator=g).to(device=dev, dtype=dt)
                    run(f"cuda-{fmt}-fwd-mt{mt}-wn{wn}-wk{wk}-perm{perm}-{dt}",
                        bind(cuda_fp4.fp4_gemm, x, rep, t["weight_scale"], t.get("weight_global_scale"), fmt,
                             tiled=tiled, shift=shift, bias=bias, mt=mt, wn=wn, wk=wk, perm=perm, splits=2),
                        x.double() @ wd.T + bias.double(), TOL[dt], M=m, N=nn, K=kk)


def _cuda_quant_linear_checks(g: torch.Generator, dev: torch.device) -> list[dict]:
    """Through QuantLinear with the CUDA backend forced: forward (with bias) and dx."""
    from qerl_kernels import dispatch

    from qerl_cli.qlinear import QuantLinear

    out: list[dict] = []
    prev = dispatch.get_backend()
    try:
        dispatch.set_backend("cuda")
        for fmt in ("nvfp4", "mxfp4"):
            lin = torch.nn.Linear(1024, 768, bias=True).to(dev)
            mod = QuantLinear.from_linear(lin, fmt).to(dev)
            wd = mod.dequantized_weight(torch.float32).double()
            for m in (1, 16, 100):
                xx = torch.randn(m, 1024, generator=g).to(device=dev, dtype=torch.bfloat16).requires_grad_(True)
                yy = mod(xx)
                dy = torch.randn_like(yy)
                yy.backward(dy)
                r1 = _rel(yy, xx.double() @ wd.T + mod.bias.double())
                r2 = _rel(xx.grad, dy.double() @ wd)
                used = dispatch.choose(mod, xx.detach()) == "cuda"
                out.append({"path": f"QuantLinear-{fmt}-backend-cuda", "M": m, "rel": max(r1, r2), "tol": 1.2e-2,
                            "used_cuda": used, "ok": used and max(r1, r2) <= 1.2e-2})
    finally:
        dispatch.set_backend(prev)
    return out


def _one_hot_case(fmt: str, n: int, k: int) -> tuple[dict, int]:
    """Weights whose every 4 rows hold all 256 byte values (every code, low and high nibble) under every E4M3
    scale (NVFP4, global scale 1) or 11 E8M0 exponents (MXFP4): one-hot activations read them back exactly."""
    from qerl_kernels.fp4 import mxfp4_shift

    packed = (torch.arange(n * k // 2) % 256).reshape(n, k // 2).to(torch.uint8)
    if fmt == "nvfp4":
        tens = {"weight_packed": packed, "weight_global_scale": torch.ones(1),
                "weight_scale": (torch.arange(n * k // 16) % 127).reshape(n, k // 16).to(torch.uint8)
                .view(torch.float8_e4m3fn)}
        return tens, 0
    sc = (140 - torch.arange(n * k // 32) % 11).reshape(n, k // 32).to(torch.uint8)
    return {"weight_packed": packed, "weight_scale": sc}, mxfp4_shift(sc)


def check_stream_plans(device: str = "cuda", g: torch.Generator | None = None) -> list[dict]:
    """The decode-size plans of qerl's CUDA FP4 kernel (`cuda_fp4.DECODE_CONFIGS`, `WIDE_CONFIGS`): every built
    configuration exact on one-hot activations (every code and scale; a one-hot LoRA expand and integer bias exact
    too, against the epilogue's emulation), random shapes at the M each serves with bias and LoRA on and off, row
    groups cut between CTAs, K segments and whole portions per CTA, NaN-poisoned outputs and workspaces, two runs
    bit-identical, the same bits from a CUDA graph with programmatic dependent launch (after a copy, after a
    kernel, after another GEMM) with new inputs, and QuantLinear through `linear.forward_with_lora`."""
    from qerl_kernels import cuda_fp4
    from qerl_kernels.fp4 import repack_fp4

    from qerl_cli.formats import quantize

    if not cuda_fp4.available():
        return [{"path": "cuda-stream", "ok": True, "skipped": True, "reason": cuda_fp4.unavailable_reason(),
                 "rel": None, "tol": 0.0}]
    g = g or torch.Generator(device="cpu").manual_seed(1)
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out: list[dict] = []
    run = bind(_stream_run, out)
    cuda_fp4.POISON_WORKSPACE = True
    try:
        for fmt in ("nvfp4", "mxfp4"):
            _stream_exact_checks(run, fmt, g, dev, sms)
        print(f"selfcheck: stream exact section done ({len(out)} checks)", flush=True)
        for fmt in ("nvfp4", "mxfp4"):
            _stream_random_checks(run, fmt, g, dev, sms)
            print(f"selfcheck: stream {fmt} random section done ({len(out)} checks)", flush=True)
        # CUDA graph with programmatic dependent launch: a GEMM after a copy, after a kernel, after a GEMM; the
        # replay's bits equal the eager (no PDL) run's, also with new inputs copied in before a second replay
        qw = quantize((torch.randn(4608, 3584, generator=g) * 0.05).to(dev), "nvfp4")
        t = qw.tensors
        w = (repack_fp4(t["weight_packed"], tiled=True), t["weight_scale"], t["weight_global_scale"], "nvfp4", True, 0)
        for m in (1, 8, 16, 64):
            out.append(_graph_pdl_check(m, w, g, dev, sms))
    finally:
        cuda_fp4.POISON_WORKSPACE = False
    out += _stream_quant_linear_checks(g, dev)
    return out


def _stream_gemm(x: torch.Tensor, w: tuple, plan: Any, bias: torch.Tensor | None = None, lora: tuple | None = None,
                 pdl: bool | None = None) -> torch.Tensor:
    """The stream kernel on ``w`` = (repacked, scales, global scale, format, tiled, shift), into a NaN-poisoned
    output."""
    from qerl_kernels import cuda_fp4

    rep, sc, gs, fmt, tiled, shift = w
    y = torch.full((x.shape[0], rep.shape[0]), float("nan"), dtype=x.dtype, device=x.device)  # poisoned
    h, b = lora or (None, None)
    return cuda_fp4.fp4_gemm(x, rep, sc, gs, fmt, tiled=tiled, shift=shift, bias=bias, lora_h=h, lora_b=b,
                             plan=plan, pdl=pdl, out=y)


def _stream_run(out: list[dict], path: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor, tol: float,
                **info) -> None:
    """Run ``fn`` twice and record the check: every output written (no NaN poison left), deterministic, and the
    reference's bits (``tol`` 0) or within ``tol``."""
    try:
        got = fn().clone()
        again = fn()
        torch.cuda.synchronize()
        det = bool(torch.equal(got, again))
        written = bool(torch.isfinite(got).all())
        if tol == 0.0:
            ok = bool(torch.equal(got.float(), ref.float()))
            rel = 0.0 if ok else _rel(got, ref)
        else:
            rel = _rel(got, ref)
            ok = rel <= tol
        out.append({"path": path, "rel": rel, "tol": tol, "deterministic": det, "written": written,
                    "ok": ok and det and written, **info})
    except Exception as exc:
        out.append({"path": path, "rel": None, "tol": tol, "ok": False, "error": repr(exc)[:400], **info})


def _stream_variants(m: int, n: int, k: int, sms: int) -> list[tuple[str, Any]]:
    """Every built stream configuration serving m, each with the rule's ranges, cut portions and whole ones."""
    from qerl_kernels import cuda_fp4

    plans: list[tuple[str, Any]] = []
    if m <= cuda_fp4.DECODE_MAX_M:
        for mt, st, perm in cuda_fp4.DECODE_CONFIGS:
            if mt != (1 if m <= 8 else 2) or (not perm and m > 2):
                continue
            for tag, kw in (("rule", {}), ("cut7", {"ctas": 7, "pmode": False}),
                            ("seg3cut5", {"ctas": 5, "nseg": 3, "pmode": False}),
                            ("whole", {"ctas": 3, "pmode": True})):
                try:
                    plans.append((f"decode-mt{mt}-S{st}-perm{int(perm)}-{tag}",
                                  cuda_fp4.decode_plan(m, n, k, sms, stages=st, perm=perm, **kw)))
                except ValueError:
                    pass
    elif m <= cuda_fp4.WIDE_MAX_M:
        for mt, wn, rbw, st in cuda_fp4.WIDE_CONFIGS:
            if mt != (4 if m <= 32 else 8):
                continue
            for tag, kw in (("rule", {}), ("cut5", {"ctas": 5, "pmode": False}), ("whole", {"ctas": 2,
                                                                                           "pmode": True})):
                plans.append((f"wide-mt{mt}-{wn}x{rbw}-{tag}",
                              cuda_fp4.wide_plan(m, n, k, sms, mt=mt, wn=wn, rbw=rbw, stages=st, **kw)))
    return plans


def _stream_exact_checks(run: Callable[..., None], fmt: str, g: torch.Generator, dev: torch.device,
                         sms: int) -> None:
    """One-hot activations and a one-hot LoRA expand with integer B and bias, every configuration: exact."""
    from qerl_kernels import cuda_fp4
    from qerl_kernels.fp4 import repack_fp4

    from qerl_cli.formats import QuantizedWeight, dequantize

    n, k = 256, 1024
    tens, shift = _one_hot_case(fmt, n, k)
    wref = dequantize(QuantizedWeight(fmt, (n, k), tens), torch.float32).to(dev)
    w = (repack_fp4(tens["weight_packed"], tiled=True).to(dev), tens["weight_scale"].to(dev),
         tens["weight_global_scale"].to(dev) if fmt == "nvfp4" else None, fmt, True, shift)
    for dt in (torch.bfloat16, torch.float16):
        for m in (1, 2, 8, 16, 32, 64):
            for name, plan in _stream_variants(m, n, k, sms):
                for call in range(2):
                    rows = torch.arange(m, device=dev)
                    kt = (rows * 37 + call * 11 + 5) % k
                    x = torch.zeros(m, k, dtype=dt, device=dev)
                    x[rows, kt] = 1
                    acc = wref[:, kt].T.contiguous()  # [m, n]: the weights the rows read back
                    lora = bias = None
                    if call == 1:
                        r = 24
                        h = torch.zeros(m, r, dtype=dt, device=dev)
                        h[rows, (rows * 5 + 3) % r] = 1
                        b = (torch.randint(-4, 5, (n, r), generator=g)).to(device=dev, dtype=dt)
                        lora = (h, b)
                        bias = torch.randint(-3, 4, (n,), generator=g).float().to(dev)
                    want = cuda_fp4.emulate_epilogue(acc, 1.0, dt, bias,
                                                     None if lora is None else (h.float() @ b.float().T))
                    run(f"stream-{fmt}-exact-{name}-{'lora-bias' if call else 'plain'}-{dt}",
                        bind(_stream_gemm, x, w, plan, bias, lora), want, 0.0, M=m, N=n, K=k)


def _stream_random_checks(run: Callable[..., None], fmt: str, g: torch.Generator, dev: torch.device,
                          sms: int) -> None:
    """Random weights: the decode shapes, odd M, bias and LoRA on/off, every configuration's ranges."""
    from qerl_kernels.fp4 import mxfp4_shift, repack_fp4

    from qerl_cli.formats import dequantize, quantize

    for nn_, kk, tiled in ((4608, 3584, True), (208, 384, False), (3584, 18944, True)):
        qw = quantize((torch.randn(nn_, kk, generator=g) * 0.05).to(dev), fmt)
        t = qw.tensors
        wd = dequantize(qw, torch.float32).double()
        shift = mxfp4_shift(t["weight_scale"]) if fmt == "mxfp4" else 0
        w = (repack_fp4(t["weight_packed"], tiled=tiled), t["weight_scale"], t.get("weight_global_scale"),
             fmt, tiled, shift)
        bias = torch.randn(nn_, generator=g).to(dev)
        small = nn_ * kk < 2**22
        ms = (1, 2, 3, 8, 13, 16, 17, 32, 45, 64) if small else (1, 8, 16, 32, 64)
        for dt in (torch.bfloat16, torch.float16):
            for m in ms:
                x = torch.randn(m, kk, generator=g).to(device=dev, dtype=dt)
                base = x.double() @ wd.T
                for li, (r, with_bias) in enumerate(((0, False), (32, True), (136, False))):
                    lora = None
                    ref = base + (bias.double() if with_bias else 0)
                    if r:
                        h = torch.randn(m, r, generator=g).to(device=dev, dtype=dt)
                        b = (torch.randn(nn_, r, generator=g) * 0.02).to(device=dev, dtype=dt)
                        lora = (h, b)
                        ref = ref + h.double() @ b.double().T
                    plans = _stream_variants(m, nn_, kk, sms)
                    for name, plan in plans if li == 0 or small else plans[:1]:
                        run(f"stream-{fmt}-fwd-{name}-tiled{tiled}-r{r}-bias{with_bias}-{dt}",
                            bind(_stream_gemm, x, w, plan, bias if with_bias else None, lora), ref, TOL[dt],
                            M=m, N=nn_, K=kk)


def _stream_quant_linear_checks(g: torch.Generator, dev: torch.device) -> list[dict]:
    """QuantLinear: forward_with_lora through each backend, and the LoRA-aware measured plan."""
    from qerl_kernels import dispatch
    from qerl_kernels import linear as ql

    from qerl_cli.qlinear import QuantLinear

    out: list[dict] = []
    prev = dispatch.get_backend()
    try:
        for fmt in ("nvfp4", "mxfp4"):
            lin = torch.nn.Linear(1024, 768, bias=True).to(dev)
            mod = QuantLinear.from_linear(lin, fmt).to(dev)
            wd = mod.dequantized_weight(torch.float32).double()
            for be in ("cuda", "triton", "cublas"):
                dispatch.set_backend(be)
                for m in (1, 16, 64, 100):
                    xx = torch.randn(m, 1024, generator=g).to(device=dev, dtype=torch.bfloat16)
                    h = torch.randn(m, 32, generator=g).to(device=dev, dtype=torch.bfloat16)
                    b = (torch.randn(768, 32, generator=g) * 0.02).to(device=dev, dtype=torch.bfloat16)
                    with torch.no_grad():
                        yy = ql.forward_with_lora(xx, mod, h, b)
                    ref = xx.double() @ wd.T + mod.bias.double() + h.double() @ b.double().T
                    out.append({"path": f"QuantLinear-{fmt}-forward_with_lora-{be}", "M": m, "rel": _rel(yy, ref),
                                "tol": 1.2e-2, "ok": _rel(yy, ref) <= 1.2e-2})
            dispatch.set_backend("auto")
            plan = dispatch.measure_plan(mod, torch.bfloat16, buckets=(1, 16, 64), rep_ms=3,
                                         cands=("triton", "cublas", "cuda"), lora_rank=32)
            out.append({"path": f"dispatch-plan-lora-{fmt}", "plan": {str(b_): c for b_, c in plan.items()},
                        "us": {str(b_): row for b_, row in dispatch.last_timings.items()},
                        "ok": set(plan.values()) <= {"triton", "cublas", "cuda"}, "rel": 0.0, "tol": 0.0})
    finally:
        dispatch.set_backend(prev)
    return out


def _graph_pdl_check(m: int, w: tuple, g: torch.Generator, dev: torch.device, sms: int) -> dict:
    """One CUDA graph: a copy, a GEMM, a kernel, a GEMM with LoRA, a GEMM (the stream plans launch with programmatic
    dependent launch under capture); two replays with different inputs must equal the eager (no PDL) bits."""
    from qerl_kernels import cuda_fp4

    rep, sc, gs, fmt = w[:4]
    n, k = rep.shape[0], rep.shape[1] * 2
    src = torch.randn(m, k, generator=g).to(device=dev, dtype=torch.bfloat16)
    h = torch.randn(m, 96, generator=g).to(device=dev, dtype=torch.bfloat16)
    b = (torch.randn(n, 96, generator=g) * 0.02).to(device=dev, dtype=torch.bfloat16)
    xbuf = torch.empty_like(src)
    ys = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(3)]

    def body() -> None:
        xbuf.copy_(src)
        cuda_fp4.fp4_gemm(xbuf, rep, sc, gs, fmt, tiled=True, out=ys[0])  # after a copy
        x2 = xbuf * 2
        cuda_fp4.fp4_gemm(x2, rep, sc, gs, fmt, tiled=True, out=ys[1], lora_h=h, lora_b=b)  # after a kernel
        cuda_fp4.fp4_gemm(x2, rep, sc, gs, fmt, tiled=True, out=ys[2])  # after a GEMM

    def eager() -> list[torch.Tensor]:
        x2 = src * 2
        return [cuda_fp4.fp4_gemm(src, rep, sc, gs, fmt, tiled=True, pdl=False),
                cuda_fp4.fp4_gemm(x2, rep, sc, gs, fmt, tiled=True, lora_h=h, lora_b=b, pdl=False),
                cuda_fp4.fp4_gemm(x2, rep, sc, gs, fmt, tiled=True, pdl=False)]

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        same = []
        for _ in range(2):
            graph.replay()
            want = eager()
            torch.cuda.synchronize()
            same.append(all(torch.equal(a, b_) for a, b_ in zip(ys, want, strict=True)))
            src.copy_(torch.randn(m, k, generator=g).to(device=dev, dtype=torch.bfloat16))
        return {"path": f"stream-graph-pdl-M{m}", "M": m, "ok": all(same), "replays_equal": same,
                "plan": cuda_fp4.launch_plan(m, n, k, sms).key(), "rel": 0.0, "tol": 0.0}
    except Exception as exc:
        return {"path": f"stream-graph-pdl-M{m}", "M": m, "ok": False, "error": repr(exc)[:400], "rel": None,
                "tol": 0.0}


def _check_resident_layout(device: str, g: torch.Generator) -> list[dict]:
    """The one-copy FP4 paths: exact dequantizer on the repack, in-place repack, fused views, every backend."""
    from qerl_kernels import dispatch, humming_peer
    from qerl_kernels import linear as ql
    from qerl_kernels.fp4 import fp4_dequantize_v2, repack_fp4

    from qerl_cli.formats import dequantize, nvfp4_global_scale, quantize
    from qerl_cli.qlinear import QuantLinear, fuse_quant_linears

    out: list[dict] = []
    for fmt in ("nvfp4", "mxfp4"):
        for n, k, tiled in ((4608, 3584, True), (200, 384, False)):
            qw = quantize((torch.randn(n, k, generator=g) * 0.05).to(device), fmt)
            t = qw.tensors
            rep = repack_fp4(t["weight_packed"], tiled=tiled)
            for dt in (torch.bfloat16, torch.float16):
                got = fp4_dequantize_v2(rep, t["weight_scale"], t.get("weight_global_scale"), fmt, dt, tiled=tiled)
                exact = bool(torch.equal(got, dequantize(qw, dt)))
                out.append({"path": f"{fmt}-dequant-v2-tiled{tiled}-{dt}-exact", "N": n, "K": k, "ok": exact,
                            "rel": 0.0 if exact else 1.0, "tol": 0.0})
        # fused q/k/v-like parts: one storage repacked in place; views are each part's own repack
        sizes, k = (512, 128, 128), 1024
        ws = [(torch.randn(n, k, generator=g) * 0.05).to(device) for n in sizes]
        gs = nvfp4_global_scale(max(w.abs().max() for w in ws).cpu()).to(device) if fmt == "nvfp4" else None
        parts = [QuantLinear.from_quantized(quantize(w, fmt, global_scale=gs)) for w in ws]
        ckpt = [p.weight_packed.clone() for p in parts]
        fused = fuse_quant_linears(parts)
        x = torch.randn(16, k, generator=g).to(device=device, dtype=torch.bfloat16)
        y_parts = torch.cat([p(x) for p in parts], -1)
        y = fused(x)
        ref = torch.cat([x.double() @ dequantize(p.quantized_weight, torch.float64).T for p in parts], -1)
        pairs = list(zip(parts, ckpt, strict=True))
        one_copy = all(ql.kernel_state(p).repacked.data_ptr() == p.weight_packed.data_ptr() for p in parts + [fused])
        views = all(torch.equal(p.weight_packed, repack_fp4(c, tiled=True)) for p, c in pairs)
        back = all(torch.equal(p.quantized_weight.tensors["weight_packed"], c) for p, c in pairs)
        out.append({"path": f"{fmt}-fused-views", "ok": views and one_copy and back and _rel(y, ref) <= 1.2e-2
                    and _rel(y_parts, ref) <= 1.2e-2, "rel": max(_rel(y, ref), _rel(y_parts, ref)), "tol": 1.2e-2,
                    "views": views, "one_copy": one_copy, "checkpoint_back": back})
        # every backend, forced, through QuantLinear (forward and dx), then the measured plan
        lin = torch.nn.Linear(1024, 768, bias=True).to(device)
        mod = QuantLinear.from_linear(lin, fmt).to(device)
        wd = mod.dequantized_weight(torch.float32).double()
        # humming JIT-compiles per shape and M (seconds each): one format, one M keeps the check short
        backends = ["triton", "cublas", "qerl"] + (["humming"] if humming_peer.available() and fmt == "nvfp4" else [])
        prev = dispatch.get_backend()
        try:
            for be in backends:
                dispatch.set_backend(be)
                for m in ((16,) if be == "humming" else (1, 16, 100, 600)):
                    xx = torch.randn(m, 1024, generator=g).to(device=device, dtype=torch.bfloat16)
                    xx.requires_grad_(True)
                    yy = mod(xx)
                    dy = torch.randn_like(yy)
                    yy.backward(dy)
                    r1 = _rel(yy, xx.double() @ wd.T + mod.bias.double())
                    r2 = _rel(xx.grad, dy.double() @ wd)
                    out.append({"path": f"QuantLinear-{fmt}-backend-{be}", "M": m, "rel": max(r1, r2), "tol": 1.2e-2,
                                "ok": max(r1, r2) <= 1.2e-2})
            dispatch.set_backend("auto")
            plan = dispatch.measure_plan(mod, torch.bfloat16, buckets=(1, 64, 1024), rep_ms=3,
                                         cands=("triton", "cublas"))
            timed = {str(b): row for b, row in dispatch.last_timings.items()}
            out.append({"path": f"dispatch-plan-{fmt}", "plan": {str(b): c for b, c in plan.items()}, "us": timed,
                        "ok": set(plan.values()) <= {"triton", "cublas"} and all(len(r) == 2 for r in timed.values()),
                        "rel": 0.0, "tol": 0.0})
        finally:
            dispatch.set_backend(prev)
    return out


def check_moe_kernels(device: str = "cuda", seed: int = 0,
                      shape: tuple[int, int, int, int] = (128, 2048, 768, 8), tokens: tuple[int, ...] = (1, 64, 700),
                      formats: tuple[str, ...] = ("nvfp4", "mxfp4", "bf16")) -> list[dict]:
    """qerl's grouped expert GEMMs (``qerl_kernels.moe``, through ``moe.MoeExperts``) against the per-expert
    reference (dequantize, matmul), forward with every expert's LoRA and backward, at the Qwen3-30B-A3B expert shape
    (E, H, I, top-k) in bf16; and the forward replayed from a CUDA graph on new inputs equals the eager one."""
    from qerl_cli.moe import LoraFactors, quantize_experts

    g = torch.Generator(device="cpu").manual_seed(seed)
    e, h, i, k = shape
    dev = torch.device(device)
    out: list[dict] = []
    for fmt in formats:
        experts = quantize_experts(torch.randn(e, 2 * i, h, generator=g).to(dev) * 0.02,
                                   torch.randn(e, h, i, generator=g).to(dev) * 0.02, fmt).to(dev)
        for t in tokens:
            x0 = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
            index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
            weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev, torch.bfloat16)
            a = (torch.randn(e, 32, h, generator=g) * 0.02).to(dev)
            b = (torch.randn(e, 2 * i, 32, generator=g) * 0.02).to(dev)
            res = []
            for kernels in (False, True):  # the reference in fp32, the kernels in bf16
                experts.use_kernels = kernels
                dt = torch.bfloat16 if kernels else torch.float32
                x, aa, bb = (v.clone().to(dt).requires_grad_(True) for v in (x0, a, b))
                y = experts(x, index, weights.to(dt), lora={"gate_up_proj": LoraFactors(aa, bb, 2.0)})
                y.float().pow(2).sum().backward()
                res.append((y.detach(), x.grad, aa.grad, bb.grad))
            rel = max(_rel(got.float(), ref) for got, ref in zip(res[1], res[0], strict=True))
            row = {"path": f"moe-grouped-{fmt}-m{t}", "rel": rel, "ok": rel < 2e-2}
            if dev.type == "cuda":
                row["graph_rel"] = _moe_graph_rel(experts, x0, index, weights)
                row["ok"] = row["ok"] and row["graph_rel"] < 1e-6
            out.append(row)
    return out


def _moe_graph_rel(experts: torch.nn.Module, x0: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> float:
    """Capture the grouped forward (routing layout included) in a CUDA graph, replay it on new inputs, compare."""
    experts.use_kernels = True
    bufs = [x0.clone(), index.clone(), weights.clone()]
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            experts(*bufs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = experts(*bufs)
        bufs[0].copy_(torch.randn_like(x0))
        bufs[1].copy_(index.roll(1, 0))
        graph.replay()
        want = experts(*bufs)
    return _rel(y, want)


def main() -> int:
    """``python -m qerl_cli.bench.kernel_selfcheck [--moe] [OUT.json]``: every check (``--moe``: the grouped expert
    GEMMs only)."""
    if not torch.cuda.is_available():
        print("kernel_selfcheck: no CUDA GPU here; it checks the compiled kernels against the torch reference on a "
              "GPU (the interpreted kernels are checked by the test suite)")
        return 2
    moe_only = "--moe" in sys.argv[1:]
    paths = [a for a in sys.argv[1:] if a != "--moe"]
    res = check_moe_kernels() if moe_only else run_selfcheck() + check_moe_kernels()
    bad = [r for r in res if not r["ok"]]
    for r in bad:
        print("FAIL", json.dumps(r))
    worst = {}
    for r in res:
        key = r["path"].split("-m")[0]
        if r.get("rel") is not None and (key not in worst or r["rel"] > worst[key]):
            worst[key] = r["rel"]
    for k, v in sorted(worst.items()):
        print(f"  {k:48s} worst rel err {v:.2e}")
    print(f"selfcheck: {len(res) - len(bad)}/{len(res)} passed")
    if paths:
        with open(paths[0], "w") as f:
            json.dump(res, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
