"""Sweep launch configurations of the fused FP4 kernel on the GPU (`python -m qerl_cli.bench.kernel_tune OUT.json`).

The data behind `linear.fp4_config`: for each M, every candidate tile shape (and split-K factor, and the
asm / arithmetic / table decoders at a few M) is timed on the four GEMMs of one Qwen2.5-7B layer, with
the same rotating-weights CUDA-graph timing as `qerl bench kernels`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial

import torch
import triton
from qerl_kernels._common import DECODE_ARITH, DECODE_ASM, TileConfig, num_sms, split_k_for

CANDIDATES: dict[int, list[tuple[int, int, int, int, int]]] = {
    # (bm, bn, bk, warps, stages) for the repacked kernel (bk % 128 == 0); none of these spills on sm_90
    1: [(16, 128, 128, 4, 4), (16, 64, 256, 4, 4), (16, 64, 128, 4, 4), (16, 128, 256, 4, 3), (16, 128, 128, 4, 6),
        (16, 256, 128, 8, 4)],
    64: [(64, 128, 128, 4, 4), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3)],
    128: [(128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (128, 128, 256, 8, 2), (128, 64, 128, 4, 4)],
    256: [(128, 128, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 256, 8, 2), (128, 256, 128, 8, 3)],
}
CANDIDATES[16] = CANDIDATES[1]
CANDIDATES[512] = CANDIDATES[256]
CANDIDATES[2048] = CANDIDATES[256]
# the checkpoint-layout kernel, once per M for comparison
V1_CFG = {1: (16, 64, 256, 4, 4), 16: (16, 64, 256, 4, 4), 64: (64, 128, 128, 4, 4), 128: (128, 128, 64, 8, 4),
          256: (128, 128, 64, 8, 3), 512: (128, 128, 64, 8, 3), 2048: (256, 128, 64, 8, 3)}


def sweep_fp4(model: str = "qwen2.5-7b", ms: tuple[int, ...] = (1, 16, 64, 128, 256, 512), fmt: str = "nvfp4",
              rep_ms: int = 25, log: Callable[[str], None] | None = print) -> list[dict]:
    from qerl_kernels.fp4 import fp4_matmul, fp4_matmul_v2, kernel_scales, repack_fp4
    from qerl_kernels.linear import kernel_state

    from qerl_cli.bench.harness import device
    from qerl_cli.bench.kernels import l2_bytes, layer_linears, quant_modules, time_calls, weight_copies

    dev = device(cuda_only="python -m qerl_cli.bench.kernel_tune")
    sms = num_sms(dev)
    copies_for = partial(weight_copies, l2=l2_bytes(dev))
    rows: list[dict] = []
    for name, n, k in layer_linears(model):
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        mods = quant_modules(w, fmt, copies_for)
        ckpt = [m_.weight_packed.clone() for m_ in mods]  # checkpoint order, before the in-place repack
        states = [kernel_state(m_) for m_ in mods]
        kss = [kernel_scales(m_.weight_scale, fmt, torch.bfloat16, st.shift)
               for m_, st in zip(mods, states, strict=True)]
        tiled = n % 64 == 0
        wts = [repack_fp4(c, tiled=True) for c in ckpt] if tiled else []
        wrs = [repack_fp4(c, tiled=False) for c in ckpt]  # the row-local layout (v2)
        kts = [kernel_scales(m_.weight_scale, fmt, torch.bfloat16, st.shift, tiled=True)
               for m_, st in zip(mods, states, strict=True)] if tiled else []
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            runs: list[tuple[TileConfig, str]] = []
            for bm, bn, bk, wp, stg in CANDIDATES.get(m, CANDIDATES[256]):
                base = split_k_for(triton.cdiv(m, bm) * triton.cdiv(n, bn), k, bk, sms)
                splits = {base}
                if m <= 64:
                    splits |= {max(1, base // 2), min(32, base * 2)}
                for sp in sorted(splits):
                    runs.append((TileConfig(bm, bn, bk, wp, stg, sp), "v2"))
                    if tiled and bn % 64 == 0:
                        runs.append((TileConfig(bm, bn, bk, wp, stg, sp), "v3"))
            bm, bn, bk, wp, stg = V1_CFG.get(m, V1_CFG[256])
            runs.append((TileConfig(bm, bn, bk, wp, stg, split_k_for(triton.cdiv(m, bm) * triton.cdiv(n, bn), k, bk,
                                                                      sms)), "v1"))
            if m in (1, 128):
                runs.append((runs[-1][0], "v1-arith"))
            for cfg, kind in runs:
                if kind == "v2":
                    calls = [partial(fp4_matmul_v2, x, wr, ks, getattr(m_, "weight_global_scale", None), fmt,
                                     cfg, shift=st.shift)
                             for m_, st, ks, wr in zip(mods, states, kss, wrs, strict=True)]
                elif kind == "v3":
                    calls = [partial(fp4_matmul_v2, x, wt, kt, getattr(m_, "weight_global_scale", None), fmt,
                                     cfg, shift=st.shift, tiled=True)
                             for m_, st, wt, kt in zip(mods, states, wts, kts, strict=True)]
                else:
                    dec = DECODE_ARITH if kind == "v1-arith" else DECODE_ASM
                    calls = [partial(fp4_matmul, x, c, m_.weight_scale,
                                     getattr(m_, "weight_global_scale", None), fmt, cfg, shift=st.shift, decode=dec)
                             for m_, st, c in zip(mods, states, ckpt, strict=True)]
                try:
                    t, _ = time_calls(calls, rep_ms=rep_ms)
                except Exception as exc:
                    rows.append({"gemm": name, "M": m, "cfg": cfg.key(), "decode": kind, "error": repr(exc)[:300]})
                    continue
                rows.append({"gemm": name, "N": n, "K": k, "M": m, "cfg": cfg.key(), "decode": kind, "ms": t})
            if log:
                best = min((r for r in rows if r["gemm"] == name and r["M"] == m and "ms" in r),
                           key=lambda r: r["ms"], default=None)
                if best:
                    log(f"sweep {name} M={m}: best {best['cfg']} {best['decode']} {best['ms'] * 1e3:.1f}us")
        del mods, w
        torch.cuda.empty_cache()
    return rows


def summarize_sweep(rows: list[dict]) -> list[str]:
    """Per M: the best single tile shape (bm/bn/bk/warps/stages, split auto) summed over the layer."""
    lines = []
    for m in sorted({r["M"] for r in rows}):
        per: dict[str, dict[str, float]] = {}
        for r in rows:
            if r["M"] == m and "ms" in r:
                tile = r["cfg"].rsplit("x", 1)[0] + f"/{r['decode']}"
                g = per.setdefault(tile, {})
                g[r["gemm"]] = min(g.get(r["gemm"], 1e9), r["ms"])
        full = {t: sum(v.values()) for t, v in per.items() if len(v) == 4}
        best_each = sum(min(r["ms"] for r in rows if r["M"] == m and r["gemm"] == g and "ms" in r)
                        for g in {r["gemm"] for r in rows if r["M"] == m and "ms" in r})
        for t, v in sorted(full.items(), key=lambda kv: kv[1])[:4]:
            lines.append(f"M={m:5d} {t:28s} layer {v * 1e3:7.1f} us")
        lines.append(f"M={m:5d} best-per-gemm               layer {best_each * 1e3:7.1f} us")
    return lines


def main() -> int:
    rows = sweep_fp4()
    for line in summarize_sweep(rows):
        print(line)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
