"""Forward passes over the trainer's own Hugging Face module tree: prefill and one decode step.

Nothing is copied. The runner calls the projection modules the model holds
(``layer.self_attn.q_proj(x)``, ``layer.mlp(x)``, ``lm_head(x)``), so LoRA wrappers, quantized modules
(qerl's ``QuantLinear`` is not an ``nn.Linear``) and their kernels all apply. What the runner computes
itself, it reproduces from transformers' Llama/Qwen2/Qwen3 code:

* RMSNorm: ``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``. ``w`` is read by reference
  from the module at every call (AQN swaps norm weights in place before a rollout), unless
  ``norm_overrides`` supplies a replacement for that module.
* RoPE: cos/sin come from the model's own ``model.model.rotary_emb`` evaluated once for positions
  ``0..max_len-1`` (so default, linear, llama3 and yarn scaling are exact); positions index that table.
  Sequence-length-dependent variants (dynamic NTK, longrope) are refused.
* Attention: torch SDPA. Prefill runs a right-padded batch with ``is_causal=True`` (valid queries never
  see padding keys, so no mask is needed and flash kernels apply). Decode attends a query token per slot
  over the slot's cache up to a length bucket with a ``position <= current`` mask; grouped-query
  attention folds the query heads of one KV head into SDPA's query-length axis, so K/V are never
  repeated.

The decode step (``decode_step``) is one function of static-shaped tensors with no host sync, so a CUDA
graph (``CudaGraphDecoder``) or ``torch.compile(mode="reduce-overhead")`` can wrap it.

Fast path (``fast_layers.py``, docs/decode.md): LoRA layers run through in-dtype shadows of A and
B*scaling (``fast_lora``; refreshed in place by ``prepare()`` at every rollout), and on CUDA residual
add + RMSNorm, RoPE + KV-cache write and SiLU*mul are fused Triton kernels (``fused_kernels``).
The ``fast_decode`` option (``QERL_FAST_DECODE=0``, qerl_cli/options.py) turns both off.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qerl_cli.arch import ArchSpec, find_spec, model_types
from qerl_cli.errors import QerlError
from qerl_cli.moe import MoeBlock
from qerl_cli.options import RunOptions, options
from qerl_cli.rollout.attention import DecodeAttention
from qerl_cli.rollout.fast_layers import (
    FastPlan,
    FusedOps,
    ProjGroup,
    apply_rope_ref,
    is_silu_mlp,
    rms_norm_ref,
    signature,
)
from qerl_cli.rollout.kv_cache import KVCache, bucket_for, cache_dtype
from qerl_cli.rollout.regions import region
from qerl_cli.rollout.routing import RoutingShape
from qerl_cli.rollout.sampling import StepSampler

_UNSUPPORTED_ROPE = ("dynamic", "longrope")
_PEFT_PREFIX = "base_model.model."
# (sparse layer j, its top-k index [rows, k]) -> None: where a forward's routing is written (routing replay)
RouteSink = Callable[[int, torch.Tensor], None]


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside a peft ``PeftModel`` (LoRA layers stay injected in it), or the model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _rope_type(config: object) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict):
        return str(params.get("rope_type", params.get("type", "default")))
    return "default"


# the torch references, under the names this module always used
_rms_norm = rms_norm_ref
_apply_rope = apply_rope_ref


def _norm_eps(module: nn.Module, default: float) -> float:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return default


class ModelRunner:
    """Prefill and decode over a Llama/Qwen2/Qwen3 ``*ForCausalLM`` (optionally peft-wrapped)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_len: int,
        dtype: torch.dtype | None = None,
        cache_len: int | None = None,
        fast_lora: bool = True,
        fused_kernels: bool | None = None,
        opts: RunOptions | None = None,
    ) -> None:
        """``opts``: the run's options (default: ``qerl_cli.options.options()``, read once here)."""
        opts = opts or options()
        self.lm = unwrap_causal_lm(model)
        self.config = self.lm.config
        # what the forward calls by name: the architecture's projections, norms and q/k norms (qerl_cli/arch)
        self.arch = self._check_supported(self.config)
        self.proj = self.arch.projections
        self.attn_norm, self.mlp_norm = self.arch.aqn_norms
        inner = self.lm.model
        self._read_shapes(inner, dtype, max_len, cache_len)
        self._collect_norms(inner)
        with torch.no_grad():
            positions = torch.arange(self.cache_len, device=self.device)[None, :]
            probe = torch.zeros((), dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, position_ids=positions)
        self.cos = cos[0].to(self.dtype).contiguous()  # [cache_len, head_dim]
        self.sin = sin[0].to(self.dtype).contiguous()
        self.cache: KVCache | None = None
        # a mixture of experts' routing (None: dense); recorded while ``record_routing`` (the engine's switch): the
        # prefill's in ``prefill_routing`` [P, T, layers, k], the decode's and extend's into the cache's slots
        self.routing_shape = RoutingShape.of_layers(self.layers)
        self.record_routing = self.routing_shape is not None
        self.prefill_routing: torch.Tensor | None = None
        self._sparse_index = {i: j for j, i in enumerate(i for i, layer in enumerate(self.layers)
                                                          if isinstance(getattr(layer, "mlp", None), MoeBlock))}
        # decode attention: qerl's split-KV kernels, cuDNN SDPA or FlashInfer (the decode_attn option; attention.py)
        self.attention = DecodeAttention(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                         head_dim=self.head_dim, scale=self.scale, max_len=self.cache_len,
                                         dtype=self.dtype, device=self.device, backend=opts.decode_attn,
                                         kv_dtype=cache_dtype(self.dtype, opts.kv_cache))
        # What the engine calls for a decode step. A torch.compile of decode_step can be put here; measured
        # on an H200 (Qwen2.5-0.5B shape, bf16, dynamic=True, CUDA graphs captured around it) it was 2.5-3x
        # SLOWER than the plain graphs (cause not established) and took 85 s to compile, so no option uses it.
        self.step_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = self.decode_step
        self._choose_fast_path(opts, fast_lora, fused_kernels)

    @staticmethod
    def _check_supported(cfg: Any) -> ArchSpec:
        """The architecture's spec; refuses what the runner does not reproduce (architectures whose spec says so or
        that have none, sliding windows, length-dependent RoPE)."""
        spec = find_spec(cfg)
        if spec is None or not spec.engine:
            raise QerlError(
                f"the builtin rollout engine supports model types {', '.join(model_types(lambda s: s.engine))}; "
                f"got {getattr(cfg, 'model_type', None)!r}"
            )
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])) or getattr(
            cfg, "use_sliding_window", False
        ) or spec.sliding_window(cfg):
            raise QerlError("sliding-window attention is not supported by the builtin rollout engine")
        rope = _rope_type(cfg)
        if rope in _UNSUPPORTED_ROPE:
            raise QerlError(f"rope type {rope!r} depends on the sequence length; the builtin engine refuses it")
        return spec

    def _read_shapes(self, inner: nn.Module, dtype: torch.dtype | None, max_len: int, cache_len: int | None) -> None:
        """The modules the forward calls and the attention geometry, dtype, device and lengths."""
        cfg = self.config
        self.embed_tokens: nn.Module = inner.embed_tokens
        self.layers = list(inner.layers)
        self.lm_head: nn.Module = self.lm.lm_head
        self.num_layers = len(self.layers)
        attn0 = self.layers[0].self_attn
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(attn0, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.groups = self.num_heads // self.num_kv_heads
        self.scale = float(getattr(attn0, "scaling", self.head_dim**-0.5))
        self.qk_norm = self.arch.qk_norm  # (q's, k's) attribute names, or None
        self.vocab_size = int(cfg.vocab_size)
        weight = self.embed_tokens.weight
        self.device = weight.device
        self.dtype = dtype or weight.dtype
        self.max_len = max_len
        self.cache_len = cache_len or max_len
        max_pos = getattr(cfg, "max_position_embeddings", None)
        if max_pos is not None and max_len > int(max_pos):
            raise QerlError(f"max_model_len {max_len} exceeds the model's max_position_embeddings {max_pos}")

    def _collect_norms(self, inner: nn.Module) -> None:
        """Every RMSNorm module by name, with its epsilon; the weights are bound per rollout (``bind_norms``)."""
        default_eps = float(getattr(self.config, "rms_norm_eps", 1e-6))
        self.norm_modules: dict[str, nn.Module] = {"model.norm": inner.norm}
        for i, layer in enumerate(self.layers):
            for attr in (self.attn_norm, self.mlp_norm):
                self.norm_modules[f"model.layers.{i}.{attr}"] = getattr(layer, attr)
            for attr in self.qk_norm or ():
                self.norm_modules[f"model.layers.{i}.self_attn.{attr}"] = getattr(layer.self_attn, attr)
        self.norm_eps = {name: _norm_eps(m, default_eps) for name, m in self.norm_modules.items()}
        # Name -> weight used by the forward; set by bind_norms() at the start of every generate().
        self.norm_w: dict[str, torch.Tensor] = {}
        self._static_norms: dict[str, torch.Tensor] | None = None

    def _choose_fast_path(self, opts: RunOptions, fast_lora: bool, fused_kernels: bool | None) -> None:
        """The fast path (fast_layers.py): LoRA through shadows, fused Triton kernels on CUDA; the fast_decode
        option off turns both off (A/B runs in one process tree)."""
        self.fast_lora = fast_lora and opts.fast_decode
        if fused_kernels is None:
            fused_kernels = self.device.type == "cuda"
        # LoRA inside the step (docs/decode.md): one-launch Triton shrinks (after the norm kernel for q/k/v and
        # gate/up, on the attention output for o; down's stays cuBLAS after the SiLU kernel) and the expands in the
        # quantized GEMM's epilogue where its kernel has one. The default; the fused_lora option off is the A/B
        # switch (one cuBLAS shrink GEMM per group, in-place expands).
        self.fused_lora = opts.fused_lora
        # q/k/v and gate/up as one GEMM each where the parts can share one (the fused_proj option)
        self.fuse_proj = opts.fused_proj
        self.ops = FusedOps(triton=fused_kernels and opts.fast_decode, fused_lora=self.fused_lora)
        self.plan: FastPlan | None = None
        # the MLP half of each layer as one persistent quantized launch (qerl_kernels.decode_layer) where it applies
        # (the decode_layer kernel option; on by default: measured faster at <= 8 tokens)
        self.decode_layer = (opts.kernels.decode_layer and self.fast_lora and self.fused_lora
                             and self.device.type == "cuda")
        self._mlp_args: dict[int, tuple | None] = {}
        # the attention half before the attention (residual + RMSNorm, q/k/v with LoRA and bias, RoPE + KV write) as
        # one persistent launch (the decode_layer_attn kernel option: by default for the formats whose per-op q/k/v
        # has no kernel, decode_layer.attn_half_wanted). Not with Qwen3's q/k norm, which sits between the q/k/v GEMM
        # and RoPE.
        self.attn_half_mode = opts.kernels.decode_layer_attn
        self.decode_layer_attn = (self.attn_half_mode != "0" and self.fast_lora and self.fused_lora
                                  and self.device.type == "cuda" and self.qk_norm is None)
        self._attn_args: dict[int, tuple | None] = {}

    def prepare(self) -> None:
        """Called at the start of every rollout: (re)build the projection plan when a LoRA switch changed,
        else refresh its shadows in place from the trainer's current LoRA factors."""
        if not self.fast_lora:
            self.plan = None
            return
        sig = signature(self.layers)
        if self.plan is None or self.plan.signature != sig:
            self.plan = FastPlan(self.layers, self.dtype, self.device, self.arch, fuse=self.fuse_proj,
                                 epilogue=self.fused_lora and self.device.type == "cuda")
            self._prepare_kernels()
        else:
            self.plan.refresh()
        self._prepare_decode_layer()

    def refresh_adapters(self) -> None:
        """Mid-rollout (new adapters between decode windows): the shadows take the trainer's factors in place. The
        plan is never rebuilt here: captured graphs and the persistent kernels' arguments keep their addresses.
        Without fast LoRA the modules' own factors are read, already current."""
        if self.plan is not None:
            self.plan.refresh()

    def _prepare_kernels(self) -> None:
        """Which FP4 kernel runs each GEMM shape of the decode step (the fused q/k/v and gate/up included) is
        measured, or loaded from the disk cache, now: before any graph capture and outside the decode steps."""
        if self.device.type != "cuda" or self.plan is None:
            return
        try:
            from qerl_kernels import dispatch
        except ImportError:
            return
        mods = [m for g in self.plan.groups() for m in g.calls]
        # the groups whose expand may ride in the GEMM's epilogue get their LoRA-aware plans measured too
        ranks = {g.single: g.b_blk.shape[1] for g in self.plan.groups() if g.epilogue and g.b_blk is not None}
        if ranks and "lora_ranks" in inspect.signature(dispatch.prepare).parameters:
            dispatch.prepare(mods, self.dtype, lora_ranks=ranks)
        else:
            dispatch.prepare(mods, self.dtype)
        # the routed experts' GEMMs (qerl's grouped kernel or humming's MoE GEMM, docs/moe.md), likewise ahead
        moe = [(lp.moe.base, lp.moe.top_k) for lp in self.plan.layers if lp.moe is not None]
        if moe and hasattr(dispatch, "prepare_experts"):
            dispatch.prepare_experts(moe, self.dtype)

    def _prepare_decode_layer(self) -> None:
        """Per layer, the persistent MLP-half kernel's view of o, gate/up and down (resident repacks, LoRA shadows) and
        the attention-half kernel's of the fused q/k/v (with its bias), or None where they do not apply; made eagerly
        here, before any graph capture (the in-place repack, the kernels' shared-memory limits, their scratch)."""
        self._mlp_args = {}
        self._attn_args = {}
        if not (self.decode_layer or self.decode_layer_attn) or self.plan is None:
            return
        try:
            from qerl_kernels import decode_layer
        except ImportError:
            return
        if self.decode_layer and decode_layer.available(self.device):
            for i, lp in enumerate(self.plan.layers):
                args = self._mlp_args[i] = self._mlp_half_args(lp, decode_layer, self.dtype)
                if args is not None:
                    decode_layer.prepare(self.device, *args, self.dtype)
        if self.decode_layer_attn and decode_layer.attn_available(self.device):
            for i, lp in enumerate(self.plan.layers):
                got = self._attn_args[i] = self._attn_half_args(lp, decode_layer)
                if got is not None:
                    decode_layer.attn_prepare(self.device, got[0], self.num_heads, self.num_kv_heads, self.head_dim,
                                              self.dtype)

    @staticmethod
    def _mlp_half_args(lp: Any, decode_layer: Any, dtype: torch.dtype) -> tuple | None:
        groups = (lp.o, lp.gate_up, lp.down)
        if any(g is None or g.single is None or (g.a_cat is not None and g.b_blk is None) for g in groups):
            return None
        args = tuple(decode_layer.gemm_args(g.single, g.a_cat, g.b_blk) for g in groups)
        if any(a is None for a in args) or decode_layer.check_shapes(*args, 1, dtype) is not None:
            return None
        return args

    def _attn_half_args(self, lp: Any, decode_layer: Any) -> tuple | None:
        """(q/k/v GemmArgs, fp32 bias or None) of a layer whose q/k/v is one 4-bit GEMM the kernel takes (and the
        option hands it), else None."""
        g = lp.qkv
        if g is None or g.single is None or len(g.modules) != 3 or (g.a_cat is not None and g.b_blk is None):
            return None
        if not decode_layer.attn_half_wanted(self.attn_half_mode, getattr(g.single, "fmt", "")):
            return None
        got = decode_layer.attn_gemm_args(g.single, g.a_cat, g.b_blk)
        if got is None or got[0].k != self.config.hidden_size or decode_layer.attn_check_shapes(
                got[0], 1, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype) is not None:
            return None
        return got

    def _attn_half(self, i: int, h: torch.Tensor, delta: torch.Tensor | None,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + delta, RoPE'd q [B, heads, D]) with k and v written into layer i's cache at each slot's position, by
        the persistent attention-half kernel; None: the per-op path runs (nothing was computed or written)."""
        from qerl_kernels import decode_layer

        got = self._attn_args.get(i)
        rows = h.numel() // h.shape[-1]
        cache = self.cache
        # the kernel writes K/V in the model's dtype: an FP8 cache takes the per-op path
        if (got is None or cache is None or cache.k is None or cache.v is None
                or rows > decode_layer.engine_max_m(got[0].fmt)
                or cache.k.dtype != h.dtype or h.dtype not in (torch.bfloat16, torch.float16)
                or self.cos.dtype != h.dtype
                or positions.shape != (rows,) or positions.dtype != torch.int64):
            return None
        name = f"model.layers.{i}.{self.attn_norm}"
        with region("qgemm"):
            hn, q = decode_layer.attn_half(h.reshape(rows, -1), None if delta is None else delta.reshape(rows, -1),
                                           self.norm_w[name], self.norm_eps[name], got[0], got[1], self.cos,
                                           self.sin, positions, cache.k[i], cache.v[i], self.num_heads)
        return hn.view(h.shape), q

    def _mlp_half(self, i: int, h: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + o_proj(o), the MLP's output) by the persistent kernel, or None (the per-GEMM path runs)."""
        from qerl_kernels import decode_layer

        args = self._mlp_args.get(i)
        rows = o.numel() // o.shape[-1]
        if (args is None or rows > decode_layer.engine_max_m(args[0].fmt)
                or o.dtype not in (torch.bfloat16, torch.float16)
                or decode_layer.input_misfit(args[0], o.reshape(rows, -1)) is not None):
            return None

        name = f"model.layers.{i}.{self.mlp_norm}"
        with region("qgemm"):
            h1, delta = decode_layer.mlp_half(o.reshape(rows, -1), h.reshape(rows, -1), self.norm_w[name],
                                              self.norm_eps[name], *args)
        return h1.view(h.shape), delta.view(h.shape)

    # ----- norm weights ---------------------------------------------------------------------------------

    def resolve_overrides(self, overrides: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Map user names (``model.layers.0.input_layernorm[.weight]``, peft-prefixed or not) to tensors."""
        resolved: dict[str, torch.Tensor] = {}
        for raw, tensor in (overrides or {}).items():
            name = raw[len(_PEFT_PREFIX) :] if raw.startswith(_PEFT_PREFIX) else raw
            name = name[: -len(".weight")] if name.endswith(".weight") else name
            module = self.norm_modules.get(name)
            if module is None:
                raise QerlError(f"norm_overrides: {raw!r} is not a norm module of this model")
            if tuple(tensor.shape) != tuple(module.weight.shape):
                raise QerlError(
                    f"norm_overrides[{raw!r}] has shape {tuple(tensor.shape)}, expected {tuple(module.weight.shape)}"
                )
            resolved[name] = tensor.to(device=module.weight.device, dtype=module.weight.dtype)
        return resolved

    def bind_norms(self, overrides: dict[str, torch.Tensor] | None, static: bool) -> None:
        """Choose the norm weights for this rollout.

        Eager: the module's own ``weight`` Parameter (by reference) or the override. Static (CUDA graph):
        a captured graph reads fixed addresses, so current values are copied into persistent buffers.
        """
        resolved = self.resolve_overrides(overrides)
        current = {n: resolved.get(n, m.weight) for n, m in self.norm_modules.items()}
        if not static:
            self.norm_w = current
            return
        if self._static_norms is None:
            self._static_norms = {n: w.detach().clone() for n, w in current.items()}
        for n, w in current.items():
            self._static_norms[n].copy_(w)
        self.norm_w = self._static_norms

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        with region("elementwise"):
            return self.ops.rms_norm(x, self.norm_w[name], self.norm_eps[name])

    def _add_norm(self, name: str, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return h, self._norm(name, h)
        with region("elementwise"):
            return self.ops.add_rms_norm(h, delta, self.norm_w[name], self.norm_eps[name])

    # ----- shared layer stack -------------------------------------------------------------------------

    def _layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor],
        rope_in_attend: bool = False,
        route_sink: RouteSink | None = None,
        decode_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run every decoder layer on ``h`` [B, T, hidden] and return the FINAL-NORMED hidden states.

        ``attend(i, q, k, v)`` -> [B, T, heads*dim]; q/k/v arrive as [B, T, heads, head_dim] after q/k-norm
        (Qwen3) and, unless ``rope_in_attend``, RoPE (cos/sin broadcast to them). Each residual add is fused
        with the norm that reads its result (``ops.add_rms_norm``), the last one with the model's final norm.
        ``route_sink`` gets each sparse layer's top-k expert index (the routing the engine records).
        ``decode_positions`` (the decode step's, one token per slot): where the persistent attention half applies it
        does the residual add, norm, q/k/v, RoPE and the KV write, and ``attend(i, q, None, None)`` gets the rotated
        q [B, heads, D].
        """
        b, t = h.shape[:2]
        plan = self.plan
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            lp = plan.layers[i] if plan is not None else None
            fused_attn = (self._attn_half(i, h, delta, decode_positions)
                          if decode_positions is not None and lp is not None and self._attn_args else None)
            if fused_attn is not None:
                h, q = fused_attn
                o = attend(i, q, None, None)
            else:
                h, x, hl = self._add_norm_shrink(f"model.layers.{i}.{self.attn_norm}", h, delta, lp and lp.qkv)
                if lp is not None:
                    q, k, v = lp.qkv(x, hl)
                else:
                    q, k, v = (getattr(attn, name)(x) for name in self.proj.qkv)
                q = q.view(b, t, self.num_heads, self.head_dim)
                k = k.view(b, t, self.num_kv_heads, self.head_dim)
                v = v.view(b, t, self.num_kv_heads, self.head_dim)
                if self.qk_norm is not None:
                    q = self._norm(f"model.layers.{i}.self_attn.{self.qk_norm[0]}", q)
                    k = self._norm(f"model.layers.{i}.self_attn.{self.qk_norm[1]}", k)
                if not rope_in_attend:
                    q = _apply_rope(q, cos, sin)
                    k = _apply_rope(k, cos, sin)
                o = attend(i, q, k, v)
            fused_mlp = self._mlp_half(i, h, o) if lp is not None and self._mlp_args else None
            if fused_mlp is not None:
                h, delta = fused_mlp
                continue
            if lp is not None:
                hl = None
                if lp.o.a_cat is not None and self.ops.fused_lora:
                    with region("lora"):  # the attention output's shrink: one launch of its own
                        hl = self.ops.lora_shrink(o, lp.o.a_cat)
                delta = lp.o(o, hl)[0]
            else:
                delta = getattr(attn, self.proj.o)(o)
            h, x, hl = self._add_norm_shrink(f"model.layers.{i}.{self.mlp_norm}", h, delta,
                                             lp and lp.gate_up)
            mlp = layer.mlp
            if lp is not None and lp.gate_up is not None and lp.down is not None:
                gate, up = lp.gate_up(x, hl)
                hl = None
                with region("elementwise"):
                    if lp.down.a_cat is not None and self.ops.fused_lora:
                        act, hl = self.ops.silu_mul_shrink(gate, up, mlp.act_fn, lp.down.a_cat)
                    else:
                        act = self.ops.silu_mul(gate, up, mlp.act_fn)
                delta = lp.down(act, hl)[0]
            elif lp is not None and lp.moe is not None:
                delta = lp.moe(x, self._route_hook(route_sink, i))
            elif isinstance(mlp, MoeBlock):
                delta = mlp(x, on_route=self._route_hook(route_sink, i))
            elif self.ops.triton and is_silu_mlp(mlp, self.arch):
                p = self.proj
                gate, up, down = getattr(mlp, p.gate), getattr(mlp, p.up), getattr(mlp, p.down)
                delta = down(self.ops.silu_mul(gate(x), up(x), mlp.act_fn))
            else:
                delta = mlp(x)
        return self._add_norm("model.norm", h, delta)[1]

    def _route_hook(self, sink: RouteSink | None, i: int) -> Callable[[torch.Tensor], None] | None:
        if sink is None:
            return None
        j = self._sparse_index[i]
        return lambda index: sink(j, index)

    def _recording(self) -> bool:
        return self.record_routing and self.routing_shape is not None

    def _cache_sink(self, slots: torch.Tensor, positions: torch.Tensor,
                    valid: torch.Tensor | None = None) -> RouteSink | None:
        """Writes a step's top-k at (slot, position) of the cache's routing: ``slots``/``positions`` [R] or [R, M]
        (a device tensor write, so a CUDA graph captures it); ``valid`` [R, M] leaves padding rows out."""
        if not self._recording() or self.cache is None or self.cache.routing is None:
            return None
        buf = self.cache.routing.buf

        def sink(j: int, index: torch.Tensor) -> None:
            index = index.view(*slots.shape, -1)
            if valid is not None:
                buf[slots[valid], positions[valid], j] = index[valid].to(buf.dtype)
            else:
                buf[slots, positions, j] = index.to(buf.dtype)
        return sink

    def _add_norm_shrink(self, name: str, h: torch.Tensor, delta: torch.Tensor | None,
                         group: ProjGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``_add_norm``, plus the LoRA shrink of the group that reads the normed x when the fused ops take it
        (else None: the group computes its own)."""
        if group is None or group.a_cat is None or not self.ops.fused_lora:
            return (*self._add_norm(name, h, delta), None)
        with region("elementwise"):
            return self.ops.add_rms_norm_shrink(h, delta, self.norm_w[name], self.norm_eps[name], group.a_cat)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids).to(self.dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of final-normed hidden states."""
        with region("dense"):
            return self.lm_head(x)

    # ----- prefill ------------------------------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill a right-padded batch ``ids`` [P, T] with true ``lengths`` [P] (device tensors).

        Returns the logits of each prompt's last token [P, V] and the K/V of every layer
        ``[layers, P, T, kv_heads, head_dim]`` (positions >= length are padding garbage, never copied).
        The caller copies a prompt's K/V into as many slots as it has samples (and, recording a mixture of experts'
        routing, its ``prefill_routing`` rows).
        """
        p, t = ids.shape
        kv_shape = (self.num_layers, p, t, self.num_kv_heads, self.head_dim)
        k_out = torch.empty(kv_shape, dtype=self.dtype, device=self.device)
        v_out = torch.empty(kv_shape, dtype=self.dtype, device=self.device)
        cos = self.cos[:t][None, :, None, :]
        sin = self.sin[:t][None, :, None, :]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_out[i].copy_(k)
            v_out[i].copy_(v)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                scale=self.scale,
                enable_gqa=self.groups > 1,
            )
            return o.transpose(1, 2).reshape(p, t, self.num_heads * self.head_dim)

        sink = None
        self.prefill_routing = None
        if self._recording():
            rs = self.routing_shape
            routing = torch.empty((p, t, rs.layers, rs.top_k), dtype=rs.dtype, device=self.device)
            self.prefill_routing = routing

            def sink(j: int, index: torch.Tensor) -> None:
                routing[:, :, j] = index.view(p, t, -1).to(routing.dtype)
        x = self._layers(self._embed(ids), cos, sin, attend, route_sink=sink)
        last = x[torch.arange(p, device=self.device), lengths - 1]
        return self._logits(last), k_out, v_out

    # ----- extend: tokens appended to sequences already in the cache ----------------------------------

    def extend(self, ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, first_slot: int,
               kv_len: int) -> torch.Tensor:
        """Append the right-padded ``ids`` [R, M] (true ``lengths`` [R]) to the sequences in slots
        ``first_slot .. first_slot + R - 1``, row r at positions ``starts[r] ..``; returns each row's last-token
        logits [R, V]. Every new token attends to its slot's cached keys before ``starts[r]`` and causally to the
        new ones (a tool's observation resumes an episode this way). Padding positions are neither written nor
        read; ``kv_len`` must cover ``starts + lengths``."""
        assert self.cache is not None and self.cache.k is not None and self.cache.v is not None
        cache_k, cache_v = self.cache.k, self.cache.v
        r, m = ids.shape
        cols = torch.arange(m, device=self.device)
        pos = starts[:, None] + cols[None, :]  # [R, M]
        valid = cols[None, :] < lengths[:, None]
        rope_pos = torch.where(valid, pos, torch.zeros_like(pos))
        cos = self.cos[rope_pos][:, :, None, :]
        sin = self.sin[rope_pos][:, :, None, :]
        keys = torch.arange(kv_len, device=self.device)
        visible = keys[None, None, :] <= pos[:, :, None]  # [R, M, kv_len]: a padding query sees keys, unused
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        slot_of = (first_slot + torch.arange(r, device=self.device))[:, None].expand(r, m)[valid]
        pos_of = pos[valid]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer_k, layer_v = cache_k[i], cache_v[i]
            layer_k[slot_of, pos_of] = k[valid].to(layer_k.dtype)  # an FP8 cache: rounded, saturated
            layer_v[slot_of, pos_of] = v[valid].to(layer_v.dtype)
            # the turn attends what later decode steps will read: the cache's values, widened
            kk = layer_k[first_slot:first_slot + r, :kv_len].to(q.dtype)
            vv = layer_v[first_slot:first_slot + r, :kv_len].to(q.dtype)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                               attn_mask=mask[:, None], scale=self.scale,
                                               enable_gqa=self.groups > 1)
            return o.transpose(1, 2).reshape(r, m, self.num_heads * self.head_dim)

        slots = (first_slot + torch.arange(r, device=self.device))[:, None].expand(r, m)
        x = self._layers(self._embed(ids), cos, sin, attend, route_sink=self._cache_sink(slots, pos, valid))
        last = x[torch.arange(r, device=self.device), lengths - 1]
        return self._logits(last)

    # ----- decode -------------------------------------------------------------------------------------

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                    host_positions: list[int] | None = None) -> torch.Tensor:
        """One token for each of the first B slots. tokens/positions: int64 [B]; returns logits [B, V].

        Slot ``b`` holds its sequence's K/V at positions < positions[b]; this step writes position
        ``positions[b]`` and attends keys ``0..positions[b]`` of the first ``kv_len`` cache positions.
        Static shapes for a fixed (B, kv_len), no host sync: safe to capture in a CUDA graph.
        ``host_positions``: ``positions`` as host ints, given by an eager caller when the attention backend is
        planned on the host (FlashInfer); a CUDA-graph caller plans before the replay and passes none.
        """
        assert self.cache is not None and self.cache.k is not None and self.cache.v is not None
        cache_k, cache_v = self.cache.k, self.cache.v
        b = tokens.shape[0]
        if host_positions is not None and self.attention.needs_host_positions:
            self.attention.select(b, kv_len)
            self.attention.plan(list(host_positions))
        rows = torch.arange(b, device=tokens.device)
        cos = self.cos[positions][:, None, None, :]
        sin = self.sin[positions][:, None, None, :]
        mask = decode_mask(positions, kv_len, self.dtype)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
            layer_k, layer_v = cache_k[i], cache_v[i]
            if k is not None and v is not None:
                # RoPE of q and k and the cache write of k and v at each slot's position: one kernel on CUDA (k None:
                # the persistent attention half did both, q is rotated)
                with region("elementwise"):
                    q = self.ops.rope_kv_write(q, k, v, positions, rows, cos, sin, self.cos, self.sin, layer_k,
                                               layer_v)
            with region("attn"):
                o = self.attention(q, layer_k, layer_v, kv_len, mask, positions)
            return o.reshape(b, 1, self.num_heads * self.head_dim)

        x = self._layers(self._embed(tokens[:, None]), cos, sin, attend, rope_in_attend=True,
                         route_sink=self._cache_sink(rows, positions), decode_positions=positions)
        return self._logits(x[:, 0])


def decode_mask(positions: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive SDPA mask [B, 1, 1, kv_len]: 0 where key <= the row's position, -inf after (SDPA would turn
    a boolean mask into this in every layer; built once per step)."""
    keys = torch.arange(kv_len, device=positions.device)
    visible = (keys[None, :] <= positions[:, None])[:, None, None, :]
    return torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))


def _bucket_sizes(max_slots: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_slots]
    sizes += list(range(16, max_slots, 16))
    return sizes + [max_slots]


def kv_len_buckets(max_len: int, smallest: int = 128) -> list[int]:
    """Attention length buckets for decode: powers of two from ``smallest``, capped by the cache length."""
    buckets = []
    size = smallest
    while size < max_len:
        buckets.append(size)
        size *= 2
    return buckets + [max_len]


class CudaGraphDecoder:
    """Replays ``ModelRunner.decode_step`` from CUDA graphs, one per (batch bucket, kv-length bucket), with the
    sampler captured after it where that is one kernel (``sample``).

    * Batches are padded up to a bucket; the padding rows decode token 0 at position 0 into slots
      ``B..bucket-1``, which are free (the scheduler keeps running sequences in slots ``0..B-1``), and a
      free slot's position 0 is rewritten by the prefill that next occupies it. Buckets never exceed the
      slot count.
    * Graphs are captured lazily, the first time a (bucket, kv_len, sampler) triple is needed, with the live
      inputs already in the static buffers: the warm-up runs then write exactly the K/V the real step writes
      (idempotent), so capturing mid-rollout cannot corrupt a running sequence.
    * All graphs share one memory pool; they never run concurrently, and each keeps its output alive.
    * A graph bakes in the address of every tensor it reads (weights, LoRA factors, cache, norm
      buffers). ``fingerprint`` records those addresses; the engine drops the graphs when it changes
      (cache reallocated after ``release()``, parameters re-assigned, adapters toggled). A captured sampler
      reads static uid/step/seed-key buffers, and the graph key holds its temperature and filters.
    * An attention backend planned on the host (FlashInfer) is planned before every replay (and before a
      capture) with the bucket's positions; the backend the graph uses is part of its key, and so is W4A8 (the kernel
      option QERL_W4A8 and its row threshold, which --rollout-w4a8 turns on around training rollouts only).
    """

    def __init__(self, runner: ModelRunner, max_slots: int) -> None:
        self.runner = runner
        self.buckets = _bucket_sizes(max_slots)
        device = runner.device
        self.tokens = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.uids = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.steps = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.key = torch.zeros((), dtype=torch.int64, device=device)
        self._key_value: int | None = None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.fingerprint: tuple | None = None

    def bucket(self, b: int) -> int:
        return bucket_for(self.buckets, b, "decode batch (sequences per CUDA graph, at most the KV-cache slots)")

    def ensure_captured(self, bs: int, kv_len: int, sampler: StepSampler | None = None,
                        host_positions: list[int] | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
        """The graph of (batch bucket ``bs``, ``kv_len``, ``sampler``) and its output (logits, or (tokens,
        log-probs) with a sampler), captured now unless it exists (benches call it to keep captures out of
        their timed runs). Plans a host-planned attention backend for the static buffers' positions first."""
        att = self.runner.attention
        if att.needs_host_positions:
            hp = host_positions if host_positions is not None else self.positions[:bs].tolist()
            att.select(bs, kv_len, lambda: self._time_attention(hp, kv_len))
            att.plan(hp, bucket=bs)
        # W4A8 is a kernel option a training rollout switches on for itself (--rollout-w4a8): a graph captured with
        # it off is never replayed with it on, nor the reverse (a held-out score between rollouts)
        k = options().kernels
        key = (bs, kv_len, att.current, None if sampler is None else sampler.signature,
               k.w4a8_min_m if k.w4a8 else None)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(bs, kv_len, sampler)
        return entry

    def _time_attention(self, positions: list[int], kv_len: int) -> dict[str, float]:
        cache = self.runner.cache
        assert cache is not None and cache.k is not None and cache.v is not None
        return self.runner.attention.time_both(positions, cache.k[0], cache.v[0], kv_len)

    def _run(self, bs: int, kv_len: int, sampler: StepSampler | None) -> Any:
        logits = self.runner.step_fn(self.tokens[:bs], self.positions[:bs], kv_len)
        if sampler is None:
            return logits
        return sampler(logits, self.uids[:bs], self.steps[:bs], key=self.key)

    def _capture(self, bs: int, kv_len: int, sampler: StepSampler | None) -> tuple[torch.cuda.CUDAGraph, Any]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: compiles, lazy inits, cuBLAS workspaces happen outside the capture
                self._run(bs, kv_len, sampler)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # only this thread's calls may not disturb the capture: other threads go on meanwhile (the training thread
        # under --async-rollout; the offloaded optimizer pinning its host moments, the checkpoint writer)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._run(bs, kv_len, sampler)
        return graph, out

    def _load(self, tokens: torch.Tensor, positions: torch.Tensor, host_positions: list[int] | None) -> tuple:
        b = tokens.shape[0]
        bs = self.bucket(b)
        self.tokens[:b].copy_(tokens)
        self.positions[:b].copy_(positions)
        if bs > b:
            self.tokens[b:bs].zero_()
            self.positions[b:bs].zero_()
        hp = None
        if self.runner.attention.needs_host_positions:
            hp = list(host_positions) if host_positions is not None else positions.tolist()
            hp += [0] * (bs - b)
        return b, bs, hp

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                 host_positions: list[int] | None = None) -> torch.Tensor:
        b, bs, hp = self._load(tokens, positions, host_positions)
        graph, out = self.ensure_captured(bs, kv_len, host_positions=hp)
        graph.replay()
        return out[:b]

    def sample(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, sampler: StepSampler,
               uids: torch.Tensor, steps: torch.Tensor,
               host_positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step and its sampling in one graph replay: (tokens int64 [B], log-probs float32 [B]).

        The results are copies: the graph's output buffers are overwritten by the next replay, and a caller
        that keeps a window of steps (the scheduler stacks k of them) would otherwise see the last step k times."""
        b, bs, hp = self._load(tokens, positions, host_positions)
        self.uids[:b].copy_(uids)
        self.steps[:b].copy_(steps)
        if bs > b:
            self.uids[b:bs].zero_()
            self.steps[b:bs].zero_()
        if self._key_value != sampler.key_value:
            self.key.fill_(sampler.key_value)
            self._key_value = sampler.key_value
        graph, (tok, lp) = self.ensure_captured(bs, kv_len, sampler, host_positions=hp)
        graph.replay()
        return tok[:b].clone(), lp[:b].clone()


def graph_fingerprint(runner: ModelRunner) -> tuple:
    """Addresses a captured decode graph depends on, plus peft adapter switches read at capture time."""
    parts: list[object] = []
    for name, t in list(runner.lm.named_parameters()) + list(runner.lm.named_buffers()):
        parts.append((name, t.data_ptr(), tuple(t.shape)))
    for name, module in runner.lm.named_modules():
        # peft tuner layers expose these as properties; models expose same-named methods (skipped).
        switches = []
        for attr in ("disable_adapters", "merged", "active_adapters"):
            value = getattr(module, attr, None)
            if value is not None and not callable(value):
                switches.append((attr, tuple(value) if isinstance(value, list | tuple) else value))
        if switches:
            parts.append((name, tuple(switches)))
    if runner.plan is not None:
        parts.append(("fast_lora", runner.plan.fingerprint()))
    cache = runner.cache
    if cache is not None and cache.k is not None and cache.v is not None:
        parts.append(("kv", cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape)))
        if cache.routing is not None:  # the decode step writes the recorded routing there
            parts.append(("routing", runner.record_routing, cache.routing.buf.data_ptr()))
    return tuple(parts)
