"""The routed experts of one Qwen3-30B-A3B MoE layer at decode sizes: qerl's grouped Triton kernel against humming's
indexed MoE GEMM, per projection and for the whole expert block with the experts' LoRA on and off (one H200 call).

    python scripts/moe_decode_bench.py OUT.json

128 experts, hidden 2048, expert intermediate 768, top-8, random NVFP4 experts from qerl's own quantizer, LoRA r32
on both projections; 1, 8, 64 and 256 tokens with uniformly random routing. Every time is the median of CUDA-graph
replays (`qerl_cli.bench.kernels.time_calls`; L2 flushed between replays, so the weights come from HBM). Exactness:
humming's output against the dequantized fp32 reference (relative Frobenius error) and against qerl's grouped
kernel. The byte floor of a row is the distinct experts its routing touches times the bytes of one expert (FP4
nibbles, E4M3 block scales, the global scale; the LoRA factors too when on) at 4.1 TB/s. The table goes last on
stdout; the JSON holds every row. Rows that would run past the time budget (humming compiles each new kernel
config with nvcc) are recorded as skipped.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

E, HIDDEN, INTER, TOP_K, RANK = 128, 2048, 768, 8, 32
TOKENS = (1, 8, 64, 256)
HBM_BPS = 4.1e12
BUDGET_S = 200.0  # leave the call's 4 minutes some room for start-up and the JSON


def expert_bytes(proj_shape: tuple[int, int], lora: bool) -> int:
    """Bytes one expert's projection reads: FP4 weight, one E4M3 scale per 16, the fp32 global scale (+ bf16 A, B)."""
    n, k = proj_shape
    return n * k // 2 + n * k // 16 + 4 + ((RANK * k + n * RANK) * 2 if lora else 0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def reference(dense: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, x_div: int,
              lora: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """fp32 y[a] = x[a // x_div] @ W_e^T (+ (x A_e^T) B_e^T), one touched expert at a time."""
    y = torch.zeros(ids.numel(), dense.shape[1], device=x.device)
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().squeeze(1)
        xe = x[rows // x_div].float()
        y[rows] = xe @ dense[e].T
        if lora is not None:
            y[rows] += (xe @ lora[0][e].float().T) @ lora[1][e].float().T
    return y


def bench_tokens(tokens: int, experts: torch.nn.Module, lora: dict, dense: dict, g: torch.Generator,
                 have_humming: bool) -> list[dict]:
    """The rows of one token count: each projection alone, then the whole block with LoRA off and on."""
    from qerl_kernels import dispatch, humming_peer
    from qerl_kernels.options import override

    from qerl_cli.bench.kernels import time_calls
    from qerl_cli.moe import DOWN, GATE_UP, Routing, _project_grouped

    dev, dt = g.device, torch.bfloat16
    rows: list[dict] = []
    index = torch.rand(tokens, E, device=dev, generator=g).topk(TOP_K, -1).indices
    weights = torch.softmax(torch.randn(tokens, TOP_K, device=dev, generator=g), -1).to(dt)
    ids = index.reshape(-1)
    touched = int(ids.unique().numel())
    routing = Routing(ids, E, kernels=True)
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=dt, generator=g)
    act = torch.randn(tokens * TOP_K, INTER, device=dev, dtype=dt, generator=g)
    block_floor = {on: 0.0 for on in (False, True)}

    def qerl(p: str, xi: torch.Tensor, xd: int) -> torch.Tensor:  # layouts made once per forward, as the block does
        return _project_grouped(experts, p, xi, routing, xd, None, None, 1.0)

    def hum(p: str, xi: torch.Tensor, xd: int) -> torch.Tensor:
        y = dispatch.experts_humming_forward(experts, p, xi, routing.expert_ids, xd, routing.layouts)
        if y is None:
            raise RuntimeError("humming refused this projection (see the log)")
        return y

    def block(lo: dict | None) -> torch.Tensor:
        return experts(x, index, weights, lora=lo)

    with torch.no_grad():
        for proj, xin, x_div, shape in ((GATE_UP, x, TOP_K, (2 * INTER, HIDDEN)), (DOWN, act, 1, (HIDDEN, INTER))):
            floor_us = touched * expert_bytes(shape, False) / HBM_BPS * 1e6
            for on in (False, True):
                block_floor[on] += touched * expert_bytes(shape, on) / HBM_BPS * 1e6
            ref = reference(dense[proj], xin, ids, x_div, None)
            call = (proj, xin, x_div)
            q_us = time_calls([lambda c=call: qerl(*c)])[0] * 1e3
            r = dict(tokens=tokens, what=proj, distinct_experts=touched, floor_us=floor_us, qerl_us=q_us,
                     qerl_pct_floor=100 * floor_us / q_us, qerl_rel_err=rel(qerl(*call), ref))
            rows.append(r)
            if not have_humming:
                continue
            try:
                y = hum(*call)
                block_m, _ = humming_peer.indexed_tuning(dispatch.experts_layer(experts, proj, dt), ids.numel())
                h_us = time_calls([lambda c=call: hum(*c)])[0] * 1e3
                r.update(humming_us=h_us, humming_pct_floor=100 * floor_us / h_us, humming_block_m=block_m,
                         humming_rel_err=rel(y, ref), humming_vs_qerl=rel(y, qerl(*call)), speedup=q_us / h_us)
            except Exception as exc:  # recorded, and the other rows still run
                r["humming_error"] = repr(exc)[:400]
        # the whole expert block (routing layout, both projections, SiLU, the weighted sum), LoRA off and on
        for on in (False, True):
            lo = lora if on else None
            ref_gu = reference(dense[GATE_UP], x, ids, TOP_K, (lora[GATE_UP].a, lora[GATE_UP].b) if on else None)
            a_ref = torch.nn.functional.silu(ref_gu[:, :INTER]) * ref_gu[:, INTER:]
            ref_dn = reference(dense[DOWN], a_ref, ids, 1, (lora[DOWN].a, lora[DOWN].b) if on else None)
            ref_y = (ref_dn.view(tokens, TOP_K, -1) * weights.float().unsqueeze(-1)).sum(1)
            r = dict(tokens=tokens, what="block+lora" if on else "block", distinct_experts=touched,
                     floor_us=block_floor[on])
            ys = {}
            for name in ("qerl", "humming") if have_humming else ("qerl",):
                try:
                    with override(linear_backend=name):  # the switch the rollout reads (QERL_LINEAR_BACKEND)
                        ys[name] = block(lo)
                        us = time_calls([lambda lo=lo: block(lo)])[0] * 1e3
                    r.update({f"{name}_us": us, f"{name}_pct_floor": 100 * block_floor[on] / us,
                              f"{name}_rel_err": rel(ys[name], ref_y)})
                except Exception as exc:
                    r[f"{name}_error"] = repr(exc)[:400]
            if len(ys) == 2 and "humming_us" in r:
                r["humming_vs_qerl"] = rel(ys["humming"], ys["qerl"])
                r["speedup"] = r["qerl_us"] / r["humming_us"]
            rows.append(r)
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    out_path = Path(argv[0])
    from qerl_kernels import humming_peer

    from qerl_cli.moe import DOWN, GATE_UP, LoraFactors, quantize_experts

    t0 = time.monotonic()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    props = torch.cuda.get_device_properties(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    experts = quantize_experts(torch.randn(E, 2 * INTER, HIDDEN, device=dev, generator=g) * 0.02,
                               torch.randn(E, HIDDEN, INTER, device=dev, generator=g) * 0.02, "nvfp4", dtype=dt)
    experts.to(dev)
    lora = {p: LoraFactors(torch.randn(E, RANK, k, device=dev, generator=g, dtype=dt) * 0.02,
                           torch.randn(E, n, RANK, device=dev, generator=g, dtype=dt) * 0.02)
            for p, (n, k) in ((GATE_UP, (2 * INTER, HIDDEN)), (DOWN, (HIDDEN, INTER)))}
    dense = {p: experts.dense_stack(p, torch.float32) for p in (GATE_UP, DOWN)}
    experts.dequantized_cache = {}  # the reference's copy only, not a kernel's
    have_humming = humming_peer.available()
    res: dict = {"gpu": props.name, "sms": props.multi_processor_count, "humming": humming_peer.version(),
                 "torch": torch.__version__, "shape": dict(experts=E, hidden=HIDDEN, intermediate=INTER, top_k=TOP_K,
                                                           lora_rank=RANK, fmt="nvfp4", dtype="bf16"),
                 "hbm_TBps": HBM_BPS / 1e12, "rows": []}
    print(f"moe decode bench on {props.name}; humming {res['humming'] if have_humming else 'absent'}", flush=True)

    for tokens in TOKENS:
        if time.monotonic() - t0 > BUDGET_S:
            res["rows"].append(dict(tokens=tokens, what="all", skipped=f"time budget {BUDGET_S:.0f} s spent"))
            continue
        res["rows"] += bench_tokens(tokens, experts, lora, dense, g, have_humming)
        print(f"tokens {tokens} done at {time.monotonic() - t0:.0f} s", flush=True)

    res["wall_s"] = time.monotonic() - t0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1))
    print(f"\n{'tokens':>6} {'what':<13} {'experts':>7} {'floor us':>8} {'qerl us':>8} {'%fl':>5} {'humm us':>8} "
          f"{'%fl':>5} {'x':>5} {'err ref':>8} {'err qerl':>8}")
    for r in res["rows"]:
        if "skipped" in r:
            print(f"{r['tokens']:>6} {r['what']:<13} skipped: {r['skipped']}")
            continue
        h = r.get("humming_us")
        print(f"{r['tokens']:>6} {r['what']:<13} {r['distinct_experts']:>7} {r['floor_us']:>8.1f} "
              f"{r.get('qerl_us', float('nan')):>8.1f} {r.get('qerl_pct_floor', float('nan')):>5.0f} "
              + (f"{h:>8.1f} {r['humming_pct_floor']:>5.0f} {r['speedup']:>5.2f} {r['humming_rel_err']:>8.1e} "
                 f"{r['humming_vs_qerl']:>8.1e}" if h is not None and "speedup" in r
                 else f"{'-':>8} {r.get('humming_error', '')[:60]}"))
    print(f"wrote {out_path} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
