"""Check the vllm rollout engine on one quantized run: LoRA push, processed log-probs vs the training forward.

    python scripts/vllm_check.py --run RUN [--dtype bf16] [--prompts 8] [--n 4] [--new 64] --out OUT_DIR

RUN is a run directory after `qerl quantize` (any format vLLM serves: bf16 on CPU; nvfp4 etc. on CUDA). Prints one
table line and writes OUT_DIR/vllm_check.json: mismatch of vLLM (mu) against qerl's training forward (pi) on the
sampled tokens (k1, k3, max |dlogp|), tokens/s, LoRA sync, sleep and wake-up times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--out", default="out/vllm_check")
    a = ap.parse_args()

    from qerl_cli.lora import attach_lora, make_lora_config
    from qerl_cli.manifest import RunDir
    from qerl_cli.models import load_model
    from qerl_cli.rollout import SamplingParams, make_engine
    from qerl_cli.runlayout import quantized_model_dir
    from qerl_cli.train.batch import build_batch, sampled_logprobs

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = quantized_model_dir(RunDir(Path(a.run)))
    base, tok = load_model(str(model_dir), dtype=dtype, device=device)
    model = attach_lora(base, make_lora_config(a.rank, 2 * a.rank), seed=0)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # a trained-looking adapter: non-zero B
        if "lora_B" in name:
            p.data = (torch.randn(p.shape, generator=g) * 0.02).to(p.device)
    t0 = time.perf_counter()
    engine = make_engine("vllm", model, tok, model_dir=model_dir, max_batch_slots=a.prompts * a.n,
                         max_model_len=128 + a.new, gpu_memory_utilization=0.4, dtype=dtype)
    startup = time.perf_counter() - t0
    prompts = [tok(f"Question: {i} + {3 * i + 1} = ?\nAnswer:")["input_ids"] for i in range(a.prompts)]
    sp = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.new, stop_token_ids=[], seed=0)
    engine.generate(prompts[:1], SamplingParams(n=1, max_tokens=4, seed=0))  # warm-up
    res = engine.generate(prompts, sp)
    t1 = time.perf_counter()
    engine.release()
    sleep_s = time.perf_counter() - t1
    mem_asleep = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else 0.0
    res2 = engine.generate(prompts[:1], SamplingParams(n=1, max_tokens=4, seed=0))
    samples = res.samples
    batch = build_batch([s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
                        [s.logprobs for s in samples], [False] * len(samples), pad_id=0).to(device)
    with torch.no_grad():
        pi, _ = sampled_logprobs(model, batch, 1.0)
    mask = batch.mask > 0
    mu = batch.rollout_logp
    d = (mu - pi)[mask].float()
    rho = torch.exp(-d)
    out = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "run": str(a.run), "dtype": a.dtype, "prompts": a.prompts, "n": a.n, "new_tokens": a.new,
        "startup_s": startup, "timings": res.timings, "sleep_s": sleep_s, "wake_s": res2.timings["wake_s"],
        "cuda_allocated_asleep_gib": mem_asleep,
        "k1": d.mean().item(), "k3": (rho - torch.log(rho) - 1).mean().item(),
        "max_abs_dlogp": d.abs().max().item(),
        "max_abs_dp": (torch.exp(mu) - torch.exp(pi))[mask].abs().max().item(),
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "vllm_check.json").write_text(json.dumps(out, indent=1))
    print(f"vllm_check {a.dtype} {out['device']}: tok/s {res.timings['tokens_per_s']:.1f} "
          f"lora_sync {res.timings['lora_sync_s'] * 1e3:.0f} ms, sleep {sleep_s:.2f} s, wake {out['wake_s']:.2f} s, "
          f"k1 {out['k1']:.2e} k3 {out['k3']:.2e} max|dlogp| {out['max_abs_dlogp']:.3f} "
          f"max|dp| {out['max_abs_dp']:.3f}")


if __name__ == "__main__":
    main()
