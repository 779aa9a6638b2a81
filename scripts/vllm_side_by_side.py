"""The builtin rollout engine and ``VllmEngine`` side by side on one GPU, same model, prompts and lengths.

    python scripts/vllm_side_by_side.py --out OUT_DIR [--shape qwen2.5-7b] [--batches 8 64]
        [--prompt-len 256] [--new-tokens 256] [--lora-rank 32] [--deadline-s 540]

One process: a random model of ``--shape`` is built on the GPU with its decoder linears in NVFP4
(``bench.shapes.build_random_model``), written as a compressed-tensors NVFP4A16 checkpoint (its state dict
already uses the checkpoint's tensor names) with a word-level tokenizer over the whole vocabulary, and a
LoRA of ``--lora-rank`` is attached to all seven decoder linears with non-zero B. The builtin engine
generates from that peft model; vLLM serves the written checkpoint (Marlin W4A16 NVFP4 on Hopper) with the
same adapter pushed as tensors. For each batch and each length mode (``fixed``: ``--new-tokens`` always;
``eos``: the bench's stop set of vocab/(new_tokens/2) ids, geometric lengths on a near-uniform random
model) both engines get the same prompts; each cell is warmed up once untimed, then timed ``--repeats``
times (seeds 100, 101, ...: with EOS each repeat draws other lengths; the cell sums them).
Finally vLLM's log-probs of its fixed-length batch are compared with qerl's training forward.

Writes OUT_DIR/side_by_side.json (after every cell, so a deadline keeps what ran) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

T0 = time.monotonic()


def _left(deadline: float) -> float:
    return deadline - (time.monotonic() - T0)


def write_checkpoint(model: torch.nn.Module, out: Path) -> float:
    """compressed-tensors NVFP4A16 checkpoint + word-level tokenizer of ``model`` (a build_random_model)."""
    from qerl_cli.bench.peers import write_shape_checkpoint

    return write_shape_checkpoint(model, out, "nvfp4")


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["fixed", "eos"], choices=["fixed", "eos", "queue"],
                    help="queue: --queue-prompts x --generations sequences, EOS, through the largest batch's slots")
    ap.add_argument("--queue-prompts", type=int, default=32)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--eos-repeats", type=int, default=None, help="timed generates of EOS cells (default --repeats)")
    ap.add_argument("--engines", nargs="+", default=["builtin", "vllm"], choices=["builtin", "vllm"])
    ap.add_argument("--ckpt", default="/tmp/qerl_v7b")
    ap.add_argument("--vllm-gpu-util", type=float, default=0.5)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile / CUDA graphs")
    ap.add_argument("--repeats", type=int, default=3, help="timed generates per cell (seeds 0..repeats-1)")
    ap.add_argument("--deadline-s", type=float, default=540.0)
    a = ap.parse_args()

    from qerl_cli.bench.rollout import attach_bench_lora, bench_stop_ids, precapture_graphs, random_prompts
    from qerl_cli.bench.shapes import build_random_model, get_shape
    from qerl_cli.env_info import environment
    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from qerl_cli.rollout.vllm_engine import VllmEngine

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = get_shape(a.shape)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the builtin side (tiny shape)
    res: dict[str, Any] = {"args": vars(a), "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                           "cells": [], "errors": []}
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
    res["write_ckpt_s"] = write_checkpoint(base, Path(a.ckpt))
    model = attach_bench_lora(base, a.lora_rank, seed=0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # larger B than the bench's 1e-3, so the log-prob check can see the adapter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    max_len = a.prompt_len + a.new_tokens
    eos_ids = bench_stop_ids("eos", spec.vocab, a.new_tokens, None, True)
    stops = {"fixed": [], "eos": eos_ids, "queue": eos_ids}
    prompts = {b: random_prompts(b, a.prompt_len, spec.vocab, set(eos_ids), seed=b) for b in a.batches}
    queue_prompts = random_prompts(a.queue_prompts, a.prompt_len, spec.vocab, set(eos_ids), seed=1000)
    cells = [(b, m) for b in a.batches for m in a.modes if m != "queue" or b == max(a.batches)]
    save()

    def work(b: int, mode: str) -> tuple[list[list[int]], int, int]:
        """(prompts, samples per prompt, timed repeats) of a cell."""
        if mode == "queue":
            return queue_prompts, a.generations, 1
        return prompts[b], 1, (a.eos_repeats or a.repeats) if mode == "eos" else a.repeats

    def params(mode: str, seed: int, max_tokens: int, n: int = 1) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=max_tokens,
                              stop_token_ids=stops[mode], seed=seed)

    if "builtin" in a.engines:
        for b, mode in cells:
            if _left(a.deadline_s) < 60:
                res["errors"].append(f"builtin b{b} {mode}: skipped, deadline")
                continue
            ps, n, reps = work(b, mode)
            eng = BuiltinEngine(model, None, max_batch_slots=b, max_model_len=max_len,
                                gpu_memory_utilization=0.3, dtype=torch.bfloat16)
            try:
                eng.generate(prompts[b], params(mode, 1, min(a.new_tokens, 16)))
                if eng.use_graphs:
                    precapture_graphs(eng, b, shrinking=mode != "fixed")
                if dev == "cuda":
                    torch.cuda.synchronize()
                runs = [eng.generate(ps, params(mode, 100 + i, a.new_tokens, n)) for i in range(reps)]
                res["cells"].append({"engine": "builtin", "batch": b, "mode": mode, **cell_summary(runs)})
            finally:
                eng.release()
                del eng
                if dev == "cuda":
                    torch.cuda.empty_cache()
            save()

    if "vllm" in a.engines and "vllm_version" in res and _left(a.deadline_s) > 120:
        t = time.perf_counter()
        try:
            veng = VllmEngine(model, None, model_dir=a.ckpt, max_batch_slots=max(a.batches), max_model_len=max_len,
                              gpu_memory_utilization=a.vllm_gpu_util, dtype=torch.bfloat16,
                              enforce_eager=a.enforce_eager, sleep=False)
        except Exception as exc:  # noqa: BLE001 - record why vLLM did not start, then stop
            res["errors"].append(f"vLLM start: {type(exc).__name__}: {exc}")
            save()
            raise
        res["vllm_startup_s"] = time.perf_counter() - t
        res["vllm_settings"] = {"enforce_eager": a.enforce_eager, "cuda_graphs": not a.enforce_eager,
                                "gpu_memory_utilization": a.vllm_gpu_util, "max_num_seqs": max(a.batches)}
        save()
        for b, mode in cells:
            if _left(a.deadline_s) < 30:
                res["errors"].append(f"vllm b{b} {mode}: skipped, deadline")
                continue
            ps, n, reps = work(b, mode)
            veng.generate(prompts[b], params(mode, 1, min(a.new_tokens, 16)))
            runs = [veng.generate(ps, params(mode, 100 + i, a.new_tokens, n)) for i in range(reps)]
            res["cells"].append({"engine": "vllm", "batch": b, "mode": mode, **cell_summary(runs)})
            if mode == "fixed" and b == min(a.batches):
                res["logprob_check"] = logprob_check(model, runs[0].samples, k=b)
            save()
    res["wall_s"] = time.monotonic() - T0
    save()
    print(f"\n{a.shape} NVFP4, LoRA r{a.lora_rank}, prompt {a.prompt_len} + up to {a.new_tokens} new, "
          f"{res['gpu']}, vLLM {res.get('vllm_version')} (startup {res.get('vllm_startup_s', 0):.0f} s)")
    print(f"{'engine':8} {'batch':>5} {'mode':6} {'tokens':>7} {'mean_len':>8} {'e2e tok/s':>10} {'gen tok/s':>10} "
          f"{'ms/step':>8} {'ttft s':>7}")
    for c in res["cells"]:
        mean_len = sum(c["mean_new_tokens"]) / len(c["mean_new_tokens"])
        print(f"{c['engine']:8} {c['batch']:>5} {c['mode']:6} {c['tokens']:>7} {mean_len:>8.1f} "
              f"{c['e2e_tok_s']:>10.0f} {c['generate_tok_s']:>10.0f} {c['ms_per_longest_token']:>8.2f} "
              f"{c['ttft_s']:>7.3f}")
    if "logprob_check" in res:
        lc = res["logprob_check"]
        print(f"vLLM vs training forward ({lc['tokens']} tokens): k1 {lc['k1']:.2e} k3 {lc['k3']:.2e} "
              f"max|dlogp| {lc['max_abs_dlogp']:.3f} mean|dlogp| {lc['mean_abs_dlogp']:.4f} "
              f"(vs no LoRA {lc['mean_abs_dlogp_vs_no_lora']:.4f})")
    for e in res["errors"]:
        print("error:", e)


if __name__ == "__main__":
    main()
