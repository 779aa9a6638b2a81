"""The builtin rollout engine and ``VllmEngine`` side by side on one GPU, same model, prompts and lengths.

    python scripts/vllm_side_by_side.py --out OUT_DIR [--shape qwen2.5-7b] [--batches 8 64]
        [--modes fixed eos long] [--prompt-len 256] [--new-tokens 256] [--long-tokens 1024] [--long-batches 8]
        [--lora-rank 32] [--vllm-gpu-util 0.5] [--deadline-s 540]

One process: a random model of ``--shape`` is built on the GPU with its decoder linears in NVFP4
(``bench.shapes.build_random_model``), written as a compressed-tensors NVFP4A16 checkpoint (its state dict
already uses the checkpoint's tensor names) with a word-level tokenizer over the whole vocabulary, and a
LoRA of ``--lora-rank`` is attached to all seven decoder linears with non-zero B. The builtin engine
generates from that peft model; vLLM serves the written checkpoint (Marlin W4A16 NVFP4 on Hopper) with the
same adapter pushed as tensors. Cells, in this order: ``fixed`` (``--new-tokens`` always) at each
batch, ``eos`` (the bench's stop set of vocab/(new_tokens/2) ids, geometric lengths on a near-uniform random
model) at each batch, ``long`` (``--long-tokens`` always, at ``--long-batches``), ``queue`` (``--queue-prompts``
x ``--generations`` sequences, EOS, through the largest batch's slots). Both engines get the same prompts;
each cell is warmed up once untimed, then timed ``--repeats`` times (seeds 100, 101, ...: with EOS each repeat
draws other lengths; the cell sums them). Finally vLLM's log-probs of its fixed-length batch are compared with
qerl's training forward.

Memory: each builtin cell's engine gets the fraction of the GPU its batch needs on top of what is resident
(``builtin_memory_fraction``: the memory plan's terms); it is released before vLLM starts. vLLM takes
``--vllm-gpu-util`` of the whole GPU from what is free beside the resident model (``vllm_memory_fraction``).
The checkpoint is written once per shape and seed (``--ckpt``; a later run on the same machine reuses it when
its fingerprint matches). Time: builtin cells start only while the rest of the deadline still holds vLLM's
start-up (``--vllm-startup-s``) and vLLM's turn at the cells run so far; vLLM runs the cells the builtin
engine ran, so every cell that ran is a pair.

A mixture-of-experts shape (``--shape qwen3-30b-a3b``) is written the way ``qerl quantize`` writes MoE checkpoints
(per-expert tensors, routers unquantized) and served by vLLM's compressed-tensors MoE method; the adapter on the
experts reaches vLLM as one LoRA per expert and projection (``qerl_cli.lora.per_expert_adapter``), the layout its
fused-MoE LoRA reads. ``--lora-targets q_proj,k_proj,v_proj,o_proj`` keeps the LoRA off the experts (for a vLLM that
serves no LoRA on them).

Writes OUT_DIR/side_by_side.json (after every cell, so a deadline keeps what ran) and prints a table last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

T0 = time.monotonic()
GIB = 2**30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # attach_bench_lora's


def _left(deadline: float) -> float:
    return deadline - (time.monotonic() - T0)


def _fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's first 64 KiB of a few tensors (embedding, first and last decoder linear): says
    whether a checkpoint written earlier holds this very model (same shape, seed and code)."""
    state = model.state_dict()
    names = sorted(state)
    picks = [n for n in names if "embed_tokens" in n][:1] + [n for n in names if "layers.0." in n][:2] + names[-2:]
    h = hashlib.blake2b(digest_size=12)
    for n in picks:
        t = state[n].detach().reshape(-1)[: 65536 // max(1, state[n].element_size())].cpu().contiguous()
        h.update(n.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_checkpoint(model: torch.nn.Module, out: Path, key: dict[str, Any]) -> tuple[float, bool]:
    """compressed-tensors NVFP4A16 checkpoint + word-level tokenizer of ``model`` (a build_random_model, before any
    CUDA forward: qerl's kernels repack FP4 weights in place at the first one). Skipped when ``out`` already holds
    the same model (``key`` and the weights' fingerprint in ``out/qerl_sbs.json``, written last). Returns (seconds,
    reused)."""
    from qerl_cli.bench.peers import write_shape_checkpoint

    t = time.perf_counter()
    key = {**key, "fingerprint": _fingerprint(model)}
    marker = out / "qerl_sbs.json"
    try:
        if json.loads(marker.read_text()) == key and (out / "config.json").is_file():
            return time.perf_counter() - t, True
    except (OSError, ValueError):
        pass
    marker.unlink(missing_ok=True)
    write_shape_checkpoint(model, out, "nvfp4")
    marker.write_text(json.dumps(key))
    return time.perf_counter() - t, False


def builtin_memory_fraction(model: torch.nn.Module, batch: int, max_len: int, lora_rank: int,
                            total: int | None = None, in_use: int | None = None, allocated: int | None = None,
                            targets: list[str] | None = None) -> tuple[float, dict[str, Any]]:
    """``gpu_memory_utilization`` for one builtin cell's engine, and the numbers it came from (bytes).

    The builtin engine sizes its cache as ``utilization x total - in use - activation reserve`` (``kv_budget``),
    capped at ``max_batch_slots``. The fraction here is what is in use now (the resident model and adapter, counted
    as the engine counts it) plus what the cell adds, each term from the memory plan (``train/memory_plan.py``):
    the FP4 kernels' derived block scales not made yet (they appear at the first CUDA forward:
    ``weight_bytes(...).kernel_derived`` less what is allocated beyond the module's tensors), the engine's LoRA
    shadows, its activation reserve (``rollout_reserve``: the engine's own formula), ``batch`` KV slots of
    ``max_len`` (rounded up as the engine does), and the plan's reserve for the allocator and what the estimate
    misses (1 GiB + 5% of the GPU); at most 0.98. The cache never exceeds ``batch`` slots, so a generous fraction
    costs nothing; the engine is released before vLLM starts, so vLLM's share is not touched. (The fixed 0.3 this
    replaces left no KV room once 23 GiB of 32B weights were resident.) ``plan["fits"]`` False: even 0.98 of the
    GPU does not hold the cell. ``total``/``in_use``/``allocated`` are for tests (default: the CUDA device now)."""
    from qerl_cli.train.memory_plan import (
        CACHE_ALIGN,
        ENGINE_PREFILL_TOKENS,
        ModelDims,
        module_bytes,
        rollout_reserve,
        weight_bytes,
    )

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    dims = ModelDims.from_config(cfg)
    elem = 2  # bf16 activations and KV cache
    if total is None:
        free, total = torch.cuda.mem_get_info()
        in_use = total - free - (torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        allocated = torch.cuda.memory_allocated()
    assert in_use is not None and allocated is not None
    derived = weight_bytes(cfg, getattr(base, "qerl_format", "nvfp4"), elem, kernels=True).kernel_derived
    made = max(0, allocated - module_bytes(model))  # allocated beyond parameters and buffers: the derived data
    cache_len = -(-max_len // CACHE_ALIGN) * CACHE_ALIGN
    plan = {
        "total": total, "in_use": in_use,
        "kernel_derived_pending": max(0, derived - made),
        "lora_shadows": dims.shadow_elems(lora_rank, targets or TARGETS) * elem if lora_rank else 0,
        "activation_reserve": rollout_reserve(dims, elem, batch, ENGINE_PREFILL_TOKENS),
        "kv_cache": batch * cache_len * dims.kv_bytes_per_token(elem),
        "slack": GIB + total // 20,  # memory_plan.plan_memory's reserve
    }
    need = sum(v for k, v in plan.items() if k != "total")
    plan.update(need=need, fits=need <= 0.98 * total)
    return min(0.98, need / total), plan


def vllm_memory_fraction(requested: float, free: int, total: int) -> tuple[float, dict[str, Any]]:
    """vLLM's ``gpu_memory_utilization``: ``requested``, or lower when the GPU has less free. vLLM takes its share
    of the whole GPU from what is free at its start (it refuses to start when ``free < utilization x total``), and
    the random model with its adapter stays resident beside it (the log-prob check runs qerl's forward on it). So
    the fraction is at most ``(free - 1 GiB) / total``; numbers in bytes."""
    cap = max(0.0, (free - GIB) / total)
    util = min(requested, cap)
    return util, {"requested": requested, "used": util, "free_at_start": free, "total": total,
                  "lowered": util < requested}


def cell_summary(runs: list[Any]) -> dict[str, Any]:
    """One cell over its timed repeats: totals, and per repeat the mean and longest sample (with EOS the
    wall time follows the longest sample of the batch, the tokens the mean: both engines draw their own)."""
    t = [r.timings for r in runs]
    tokens = sum(int(x["tokens"]) for x in t)
    total = sum(x["total_s"] for x in t)
    sync = sum(x.get("lora_sync_s") or 0.0 for x in t)
    lengths = [[len(s.token_ids) for s in r.samples] for r in runs]
    return {
        "repeats": len(runs),
        "tokens": tokens,
        "total_s": total,
        "e2e_tok_s": tokens / total,
        # without the LoRA push VllmEngine makes before each generate (the builtin engine makes none)
        "generate_tok_s": tokens / max(1e-9, total - sync),
        "lora_sync_s": sync / len(runs) if sync else None,
        "ttft_s": sum(x["ttft"] for x in t) / len(t),
        "decode_s": sum(x["decode_s"] for x in t) / len(t),
        "ms_per_longest_token": 1000.0 * total / sum(max(n) for n in lengths),
        "mean_new_tokens": [sum(n) / len(n) for n in lengths],
        "max_new_tokens": [max(n) for n in lengths],
        "stopped": sum(s.finish_reason == "stop" for r in runs for s in r.samples),
        "sequences": sum(len(n) for n in lengths),
    }


def logprob_check(model: torch.nn.Module, samples: list[Any], k: int) -> dict[str, float]:
    """vLLM's sampled-token log-probs (mu) vs qerl's training forward (pi) on the first ``k`` samples."""
    from qerl_cli.train.batch import build_batch, sampled_logprobs

    s = samples[:k]
    batch = build_batch([x.prompt_token_ids for x in s], [x.token_ids for x in s], [x.logprobs for x in s],
                        [False] * len(s), pad_id=0).to(next(model.parameters()).device)
    with torch.no_grad():
        pi, _ = sampled_logprobs(model, batch, 1.0)
        with model.disable_adapter():
            pi_base, _ = sampled_logprobs(model, batch, 1.0)
    mask = batch.mask > 0
    d = (batch.rollout_logp - pi)[mask].float()
    rho = torch.exp(-d)
    return {
        "samples": len(s), "tokens": int(mask.sum().item()),
        "k1": d.mean().item(), "k3": (rho - torch.log(rho) - 1).mean().item(),
        "max_abs_dlogp": d.abs().max().item(), "mean_abs_dlogp": d.abs().mean().item(),
        # the same against the base model without LoRA: shows the adapter really reached vLLM
        "mean_abs_dlogp_vs_no_lora": (batch.rollout_logp - pi_base)[mask].float().abs().mean().item(),
    }


def plan_cells(batches: list[int], modes: list[str], long_batches: list[int]) -> list[tuple[int, str]]:
    """(batch, mode) in run order: mode by mode as given, each over the batches (``long`` only at
    ``long_batches``, ``queue`` only at the largest batch)."""
    cells = []
    for m in modes:
        bs = long_batches if m == "long" else [max(batches)] if m == "queue" else batches
        cells += [(b, m) for b in bs]
    return cells


def may_start_builtin(left: float, walls: list[float], timed: list[float], vllm_startup_s: float | None) -> bool:
    """Whether a builtin cell may start with ``left`` seconds to go. ``walls``: the whole time of each builtin cell so
    far (warm-up, graph capture, repeats; the first also holds one-time kernel compiles), ``timed``: their timed
    generates. This cell takes about the longest wall after the first (60 s before any); with vLLM to follow, vLLM's
    start-up and its turn at every cell run so far and at this one (about the timed part, plus 5 s of warm-up each)
    must still fit after it."""
    wall = max(walls[1:] or walls or [60.0])
    if vllm_startup_s is None:
        return left > wall + 10
    turn = sum(t + 5 for t in timed) + max(timed or [40.0]) + 5
    return left > vllm_startup_s + turn + wall + 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256, help="new tokens of the fixed and eos cells")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--lora-targets", default=",".join(TARGETS), help="comma-separated projections the LoRA adapts")
    ap.add_argument("--modes", nargs="+", default=["fixed", "eos", "long"], choices=["fixed", "eos", "long", "queue"],
                    help="long: --long-tokens new tokens, fixed length, at --long-batches; queue: --queue-prompts x "
                         "--generations sequences, EOS, through the largest batch's slots")
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--long-batches", type=int, nargs="+", default=None, help="default: the smallest of --batches")
    ap.add_argument("--queue-prompts", type=int, default=32)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed generates per cell (seeds 100, 101, ...)")
    ap.add_argument("--eos-repeats", type=int, default=None, help="timed generates of EOS cells (default --repeats)")
    ap.add_argument("--long-repeats", type=int, default=None, help="timed generates of long cells (default --repeats)")
    ap.add_argument("--engines", nargs="+", default=["builtin", "vllm"], choices=["builtin", "vllm"])
    ap.add_argument("--ckpt", default=None, help="where vLLM's checkpoint is written (default /tmp/qerl_sbs_SHAPE)")
    ap.add_argument("--vllm-gpu-util", type=float, default=0.5,
                    help="vLLM's share of the whole GPU, taken from what is free beside the resident model")
    ap.add_argument("--vllm-startup-s", type=float, default=150.0,
                    help="vLLM's start-up time the builtin cells leave room for (7B: 46-114 s measured)")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile / CUDA graphs")
    ap.add_argument("--deadline-s", type=float, default=540.0)
    a = ap.parse_args(argv)
    a.long_batches = a.long_batches or [min(a.batches)]
    a.lora_targets = [t for t in a.lora_targets.split(",") if t]
    a.ckpt = a.ckpt or f"/tmp/qerl_sbs_{a.shape}"
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)

    from qerl_cli.bench.rollout import attach_bench_lora, bench_stop_ids, precapture_graphs, random_prompts
    from qerl_cli.bench.shapes import build_random_model, get_shape
    from qerl_cli.env_info import environment
    from qerl_cli.rollout import BuiltinEngine, SamplingParams

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = get_shape(a.shape)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the builtin side (tiny shape)
    res: dict[str, Any] = {"args": vars(a), "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                           "cells": [], "skipped": [], "errors": []}
    if "vllm" in a.engines:
        try:
            import vllm

            res["vllm_version"] = vllm.__version__
        except ImportError as exc:
            res["errors"].append(f"import vllm: {exc}")
    res["env"] = environment()

    def save() -> None:
        (out_dir / "side_by_side.json").write_text(json.dumps(res, indent=1, default=str))

    t = time.perf_counter()
    base = build_random_model(spec, "nvfp4", dev, seed=0)
    res["build_s"] = time.perf_counter() - t
    res["write_ckpt_s"], res["ckpt_reused"] = write_checkpoint(
        base, Path(a.ckpt), {"shape": a.shape, "format": "nvfp4", "seed": 0})
    model = attach_bench_lora(base, a.lora_rank, seed=0, targets=a.lora_targets)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # larger B than the bench's 1e-3, so the log-prob check can see the adapter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    new_tokens = {"fixed": a.new_tokens, "eos": a.new_tokens, "queue": a.new_tokens, "long": a.long_tokens}
    eos_ids = bench_stop_ids("eos", spec.vocab, a.new_tokens, None, True)
    stops = {"fixed": [], "long": [], "eos": eos_ids, "queue": eos_ids}
    cells = plan_cells(a.batches, a.modes, a.long_batches)
    prompts = {b: random_prompts(b, a.prompt_len, spec.vocab, set(eos_ids), seed=b) for b, _ in cells}
    queue_prompts = random_prompts(a.queue_prompts, a.prompt_len, spec.vocab, set(eos_ids), seed=1000)
    max_len = a.prompt_len + max(new_tokens[m] for _, m in cells)  # vLLM's max_model_len
    res["cells_planned"] = [f"b{b} {m} {new_tokens[m]}" for b, m in cells]
    save()

    def work(b: int, mode: str) -> tuple[list[list[int]], int, int]:
        """(prompts, samples per prompt, timed repeats) of a cell."""
        if mode == "queue":
            return queue_prompts, a.generations, 1
        reps = {"eos": a.eos_repeats, "long": a.long_repeats}.get(mode)
        return prompts[b], 1, reps or a.repeats

    def params(mode: str, seed: int, max_tokens: int, n: int = 1) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=max_tokens,
                              stop_token_ids=stops[mode], seed=seed)

    vllm_next = "vllm" in a.engines and "vllm_version" in res
    walls: dict[tuple[int, str], float] = {}  # builtin cells that ran: their whole time (warm-up, capture, repeats)
    timed: dict[tuple[int, str], float] = {}  # ... and their timed generates
    if "builtin" in a.engines:
        for b, mode in cells:
            if not may_start_builtin(_left(a.deadline_s), list(walls.values()), list(timed.values()),
                                     a.vllm_startup_s if vllm_next else None):
                res["skipped"].append(f"builtin b{b} {mode}: deadline")
                continue
            t_cell = time.monotonic()
            ps, n, reps = work(b, mode)
            cell_len = a.prompt_len + new_tokens[mode]
            row: dict[str, Any] = {"engine": "builtin", "batch": b, "mode": mode, "new_tokens": new_tokens[mode]}
            gmu, plan = 0.5, None  # CPU: the engine ignores the fraction
            if dev == "cuda":
                gmu, plan = builtin_memory_fraction(model, b, cell_len, a.lora_rank, targets=a.lora_targets)
                row.update(gpu_memory_utilization=gmu, memory={k: (v / GIB if isinstance(v, int) and
                                                                  not isinstance(v, bool) else v)
                                                               for k, v in plan.items()})
                if not plan["fits"]:
                    res["errors"].append(f"builtin b{b} {mode}: needs {plan['need'] / GIB:.1f} GiB of "
                                         f"{plan['total'] / GIB:.1f} GiB; not run")
                    save()
                    continue
            eng = BuiltinEngine(model, None, max_batch_slots=b, max_model_len=cell_len,
                                gpu_memory_utilization=gmu, dtype=torch.bfloat16)
            try:
                eng.generate(prompts[b], params(mode, 1, min(new_tokens[mode], 16)))
                row["kv_slots"] = eng.num_slots
                if eng.kv_room is not None:
                    row["kv_room"] = eng.kv_room.describe()
                if eng.num_slots < b:  # the cell would queue: not the same work as vLLM's
                    res["errors"].append(f"builtin b{b} {mode}: only {eng.num_slots} KV slots ({row.get('kv_room')})")
                if eng.use_graphs:
                    precapture_graphs(eng, b, shrinking=mode not in ("fixed", "long"))
                if dev == "cuda":
                    torch.cuda.synchronize()
                runs = [eng.generate(ps, params(mode, 100 + i, new_tokens[mode], n)) for i in range(reps)]
                walls[(b, mode)] = time.monotonic() - t_cell
                summary = cell_summary(runs)
                timed[(b, mode)] = summary["total_s"]
                res["cells"].append({**row, **summary, "wall_s": walls[(b, mode)]})
            finally:
                eng.release()
                del eng
                if dev == "cuda":
                    torch.cuda.empty_cache()
            save()

    if vllm_next and _left(a.deadline_s) > 120:
        from qerl_cli.rollout.vllm_engine import VllmEngine

        vcells = [c for c in cells if c in walls] if "builtin" in a.engines else cells
        t = time.perf_counter()
        util, vplan = a.vllm_gpu_util, None
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # vLLM measures its profile run's peak from here
            util, vplan = vllm_memory_fraction(a.vllm_gpu_util, *torch.cuda.mem_get_info())
            if vplan["lowered"]:
                res["errors"].append(f"vLLM gpu_memory_utilization lowered {a.vllm_gpu_util} -> {util:.3f}: "
                                     f"{vplan['free_at_start'] / GIB:.1f} GiB free of {vplan['total'] / GIB:.1f}")
        try:
            veng = VllmEngine(model, None, model_dir=a.ckpt, max_batch_slots=max(b for b, _ in vcells or cells),
                              max_model_len=max_len, gpu_memory_utilization=util, dtype=torch.bfloat16,
                              enforce_eager=a.enforce_eager, sleep=False)
        except Exception as exc:  # noqa: BLE001 - record why vLLM did not start, then stop
            res["errors"].append(f"vLLM start: {type(exc).__name__}: {exc}")
            save()
            raise
        res["vllm_startup_s"] = time.perf_counter() - t
        res["vllm_settings"] = {"enforce_eager": a.enforce_eager, "cuda_graphs": not a.enforce_eager,
                                "gpu_memory_utilization": util, "max_num_seqs": max(b for b, _ in vcells or cells),
                                "max_model_len": max_len,
                                "memory_gib": {k: v / GIB if isinstance(v, int) and not isinstance(v, bool) else v
                                               for k, v in (vplan or {}).items()}}
        save()
        for b, mode in vcells:
            if _left(a.deadline_s) < timed.get((b, mode), 20.0) + 15:
                res["skipped"].append(f"vllm b{b} {mode}: deadline")
                continue
            ps, n, reps = work(b, mode)
            veng.generate(prompts[b], params(mode, 1, min(new_tokens[mode], 16)))
            runs = [veng.generate(ps, params(mode, 100 + i, new_tokens[mode], n)) for i in range(reps)]
            res["cells"].append({"engine": "vllm", "batch": b, "mode": mode, "new_tokens": new_tokens[mode],
                                 **cell_summary(runs)})
            if mode == "fixed" and b == min(a.batches) and "logprob_check" not in res:
                res["logprob_check"] = logprob_check(model, runs[0].samples, k=b)
            save()
    elif vllm_next:
        res["skipped"].append("vllm: deadline (no time to start)")
    res["wall_s"] = time.monotonic() - T0
    save()
    print_table(res, a)
    return res


def print_table(res: dict[str, Any], a: argparse.Namespace) -> None:
    print(f"\n{a.shape} NVFP4, LoRA r{a.lora_rank}, prompt {a.prompt_len}, {res['gpu']}, vLLM "
          f"{res.get('vllm_version')} (startup {res.get('vllm_startup_s', 0):.0f} s), checkpoint "
          f"{'reused' if res.get('ckpt_reused') else 'written'} in {res.get('write_ckpt_s', 0):.0f} s")
    print(f"{'engine':8} {'batch':>5} {'mode':6} {'new':>5} {'tokens':>7} {'mean_len':>8} {'e2e tok/s':>10} "
          f"{'gen tok/s':>10} {'ms/step':>8} {'ttft s':>7}")
    for c in res["cells"]:
        mean_len = sum(c["mean_new_tokens"]) / len(c["mean_new_tokens"])
        print(f"{c['engine']:8} {c['batch']:>5} {c['mode']:6} {c['new_tokens']:>5} {c['tokens']:>7} {mean_len:>8.1f} "
              f"{c['e2e_tok_s']:>10.0f} {c['generate_tok_s']:>10.0f} {c['ms_per_longest_token']:>8.2f} "
              f"{c['ttft_s']:>7.3f}")
    if "logprob_check" in res:
        lc = res["logprob_check"]
        print(f"vLLM vs training forward ({lc['tokens']} tokens): k1 {lc['k1']:.2e} k3 {lc['k3']:.2e} "
              f"max|dlogp| {lc['max_abs_dlogp']:.3f} mean|dlogp| {lc['mean_abs_dlogp']:.4f} "
              f"(vs no LoRA {lc['mean_abs_dlogp_vs_no_lora']:.4f})")
    for s in res["skipped"]:
        print("skipped:", s)
    for e in res["errors"]:
        print("error:", e)


if __name__ == "__main__":
    main()
