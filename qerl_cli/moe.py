"""Mixture-of-experts layers (Qwen3-MoE, Mixtral): qerl's experts container, the sparse block, the router's statistics.

In memory each sparse MLP is a :class:`MoeBlock`: transformers' own router module (``mlp.gate``, kept in the
model dtype, so routing is exactly the model's: softmax in fp32, top-k, renormalised when ``norm_topk_prob``) and a
:class:`MoeExperts` holding every expert's weights stacked per projection, ``gate_up_proj`` ``[E, 2I, H]`` (gate
rows first, as transformers fuses them) and ``down_proj`` ``[E, H, I]``, in the run's weight format (the format's
own checkpoint tensors with a leading expert dimension; one NVFP4 global scale per expert, shared by its gate and
up). The names are transformers' fused parameter names, which is what peft's ``target_parameters`` targets, so a
LoRA on the experts saves as the adapter peft makes on the transformers model (``qerl_cli.lora.ParamWrapper``).
``state_dict()`` hands the experts back per expert under the checkpoint's names
(``experts.E.{gate,up,down}_proj.weight_packed|...``), the layout llm-compressor writes and vLLM loads.

The computation (:class:`ExpertProjection`): the top-k assignments are sorted by expert, each projection runs as
one grouped GEMM over all experts (``qerl_kernels.moe.grouped_linear`` on CUDA: no host sync, so it runs inside the
decode CUDA graph; a per-expert loop elsewhere), with the LoRA delta of each assignment's own expert, and the
down-projection outputs are summed with the routing weights. The backward (training; frozen base, LoRA gradients)
runs wherever the grouped forward runs as grouped kernels on the same sorted rows (``grouped_linear_t`` for dX,
``segment_outer`` for the factors' gradients); elsewhere it loops over the experts, dequantizing one expert's weight
at a time (the reference). docs/moe.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qerl_cli.arch import find_spec
from qerl_cli.arch.qwen3_moe import QWEN3_MOE
from qerl_cli.errors import QerlError
from qerl_cli.formats import (
    QuantizedWeight,
    WeightFormat,
    as_format,
    fake_quantize_activations,
    get_format,
    nvfp4_global_scale,
)

# qerl's experts hold the layout Qwen3-MoE declares (transformers' fused expert parameters, qerl_cli/arch/qwen3_moe.py;
# Mixtral's spec declares the same names): the stacked parameters' names and the per-expert linears each is written
# as on disk (gate rows first in gate_up)
GATE_UP, DOWN = QWEN3_MOE.moe.gate_up, QWEN3_MOE.moe.down
PROJECTIONS = (GATE_UP, DOWN)
CHECKPOINT_PARTS = QWEN3_MOE.expert_parts()
# one tensor per expert, the same for its gate and up (NVFP4's global scale, NF4's code table)
_SHARED = ("weight_global_scale", "quant_map")
_SHAPE = "weight_shape"  # a layer's [N, K] (INT4): rebuilt per expert when written, not kept


def is_moe_config(config: Any) -> bool:
    """Whether a transformers config is a mixture of experts qerl runs (its architecture has a sparse block, and the
    config gives it experts)."""
    spec = find_spec(config)
    return spec is not None and spec.experts(config) > 0


def check_moe_config(config: Any) -> None:
    """Refuse a MoE variant qerl's block does not compute exactly (dense layers mixed in, another activation, the
    router's training-time jitter)."""
    if getattr(config, "mlp_only_layers", None) or int(getattr(config, "decoder_sparse_step", 1) or 1) != 1:
        raise QerlError("this MoE config mixes dense MLP layers (mlp_only_layers / decoder_sparse_step); qerl "
                        "runs models whose every layer is sparse")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise QerlError(f"qerl's experts compute SiLU, this model uses {config.hidden_act!r}")
    # transformers' Mixtral scales the block's input by uniform noise in training mode: the update would then
    # compute another function than the rollout (and the replayed routing would not be its own)
    if float(getattr(config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise QerlError(f"router_jitter_noise={config.router_jitter_noise}: qerl's sparse block routes without "
                        "jitter; set it to 0 in config.json")


@dataclass
class MoeDims:
    """The expert side of a MoE config: experts per layer, experts per token, one expert's intermediate size."""

    experts: int
    top_k: int
    intermediate: int

    @classmethod
    def from_config(cls, config: Any) -> MoeDims | None:
        if not is_moe_config(config):
            return None
        dims = find_spec(config).dims(config)
        return cls(dims.experts, dims.top_k, dims.intermediate)

    def active_experts(self, tokens: int) -> float:
        """Expected distinct experts one layer reads for ``tokens`` routed tokens, routing uniform at random:
        ``E * (1 - (1 - k/E)^tokens)``."""
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** max(0, tokens))


def _row_split(name: str) -> bool:
    """Whether tensor ``name`` of an expert projection follows its output rows in order along dim 0, so gate and up
    concatenate and split there (else one value per expert). NF4's flat packed bytes and block absmax do too:
    row-major blocks of whole rows, not one entry per row."""
    return name not in _SHARED and name != _SHAPE


class MoeExperts(nn.Module):
    """Every expert of one sparse layer, stacked per projection, in one weight format (module docstring).

    The main tensor of a projection (``weight_packed``, or ``weight`` for the 8-bit and plain formats) is a frozen
    parameter named after the projection, so peft's ``target_parameters`` finds it; the format's other tensors are
    buffers ``<projection>_<name>``."""

    projections = PROJECTIONS  # what a kernel dispatcher iterates (qerl_kernels.dispatch.prepare_experts)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, fmt: str,
                 tensors: Mapping[str, Mapping[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16,
                 group_size: int | None = None, act_quant: str | None = None, shape_tensor: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.fmt, self.dtype, self.group_size, self.act_quant = fmt, dtype, group_size, act_quant
        self.shape_tensor = shape_tensor  # the checkpoint stores weight_shape per expert (INT4)
        self.tensor_names: dict[str, tuple[str, ...]] = {}
        for proj in PROJECTIONS:
            names = tuple(tensors[proj])
            primary = "weight_packed" if "weight_packed" in names else "weight"
            self.tensor_names[proj] = (primary, *(n for n in names if n != primary))
            self.register_parameter(proj, nn.Parameter(tensors[proj][primary], requires_grad=False))
            for name in self.tensor_names[proj][1:]:
                self.register_buffer(f"{proj}_{name}", tensors[proj][name])
        self.cache_dequantized = False  # CPU: dequantize each stack once (QuantLinear's switch, same reason)
        # the grouped kernels: None = on CUDA; True also runs them elsewhere (the CPU tests, under the interpreter)
        self.use_kernels: bool | None = None
        self.dequantized_cache: dict[str, torch.Tensor] = {}
        self.mxfp4_shift: dict[str, int] = {}
        # a peer kernel's converted copies of the experts (humming's, qerl_kernels.dispatch.experts_layer)
        self.peer_state: dict[str, Any] | None = None

    @property
    def format(self) -> WeightFormat:
        """The `WeightFormat` of `fmt`: the module keeps the checkpoint's name (what its `QuantizedWeight`s carry)."""
        return get_format(self.fmt)

    def projection_shape(self, proj: str) -> tuple[int, int, int]:
        """(experts, out N, in K) of ``proj``."""
        if proj == GATE_UP:
            return self.num_experts, 2 * self.intermediate, self.hidden
        return self.num_experts, self.hidden, self.intermediate

    def tensors(self, proj: str) -> dict[str, torch.Tensor]:
        """The format's tensors of ``proj``, each with the expert dimension first."""
        primary, *rest = self.tensor_names[proj]
        return {primary: getattr(self, proj), **{n: getattr(self, f"{proj}_{n}") for n in rest}}

    def expert_tensors(self, proj: str, e: int) -> QuantizedWeight:
        _, n, k = self.projection_shape(proj)
        return QuantizedWeight(self.fmt, (n, k), {name: t[e] for name, t in self.tensors(proj).items()}, self.dtype,
                               self.group_size)

    def expert_weight(self, proj: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s weight of ``proj`` [N, K] in ``dtype`` (dequantized)."""
        if not self.format.quantized:
            return getattr(self, proj)[e].to(dtype)
        if self.cache_dequantized:
            return self.dense_stack(proj, dtype)[e]
        return self.format.dequantize(self.expert_tensors(proj, e), dtype)

    def dense_stack(self, proj: str, dtype: torch.dtype) -> torch.Tensor:
        """All experts' weights of ``proj`` [E, N, K] in ``dtype``, dequantized once and kept."""
        cached = self.dequantized_cache.get(proj)
        if cached is None or cached.dtype != dtype:
            cached = torch.stack([self.format.dequantize(self.expert_tensors(proj, e), dtype)
                                  for e in range(self.num_experts)])
            self.dequantized_cache[proj] = cached
        return cached

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202
        self.dequantized_cache = {}  # made from the tensors as they were (device, dtype)
        self.peer_state = None
        return super()._apply(fn, recurse)

    @property
    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in PROJECTIONS for t in self.tensors(p).values())

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:  # noqa: ANN001
        # the checkpoint layout: one linear per expert and part, gate/up split back out of the fused rows
        spec = self.format
        for proj in PROJECTIONS:
            parts = CHECKPOINT_PARTS[proj]
            _, n, k = self.projection_shape(proj)
            rows = n // len(parts)
            for e in range(self.num_experts):
                full = self.expert_tensors(proj, e).tensors
                for i, part in enumerate(parts):
                    # a shared tensor (the global scale) is copied per part: safetensors refuses aliased entries
                    t = {name: (v.chunk(len(parts))[i] if _row_split(name) else v.clone())
                         for name, v in full.items()}
                    if self.shape_tensor:
                        t[_SHAPE] = torch.tensor([rows, k], dtype=torch.int64)
                    qw = QuantizedWeight(self.fmt, (rows, k), t, self.dtype, self.group_size)
                    for key, v in spec.checkpoint_tensors(f"{prefix}{e}.{part}", qw).items():
                        destination[key] = v if keep_vars else v.detach()

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                lora: Mapping[str, LoraFactors] | None = None) -> torch.Tensor:
        """hidden [T, H], the router's top-k experts and weights [T, k] -> [T, H]. ``lora``: per projection the
        adapter (``qerl_cli.lora.ParamWrapper`` passes it; the rollout passes its in-dtype copies)."""
        lora = lora or {}
        t, k = top_k_index.shape
        kernels = self.kernel_kind(hidden) is not None
        peer = _peer_rows(self, hidden, k, t * k) if kernels and not torch.is_grad_enabled() else None
        routing = Routing(top_k_index.reshape(-1), self.num_experts, kernels=kernels, peer_rows=peer)
        gu = ExpertProjection.run(self, GATE_UP, hidden, routing, k, lora.get(GATE_UP))
        gate, up = gu[:, :self.intermediate], gu[:, self.intermediate:]
        act = F.silu(gate) * up
        down = ExpertProjection.run(self, DOWN, act, routing, 1, lora.get(DOWN))
        return (down.view(t, k, -1) * top_k_weights.to(down.dtype).unsqueeze(-1)).sum(1)

    def kernel_kind(self, x: torch.Tensor) -> str | None:
        """What ``qerl_kernels.moe.grouped_linear`` runs this format as on x's device ("dense" for the plain
        format and for the formats without a grouped kernel, from a dequantized copy), None: the per-expert loop."""
        if self.use_kernels is False or (self.use_kernels is None and not x.is_cuda):
            return None
        try:
            import qerl_kernels.moe  # noqa: F401
        except ImportError:
            return None
        return self.fmt if self.format.kernel == "fp4" else "dense"

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"fmt={self.fmt}")


@dataclass
class LoraFactors:
    """One projection's adapter for every expert: A [E, r, K], B [E, N, r] and the scaling (views of peft's stacked
    factors, or the rollout's in-dtype copies with the scaling folded into B and 1.0 here)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float = 1.0


@dataclass
class Routing:
    """The assignments of one forward (``expert_ids`` [T*k]) grouped by expert: the kernels' padded block layout
    (device tensors, no host sync) and, for the loop and the backward, each expert's assignment indices."""

    expert_ids: torch.Tensor
    num_experts: int
    kernels: bool = False
    rows: torch.Tensor | None = None
    block_expert: torch.Tensor | None = None
    # the routing at a peer kernel's block rows ({rows: humming's indexed layout}), made once per forward
    layouts: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)
    # the peer's block rows when it is known to run this forward: its layout is then made in qerl's layout's launch
    peer_rows: int | None = None
    _groups: list[tuple[int, torch.Tensor]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kernels:
            from qerl_kernels.moe import routing_layouts

            self.rows, self.block_expert, peer = routing_layouts(self.expert_ids, self.num_experts, self.peer_rows)
            if peer is not None:
                self.layouts[self.peer_rows] = peer

    @property
    def assignments(self) -> int:
        return self.expert_ids.numel()

    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(expert, its assignment indices in ascending order) for every expert that has any (one host sync)."""
        if self._groups is None:
            order = torch.argsort(self.expert_ids, stable=True)
            counts = torch.bincount(self.expert_ids, minlength=self.num_experts).tolist()
            out, start = [], 0
            for e, c in enumerate(counts):
                if c:
                    out.append((e, order[start:start + c]))
                start += c
            self._groups = out
        return self._groups


class ExpertProjection(torch.autograd.Function):
    """y [T*k, N] in assignment order: each assignment's input row (x row ``a // x_div``) through its expert's
    weight of one projection, plus its expert's LoRA delta. Gradients reach x and the LoRA factors (the base is
    frozen): grouped kernels when ``routing.kernels`` (:func:`_backward_grouped`), else one expert at a time
    (:func:`_backward_loop`)."""

    @staticmethod
    def run(experts: MoeExperts, proj: str, x: torch.Tensor, routing: Routing, x_div: int,
            lora: LoraFactors | None) -> torch.Tensor:
        a, b, s = (lora.a, lora.b, lora.scaling) if lora is not None else (None, None, 1.0)
        if routing.kernels and not torch.is_grad_enabled():  # a forward only (the rollout): a peer kernel may run
            return _project_grouped(experts, proj, x, routing, x_div, a, b, s, peer=True)
        return ExpertProjection.apply(x, a, b, experts, proj, routing, x_div, s)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, experts: MoeExperts,
                proj: str, routing: Routing, x_div: int, scaling: float) -> torch.Tensor:
        ctx.save_for_backward(x, a, b)
        ctx.experts, ctx.proj, ctx.routing, ctx.x_div, ctx.scaling = experts, proj, routing, x_div, scaling
        if routing.kernels:
            return _project_grouped(experts, proj, x, routing, x_div, a, b, scaling)
        return _project_loop(experts, proj, x, routing, x_div, a, b, scaling)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, a, b = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        args = (ctx.experts, ctx.proj, x, dy, ctx.routing, ctx.x_div, a, b, ctx.scaling, need)
        # the same condition as the forward: the grouped kernels wherever the forward ran them
        dx, da, db = _backward_grouped(*args) if ctx.routing.kernels else _backward_loop(*args)
        return dx, da, db, None, None, None, None, None


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _backward_loop(experts: MoeExperts, proj: str, x: torch.Tensor, dy: torch.Tensor, routing: Routing, x_div: int,
                   a: torch.Tensor | None, b: torch.Tensor | None, s: float, need: tuple[bool, ...]) -> Grads:
    """(dx, dA, dB) one expert at a time (one dequantized weight at a time): the reference and the fallback."""
    need_x, need_a, need_b = need
    dx = torch.zeros((dy.shape[0], x.shape[1]), dtype=x.dtype, device=x.device) if need_x else None
    da = torch.zeros_like(a, dtype=torch.float32) if need_a else None
    db = torch.zeros_like(b, dtype=torch.float32) if need_b else None
    for e, rows in routing.groups():
        g = dy[rows]
        xin = x[rows // x_div]
        if need_x:
            dx[rows] = g @ experts.expert_weight(proj, e, g.dtype)
        if a is not None:
            ae, be = a[e].to(g.dtype), b[e].to(g.dtype)
            u = (g @ be) * s  # dL/dh, h = x A^T
            if need_x:
                dx[rows] += u @ ae
            if need_a:
                da[e] += (u.t() @ xin).float()
            if need_b:
                db[e] += ((g.t() @ (xin @ ae.t())) * s).float()
    if dx is not None and x_div > 1:  # several assignments read one token: summed in a fixed order
        dx = dx.view(x.shape[0], x_div, x.shape[1]).sum(1)
    return dx, None if da is None else da.to(a.dtype), None if db is None else db.to(b.dtype)


def _backward_grouped(experts: MoeExperts, proj: str, x: torch.Tensor, dy: torch.Tensor, routing: Routing,
                      x_div: int, a: torch.Tensor | None, b: torch.Tensor | None, s: float,
                      need: tuple[bool, ...]) -> Grads:
    """(dx, dA, dB) as grouped kernels on the forward's sorted rows (``routing.rows``), every expert in each launch
    and no host sync: ``u = s * dy @ B_e`` (dense transposed grouped GEMM, N = out features), ``dx = dy @ W_e + u @
    A_e`` (the transposed grouped GEMM over the frozen weight as the forward reads it, the LoRA term in its
    epilogue), ``dA_e = u_e^T x_e`` and ``dB_e = s * dy_e^T h_e`` (``h = x A_e^T`` recomputed grouped, as the loop
    recomputes it) as per-expert segment sums. The loop's math, fp32 accumulation, another summation order."""
    from qerl_kernels.moe import expert_block_starts, grouped_linear, grouped_linear_t, segment_outer

    need_x, need_a, need_b = need
    rows, bexp, m = routing.rows, routing.block_expert, routing.assignments
    dy = dy.contiguous()
    lora = a is not None and b is not None
    u = ad = None
    if lora and (need_x or need_a):
        ad = a.to(dy.dtype).contiguous()
        u = grouped_linear_t(dy, rows, bexp, kind="dense", weight=b.to(dy.dtype).contiguous(), out_scale=s)
    dx = da = db = None
    if need_x:
        kind, w = _grouped_weight(experts, proj, dy)
        dx = grouped_linear_t(dy, rows, bexp, kind=kind, **w, lora_u=u if lora else None, lora_a=ad)
        if x_div > 1:  # several assignments read one token: summed in a fixed order, as the loop does
            dx = dx.view(x.shape[0], x_div, x.shape[1]).sum(1)
        dx = dx.to(x.dtype)
    if lora and (need_a or need_b):
        starts = expert_block_starts(bexp, experts.num_experts)
        common = dict(assignments=m, block_starts=starts)
        if need_a:
            da = segment_outer(u, x.to(dy.dtype), rows, bexp, experts.num_experts, right_div=x_div,
                               **common).to(a.dtype)
        if need_b:
            h = grouped_linear(x.to(dy.dtype), rows, bexp, kind="dense", weight=ad if ad is not None else
                               a.to(dy.dtype).contiguous(), out_rows=m, x_div=x_div)
            db = segment_outer(dy, h, rows, bexp, experts.num_experts, scale=s, **common).to(b.dtype)
    return dx, da, db


def _grouped_weight(experts: MoeExperts, proj: str, x: torch.Tensor) -> tuple[str, dict[str, Any]]:
    """(kind, weight arguments) of ``proj`` for ``grouped_linear``/``grouped_linear_t``: the FP4 checkpoint tensors
    (MXFP4 with its exponent shift over all experts, computed once), or a dense stack in x's dtype (the plain
    format's own, the other formats' dequantized copy)."""
    kind = experts.kernel_kind(x)
    if kind == "dense":
        w = getattr(experts, proj) if not experts.format.quantized else experts.dense_stack(proj, x.dtype)
        return kind, {"weight": w.to(x.dtype)}
    t = experts.tensors(proj)
    shift = experts.mxfp4_shift.get(proj)
    if shift is None and experts.format.power_of_two_scales:
        from qerl_kernels.fp4 import mxfp4_shift

        shift = experts.mxfp4_shift[proj] = mxfp4_shift(t["weight_scale"])
    return kind, {"weight": t["weight_packed"], "scale": t["weight_scale"],
                  "global_scale": t.get("weight_global_scale"), "shift": shift or 0}


def _project_loop(experts: MoeExperts, proj: str, x: torch.Tensor, routing: Routing, x_div: int,
                  a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> torch.Tensor:
    _, n, _ = experts.projection_shape(proj)
    y = x.new_zeros((routing.assignments, n))
    for e, rows in routing.groups():
        xin = x[rows // x_div]
        xq = fake_quantize_activations(xin, experts.act_quant) if experts.act_quant is not None else xin
        ye = F.linear(xq, experts.expert_weight(proj, e, x.dtype))
        if a is not None:
            ye = ye + F.linear(F.linear(xin, a[e].to(x.dtype)), b[e].to(x.dtype)) * scaling
        y[rows] = ye
    return y


def _project_grouped(experts: MoeExperts, proj: str, x: torch.Tensor, routing: Routing, x_div: int,
                     a: torch.Tensor | None, b: torch.Tensor | None, scaling: float,
                     peer: bool = False) -> torch.Tensor:
    """The grouped forward; ``peer`` (no-grad forwards only): the base GEMM may run on humming's indexed MoE GEMM
    where the kernel dispatcher picks it, the LoRA staying on qerl's grouped kernels (shrink, then the expand added
    into humming's output in one launch: humming's GEMM has no LoRA epilogue)."""
    from qerl_kernels.moe import grouped_linear

    common = dict(out_rows=routing.assignments, x_div=x_div)
    h = bs = None
    xb = fake_quantize_activations(x, experts.act_quant) if experts.act_quant is not None else x
    if a is not None and b is not None:
        h = grouped_linear(x, routing.rows, routing.block_expert, kind="dense", weight=a.to(x.dtype).contiguous(),
                           **common)
        bs = b.to(x.dtype) if scaling == 1.0 else (b * scaling).to(x.dtype)
    y = _peer_base(experts, proj, x, routing, x_div) if peer and experts.act_quant is None else None
    if y is not None:
        if h is not None:
            grouped_linear(h, routing.rows, routing.block_expert, kind="dense", weight=bs.contiguous(),
                           out_rows=routing.assignments, out=y)
        return y
    kind, w = _grouped_weight(experts, proj, x)
    _record_ran(experts, proj, "qerl-grouped")
    return grouped_linear(xb, routing.rows, routing.block_expert, kind=kind, **w, lora_h=h, lora_b=bs, **common)


def _record_ran(experts: MoeExperts, proj: str, kernel: str) -> None:
    """The bench's account of what ran a routed projection (`qerl_kernels.dispatch.record_shape`; called where a
    grouped kernel runs, so qerl_kernels is there)."""
    from qerl_kernels import dispatch

    dispatch.record_shape(*experts.projection_shape(proj)[1:], kernel)


def _peer_base(experts: MoeExperts, proj: str, x: torch.Tensor, routing: Routing, x_div: int) -> torch.Tensor | None:
    """``proj``'s base product on humming's MoE GEMM when ``qerl_kernels.dispatch`` picks it (the linears' backend
    switch and plan cache; docs/moe.md), else None (qerl's grouped kernel runs it)."""
    try:
        from qerl_kernels import dispatch
    except ImportError:
        return None
    if dispatch.choose_experts(experts, proj, x, x_div, routing.assignments) != "humming":
        return None
    return dispatch.experts_humming_forward(experts, proj, x, routing.expert_ids, x_div, routing.layouts)


def _peer_rows(experts: MoeExperts, x: torch.Tensor, top_k: int, assignments: int) -> int | None:
    """The block rows of humming's expert GEMM when it will run this forward's first projection (its routing
    layout then comes from the launch that makes qerl's), else None."""
    try:
        from qerl_kernels import dispatch
    except ImportError:
        return None
    return dispatch.experts_peer_rows(experts, GATE_UP, x, top_k, assignments)


# ---- the sparse block --------------------------------------------------------------------------------------------
def route(x: torch.Tensor, weight: torch.Tensor, top_k: int,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's routing of tokens x [T, H] by the router weight [E, H]: (logits [T, E], weights [T, k] in the
    logits' dtype, expert index [T, k]). Softmax in fp32, top-k, renormalised over the k when ``norm_topk_prob``,
    exactly as transformers' router computes it."""
    logits = F.linear(x, weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    index = torch.topk(probs, top_k, dim=-1).indices
    return logits, gate_weights(probs, index, norm_topk_prob).to(logits.dtype), index


def gate_weights(probs: torch.Tensor, index: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """The router's fp32 probabilities [T, E] at the experts ``index`` [T, k] that run, renormalised over the k when
    ``norm_topk_prob``: the experts' output weights, whether the experts are the router's top-k or recorded ones."""
    top = probs.gather(-1, index)
    return top / top.sum(dim=-1, keepdim=True) if norm_topk_prob else top


def in_backward() -> bool:
    """Whether this runs inside the autograd engine's backward (e.g. torch.utils.checkpoint recomputing a forward,
    reentrant or not): the engine sets a current graph task only while it executes one."""
    return torch._C._current_graph_task_id() != -1


RouteHook = Callable[[torch.Tensor], None]  # receives a forward's top-k expert index [T, k]


class MoeBlock(nn.Module):
    """A sparse MLP: transformers' router module (``gate``, whose weight :func:`route` reads) and qerl's experts. In a
    training forward (training mode, gradients on) it records the routing (per-expert assignment counts and mean router
    probabilities, on the device) for :func:`router_metrics`. Under :func:`replay_routing` it takes the recorded
    experts instead of its own top-k (routing replay, docs/moe.md)."""

    def __init__(self, gate: nn.Module, experts: nn.Module, top_k: int, norm_topk_prob: bool = True) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.stats: dict[str, torch.Tensor] | None = None
        self.replay: Replay | None = None

    def forward(self, hidden_states: torch.Tensor, on_route: RouteHook | None = None) -> torch.Tensor:
        """``on_route``: called with the top-k index the experts run with (the rollout engine records it)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, weights, index = route(x, self.gate.weight, self.top_k, self.norm_topk_prob)
        own = index
        if self.replay is not None:
            self.replay.check(x.shape[0])
            if self.replay.use:
                weights, index = self.replay.apply(logits, own, self.norm_topk_prob)
        # the update's forwards, never a rollout running beside them, nor activation checkpointing's recompute of
        # this forward (it runs inside the backward, where the autograd engine has a graph task): counted twice, the
        # statistics would differ with --gradient-checkpointing
        if self.training and torch.is_grad_enabled() and not in_backward():
            self.record(logits, own)
            if self.replay is not None:
                self.record_disagreement(self.replay.disagreement(own))
        if on_route is not None:
            on_route(index)
        return self.experts(x, index, weights).reshape(shape)

    @torch.no_grad()
    def record(self, logits: torch.Tensor, index: torch.Tensor) -> None:
        e = logits.shape[-1]
        if self.stats is None:
            self.stats = {k: torch.zeros(e, dtype=torch.float64, device=logits.device) for k in ("count", "prob")}
            self.stats["tokens"] = torch.zeros((), dtype=torch.float64, device=logits.device)
        flat = index.reshape(-1)
        self.stats["count"].scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        self.stats["prob"] += torch.softmax(logits.float(), dim=-1).sum(0).double()
        self.stats["tokens"] += logits.shape[0]

    @torch.no_grad()
    def record_disagreement(self, differ_total: torch.Tensor) -> None:
        """Adds (tokens whose own top-k set differs from the recorded one, tokens with a recorded set)."""
        assert self.stats is not None
        if "replay" not in self.stats:
            self.stats["replay"] = torch.zeros(2, dtype=torch.float64, device=differ_total.device)
        self.stats["replay"] += differ_total


@dataclass
class Replay:
    """One layer's recorded top-k experts for the tokens of a forward, ``index`` [T, k] (int64; -1 on a token the
    rollout did not route: padding, a completion's last token), and whether the forward takes them (``use``) or only
    compares its own top-k with them (the disagreement metric with replay off)."""

    index: torch.Tensor
    use: bool = True

    def check(self, tokens: int) -> None:
        if self.index.shape[0] != tokens:
            raise QerlError(f"routing replay: {self.index.shape[0]} recorded tokens for a forward of {tokens}; the "
                            "routing must be laid out like the forward's input_ids")

    def apply(self, logits: torch.Tensor, own: torch.Tensor, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, index) with the recorded experts where there are any (own top-k elsewhere): the weights are the
        router's own probabilities at those experts, renormalised as :func:`route` does, so its gradient flows."""
        rec = self.index.to(own.device)
        index = torch.where(rec >= 0, rec, own)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return gate_weights(probs, index, norm_topk_prob).to(logits.dtype), index

    def disagreement(self, own: torch.Tensor) -> torch.Tensor:
        """[tokens whose own top-k set differs from the recorded set, tokens with a recorded set] (float64)."""
        rec = self.index.to(own.device)
        valid = (rec >= 0).all(-1)
        differ = (own.sort(-1).values != rec.sort(-1).values).any(-1) & valid
        return torch.stack([differ.sum(), valid.sum()]).double()


@contextmanager
def replay_routing(model: nn.Module, routing: torch.Tensor | None, replay: bool = True) -> Iterator[None]:
    """Within: every :class:`MoeBlock` of ``model`` (the j-th in module order takes ``routing[..., j, :]``) routes the
    forward's tokens with the rollout's recorded experts (``replay``; else it only measures the disagreement).
    ``routing`` [..., layers, k] is laid out exactly like the forward's input_ids (padded [B, L] or packed [1, T]),
    -1 where nothing was recorded. A backward that recomputes (activation checkpointing) must run inside too."""
    blocks = moe_blocks(model)
    if routing is None or not blocks:
        yield
        return
    if routing.shape[-2] != len(blocks):
        raise QerlError(f"routing replay: the routing has {routing.shape[-2]} layers, the model {len(blocks)}")
    flat = routing.reshape(-1, *routing.shape[-2:]).long()
    try:
        for j, block in enumerate(blocks):
            block.replay = Replay(flat[:, j], use=replay)
        yield
    finally:
        for block in blocks:
            block.replay = None


def moe_blocks(model: nn.Module) -> list[MoeBlock]:
    return [m for m in model.modules() if isinstance(m, MoeBlock)]


def router_metrics(model: nn.Module) -> dict[str, float]:
    """The routing of the training forwards since the last call, then forgotten (``router/*``; empty for a dense
    model). Per layer: the load of expert e is its assignment count over the mean count (1 = balanced);
    ``load_cv`` its coefficient of variation, ``load_max``/``load_min`` the extremes over layers and experts,
    ``aux_loss`` transformers' load-balancing loss ``E * sum_e (count_e / tokens) * mean_prob_e`` (k when
    balanced), averaged over layers; ``dropped_tokens`` is 0: every assignment is computed (no capacity limit).
    ``replay_disagreement`` (forwards under :func:`replay_routing` only): the share of (token, layer) top-k expert
    sets the training forward's own router picks that differ from the ones the rollout recorded."""
    per_layer = []
    replayed = []
    for block in moe_blocks(model):
        st, block.stats = block.stats, None
        if st is None or float(st["tokens"]) == 0:
            continue
        if "replay" in st:
            replayed.append(st["replay"])
        count, tokens = st["count"], st["tokens"]
        load = count / count.mean().clamp(min=1e-12)
        aux = count.numel() * (count / tokens * st["prob"] / tokens).sum()
        per_layer.append(torch.stack([load.std(unbiased=False), load.max(), load.min(), aux]).cpu())
    if not per_layer:
        return {}
    v = torch.stack(per_layer)
    out = {"router/load_cv": float(v[:, 0].mean()), "router/load_max": float(v[:, 1].max()),
           "router/load_min": float(v[:, 2].min()), "router/aux_loss": float(v[:, 3].mean()),
           "router/dropped_tokens": 0.0}
    if replayed:
        differ, total = torch.stack(replayed).sum(0).tolist()
        out["router/replay_disagreement"] = differ / total if total else 0.0
    return out


# ---- building the experts ----------------------------------------------------------------------------------------
def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor, fmt: str | WeightFormat, *,
                     dtype: torch.dtype = torch.bfloat16,
                     group_size: int | None = None) -> MoeExperts:
    """:class:`MoeExperts` from dense stacks ``gate_up`` [E, 2I, H] and ``down`` [E, H, I], each expert quantized
    to ``fmt`` (NVFP4: one global scale per expert for its gate and up, as vLLM's fused w13 needs)."""
    spec = as_format(fmt)
    e, two_i, h = gate_up.shape
    group_size = group_size or spec.common_group_size([h, two_i // 2])
    tensors: dict[str, dict[str, list[torch.Tensor]]] = {p: {} for p in PROJECTIONS}
    shape_tensor = False
    for i in range(e):
        for proj, w in ((GATE_UP, gate_up[i]), (DOWN, down[i])):
            w = w.detach().float()
            parts = w.chunk(len(CHECKPOINT_PARTS[proj]))
            gs = nvfp4_global_scale(w.abs().max()) if spec.global_scale else None
            qws = [spec.quantize(p, global_scale=gs, group_size=group_size, dtype=dtype) for p in parts]
            shape_tensor = shape_tensor or _SHAPE in qws[0].tensors
            for name, t in fuse_parts([q.tensors for q in qws]).items():
                tensors[proj].setdefault(name, []).append(t)
    group_size = group_size or qws[0].group_size
    stacked = {p: {n: torch.stack(ts) for n, ts in d.items()} for p, d in tensors.items()}
    return MoeExperts(e, h, two_i // 2, spec.name, stacked, dtype, group_size if spec.quantized else None,
                      spec.act_quant, shape_tensor)


def fuse_parts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One expert's gate and up tensors as one fused projection: row tensors concatenated, the shared global scale
    once (a QerlError when the parts' differ: vLLM's fused gate/up GEMM reads one)."""
    first = parts[0]
    if not any(_row_split(n) for n in first):
        raise QerlError("an expert's gate_proj holds no weight tensor; the checkpoint is incomplete: quantize the "
                        "model again with `qerl quantize`")
    out: dict[str, torch.Tensor] = {}
    for name, t in first.items():
        if name == _SHAPE:
            continue
        if _row_split(name):
            out[name] = torch.cat([p[name] for p in parts])
        else:
            if any(not torch.equal(p[name], t) for p in parts[1:]):
                raise QerlError(f"an expert's gate_proj and up_proj have different {name}s; qerl fuses them into one "
                                "GEMM that reads one: quantize the model again with `qerl quantize`")
            out[name] = t
    return out


def experts_from_checkpoint(state: dict[str, torch.Tensor], prefix: str, config: Any, spec: WeightFormat,
                            dtype: torch.dtype, group_size: int | None, act_quant: str | None) -> MoeExperts:
    """Take one layer's per-expert tensors (``<prefix>.<e>.<part>.*``) out of ``state`` into a :class:`MoeExperts`
    (unquantized experts, which ``--ignore`` leaves so, in the plain format whatever the checkpoint's)."""
    from qerl_cli.formats import FORMATS

    if spec.quantized and f"{prefix}.0.{CHECKPOINT_PARTS[GATE_UP][0]}.weight" in state:
        spec = next((f for f in FORMATS.values() if not f.quantized), spec)
        group_size, act_quant = None, None
    dims = find_spec(config).dims(config)
    e_count, inter, hidden = dims.experts, dims.intermediate, dims.hidden
    tensors: dict[str, dict[str, list[torch.Tensor]]] = {p: {} for p in PROJECTIONS}
    shape_tensor = False
    for e in range(e_count):
        for proj, parts in CHECKPOINT_PARTS.items():
            found = []
            for part in parts:
                name = f"{prefix}.{e}.{part}"
                if spec.quantized:
                    shape_tensor = shape_tensor or f"{name}.{_SHAPE}" in state
                    found.append(spec.pop_layer_tensors(name, state))
                elif f"{name}.weight" in state:
                    found.append({"weight": state.pop(f"{name}.weight")})
                if not found or not found[-1]:
                    raise QerlError(f"the checkpoint has no tensors for {name}: quantize the model again with "
                                    "`qerl quantize`")
            for n, t in fuse_parts(found).items():
                tensors[proj].setdefault(n, []).append(t)
    stacked = {p: {n: torch.stack(ts) for n, ts in d.items()} for p, d in tensors.items()}
    if not spec.quantized:
        stacked = {p: {"weight": d["weight"].to(dtype)} for p, d in stacked.items()}
    return MoeExperts(e_count, hidden, inter, spec.name, stacked, dtype, group_size, act_quant, shape_tensor)


def sparse_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every sparse MLP of a transformers MoE model (its own block or qerl's), by the router and
    experts attributes its architecture declares."""
    spec = find_spec(model)
    moe = spec.moe if spec is not None else None
    if moe is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoeBlock) or (
        hasattr(m, moe.router) and hasattr(getattr(m, moe.experts, None), moe.gate_up))]


def adopt(model: nn.Module, make_experts: Any) -> list[str]:
    """Replace every sparse MLP of ``model`` by a :class:`MoeBlock` keeping its router; ``make_experts(name, block)``
    returns the layer's :class:`MoeExperts`. Returns the experts' module names."""
    check_moe_config(model.config)
    spec = find_spec(model)
    top_k = spec.dims(model.config).top_k if spec is not None else 0
    names = []
    for name, block in sparse_layers(model):
        if isinstance(block, MoeBlock):
            continue
        parent, _, leaf = name.rpartition(".")
        experts = make_experts(name, block)
        router = getattr(block, spec.moe.router)
        setattr(model.get_submodule(parent), leaf, MoeBlock(router, experts, top_k,
                                                            spec.moe.norm_topk(model.config)))
        names.append(f"{name}.experts")
    return names


def dense_experts(experts: nn.Module) -> dict[str, torch.Tensor]:
    """Both projections' weights [E, N, K] of a layer's experts, transformers' (fused parameters, as its loader
    made them) or qerl's (dequantized to fp32)."""
    if isinstance(experts, MoeExperts):
        return {p: experts.dense_stack(p, torch.float32) if experts.format.quantized else getattr(experts, p).float()
                for p in PROJECTIONS}
    return {p: getattr(experts, p).detach() for p in PROJECTIONS}
