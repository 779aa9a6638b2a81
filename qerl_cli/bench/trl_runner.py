"""TRL's trainers on one spec, in their own process: ``GRPOTrainer`` for ``bench step``'s TRL peer (started by
``qerl_cli.bench.peers.run_trl``) and ``AsyncGRPOTrainer`` for the async split's peer (started by
``qerl_cli.bench.trl_async``); the spec's ``trainer`` ("grpo", the default, or "async_grpo") says which.

    python -P trl_runner.py SPEC.json

Imports only TRL and what it needs (never qerl: ``-P`` keeps the bench folder, whose ``kernels.py`` would shadow
the ``kernels`` package transformers probes, off the path) and writes ``result`` (JSON): the versions, the run's
numbers, TRL's own logged metrics. Any exception is written there as ``error`` (the bench shows it as the cell's
or the layout's status), so a failure says exactly where TRL stopped.

GRPO: ``steps`` steps on the spec's checkpoint with a peft LoRA; per optimizer step its wall time and parts, medians
over the steps after ``warmup``. A ``TrainerCallback`` takes the synchronized wall time from ``on_step_begin`` to
``on_step_end`` (one optimizer step: generation, every micro-batch's forward and backward, the optimizer). Inside
it, the generate-and-score phase (``_generate_and_score_completions``), and within that the vLLM weight sync and
``generate`` calls, are timed by wrapping them on the trainer instance; ``update`` is the step minus
generate-and-score.

Async GRPO: the spec names a checkpoint and a running vLLM server (started with ``--enable-lora``, so TRL syncs the
LoRA adapter only: it saves the adapter and the server loads it through ``/v1/load_lora_adapter``), the prompts,
TRL's settings and the LoRA config. It trains ``steps`` optimizer steps and keeps TRL's own logged metrics
(``perf/step_s``, ``perf/weight_sync_s``, ``perf/rollout_wait_s``, ``batch/*``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"status": "starting", "phase": "start"}
    out = Path(spec["result"])

    def save() -> None:
        out.write_text(json.dumps(result, default=str))

    try:
        run = _run_async if spec.get("trainer", "grpo") == "async_grpo" else _run_grpo
        return run(spec, result, save)
    except BaseException as exc:  # noqa: BLE001 - the cell or layout records exactly why TRL stopped
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:600]
        result["traceback"] = traceback.format_exc()[-4000:]
        save()
        traceback.print_exc()
        return 1


def _run_grpo(spec: dict[str, Any], result: dict[str, Any], save: Any) -> int:
    t_start = time.perf_counter()
    import torch

    result["phase"] = "import"
    save()
    result["versions"] = _versions()
    result["import_s"] = time.perf_counter() - t_start
    on_cuda = torch.cuda.is_available()
    rng = random.Random(spec["seed"])

    def synthetic_random_reward(prompts: Any, completions: Any, **kwargs: Any) -> list[float]:
        return [rng.random() for _ in completions]

    timing = _Timing(spec, result, save, on_cuda)
    result["phase"] = "load"
    save()
    model, tokenizer, data, peft_config, args = _load(spec, result)
    result["phase"] = "trainer"
    save()
    t = time.perf_counter()
    trainer = timing.trainer_class()(model=model, reward_funcs=synthetic_random_reward, args=args, train_dataset=data,
                                     processing_class=tokenizer, peft_config=peft_config,
                                     callbacks=[timing.callback()])
    result["trainer_init_s"] = time.perf_counter() - t  # includes vLLM's start-up in colocate mode
    gen = getattr(trainer, "vllm_generation", None)
    if gen is not None:  # TRL's vLLM phases, timed on this instance
        gen.sync_weights = timing.timed("sync_s", gen.sync_weights)
        gen.generate = timing.timed("generate_s", gen.generate)
    result["phase"] = "train"
    save()
    trainer.train()
    _summarize(result, timing.steps, trainer, on_cuda)
    result["wall_s"] = time.perf_counter() - t_start
    save()
    return 0


def _versions() -> dict[str, Any]:
    """The versions of TRL and what it runs on (vLLM None when it is not installed)."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "datasets": datasets.__version__, "torch": torch.__version__}
    try:
        import vllm

        versions["vllm"] = vllm.__version__
    except ImportError:
        versions["vllm"] = None
    try:
        import accelerate

        versions["accelerate"] = accelerate.__version__
    except ImportError:
        pass
    return versions


class _Timing:
    """The per-step timing: a callback for each optimizer step's wall time and peak memory, and wrappers that add
    a call's synchronized time to the running step's ``key``; every finished step is saved at once."""

    def __init__(self, spec: dict[str, Any], result: dict[str, Any], save: Any, on_cuda: bool) -> None:
        self.spec, self.result, self.save, self.on_cuda = spec, result, save, on_cuda
        self.steps: list[dict[str, Any]] = []
        self.current: dict[str, Any] = {}

    def begin(self) -> None:
        import torch

        _sync()
        self.current.clear()
        self.current.update(t0=time.perf_counter(), gen_score_s=0.0, sync_s=0.0, generate_s=0.0)
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats()

    def end(self) -> None:
        import torch

        _sync()
        current = self.current
        row = {"step_s": time.perf_counter() - current["t0"], **{k: v for k, v in current.items() if k != "t0"}}
        row["update_s"] = row["step_s"] - row["gen_score_s"]
        row["rest_of_gen_score_s"] = row["gen_score_s"] - row["sync_s"] - row["generate_s"]
        if self.on_cuda:
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        row["warmup"] = len(self.steps) < self.spec["warmup"]
        self.steps.append(row)
        self.result["steps"] = self.steps
        self.save()

    def timed(self, key: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            _sync()
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync()
                self.current[key] = self.current.get(key, 0.0) + time.perf_counter() - t

        return wrapper

    def callback(self) -> Any:
        from transformers import TrainerCallback

        timing = self

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                timing.begin()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                timing.end()

        return StepTimer()

    def trainer_class(self) -> Any:
        """GRPOTrainer with its generate-and-score phase timed."""
        from trl import GRPOTrainer

        timed = self.timed

        class TimedGRPOTrainer(GRPOTrainer):
            def _generate_and_score_completions(self, inputs: Any) -> Any:
                return timed("gen_score_s", super()._generate_and_score_completions)(inputs)

        return TimedGRPOTrainer


def _load(spec: dict[str, Any], result: dict[str, Any]) -> tuple[Any, Any, Any, Any, Any]:
    """The spec's model and tokenizer, the prompts as a dataset, the LoRA config and the GRPOConfig."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig

    on_cuda = torch.cuda.is_available()
    t = time.perf_counter()
    dtype = torch.bfloat16 if spec["settings"].get("bf16") else torch.float32
    # the word tokenizer by its own class: AutoTokenizer would swap in the model type's tokenizer (transformers 5
    # maps qwen2 checkpoints to Qwen2Tokenizer whatever tokenizer_config says), which cannot read "t5 t17"
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model"])
    # straight onto the GPU (TRL would move it there anyway; through host memory a 7B load takes longer)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, device_map="cuda" if on_cuda else None)
    result["load_s"] = time.perf_counter() - t
    data = datasets.Dataset.from_dict({"prompt": spec["prompts"]})
    lora = spec["lora"]
    peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"], lora_dropout=lora["lora_dropout"],
                             target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    settings = dict(spec["settings"])
    args = GRPOConfig(output_dir=spec["out"], max_steps=spec["steps"], generation_kwargs=spec["generation_kwargs"],
                      **settings)
    return model, tokenizer, data, peft_config, args


def _summarize(result: dict[str, Any], steps: list[dict[str, Any]], trainer: Any, on_cuda: bool) -> None:
    """Medians over the measured steps (all when there are no others), the peak, TRL's own logged metrics."""
    meas = [s for s in steps if not s["warmup"]] or steps
    med = {k: statistics.median(s[k] for s in meas) for k in
           ("step_s", "gen_score_s", "sync_s", "generate_s", "rest_of_gen_score_s", "update_s")}
    if on_cuda:
        med["peak_gb"] = max(s.get("peak_gb", 0.0) for s in steps)
    logs = [h for h in trainer.state.log_history if "loss" in h or "reward" in h]
    lengths = [h.get("completions/mean_length") for h in logs if h.get("completions/mean_length") is not None]
    result.update(status="ok", phase="done", median=med, log_history=logs,
                  mean_completion_length=statistics.mean(lengths) if lengths else None,
                  trl_step_time=[h.get("step_time") for h in logs if h.get("step_time") is not None])


# ---- AsyncGRPOTrainer (the async split's peer) ----
def seeded_random_reward(prompts: Any, completions: Any, **kwargs: Any) -> list[float]:
    """Uniform random rewards, seeded by each completion's text (TRL scores in a spawned child process, so the
    function must be module-level and its randomness its own)."""
    return [random.Random(zlib.crc32(str(c).encode())).random() for c in completions]


def _run_async(spec: dict[str, Any], result: dict[str, Any], save: Any) -> int:
    t_start = time.perf_counter()
    result["phase"] = "import"
    save()
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerFast
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    result["versions"] = _versions()
    if not torch.cuda.is_available():  # a CPU dry run: TRL asks CUDA for the GPU's peak FLOPs (its MFU metric)
        import trl.experimental.async_grpo.async_grpo_trainer as trainer_module

        trainer_module.get_peak_flops_per_device = lambda *a, **kw: None
    result["attention"] = _attention(torch.cuda.is_available(), spec.get("attention_fallback", True), result)
    save()
    result["phase"] = "trainer"
    save()
    # the word tokenizer by its own class (AutoTokenizer would swap in the model type's, which cannot read "t5 t17")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model"])
    tokenizer.padding_side = "left"
    # TRL's asynchronous GRPO takes conversations only: a chat template that renders the user's words verbatim (the
    # prompt's token ids, exactly), and a response template that reads the whole completion as the assistant's text
    # (its tool-call parser needs one; no tools here)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.response_template = {"defaults": {"role": "assistant"}, "fields": {"content": {"content": "text"}}}
    lora = spec["lora"]
    peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"], lora_dropout=lora["lora_dropout"],
                             target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    args = AsyncGRPOConfig(output_dir=spec["out"], max_steps=spec["steps"], **spec["settings"])
    t = time.perf_counter()
    trainer = AsyncGRPOTrainer(model=spec["model"], reward_funcs=seeded_random_reward, args=args,
                               train_dataset=datasets.Dataset.from_dict(
                                   {"prompt": [[{"role": "user", "content": p}] for p in spec["prompts"]]}),
                               processing_class=tokenizer, peft_config=peft_config)
    result["trainer_init_s"] = time.perf_counter() - t
    result["adapter_sync"] = bool(getattr(trainer, "_lora_sync", False))
    result["phase"] = "train"
    save()
    trainer.train()
    # each step's time is TRL's own (perf/step_s, end to end between optimizer steps), read by the layout
    logs = [h for h in trainer.state.log_history if "perf/step_s" in h or "loss" in h]
    result.update(status="ok", phase="done", log_history=logs, wall_s=time.perf_counter() - t_start)
    save()
    return 0


def _attention(on_cuda: bool, fallback: bool, result: dict[str, Any]) -> str:
    """What TRL's packed ("tree") attention runs on. TRL fetches FlashAttention-3 from the Hugging Face kernels
    Hub at run time (``kernels.get_kernel("kernels-community/flash-attn3")``); where that fails (no network, no
    ``kernels`` package, no GPU) the error is kept in ``result["fa3_error"]`` and, with ``fallback``, TRL's
    ``flash_attn_varlen_func`` call is served by :func:`varlen_sdpa` instead: the same contract on torch's SDPA,
    so the run goes on and its row says so."""
    from trl.experimental.async_grpo import packing

    try:
        if not on_cuda:
            raise RuntimeError("no CUDA: FlashAttention-3 needs a Hopper GPU")
        packing._flash_attn()
        return "flash-attn3 (kernels Hub)"
    except Exception as exc:  # noqa: BLE001 - the exact reason is the record
        result["fa3_error"] = f"{type(exc).__name__}: {exc}"[:400]
        if not fallback:
            raise
    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=varlen_sdpa)
    return "torch SDPA per segment (stand-in: FlashAttention-3 unavailable)"


def varlen_sdpa(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: Any, max_k: Any, softmax_scale: Any = None,
                causal: bool = True, window_size: Any = (-1, -1), **kwargs: Any) -> Any:
    """``flash_attn_varlen_func`` on torch SDPA, one packed segment at a time: q ``[total_q, heads, d]``, k/v
    ``[total_k, kv_heads, d]``, segment s the rows ``cu[s]:cu[s + 1]``; causal aligned bottom-right as
    FlashAttention aligns it when a segment has fewer queries than keys (query i sees keys up to i + Lk - Lq)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    if tuple(window_size) != (-1, -1) or kwargs.get("softcap"):
        raise NotImplementedError("the SDPA stand-in has no sliding window or softcap")
    groups = q.shape[1] // k.shape[1]
    outs = []
    for s in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        qs = q[a:b].transpose(0, 1).unsqueeze(0)
        ks = k[c:d].transpose(0, 1).repeat_interleave(groups, 0).unsqueeze(0)
        vs = v[c:d].transpose(0, 1).repeat_interleave(groups, 0).unsqueeze(0)
        mask = None
        if causal:
            i = torch.arange(b - a, device=q.device)[:, None]
            j = torch.arange(d - c, device=q.device)[None, :]
            mask = j <= i + (d - c) - (b - a)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale)[0]
                    .transpose(0, 1))
    return torch.cat(outs, 0)

if __name__ == "__main__":
    code = main(sys.argv[1])
    # AsyncGRPOTrainer's rollout worker is a multiprocessing child that outlives train(): the interpreter's exit
    # would join it, forever (H200 x2, 2026-11-30)
    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
