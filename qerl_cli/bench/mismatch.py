"""`qerl bench mismatch`: offline training-inference mismatch per precision and weight format.

After the FP16-vs-BF16 mismatch study. For every weight format (``bf16`` = unquantized) and every precision
(bf16 / fp16 / fp32) the same model is put in that precision, completions are sampled with the builtin
rollout engine (mu: the log-probs of the processed distribution it sampled from), and the sampled
tokens are scored again with the training forward (pi: the HF model, teacher-forced, as the trainer
computes pi_old). Both engines run in the same precision on the same weights, so every difference is
rounding: different kernels, different reduction orders, a KV cache versus one full forward.

Per cell: k1 = mean_t(log mu - log pi), k3 = mean_t(rho - log rho - 1) with rho = pi / mu,
max_t |mu - pi| in probability space, the distribution of the sequence log-ratio sum_t log rho_t
(mean / std / min / max) and its growth with length (least-squares slope of |sum_t log rho_t| on the
completion length, per token). Per format, the BF16-over-FP16 k3 ratio (the paper's claim: switching
both engines to FP16 cuts mismatch ~24x; docs/benchmarks.md holds qerl's target).

Models: without ``run_dir`` the embedded SmolLM2-135M is loaded once in fp32 and each format quantizes
its linears (lm_head excepted) from those fp32 weights, so the codes are the same at every precision.
With ``run_dir`` the run's quantized checkpoint is loaded in each precision (its format only).
Outputs (written only when the whole bench has finished, each file atomically): ``mismatch.json``,
``mismatch_scatter.png`` (pi vs mu token probabilities, one panel per precision, formats coloured) and
``mismatch_seq.png`` (sequence log-ratio vs completion length, one panel per precision).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_cli.bench import harness
from qerl_cli.bench.harness import SCI, figure, num, save_figure
from qerl_cli.bench.mismatch_settings import DEFAULTS
from qerl_cli.errors import QerlError
from qerl_cli.precision import PRECISIONS, dtype_of

DEFAULT_PRECISIONS = DEFAULTS.precisions
DEFAULT_FORMATS = DEFAULTS.formats
TASKS = ("arith", "gsm8k")
SCHEMA = 1
_SCATTER_POINTS = 4000  # token pairs kept per cell for the scatter plot (not written to JSON)
_LOGP_ROWS = 16  # rows per training forward: bounds the fp32 logits window in memory


# ---- inputs ---------------------------------------------------------------------------------------
def _check_args(precisions: Iterable[str], formats: Iterable[str], task: str, prompts: int, samples: int,
                max_tokens: int, temperature: float) -> tuple[list[str], list[str]]:
    from qerl_cli.formats import FORMATS

    precs = list(dict.fromkeys(precisions))
    bad = [p for p in precs if p not in PRECISIONS]
    if bad or not precs:
        raise QerlError(f"unknown precision(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(PRECISIONS)}")
    fmts = list(dict.fromkeys(formats))
    bad = [f for f in fmts if f not in FORMATS]
    if bad:
        raise QerlError(f"unknown format(s) {', '.join(bad)}; choose from {', '.join(FORMATS)}")
    if task.partition(":")[0].strip().lower() not in TASKS:
        raise QerlError(f"unknown task {task!r} for bench mismatch: use one of {', '.join(TASKS)}")
    for name, v in (("prompts", prompts), ("samples", samples), ("max_tokens", max_tokens)):
        if not isinstance(v, int) or v < 1:
            raise QerlError(f"{name} must be a positive integer, got {v!r}")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise QerlError(f"temperature must be > 0 (mismatch is measured on sampled tokens), got {temperature!r}")
    return precs, fmts


# ---- models ---------------------------------------------------------------------------------------
def _cast_copy(base: nn.Module, fmt: str, dtype: torch.dtype,
               cache: dict[tuple[str, Any], dict[str, Any]] | None = None) -> nn.Module:
    """A copy of the fp32 ``base`` in ``dtype`` with its target linears quantized to ``fmt`` (from fp32)."""
    from qerl_cli.arch import layout_of
    from qerl_cli.bench.shapes import set_module
    from qerl_cli.checkpoint import fused_global_scales, target_linears
    from qerl_cli.formats import get_format, quantize
    from qerl_cli.qlinear import QuantLinear

    model = copy.deepcopy(base).to(dtype)
    # Rotary frequencies stay fp32, as from_pretrained(dtype=...) leaves them.
    base_bufs = dict(base.named_buffers())
    for name, _ in list(model.named_buffers()):
        if name.rsplit(".", 1)[-1] in ("inv_freq", "original_inv_freq") and name in base_bufs:
            mod_name, _, leaf = name.rpartition(".")
            model.get_submodule(mod_name)._buffers[leaf] = base_bufs[name].clone()
    spec = get_format(fmt)
    if spec.quantized:
        targets, _ = target_linears(base, ["lm_head"])
        # stored tensors that do not depend on the model dtype are quantized once and shared by every precision
        key = (fmt, dtype if spec.scales_follow_dtype else None)
        qws = cache.get(key) if cache is not None else None
        if qws is None:
            scales = fused_global_scales(targets, layout_of(base).projections) if spec.global_scale else {}
            qws = {name: quantize(lin.weight.detach(), fmt, global_scale=scales.get(name), dtype=dtype)
                   for name, lin in targets.items()}
            if cache is not None:
                cache[key] = qws
        for name, lin in targets.items():
            qw = qws[name]
            n, k = qw.shape
            ql = QuantLinear(k, n, fmt, dict(qw.tensors), dtype, qw.group_size, lin.bias, spec.act_quant)
            ql.cache_dequantized = lin.weight.device.type == "cpu"  # no kernels off CUDA: dequantize once
            set_module(model, name, ql)
    model.eval()
    return model


# ---- measurement ----------------------------------------------------------------------------------
def _abs_slope(lengths: torch.Tensor, seq: torch.Tensor) -> float:
    """Least-squares slope of |seq log-ratio| on completion length (0.0 when undefined)."""
    if lengths.numel() < 2:
        return 0.0
    x = lengths.double()
    y = seq.abs().double()
    dx = x - x.mean()
    sxx = (dx * dx).sum()
    return ((dx * (y - y.mean())).sum() / sxx).item() if sxx > 0 else 0.0


def _run_cell(model: nn.Module, tok: Any, prompt_ids: list[list[int]], stop: list[str], *, dtype: torch.dtype,
              samples: int, max_tokens: int, temperature: float, seed: int,
              ignore_eos: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sample (mu), recompute (pi), measure. Returns (JSON row, plot data)."""
    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from qerl_cli.train.batch import build_batch, sampled_logprobs
    from qerl_cli.train.corrections import mismatch_metrics

    t0 = time.perf_counter()
    engine = BuiltinEngine(model, tok, max_batch_slots=len(prompt_ids) * samples,
                           max_model_len=max(len(p) for p in prompt_ids) + max_tokens, dtype=dtype,
                           gpu_memory_utilization=0.92)  # the bench holds no optimizer: the cache may take the rest
    try:
        out = engine.generate(prompt_ids, SamplingParams(n=samples, temperature=temperature, top_p=1.0, top_k=-1,
                                                         max_tokens=max_tokens, stop=stop, seed=seed,
                                                         stop_token_ids=[] if ignore_eos else None))
    finally:
        engine.release()
    t_sample = time.perf_counter() - t0
    pad = 0 if tok is None else (tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0))
    device = next(model.parameters()).device
    batch = build_batch([s.prompt_token_ids for s in out.samples], [s.token_ids for s in out.samples],
                        [s.logprobs for s in out.samples], [s.finish_reason == "length" for s in out.samples],
                        pad).to(device)
    t1 = time.perf_counter()
    with torch.no_grad():
        pi = torch.cat([sampled_logprobs(model, batch.rows(slice(i, i + _LOGP_ROWS)), temperature)[0]
                        for i in range(0, batch.mask.shape[0], _LOGP_ROWS)])
    t_score = time.perf_counter() - t1
    if device.type == "cuda":
        torch.cuda.synchronize()
        t_score = time.perf_counter() - t1
    pi, mu, mask = pi.cpu(), batch.rollout_logp.cpu(), batch.mask.cpu()
    m = mismatch_metrics(pi, mu, mask)
    valid = mask > 0
    seq = ((pi.double() - mu.double()) * mask).sum(-1)
    lengths = mask.sum(-1)
    row = {
        "k1": m["sampling/k1"],
        "k3": m["sampling/k3"],
        "max_abs_dprob": m["sampling/max_abs_dprob"],
        "seq_log_ratio_mean": m["sampling/seq_log_ratio_mean"],
        "seq_log_ratio_std": seq.std().item() if seq.numel() > 1 else 0.0,
        "seq_log_ratio_min": m["sampling/seq_log_ratio_min"],
        "seq_log_ratio_max": m["sampling/seq_log_ratio_max"],
        "seq_abs_log_ratio_len_slope": _abs_slope(lengths, seq),
        "seq_log_ratio_len_slope": m["sampling/seq_log_ratio_len_slope"],
        "seq_log_ratio_len_corr": m["sampling/seq_log_ratio_len_corr"],
        "sequences": len(out.samples),
        "tokens": int(valid.sum()),
        "mean_length": lengths.mean().item(),
        "sample_s": t_sample,
        "score_s": t_score,
        # (length, sum_t log rho_t) per sequence: small, and what the length plot shows
        "seq_points": [[int(n), float(s)] for n, s in zip(lengths.tolist(), seq.tolist(), strict=True)],
    }
    mu_p, pi_p = mu[valid].double().exp(), pi[valid].double().exp()
    if mu_p.numel() > _SCATTER_POINTS:
        keep = torch.randperm(mu_p.numel(), generator=torch.Generator().manual_seed(seed))[:_SCATTER_POINTS]
        mu_p, pi_p = mu_p[keep], pi_p[keep]
    return row, {"mu": mu_p.tolist(), "pi": pi_p.tolist()}


def _ratios(results: list[dict[str, Any]], fmts: list[str]) -> list[dict[str, Any]]:
    """Per format: k3(bf16) / k3(fp16); NaN (with a note) where either k3 is not finite."""
    k3 = {(r["format"], r["precision"]): r.get("k3") for r in results if r.get("status") == "ok"}
    out = []
    for f in fmts:
        b, h = k3.get((f, "bf16")), k3.get((f, "fp16"))
        if b is None or h is None:
            continue
        if not (math.isfinite(b) and math.isfinite(h)):  # a NaN/inf cell proves nothing: no ratio
            out.append({"format": f, "k3_bf16": b, "k3_fp16": h, "bf16_over_fp16": math.nan,
                        "note": "non-finite k3"})
            continue
        ratio = b / h if h > 0 else math.inf
        out.append({"format": f, "k3_bf16": b, "k3_fp16": h, "bf16_over_fp16": ratio})
    return out


# ---- the bench ------------------------------------------------------------------------------------
def bench_mismatch(
    *,
    run_dir: Path | None = None,
    precisions: Iterable[str] = DEFAULT_PRECISIONS,
    formats: Iterable[str] = DEFAULT_FORMATS,
    task: str = DEFAULTS.task,
    prompts: int = DEFAULTS.prompts,
    samples: int = DEFAULTS.samples,
    max_tokens: int = DEFAULTS.max_tokens,
    temperature: float = DEFAULTS.temperature,
    seed: int = DEFAULTS.seed,
    out_dir: Path | None = None,
    shape: str | None = None,
    device: str = DEFAULTS.device,
    prompt_len: int = DEFAULTS.prompt_len,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure pi-vs-mu mismatch for every (format, precision); write JSON + 2 PNGs; return the result.

    ``shape`` (e.g. ``qwen2.5-7b``) measures a randomly initialised model of that architecture instead
    (fp32 draws, quantized per format from them), on random ``prompt_len``-token prompts with generation
    forced to ``max_tokens`` (EOS ignored): the paper's model sizes without a download. Random weights
    give a flat next-token distribution, so absolute k3 values are not comparable with a trained model's;
    the BF16/FP16 ratio is what such a run checks. ``device`` runs both engines there (``cuda``: the
    rollout engine's CUDA graphs and Triton kernels against the training forward).

    Output directory: ``out_dir``, else ``run_dir/bench``, else ``./qerl-bench/mismatch-<date>-<time>``. With
    ``run_dir`` the run's quantized model and its single format are used, and the bench is recorded in the
    manifest under ``bench/mismatch``. Nothing is written until every cell has run.
    """
    precs, fmts = _check_args(precisions, formats, task, prompts, samples, max_tokens, temperature)
    dev = harness.device(device)
    if shape is not None and run_dir is not None:
        raise QerlError("--shape and --run are exclusive: a shape is a random model, --run measures the run's model")
    run, model_dir, fmts = _run_formats(run_dir, fmts, log)
    out = harness.out_dir(out_dir, run, "mismatch")

    budget = harness.Budget()
    torch.manual_seed(seed)
    work = _workload(shape, model_dir, task, prompts, prompt_len, seed, device, dev, log)
    res = harness.header(
        "bench/mismatch", model=work.model_name,
        config={"precisions": precs, "formats": fmts, "task": work.task_name, "prompts": len(work.prompt_ids),
                "samples": samples, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                "engine": "builtin", "stop": work.stop,
                "sampling": f"temperature {temperature}, top_p 1, top_k off",
                "device": device, "shape": shape, "fixed_length": shape is not None})
    scatter: dict[tuple[str, str], dict[str, Any]] = {}
    measure = partial(_measure_cell, work, model_dir, dev, scatter, samples=samples, max_tokens=max_tokens,
                      temperature=temperature, seed=seed, ignore_eos=shape is not None)
    cells = []
    for fmt in fmts:
        qcache: dict[tuple[str, Any], dict[str, Any]] = {}  # this format's quantized weights, per dtype
        cells += [harness.Cell({"format": fmt, "precision": prec}, partial(measure, fmt, prec, qcache),
                               f"{fmt} / {prec}") for prec in precs]
    # a qerl error (bad input found late, a missing run) stops the bench; anything else is that cell's status
    res["results"] = harness.run_cells(cells, fatal=lambda exc: isinstance(exc, QerlError),
                                       on_row=partial(_log_cell, log))
    res["k3_ratios"] = _ratios(res["results"], fmts)
    res["wall_s"] = budget.elapsed()
    paths = harness.write_results(res, out, "mismatch.json",
                                  {"scatter": ("mismatch_scatter.png", partial(plot_scatter, res, scatter)),
                                   "seq": ("mismatch_seq.png", partial(plot_seq, res))})
    if run is not None:
        harness.record(run, "mismatch", config=res["config"], inputs={"model": run.rel(res["model"])},
                       outputs=paths, extra={"k3_ratios": res["k3_ratios"]},
                       metrics={f"{r['format']}/{r['precision']}/{k}": r[k] for r in res["results"]
                                if r["status"] == "ok" for k in ("k1", "k3", "max_abs_dprob")})
    return res


def _run_formats(run_dir: Path | None, fmts: list[str], log: Callable[[str], None]) -> tuple[Any, Any, list[str]]:
    """(the run, its quantized model's directory, the formats measured): with ``run_dir`` only the run's own
    format; without, the formats asked for (None, None, fmts)."""
    if run_dir is None:
        if not fmts:
            raise QerlError(f"no format given; choose from {', '.join(DEFAULT_FORMATS)}")
        return None, None, fmts
    from qerl_cli.bench.runmodels import run_model

    run, model_dir, run_fmt = run_model(run_dir)
    if fmts and fmts != [run_fmt] and fmts != list(DEFAULT_FORMATS):
        log(f"--run: measuring the run's model ({run_fmt}); formats {fmts} ignored")
    return run, model_dir, [run_fmt]


@dataclass
class _Workload:
    """The fp32 model every cell starts from (None: each cell loads the run's), its prompts and stop strings."""

    base: nn.Module
    tok: Any
    prompt_ids: list[list[int]]
    stop: list[str]
    model_name: str
    task_name: str


def _workload(shape: str | None, model_dir: Any, task: str, prompts: int, prompt_len: int, seed: int, device: str,
              dev: torch.device, log: Callable[[str], None]) -> _Workload:
    """A random ``shape`` on random token prompts, or the embedded / run's model on the task's test prompts."""
    if shape is not None:
        from qerl_cli.bench.shapes import build_random_model, get_shape

        spec = get_shape(shape)
        log(f"building a random {shape} (fp32) on {device} ...")
        base = build_random_model(spec, "bf16", dev, dtype=torch.float32, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        prompt_ids = torch.randint(0, spec.vocab, (prompts, prompt_len), generator=gen).tolist()
        return _Workload(base, None, prompt_ids, [], f"random {shape}", f"random tokens ({prompt_len})")
    from qerl_cli.models import load_model
    from qerl_cli.tasks import load_task

    log(f"loading {'the embedded model' if model_dir is None else model_dir} ...")
    base, tok = load_model(None if model_dir is None else str(model_dir), dtype=torch.float32, device=dev)
    task_obj = load_task(task, split="test", limit=prompts, seed=seed)
    texts = task_obj.prompts[:prompts]
    if not texts:
        raise QerlError(f"task {task!r} has no test prompts")
    prompt_ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    model_name = "embedded SmolLM2-135M" if model_dir is None else str(model_dir)
    return _Workload(base, tok, prompt_ids, list(task_obj.stop), model_name, task)


def _measure_cell(work: _Workload, model_dir: Any, dev: torch.device, scatter: dict[tuple[str, str], Any],
                  fmt: str, prec: str, qcache: dict[tuple[str, Any], dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """One (format, precision) cell: the model in that precision (cast and quantized from the fp32 base, or the
    run's loaded in it), measured; its token probabilities kept for the scatter plot."""
    from qerl_cli.models import load_model

    dtype = dtype_of(prec)
    model = None
    try:
        if model_dir is None:
            model = _cast_copy(work.base, fmt, dtype, qcache)
        else:
            model, _ = load_model(str(model_dir), dtype=dtype, device=dev)
        row, scatter[(fmt, prec)] = _run_cell(model, work.tok, work.prompt_ids, work.stop, dtype=dtype, **kw)
        return row
    finally:
        del model
        harness.free_memory()


def _log_cell(log: Callable[[str], None], cell: harness.Cell, row: dict[str, Any]) -> None:
    row["wall_s"] = cell.seconds
    if row["status"] == "ok":
        log(f"{cell.label}: k1 {row['k1']:.3e}  k3 {row['k3']:.3e}  max|dp| {row['max_abs_dprob']:.3e}  "
            f"seq log-ratio {row['seq_log_ratio_mean']:+.3e} +- {row['seq_log_ratio_std']:.3e}  "
            f"({row['tokens']} tokens, {row['wall_s']:.1f}s)")
    else:
        log(f"{cell.label}: {row['status']}")


# ---- presentation ---------------------------------------------------------------------------------
def tables(res: dict[str, Any]) -> list[Any]:
    return [render_table(res)]


def render_table(res: dict[str, Any]) -> Any:
    """A rich Table: one row per (format, precision), then the BF16/FP16 k3 ratio per format."""
    from rich.table import Table

    c = res["config"]
    table = Table(title=f"qerl bench mismatch: {res['model']}, {c['task']} x {c['prompts']} prompts x "
                        f"{c['samples']} samples, <= {c['max_tokens']} tokens, T={c['temperature']}, builtin engine")
    cols = ("format", "precision", "k1", "k3", "max |dp|", "seq lr mean", "seq lr std", "seq lr min", "seq lr max",
            "|seq lr|/token", "tokens", "status")
    for col in cols:
        table.add_column(col, justify="left" if col in ("format", "precision", "status") else "right")
    for r in res["results"]:
        table.add_row(r["format"], r["precision"], num(r.get("k1"), SCI), num(r.get("k3"), SCI),
                      num(r.get("max_abs_dprob"), SCI),
                      num(r.get("seq_log_ratio_mean"), SCI), num(r.get("seq_log_ratio_std"), SCI),
                      num(r.get("seq_log_ratio_min"), SCI), num(r.get("seq_log_ratio_max"), SCI),
                      num(r.get("seq_abs_log_ratio_len_slope"), SCI), str(r.get("tokens", "-")), r["status"])
    return table


def short_summary(res: dict[str, Any]) -> list[str]:
    """Plain lines: the BF16/FP16 k3 ratio per format, and the output files."""
    lines = []
    for r in res.get("k3_ratios", []):
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(f"{r['format']}: k3 bf16/fp16 = {r['bf16_over_fp16']:.1f}x{note}")
    f = res["files"]
    lines.append(f"JSON: {f['json']}  plots: {f['scatter']}, {f['seq']}")
    return lines


def _figure(n: int) -> tuple[Any, Any]:
    fig, axes = figure(1, n, figsize=(4.6 * n, 4.4), squeeze=False)
    return fig, axes[0]


def plot_scatter(res: dict[str, Any], points: dict[tuple[str, str], dict[str, Any]], path: Path) -> None:
    """PNG: pi vs mu token probability, one panel per precision, formats coloured, diagonal dashed."""
    precs, fmts = res["config"]["precisions"], res["config"]["formats"]
    fig, axes = _figure(len(precs))
    k3 = {(r["format"], r["precision"]): r.get("k3") for r in res["results"]}
    for ax, prec in zip(axes, precs, strict=True):
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        for fmt in fmts:
            p = points.get((fmt, prec))
            if p:
                ax.scatter(p["mu"], p["pi"], s=4, alpha=0.5, label=f"{fmt} (k3 {num(k3.get((fmt, prec)), SCI)})")
        ax.set_title(f"{prec}: training pi vs rollout mu")
        ax.set_xlabel("mu(y_t) (rollout engine)")
        ax.set_ylabel("pi(y_t) (training forward)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, markerscale=3, loc="upper left")
    save_figure(fig, path)


def plot_seq(res: dict[str, Any], path: Path) -> None:
    """PNG: sequence log-ratio sum_t log(pi/mu) vs completion length, one panel per precision."""
    precs, fmts = res["config"]["precisions"], res["config"]["formats"]
    fig, axes = _figure(len(precs))
    rows = {(r["format"], r["precision"]): r for r in res["results"] if r["status"] == "ok"}
    for ax, prec in zip(axes, precs, strict=True):
        ax.axhline(0.0, color="k", lw=0.8, ls="--")
        for fmt in fmts:
            r = rows.get((fmt, prec))
            if r and r["seq_points"]:
                lens, lr = zip(*r["seq_points"], strict=True)
                ax.scatter(lens, lr, s=8, alpha=0.6,
                           label=f"{fmt} (|lr| {num(r['seq_abs_log_ratio_len_slope'], SCI)}/tok)")
        ax.set_title(f"{prec}: sequence log-ratio vs length")
        ax.set_xlabel("completion length (tokens)")
        ax.set_ylabel("sum_t log(pi/mu)")
        ax.legend(fontsize=7, markerscale=2, loc="upper left")
    save_figure(fig, path)
