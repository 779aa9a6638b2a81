"""`qerl bench step`: one RL step of the real trainer, broken down by phase, per weight format.

Every step is ``Trainer.train_step()`` followed by ``Trainer.save()`` (qerl_cli/train/trainer.py), on a
Trainer whose model is built here and injected (``Trainer.setup(model=...)``), with its checkpoints
in a scratch run directory that is deleted afterwards. Phases, as the trainer times them (on CUDA each
boundary synchronizes, and each phase's peak memory is counted from its own start):

  aqn         drawing this step's noisy RMSNorm weights (0 without AQN)
  rollout     generation with the builtin engine and reward scoring
  recompute   the no-grad training forward that gives pi_old (and the mismatch metrics)
  fwd_bwd     forward + backward of the policy loss over the micro-batches
  optimizer   unscale, clip, AdamW step, scheduler
  requant     FlashRL mode: re-quantizing the rollout copy from the updated weights (0 otherwise)
  checkpoint  ``Trainer.save()`` (adapter + optimizer state, atomically)
  other       the step's wall time minus the phases (advantages, batch building, bookkeeping)

Warm-up steps (Triton compiles, CUDA graph captures, allocator growth) are run and discarded; each
number is the median over the measured steps. The speed-up is the BF16-LoRA step time over the format's.

Models: ``shape`` builds a random model of a real architecture on the device (bench/shapes.py) with
synthetic token prompts of ``prompt_len`` tokens, generation forced to ``max_completion_length`` tokens
(EOS ignored), no tokenizer, and seeded uniform random rewards (every group has distinct rewards, so
advantages are non-zero and the update does real work). ``run_dir`` uses the run's model, task and
reward (real lengths: EOS and stop strings end samples); formats other than the run's are quantized
from the run's source into ``<out>/models/<format>`` (bench/runmodels.py). ``nf4`` is QLoRA through
bitsandbytes' 4-bit matmul and needs CUDA and bitsandbytes (else skipped with the reason).
A format ``BASE+ROLLOUT`` (e.g. ``bf16+int8``) is the FlashRL setting: the trained model in ``BASE``,
rollouts through a copy quantized to ``ROLLOUT`` and re-quantized after every update (``rollout_quant``),
corrected by token TIS; its speed-up is still measured against the plain ``bf16`` row.
Peers (bench/peers.py): a format ``FMT@vllm`` runs the same trainer with the vLLM rollout engine (QeRL's
architecture, the random model written as a checkpoint vLLM serves); ``peers=("trl",)`` adds TRL's
GRPOTrainer with LoRA and colocated vLLM on the BF16 model, in its own process.
``eos``: rollouts end at a stop set of ``vocab / (max_completion_length / 2)`` token ids (geometric lengths,
mean about half the maximum, as ``bench rollout --eos``), so the training phases see real padding.
Per cell also: the rollout's milliseconds per decode token-step (the whole phase, and the engine's decode part
alone), the training phases' TFLOP/s and MFU against the BF16 matmul ceiling measured once per run
(bench/flops.py), and with ``profile`` the decode step's GPU time by category on the step's own engine.
A mixture-of-experts cell also records its update's routing as the trainer logs it (``moe.router_metrics``,
``router/*``): per step ``router`` in ``steps``, and the median over the measured steps as the cell's ``router``
(``replay_disagreement``, ``load_cv``, ``load_max``, ``load_min``, ``aux_loss``, ``dropped_tokens``).
Outputs (written last, each atomically): ``step.json`` and ``step.png`` (stacked phase bars).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qerl_cli.bench import harness, kernels_ran
from qerl_cli.bench.cells import check_cell, parse_cell
from qerl_cli.bench.harness import figure, num, save_figure
from qerl_cli.errors import QerlError
from qerl_cli.formats import FORMATS, REFERENCE, get_format, rollout_formats
from qerl_cli.manifest import jsonable
from qerl_cli.precision import dtype_of
from qerl_cli.train.phases import CHECKPOINT, STEP_PHASES

PEAK_COLUMNS = ("rollout", "recompute", "fwd_bwd", "optimizer", "checkpoint")  # the table's peak-memory columns
DEFAULT_FORMATS = ("bf16", "nvfp4", "nf4")
PEERS = ("trl",)
SCHEMA = 1


def default_config(device: torch.device, warmup: int, measure: int) -> dict[str, Any]:
    """The bench's TrainConfig defaults (user --set values go on top)."""
    return {
        "batch_prompts": 8, "num_generations": 8, "max_completion_length": 256, "lora_rank": 32,
        "precision": "bf16" if device.type == "cuda" else "fp32", "lr": 1e-5,
        "steps": warmup + measure, "save_steps": 10**9, "keep_checkpoints": 1, "log_rollouts": False,
        "aqn": True, "aqn_stages": max(1, warmup + measure),
    }


def nf4_skip_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "skipped: NF4 QLoRA runs through bitsandbytes, which needs a CUDA GPU"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "skipped: bitsandbytes is not installed (pip install bitsandbytes)"
    return None


def synthetic_reward(seed: int) -> Callable[..., list[float]]:
    """Uniform random rewards from a seeded stream: distinct within a group, so advantages are non-zero."""
    gen = torch.Generator().manual_seed(seed)

    def synthetic_random_reward(prompts: Any, completions: Any, answer: Any = None, **kw: Any) -> list[float]:
        return torch.rand(len(completions), generator=gen, dtype=torch.float64).tolist()

    return synthetic_random_reward


def synthetic_prompts(n: int, length: int, vocab: int, seed: int, avoid_top: int = 1) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids; the last ``avoid_top`` ids (EOS, the stop set) never drawn."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab - avoid_top) for _ in range(length)] for _ in range(n)]


def stop_set(vocab: int, completion_len: int, eos: bool) -> list[int]:
    """The shape workload's stop ids: none (fixed lengths) or ``bench rollout``'s EOS set (the top ids)."""
    from qerl_cli.bench.rollout import bench_stop_ids

    return (bench_stop_ids("eos", vocab, completion_len, None, True) or []) if eos else []


def measured_rates(device: torch.device, ceiling: float | None) -> Any:
    """The device's rates for the memory plan's cost model (train/step_cost.py), measured here: the BF16 matmul
    ceiling and the copy bandwidth; None off CUDA."""
    if device.type != "cuda" or ceiling is None:
        return None
    from qerl_cli.train.step_cost import DeviceRates, default_rates

    known = default_rates(torch.cuda.get_device_name(device))
    copy = harness.copy_bandwidth_gbps(device)
    return DeviceRates(ceiling, copy or known.copy_gbps, known.gpu, "measured")


def _synthetic_task(n: int, prompt_len: int, completion_len: int, stop_ids: list[int] | None = None) -> Any:
    from qerl_cli.tasks.datasets import Example, Task

    examples = [Example(prompt=f"<synthetic prompt {i}: {prompt_len} random token ids>", answer="")
                for i in range(n)]
    return Task("synthetic", "train", examples, "synthetic_random_reward", (), lambda q: q,
                max_new_tokens=completion_len, stop_token_ids=tuple(stop_ids or ()))


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def step_router_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The trainer's ``router/*`` metrics of one step (``moe.router_metrics``, read once per update) without the
    prefix: ``replay_disagreement``, ``load_cv``, ... ; empty for a dense model."""
    return {k.removeprefix("router/"): float(v) for k, v in metrics.items() if k.startswith("router/")}


def median_router_metrics(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Per router metric, the median over the measured ``steps`` that logged it (as every other number of a cell;
    an even count takes the mean of the middle two); empty for a dense model. A key some steps lack (no recorded
    routing to compare with) is the median of those that have it."""
    keys = dict.fromkeys(k for r in steps for k in r.get("router") or {})
    return {k: statistics.median([r["router"][k] for r in steps if k in (r.get("router") or {})]) for k in keys}


def _known_cell(text: str, bases: tuple[str, ...], rollouts: tuple[str, ...]) -> bool:
    try:
        return check_cell(parse_cell(text), bases, rollouts)
    except QerlError:
        return False


# ---- one format ---------------------------------------------------------------------------------
def build_shape_model(spec: Any, fmt: str, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from qerl_cli.bench.shapes import build_random_model

    model = build_random_model(spec, fmt, device, dtype=dtype, seed=seed)
    # Fixed-length generation: with no EOS id anywhere (and no tokenizer) the engine never stops early.
    model.config.eos_token_id = None
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None
    return model


def _measure(trainer: Any, warmup: int, measure: int, log: Callable[[str], None], label: str) -> list[dict[str, Any]]:
    """Run warm-up + measured steps (train_step + save); per measured step: phase seconds, tokens, peaks."""
    on_cuda = trainer.device.type == "cuda"
    rows = []
    for i in range(warmup + measure):
        t0 = trainer.phases.clock()
        m = trainer.train_step()
        rec = trainer.last_step  # the step's phases, typed (train/phases.py)
        reserved = torch.cuda.max_memory_reserved(trainer.device) / 2**30 if on_cuda else None
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(trainer.device)
        trainer.save()
        step_s = trainer.phases.clock() - t0
        n_seq = trainer.cfg.batch_prompts * trainer.cfg.num_generations
        row = {f"{p}_s": rec.seconds(p) for p in STEP_PHASES if p != CHECKPOINT}
        row["checkpoint_s"] = trainer.checkpoints.last_checkpoint_s
        # the background checkpoint's critical path
        for part, secs in trainer.checkpoints.last_checkpoint_parts.items():
            row[f"checkpoint_{part}_s"] = secs
        row["step_s"] = step_s
        row["other_s"] = step_s - sum(row[f"{p}_s"] for p in STEP_PHASES)
        row["rollout_tokens"] = int(rec.rollout_tokens)
        row["generated_tokens"] = int(round(m["completions/mean_length"] * n_seq))
        row["sequences"] = n_seq
        row["accuracy"] = m.get("accuracy")
        row["loss"] = m.get("loss")
        row["reward"] = m.get("reward")
        for k in ("tokens", "padded_tokens", "attention_pairs", "loss_tokens"):
            row[f"batch_{k}"] = m.get(f"batch/{k}")
        row["decode_steps"] = rec.decode_steps
        row["pi_old_pass"] = float(rec.pi_old_pass)  # 0: pi_old came from the update's own forward
        row["rollout_decode_s"] = rec.rollout_decode_s
        row["rollout_prefill_s"] = rec.rollout_prefill_s
        router = step_router_metrics(m)
        if router:  # a mixture of experts: its update's routing, as the trainer logs it (router/*)
            row["router"] = router
        if on_cuda:
            for p in STEP_PHASES[:-1]:
                row[f"mem_{p}_gb"] = rec.peak_gb(p)
                row[f"end_{p}_gb"] = rec.end_gb(p)  # still allocated when the phase ended
            row["mem_checkpoint_gb"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
            row["end_checkpoint_gb"] = torch.cuda.memory_allocated(trainer.device) / 2**30
            row["peak_gb"] = max(v for k, v in row.items() if k.startswith("mem_") and v is not None)
            # what the allocator held at its most during the step (train_step to before the checkpoint): the
            # difference to peak_gb is what fragmentation cost (the plan's reserve is sized for it)
            row["reserved_peak_gb"] = reserved
        row["warmup"] = i < warmup
        rows.append(row)
        log(f"{label} step {i + 1}{' (warm-up)' if i < warmup else ''}: {step_s:.2f}s = rollout "
            f"{row['rollout_s']:.2f} + recompute {row['recompute_s']:.2f} + fwd+bwd {row['fwd_bwd_s']:.2f} + "
            f"optimizer {row['optimizer_s']:.3f} + aqn {row['aqn_s']:.3f} + requant {row['requant_s']:.3f} + "
            f"checkpoint {row['checkpoint_s']:.2f} "
            f"+ other {row['other_s']:.2f}; {row['rollout_tokens']} tokens")
    return rows


def _summarize(rows: list[dict[str, Any]], prompt_len: float) -> dict[str, Any]:
    meas = [r for r in rows if not r["warmup"]]
    out: dict[str, Any] = {k: _median([r.get(k) for r in meas]) for k in
                           [f"{p}_s" for p in STEP_PHASES] + ["other_s", "step_s", "rollout_tokens", "generated_tokens",
                                                         "batch_tokens", "batch_padded_tokens",
                                                         "batch_attention_pairs", "batch_loss_tokens", "decode_steps",
                                                         "pi_old_pass", "checkpoint_wait_s", "checkpoint_state_s",
                                                         "checkpoint_snapshot_s", "checkpoint_rng_s",
                                                         "checkpoint_submit_s", "rollout_decode_s",
                                                         "rollout_prefill_s"]}
    out["sequences"] = meas[0]["sequences"]
    router = median_router_metrics(meas)
    if router:
        out["router"] = router
    gen = out["generated_tokens"]
    train_tokens = out["sequences"] * prompt_len + gen  # tokens each training forward processes
    out["train_tokens"] = train_tokens
    out["rollout_tok_s"] = out["rollout_tokens"] / out["rollout_s"] if out["rollout_s"] else None
    out["recompute_tok_s"] = train_tokens / out["recompute_s"] if out["recompute_s"] else None
    out["fwd_bwd_tok_s"] = train_tokens / out["fwd_bwd_s"] if out["fwd_bwd_s"] else None
    out["step_tok_s"] = gen / out["step_s"] if out["step_s"] else None
    steps = out.get("decode_steps")
    # the rollout phase per decode token-step (prefill, scoring, engine set-up included) and the engine's decode
    # alone: what `bench rollout` reports as decode ms/step at the same batch and context
    out["rollout_ms_per_token_step"] = 1000.0 * out["rollout_s"] / steps if steps else None
    out["decode_ms_per_step"] = 1000.0 * out["rollout_decode_s"] / steps if steps and out.get("rollout_decode_s") \
        else None
    if out.get("batch_tokens") and out.get("batch_padded_tokens"):
        out["padding_pct"] = 100.0 * (1.0 - out["batch_tokens"] / out["batch_padded_tokens"])
    if "peak_gb" in meas[0]:
        for p in STEP_PHASES:
            out[f"mem_{p}_gb"] = max((r.get(f"mem_{p}_gb") or 0.0) for r in rows)
        out["peak_gb"] = max(r["peak_gb"] for r in rows)
        out["reserved_peak_gb"] = max(r["reserved_peak_gb"] for r in rows)
    out["steps"] = rows
    return out


def time_estimates(trainer: Any, row: dict[str, Any], prompt_len: float, rates: Any) -> dict[str, float]:
    """The cost model's seconds per phase (train/step_cost.py) for the work this cell measured (its tokens,
    completion lengths, attention pairs) with the settings it ran with: ``est_<phase>_s`` beside ``<phase>_s``.
    Empty without a GPU plan."""
    plan = trainer.memory_plan
    if plan is None or plan.estimate is None or not row.get("sequences"):
        return {}
    from qerl_cli.train.memory_plan import ModelDims, cost_base
    from qerl_cli.train.step_cost import DeviceRates, Setting, Workload, estimate_step

    c, s, n = trainer.cfg, trainer.settings, row["sequences"]
    base = cost_base(ModelDims.from_config(trainer.model.config), plan.weight_parts, trainer.dtype.itemsize,
                     trainer.cfg.lora_dropout > 0)
    work = Workload(n, prompt_len, c.max_completion_length, c.lora_rank, tuple(c.lora_targets),
                    mean_completion=(row.get("generated_tokens") or n * c.max_completion_length) / n,
                    old_pass=trainer.updater.needs_old_pass(), reference_pass=c.beta > 0,
                    train_tokens=row.get("batch_tokens"),
                    attention_pairs=row.get("batch_attention_pairs"), loss_tokens=row.get("batch_loss_tokens"))
    setting = Setting(s.micro_batch_size, s.gradient_checkpointing, s.kernel_weight_copies, s.optimizer_offload,
                      s.kv_slots, s.keep_rollout_cache)
    est = estimate_step(base, work, setting, rates or DeviceRates(**plan.rates))
    return {**{f"est_{p}_s": v for p, v in est.phases.items()}, "est_step_s": est.step_s}


# ---- the bench ----------------------------------------------------------------------------------
def bench_step(
    *,
    run_dir: Path | None = None,
    shape: str | None = None,
    formats: Iterable[str] | None = None,
    overrides: dict[str, Any] | None = None,
    prompt_len: int = 256,
    warmup: int = 1,
    measure: int = 3,
    out_dir: Path | None = None,
    seed: int = 0,
    memory_cap_gib: float | None = None,
    time_budget_s: float | None = None,
    peers: Iterable[str] | None = None,
    eos: bool = False,
    profile: bool = False,
    vllm_memory: float = 0.35,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time the real RL step per format; write ``step.json`` + ``step.png``; return the result.

    Exactly one of ``run_dir`` / ``shape``. ``overrides`` are TrainConfig fields (``--set``) on top of
    :func:`default_config`; with ``shape`` they size the batch (``batch_prompts`` x ``num_generations``
    sequences of ``prompt_len`` + ``max_completion_length`` tokens). ``formats`` default: bf16, nvfp4, nf4
    (``shape``) or the run's format (``run_dir``). ``time_budget_s`` skips formats that would start after it.
    A format ``FMT@vllm`` runs with the vLLM rollout engine; ``peers`` ("trl") adds TRL's GRPOTrainer
    (bench/peers.py). ``eos``: shape rollouts end at the bench's stop set. ``profile``: the decode step's GPU
    time by category on each builtin cell's own engine (CUDA). ``vllm_memory``: vLLM's
    ``gpu_memory_utilization`` in the vLLM-engine and TRL cells.
    """
    from qerl_cli.bench.overrides import build_bench_config

    peers = _check_args(run_dir, shape, peers, eos, vllm_memory, warmup, measure, prompt_len)
    device = harness.device()
    overrides = dict(overrides or {})
    if memory_cap_gib is not None:  # the memory plan fits the step into the cap (unless --set says otherwise)
        overrides.setdefault("gpu_memory_gib", memory_cap_gib)
    cfg = build_bench_config(default_config(device, warmup, measure), overrides)
    cfg = dataclasses.replace(cfg, steps=warmup + measure)  # the AQN schedule and the LR warm-up see the steps run
    run, spec, fmts = _workload(run_dir, shape, formats, prompt_len, cfg, device)
    out = harness.out_dir(out_dir, run, "step")
    harness.cap_memory(device, memory_cap_gib)
    budget = harness.Budget(time_budget_s)
    res = harness.header(
        "bench/step", shape=shape, model=f"random {shape}" if shape else None,
        config={"formats": fmts, "prompt_len": prompt_len if shape else "task", "warmup": warmup,
                "measure": measure, "seed": seed, "memory_cap_gib": memory_cap_gib,
                "train": cfg.resolved().to_dict(), "overrides": jsonable(dict(overrides or {})),
                "lengths": ("EOS (stop set of the top token ids)" if eos else "fixed (EOS ignored)") if shape
                else "the model's (EOS / stop strings)",
                "rewards": "seeded uniform random" if shape else "the task's", "peers": peers, "eos": eos,
                "profile": profile, "vllm_memory": vllm_memory})
    ceiling, rates = _device_rates(res, device, log)
    stop_ids = stop_set(spec.vocab, cfg.max_completion_length, eos) if spec is not None else None
    common = dict(device=device, dtype=dtype_of(cfg.precision), warmup=warmup, measure=measure,
                  prompt_len=prompt_len, seed=seed, spec=spec, run=run, out=out, log=log, stop_ids=stop_ids,
                  profile=profile, ceiling=ceiling, rates=rates)
    cells, steps = _format_cells(res, fmts, cfg, overrides, vllm_memory, common)
    _add_peer_cells(cells, res, cfg, steps, peers, vllm_memory, budget, common)
    res["results"] = harness.run_cells(cells, budget=budget, log=log)
    _ratios(res["results"], peers)
    res["wall_s"] = budget.elapsed()
    paths = harness.write_results(res, out, "step.json", {"plot": ("step.png", partial(plot, res))})
    if run is not None:
        harness.record(run, "step", config=res["config"], inputs={"model": run.rel(res["model"])}, outputs=paths,
                       metrics={f"{r['format']}/{k}": r[k] for r in res["results"] if r["status"] == "ok"
                                for k in ("step_s", "rollout_tok_s", "speedup_vs_bf16") if r.get(k) is not None})
    return res


def _check_args(run_dir: Path | None, shape: str | None, peers: Iterable[str] | None, eos: bool,
                vllm_memory: float, warmup: int, measure: int, prompt_len: int) -> list[str]:
    """Refuse bad arguments before anything runs; the peers, deduplicated."""
    if (shape is None) == (run_dir is None):
        raise QerlError("give exactly one of --shape (random model of an architecture) or --run (the run's model)")
    peers = list(dict.fromkeys(peers or []))
    if [p for p in peers if p not in PEERS]:
        raise QerlError(f"unknown peer(s) {', '.join(p for p in peers if p not in PEERS)}; choose from "
                        f"{', '.join(PEERS)}")
    if peers and shape is None:
        raise QerlError("--peers runs on a random model shape: give --shape")
    if eos and shape is None:
        raise QerlError("--eos is for --shape runs (a run's own task ends at its EOS already)")
    if not 0.0 < vllm_memory <= 1.0:
        raise QerlError(f"--vllm-memory must be in (0, 1], got {vllm_memory}")
    for name, v, lo in (("warmup", warmup, 0), ("measure", measure, 1), ("prompt_len", prompt_len, 1)):
        if not isinstance(v, int) or v < lo:
            raise QerlError(f"{name} must be an integer >= {lo}, got {v!r}")
    return peers


def _workload(run_dir: Path | None, shape: str | None, formats: Iterable[str] | None, prompt_len: int, cfg: Any,
              device: torch.device) -> tuple[Any, Any, list[str]]:
    """(the run, the shape's spec, the cells): one of run / spec is None; every cell checked against the formats."""
    run = spec = None
    if shape is not None:
        spec = harness.shape_for(shape, device)
        if prompt_len + cfg.max_completion_length > spec.max_positions:
            raise QerlError(f"prompt_len + max_completion_length = {prompt_len + cfg.max_completion_length} exceeds "
                            f"the {shape} shape's {spec.max_positions} positions")
        fmts = list(dict.fromkeys(formats or DEFAULT_FORMATS))
    else:
        from qerl_cli.bench.runmodels import run_format
        from qerl_cli.manifest import RunDir

        run = RunDir(run_dir, create=False)
        fmts = list(dict.fromkeys(formats or [run_format(run)]))  # StageMissingError names `qerl quantize`
    allowed = tuple(n for n, f in FORMATS.items() if f.cuda_backend != REFERENCE)  # a GPU path exists
    rollout_quants = rollout_formats()  # the `BASE+ROLLOUT` cells (FlashRL mode)
    bad = [f for f in fmts if not _known_cell(f, allowed, rollout_quants)]
    if bad or not fmts:
        raise QerlError(f"unknown format(s) {', '.join(bad) or '(none given)'}; "
                        f"choose from {', '.join(allowed)}, BASE+ROLLOUT with ROLLOUT one of "
                        f"{', '.join(rollout_quants)} (FlashRL rollouts), or FMT@vllm (the vLLM rollout engine)")
    return run, spec, fmts


def _device_rates(res: dict[str, Any], device: torch.device, log: Callable[[str], None]) -> tuple[Any, Any]:
    """The BF16 matmul ceiling and the cost model's rates, measured once for the run (recorded in ``res``)."""
    from qerl_cli.bench.flops import fp8_matmul_ceiling_tflops, matmul_ceiling_tflops

    res["matmul_ceiling_tflops"] = ceiling = matmul_ceiling_tflops(device)
    # the decode profile's quantized GEMMs that ran W4A8 kernels are floored at this rate
    res["fp8_matmul_ceiling_tflops"] = fp8_matmul_ceiling_tflops(device)
    rates = measured_rates(device, ceiling)
    res["device_rates"] = None if rates is None else dataclasses.asdict(rates)
    if rates is not None:
        log(f"BF16 matmul ceiling (8192^3): {rates.matmul_tflops:.0f} TFLOP/s, copy {rates.copy_gbps:.0f} GB/s")
    return ceiling, rates


def _format_cells(res: dict[str, Any], fmts: list[str], cfg: Any, overrides: dict[str, Any], vllm_memory: float,
                  common: dict[str, Any]) -> tuple[list[Any], dict[str, _FormatStep]]:
    """One harness cell per qerl cell: its own TrainConfig where the cell asks for a rollout format or engine."""
    from qerl_cli.bench.overrides import build_bench_config

    device, warmup, measure = common["device"], common["warmup"], common["measure"]
    cells = []
    steps: dict[str, _FormatStep] = {}
    for cell in fmts:
        parsed = parse_cell(cell)
        fmt, rollout_quant, engine = parsed.base, parsed.rollout, parsed.engine
        cell_over = dict(overrides)
        if rollout_quant:
            cell_over["rollout_quant"] = rollout_quant
        if engine:
            cell_over.update(rollout_engine=engine, gpu_memory_utilization=vllm_memory)
        cell_cfg = cfg
        if cell_over != overrides:
            cell_cfg = dataclasses.replace(build_bench_config(default_config(device, warmup, measure), cell_over),
                                           steps=cfg.steps)
        backend = get_format(fmt).kernel_backend(device) + (
            f", rollouts {get_format(rollout_quant).kernel_backend(device)}" if rollout_quant else "") + (
            ", rollouts vLLM" if engine else "")
        step = _FormatStep(res, cell, fmt, backend, cell_cfg, **common)
        steps[cell] = step
        cells.append(harness.Cell({"format": cell, "backend": backend}, step.measure, cell))
    return cells, steps


def _add_peer_cells(cells: list[Any], res: dict[str, Any], cfg: Any, steps: dict[str, _FormatStep],
                    peers: list[str], vllm_memory: float, budget: Any, common: dict[str, Any]) -> None:
    """The peers' cells, placed before any FMT@vllm cell: an in-process vLLM engine leaves ~10 GiB behind in this
    process (its context and pools, on an H100), and TRL's own process then ran out of memory."""
    first_vllm = next((i for i, c in enumerate(cells) if parse_cell(c.key["format"]).engine), len(cells))
    for peer in peers:
        trl = _TrlStep(res, cfg, steps, vllm_memory=vllm_memory, budget=budget, **common)
        cells.insert(first_vllm, harness.Cell(
            {"format": peer, "backend": "TRL GRPOTrainer, peft LoRA, vLLM colocate (bf16)"}, trl.measure, peer))
        first_vllm += 1


def _ratios(results: list[dict[str, Any]], peers: list[str]) -> None:
    """Per row: the step and peak against the BF16-LoRA cell's; per qerl cell on the builtin engine, its step
    against TRL's and against the vLLM-engine cell of its own format."""
    unquantized = {name for name, f in FORMATS.items() if not f.quantized}  # the BF16-LoRA baseline cell
    base = next((r for r in results if r["format"] in unquantized and r["status"] == "ok"), None)
    by_name = {r["format"]: r for r in results if r["status"] == "ok"}
    for r in results:
        r["speedup_vs_bf16"] = (base["step_s"] / r["step_s"]) if base and r["status"] == "ok" and r["step_s"] else None
        if base and r["status"] == "ok" and r.get("peak_gb") and base.get("peak_gb"):
            r["peak_vs_bf16"] = r["peak_gb"] / base["peak_gb"]
        if r["status"] != "ok" or not r["step_s"] or not parse_cell(r["format"], peers).builtin:
            continue
        for peer in ("trl", f"{r['format']}@vllm"):
            if peer in by_name:
                r[f"speedup_vs_{parse_cell(peer, peers).key}"] = by_name[peer]["step_s"] / r["step_s"]


class _FormatStep:
    """One format's cell: a Trainer on that format's model, its warm-up and measured steps, then cleanup."""

    def __init__(self, res: dict[str, Any], cell: str, fmt: str, backend: str, cfg: Any, *, device: torch.device,
                 dtype: torch.dtype, warmup: int, measure: int, prompt_len: int, seed: int, spec: Any, run: Any,
                 out: Path, log: Callable[[str], None], stop_ids: list[int] | None = None, profile: bool = False,
                 ceiling: float | None = None, rates: Any = None) -> None:
        self.res, self.cell, self.fmt, self.backend, self.cfg = res, cell, fmt, backend, cfg
        self.device, self.dtype, self.warmup, self.measure_steps = device, dtype, warmup, measure
        self.prompt_len, self.seed, self.spec, self.run, self.out, self.log = prompt_len, seed, spec, run, out, log
        self.stop_ids, self.profile, self.ceiling, self.rates = stop_ids, profile, ceiling, rates
        self.row: dict[str, Any] = {}  # what the cell measured (the TRL cell reads the plan's choices from it)

    def measure(self) -> dict[str, Any]:
        reason = nf4_skip_reason(self.device) if get_format(self.fmt).requires == "bitsandbytes" else None
        if reason is not None:
            self.log(f"{self.fmt}: {reason}")
            return {"status": reason}
        from qerl_cli.manifest import RunDir
        from qerl_cli.train.trainer import Trainer

        row: dict[str, Any] = self.row
        scratch = Path(tempfile.mkdtemp(prefix=f"qerl-step-{self.fmt}-"))
        trainer = None
        try:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            trainer = Trainer(RunDir(scratch), self.cfg, device=str(self.device))
            self._setup(trainer, row, scratch)
            row["build_s"] = time.perf_counter() - t0
            plan = trainer.memory_plan
            if plan is not None:  # what the plan predicted (train/memory_plan.py)
                row["memory_plan"] = plan.to_dict()
                # next to the measured mem_<phase>_gb: the plan's estimate of the same peak (allocated bytes)
                row.update({f"est_{p}_gb": b / 2**30 for p, b in plan.phase_estimates().items()})
            # the settings the cell ran with (the plan's choices where the configuration left them open)
            row["resolved"] = trainer.settings.to_dict()
            row.update({k: row["resolved"][k] for k in ("micro_batch_size", "gradient_checkpointing",
                                                        "optimizer_offload", "kernel_weight_copies",
                                                        "keep_rollout_cache")})
            row["pack_sequences"] = trainer.cfg.pack_sequences
            row["logprob_backend"] = trainer.cfg.logprob_backend
            if self.device.type == "cuda":
                row["build_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            self.log(f"{self.cell}: trainer ready in {row['build_s']:.1f}s ({self.backend})")
            p_len = (self.prompt_len if self.spec is not None
                     else statistics.mean(len(p) for p in trainer.rollouter.prompt_ids))
            # the linears column names what ran (the dispatcher picks per shape and bucket: humming, qerl's
            # kernels, the persistent decode layer), not what the format would pick by default
            kernels_ran.reset()
            rows = _measure(trainer, self.warmup, self.measure_steps, self.log, self.cell)
            row["backend"], row["linears"] = kernels_ran.read(trainer.model.config, self.backend)
            row.update(_summarize(rows, p_len))
            row.update(time_estimates(trainer, row, p_len, self.rates))
            from qerl_cli.bench.flops import add_mfu

            add_mfu(row, trainer.model.config, self.ceiling, lora_rank=trainer.cfg.lora_rank,
                    lora_targets=list(trainer.cfg.lora_targets))
            if trainer.cfg.pack_sequences:
                from qerl_cli.train.packing import varlen_kernel

                mc = trainer.model.config
                heads = int(mc.num_attention_heads)
                row["packed_attention"] = varlen_kernel(
                    self.device, self.dtype, heads, int(getattr(mc, "num_key_value_heads", None) or heads),
                    int(getattr(mc, "head_dim", None) or mc.hidden_size // heads))
            if self.profile and self.device.type == "cuda":
                row["rollout_profile"] = self._profile(trainer)
                row["phase_profile"] = self._phase_profile(trainer)
            return row
        except Exception as exc:  # noqa: BLE001 - an OOM is explained here, anything else goes to the harness
            if not harness.is_oom(exc):
                raise
            oom = oom_explanation(trainer.phases.phase if trainer is not None else "setup",
                                  trainer.memory_plan if trainer is not None else None, self.device, self.cfg)
            self.log(f"{self.cell}: {oom['note']}")
            return {**row, "status": f"OOM in {oom['phase']}", "note": oom.pop("note"), "oom": oom}
        finally:
            if trainer is not None:
                try:
                    trainer.wait_checkpoint()  # the last background write, before its directory goes
                except QerlError as exc:
                    self.log(f"{self.cell}: {exc}")
                if getattr(trainer, "engine", None) is not None:
                    trainer.engine.release()
            trainer = None
            harness.free_memory()
            shutil.rmtree(scratch, ignore_errors=True)

    def _profile(self, trainer: Any) -> dict[str, Any] | None:
        """The decode step of the step's own engine by GPU-time category, at the step's batch and mean context
        (bench/decode_profile.py), as `bench rollout --profile` reports it: after a short generate with the step's
        prompts, so cache, LoRA shadows and graphs are those the step's rollout used."""
        from qerl_cli.bench.decode_profile import profile_decode
        from qerl_cli.rollout import BuiltinEngine, SamplingParams

        engine = trainer.engine
        if not isinstance(engine, BuiltinEngine):
            return None
        c = trainer.cfg
        prompts = trainer.rollouter.prompt_ids[:c.batch_prompts]
        with torch.no_grad():
            engine.generate(prompts, SamplingParams(n=c.num_generations, temperature=c.temperature,
                                                    max_tokens=min(16, c.max_completion_length), stop_token_ids=[],
                                                    seed=self.seed))
        batch = min(c.batch_prompts * c.num_generations, engine.num_slots)
        context = int(statistics.mean(len(p) for p in prompts)) + c.max_completion_length // 2
        rates = self.rates
        prof = profile_decode(engine, batch, context, copy_gbps=rates.copy_gbps if rates else None,
                              mma_tflops=self.ceiling or (rates.matmul_tflops if rates else None),
                              fp8_tflops=self.res.get("fp8_matmul_ceiling_tflops"))
        step_ms = prof["graph_step_ms"] or prof["kernel_ms_per_step"]
        # the compute-aware floor: per category the larger of its bytes over the bandwidth and its FLOPs over the
        # run's matmul rate (FP8 for what ran W4A8); at RL batches the quantized GEMMs are bound by the MMA rate
        prof["pct_of_floor"] = 100.0 * prof["step_floor_ms"] / step_ms if prof.get("step_floor_ms") else None
        self.log(f"{self.cell}: decode-step profile at batch {batch}, context {context}: "
                 f"{prof['kernel_ms_per_step']:.2f} ms of kernels, graph step {prof['graph_step_ms'] or 0:.2f} ms, "
                 f"floor {num(prof.get('step_floor_ms'), '{:.2f}')} ms ({num(prof['pct_of_floor'], '{:.0f}')}%)")
        return prof

    def _phase_profile(self, trainer: Any) -> dict[str, Any]:
        """One more step with the training phases profiled kernel by kernel (bench/phase_profile.py)."""
        from qerl_cli.bench.phase_profile import profile_train_phases

        prof = profile_train_phases(trainer)
        for name, p in prof.get("phases", {}).items():
            by_time = sorted(p["by_category"].items(), key=lambda kv: -kv[1])
            cats = ", ".join(f"{c} {us / 1000:.0f}" for c, us in by_time)
            self.log(f"{self.cell}: {name} {p.get('wall_s', 0):.3f}s wall, kernels {p['kernel_us'] / 1000:.0f} ms "
                     f"({p.get('gpu_busy_pct', 0):.0f}% busy; {p['kernels']} kernels): {cats}")
            for k in p["top"][:8]:
                self.log(f"    {k['us'] / 1000:8.1f} ms {k['calls']:6d}x  {k['category']:<22} {k['name'][:90]}")
        return prof

    def _setup(self, trainer: Any, row: dict[str, Any], scratch: Path) -> None:
        """The trainer on this format's model: a random shape with synthetic prompts and rewards, or the run's."""
        cfg = self.cfg
        vllm = cfg.rollout_engine == "vllm"
        if self.spec is not None:
            n_prompts = cfg.batch_prompts * (self.warmup + self.measure_steps)
            # the memory plan from the shape's config: a step that cannot fit is refused here, before any weight
            trainer.plan_memory(self.spec.config(), self.fmt, prompt_tokens=self.prompt_len, rates=self.rates)
            stops = list(self.stop_ids or [])
            t0 = time.perf_counter()
            model = build_shape_model(self.spec, self.fmt, self.device, self.dtype, self.seed)
            row["model_build_s"] = time.perf_counter() - t0
            model_dir = None
            if vllm:  # vLLM serves its own copy: the same random weights, written as a checkpoint
                from qerl_cli.bench.peers import write_shape_checkpoint

                model_dir = scratch / "model"
                row["write_ckpt_s"] = write_shape_checkpoint(model, model_dir, self.fmt)
            trainer.setup(model=model, tokenizer=None,
                          task=_synthetic_task(n_prompts, self.prompt_len, cfg.max_completion_length, stops),
                          prompt_ids=synthetic_prompts(n_prompts, self.prompt_len, self.spec.vocab, self.seed,
                                                       avoid_top=max(1, len(stops))),
                          reward_fn=synthetic_reward(self.seed), model_dir=model_dir)
            if vllm:
                row["vllm_startup_s"] = getattr(trainer.engine, "startup_s", None)
            return
        from qerl_cli.bench.runmodels import format_model_dir
        from qerl_cli.model_config import read_model_config
        from qerl_cli.models import load_model
        from qerl_cli.train.memory_plan import model_dir_format, stored_bytes

        model_dir = format_model_dir(self.run, self.fmt, self.out, self.log)
        trainer.plan_memory(read_model_config(model_dir), model_dir_format(model_dir),
                            prompt_tokens=cfg.max_prompt_length, stored=stored_bytes(model_dir), rates=self.rates)
        model, tok = load_model(str(model_dir), dtype=self.dtype, device=self.device)
        trainer.setup(model=model, tokenizer=tok, model_dir=model_dir if vllm else None)
        row["model_dir"] = str(model_dir)
        self.res["model"] = str(self.run.path)


class _TrlStep:
    """The TRL peer cell (bench/peers.py): the same shape in bf16, written as a Hugging Face checkpoint, trained
    by TRL's GRPOTrainer in its own process; micro-batch and gradient checkpointing as qerl's bf16 cell chose."""

    def __init__(self, res: dict[str, Any], cfg: Any, steps: dict[str, _FormatStep], *, vllm_memory: float,
                 budget: Any, device: torch.device, dtype: torch.dtype, warmup: int, measure: int, prompt_len: int,
                 seed: int, spec: Any, log: Callable[[str], None], stop_ids: list[int] | None,
                 ceiling: float | None, out: Path, **_: Any) -> None:
        self.res, self.cfg, self.steps, self.vllm_memory, self.budget = res, cfg, steps, vllm_memory, budget
        self.device, self.dtype, self.warmup, self.measure_steps = device, dtype, warmup, measure
        self.prompt_len, self.seed, self.spec, self.log = prompt_len, seed, spec, log
        self.stop_ids, self.ceiling, self.out = stop_ids, ceiling, out

    def measure(self) -> dict[str, Any]:
        from qerl_cli.bench.flops import add_mfu
        from qerl_cli.bench.peers import run_trl

        cfg = self.cfg.resolved()  # TRL gets the values qerl's cells ran with (lora_alpha, lr, scale_rewards)
        settings = self._bf16_settings(cfg)
        mb, gc = settings["micro_batch_size"], settings["gradient_checkpointing"]
        n_prompts = cfg.batch_prompts * (self.warmup + self.measure_steps)
        stops = list(self.stop_ids or [])
        prompts = synthetic_prompts(n_prompts, self.prompt_len, self.spec.vocab, self.seed,
                                    avoid_top=max(1, len(stops)))
        model = build_shape_model(self.spec, "bf16", self.device, self.dtype, self.seed)
        config = model.config
        left = None if self.budget.seconds is None else max(60.0, self.budget.seconds - self.budget.elapsed())
        try:
            row = run_trl(model=model, cfg=cfg, prompts=prompts, stop_ids=stops, prompt_len=self.prompt_len,
                          warmup=self.warmup, measure=self.measure_steps, micro_batch=mb, gradient_checkpointing=gc,
                          seed=self.seed, vllm_gpu_memory_utilization=self.vllm_memory, timeout_s=left, log=self.log,
                          before_run=lambda: _drop(model), log_dir=self.out)
        finally:
            model = None
            harness.free_memory()
        if row.get("status", "ok") != "ok":
            return row
        med = row["median"]
        seqs = cfg.batch_prompts * cfg.num_generations
        mean_len = row.get("mean_completion_length") or cfg.max_completion_length
        # TRL's phases in qerl's columns: rollout = weight sync + vLLM generate; recompute = the rest of
        # generate-and-score (old log-probs, rewards, padding); fwd_bwd = the update (optimizer included)
        row.update(rollout_s=med["sync_s"] + med["generate_s"], recompute_s=med["rest_of_gen_score_s"],
                   fwd_bwd_s=med["update_s"], optimizer_s=None, step_s=med["step_s"], peak_gb=med.get("peak_gb"),
                   sequences=seqs, generated_tokens=mean_len * seqs, rollout_tokens=mean_len * seqs,
                   micro_batch_size=mb, gradient_checkpointing=gc, weight_sync_s=med["sync_s"])
        row["rollout_tok_s"] = row["rollout_tokens"] / row["rollout_s"] if row["rollout_s"] else None
        n = self.prompt_len + mean_len  # lengths per sequence are not reported by TRL: the mean stands for all
        row.update(batch_tokens=seqs * n, batch_attention_pairs=seqs * n * (n + 1) / 2,
                   batch_loss_tokens=seqs * mean_len)
        add_mfu(row, config, self.ceiling, lora_rank=cfg.lora_rank, lora_targets=list(cfg.lora_targets))
        return row

    def _bf16_settings(self, cfg: Any) -> dict[str, Any]:
        """The settings qerl's bf16 cell ran with, or, when it did not run, those its plan resolves to."""
        ref = next((s.row for name, s in self.steps.items() if name.startswith("bf16") and s.row.get("resolved")),
                   None)
        if ref is not None:
            return ref["resolved"]
        from qerl_cli.train.memory_plan import plan_before_build, resolve_settings

        plan = plan_before_build(cfg, self.spec.config(), "bf16", device=self.device, prompt_tokens=self.prompt_len)
        return resolve_settings(cfg, plan).to_dict()


def _drop(model: Any) -> None:
    """Free a model's GPU memory before another process needs it (its parameters become empty)."""
    for p in model.parameters():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    harness.free_memory()


def oom_explanation(phase: str, plan: Any, device: torch.device, cfg: Any) -> dict[str, Any]:
    """An out-of-memory cell: the phase it hit, the memory plan's estimate for that phase, the capacity it had and
    the setting to change (the memory plan's advice, train/memory_plan.py); ``note`` says it in one line."""
    from qerl_cli.train.memory_plan import GIB, PHASE_PART, device_capacity, phase_advice

    part = PHASE_PART.get(phase, "peak")
    estimate = getattr(plan, part, None) if plan is not None else None
    capacity, _ = device_capacity(device, cfg.gpu_memory_gib)
    source = "GPU cap" if cfg.gpu_memory_gib is not None else "GPU"
    if capacity is None:  # CPU: the host's memory is the bound
        import os

        capacity, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    setting = phase_advice(phase, plan, cfg)
    est = (f"the memory plan estimated {estimate / GIB:.1f} GiB ({part.replace('_', ' ')})" if estimate is not None
           else "no memory plan yet (the model did not finish loading)")
    seen = f", {peak / GIB:.1f} GiB allocated at the failure" if peak is not None else ""
    return {"phase": phase, "plan_estimate_gib": None if estimate is None else estimate / GIB,
            "plan_part": part, "capacity_gib": capacity / GIB, "capacity_source": source,
            "allocated_gib": None if peak is None else peak / GIB, "setting": setting,
            "note": f"out of memory in {phase}: {est} of {capacity / GIB:.1f} GiB ({source}){seen}; change: {setting}"}


# ---- presentation -------------------------------------------------------------------------------
def tables(res: dict[str, Any]) -> list[Any]:
    return [render_table(res)]


def render_table(res: dict[str, Any]) -> Any:
    """A rich Table: one row per format, median phase seconds, tok/s, peak memory, speed-up."""
    from rich.table import Table

    c = res["config"]["train"]
    gpu = res["env"]["device"].get("gpu") or "CPU"
    table = Table(title=f"qerl bench step: {res['model']}, {c['batch_prompts']} x {c['num_generations']} sequences, "
                        f"<= {c['max_completion_length']} new tokens, LoRA r={c['lora_rank']}, {c['precision']}, "
                        f"AQN {'on' if c['aqn'] else 'off'}, {gpu}; median of {res['config']['measure']} steps")
    cols = ("format", "linears", "rollout s", "rollout tok/s", "ms/token-step", "decode ms/step", "recompute s",
            "fwd+bwd s", "recompute TF/s (MFU)", "fwd+bwd TF/s (MFU)", "pad %", "optimizer s", "AQN s",
            "requant s", "checkpoint s", "other s", "step s", "est step s", "speed-up",
            *(f"{p} GiB" for p in PEAK_COLUMNS),
            "peak GiB", "plan GiB", "mb / gc", "status")
    for col in cols:
        table.add_column(col, justify="left" if col in ("format", "linears", "status") else "right")
    for r in res["results"]:
        peaks = [num(r.get(f"mem_{p}_gb"), "{:.1f}") for p in PEAK_COLUMNS]
        choice = "-" if r.get("micro_batch_size") is None else \
            f"{r['micro_batch_size']} / {'on' if r.get('gradient_checkpointing') else 'off'}"
        table.add_row(r["format"], r["backend"], num(r.get("rollout_s")), num(r.get("rollout_tok_s"), "{:,.0f}"),
                      num(r.get("rollout_ms_per_token_step"), "{:.2f}"), num(r.get("decode_ms_per_step"), "{:.2f}"),
                      num(r.get("recompute_s")), num(r.get("fwd_bwd_s")), _tf(r, "recompute"), _tf(r, "fwd_bwd"),
                      num(r.get("padding_pct"), "{:.0f}"), num(r.get("optimizer_s")),
                      num(r.get("aqn_s")),
                      num(r.get("requant_s")), num(r.get("checkpoint_s")), num(r.get("other_s")), num(r.get("step_s")),
                      num(r.get("est_step_s")), num(r.get("speedup_vs_bf16"), "{:.2f}x"), *peaks,
                      num(r.get("peak_gb"), "{:.1f}"),
                      num((r.get("memory_plan") or {}).get("peak", 0) / 2**30 or None, "{:.1f}"), choice,
                      r["status"])
    return table


def _tf(r: dict[str, Any], phase: str) -> str:
    tf, mfu = r.get(f"{phase}_tflops"), r.get(f"{phase}_mfu")
    if tf is None:
        return "-"
    return f"{tf:.0f} ({100 * mfu:.0f}%)" if mfu is not None else f"{tf:.0f}"


def short_summary(res: dict[str, Any]) -> list[str]:
    lines = []
    if res.get("matmul_ceiling_tflops"):
        lines.append(f"BF16 matmul ceiling (8192^3, measured in this run): {res['matmul_ceiling_tflops']:.0f} TFLOP/s")
    for r in res["results"]:
        if r.get("status") != "ok" and r.get("log_tail"):
            lines.append(f"{r['format']}: {r['status']}")
    lines += ratio_lines(res)
    lines += router_lines(res)
    lines += floor_lines(res)
    lines += [f"JSON: {res['files']['json']}", f"plot: {res['files']['plot']}"]  # one path a line: 80 columns
    return lines


def router_lines(res: dict[str, Any]) -> list[str]:
    """Per mixture-of-experts cell, one line: the share of (token, layer) top-k expert sets the update forward's
    router picks that differ from the rollout's recorded routing (docs/moe.md, "The metric"); none for a dense
    model (its rows have no ``router``)."""
    lines = []
    measured = res["config"]["measure"]
    for r in res["results"]:
        router = r.get("router")
        if r.get("status") != "ok" or not router:
            continue
        share = router.get("replay_disagreement")
        if share is None:  # no recorded routing to compare with (a rollout engine that records none)
            lines.append(f"{r['format']}: router replay disagreement not measured (the rollouts recorded no "
                         f"routing); load cv {router['load_cv']:.2f}")
            continue
        lines.append(f"{r['format']}: router replay disagreement {share:.2%} of (token, layer) top-k sets (median "
                     f"of {measured} measured steps); load cv {router['load_cv']:.2f}")
    return lines


def floor_lines(res: dict[str, Any]) -> list[str]:
    """Per profiled cell, the step against its compute-aware floors: the decode step's (bytes or FLOPs per
    category, whichever binds) and the training phases' MFU (their FLOPs over the measured matmul ceiling)."""
    lines = []
    for r in res["results"]:
        prof = r.get("rollout_profile") or {}
        if r.get("status") != "ok" or prof.get("pct_of_floor") is None:
            continue
        lines.append(f"{r['format']}: decode step {prof['graph_step_ms'] or prof['kernel_ms_per_step']:.2f} ms at "
                     f"batch {prof['batch']}, {prof['pct_of_floor']:.0f}% of its compute-aware floor "
                     f"({prof['step_floor_ms']:.2f} ms); fwd+bwd MFU {num(r.get('fwd_bwd_mfu'), '{:.0%}')}")
    return lines


def ratio_lines(res: dict[str, Any]) -> list[str]:
    """Per quantized cell on the builtin engine: its step against BF16-LoRA's and the peers', and its peak memory
    over BF16-LoRA's (the measured ratios; docs/benchmarks.md holds the targets they are read against)."""
    unquantized = {name for name, f in FORMATS.items() if not f.quantized}  # the BF16-LoRA baseline
    lines = []
    for r in res["results"]:
        if r.get("status") != "ok" or r.get("speedup_vs_bf16") is None or r["format"] in unquantized:
            continue
        parts = [f"step {r['speedup_vs_bf16']:.2f}x BF16-LoRA"]
        parts += [f"{r[k]:.2f}x the {k.removeprefix('speedup_vs_').replace('_', '@')} cell" for k in sorted(r)
                  if k.startswith("speedup_vs_") and k != "speedup_vs_bf16" and r[k] is not None]
        if r.get("peak_vs_bf16") is not None:
            parts.append(f"peak {r['peak_gb']:.1f} GiB = {r['peak_vs_bf16']:.2f}x BF16-LoRA's")
        lines.append(f"{r['format']}: " + ", ".join(parts))
    return lines


def plot(res: dict[str, Any], path: Path) -> None:
    """PNG: stacked bars of the median phase seconds per format (speed-up over BF16-LoRA on top)."""
    ok = [r for r in res["results"] if r["status"] == "ok"]
    fig, ax = figure(figsize=(max(4.5, 1.6 * len(ok) + 2.5), 4.6))
    names = [r["format"] for r in ok]
    bottom = [0.0] * len(ok)
    for phase in (*STEP_PHASES, "other"):
        vals = [max(0.0, r.get(f"{phase}_s") or 0.0) for r in ok]
        ax.bar(names, vals, bottom=bottom, label=phase.replace("fwd_bwd", "fwd+bwd"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(ok):
        if r.get("speedup_vs_bf16") is not None:
            ax.text(i, bottom[i], f"{r['speedup_vs_bf16']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("seconds per RL step (median)")
    c = res["config"]["train"]
    ax.set_title(f"{res['model']}: {c['batch_prompts']}x{c['num_generations']} seqs, "
                 f"{c['max_completion_length']} new tokens, {res['env']['device'].get('gpu') or 'CPU'}", fontsize=9)
    if ok:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path)
