"""humming-kernels (the W4A16 kernel family vLLM uses on Hopper) as a peer backend for qerl's FP4 layers.

humming is optional: `available()` says whether it imports here. It takes compressed-tensors NVFP4/MXFP4
tensors as they are (its compressed-tensors schema converts them: the NVFP4 global scale becomes its
second-level tensor scale `1/G`), repacks them into its own layout at `transform()`, and JIT-compiles a
CUDA kernel with nvcc on the first call of each (shape, tile config); `warm(layer, ms)` does that ahead of
timing. The converted layout is humming's own copy of the weight (0.5 byte per weight plus scales).
`build_experts` / `experts_forward` do the same for a MoE layer's stacked experts through humming's indexed MoE GEMM
(routing in vLLM's moe_align_block_size layout, `qerl_kernels.moe.indexed_layout`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import Any

import torch

_CT_CONFIG = {
    "nvfp4": {"format": "nvfp4-pack-quantized", "type": "float", "num_bits": 4, "strategy": "tensor_group",
              "group_size": 16},
    "mxfp4": {"format": "mxfp4-pack-quantized", "type": "float", "num_bits": 4, "strategy": "group",
              "group_size": 32},
}
FORMATS = tuple(_CT_CONFIG)


@functools.cache
def available() -> bool:
    if importlib.util.find_spec("humming") is None or not torch.cuda.is_available():
        return False
    try:
        import humming.layer  # noqa: F401
    except Exception:  # a broken install (missing cuda-bindings, no nvcc) counts as absent
        return False
    return True


def version() -> str | None:
    if importlib.util.find_spec("humming") is None:
        return None
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _v

    try:
        return _v("humming-kernels")
    except PackageNotFoundError:
        return None


# humming's own input schema: activations quantized to E4M3 per token inside its forward (its W4A8 path)
_FP8_INPUT = {"quant_method": "humming", "dtype": "float8e4m3", "quant_mode": "dynamic_token"}
ACTS = ("bf16", "fp8")
# humming's W4A8 schedules (SM90 WGMMA on E4M3 activations) apply a weight scale group to the fp32 partial at the
# group's end, so a group must span at least the FP8 MMA's K of 32: MXFP4's does; NVFP4's 16 is refused at the first
# forward, when humming picks its kernel ("weight scale group=16 is smaller than MMA K=32", H200, 2026-11-29; the
# layer itself builds). tests/test_w4a8_cuda.py fails if a humming version runs NVFP4 within the W4A8 bound
W4A8_FORMATS = ("mxfp4",)


def build(tensors: dict[str, torch.Tensor], fmt: str, n: int, k: int, *, bias: torch.Tensor | None = None,
          dtype: torch.dtype = torch.bfloat16, act: str = "bf16") -> Any:
    """A transformed `humming.layer.HummingLayer` computing x @ dequant(W)^T (+ bias) on the tensors' GPU.

    `act="fp8"` asks humming for its W4A8 path (dynamic per-token E4M3 activations, `_FP8_INPUT`); whether it
    accepts a format's block scales with FP8 activations on this GPU is humming's decision, raised here as its
    own error (scripts/w4a8_bench.py records it)."""
    from humming.layer import HummingLayer

    if fmt not in _CT_CONFIG:
        raise ValueError(f"humming peer covers {', '.join(FORMATS)}, not {fmt!r}")
    if act not in ACTS:
        raise ValueError(f"humming peer activations: {', '.join(ACTS)}, not {act!r}")
    device = tensors["weight_packed"].device
    extra = {"input_config": dict(_FP8_INPUT)} if act == "fp8" else {}
    with torch.device(device):
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "compressed-tensors",
                                                                   **_CT_CONFIG[fmt]},
                             has_bias=bias is not None, torch_dtype=dtype, **extra)
    state = {name: t for name, t in tensors.items() if name in ("weight_packed", "weight_scale",
                                                                 "weight_global_scale")}
    if bias is not None:
        state["bias"] = bias.detach().to(dtype)
    layer.load_from_tensors(state)
    layer.transform()
    return layer


def forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def warm(layer: Any, x: torch.Tensor) -> None:
    """Run once so humming's JIT compile (nvcc, seconds per shape) happens outside any timing."""
    layer(x)
    torch.cuda.synchronize(x.device)


# ---- routed experts: humming's indexed MoE GEMM (vLLM's moe_align_block_size layout) --------------------------
# The compute config that makes humming's kernel read its rows through sorted_ids/expert_ids (its "indexed" GEMM)
_INDEXED = json.dumps({"gemm_type": "indexed"})


def build_experts(tensors: dict[str, torch.Tensor], fmt: str, num_experts: int, n: int, k: int, *,
                  dtype: torch.dtype = torch.bfloat16) -> Any:
    """A transformed `HummingLayer` over every expert of one projection: `tensors` are the stacked checkpoint
    tensors (`weight_packed [E, N, K/2]`, `weight_scale [E, N, K/G]`, NVFP4's `weight_global_scale [E]`), which
    humming's compressed-tensors schema takes with the expert dimension first. Its repack is humming's own copy."""
    from humming.layer import HummingLayer

    if fmt not in _CT_CONFIG:
        raise ValueError(f"humming peer covers {', '.join(FORMATS)}, not {fmt!r}")
    device = tensors["weight_packed"].device
    with torch.device(device):
        layer = HummingLayer(shape_n=n, shape_k=k, num_experts=num_experts,
                             weight_config={"quant_method": "compressed-tensors", **_CT_CONFIG[fmt]}, torch_dtype=dtype)
    # qerl keeps each expert's global scale as [E, 1] (one per weight, broadcast over rows); humming's schema is [E]
    layer.load_from_tensors({name: t.reshape(num_experts) if name == "weight_global_scale" else t
                             for name, t in tensors.items()
                             if name in ("weight_packed", "weight_scale", "weight_global_scale")})
    layer.transform()
    return layer


def indexed_tuning(layer: Any, assignments: int) -> tuple[int, str]:
    """(block rows, tuning config JSON) of humming's own heuristic kernel choice for an indexed GEMM of
    `assignments` rows. The routing must be padded to exactly that kernel's block rows, so the kernel is pinned
    by its config (one config in, one kernel out) rather than left to humming's per-M list, whose entry the
    launcher picks after the caller has laid the routing out. Host-only; cached per (layer, assignments)."""
    cache = layer.__dict__.setdefault("_qerl_tuning", {})
    hit = cache.get(assignments)
    if hit is None:
        from humming.tune import get_heuristics_config

        cfg = get_heuristics_config(layer.humming_config, shape_m=max(1, assignments), gemm_type="indexed",
                                    device=layer.weight.device)
        hit = cache[assignments] = (int(cfg["block_shape"][0]), json.dumps(cfg, default=_json_value))
    return hit


def _json_value(v: Any) -> Any:
    """An enum's value or a numpy scalar's Python value, as humming's own config strings hold them."""
    if hasattr(v, "value"):
        return v.value
    if hasattr(v, "item"):
        return v.item()
    raise TypeError(f"not JSON serializable: {v!r}")


def experts_forward(layer: Any, x: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                    num_tokens_padded: torch.Tensor, *, top_k: int, tuning: str) -> torch.Tensor:
    """y [rows(x) * top_k, N] in assignment order: ``y[a] = x[a // top_k] @ dequant(W_{e(a)})^T`` over the
    routing laid out at `indexed_tuning`'s block rows (`qerl_kernels.moe.indexed_layout`)."""
    return layer(x, sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=num_tokens_padded,
                 top_k=top_k, compute_config=_INDEXED, tuning_config=tuning)
