"""The thin `qerl` command line: parse options, call a library function, print a rich summary."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from qerl_cli.errors import QerlError

app = typer.Typer(
    name="qerl",
    help="RL for LLMs on low-bit weights: quantize -> train -> eval -> bench, through one run directory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks: kernels, rollout, mismatch, step, sanity.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}

RunOpt = Annotated[Path, typer.Option("--run", help="Run directory shared by all stages.")]


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False) -> None:
    _state["debug"] = debug or os.environ.get("QERL_DEBUG") == "1"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@app.command()
def quantize(
    model: Annotated[str | None, typer.Argument(help="HF id, local dir or .gguf; default: embedded SmolLM2.")] = None,
    run: RunOpt = Path("runs/default"),
    format: Annotated[str, typer.Option("--format", "-f", help="nvfp4|mxfp4|int4|int8|fp8|nf4|bf16")] = "nvfp4",
    ignore: Annotated[list[str] | None, typer.Option("--ignore", help="Layer patterns left unquantized.")] = None,
    method: Annotated[str, typer.Option(help="rtn (data-free) | gptq | awq (need qerl[llmcompressor]).")] = "rtn",
    dtype: Annotated[str, typer.Option(help="Dtype of unquantized tensors and scales: bf16|fp16.")] = "bf16",
    seed: int = 0,
    show_layers: Annotated[int, typer.Option(help="Rows of the per-layer error table to print (worst first).")] = 12,
) -> None:
    """Quantize a model into RUN/model as a compressed-tensors checkpoint."""
    from rich.progress import Progress

    from qerl_cli.quantize import quantize_model

    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("quantizing", total=None)

        def progress(name: str, i: int, n: int) -> None:
            bar.update(task, total=n, completed=i, description=name)

        res = quantize_model(run, model, fmt=format, ignore=ignore, method=method, dtype=dtype, seed=seed,
                             progress=progress)
    s = res.summary()
    table = Table(title=f"{res.fmt} per-layer error (worst {min(show_layers, len(res.layers))} of {len(res.layers)})")
    for col in ("layer", "shape", "rel. Frobenius err", "max |err|"):
        table.add_column(col, justify="right" if col != "layer" else "left")
    for e in sorted(res.layers, key=lambda e: -e.rel_fro)[:show_layers]:
        table.add_row(e.name, f"{e.shape[0]}x{e.shape[1]}", f"{e.rel_fro:.4f}", f"{e.max_abs:.4g}")
    console.print(table)
    console.print(
        f"[bold]{res.source.display}[/] -> [bold]{res.model_dir}[/] ({res.fmt}): "
        f"{_fmt_bytes(res.bytes_before)} (bf16) -> {_fmt_bytes(res.bytes_after)} "
        f"({s['compression']:.2f}x); rel. error mean {s['rel_fro_mean']:.4f}, max {s['rel_fro_max']:.4f}; "
        f"unquantized: {', '.join(res.skipped) or 'none'}"
    )


Opt = typer.Option


@app.command()
def train(
    run: RunOpt = Path("runs/default"),
    config: Annotated[str | None, Opt("--config", help="YAML preset (templates/NAME.yaml or a path).")] = None,
    dry_run: Annotated[bool, Opt("--dry-run", help="Print the resolved config and exit.")] = False,
    resume: Annotated[bool, Opt("--resume", help="Continue from the run's latest checkpoint.")] = False,
    algo: Annotated[str | None, Opt(help="grpo|dapo|dr_grpo|gspo|pg_seq_is|pg_seq_tis")] = None,
    aqn: Annotated[bool | None, Opt("--aqn/--no-aqn", help="Adaptive quantization noise.")] = None,
    aqn_sigma_start: float | None = None,
    aqn_sigma_end: float | None = None,
    aqn_stages: int | None = None,
    task: Annotated[str | None, Opt(help="gsm8k|math|arith|jsonl:PATH")] = None,
    task_level: Annotated[str | None, Opt(help="arith difficulty (1-7, 'mixed', 'd=0.5').")] = None,
    reward: Annotated[str | None, Opt(help="Reward registry name or dotted path.")] = None,
    steps: int | None = None,
    batch_prompts: int | None = None,
    num_generations: int | None = None,
    max_completion_length: int | None = None,
    temperature: float | None = None,
    lr: float | None = None,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    lora_targets: Annotated[str | None, Opt(help="Comma-separated module names.")] = None,
    beta: float | None = None,
    epsilon: float | None = None,
    epsilon_high: float | None = None,
    scale_rewards: Annotated[str | None, Opt(help="group|batch|none")] = None,
    precision: Annotated[str | None, Opt(help="bf16|fp16|fp32")] = None,
    correction: Annotated[str | None, Opt(help="none|token_tis|token_mis|seq_tis|seq_mis|geo_mis")] = None,
    correction_cap: float | None = None,
    rollout_engine: Annotated[str | None, Opt(help="builtin|vllm")] = None,
    gpu_memory_utilization: float | None = None,
    micro_batch_size: int | None = None,
    save_steps: int | None = None,
    seed: int | None = None,
    finetune: Annotated[str | None, Opt(help="lora | full (all weights but embeddings; needs a bf16 run dir)")] = None,
    rollout_quant: Annotated[str | None, Opt(help="FlashRL rollouts: none|int8|fp8|nvfp4|mxfp4 (bf16 run dir)")] = None,
    requant_scales: Annotated[str | None, Opt(help="fixed (int8 default) | dynamic")] = None,
    gpus: Annotated[int | None, Opt("--gpus", help="Data-parallel on N GPUs: launches torchrun, one process per "
                                    "GPU (NCCL). On CPU use `torchrun --nproc-per-node N -m qerl_cli train` (gloo).")
                    ] = None,
) -> None:
    """RL on the run's quantized model with LoRA (GRPO/DAPO/Dr.GRPO/GSPO/PG-seq-IS, AQN, TIS/MIS)."""
    import yaml

    from qerl_cli.train import distributed
    from qerl_cli.train.config import build_config

    in_torchrun = "LOCAL_RANK" in os.environ
    if gpus is not None and not in_torchrun and not dry_run:
        if _launch_gpus(gpus):
            return
    if gpus is not None and in_torchrun and gpus != int(os.environ.get("WORLD_SIZE", "1")):
        raise QerlError(f"--gpus {gpus} under torchrun with {os.environ['WORLD_SIZE']} processes: drop --gpus")

    overrides = dict(
        algo=algo, aqn=aqn, aqn_sigma_start=aqn_sigma_start, aqn_sigma_end=aqn_sigma_end, aqn_stages=aqn_stages,
        task=task, task_level=task_level, reward=reward, steps=steps, batch_prompts=batch_prompts,
        num_generations=num_generations, max_completion_length=max_completion_length, temperature=temperature,
        lr=lr, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_targets=[t.strip() for t in lora_targets.split(",")] if lora_targets else None, beta=beta,
        epsilon=epsilon, epsilon_high=epsilon_high, scale_rewards=scale_rewards, precision=precision,
        correction=correction, correction_cap=correction_cap, rollout_engine=rollout_engine,
        gpu_memory_utilization=gpu_memory_utilization, micro_batch_size=micro_batch_size, save_steps=save_steps,
        seed=seed, finetune=finetune, rollout_quant=rollout_quant, requant_scales=requant_scales,
    )
    if config is None and not _has_cuda():
        config = "quick_cpu"  # the CPU-sized preset when nothing else is asked for
    cfg = build_config(config, overrides)
    if dry_run:
        console.print(yaml.safe_dump(cfg.resolved().to_dict(), sort_keys=False).rstrip())
        return
    from qerl_cli.train.console import TrainConsole
    from qerl_cli.train.trainer import train as run_train

    ctx = distributed.init_from_env()
    if not ctx.is_main:  # only rank 0 prints the console panel
        run_train(run, cfg, resume=resume)
    else:
        with TrainConsole(console, cfg.resolved()) as ui:
            res = run_train(run, cfg, resume=resume, on_step=ui.update)
        ui.summary(res)
    distributed.shutdown()  # on success only: after a failure the process exits without more collectives


def _launch_gpus(n: int) -> bool:
    """`qerl train --gpus N`: rerun this command under torchrun with N processes (minus --gpus).

    False for N = 1: one GPU needs no launcher, the command runs in this process."""
    import torch

    from qerl_cli.train.distributed import launch, strip_option

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 1 or n > have:
        raise QerlError(f"--gpus {n} needs {n} CUDA GPUs but {have} are visible; on CPU run "
                        "`torchrun --nproc-per-node N -m qerl_cli train ...` (gloo) instead")
    if n == 1:
        return False
    rc = launch(n, strip_option(sys.argv[1:], "--gpus"), debug=_state["debug"])
    if rc:
        sys.exit(rc)
    return True


def _progress(msg: str) -> None:
    """A bench's progress lines: stderr, so stdout holds only the result tables."""
    err_console.print(msg, highlight=False)


def _show(tables: list[Any], lines: list[str]) -> None:
    for table in tables:
        console.print(table)
    for line in lines:
        console.print(line, highlight=False)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@app.command(name="eval")
def eval_(
    task: Annotated[str, typer.Argument(help="gsm8k | math500 | arith")],
    run: RunOpt = Path("runs/default"),
    checkpoint: Annotated[str, Opt(help="latest | step_N | base (no adapter)")] = "latest",
    limit: Annotated[int | None, Opt(help="Evaluate the first N problems.")] = None,
    samples: Annotated[int, Opt(help="Samples per problem (K > 1: pass@1, pass@K, mean accuracy).")] = 1,
    temperature: Annotated[float | None, Opt(help="Sampling temperature (default: greedy for K=1).")] = None,
    max_tokens: Annotated[int | None, Opt(help="Max new tokens (default per task).")] = None,
    shots: Annotated[int | None, Opt(help="Few-shot examples (0 or 5 for gsm8k).")] = None,
    chat_template: Annotated[bool | None, Opt("--chat-template/--no-chat-template")] = None,
    harness: Annotated[str, Opt(help="builtin | lm-eval | lighteval")] = "builtin",
    seed: int = 0,
    json_only: Annotated[bool, Opt("--json", help="Print the JSON result only.")] = False,
) -> None:
    """Evaluate the run's model (with its latest adapter) on GSM8K, MATH-500 or arith, scored exactly."""
    import json

    from qerl_cli.eval.harness import render_eval_table, run_eval

    res = run_eval(run, task, checkpoint=checkpoint, limit=limit, samples=samples, temperature=temperature,
                   max_tokens=max_tokens, shots=shots, chat_template=chat_template, harness=harness, seed=seed)
    if json_only:
        print(json.dumps(res, indent=2, default=str))
        return
    console.print(render_eval_table(res))


@bench_app.command("kernels")
def bench_kernels(
    shapes: Annotated[str, Opt(help="Comma-separated: qwen2.5-7b,qwen2.5-32b")] = "qwen2.5-7b,qwen2.5-32b",
    ms: Annotated[str, Opt("--m", help="Comma-separated rows M.")] = "1,16,64,128,256,512,2048",
    methods: Annotated[str, Opt(help="bf16,nvfp4,mxfp4,int8,fp8,fp8xfp8")] = "bf16,nvfp4,mxfp4,int8,fp8,fp8xfp8",
    peers: Annotated[str | None, Opt(help="Peers to time (default: every installed one); 'none' for none.")] = None,
    backward: Annotated[bool, Opt("--backward/--no-backward", help="Time dx = dy @ W at M=2048.")] = True,
    out: Annotated[Path, Opt(help="JSON output path.")] = Path("bench-kernels.json"),
) -> None:
    """Time qerl's quantized GEMM kernels against BF16 cuBLAS and installed peers (CUDA GPU)."""
    from qerl_cli.bench.kernels import bench_kernels as run
    from qerl_cli.bench.kernels import render_tables, short_summary

    peer_list = None if peers is None else ([] if peers == "none" else peers.split(","))
    res = run(shapes=tuple(shapes.split(",")), ms=tuple(int(m) for m in ms.split(",")), out_json=out,
              methods=tuple(methods.split(",")), peers=peer_list, backward=backward,
              log=_progress)
    _show(render_tables(res), short_summary(res))
    console.print(f"JSON: {out}")


@bench_app.command("rollout")
def bench_rollout(
    run: Annotated[Path | None, Opt("--run", help="Use the run's quantized model.")] = None,
    shape: Annotated[str | None, Opt(help="Random model: tiny|qwen2.5-0.5b|qwen2.5-7b|qwen2.5-14b|qwen2.5-32b")] = None,
    formats: Annotated[str, Opt(help="Comma-separated formats (with --shape).")] = "bf16,nvfp4,mxfp4,int8,fp8,nf4",
    batches: Annotated[str | None, Opt(help="Comma-separated batch sizes (default 1,8,64,256; 1,8 on CPU).")] = None,
    prompt_len: int = 256,
    new_tokens: Annotated[int | None, Opt(help="New tokens per sequence (default 1024; 64 on CPU).")] = None,
    lora_rank: int = 32,
    eos: Annotated[bool, Opt("--eos/--fixed-length", help="Stop at EOS instead of a fixed length.")] = False,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench or ./bench-rollout).")] = None,
) -> None:
    """Rollout tokens/s, TTFT and memory per format and batch, against the weight+KV roofline."""
    from qerl_cli.bench.rollout import bench_rollout as run_bench
    from qerl_cli.bench.rollout import render_table, short_summary

    gpu = _has_cuda()
    batches = batches or ("1,8,64,256" if gpu else "1,8")
    new_tokens = new_tokens or (1024 if gpu else 64)
    res = run_bench(shape=shape, run_dir=run, formats=tuple(formats.split(",")) if run is None else (),
                    batches=tuple(int(b) for b in batches.split(",")), prompt_len=prompt_len, new_tokens=new_tokens,
                    lora_rank=lora_rank, out_dir=out, eos_mode="eos" if eos else "fixed",
                    log=_progress)
    _show([render_table(res)], short_summary(res))


@bench_app.command("mismatch")
def bench_mismatch(
    run: Annotated[Path | None, Opt("--run", help="Use the run's quantized model (else the embedded model).")] = None,
    precisions: Annotated[str, Opt(help="Comma-separated: bf16,fp16,fp32")] = "bf16,fp16,fp32",
    formats: Annotated[str, Opt(help="Comma-separated formats (embedded model).")] = "bf16,nvfp4,mxfp4,int8,fp8",
    task: str = "arith",
    prompts: int = 16,
    samples: int = 4,
    max_tokens: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench or ./bench-mismatch).")] = None,
    shape: Annotated[str | None, Opt(help="Random model of this shape, e.g. qwen2.5-7b.")] = None,
    device: Annotated[str, Opt(help="cpu | cuda")] = "cpu",
    prompt_len: Annotated[int, Opt(help="Random prompt length with --shape.")] = 64,
) -> None:
    """Training-inference mismatch (k1, k3, max |dp|, sequence log-ratio) per precision x format, with plots."""
    from qerl_cli.bench.mismatch import bench_mismatch as run_bench
    from qerl_cli.bench.mismatch import render_table, short_summary

    res = run_bench(run_dir=run, precisions=tuple(precisions.split(",")), formats=tuple(formats.split(",")),
                    task=task, prompts=prompts, samples=samples, max_tokens=max_tokens, temperature=temperature,
                    seed=seed, out_dir=out, shape=shape, device=device, prompt_len=prompt_len,
                    log=_progress)
    _show([render_table(res)], short_summary(res))


SetOpt = Annotated[list[str] | None, Opt("--set", help="TrainConfig override KEY=VALUE (repeatable).")]


@bench_app.command("step")
def bench_step(
    run: Annotated[Path | None, Opt("--run", help="Use the run's model, task and reward.")] = None,
    shape: Annotated[str | None, Opt(help="Random model: tiny|qwen2.5-0.5b|qwen2.5-7b|qwen2.5-14b|qwen2.5-32b")] = None,
    formats: Annotated[str | None, Opt(help="Comma-separated: bf16,nvfp4,nf4 (mxfp4,int8,fp8 too); "
                                             "default bf16,nvfp4,nf4 with --shape, the run's with --run.")] = None,
    set_: SetOpt = None,
    finetune: Annotated[str | None, Opt(help="Passed as the finetune train option (FlashRL).")] = None,
    rollout_quant: Annotated[str | None, Opt(help="Passed as the rollout_quant train option (FlashRL).")] = None,
    prompt_len: Annotated[int, Opt(help="Synthetic prompt tokens (--shape).")] = 256,
    warmup: Annotated[int, Opt(help="Warm-up steps, not measured.")] = 1,
    measure: Annotated[int, Opt(help="Measured steps (median).")] = 3,
    memory_cap_gib: Annotated[float | None, Opt(help="Cap this process's GPU memory (GiB).")] = None,
    time_budget: Annotated[float | None, Opt(help="Skip formats that would start after this many seconds.")] = None,
    seed: int = 0,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench or ./bench-step).")] = None,
) -> None:
    """One RL step of the trainer broken down by phase (rollout .. checkpoint) per format, vs BF16-LoRA."""
    from qerl_cli.bench.overrides import parse_sets
    from qerl_cli.bench.step import bench_step as run_bench
    from qerl_cli.bench.step import render_table, short_summary

    items = list(set_ or [])
    items += [f"finetune={finetune}"] if finetune is not None else []
    items += [f"rollout_quant={rollout_quant}"] if rollout_quant is not None else []
    res = run_bench(run_dir=run, shape=shape, formats=formats.split(",") if formats else None,
                    overrides=parse_sets(items), prompt_len=prompt_len, warmup=warmup, measure=measure, out_dir=out,
                    seed=seed, memory_cap_gib=memory_cap_gib, time_budget_s=time_budget,
                    log=_progress)
    _show([render_table(res)], short_summary(res))


@bench_app.command("sanity")
def bench_sanity(
    run: RunOpt = Path("runs/default"),
    grid: Annotated[list[str] | None, Opt("--grid", help="Axis KEY=V1,V2 (format or a train option; repeatable).")]
    = None,
    set_: SetOpt = None,
    candidates: Annotated[int, Opt(help="Problems sampled to find the perfectible ones.")] = 64,
    samples: Annotated[int, Opt(help="Samples per candidate problem.")] = 40,
    lo: Annotated[float, Opt(help="Lowest pass rate kept.")] = 0.2,
    hi: Annotated[float, Opt(help="Highest pass rate kept.")] = 0.8,
    seeds: Annotated[int, Opt(help="Seeds per cell (mean and 95% interval over them).")] = 1,
    seed_start: Annotated[int | None, Opt(help="First seed (default: the config's seed).")] = None,
    heldout: Annotated[int, Opt(help="Held-out test problems scored after training (0: none).")] = 0,
    stop: Annotated[bool, Opt("--stop/--no-stop", help="--no-stop: completions run to max length.")] = True,
    time_budget: Annotated[float | None, Opt(help="Seconds after which no further (seed, cell) run starts.")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench).")] = None,
) -> None:
    """Steps until training accuracy > 95% on the model's perfectible problems, per grid cell and seed."""
    from qerl_cli.bench.overrides import parse_sets
    from qerl_cli.bench.sanity import bench_sanity as run_bench
    from qerl_cli.bench.sanity import parse_axes, render_table, short_summary

    res = run_bench(run_dir=run, grid=parse_axes(grid), overrides=parse_sets(set_), candidates=candidates,
                    samples=samples, lo=lo, hi=hi, seeds=seeds, seed_start=seed_start, heldout=heldout, stop=stop,
                    time_budget_s=time_budget,
                    out_dir=out, log=_progress)
    _show([render_table(res)], short_summary(res))


@bench_app.command("evidence")
def bench_evidence(
    input_: Annotated[list[str], Opt("--input", help="GROUP=SANITY_JSON (qerl|flashrl|fp16; repeatable).")],
    run: Annotated[Path | None, Opt("--run", help="Run directory to record it in (for qerl report).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench/evidence or ./evidence).")] = None,
) -> None:
    """The seed claims' verdicts from `bench sanity --seeds` results: intervals, tests, evidence.{json,md,png}."""
    from qerl_cli.bench.evidence import parse_inputs, write_evidence

    dest = out or ((run / "bench" / "evidence") if run else Path("evidence"))
    ev = write_evidence(inputs=parse_inputs(input_), out_dir=dest, run_dir=run, log=_progress)
    console.print(f"evidence: {dest / 'evidence.json'}  ({', '.join(c['verdict'] for c in ev['claims'])})")


@app.command()
def report(
    run: RunOpt = Path("runs/default"),
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/report).")] = None,
) -> None:
    """Write RUN/report/index.html (self-contained, offline) and PNGs from every stage's outputs."""
    from qerl_cli.report import build_report, render_summary

    console.print(render_summary(build_report(run, out)))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--":
        # `torchrun ... -m qerl_cli -- train --run DIR`: the `--` keeps torchrun from reading --run as its
        # --run-path; some Python versions pass it on to the script
        del sys.argv[1]
    try:
        rc = app(standalone_mode=False)
        # typer turns KeyboardInterrupt into exit code 130 and, outside standalone mode, returns it
        if rc == 130:
            raise KeyboardInterrupt
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except QerlError as exc:
        if _state["debug"]:
            raise
        if getattr(exc, "quiet", False):  # another rank failed and rank 0 said why
            sys.exit(exc.exit_code)
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]: the run directory was left consistent; rerun to continue "
                          "(`qerl train ... --resume` continues from the last checkpoint)")
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, EOFError):
        sys.exit(1)
    except Exception as exc:  # click usage errors arrive here in standalone_mode=False
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        if _state["debug"]:
            raise
        err_console.print(f"[bold red]internal error:[/] {exc.__class__.__name__}: {exc} (rerun with --debug "
                          "for the traceback and please report it)", highlight=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
