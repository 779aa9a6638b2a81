"""`QuantLinear`: a frozen quantized linear layer that keeps its packed weights in memory.

It is deliberately not an `nn.Linear` subclass, so peft can never silently merge an adapter into
packed bytes; qerl registers its own LoRA layer for it. On CUDA the forward runs qerl's Triton
kernels (fused dequantize-GEMM, and the transposed product in backward); elsewhere it dequantizes
with the torch reference and multiplies.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qerl_cli import kernel_dispatch
from qerl_cli.errors import QerlError
from qerl_cli.formats import (
    QuantizedWeight,
    WeightFormat,
    as_format,
    dequantize,
    fake_quantize_activations,
    get_format,
)


class QuantLinear(nn.Module):
    """y = x @ dequant(W)^T + b with W stored in one of qerl's formats (buffers, never trained)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.bfloat16,
        group_size: int | None = None,
        bias: torch.Tensor | None = None,
        act_quant: str | None = None,
    ) -> None:
        super().__init__()
        # Dynamic per-token activation quantization the checkpoint's scheme asks for (W8A8 int8 and
        # FP8_DYNAMIC): "int8" | "fp8" | None. vLLM runs these checkpoints W8A8, so qerl does too.
        self.act_quant = act_quant
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.dtype = dtype
        self.group_size = group_size
        self.tensor_names = tuple(tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False) if bias is not None else None
        # Optional CPU-side cache of the dequantized weight (off by default: it costs the bf16 memory
        # the format exists to save). Trainers on CPU switch it on for speed.
        self.cache_dequantized = False
        self.dequantized_cache: torch.Tensor | None = None
        self._dequantized_key: tuple = ()
        self.kernel_layout_state: object | None = None  # load-time data owned by qerl_kernels
        # Byte order of `weight_packed` (FP4, INT4): None = the checkpoint's; "rows" or "tiled" = qerl_kernels'
        # load-time repack, done in place so the GPU holds one copy. Shared by modules whose tensors share
        # storage (`fuse_quant_linears`), which are always in one order.
        self._layout = PackedLayout(self)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fmt: str | WeightFormat,
        *,
        global_scale: torch.Tensor | None = None,
        group_size: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> QuantLinear:
        spec = as_format(fmt)
        qw = spec.quantize(linear.weight.detach(), global_scale=global_scale, group_size=group_size, dtype=dtype)
        return cls.from_quantized(qw, bias=linear.bias, act_quant=spec.act_quant)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                       act_quant: str | None = None) -> QuantLinear:
        n, k = qw.shape
        return cls(k, n, qw.fmt, qw.tensors, qw.dtype, qw.group_size, bias, act_quant)

    @property
    def format(self) -> WeightFormat:
        """The `WeightFormat` object of `fmt` (what every decision about the format asks)."""
        return get_format(self.fmt)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        """The checkpoint-layout tensors (a transient unrepacked copy of `weight_packed` if it is repacked)."""
        tensors = {name: getattr(self, name) for name in self.tensor_names}
        if self._layout.kind is not None:
            tensors["weight_packed"] = self._layout.checkpoint_bytes(tensors["weight_packed"])
        return QuantizedWeight(self.fmt, (self.out_features, self.in_features), tensors, self.dtype, self.group_size)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:  # noqa: ANN001
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight_packed"
        if self._layout.kind is not None and key in destination:
            destination[key] = self._layout.checkpoint_bytes(self.weight_packed)

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        self._layout.restore_checkpoint_order()  # the incoming bytes are in checkpoint order
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202
        # .to()/.cpu()/.half() copy buffers one by one: hand over checkpoint order, and a moved module no
        # longer shares storage with its fused siblings.
        self._layout.restore_checkpoint_order()
        ptr = self.qweight.data_ptr()
        out = super()._apply(fn, recurse)
        if self.qweight.data_ptr() != ptr:
            self._layout = PackedLayout(self)
            self.kernel_layout_state = None
        return out

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if not self.cache_dequantized:
            return dequantize(self.quantized_weight, dtype)
        fused = self.fused_rows()
        if fused is not None and fused[0].cache_dequantized:
            # a part of a fused q/k/v or gate/up (the rollout's): its rows of the fused module's copy, so training
            # and decoding share one dequantized weight instead of holding two
            owner, row = fused
            return owner.dequantized_weight(dtype)[row:row + self.out_features]
        # keyed by the tensors' storage and version: an in-place update (FlashRL's re-quantization, a part's rows
        # written through its view of the fused storage, load_state_dict) or a move makes a new copy
        key = (dtype, *((t.data_ptr(), t._version) for t in (getattr(self, n) for n in self.tensor_names)))
        if self.dequantized_cache is None or self._dequantized_key != key:
            self.dequantized_cache = dequantize(self.quantized_weight, dtype)
            self._dequantized_key = key
        return self.dequantized_cache

    @property
    def qweight(self) -> torch.Tensor:
        """The main packed tensor (peft and other tools look here for the layer's device)."""
        return getattr(self, self.tensor_names[0])

    def fused_rows(self) -> tuple[QuantLinear, int] | None:
        """(the fused module whose storage this module's rows are a view of, the first of those rows), or None
        for a module that owns its storage (`fuse_quant_linears`). Kernels use it to derive per-storage data
        once (the FP4 block-scale layout) and hand the parts their rows of it."""
        layout = self._layout
        owner = layout.owner()
        if owner is None or owner is self:
            return None
        row = 0
        for ref in getattr(layout, "parts", ()):
            m = ref()
            if m is None:
                return None
            if m is self:
                return owner, row
            row += m.out_features
        return None

    @property
    def weight_nbytes(self) -> int:
        # from the buffers as they are (the repack has the same size; no transient unrepacked copy)
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self.tensor_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            y = kernel_dispatch.quant_linear(x, self)
            if y is not None:
                return y
        if self.act_quant is not None:
            x = fake_quantize_activations(x, self.act_quant)
        w = self.dequantized_weight(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        gs = f", group_size={self.group_size}" if self.group_size else ""
        aq = f", act_quant={self.act_quant}" if self.act_quant else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}{gs}{aq}"


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


class PackedLayout:
    """The byte order of 4-bit `weight_packed` storage shared by one or more QuantLinears (FP4's bytes, or INT4's
    int32 words seen as their little-endian bytes: the same nibble order, so the same repack).

    `members` tile the storage (a fused module and its parts, or one module alone); qerl_kernels repacks
    all of them in place at once (`repack_in_place`) and everything that hands bytes to the outside
    (state_dict, `quantized_weight`, `.to()`) sees the checkpoint order.
    """

    def __init__(self, owner: QuantLinear) -> None:
        self.kind: str | None = None
        self.owner = weakref.ref(owner)  # the module whose weight_packed spans the whole storage
        self.tiled_ok = owner.out_features % 64 == 0

    def __deepcopy__(self, memo: dict) -> PackedLayout:
        # weakrefs do not deep-copy: point the copy at the copies of the same modules
        import copy

        new = PackedLayout.__new__(PackedLayout)
        memo[id(self)] = new
        new.kind, new.tiled_ok = self.kind, self.tiled_ok
        owner = self.owner()
        new.owner = weakref.ref(copy.deepcopy(owner, memo)) if owner is not None else (lambda: None)
        if hasattr(self, "parts"):
            new.parts = tuple(weakref.ref(copy.deepcopy(m, memo)) for m in (r() for r in self.parts) if m is not None)
        return new

    def _targets(self) -> list[QuantLinear]:
        owner = self.owner()
        if owner is not None:
            return [owner]
        # the fused module is gone: its parts still tile what is reachable of the storage
        return [m for m in (r() for r in getattr(self, "parts", ())) if m is not None]

    def repack_in_place(self, tiled: bool) -> None:
        from qerl_kernels.fp4 import repack_fp4

        if self.kind is not None:
            return
        tiled = tiled and self.tiled_ok
        for m in self._targets():
            wp = m.weight_packed.view(torch.uint8)
            wp.copy_(repack_fp4(wp, tiled=tiled))
        self.kind = "tiled" if tiled else "rows"

    def restore_checkpoint_order(self) -> None:
        if self.kind is None:
            return
        for m in self._targets():
            m.weight_packed.copy_(self.checkpoint_bytes(m.weight_packed))
            m.kernel_layout_state = None
        for m in (r() for r in getattr(self, "parts", ())):
            if m is not None:
                m.kernel_layout_state = None
        self.kind = None

    def checkpoint_bytes(self, packed: torch.Tensor) -> torch.Tensor:
        from qerl_kernels.fp4 import unrepack_fp4

        if self.kind is None:
            return packed
        return unrepack_fp4(packed.view(torch.uint8), tiled=self.kind == "tiled").view(packed.dtype)


# Tensors one fused layer holds once for all its parts (they must be equal in every part), and the one
# that describes the whole layer's shape (rebuilt, never viewed). Every other tensor is laid out by
# output row along dim 0 (NF4's flat blocks too: its parts' flat tensors simply follow one another).
_SHARED_TENSORS = ("weight_global_scale", "quant_map")
_SHAPE_TENSOR = "weight_shape"


def fuse_quant_linears(modules: Sequence[QuantLinear]) -> QuantLinear:
    """One `QuantLinear` for layers that read the same input (q/k/v, gate/up), concatenated along N.

    The parts must agree on format, in_features, dtype, group size, activation quantization, bias
    presence and device, and (NVFP4) hold the same global scale. Afterwards each part's tensors are
    row views of the fused module's (bias too), so no weight byte is stored twice and the fused
    output's columns `sum(sizes[:i]):sum(sizes[:i+1])` are part i's output. `fused.split_sizes` lists
    the parts' out_features. Fuse after the model is on its device: `Module.to()` copies each buffer
    on its own and would break the sharing.
    """
    parts = list(modules)
    if not parts:
        raise QerlError("fuse_quant_linears needs at least one QuantLinear")
    first = parts[0]
    for m in parts:  # fuse checkpoint-order bytes (a repacked part goes back first)
        if isinstance(m, QuantLinear):
            m._layout.restore_checkpoint_order()
    for i, m in enumerate(parts):
        if not isinstance(m, QuantLinear):
            raise QerlError(f"fuse_quant_linears: part {i} is a {type(m).__name__}, not a QuantLinear")
        for attr in ("fmt", "in_features", "dtype", "group_size", "act_quant", "tensor_names"):
            if getattr(m, attr) != getattr(first, attr):
                raise QerlError(
                    f"fuse_quant_linears: part {i} has {attr}={getattr(m, attr)!r} but part 0 has "
                    f"{getattr(first, attr)!r}; only layers quantized alike can share one GEMM")
        if (m.bias is None) != (first.bias is None):
            raise QerlError(f"fuse_quant_linears: part {i} {'lacks' if m.bias is None else 'has'} a bias and part "
                            f"0 does not; fuse only layers that all have a bias or all have none")
        if m.qweight.device != first.qweight.device:
            raise QerlError(f"fuse_quant_linears: part {i} is on {m.qweight.device}, part 0 on "
                            f"{first.qweight.device}; move the model to one device before fusing")
        for name in _SHARED_TENSORS:
            if name in m.tensor_names and not torch.equal(getattr(m, name), getattr(first, name)):
                raise QerlError(
                    f"fuse_quant_linears: part {i} has a different {name} than part 0; re-quantize the layers "
                    f"with one shared global scale (qerl quantize does this for q/k/v and gate/up)")
    n_total = sum(m.out_features for m in parts)
    k = first.in_features
    tensors: dict[str, torch.Tensor] = {}
    for name in first.tensor_names:
        if name in _SHARED_TENSORS:
            tensors[name] = getattr(first, name).detach()
        elif name == _SHAPE_TENSOR:
            ref = getattr(first, name)
            tensors[name] = torch.tensor([n_total, k], dtype=ref.dtype, device=ref.device)
        else:
            tensors[name] = torch.cat([getattr(m, name).detach() for m in parts], dim=0)
    bias = torch.cat([m.bias.detach() for m in parts]) if first.bias is not None else None
    fused = QuantLinear(k, n_total, first.fmt, tensors, first.dtype, first.group_size, bias, first.act_quant)
    fused.split_sizes = [m.out_features for m in parts]
    # CPU: the fused GEMM of the rollout keeps its dequantized weight as its parts did (the parts then read their
    # rows of it), rather than dequantizing on every decode step
    fused.cache_dequantized = all(m.cache_dequantized for m in parts)

    # one layout for the shared storage; the tiled repack keeps every 64-row block contiguous, so it is
    # row-local (a part's view reads its own tiled repack) only when every part starts on a 64-row boundary
    layout = fused._layout
    layout.tiled_ok = all(m.out_features % 64 == 0 for m in parts)
    layout.parts = tuple(weakref.ref(m) for m in parts)
    offsets = dict.fromkeys(tensors, 0)
    row0 = 0
    for m in parts:
        for name in first.tensor_names:
            if name == _SHAPE_TENSOR:
                continue
            if name in _SHARED_TENSORS:
                m._buffers[name] = tensors[name]
                continue
            length = getattr(m, name).shape[0]
            m._buffers[name] = tensors[name][offsets[name]:offsets[name] + length]
            offsets[name] += length
        if bias is not None:
            m.bias = nn.Parameter(fused.bias.data[row0:row0 + m.out_features], requires_grad=False)
        row0 += m.out_features
        m.dequantized_cache = None
        m.kernel_layout_state = None
        m._layout = layout
    return fused
