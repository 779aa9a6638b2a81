"""The floors of a decode step, per profile category: the bytes its kernels must move and the FLOPs they must do.

``qerl bench rollout --profile`` times a decode step's GPU kernels by category (``decode_profile.py``); this module
says how many bytes each category has to read and write for that step, so the profile can show each
category against physics: its floor is ``bytes / copy bandwidth`` (the device-to-device copy GB/s measured
once per run, read + write bytes per second, which is how the bytes here are counted too), and the
category reaches ``floor / measured`` of it.

What is counted, for the step as the runner runs it now (its projection plan, fused ops, attention):

* quantized GEMM / dense GEMM: each base GEMM's weight as resident (FP4 bytes + block scales + global
  scale; bf16 for dense bases), its bias, its activations in and out; the lm_head (dense) and its logits;
  a LoRA expand done in a quantized GEMM's epilogue adds its B factor and h here.
* LoRA: the bf16 shadows the step really reads (``A_cat`` of a shrink run as its own GEMM, the
  block-diagonal ``B_blk`` of an in-place expand, zeros included) and h; an in-place expand also reads and
  writes the base output.
* norm/RoPE/activation: residual adds + RMSNorms (read h and delta, write h and x), Qwen3's q/k norms,
  RoPE + the K/V cache write, SiLU * up; and ``A_cat`` of the shrinks fused into the norm / SiLU kernels.
* attention: the K and V the step needs, ``2 x layers x batch x (context + 1) x kv_heads x head_dim``
  (the live context); ``attention_read_bytes`` is what SDPA reads with the power-of-two KV bucket
  (``kv_len`` positions per row, plus the mask), up to twice that. q in, o out.
* sampling: one read of the logits (what the one-pass sampler reads; the torch path makes ~10 passes).
* copies / other: nothing (the embedding gather and the step's tiny index tensors).

FLOPs are counted for the same work, as it runs: 2 x rows x in x out per base GEMM (the lm_head too), 2 x rows x r x
(in + out) per LoRA group (block-diagonal B_blk with its zeros: what the expand multiplies), 2 x 2 x rows x
(context + 1) x heads x head_dim per layer of attention (q k^T and p v over the live keys), the routed experts of a
sparse layer. A category's floor is the larger of bytes / copy bandwidth and FLOPs / the matrix rate of the path
(the run's measured BF16 matmul rate: every kernel of the decode step multiplies on the BF16 tensor cores), so at
large batches, where the GEMMs are bound by the tensor cores, the bench says so instead of showing a byte floor
no kernel could reach.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from qerl_cli.rollout.fast_layers import ProjGroup
    from qerl_cli.rollout.model_runner import ModelRunner


def module_bytes(m: nn.Module) -> int:
    """Bytes of weight (as resident) and bias one forward of a base module reads."""
    from qerl_cli.qlinear import QuantLinear

    if isinstance(m, QuantLinear):
        return m.weight_nbytes + (0 if m.bias is None else m.bias.numel() * m.bias.element_size())
    return sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))


def _in_out(m: nn.Module) -> tuple[int, int]:
    from qerl_cli.qlinear import QuantLinear

    if isinstance(m, QuantLinear | nn.Linear):
        return int(m.in_features), int(m.out_features)
    w = getattr(m, "weight", None)
    return (int(w.shape[1]), int(w.shape[0])) if isinstance(w, torch.Tensor) and w.dim() == 2 else (0, 0)


def _add(out: dict[str, float], cat: str, nbytes: float) -> None:
    out[cat] = out.get(cat, 0.0) + float(nbytes)


def _gemm_flops(rows: int, k: int, n: int) -> float:
    return 2.0 * rows * k * n


def group_bytes(g: ProjGroup, rows: int, elem: int, shrink_fused: bool, out: dict[str, float],
                flops: dict[str, float]) -> None:
    """One projection group's base GEMM(s) and LoRA, by category: bytes into ``out``, FLOPs into ``flops``.
    ``shrink_fused``: its shrink ran inside the kernel that made its input (a norm or SiLU kernel), which reads
    ``A_cat`` instead of a GEMM."""
    base_cat = "quantized GEMM" if g.base_kind == "qgemm" else "dense GEMM"
    bases = [g.single] if g.single is not None else g.calls
    for m in bases:
        k, n = _in_out(m)
        _add(out, base_cat, module_bytes(m) + rows * (k + n) * elem)
        _add(flops, base_cat, _gemm_flops(rows, k, n))
    if g.a_cat is None:
        return
    r, k_in = g.a_cat.shape
    shrink_cat = "norm/RoPE/activation" if shrink_fused else "LoRA"
    _add(out, shrink_cat, (g.a_cat.numel() + rows * r) * elem)
    _add(flops, shrink_cat, _gemm_flops(rows, k_in, r))
    if g.b_blk is not None:
        n = g.b_blk.shape[0]
        # in the GEMM's epilogue: B and h; an in-place addmm_ also reads and writes the base output again
        expand_cat, rewrite = (base_cat, 0) if g.expand_in_epilogue else ("LoRA", 2 * rows * n)
        _add(out, expand_cat, (g.b_blk.numel() + rows * r + rewrite) * elem)
        _add(flops, expand_cat, _gemm_flops(rows, r, n))
    else:
        for sb in g.sb:
            if sb is not None:
                _add(out, "LoRA", (sb.numel() + rows * sb.shape[1] + 2 * rows * sb.shape[0]) * elem)
                _add(flops, "LoRA", _gemm_flops(rows, sb.shape[1], sb.shape[0]))


def moe_bytes(plan: Any, rows: int, elem: int, out: dict[str, float], flops: dict[str, float]) -> None:
    """A sparse MLP's router (dense) and experts: only the experts the step's ``rows`` tokens are routed to are read,
    their expected number under uniform routing (``moe.MoeDims.active_experts``), with their LoRA copies' rows."""
    from qerl_cli.moe import MoeDims

    experts = plan.base
    e, h, i = experts.num_experts, experts.hidden, experts.intermediate
    _add(out, "dense GEMM", module_bytes(plan.gate) + rows * (h + e) * elem)
    _add(flops, "dense GEMM", _gemm_flops(rows, h, e))
    active = MoeDims(e, int(plan.top_k), i).active_experts(rows) / e
    k = int(plan.top_k)
    base_cat = "quantized GEMM" if experts.format.quantized else "dense GEMM"
    _add(out, base_cat, experts.weight_nbytes * active + rows * k * (2 * h + 3 * i) * elem)
    _add(flops, base_cat, _gemm_flops(rows * k, h, 3 * i))  # gate, up and down of each routed token
    for f in plan.lora.values():
        r = f.a.shape[1]
        _add(out, "LoRA", (f.a.numel() + f.b.numel()) * elem * active + rows * k * r * elem * 2)
        _add(flops, "LoRA", 2.0 * rows * k * (f.a.numel() + f.b.numel()) / e)  # per expert: r x (in + out)


def decode_step_bytes(runner: ModelRunner, batch: int, context: int, kv_len: int) -> dict[str, Any]:
    """{"bytes": {category: bytes}, "attention_read_bytes": ...} for one decode step of ``batch`` rows whose
    cache holds ``context`` positions (this step writes position ``context``), SDPA over ``kv_len``."""
    cfg = runner.config
    elem = torch.empty((), dtype=runner.dtype).element_size()
    kv_elem = elem if runner.cache is None else runner.cache.shape.dtype.itemsize
    hidden, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
    heads, kvh, d, layers = runner.num_heads, runner.num_kv_heads, runner.head_dim, runner.num_layers
    m = batch
    out: dict[str, float] = {}
    fl: dict[str, float] = {}
    ops = runner.ops
    fused_rows = m <= ops.FUSED_SHRINK_MAX_ROWS
    norm_fused = ops.enabled["rmsnorm_shrink"] and fused_rows
    silu_fused = ops.enabled["silu_mul_shrink"] and fused_rows
    plan = runner.plan
    for i, layer in enumerate(runner.layers):
        lp = plan.layers[i] if plan is not None else None
        if lp is not None:
            group_bytes(lp.qkv, m, elem, norm_fused, out, fl)
            group_bytes(lp.o, m, elem, False, out, fl)
            if lp.gate_up is not None and lp.down is not None:
                group_bytes(lp.gate_up, m, elem, norm_fused, out, fl)
                group_bytes(lp.down, m, elem, silu_fused, out, fl)
            elif lp.moe is not None:
                moe_bytes(lp.moe, m, elem, out, fl)
            else:
                for mod in layer.mlp.modules():
                    if mod is not layer.mlp and not list(mod.children()):
                        k, n = _in_out(mod)
                        _add(out, "dense GEMM", module_bytes(mod) + m * (k + n) * elem)
                        _add(fl, "dense GEMM", _gemm_flops(m, k, n))
        else:
            for mod in (layer.self_attn, layer.mlp):
                for sub in mod.modules():
                    if not list(sub.children()) and _in_out(sub) != (0, 0):
                        k, n = _in_out(sub)
                        _add(out, "dense GEMM", module_bytes(sub) + m * (k + n) * elem)
                        _add(fl, "dense GEMM", _gemm_flops(m, k, n))
        # two residual adds + RMSNorms (the first layer's input norm has no residual to add), SiLU * up
        _add(out, "norm/RoPE/activation", (8 - (1 if i == 0 else 0)) * m * hidden * elem + 2 * hidden * elem)
        _add(out, "norm/RoPE/activation", 3 * m * inter * elem)
        if runner.qk_norm is not None:
            _add(out, "norm/RoPE/activation", 2 * m * (heads + kvh) * d * elem)
        # RoPE + K/V write: q, k, v in; q out; k, v into the cache
        _add(out, "norm/RoPE/activation", m * ((heads + 2 * kvh) * d + heads * d) * elem + 2 * m * kvh * d * kv_elem)
        _add(out, "attention", 2 * m * (context + 1) * kvh * d * kv_elem + 2 * m * heads * d * elem)
        _add(fl, "attention", 2 * _gemm_flops(m, (context + 1), heads * d))
    _add(out, "norm/RoPE/activation", 4 * m * hidden * elem + hidden * elem)  # the final norm
    vocab = runner.vocab_size
    _add(out, "dense GEMM", module_bytes(runner.lm_head) + m * (hidden + vocab) * elem)
    _add(fl, "dense GEMM", _gemm_flops(m, hidden, vocab))
    _add(out, "sampling", m * vocab * elem)
    bucket = layers * (2 * m * kv_len * kvh * d * kv_elem + 2 * m * heads * d * elem + m * kv_len * elem)
    return {"bytes": out, "flops": fl, "attention_read_bytes": float(bucket), "total_bytes": sum(out.values()),
            "total_flops": sum(fl.values())}


def w4a8_flop_share(ran: dict[tuple[int, int], dict[str, int]]) -> float:
    """The share of the quantized linears' FLOPs that ran a W4A8 kernel (FP8 MMA), from the dispatch's record of
    what ran ({(N, K): {kernel: forwards}}, every forward of one decode step at the same M): N x K x forwards."""
    total = w4a8 = 0.0
    for (n, k), kernels in ran.items():
        for name, count in kernels.items():
            total += n * k * count
            w4a8 += n * k * count if "w4a8" in name else 0.0
    return w4a8 / total if total else 0.0


def path_rate(bf16_tflops: float | None, fp8_tflops: float | None, fp8_share: float) -> float | None:
    """The MMA rate of a category whose FLOPs run ``fp8_share`` on FP8 tensor cores and the rest on BF16 ones:
    the time of each part at its own rate, summed (harmonic)."""
    if not bf16_tflops:
        return None
    if fp8_share <= 0 or not fp8_tflops:
        return bf16_tflops
    return 1.0 / (fp8_share / fp8_tflops + (1.0 - fp8_share) / bf16_tflops)


def floors(step_bytes: dict[str, float], ms: dict[str, float], copy_gbps: float | None,
           step_flops: dict[str, float] | None = None, mma_tflops: float | None = None,
           cat_tflops: dict[str, float | None] | None = None) -> dict[str, dict]:
    """Per category: bytes, FLOPs, the byte floor (bytes over the copy bandwidth), the FLOP floor (FLOPs over the
    matrix rate of the path that ran: ``cat_tflops`` where given, e.g. the quantized GEMMs on the FP8 tensor
    cores, else ``mma_tflops``), ``floor_ms`` the larger of those known, ``bound`` which one it is, and the % of
    that floor the measured ms reach (None without a bandwidth or a measured time)."""
    rows: dict[str, dict] = {}
    for cat, nbytes in step_bytes.items():
        byte_floor = nbytes / (copy_gbps * 1e9) * 1e3 if copy_gbps else None
        nflops = (step_flops or {}).get(cat, 0.0)
        rate = (cat_tflops or {}).get(cat) or mma_tflops
        flop_floor = nflops / (rate * 1e12) * 1e3 if rate and step_flops is not None else None
        floor, bound = byte_floor, "bytes"
        if flop_floor is not None and (floor is None or flop_floor > floor):
            floor, bound = flop_floor, "FLOPs"
        t = ms.get(cat)
        rows[cat] = {"bytes": nbytes, "flops": nflops, "mma_TFLOPs": rate if flop_floor is not None else None,
                     "byte_floor_ms": byte_floor, "flop_floor_ms": flop_floor,
                     "floor_ms": floor, "bound": bound if floor is not None else None,
                     "pct_of_floor": 100.0 * floor / t if floor is not None and t else None}
    return rows


def step_floor_ms(cat_floors: dict[str, dict]) -> float | None:
    """The whole step's floor: the sum of its categories' floors (each the larger of its bytes and FLOPs)."""
    known = [f["floor_ms"] for f in cat_floors.values() if f.get("floor_ms") is not None]
    return sum(known) if known else None
