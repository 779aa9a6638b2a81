"""One Qwen3-30B-A3B MoE layer's experts, forward and backward: the per-expert loop against the grouped kernels.

    python scripts/moe_grouped_bench.py OUT.json [--tokens 2048,8192] [--formats nvfp4,mxfp4,bf16] [--rank 32]
    python scripts/moe_grouped_bench.py OUT.json --shape 8,64,32,2 --tokens 16 --device cpu   # smoke test (CPU)

The layer: 128 experts, hidden 2048, moe_intermediate 768, top-8 (``--shape E,H,I,k``), random experts quantized per
format, LoRA of ``--rank`` on both projections (fp32 factors, as training keeps them), bf16 activations, uniform
random routing of ``--tokens`` tokens (x 8 assignments each). Timed with CUDA events (median of ``--reps``):

* ``layer``: ``MoeExperts.forward`` then ``backward`` on a random cotangent (SiLU-gate, both projections, the
  routing-weighted sum): ``loop`` (``use_kernels=False``: per-expert loop forward and backward) against
  ``grouped`` (``qerl_kernels.moe.grouped_linear`` forward, ``grouped_linear_t`` + ``segment_outer`` backward).
  Forward alone and forward+backward; TFLOP/s counts the useful GEMM FLOPs (base and LoRA, not the padding).
* ``bwd <proj>``: one projection's backward alone from saved inputs (gate_up: x_div 8, down: x_div 1): the loop,
  the grouped kernels, and ``grouped_mm`` (the alternative design: dequantize every expert once per call into a
  bf16 stack, sort the rows, ``torch._grouped_mm`` with offsets for dX, u, h and the per-expert dA/dB sums, scatter
  back), each against the loop (max |diff| / max |loop|, bf16).

Prints a table last and writes the rows as JSON to OUT.json. One H200: well under 3 minutes at the defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch


def _timed(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after one warm-up (which also compiles the kernels)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _rel(got: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if got is None or ref is None:
        return 0.0
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def proj_flops(m: int, n: int, k: int, r: int, backward: bool) -> float:
    """Useful FLOPs of one projection over m assignments (N out, K in, LoRA rank r). Forward: x W^T, h = x A^T,
    h B^T. Backward: dy W, u = dy B, u A, dA = u^T x, h again, dB = dy^T h."""
    if backward:
        return 2.0 * m * (n * k + 2 * n * r + 3 * r * k)
    return 2.0 * m * (n * k + r * (n + k))


def dequant_stack(experts: Any, proj: str, dtype: torch.dtype) -> torch.Tensor:
    """Every expert's weight of ``proj`` [E, N, K] in ``dtype``, dequantized in one batched pass (no cache): what
    the ``grouped_mm`` design pays per call."""
    from qerl_cli.formats.fp4 import dequantize_fp4_blocks, e8m0_to_float

    if not experts.format.quantized:
        return getattr(experts, proj).to(dtype)
    e, n, k = experts.projection_shape(proj)
    t = experts.tensors(proj)
    packed = t["weight_packed"].reshape(e * n, -1)
    if experts.fmt == "nvfp4":
        eff = t["weight_scale"].float() / t["weight_global_scale"].float().reshape(e, 1, 1)
        block = 16
    elif experts.fmt == "mxfp4":
        eff, block = e8m0_to_float(t["weight_scale"]), 32
    else:
        return experts.dense_stack(proj, dtype)
    return dequantize_fp4_blocks(packed, eff.reshape(e * n, -1), block, dtype).view(e, n, k)


def backward_grouped_mm(experts: Any, proj: str, x: torch.Tensor, dy: torch.Tensor, expert_ids: torch.Tensor,
                        x_div: int, a: torch.Tensor, b: torch.Tensor,
                        s: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dA, dB) through ``torch._grouped_mm`` on a per-call dequantized bf16 stack (the measured alternative)."""
    num = experts.num_experts
    order = torch.argsort(expert_ids, stable=True)
    offs = torch.cumsum(torch.bincount(expert_ids, minlength=num), 0).to(torch.int32)
    w = dequant_stack(experts, proj, dy.dtype)
    dys = dy[order].contiguous()
    xs = x[order // x_div].contiguous()
    ad, bd = a.to(dy.dtype), b.to(dy.dtype)
    u = torch._grouped_mm(dys, bd, offs=offs) * s  # [M, R]
    dxs = torch._grouped_mm(dys, w, offs=offs) + torch._grouped_mm(u, ad, offs=offs)
    da = torch._grouped_mm(u.t(), xs, offs=offs)  # 2d x 2d: one [R, K] sum per expert's rows
    h = torch._grouped_mm(xs, ad.transpose(1, 2), offs=offs)
    db = torch._grouped_mm(dys.t(), h, offs=offs) * s
    dx = torch.empty_like(dxs)
    dx[order] = dxs
    if x_div > 1:
        dx = dx.view(x.shape[0], x_div, x.shape[1]).sum(1)
    return dx, da.to(a.dtype), db.to(b.dtype)


Closures = tuple[Callable[[], Any], Callable[[], None], list[torch.Tensor]]


def _layer_closures(experts: Any, x0: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, cot: torch.Tensor,
                    lora_t: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Closures:
    """(forward, forward+backward, the leaves whose .grad the latter fills: x, then A and B of each projection)."""
    from qerl_cli.moe import LoraFactors

    x = x0.clone().requires_grad_(True)
    fac = {p: (a.to(x0.dtype).clone().requires_grad_(True), b.to(x0.dtype).clone().requires_grad_(True))
           for p, (a, b) in lora_t.items()}
    lora = {p: LoraFactors(a, b, 2.0) for p, (a, b) in fac.items()}
    leaves = [x, *(v for ab in fac.values() for v in ab)]

    def fwd() -> torch.Tensor:
        return experts(x, index, weights, lora=lora)

    def fwd_bwd() -> None:
        for v in leaves:
            v.grad = None
        fwd().backward(cot)

    return fwd, fwd_bwd, leaves


def bench_format(fmt: str, shape: tuple[int, int, int, int], tokens: list[int], rank: int, reps: int,
                 device: torch.device, seed: int) -> list[dict[str, Any]]:
    from qerl_cli import moe
    from qerl_cli.moe import Routing, quantize_experts

    e, hdim, inter, k = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    experts = quantize_experts(torch.randn(e, 2 * inter, hdim, generator=g).to(device) * 0.02,
                               torch.randn(e, hdim, inter, generator=g).to(device) * 0.02, fmt).to(device)
    lora_t = {p: ((torch.randn(e, rank, kk, generator=g) * 0.02).to(device),
                  (torch.randn(e, nn, rank, generator=g) * 0.02).to(device))
              for p, (_, nn, kk) in ((p, experts.projection_shape(p)) for p in moe.PROJECTIONS)}
    rows: list[dict[str, Any]] = []
    for t in tokens:
        x0 = torch.randn(t, hdim, generator=g).to(device, torch.bfloat16)
        index = torch.rand(t, e, generator=g).topk(k, dim=-1).indices.to(device)
        weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(device, torch.bfloat16)
        cot = torch.randn(t, hdim, generator=g).to(device, torch.bfloat16)
        m = t * k
        fl_f = sum(proj_flops(m, *experts.projection_shape(p)[1:], rank, False) for p in moe.PROJECTIONS)
        fl_b = sum(proj_flops(m, *experts.projection_shape(p)[1:], rank, True) for p in moe.PROJECTIONS)
        grads: dict[str, tuple[torch.Tensor, ...]] = {}
        for path in ("fp32", "loop", "grouped"):  # fp32: the loop in fp32, the reference both bf16 paths are held to
            experts.use_kernels = path == "grouped"
            dt = torch.float32 if path == "fp32" else torch.bfloat16
            fwd, fwd_bwd, leaves = _layer_closures(experts, x0.to(dt), index, weights.to(dt), cot.to(dt), lora_t)
            if path == "fp32":
                fwd_bwd()
                grads[path] = tuple(v.grad for v in leaves)
                continue
            with torch.no_grad():
                ms_f = _timed(fwd, reps, device)
            ms_fb = _timed(fwd_bwd, reps, device)
            grads[path] = tuple(v.grad for v in leaves)
            rows.append({"fmt": fmt, "tokens": t, "bench": "layer", "path": path, "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb,
                         "fwd_tflops": fl_f / ms_f / 1e9, "fwd_bwd_tflops": (fl_f + fl_b) / ms_fb / 1e9,
                         "rel_vs_loop": max(_rel(gv, rv) for gv, rv in zip(grads[path], grads["loop"], strict=True)),
                         "rel_vs_fp32": max(_rel(gv, rv) for gv, rv in zip(grads[path], grads["fp32"], strict=True))})
        # one projection's backward alone, from saved inputs
        flat = index.reshape(-1)
        for proj in moe.PROJECTIONS:
            _, n, kk = experts.projection_shape(proj)
            x_div = k if proj == moe.GATE_UP else 1
            xin = torch.randn(m // x_div, kk, generator=g).to(device, torch.bfloat16)
            dy = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
            a, b = lora_t[proj]
            need = (True, True, True)
            runs = {"loop": partial(moe._backward_loop, experts, proj, xin, dy, Routing(flat, e), x_div, a, b, 2.0,
                                    need),
                    "grouped": partial(moe._backward_grouped, experts, proj, xin, dy, Routing(flat, e, kernels=True),
                                       x_div, a, b, 2.0, need),
                    "grouped_mm": partial(backward_grouped_mm, experts, proj, xin, dy, flat, x_div, a, b, 2.0)}
            results: dict[str, tuple[torch.Tensor | None, ...]] = {}
            for path, run in runs.items():
                experts.use_kernels = path == "grouped"
                row: dict[str, Any] = {"fmt": fmt, "tokens": t, "bench": f"bwd {proj}", "path": path}
                try:
                    ms = _timed(run, reps, device)
                    results[path] = run()
                    row.update(bwd_ms=ms, bwd_tflops=proj_flops(m, n, kk, rank, True) / ms / 1e9,
                               rel_vs_loop=max(_rel(gv, rv) for gv, rv in
                                               zip(results[path], results["loop"], strict=True)))
                except Exception as exc:  # noqa: BLE001 - a design that does not run here is a result too
                    row["error"] = repr(exc)[:300]
                rows.append(row)
        experts.use_kernels = None
    return rows


def _cell(r: dict[str, Any], key: str, fmt: str = "8.2f") -> str:
    return f"{r[key]:{fmt}}" if key in r else " " * 8


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'fmt':6} {'tokens':>6} {'bench':18} {'path':10} {'fwd ms':>8} {'f+b ms':>8} {'bwd ms':>8} "
            f"{'TFLOP/s':>8} {'rel loop':>8} {'rel fp32':>8}")
    out = [head, "-" * len(head)]
    for r in rows:
        lead = f"{r['fmt']:6} {r['tokens']:6d} {r['bench']:18} {r['path']:10}"
        if "error" in r:
            out.append(f"{lead} error: {r['error'][:80]}")
            continue
        tf = r.get("fwd_bwd_tflops", r.get("bwd_tflops", 0.0))
        out.append(f"{lead} {_cell(r, 'fwd_ms')} {_cell(r, 'fwd_bwd_ms')} {_cell(r, 'bwd_ms')} {tf:8.1f} "
                   f"{_cell(r, 'rel_vs_loop', '8.1e')} {_cell(r, 'rel_vs_fp32', '8.1e')}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--formats", default="nvfp4,mxfp4,bf16")
    ap.add_argument("--shape", default="128,2048,768,8", help="experts,hidden,moe_intermediate,top_k")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    shape = tuple(int(v) for v in args.shape.split(","))
    assert len(shape) == 4, "--shape E,H,I,k"
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for fmt in args.formats.split(","):
        rows += bench_format(fmt, shape, [int(v) for v in args.tokens.split(",")], args.rank, args.reps, device,
                             args.seed)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = {"shape": dict(zip(("experts", "hidden", "moe_intermediate", "top_k"), shape, strict=True)),
            "rank": args.rank, "reps": args.reps, "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else "cpu", "torch": torch.__version__, "seconds": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
