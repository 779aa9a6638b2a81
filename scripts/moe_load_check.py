"""Do vLLM and transformers load qerl's mixture-of-experts checkpoint, and compute what qerl computes?

    python scripts/moe_load_check.py --out OUT_DIR [--shape tiny-moe] [--formats nvfp4 mxfp4 bf16] [--engines vllm hf]
    python scripts/moe_load_check.py --out OUT_DIR --model-dir RUN/model

A random model of ``--shape`` (``bench.shapes``; ``qwen3-30b-a3b`` is the real architecture) is built on the GPU in
each format and written as a checkpoint the way ``qerl quantize`` writes MoE models (per-expert compressed-tensors
tensors, routers in the ignore list; ``bench.peers.write_shape_checkpoint``), or ``--model-dir`` names one that
``qerl quantize`` wrote. Then, per engine, greedy completions of a few random prompts and their log-probs are
compared with qerl's own forward (``qerl_cli.checkpoint.load_quantized`` on the same directory, bf16):

* ``vllm``: ``vllm.LLM`` on the directory (NVFP4 experts run through vLLM's compressed-tensors MoE method, Marlin
  W4A16 on Hopper); its greedy tokens and their log-probs against qerl's teacher-forced log-probs.
* ``hf``: transformers' ``AutoModelForCausalLM`` (its compressed-tensors loader dequantizes the experts into the
  fused parameters); logits against qerl's. transformers up to at least 5.19 drops NVFP4 experts' global scales
  when it dequantizes them (huggingface/transformers#48371), so its NVFP4 logits are expected to differ there.

Writes OUT_DIR/moe_load_check.json and prints one line per (format, engine).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch


def write_model(shape: str, fmt: str, out: Path) -> Path:
    from qerl_cli.bench.peers import write_shape_checkpoint
    from qerl_cli.bench.shapes import build_random_model

    model = build_random_model(shape, fmt, "cuda" if torch.cuda.is_available() else "cpu", seed=0)
    model.config.eos_token_id = None
    write_shape_checkpoint(model, out, fmt)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def qerl_logprobs(model_dir: Path, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
    """qerl's log-prob of each completion token (teacher forced, bf16, the training forward)."""
    from qerl_cli.checkpoint import load_quantized

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_quantized(model_dir, dtype=torch.bfloat16, device=dev)
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            logits = model(torch.tensor([p + c], device=dev)).logits[0].float()
            steps = torch.log_softmax(logits[len(p) - 1:len(p) + len(c) - 1], -1)
            out.append(steps.gather(-1, torch.tensor(c, device=dev)[:, None])[:, 0].cpu())
    del model
    return out


def vllm_check(model_dir: Path, prompts: list[list[int]], new: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt

    t = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=max(map(len, prompts)) + new + 8,
              gpu_memory_utilization=0.5, enforce_eager=True, skip_tokenizer_init=True)
    startup = time.perf_counter() - t
    sp = SamplingParams(temperature=0.0, max_tokens=new, logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    mu = [torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks, strict=True)])
          for o, toks in zip(outs, tokens, strict=True)]
    del llm
    pi = qerl_logprobs(model_dir, prompts, tokens)
    d = torch.cat([m - p for m, p in zip(mu, pi, strict=True)])
    return {"startup_s": startup, "tokens": sum(map(len, tokens)), "max_abs_dlogp": d.abs().max().item(),
            "mean_abs_dlogp": d.abs().mean().item(), "k1": d.mean().item()}


def hf_check(model_dir: Path, prompts: list[list[int]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from qerl_cli.checkpoint import load_quantized

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(dev)
    ours = load_quantized(model_dir, dtype=torch.bfloat16, device=dev)
    worst = agree = 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=dev)
            a, b = hf(ids).logits.float(), ours(ids).logits.float()
            worst = max(worst, (a - b).abs().max().item())
            agree += (a.argmax(-1) == b.argmax(-1)).float().mean().item() / len(prompts)
    return {"max_abs_dlogit": worst, "argmax_agree": agree}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="tiny-moe")
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "mxfp4", "bf16"])
    ap.add_argument("--model-dir", default=None, help="a checkpoint `qerl quantize` wrote (instead of --shape)")
    ap.add_argument("--engines", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"args": vars(a), "results": []}
    dirs = [(None, Path(a.model_dir))] if a.model_dir else [(f, out / f"model_{f}") for f in a.formats]
    for fmt, model_dir in dirs:
        if fmt is not None:
            write_model(a.shape, fmt, model_dir)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab - 1, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
        for engine in a.engines:
            row: dict[str, Any] = {"format": fmt or str(model_dir), "engine": engine}
            try:
                row.update(vllm_check(model_dir, prompts, a.new) if engine == "vllm" else hf_check(model_dir, prompts))
                row["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 - what the engine raised is the result
                row["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            res["results"].append(row)
            print(json.dumps(row), flush=True)
            (out / "moe_load_check.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
