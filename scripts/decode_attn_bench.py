"""Decode attention and sampling on the GPU: qerl's paths against each other and FlashInfer.

Attention, on the builtin engine's decode layout: one query token per slot over the slot's cache
``[slots, kv_len, kv_heads, d]``; rows at random positions in [kv_len / 2, kv_len). Timed per call (one
layer; CUDA events, median of triton's do_bench):
  * SDPA backends (cudnn, efficient, math; flash without a mask as a bound) as the engine calls them: the
    whole KV bucket with an additive mask, GQA folded onto the query axis;
  * FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on the same cache viewed as pages
    (``qerl_cli.rollout.attention``: the page table qerl builds, live keys only), when flashinfer imports;
  * qerl's split-KV decode (``qerl_kernels.decode_attention``, ``decode_attn=split``): live keys only.
GB/s are of the live K/V bytes (what the step needs); ``bucket GB/s`` of what SDPA reads.
Times are per call from CUDA-graph replays (as the engine runs the step), launch-by-launch where a call
cannot be captured. Shapes: batch 8/64/256 x KV 512-8192 for the Qwen2.5-7B (28 q heads over 4 KV heads, d 128)
and -32B (40 over 8) layouts.

Sampling over [batch, 152064] bf16 logits, batch 8/64/256: qerl's torch path, qerl's one-pass kernel
(temperature 1, and 0.7), qerl's top-p 0.9 / top-k 50 (torch filter + the one pass), FlashInfer's
``sampling_from_logits`` and ``top_k_top_p_sampling_from_logits``.

Usage: python3 decode_attn_bench.py OUT.json [--only attn|sampling]  (run with the repo's path shim: qerl_cli)
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"7b": (28, 4, 128), "32b": (40, 8, 128)}
BATCHES = (8, 64, 256)
KV_LENS = (512, 1024, 2048, 4096, 8192)
VOCAB = 152064


GRAPH_CALLS = 20


def bench_ms(fn) -> float:  # noqa: ANN001
    """Per call, as the engine runs it: replays of a CUDA graph of GRAPH_CALLS calls (a Triton launch costs tens of
    microseconds of Python, more than a small step's kernels, and the engine's graph hides it); a call that cannot
    be captured is timed launch by launch (`bench.kernels.time_calls`)."""
    from qerl_cli.bench.kernels import time_calls

    return time_calls([fn] * GRAPH_CALLS)[0]


def flashinfer_or_reason() -> tuple[object | None, str]:
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - reported, the SDPA rows still run
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return flashinfer, getattr(flashinfer, "__version__", "?")


def attention_rows(fi: object | None) -> list[dict]:
    from qerl_cli.rollout.attention import PAGE_SIZE, WORKSPACE_BYTES, cache_pages, paged_layout

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows: list[dict] = []
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev) if fi is not None else None
    for shape, (hq, kvh, d) in SHAPES.items():
        groups = hq // kvh
        for b in BATCHES:
            for kv in KV_LENS:
                cache_k = torch.randn(b, kv, kvh, d, device=dev, dtype=dt)
                cache_v = torch.randn(b, kv, kvh, d, device=dev, dtype=dt)
                q = torch.randn(b, hq, d, device=dev, dtype=dt)
                pos = torch.randint(kv // 2, kv, (b,), device=dev)
                visible = (torch.arange(kv, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
                mask = torch.zeros(visible.shape, dtype=dt, device=dev).masked_fill_(~visible, float("-inf"))
                k, v = cache_k.transpose(1, 2), cache_v.transpose(1, 2)
                qg = q.view(b, kvh, groups, d)
                live = 2 * int((pos + 1).sum()) * kvh * d * 2
                bucket = 2 * b * kv * kvh * d * 2
                ref = F.scaled_dot_product_attention(qg.float(), k.float(), v.float(), attn_mask=mask.float())
                cands = [("cudnn", SDPBackend.CUDNN_ATTENTION, True),
                         ("efficient", SDPBackend.EFFICIENT_ATTENTION, True),
                         ("flash (no mask)", SDPBackend.FLASH_ATTENTION, False), ("math", SDPBackend.MATH, True)]
                for name, backend, use_mask in cands:
                    if name == "math" and b * kv > 64 * 2048:
                        continue
                    row = {"shape": shape, "batch": b, "kv_len": kv, "backend": name}
                    try:
                        with sdpa_kernel([backend]):
                            m = mask if use_mask else None

                            def fn(qg=qg, k=k, v=v, m=m):  # noqa: ANN001, ANN202
                                return F.scaled_dot_product_attention(qg, k, v, attn_mask=m)

                            o = fn()
                            if use_mask:
                                row["err"] = ((o.float() - ref).norm() / ref.norm()).item()
                            row["ms"] = bench_ms(fn)
                    except Exception as exc:  # noqa: BLE001 - a backend that refuses the call is a result
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    rows.append(row)
                if fi is not None:
                    row = {"shape": shape, "batch": b, "kv_len": kv, "backend": "flashinfer"}
                    try:
                        w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=groups >= 4,
                                                                 backend="fa2")
                        indptr, indices, last = paged_layout((pos + 1).tolist(), kv)
                        w.plan(indptr, indices, last, hq, kvh, d, PAGE_SIZE, pos_encoding_mode="NONE",
                               q_data_type=dt, kv_data_type=dt)
                        pages = (cache_pages(cache_k), cache_pages(cache_v))
                        o = w.run(q, pages)
                        row["err"] = ((o.float().view(b, kvh, groups, d) - ref).norm() / ref.norm()).item()
                        row["ms"] = bench_ms(lambda w=w, q=q, pages=pages: w.run(q, pages))
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    rows.append(row)
                row = {"shape": shape, "batch": b, "kv_len": kv, "backend": "qerl split"}
                try:
                    from qerl_kernels.decode_attention import split_kv_decode

                    def split(q=q, ck=cache_k, cv=cache_v, pos=pos, kv=kv, d=d):  # noqa: ANN001, ANN202
                        return split_kv_decode(q, ck, cv, pos, kv, d**-0.5)

                    o = split()
                    row["err"] = ((o.float().view(b, kvh, groups, d) - ref).norm() / ref.norm()).item()
                    row["ms"] = bench_ms(split)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                rows.append(row)
                for r in rows:
                    if r.get("ms") and r["shape"] == shape and r["batch"] == b and r["kv_len"] == kv:
                        r["GBps"] = live / (r["ms"] * 1e-3) / 1e9
                        r["bucket_GBps"] = bucket / (r["ms"] * 1e-3) / 1e9
                del cache_k, cache_v, k, v
                torch.cuda.empty_cache()
    return rows


def sampling_rows(fi: object | None) -> list[dict]:
    from qerl_cli.rollout.sampling import SamplingParams, StepSampler, TokenNoise

    dev = torch.device("cuda")
    fused = TokenNoise(VOCAB, dev, fused=True, fused_sampling=True)
    plain = TokenNoise(VOCAB, dev, fused=True, fused_sampling=False)
    rows: list[dict] = []
    for b in BATCHES:
        logits = (3 * torch.randn(b, VOCAB, device=dev)).to(torch.bfloat16)
        uids, steps = torch.arange(b, device=dev), torch.zeros(b, dtype=torch.int64, device=dev)
        cases = [
            ("qerl torch, T=1", SamplingParams(temperature=1.0), plain),
            ("qerl fused, T=1", SamplingParams(temperature=1.0), fused),
            ("qerl fused, T=0.7", SamplingParams(temperature=0.7), fused),
            ("qerl fused, top-p 0.9 top-k 50", SamplingParams(temperature=1.0, top_p=0.9, top_k=50), fused),
        ]
        for name, params, noise in cases:
            sampler = StepSampler(params, noise, 0, dev)
            sampler(logits, uids, steps)  # first-use check outside the timing
            ms = bench_ms(lambda s=sampler, x=logits, u=uids, t=steps: s(x, u, t))
            rows.append({"batch": b, "sampler": name, "ms": ms, "fused": noise.fused_sampling})
        if fi is not None:
            for name, fn in (("flashinfer sampling_from_logits", lambda x=logits: fi.sampling_from_logits(x)),
                             ("flashinfer top_k_top_p_from_logits 50/0.9",
                              lambda x=logits: fi.top_k_top_p_sampling_from_logits(x, 50, 0.9))):
                row = {"batch": b, "sampler": name}
                try:
                    fn()
                    row["ms"] = bench_ms(fn)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                rows.append(row)
        for r in rows:
            if r["batch"] == b and r.get("ms"):
                r["GBps"] = b * VOCAB * 2 / (r["ms"] * 1e-3) / 1e9  # one read of the logits
    return rows


def print_attention(rows: list[dict]) -> None:
    print(f"{'shape':5} {'batch':>5} {'kv':>5} {'backend':16} {'us/layer':>9} {'live GB/s':>9} {'bucket GB/s':>11} "
          f"{'rel err':>8}")
    for r in rows:
        ms = "-" if r.get("ms") is None else f"{1000 * r['ms']:.1f}"
        gb = "-" if r.get("GBps") is None else f"{r['GBps']:.0f}"
        bb = "-" if r.get("bucket_GBps") is None else f"{r['bucket_GBps']:.0f}"
        err = "-" if r.get("err") is None else f"{r['err']:.1e}"
        print(f"{r['shape']:5} {r['batch']:>5} {r['kv_len']:>5} {r['backend']:16} {ms:>9} {gb:>9} {bb:>11} "
              f"{err:>8} {r.get('error', '')}", flush=True)


def print_sampling(rows: list[dict]) -> None:
    print(f"{'batch':>5} {'sampler':42} {'us':>8} {'logits GB/s':>11}")
    for r in rows:
        us = "-" if r.get("ms") is None else f"{1000 * r['ms']:.1f}"
        gb = "-" if r.get("GBps") is None else f"{r['GBps']:.0f}"
        print(f"{r['batch']:>5} {r['sampler']:42} {us:>8} {gb:>11} {r.get('error', '')}", flush=True)


def main() -> None:
    out = sys.argv[1]
    only = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--only" else None
    fi, fi_info = flashinfer_or_reason()
    print(f"flashinfer: {fi_info}", flush=True)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": fi_info}
    # each part is written and printed when it is done: FlashInfer's JIT build of its sampling modules can take
    # minutes, and a deadline must not lose the attention rows
    if only in (None, "attn"):
        res["attention"] = attention_rows(fi)
        json.dump(res, open(out, "w"), indent=1)
        print_attention(res["attention"])
    if only in (None, "sampling"):
        res["sampling"] = sampling_rows(fi)
        json.dump(res, open(out, "w"), indent=1)
        print_sampling(res["sampling"])


if __name__ == "__main__":
    main()
