"""The memory plan of an RL run: what each phase of a step holds on the GPU, and the settings that fit.

Made from the model's config (shapes only) BEFORE any weight is built, so a run that cannot fit is refused
with one line naming the setting to change, and made again after loading with the resident bytes measured
(the larger of estimate and measurement counts). All sizes are bytes; docs/memory.md explains every term.

Weights (:class:`WeightBytes`, :func:`weight_bytes`):
  stored          the base as loaded: the decoder linears in their format (bytes per layer from the format's
                  own quantizer on a small zero slab, so every format and group size is exact), embeddings,
                  lm_head, norms, biases; for a run directory at least its safetensors files
  kernel_derived  what qerl's CUDA kernels derive and keep per quantized linear (the FP4 block scales as
                  16-bit factors: 0.125 byte per NVFP4 weight; ``qerl_kernels.dispatch.derived_bytes``)
  extra_copies    a peer kernel's own converted copy (humming, +0.5 byte per FP4 weight, the fused q/k/v and
                  gate/up counted again), only when humming is importable; the plan allows it only if it fits

Per phase (:meth:`MemoryPlan.phase_estimates`, allocated bytes as ``torch.cuda.max_memory_allocated`` counts
them; the fit adds a reserve of 1 GiB + 5% of the capacity for the allocator and the CUDA context):
  static     weights + LoRA factors in fp32 + AdamW's moments when they stay on the GPU (8 B per parameter)
  setup      weights + LoRA factors
  aqn        static + the noisy norm weights
  rollout    static + the engine's in-dtype LoRA shadows + KV cache (one slot per sequence that fits) + its
             prefill/sampling activations (the engine's own formula at the real prefill size)
  recompute  static + the larger of one layer's no-grad intermediates at the micro-batch with one dequantized
             weight (the large-M forward and every backward dequantize one layer transiently) and the log-prob
             chunk
  fwd_bwd    static + fp32 gradients + the kept activations (all layers, or with gradient checkpointing every
             layer's input) + the kept log-prob rows + the larger of the log-prob chunk and one layer's backward
             (with checkpointing its recomputed set) with one dequantized weight
  optimizer  static + gradients + the step's temporaries (AdamW's foreach square root, or the streamed buckets
             of :class:`~qerl_cli.train.host_offload.HostOffloadAdamW`)
  checkpoint static (the snapshot goes to host memory; gradients are freed after the optimizer step)

Activation model per token and layer (bf16, LoRA on all seven projections, SDPA attention), what autograd
keeps: each RMSNorm its fp32 input (2 H values) and the bf16 output the LoRA factors read (H); SDPA q, k and v
(K/V repeated to every head under a padding mask) and its output (4 H); the o_proj input (H); gate, SiLU(gate),
up and their product (4 I). RoPE keeps nothing (its factors need no gradient), nor do the frozen quantized GEMMs.
So (11 H + 4 I) * dtype bytes, plus one layer's gradients in flight in the backward ((3 I + 2 H) * dtype); with
checkpointing only the layer input (H) is kept per layer, plus one layer's full set during its recompute. The
log-prob chunk's transient and a layer's backward do not overlap: the phase takes the larger.

Choices, the first that fits (settings given explicitly are kept):
  1. no gradient checkpointing, the largest micro-batch (<= 8) that still feeds the GEMMs >= 2048 rows; the
     peer kernel's weight copies if they fit; AdamW's moments on the GPU, else in pinned host memory;
  2. "memory short": gradient checkpointing with AdamW's moments in host memory and the smallest micro-batch
     whose rows reach 1,024 (then smaller ones), the peer's copies only if they fit. Both savers cost little
     time (one PCIe round trip of the moments per step, overlapped; a few more dequantize passes) and leave
     headroom exactly where the estimate is least certain (activations);
  3. no checkpointing with the remaining smaller micro-batches.
The KV cache takes one slot per sequence, as many as fit beside the rollout phase. When nothing fits,
:class:`MemoryPlanError` says which setting to change and to what.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from qerl_cli.device import pick as pick_device
from qerl_cli.errors import QerlError
from qerl_cli.precision import dtype_of

GIB = 2**30
MAX_DEFAULT_MICRO_BATCH = 8
MIN_GEMM_TOKENS = 2048  # below this many rows per micro-batch the base GEMMs run far under their rate
# with checkpointing the micro-batch only needs this many rows: the forward and backward GEMMs run through
# dequantize + cuBLAS from 512 rows, near its rate at 1,024, and the extra dequantize passes of more micro-batches
# cost ~0.1 s per micro-batch at 72B; every further row costs checkpointed activations
GC_MIN_ROWS = 1024
ENGINE_PREFILL_TOKENS = 8192  # the builtin engine's max_prefill_tokens
CACHE_ALIGN = 64  # the builtin engine rounds the cache length up to this
PHASES = ("setup", "aqn", "rollout", "recompute", "fwd_bwd", "optimizer", "checkpoint")
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


class MemoryPlanError(QerlError):
    """Nothing fits: the message names the setting to change."""


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int  # one MLP's (one expert's, in a mixture of experts)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # mixture of experts: experts per layer, all resident (0: a dense MLP)
    top_k: int = 0  # ... and experts per token

    @classmethod
    def from_config(cls, cfg: Any) -> ModelDims:
        from qerl_cli.moe import MoeDims

        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        moe = MoeDims.from_config(cfg)
        inter = moe.intermediate if moe is not None else int(cfg.intermediate_size)
        return cls(int(cfg.hidden_size), inter, int(cfg.num_hidden_layers), heads,
                   int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim, int(cfg.vocab_size),
                   moe.experts if moe else 0, moe.top_k if moe else 0)

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token runs through: the top-k experts' together in a mixture of experts."""
        return self.intermediate * (self.top_k or 1)

    @property
    def moe_token_extra(self) -> int:
        """Per token and sparse layer, besides the MLP's width: the k expert outputs before they are summed and the
        router's logits and fp32 probabilities (in dtype elements, counted as 3 per expert)."""
        return self.top_k * self.hidden + 3 * self.experts if self.experts else 0

    def mlp_copies(self, target: str) -> int:
        """How many of a projection each layer holds: every expert's MLP projection, one of anything else."""
        return self.experts if self.experts and target in PROJECTION_GROUPS[2] + PROJECTION_GROUPS[3] else 1

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection LoRA may target."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        if self.experts:  # peft's LoRA on the stacked experts: gate and up are one fused projection
            mlp = PROJECTION_GROUPS[2] + PROJECTION_GROUPS[3]
            attn = sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes and t not in mlp)
            gate_up = any(t in targets for t in PROJECTION_GROUPS[2])
            h, i = self.hidden, self.intermediate
            experts = self.experts * rank * ((h + 2 * i if gate_up else 0) + (i + h if "down_proj" in targets else 0))
            return self.layers * (attn + experts)
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)

    def shadow_elems(self, rank: int, targets: list[str]) -> int:
        """Elements of the rollout engine's in-dtype LoRA shadows (rollout/fast_layers.py): per projection group
        the concatenated A [sum r, in] and, the group being one fused GEMM, the block-diagonal B [sum out, sum r]."""
        shapes = self.linear_shapes()
        per_layer = 0
        if self.experts:  # the experts' copies are their factors in dtype, [E, r, K] and [E, N, r]
            per_layer = self.lora_params(rank, [t for t in targets if self.mlp_copies(t) > 1]) // self.layers
        for group in PROJECTION_GROUPS:
            if self.experts and self.mlp_copies(group[0]) > 1:
                continue
            r = rank * sum(1 for t in group if t in targets)
            if r:
                per_layer += r * shapes[group[0]][0] + r * sum(shapes[t][1] for t in group)
        return self.layers * per_layer

    def kv_bytes_per_token(self, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def act_bytes_per_token_layer(self, elem: int) -> int:
        return (11 * self.hidden + 4 * self.active_intermediate + self.moe_token_extra) * elem

    def grad_bytes_per_token_layer(self, elem: int) -> int:
        """Gradients in flight inside one layer's backward (the MLP's three [I] ones, the residual's two [H])."""
        return (3 * self.active_intermediate + 2 * self.hidden + self.moe_token_extra) * elem

    def largest_linear(self) -> int:
        return max(i * o for i, o in self.linear_shapes().values())


# ---- the weights, from the config -----------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightBytes:
    """The base model's bytes on the device (see the module docstring); ``measured`` after loading, if known."""

    stored: int
    kernel_derived: int = 0
    extra_copies: int = 0
    measured: int | None = None
    low_bit: bool = True  # decoder linears stored at <= 4.5 bits per weight (the advice differs)
    dequantizes: bool = True  # quantized linears: the large-M forward and the backward dequantize one at a time

    def resident(self, copies: bool) -> int:
        est = self.stored + self.kernel_derived + (self.extra_copies if copies else 0)
        return max(est, self.measured or 0)


def linear_bytes(fmt: str, out_features: int, in_features: int, elem: int) -> int:
    """Stored bytes of one [out, in] linear in ``fmt`` (no bias), from :func:`_row_bytes`."""
    per_row, per_layer = _row_bytes(fmt, in_features, elem)
    return int(round(per_row * out_features + per_layer))


@functools.cache
def _row_bytes(fmt: str, in_features: int, elem: int) -> tuple[float, float]:
    """(bytes per output row, bytes per layer) of a linear with ``in_features`` inputs in ``fmt``: the format's own
    quantizer on zero slabs of r and 2r rows (every tensor of every format is per row or per layer, so this is
    exact for any format and group size). r = 1, or 32 where a format needs whole blocks across rows (NF4)."""
    import torch

    from qerl_cli.formats import get_format
    from qerl_cli.precision import PRECISIONS

    spec = get_format(fmt)
    if not spec.quantized:
        return float(in_features * elem), 0.0
    dtype = next((dtype_of(p) for p in PRECISIONS if dtype_of(p).itemsize == elem), torch.bfloat16)
    for rows in (1, 32):
        try:
            b1, b2 = (spec.quantize(torch.zeros(r, in_features), dtype=dtype).nbytes() for r in (rows, 2 * rows))
        except (ValueError, RuntimeError, QerlError):
            continue
        per_row = (b2 - b1) / rows
        return per_row, b1 - rows * per_row
    raise QerlError(f"cannot size a {fmt} layer with {in_features} inputs")


def weight_bytes(model_config: Any, fmt: str, elem: int, *, kernels: bool, stored: int | None = None) -> WeightBytes:
    """The base's bytes from its config, before anything is built. ``kernels``: CUDA kernels will run it (their
    derived data and a peer's copies count); ``stored``: a lower bound known otherwise (checkpoint file sizes)."""
    from qerl_cli import kernel_dispatch
    from qerl_cli.formats import get_format

    d = ModelDims.from_config(model_config)
    bias = bool(getattr(model_config, "attention_bias", getattr(model_config, "model_type", "") == "qwen2"))
    shapes = d.linear_shapes()
    linears = derived = extra = 0
    for name, (k, n) in shapes.items():
        copies = d.mlp_copies(name)
        linears += copies * linear_bytes(fmt, n, k, elem)
        if kernels and copies == 1:  # the experts' grouped kernel reads the stored tensors as they are
            has_bias = bias and name in PROJECTION_GROUPS[0]
            derived += kernel_dispatch.derived_bytes(fmt, n, k, elem, has_bias)
            extra += kernel_dispatch.extra_copy_bytes(fmt, n, k)
    if kernels:  # the rollout's fused q/k/v and gate/up may get a peer copy of their own
        for group in (PROJECTION_GROUPS[0], PROJECTION_GROUPS[2])[:1 if d.experts else 2]:
            extra += kernel_dispatch.extra_copy_bytes(fmt, sum(shapes[t][1] for t in group), shapes[group[0]][0])
    linears += d.experts * d.hidden * elem  # the routers, kept in the model dtype
    biases = sum(shapes[t][1] for t in PROJECTION_GROUPS[0]) * elem if bias else 0
    qk_norms = getattr(model_config, "model_type", "") in ("qwen3", "qwen3_moe")
    norms = (2 * d.hidden + (2 * d.head_dim if qk_norms else 0)) * elem
    embed = d.vocab * d.hidden * elem
    head = 0 if getattr(model_config, "tie_word_embeddings", False) else embed
    rotary = d.head_dim * 4  # the rotary embedding's fp32 inv_freq and original_inv_freq buffers
    total = d.layers * (linears + biases + norms) + d.hidden * elem + embed + head + rotary
    return WeightBytes(stored=max(total, stored or 0), kernel_derived=d.layers * derived, extra_copies=d.layers * extra,
                       low_bit=get_format(fmt).bits <= 4.5, dequantizes=get_format(fmt).quantized)


# ---- the plan -------------------------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """Bytes per part, the per-phase estimates and the chosen settings; ``capacity`` None: no limit known (CPU)."""

    capacity: int | None
    reserve: int
    weights: int  # resident base (the chosen copies included)
    weight_parts: WeightBytes
    lora_params: int  # fp32 factors
    grads: int
    optimizer_state: int  # AdamW's moments on the GPU (0 when offloaded)
    optimizer_host: int  # ... in pinned host memory
    optimizer_step: int  # the step's transient
    shadows: int
    activations: int  # kept through the training forward, the chosen setting's (all layers' or the layer inputs)
    layer_backward: int  # one layer's backward (its recomputed set with checkpointing) and gradients in flight
    activations_no_gc: int  # kept + layer backward, at the chosen micro-batch, without / with checkpointing
    activations_gc: int
    recompute: int  # one layer's no-grad intermediates at the micro-batch
    logprob_chunk: int  # one chunk of lm_head rows: logits, fp32 log-softmax / softmax / entropy terms
    logprob_kept: int  # the final hidden states, the selected rows and their Jacobian
    dequant: int
    kv_cache: int
    rollout: int
    micro_batch_size: int
    gradient_checkpointing: bool
    optimizer_offload: bool
    extra_weight_copies: bool
    kv_slots: int
    gpu_memory_utilization: float | None
    sequences: int
    seq_tokens: int
    aqn: int = 0
    resident_cache: bool = True  # the KV cache stays through the update (see resident_cache_fits)
    tried: list[str] = field(default_factory=list)

    @property
    def adapters(self) -> int:
        """LoRA factors + gradients + AdamW moments wherever they live (the old single figure)."""
        return self.lora_params + self.grads + self.optimizer_state + self.optimizer_host

    @property
    def resident_cache_fits(self) -> bool:
        """Whether the builtin engine keeps its KV cache (and shadows, CUDA graphs) through the update: chosen
        by the plan when there is room and memory is not short (then every phase holds it)."""
        return self.resident_cache

    def phase_estimates(self) -> dict[str, int]:
        """Estimated peak allocated bytes per phase of a step (the names of ``qerl bench step``'s phases, plus
        ``setup``: after the trainer is built); compare with ``max_memory_allocated`` per phase."""
        cache = self.kv_cache + self.shadows if self.resident_cache and self.capacity is not None else 0
        static = self.weights + self.lora_params + self.optimizer_state
        train = static + self.grads + cache
        return {
            "setup": self.weights + self.lora_params,
            "aqn": static + cache + self.aqn,
            "rollout": static + self.shadows + self.kv_cache + self.rollout,
            "recompute": static + cache + self.logprob_kept + max(self.logprob_chunk, self.recompute + self.dequant),
            "fwd_bwd": train + self.activations + self.logprob_kept + max(self.logprob_chunk,
                                                                          self.layer_backward + self.dequant),
            "optimizer": train + self.optimizer_step,
            "checkpoint": static + cache,
        }

    @property
    def peak(self) -> int:
        """The largest phase estimate (allocated bytes, without the reserve)."""
        return max(self.phase_estimates().values())

    @property
    def train_peak(self) -> int:
        """The training side's estimate plus the reserve (what the fit compares with the capacity)."""
        e = self.phase_estimates()
        return max(e["recompute"], e["fwd_bwd"], e["optimizer"]) + self.reserve

    @property
    def rollout_peak(self) -> int:
        return self.phase_estimates()["rollout"] + self.reserve

    def fits(self) -> bool:
        return self.capacity is None or (self.kv_slots >= 1 and self.peak + self.reserve <= self.capacity)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # "peak" includes the reserve (what the fit compares with the capacity); "peak_allocated" does not
        d.update(adapters=self.adapters, train_peak=self.train_peak, rollout_peak=self.rollout_peak,
                 peak=self.peak + self.reserve, peak_allocated=self.peak, phase_estimates=self.phase_estimates())
        return d

    def lines(self) -> list[str]:
        """The plan as printed by ``qerl train --dry-run`` (GiB)."""
        def g(b: int | None) -> str:
            return "-" if b is None else f"{b / GIB:8.2f}"

        w = self.weight_parts
        cap = "no limit known (CPU)" if self.capacity is None else f"{self.capacity / GIB:.2f} GiB"
        opt = "in pinned host memory" if self.optimizer_offload else "on the GPU"
        est = self.phase_estimates()
        out = [
            f"memory plan ({self.sequences} sequences x {self.seq_tokens} tokens; GPU memory {cap})",
            f"  weights                         {g(self.weights)} GiB  (stored {w.stored / GIB:.2f}, kernel layouts "
            f"{w.kernel_derived / GIB:.2f}, peer copies {(w.extra_copies if self.extra_weight_copies else 0) / GIB:.2f}"
            f"{'' if w.measured is None else f', measured {w.measured / GIB:.2f}'})",
            f"  LoRA factors (fp32)             {g(self.lora_params)} GiB",
            f"  gradients (fp32)                {g(self.grads)} GiB",
            f"  AdamW moments                   {g(self.optimizer_state + self.optimizer_host)} GiB  ({opt})",
            f"  activations, no grad ckpt       {g(self.activations_no_gc)} GiB  (micro-batch {self.micro_batch_size})",
            f"  activations, grad ckpt          {g(self.activations_gc)} GiB  (micro-batch {self.micro_batch_size})",
            f"  logprob chunk + kept rows       {g(self.logprob_chunk + self.logprob_kept)} GiB",
            f"  kv cache                        {g(self.kv_cache)} GiB  ({self.kv_slots} slots)",
            f"  rollout activations + shadows   {g(self.rollout + self.shadows)} GiB",
            f"  reserve                         {g(self.reserve)} GiB",
            "  peak per phase (GiB): " + ", ".join(f"{p} {b / GIB:.1f}" for p, b in est.items()),
            f"  chosen: micro_batch_size {self.micro_batch_size}, gradient_checkpointing "
            f"{str(self.gradient_checkpointing).lower()}, optimizer_offload {str(self.optimizer_offload).lower()}, "
            f"kernel_weight_copies {str(self.extra_weight_copies).lower()}, keep_rollout_cache "
            f"{str(self.resident_cache).lower()}, gpu_memory_utilization "
            f"{'-' if self.gpu_memory_utilization is None else f'{self.gpu_memory_utilization:.3f}'}",
        ]
        return out


def _activations(dims: ModelDims, elem: int, tokens: int, gc: bool) -> tuple[int, int]:
    """(kept through the forward, one layer's backward on top) for ``tokens`` rows."""
    per_layer = dims.act_bytes_per_token_layer(elem)
    if gc:  # every layer's input; in the backward one layer's recomputed set (+ its gradient in flight)
        return tokens * dims.layers * dims.hidden * elem, tokens * (per_layer + 2 * dims.hidden * elem)
    return tokens * dims.layers * per_layer, tokens * dims.grad_bytes_per_token_layer(elem)


def _recompute(dims: ModelDims, elem: int, tokens: int) -> int:
    """No-grad forward of one micro-batch: one layer's live intermediates (the MLP's gate/up/SiLU/product with
    a LoRA sum in flight, the residual stream, the norms' fp32 copies)."""
    return tokens * (4 * dims.active_intermediate + 10 * dims.hidden + dims.moe_token_extra) * elem


def _logprobs(dims: ModelDims, elem: int, tokens: int, completion_tokens: int, chunk: int) -> tuple[int, int]:
    """(one chunk's transient, what stays through it): the chunk's logits in dtype and z, the log-softmax, the
    entropy terms / Jacobian factor in fp32; the micro-batch's final hidden states, the selected rows and their
    Jacobian."""
    chunk = completion_tokens if chunk <= 0 else min(chunk, completion_tokens)
    return chunk * dims.vocab * (elem + 16), (tokens + 2 * completion_tokens) * dims.hidden * elem


def rollout_reserve(dims: ModelDims, elem: int, slots: int, prefill_tokens: int = ENGINE_PREFILL_TOKENS) -> int:
    """The builtin engine's activation reserve for ``slots`` sequences, in bytes (its own formula)."""
    from qerl_cli.rollout.kv_cache import activation_reserve

    return activation_reserve(hidden=dims.hidden, intermediate=dims.active_intermediate, heads=dims.heads,
                              kv_heads=dims.kv_heads, head_dim=dims.head_dim, layers=dims.layers, vocab=dims.vocab,
                              elem=elem, prefill_tokens=prefill_tokens, slots=slots)


def plan_memory(dims: ModelDims, *, weights: int | WeightBytes, capacity: int | None, device_total: int | None,
                elem: int, sequences: int, prompt_tokens: int, completion_tokens: int, lora_rank: int,
                lora_targets: list[str], micro_batch_size: int | None = None,
                gradient_checkpointing: bool | None = None, logprob_chunk: int = 512,
                gpu_memory_utilization: float | None = None, optimizer_offload: bool | None = None,
                extra_weight_copies: bool | None = None, prompts: int | None = None,
                keep_rollout_cache: bool | None = None, advise: bool = True) -> MemoryPlan:
    """Choose micro-batch, gradient checkpointing, where AdamW's moments live and whether kernels may keep a
    second weight copy, so the step fits ``capacity`` bytes (module docstring).

    Raises :class:`MemoryPlanError` when nothing fits (with the one-line advice unless ``advise`` is False).
    """
    from qerl_cli.train.host_offload import DEFAULT_BUCKET_BYTES

    wb = weights if isinstance(weights, WeightBytes) else WeightBytes(stored=int(weights))
    seq_tokens = prompt_tokens + completion_tokens
    n_lora = dims.lora_params(lora_rank, lora_targets)
    reserve = (GIB + capacity // 20) if capacity is not None else 0
    cache_len = -(-(seq_tokens + 1) // CACHE_ALIGN) * CACHE_ALIGN
    per_slot = cache_len * dims.kv_bytes_per_token(elem)
    prefill = min(ENGINE_PREFILL_TOKENS, max(prompt_tokens, (prompts or sequences) * prompt_tokens))
    mb_max = min(micro_batch_size or MAX_DEFAULT_MICRO_BATCH, sequences)
    sizes = sorted({max(1, mb_max >> k) for k in range(mb_max.bit_length() + 1)}, reverse=True)
    if micro_batch_size is not None:
        sizes = [mb_max]
    big = [m for m in sizes if m * seq_tokens >= MIN_GEMM_TOKENS or m == sizes[0]]
    # memory short: the smallest micro-batch that still feeds the GEMMs, then smaller ones
    gc_first = min([m for m in sizes if m * seq_tokens >= GC_MIN_ROWS] or sizes[:1])
    gc_sizes = [m for m in sizes if m <= gc_first]
    copies_opts = [extra_weight_copies] if extra_weight_copies is not None else \
        ([True, False] if wb.extra_copies > 0 else [False])
    free_offload = [optimizer_offload] if optimizer_offload is not None else [False, True]
    short_offload = optimizer_offload if optimizer_offload is not None else True
    order: list[tuple[bool, int, bool, bool]] = []
    if gradient_checkpointing is not True:
        order += [(False, m, c, o) for m in big for c in copies_opts for o in free_offload]
    if gradient_checkpointing is not False:
        order += [(True, m, c, short_offload) for m in gc_sizes for c in copies_opts]
    if gradient_checkpointing is not True:
        order += [(False, m, c, short_offload) for m in sizes if m not in big for c in copies_opts]

    def build(gc: bool, mb: int, copies: bool, offload: bool, slots: int | None) -> MemoryPlan:
        tokens = mb * seq_tokens
        util = gpu_memory_utilization
        if util is None and capacity is not None and device_total:
            util = min(1.0, capacity / device_total)
        moments = 8 * n_lora
        kept, backward = _activations(dims, elem, tokens, gc)
        chunk, lp_kept = _logprobs(dims, elem, tokens, mb * completion_tokens, logprob_chunk)
        p = MemoryPlan(
            capacity=capacity, reserve=reserve, weights=wb.resident(copies), weight_parts=wb,
            lora_params=4 * n_lora, grads=4 * n_lora, optimizer_state=0 if offload else moments,
            optimizer_host=moments if offload else 0,
            # offloaded: the moments of <= 3 buckets on the GPU + AdamW's square root of one; else the foreach root
            optimizer_step=min(7 * DEFAULT_BUCKET_BYTES, 2 * moments) if offload else 4 * n_lora,
            shadows=dims.shadow_elems(lora_rank, lora_targets) * elem,
            activations=kept, layer_backward=backward,
            activations_no_gc=sum(_activations(dims, elem, tokens, False)),
            activations_gc=sum(_activations(dims, elem, tokens, True)),
            recompute=_recompute(dims, elem, tokens), logprob_chunk=chunk, logprob_kept=lp_kept,
            dequant=dims.largest_linear() * elem if wb.dequantizes else 0,
            kv_cache=0, rollout=0, micro_batch_size=mb, gradient_checkpointing=gc, optimizer_offload=offload,
            extra_weight_copies=copies, kv_slots=0, gpu_memory_utilization=util, sequences=sequences,
            seq_tokens=seq_tokens, aqn=2 * (2 * dims.layers + 1) * dims.hidden * elem)
        if slots is None:  # as many slots as fit beside the rollout phase, one per sequence at most
            p.rollout = rollout_reserve(dims, elem, sequences, prefill)
            room = capacity - reserve - p.phase_estimates()["rollout"]
            slots = max(0, min(sequences, room // per_slot if per_slot else sequences))
        p.kv_slots = slots
        p.kv_cache = slots * per_slot
        p.rollout = rollout_reserve(dims, elem, max(1, slots), prefill)
        if keep_rollout_cache is not None or capacity is None:
            p.resident_cache = keep_rollout_cache is not False
        else:  # kept between steps when there is room for it in every phase, and memory is not short
            p.resident_cache = not gc
            p.resident_cache = p.resident_cache and p.fits()
        return p

    if capacity is None:  # CPU: nothing to fit; the defaults as they always were
        gc, mb = bool(gradient_checkpointing), sizes[0]
        copies = extra_weight_copies if extra_weight_copies is not None else wb.extra_copies > 0
        return build(gc, mb, copies, bool(optimizer_offload), sequences)
    tried = []
    p = None
    for gc, mb, copies, offload in order:
        p = build(gc, mb, copies, offload, None)
        tried.append(f"gc={str(gc).lower()} mb={mb} copies={str(copies).lower()} offload={str(offload).lower()}: "
                     f"{(p.peak + p.reserve) / GIB:.1f} GiB")
        if p.fits():
            p.tried = tried
            return p
    assert p is not None
    if not advise:
        raise MemoryPlanError("memory plan: nothing fits")
    kw = dict(weights=wb, elem=elem, sequences=sequences, prompt_tokens=prompt_tokens,
              completion_tokens=completion_tokens, lora_rank=lora_rank, lora_targets=lora_targets,
              logprob_chunk=logprob_chunk, prompts=prompts, keep_rollout_cache=False if keep_rollout_cache is False
              else None)
    raise MemoryPlanError(_advice(dims, capacity=capacity, fixed_mb=micro_batch_size, fixed_gc=gradient_checkpointing,
                                  fixed_offload=optimizer_offload, fixed_copies=extra_weight_copies, last=p, kw=kw))


def _fits(dims: ModelDims, **kw: Any) -> MemoryPlan | None:
    try:
        return plan_memory(dims, device_total=None, advise=False, **kw)
    except MemoryPlanError:
        return None


def min_capacity(dims: ModelDims, **kw: Any) -> int | None:
    """The smallest GPU memory (bytes, to 0.05 GiB) in which the plan's own choices fit; None: not even 4 TiB."""
    lo, hi = 0, 4096 * GIB
    if _fits(dims, capacity=hi, **kw) is None:
        return None
    step = GIB // 20
    while hi - lo > step:
        mid = (lo + hi) // 2
        if _fits(dims, capacity=mid, **kw) is not None:
            hi = mid
        else:
            lo = mid
    return hi


def _advice(dims: ModelDims, *, capacity: int, fixed_mb: int | None, fixed_gc: bool | None,
            fixed_offload: bool | None, fixed_copies: bool | None, last: MemoryPlan, kw: dict[str, Any]) -> str:
    """One line: what does not fit and the nearest setting that would."""
    cap = capacity / GIB
    need = f"needs {(last.peak + last.reserve) / GIB:.1f} GiB of {cap:.1f} GiB (weights {last.weights / GIB:.1f}, " \
           f"adapters + optimizer {last.adapters / GIB:.1f}, activations {last.activations / GIB:.1f}, kv cache " \
           f"{last.kv_cache / GIB:.1f}, reserve {last.reserve / GIB:.1f})"
    if any(v is not None for v in (fixed_mb, fixed_gc, fixed_offload, fixed_copies)):
        p = _fits(dims, capacity=capacity, **kw)  # would the planner's own choice fit?
        if p is not None:
            return (f"memory plan: micro_batch_size {fixed_mb or '-'} / gradient_checkpointing "
                    f"{fixed_gc if fixed_gc is not None else '-'} / optimizer_offload "
                    f"{fixed_offload if fixed_offload is not None else '-'} {need}: use --micro-batch-size "
                    f"{p.micro_batch_size}{' --gradient-checkpointing' if p.gradient_checkpointing else ''}"
                    f"{' --optimizer-offload' if p.optimizer_offload else ''} (or leave them unset and the plan "
                    "chooses)")
    smallest = min_capacity(dims, **kw)
    gpu = (f"raise --gpu-memory-gib (qerl bench step: --memory-cap) to at least {smallest / GIB:.1f} or use a larger "
           "GPU") if smallest is not None else "use a larger GPU"
    wb: WeightBytes = kw["weights"]
    base = wb.resident(False) + last.lora_params + last.reserve
    if base >= capacity:
        quant = "" if wb.low_bit else "quantize the base to 4 bits (qerl quantize --format nvfp4), "
        return (f"memory plan: the weights and adapter state alone need {base / GIB:.1f} GiB of {cap:.1f} GiB: "
                f"{quant}{gpu}, or lower --lora-rank (weights {wb.resident(False) / GIB:.1f}, LoRA factors "
                f"{last.lora_params / GIB:.1f}, reserve {last.reserve / GIB:.1f} GiB)")
    lo, hi = 0, kw["completion_tokens"]  # the largest completion length that fits (0: none)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid >= 1 and _fits(dims, capacity=capacity, **{**kw, "completion_tokens": mid}) is not None:
            lo = mid
        else:
            hi = mid - 1
    if lo >= 1:
        return (f"memory plan: {kw['sequences']} sequences of {kw['prompt_tokens']} + {kw['completion_tokens']} "
                f"tokens {need}: lower --max-completion-length to {lo} (or --max-prompt-length / the batch), or "
                f"{gpu}")
    return (f"memory plan: even gradient checkpointing with micro-batch 1 {need}: shorten the prompts "
            f"(--max-prompt-length) or {gpu}")


def gib(x: float | None) -> int | None:
    return None if x is None else int(math.floor(x * GIB))


# ---- the trainer's, the benches' and `qerl train --dry-run`'s entry points -------------------------------
def device_capacity(device: Any, cap_gib: float | None) -> tuple[int | None, int | None]:
    """(capacity, device total) in bytes: the cap when given, else the whole device; (None, None) off CUDA
    without a cap. A cap off CUDA plans for a GPU of that size (``--dry-run``, tests) and enforces nothing."""
    import torch

    if torch.device(device).type != "cuda":
        return (gib(cap_gib), gib(cap_gib)) if cap_gib is not None else (None, None)
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return (min(total, gib(cap_gib)) if cap_gib is not None else total), total


def plans_for_gpu(device: Any, cap_gib: float | None) -> bool:
    """Whether the plan counts the CUDA kernels' data: on a GPU, or planning for one (a cap given off CUDA)."""
    import torch

    return torch.device(device).type == "cuda" or cap_gib is not None


def module_bytes(model: Any) -> int:
    seen: set[int] = set()
    n = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def plan_for_config(cfg: Any, model_config: Any, *, weights: int | WeightBytes, device: Any, prompt_tokens: int,
                    elem: int, extra_weight_copies: bool | None = None) -> MemoryPlan:
    """The plan for a resolved TrainConfig on ``device``; modes the plan does not model keep their settings.
    ``extra_weight_copies`` fixes that decision (taken before the weights were built)."""
    capacity, total = device_capacity(device, cfg.gpu_memory_gib)
    if cfg.finetune != "lora" or cfg.rollout_quant != "none":
        capacity = None  # full fine-tuning / a second quantized copy: not modelled, settings as given
    copies = cfg.kernel_weight_copies if cfg.kernel_weight_copies is not None else extra_weight_copies
    return plan_memory(
        ModelDims.from_config(model_config), weights=weights, capacity=capacity, device_total=total, elem=elem,
        sequences=cfg.batch_prompts * cfg.num_generations, prompt_tokens=prompt_tokens,
        completion_tokens=cfg.max_completion_length, lora_rank=cfg.lora_rank, lora_targets=list(cfg.lora_targets),
        micro_batch_size=cfg.micro_batch_size, gradient_checkpointing=cfg.gradient_checkpointing,
        logprob_chunk=cfg.logprob_chunk_tokens, gpu_memory_utilization=cfg.gpu_memory_utilization,
        optimizer_offload=cfg.optimizer_offload, extra_weight_copies=copies, prompts=cfg.batch_prompts,
        keep_rollout_cache=cfg.keep_rollout_cache if cfg.rollout_engine == "builtin" else False)


def plan_before_build(cfg: Any, model_config: Any, fmt: str, *, device: Any, prompt_tokens: int,
                      stored: int | None = None) -> MemoryPlan:
    """The plan from the model's config and format alone (nothing built yet): raises MemoryPlanError when the
    run cannot fit. ``stored``: the checkpoint's file sizes, when there is one."""
    c = cfg.resolved() if hasattr(cfg, "resolved") else cfg
    elem = dtype_of(c.precision).itemsize
    wb = weight_bytes(model_config, fmt, elem, kernels=plans_for_gpu(device, c.gpu_memory_gib), stored=stored)
    return plan_for_config(c, model_config, weights=wb, device=device, prompt_tokens=prompt_tokens, elem=elem)


def model_dir_format(model_dir: Any) -> str:
    """The weight format of a model directory written by `qerl quantize` (its config's quantization_config)."""
    import json
    from pathlib import Path

    from qerl_cli.formats import FORMATS, detect

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if not config.get("quantization_config"):
        return next((name for name, f in FORMATS.items() if not f.quantized), "bf16")
    return detect(config)[0].name


def stored_bytes(model_dir: Any) -> int:
    """The sizes of a model directory's safetensors files (a lower bound of the loaded weights)."""
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def dry_run_lines(run_dir: Any, cfg: Any) -> list[str]:
    """`qerl train --dry-run`: the plan for the run's model on this machine's GPU (or the CPU)."""
    from pathlib import Path

    from transformers import AutoConfig

    from qerl_cli.manifest import RunDir
    from qerl_cli.runlayout import quantized_model_dir

    try:
        run = RunDir(run_dir, create=False)
        model_dir = Path(quantized_model_dir(run))
        model_config = AutoConfig.from_pretrained(str(model_dir))
        fmt = model_dir_format(model_dir)
    except (QerlError, OSError, ValueError) as exc:
        return [f"memory plan: not available ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"]
    c = cfg.resolved()
    try:
        plan = plan_before_build(c, model_config, fmt, device=pick_device().type, prompt_tokens=c.max_prompt_length,
                                 stored=stored_bytes(model_dir))
    except MemoryPlanError as exc:
        return [str(exc)]
    return [*plan.lines(), f"  (weights from the config and the checkpoint files; prompts counted at "
                           f"--max-prompt-length {c.max_prompt_length} tokens, the bound; the trainer plans again "
                           "with the real ones and the measured weights)"]


__all__ = ["GIB", "PHASES", "MemoryPlan", "MemoryPlanError", "ModelDims", "WeightBytes", "device_capacity",
           "dry_run_lines", "linear_bytes", "min_capacity", "model_dir_format", "plan_before_build",
           "plan_for_config", "plan_memory", "rollout_reserve", "stored_bytes", "weight_bytes"]
