"""The training LoRA linear: y = base(x) + s * x A^T B^T as one autograd node on the tensor cores.

Why: peft's LoRA Linear casts the activations to the adapters' fp32 dtype, so its two adapter GEMMs run as fp32
SIMT kernels, with cast, scale and add kernels around them, forward and backward (about a dozen small kernels per
linear beside the base); and every op is host time (~70 us of wall per kernel in the measured 7B step).

What runs per call, for 2-D x [M, K], the fp32 masters A [r, K] and B [N, r], scaling s, and sA = s*A, sB = s*B
kept in the activation dtype (`AdapterShadows`):

- forward: y = base(x) (no autograd node of its own), h = x @ sA^T [M, r], y.addmm_(h, sB^T, alpha=1/s):
  the base and two GEMM-class kernels; x and h (tiny) are saved;
- backward: g = dy @ sB [M, r]; dx = base_dx(dy), dx.addmm_(g, sA, alpha=1/s); dA = g^T x; dB = dy^T h: the
  base's dx and four GEMM-class kernels. dA and dB are computed in the activation dtype on the tensor cores (as
  autocast would) and handed back as fp32, so autograd accumulates them straight into the masters' fp32 grads.

The scaling rides in both shadows, with 1/s as cuBLAS's alpha where the two meet: then h and g already carry s,
dA = g^T x and dB = dy^T h need no scale kernel, and one 16-bit copy of the adapter serves forward and backward.

The shadows are built on the first forward after a master changed (an optimizer step drops them; a version or
storage change of a master, the dtype or the scaling rebuilds them), so no cast runs per call.

Exactness: in fp32 this is peft's LoRA math up to GEMM order and the rounding of s*A, s*B and the 1/s factor (none
for a power-of-two s, as the default alpha = 2r gives). In bf16/fp16 it differs from peft's fp32-adapter path by
rounding only: the adapter products are formed from 16-bit operands (the shadows, x, dy) with fp32 accumulation,
and h and g are rounded to the activation dtype, where peft multiplies fp32 copies.

The base runs without autograd through `BaseOps`: an ``nn.Linear`` (F.linear; dx = dy @ W), a ``QuantLinear`` on
qerl_kernels (``linear_forward`` / ``linear_backward_dx``, the same kernels ``QuantLinear.forward`` runs) or on
the torch reference (dequantize, then multiply: CPU). Anything else (bitsandbytes' NF4, a base that trains, LoRA
dropout while training, several active adapters, DoRA and other variants) keeps the layer's own forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qerl_cli import kernel_dispatch
from qerl_cli.formats import fake_quantize_activations
from qerl_cli.qlinear import QuantLinear


@dataclass(frozen=True)
class BaseOps:
    """A frozen base layer without autograd, for 2-D activations: y = forward(x, base), dx = dx(dy, base)."""

    name: str
    forward: Callable[[torch.Tensor, nn.Module], torch.Tensor]
    dx: Callable[[torch.Tensor, nn.Module], torch.Tensor]


def _dense_forward(x: torch.Tensor, base: nn.Module) -> torch.Tensor:
    return F.linear(x, base.weight, base.bias)


def _dense_dx(dy: torch.Tensor, base: nn.Module) -> torch.Tensor:
    return dy.mm(base.weight)


def _reference_forward(x: torch.Tensor, base: nn.Module) -> torch.Tensor:
    if base.act_quant is not None:  # as QuantLinear.forward; its straight-through gradient is dy @ W
        x = fake_quantize_activations(x, base.act_quant)
    bias = base.bias
    return F.linear(x, base.dequantized_weight(x.dtype), None if bias is None else bias.to(x.dtype))


def _reference_dx(dy: torch.Tensor, base: nn.Module) -> torch.Tensor:
    # dequantized again rather than kept from the forward: no [N, K] copy lives from forward to backward
    return dy.mm(base.dequantized_weight(dy.dtype))


DENSE = BaseOps("dense", _dense_forward, _dense_dx)
QUANT_KERNELS = BaseOps("kernels", kernel_dispatch.kernel_forward, kernel_dispatch.kernel_backward_dx)
QUANT_REFERENCE = BaseOps("reference", _reference_forward, _reference_dx)


def frozen(base: nn.Module) -> bool:
    """No parameter of `base` trains (the fast path computes no base weight gradient; a QuantLinear's weight is
    buffers, only its bias is a parameter)."""
    for p in base._parameters.values():
        if p is not None and p.requires_grad:
            return False
    return True


def base_ops(base: nn.Module, x: torch.Tensor) -> BaseOps | None:
    """How the fast path runs `base` for activations like `x`, or None where only the module's own forward is
    right (bitsandbytes' NF4 kernels, an nn.Linear of another dtype, a layer type it does not know)."""
    if type(base) is nn.Linear:
        return DENSE if base.weight.dtype == x.dtype else None
    if isinstance(base, QuantLinear) and x.is_floating_point():
        if kernel_dispatch.kernels_cover(x, base):
            return QUANT_KERNELS
        return None if kernel_dispatch.uses_bitsandbytes(x, base) else QUANT_REFERENCE
    return None


# Every shadow set alive, so an optimizer step can drop them all: a fused optimizer (AdamW(fused=True)) writes the
# masters without bumping their version counter, and after a step every shadow is stale anyway, so between the
# optimizer step and the next training forward (the rollout) they take no memory.
_live: weakref.WeakSet[AdapterShadows] = weakref.WeakSet()
_hook_registered = False


def _drop_all_shadows(*_args: object) -> None:
    for sh in list(_live):
        sh.invalidate()


def _watch_optimizer_steps() -> None:
    global _hook_registered
    if not _hook_registered:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_drop_all_shadows)
        _hook_registered = True


class AdapterShadows:
    """sA = s*A and sB = s*B of one adapter in the activation dtype, built on the first forward after a master
    changed: its storage or version counter (in-place updates under autograd's eye, `load_state_dict`, a foreach
    or for-loop optimizer), the dtype or the scaling; and dropped by every optimizer step (any torch optimizer,
    fused ones included). A write through ``.data`` is invisible to all of these: call `invalidate` after one.
    While built they hold one 16-bit copy of the adapter, what peft's per-call casts held for backward."""

    def __init__(self) -> None:
        self.masters: tuple[torch.Tensor, torch.Tensor] | None = None
        self.key: tuple | None = None
        self.sa: torch.Tensor | None = None
        self.sb: torch.Tensor | None = None

    def invalidate(self) -> None:
        self.masters = self.key = self.sa = self.sb = None

    def __deepcopy__(self, memo: dict) -> AdapterShadows:
        return AdapterShadows()  # a cache: a copied layer builds (and registers) its own on its first forward

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def get(self, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        key = (a._version, b._version, a.data_ptr(), b.data_ptr(), dtype, scale)
        masters = self.masters
        if masters is None or masters[0] is not a or masters[1] is not b or key != self.key:
            _watch_optimizer_steps()
            with torch.no_grad():
                self.sa = (a.detach() * scale).to(dtype)
                self.sb = (b.detach() * scale).to(dtype)
            self.masters, self.key = (a, b), key
            _live.add(self)
        return self.sa, self.sb


_out_dtype_mm: bool | None = None  # does this torch multiply 16-bit CUDA operands straight into fp32 (mm.dtype)?


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b on the tensor cores in the operands' dtype, as fp32: one kernel where torch has ``mm(out_dtype=)`` (16-bit
    CUDA operands, fp32 accumulate and output), else the product in the operands' dtype, then a cast."""
    global _out_dtype_mm
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _out_dtype_mm is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _out_dtype_mm = True
            return out
        except (TypeError, RuntimeError):  # an older torch: no fp32-output product for 16-bit operands
            _out_dtype_mm = False
    return torch.mm(a, b).float()


class LoraLinearFunction(torch.autograd.Function):
    """y = base(x) + (x @ sA^T) @ sB^T / s for 2-D x, with fp32 gradients for the masters A and B (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, base: nn.Module, ops: BaseOps,  # noqa: ANN001
                sa: torch.Tensor, sb: torch.Tensor, inv_scale: float) -> torch.Tensor:
        y = ops.forward(x, base)
        h = torch.mm(x, sa.t())
        y.addmm_(h, sb.t(), alpha=inv_scale)
        ctx.save_for_backward(x, h)
        ctx.base, ctx.ops, ctx.sa, ctx.sb, ctx.inv_scale = base, ops, sa, sb, inv_scale
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        x, h = ctx.saved_tensors
        if not dy.is_contiguous():  # the kernels' dx reads dense rows
            dy = dy.contiguous()
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        g = torch.mm(dy, ctx.sb) if need_x or need_a else None
        dx = da = db = None
        if need_x:
            dx = ctx.ops.dx(dy, ctx.base)
            dx.addmm_(g, ctx.sa, alpha=ctx.inv_scale)
        if need_a:
            da = mm_f32(g.t(), x)
        if need_b:
            db = mm_f32(dy.t(), h)
        return dx, da, db, None, None, None, None, None


def lora_linear(x: torch.Tensor, base: nn.Module, ops: BaseOps, a: torch.Tensor, b: torch.Tensor, scale: float,
                shadows: AdapterShadows) -> torch.Tensor:
    """base(x) + scale * x A^T B^T for x [..., K] through `LoraLinearFunction` (a plain forward without grad)."""
    sa, sb = shadows.get(a, b, scale, x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or a.requires_grad or b.requires_grad):
        y = LoraLinearFunction.apply(x2, a, b, base, ops, sa, sb, 1.0 / scale)
    else:
        y = ops.forward(x2, base)
        y.addmm_(torch.mm(x2, sa.t()), sb.t(), alpha=1.0 / scale)
    return y.view(*lead, y.shape[-1])


class FastLoraForward:
    """The fast path for a peft LoRA layer (mixed into qerl's layer classes, before peft's base classes).

    It runs for every LoRA linear, forward and recompute, so it reads submodules and parameters from the modules'
    own dicts: nn.Module.__getattr__ costs ~1.5 us per name, about what the whole check costs otherwise."""

    def fast_lora_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """`lora_linear` for the common case (one active plain adapter, no live dropout, nothing merged, adapters
        enabled, no autocast, a frozen base `base_ops` knows), else None (the caller runs the general forward)."""
        if self.disable_adapters or self.merged or x.numel() == 0 or \
                torch.is_autocast_enabled("cuda" if x.is_cuda else "cpu"):
            return None
        mods = self._modules
        name = self.single_active_adapter()
        if name is None or name in self.lora_variant or self.lora_bias.get(name):
            return None
        dropout = mods["lora_dropout"]._modules[name]
        scale = float(self.scaling[name])
        if (dropout.training and getattr(dropout, "p", 0.0) > 0) or scale == 0.0:
            return None
        base = mods["base_layer"]
        ops = self.cached_base_ops(base, x)
        if ops is None or not frozen(base):
            return None
        a = mods["lora_A"]._modules[name]._parameters["weight"]
        b = mods["lora_B"]._modules[name]._parameters["weight"]
        return lora_linear(x, base, ops, a, b, scale, self.shadows_of(name))

    def single_active_adapter(self) -> str | None:
        """The one active adapter that has LoRA weights here, or None (none, several, or not on this layer)."""
        names = self.active_adapters
        if len(names) != 1 or names[0] not in self._modules["lora_A"]._modules or \
                self.__dict__.get("fan_in_fan_out", False):
            return None
        return names[0]

    def cached_base_ops(self, base: nn.Module, x: torch.Tensor) -> BaseOps | None:
        """`base_ops`, remembered per activation dtype and device type."""
        key = (x.dtype, x.is_cuda)
        cached = self.__dict__.get("lora_base_ops")
        if cached is not None and cached[0] == key:
            return cached[1]
        ops = base_ops(base, x)
        self.__dict__["lora_base_ops"] = (key, ops)
        return ops

    def shadows_of(self, name: str) -> AdapterShadows:
        """The 16-bit shadows of adapter `name` (kept beside the module's state, never saved with it)."""
        shadows = self.__dict__.setdefault("lora_shadows", {})
        sh = shadows.get(name)
        if sh is None:
            sh = shadows[name] = AdapterShadows()
        return sh
