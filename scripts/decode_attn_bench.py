"""Decode attention on the GPU: torch SDPA backends on the builtin engine's decode layout.

The engine attends one query token per slot over the slot's cache up to a KV-length bucket, with an
additive mask (keys past the slot's position are -inf) and grouped-query heads folded onto SDPA's
query-length axis: q [B, kv_heads, groups, d], K/V strided views [B, kv_heads, kv_len, d] of the cache
[slots, max_len, kv_heads, d]. This times each SDPA backend that accepts that call (CUDA events, median of
triton's do_bench) and, as a lower bound with no mask, the flash backend on the same shapes; bytes = the
K/V rows the call must read. Usage: python3 decode_attn_bench.py OUT.json [shape: kv_heads,groups,d]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    out = sys.argv[1]
    kvh, groups, d = (int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "4,7,128").split(","))
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for b in (8, 64, 256):
        for kv in (512, 2048, 8192):
            cache_k = torch.randn(b, kv, kvh, d, device=dev, dtype=dt)
            cache_v = torch.randn(b, kv, kvh, d, device=dev, dtype=dt)
            q = torch.randn(b, kvh, groups, d, device=dev, dtype=dt)
            pos = torch.randint(kv // 2, kv, (b,), device=dev)
            visible = (torch.arange(kv, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
            mask = torch.zeros(visible.shape, dtype=dt, device=dev).masked_fill_(~visible, float("-inf"))
            k, v = cache_k.transpose(1, 2), cache_v.transpose(1, 2)
            nbytes = 2 * b * kv * kvh * d * 2
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float())
            for name, backend, use_mask in (("cudnn", SDPBackend.CUDNN_ATTENTION, True),
                                            ("efficient", SDPBackend.EFFICIENT_ATTENTION, True),
                                            ("flash (no mask)", SDPBackend.FLASH_ATTENTION, False),
                                            ("math", SDPBackend.MATH, True)):
                if name == "math" and b * kv > 64 * 2048:
                    continue
                row = {"batch": b, "kv_len": kv, "backend": name, "ms": None, "GBps": None, "err": None}
                try:
                    with sdpa_kernel([backend]):
                        m = mask if use_mask else None

                        def fn(q=q, k=k, v=v, m=m):  # noqa: ANN001, ANN202
                            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

                        o = fn()
                        if use_mask:
                            row["err"] = ((o.float() - ref).norm() / ref.norm()).item()
                        ms = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
                    row["ms"] = ms
                    row["GBps"] = nbytes / (ms * 1e-3) / 1e9
                except Exception as exc:  # noqa: BLE001 - a backend that refuses the call is a result
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append(row)
            del cache_k, cache_v
            torch.cuda.empty_cache()
    json.dump({"shape": {"kv_heads": kvh, "groups": groups, "head_dim": d}, "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "rows": rows}, open(out, "w"), indent=1)
    print(f"{'batch':>5} {'kv':>5} {'backend':16} {'ms/layer':>9} {'GB/s':>7} {'rel err':>8}")
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.4f}"
        gb = "-" if r["GBps"] is None else f"{r['GBps']:.0f}"
        err = "-" if r["err"] is None else f"{r['err']:.1e}"
        print(f"{r['batch']:>5} {r['kv_len']:>5} {r['backend']:16} {ms:>9} {gb:>7} {err:>8} {r.get('error', '')}")


if __name__ == "__main__":
    main()
