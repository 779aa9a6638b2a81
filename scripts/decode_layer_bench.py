"""The persistent decode layer (qerl_kernels.decode_layer) on the GPU: correct, then timed against the present path.

1. Exactness, tiny layer (hidden 256, o input 384, intermediate 384, LoRA ranks 16/40/24) at M = 1, 5, 8, 13, 16,
   bf16 and fp16: the kernel against its CPU emulation at the same grid (`emulate_mlp_half`, the kernel's order up to
   the sums inside one mma; < 5e-3 relative, a few bf16 values one ulp apart) and against the present path's math
   (`reference_mlp_half`, < 1e-2); every check run twice and bit-compared, and the counters must be back to zero.
2. The 7B MLP half (o 3584x3584, gate/up 37888x3584, down 3584x18944; NVFP4, bf16) at M = 1, 8, 16 with LoRA
   r32/64/32 and at M = 1, 8 without: each build variant in VARIANTS (ring stages, CTAs per SM, x fragments
   ahead) against the present path's kernels (Triton `lora_shrink` on o's input, `cuda_fp4.fp4_gemm` with the
   LoRA epilogue for o, `rmsnorm_shrink`, gate/up GEMM, `silu_mul_shrink`, down GEMM: 7 launches) on the same
   inputs (rel. error), all timed as the median of CUDA-graph replays (20 layers per graph, CUDA events), and the
   layer's byte floor (NVFP4 weights + E4M3 scales + LoRA A/B + activations) against the benches' device copy
   bandwidth.

3. The attention half (`attn_half`, decode_attn.cu): exactness on a tiny GQA layer (hidden 256, 4/2 heads x 64,
   LoRA rank 24, with and without the q/k/v bias, with and without the previous layer's delta) at M = 1, 3, 8, 13,
   bf16 and fp16: q, hn and the written K/V rows against `emulate_attn_half` (< 5e-3) and `reference_attn_half`
   (< 1e-2), reruns bit-equal, counters back to zero, no cache row but (m, positions[m]) touched. Then the 7B q/k/v
   (4608 x 3584, 28/4 heads x 128, bias, LoRA r96 = 3 x 32) at M = 1, 8 against today's 4 launches (`add_rmsnorm`,
   Triton `lora_shrink`, `cuda_fp4.fp4_gemm` with the LoRA epilogue and bias, `rope_kv_write`): rel. error of q / K /
   V / hn, graph-replay us (20 layers per graph), and the byte floor. `--attn` runs only this part.

`--shape 32b` (or 72b) times that model's MLP half instead of the 7B one in part 2 and under `--ncu` (the keys
stay `seven_b` and the JSON rows name the shape). `--ncu`: one launch of each case (M 1 and 8, LoRA on and off) and
of the present path, no graphs, for `ncu --kernel-name regex:"decode_mlp|fp4_decode" ...`.

Usage (the repo's path shim on PYTHONPATH, as scripts/gpu.sh's `cmd` stage gives it):
    QERL_CMD='python3 $REPO/scripts/decode_layer_bench.py $OUT/decode_layer.json' bash scripts/gpu.sh cmd
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
from qerl_kernels import cuda_fp4, decode
from qerl_kernels import decode_layer as dl

from qerl_cli.formats import dequantize, quantize


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def on_cpu(g: dl.GemmArgs) -> dl.GemmArgs:
    return dataclasses.replace(g, repacked=g.repacked.cpu(), scale=g.scale.cpu(),
                               global_scale=None if g.global_scale is None else g.global_scale.cpu(),
                               a=None if g.a is None else g.a.cpu(), b=None if g.b is None else g.b.cpu())


def make_layer(h: int, ko: int, i: int, ranks: tuple[int, int, int], dtype: torch.dtype, dev: str, seed: int,
               dense: bool, fmt: str = "nvfp4") -> dict:
    """Random 4-bit (`fmt`) o / gate_up (one tensor: one global scale) / down, LoRA factors, inputs; `dense`: also
    the dequantized fp32 weights (the reference); `qws`: the checkpoint tensors (INT4's per-GEMM path)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    args, weights, loras, qws = [], [], [], []
    for (n, k), r in zip(((h, ko), (2 * i, h), (h, i)), ranks, strict=True):
        w = torch.randn(n, k, generator=g, device=dev) * k**-0.5
        qw = quantize(w, fmt, dtype=dtype)  # INT4's scales in the activation dtype
        qws.append(qw)
        a = (torch.randn(r, k, generator=g, device=dev) * k**-0.5).to(dtype) if r else None
        b = (torch.randn(n, r, generator=g, device=dev) * 0.3).to(dtype) if r else None
        args.append(dl.checkpoint_args(qw, a, b))
        weights.append(dequantize(qw, torch.float32) if dense else None)
        loras.append(None if a is None else (a, b))
    norm_w = (1 + 0.1 * torch.randn(h, generator=g, device=dev)).to(dtype)
    return dict(args=args, weights=weights, loras=loras, norm_w=norm_w, gen=g, qws=qws)


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
        total += g.repacked.numel() + g.scale.numel() * g.scale.element_size()  # 4-bit weights + their scales
        total += 2 * (g.a.numel() + g.b.numel()) if g.a is not None else 0
    return total + 2 * m * (ko + 3 * h + 2 * h)  # attn, h in; h1, delta out; the norm weight (tokens are few)


def exactness(dev: str, formats: tuple[str, ...] = dl.KERNEL_FORMATS) -> list[dict]:
    rows = []
    hd, ko, i = 256, 384, 384
    for fmt, dtype in ((f, d) for f in formats for d in (torch.bfloat16, torch.float16)):
        lay = make_layer(hd, ko, i, (16, 40, 24), dtype, dev, 1, dense=True, fmt=fmt)
        cpu_args = [on_cpu(g) for g in lay["args"]]
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
            rows.append(dict(fmt=fmt, dtype=str(dtype), m=m, err_emul=max(rel(h1.cpu(), eh), rel(out.cpu(), eo)),
                             err_present=max(rel(h1, rh), rel(out, ro)),
                             bit_equal_rerun=bool(torch.equal(h1, h1b) and torch.equal(out, outb)),
                             counters_zero=all(c == 0 for c in cnt)))
    return rows


# (ring stages per warp, CTAs per SM[, gate/up's and down's x fragments loaded ahead]); the first is the default
VARIANTS = ((4, 2), (4, 2, 1), (8, 2))
ATTN_VARIANTS = ((4, 2), (2, 2), (8, 2))  # the attention half has no x-fragment knob


def variant_name(var: tuple[int, ...]) -> str:
    return f"s{var[0]}b{var[1]}" + ("x" if len(var) > 2 and var[2] else "")


# (hidden, o's input, intermediate) of the Qwen2.5 shapes the engine decodes; `--shape` picks one (default 7b)
SHAPES = {"7b": (3584, 3584, 18944), "32b": (5120, 5120, 27648), "72b": (8192, 8192, 29568)}


def shape_arg() -> str:
    """`--shape NAME` from the command line (default 7b)."""
    argv = sys.argv[1:]
    name = argv[argv.index("--shape") + 1] if "--shape" in argv and argv.index("--shape") + 1 < len(argv) else "7b"
    if name not in SHAPES:
        raise SystemExit(f"--shape {name}: use one of {', '.join(SHAPES)}")
    return name


def seven_b(dev: str, ranks: tuple[int, int, int] = (32, 64, 32), ms: tuple[int, ...] = (1, 8, 16),
            shape: str = "7b") -> list[dict]:
    """The MLP half of `shape` (7B unless named) at each M: every variant against the present path."""
    hd, ko, i = SHAPES[shape]
    lay = make_layer(hd, ko, i, ranks, torch.bfloat16, dev, 2, dense=False)
    bw = copy_gbps(dev)
    rows = []
    for m in ms:
        attn, hres = inputs(lay, m, ko, hd, torch.bfloat16, dev)
        ph1, pout = present_path(attn, hres, lay, 1e-6)
        t_old = graph_ms(lambda: present_path(attn, hres, lay, 1e-6))  # noqa: B023
        nbytes = layer_bytes(lay, m, hd, ko, i)
        floor = nbytes / bw / 1e6
        row = dict(shape=shape, m=m, ranks=list(ranks), present_us=1e3 * t_old, floor_us=1e3 * floor, mb=nbytes / 1e6,
                   present_pct_floor=100 * floor / t_old, copy_gbps=bw, variants={})
        first = None  # the default build's outputs: a variant on the same grid sums the same partials in the same order
        for var in VARIANTS:
            h1, out = dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"], variant=var)
            first = first or (h1.clone(), out.clone())
            err = max(rel(h1, ph1), rel(out, pout))
            t_new = graph_ms(lambda: dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"],  # noqa: B023
                                                 variant=var))  # noqa: B023
            row["variants"][variant_name(var)] = dict(
                us=1e3 * t_new, pct_floor=100 * floor / t_new, speedup=t_old / t_new, err_vs_present=err,
                bits_equal_default=(bool(torch.equal(h1, first[0]) and torch.equal(out, first[1]))
                                    if var[:2] == VARIANTS[0][:2] else None))  # another ring size: another grid
        best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
        row.update(best=best[0], persistent_us=best[1]["us"], persistent_pct_floor=best[1]["pct_floor"],
                   speedup=best[1]["speedup"],
                   err_vs_present=max(v["err_vs_present"] for v in row["variants"].values()))
        rows.append(row)
    return rows


def per_gemm_mlp(attn: torch.Tensor, hres: torch.Tensor, lay: dict, eps: float, gemm) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """The engine's per-GEMM MLP half with `gemm(x, qw, g)` as each linear's base GEMM, the LoRA shrink and expand in
    cuBLAS, the same fused norm and SiLU kernels."""
    o, gu, dn = lay["args"]

    def lin(x: torch.Tensor, qw, g: dl.GemmArgs) -> torch.Tensor:  # noqa: ANN001
        y = gemm(x, qw, g)
        return y if g.a is None else y + (x @ g.a.t()) @ g.b.t()

    yo = lin(attn, lay["qws"][0], o)
    h1, x2 = decode.add_rmsnorm(hres, yo, lay["norm_w"], eps)
    y = lin(x2, lay["qws"][1], gu)
    i = dn.k
    act = decode.silu_mul(y[:, :i], y[:, i:])
    return h1, lin(act, lay["qws"][2], dn)


def int4_gemm(x: torch.Tensor, qw, g: dl.GemmArgs) -> torch.Tensor:  # noqa: ANN001
    """INT4's per-GEMM path: no qerl kernel takes INT4 GEMMs, so the weight is dequantized per call (as
    QuantLinear.forward does on CUDA) for cuBLAS."""
    return x @ dequantize(qw, x.dtype).t()


def w8_gemm(x: torch.Tensor, qw, g: dl.GemmArgs) -> torch.Tensor:  # noqa: ANN001
    """W8's per-GEMM path: qerl's Triton W8 GEMM (per-channel scale on its fp32 sums)."""
    from qerl_kernels._common import num_sms
    from qerl_kernels.backends import w8_config
    from qerl_kernels.w8 import w8_matmul

    t = qw.tensors
    return w8_matmul(x, t["weight"], t["weight_scale"], w8_config(x.shape[0], g.n, g.k, num_sms(x.device)))


def format_rows(dev: str, shape: str, fmt: str, gemm, seed: int, slow: bool = False,  # noqa: ANN001
                ranks: tuple[int, int, int] = (32, 64, 32), ms: tuple[int, ...] = (1, 8, 16)) -> list[dict]:
    """The `fmt` MLP half of `shape` (scales in bf16) at each M: the persistent kernel (default build) against the
    engine's per-GEMM path for that format (`per_gemm_mlp` with `gemm`; `slow`: fewer replays), with its byte floor
    (weights + scales + LoRA + activations)."""
    hd, ko, i = SHAPES[shape]
    lay = make_layer(hd, ko, i, ranks, torch.bfloat16, dev, seed, dense=False, fmt=fmt)
    bw = copy_gbps(dev)
    rows = []
    for m in ms:
        attn, hres = inputs(lay, m, ko, hd, torch.bfloat16, dev)
        ph1, pout = per_gemm_mlp(attn, hres, lay, 1e-6, gemm)
        h1, out = dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"])
        t_old = graph_ms(lambda: per_gemm_mlp(attn, hres, lay, 1e-6, gemm),  # noqa: B023
                         **(dict(reps=4, iters=10) if slow else {}))
        t_new = graph_ms(lambda: dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"]))  # noqa: B023
        nbytes = layer_bytes(lay, m, hd, ko, i)
        floor = nbytes / bw / 1e6
        rows.append(dict(shape=shape, fmt=fmt, m=m, ranks=list(ranks), mb=nbytes / 1e6, floor_us=1e3 * floor,
                         persistent_us=1e3 * t_new, persistent_pct_floor=100 * floor / t_new,
                         present_us=1e3 * t_old, present_pct_floor=100 * floor / t_old, speedup=t_old / t_new,
                         err_vs_present=max(rel(h1, ph1), rel(out, pout)), copy_gbps=bw))
    return rows


def int4_rows(dev: str, shape: str = "7b") -> list[dict]:
    """INT4 (group 128) against its dequantize-per-call path."""
    return format_rows(dev, shape, "int4", int4_gemm, 5, slow=True)


def w8_rows(dev: str, shape: str = "7b") -> list[dict]:
    """INT8 and FP8 (row-major codes, per-channel scales) against qerl's Triton W8 path."""
    return [r for fmt in dl.W8_FORMATS for r in format_rows(dev, shape, fmt, w8_gemm, 6)]


def build_variants() -> None:
    """nvcc for every variant at once (one process each) before anything is timed."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(VARIANTS)) as pool:
        list(pool.map(lambda v: dl.library(v).build(), VARIANTS))


def ncu_once(dev: str, shape: str = "7b") -> None:
    """One launch of each case of `shape` (M 1 and 8, LoRA on and off), no graphs: for `ncu --kernel-name
    regex:decode_mlp`."""
    hd, ko, i = SHAPES[shape]
    for ranks in ((32, 64, 32), (0, 0, 0)):
        lay = make_layer(hd, ko, i, ranks, torch.bfloat16, dev, 2, dense=False)
        for m in (1, 8):
            attn, hres = inputs(lay, m, ko, hd, torch.bfloat16, dev)
            dl.mlp_half(attn, hres, lay["norm_w"], 1e-6, *lay["args"])
            present_path(attn, hres, lay, 1e-6)
    torch.cuda.synchronize()


# ---- the attention half ------------------------------------------------------------------------------------------
def make_attn_layer(h: int, hq: int, hk: int, d: int, rank: int, bias: bool, dtype: torch.dtype, dev: str, seed: int,
                    dense: bool, max_len: int = 512, fmt: str = "nvfp4") -> dict:
    """A random FP4 fused q/k/v, LoRA (A_cat [rank, H], B_blk [N, rank]), fp32 bias, RoPE tables [max_len, d]."""
    g = torch.Generator(device=dev).manual_seed(seed)
    n = (hq + 2 * hk) * d
    w = torch.randn(n, h, generator=g, device=dev) * h**-0.5
    qw = quantize(w, fmt, dtype=dtype)
    a = (torch.randn(rank, h, generator=g, device=dev) * h**-0.5).to(dtype) if rank else None
    b = (torch.randn(n, rank, generator=g, device=dev) * 0.3).to(dtype) if rank else None
    args = dl.checkpoint_args(qw, a, b)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(max_len, device=dev).float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return dict(args=args, weight=dequantize(qw, torch.float32) if dense else None,
                lora=None if a is None else (a, b),
                bias=(torch.randn(n, generator=g, device=dev) * 0.5).to(dtype).float() if bias else None,
                norm_w=(1 + 0.1 * torch.randn(h, generator=g, device=dev)).to(dtype),
                cos=emb.cos().to(dtype).contiguous(), sin=emb.sin().to(dtype).contiguous(), gen=g, hq=hq, hk=hk, d=d,
                h=h, max_len=max_len)


def attn_inputs(lay: dict, m: int, dtype: torch.dtype, dev: str, delta: bool = True, slots: int = 16) -> tuple:
    g = lay["gen"]
    h = (torch.randn(m, lay["h"], generator=g, device=dev) * 2).to(dtype)
    d = torch.randn(m, lay["h"], generator=g, device=dev).to(dtype) if delta else None
    pos = torch.randperm(lay["max_len"], generator=g, device=dev)[:m].to(torch.int64)
    shape = (slots, lay["max_len"], lay["hk"], lay["d"])
    return h, d, pos, torch.randn(shape, generator=g, device=dev).to(dtype), torch.randn(shape, generator=g,
                                                                                        device=dev).to(dtype)


def attn_present_path(h: torch.Tensor, delta: torch.Tensor | None, pos: torch.Tensor, ck: torch.Tensor,
                      cv: torch.Tensor, lay: dict, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's attention half before the attention, launch by launch, as ModelRunner._layers runs it with the fused
    ops at decode: add_rmsnorm, the Triton shrink, the cuda FP4 GEMM with its LoRA epilogue and bias, rope_kv_write."""
    qkv = lay["args"]
    hq, hk, d = lay["hq"], lay["hk"], lay["d"]
    if delta is not None:
        hn, x = decode.add_rmsnorm(h, delta, lay["norm_w"], eps)
    else:
        hn, x = h, decode.add_rmsnorm(h, None, lay["norm_w"], eps)[1]
    hl = decode.lora_shrink(x, qkv.a) if qkv.a is not None else None
    y = cuda_fp4.fp4_gemm(x, qkv.repacked, qkv.scale, qkv.global_scale, "nvfp4", tiled=qkv.tiled, bias=lay["bias"],
                          lora_h=hl, lora_b=qkv.b)
    q = decode.rope_kv_write(y[:, :hq * d], y[:, hq * d:(hq + hk) * d], y[:, (hq + hk) * d:], pos, lay["cos"],
                             lay["sin"], ck, cv)
    return hn, q


def _attn_kernel(h: torch.Tensor, delta: torch.Tensor | None, pos: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                 lay: dict, eps: float, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    return dl.attn_half(h, delta, lay["norm_w"], eps, lay["args"], lay["bias"], lay["cos"], lay["sin"], pos, ck, cv,
                        lay["hq"], **kw)


def attn_exactness(dev: str) -> list[dict]:
    rows = []
    for fmt, dtype in ((f, d) for f in dl.ATTN_KERNEL_FORMATS for d in (torch.bfloat16, torch.float16)):
        for bias in (True, False):
            lay = make_attn_layer(256, 4, 2, 64, 24, bias, dtype, dev, 3, dense=True, max_len=40, fmt=fmt)
            cpu_args = on_cpu(lay["args"])
            for m in (1, 3, 8, 13):
                for with_delta in (True, False):
                    h, d, pos, ck, cv = attn_inputs(lay, m, dtype, dev, with_delta)
                    k0, v0 = ck.clone(), cv.clone()
                    runs = []
                    for _ in range(2):
                        kk, vv = k0.clone(), v0.clone()
                        hn, q = _attn_kernel(h, d, pos, kk, vv, lay, 1e-6)
                        runs.append((hn, q, kk, vv))
                    torch.cuda.synchronize()
                    cnt = dl._attn_counter(torch.device(dev)).cpu().tolist()
                    ctas = dl.attn_default_ctas(torch.device(dev), 1 if m <= 8 else 2, dtype == torch.bfloat16)
                    ek, ev = k0.cpu(), v0.cpu()
                    ehn, eq = dl.emulate_attn_half(h.cpu(), None if d is None else d.cpu(), lay["norm_w"].cpu(),
                                                   1e-6, cpu_args, None if lay["bias"] is None else lay["bias"].cpu(),
                                                   lay["cos"].cpu(), lay["sin"].cpu(), pos.cpu(), ek, ev, 4, ctas)
                    rk, rv = k0.clone(), v0.clone()
                    rhn, rq = dl.reference_attn_half(h, d, lay["norm_w"], 1e-6, lay["weight"], lay["lora"],
                                                     lay["bias"], lay["cos"], lay["sin"], pos, rk, rv, 4)
                    hn, q, kk, vv = runs[0]
                    r = torch.arange(m, device=dev)
                    rc, pc = r.cpu(), pos.cpu()
                    touched = torch.zeros(k0.shape[:2], dtype=torch.bool, device=dev)
                    touched[r, pos] = True
                    rows.append(dict(
                        fmt=fmt, dtype=str(dtype), m=m, bias=bias, delta=with_delta,
                        err_emul=max(rel(q.cpu(), eq), rel(hn.cpu(), ehn), rel(kk[r, pos].cpu(), ek[rc, pc]),
                                     rel(vv[r, pos].cpu(), ev[rc, pc])),
                        err_present=max(rel(q, rq), rel(hn, rhn), rel(kk[r, pos], rk[r, pos]),
                                        rel(vv[r, pos], rv[r, pos])),
                        others_untouched=bool(torch.equal(kk[~touched], k0[~touched])
                                              and torch.equal(vv[~touched], v0[~touched])),
                        bit_equal_rerun=all(torch.equal(x, y) for x, y in zip(runs[0], runs[1], strict=True)),
                        counters_zero=all(c == 0 for c in cnt)))
    return rows


def attn_bytes(lay: dict, m: int) -> int:
    g = lay["args"]
    total = g.repacked.numel() + g.scale.numel() * g.scale.element_size()
    total += 2 * (g.a.numel() + g.b.numel()) if g.a is not None else 0
    total += 4 * lay["bias"].numel() if lay["bias"] is not None else 0
    h, hq, hk, d = lay["h"], lay["hq"], lay["hk"], lay["d"]
    # h, delta in; hn out; norm weight; q out, K/V rows written; cos/sin rows read
    return total + 2 * (3 * m * h + h + m * (hq + 2 * hk) * d + 2 * m * d)


def attn_seven_b(dev: str, rank: int = 96, ms: tuple[int, ...] = (1, 8)) -> list[dict]:
    lay = make_attn_layer(3584, 28, 4, 128, rank, True, torch.bfloat16, dev, 4, dense=False)
    bw = copy_gbps(dev)
    rows = []
    for m in ms:
        h, d, pos, ck, cv = attn_inputs(lay, m, torch.bfloat16, dev)
        pk, pv = ck.clone(), cv.clone()
        phn, pq = attn_present_path(h, d, pos, pk, pv, lay, 1e-6)
        kk, vv = ck.clone(), cv.clone()
        hn, q = _attn_kernel(h, d, pos, kk, vv, lay, 1e-6)
        r = torch.arange(m, device=dev)
        err = dict(q=rel(q, pq), k=rel(kk[r, pos], pk[r, pos]), v=rel(vv[r, pos], pv[r, pos]), h=rel(hn, phn))
        t_old = graph_ms(lambda: attn_present_path(h, d, pos, pk, pv, lay, 1e-6))  # noqa: B023
        row = dict(m=m, rank=rank, present_us=1e3 * t_old, err=err, err_vs_present=max(err.values()), variants={})
        nbytes = attn_bytes(lay, m)
        floor = nbytes / bw / 1e6
        row.update(mb=nbytes / 1e6, floor_us=1e3 * floor, present_pct_floor=100 * floor / t_old, copy_gbps=bw)
        for var in ATTN_VARIANTS:
            t_new = graph_ms(lambda: _attn_kernel(h, d, pos, kk, vv, lay, 1e-6, variant=var))  # noqa: B023
            row["variants"][variant_name(var)] = dict(us=1e3 * t_new, pct_floor=100 * floor / t_new,
                                                         speedup=t_old / t_new)
        best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
        row.update(best=best[0], persistent_us=best[1]["us"], persistent_pct_floor=best[1]["pct_floor"],
                   speedup=best[1]["speedup"])
        rows.append(row)
    return rows


def attn_report(result: dict) -> bool:
    ok = all(r["err_emul"] < 5e-3 and r["err_present"] < 1e-2 and r["bit_equal_rerun"] and r["counters_zero"]
             and r["others_untouched"] for r in result["attn_exactness"])
    ok = ok and all(r["err_vs_present"] < 1e-2 for r in result["attn_seven_b"])
    for r in result["attn_exactness"]:
        print(f"attn exact {r['fmt']:5s} {r['dtype']:15s} M={r['m']:2d} bias={r['bias']!s:5} delta={r['delta']!s:5} "
              f"err_emul={r['err_emul']:.2e} err_present={r['err_present']:.2e} rerun_bits={r['bit_equal_rerun']} "
              f"counters_zero={r['counters_zero']} others_untouched={r['others_untouched']}")
    print(f"attn half 7B: {'M':>3} {'rank':>4} {'MB':>6} {'floor us':>9} {'persistent us':>14} {'%floor':>7} "
          f"{'present us':>11} {'%floor':>7} {'speedup':>8} {'err q/k/v/h':>30}")
    for r in result["attn_seven_b"]:
        e = r["err"]
        print(f"             {r['m']:3d} {r['rank']:4d} {r['mb']:6.1f} {r['floor_us']:9.2f} {r['persistent_us']:14.2f} "
              f"{r['persistent_pct_floor']:6.1f}% {r['present_us']:11.2f} {r['present_pct_floor']:6.1f}% "
              f"{r['speedup']:7.2f}x {e['q']:.1e}/{e['k']:.1e}/{e['v']:.1e}/{e['h']:.1e} best {r['best']}: "
              + " ".join(f"{k} {v['us']:.1f}" for k, v in r["variants"].items()))
    return ok


def attn_only(dev: str) -> int:
    if not dl.attn_available(torch.device(dev)):
        print("decode attention-half kernel unavailable:", dl.attn_unavailable_reason())
        return 2
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(ATTN_VARIANTS)) as pool:
        list(pool.map(lambda v: dl.attn_library(v).build(), ATTN_VARIANTS))
    result = {"attn_exactness": attn_exactness(dev), "attn_seven_b": attn_seven_b(dev) + attn_seven_b(dev, 0)}
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if args:
        with open(args[0], "w") as f:
            json.dump(result, f, indent=1)
    ok = attn_report(result)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def w8_only(dev: str, shape: str) -> int:
    """`--w8`: the default build only: exactness rows of every format (the 8-bit ones new), then the 8-bit MLP halves
    of `shape` against the per-GEMM W8 path."""
    result = {"exactness": exactness(dev), "w8": w8_rows(dev, shape)}
    ok = all(r["err_emul"] < 5e-3 and r["err_present"] < 1e-2 and r["bit_equal_rerun"] and r["counters_zero"]
             for r in result["exactness"]) and all(r["err_vs_present"] < 1e-2 for r in result["w8"])
    args = [a for a in sys.argv[1:] if not a.startswith("--") and a not in SHAPES]
    if args:
        with open(args[0], "w") as f:
            json.dump(result, f, indent=1)
    for r in result["exactness"]:
        print(f"exact {r['fmt']:5s} {r['dtype']:15s} M={r['m']:2d} err_emul={r['err_emul']:.2e} "
              f"err_present={r['err_present']:.2e} rerun_bits={r['bit_equal_rerun']} "
              f"counters_zero={r['counters_zero']}")
    for r in result["w8"]:
        print(f"{r['fmt']:5s} M={r['m']:2d} {r['mb']:7.1f} MB floor {r['floor_us']:7.1f} us: persistent "
              f"{r['persistent_us']:7.1f} us ({r['persistent_pct_floor']:5.1f}%), Triton W8 path "
              f"{r['present_us']:7.1f} us ({r['present_pct_floor']:5.1f}%), {r['speedup']:5.2f}x, "
              f"err {r['err_vs_present']:.2e}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    dev = "cuda"
    if not torch.cuda.is_available() or not dl.available(torch.device(dev)):
        print("decode layer kernel unavailable:", dl.unavailable_reason())
        return 2
    shape = shape_arg()
    if "--ncu" in sys.argv:
        ncu_once(dev, shape)
        return 0
    if "--attn" in sys.argv:
        return attn_only(dev)
    if "--w8" in sys.argv:
        return w8_only(dev, shape)
    sys.argv = [a for i, a in enumerate(sys.argv)
                if not a.startswith("--") and not (i > 0 and sys.argv[i - 1] == "--shape")]
    build_variants()
    result = {"exactness": exactness(dev)}
    ok = all(r["err_emul"] < 5e-3 and r["err_present"] < 1e-2 and r["bit_equal_rerun"] and r["counters_zero"]
             for r in result["exactness"])
    result["seven_b"] = seven_b(dev, shape=shape) + seven_b(dev, (0, 0, 0), (1, 8), shape=shape)
    ok = ok and all(r["err_vs_present"] < 1e-2 and all(v["bits_equal_default"] is not False
                                                         for v in r["variants"].values())
                    for r in result["seven_b"])
    result["int4"] = int4_rows(dev, shape)
    result["w8"] = w8_rows(dev, shape)
    ok = ok and all(r["err_vs_present"] < 1e-2 for r in result["int4"] + result["w8"])
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
    for r in result["exactness"]:
        print(f"exact {r['fmt']:5s} {r['dtype']:15s} M={r['m']:2d} err_emul={r['err_emul']:.2e} "
              f"err_present={r['err_present']:.2e} rerun_bits={r['bit_equal_rerun']} "
              f"counters_zero={r['counters_zero']}")
    print(f"{'M':>3} {'ranks':>9} {'MB':>7} {'floor us':>9} {'persistent us':>14} {'%floor':>7} {'present us':>11} "
          f"{'%floor':>7} {'speedup':>8} {'err':>9}")
    for r in result["seven_b"]:
        print(f"{r['m']:3d} {'/'.join(map(str, r['ranks'])):>9} {r['mb']:7.1f} {r['floor_us']:9.1f} "
              f"{r['persistent_us']:14.1f} {r['persistent_pct_floor']:6.1f}% {r['present_us']:11.1f} "
              f"{r['present_pct_floor']:6.1f}% {r['speedup']:7.2f}x {r['err_vs_present']:9.2e} best {r['best']}: "
              + " ".join(f"{k} {v['us']:.1f}" for k, v in r["variants"].items()))
    for r in result["int4"]:
        print(f"{r['m']:3d} {'/'.join(map(str, r['ranks'])):>9} {r['mb']:7.1f} {r['floor_us']:9.1f} "
              f"{r['persistent_us']:14.1f} {r['persistent_pct_floor']:6.1f}% {r['present_us']:11.1f} "
              f"{r['present_pct_floor']:6.1f}% {r['speedup']:7.2f}x {r['err_vs_present']:9.2e} INT4 (present: "
              "dequantize per call + cuBLAS)")
    for r in result["w8"]:
        print(f"{r['m']:3d} {'/'.join(map(str, r['ranks'])):>9} {r['mb']:7.1f} {r['floor_us']:9.1f} "
              f"{r['persistent_us']:14.1f} {r['persistent_pct_floor']:6.1f}% {r['present_us']:11.1f} "
              f"{r['present_pct_floor']:6.1f}% {r['speedup']:7.2f}x {r['err_vs_present']:9.2e} {r['fmt'].upper()} "
              "(present: Triton W8 GEMMs)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
