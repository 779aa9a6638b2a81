"""The persistent decode layer (qerl_kernels.decode_layer) on the GPU: correct, then timed against the present path.

1. Exactness, tiny layer (hidden 256, o input 384, intermediate 384, LoRA ranks 16/40/24) at M = 1, 5, 8, 13, 16,
   bf16 and fp16: the kernel against its CPU emulation at the same grid (`emulate_mlp_half`, the kernel's order up to
   the sums inside one mma; < 5e-3 relative, a few bf16 values one ulp apart) and against the present path's math
   (`reference_mlp_half`, < 1e-2); every check run twice and bit-compared, and the counters must be back to zero.
2. The 7B MLP half (o 3584x3584, gate/up 37888x3584, down 3584x18944; NVFP4, bf16) at M = 1, 8, 16 with LoRA
   r32/64/32 and at M = 1, 8 without: each build variant in VARIANTS (ring stages, CTAs per SM) against the present
   path's kernels (Triton `lora_shrink` on o's input, `cuda_fp4.fp4_gemm` with the LoRA epilogue for o,
   `rmsnorm_shrink`, gate/up GEMM, `silu_mul_shrink`, down GEMM: 7 launches) on the same inputs (rel. error), all
   timed as the median of CUDA-graph replays (20 layers per graph, CUDA events), and the layer's byte floor (NVFP4
   weights + E4M3 scales + LoRA A/B + activations) against the benches' device copy bandwidth.

`--ncu`: one launch of each 7B case (M 1 and 8, LoRA on and off) and of the present path, no graphs, for
`ncu --kernel-name regex:"decode_mlp|fp4_decode" ...`.

Usage (the repo's path shim on PYTHONPATH, as scripts/gpu.sh's `cmd` stage gives it):
    QERL_CMD='python3 $REPO/scripts/decode_layer_bench.py $OUT/decode_layer.json' bash scripts/gpu.sh cmd
"""

from __future__ import annotations

import json
import sys

import torch
from qerl_kernels import cuda_fp4, decode
from qerl_kernels import decode_layer as dl
from qerl_kernels.fp4 import repack_fp4

from qerl_cli.formats import dequantize, quantize


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_layer(h: int, ko: int, i: int, ranks: tuple[int, int, int], dtype: torch.dtype, dev: str, seed: int,
               dense: bool) -> dict:
    """Random NVFP4 o / gate_up (one tensor: one global scale) / down, LoRA factors, inputs; `dense`: also the
    dequantized fp32 weights (the reference)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    args, weights, loras = [], [], []
    for (n, k), r in zip(((h, ko), (2 * i, h), (h, i)), ranks, strict=True):
        w = torch.randn(n, k, generator=g, device=dev) * k**-0.5
        qw = quantize(w, "nvfp4")
        t = qw.tensors
        a = (torch.randn(r, k, generator=g, device=dev) * k**-0.5).to(dtype) if r else None
        b = (torch.randn(n, r, generator=g, device=dev) * 0.3).to(dtype) if r else None
        args.append(dl.GemmArgs(repack_fp4(t["weight_packed"], tiled=n % 64 == 0).contiguous(), t["weight_scale"],
                                t["weight_global_scale"].float().reshape(1), n % 64 == 0, a, b))
        weights.append(dequantize(qw, torch.float32) if dense else None)
        loras.append(None if a is None else (a, b))
    norm_w = (1 + 0.1 * torch.randn(h, generator=g, device=dev)).to(dtype)
    return dict(args=args, weights=weights, loras=loras, norm_w=norm_w, gen=g)


def inputs(lay: dict, m: int, ko: int, h: int, dtype: torch.dtype, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = lay["gen"]
    attn = torch.randn(m, ko, generator=g, device=dev).to(dtype)
    return attn, (torch.randn(m, h, generator=g, device=dev) * 2).to(dtype)


def present_path(attn: torch.Tensor, hres: torch.Tensor, lay: dict, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The present decode path's MLP half, launch by launch, as ModelRunner._layers runs it with the fused ops."""
    o, gu, dn = lay["args"]
    lora = o.a is not None
    ho = decode.lora_shrink(attn, o.a) if lora else None
    yo = cuda_fp4.fp4_gemm(attn, o.repacked, o.scale, o.global_scale, "nvfp4", tiled=o.tiled, lora_h=ho, lora_b=o.b)
    if lora:
        h1, x2, hg = decode.rmsnorm_shrink(hres, yo, lay["norm_w"], eps, gu.a)
    else:
        (h1, x2), hg = decode.add_rmsnorm(hres, yo, lay["norm_w"], eps), None
    y = cuda_fp4.fp4_gemm(x2, gu.repacked, gu.scale, gu.global_scale, "nvfp4", tiled=gu.tiled, lora_h=hg, lora_b=gu.b)
    i = dn.k
    if lora:
        act, hd = decode.silu_mul_shrink(y[:, :i], y[:, i:], dn.a)
    else:
        act, hd = decode.silu_mul(y[:, :i], y[:, i:]), None
    out = cuda_fp4.fp4_gemm(act, dn.repacked, dn.scale, dn.global_scale, "nvfp4", tiled=dn.tiled, lora_h=hd,
                            lora_b=dn.b)
    return h1, out


def graph_ms(fn, reps: int = 20, iters: int = 30) -> float:  # noqa: ANN001
    """Median ms of one call inside a CUDA graph of `reps` calls, over `iters` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


def copy_gbps(dev: str) -> float:
    """The bandwidth every qerl bench divides by (bytes read + written by a bf16 device copy)."""
    from qerl_cli.bench.harness import copy_bandwidth_gbps

    return copy_bandwidth_gbps(torch.device(dev))


def layer_bytes(lay: dict, m: int, h: int, ko: int, i: int) -> int:
    total = 0
    for g in lay["args"]:
        total += g.repacked.numel() + g.scale.numel()  # FP4 weights + E4M3 block scales (1 byte each)
        total += 2 * (g.a.numel() + g.b.numel()) if g.a is not None else 0
    return total + 2 * m * (ko + 3 * h + 2 * h)  # attn, h in; h1, delta out; the norm weight (tokens are few)


def exactness(dev: str) -> list[dict]:
    rows = []
    hd, ko, i = 256, 384, 384
    for dtype in (torch.bfloat16, torch.float16):
        lay = make_layer(hd, ko, i, (16, 40, 24), dtype, dev, 1, dense=True)
        cpu_args = [dl.GemmArgs(g.repacked.cpu(), g.scale.cpu(), g.global_scale.cpu(), g.tiled,
                                None if g.a is None else g.a.cpu(), None if g.b is None else g.b.cpu())
                    for g in lay["args"]]
        for m in (1, 5, 8, 13, 16):
            attn, hres = inputs(lay, m, ko, hd, dtype, dev)
            runs = []
            for _ in range(2):
                runs.append(dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"]))
            torch.cuda.synchronize()
            cnt = dl._counter(torch.device(dev)).cpu().tolist()
            ctas = dl.default_ctas(torch.device(dev), 1 if m <= 8 else 2, dtype == torch.bfloat16)
            eh, eo = dl.emulate_mlp_half(attn.cpu(), hres.cpu(), lay["norm_w"].cpu(), 1e-6, *cpu_args, ctas)
            rh, ro = dl.reference_mlp_half(attn, hres, lay["norm_w"], 1e-6, tuple(lay["weights"]), tuple(lay["loras"]))
            (h1, out), (h1b, outb) = runs
            rows.append(dict(dtype=str(dtype), m=m, err_emul=max(rel(h1.cpu(), eh), rel(out.cpu(), eo)),
                             err_present=max(rel(h1, rh), rel(out, ro)),
                             bit_equal_rerun=bool(torch.equal(h1, h1b) and torch.equal(out, outb)),
                             counters_zero=all(c == 0 for c in cnt)))
    return rows


VARIANTS = ((4, 2), (2, 2), (8, 2))  # (ring stages per warp, CTAs per SM); the first is the default


def seven_b(dev: str, ranks: tuple[int, int, int] = (32, 64, 32), ms: tuple[int, ...] = (1, 8, 16)) -> list[dict]:
    hd, ko, i = 3584, 3584, 18944
    lay = make_layer(hd, ko, i, ranks, torch.bfloat16, dev, 2, dense=False)
    bw = copy_gbps(dev)
    rows = []
    for m in ms:
        attn, hres = inputs(lay, m, ko, hd, torch.bfloat16, dev)
        ph1, pout = present_path(attn, hres, lay, 1e-6)
        t_old = graph_ms(lambda: present_path(attn, hres, lay, 1e-6))  # noqa: B023
        nbytes = layer_bytes(lay, m, hd, ko, i)
        floor = nbytes / bw / 1e6
        row = dict(m=m, ranks=list(ranks), present_us=1e3 * t_old, floor_us=1e3 * floor, mb=nbytes / 1e6,
                   present_pct_floor=100 * floor / t_old, copy_gbps=bw, variants={})
        for var in VARIANTS:
            h1, out = dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"], variant=var)
            err = max(rel(h1, ph1), rel(out, pout))
            t_new = graph_ms(lambda: dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"],  # noqa: B023
                                                 variant=var))  # noqa: B023
            row["variants"][f"s{var[0]}b{var[1]}"] = dict(us=1e3 * t_new, pct_floor=100 * floor / t_new,
                                                         speedup=t_old / t_new, err_vs_present=err)
        best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
        row.update(best=best[0], persistent_us=best[1]["us"], persistent_pct_floor=best[1]["pct_floor"],
                   speedup=best[1]["speedup"],
                   err_vs_present=max(v["err_vs_present"] for v in row["variants"].values()))
        rows.append(row)
    return rows


def build_variants() -> None:
    """nvcc for every variant at once (one process each) before anything is timed."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(VARIANTS)) as pool:
        list(pool.map(lambda v: dl.library(v).build(), VARIANTS))


def ncu_once(dev: str) -> None:
    """One launch of each 7B variant (M 1 and 8, LoRA on and off), no graphs: for `ncu --kernel-name
    regex:decode_mlp`."""
    hd, ko, i = 3584, 3584, 18944
    for ranks in ((32, 64, 32), (0, 0, 0)):
        lay = make_layer(hd, ko, i, ranks, torch.bfloat16, dev, 2, dense=False)
        for m in (1, 8):
            attn, hres = inputs(lay, m, ko, hd, torch.bfloat16, dev)
            dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"])
            present_path(attn, hres, lay, 1e-6)
    torch.cuda.synchronize()


def main() -> int:
    dev = "cuda"
    if not torch.cuda.is_available() or not dl.available(torch.device(dev)):
        print("decode layer kernel unavailable:", dl.unavailable_reason())
        return 2
    if "--ncu" in sys.argv:
        ncu_once(dev)
        return 0
    sys.argv = [a for a in sys.argv if not a.startswith("--")]
    build_variants()
    result = {"exactness": exactness(dev)}
    ok = all(r["err_emul"] < 5e-3 and r["err_present"] < 1e-2 and r["bit_equal_rerun"] and r["counters_zero"]
             for r in result["exactness"])
    result["seven_b"] = seven_b(dev) + seven_b(dev, (0, 0, 0), (1, 8))
    ok = ok and all(r["err_vs_present"] < 1e-2 for r in result["seven_b"])
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
    for r in result["exactness"]:
        print(f"exact {r['dtype']:15s} M={r['m']:2d} err_emul={r['err_emul']:.2e} err_present={r['err_present']:.2e} "
              f"rerun_bits={r['bit_equal_rerun']} counters_zero={r['counters_zero']}")
    print(f"{'M':>3} {'ranks':>9} {'MB':>7} {'floor us':>9} {'persistent us':>14} {'%floor':>7} {'present us':>11} "
          f"{'%floor':>7} {'speedup':>8} {'err':>9}")
    for r in result["seven_b"]:
        print(f"{r['m']:3d} {'/'.join(map(str, r['ranks'])):>9} {r['mb']:7.1f} {r['floor_us']:9.1f} "
              f"{r['persistent_us']:14.1f} {r['persistent_pct_floor']:6.1f}% {r['present_us']:11.1f} "
              f"{r['present_pct_floor']:6.1f}% {r['speedup']:7.2f}x {r['err_vs_present']:9.2e} best {r['best']}: "
              + " ".join(f"{k} {v['us']:.1f}" for k, v in r["variants"].items()))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
