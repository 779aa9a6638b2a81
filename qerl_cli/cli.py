"""The thin `qerl` command line: parse options, call a library function, print a rich summary."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qerl_cli.bench.mismatch_settings import DEFAULTS as MISMATCH
from qerl_cli.errors import Preempted, QerlError, path_error

app = typer.Typer(
    name="qerl",
    help="RL for LLMs on low-bit weights: quantize -> train -> eval -> bench, through one run directory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # click's plain help: option names are never cut (`--x / --no-x` on one line, the description wraps below a
    # long name) and help text is printed as written (rich markup would eat `qerl[llmcompressor]`)
    rich_markup_mode=None,
)
bench_app = typer.Typer(help="Benchmarks: kernels, rollout, mismatch, step, sanity, evidence.", no_args_is_help=True,
                        rich_markup_mode=None)
app.add_typer(bench_app, name="bench")

# rich wraps at 80 columns wherever the output is not a terminal (a log file, a pipe, a CI log): there, lines stay
# whole up to this width unless COLUMNS says otherwise
LOG_WIDTH = 250


def make_console(stderr: bool = False, file: Any = None) -> Console:
    out = Console(stderr=stderr, file=file)
    if out.is_terminal or os.environ.get("COLUMNS"):
        return out
    return Console(stderr=stderr, file=file, width=LOG_WIDTH)


console = make_console()
err_console = make_console(stderr=True)
_state = {"debug": False}


def _run_arg(value: str | Path) -> Path:
    """--run as given (typer would turn an empty one into ".", the current directory)."""
    from qerl_cli.manifest import run_path

    return value if isinstance(value, Path) else run_path(value)


def _run_opt(help_: str) -> Any:
    return typer.Option("--run", parser=_run_arg, metavar="PATH", help=help_)


RunOpt = Annotated[Path, _run_opt("Run directory shared by all stages.")]


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False) -> None:
    from qerl_cli.options import reload_options

    # start-up: every QERL_* setting is read here, once, and checked (a bad value stops the run before any work)
    _state["debug"] = debug  # first: with --debug, a bad setting shows its traceback
    _state["debug"] = debug or reload_options().debug


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@app.command(short_help="Quantize a model into RUN/model (compressed-tensors).")
def quantize(
    model: Annotated[str | None, typer.Argument(help="HF id, local dir or .gguf; default: embedded SmolLM2.")] = None,
    run: RunOpt = Path("runs/default"),
    format: Annotated[str, typer.Option("--format", "-f", help="nvfp4|mxfp4|int4|int8|fp8|nf4|bf16")] = "nvfp4",
    ignore: Annotated[list[str] | None, typer.Option("--ignore", metavar="PATTERN",
                                                     help="Layer patterns left unquantized (repeatable).")] = None,
    method: Annotated[str, typer.Option(help="rtn (data-free) | gptq | awq (need qerl[llmcompressor]).")] = "rtn",
    dtype: Annotated[str, typer.Option(help="Dtype of unquantized tensors and scales: bf16|fp16.")] = "bf16",
    seed: int = 0,
    show_layers: Annotated[int, typer.Option(help="Rows of the per-layer error table to print (worst first).")] = 12,
    force: Annotated[bool, typer.Option("--force", help="Re-quantize a run that holds a trained adapter: its train/ "
                                        "is moved to train.replaced-<time>/ (recorded in the manifest).")] = False,
) -> None:
    """Quantize a model into RUN/model as a compressed-tensors checkpoint."""
    from rich.progress import Progress

    from qerl_cli.quantize import quantize_model

    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("quantizing", total=None)

        def progress(name: str, i: int, n: int) -> None:
            bar.update(task, total=n, completed=i, description=name)

        def notice(line: str) -> None:  # e.g. the first run's ~40 s GGUF conversion, which shows nothing else
            bar.console.print(line, highlight=False, markup=False, soft_wrap=True)

        res = quantize_model(run, model, fmt=format, ignore=ignore, method=method, dtype=dtype, seed=seed,
                             progress=progress, force=force, notice=notice)
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
    if res.replaced_train:
        console.print(f"the adapter trained on the old base ({escape(res.replaced_train['held'])}) moved to "
                      f"{escape(str(res.run / res.replaced_train['moved_to']))}", highlight=False)


Opt = typer.Option


TRAIN_FIXED_OPTIONS: dict[str, tuple[Any, Any]] = {
    # name: (annotation, default); everything else is generated from TrainConfig (train_flags)
    "run": (RunOpt, Path("runs/default")),
    "config": (Annotated[str | None, Opt("--config", help="Preset name (quick_cpu, gpu_arith, gsm8k_grpo_paper, "
                                         "gsm8k_dapo_paper) or a YAML path. Default: quick_cpu without CUDA; on a "
                                         "GPU gpu_arith for the embedded model, else gsm8k_dapo_paper. A preset's "
                                         "values replace the defaults shown below; flags and --set win.")], None),
    "set_": (Annotated[list[str] | None, Opt("--set", metavar="KEY=VALUE", help="TrainConfig field KEY=VALUE "
                                             "(repeatable); flags win.")], None),
    "dry_run": (Annotated[bool, Opt("--dry-run", help="Print the resolved config and exit.")], False),
    "resume": (Annotated[bool, Opt("--resume", help="Continue from the run's latest checkpoint; with --steps "
                                   "larger than the run's, extend a finished run.")], False),
    "resume_from": (Annotated[str | None, Opt("--resume-from", help="Continue from an earlier checkpoint step_N "
                                              "(e.g. when a later one is damaged); what the run wrote after it "
                                              "(checkpoints, rollouts, metrics lines) is moved to "
                                              "train/checkpoints.abandoned-<time>/, never deleted.")], None),
    "gpus": (Annotated[int | None, Opt("--gpus", metavar="N", help="Data-parallel on N GPUs: launches torchrun, "
                                       "one process per GPU (NCCL). On CPU use `torchrun --nproc-per-node N -m "
                                       "qerl_cli -- train --run DIR ...` (gloo).")], None),
}


def _train(run: Path, config: str | None, set_: list[str] | None, dry_run: bool, resume: bool,
           resume_from: str | None, gpus: int | None, **fields: Any) -> None:
    """RL on the run's quantized model with LoRA (GRPO/DAPO/Dr.GRPO/GSPO/PG-seq-IS, AQN, TIS/MIS).

    The values come from the preset (--config) first, then --set, then the flags: a default named in a flag's
    help below applies only where the preset leaves that field unset (--dry-run prints the resolved values)."""
    import yaml

    from qerl_cli.train import distributed
    from qerl_cli.train.config import build_config, flag_overrides, parse_sets
    from qerl_cli.train.presets import choose_preset

    in_torchrun = "LOCAL_RANK" in os.environ
    rollout_gpus = fields.get("rollout_gpus")
    if rollout_gpus and not dry_run:  # a split that cannot work is refused before torchrun starts N processes
        from qerl_cli.train.disagg import check_split

        check_split(rollout_gpus, gpus if gpus is not None else int(os.environ.get("WORLD_SIZE", "1")))
    if gpus is not None and not in_torchrun and not dry_run:
        if _launch_gpus(gpus):
            return
    if gpus is not None and in_torchrun and gpus != int(os.environ.get("WORLD_SIZE", "1")):
        raise QerlError(f"--gpus {gpus} under torchrun with {os.environ['WORLD_SIZE']} processes: drop --gpus")

    overrides = {**parse_sets(set_), **flag_overrides(fields)}
    preset = choose_preset(config, run, _has_cuda())
    cfg = build_config(preset.name, overrides)
    if dry_run:
        console.print(yaml.safe_dump(cfg.resolved().to_dict(), sort_keys=False).rstrip(), soft_wrap=True)
        from qerl_cli.train.memory_plan import dry_run_lines

        # as YAML comments, so the output stays the loadable resolved config
        lines = [f"preset: {preset.name} ({preset.reason})", *dry_run_lines(run, cfg)]
        console.print("\n".join(f"# {line}" for line in lines), markup=False, highlight=False, soft_wrap=True)
        return
    from qerl_cli.train.console import TrainConsole, reference_step
    from qerl_cli.train.run import train as run_train

    ctx = distributed.init_from_env()
    try:
        if not ctx.is_main:  # only rank 0 prints the console panel
            run_train(run, cfg, resume=resume, resume_from=resume_from, preset=preset.name)
        else:
            ui = TrainConsole(console, cfg.resolved(),
                              reference_step(preset.name, _has_cuda(), bool(cfg.tools or cfg.env)),
                              start_step=_resume_step(run, resume_from) if (resume or resume_from) else 0,
                              preset=preset)
            with ui:
                res = run_train(run, cfg, resume=resume, resume_from=resume_from, on_step=ui.update,
                                on_setup=ui.attach, preset=preset.name)
            ui.summary(res)
    except Preempted as exc:  # SIGTERM: stopped cleanly; 143 is what schedulers expect of a terminated job
        if ctx.is_main:
            err_console.print(f"[yellow]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(Preempted.exit_code) from exc
    distributed.shutdown()  # on success only: after a failure the process exits without more collectives


def _train_command() -> Any:
    """`qerl train` with one option per TrainConfig field (train_flags), so flags and config cannot drift."""
    import inspect

    from qerl_cli.train.config import train_flags

    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=default)
              for name, (ann, default) in TRAIN_FIXED_OPTIONS.items()]
    for flag in train_flags():
        ann = Annotated[flag.type | None, Opt(flag.decl, help=flag.help, metavar="NAMES" if flag.is_list else None,
                                              rich_help_panel="Train config (TrainConfig)")]
        params.append(inspect.Parameter(flag.field, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=None))

    def train(**kwargs: Any) -> None:
        _train(**kwargs)

    train.__doc__ = _train.__doc__
    train.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    train.__annotations__ = {p.name: p.annotation for p in params}
    return train


app.command(name="train", short_help="RL with LoRA on the run's quantized model.")(_train_command())


def _resume_step(run: Path, resume_from: str | None = None) -> int:
    """The step `--resume` (or `--resume-from step_N`) continues from, for the console's first line (0 where
    there is none yet; the trainer itself checks the run and says what is wrong)."""
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.checkpointing import checkpoint_step, latest_step

    if resume_from:
        return checkpoint_step(Path(resume_from)) or 0

    try:
        return latest_step(RunDir(run, create=False)) or 0
    except QerlError:
        return 0


def _launch_gpus(n: int) -> bool:
    """`qerl train --gpus N`: rerun this command under torchrun with N processes (minus --gpus).

    False for N = 1: one GPU needs no launcher, the command runs in this process."""
    from qerl_cli.device import cuda_count
    from qerl_cli.train.distributed import launch, strip_option

    have = cuda_count()
    if n < 1 or n > have:
        raise QerlError(f"--gpus {n} needs {n} CUDA GPUs but {have} are visible; on CPU run "
                        "`torchrun --nproc-per-node N -m qerl_cli -- train ...` (gloo) instead")
    if n == 1:
        return False
    rc = launch(n, strip_option(sys.argv[1:], "--gpus"), debug=_state["debug"])
    if rc:
        sys.exit(rc)
    return True


def _progress(msg: str) -> None:
    """A bench's progress lines: stderr, so stdout holds only the result tables."""
    err_console.print(msg, highlight=False)


def _show(res: dict[str, Any]) -> None:
    """A bench's tables (split to the terminal's width) and summary lines, as its module draws them."""
    from qerl_cli.bench.harness import report, show

    show(console, *report(res))


def _has_cuda() -> bool:
    from qerl_cli.device import cuda_available

    return cuda_available()


@app.command(name="eval", short_help="Score the run's model on GSM8K, MATH-500 or arith.")
def eval_(
    task: Annotated[str, typer.Argument(help="gsm8k | math500 | arith")],
    run: RunOpt = Path("runs/default"),
    checkpoint: Annotated[str, Opt(help="latest | step_N (or its path in the run's train/checkpoints) | base (no "
                                        "adapter)")] = "latest",
    limit: Annotated[int | None, Opt(help="Evaluate the first N problems (a result of its own: -limitN).")] = None,
    samples: Annotated[int, Opt(help="Samples per problem (K > 1: pass@1, pass@K, mean accuracy).")] = 1,
    temperature: Annotated[float | None, Opt(help="Sampling temperature (default: greedy for K=1).")] = None,
    max_tokens: Annotated[int | None, Opt(help="Max new tokens (default per task).")] = None,
    shots: Annotated[int | None, Opt(help="Few-shot examples (0 or 5 for gsm8k).")] = None,
    chat_template: Annotated[bool | None, Opt("--chat-template/--no-chat-template")] = None,
    harness: Annotated[str, Opt(help="builtin | lm-eval | lighteval")] = "builtin",
    seed: int = 0,
    json_only: Annotated[bool, Opt("--json", help="Print the JSON result only.")] = False,
    tools: Annotated[str | None, Opt(help="python | calculator: score episodes with the tool on (docs/tools.md).")]
    = None,
    env: Annotated[str | None, Opt(help="module:Class or file.py:Class: score episodes with your environment.")]
    = None,
    max_turns: Annotated[int, Opt(help="Model turns per episode (--tools/--env).")] = 4,
) -> None:
    """Evaluate the run's model (with its latest adapter) on GSM8K, MATH-500 or arith, scored exactly."""
    import json

    from qerl_cli.eval.harness import render_eval_table, run_eval, scoring_notice

    notice = scoring_notice(task, harness)
    if notice:  # first, before the minutes of generation, so the user can stop and install what is missing
        err_console.print(f"[yellow]note:[/] {escape(notice)}", highlight=False, soft_wrap=True)
    res = run_eval(run, task, checkpoint=checkpoint, limit=limit, samples=samples, temperature=temperature,
                   max_tokens=max_tokens, shots=shots, chat_template=chat_template, harness=harness, seed=seed,
                   tools=tools, env=env, max_turns=max_turns)
    if json_only:
        print(json.dumps(res, indent=2, default=str))
        return
    console.print(render_eval_table(res))


@bench_app.command("kernels", short_help="Time the quantized GEMM kernels against BF16 cuBLAS.")
def bench_kernels(
    shapes: Annotated[str, Opt(help="Comma-separated: qwen2.5-7b,qwen2.5-32b")] = "qwen2.5-7b,qwen2.5-32b",
    ms: Annotated[str, Opt("--m", help="Comma-separated rows M.")] = "1,16,64,128,256,512,2048",
    methods: Annotated[str, Opt(help="bf16,nvfp4,mxfp4,int8,fp8,fp8xfp8")] = "bf16,nvfp4,mxfp4,int8,fp8,fp8xfp8",
    peers: Annotated[str | None, Opt(help="Peers to time (default: every installed one); 'none' for none.")] = None,
    backward: Annotated[bool, Opt("--backward/--no-backward", help="Time dx = dy @ W at M=2048.")] = True,
    out: Annotated[Path | None, Opt(help="JSON output path (default ./qerl-bench/kernels-DATE-TIME/kernels.json).")]
    = None,
) -> None:
    """Time qerl's quantized GEMM kernels against BF16 cuBLAS and installed peers (CUDA GPU)."""
    from qerl_cli.bench.harness import default_out, int_list
    from qerl_cli.bench.kernels import bench_kernels as run

    m_list = int_list(ms, "--m")
    out = out or default_out("kernels") / "kernels.json"
    peer_list = None if peers is None else ([] if peers == "none" else peers.split(","))
    res = run(shapes=tuple(shapes.split(",")), ms=m_list, out_json=out,
              methods=tuple(methods.split(",")), peers=peer_list, backward=backward,
              log=_progress)
    _show(res)
    console.print(f"JSON: {escape(str(out))}")


@bench_app.command("rollout", short_help="Rollout tokens/s, TTFT and memory per format and batch.")
def bench_rollout(
    run: Annotated[Path | None, _run_opt("Use the run's quantized model.")] = None,
    shape: Annotated[str | None, Opt(help="Random model: tiny|qwen2.5-0.5b|qwen2.5-7b|qwen2.5-14b|qwen2.5-32b; "
                                                  "MoE: tiny-moe|qwen3-30b-a3b")] = None,
    formats: Annotated[str, Opt(help="Comma-separated formats (with --shape).")] = "bf16,nvfp4,mxfp4,int8,fp8,nf4",
    batches: Annotated[str | None, Opt(help="Comma-separated batch sizes (default 1,8,64,256; 1,8 on CPU).")] = None,
    prompt_len: int = 256,
    new_tokens: Annotated[int | None, Opt(help="New tokens per sequence (default 1024; 64 on CPU).")] = None,
    lora_rank: int = 32,
    eos: Annotated[bool, Opt("--eos/--fixed-length", help="Stop at EOS instead of a fixed length.")] = False,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench, else ./qerl-bench/rollout-DATE-TIME).")]
    = None,
    prompts: Annotated[int | None, Opt(help="Prompts per cell (default: one per slot); with --num-generations "
                                            "more sequences than slots, the queue refills finished slots.")] = None,
    num_generations: Annotated[int, Opt(help="Samples per prompt (needs --prompts).")] = 1,
    lora_off: Annotated[bool, Opt("--lora-off/--no-lora-off", help="Also run every cell with the adapters "
                                                                  "disabled (LoRA's cost).")] = False,
    profile: Annotated[bool, Opt("--profile", help="Per-decode-step GPU time by category (CUDA).")] = False,
    linear_backend: Annotated[str | None, Opt(help="Linear kernels: auto|qerl|triton|cuda|humming|cublas.")] = None,
    memory_cap_gib: Annotated[float | None, Opt("--memory-cap", help="Cap this process's GPU memory (GiB; 79.2 on "
                                                "an H200 stands for an 80 GB card).")] = None,
    episodes: Annotated[int, Opt(help="Synthetic multi-turn episodes of N turns (a sleeping tool between them) "
                                      "against single-turn decoding of the same tokens (0: off).")] = 0,
    tool_latency_ms: Annotated[float, Opt(help="--episodes: the synthetic tool's latency, ms.")] = 50.0,
    observation_tokens: Annotated[int, Opt(help="--episodes: tokens of each observation.")] = 32,
) -> None:
    """Rollout tokens/s, TTFT and memory per format and batch, against the weight+KV roofline."""
    from qerl_cli.bench.harness import int_list
    from qerl_cli.bench.rollout import bench_rollout as run_bench

    gpu = _has_cuda()
    batch_sizes = int_list(batches or ("1,8,64,256" if gpu else "1,8"), "--batches")
    new_tokens = new_tokens or (1024 if gpu else 64)
    res = run_bench(shape=shape, run_dir=run, formats=tuple(formats.split(",")) if run is None else (),
                    batches=batch_sizes, prompt_len=prompt_len, new_tokens=new_tokens,
                    lora_rank=lora_rank, out_dir=out, eos_mode="eos" if eos else "fixed",
                    log=_progress, prompts=prompts, num_generations=num_generations,
                    lora_modes=("on", "off") if lora_off else ("on",), profile=profile, linear_backend=linear_backend,
                    memory_cap_gib=memory_cap_gib, episodes=episodes, tool_latency_ms=tool_latency_ms,
                    observation_tokens=observation_tokens)
    _show(res)


@bench_app.command("mismatch", short_help="Training-inference mismatch per precision and format.")
def bench_mismatch(
    run: Annotated[Path | None, _run_opt("Use the run's quantized model (else the embedded model).")] = None,
    precisions: Annotated[str, Opt(help="Comma-separated: bf16,fp16,fp32")] = ",".join(MISMATCH.precisions),
    formats: Annotated[str, Opt(help="Comma-separated formats (embedded model).")] = ",".join(MISMATCH.formats),
    task: str = MISMATCH.task,
    prompts: int = MISMATCH.prompts,
    samples: int = MISMATCH.samples,
    max_tokens: int = MISMATCH.max_tokens,
    temperature: float = MISMATCH.temperature,
    seed: int = MISMATCH.seed,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench, else ./qerl-bench/mismatch-DATE-TIME).")]
    = None,
    shape: Annotated[str | None, Opt(help="Random model of this shape, e.g. qwen2.5-7b.")] = None,
    device: Annotated[str, Opt(help="cpu | cuda")] = MISMATCH.device,
    prompt_len: Annotated[int, Opt(help="Random prompt length with --shape.")] = MISMATCH.prompt_len,
) -> None:
    """Training-inference mismatch (k1, k3, max |dp|, sequence log-ratio) per precision x format, with plots."""
    from qerl_cli.bench.mismatch import bench_mismatch as run_bench

    res = run_bench(run_dir=run, precisions=tuple(precisions.split(",")), formats=tuple(formats.split(",")),
                    task=task, prompts=prompts, samples=samples, max_tokens=max_tokens, temperature=temperature,
                    seed=seed, out_dir=out, shape=shape, device=device, prompt_len=prompt_len,
                    log=_progress)
    _show(res)


SetOpt = Annotated[list[str] | None, Opt("--set", metavar="KEY=VALUE", help="TrainConfig override KEY=VALUE "
                                                                      "(repeatable).")]


@bench_app.command("step", short_help="One RL step, phase by phase, per format vs BF16-LoRA.")
def bench_step(
    run: Annotated[Path | None, _run_opt("Use the run's model, task and reward.")] = None,
    shape: Annotated[str | None, Opt(help="Random model: tiny|qwen2.5-0.5b|qwen2.5-7b|14b|32b|72b; MoE: "
                                                  "tiny-moe|qwen3-30b-a3b")] = None,
    formats: Annotated[str | None, Opt(help="Comma-separated: bf16,nvfp4,nf4 (mxfp4,int8,fp8 too); "
                                             "default bf16,nvfp4,nf4 with --shape, the run's with --run.")] = None,
    set_: SetOpt = None,
    finetune: Annotated[str | None, Opt(help="Passed as the finetune train option (FlashRL).")] = None,
    rollout_quant: Annotated[str | None, Opt(help="Passed as the rollout_quant train option (FlashRL).")] = None,
    prompt_len: Annotated[int, Opt(help="Synthetic prompt tokens (--shape).")] = 256,
    warmup: Annotated[int, Opt(help="Warm-up steps, not measured.")] = 1,
    measure: Annotated[int, Opt(help="Measured steps (median).")] = 3,
    memory_cap_gib: Annotated[float | None, Opt("--memory-cap", "--memory-cap-gib", help="Cap this process's GPU "
                                                "memory (GiB; 79.2 on an H200 stands for an 80 GB card); the memory "
                                                "plan fits the step into it.")] = None,
    time_budget: Annotated[float | None, Opt(help="Skip formats that would start after this many seconds.")] = None,
    peers: Annotated[str | None, Opt(help="Comma-separated peer stacks on the same shape and workload: trl (TRL "
                                          "GRPOTrainer + peft LoRA + colocated vLLM, bf16).")] = None,
    eos: Annotated[bool, Opt("--eos", help="--shape: rollouts end at a stop set (RL-like lengths, real padding).")]
    = False,
    profile: Annotated[bool, Opt("--profile", help="The step rollout's decode step by GPU-time category, "
                                                   "and one more step's training phases kernel by kernel (CUDA).")]
    = False,
    vllm_memory: Annotated[float, Opt(help="vLLM's gpu_memory_utilization in FMT@vllm and TRL cells.")] = 0.35,
    seed: int = 0,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench, else ./qerl-bench/step-DATE-TIME).")]
    = None,
) -> None:
    """One RL step of the trainer broken down by phase (rollout .. checkpoint) per format, vs BF16-LoRA.

    A format FMT@vllm uses the vLLM rollout engine (QeRL's architecture); --peers trl adds TRL's GRPOTrainer."""
    from qerl_cli.bench.step import bench_step as run_bench
    from qerl_cli.train.config import parse_sets

    items = list(set_ or [])
    items += [f"finetune={finetune}"] if finetune is not None else []
    items += [f"rollout_quant={rollout_quant}"] if rollout_quant is not None else []
    res = run_bench(run_dir=run, shape=shape, formats=formats.split(",") if formats else None,
                    overrides=parse_sets(items), prompt_len=prompt_len, warmup=warmup, measure=measure, out_dir=out,
                    seed=seed, memory_cap_gib=memory_cap_gib, time_budget_s=time_budget,
                    peers=peers.split(",") if peers else None, eos=eos, profile=profile, vllm_memory=vllm_memory,
                    log=_progress)
    _show(res)


@bench_app.command("sanity", short_help="Steps to 95% training accuracy per grid cell and seed.")
def bench_sanity(
    run: RunOpt = Path("runs/default"),
    grid: Annotated[list[str] | None, Opt("--grid", metavar="KEY=V1,V2", help="Axis KEY=V1,V2 (format or a train "
                                          "option; repeatable).")] = None,
    set_: SetOpt = None,
    candidates: Annotated[int, Opt(help="Problems sampled to find the perfectible ones.")] = 64,
    samples: Annotated[int, Opt(help="Samples per candidate problem.")] = 40,
    lo: Annotated[float, Opt(help="Lowest pass rate kept.")] = 0.2,
    hi: Annotated[float, Opt(help="Highest pass rate kept.")] = 0.8,
    seeds: Annotated[int, Opt(help="Seeds per cell (mean and 95% interval over them).")] = 1,
    seed_start: Annotated[int | None, Opt(help="First seed (default: the config's seed).")] = None,
    heldout: Annotated[int, Opt(help="Held-out test problems scored before and after training (0: none).")] = 0,
    heldout_samples: Annotated[int, Opt(help="Samples per held-out problem.")] = 32,
    stop: Annotated[bool, Opt("--stop/--no-stop", help="--no-stop: completions run to max length.")] = True,
    skip: Annotated[list[str] | None, Opt("--skip", metavar="KEY=V[,KEY=V]", help="Leave out the grid cells with "
                                          "KEY=V[,KEY=V] (repeatable).")] = None,
    time_budget: Annotated[float | None, Opt(help="Seconds after which no further (seed, cell) run starts.")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench).")] = None,
) -> None:
    """Steps until training accuracy > 95% on the model's perfectible problems, per grid cell and seed."""
    from qerl_cli.bench.sanity import bench_sanity as run_bench
    from qerl_cli.bench.sanity import parse_axes, parse_skip
    from qerl_cli.train.config import parse_sets

    res = run_bench(run_dir=run, grid=parse_axes(grid), overrides=parse_sets(set_), candidates=candidates,
                    samples=samples, lo=lo, hi=hi, seeds=seeds, seed_start=seed_start, heldout=heldout,
                    heldout_samples=heldout_samples, stop=stop, skip=parse_skip(skip), time_budget_s=time_budget,
                    out_dir=out, log=_progress)
    _show(res)


@bench_app.command("evidence", short_help="The seed claims' verdicts from bench sanity results.")
def bench_evidence(
    input_: Annotated[list[str], Opt("--input", metavar="GROUP=FILE", help="GROUP=SANITY_JSON (qerl|flashrl|fp16|moe|"
                                     "w4a8; repeatable).")],
    run: Annotated[Path | None, _run_opt("Run directory to record it in (for qerl report).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/bench/evidence, else "
                                         "./qerl-bench/evidence-DATE-TIME).")] = None,
) -> None:
    """The seed claims' verdicts from `bench sanity --seeds` results: intervals, tests, evidence.{json,md,png}."""
    from qerl_cli.bench.evidence import parse_inputs, write_evidence
    from qerl_cli.bench.harness import default_out
    from qerl_cli.manifest import RunDir

    dest = out or (RunDir(run).inside("bench/evidence") if run else default_out("evidence"))
    ev = write_evidence(inputs=parse_inputs(input_), out_dir=dest, run_dir=run, log=_progress)
    console.print(f"evidence: {escape(str(dest / 'evidence.json'))}  ({', '.join(c['verdict'] for c in ev['claims'])})")


@app.command(short_help="Write RUN/report/index.html from every stage.")
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
        _error_line(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print(f"[yellow]interrupted[/]: {escape(interrupt_hint(sys.argv[1:]))}", highlight=False,
                          soft_wrap=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, EOFError):
        sys.exit(1)
    except Exception as exc:
        if isinstance(exc, _usage_error_types()):
            sys.exit(_usage_error(exc))
        if _state["debug"]:
            raise
        if (err := path_error(exc)) is not None:  # a path the user gave, not a bug
            _error_line(str(err))
            sys.exit(err.exit_code)
        if isinstance(exc, _kernel_setting_error()):  # a kernel setting the user chose: theirs to fix, one line
            _error_line(str(exc))
            sys.exit(2)
        err_console.print(f"[bold red]internal error:[/] {escape(exc.__class__.__name__)}: {escape(str(exc))} "
                          "(rerun with --debug for the traceback and please report it)", highlight=False,
                          soft_wrap=True)
        sys.exit(1)


# What a Ctrl-C leaves and how to go on, per command: only training continues where it stopped.
INTERRUPT_HINTS = {
    "train": "the run directory was left consistent; `qerl train --run DIR --resume` continues from the last "
             "checkpoint",
    "quantize": "the run's model was not replaced (nor its record, in a run quantized before); run `qerl quantize` "
                "again",
    "eval": "no result was written and the run's earlier results stand; run the same `qerl eval` command again",
    "bench": "the cells measured so far were not written; run the same `qerl bench` command again",
    "report": "the earlier report stands; run `qerl report` again",
}


def interrupt_hint(argv: list[str]) -> str:
    """The Ctrl-C line of the command in ``argv`` (the arguments after `qerl`)."""
    command = next((a for a in argv if not a.startswith("-")), "")
    return INTERRUPT_HINTS.get(command, "the run directory was left consistent; run the command again")


def _error_line(message: str) -> None:
    """One `error: ...` line. The message is escaped: rich would read `qerl[vllm]` as a markup tag and drop it."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _kernel_setting_error() -> tuple[type[BaseException], ...]:
    """qerl_kernels' error for a kernel setting that cannot work (a bad QERL_LINEAR_BACKEND, say); it can only
    come from kernels already loaded, so a CLI run that never loaded them does not import them here."""
    common = sys.modules.get("qerl_kernels._common")
    return (common.KernelSettingError,) if common is not None else ()


def _usage_error_types() -> tuple[type[BaseException], ...]:
    """Click's exception classes, from every click that typer may raise through.

    typer >= 0.29 bundles its own copy of click (`typer._click`) whose exceptions do not derive from the
    installed click's, so both are caught."""
    import click

    types_: list[type[BaseException]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException as BundledClickException

        types_.append(BundledClickException)
    except ImportError:  # typer < 0.29 uses the installed click
        pass
    return tuple(types_)


def _usage_error(exc: BaseException) -> int:
    """Report a command-line usage error in one line and return its exit code (2 for usage errors)."""
    code = int(getattr(exc, "exit_code", 2) or 2)
    if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `qerl` or `qerl bench`: the help is the message
        # click's plain help (rich_markup_mode=None) leaves printing it to the caller outside standalone mode
        print(exc.format_message() if hasattr(exc, "format_message") else str(exc))
        return code
    ctx = getattr(exc, "ctx", None)
    where = getattr(ctx, "command_path", None) or "qerl"
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    message = " ".join(str(message).split())  # click's messages may span lines
    _error_line(f"{message} (see `{where} --help`)")
    return code


if __name__ == "__main__":
    main()
