"""Where the training phases of one RL step spend GPU time, kernel by kernel.

One extra step runs under torch.profiler from the end of the rollout on (the rollout's decode has its own
profile, rollout/profile.py). A kernel belongs to the phase whose wall-clock span contains the host call that
launched it, matched through the trace's correlation ids; the phases are sequential and the trainer
synchronises the device at each boundary, so the spans do not overlap. Backward kernels are launched from
autograd's own thread, which is why the match is by time alone, not by thread.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from qerl_cli.bench.decode_profile import chrome_trace, classify_name

PROFILED_FROM = "recompute"  # the first phase after the rollout (fwd_bwd where the recompute is skipped)
TOP_KERNELS = 15


def _launch_times(events: list[dict[str, Any]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                out[int(corr)] = float(e["ts"])
    return out


def kernels_by_phase(trace: dict[str, Any], spans: list[tuple[str, float, float]]) -> dict[str, Any]:
    """GPU time per phase (microseconds), by category and by kernel name, from a chrome trace and the phases'
    host time spans (in the trace's clock)."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    launches = _launch_times(events)
    out: dict[str, Any] = {}
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        corr = (e.get("args") or {}).get("correlation")
        ts = launches.get(int(corr)) if corr is not None else None
        phase = next((name for name, start, end in spans if ts is not None and start <= ts < end), "unmatched")
        name, dur = str(e.get("name", "")), float(e.get("dur", 0.0))
        p = out.setdefault(phase, {"kernel_us": 0.0, "kernels": 0, "by_category": {}, "by_name": {}})
        category = classify_name(name, cat)
        p["kernel_us"] += dur
        p["kernels"] += 1
        p["by_category"][category] = p["by_category"].get(category, 0.0) + dur
        entry = p["by_name"].setdefault(name, [category, 0, 0.0])
        entry[1] += 1
        entry[2] += dur
    for p in out.values():
        top = sorted(p.pop("by_name").items(), key=lambda kv: -kv[1][2])[:TOP_KERNELS]
        p["top"] = [{"name": n[:140], "category": c, "calls": k, "us": us} for n, (c, k, us) in top]
    return out


def profile_train_phases(trainer: Any) -> dict[str, Any]:
    """Run one more ``train_step`` with the profiler on from :data:`PROFILED_FROM` (CUDA); per phase its wall
    seconds, summed kernel time, time by category and top kernels."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = torch.profiler.profile(activities=acts)
    marks: list[tuple[str, float]] = []  # (phase, perf_counter at its start)
    previous = trainer.phases.on_phase

    def on_phase(name: str) -> None:
        if previous is not None:
            previous(name)
        if not marks and name in (PROFILED_FROM, "fwd_bwd"):
            torch.cuda.synchronize(trainer.device)
            prof.start()
            marks.append(("_anchor", time.perf_counter()))
        if marks:
            marks.append((name, time.perf_counter()))

    trainer.phases.on_phase = on_phase
    try:
        metrics = trainer.train_step()
        torch.cuda.synchronize(trainer.device)
        end = time.perf_counter()
    finally:
        trainer.phases.on_phase = previous
    if not marks:
        return {"note": "no training phase ran under the profiler"}
    prof.stop()
    return {"phases": _summarise(chrome_trace(prof), marks, end, metrics)}


def _summarise(trace: dict[str, Any], marks: list[tuple[str, float]], end: float,
               metrics: dict[str, Any]) -> dict[str, Any]:
    """Phase spans in the trace's clock (anchored at the profiler's first host event), then the kernels in each."""
    host = [float(e["ts"]) for e in trace.get("traceEvents", [])
            if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime")]
    origin_us = min(host) if host else 0.0
    anchor = marks[0][1]
    bounds = marks[1:] + [("_end", end)]
    spans = [(name, origin_us + (t0 - anchor) * 1e6, origin_us + (t1 - anchor) * 1e6)
             for (name, t0), (_, t1) in zip(bounds, bounds[1:], strict=False)]
    per_phase = kernels_by_phase(trace, spans)
    for name, t0, t1 in spans:
        p = per_phase.setdefault(name, {"kernel_us": 0.0, "kernels": 0, "by_category": {}, "top": []})
        p["wall_s"] = (t1 - t0) / 1e6
        p["gpu_busy_pct"] = 100.0 * p["kernel_us"] / max(t1 - t0, 1e-9)
        p["metric_s"] = metrics.get(f"timing/{name}_s")
    return per_phase
