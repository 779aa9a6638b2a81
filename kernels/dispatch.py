"""Which FP4 forward kernel a `QuantLinear` runs at M rows: measured once per shape on this GPU, cached.

Backends (`set_backend(name)`, or QERL_LINEAR_BACKEND read at start-up into `options.kernel_options()`;
`qerl bench rollout --linear-backend` calls `set_backend`):
- `auto` (default): per (format, N, K, activation dtype) and M bucket, the fastest of the candidates below
  that is correct on this GPU, from a short timing pass the first time the shape runs outside graph
  capture (a few hundred ms per shape); the plan is cached on disk per GPU, library versions and kernel
  source, and logged (logger `qerl.kernels`).
- `qerl`: qerl's own kernels by the fixed M threshold (fused Triton below the `fp4_dequant_m` option,
  dequantize + cuBLAS from it) - what qerl ran before the timing pass, and the fallback while a graph is captured;
- `triton`: the fused Triton kernel at every M; `cublas`: dequantize + cuBLAS at every M;
- `cuda`: qerl's CUDA C++ kernel (`cuda_fp4`, Hopper only, built with nvcc on first use) at every M; it
  reads the same resident repack as `triton`/`cublas`, so choosing it costs no extra weight copy;
- `humming`: humming-kernels at every M (needs the package; it converts the weight into its own layout,
  a second resident copy, which `auto` accepts only where humming measured faster;
  QERL_DISPATCH_CANDIDATES=triton,cublas keeps `auto` on qerl's single copy, and so does
  `allow_extra_copies(False)`, which the training memory plan calls when the step would not fit with them).
`set_backend` updates the kernel options, so the run's manifest (which records the resolved options) names the
backend. Timing uses `triton.testing.do_bench` (median; it flushes L2 before every call, so the
weights come from HBM) on the module's own weight.

With a LoRA expand to add (`choose(module, x, lora_rank=R)`, used by `linear.forward_with_lora`), the plan is
measured per (shape, R) on what each candidate really costs: `cuda` with the expand in its epilogue against every
other backend followed by one `addmm_` of the expand; the answer names the base backend.

The routed experts of a mixture of experts (`choose_experts`, for no-grad forwards) follow the same switch: qerl's
grouped Triton kernel or humming's indexed MoE GEMM, forced by `humming`, measured by `auto` into the same plan
cache, qerl's kernel under every other backend (docs/moe.md, the decode expert backend).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from qerl_kernels._common import KernelSettingError
from qerl_kernels.options import LINEAR_BACKENDS, kernel_options, update
from torch import nn

log = logging.getLogger("qerl.kernels")

BACKENDS = LINEAR_BACKENDS
M_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_plans: dict[tuple, dict[int, str]] = {}  # shape key -> {bucket: backend}
# module -> {(dtype, rank, candidates setting, extra copies, epoch): plan}, a shortcut past `shape_key`
_module_plans: weakref.WeakKeyDictionary[nn.Module, dict[tuple, dict[int, str]]] = weakref.WeakKeyDictionary()
_epoch = 0  # bumped by `reset`, so no module keeps a forgotten plan
_extra_copies = True  # may `auto` measure (and so choose) backends that keep their own copy of a weight?
_disk: dict[str, Any] | None = None
last_timings: dict[int, dict[str, float]] = {}  # the latest measure_plan's {bucket: {candidate: us}}
# (N, K) -> {kernel: forwards}: what really ran since `reset_ran`, so a bench names the kernels behind its numbers
# rather than what the format would pick by default (calls made while a CUDA graph is captured count once)
_ran: dict[tuple[int, int], dict[str, int]] = {}


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise KernelSettingError(f"unknown linear backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def get_backend() -> str:
    return kernel_options().linear_backend


def set_backend(name: str) -> None:
    """Force one backend for every FP4 QuantLinear forward (or `auto`) for the rest of the process; the manifest
    records it with the other kernel options."""
    _check(name)
    if name == "humming":
        from qerl_kernels import humming_peer

        if not humming_peer.available():
            raise KernelSettingError("linear backend 'humming' needs the humming-kernels package (and CUDA); "
                                     "install it or choose auto|qerl|triton|cuda|cublas")
    if name == "cuda":
        from qerl_kernels import cuda_fp4

        if not cuda_fp4.available():
            raise KernelSettingError("linear backend 'cuda' needs a Hopper (sm_90) GPU and nvcc to build qerl's CUDA "
                                     "FP4 kernel (set CUDA_HOME); choose auto|qerl|triton|cublas")
    update(linear_backend=name)


def bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def _threshold_choice(m: int) -> str:
    return "cublas" if m >= kernel_options().fp4_dequant_m else "triton"


def choose(module: nn.Module, x: torch.Tensor, lora_rank: int | None = None) -> str:
    """'triton' | 'cuda' | 'cublas' | 'humming' for this forward. With `lora_rank` R the forward also adds a
    rank-R LoRA expand: 'cuda' then means the expand in its epilogue, any other answer that backend + one addmm."""
    backend = get_backend()
    m = x.shape[0]
    if backend == "cuda":
        from qerl_kernels.backends import cuda_lora_supported, cuda_supported

        ok = cuda_lora_supported(module, x, lora_rank) if lora_rank else cuda_supported(module, x)
        return "cuda" if ok else _threshold_choice(m)  # shapes it cannot run fall back
    if backend in ("triton", "cublas", "humming"):
        return backend
    if backend == "qerl":
        return _threshold_choice(m)
    plan = module_plan(module, x.dtype, lora_rank)
    if plan is None:
        return _threshold_choice(m)  # cannot time inside a graph capture; qerl's threshold meanwhile
    choice = plan.get(bucket(m))
    return choice if choice is not None else _threshold_choice(m)


def module_plan(module: nn.Module, dtype: torch.dtype, lora_rank: int | None = None) -> dict[int, str] | None:
    """`auto`'s {bucket: backend} for `module` (loaded, or measured now), or None inside a graph capture when it
    is not known yet. Remembered per module: the shape key alone (format, shape, candidate list) costs ~15 us of
    Python per call, and a training step calls this for every linear, forward and backward."""
    return _remembered(module, (dtype, lora_rank), lambda: shape_key(module, dtype, lora_rank),
                       lambda: measure_plan(module, dtype, lora_rank=lora_rank))


def _remembered(module: nn.Module, what: tuple, key: Any, measure: Any) -> dict[int, str] | None:
    """`_known_plan(key(), measure)` remembered on `module` under `what` (and the switches a plan depends on), so
    that a forward does not rebuild its shape key."""
    memo_key = (*what, kernel_options().dispatch_candidates, _extra_copies, _epoch)
    per_module = _module_plans.get(module)
    if per_module is not None and memo_key in per_module:
        return per_module[memo_key]
    plan = _known_plan(key(), measure)
    if plan is not None:
        _module_plans.setdefault(module, {})[memo_key] = plan
    return plan


def _known_plan(key: tuple, measure: Any) -> dict[int, str] | None:
    """The plan of `key`: in memory, else from the on-disk cache, else measured now by `measure()` and stored; None
    inside a graph capture when it is not known yet (timing cannot run there)."""
    plan = _plans.get(key)
    if plan is None:
        plan = _load_cached(key)
        if plan is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            plan = measure()
            _store_cached(key, plan)
        _plans[key] = plan
    return plan


def prepare(model: nn.Module | Iterable[nn.Module], dtype: torch.dtype = torch.bfloat16,
            lora_ranks: Mapping[nn.Module, int] | None = None) -> dict[tuple, dict[int, str]]:
    """Measure (or load) the plan of every FP4 QuantLinear shape in `model` (a module, or several) now: call it
    after loading and before capturing CUDA graphs, since a shape first seen inside a capture runs qerl's fixed
    threshold, and so that the timing pass is not inside a timed decode. `lora_ranks` {module: R} also measures
    the plans with a rank-R expand for the modules that will run `linear.forward_with_lora`. Logs how long
    measuring took."""
    if get_backend() != "auto" or not torch.cuda.is_available():
        return {}
    from qerl_kernels import humming_peer

    roots = [model] if isinstance(model, nn.Module) else list(model)
    done: dict[tuple, dict[int, str]] = {}
    t0, measured = time.perf_counter(), 0
    ranks = dict(lora_ranks or {})
    for m in [sub for root in roots for sub in root.modules()] + list(ranks):
        if getattr(m, "fmt", None) not in ("nvfp4", "mxfp4") or not hasattr(m, "qweight") or not m.qweight.is_cuda:
            continue
        for rank in (None, ranks[m]) if ranks.get(m) else (None,):
            key = shape_key(m, dtype, rank)
            if key in done:
                continue
            plan = _plans.get(key) or _load_cached(key)
            if plan is None:
                plan = measure_plan(m, dtype, lora_rank=rank)
                _store_cached(key, plan)
                measured += 1
            _plans[key] = done[key] = plan
        if kernel_options().w4a8 and m.fmt in humming_peer.W4A8_FORMATS and "humming" in candidates():
            done[("w4a8",) + shape_key(m, dtype)] = w4a8_plan(m, dtype)
    if measured:
        log.info("kernel plans: %d new shape(s) measured in %.1f s (%d in all; later runs load them from %s)",
                 measured, time.perf_counter() - t0, len(done), cache_path())
    return done


def humming_forward(module: nn.Module, x: torch.Tensor, act: str = "bf16") -> torch.Tensor:
    """x @ W^T (+ bias) on humming's copy of the module's weight, built at first use: W4A16, or W4A8 with
    `act="fp8"` (its own copy: `extra_copy_bytes` counts both)."""
    from qerl_kernels import humming_peer
    from qerl_kernels.backends import kernel_state

    st = kernel_state(module)
    name = "humming" if act == "bf16" else f"humming_{act}"
    layer = st.extra.get(name)
    if layer is None:
        qw = module.quantized_weight  # checkpoint order (a transient unrepacked copy)
        layer = st.extra[name] = humming_peer.build(qw.tensors, module.fmt, module.out_features, module.in_features,
                                                    bias=module.bias, dtype=x.dtype, act=act)
        log.info("humming %s layout built for %s N=%d K=%d (+%.1f MB resident)", act, module.fmt,
                 module.out_features, module.in_features, qw.nbytes() / 2**20)
    return humming_peer.forward(layer, x)


# ---- W4A8 (QERL_W4A8=1): qerl's kernel or humming's, per shape and M bucket ----------------------------------
# humming's W4A8 keeps its own copy of the weight (as its W4A16 path does) and covers humming_peer.W4A8_FORMATS;
# where it can run, the faster of the two at each bucket from QERL_W4A8_MIN_M is measured once (outside any graph
# capture) and cached with the linears' plans; qerl's kernel runs everything else.
W4A8_TOLERANCE = 6e-2  # both round activations to E4M3 per token: ~3e-2 relative against the exact product


def w4a8_backend(module: nn.Module, x: torch.Tensor) -> str:
    """'qerl' | 'humming' for one W4A8 forward of `module` on x's rows."""
    from qerl_kernels import humming_peer

    if module.fmt not in humming_peer.W4A8_FORMATS or "humming" not in candidates():
        return "qerl"
    plan = w4a8_plan(module, x.dtype)
    return "qerl" if plan is None else plan.get(bucket(x.shape[0]), "qerl")


def w4a8_plan(module: nn.Module, dtype: torch.dtype) -> dict[int, str] | None:
    """The W4A8 {bucket: 'qerl' | 'humming'} of `module`'s shape, loaded or measured now; None inside a graph
    capture before it is known (`prepare` measures it first under QERL_W4A8=1)."""
    return _remembered(module, ("w4a8", dtype), lambda: ("w4a8",) + shape_key(module, dtype),
                       lambda: measure_w4a8_plan(module, dtype))


def measure_w4a8_plan(module: nn.Module, dtype: torch.dtype, rep_ms: int = 8) -> dict[int, str]:
    """Time qerl's W4A8 kernel and humming's at each bucket from QERL_W4A8_MIN_M (CUDA-graph replays, L2
    flushed); humming wins a bucket only where it is faster and within W4A8_TOLERANCE of the exact product.
    Returns {bucket: 'qerl' | 'humming'}; humming's copy is dropped where it won nowhere."""
    from qerl_kernels import backends as ql

    dev = module.qweight.device
    gen = torch.Generator(device=dev).manual_seed(0)
    what = f"W4A8 {module.fmt} N={module.out_features} K={module.in_features}"
    plan: dict[int, str] = {}
    timings: dict[int, dict[str, float]] = {}
    with torch.no_grad():
        for b in (b for b in M_BUCKETS if b >= kernel_options().w4a8_min_m):
            x = torch.randn(b, module.in_features, device=dev, dtype=dtype, generator=gen)
            funcs = {"qerl": lambda x=x: ql.w4a8_forward(x, module),
                     "humming": lambda x=x: humming_forward(module, x, act="fp8")}
            best, timings[b] = _fastest(funcs, ql.dequant_linear(x, module).float(), W4A8_TOLERANCE, rep_ms,
                                        f"{what} M={b}")
            plan[b] = best or "qerl"
    if "humming" not in plan.values():
        ql.kernel_state(module).extra.pop("humming_fp8", None)
    _log_plan(f"W4A8 {module.fmt} N={module.out_features} K={module.in_features} {dtype}", "M", plan, timings)
    return plan


# ---- the routed experts of a mixture of experts: the same switch, plans and cache -------------------------------
# A MoE layer's experts (`qerl_cli.moe.MoeExperts`: `fmt`, `num_experts`, `projection_shape(proj)`, `tensors(proj)`
# stacked per projection) run one grouped GEMM per projection: qerl's grouped Triton kernel (`qerl_kernels.moe`,
# plan value "qerl") or humming's indexed MoE GEMM ("humming", its own converted copy of the experts). Only no-grad
# forwards (the rollout) ask: humming has no backward. The choice follows `linear_backend` as the linears do:
# `humming` forces it, `auto` measures it per shape and assignment bucket against qerl's kernel (the plan lands in
# the same in-memory and on-disk cache, keyed "experts|..."), every other backend keeps qerl's kernel.
EXPERT_BUCKETS = (8, 64, 512, 2048, 16384)  # routed assignments (tokens x top-k): decode 1, 8, 64, 256 tokens; prefill


def _expert_key(experts: nn.Module, proj: str, dtype: torch.dtype, x_div: int) -> tuple:
    e, n, k = experts.projection_shape(proj)
    return ("experts", experts.fmt, e, n, k, str(dtype).removeprefix("torch."), f"x{x_div}", ",".join(candidates()))


def _peer_state(experts: nn.Module) -> dict:
    """Humming's layers of `experts` ({proj: (weight address, layer)}) and the projections it refused; the module
    forgets them when its tensors move (`MoeExperts._apply`)."""
    st = getattr(experts, "peer_state", None)
    if st is None:
        st = {"layers": {}, "refused": set()}
        experts.peer_state = st
    return st


def choose_experts(experts: nn.Module, proj: str, x: torch.Tensor, x_div: int, assignments: int) -> str:
    """'humming' | 'qerl' for one no-grad forward of `proj` over `assignments` routed rows (x: tokens, `x_div` =
    top-k, for the first projection; the assignments themselves, `x_div` = 1, for the second)."""
    from qerl_kernels import humming_peer

    if experts.fmt not in humming_peer.FORMATS or not x.is_cuda or not humming_peer.available():
        return "qerl"
    st = _peer_state(experts)
    if proj in st["refused"]:
        return "qerl"
    capturing = torch.cuda.is_current_stream_capturing()
    backend = get_backend()
    if backend == "humming":  # a layer not built yet is not built inside a graph capture (its repack would replay)
        return "humming" if not capturing or proj in st["layers"] else "qerl"
    if backend != "auto" or "humming" not in candidates():
        return "qerl"
    plan = experts_plan(experts, proj, x.dtype, x_div)
    if plan is None:
        return "qerl"
    choice = plan.get(_expert_bucket(assignments), "qerl")
    return choice if choice != "humming" or not capturing or proj in st["layers"] else "qerl"


def _expert_bucket(m: int) -> int:
    return next((b for b in EXPERT_BUCKETS if m <= b), EXPERT_BUCKETS[-1])


def experts_peer_rows(experts: nn.Module, proj: str, x: torch.Tensor, x_div: int, assignments: int) -> int | None:
    """humming's block rows for `proj` over `assignments` rows when `choose_experts` picks it (else None), so the
    caller can lay the routing out for it in the launch that lays it out for qerl's kernels
    (`moe.routing_layouts`); the layer is the one `experts_humming_forward` then runs."""
    if choose_experts(experts, proj, x, x_div, assignments) != "humming":
        return None
    from qerl_kernels import humming_peer

    try:
        return humming_peer.indexed_tuning(experts_layer(experts, proj, x.dtype), assignments)[0]
    except Exception:  # a refusal is experts_humming_forward's to record; the layout is then made where needed
        return None


def experts_plan(experts: nn.Module, proj: str, dtype: torch.dtype, x_div: int,
                 top_k: int | None = None) -> dict[int, str] | None:
    """`auto`'s {assignment bucket: 'qerl' | 'humming'} for `proj` of `experts`, loaded or measured now (None inside
    a graph capture when not known yet), remembered per module as `module_plan` does."""
    return _remembered(experts, ("experts", proj, dtype, x_div), lambda: _expert_key(experts, proj, dtype, x_div),
                       lambda: measure_experts_plan(experts, proj, dtype, x_div, top_k))


def experts_layer(experts: nn.Module, proj: str, dtype: torch.dtype) -> Any:
    """Humming's converted copy of every expert of `proj` (built once per weight storage, then kept)."""
    from qerl_kernels import humming_peer

    st = _peer_state(experts)
    t = experts.tensors(proj)
    addr = (t["weight_packed"].data_ptr(), dtype)  # rebuilt for new storage or another activation dtype
    hit = st["layers"].get(proj)
    if hit is not None and hit[0] == addr:
        return hit[1]
    e, n, k = experts.projection_shape(proj)
    layer = humming_peer.build_experts(t, experts.fmt, e, n, k, dtype=dtype)
    st["layers"][proj] = (addr, layer)
    log.info("humming expert layout built for %s E=%d N=%d K=%d (+%.1f MB resident)", experts.fmt, e, n, k,
             e * extra_copy_bytes(experts.fmt, n, k) / 2**20)
    return layer


def experts_humming_forward(experts: nn.Module, proj: str, x: torch.Tensor, expert_ids: torch.Tensor, x_div: int,
                            layouts: dict[int, tuple[torch.Tensor, ...]] | None = None) -> torch.Tensor | None:
    """y [assignments, N] of `proj` through humming's indexed MoE GEMM, or None when humming refuses it (logged once;
    that projection then stays on qerl's kernel). `expert_ids` [assignments]; `layouts` {block rows: the routing
    at those rows} memoizes `indexed_layout` across a forward's projections."""
    from qerl_kernels import humming_peer
    from qerl_kernels.moe import indexed_layout

    m = expert_ids.numel()
    try:
        layer = experts_layer(experts, proj, x.dtype)
        block_m, tuning = humming_peer.indexed_tuning(layer, m)
        lay = None if layouts is None else layouts.get(block_m)
        if lay is None:
            lay = indexed_layout(expert_ids, experts.num_experts, block_m)
            if layouts is not None:
                layouts[block_m] = lay
        y = humming_peer.experts_forward(layer, x, *lay, top_k=x_div, tuning=tuning)
        record_shape(*experts.projection_shape(proj)[1:], "humming")
        return y
    except Exception as exc:  # a shape or config humming refuses: qerl's grouped kernel runs it instead
        if torch.cuda.is_current_stream_capturing():
            raise  # a failure inside a capture has broken it already; say so rather than fall back silently
        st = _peer_state(experts)
        st["refused"].add(proj)
        st["layers"].pop(proj, None)
        log.warning("humming refused the %s experts %s (E=%d %s): %s; qerl's grouped kernel runs it", experts.fmt,
                    proj, experts.num_experts, "x".join(map(str, experts.projection_shape(proj)[1:])),
                    repr(exc)[:300])
        return None


def _grouped_reference(experts: nn.Module, proj: str, x: torch.Tensor, expert_ids: torch.Tensor,
                       x_div: int) -> torch.Tensor:
    """qerl's grouped Triton kernel on the experts' checkpoint tensors (what runs when humming does not)."""
    from qerl_kernels.fp4 import mxfp4_shift
    from qerl_kernels.moe import align_blocks, grouped_linear

    t = experts.tensors(proj)
    rows, bexp = align_blocks(expert_ids, experts.num_experts)
    shift = mxfp4_shift(t["weight_scale"]) if experts.fmt == "mxfp4" else 0
    return grouped_linear(x, rows, bexp, kind=experts.fmt, weight=t["weight_packed"], scale=t["weight_scale"],
                          global_scale=t.get("weight_global_scale"), shift=shift, out_rows=expert_ids.numel(),
                          x_div=x_div)


def measure_experts_plan(experts: nn.Module, proj: str, dtype: torch.dtype, x_div: int, top_k: int | None = None,
                         buckets: tuple[int, ...] = EXPERT_BUCKETS, rep_ms: int = 8) -> dict[int, str]:
    """Time qerl's grouped kernel and humming at each bucket's assignment count (uniformly random top-`x_div`
    routing of bucket / x_div tokens for the first projection, the assignments for the second) from CUDA-graph
    replays with L2 flushed, as `measure_plan` times the linears; humming wins a bucket only where it is faster
    and matches qerl's kernel (relative error < 2e-2). `top_k`: the router's (default `x_div`, or 8 for the
    second projection, Qwen3-MoE's). Returns {bucket: 'qerl' | 'humming'}."""
    e, n, k = experts.projection_shape(proj)
    dev = experts.tensors(proj)["weight_packed"].device
    gen = torch.Generator(device=dev).manual_seed(0)
    top_k = top_k or (x_div if x_div > 1 else 8)
    plan: dict[int, str] = {}
    timings: dict[int, dict[str, float]] = {}
    with torch.no_grad():
        for b in buckets:
            tokens = max(1, b // top_k)
            ids = torch.rand(tokens, e, device=dev, generator=gen).topk(min(top_k, e), -1).indices.reshape(-1)
            rows_in = tokens if x_div > 1 else ids.numel()
            x = torch.randn(rows_in, k, device=dev, dtype=dtype, generator=gen)
            # each candidate lays its routing out itself, inside the timing: align_blocks, indexed_layout
            funcs = {"qerl": lambda x=x, ids=ids: _grouped_reference(experts, proj, x, ids, x_div),
                     "humming": lambda x=x, ids=ids: experts_humming_forward(experts, proj, x, ids, x_div)}
            best, timings[b] = _fastest(funcs, funcs["qerl"]().float(), 2e-2, rep_ms,
                                        f"the {experts.fmt} experts E={e} N={n} K={k} at {ids.numel()} rows")
            plan[b] = best or "qerl"
    if "humming" not in plan.values():  # drop humming's copy when it won nowhere
        _peer_state(experts)["layers"].pop(proj, None)
    _log_plan(f"{experts.fmt} experts E={e} N={n} K={k} {dtype} x_div={x_div}", "rows", plan, timings)
    return plan


def prepare_experts(blocks: Iterable[tuple[nn.Module, int]], dtype: torch.dtype = torch.bfloat16) -> None:
    """Before any graph capture: per (experts, top-k) of the rollout's sparse layers, load or measure `auto`'s plan
    of both projections, or under `linear_backend=humming` build humming's copies, so no plan is timed and no
    weight converted inside a capture or a timed decode. Same-shaped layers share one measured plan."""
    from qerl_kernels import humming_peer

    backend = get_backend()
    if backend not in ("auto", "humming") or not humming_peer.available():
        return
    if backend == "auto" and "humming" not in candidates():
        return
    for experts, top_k in blocks:
        if experts.fmt not in humming_peer.FORMATS or not experts.tensors(experts.projections[0])[
                "weight_packed"].is_cuda:
            continue
        for proj, x_div in zip(experts.projections, (top_k, 1), strict=True):
            if backend == "humming":
                try:
                    experts_layer(experts, proj, dtype)
                except Exception as exc:
                    _peer_state(experts)["refused"].add(proj)
                    log.warning("humming refused the %s experts %s: %s", experts.fmt, proj, repr(exc)[:300])
                continue
            plan = experts_plan(experts, proj, dtype, x_div, top_k)
            if plan and "humming" in plan.values():
                experts_layer(experts, proj, dtype)


# ---- what the kernels keep beside a module's own tensors (the memory plan counts it) --------------------------
def derived_bytes(fmt: str, n: int, k: int, act_elem: int = 2, bias: bool = False) -> int:
    """Bytes qerl's kernels derive from an [n, k] module's stored tensors and keep (an upper bound: it assumes
    every kernel that could run the module ran once).

    FP4 on the in-place repacked layout (K % 128 == 0): the block scales as 16-bit factors for the activation
    dtype (`fp4.kernel_scales`, 2 bytes per block of 16 (NVFP4) or 32 (MXFP4) weights, one set per storage:
    a fused q/k/v or gate/up shares it with its parts) and, with a bias, the CUDA kernel's fp32 copy of it.
    FP8: the fp32 scale row of the FP8xFP8 path. The repack itself is in place (no bytes)."""
    from qerl_kernels.backends import FP4_FORMATS

    if fmt in FP4_FORMATS:
        from qerl_kernels.fp4 import group_size

        if not kernel_options().fp4_repack or k % 128:
            return 0
        return n * (k // group_size(fmt)) * 2 + (n * 4 if bias else 0)
    return n * 4 if fmt == "fp8" else 0


def extra_copy_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of the copy a peer backend converts an [n, k] module into when `auto` chooses it (humming: FP4
    nibbles + one scale byte per block); 0 when no such backend can be chosen here."""
    from qerl_kernels import humming_peer

    if fmt not in humming_peer.FORMATS or not humming_peer.available():
        return 0
    from qerl_kernels.fp4 import group_size

    copies = 2 if kernel_options().w4a8 and fmt in humming_peer.W4A8_FORMATS else 1  # + humming's W4A8 copy
    return copies * (n * k // 2 + n * (k // group_size(fmt)))


# ---- the timing pass -----------------------------------------------------------------------------------
def shape_key(module: nn.Module, dtype: torch.dtype, lora_rank: int | None = None) -> tuple:
    key = (module.fmt, module.out_features, module.in_features, str(dtype).removeprefix("torch."),
           module.bias is not None, ",".join(candidates()))
    return key + (f"lora{lora_rank}",) if lora_rank else key


def allow_extra_copies(allowed: bool) -> None:
    """Whether `auto` may measure, and so choose, a backend that keeps its own converted copy of a weight
    (humming: +0.5 byte per weight, for every module it wins on, a fused q/k/v or gate/up included). The memory
    plan turns it off when the step would not fit with those copies (qerl_cli/train/memory_plan.py). Plans are
    keyed by the candidate list, so a plan measured with humming is not reused without it."""
    global _extra_copies
    _extra_copies = bool(allowed)


def extra_copies_allowed() -> bool:
    return _extra_copies


def candidates() -> list[str]:
    """What `auto` measures: triton, cublas, cuda (Hopper with nvcc) and (installed, unless
    `allow_extra_copies(False)`) humming, or the subset the `dispatch_candidates` option names
    (QERL_DISPATCH_CANDIDATES; e.g. `triton,cublas,cuda` keeps auto on qerl's one resident copy)."""
    from qerl_kernels import cuda_fp4, humming_peer

    found = ["triton", "cublas"] + (["cuda"] if cuda_fp4.available() else []) + \
        (["humming"] if _extra_copies and humming_peer.available() else [])
    names = kernel_options().dispatch_candidates  # checked when the options were read
    if not names:
        return found
    return [c for c in found if c in names] or ["triton"]


def measure_plan(module: nn.Module, dtype: torch.dtype, buckets: tuple[int, ...] = M_BUCKETS,
                 rep_ms: int = 8, cands: tuple[str, ...] | None = None, lora_rank: int | None = None) -> dict[int, str]:
    """Time every candidate at each bucket's M on `module`; the fastest whose output matches the exact
    dequantize + matmul (relative error < 2e-2) wins. Returns {bucket: backend}. With `lora_rank` R every
    candidate also adds a rank-R expand: `cuda` in its epilogue, the others by one addmm after the GEMM."""
    from qerl_kernels import backends as ql

    dev = module.qweight.device
    gen = torch.Generator(device=dev).manual_seed(0)
    plan: dict[int, str] = {}
    timings: dict[int, dict[str, float]] = {}
    base = {"triton": ql.fp4_fused, "cublas": ql.dequant_linear, "cuda": ql.cuda_fused,
            "humming": lambda x, mod: humming_forward(mod, x)}
    probe = torch.empty(1, module.in_features, device=dev, dtype=dtype)
    cands = list(cands or candidates())
    if "cuda" in cands and not (ql.cuda_lora_supported(module, probe, lora_rank) if lora_rank
                                else ql.cuda_supported(module, probe)):
        cands.remove("cuda")  # a shape, dtype or rank the CUDA kernel does not cover
    lora_b = None
    if lora_rank:
        lora_b = torch.randn(module.out_features, lora_rank, device=dev, dtype=dtype, generator=gen) * 0.02
    with torch.no_grad():
        for b in buckets:
            x = torch.randn(b, module.in_features, device=dev, dtype=dtype, generator=gen)
            ref = ql.dequant_linear(x, module).float()
            funcs = base
            if lora_rank:
                h = torch.randn(b, lora_rank, device=dev, dtype=dtype, generator=gen)
                ref = ref + h.float() @ lora_b.float().T
                funcs = {c: (lambda x_, mod, f=f, h=h: f(x_, mod).addmm_(h, lora_b.t())) for c, f in base.items()}
                funcs["cuda"] = lambda x_, mod, h=h: ql.cuda_fused(x_, mod, h, lora_b)
            best, timings[b] = _fastest({c: (lambda f=funcs[c], x=x: f(x, module)) for c in cands}, ref, 2e-2, rep_ms,
                                        f"{module.fmt} N={module.out_features} K={module.in_features} M={b}")
            plan[b] = best or _threshold_choice(b)
    last_timings.clear()
    last_timings.update(timings)
    if "humming" not in plan.values():  # drop humming's copy of the weight when it won nowhere
        ql.kernel_state(module).extra.pop("humming", None)
    _log_plan(f"{module.fmt} N={module.out_features} K={module.in_features} {dtype}"
              + (f" +LoRA r{lora_rank}" if lora_rank else ""), "M", plan, timings)
    return plan


def _fastest(funcs: Mapping[str, Any], ref: torch.Tensor, tol: float, rep_ms: int,
             what: str) -> tuple[str | None, dict[str, float]]:
    """The fastest of the candidates `funcs` (no-argument calls; one returning None declines) whose output is
    within `tol` relative (Frobenius) of `ref`, and each timed candidate's us. A candidate that fails or is wrong is
    logged and not chosen; None when none qualifies."""
    best, best_t, row = None, float("inf"), {}
    for c, f in funcs.items():
        try:
            y = f()
            if y is None:
                continue
            err = ((y.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            if not err < tol:
                log.warning("dispatch: %s wrong on %s (rel err %.2e); not used", c, what, err)
                continue
            t = _time_gpu(f, rep_ms)
        except Exception as exc:  # a candidate that fails here is simply not chosen
            log.warning("dispatch: %s failed on %s: %s", c, what, repr(exc)[:200])
            continue
        row[c] = t * 1e3
        if t < best_t:
            best, best_t = c, t
    return best, row


def _log_plan(what: str, rows: str, plan: dict[int, str], timings: dict[int, dict[str, float]]) -> None:
    log.info("dispatch plan %s: %s", what, ", ".join(
        f"{rows}<={b} {c} ({', '.join(f'{k} {us:.1f}us' for k, us in timings[b].items())})" for b, c in plan.items()))


def _time_gpu(fn, rep_ms: int) -> float:  # noqa: ANN001
    """Median ms of `fn`'s GPU work: replayed from a CUDA graph (no Python launch cost, as the rollout's
    graphs run it) with L2 flushed before each replay by do_bench, so the weight comes from HBM."""
    import triton

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # allocator warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode="thread_local"):  # other threads may pin memory meanwhile
            fn()
        run = g.replay
    except Exception:  # not capturable: time it eagerly (launch cost included)
        torch.cuda.synchronize()
        run = fn
    return triton.testing.do_bench(run, warmup=2, rep=rep_ms, return_mode="median")


# ---- the on-disk cache ---------------------------------------------------------------------------------
def cache_path() -> Path:
    return kernel_options().kernel_cache / f"{_fingerprint()}.json"


def _fingerprint() -> str:
    """GPU, its driver-visible name and SM count, torch/triton/humming versions and qerl's kernel sources."""
    import triton
    from qerl_kernels import humming_peer

    gpu = "cpu"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = f"{props.name}|{props.multi_processor_count}"
    src = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")) + sorted(Path(__file__).parent.glob("cuda/*.cu")):
        src.update(f.read_bytes())
    ident = f"{gpu}|{torch.__version__}|{triton.__version__}|" \
            f"{humming_peer.version()}|{src.hexdigest()}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _key_str(key: tuple) -> str:
    return "|".join(str(k) for k in key)


def _load_cached(key: tuple) -> dict[int, str] | None:
    global _disk
    if _disk is None:
        try:
            _disk = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _disk = {}
    raw = _disk.get(_key_str(key))
    if not raw:
        return None
    plan = {int(b): c for b, c in raw.items()}
    if any(c in plan.values() and c not in candidates() for c in ("humming", "cuda")):
        return None  # measured with humming installed / the CUDA kernel built; not here now
    log.info("dispatch plan %s from %s: %s", key, cache_path(), plan)
    return plan


def _store_cached(key: tuple, plan: dict[int, str]) -> None:
    global _disk
    if _disk is None:
        _disk = {}
    _disk[_key_str(key)] = {str(b): c for b, c in plan.items()}
    path = cache_path()
    try:  # atomic: a concurrent reader sees the old or the new file, never half of one
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(_disk, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        log.warning("dispatch: could not write the plan cache %s: %s", path, exc)


def plans() -> dict[str, dict[str, str]]:
    """The plans measured or loaded in this process, as {shape key: {M bucket: backend}} (for reports)."""
    return {_key_str(k): {str(b): c for b, c in p.items()} for k, p in _plans.items()}


def record_ran(module: nn.Module, kernel: str) -> None:
    """Count one forward of `module` through `kernel` (called where the kernel is launched)."""
    record_shape(int(module.out_features), int(module.in_features), kernel)


def record_shape(n: int, k: int, kernel: str) -> None:
    """Count one forward of an [N, K] projection through `kernel`, where no module is at hand (the persistent
    decode layer's GEMMs, a routed experts' projection)."""
    per = _ran.setdefault((int(n), int(k)), {})
    per[kernel] = per.get(kernel, 0) + 1


def ran() -> dict[tuple[int, int], dict[str, int]]:
    """{(N, K): {kernel: forwards}} since the last `reset_ran`."""
    return {k: dict(v) for k, v in _ran.items()}


def reset_ran() -> None:
    _ran.clear()


def reset() -> None:
    """Forget the in-memory plans (tests; after changing GPUs)."""
    global _disk, _epoch
    _plans.clear()
    _module_plans.clear()
    _epoch += 1
    _disk = None
