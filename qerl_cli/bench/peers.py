"""The peers of `qerl bench step`: the same RL step run by the stacks users run today.

Two cells beside qerl's own (bench/step.py), on the same random model shape, prompts, lengths, seeds and GPU:

* ``FMT@vllm``: qerl's trainer with ``--rollout-engine vllm`` (QeRL's architecture: vLLM serves the quantized
  checkpoint with Marlin kernels, the live LoRA is pushed before every rollout, training runs in qerl). The
  random model is written as a checkpoint vLLM can load (:func:`write_shape_checkpoint`); the trainer gets it
  as ``model_dir``.
* ``trl``: TRL's ``GRPOTrainer`` with a peft LoRA and colocated vLLM (``use_vllm=True, vllm_mode="colocate"``)
  on the BF16 model, run in its own Python process (``trl_runner.py``), so nothing TRL, accelerate or datasets
  import or set (``RANK``, ``MASTER_PORT``, torch.distributed) reaches qerl's process. TRL's step is timed
  the way qerl's cells are: the wall time of each optimizer step (a ``TrainerCallback``, synchronized), and
  its parts from TRL's own phases: weight sync into vLLM, vLLM generate, the rest of generate-and-score (the
  old-log-prob forward and rewards), and the update (forward, backward, optimizer). Warm-up steps are
  discarded; numbers are medians of the measured steps, as in qerl's cells.

A token-level word tokenizer over the whole vocabulary (``t0 t1 ...``) makes the prompts exact: the text
``"t5 t17"`` encodes to ids ``[5, 17]`` in TRL's own tokenization, so both stacks see the same token ids.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_cli.arch import DEFAULT_LORA_TARGETS

TRL_RUNNER = Path(__file__).with_name("trl_runner.py")
LORA_TARGETS = list(DEFAULT_LORA_TARGETS)


def word_tokenizer(vocab: int, out: Path, eos_id: int | None = None) -> None:
    """Save a tokenizer whose token ``i`` is the word ``t{i}`` (whitespace-split, no special tokens added)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    eos = f"t{vocab - 1 if eos_id is None else eos_id}"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="t0").save_pretrained(str(out))


def prompt_text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def write_shape_checkpoint(model: nn.Module, out: Path, fmt: str) -> float:
    """Write a random shape model (``bench.shapes.build_random_model``) as a checkpoint: compressed-tensors for a
    quantized format (its state dict already uses the checkpoint's tensor names), plain safetensors for bf16,
    plus the word tokenizer. Returns the seconds it took."""
    from qerl_cli.checkpoint import save_tensors, target_linears, write_config
    from qerl_cli.formats import get_format

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_tensors(state, out)
    _, skipped = target_linears(model, ["lm_head"])
    from qerl_cli.moe import sparse_layers

    skipped += [f"{name}.gate" for name, _ in sparse_layers(model)]  # the routers stay in the model dtype
    write_config(model, out, get_format(fmt), skipped or ["lm_head"], None, torch.bfloat16)
    eos = getattr(model.config, "eos_token_id", None)
    word_tokenizer(int(model.config.vocab_size), out, eos if isinstance(eos, int) else None)
    return time.perf_counter() - t0


# ---- TRL ------------------------------------------------------------------------------------------
def trl_settings(cfg: Any, *, prompt_len: int, micro_batch: int, gradient_checkpointing: bool,
                 vllm_gpu_memory_utilization: float) -> dict[str, Any]:
    """GRPOConfig fields that make TRL's step the same work as qerl's (docs/bench_step.md says why each)."""
    seqs = cfg.batch_prompts * cfg.num_generations
    mb = max(1, min(micro_batch, seqs))
    while seqs % mb:  # TRL needs the generation batch to split into whole micro-batches
        mb -= 1
    return {
        "per_device_train_batch_size": mb,
        "gradient_accumulation_steps": seqs // mb,  # one generation (8 x 4 sequences) per optimizer step
        "num_generations": cfg.num_generations,
        "max_completion_length": cfg.max_completion_length,
        "num_iterations": 1,
        "learning_rate": cfg.lr,
        "lr_scheduler_type": "constant",
        "adam_beta2": 0.99,  # qerl's AdamW betas (0.9, 0.99)
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "beta": cfg.beta,
        "epsilon": cfg.epsilon,
        "loss_type": "grpo",  # qerl's grpo: mean over a sequence's tokens, summed over sequences
        "scale_rewards": cfg.scale_rewards,
        "bf16": True,
        "gradient_checkpointing": gradient_checkpointing,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": vllm_gpu_memory_utilization,
        "vllm_max_model_length": prompt_len + cfg.max_completion_length,
        "seed": cfg.seed,
        "shuffle_dataset": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_dropout": True,
    }


def run_trl(*, model: nn.Module, cfg: Any, prompts: list[list[int]], stop_ids: list[int] | None, prompt_len: int,
            warmup: int, measure: int, micro_batch: int, gradient_checkpointing: bool, seed: int,
            vllm_gpu_memory_utilization: float, timeout_s: float | None, log: Any,
            scratch: Path | None = None, use_vllm: bool = True,
            before_run: Callable[[], None] | None = None, log_dir: Path | None = None) -> dict[str, Any]:
    """Write ``model`` (bf16) as a Hugging Face checkpoint, run ``trl_runner.py`` on it in a subprocess, return
    the cell's row (status "ok", or exactly why TRL did not run). ``before_run``: called once the checkpoint is
    written (the caller frees its copy of the model: TRL loads its own). ``log_dir``: where the runner's output
    is kept (``trl_runner.log``)."""
    work = Path(tempfile.mkdtemp(prefix="qerl-trl-", dir=scratch))
    row: dict[str, Any] = {"lora_rank": cfg.lora_rank}
    try:
        row["write_ckpt_s"] = write_shape_checkpoint(model, work / "model", "bf16")
        if before_run is not None:
            before_run()
        settings = trl_settings(cfg, prompt_len=prompt_len, micro_batch=micro_batch,
                                gradient_checkpointing=gradient_checkpointing,
                                vllm_gpu_memory_utilization=vllm_gpu_memory_utilization)
        if not torch.cuda.is_available():  # a CPU dry run: fp32
            settings["bf16"] = False
        if not use_vllm:  # TRL generating with transformers (a CPU dry run without vLLM)
            settings["use_vllm"] = False
        # fixed lengths: no stop at all; EOS workload: the bench's stop set (TRL passes these to vLLM)
        gen_kwargs = {"ignore_eos": True} if not stop_ids else {"ignore_eos": True, "stop_token_ids": stop_ids}
        if not use_vllm:
            gen_kwargs = {"eos_token_id": stop_ids} if stop_ids else {"eos_token_id": None}
        spec = {
            "model": str(work / "model"), "out": str(work / "trl_out"), "result": str(work / "result.json"),
            "prompts": [prompt_text(p) for p in prompts], "seed": seed, "steps": warmup + measure,
            "warmup": warmup, "settings": settings, "generation_kwargs": gen_kwargs,
            "lora": {"r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                     "target_modules": list(cfg.lora_targets)},
        }
        (work / "spec.json").write_text(json.dumps(spec))
        row["trl_settings"] = settings
        row["generation_kwargs"] = gen_kwargs
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        log_file = work / "trl_runner.log"
        t0 = time.perf_counter()
        timed_out = False
        with open(log_file, "w") as f:
            try:
                proc = subprocess.run([sys.executable, "-P", str(TRL_RUNNER), str(work / "spec.json")],
                                      cwd=str(work), env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                timed_out, code = True, None
        row["process_s"] = time.perf_counter() - t0
        text = log_file.read_text(errors="replace")
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(log_file, log_dir / "trl_runner.log")
        result_file = work / "result.json"
        result = json.loads(result_file.read_text()) if result_file.is_file() else {}
        if timed_out:
            row["status"] = f"TRL did not finish within {timeout_s:.0f} s (phase: {result.get('phase', 'start')})"
        elif code != 0 or result.get("status") != "ok":
            why = result.get("error") or _last_error(text) or f"exit code {code}"
            row["status"] = f"TRL failed: {why}"
        if row.get("status"):
            row["log_tail"] = text[-3000:]
            row.update({k: v for k, v in result.items() if k not in ("status", "error")})
            log(f"trl: {row['status']}")
            return row
        row.update(result)
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _last_error(text: str) -> str | None:
    """The last exception line of a traceback in ``text``."""
    for line in reversed(text.strip().splitlines()):
        s = line.strip()
        if s and (s.split(":")[0].endswith(("Error", "Exception")) or s.startswith("RuntimeError")):
            return s[:500]
    return None
