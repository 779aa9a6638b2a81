"""Synchronous vs asynchronous RL on the same GPUs (issue 46): one call, three layouts, one table.

``python -m qerl_cli.bench.async_scale --gpus 2`` (not under torchrun) runs, one after the other on the same GPUs:

* ``sync1``: one GPU, synchronous (rollout then update on the same GPU);
* ``ddp``: every GPU synchronous, data parallel (train/distributed.py);
* ``async``: ``--rollout-gpus R`` GPUs only roll out, the others train (train/disagg.py), adapters broadcast
  after every update;
* ``trl_async``: the peer, TRL's AsyncGRPOTrainer with adapter-only sync, its vLLM server on GPU 1 and its trainer
  on GPU 0 (bench/trl_async.py; BF16 + LoRA: vLLM serves TRL's adapters on a BF16 model). Not in the default
  list: it needs vLLM and TRL installed (``bash scripts/gpu.sh vllm trl``); ``--layouts sync1,ddp,async,trl_async``.

Each layout runs the REAL trainer (Trainer.train_step; its rollouts from the rollout ranks in the async layout) on
an in-memory random model of a shape (bench/shapes.py) with LoRA, synthetic token prompts and random rewards per
(prompt, sample). Lengths vary as with EOS: a share ``--stop-frac`` of the vocabulary stops a completion (a random
model spreads its probability, so a completion ends after ~1/stop-frac tokens, capped at --new-tokens; the
measured mean length is reported). What it reports per layout: trained tokens/s (prompt + completion tokens of
the trained batch per second of trainer step), step seconds, the adapter sync's share of the trainer step
(async), the rollout ranks' idle fraction, the staleness and the dropped groups. Default workload: the issue's,
Qwen2.5-7B shape NVFP4, LoRA r32, 64 prompts x 8 samples x (256 + <= 1024) tokens; ``--smoke`` is a small one
(tiny shape, a few tokens) that also runs on CPU (gloo). ``$OUT``-style output: ``--out DIR`` gets one JSON per
layout and ``async_scale.json`` with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from qerl_cli.bench.harness import stamp
from qerl_cli.manifest import atomic_write_json

LAYOUTS = ("sync1", "ddp", "async")
PEER_LAYOUTS = ("trl_async",)
SMOKE = {"shape": "tiny", "batch_prompts": 4, "num_generations": 2, "prompt_len": 8, "new_tokens": 8,
         "lora_rank": 4, "micro_batch_size": 4, "steps": 2, "warmup": 1, "stop_frac": 0.1}
ISSUE = {"shape": "qwen2.5-7b", "batch_prompts": 64, "num_generations": 8, "prompt_len": 256, "new_tokens": 1024,
         "lora_rank": 32, "micro_batch_size": 8, "steps": 3, "warmup": 1, "stop_frac": 1 / 600}


def _with_stops(trainer: Any, stop_frac: float, vocab: int) -> None:
    """Stop tokens: the first ``stop_frac`` of the vocabulary (past the 3 special ids), as an EOS set."""
    n = max(1, int(stop_frac * vocab))
    trainer.rollouter.task.stop_token_ids = list(range(3, 3 + n))


def worker(a: argparse.Namespace) -> dict[str, Any]:
    """One layout, in this process (under torchrun for ddp/async): the trainer ranks' measured steps."""
    from qerl_cli.bench.scale import build_trainer
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.train import disagg
    from qerl_cli.train.distributed import current, init_from_env, shutdown

    init_from_env()
    roles = disagg.init_roles(a.rollout_gpus) if a.layout == "async" else None
    ctx = current()
    trainer = build_trainer(a.shape, a.format, batch_prompts=a.batch_prompts, num_generations=a.num_generations,
                            prompt_len=a.prompt_len, new_tokens=a.new_tokens, lora_rank=a.lora_rank,
                            micro_batch_size=a.micro_batch_size, seed=a.seed,
                            train={"rollout_gpus": a.rollout_gpus if roles else 0,
                                   "max_staleness": a.max_staleness, "correction": "token_tis",
                                   "gpu_memory_utilization": a.gpu_memory_utilization})
    _with_stops(trainer, a.stop_frac, get_shape(a.shape).vocab)
    if roles is not None and roles.role == disagg.ROLLOUT:
        from qerl_cli.train.memory_plan import role_summary

        plan = role_summary(trainer.memory_plan, trainer.settings) if trainer.memory_plan and trainer.settings \
            else None
        disagg.rollout_loop(trainer.rollouter, trainer.updater, roles, plan)
        shutdown()
        return {}
    rec, stop = SimpleNamespace(extra={}), SimpleNamespace(requested=False, preempted=False)
    rows = []
    with disagg.session(trainer, roles, rec, stop):
        for i in range(a.warmup + a.steps):
            ctx.barrier()
            t = time.perf_counter()
            m = trainer.train_step()
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            dt = max(ctx.gather_objects(time.perf_counter() - t))  # a step ends when its slowest trainer does
            if i >= a.warmup:
                rows.append({"step_s": dt, **{k: m.get(k) for k in (
                    "batch/tokens", "completions/mean_length", "timing/rollout_s", "timing/train_s",
                    "dist/rollout_idle_frac", "async/sync_s", "async/rollout_idle_frac", "async/staleness_mean",
                    "async/dropped_stale", "grad_norm")}})
    res: dict[str, Any] = {}
    if ctx.is_main:
        step_s = statistics.median(r["step_s"] for r in rows)
        tokens = statistics.median(r["batch/tokens"] for r in rows)

        def med(key: str) -> float | None:
            vals = [r[key] for r in rows if r.get(key) is not None]
            return statistics.median(vals) if vals else None

        sync_s = med("async/sync_s")
        res = {"layout": a.layout, **stamp(), "gpus": int(os.environ.get("WORLD_SIZE", "1")), "rollout_gpus":
               a.rollout_gpus if roles else 0, "device": str(trainer.device),
               "gpu": torch.cuda.get_device_name() if trainer.device.type == "cuda" else None,
               "step_s_median": step_s, "trained_tokens_per_step": tokens,
               "trained_tokens_per_s": tokens / step_s, "mean_completion_length": med("completions/mean_length"),
               "sync_share": None if sync_s is None else sync_s / step_s,
               "rollout_idle_frac": med("async/rollout_idle_frac") if roles else med("dist/rollout_idle_frac"),
               "staleness_mean": med("async/staleness_mean"),
               "dropped_stale": sum(r.get("async/dropped_stale") or 0 for r in rows),
               "async": rec.extra.get("async"), "config": {k: getattr(a, k) for k in (
                   "shape", "format", "batch_prompts", "num_generations", "prompt_len", "new_tokens", "lora_rank",
                   "micro_batch_size", "steps", "warmup", "stop_frac", "max_staleness", "seed")},
               "steps_detail": rows}
        if a.out:
            atomic_write_json(Path(a.out), res)
    shutdown()
    return res


def table(results: list[dict[str, Any]]) -> list[str]:
    def f(v: Any, fmt: str = "{:.3g}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = ["| layout | GPUs | rollout GPUs | trained tokens/s | step s | sync share | rollout idle | staleness "
             "| dropped stale | mean length |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status", "ok") != "ok":  # a peer that did not run: why, in its row
            lines.append(f"| {r['layout']} | {r['gpus']} | {r['rollout_gpus']} | {r['status']} | | | | | | |")
            continue
        name = r["layout"] + (" (SDPA stand-in)" if str(r.get("attention", "")).startswith("torch SDPA") else "")
        lines.append(f"| {name} | {r['gpus']} | {r['rollout_gpus']} | {f(r['trained_tokens_per_s'], '{:.0f}')} "
                     f"| {f(r['step_s_median'])} | {f(r['sync_share'])} | {f(r.get('rollout_idle_frac'))} "
                     f"| {f(r.get('staleness_mean'))} | {_dropped(r)} "
                     f"| {f(r.get('mean_completion_length'))} |")
    return lines


def _dropped(row: dict[str, Any]) -> str:
    """Groups dropped stale (qerl's layouts), or the peer's count in its own unit (TRL drops single samples)."""
    if row.get("dropped_stale") is None and "dropped_stale_samples" in row:
        return f"{row['dropped_stale_samples']:.0f} samples"
    return str(row.get("dropped_stale", 0))


def driver(a: argparse.Namespace, rest: list[str]) -> int:
    """The three layouts one after the other on the same ``--gpus`` (CPU: gloo processes); the table."""
    out = Path(a.out or "async_scale_out")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", "1")
    me = [sys.executable, "-m", "qerl_cli.bench.async_scale", "--worker"]
    port = 29500 + os.getpid() % 1000

    def torchrun(n: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m",
                "qerl_cli.bench.async_scale", "--worker"] if torch.cuda.is_available() else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
            f"--master-port={port}", "-m", "qerl_cli.bench.async_scale", "--worker"]

    runs = {"sync1": (me, {"CUDA_VISIBLE_DEVICES": "0"} if torch.cuda.is_available() else {}),
            "ddp": (torchrun(a.gpus), {}), "async": (torchrun(a.gpus), {})}
    results = []
    for layout in a.layouts.split(","):
        path = out / f"{layout}.json"
        if layout == "trl_async":  # its own processes (a vLLM server, TRL's trainer), started from here
            from qerl_cli.bench.trl_async import run_trl_async

            print(f"== {layout}: TRL's AsyncGRPOTrainer, vLLM server on GPU 1, trainer on GPU 0", flush=True)
            row = {**run_trl_async(a, path), **stamp()}
            row["config"] = {k: getattr(a, k) for k in ("shape", "batch_prompts", "num_generations", "prompt_len",
                                                        "new_tokens", "lora_rank", "steps", "warmup", "stop_frac",
                                                        "max_staleness", "seed")}
            atomic_write_json(path, row)
            results.append(row)
            continue
        cmd, extra = runs[layout]
        args = [*cmd, *rest, "--layout", layout, "--out", str(path)]
        print(f"== {layout}: {' '.join(args)}", flush=True)
        rc = subprocess.run(args, env={**env, **extra}).returncode
        if rc != 0:
            print(f"error: layout {layout} failed (exit code {rc})", file=sys.stderr)
            return rc
        results.append(json.loads(path.read_text()))
    lines = table(results)
    print("\n".join(lines))
    atomic_write_json(out / "async_scale.json", {**stamp(), "results": results, "table": lines})
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, help="GPUs (CPU: gloo processes) of the ddp and async layouts")
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help="comma-separated, of " + ", ".join(LAYOUTS + PEER_LAYOUTS))
    ap.add_argument("--smoke", action="store_true", help="the small workload (tiny shape; runs on CPU)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="async", help=argparse.SUPPRESS)
    ap.add_argument("--rollout-gpus", type=int, default=1)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--out", default=None, help="driver: the output folder; worker: its JSON file")
    for k, v in ISSUE.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"default {v} ({SMOKE[k]} "
                        "with --smoke)")
    return ap


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    base = SMOKE if a.smoke else ISSUE
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.worker:
        worker(a)
        return
    unknown = [x for x in a.layouts.split(",") if x not in LAYOUTS + PEER_LAYOUTS]
    if unknown:
        print(f"error: unknown layout {', '.join(unknown)}; the layouts are {', '.join(LAYOUTS + PEER_LAYOUTS)}",
              file=sys.stderr)
        sys.exit(2)
    # the workload options go to every layout's worker as given (the worker fills in the same defaults)
    rest = _drop_values(sys.argv[1:], ("--gpus", "--layouts", "--out"))
    sys.exit(driver(a, rest))


def _drop_values(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in names:
            skip = True
        elif not x.startswith(tuple(n + "=" for n in names)):
            out.append(x)
    return out


if __name__ == "__main__":
    main()
