"""Where a decode step's GPU time goes: torch.profiler kernels grouped into a few categories.

Kernel names alone cannot tell a LoRA GEMM from the lm_head GEMM (both are cuBLAS kernels), so the
decode path marks its pieces with ``regions.region(name)``. A kernel belongs to the innermost region around
the host call that launched it (matched through the trace's correlation ids); a kernel outside every region
is classified by its name.

The profile runs the decode step eagerly (a graph replay hides which host call launched each kernel); the
per-kernel GPU times are those of the graphed step, the gaps between them are not, so the report gives
both the summed kernel time and, separately, the graph-replayed step time (decode and sampling, as the
scheduler runs them: the sampler inside the graph where it is captured there).

Each category also gets its byte floor (``roofline.py``: the bytes its kernels must move over the measured
copy bandwidth) and the % of that floor it reaches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qerl_cli.rollout.regions import PREFIX, profiling, region

__all__ = ["CATEGORIES", "categorize_trace", "chrome_trace", "classify_name", "profile_decode", "profiling", "region"]

CATEGORIES = ("quantized GEMM", "dense GEMM", "LoRA", "attention", "norm/RoPE/activation", "sampling", "copies",
              "other")
# region name -> category (regions are opened by the rollout code; see region())
REGION_CATEGORY = {
    "qgemm": "quantized GEMM",
    "dense": "dense GEMM",
    "module": "dense GEMM",  # a projection left to its own module (peft forward: GEMMs with their adapter)
    "lora": "LoRA",
    "attn": "attention",
    "elementwise": "norm/RoPE/activation",
    "sampling": "sampling",
}
# name fragments -> category, for kernels launched outside every region (first match wins)
_NAME_RULES = (
    # qerl's CUDA FP4 kernels (old and stream plans, the fix-up and activation permute) before "gemm" below
    (("_fp4_mm", "fp4_gemm_kernel", "fp4_decode_kernel", "fp4_wide_kernel", "fp4_fixup_kernel", "permute_x_kernel",
      "_w8_mm", "fp4_dequant", "splitk_reduce", "humming", "marlin", "_moe_grouped"), "quantized GEMM"),
    (("memcpy", "memset", "copy_kernel", "catarraybatchedcopy", "copy_"), "copies"),
    (("rmsnorm", "rope", "silu", "layer_norm", "rms_norm"), "norm/RoPE/activation"),
    (("fmha", "flash", "attention", "sdpa", "cudnn"), "attention"),
    (("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "gemv"), "dense GEMM"),
)

def classify_name(name: str, cat: str = "kernel") -> str:
    """Category of a kernel launched outside every region, from its trace category and name."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    low = name.lower()
    for frags, category in _NAME_RULES:
        if any(f in low for f in frags):
            return category
    return "other"


def categorize_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """GPU time by category (microseconds) from a chrome trace written by torch.profiler.

    Each GPU event (kernel, memcpy, memset) is matched by its ``correlation`` id to the host launch
    (``cuda_runtime`` / ``cuda_driver`` events), and that launch to the innermost ``qerl.*``
    ``user_annotation`` range on the same thread that contains it in time.
    Returns {"us": {category: us}, "kernels": count, "top": [(name, category, us), ...]}.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    launches: dict[int, tuple[Any, float]] = {}
    ranges: dict[Any, list[tuple[float, float, str]]] = {}
    for e in events:
        cat = e.get("cat", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[int(corr)] = (e.get("tid"), float(e["ts"]))
        elif cat == "user_annotation" and str(e.get("name", "")).startswith(PREFIX):
            ts = float(e["ts"])
            ranges.setdefault(e.get("tid"), []).append((ts, ts + float(e.get("dur", 0.0)),
                                                         str(e["name"])[len(PREFIX):]))
    us = dict.fromkeys(CATEGORIES, 0.0)
    per_name: dict[tuple[str, str], float] = {}
    count = 0
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        dur = float(e.get("dur", 0.0))
        name = str(e.get("name", ""))
        category = None
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None and int(corr) in launches:
            tid, ts = launches[int(corr)]
            inner = None
            for start, end, reg in ranges.get(tid, []):
                if start <= ts <= end and (inner is None or start >= inner[0]):
                    inner = (start, reg)
            if inner is not None:
                category = REGION_CATEGORY.get(inner[1])
        if category is None:
            category = classify_name(name, cat)
        us[category] += dur
        per_name[(name, category)] = per_name.get((name, category), 0.0) + dur
        count += 1
    top = sorted(((n, c, t) for (n, c), t in per_name.items()), key=lambda r: -r[2])[:25]
    return {"us": us, "kernels": count, "top": top}


def profile_decode(engine: Any, batch: int, context: int, steps: int = 4, graph_reps: int = 20,
                   trace_path: Path | None = None, copy_gbps: float | None = None,
                   mma_tflops: float | None = None, fp8_tflops: float | None = None) -> dict[str, Any]:
    """Profile ``steps`` decode steps (+ sampling) of ``batch`` slots at ``context`` cached tokens.

    Needs an engine whose last ``generate`` left its KV cache, LoRA plan and norm buffers in place (call
    before ``release()``). Writes K/V at position ``context`` of slots ``0..batch-1`` (bench use only).
    Returns per-step milliseconds by category, the summed kernel time, the CUDA-graph-replayed step
    time at the same (batch, KV bucket) when the engine uses graphs, and per category the bytes the step
    must move and the FLOPs it must do, the floor they set at ``copy_gbps`` (the run's measured copy bandwidth)
    and ``mma_tflops`` (its measured BF16 matmul rate; the quantized GEMMs' share that ran W4A8 kernels at
    ``fp8_tflops``, its measured FP8 rate), the larger of the two, and the % of it.
    """
    from qerl_cli.rollout.sampling import SamplingParams, StepSampler

    runner = engine.runner
    device = runner.device
    if device.type != "cuda":
        raise RuntimeError("profile_decode needs CUDA")
    from qerl_cli.rollout.kv_cache import bucket_for

    kv_len = bucket_for(engine.kv_buckets, context + 1, "profiled decode step (tokens cached per sequence)")
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (batch,), generator=gen).to(device)
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)
    uid = torch.arange(batch, dtype=torch.int64, device=device)
    step = torch.zeros(batch, dtype=torch.int64, device=device)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=1, stop_token_ids=[], seed=0)
    sampler = StepSampler(params, engine.noise, 0, device)
    host = [context] * batch

    def one() -> None:
        logits = runner.decode_step(tokens, positions, kv_len, host_positions=host)
        with region("sampling"):
            sampler(logits, uid, step)

    from qerl_kernels import dispatch

    with torch.no_grad():
        before = dispatch.ran()
        prof = _profiled(one, steps)
        ran = _ran_since(before, dispatch.ran())
        graph_ms = None
        graphs = getattr(engine, "_graphs", None)
        if graphs is not None:
            graph_ms = _graph_step_ms(graphs, sampler, tokens, positions, kv_len, uid, step, host, graph_reps)
    return _report(prof, runner, batch, context, kv_len, steps, trace_path, (copy_gbps, mma_tflops, fp8_tflops),
                   graph_ms, bool(graphs is not None and sampler.capturable), ran)


def _ran_since(before: dict[tuple[int, int], dict[str, int]],
               after: dict[tuple[int, int], dict[str, int]]) -> dict[tuple[int, int], dict[str, int]]:
    """The quantized linears' forwards between two reads of the dispatch's record, by shape and kernel."""
    out: dict[tuple[int, int], dict[str, int]] = {}
    for shape, kernels in after.items():
        diff = {k: c - before.get(shape, {}).get(k, 0) for k, c in kernels.items()}
        if any(v > 0 for v in diff.values()):
            out[shape] = {k: v for k, v in diff.items() if v > 0}
    return out


def _profiled(one: Any, steps: int) -> Any:
    """torch.profiler over ``steps`` calls of ``one`` (after one warm call: first-use kernel checks and
    autotuning stay out of the trace), with the regions recorded."""
    with profiling():
        one()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                one()
            torch.cuda.synchronize()
    return prof


def _graph_step_ms(graphs: Any, sampler: Any, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                   uid: torch.Tensor, step: torch.Tensor, host: list[int], reps: int) -> float:
    """Milliseconds per replay of the graphed step as the scheduler runs it (the sampler inside the graph where it
    is captured there), after one replay that captures the bucket if needed."""
    in_graph = sampler.capturable

    def replay() -> None:
        if in_graph:
            graphs.sample(tokens, positions, kv_len, sampler, uid, step, host_positions=host)
        else:
            sampler(graphs(tokens, positions, kv_len, host_positions=host), uid, step)

    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def chrome_trace(prof: Any) -> dict[str, Any]:
    """A finished profiler's chrome trace as data. The profiler writes it only to a file: a fresh private one from
    ``tempfile.mkstemp`` (never a fixed name in a shared temporary folder, which another user could have planted as
    a link to a file of ours), removed once read."""
    import os
    import tempfile

    fd, name = tempfile.mkstemp(prefix="qerl_trace_", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(name)
        return json.loads(Path(name).read_text())
    finally:
        Path(name).unlink(missing_ok=True)


def _report(prof: Any, runner: Any, batch: int, context: int, kv_len: int, steps: int, trace_path: Path | None,
            rates: tuple[float | None, float | None, float | None], graph_ms: float | None,
            sampler_in_graph: bool, ran: dict[tuple[int, int], dict[str, int]] | None = None) -> dict[str, Any]:
    """The trace by category per step, against each category's floor; ``rates``: (copy GB/s, BF16 and FP8 matmul
    TFLOP/s); ``ran``: the kernels of the quantized linears in the profiled steps (their W4A8 share runs FP8)."""
    from qerl_cli.bench.roofline import decode_step_bytes, floors, path_rate, step_floor_ms, w4a8_flop_share

    copy_gbps, mma_tflops, fp8_tflops = rates
    share = w4a8_flop_share(ran or {})
    cat_tflops = {"quantized GEMM": path_rate(mma_tflops, fp8_tflops, share)}

    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(Path(trace_path).read_text())
    else:
        trace = chrome_trace(prof)
    cats = categorize_trace(trace)
    ms = {c: v / 1000.0 / steps for c, v in cats["us"].items()}
    need = decode_step_bytes(runner, batch, context, kv_len)
    return {
        "batch": batch,
        "context": context,
        "kv_len": kv_len,
        "steps": steps,
        "ms_per_step": ms,
        "floors": (cat_floors := floors(need["bytes"], ms, copy_gbps, need["flops"], mma_tflops, cat_tflops)),
        "step_floor_ms": step_floor_ms(cat_floors),
        "attention_read_bytes": need["attention_read_bytes"],
        "step_bytes": need["total_bytes"],
        "step_flops": need["total_flops"],
        "copy_GBps": copy_gbps,
        "mma_TFLOPs": mma_tflops,
        "fp8_TFLOPs": fp8_tflops,
        "w4a8_flop_share": share,
        "sampler_in_graph": sampler_in_graph,
        "fused_lora": runner.ops.fused_lora,
        "attention_backend": runner.attention.current,
        "kernel_ms_per_step": sum(ms.values()),
        "kernels_per_step": cats["kernels"] / steps,
        "graph_step_ms": graph_ms,
        "top_kernels": [{"name": n[:120], "category": c, "ms_per_step": t / 1000.0 / steps}
                        for n, c, t in cats["top"]],
    }
