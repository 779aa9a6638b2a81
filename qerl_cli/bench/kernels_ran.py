"""Which kernels ran a bench cell's quantized linears, named per projection class.

The dispatcher picks a kernel per GEMM shape and batch bucket (`qerl_kernels.dispatch`), so one decode step can
run humming for q/k/v and qerl's CUDA kernel for down: the bench's `linears` column must say what ran, not what
the format would choose by default. The kernels count every forward where they launch; a cell resets the count,
runs, and reads it back here.
"""

from __future__ import annotations

from typing import Any


def _dispatch() -> Any | None:
    try:
        from qerl_kernels import dispatch
    except ImportError:  # qerl_kernels is optional: without it no kernel counts a forward
        return None
    return dispatch


def reset() -> None:
    d = _dispatch()
    if d is not None:
        d.reset_ran()


def projection_classes(config: Any) -> dict[tuple[int, int], str]:
    """(N, K) -> the projection class(es) of a decoder layer with that GEMM shape, fused or not ("q|o" where two
    classes share a shape)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or hidden // heads
    inter = getattr(config, "intermediate_size", None)
    shapes: dict[tuple[int, int], list[str]] = {}
    pairs = [("qkv", (heads + 2 * kv) * hd, hidden), ("q", heads * hd, hidden), ("kv", kv * hd, hidden),
             ("o", hidden, heads * hd)]
    if inter:
        pairs += [("gate_up", 2 * inter, hidden), ("gate|up", inter, hidden), ("down", hidden, inter)]
    moe_inter = getattr(config, "moe_intermediate_size", None)  # the routed experts (one class per projection)
    if moe_inter and (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)):
        pairs += [("experts gate_up", 2 * moe_inter, hidden), ("experts down", hidden, moe_inter)]
    for name, n, k in pairs:
        names = shapes.setdefault((n, k), [])
        if name not in names:
            names.append(name)
    return {key: "|".join(v) for key, v in shapes.items()}


def summarize(ran: dict[tuple[int, int], dict[str, int]], classes: dict[tuple[int, int], str],
              default: str) -> tuple[str, dict[str, dict[str, int]]]:
    """(the column's label, {projection class: {kernel: forwards}}): one kernel's name when every class ran on it,
    "mixed" with the split otherwise, ``default`` (the format's own path) when no counted kernel ran."""
    split: dict[str, dict[str, int]] = {}
    order = list(classes)  # the layer's order: q/k/v before o before the MLP
    for (n, k), kernels in sorted(ran.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order),
                                                              kv[0])):
        name = classes.get((n, k), f"{n}x{k}")
        per = split.setdefault(name, {})
        for kernel, count in kernels.items():
            per[kernel] = per.get(kernel, 0) + count
    used = {kernel for per in split.values() for kernel in per}
    if not used:
        return default, split
    if len(used) == 1:
        return next(iter(used)), split
    parts = []
    for name, per in split.items():
        top = max(per, key=lambda kernel: per[kernel])
        parts.append(f"{name} {top}" if len(per) == 1 else f"{name} " + "+".join(sorted(per)))
    return "mixed (" + ", ".join(parts) + ")", split


def read(config: Any, default: str) -> tuple[str, dict[str, dict[str, int]]]:
    """What ran since `reset`, summarized for a model of `config`."""
    d = _dispatch()
    return summarize(d.ran() if d is not None else {}, projection_classes(config), default)
