"""The decode step's LoRA shrinks on one GPU: every fused-shrink plan against the unfused launches they replace.

For each model's four projection groups (q/k/v and gate/up read the RMSNorm's output, o the attention output,
down the SiLU's) and each decode batch M, this times, in CUDA graphs over rotating copies of A (so A streams
from DRAM as it does in a 28-64 layer step):

* ``unfused``: what the engine runs without fused shrinks: the norm / SiLU kernel, then cuBLAS ``x @ A^T``;
* ``producer``: the norm / SiLU kernel alone (what the step pays without LoRA);
* ``norm+shrink`` (norm groups): the norm kernel, then the one-launch plain shrink with its rule's plan;
* one row per fused-shrink plan (``qerl_kernels.decode.ShrinkPlan``): the rule's plan and variants of K tile,
  K splits, warps, pipeline stages, rows per program and the norm pass's block width.

It answers which plan the rule should pick and whether the one-launch norm form beats norm + shrink at each M
(``NORM_SHRINK_MAX_ROWS``). Run on the GPU machine: ``python -m qerl_cli.bench.lora_shrinks OUT.json``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from qerl_cli.bench import harness
from qerl_cli.bench.kernels import MODELS, l2_bytes, save_result, time_calls, weight_copies

SHRINK_MS = (8, 64)
RANK = 32
MAX_SPLITS = 128


def groups(model: str) -> list[tuple[str, int, int, int]]:
    """(group, prologue, K, R) of one decoder layer's LoRA shrinks with rank ``RANK`` on all seven linears."""
    from qerl_kernels.decode import SHRINK_NORM, SHRINK_PLAIN, SHRINK_SILU

    c = MODELS[model]
    return [("qkv", SHRINK_NORM, c["hidden"], 3 * RANK), ("gate_up", SHRINK_NORM, c["hidden"], 2 * RANK),
            ("o", SHRINK_PLAIN, c["heads"] * c["head_dim"], RANK), ("down", SHRINK_SILU, c["intermediate"], RANK)]


def plan_variants(m: int, k: int, r: int, prologue: int, sms: int) -> list[tuple[str, Any]]:
    """The rule's plan first, then variants along each axis (deduplicated)."""
    import triton
    from qerl_kernels.decode import SHRINK_NORM, SHRINK_SUM_BYTES, ShrinkPlan, shrink_plan

    rule = shrink_plan(m, k, r, prologue, sms)
    out: list[tuple[str, Any]] = [("rule", rule)]
    for bk in (64, 128, 256):
        kt = triton.cdiv(k, bk)
        for iters in (1, 2, 4):
            splits = max(1, triton.cdiv(kt, iters))
            # an unrolled sum of more partials than ~128 compiles slowly and reads too much in one program
            if splits <= MAX_SPLITS and splits * min(m, 16) * rule.br * 4 <= 4 * SHRINK_SUM_BYTES:
                out.append((f"bk{bk}_it{iters}", rule._replace(bk=bk, splits=splits)))
    out += [("w8", rule._replace(warps=8)), ("st3_it4", rule._replace(splits=max(1, rule.splits // 4), stages=3))]
    if m >= 32 and prologue != SHRINK_NORM:
        out.append(("bm_all", rule._replace(bm=max(16, triton.next_power_of_2(m)))))
    if prologue == SHRINK_NORM:
        out += [("bkn128", rule._replace(bkn=128)), ("bkn512", rule._replace(bkn=512))]
    seen, uniq = set(), []
    for name, p in out:
        if p not in seen and isinstance(p, ShrinkPlan):
            seen.add(p)
            uniq.append((name, p))
    return uniq


def _inputs(prologue: int, m: int, k: int, device: torch.device, g: torch.Generator) -> dict[str, torch.Tensor]:
    from qerl_kernels.decode import SHRINK_NORM, SHRINK_SILU

    bf = torch.bfloat16
    if prologue == SHRINK_NORM:
        return {"h": torch.randn(m, k, device=device, generator=g).to(bf),
                "d": torch.randn(m, k, device=device, generator=g).to(bf),
                "w": (1 + 0.1 * torch.randn(k, device=device, generator=g)).to(bf)}
    if prologue == SHRINK_SILU:
        gu = torch.randn(m, 2 * k, device=device, generator=g).to(bf)
        return {"gate": gu[:, :k], "up": gu[:, k:]}
    return {"x": torch.randn(m, k, device=device, generator=g).to(bf)}


def _calls(method: str, prologue: int, ins: dict, a_copies: list[torch.Tensor], plan: Any) -> list[Callable]:
    """One call per A copy: the method on the same inputs."""
    from qerl_kernels import decode as kd

    def one(a: torch.Tensor) -> Callable[[], Any]:
        if prologue == kd.SHRINK_NORM:
            h, d, w = ins["h"], ins["d"], ins["w"]
            if method == "producer":
                return lambda: kd.add_rmsnorm(h, d, w, 1e-6)
            if method == "unfused":
                return lambda: torch.mm(kd.add_rmsnorm(h, d, w, 1e-6)[1], a.t())
            if method == "norm+shrink":
                return lambda: kd.lora_shrink(kd.add_rmsnorm(h, d, w, 1e-6)[1], a)
            return lambda: kd.rmsnorm_shrink(h, d, w, 1e-6, a, plan=plan)
        if prologue == kd.SHRINK_SILU:
            gate, up = ins["gate"], ins["up"]
            if method == "producer":
                return lambda: kd.silu_mul(gate, up)
            if method == "unfused":
                return lambda: torch.mm(kd.silu_mul(gate, up), a.t())
            return lambda: kd.silu_mul_shrink(gate, up, a, plan=plan)
        x = ins["x"]
        if method == "producer":
            return lambda: None
        if method == "unfused":
            return lambda: torch.mm(x, a.t())
        return lambda: kd.lora_shrink(x, a, plan=plan)

    return [one(a) for a in a_copies]


def sweep_shrinks(shapes: Sequence[str] = ("qwen2.5-7b", "qwen2.5-32b"), ms: Sequence[int] = SHRINK_MS,
                  out_json: Path | None = None, *, deadline_s: float = 1e9, rep_ms: int = 15,
                  log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Rows: model, group, M, K, R, method (``unfused`` | ``producer`` | ``norm+shrink`` | plan variant name),
    plan key, us per call (CUDA-graph replays over rotating A copies, do_bench median)."""
    from qerl_kernels.decode import SHRINK_NORM

    t_end = time.monotonic() + deadline_s
    device = harness.device(cuda_only="the LoRA shrink sweep")
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    l2 = l2_bytes(device)
    res = harness.header("bench/lora_shrinks", device=props.name, sms=sms, l2_bytes=l2, ms=list(ms),
                         shapes=list(shapes), rank=RANK,
                         timing="triton.testing.do_bench median over CUDA-graph replays of rotating A copies")
    res["errors"] = []
    g = torch.Generator(device=device).manual_seed(0)
    for model in shapes:
        for group, prologue, k, r in groups(model):
            a0 = (0.02 * torch.randn(r, k, device=device, generator=g)).to(torch.bfloat16)
            a_copies = [a0] + [a0.clone() for _ in range(weight_copies(a0.numel() * 2, l2) - 1)]
            for m in ms:
                ins = _inputs(prologue, m, k, device, g)
                methods: list[tuple[str, Any]] = [("unfused", None), ("producer", None)]
                if prologue == SHRINK_NORM:
                    methods.append(("norm+shrink", None))
                methods += plan_variants(m, k, r, prologue, sms)
                for name, plan in methods:
                    if time.monotonic() > t_end:
                        res["errors"].append(f"{model} {group} M={m} {name}: skipped, deadline")
                        continue
                    if name == "producer" and prologue not in (1, 2):
                        continue
                    try:
                        t, mode = time_calls(_calls(name, prologue, ins, a_copies, plan), rep_ms=rep_ms)
                    except Exception as exc:  # noqa: BLE001 - a plan that fails to build is a row, not the end
                        res["errors"].append(f"{model} {group} M={m} {name}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    res["results"].append({"model": model, "group": group, "M": m, "K": k, "R": r,
                                           "method": name, "plan": None if plan is None else plan.key(),
                                           "plan_fields": None if plan is None else list(plan),
                                           "us": t * 1e3, "timing": mode})
                if log:
                    rows = [x for x in res["results"] if (x["model"], x["group"], x["M"]) == (model, group, m)]
                    log(f"{model} {group} M={m}: " + ", ".join(f"{x['method']} {x['us']:.1f}" for x in rows))
                if out_json is not None:
                    save_result(res, out_json)
            del a_copies, a0
            torch.cuda.empty_cache()
    if out_json is not None:
        save_result(res, out_json)
    return res


def summary(res: dict) -> list[str]:
    """Per (model, group, M): unfused, producer alone, the rule, the best plan and norm+shrink, in us."""
    cells: dict[tuple, dict[str, dict]] = {}
    for x in res["results"]:
        cells.setdefault((x["model"], x["group"], x["M"]), {})[x["method"]] = x
    lines = ["| model | group | M | unfused | producer | norm+shrink | rule | best plan | best us |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|"]

    def us(c: dict, name: str) -> str:
        return f"{c[name]['us']:.1f}" if name in c else "-"

    for (model, group, m), c in cells.items():
        plans = [x for n, x in c.items() if x["plan"] is not None]
        best = min(plans, key=lambda x: x["us"]) if plans else None
        best_us = f"{best['us']:.1f}" if best else "-"
        lines.append(f"| {model} | {group} | {m} | {us(c, 'unfused')} | {us(c, 'producer')} | {us(c, 'norm+shrink')} "
                     f"| {us(c, 'rule')} | {best['plan'] if best else '-'} | {best_us} |")
    return lines


if __name__ == "__main__":  # python -m qerl_cli.bench.lora_shrinks OUT.json [DEADLINE_S]
    out = Path(sys.argv[1])
    r_ = sweep_shrinks(out_json=out, deadline_s=float(sys.argv[2]) if len(sys.argv) > 2 else 1e9)
    print("\n".join(summary(r_)))
