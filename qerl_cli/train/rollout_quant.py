"""FlashRL rollouts: a quantized copy of the trained model, re-quantized in place after every update.

`RolloutQuant(model, fmt)` builds a second module tree over the trained model (full-precision weights,
optionally with LoRA adapters) that shares every tensor except the Linear layers: embeddings, norms,
rotary tables and lm_head are the SAME tensors (so norm training and AQN's norm overrides reach the
rollouts for free), while each projection is a `QuantLinear` holding only its quantized weight. With
LoRA the quantized weight is W + scale * B @ A merged, so the rollout copy carries no adapters.

With sharded training (train/fsdp.py) the trained norms and biases are sharded too: the copy then holds its
own copies of them (``private``), and ``bind_gather`` hands it one context per FSDP unit in which that
unit's weights are whole; `requantize_()` enters them one at a time (quantize the unit's projections, copy
its norms and biases, reshard), so the full-precision model is never gathered at once.

`requantize_()` refreshes those quantized tensors from the current trained weights by `copy_` into the
existing buffers (the Triton kernels of `qerl_kernels.quantize` on CUDA for INT8/FP8), so no tensor is
reallocated and the decode CUDA graphs, which bake in buffer addresses, stay valid. INT8 scales are
"fixed" by default, as FlashRL does: computed once from the initial weights (per-channel absmax, the
calibration) and reused, values beyond them clamp; "dynamic" recomputes them like FP8/NVFP4/MXFP4.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from qerl_cli.arch import spec_for
from qerl_cli.errors import QerlError
from qerl_cli.formats import dequantize, get_format, nvfp4_global_scale, rollout_formats
from qerl_cli.qlinear import QuantLinear

ROLLOUT_FORMATS = rollout_formats()


def check_full_precision_base(model: nn.Module, what: str) -> None:
    """FlashRL modes train full-precision weights: refuse a run dir whose model is already quantized."""
    from qerl_cli.moe import moe_blocks

    if moe_blocks(model):
        raise QerlError(f"{what} does not train mixture-of-experts models (their experts are frozen stacks): train "
                        "a LoRA on them instead (--finetune lora, --rollout-quant none)")
    fmt = next((m.fmt for m in model.modules() if isinstance(m, QuantLinear)), None)
    if fmt is not None:
        raise QerlError(f"{what} trains full-precision weights, but this run dir holds a {fmt} model: make one "
                        "with `qerl quantize --format bf16 --run NEW_DIR` and train there")


def _unwrap(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_base_layer")


def rollout_targets(lm: nn.Module) -> dict[str, nn.Module]:
    """Name -> trained projection (nn.Linear, or a peft LoRA layer over one) to quantize; lm_head stays."""
    targets: dict[str, nn.Module] = {}
    lora_prefixes: list[str] = []
    for name, m in lm.named_modules():
        if any(name.startswith(p) for p in lora_prefixes) or name == "lm_head" or name.endswith(".lm_head"):
            continue
        if _is_lora(m):
            targets[name] = m
            lora_prefixes.append(name + ".")
        elif isinstance(m, nn.Linear):
            targets[name] = m
    return targets


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight the trained layer applies: W, or W + scale * B @ A for its active adapters (fp32 then)."""
    if not _is_lora(module):
        return module.weight.detach()
    base = module.get_base_layer()
    w = base.weight.detach()
    if getattr(module, "disable_adapters", False):
        return w
    w = w.float()
    for name in module.active_adapters:
        if name in module.lora_A:
            a, b = module.lora_A[name].weight.detach().float(), module.lora_B[name].weight.detach().float()
            w = w + (b @ a) * module.scaling[name]
    return w


def _bias(module: nn.Module) -> torch.Tensor | None:
    return (module.get_base_layer() if _is_lora(module) else module).bias


class RolloutQuant:
    """The quantized rollout copy of `model` in `fmt`, and its in-place re-quantization."""

    def __init__(self, model: nn.Module, fmt: str, *, scales: str = "dynamic", dtype: torch.dtype | None = None,
                 use_kernels: bool | None = None, private: Collection[str] = ()) -> None:
        """``private``: names of the (unwrapped) model's parameters the copy holds its own copy of instead of
        sharing them (those a sharded trainer shards); ``requantize_`` refreshes them with the weights."""
        if fmt not in ROLLOUT_FORMATS:
            raise QerlError(f"--rollout-quant must be one of {', '.join(ROLLOUT_FORMATS)}, not {fmt!r}")
        spec = get_format(fmt)
        if scales == "fixed" and not spec.fixed_scales:
            fixed = ", ".join(n for n in ROLLOUT_FORMATS if get_format(n).fixed_scales)
            raise QerlError(f"--requant-scales fixed is for --rollout-quant {fixed} only")
        self.fmt = fmt
        self.spec = spec
        self.fixed_scales = scales == "fixed"
        lm = _unwrap(model)
        # the groups the rollout fuses share one global scale (the architecture declares them)
        self.projections = spec_for(lm).projections
        self.sources = rollout_targets(lm)
        if not self.sources:
            raise QerlError("the model has no Linear layer to quantize for the rollouts")
        block = spec.group_size or 1
        for name, m in self.sources.items():
            k = (m.get_base_layer() if _is_lora(m) else m).in_features
            if k % block:
                raise QerlError(f"{name} has {k} input features, not a multiple of {fmt}'s block of {block}: "
                                "choose --rollout-quant int8 or fp8")
        first = next(iter(self.sources.values()))
        self.dtype = dtype or (first.get_base_layer() if _is_lora(first) else first).weight.dtype
        self.use_kernels = use_kernels
        # Every parameter and buffer maps to itself: the copy gets new module objects over shared tensors,
        # except the private ones, which deepcopy clones.
        self.lm = lm
        self.private = sorted(private)
        unshared = {id(lm.get_parameter(n)) for n in self.private}
        memo: dict[int, Any] = {id(t): t for t in itertools.chain(lm.parameters(), lm.buffers())
                                if id(t) not in unshared}
        self.model = copy.deepcopy(lm, memo)
        for n in self.private:
            self.model.get_parameter(n).requires_grad_(False)
        self.units: list[tuple[str, Callable[[], contextlib.AbstractContextManager[Any]]]] = []
        private_set = set(self.private)
        self.layers: dict[str, QuantLinear] = {}
        gscales = self._global_scales() if spec.global_scale else {}
        for name, src in self.sources.items():
            w = effective_weight(src)
            bias = _bias(src)
            if bias is not None and f"{name}.bias" in private_set:
                bias = bias.detach().clone()
            qw = spec.quantize(w, global_scale=gscales.get(name), dtype=self.dtype)
            ql = QuantLinear.from_quantized(qw, bias=bias, act_quant=spec.act_quant)
            # CPU has no kernels: dequantize each weight once per update instead of on every forward
            ql.cache_dequantized = w.device.type == "cpu"
            _set_module(self.model, name, ql)
            self.layers[name] = ql
        self.model.eval()
        self.last_metrics: dict[str, float] = {}

    # ---- re-quantization ---------------------------------------------------------------------------
    def _global_scales(self, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Formats with a global scale (NVFP4): one per fused group (q/k/v, gate/up), from the current weights' amax
        (of ``names`` only: a fused group lies within one decoder layer, so one gathered unit holds all of it)."""
        names = list(self.sources) if names is None else list(names)
        amax = {n: effective_weight(self.sources[n]).float().abs().max() for n in names}
        out = {}
        for name in names:
            parent, _, leaf = name.rpartition(".")
            group = self.projections.fused_group(leaf)
            members = [f"{parent}.{g}" if parent else g for g in group]
            out[name] = nvfp4_global_scale(max(amax[m] for m in members if m in amax))
        return out

    def _kernels_for(self, w: torch.Tensor) -> bool:
        # qerl_kernels.quantize re-quantizes the per-channel 8-bit formats in place on the GPU
        return self.spec.kernel == "w8" and (w.is_cuda if self.use_kernels is None else self.use_kernels)

    def bind_gather(self, units: list[tuple[str, Callable[[], contextlib.AbstractContextManager[Any]]]]) -> None:
        """Sharded weights (train/fsdp.py): (module prefix, context in which that unit's weights are whole) per
        unit; ``requantize_`` then refreshes the copy unit by unit inside those contexts."""
        self.units = list(units)

    def _groups(self) -> list[tuple[Callable[[], contextlib.AbstractContextManager[Any]], list[str], list[str]]]:
        """(context, projection names, private parameter names) per gathered unit (one group without units).
        A projection's own bias is refreshed with its weight, so it is not listed again."""
        own_bias = {f"{n}.bias" for n in self.sources}
        private = [n for n in self.private if n not in own_bias]
        if not self.units:
            return [(contextlib.nullcontext, list(self.sources), private)]

        def owner(name: str) -> int:
            best = -1
            for i, (prefix, _) in enumerate(self.units):
                if (name == prefix or name.startswith(prefix + ".")) and \
                        (best < 0 or len(prefix) > len(self.units[best][0])):
                    best = i
            if best < 0:
                raise QerlError(f"{name} belongs to no sharded unit of the model; report this")
            return best

        groups: list[tuple[list[str], list[str]]] = [([], []) for _ in self.units]
        for name in self.sources:
            groups[owner(name)][0].append(name)
        for name in private:
            groups[owner(name)][1].append(name)
        return [(ctx, srcs, privs) for (_, ctx), (srcs, privs) in zip(self.units, groups, strict=True)]

    @torch.no_grad()
    def requantize_(self) -> dict[str, float]:
        """Refresh every quantized weight (and private norm/bias) from the trained weights, in place; returns
        rollout_quant metrics. With sharded weights every rank must call it (each unit is all-gathered)."""
        sync = next(iter(self.layers.values())).qweight.is_cuda
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = next(iter(self.sources))
        quality: dict[str, float] = {}
        for ctx, names, privs in self._groups():
            with ctx():
                gscales = self._global_scales(names) if self.spec.global_scale else {}
                for name in names:
                    self._requantize_one(name, gscales.get(name))
                for name in privs:
                    self.model.get_parameter(name).copy_(self.lm.get_parameter(name).detach())
                if first in names:
                    quality = self.quality()
        if sync:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        self.last_metrics = {"timing/requant_s": elapsed, **quality}
        return self.last_metrics

    def _requantize_one(self, name: str, global_scale: torch.Tensor | None) -> None:
        src = self.sources[name]
        ql = self.layers[name]
        w = effective_weight(src)
        if self._kernels_for(w):
            from qerl_kernels.quantize import quantize_w8_

            quantize_w8_(w, ql.weight, ql.weight_scale, self.fmt, recompute_scale=not self.fixed_scales)
        elif self.fixed_scales:
            s = ql.weight_scale.float()
            ql.weight.copy_(torch.round((w.float() / s).clamp(-128, 127)).to(torch.int8))
        else:
            qw = self.spec.quantize(w, global_scale=global_scale, dtype=self.dtype)
            for key, t in qw.tensors.items():
                getattr(ql, key).copy_(t)
        bias = _bias(src)
        if ql.bias is not None and bias is not None:
            ql.bias.copy_(bias.detach())
        ql.dequantized_cache = None
        _refresh_kernel_state(ql)

    @torch.no_grad()
    def quality(self) -> dict[str, float]:
        """Cheap check on the first layer: relative error of the quantized weight, and (INT8 fixed scales)
        the fraction of weights that outgrew the calibrated range (they clamp)."""
        name, src = next(iter(self.sources.items()))
        w = effective_weight(src).float()
        deq = dequantize(self.layers[name].quantized_weight, torch.float32)
        out = {"rollout_quant/rel_err": ((deq - w).norm() / w.norm().clamp(min=1e-30)).item()}
        if self.spec.fixed_scales:
            s = self.layers[name].weight_scale.float()
            # the calibration maps each row's absmax to 127.5 (which itself clamps to 127, as in the
            # reference); only weights that grew past it by more than rounding count
            out["rollout_quant/outside_calib_frac"] = ((w / s).abs() > 127.5 * (1 + 1e-3)).float().mean().item()
        return out

    # ---- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What resume needs besides the trained weights: the fixed INT8 scales (calibration)."""
        if not self.fixed_scales:
            return {"fmt": self.fmt, "fixed_scales": False}
        return {"fmt": self.fmt, "fixed_scales": True,
                "scales": {n: ql.weight_scale.detach().cpu().clone() for n, ql in self.layers.items()}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state or not state.get("fixed_scales") or not self.fixed_scales:
            return
        for name, s in state["scales"].items():
            if name not in self.layers:
                raise QerlError(f"checkpoint has rollout scales for {name}, which this model does not have")
            self.layers[name].weight_scale.copy_(s)


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _refresh_kernel_state(ql: QuantLinear) -> None:
    """The kernels cache tensors derived from the weight (FP8 scale row, FP4 repack) keyed by buffer address,
    which in-place updates keep: refresh them in place too (graphs read their addresses), or drop the
    state when a Python-level constant baked into the launch changed (MXFP4 shift; next launch rebuilds)."""
    st = getattr(ql, "kernel_layout_state", None)
    if st is None:
        return
    from qerl_kernels.fp4 import kernel_scales, mxfp4_shift, repack_fp4

    t = {n: getattr(ql, n) for n in ql.tensor_names}
    if ql.format.power_of_two_scales and mxfp4_shift(t["weight_scale"]) != st.shift:
        ql.kernel_layout_state = None
        return
    if st.fp8_scale_row is not None:
        st.fp8_scale_row.copy_(t["weight_scale"].float().reshape(1, -1))
    if st.repacked is not None:
        st.repacked.copy_(repack_fp4(t["weight_packed"], tiled=st.tiled))
    for dt, ks in st.kscales.items():
        ks.copy_(kernel_scales(t["weight_scale"], st.fmt, dt, st.shift, tiled=st.tiled))
