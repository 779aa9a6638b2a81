"""`qerl bench rollout`: tokens/s of the builtin rollout engine per weight format and batch size.

For each format a model is built (``shape``: a randomly initialised model of a real architecture, made
on the device layer by layer, see :mod:`qerl_cli.bench.shapes`; ``run_dir``: the run's quantized
model), LoRA rank ``lora_rank`` is attached with nonzero B so the adapters really compute, and for each
batch size ``batch`` random prompts of ``prompt_len`` tokens are generated to ``new_tokens`` tokens
(one sample per prompt, temperature 1, stop tokens ignored: ``eos_mode="fixed"``). Each cell is run
once untimed at the same batch (compiles kernels, captures the decode graphs of every KV-length
bucket), then timed once.

Reported per cell: prefill tok/s (prompt tokens / prefill time), decode tok/s (tokens sampled by
decode steps / decode time), end-to-end tok/s (all generated tokens / wall time of ``generate``),
time to first token, peak GPU memory, and on CUDA the decode roofline: one decode step must read the
weights (quantized linears as stored, bf16 embeddings/lm_head/norms/biases, fp32 LoRA factors) and
each sequence's KV cache up to its context; at the mean context of the run
(``prompt_len + new_tokens / 2``) that is ``weights + batch * kv_bytes_per_token * mean_ctx`` bytes per
step, over the device copy bandwidth measured at the start of the same run (bytes read + written, as
`qerl bench kernels` measures it). % of roofline = decode tok/s over ``batch / step time``.

``eos_mode="eos"`` ends samples at EOS instead (realistic lengths). A random model never picks one
particular token, so for ``shape`` models the stop set is ``vocab / mean_len`` token ids, which gives
geometric lengths with mean ~``new_tokens / 2`` on the near-uniform random model (capped at
``new_tokens``); with ``run_dir`` the model's own EOS is used. ``"both"`` runs each cell both ways.

Realistic workloads (``prompts``/``num_generations``): ``prompts`` random prompts with ``num_generations``
samples each run through ``batch`` KV-cache slots, so with more sequences than slots the engine's queue
refills every slot a finished sequence frees (combine with ``eos_mode="eos"`` for RL-like lengths).

``episodes=TURNS`` measures multi-turn episodes instead (qerl_cli/bench/episodes.py): each cell runs ``TURNS``
turns of ``new_tokens / TURNS`` tokens with a synthetic tool of ``tool_latency_ms`` between them, against
single-turn decoding of the same tokens.

``lora_modes=("on", "off")`` runs every cell with the adapters active and again with them disabled
(peft's ``disable_adapter``), the measured cost of LoRA. ``profile=True`` adds, per cell, the GPU time of
one decode step by category (quantized GEMM, dense GEMM, LoRA, attention, norm/RoPE/activation,
sampling, copies, other) from torch.profiler (:mod:`qerl_cli.bench.decode_profile`) and the CUDA-graph step
time at the run's mean context.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_cli.bench import harness
from qerl_cli.bench.flops import fp8_matmul_ceiling_tflops, matmul_ceiling_tflops
from qerl_cli.bench.harness import COUNT, figure, num, save_figure
from qerl_cli.errors import QerlError
from qerl_cli.formats import FORMATS, get_format
from qerl_cli.rollout.kv_cache import kv_elem

DEFAULT_FORMATS = ("bf16", "nvfp4", "mxfp4", "int8", "fp8", "nf4")
DEFAULT_BATCHES = (1, 8, 64, 256)
EOS_MODES = ("fixed", "eos", "both")
SCHEMA = 1
LORA_MODES = ("on", "off")


# ---- inputs ----------------------------------------------------------------------------------------
def _check_workload(prompts: int | None, num_generations: int, lora_modes: Iterable[str]) -> list[str]:
    if prompts is not None and prompts < 1:
        raise QerlError(f"--prompts must be >= 1, got {prompts}")
    if num_generations < 1:
        raise QerlError(f"--num-generations must be >= 1, got {num_generations}")
    if num_generations > 1 and prompts is None:
        raise QerlError("--num-generations needs --prompts (without it each batch is one sample per prompt)")
    modes = list(dict.fromkeys(lora_modes))
    bad = [m for m in modes if m not in LORA_MODES]
    if bad or not modes:
        raise QerlError(f"LoRA modes must be among {', '.join(LORA_MODES)}, got {', '.join(bad) or '(none)'}")
    return modes


def set_linear_backend(name: str | None, device: torch.device) -> str | None:
    """Force qerl_kernels' linear backend (auto|qerl|triton|cuda|humming|cublas) for this process."""
    if name is None:
        return None
    if device.type != "cuda" and name != "auto":
        raise QerlError(f"--linear-backend {name}: the backends are CUDA kernels and this bench runs on "
                        f"{device.type}; leave the option out here or run on a GPU")
    try:
        from qerl_kernels import linear as klinear
    except ImportError as exc:
        raise QerlError(f"--linear-backend needs the qerl_kernels package ({exc})") from None
    if not hasattr(klinear, "set_backend"):
        raise QerlError("--linear-backend: this qerl_kernels has no set_backend(); use a build that has the "
                        "linear-backend override, or leave the option out")
    try:
        klinear.set_backend(name)
    except (ValueError, KeyError, QerlError) as exc:
        raise QerlError(f"--linear-backend {name!r}: {exc}") from None
    return name


def _resolved_options() -> dict[str, object]:
    """The options this bench ran with (fast paths, fusion, kernels: docs/options.md), as resolved at start-up and
    by --linear-backend; the manifest also keeps the raw QERL_* environment."""
    from qerl_cli.options import options

    return options().as_record()


def _check_args(shape: str | None, run_dir: Path | None, formats: Iterable[str], batches: Iterable[int],
                prompt_len: int, new_tokens: int, lora_rank: int, eos_mode: str) -> tuple[list[str], list[int]]:
    from qerl_cli.formats import FORMATS

    if (shape is None) == (run_dir is None):
        raise QerlError("give exactly one of --shape (random model of an architecture) or --run (the run's model)")
    if eos_mode not in EOS_MODES:
        raise QerlError(f"eos_mode must be one of {', '.join(EOS_MODES)}, not {eos_mode!r}")
    fmts = list(dict.fromkeys(formats))
    bad = [f for f in fmts if f not in FORMATS]
    if bad or (not fmts and run_dir is None):  # with a run, its own format is used
        raise QerlError(f"unknown format(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(FORMATS)}")
    bs = sorted(dict.fromkeys(int(b) for b in batches))
    if not bs or bs[0] < 1:
        raise QerlError(f"batch sizes must be positive integers, got {list(batches)}")
    if prompt_len < 1 or new_tokens < 1:
        raise QerlError(f"prompt_len and new_tokens must be >= 1, got {prompt_len} and {new_tokens}")
    if lora_rank < 0:
        raise QerlError(f"lora_rank must be >= 0 (0: no LoRA), got {lora_rank}")
    return fmts, bs


# ---- model ---------------------------------------------------------------------------------------
def attach_bench_lora(model: nn.Module, rank: int, seed: int, targets: list[str] | None = None) -> nn.Module:
    """LoRA on every decoder linear (or ``targets``) with B ~ N(0, 1e-3): nonzero, so both adapter GEMMs really
    run (a mixture of experts: on every expert's projections too)."""
    if rank == 0:
        return model
    from qerl_cli.lora import attach_lora, make_lora_config

    peft_model = attach_lora(model, make_lora_config(rank=rank, targets=targets), seed=seed)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    return peft_model


def model_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes one decode step reads: base weights (quantized as stored, bf16 rest, no embedding table:
    a step gathers B rows of it) and LoRA factors; plus what is resident now (parameters, buffers and any
    repacked FP4 copies the kernels have made: those appear at the first CUDA forward, so a model
    measured right after it is built shows none of them)."""
    from qerl_cli.moe import MoeExperts
    from qerl_cli.qlinear import QuantLinear

    weights = lora = lora_numel = experts = expert_lora_numel = 0
    seen: set[int] = set()
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear | MoeExperts):
            weights += m.weight_nbytes if isinstance(m, QuantLinear) else 0
            experts += m.weight_nbytes if isinstance(m, MoeExperts) else 0
            if getattr(m, "bias", None) is not None:
                weights += m.bias.numel() * m.bias.element_size()
            continue
        if isinstance(m, nn.Embedding):
            continue
        for p in m.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if "lora_" in name:
                lora += p.numel() * p.element_size()
                lora_numel += p.numel()
                expert_lora_numel += p.numel() if ".experts." in f".{name}." else 0
            else:
                weights += p.numel() * p.element_size()
    resident = 0
    storages = set()
    for t in list(model.parameters()) + list(model.buffers()):
        resident += t.numel() * t.element_size()
        storages.add(t.untyped_storage().data_ptr())
    for m in model.modules():
        st = getattr(m, "kernel_layout_state", None)
        rep = getattr(st, "repacked", None)
        # the FP4 repack is made in place (qerl_kernels): count it only if it is a separate copy
        if isinstance(rep, torch.Tensor) and rep.untyped_storage().data_ptr() not in storages:
            resident += rep.numel() * rep.element_size()
    # the decode step reads the adapters from model-dtype (bf16) shadows, not the fp32 masters; of a mixture of experts
    # the experts (and their adapters' copies) are apart: a step reads those of the experts its tokens are routed to
    return {"weights": weights, "lora": lora, "lora_step": (lora_numel - expert_lora_numel) * 2, "resident": resident,
            "experts": experts, "expert_lora_step": expert_lora_numel * 2}


def active_expert_share(config: Any, tokens: int) -> float:
    """The share of a layer's experts one decode step over ``tokens`` sequences reads, routing uniform at random
    (``moe.MoeDims.active_experts``); 1.0 for a dense model."""
    from qerl_cli.moe import MoeDims

    dims = MoeDims.from_config(config)
    return 1.0 if dims is None else dims.active_experts(tokens) / dims.experts


def _estimate_gib(spec: Any, fmt: str, batch: int, max_len: int, lora_rank: int) -> float:
    """Rough resident memory of a shape model + KV cache (for skipping what cannot fit, before trying)."""
    f = get_format(fmt)  # stored bytes + what the kernels keep resident besides them
    per_w = f.bytes_per_weight + f.resident_extra_bytes
    emb = spec.vocab * spec.hidden * 2 * (1 if spec.tie_embeddings else 2)
    lora = spec.layers * sum(c * (n + k) for _, n, k, c in spec.linear_counts()) * lora_rank * 4
    kv = batch * max_len * spec.kv_bytes_per_token(kv_elem(2))
    return (spec.linear_params() * per_w + emb + lora + kv) / 2**30


# ---- measurement ----------------------------------------------------------------------------------
def random_prompts(batch: int, prompt_len: int, vocab: int, avoid: set[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        row = []
        while len(row) < prompt_len:
            t = rng.randrange(vocab)
            if t not in avoid:
                row.append(t)
        out.append(row)
    return out


def bench_stop_ids(mode: str, vocab: int, new_tokens: int, model_eos: list[int] | None,
                   from_shape: bool) -> list[int] | None:
    """Stop ids for a cell: [] for fixed length; for random models a vocab/mean_len-sized stop set."""
    if mode == "fixed":
        return []
    if not from_shape:
        return model_eos  # None: the model's own EOS
    mean_len = max(1.0, new_tokens / 2)
    k = max(1, min(vocab - 1, round(vocab / mean_len)))
    return list(range(vocab - k, vocab))


def precapture_graphs(engine: Any, batch: int, shrinking: bool = False, params: Any = None) -> None:
    """Capture the decode graphs of every KV-length bucket now, so no capture lands in the timed run;
    ``shrinking`` (EOS-ended or queued workloads, whose batch drains at the end): every smaller batch
    bucket too. ``params``: the timed run's ``SamplingParams``; where the engine captures its sampler
    in the decode graph, those graphs are the ones captured.

    Uses the engine's graph decoder (built by the warm-up generate); any failure just leaves capture to
    the timed run (a few extra eager steps, about 1%)."""
    graphs = getattr(engine, "_graphs", None)
    if graphs is None or not hasattr(graphs, "ensure_captured"):
        return
    sampler = None
    if params is not None:
        from qerl_cli.rollout.sampling import StepSampler

        sampler = StepSampler(params, engine.noise, 0, engine.device)
        sampler = sampler if sampler.capturable else None
    top = graphs.bucket(min(batch, engine.num_slots))  # fewer slots may fit than the cell asks for
    sizes = [b for b in graphs.buckets if b <= top] if shrinking else [top]
    with torch.no_grad():
        for bs in sizes:
            for kv in engine.kv_buckets:
                graphs.ensure_captured(bs, kv, sampler)
    torch.cuda.synchronize()


def _adapters(model: nn.Module, lora: str) -> Any:
    """Context: the adapters as the cell wants them ("off": peft's disable_adapter; else unchanged)."""
    import contextlib

    if lora == "off" and hasattr(model, "disable_adapter"):
        return model.disable_adapter()
    return contextlib.nullcontext()


def _run_cell(model: nn.Module, tokenizer: Any, *, batch: int, prompt_len: int, new_tokens: int, vocab: int,
              stop_ids: list[int] | None, device: torch.device, gpu_memory_utilization: float, seed: int,
              warmup: bool, prompts_n: int | None = None, generations: int = 1, lora: str = "on",
              profile: bool = False,
              rates: tuple[float | None, float | None, float | None] = (None, None, None)) -> dict[str, Any]:
    from qerl_cli.rollout import BuiltinEngine, SamplingParams

    engine = BuiltinEngine(model, tokenizer, max_batch_slots=batch, max_model_len=prompt_len + new_tokens,
                           gpu_memory_utilization=gpu_memory_utilization, dtype=torch.bfloat16)
    avoid = set(stop_ids or [])
    prompts = random_prompts(prompts_n or batch, prompt_len, vocab, avoid, seed)
    prof = None
    try:
        with _adapters(model, lora):
            params = SamplingParams(n=generations, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=new_tokens,
                                    stop_token_ids=stop_ids, seed=seed)
            if warmup:
                warm = SamplingParams(n=1, temperature=1.0, max_tokens=min(new_tokens, 16), stop_token_ids=[],
                                      seed=seed + 1)
                engine.generate(prompts[:batch], warm)
                if device.type == "cuda" and engine.use_graphs:
                    precapture_graphs(engine, batch, shrinking=bool(stop_ids) or len(prompts) * generations > batch,
                                      params=params)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            res = engine.generate(prompts, params)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            peak_reserved = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None
            slots = engine.num_slots
            kv_gib = engine.runner.cache.shape.bytes_per_slot() * slots / 2**30
            kv_room = engine.kv_room.describe() if engine.kv_room is not None else None
            if profile and device.type == "cuda":
                from qerl_cli.bench.decode_profile import profile_decode

                prof = profile_decode(engine, min(batch, slots), prompt_len + new_tokens // 2, copy_gbps=rates[0],
                                      mma_tflops=rates[1], fp8_tflops=rates[2])
    finally:
        engine.release()
    t, st = res.timings, res.stats
    n_seq = len(res.samples)
    tokens = int(t["tokens"])
    decode_tokens = tokens - n_seq  # each sample's first token comes from the prefill logits
    lengths = [len(s.token_ids) for s in res.samples]
    return {
        "prefill_tok_s": st["prefill_tokens"] / t["prefill_s"] if t["prefill_s"] > 0 else None,
        "decode_tok_s": decode_tokens / t["decode_s"] if t["decode_s"] > 0 else None,
        "e2e_tok_s": t["tokens_per_s"],
        "ttft_s": t["ttft"],
        "prefill_s": t["prefill_s"],
        "decode_s": t["decode_s"],
        "total_s": t["total_s"],
        "tokens": tokens,
        "mean_new_tokens": sum(lengths) / max(1, len(lengths)),
        "stopped": sum(s.finish_reason == "stop" for s in res.samples),
        "decode_steps": st["decode_steps"],
        "sequences": n_seq,
        "decode_ms_per_step": 1000.0 * t["decode_s"] / st["decode_steps"] if st["decode_steps"] else None,
        "num_slots": slots,
        "kv_room": kv_room,
        "profile": prof,
        "kv_cache_gib": kv_gib,
        "peak_mem_gib": peak,
        "peak_reserved_gib": peak_reserved,
    }


def _roofline(cell: dict[str, Any], *, batch: int, bytes_: dict[str, int], kv_per_token: int, prompt_len: int,
              bw_gbps: float | None, expert_share: float = 1.0) -> None:
    """Fill roofline fields for a fixed-length cell (None off CUDA or for EOS-terminated cells). ``expert_share``:
    the share of the experts (and their adapters) a step reads (``active_expert_share``)."""
    cell["roofline_tok_s"] = cell["pct_roofline"] = cell["step_bytes"] = None
    if bw_gbps is None or cell.get("status") != "ok" or cell.get("mode") != "fixed" or cell.get("sequences",
                                                                                            batch) != batch:
        return
    if "mean_new_tokens" not in cell:  # an episode cell: its steps mix decoding with observation prefills
        return
    mean_ctx = prompt_len + cell["mean_new_tokens"] / 2
    lora = 0 if cell.get("lora") == "off" else bytes_.get("lora_step", bytes_["lora"])
    lora += 0 if cell.get("lora") == "off" else bytes_.get("expert_lora_step", 0) * expert_share
    step_bytes = bytes_["weights"] + bytes_.get("experts", 0) * expert_share + lora + batch * kv_per_token * mean_ctx
    roof = batch * bw_gbps * 1e9 / step_bytes
    cell["step_bytes"] = step_bytes
    cell["roofline_tok_s"] = roof
    cell["pct_roofline"] = 100.0 * cell["decode_tok_s"] / roof if cell["decode_tok_s"] else None


def _compute_aware_roofline(cell: dict[str, Any]) -> None:
    """The profiled cell's roofline counting FLOPs too: batch over the step floor, the sum over categories of the
    larger of bytes / bandwidth and FLOPs / the run's matmul rate (qerl_cli/bench/roofline.py). At batch >= 64 the
    quantized GEMMs are bound by the MMA rate, so the byte roofline alone asks for the impossible there."""
    floor = (cell.get("profile") or {}).get("step_floor_ms")
    cell["roofline_ca_tok_s"] = cell["pct_roofline_ca"] = None
    if not floor or cell.get("status") != "ok" or cell.get("mode") != "fixed":
        return
    cell["roofline_ca_tok_s"] = cell["batch"] * 1e3 / floor
    if cell.get("decode_tok_s"):
        cell["pct_roofline_ca"] = 100.0 * cell["decode_tok_s"] / cell["roofline_ca_tok_s"]


def _unquantized(name: str) -> bool:
    """A format that keeps the weights as they are (the BF16 baseline)."""
    fmt = FORMATS.get(name)
    return fmt is not None and not fmt.quantized


def speedups_vs_bf16(res: dict[str, Any]) -> None:
    """Per fixed-length cell with one sequence per slot: ``speedup_vs_bf16``, its decode tok/s over qerl's bf16
    cell (the unquantized format) of the same batch and adapters (None without one)."""
    def key(c: dict[str, Any]) -> tuple[Any, ...] | None:
        one_per_slot = c["mode"] == "fixed" and c.get("sequences", c["batch"]) == c["batch"]
        return (c["batch"], c.get("lora", "on")) if one_per_slot and c["status"] == "ok" else None

    base = {key(c): c["decode_tok_s"] for c in res["results"] if _unquantized(c["format"]) and key(c) is not None}
    for c in res["results"]:
        ref = base.get(key(c)) if key(c) is not None else None
        c["speedup_vs_bf16"] = c["decode_tok_s"] / ref if ref and c.get("decode_tok_s") else None


def lora_shares(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (format, batch) with fixed-length cells both with adapters on and off: LoRA's share of the decode
    step, ``(t_on - t_off) / t_on``, from the CUDA-graph step time at the mean context when profiled, else
    from the decode ms/step of the timed runs; and the profile's LoRA kernel share (adapters on)."""
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    for c in res["results"]:
        if c["mode"] == "fixed" and c["status"] == "ok" and c.get("sequences", c["batch"]) == c["batch"]:
            cells[(c["format"], c["batch"], c.get("lora", "on"))] = c
    out = []
    for (fmt, batch, lora), on in cells.items():
        off = cells.get((fmt, batch, "off"))
        if lora != "on" or off is None:
            continue
        p_on, p_off = on.get("profile") or {}, off.get("profile") or {}
        if p_on.get("graph_step_ms") and p_off.get("graph_step_ms"):
            t_on, t_off, source = p_on["graph_step_ms"], p_off["graph_step_ms"], "graph step"
        else:
            t_on, t_off, source = on.get("decode_ms_per_step"), off.get("decode_ms_per_step"), "decode ms/step"
        share = 100.0 * (t_on - t_off) / t_on if t_on and t_off else None
        kern = None
        if p_on.get("kernel_ms_per_step"):
            kern = 100.0 * p_on["ms_per_step"]["LoRA"] / p_on["kernel_ms_per_step"]
        out.append({"format": fmt, "batch": batch, "ms_on": t_on, "ms_off": t_off, "source": source,
                    "share_pct": share, "profile_lora_pct": kern})
    return sorted(out, key=lambda r: (r["format"], r["batch"]))


# ---- output ---------------------------------------------------------------------------------------
def render_table(res: dict[str, Any]) -> Any:
    """A rich Table of every cell."""
    from rich.table import Table

    model = res.get("shape") or res.get("model_dir")
    gpu = res["env"]["device"].get("gpu") or "CPU"
    table = Table(title=f"qerl bench rollout: {model}, {res['config']['prompt_len']} prompt + "
                        f"{res['config']['new_tokens']} new tokens, LoRA r={res['config']['lora_rank']}, {gpu}")
    cols = ("format", "linears", "batch", "mode", "LoRA", "seqs", "prefill tok/s", "decode tok/s", "ms/step",
            "e2e tok/s", "TTFT s", "peak GiB", "roofline tok/s", "% roofline", "% compute-aware", "status")
    for c in cols:
        table.add_column(c, justify="left" if c in ("format", "linears", "mode", "LoRA", "status") else "right")
    for c in res["results"]:
        table.add_row(c["format"], c["backend"], str(c["batch"]), c["mode"], c.get("lora", "on"),
                      num(c.get("sequences"), COUNT), num(c.get("prefill_tok_s"), COUNT),
                      num(c.get("decode_tok_s"), COUNT), num(c.get("decode_ms_per_step"), "{:.2f}"),
                      num(c.get("e2e_tok_s"), COUNT), num(c.get("ttft_s"), "{:.3f}"),
                      num(c.get("peak_reserved_gib") or c.get("peak_mem_gib"), "{:.1f}"),
                      num(c.get("roofline_tok_s"), COUNT), num(c.get("pct_roofline"), "{:.1f}"),
                      num(c.get("pct_roofline_ca"), "{:.1f}"), c["status"])
    return table


def tables(res: dict[str, Any]) -> list[Any]:
    """The bench's tables: every cell, then the decode-step profile and its byte floors when profiled."""
    extra = [t for t in (render_profile_table(res), render_floor_table(res)) if t is not None]
    return [render_table(res)] + extra


def render_floor_table(res: dict[str, Any]) -> Any | None:
    """A rich Table: per profiled cell and category, its floor (bytes it must move over the run's copy bandwidth,
    or FLOPs over the run's BF16 matmul rate where that is larger, marked f; qerl_cli/bench/roofline.py) and the %
    of it the measured kernel time reaches."""
    from rich.table import Table

    from qerl_cli.bench.decode_profile import CATEGORIES
    from qerl_cli.bench.roofline import step_floor_ms

    cells = [c for c in res["results"] if (c.get("profile") or {}).get("floors")]
    if not cells:
        return None
    cats = [k for k in CATEGORIES if k not in ("copies", "other")]
    mma = res.get("mma_TFLOPs")
    fp8 = res.get("fp8_TFLOPs")
    fp8_note = f" (FP8 {num(fp8, COUNT)} for what ran W4A8 kernels)" if fp8 else ""
    rate = f" or FLOPs / {num(mma, COUNT)} TFLOP/s BF16 matmul{fp8_note}, whichever is larger: f" if mma else ""
    table = Table(title=f"decode step floors: floor ms (bytes / {num(res.get('copy_GBps'), COUNT)} GB/s copy "
                        f"bandwidth{rate}) and % of it reached; attention: live context (SDPA's KV bucket in KV "
                        "read)")
    for col in ("format", "batch", "LoRA", *cats, "KV read MB", "step"):
        table.add_column(col, justify="left" if col in ("format", "LoRA") else "right")
    def cell(floor_ms: float | None, measured_ms: float | None, bound: str | None = None) -> str:
        if floor_ms is None:
            return "-"
        pct = 100.0 * floor_ms / measured_ms if measured_ms else None
        return f"{floor_ms:.3f}{' f' if bound == 'FLOPs' else ''} ({num(pct, '{:.0f}')}%)"

    for c in cells:
        p = c["profile"]
        fl = p["floors"]
        table.add_row(c["format"], str(c["batch"]), c.get("lora", "on"),
                      *(cell(fl.get(k, {}).get("floor_ms"), p["ms_per_step"].get(k), fl.get(k, {}).get("bound"))
                        for k in cats),
                      f"{p['attention_read_bytes'] / 1e6:,.0f}",
                      cell(step_floor_ms(fl), p.get("graph_step_ms") or p["kernel_ms_per_step"]))
    return table


def render_profile_table(res: dict[str, Any]) -> Any | None:
    """A rich Table: per profiled cell, decode-step GPU ms by category, kernel sum and graph step time."""
    from rich.table import Table

    from qerl_cli.bench.decode_profile import CATEGORIES

    cells = [c for c in res["results"] if c.get("profile")]
    if not cells:
        return None
    table = Table(title="decode step profile: GPU ms per step by category (torch.profiler, eager step at the "
                        "mean context); graph = CUDA-graph replay ms/step")
    for col in ("format", "batch", "LoRA", "ctx", *CATEGORIES, "kernels", "graph"):
        table.add_column(col, justify="left" if col in ("format", "LoRA") else "right")
    for c in cells:
        p = c["profile"]
        table.add_row(c["format"], str(c["batch"]), c.get("lora", "on"), str(p["context"]),
                      *(f"{p['ms_per_step'][k]:.2f}" for k in CATEGORIES), f"{p['kernel_ms_per_step']:.2f}",
                      num(p.get("graph_step_ms"), "{:.2f}"))
    return table


def short_summary(res: dict[str, Any]) -> list[str]:
    """A few plain lines: ceilings, LoRA shares, the quantized cells' speed-ups over bf16, output files."""
    lines = []
    bw = res.get("copy_GBps")
    lines.append(f"copy bandwidth: {bw:,.0f} GB/s" if bw else "copy bandwidth: not measured (no CUDA)")
    for sh in res.get("lora_shares", []):
        lines.append(f"LoRA share {sh['format']} batch {sh['batch']}: {num(sh['share_pct'], '{:.1f}')}% of the step "
                     f"({sh['source']}: {num(sh['ms_on'], '{:.2f}')} ms on, {num(sh['ms_off'], '{:.2f}')} ms off; "
                     f"profile LoRA kernels {num(sh['profile_lora_pct'], '{:.1f}')}%)")
    if res["config"].get("episodes"):
        from qerl_cli.bench.episodes import summary_lines

        lines += summary_lines(res)
    for c in res["results"]:
        if c.get("speedup_vs_bf16") is not None and not _unquantized(c["format"]):
            lines.append(f"{c['format']} batch {c['batch']}{' LoRA off' if c.get('lora') == 'off' else ''}: decode "
                         f"{c['speedup_vs_bf16']:.2f}x qerl bf16, {num(c.get('pct_roofline'), '{:.1f}')}% of roofline"
                         + (f" (bytes), {c['pct_roofline_ca']:.1f}% of the compute-aware one"
                            if c.get("pct_roofline_ca") is not None else ""))
    lines += [f"JSON: {res['files']['json']}", f"plot: {res['files']['plot']}"]  # one path a line: 80 columns
    return lines


def plot(res: dict[str, Any], path: Path) -> None:
    """PNG: decode and end-to-end tok/s vs batch per format (log-log), roofline dashed."""
    fig, axes = figure(1, 2, figsize=(12, 4.8))
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(c["format"] for c in res["results"]))
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(formats)}
    for ax, key, title in ((axes[0], "decode_tok_s", "decode tok/s"), (axes[1], "e2e_tok_s", "end-to-end tok/s")):
        for fmt in formats:
            for mode, style in (("fixed", "-o"), ("eos", ":s")):
                cells = [c for c in res["results"] if c["format"] == fmt and c["mode"] == mode
                         and c["status"] == "ok" and c.get(key)]
                if not cells:
                    continue
                label = fmt if mode == "fixed" else f"{fmt} (EOS)"
                ax.plot([c["batch"] for c in cells], [c[key] for c in cells], style, color=colors[fmt], label=label)
                roof = [(c["batch"], c["roofline_tok_s"]) for c in cells if c.get("roofline_tok_s")]
                if key == "decode_tok_s" and roof:
                    ax.plot(*zip(*roof, strict=True), "--", color=colors[fmt], alpha=0.5, linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_title(title + (" (dashed: weight+KV roofline)" if key == "decode_tok_s" else ""))
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    cfg = res["config"]
    fig.suptitle(f"{res.get('shape') or res.get('model_dir')}: {cfg['prompt_len']}+{cfg['new_tokens']} tokens, "
                 f"LoRA r={cfg['lora_rank']}, {res['env']['device'].get('gpu') or 'CPU'}")
    save_figure(fig, path)


# ---- main ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Workload:
    """What every cell of one bench shares."""

    device: torch.device
    prompt_len: int
    new_tokens: int
    lora_rank: int
    modes: list[str]  # fixed | eos
    lora_modes: list[str]  # on | off
    seed: int
    warmup: bool
    prompts: int | None
    num_generations: int
    profile: bool
    gmu: float
    copy_GBps: float | None
    from_shape: bool
    episodes: int = 0  # turns per synthetic episode (0: single-turn cells)
    tool_latency_ms: float = 50.0
    observation_tokens: int = 32
    mma_TFLOPs: float | None = None  # the run's BF16 matmul rate (profiled runs): the FLOP floors' divisor
    fp8_TFLOPs: float | None = None  # its FP8 rate: the divisor of what ran on W4A8 kernels

    def lora_label(self, lora: str) -> str:
        return lora if self.lora_rank else "none"


@dataclass
class _Model:
    """One format's model, built once for all of its cells, and what the roofline needs of it."""

    fmt: str
    backend: str
    model: nn.Module
    tokenizer: Any
    build_s: float
    vocab: int = 0
    kv_per_token: int = 0
    eos: list[int] | None = None
    nbytes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg = self.model.config
        self.vocab = int(cfg.vocab_size)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv_per_token = (2 * int(cfg.num_hidden_layers) * int(cfg.num_key_value_heads) * head_dim
                             * kv_elem(2))  # bf16/fp16 rollouts; QERL_KV_CACHE=fp8 halves it
        self.nbytes = model_bytes(self.model)
        eos = getattr(cfg, "eos_token_id", None)
        self.eos = None if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def info(self, device: torch.device) -> dict[str, Any]:
        """The model's entry in the result's ``models``."""
        return {
            "backend": self.backend,
            "build_s": self.build_s,
            "weight_bytes": self.nbytes["weights"],
            "expert_bytes": self.nbytes["experts"],
            "lora_bytes": self.nbytes["lora"],
            "resident_gib": self.nbytes["resident"] / 2**30,
            "kv_bytes_per_token": self.kv_per_token,
            "build_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        }


def bench_rollout(
    *,
    shape: str | None = None,
    run_dir: Path | None = None,
    formats: Iterable[str] = DEFAULT_FORMATS,
    batches: Iterable[int] = DEFAULT_BATCHES,
    prompt_len: int = 256,
    new_tokens: int = 1024,
    lora_rank: int = 32,
    out_dir: Path | None = None,
    eos_mode: str = "fixed",
    log: Callable[[str], None] = print,
    seed: int = 0,
    warmup: bool = True,
    gpu_memory_utilization: float = 0.9,
    memory_cap_gib: float | None = None,
    time_budget_s: float | None = None,
    prompts: int | None = None,
    num_generations: int = 1,
    lora_modes: Iterable[str] = ("on",),
    profile: bool = False,
    linear_backend: str | None = None,
    episodes: int = 0,
    tool_latency_ms: float = 50.0,
    observation_tokens: int = 32,
) -> dict[str, Any]:
    """Benchmark the builtin rollout engine; returns the result dict (also written as JSON + PNG).

    Exactly one of ``shape`` (tiny | qwen2.5-0.5b | qwen2.5-7b | qwen2.5-14b | qwen2.5-32b: a random
    model built on the device) or ``run_dir`` (the run's quantized model; ``formats`` is then the run's
    format) is required. ``memory_cap_gib`` caps this process's GPU memory (e.g. 79.6 to check that a
    configuration fits an 80 GB H100 while running on a larger GPU); ``time_budget_s`` skips the cells
    that would start after it (recorded as skipped). Cells that do not fit are recorded as OOM/skipped.
    ``prompts``/``num_generations``: the realistic workload (more sequences than ``batch`` slots);
    ``lora_modes``: ("on",), ("off",) or both; ``profile``: per-category decode-step GPU time (CUDA);
    ``linear_backend``: force qerl_kernels' linear backend (``set_backend``) for the whole run.
    ``episodes``: turns per synthetic episode, each cell against single-turn decoding (bench/episodes.py).
    """
    fmts, bs = _check_args(shape, run_dir, formats, batches, prompt_len, new_tokens, lora_rank, eos_mode)
    lmodes = _check_workload(prompts, num_generations, lora_modes) if lora_rank else ["on"]
    device = harness.device()
    set_linear_backend(linear_backend, device)
    spec, run, model_dir, fmts = _model_source(shape, run_dir, fmts, device, log)
    out = harness.out_dir(out_dir, run, "rollout")
    max_len = _max_len(spec, shape, prompt_len, new_tokens, episodes, observation_tokens, tool_latency_ms)
    total_gib = harness.gpu_total_gib(device)
    frac = harness.cap_memory(device, memory_cap_gib)
    gmu = gpu_memory_utilization if frac is None else min(gpu_memory_utilization, frac)
    budget = harness.Budget(time_budget_s)
    res = harness.header(
        "bench/rollout", shape=shape, model_dir=str(model_dir) if model_dir else None,
        config={"formats": fmts, "batches": bs, "prompt_len": prompt_len, "new_tokens": new_tokens,
                "lora_rank": lora_rank, "eos_mode": eos_mode, "seed": seed, "warmup": warmup,
                "gpu_memory_utilization": gmu, "memory_cap_gib": memory_cap_gib,
                "time_budget_s": time_budget_s, "prompts": prompts, "num_generations": num_generations,
                "lora_modes": lmodes, "profile": profile, "linear_backend": linear_backend,
                "episodes": episodes, "tool_latency_ms": tool_latency_ms if episodes else None,
                "observation_tokens": observation_tokens if episodes else None,
                "options": _resolved_options(),
                "sampling": f"temperature 1.0, top_p 1, top_k off, n={num_generations}"})
    bw = harness.copy_bandwidth_gbps(device)
    mma = matmul_ceiling_tflops(device) if profile else None
    fp8 = fp8_matmul_ceiling_tflops(device) if profile else None
    res.update({"gpu_total_gib": total_gib, "copy_GBps": bw, "mma_TFLOPs": mma, "fp8_TFLOPs": fp8, "models": {}})
    if bw:
        log(f"copy bandwidth {bw:,.0f} GB/s (read + write)" + (f", BF16 matmul {mma:,.0f} TFLOP/s" if mma else "")
            + (f", FP8 matmul {fp8:,.0f} TFLOP/s" if fp8 else ""))
    work = _Workload(device, prompt_len, new_tokens, lora_rank, ["fixed", "eos"] if eos_mode == "both" else [eos_mode],
                     lmodes, seed, warmup, prompts, num_generations, profile, gmu, bw, spec is not None, episodes,
                     tool_latency_ms, observation_tokens, mma_TFLOPs=mma, fp8_TFLOPs=fp8)
    cell_times: dict[tuple[int, str, str], float] = {}  # a cell's time in the last format: the next one's guess
    for fmt in fmts:
        cap = (memory_cap_gib or total_gib) if spec is not None and device.type == "cuda" else None
        res["results"] += _bench_format(res, fmt, bs, work, spec=spec, model_dir=model_dir, cap_gib=cap,
                                        max_len=max_len, budget=budget, cell_times=cell_times, log=log)
    _finish(res, fmts, budget)
    paths = harness.write_results(res, out, "rollout.json", {"plot": ("rollout.png", partial(plot, res))})
    if run is not None:
        _record_stage(run, res, paths)
    return res


def _model_source(shape: str | None, run_dir: Path | None, fmts: list[str], device: torch.device,
                  log: Callable[[str], None]) -> tuple[Any, Any, Any, list[str]]:
    """(the shape's spec, the run, its model directory, the formats): a random shape in the formats asked for, or
    the run's quantized model in its own format."""
    if shape is not None:
        return harness.shape_for(shape, device), None, None, fmts
    from qerl_cli.bench.runmodels import run_model

    run, model_dir, run_fmt = run_model(run_dir)
    if fmts and fmts != [run_fmt]:
        log(f"--run: benchmarking the run's model ({run_fmt}); formats {fmts} ignored")
    return None, run, model_dir, [run_fmt]


def _max_len(spec: Any, shape: str | None, prompt_len: int, new_tokens: int, episodes: int, observation_tokens: int,
             tool_latency_ms: float) -> int:
    """The longest sequence a cell holds (an episode's observations included), checked against the shape."""
    max_len = prompt_len + new_tokens
    if episodes:
        from qerl_cli.bench.episodes import check_episode_args, episode_len

        check_episode_args(episodes, new_tokens, observation_tokens, tool_latency_ms)
        max_len = episode_len(prompt_len, new_tokens, episodes, observation_tokens)
    if spec is not None and max_len > spec.max_positions:
        raise QerlError(f"prompt_len + new_tokens = {max_len} exceeds the {shape} shape's "
                        f"{spec.max_positions} positions")
    return max_len


def _rows(fmt: str, backend: str, batches: Iterable[int], work: _Workload, status: str,
          **extra: Any) -> list[dict[str, Any]]:
    """The rows of cells that never ran (did not fit, no time left, the model did not build)."""
    return [{"format": fmt, "backend": backend, "batch": b, "mode": mode, "lora": work.lora_label(lora),
             "status": status, **extra} for b in batches for mode in work.modes for lora in work.lora_modes]


def _bench_format(res: dict[str, Any], fmt: str, batches: list[int], work: _Workload, *, spec: Any,
                  model_dir: Path | None, cap_gib: float | None, max_len: int, budget: harness.Budget,
                  cell_times: dict[tuple[int, str, str], float], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every cell of one format: the model built once, then one row per (batch, mode, adapters)."""
    backend = get_format(fmt).kernel_backend(work.device)
    rows: list[dict[str, Any]] = []
    fitting = list(batches)
    if cap_gib is not None:  # a shape model on a GPU: leave out what cannot fit before trying it
        fitting = [b for b in batches if _estimate_gib(spec, fmt, b, max_len, work.lora_rank) <= 0.97 * cap_gib]
        for b in batches:
            if b not in fitting:
                est = _estimate_gib(spec, fmt, b, max_len, work.lora_rank)
                rows += _rows(fmt, backend, [b], work, "OOM/skipped", note=f"needs ~{est:.0f} GiB of {cap_gib:.0f}")
                log(f"{fmt} batch {b}: OOM/skipped (estimated {est:.0f} GiB > {cap_gib:.0f} GiB)")
    if not fitting:
        return rows
    if budget.exceeded():
        return rows + _rows(fmt, backend, fitting, work, harness.SKIPPED_BUDGET)
    try:
        loaded = _build(fmt, backend, work, spec=spec, model_dir=model_dir)
    except Exception as exc:  # noqa: BLE001 - recorded per cell, the bench goes on
        status = harness.failure_status(exc, "OOM/skipped")
        harness.free_memory()
        log(f"{fmt}: model build failed: {status}")
        return rows + _rows(fmt, backend, fitting, work, status)
    res["models"][fmt] = loaded.info(work.device)
    experts = loaded.nbytes["experts"]
    routed = f" + the routed share of {experts / 2**30:.2f} GiB of experts" if experts else ""
    log(f"{fmt}: model ready in {loaded.build_s:.1f}s ({backend}; step reads "
        f"{loaded.nbytes['weights'] / 2**30:.2f} GiB weights + {loaded.nbytes['lora'] / 2**30:.2f} GiB LoRA{routed})")
    cells = [harness.Cell({"format": fmt, "backend": backend, "batch": b, "mode": mode, "lora": work.lora_label(lora)},
                          partial(_measure_naming_kernels, loaded, work, b, mode, lora),
                          f"{fmt} batch {b} {mode} LoRA {work.lora_label(lora)}")
             for b in fitting for mode in work.modes for lora in work.lora_modes]

    nbytes, kv_per_token, model_config = loaded.nbytes, loaded.kv_per_token, loaded.model.config

    def key(cell: harness.Cell) -> tuple[int, str, str]:
        return cell.key["batch"], cell.key["mode"], cell.key["lora"]

    def done(cell: harness.Cell, row: dict[str, Any]) -> None:
        if row["status"] == harness.SKIPPED_BUDGET:
            log(f"{cell.label}: {row['status']}")
            return
        cell_times[key(cell)] = cell.seconds or 0.0
        _roofline(row, batch=row["batch"], bytes_=nbytes, kv_per_token=kv_per_token,
                  prompt_len=work.prompt_len, bw_gbps=work.copy_GBps,
                  expert_share=active_expert_share(model_config, row["batch"]))
        _log_cell(log, cell, row)

    rows += harness.run_cells(cells, budget=budget, oom="OOM/skipped", guess=lambda c: cell_times.get(key(c), 0.0),
                              on_row=done)
    del loaded, cells
    harness.free_memory()
    return rows


def _build(fmt: str, backend: str, work: _Workload, *, spec: Any, model_dir: Path | None) -> _Model:
    """The format's model on the device (a random shape, or the run's), with NF4 routed through bitsandbytes
    where it runs there and LoRA attached."""
    t0 = time.perf_counter()
    if work.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokenizer = None
    if spec is not None:
        from qerl_cli.bench.shapes import build_random_model

        model = build_random_model(spec, fmt, work.device, dtype=torch.bfloat16, seed=work.seed)
    else:
        from qerl_cli.models import load_model

        model, tokenizer = load_model(str(model_dir), dtype=torch.bfloat16, device=work.device)
    model = attach_bench_lora(model, work.lora_rank, work.seed)
    return _Model(fmt, backend, model, tokenizer, time.perf_counter() - t0)


def _measure_naming_kernels(m: _Model, work: _Workload, batch: int, mode: str, lora: str) -> dict[str, Any]:
    """`_measure`, with the row's `backend` naming the kernels that ran its quantized linears and `linears` the
    forwards per projection class and kernel."""
    from qerl_cli.bench import kernels_ran

    kernels_ran.reset()
    row = _measure(m, work, batch, mode, lora)
    label, split = kernels_ran.read(m.model.config, m.backend)
    return {**row, "backend": label, "linears": split}


def _measure(m: _Model, work: _Workload, batch: int, mode: str, lora: str) -> dict[str, Any]:
    """One (format, batch, mode, adapters) cell's numbers; a status when fewer slots than ``batch`` fit."""
    if work.episodes:
        from qerl_cli.bench.episodes import measure_episodes

        prompts = random_prompts(work.prompts or batch, work.prompt_len, m.vocab, set(), work.seed)
        with _adapters(m.model, lora):
            cell = measure_episodes(
                m.model, m.tokenizer, batch=batch, prompts=prompts, prompt_len=work.prompt_len,
                new_tokens=work.new_tokens, turns=work.episodes, observation_tokens=work.observation_tokens,
                latency_ms=work.tool_latency_ms, vocab=m.vocab, device=work.device, gpu_memory_utilization=work.gmu,
                seed=work.seed, warmup=work.warmup, precapture=precapture_graphs)
        return {"status": "ok" if cell["num_slots"] >= batch else f"ok ({cell['num_slots']} of {batch} slots fit)",
                **cell}
    stop_ids = bench_stop_ids(mode, m.vocab, work.new_tokens, m.eos, from_shape=work.from_shape)
    cell = _run_cell(m.model, m.tokenizer, batch=batch, prompt_len=work.prompt_len, new_tokens=work.new_tokens,
                     vocab=m.vocab, stop_ids=stop_ids, device=work.device, gpu_memory_utilization=work.gmu,
                     seed=work.seed, warmup=work.warmup, prompts_n=work.prompts, generations=work.num_generations,
                     lora=lora, profile=work.profile, rates=(work.copy_GBps, work.mma_TFLOPs, work.fp8_TFLOPs))
    if cell["num_slots"] >= batch:
        return {"status": "ok", **cell}
    # the cell ran, but with fewer sequences at once than its batch: say so, and why
    why = f"{m.fmt} weights {m.nbytes['weights'] / 2**30:.1f} GiB: {cell['kv_room'] or 'the KV budget'}"
    return {"status": f"ok ({cell['num_slots']} of {batch} slots fit)", **cell,
            "note": f"{why}; this cell needs {batch}"}


def _log_cell(log: Callable[[str], None], cell: harness.Cell, row: dict[str, Any]) -> None:
    prof = row.get("profile")
    extra = ""
    if prof:
        extra = (f"; profile {prof['kernel_ms_per_step']:.2f} ms kernels/step, graph step "
                 f"{num(prof['graph_step_ms'], '{:.2f}')} ms, LoRA {prof['ms_per_step']['LoRA']:.2f} ms")
    log(f"{cell.label}: {row['status']}; decode {num(row.get('decode_tok_s'), COUNT)} tok/s, "
        f"e2e {num(row.get('e2e_tok_s'), COUNT)} tok/s, prefill {num(row.get('prefill_tok_s'), COUNT)} tok/s, "
        f"TTFT {num(row.get('ttft_s'), '{:.3f}')} s, peak {num(row.get('peak_reserved_gib'), '{:.1f}')} GiB, "
        f"{num(row.get('pct_roofline'), '{:.1f}')}% of roofline ({cell.seconds or 0.0:.0f}s){extra}")


def _finish(res: dict[str, Any], fmts: list[str], budget: harness.Budget) -> None:
    """Order the rows, give every row the roofline fields and its decode speed-up over bf16."""
    res["results"].sort(key=lambda c: (fmts.index(c["format"]), c["batch"], c["mode"], c.get("lora", "")))
    for c in res["results"]:
        c.setdefault("roofline_tok_s", None)
        c.setdefault("pct_roofline", None)
        _compute_aware_roofline(c)
    res["lora_shares"] = lora_shares(res)
    speedups_vs_bf16(res)
    res["wall_s"] = budget.elapsed()


def _record_stage(run: Any, res: dict[str, Any], paths: dict[str, Path]) -> None:
    """Record the bench in the run's manifest under key bench/rollout."""
    metrics = {f"{c['format']}/b{c['batch']}/{c['mode']}{'/lora-off' if c.get('lora') == 'off' else ''}"
               "/decode_tok_s": c.get("decode_tok_s") for c in res["results"] if c["status"] == "ok"}
    harness.record(run, "rollout", config=res["config"], inputs={"model": run.rel(res["model_dir"])},
                   outputs=paths, metrics=metrics, extra={"copy_GBps": res["copy_GBps"]})
