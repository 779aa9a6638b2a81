"""The decode step's fast path: a per-projection plan resolved once, LoRA through small shadows.

Why: through peft every LoRA linear costs ~6 kernels on top of its base GEMM (cast x to the adapter's
fp32, two fp32 GEMMs, scale, cast back, add), 7 linears per layer. At decode sizes these launches, not
the GEMMs, set the step time.

What: ``FastPlan`` resolves, for every linear the runner calls, the base module (``QuantLinear``,
``nn.Linear``, a bitsandbytes layer: anything callable) and, for a peft LoRA layer with one active
plain adapter, its A, B and scaling. It keeps shadows ``A`` and ``B * scaling`` in the activation
dtype, refreshed IN PLACE (``copy_``) by ``refresh()`` at the start of every ``generate()`` (LoRA
factors are tiny, so this costs nothing measurable, and CUDA graphs that captured the shadows' addresses
stay valid). Projections sharing an input (q/k/v, gate/up) concatenate their A shadows so one ``mm``
serves all of them; then each projection is ``addmm(base(x), h_i, (s*B)^T)``:
``y = base(x) + (x @ A^T) @ (s*B)^T``. With fp32 activations the shadows are fp32 and this is the
training math up to GEMM ordering; with bf16/fp16 the adapter product is rounded to that dtype (peft
computes it in fp32), a rounding-level difference.

Anything unusual (several active adapters, DoRA or another LoRA variant, LoRA bias, merged weights,
``fan_in_fan_out``) keeps the module's own forward for that projection. Disabled adapters
(``disable_adapter()``) resolve to the bare base module; ``signature()`` notices any switch and the
runner rebuilds the plan.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qerl_cli.arch import ArchSpec
from qerl_cli.errors import QerlError
from qerl_cli.moe import MoeBlock, route
from qerl_cli.rollout.regions import region

log = logging.getLogger("qerl.rollout")


def _lora_layer_cls() -> type | None:
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:  # peft is optional for the runner
        return None
    return LoraLayer


def switches(module: nn.Module) -> tuple:
    """The peft switches that decide how a LoRA layer computes (empty for a plain module)."""
    cls = _lora_layer_cls()
    if cls is None or not isinstance(module, cls):
        return ()
    return (bool(module.disable_adapters), bool(module.merged), tuple(module.active_adapters),
            tuple(float(module.scaling.get(a, 0.0)) for a in module.active_adapters))


@dataclass
class _Lora:
    a: torch.Tensor  # the trainer's lora_A weight [r, in] (read at refresh)
    b: torch.Tensor  # lora_B weight [out, r]
    scaling: float


def resolve(module: nn.Module) -> tuple[nn.Module, _Lora | None] | None:
    """(base module, plain LoRA or None), or None when only the module's own forward is exact."""
    cls = _lora_layer_cls()
    if cls is None or not isinstance(module, cls):
        return module, None
    base = module.get_base_layer()
    if module.disable_adapters:
        # peft unmerges on a disabled forward; a merged layer is left to do that itself
        return None if module.merged else (base, None)
    if module.merged or getattr(module, "fan_in_fan_out", False):
        return None
    names = [a for a in module.active_adapters if a in module.lora_A]
    if not names:
        return base, None
    if len(names) > 1:
        return None
    name = names[0]
    if name in (getattr(module, "lora_variant", None) or {}) or (getattr(module, "use_dora", None) or {}).get(name):
        return None
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    if not isinstance(lora_a, nn.Linear) or not isinstance(lora_b, nn.Linear) or lora_b.bias is not None:
        return None
    dropout = module.lora_dropout[name]
    if dropout.training and getattr(dropout, "p", 0.0) > 0:
        return None  # a live dropout draws noise; only the module reproduces it
    return base, _Lora(lora_a.weight, lora_b.weight, float(module.scaling[name]))


def _fusable_dense(mods: list[nn.Module]) -> bool:
    first = mods[0]
    return all(
        type(m) is nn.Linear and not m.weight.requires_grad and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in mods
    )


def _fuse_dense(mods: list[nn.Module]) -> nn.Linear:
    """One frozen ``nn.Linear`` for layers that read the same input; the parts' weights (and biases) are
    rebound as row views of it, so no byte is stored twice (frozen bases only: an optimizer never holds
    them, so rebinding cannot desynchronise training)."""
    with torch.no_grad():
        w = torch.cat([m.weight for m in mods])
        b = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    fused.bias = None if b is None else nn.Parameter(b, requires_grad=False)
    row = 0
    for m in mods:
        n = m.out_features
        m.weight = nn.Parameter(w[row:row + n], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[row:row + n], requires_grad=False)
        row += n
    return fused


def _first_tensor(m: nn.Module) -> torch.Tensor:
    from qerl_cli.qlinear import QuantLinear

    return m.qweight if isinstance(m, QuantLinear) else m.weight


# first part -> (fused module, data pointers of the parts right after fusing): a rebuilt plan (after
# ``release()``) reuses the fused layer instead of concatenating again, unless a part was reassigned since.
_FUSED: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def fuse_bases(bases: list[nn.Module]) -> nn.Module | None:
    """One module whose output is the parts' outputs side by side (``QuantLinear`` through
    ``qlinear.fuse_quant_linears``, frozen ``nn.Linear`` through ``_fuse_dense``), or None when the parts
    cannot share a GEMM (mixed types or formats, different global scales, trainable weights, ...)."""
    from qerl_cli.qlinear import QuantLinear, fuse_quant_linears

    if len(bases) < 2:
        return None
    hit = _FUSED.get(bases[0])
    if hit is not None and hit[1] == tuple(_first_tensor(m).data_ptr() for m in bases):
        return hit[0]
    fused: nn.Module | None = None
    if all(isinstance(m, QuantLinear) for m in bases):
        try:
            fused = fuse_quant_linears(bases)
        except QerlError as exc:
            log.info("q/k/v or gate/up kept as separate GEMMs: %s", exc)
            return None
    elif _fusable_dense(bases):
        fused = _fuse_dense(bases)
    if fused is None:
        return None
    _FUSED[bases[0]] = (fused, tuple(_first_tensor(m).data_ptr() for m in bases))
    return fused


class ProjGroup:
    """Linears that share one input (q/k/v, gate/up; o and down alone).

    Base: one GEMM for the whole group when the parts can be fused (``fuse_bases``), else one per part.
    LoRA: one shrink ``h = x @ [A_1; A_2; ...]^T`` for the group, then with a single base output one
    in-place expand ``y += h @ B_blk^T`` where ``B_blk`` [sum N_i, sum r_i] holds each part's
    ``scaling * B_i`` on its diagonal block and zeros elsewhere (the zeros cost a few MB of reads per layer,
    far less than the launches they save); with separate bases, one in-place ``addmm_`` per part.
    Projections the plan cannot express call the module.
    """

    def __init__(self, modules: list[nn.Module], dtype: torch.dtype, device: torch.device,
                 fuse: bool = True, epilogue: bool = False) -> None:
        from qerl_cli.qlinear import QuantLinear

        self.modules = modules
        self.calls: list[nn.Module] = []
        self.loras: list[_Lora | None] = []
        resolved = [resolve(m) for m in modules]
        for m, r in zip(modules, resolved, strict=True):
            self.calls.append(m if r is None else r[0])
            self.loras.append(None if r is None else r[1])
        self.sizes = [_out_features(m) for m in self.calls]
        self.fused: nn.Module | None = None
        if fuse and all(r is not None for r in resolved) and None not in self.sizes:
            self.fused = fuse_bases(self.calls)
        single = self.fused if self.fused is not None else (self.calls[0] if len(modules) == 1 else None)
        self.base_kind = "qgemm" if all(isinstance(c, QuantLinear) for c in self.calls) else "dense"
        ranks = [lo.a.shape[0] if lo is not None else 0 for lo in self.loras]
        self.slices: list[tuple[int, int] | None] = []
        start = 0
        for lo, r in zip(self.loras, ranks, strict=True):
            self.slices.append((start, start + r) if lo is not None else None)
            start += r
        self.a_cat: torch.Tensor | None = None
        self.sb: list[torch.Tensor | None] = [None] * len(modules)
        self.b_blk: torch.Tensor | None = None  # [sum N, sum r]: the one expand of a single-output group
        self.one_output = single is not None
        if start:
            in_f = [lo.a.shape[1] for lo in self.loras if lo is not None][0]  # start > 0: one adapter at least
            self.a_cat = torch.empty(start, in_f, dtype=dtype, device=device)
            if self.one_output:
                self.b_blk = torch.zeros(sum(self.sizes), start, dtype=dtype, device=device)  # type: ignore[arg-type]
            else:
                for i, lo in enumerate(self.loras):
                    if lo is not None:
                        self.sb[i] = torch.empty(lo.b.shape, dtype=dtype, device=device)
        self.single = single
        # the expand may run in the quantized GEMM's epilogue (kernel_dispatch.lora_epilogue_linear)
        self.epilogue = epilogue and isinstance(single, QuantLinear)
        self.expand_in_epilogue = False  # where the last call's expand ran (the profile's byte accounting)
        self.refresh()

    @property
    def has_lora(self) -> bool:
        return self.a_cat is not None

    def _rows(self, i: int) -> tuple[int, int]:
        r0 = sum(self.sizes[:i])  # type: ignore[arg-type]
        return r0, r0 + self.sizes[i]  # type: ignore[operator]

    def refresh(self) -> None:
        """Copy the trainer's current factors into the shadows, in place (addresses never change)."""
        with torch.no_grad():
            for i, lo in enumerate(self.loras):
                if lo is None:
                    continue
                s0, s1 = self.slices[i]  # type: ignore[misc]
                self.a_cat[s0:s1].copy_(lo.a)  # type: ignore[index]
                # scale in the factor's own precision (fp32 master), round once into the shadow
                if self.b_blk is not None:
                    r0, r1 = self._rows(i)
                    self.b_blk[r0:r1, s0:s1].copy_(lo.b * lo.scaling)
                else:
                    self.sb[i].copy_(lo.b * lo.scaling)  # type: ignore[union-attr]

    def shadows(self) -> list[torch.Tensor]:
        return [t for t in [self.a_cat, self.b_blk, *self.sb] if t is not None]

    def __call__(self, x: torch.Tensor, h: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``x`` [..., in] -> one output [..., out_i] per projection (column views of one tensor when the
        group runs as one GEMM). ``h`` [rows, sum r]: the LoRA shrink ``x @ A_cat^T`` when the kernel that
        made x already computed it (``FusedOps``), else it is computed here."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.a_cat is not None and h is None:
            with region("lora"):
                h = torch.mm(x2, self.a_cat.t())
        if self.single is not None:
            y = self._base_and_expand(x2, h)
            outs, c0 = [], 0
            for n in self.sizes:
                outs.append(y[:, c0:c0 + n].view(*lead, n))  # type: ignore[misc]
                c0 += n  # type: ignore[operator]
            return outs
        outs = []
        for call, lo, sl, sb in zip(self.calls, self.loras, self.slices, self.sb, strict=True):
            with region(self.base_kind if lo is not None or call not in self.modules else "module"):
                y = call(x2)
            if lo is not None:
                with region("lora"):
                    y.addmm_(h[:, sl[0] : sl[1]], sb.t())  # type: ignore[index,union-attr]
            outs.append(y.view(*lead, y.shape[-1]))
        return outs

    def _base_and_expand(self, x2: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
        """The group's one base GEMM plus the LoRA expand ``h @ B_blk^T``: in the quantized GEMM's epilogue
        where the kernel the dispatcher chose has one (``epilogue`` on, a ``QuantLinear`` base), else one
        in-place ``addmm_`` (beta = 1: cuBLAS adds into the base output, no copy)."""
        if self.b_blk is not None and self.epilogue and x2.is_cuda:
            from qerl_cli import kernel_dispatch

            with region(self.base_kind):
                y = kernel_dispatch.lora_epilogue_linear(x2, self.single, h, self.b_blk)  # type: ignore[arg-type]
            if y is not None:
                self.expand_in_epilogue = True
                return y
        with region(self.base_kind):
            y = self.single(x2)  # type: ignore[misc]
        if self.b_blk is not None:
            with region("lora"):
                y.addmm_(h, self.b_blk.t())  # in place: no copy of y
        self.expand_in_epilogue = False
        return y


def _out_features(m: nn.Module) -> int | None:
    n = getattr(m, "out_features", None)
    return int(n) if isinstance(n, int) else None


class MoePlan:
    """A sparse MLP (``qerl_cli.moe.MoeBlock``) in the decode step: the model's router, then qerl's grouped experts
    with every expert's LoRA read from in-dtype copies of peft's stacked factors (A as [E, r, K], scaling * B as
    [E, N, r]), refreshed in place by ``refresh()`` like the projection shadows. No host sync: a CUDA graph holds it."""

    def __init__(self, block: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        from qerl_cli.moe import LoraFactors

        self.gate = block.gate
        self.top_k, self.norm_topk_prob = int(block.top_k), bool(block.norm_topk_prob)
        experts = block.experts
        factors = getattr(experts, "factors", None)
        self.masters = factors() if callable(factors) else {}  # peft's qerl_cli.lora.ParamWrapper, or none
        # the experts themselves whenever peft wraps them, whether or not an adapter is active: a wrapper with its
        # adapters disabled (peft's disable_adapter) has no factors but is still no MoeExperts, and calling it would
        # drop the in-dtype copies this plan hands the experts
        self.base = experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts
        self.hidden = int(self.base.hidden)
        self.lora = {p: LoraFactors(torch.empty(f.a.shape, dtype=dtype, device=device),
                                    torch.empty(f.b.shape, dtype=dtype, device=device))
                     for p, f in self.masters.items()}
        self.refresh()

    def refresh(self) -> None:
        with torch.no_grad():
            for p, f in self.masters.items():
                self.lora[p].a.copy_(f.a)
                self.lora[p].b.copy_(f.b * f.scaling)  # scaled in the fp32 master, rounded once into the copy

    def shadows(self) -> list[torch.Tensor]:
        return [t for f in self.lora.values() for t in (f.a, f.b)]

    def __call__(self, x: torch.Tensor, on_route: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """``on_route``: given the top-k index (the engine records it for routing replay)."""
        x2 = x.reshape(-1, self.hidden)
        with region("dense"):
            _, weights, index = route(x2, self.gate.weight, self.top_k, self.norm_topk_prob)
            if on_route is not None:
                on_route(index)
        # bf16 experts count as dense GEMMs, as the roofline counts their bytes (roofline.moe_bytes)
        with region("qgemm" if self.base.format.quantized else "dense"):
            return self.base(x2, index, weights, lora=self.lora).view(x.shape)


@dataclass
class LayerPlan:
    qkv: ProjGroup
    o: ProjGroup
    gate_up: ProjGroup | None  # None: the MLP is not gate/up/down with SiLU; call layer.mlp (or moe)
    down: ProjGroup | None
    moe: MoePlan | None = None  # a sparse MLP


def is_silu_mlp(mlp: nn.Module, arch: ArchSpec) -> bool:
    """Whether ``mlp`` computes exactly down(silu(gate(x)) * up(x)): a class its architecture declares gated
    (``ArchSpec.gated_mlps``), with a SiLU activation."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"  # transformers' ACT2FN["silu"]
    return type(mlp).__name__ in arch.gated_mlps and silu


class FastPlan:
    """Per-layer projection groups of a Llama/Qwen decoder stack (see the module docstring)."""

    def __init__(self, layers: list[nn.Module], dtype: torch.dtype, device: torch.device, arch: ArchSpec,
                 epilogue: bool = False, fuse: bool = True) -> None:
        """``arch``: the layers' architecture (its projection names and gated MLPs); ``fuse``: q/k/v and gate/up as
        one GEMM each where their bases can share one (``fuse_bases``)."""
        self.layers: list[LayerPlan] = []
        p = arch.projections
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = ProjGroup([getattr(attn, n) for n in p.qkv], dtype, device, fuse=fuse, epilogue=epilogue)
            o = ProjGroup([getattr(attn, p.o)], dtype, device, epilogue=epilogue)
            if is_silu_mlp(mlp, arch):
                gate_up = ProjGroup([getattr(mlp, n) for n in p.gate_up], dtype, device, fuse=fuse, epilogue=epilogue)
                down = ProjGroup([getattr(mlp, p.down)], dtype, device, epilogue=epilogue)
            else:
                gate_up = down = None
            moe = MoePlan(mlp, dtype, device) if isinstance(mlp, MoeBlock) else None
            self.layers.append(LayerPlan(qkv, o, gate_up, down, moe))
        self.signature = signature(layers)

    def groups(self) -> list[ProjGroup]:
        out: list[ProjGroup] = []
        for lp in self.layers:
            out += [g for g in (lp.qkv, lp.o, lp.gate_up, lp.down) if g is not None]
        return out

    def moe_plans(self) -> list[MoePlan]:
        return [lp.moe for lp in self.layers if lp.moe is not None]

    def refresh(self) -> None:
        for g in self.groups():
            g.refresh()
        for m in self.moe_plans():
            m.refresh()

    def fingerprint(self) -> tuple:
        """Addresses of the shadows (a captured graph reads them)."""
        shadows = [t for g in self.groups() for t in g.shadows()] + [t for m in self.moe_plans() for t in m.shadows()]
        return tuple(t.data_ptr() for t in shadows)


def signature(layers: list[nn.Module]) -> tuple:
    """Every LoRA switch and adapter-factor identity the plan depends on; a change means rebuild."""
    parts: list[object] = []
    cls = _lora_layer_cls()
    for layer in layers:
        for m in layer.modules():
            if cls is not None and isinstance(m, cls):
                sw = switches(m)
                factors = tuple(
                    (n, m.lora_A[n].weight.data_ptr(), tuple(m.lora_A[n].weight.shape), m.lora_B[n].weight.data_ptr())
                    for n in m.active_adapters if n in m.lora_A
                )
                parts.append((sw, factors, bool(m.lora_dropout.training)))
    return tuple(parts)


# ----- fused elementwise ops: Triton on CUDA, the torch reference elsewhere --------------------------------

# First-use check tolerance (relative L2 error vs the torch reference): rounding-level differences pass,
# a miscompiled kernel does not.
_CHECK_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm: ``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class FusedOps:
    """The decode step's elementwise work. ``triton=True`` routes it to ``qerl_kernels.decode``.

    ``fused_lora`` (default: with ``triton``): the LoRA shrinks run inside the kernel that makes their input
    (``rmsnorm_shrink``, ``silu_mul_shrink``; o_proj's alone in ``lora_shrink``), up to
    ``FUSED_SHRINK_MAX_ROWS`` rows (decode batches; a long prefill keeps norm + cuBLAS shrink).
    The first call of each kernel is checked against the torch reference on the same inputs (outside
    graph capture, which always follows eager warm-up runs); an exception or a mismatch logs one warning
    and that op stays on the torch path, so a kernel that fails to build on a GPU costs no run.
    """

    NAMES = ("add_rmsnorm", "rope_kv_write", "silu_mul", "rmsnorm_shrink", "silu_mul_shrink", "lora_shrink")
    LORA_NAMES = ("rmsnorm_shrink", "silu_mul_shrink", "lora_shrink")
    FUSED_SHRINK_MAX_ROWS = 256

    def __init__(self, triton: bool, fused_lora: bool | None = None) -> None:
        fused_lora = triton if fused_lora is None else fused_lora and triton
        self.enabled = {n: (fused_lora if n in self.LORA_NAMES else triton) for n in self.NAMES}
        self.checked: set[str] = set()
        self.fell_back: set[str] = set()  # kernels that failed to build or their first-use check
        self._k = None
        self.one_launch_rows = {"rmsnorm_shrink": 0, "silu_mul_shrink": 0}
        if triton:
            try:
                from qerl_kernels import decode as kernels

                self._k = kernels
                # up to how many rows the one-launch producer + shrink forms run (the kernels' measured rule)
                self.one_launch_rows = {"rmsnorm_shrink": kernels.NORM_SHRINK_MAX_ROWS,
                                        "silu_mul_shrink": kernels.SILU_SHRINK_MAX_ROWS}
            except Exception as exc:  # noqa: BLE001 - any import/build problem means: torch path
                log.warning("qerl fused decode kernels unavailable (%s); using the torch path", exc)
                self.fell_back = {n for n, on in self.enabled.items() if on}
                self.enabled = dict.fromkeys(self.NAMES, False)

    @property
    def fused_lora(self) -> bool:
        """Whether the runner should hand LoRA shrinks to these ops (else each group computes its own)."""
        return any(self.enabled[n] for n in self.LORA_NAMES)

    @property
    def triton(self) -> bool:
        return any(self.enabled.values())

    def _fail(self, name: str, why: str) -> None:
        self.enabled[name] = False
        self.fell_back.add(name)
        log.warning("qerl fused decode kernel %s disabled, torch path used instead: %s", name, why)

    def _try(self, name: str, run, ref):  # noqa: ANN001, ANN202 - small local dispatcher
        """Run the kernel; on first use compare with ``ref()``; return None to request the torch path."""
        try:
            out = run()
        except Exception as exc:  # noqa: BLE001
            self._fail(name, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        if name not in self.checked and not _capturing():
            self.checked.add(name)
            got, want = out if isinstance(out, tuple) else (out,), ref()
            want = want if isinstance(want, tuple) else (want,)
            for g, w in zip(got, want, strict=True):
                err = _rel_err(g, w)
                if err > _CHECK_TOL.get(w.dtype, 3e-2):
                    self._fail(name, f"first-use check: relative error {err:.3g} vs the torch reference")
                    return None
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.enabled["add_rmsnorm"] and _fusable(x, weight):
            out = self._try("add_rmsnorm", lambda: self._k.add_rmsnorm(x, None, weight, eps)[1],
                            lambda: rms_norm_ref(x, weight, eps))
            if out is not None:
                return out
        return rms_norm_ref(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rmsnorm(h + delta)); new tensors, ``h`` is left as it was."""
        if self.enabled["add_rmsnorm"] and _fusable(h, weight, delta):

            def ref() -> tuple[torch.Tensor, torch.Tensor]:
                s = h + delta
                return s, rms_norm_ref(s, weight, eps)

            out = self._try("add_rmsnorm", lambda: self._k.add_rmsnorm(h, delta, weight, eps), ref)
            if out is not None:
                return out
        h = h + delta
        return h, rms_norm_ref(h, weight, eps)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, act: nn.Module) -> torch.Tensor:
        if (self.enabled["silu_mul"] and _rows_packed(gate) and _rows_packed(up) and gate.shape == up.shape
                and gate.dtype == up.dtype):
            out = self._try("silu_mul", lambda: self._k.silu_mul(gate, up), lambda: act(gate) * up)
            if out is not None:
                return out
        return act(gate) * up

    def _shrink_ok(self, name: str, x: torch.Tensor, a: torch.Tensor) -> bool:
        rows = x.numel() // max(1, x.shape[-1])
        return (self.enabled[name] and rows <= self.FUSED_SHRINK_MAX_ROWS and a.dtype == x.dtype and a.dim() == 2
                and a.is_contiguous() and a.shape[1] == x.shape[-1] and a.shape[0] <= 256)

    def add_rms_norm_shrink(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                            a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(h + delta, x = rmsnorm(h + delta) * weight, x @ A^T as [rows, R]); ``delta=None``: (h, rmsnorm(h), ..)."""

        def ref() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            s = h if delta is None else h + delta
            x = rms_norm_ref(s, weight, eps)
            return s, x, torch.mm(x.reshape(-1, x.shape[-1]), a.t())

        rows = h.numel() // max(1, h.shape[-1])
        if (rows <= self.one_launch_rows["rmsnorm_shrink"] and self._shrink_ok("rmsnorm_shrink", h, a)
                and _fusable(h, weight, delta)):
            out = self._try("rmsnorm_shrink", lambda: self._k.rmsnorm_shrink(h, delta, weight, eps, a), ref)
            if out is not None:
                return out
        s, x = self.add_rms_norm(h, delta, weight, eps) if delta is not None else (h, self.rms_norm(h, weight, eps))
        with region("lora"):
            if self.enabled["rmsnorm_shrink"]:  # more rows than the one-launch form takes: norm, then shrink kernel
                return s, x, self.lora_shrink(x, a)
            return s, x, torch.mm(x.reshape(-1, x.shape[-1]), a.t())

    def silu_mul_shrink(self, gate: torch.Tensor, up: torch.Tensor, act: nn.Module,
                        a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(silu(gate) * up, that @ A^T as [rows, R])."""

        def ref() -> tuple[torch.Tensor, torch.Tensor]:
            y = act(gate) * up
            return y, torch.mm(y.reshape(-1, y.shape[-1]), a.t())

        rows = gate.numel() // max(1, gate.shape[-1])
        if (rows <= self.one_launch_rows["silu_mul_shrink"] and self._shrink_ok("silu_mul_shrink", gate, a)
                and _rows_packed(gate) and _rows_packed(up) and gate.shape == up.shape and gate.dtype == up.dtype):
            out = self._try("silu_mul_shrink", lambda: self._k.silu_mul_shrink(gate, up, a), ref)
            if out is not None:
                return out
        y = self.silu_mul(gate, up, act)
        with region("lora"):
            return y, torch.mm(y.reshape(-1, y.shape[-1]), a.t())

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x @ A^T as [rows, R] (one launch: K split across programs, reduced in the same kernel)."""
        x2 = x.reshape(-1, x.shape[-1])
        if self._shrink_ok("lora_shrink", x2, a) and _rows_packed(x2):
            out = self._try("lora_shrink", lambda: self._k.lora_shrink(x2, a), lambda: torch.mm(x2, a.t()))
            if out is not None:
                return out
        return torch.mm(x2, a.t())

    def rope_kv_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      rows: torch.Tensor, cos_g: torch.Tensor, sin_g: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """One decode token per slot: q/k/v [B, 1, heads, D]; rotate q and k, write k and v into the layer's
        cache [slots, max_len, kv_heads, D] at (row b, positions[b]). Returns rotated q [B, heads, D].
        ``cos_g``/``sin_g``: the tables gathered at ``positions`` [B, 1, 1, D] (torch path)."""

        def ref() -> torch.Tensor:
            qr = apply_rope_ref(q, cos_g, sin_g)[:, 0]
            # an FP8 cache: rounded to nearest, saturated at +-448 (torch's cast; the Triton write does the same)
            cache_k.index_put_((rows, positions), apply_rope_ref(k, cos_g, sin_g)[:, 0].to(cache_k.dtype))
            cache_v.index_put_((rows, positions), v[:, 0].to(cache_v.dtype))
            return qr

        b, _, hq, d = q.shape
        if (self.enabled["rope_kv_write"] and d % 2 == 0 and q.dtype == k.dtype == v.dtype == cos.dtype
                and _rows_ok(q) and _rows_ok(k) and _rows_ok(v) and cache_k.stride(-1) == 1
                and cache_k.stride(-2) == d and cache_v.stride(-1) == 1 and cache_v.stride(-2) == d):
            q2, k2, v2 = q.reshape(b, hq * d), k.reshape(b, -1), v.reshape(b, -1)
            name = "rope_kv_write"
            try:
                out = self._k.rope_kv_write(q2, k2, v2, positions, cos, sin, cache_k, cache_v)
            except Exception as exc:  # noqa: BLE001
                self._fail(name, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                return ref()
            if name in self.checked or _capturing():
                return out
            # first use: the reference re-writes the same cache rows; compare them and q
            self.checked.add(name)
            got_k, got_v = cache_k[rows, positions].clone(), cache_v[rows, positions].clone()
            want_q = ref()
            bad = max(_rel_err(out, want_q), _rel_err(got_k, cache_k[rows, positions]),
                      _rel_err(got_v, cache_v[rows, positions]))
            if bad > _CHECK_TOL.get(q.dtype, 3e-2):
                self._fail(name, f"first-use check: relative error {bad:.3g} vs the torch reference")
                return want_q
            # put the kernel's rows back: the check must leave the cache as every later step (and a CUDA
            # graph, whose warm-up run does the check) writes it, or eager and graphed runs part at rounding
            cache_k.index_put_((rows, positions), got_k)
            cache_v.index_put_((rows, positions), got_v)
            return out
        return ref()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _rows_packed(x: torch.Tensor) -> bool:
    """Last dim contiguous and the leading dims collapsible into one row stride (``view(-1, n)`` works)."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return False
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


def _rows_ok(x: torch.Tensor) -> bool:
    """[B, 1, heads, D] whose heads and D are packed (the row stride may be anything)."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def _fusable(h: torch.Tensor, w: torch.Tensor, d: torch.Tensor | None = None) -> bool:
    ok = h.is_contiguous() and w.is_contiguous() and w.dtype == h.dtype and w.dim() == 1 and w.numel() == h.shape[-1]
    return ok and (d is None or (d.is_contiguous() and d.dtype == h.dtype and d.shape == h.shape))
