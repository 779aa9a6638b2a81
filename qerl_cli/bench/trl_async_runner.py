"""TRL's AsyncGRPOTrainer on one spec, in its own process (started by ``qerl_cli.bench.trl_async``).

    python -P trl_async_runner.py SPEC.json

Imports only TRL and what it needs (never qerl). The spec names a checkpoint and a running vLLM server (started
with ``--enable-lora``, so TRL syncs the LoRA adapter only: it saves the adapter and the server loads it through
``/v1/load_lora_adapter``), the prompts, TRL's settings and the LoRA config. It trains ``steps`` optimizer steps
and writes ``result`` (JSON): TRL's own logged metrics (``perf/step_s``, ``perf/weight_sync_s``,
``perf/rollout_wait_s``, ``batch/*``), the versions. Any exception is written there as ``error``, so a failure
says exactly where TRL stopped.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def synthetic_random_reward(prompts: Any, completions: Any, **kwargs: Any) -> list[float]:
    """Uniform random rewards, seeded by each completion's text (TRL scores in a spawned child process, so the
    function must be module-level and its randomness its own)."""
    return [random.Random(zlib.crc32(str(c).encode())).random() for c in completions]


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"status": "starting", "phase": "start"}
    out = Path(spec["result"])

    def save() -> None:
        out.write_text(json.dumps(result, default=str))

    try:
        return _run(spec, result, save)
    except BaseException as exc:  # noqa: BLE001 - the layout records exactly why TRL stopped
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:600]
        result["traceback"] = traceback.format_exc()[-4000:]
        save()
        traceback.print_exc()
        return 1


def _run(spec: dict[str, Any], result: dict[str, Any], save: Any) -> int:
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
    trainer = AsyncGRPOTrainer(model=spec["model"], reward_funcs=synthetic_random_reward, args=args,
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


def _versions() -> dict[str, Any]:
    import peft
    import torch
    import transformers
    import trl

    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "torch": torch.__version__}
    try:
        import vllm

        versions["vllm"] = vllm.__version__
    except ImportError:
        versions["vllm"] = None
    return versions


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
