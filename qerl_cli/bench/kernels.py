"""`qerl bench kernels`: time qerl's quantized GEMMs against BF16 cuBLAS and installed peers on one GPU.

For each model's decoder-layer linears (qkv, o, gate_up, down) and each M, every method is timed with
`triton.testing.do_bench` (median) on a CUDA graph that calls the GEMM once per weight copy, rotating
over enough copies that the weights cannot stay in L2 (do_bench also flushes L2 before each replay);
the time per GEMM is the replay time over the number of copies. Graphs take the Python launch cost out
of the number for every method alike, as rollout engines do for decoding. The run also measures its
own ceilings (device copy bandwidth, a bf16 8192^3 matmul) and reports achieved GB/s and TFLOP/s
against them, plus the backward product dx = dy @ W at M = 2048.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qerl_cli.bench import harness
from qerl_cli.errors import QerlError
from qerl_cli.formats import FORMATS

MODELS: dict[str, dict[str, int]] = {
    "qwen2.5-7b": {"hidden": 3584, "heads": 28, "kv_heads": 4, "head_dim": 128, "intermediate": 18944},
    "qwen2.5-32b": {"hidden": 5120, "heads": 40, "kv_heads": 8, "head_dim": 128, "intermediate": 27648},
}
QERL_METHODS = ("nvfp4", "mxfp4", "int8", "fp8", "fp8xfp8")
BASELINE = "bf16"  # the method every speed-up is measured against: dense BF16 weights through cuBLAS
# the format whose backward alternatives (serial dequantize, the transposed fused kernel) are timed too
BACKWARD_VARIANTS_FOR = "nvfp4"


def layer_linears(model: str) -> list[tuple[str, int, int]]:
    """(name, N=out, K=in) of one decoder layer's GEMMs, q/k/v and gate/up fused as vLLM runs them."""
    if model not in MODELS:
        raise QerlError(f"unknown model shape {model!r}; choose from {', '.join(MODELS)}")
    c = MODELS[model]
    attn = c["heads"] * c["head_dim"]
    return [
        ("qkv", (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"], c["hidden"]),
        ("o", c["hidden"], attn),
        ("gate_up", 2 * c["intermediate"], c["hidden"]),
        ("down", c["hidden"], c["intermediate"]),
    ]


# ---- timing --------------------------------------------------------------------------------------
def time_calls(calls: Sequence[Callable[[], Any]], *, graph: bool = True, rep_ms: int = 40) -> tuple[float, str]:
    """Median ms per call over `calls` (one per weight copy); returns (ms, 'graph' | 'eager')."""
    import triton

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:  # compile, autotune, allocate workspaces outside the graph
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mode = "eager"
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):  # other threads may pin meanwhile
                for c in calls:
                    c()
            fn, per, mode = g.replay, len(calls), "graph"
        except Exception:  # a peer that cannot be captured is timed eagerly
            torch.cuda.synchronize()
            graph = False
    if not graph:
        it = itertools.cycle(calls)
        fn, per = (lambda: next(it)()), 1
    ms = triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
    return ms / per, mode


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Device copy bandwidth (bytes read + written) and bf16 8192^3 matmul rate, measured now."""
    import triton

    bw = harness.copy_bandwidth_gbps(device)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    t = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return {"copy_GBps": bw, "bf16_matmul_TFLOPs": 2 * 8192**3 / (t * 1e-3) / 1e12}


# ---- weights -------------------------------------------------------------------------------------
def l2_bytes(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20))


def weight_copies(nbytes: int, l2: int, cap: int = 48) -> int:
    """How many copies of a weight of ``nbytes`` to rotate over so that they cannot stay in an L2 of ``l2``."""
    return max(1, min(cap, math.ceil(3 * l2 / max(nbytes, 1))))


def quant_modules(w: torch.Tensor, fmt: str, copies_for: Callable[[int], int]) -> list[torch.nn.Module]:
    """``copies_for(bytes)`` QuantLinear copies of ``w`` quantized to ``fmt`` (each with its own tensors)."""
    from qerl_cli.formats import QuantizedWeight, quantize
    from qerl_cli.qlinear import QuantLinear

    qw = quantize(w, fmt, dtype=torch.bfloat16)
    mods = []
    for _ in range(copies_for(qw.nbytes())):
        t = {k: v.clone() for k, v in qw.tensors.items()}
        mods.append(QuantLinear.from_quantized(QuantizedWeight(qw.fmt, qw.shape, t, qw.dtype, qw.group_size)))
    return mods


def _method_calls(method: str, w: torch.Tensor, x: torch.Tensor, copies_for: Callable[[int], int],
                  cache: dict) -> tuple[list[Callable[[], Any]], int]:
    """Callables (one per weight copy) computing x @ W^T by `method`, and the weight bytes per copy."""
    import torch.nn.functional as F
    from qerl_kernels import linear as ql
    from qerl_kernels.w8 import fp8_scaled_matmul

    def mods(fmt: str) -> list[torch.nn.Module]:
        if fmt not in cache:
            cache[fmt] = quant_modules(w, fmt, copies_for)
        return cache[fmt]

    if method == BASELINE:
        ws = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
        return [lambda w_=w_: F.linear(x, w_) for w_ in ws], w.numel() * 2
    base = method.split("-")[0].replace("fp8xfp8", "fp8")
    if method in FORMATS and FORMATS[method].kernel is not None:  # a qerl_kernels format
        ms = mods(method)
        if FORMATS[method].act_quant_kernel:  # the weight-only kernel regardless of the FP8xFP8 policy
            return [lambda m_=m_: ql.w8_matmul(x, m_.weight, m_.weight_scale,
                                               ql.w8_config(x.shape[0], m_.out_features, m_.in_features))
                    for m_ in ms], ms[0].weight_nbytes
        return [lambda m_=m_: ql.linear_forward(x, m_) for m_ in ms], ms[0].weight_nbytes
    if method == "fp8xfp8":
        ms = mods("fp8")
        rows = [m_.weight_scale.float().reshape(1, -1).contiguous() for m_ in ms]
        return [lambda m_=m_, r_=r_: fp8_scaled_matmul(x, m_.weight, r_) for m_, r_ in zip(ms, rows, strict=True)], \
            ms[0].weight_nbytes
    if method.endswith("-fused"):
        ms = mods(base)
        return [partial(ql.fp4_fused, x, m_) for m_ in ms], ms[0].weight_nbytes
    if method.endswith("-dequant"):
        ms = mods(base)
        return [partial(ql.dequant_linear, x, m_) for m_ in ms], ms[0].weight_nbytes
    if method.endswith("-cuda"):  # qerl's CUDA C++ kernel (Hopper), on the same resident repack
        ms = mods(base)
        return [partial(ql.cuda_fused, x, m_) for m_ in ms], ms[0].weight_nbytes
    raise ValueError(f"unknown method {method!r}")


# ---- peers (each optional; absent or failing peers are reported, never fatal) ----------------------
def _peer_calls(peer: str, w: torch.Tensor, x: torch.Tensor,
                copies_for: Callable[[int], int], cache: dict | None = None) -> tuple[list[Callable[[], Any]], int]:
    n, k = w.shape
    cache = {} if cache is None else cache
    if peer == "bnb-nf4":
        import bitsandbytes as bnb

        mods = []
        for _ in range(copies_for(n * k // 2)):
            lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
            lin.weight = bnb.nn.Params4bit(w.detach().cpu(), requires_grad=False, quant_type="nf4")
            mods.append(lin.to(w.device))
        return [lambda m_=m_: m_(x) for m_ in mods], n * k // 2 + n * k // 64 * 4
    if peer == "tinygemm-int4":  # torchao's int4 weight-only CUDA kernel, called through torch.ops.aten
        group = 128
        packs = []
        for _ in range(copies_for(n * k // 2)):
            q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=w.device)
            packed = torch.ops.aten._convert_weight_to_int4pack(q, 8)
            sz = torch.randn(k // group, n, 2, dtype=torch.bfloat16, device=w.device) * 0.01
            packs.append((packed, sz))
        return [lambda p_=p_: torch.ops.aten._weight_int4pack_mm(x, p_[0], group, p_[1]) for p_ in packs], \
            n * k // 2 + n * k // group * 4
    if peer.startswith("humming-"):  # vLLM's W4A16 kernel family, on the same compressed-tensors tensors
        from qerl_kernels import humming_peer

        from qerl_cli.formats import quantize

        fmt = peer.split("-", 1)[1]
        if peer not in cache:  # built once per weight, reused for every M
            qw = quantize(w, fmt, dtype=torch.bfloat16)
            cache[peer] = ([humming_peer.build({k_: v.clone() for k_, v in qw.tensors.items()}, fmt, n, k)
                            for _ in range(copies_for(qw.nbytes()))], qw.nbytes())
        layers, nbytes = cache[peer]
        humming_peer.warm(layers[0], x)  # JIT compile (nvcc) for this M outside the timing
        return [partial(humming_peer.forward, lay, x) for lay in layers], nbytes
    if peer.startswith("gemlite-"):
        from gemlite.helper import A16W4_MXFP

        mods = []
        for _ in range(copies_for(n * k // 2)):
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=w.device)
            lin.weight.data.copy_(w)
            mods.append(A16W4_MXFP(device=str(w.device), dtype=torch.bfloat16).from_linear(lin))
        return [lambda m_=m_: m_(x) for m_ in mods], n * k // 2 + n * k // 32
    raise ValueError(f"unknown peer {peer!r}")


def available_peers() -> list[str]:
    import importlib.util

    peers = []
    if importlib.util.find_spec("bitsandbytes"):
        peers.append("bnb-nf4")
    if hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        peers.append("tinygemm-int4")
    if importlib.util.find_spec("gemlite"):
        peers.append("gemlite-mxfp4")
    from qerl_kernels import humming_peer

    if humming_peer.available():
        peers += ["humming-nvfp4", "humming-mxfp4"]
    return peers


# ---- the benchmark -------------------------------------------------------------------------------
def bench_kernels(
    shapes: Sequence[str] = ("qwen2.5-7b", "qwen2.5-32b"),
    ms: Sequence[int] = (1, 16, 64, 128, 256, 512, 2048),
    out_json: Path | None = None,
    *,
    methods: Sequence[str] = ("bf16",) + QERL_METHODS,
    peers: Sequence[str] | None = None,
    backward: bool = True,
    variants: bool = True,
    rep_ms: int = 40,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Time every method on every layer GEMM of `shapes` at every M; return (and write) the results dict.

    `peers=None` benchmarks every installed peer; `variants` adds the fused-only (every M) and
    dequantize+cuBLAS (M >= 64) NVFP4 variants and, on Hopper, the CUDA C++ kernel for NVFP4 and MXFP4
    (`nvfp4-cuda`, `mxfp4-cuda`): the candidates the dispatcher measures. The plain format
    methods run `QuantLinear`'s dispatch (QERL_LINEAR_BACKEND, default auto: measured per shape).
    """
    device = harness.device(cuda_only="qerl bench kernels")
    import triton

    props = torch.cuda.get_device_properties(device)
    l2 = l2_bytes(device)
    peers = available_peers() if peers is None else list(peers)
    res = harness.header(
        "bench/kernels", device=props.name, sms=props.multi_processor_count, l2_bytes=l2,
        torch=torch.__version__, triton=triton.__version__,
        timing="triton.testing.do_bench median over CUDA-graph replays of rotating weight copies",
        ms=list(ms), shapes=list(shapes))
    res.update({"layer": [], "backward": [], "errors": []})
    res["ceilings"] = measure_ceilings(device)
    if log:
        log(f"ceilings: {res['ceilings']}")

    copies_for = partial(weight_copies, l2=l2)
    from qerl_kernels import cuda_fp4

    cuda_variants = ["nvfp4-cuda", "mxfp4-cuda"] if cuda_fp4.available(device) else []
    for model in shapes:
        for name, n, k in layer_linears(model):
            w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
            cache: dict = {}
            for m in ms:
                meths = list(methods)
                if variants:  # the qerl kernels the dispatcher chooses between, each at every M
                    meths += ["nvfp4-fused"] + (["nvfp4-dequant"] if m >= 64 else []) + cuda_variants
                _time_methods(res, model, name, w, m, meths, peers, copies_for, cache, rep_ms)
                if out_json is not None:  # partial results survive a timeout
                    save_result(res, out_json)
                if log:
                    done = [r for r in res["results"] if r["model"] == model and r["gemm"] == name and r["M"] == m]
                    log(f"{model} {name} M={m}: " + ", ".join(f"{r['method']} {r['ms'] * 1e3:.1f}us" for r in done))
            if backward:
                fmts = tuple(f for f in kernel_formats() if f in methods)
                _bench_backward(res, model, name, w, cache, copies_for, rep_ms, fmts=fmts)
            del cache, w
            torch.cuda.empty_cache()
    summarize(res)
    from qerl_kernels import dispatch

    # what `auto` chose for the plain format methods, and what it measured for the last shape it timed
    res["dispatch"] = {"backend": dispatch.get_backend(), "candidates": dispatch.candidates(),
                       "plans": dispatch.plans()}
    if out_json is not None:
        save_result(res, out_json)
    return res


def _time_methods(res: dict[str, Any], model: str, name: str, w: torch.Tensor, m: int, meths: list[str],
                  peers: list[str], copies_for: Callable[..., int], cache: dict, rep_ms: int) -> None:
    """Every method and peer on one GEMM at one M: its time, bandwidth and TFLOP/s as a result row; a method that
    cannot be built or timed is reported (``_failed``), never fatal."""
    n, k = w.shape
    x = torch.randn(m, k, device=w.device, dtype=torch.bfloat16)
    for method, make in [(mt, _method_calls) for mt in meths] + [(p, _peer_calls) for p in peers]:
        try:
            calls, wbytes = make(method, w, x, copies_for, cache)
        except Exception as exc:
            _failed(res, model, name, m, method, exc)
            continue
        try:
            t, mode = time_calls(calls, rep_ms=rep_ms)
        except Exception as exc:  # keep going; a failing method is reported, not fatal
            _failed(res, model, name, m, method, exc)
            continue
        finally:
            del calls
        nbytes = wbytes + m * k * 2 + m * n * 2
        res["results"].append({
            "model": model, "gemm": name, "N": n, "K": k, "M": m, "method": method, "ms": t, "timing": mode,
            "GBps": nbytes / (t * 1e-3) / 1e9, "TFLOPs": 2 * m * n * k / (t * 1e-3) / 1e12,
        })


def _failed(res: dict[str, Any], model: str, gemm: str, m: int, method: str, exc: Exception) -> None:
    """A method that cannot be built or timed (a missing peer, an unsupported shape) is reported, never fatal."""
    res["errors"].append({"model": model, "gemm": gemm, "M": m, "method": method, "error": repr(exc)[:300]})


def save_result(res: dict[str, Any], out_json: Path) -> None:
    from qerl_cli.manifest import atomic_write_json, jsonable

    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(out_json), jsonable(res))


def kernel_formats() -> tuple[str, ...]:
    """The formats qerl_kernels runs (FP4 and W8 families), in registry order."""
    return tuple(name for name, f in FORMATS.items() if f.kernel is not None)


def _bench_backward(res: dict, model: str, name: str, w: torch.Tensor, cache: dict,
                    copies_for: Callable[[int], int], rep_ms: int, m: int = 2048,
                    fmts: tuple[str, ...] | None = None) -> None:
    from qerl_kernels import linear as ql
    from qerl_kernels.fp4 import fp4_matmul_t

    n, k = w.shape
    dy = torch.randn(m, n, device=w.device, dtype=torch.bfloat16)
    entries: list[tuple[str, list, int]] = []
    ws = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
    entries.append((BASELINE, [lambda w_=w_: dy @ w_ for w_ in ws], w.numel() * 2))
    for fmt in fmts if fmts is not None else kernel_formats():
        if fmt not in cache:
            cache[fmt] = quant_modules(w, fmt, copies_for)
        mods = cache[fmt]
        entries.append((fmt, [lambda m_=m_: ql.linear_backward_dx(dy, m_) for m_ in mods], mods[0].weight_nbytes))
        if fmt == BACKWARD_VARIANTS_FOR:  # one transient dequantized weight, no overlap (what the overlap saves)
            entries.append(("nvfp4-serial", [lambda m_=m_: dy @ ql.dequantized(m_, dy.dtype) for m_ in mods],
                            mods[0].weight_nbytes))
            cfg = ql.fp4_t_config(m, n, k)
            entries.append(("nvfp4-fused", [partial(fp4_matmul_t, dy, m_.weight_packed, m_.weight_scale,
                                                    m_.weight_global_scale, "nvfp4", cfg) for m_ in mods],
                            mods[0].weight_nbytes))
    for method, calls, wb in entries:
        try:
            t, mode = time_calls(calls, rep_ms=rep_ms)
        except Exception as exc:
            _failed(res, model, name, m, f"dx-{method}", exc)
            continue
        res["backward"].append({"model": model, "gemm": name, "N": n, "K": k, "M": m, "method": method, "ms": t,
                                "timing": mode, "TFLOPs": 2 * m * n * k / (t * 1e-3) / 1e12,
                                "GBps": (wb + m * (n + k) * 2) / (t * 1e-3) / 1e9})


def summarize(res: dict) -> None:
    """Fill res['layer'] / res['backward_layer']: per model, M and method, the 4 GEMMs summed, vs BF16."""
    res["layer"] = _layer_sums(res["results"])
    res["backward_layer"] = _layer_sums(res["backward"])


def _layer_sums(gemms: list[dict]) -> list[dict]:
    """Per (model, M, method) timed on all 4 GEMMs of a layer: their summed ms and the speed-up over BF16."""
    layer = []
    for key, rows in _group(gemms, ("model", "M", "method")).items():
        if len(rows) == 4:
            layer.append({"model": key[0], "M": key[1], "method": key[2], "ms": sum(r["ms"] for r in rows)})
    base = {(r["model"], r["M"]): r["ms"] for r in layer if r["method"] == BASELINE}
    for r in layer:
        b = base.get((r["model"], r["M"]))
        r["speedup"] = b / r["ms"] if b else None
    return layer


def _group(rows: Iterable[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def render_tables(res: dict) -> list[Any]:
    """rich Tables: per model, layer time (us) and speedup over BF16 for every method and M."""
    from rich.table import Table

    tables = []
    ceil = res.get("ceilings", {})
    for model in res["shapes"]:
        rows = [r for r in res["layer"] if r["model"] == model]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        t = Table(title=f"{model}: one decoder layer's 4 GEMMs, {res['device']} "
                        f"(copy {ceil.get('copy_GBps', 0):.0f} GB/s, bf16 {ceil.get('bf16_matmul_TFLOPs', 0):.0f} "
                        "TFLOP/s); us, (x BF16)")
        t.add_column("M", justify="right")
        for meth in methods:
            t.add_column(meth, justify="right")
        for m in res["ms"]:
            cells = []
            for meth in methods:
                r = next((r for r in rows if r["M"] == m and r["method"] == meth), None)
                if r is None:
                    cells.append("-")
                elif meth == BASELINE:
                    cells.append(f"{r['ms'] * 1e3:.1f}")
                else:
                    cells.append(f"{r['ms'] * 1e3:.1f} ({r['speedup']:.2f}x)")
            t.add_row(str(m), *cells)
        bl = [r for r in res.get("backward_layer", []) if r["model"] == model]
        if bl:
            t.add_row("dx@2048", *[next((f"{r['ms'] * 1e3:.1f} ({r['speedup']:.2f}x)" for r in bl
                                         if r["method"] == meth), "-") for meth in methods])
        tables.append(t)
    return tables


def tables(res: dict) -> list[Any]:
    return render_tables(res)


def short_summary(res: dict, model: str | None = None, method: str = "nvfp4") -> list[str]:
    """Plain lines: speedup of `method` over BF16 at each M (every shape run: ``model=None``); docs/benchmarks.md
    holds the speed-ups it is held to."""
    if model is None:
        return [line for shape in res["shapes"] for line in short_summary(res, shape, method)]
    out = []
    for m in res["ms"]:
        r = next((r for r in res["layer"] if r["model"] == model and r["M"] == m and r["method"] == method), None)
        if r and r["speedup"]:
            out.append(f"{model} {method} M={m}: {r['ms'] * 1e3:.1f} us, {r['speedup']:.2f}x BF16")
    r = next((r for r in res.get("backward_layer", []) if r["model"] == model and r["method"] == method), None)
    if r and r["speedup"]:
        out.append(f"{model} {method} dx M=2048: {r['ms'] * 1e3:.1f} us, {r['speedup']:.2f}x BF16")
    return out


# ---- the CUDA kernel's decode-size plans, old vs new, against humming and BF16 --------------------------
DECODE_MS = (1, 8, 16, 32, 64)
# the expand each decoder-layer GEMM adds with LoRA r32 on all seven linears (q/k/v and gate/up fused: the
# block-diagonal B of the group has the parts' ranks side by side)
DECODE_LORA_RANKS = {"qkv": 96, "o": 32, "gate_up": 64, "down": 32}


def decode_plan_variants(m: int, n: int, k: int, sms: int) -> list[tuple[str, Any]]:
    """(name, cuda_fp4.Plan) timed per GEMM and M: the legacy rule, the stream rule, and the variants the rule
    chose between (ring depth, K segments, whole portions vs unit ranges; the wide kernel's warp shapes)."""
    from qerl_kernels import cuda_fp4 as cf

    out = [("legacy", cf.legacy_plan(m, n, k, sms))]
    rule = cf.decode_plan(m, n, k, sms) if m <= cf.DECODE_MAX_M else cf.wide_plan(m, n, k, sms)
    out.append(("stream", rule))
    alts: list[Any] = []
    if rule.kind == "decode":
        for st in (4, 8):
            try:
                alts.append(cf.decode_plan(m, n, k, sms, stages=st))
            except ValueError:
                pass
        alts.append(cf.decode_plan(m, n, k, sms, nseg=1))
        alts.append(cf.decode_plan(m, n, k, sms, pmode=not rule.pmode))
        if m <= 2:
            alts.append(cf.decode_plan(m, n, k, sms, perm=True, stages=4))
    else:
        for wn, rbw in ((8, 1), (4, 2)):
            alts.append(cf.wide_plan(m, n, k, sms, wn=wn, rbw=rbw))
        alts.append(cf.wide_plan(m, n, k, sms, ctas=cf.ctas_per_sm(rule) * sms))
        alts.append(cf.wide_plan(m, n, k, sms, ctas=sms))
        alts.append(cf.wide_plan(m, n, k, sms, pmode=not rule.pmode))
    seen = {rule.key()}
    for p in alts:
        if p.key() not in seen:
            seen.add(p.key())
            out.append((p.key(), p))
    return out


def sweep_decode(shapes: Sequence[str] = ("qwen2.5-7b", "qwen2.5-32b"), ms: Sequence[int] = DECODE_MS,
                 out_json: Path | None = None, *, fmt: str = "nvfp4", peers: bool = True, rep_ms: int = 15,
                 log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Time qerl's CUDA FP4 kernel's plans on the decode GEMMs of `shapes` at each M: the legacy plan, the stream
    rule (without and with programmatic dependent launch between the graph's GEMMs) and its variants, the rule
    with the LoRA expand in its epilogue against the rule + one addmm of the expand, the Triton kernel, humming
    (when it imports; + addmm for the LoRA row) and BF16 cuBLAS. Rows: ms per GEMM, GB/s of weight + scale bytes
    and % of the measured copy bandwidth. Same timing as `bench_kernels` (graphs over rotating weight copies)."""
    from qerl_kernels import humming_peer
    from qerl_kernels import linear as ql

    device = harness.device(cuda_only="sweep_decode")
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    l2 = l2_bytes(device)
    res = harness.header("bench/decode_plans", device=props.name, sms=sms, l2_bytes=l2, torch=torch.__version__,
                         fmt=fmt, ms=list(ms), shapes=list(shapes),
                         timing="triton.testing.do_bench median over CUDA-graph replays of rotating weight copies")
    res.update({"errors": [], "copy_GBps": harness.copy_bandwidth_gbps(device)})
    copy = res["copy_GBps"] or float("nan")
    with_humming = peers and humming_peer.available()
    copies_for = partial(weight_copies, l2=l2)
    if log:
        log(f"decode sweep on {props.name} ({sms} SMs), copy {copy:.0f} GB/s, humming {with_humming}")

    def record(model: str, gemm: str, n: int, k: int, m: int, method: str, calls: list, wbytes: int,
               plan: Any = None) -> None:
        try:
            t, mode = time_calls(calls, rep_ms=rep_ms)
        except Exception as exc:
            _failed(res, model, gemm, m, method, exc)
            return
        gbps = wbytes / (t * 1e-3) / 1e9
        res["results"].append({"model": model, "gemm": gemm, "N": n, "K": k, "M": m, "method": method, "ms": t,
                               "timing": mode, "GBps": gbps, "pct_copy": 100 * gbps / copy,
                               "plan": None if plan is None else plan.key()})

    for model in shapes:
        for gemm, n, k in layer_linears(model):
            w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
            mods = quant_modules(w, fmt, copies_for)
            st = [ql.kernel_state(m_) for m_ in mods]
            wbytes = mods[0].weight_nbytes
            r = DECODE_LORA_RANKS.get(gemm, 32)
            lb = (torch.randn(n, r, device=device) * 0.02).to(torch.bfloat16)
            dense = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
            hum = None
            if with_humming:
                try:
                    qw = quantize_for_peer(w, fmt)
                    hum = [humming_peer.build({a: b.clone() for a, b in qw.tensors.items()}, fmt, n, k)
                           for _ in range(copies_for(qw.nbytes()))]
                except Exception as exc:
                    _failed(res, model, gemm, 0, "humming", exc)
            for m in ms:
                _sweep_one(res, record, model, gemm, n, k, m, fmt, sms, mods, st, wbytes, dense, hum, r, lb, device)
                if out_json is not None:
                    save_result(res, out_json)
                if log:
                    done = [x_ for x_ in res["results"] if x_["model"] == model and x_["gemm"] == gemm
                            and x_["M"] == m]
                    log(f"{model} {gemm} M={m}: " + ", ".join(f"{x_['method']} {x_['ms'] * 1e3:.1f}us" for x_ in done))
            del mods, st, dense, hum, w
            torch.cuda.empty_cache()
    if out_json is not None:
        save_result(res, out_json)
    return res


def _sweep_one(res: dict, record: Callable, model: str, gemm: str, n: int, k: int, m: int, fmt: str, sms: int,
               mods: list, st: list, wbytes: int, dense: list, hum: list | None, r: int, lb: torch.Tensor,
               device: torch.device) -> None:
    """One (GEMM, M) cell of `sweep_decode`: every method timed on the same activations."""
    import torch.nn.functional as F
    from qerl_kernels import cuda_fp4, humming_peer
    from qerl_kernels import linear as ql

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    h = torch.randn(m, r, device=device, dtype=torch.bfloat16)

    def gemm_calls(plan: Any, pdl: bool, lora: bool = False) -> list:
        return [partial(cuda_fp4.fp4_gemm, x, s_.repacked, m_.weight_scale, getattr(m_, "weight_global_scale", None),
                        fmt, tiled=s_.tiled, shift=s_.shift, plan=plan, pdl=pdl, lora_h=h if lora else None,
                        lora_b=lb if lora else None) for m_, s_ in zip(mods, st, strict=True)]

    def then_addmm(calls: list) -> list:
        return [partial(_addmm_after, c, h, lb) for c in calls]

    record(model, gemm, n, k, m, "bf16", [partial(F.linear, x, w_) for w_ in dense], n * k * 2)
    record(model, gemm, n, k, m, "triton", [partial(ql.fp4_fused, x, m_) for m_ in mods], wbytes)
    rule = None
    for name, plan in decode_plan_variants(m, n, k, sms):
        rule = plan if name == "stream" else rule
        record(model, gemm, n, k, m, f"cuda-{name}", gemm_calls(plan, False), wbytes, plan)
    if rule is not None:
        record(model, gemm, n, k, m, "cuda-stream-pdl", gemm_calls(rule, True), wbytes, rule)
        record(model, gemm, n, k, m, f"cuda-stream+lora{r}", gemm_calls(rule, False, True), wbytes, rule)
        record(model, gemm, n, k, m, f"cuda-stream+addmm{r}", then_addmm(gemm_calls(rule, False)), wbytes, rule)
    if hum:
        try:
            humming_peer.warm(hum[0], x)
            calls = [partial(humming_peer.forward, l_, x) for l_ in hum]
            record(model, gemm, n, k, m, "humming", calls, wbytes)
            record(model, gemm, n, k, m, f"humming+addmm{r}", then_addmm(calls), wbytes)
        except Exception as exc:
            _failed(res, model, gemm, m, "humming", exc)


def _addmm_after(call: Callable[[], torch.Tensor], h: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    return call().addmm_(h, lb.t())


def quantize_for_peer(w: torch.Tensor, fmt: str) -> Any:
    from qerl_cli.formats import quantize

    return quantize(w, fmt, dtype=torch.bfloat16)


def decode_table(res: dict) -> list[str]:
    """Plain lines, per model and M: the layer's four GEMMs summed (us) for BF16, the legacy plan, the stream rule
    (and with PDL), the best stream variant, humming; the rule's GB/s and % of copy bandwidth; the LoRA rows."""
    rows = res["results"]
    lines = [f"decode plans, {res.get('device')} ({res.get('sms')} SMs), copy {res.get('copy_GBps') or 0:.0f} GB/s; "
             "us per layer (4 GEMMs), rule GB/s (% copy)"]
    for model in res["shapes"]:
        lines.append(f"{model}:  M |   bf16 | legacy | stream | +pdl   | best variant    | humming | "
                     "GB/s (%copy) | +lora fused / +addmm | humming+addmm")
        for m in res["ms"]:
            def layer(method: str, rows_=rows, m=m, model=model) -> float | None:
                got = [r for r in rows_ if r["model"] == model and r["M"] == m and r["method"] == method]
                return sum(r["ms"] for r in got) * 1e3 if len(got) == 4 else None

            def fmt_us(v: float | None) -> str:
                return f"{v:6.1f}" if v is not None else "     -"

            cand = {r["method"] for r in rows if r["model"] == model and r["M"] == m and r["method"].startswith(
                "cuda-") and "+" not in r["method"] and r["method"] != "cuda-stream-pdl"}
            per_gemm_best = 0.0
            for gemm, _, _ in layer_linears(model):
                got = [r["ms"] for r in rows if r["model"] == model and r["M"] == m and r["gemm"] == gemm
                       and r["method"] in cand]
                per_gemm_best += min(got) * 1e3 if got else float("nan")
            stream = [r for r in rows if r["model"] == model and r["M"] == m and r["method"] == "cuda-stream"]
            gb = sum(r["GBps"] * r["ms"] for r in stream) / max(1e-12, sum(r["ms"] for r in stream))
            pct = 100 * gb / (res.get("copy_GBps") or float("nan"))
            lo = [r for r in rows if r["model"] == model and r["M"] == m and "+lora" in r["method"]]
            ad = [r for r in rows if r["model"] == model and r["M"] == m
                  and r["method"].startswith("cuda-stream+addmm")]
            ha = [r for r in rows if r["model"] == model and r["M"] == m and r["method"].startswith("humming+addmm")]
            fused = sum(r["ms"] for r in lo) * 1e3 if len(lo) == 4 else None
            sep = sum(r["ms"] for r in ad) * 1e3 if len(ad) == 4 else None
            hsep = sum(r["ms"] for r in ha) * 1e3 if len(ha) == 4 else None
            lines.append(f"{'':>12}{m:3d} | {fmt_us(layer('bf16'))} | {fmt_us(layer('cuda-legacy'))} | "
                         f"{fmt_us(layer('cuda-stream'))} | {fmt_us(layer('cuda-stream-pdl'))} | "
                         f"{per_gemm_best:15.1f} | {fmt_us(layer('humming'))}  | {gb:5.0f} ({pct:4.1f}%) | "
                         f"{fmt_us(fused)} / {fmt_us(sep)}   | {fmt_us(hsep)}")
    return lines
