"""Data-parallel scaling of one RL step: run under torchrun at 1, 2, 4 ranks and compare.

Each rank builds the same random model of a shape (qerl_cli/bench/shapes.py) on its device with LoRA and
runs the REAL trainer step (Trainer.train_step: store-counter rollout share, all-gather of the batch,
advantages, row-sharded backward, summed gradients, optimizer) on synthetic token prompts with
fixed-length generation (EOS disabled) and random rewards seeded per (prompt, sample), so advantages are
non-zero. Rank 0 writes a JSON with per-step seconds and global tokens/s (prompt + generated tokens of
the whole batch per step second); tokens/s per GPU at N ranks over tokens/s at 1 rank is the scaling
efficiency. ``python -m qerl_cli.bench.scale --help`` for the options; ``bash scripts/gpu.sh scale`` runs it at
1, 2 and 4 GPUs and ``python -m qerl_cli.bench.scale --table DIR`` prints the table of the results in DIR.

``--finetune full --rollout-quant int8 --sharding fsdp2`` (format bf16: the trained weights are full precision)
is FlashRL mode on FSDP2 (train/fsdp.py): every weight trains, sharded over the ranks, rollouts from an INT8
copy re-quantized from the sharded masters after each step; ``--fsdp-offload`` keeps the sharded state in
host memory. The result then also holds each phase's peak GPU memory per rank (``memory/*_peak_gb`` of every
rank's step metrics: the max over ranks is the per-GPU peak). ``bash scripts/gpu.sh fsdp`` runs that mode.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.manifest import atomic_write_json
from qerl_cli.precision import dtype_of


def _reward(prompts: list[str], completions: list[str], answer: list[str] | None = None, **_: Any) -> list[float]:
    # the prompt string is the example's global index; the samples of one prompt arrive contiguously, so
    # the position modulo the group is the sample index: the reward is a function of (prompt, sample)
    g = _reward.group  # type: ignore[attr-defined]
    return [random.Random(f"{p}/{j % g}").random() for j, p in enumerate(prompts)]


def build_trainer(shape: str, fmt: str, *, batch_prompts: int, num_generations: int, prompt_len: int,
                  new_tokens: int, lora_rank: int, micro_batch_size: int, seed: int, num_prompts: int = 4096,
                  device: str | None = None, train: dict[str, Any] | None = None) -> Any:
    """A Trainer over an in-memory random shape model (no run directory), on this rank's device; ``train``:
    more TrainConfig fields (finetune, rollout_quant, sharding, fsdp_offload, gradient_checkpointing, ...)."""
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.bench.step import build_shape_model
    from qerl_cli.device import pick as pick_device
    from qerl_cli.manifest import RunDir
    from qerl_cli.tasks.datasets import Example, Task
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.distributed import current
    from qerl_cli.train.trainer import Trainer

    ctx = current()
    dev = pick_device(device or ctx.device)
    fields = {"algo": "dapo", "steps": 10**6, "batch_prompts": batch_prompts, "num_generations": num_generations,
              "max_completion_length": new_tokens, "lora_rank": lora_rank,
              "precision": "bf16" if dev.type == "cuda" else "fp32", "micro_batch_size": micro_batch_size,
              "dynamic_sampling": False, "overlong_buffer": 0, "seed": seed, "log_rollouts": False, "lr": 1e-5,
              **(train or {})}
    cfg = TrainConfig(**fields)
    cfg.validate()
    cfg = cfg.resolved()
    dtype = dtype_of(cfg.precision)
    model = build_shape_model(get_shape(shape), fmt, dev, dtype, seed)  # no EOS: fixed-length generation
    task = Task("synthetic", "train", [Example(prompt=str(i), answer="") for i in range(num_prompts)],
                "bench_random", (), lambda q: q, max_new_tokens=new_tokens)
    _reward.group = num_generations  # type: ignore[attr-defined]
    vocab = get_shape(shape).vocab
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab - 1, (num_prompts, prompt_len), generator=g).tolist()
    # the Trainer's own setup (LoRA, engine, optimizer) over the in-memory model; its run directory is a
    # per-rank scratch folder that nothing reads (the bench never saves)
    t = Trainer(RunDir(Path(tempfile.mkdtemp(prefix=f"qerl-scale-r{ctx.rank}-"))), cfg, device=str(dev))
    t.setup(model=model, tokenizer=None, task=task, prompt_ids=prompt_ids, reward_fn=_reward)
    return t


PHASE_TIMES = ("rollout", "recompute", "fwd_bwd", "optimizer", "requant", "train")
PEAK_PHASES = ("rollout", "recompute", "fwd_bwd", "optimizer", "requant")


def run(shape: str = "tiny", fmt: str = "nvfp4", steps: int = 3, warmup: int = 1, batch_prompts: int = 8,
        num_generations: int = 4, prompt_len: int = 64, new_tokens: int = 32, lora_rank: int = 16,
        micro_batch_size: int = 8, seed: int = 0, out: str | Path | None = None,
        train: dict[str, Any] | None = None) -> dict[str, Any]:
    from qerl_cli.train.distributed import current, init_from_env

    init_from_env()
    ctx = current()
    t0 = time.perf_counter()
    trainer = build_trainer(shape, fmt, batch_prompts=batch_prompts, num_generations=num_generations,
                            prompt_len=prompt_len, new_tokens=new_tokens, lora_rank=lora_rank,
                            micro_batch_size=micro_batch_size, seed=seed, train=train)
    build_s = time.perf_counter() - t0
    on_cuda = trainer.device.type == "cuda"
    build_peak = torch.cuda.max_memory_allocated(trainer.device) / 2**30 if on_cuda else None
    rows = []
    for i in range(warmup + steps):
        ctx.barrier()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        m = trainer.train_step()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        dt = max(ctx.gather_objects(dt))  # a step ends when its slowest rank does
        # each rank's phase peaks (its own GPU): the per-GPU peak of a phase is the max over ranks
        peaks = ctx.gather_objects({p: m.get(f"memory/{p}_peak_gb") for p in PEAK_PHASES})
        if i >= warmup:
            rows.append({"step_s": dt, **{k: m.get(k) for k in (
                "timing/rollout_s", "timing/recompute_s", "timing/train_s", "timing/rollout_tokens_per_s",
                "timing/fwd_bwd_s", "timing/optimizer_s", "timing/requant_s",
                "dist/rollout_s_max", "dist/rollout_s_min", "dist/rollout_idle_frac", "grad_norm", "reward",
                "memory/peak_gb")}, "rank_peaks_gb": peaks})
    tokens = batch_prompts * num_generations * (prompt_len + new_tokens)
    step_s = statistics.median(r["step_s"] for r in rows) if rows else float("nan")

    def peak(phase: str) -> float | None:
        vals = [v for r in rows for rank in r["rank_peaks_gb"] for k, v in rank.items() if k == phase and v is not None]
        return max(vals) if vals else None

    c = trainer.cfg
    res = {"shape": shape, "format": fmt, "world_size": ctx.world_size, "backend": ctx.backend,
           "mode": {"finetune": c.finetune, "sharding": c.sharding, "rollout_quant": c.rollout_quant,
                    "fsdp_offload": c.fsdp_offload, "precision": c.precision,
                    "gradient_checkpointing": trainer.settings.gradient_checkpointing},
           "phase_s": {p: statistics.median(r.get(f"timing/{p}_s") or 0.0 for r in rows) if rows else None
                       for p in PHASE_TIMES},
           "peak_gb": {p: peak(p) for p in PEAK_PHASES}, "build_peak_gb": max(ctx.gather_objects(build_peak))
           if on_cuda else None,
           "device": str(trainer.device), "gpu": torch.cuda.get_device_name() if on_cuda else None,
           "config": {"batch_prompts": batch_prompts, "num_generations": num_generations, "prompt_len": prompt_len,
                      "new_tokens": new_tokens, "lora_rank": lora_rank, "micro_batch_size": micro_batch_size,
                      "steps": steps, "warmup": warmup, "seed": seed},
           "build_s": build_s, "step_s_median": step_s, "tokens_per_step": tokens,
           "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / ctx.world_size,
           "generated_tokens_per_s": batch_prompts * num_generations * new_tokens / step_s, "steps_detail": rows}
    if ctx.is_main and out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(out), res)
    return res


def scaling_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Efficiency of each world size: tokens/s per GPU over the 1-rank tokens/s (same shape and config)."""
    base = next((r for r in results if r["world_size"] == 1), None)
    out = []
    for r in sorted(results, key=lambda r: r["world_size"]):
        eff = r["tokens_per_s_per_gpu"] / base["tokens_per_s"] if base else None
        out.append({"world_size": r["world_size"], "step_s": r["step_s_median"], "tokens_per_s": r["tokens_per_s"],
                    "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "efficiency": eff,
                    "idle_frac": statistics.mean(d["dist/rollout_idle_frac"] or 0.0 for d in r["steps_detail"])
                    if r["world_size"] > 1 and r["steps_detail"] else 0.0})
    return out


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table_lines(results: list[dict[str, Any]]) -> list[str]:
    """The scaling table as text: per world size the step, tokens/s in all and per GPU, the efficiency and the
    ranks' idle share of the rollout; where the results hold them (full fine-tuning), whether the state was
    offloaded, each phase's seconds and each phase's per-GPU peak GiB."""
    r0, c = results[0], results[0]["config"]
    by_n = {r["world_size"]: r for r in results}
    phases = all(r.get("phase_s") and r.get("peak_gb") for r in results)
    lines = [f"== {r0['shape']} {r0['format']} on {r0.get('gpu') or r0.get('device')}: "
             f"{c['batch_prompts'] // r0['world_size']} prompts per GPU x {c['num_generations']} generations, "
             f"{c['prompt_len']}+{c['new_tokens']} tokens, median of {c['steps']} steps"]
    head = f"{'GPUs':>4} {'step_s':>8} {'tok/s':>9} {'tok/s/GPU':>9} {'eff':>6} {'idle':>6}"
    if phases:
        head += f" {'offload':>7} " + " ".join(f"{p[:7] + ' s':>9}" for p in PHASE_TIMES[:-1])
        head += " " + " ".join(f"{p[:7] + ' GiB':>11}" for p in PEAK_PHASES)
    lines.append(head)
    for t in scaling_table(results):
        r = by_n[t["world_size"]]
        eff = "-" if t["efficiency"] is None else f"{t['efficiency']:.1%}"
        row = (f"{t['world_size']:>4} {t['step_s']:>8.2f} {t['tokens_per_s']:>9.0f} {t['tokens_per_s_per_gpu']:>9.0f} "
               f"{eff:>6} {t['idle_frac']:>6.1%}")
        if phases:
            row += f" {'yes' if r['mode']['fsdp_offload'] else 'no':>7} "
            row += " ".join(f"{_num(r['phase_s'].get(p)):>9}" for p in PHASE_TIMES[:-1])
            row += " " + " ".join(f"{_num(r['peak_gb'].get(p)):>11}" for p in PEAK_PHASES)
        lines.append(row)
    return lines


def write_table(folder: Path) -> list[str]:
    """Every ``<name>_w<N>.json`` in ``folder`` (one run per world size) into ``<name>.json`` (results + table),
    and the table's lines."""
    files = sorted(folder.glob("*_w*.json"))
    if not files:
        raise QerlError(f"no <name>_w<N>.json results in {folder}: run the bench at some world size first")
    results = [json.loads(f.read_text()) for f in files]
    name = files[0].stem.rsplit("_w", 1)[0]
    atomic_write_json(folder / f"{name}.json", {"results": results, "table": scaling_table(results)})
    return table_lines(results)


def main() -> None:
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--table":  # no torchrun: the summary of earlier runs
        try:
            print("\n".join(write_table(Path(sys.argv[2]))))
        except QerlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="--table DIR: the table of the "
                                 "<name>_w<N>.json results in DIR, written to DIR/<name>.json")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch-prompts", type=int, default=8, help="Global prompts per step.")
    ap.add_argument("--batch-prompts-per-rank", type=int, default=None,
                    help="Prompts per rank (global = this x world size: weak scaling); overrides --batch-prompts.")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--finetune", default="lora", help="lora, or full (FlashRL mode: needs --format bf16)")
    ap.add_argument("--rollout-quant", default="none", help="FlashRL rollout copy: int8, fp8, nvfp4, mxfp4")
    ap.add_argument("--sharding", default="auto", help="auto, none, ddp or fsdp2")
    ap.add_argument("--fsdp-offload", action="store_true", help="fsdp2: sharded state in pinned host memory")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="the KV-cache budget as a fraction of the GPU (full fine-tuning holds much more than LoRA)")
    a = ap.parse_args()
    import os

    if a.batch_prompts_per_rank:
        a.batch_prompts = a.batch_prompts_per_rank * int(os.environ.get("WORLD_SIZE", "1"))
    train = {"finetune": a.finetune, "rollout_quant": a.rollout_quant, "sharding": a.sharding,
             "fsdp_offload": a.fsdp_offload, "gpu_memory_utilization": a.gpu_memory_utilization,
             **({"gradient_checkpointing": True} if a.gradient_checkpointing else {})}
    res = run(a.shape, a.format, a.steps, a.warmup, a.batch_prompts, a.num_generations, a.prompt_len, a.new_tokens,
              a.lora_rank, a.micro_batch_size, a.seed, a.out, train)
    if res["world_size"] == 1 or __import__("qerl_cli.train.distributed", fromlist=["x"]).current().is_main:
        print(json.dumps({k: res[k] for k in ("world_size", "step_s_median", "tokens_per_s", "tokens_per_s_per_gpu")}))
    from qerl_cli.train.distributed import shutdown

    shutdown()


if __name__ == "__main__":
    main()
