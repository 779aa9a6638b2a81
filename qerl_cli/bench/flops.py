"""Model FLOPs of the training phases of an RL step, and the GPU's measured BF16 matmul ceiling (MFU).

Counted on the REAL tokens of the batch (prompt + completion of every sequence, no padding), so compute
spent on padding shows up as a lower MFU. Per forward (multiply-add = 2 FLOPs):

  linears    2 * P * tokens              P = the decoder's projection weights (q, k, v, o, gate, up, down)
  LoRA       2 * r * (in + out) * tokens per adapted projection
  attention  4 * heads * head_dim * pairs per layer     pairs = sum_i n_i (n_i + 1) / 2 (causal)
  lm_head    2 * hidden * vocab * loss tokens            (the chunked log-probs project only those)

recompute = one forward. fwd+bwd = the forward, the chunked log-prob Jacobian rows (another
2 * hidden * vocab per loss token), and the backward: the input gradient through every frozen linear
(2 P tokens), twice the attention forward, and three times the LoRA forward (dA, dB, dx). Gradient
checkpointing's extra forward is NOT counted (model FLOPs, not hardware FLOPs): with checkpointing on, the MFU
is lower by that recompute. The optimizer and the reference (KL) pass are not counted.
"""

from __future__ import annotations

from typing import Any

import torch


def matmul_ceiling_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float | None:
    """TFLOP/s of an n x n x n bf16 matmul on ``device`` (median of ``reps`` timed runs after a warm-up);
    None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2.0 * n**3 / _median_s(lambda: a @ b, device, reps) / 1e12


def _median_s(fn: Any, device: torch.device, reps: int) -> float:
    """The median (upper, for an even count) seconds of ``fn`` over ``reps`` CUDA-event-timed runs after three
    warm-up runs; the memory it allocated is handed back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def fp8_matmul_ceiling_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float | None:
    """TFLOP/s of an n x n x n E4M3 matmul (``torch._scaled_mm``, per-tensor scales, bf16 out) on ``device``: the
    MMA rate of the W4A8 path, measured like :func:`matmul_ceiling_tflops`; None off CUDA or where the GPU has no
    FP8 tensor cores."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    fp8 = torch.float8_e4m3fn
    a = torch.randn(n, n, device=device).to(fp8)
    b = torch.randn(n, n, device=device).to(fp8).t()  # column-major, as cuBLASLt's FP8 GEMM takes it
    one = torch.ones((), device=device)
    return 2.0 * n**3 / _median_s(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                  device, reps) / 1e12


def phase_flops(config: Any, *, tokens: float, attention_pairs: float, loss_tokens: float, lora_rank: int,
                lora_targets: list[str]) -> dict[str, float]:
    """FLOPs of the recompute forward and of forward + backward (see the module docstring; the counts are
    ``ModelDims.forward_flops`` / ``backward_flops``, which the memory plan's cost model uses too)."""
    from qerl_cli.train.model_dims import ModelDims

    dims = ModelDims.from_config(config)
    fwd = dims.forward_flops(tokens=tokens, attention_pairs=attention_pairs, loss_tokens=loss_tokens,
                             lora_rank=lora_rank, lora_targets=lora_targets)
    forward = sum(fwd.values())
    return {"recompute": forward, "fwd_bwd": forward + sum(dims.backward_flops(fwd).values())}


def add_mfu(row: dict[str, Any], config: Any, ceiling_tflops: float | None, *, lora_rank: int,
            lora_targets: list[str]) -> None:
    """Fill ``{recompute,fwd_bwd}_tflops`` and ``_mfu`` of a bench-step row from its token counts and seconds."""
    if not row.get("batch_tokens"):
        return
    fl = phase_flops(config, tokens=row["batch_tokens"], attention_pairs=row.get("batch_attention_pairs") or 0.0,
                     loss_tokens=row.get("batch_loss_tokens") or 0.0, lora_rank=lora_rank, lora_targets=lora_targets)
    for phase, flops in fl.items():
        secs = row.get(f"{phase}_s")
        if phase == "recompute" and not row.get("pi_old_pass", 1.0):
            secs = None  # no pass ran: the update's forward gave pi_old
        tf = flops / secs / 1e12 if secs else None
        row[f"{phase}_tflops"] = tf
        row[f"{phase}_mfu"] = tf / ceiling_tflops if tf is not None and ceiling_tflops else None
