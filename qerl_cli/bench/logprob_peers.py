"""qerl's chunked log-probs against Liger-Kernel's fused linear losses: the update's lm_head + loss, fwd + bwd.

    python -m qerl_cli.bench.logprob_peers --out DIR [--hidden 3584 --vocab 152064 --rows 8 --completion 256]

One micro-batch of the update at a model shape (defaults: Qwen2.5-7B's hidden and vocabulary, 8 sequences x 256
completion tokens), random bf16 hidden states with gradient, the bf16 ``lm_head`` weight (frozen), GRPO with
group advantages, old log-probs near the current ones. Timed (CUDA events, median of ``--reps`` after a warm-up):

  chunked        qerl: ``ChunkedLogProb`` (train/logprobs.py) -> ``losses.policy_loss("grpo")`` -> backward
  liger_ce       Liger's fused linear + cross-entropy per token (``reduction="none"``, the ``--logprob-backend
                 liger`` path) -> the same policy loss -> backward
  liger_grpo     Liger's ``LigerFusedLinearGRPOLoss`` (fused linear + its own GRPO loss, ``loss_type="grpo"``,
                 beta 0) -> backward

Also checked: the log-probs of the two per-token paths, their gradients of the hidden states, and Liger's GRPO
loss against qerl's. Writes DIR/logprob_peers.json and prints a table; ``faster`` names the per-token path to
keep as ``--logprob-backend`` (liger_grpo is a reference: it replaces qerl's loss, corrections and metrics).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def _time(fn: Any, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def run(hidden: int, vocab: int, rows: int, completion: int, reps: int, chunk: int) -> dict[str, Any]:
    from qerl_cli.train.logprobs import chunked_token_logprobs, liger_token_logprobs
    from qerl_cli.train.losses import policy_loss

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n = rows * completion
    h0 = (torch.randn(n, hidden, device=dev, generator=g) * 1.0).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    y = torch.randint(0, vocab, (n,), device=dev, generator=g)
    adv = torch.randn(rows, device=dev, generator=g)
    mask = torch.ones(rows, completion, device=dev)
    with torch.no_grad():
        old = chunked_token_logprobs(h0, w, None, y, 1.0, chunk)[0].view(rows, completion)
        old = old + 0.01 * torch.randn(old.shape, device=dev, generator=g)
    res: dict[str, Any] = {"hidden": hidden, "vocab": vocab, "rows": rows, "completion": completion, "chunk": chunk,
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    def per_token(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = h0.detach().requires_grad_(True)
        if path == "chunked":
            lp = chunked_token_logprobs(h, w, None, y, 1.0, chunk)[0]
        else:
            lp = liger_token_logprobs(h, w, None, y, 1.0)
        loss, _ = policy_loss("grpo", lp.view(rows, completion), old, adv, mask, epsilon=0.2, epsilon_high=0.2,
                              max_completion_length=completion)
        loss.backward()
        return lp.detach(), h.grad, loss.detach()

    lp_c, g_c, loss_c = per_token("chunked")
    res["chunked_ms"] = _time(lambda: per_token("chunked"), reps)
    try:
        import liger_kernel

        res["liger_version"] = getattr(liger_kernel, "__version__", None)
        from importlib.metadata import version

        res["liger_version"] = res["liger_version"] or version("liger-kernel")
    except Exception as exc:  # noqa: BLE001 - liger missing or broken: say why, keep qerl's number
        res["liger_error"] = f"{type(exc).__name__}: {exc}"
        return res
    try:
        lp_l, g_l, loss_l = per_token("liger")
        res["liger_ce_ms"] = _time(lambda: per_token("liger"), reps)
        res["liger_ce_max_abs_dlogp"] = (lp_l - lp_c).abs().max().item()
        res["liger_ce_grad_rel_err"] = ((g_l.float() - g_c.float()).norm() / g_c.float().norm()).item()
        res["liger_ce_loss_diff"] = (loss_l - loss_c).abs().item()
    except Exception as exc:  # noqa: BLE001
        res["liger_ce_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        fused = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo", epsilon_low=0.2,
                                         epsilon_high=0.2, temperature=1.0, max_completion_length=completion)

        def liger_grpo() -> torch.Tensor:
            h = h0.detach().view(rows, completion, hidden).requires_grad_(True)
            out = fused(h, w, y.view(rows, completion), mask, adv, old_per_token_logps=old)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            return loss.detach()

        res["liger_grpo_loss_diff"] = (liger_grpo() - loss_c).abs().item()
        res["liger_grpo_ms"] = _time(liger_grpo, reps)
    except Exception as exc:  # noqa: BLE001
        res["liger_grpo_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if res.get("liger_ce_ms"):
        res["faster"] = "liger" if res["liger_ce_ms"] < res["chunked_ms"] else "chunked"
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    t0 = time.perf_counter()
    res = run(a.hidden, a.vocab, a.rows, a.completion, a.reps, a.chunk)
    res["wall_s"] = time.perf_counter() - t0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logprob_peers.json").write_text(json.dumps(res, indent=1))
    print(f"lm_head + GRPO loss, fwd+bwd, {a.rows} x {a.completion} tokens, hidden {a.hidden}, vocab {a.vocab}, "
          f"{res['gpu']}")
    for k in ("chunked", "liger_ce", "liger_grpo"):
        if res.get(f"{k}_ms") is not None:
            print(f"  {k:11} {res[k + '_ms']:8.2f} ms")
        elif res.get(f"{k}_error"):
            print(f"  {k:11} failed: {res[k + '_error']}")
    for k in ("liger_ce_max_abs_dlogp", "liger_ce_grad_rel_err", "liger_grpo_loss_diff", "liger_error", "faster"):
        if k in res:
            print(f"  {k}: {res[k]}")


if __name__ == "__main__":
    main()
