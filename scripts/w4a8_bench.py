"""W4A8 against W4A16 and BF16 on one H200 (issue 44): Qwen2.5-7B's quantized GEMMs at M = 64, 128, 256.

    PYTHONPATH=.shim:. python scripts/w4a8_bench.py out.json [--fmt nvfp4,mxfp4] [--no-humming] [--no-cuda]

Per (format, shape, M), CUDA-graph replays timed by `triton.testing.do_bench` (median, L2 flushed before each
replay, so weights come from HBM):
* `bf16`: cuBLAS `F.linear` on the dequantized bf16 weight;
* `w4a16-triton`, `w4a16-cublas`, `w4a16-cuda`: qerl's W4A16 backends (the ones `dispatch`'s `auto` chooses
  among); `w4a16-best` is the fastest, what `auto` would pick;
* `humming-w4a16`, `humming-w4a8`: humming-kernels if importable (its W4A8 = `humming_peer.build(act="fp8")`;
  when humming refuses a format with FP8 activations, the error is recorded instead of a time);
* `w4a8`, `w4a8-imprecise`: kernels/w4a8.py, tile config timed among its few candidates first; `-imprecise`
  lets the FP8 wgmma accumulate the whole K in its own (shorter) accumulator, `-swap` puts the widened weight on
  the wgmma's A side from registers (default: activations as A, weight through shared memory).
Each line: us, TFLOP/s, the FLOP floor (at the measured BF16 or FP8 dense rate), the byte floor (weight + scales +
activations + output at the measured read bandwidth of a 2 GB sum), % of max(floors), and the relative Frobenius
error against the exact x @ dequant(W)^T in float64. JSON to argv[1]; a table last. Runs in ~2-4 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton

# Qwen2.5-7B: hidden 3584, 28 query heads and 4 KV heads of 128, MLP 18944; q/k/v and gate/up fused as qerl runs
# them in the rollout (`fuse_quant_linears`); q/k/v carry a bias
SHAPES: dict[str, tuple[int, int, bool]] = {
    "qkv": (3584 + 2 * 512, 3584, True),
    "o": (3584, 3584, False),
    "gate_up": (2 * 18944, 3584, False),
    "down": (3584, 18944, False),
}
MS = (64, 128, 256)
W4_BITS = {"nvfp4": 4.5, "mxfp4": 4.25}


def graph_us(fn: Callable[[], Any]) -> float:
    from qerl_cli.bench.kernels import time_calls

    return time_calls([fn])[0] * 1e3


def peaks() -> dict[str, float]:
    """Measured dense rates (TFLOP/s) of BF16 and FP8 (torch._scaled_mm) 8192^3 products, and read GB/s."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16 = 2 * n**3 / graph_us(lambda: a @ b) / 1e6
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda")
    fp8 = 2 * n**3 / graph_us(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                         out_dtype=torch.bfloat16)) / 1e6
    src = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GB, read once by a sum
    gbs = 2 * src.numel() / graph_us(lambda: src.sum()) / 1e3
    return {"bf16_tflops": bf16, "fp8_tflops": fp8, "copy_gbs": gbs}


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def bench_shape(fmt: str, name: str, pk: dict[str, float], use_humming: bool, with_cuda: bool,
                errors: dict[str, str], t_start: float) -> list[dict[str, Any]]:
    from qerl_kernels import backends as ql
    from qerl_kernels import humming_peer

    from qerl_cli.qlinear import QuantLinear

    n, k, has_bias = SHAPES[name]
    out: list[dict[str, Any]] = []
    lin = torch.nn.Linear(k, n, bias=has_bias, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=k**-0.5)
    mod = QuantLinear.from_linear(lin, fmt, dtype=torch.bfloat16)
    del lin
    w32 = mod.dequantized_weight(torch.float32)
    wb = w32.to(torch.bfloat16)
    bias = mod.bias
    ql.kernel_state(mod)  # the in-place repack, as the engine does at load
    cands: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "bf16": lambda x: torch.nn.functional.linear(x, wb, bias),
        "w4a16-triton": lambda x: ql.fp4_fused(x, mod),
        "w4a16-cublas": lambda x: ql.dequant_linear(x, mod),
        "w4a8": lambda x: ql.w4a8_forward(x, mod),
        "w4a8-imprecise": lambda x: ql.w4a8_forward(x, mod, precise=False),
        "w4a8-swap": lambda x: ql.w4a8_forward(x, mod, swap=True),
    }
    probe = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
    if with_cuda and ql.cuda_supported(mod, probe):
        cands["w4a16-cuda"] = lambda x: ql.cuda_fused(x, mod)
    if use_humming:
        qw = mod.quantized_weight
        for act in ("bf16", "fp8"):
            label = f"humming-w4a{16 if act == 'bf16' else 8}"
            try:
                layer = humming_peer.build(qw.tensors, fmt, n, k, bias=bias, dtype=torch.bfloat16, act=act)
                cands[label] = lambda x, layer=layer: humming_peer.forward(layer, x)
            except Exception as exc:  # humming's own refusal, kept for the report
                errors[f"{fmt}/{name}/{label}"] = repr(exc)[:400]
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ w32.double().T + (bias.double() if bias is not None else 0.0)
        flops = 2 * m * n * k
        act_bytes = 2 * m * k + 2 * m * n
        for label, fn in cands.items():
            try:
                y = fn(x)  # first call: compile / JIT / W4A8 tile timing, outside the timing
                torch.cuda.synchronize()
                err = rel(y, ref)
                us = graph_us(lambda fn=fn, x=x: fn(x))
            except Exception as exc:
                errors[f"{fmt}/{name}/M{m}/{label}"] = repr(exc)[:400]
                continue
            fp8 = "w4a8" in label
            rate = pk["fp8_tflops"] if fp8 else pk["bf16_tflops"]
            wbytes = 2 * n * k if label == "bf16" else n * k * W4_BITS[fmt] / 8
            flop_us = flops / rate / 1e6
            byte_us = (wbytes + act_bytes) / pk["copy_gbs"] / 1e3
            out.append({"fmt": fmt, "shape": name, "N": n, "K": k, "M": m, "kernel": label,
                         "us": us, "tflops": flops / us / 1e6, "flop_floor_us": flop_us,
                         "byte_floor_us": byte_us, "pct_of_floor": 100 * max(flop_us, byte_us) / us,
                         "rel_err": err})
        w4a16 = [r for r in out if r["M"] == m and r["kernel"].startswith("w4a16-")]
        best = min(w4a16, key=lambda r: r["us"], default=None)
        if best is not None:
            out.append({**best, "kernel": "w4a16-best", "picked": best["kernel"]})
        print(f"{fmt} {name} M={m} done ({time.time() - t_start:.0f} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fmt", default="nvfp4,mxfp4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-humming", action="store_true")
    ap.add_argument("--no-cuda", action="store_true", help="skip qerl's CUDA C++ W4A16 kernel (nvcc build)")
    args = ap.parse_args()

    from qerl_kernels import humming_peer
    from qerl_kernels.w4a8 import _TUNED, M_BUCKETS

    t_start = time.time()
    torch.manual_seed(0)
    pk = peaks()
    print(f"peaks: bf16 {pk['bf16_tflops']:.0f} TFLOP/s, fp8 {pk['fp8_tflops']:.0f} TFLOP/s, "
          f"read {pk['copy_gbs']:.0f} GB/s", flush=True)
    use_humming = not args.no_humming and humming_peer.available()
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for fmt in args.fmt.split(","):
        for name in args.shapes.split(","):
            rows += bench_shape(fmt, name, pk, use_humming, not args.no_cuda, errors, t_start)
            torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "humming": humming_peer.version() if use_humming else None, "peaks": pk, "rows": rows,
              "errors": errors, "w4a8_tiles": {f"M<={b}/N{n}/K{k}/precise{p}/swap{s}": c.key()
                             for (b, n, k, (p, s)), c in _TUNED.items()},
              "m_buckets": list(M_BUCKETS), "seconds": time.time() - t_start}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for key, msg in errors.items():
        print(f"error {key}: {msg}")
    print(f"\n{'fmt':6} {'shape':8} {'M':>4} {'kernel':16} {'us':>8} {'TFLOP/s':>8} {'flop_fl':>8} {'byte_fl':>8} "
          f"{'%floor':>7} {'rel_err':>9}")
    for r in rows:
        print(f"{r['fmt']:6} {r['shape']:8} {r['M']:>4} {r['kernel']:16} {r['us']:8.1f} {r['tflops']:8.0f} "
              f"{r['flop_floor_us']:8.1f} {r['byte_floor_us']:8.1f} {r['pct_of_floor']:6.0f}% {r['rel_err']:9.2e}")
    print(f"\n{time.time() - t_start:.0f} s; JSON: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
