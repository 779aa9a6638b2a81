"""The memory plan of an RL run: what each phase of a step holds on the GPU, and the fastest settings that fit.

Made from the model's config (shapes only) BEFORE any weight is built, so a run that cannot fit is refused
with one line naming the setting to change, and made again after loading with the resident bytes measured.
All sizes are bytes; docs/memory.md explains every term. The plan's choices come back as
:class:`ResolvedSettings` (:func:`resolve_settings`); the TrainConfig that asked is left as it was.

Weights (:class:`WeightBytes`, :func:`weight_bytes`):
  stored          the base as loaded: the decoder linears in their format (bytes per layer from the format's
                  own quantizer on a small zero slab, so every format and group size is exact), embeddings,
                  lm_head, norms, biases; for a run directory at least its safetensors files
  kernel_derived  what qerl's CUDA kernels derive and keep per quantized linear (the FP4 block scales as
                  16-bit factors: 0.125 byte per NVFP4 weight; ``qerl_kernels.dispatch.derived_bytes``)
  extra_copies    a peer kernel's own converted copy (humming, +0.5 byte per FP4 weight, the fused q/k/v and
                  gate/up counted again, and every routed expert of a mixture of experts: humming's MoE GEMM),
                  only when humming is importable
  measured        after loading (a 1-token forward): counts where larger; measured below stored + kernel_derived,
                  the kernels had not built their layouts yet (the large-M path builds them), so they come on top
  dequantized     on the CPU (no kernels): the dequantized copy in the compute dtype every quantized linear keeps
                  from its first forward on (``QuantLinear.cache_dequantized``), which the measurement at load
                  time cannot see yet

Per phase (:meth:`MemoryPlan.phase_estimates`, allocated bytes as ``torch.cuda.max_memory_allocated`` counts
them):
  static     weights + LoRA factors in fp32 + AdamW's moments when they stay on the GPU (8 B per parameter)
  setup      weights + LoRA factors
  aqn        static + the noisy norm weights
  rollout    static + the engine's in-dtype LoRA shadows + KV cache (its slots) + its prefill/sampling
             activations (the engine's own formula at the real prefill size)
  recompute  static + the larger of one layer's no-grad intermediates at the micro-batch with one dequantized
             weight (the large-M forward and every backward dequantize one layer transiently) and the log-prob
             chunk
  fwd_bwd    static + fp32 gradients + the kept activations (all layers, or with gradient checkpointing every
             layer's input) + the kept log-prob rows + the larger of the log-prob chunk and one layer's backward
             (with checkpointing its recomputed set) with one dequantized weight
  optimizer  static + gradients + the step's temporaries (AdamW's foreach square root, or the streamed buckets
             of :class:`~qerl_cli.train.host_offload.HostOffloadAdamW`)
  checkpoint static (the snapshot goes to host memory; gradients are freed after the optimizer step)
A resident rollout cache (KV cache + shadows) is held in every phase. The fit adds a reserve: 1 GiB (the CUDA
context, library workspaces) + 5% of the capacity + ``FRAGMENTATION_SHARE`` of the bytes the update or the
recompute allocates and frees (:attr:`MemoryPlan.transient`): the allocator's fragmentation grows with them.

Activation model per token and layer (LoRA on all seven projections, SDPA attention), what autograd keeps:
each RMSNorm its fp32 input (2 H values) and the output the LoRA factors read (H); SDPA q, k and v (K/V repeated
to every head under a padding mask) and its output (4 H); the o_proj input (H); gate, SiLU(gate), up and their
product (4 I). RoPE keeps nothing (its factors need no gradient), nor do the frozen GEMMs. So (11 H + 4 I) *
dtype bytes, plus one layer's gradients in flight in the backward ((3 I + 2 H) * dtype); with checkpointing only
the layer input (H) is kept per layer, plus one layer's full set during its recompute. An unquantized base runs
peft's own LoRA layer, which casts each adapted projection's input to the fp32 adapters' dtype: autograd keeps
those casts (q, k and v one each) instead of the shared input (``ModelDims.fp32_input_bytes_per_token_layer``,
+45% at 7B). The log-prob chunk's transient and a layer's backward do not overlap: the phase takes the larger.

Choice (:func:`plan_memory`): every setting is built and estimated: micro-batch 1, 2, 4, ... up to the sequences
per step (and the sequences themselves), with and without gradient checkpointing, the peer kernel's weight copies
on and off (where there are any), AdamW's moments on the GPU or in host memory, a resident rollout cache or not;
the KV cache gets as many slots as fit (one per sequence at most; a resident cache must also fit beside every
other phase, and fewer slots decode in waves). Settings given explicitly stay fixed. Of the settings that fit,
the one the step's cost model (train/step_cost.py) estimates fastest wins; settings within ``NEAR_TIE`` of it
count as equally fast and the one needing least memory wins among them. The plan records its per-phase time
estimate, why, and the runner-ups. When nothing fits, :class:`MemoryPlanError` says which setting to change
and to what.

Per role (``role``, train/phases.py): one process running the whole step plans "both", as above. Under
--rollout-gpus (train/disagg.py) a trainer rank plans "train": no KV cache, shadows or engine activations (its
engine never runs, and the builtin engine allocates them only at its first ``generate``), so that room goes to
the micro-batch and checkpointing choice, timed by the update's phases. A rollout rank plans "rollout": no
gradients, AdamW moments or training activations, so the room goes to KV slots (for one chunk of prompts, all it
decodes at once), timed by the AQN draw and the rollout.
"""


from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from qerl_cli.device import pick as pick_device
from qerl_cli.errors import QerlError
from qerl_cli.precision import dtype_of
from qerl_cli.rollout.kv_cache import kv_elem
from qerl_cli.train.model_dims import ModelDims
from qerl_cli.train.phases import (
    AQN,
    CHECKPOINT,
    FWD_BWD,
    OPTIMIZER,
    PLANNED_MEMORY,
    RECOMPUTE,
    ROLE_BOTH,
    ROLE_MEMORY,
    ROLE_ROLLOUT,
    ROLE_TRAIN,
    ROLLOUT,
    SETUP,
    check_role,
)
from qerl_cli.train.step_cost import Base, DeviceRates, Setting, Workload, default_rates, estimate_step

GIB = 2**30
MAX_DEFAULT_MICRO_BATCH = 8  # without a GPU to fit (CPU) the micro-batch is min(this, the sequences)
NEAR_TIE = 0.03  # settings estimated within this share of the fastest count as equally fast: the smallest wins
RUNNER_UPS = 5  # the plan records this many of the next fastest settings that fit
# the allocator's fragmentation, as a share of the bytes a step allocates and frees beyond what stays resident
# (activations, log-prob chunks, dequantized weights, the prefill): packed micro-batches differ in length, so
# their activations come in new sizes every micro-batch
FRAGMENTATION_SHARE = 0.10
ENGINE_PREFILL_TOKENS = 8192  # the builtin engine's max_prefill_tokens
CACHE_ALIGN = 64  # the builtin engine rounds the cache length up to this
PHASES = PLANNED_MEMORY  # the phases it estimates a peak for, in order (train/phases.py)


class MemoryPlanError(QerlError):
    """Nothing fits: the message names the setting to change."""


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
    linear: int = 0  # of ``stored``: the decoder linears (what every forward reads); 0: not known
    dequantized: int = 0  # CPU: the quantized linears' dequantized copies (kept after their first forward)

    def resident(self, copies: bool) -> int:
        est = self.stored + self.kernel_derived + self.dequantized + (self.extra_copies if copies else 0)
        if self.measured is None:
            return est
        # measured below the stored tensors + the kernels' layouts: the layouts were not built yet (the large-M
        # path builds them) and come on top of what was measured; so do the CPU's dequantized copies
        later = self.kernel_derived if self.measured < self.stored + self.kernel_derived else 0
        return max(est, self.measured + later + self.dequantized)


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


def weight_bytes(model_config: Any, fmt: str, elem: int, *, kernels: bool, stored: int | None = None,
                 cpu: bool = False) -> WeightBytes:
    """The base's bytes from its config, before anything is built. ``kernels``: CUDA kernels will run it (their
    derived data and a peer's copies count); ``stored``: a lower bound known otherwise (checkpoint file sizes);
    ``cpu``: it runs on the CPU, where every quantized linear keeps a dequantized copy."""
    from qerl_cli import kernel_dispatch
    from qerl_cli.formats import get_format

    spec = get_format(fmt)
    d = ModelDims.from_config(model_config)
    shapes = d.linear_shapes()
    qkv = d.projections.qkv
    linears = derived = extra = dense = 0
    for name, (k, n) in shapes.items():
        copies = d.mlp_copies(name)
        linears += copies * linear_bytes(fmt, n, k, elem)
        dense += copies * n * k * elem
        if kernels and copies == 1:  # the experts' grouped kernel reads the stored tensors as they are
            has_bias = d.qkv_bias and name in qkv
            derived += kernel_dispatch.derived_bytes(fmt, n, k, elem, has_bias)
            extra += kernel_dispatch.extra_copy_bytes(fmt, n, k)
        elif kernels:  # the routed experts: humming's MoE GEMM converts every expert when the rollout may pick it
            extra += copies * kernel_dispatch.extra_copy_bytes(fmt, n, k)
    if kernels:  # the rollout's fused q/k/v and gate/up may get a peer copy of their own
        for group in d.projections.fused[:1 if d.experts else 2]:
            extra += kernel_dispatch.extra_copy_bytes(fmt, sum(shapes[t][1] for t in group), shapes[group[0]][0])
    linears += d.experts * d.hidden * elem  # the routers, kept in the model dtype
    biases = sum(shapes[t][1] for t in qkv) * elem if d.qkv_bias else 0
    norms = (2 * d.hidden + (2 * d.head_dim if d.qk_norm else 0)) * elem
    embed = d.vocab * d.hidden * elem
    head = 0 if getattr(model_config, "tie_word_embeddings", False) else embed
    rotary = d.head_dim * 4  # the rotary embedding's fp32 inv_freq and original_inv_freq buffers
    total = d.layers * (linears + biases + norms) + d.hidden * elem + embed + head + rotary
    return WeightBytes(stored=max(total, stored or 0), kernel_derived=d.layers * derived, extra_copies=d.layers * extra,
                       low_bit=spec.bits <= 4.5, dequantizes=spec.quantized,
                       linear=d.layers * linears, dequantized=d.layers * dense if cpu and spec.quantized else 0)


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
    estimate: dict[str, float] | None = None  # seconds per phase of a step (train/step_cost.py); None: no GPU
    rates: dict[str, Any] | None = None  # the device rates the estimate used
    reason: str = ""  # why this setting (the choice rule's words)
    candidates: list[dict[str, Any]] = field(default_factory=list)  # runner-ups: the fastest that fit, then not
    considered: int = 0  # settings estimated, and how many of them fit
    fitting: int = 0
    device: str = "cuda"  # where the step runs: "cpu" plans host memory (nothing to fit, no time model)
    # a mixture of experts' recorded routing (routing replay): the batch's [B, L, layers, k] int16 ids on the device
    # through the update, and one micro-batch's int64 copy that replay_routing makes for its forward and backward
    routing_batch: int = 0
    routing_micro: int = 0
    # whose plan (train/phases.py's roles): "both" runs the whole step; under --rollout-gpus a trainer rank ("train")
    # holds no KV cache and a rollout rank ("rollout") no optimizer, gradients or activations
    role: str = ROLE_BOTH
    # the physical device's bytes when ``capacity`` is a cap below them (--gpu-memory-gib), else None: engines take
    # their shares as fractions of the physical device (vLLM's gpu_memory_utilization, the KV budget)
    device_total: int | None = None

    @property
    def est_step_s(self) -> float | None:
        return None if self.estimate is None else sum(self.estimate.values())

    def setting(self) -> dict[str, Any]:
        """The settings this plan stands for (what the candidates' lists show)."""
        return {"micro_batch_size": self.micro_batch_size, "gradient_checkpointing": self.gradient_checkpointing,
                "kernel_weight_copies": self.extra_weight_copies, "optimizer_offload": self.optimizer_offload,
                "kv_slots": self.kv_slots, "keep_rollout_cache": self.resident_cache}

    @property
    def adapters(self) -> int:
        """LoRA factors + gradients + AdamW moments wherever they live (the old single figure)."""
        return self.lora_params + self.grads + self.optimizer_state + self.optimizer_host

    @property
    def transient(self) -> int:
        """What the update or the recompute allocates and frees beyond what stays resident (their activations, the
        log-prob chunk or a layer's backward, a dequantized weight): the reserve's fragmentation share grows with it."""
        train = self.activations + self.logprob_kept + max(self.logprob_chunk, self.layer_backward + self.dequant)
        return max(train, self.logprob_kept + max(self.logprob_chunk, self.recompute + self.dequant))

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
        train = static + self.grads + cache + self.routing_batch + self.routing_micro
        return {
            SETUP: self.weights + self.lora_params,
            AQN: static + cache + self.aqn,
            ROLLOUT: static + self.shadows + self.kv_cache + self.rollout,
            RECOMPUTE: static + cache + self.routing_batch + self.routing_micro + self.logprob_kept + max(
                self.logprob_chunk, self.recompute + self.dequant),
            FWD_BWD: train + self.activations + self.logprob_kept + max(self.logprob_chunk,
                                                                        self.layer_backward + self.dequant),
            OPTIMIZER: train - self.routing_micro + self.optimizer_step,
            CHECKPOINT: static + cache,
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
        # a trainer rank's engine never decodes: it needs no KV slot
        slots = self.kv_slots >= 1 or self.role == ROLE_TRAIN
        return self.capacity is None or (slots and self.peak + self.reserve <= self.capacity)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # "peak" includes the reserve (what the fit compares with the capacity); "peak_allocated" does not
        d.update(adapters=self.adapters, train_peak=self.train_peak, rollout_peak=self.rollout_peak,
                 peak=self.peak + self.reserve, peak_allocated=self.peak, phase_estimates=self.phase_estimates(),
                 est_step_s=self.est_step_s)
        return d

    def lines(self) -> list[str]:
        """The plan as printed by ``qerl train --dry-run`` (GiB)."""
        def g(b: int | None) -> str:
            return "-" if b is None else f"{b / GIB:8.2f}"

        w = self.weight_parts
        cpu = self.device == "cpu"
        cap = "no limit known" if self.capacity is None else f"{self.capacity / GIB:.2f} GiB"
        where = "host memory (CPU run; not capped)" if cpu else f"GPU memory {cap}"
        opt = "in host memory" if cpu else "in pinned host memory" if self.optimizer_offload else "on the GPU"
        parts = (f"stored {w.stored / GIB:.2f}, dequantized copies {w.dequantized / GIB:.2f}" if cpu else
                 f"stored {w.stored / GIB:.2f}, kernel layouts {w.kernel_derived / GIB:.2f}, peer copies "
                 f"{(w.extra_copies if self.extra_weight_copies else 0) / GIB:.2f}")
        est = self.phase_estimates()
        train, rollout = self.role != ROLE_ROLLOUT, self.role != ROLE_TRAIN
        head = {ROLE_BOTH: "memory plan", ROLE_TRAIN: "memory plan of a trainer rank",
                ROLE_ROLLOUT: "memory plan of a rollout rank"}[self.role]
        out = [
            f"{head} ({self.sequences} sequences x {self.seq_tokens} tokens; {where})",
            f"  weights                         {g(self.weights)} GiB  ({parts}"
            f"{'' if w.measured is None else f', measured {w.measured / GIB:.2f}'})",
            f"  LoRA factors (fp32)             {g(self.lora_params)} GiB",
        ]
        if train:
            out += [
                f"  gradients (fp32)                {g(self.grads)} GiB",
                f"  AdamW moments                   {g(self.optimizer_state + self.optimizer_host)} GiB  ({opt})",
                f"  activations, no grad ckpt       {g(self.activations_no_gc)} GiB  (micro-batch "
                f"{self.micro_batch_size})",
                f"  activations, grad ckpt          {g(self.activations_gc)} GiB  (micro-batch "
                f"{self.micro_batch_size})",
                f"  logprob chunk + kept rows       {g(self.logprob_chunk + self.logprob_kept)} GiB",
            ]
        else:
            out.append("  gradients, AdamW, activations   none (a rollout rank never runs the update)")
        if rollout:
            out += [
                f"  kv cache                        {g(self.kv_cache)} GiB  ({self.kv_slots} slots)",
                f"  rollout activations + shadows   {g(self.rollout + self.shadows)} GiB",
            ]
        else:
            out.append("  kv cache, rollout, shadows      none (a trainer rank's engine never runs)")
        util = '-' if self.gpu_memory_utilization is None else f'{self.gpu_memory_utilization:.3f}'
        # the settings this role acts on: the update's where it trains, the engine's where it decodes
        chosen = [f"micro_batch_size {self.micro_batch_size}, gradient_checkpointing "
                  f"{str(self.gradient_checkpointing).lower()}, optimizer_offload "
                  f"{str(self.optimizer_offload).lower()}" if train else f"kv_slots {self.kv_slots}",
                  f"kernel_weight_copies {str(self.extra_weight_copies).lower()}"]
        if rollout:
            chosen.append(f"keep_rollout_cache {str(self.resident_cache).lower()}, gpu_memory_utilization {util}")
        out += [
            f"  reserve                         {g(self.reserve)} GiB",
            "  peak per phase (GiB): " + ", ".join(f"{p} {est[p] / GIB:.1f}" for p in ROLE_MEMORY[self.role]),
            f"  chosen: {', '.join(chosen)}",
        ]
        return out + self.time_lines()

    def time_lines(self) -> list[str]:
        """The step's time estimate per phase, why this setting, and the runner-ups (GPU plans only; a CPU plan
        says why it has none)."""
        if self.device == "cpu":
            return ["  step time estimate: none on the CPU (the cost model's rates and calibration are GPUs'); "
                    "qerl train times its first step and estimates the run from it"]
        if self.estimate is None:
            return []
        r = self.rates or {}
        out = ["  step time estimate (s): " + ", ".join(f"{p} {v:.2f}" for p, v in self.estimate.items())
               + f" = {self.est_step_s:.2f} ({r.get('gpu')} {r.get('source')}: {r.get('matmul_tflops', 0):.0f} "
               f"TFLOP/s, {r.get('copy_gbps', 0):.0f} GB/s)", f"  why: {self.reason}"]
        for c in self.candidates:
            out.append(f"    {'fits' if c['fits'] else 'no fit'}: {setting_text(c['setting'])}: "
                       f"{c['est_step_s']:.2f} s, {c['peak_gib']:.1f} GiB")
        return out


def _activations(dims: ModelDims, elem: int, tokens: int, gc: bool, fp32_inputs: int = 0) -> tuple[int, int]:
    """(kept through the forward, one layer's backward on top) for ``tokens`` rows; ``fp32_inputs``: the bytes per
    token and layer peft's fp32-input LoRA layer keeps on top (an unquantized base)."""
    per_layer = dims.act_bytes_per_token_layer(elem) + fp32_inputs
    if gc:  # every layer's input; in the backward one layer's recomputed set (+ its gradient in flight)
        kept = tokens * dims.layers * (dims.hidden + dims.moe_kept_extra) * elem
        return kept, tokens * (per_layer + 2 * dims.hidden * elem)
    kept = tokens * dims.layers * (per_layer + dims.moe_kept_extra * elem)
    return kept, tokens * dims.grad_bytes_per_token_layer(elem)


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


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is made for: the model, the workload, the device, and the settings given (None: planned)."""

    dims: ModelDims
    weights: WeightBytes
    capacity: int | None
    device_total: int | None
    elem: int
    sequences: int
    prompt_tokens: int
    completion_tokens: int
    lora_rank: int
    lora_targets: tuple[str, ...]
    logprob_chunk: int
    prompts: int | None
    gpu_memory_utilization: float | None
    rates: DeviceRates
    old_pass: bool
    reference_pass: bool
    peft_lora: bool  # LoRA dropout > 0: peft's own layer over a 16-bit base (fp32 inputs kept, no tensor cores)
    micro_batch_size: int | None
    gradient_checkpointing: bool | None
    optimizer_offload: bool | None
    extra_weight_copies: bool | None
    keep_rollout_cache: bool | None
    role: str = ROLE_BOTH  # the phases this process runs (train/phases.py): what it holds and what it is timed by

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def per_slot(self) -> int:
        cache_len = -(-(self.seq_tokens + 1) // CACHE_ALIGN) * CACHE_ALIGN
        return cache_len * self.dims.kv_bytes_per_token(kv_elem(self.elem))

    @property
    def prefill(self) -> int:
        prompts = self.prompts or self.sequences
        return min(ENGINE_PREFILL_TOKENS, max(self.prompt_tokens, prompts * self.prompt_tokens))

    def candidates(self) -> list[Setting]:
        """Every setting the plan estimates: micro-batches of 1, 2, 4, ... up to the sequences (and the sequences
        themselves), with and without checkpointing, copies, offload and a resident cache; given ones stay. A role
        varies only what it runs: a rollout rank's micro-batch, checkpointing and optimizer never act (one value
        each, the given one or the least), a trainer rank has no cache to keep."""
        n = self.sequences
        sizes = sorted({min(self.micro_batch_size, n)} if self.micro_batch_size is not None else
                       {1 << k for k in range(n.bit_length()) if 1 << k <= n} | {n}, reverse=True)

        def options(given: bool | None, free: tuple[bool, ...] = (False, True)) -> tuple[bool, ...]:
            return (given,) if given is not None else free

        copies = options(self.extra_weight_copies, (True, False) if self.weights.extra_copies > 0 else (False,))
        gcs, offloads = options(self.gradient_checkpointing), options(self.optimizer_offload)
        keeps = options(self.keep_rollout_cache)
        if self.role == ROLE_ROLLOUT:
            sizes, gcs, offloads = sizes[-1:], gcs[:1], offloads[:1]
        elif self.role == ROLE_TRAIN:
            keeps = (False,)
        return [Setting(mb, gc, c, o, None, keep) for mb in sizes for gc in gcs for c in copies for o in offloads
                for keep in keeps]


def cost_base(dims: ModelDims, weights: WeightBytes, elem: int, peft_lora: bool = False) -> Base:
    """The model as the step's cost model sees it: the decoder linears' bytes (from the format, else the stored
    bytes less the embeddings and lm_head), dequantized per pass or not; ``peft_lora``: LoRA through peft's own
    layer (dropout), else qerl's training LoRA path."""
    linear = weights.linear or max(0, weights.stored - 2 * dims.vocab * dims.hidden * elem)
    return Base(dims, elem, linear, weights.dequantizes, peft_lora)


def _reserve(capacity: int, transient: int) -> int:
    """Room the fit leaves beside the estimate: the CUDA context and library workspaces (1 GiB), 5% of the card,
    and the allocator's fragmentation, which grows with the bytes a step allocates and frees (module docstring)."""
    return GIB + capacity // 20 + int(FRAGMENTATION_SHARE * transient)


def _parts(req: PlanRequest, s: Setting) -> MemoryPlan:
    """The plan's bytes for setting ``s``, without its KV cache (``_build`` sizes that)."""
    from qerl_cli.train.host_offload import DEFAULT_BUCKET_BYTES

    dims, elem, wb = req.dims, req.elem, req.weights
    mb = s.micro_batch_size
    tokens = mb * req.seq_tokens
    util = req.gpu_memory_utilization
    if util is None and req.capacity is not None and req.device_total:
        util = min(1.0, req.capacity / req.device_total)
    n_lora = dims.lora_params(req.lora_rank, list(req.lora_targets))
    moments = 8 * n_lora
    fp32 = 0 if wb.dequantizes or not req.peft_lora else dims.fp32_input_bytes_per_token_layer(
        req.lora_rank, list(req.lora_targets), elem)
    kept, backward = _activations(dims, elem, tokens, s.gradient_checkpointing, fp32)
    chunk, lp_kept = _logprobs(dims, elem, tokens, mb * req.completion_tokens, req.logprob_chunk)
    plan = MemoryPlan(
        capacity=req.capacity, reserve=0, weights=wb.resident(s.kernel_weight_copies), weight_parts=wb,
        lora_params=4 * n_lora, grads=4 * n_lora, optimizer_state=0 if s.optimizer_offload else moments,
        optimizer_host=moments if s.optimizer_offload else 0,
        # offloaded: the moments of <= 3 buckets on the GPU + AdamW's square root of one; else the foreach root
        optimizer_step=min(7 * DEFAULT_BUCKET_BYTES, 2 * moments) if s.optimizer_offload else 4 * n_lora,
        shadows=dims.shadow_elems(req.lora_rank, list(req.lora_targets)) * elem,
        activations=kept, layer_backward=backward,
        activations_no_gc=sum(_activations(dims, elem, tokens, False, fp32)),
        activations_gc=sum(_activations(dims, elem, tokens, True, fp32)),
        recompute=_recompute(dims, elem, tokens), logprob_chunk=chunk, logprob_kept=lp_kept,
        dequant=dims.largest_linear() * elem if wb.dequantizes else 0,
        kv_cache=0, rollout=rollout_reserve(dims, elem, req.sequences, req.prefill), micro_batch_size=mb,
        gradient_checkpointing=s.gradient_checkpointing, optimizer_offload=s.optimizer_offload,
        extra_weight_copies=s.kernel_weight_copies, kv_slots=0, gpu_memory_utilization=util,
        sequences=req.sequences, seq_tokens=req.seq_tokens, aqn=2 * (2 * dims.layers + 1) * dims.hidden * elem,
        resident_cache=s.keep_rollout_cache,
        routing_batch=req.sequences * req.seq_tokens * dims.layers * dims.top_k * 2 if dims.experts else 0,
        routing_micro=tokens * dims.layers * dims.top_k * 8 if dims.experts else 0, role=req.role,
        device_total=req.device_total)
    return _role_parts(plan)


def _role_parts(p: MemoryPlan) -> MemoryPlan:
    """``p`` less what its role never allocates. A rollout rank never steps: no gradients, no AdamW moments (a
    resumed rank drops the ones its checkpoint restored, disagg.run_rollout_rank), no training activations,
    log-prob chunks, dequantized weights or recorded routing; it keeps the fp32 LoRA factors the trainers' adapters
    are copied into (adapter_sync.py) and the engine's in-dtype shadows of them. A trainer rank's engine is built
    but never decodes: the KV cache, the shadows and the engine's activations are allocated at its first
    ``generate`` (rollout/engine.py), so they are not counted; nor is AQN's draw, which the rollout ranks make."""
    if p.role == ROLE_ROLLOUT:
        return replace(p, grads=0, optimizer_state=0, optimizer_host=0, optimizer_step=0, activations=0,
                       layer_backward=0, activations_no_gc=0, activations_gc=0, recompute=0, logprob_chunk=0,
                       logprob_kept=0, dequant=0, routing_batch=0, routing_micro=0)
    if p.role == ROLE_TRAIN:
        return replace(p, shadows=0, rollout=0, aqn=0, resident_cache=False)
    return p


def _build(req: PlanRequest, s: Setting) -> MemoryPlan:
    """The plan for setting ``s``: its bytes, the reserve, as many KV slots as fit (one per sequence at most; a
    resident cache must also fit beside the update), and, on a GPU, the step's time estimate."""
    p = _parts(req, s)
    decodes = req.role != ROLE_TRAIN  # a trainer rank's engine never runs: no slots to size
    if req.capacity is None:  # CPU: nothing to fit
        if decodes:
            p.kv_slots = s.kv_slots or req.sequences
            p.kv_cache = p.kv_slots * req.per_slot
            p.rollout = rollout_reserve(req.dims, req.elem, max(1, p.kv_slots), req.prefill)
        return p
    p.reserve = _reserve(req.capacity, p.transient)
    slots = 0
    if decodes:
        per_slot = max(1, req.per_slot)
        room = req.capacity - p.reserve - p.phase_estimates()["rollout"]
        if p.resident_cache:  # the cache (and shadows) also stay through every other phase
            others = {k: v for k, v in p.phase_estimates().items() if k != "rollout"}
            room = min(room, req.capacity - p.reserve - max(others.values()) - p.shadows)
        slots = s.kv_slots if s.kv_slots is not None else max(0, min(req.sequences, room // per_slot))
        p.kv_slots, p.kv_cache = slots, slots * req.per_slot
        p.rollout = rollout_reserve(req.dims, req.elem, max(1, slots), req.prefill)
    if slots >= 1 or not decodes:
        work = Workload(req.sequences, req.prompt_tokens, req.completion_tokens, req.lora_rank, req.lora_targets,
                        old_pass=req.old_pass, reference_pass=req.reference_pass)
        setting = Setting(s.micro_batch_size, s.gradient_checkpointing, s.kernel_weight_copies,
                          s.optimizer_offload, slots or None, s.keep_rollout_cache)
        p.estimate = estimate_step(cost_base(req.dims, req.weights, req.elem, req.peft_lora), work, setting,
                                   req.rates, role=req.role).phases
        p.rates = asdict(req.rates)
    return p


def setting_text(s: dict[str, Any]) -> str:
    """One setting in a line: 'mb 8, gc on, copies off, offload off, 32 slots, cache kept'."""
    def on(v: Any) -> str:
        return "on" if v else "off"

    return (f"mb {s['micro_batch_size']}, gc {on(s['gradient_checkpointing'])}, copies "
            f"{on(s['kernel_weight_copies'])}, offload {on(s['optimizer_offload'])}, {s['kv_slots']} slots, cache "
            f"{'kept' if s['keep_rollout_cache'] else 'released'}")


def _summary(p: MemoryPlan) -> dict[str, Any]:
    return {"setting": p.setting(), "est_step_s": p.est_step_s or 0.0, "peak_gib": (p.peak + p.reserve) / GIB,
            "fits": p.fits()}


def _choose(plans: list[MemoryPlan]) -> MemoryPlan:
    """The fastest plan that fits by the cost model; within ``NEAR_TIE`` of it, the one needing least memory.
    Records why, and the runner-ups (the fastest others that fit, and the fastest that did not)."""
    fitting = sorted((p for p in plans if p.fits()), key=lambda p: (p.est_step_s or 0.0, p.peak + p.reserve))
    best = fitting[0]
    near = [p for p in fitting if (p.est_step_s or 0.0) <= (best.est_step_s or 0.0) * (1 + NEAR_TIE)]
    chosen = min(near, key=lambda p: (p.peak + p.reserve, p.est_step_s or 0.0))
    est = chosen.est_step_s or 0.0
    if chosen is best:
        chosen.reason = (f"the fastest of the {len(fitting)} settings that fit (of {len(plans)} estimated): "
                         f"{est:.2f} s per step")
    else:
        chosen.reason = (f"within {NEAR_TIE:.0%} of the fastest that fits ({setting_text(best.setting())}: "
                         f"{best.est_step_s:.2f} s, {(best.peak + best.reserve) / GIB:.1f} GiB) and "
                         f"{(best.peak + best.reserve - chosen.peak - chosen.reserve) / GIB:.1f} GiB smaller: "
                         f"{est:.2f} s per step")
    others = [p for p in fitting if p is not chosen][:RUNNER_UPS]
    faster = [p for p in plans if not p.fits() and p.estimate is not None and (p.est_step_s or 0.0) < est]
    if faster:
        others.append(min(faster, key=lambda p: p.est_step_s or 0.0))
    chosen.candidates = [_summary(p) for p in others]
    chosen.considered, chosen.fitting = len(plans), len(fitting)
    return chosen


def plan_memory(dims: ModelDims, *, weights: int | WeightBytes, capacity: int | None, device_total: int | None,
                elem: int, sequences: int, prompt_tokens: int, completion_tokens: int, lora_rank: int,
                lora_targets: list[str], micro_batch_size: int | None = None,
                gradient_checkpointing: bool | None = None, logprob_chunk: int = 512,
                gpu_memory_utilization: float | None = None, optimizer_offload: bool | None = None,
                extra_weight_copies: bool | None = None, prompts: int | None = None,
                keep_rollout_cache: bool | None = None, rates: DeviceRates | None = None, old_pass: bool = True,
                reference_pass: bool = False, peft_lora: bool = False, advise: bool = True,
                role: str = ROLE_BOTH) -> MemoryPlan:
    """The fastest setting (micro-batch, gradient checkpointing, kernel weight copies, where AdamW's moments live,
    KV slots, a resident rollout cache) whose step fits ``capacity`` bytes, by the step's cost model (module
    docstring). ``rates``: the device's (default: an H100's); ``old_pass`` / ``reference_pass``: the no-grad
    passes the step runs before the update (pi_old's own, the reference model's); ``peft_lora``: LoRA through
    peft's own layer (dropout > 0) instead of qerl's training path. ``role``: "both" (the whole step), or under
    --rollout-gpus "train" (no KV cache: the memory goes to the micro-batch; timed by the update) or "rollout"
    (no optimizer, gradients or activations: the memory goes to KV slots; timed by the rollout).

    Raises :class:`MemoryPlanError` when nothing fits (with the one-line advice unless ``advise`` is False).
    """
    wb = weights if isinstance(weights, WeightBytes) else WeightBytes(stored=int(weights))
    req = PlanRequest(dims, wb, capacity, device_total, elem, sequences, prompt_tokens, completion_tokens, lora_rank,
                      tuple(lora_targets), logprob_chunk, prompts, gpu_memory_utilization,
                      rates or default_rates(None), old_pass, reference_pass, peft_lora, micro_batch_size,
                      gradient_checkpointing, optimizer_offload, extra_weight_copies, keep_rollout_cache,
                      check_role(role))
    if capacity is None:  # CPU: nothing to fit; the defaults as they always were
        copies = extra_weight_copies if extra_weight_copies is not None else wb.extra_copies > 0
        return _build(req, Setting(min(micro_batch_size or MAX_DEFAULT_MICRO_BATCH, sequences),
                                   bool(gradient_checkpointing), copies, bool(optimizer_offload), sequences,
                                   keep_rollout_cache is not False))
    plans = [_build(req, s) for s in req.candidates()]
    if any(p.fits() for p in plans):
        return _choose(plans)
    if not advise:
        raise MemoryPlanError("memory plan: nothing fits")
    kw = dict(weights=wb, elem=elem, sequences=sequences, prompt_tokens=prompt_tokens,
              completion_tokens=completion_tokens, lora_rank=lora_rank, lora_targets=lora_targets,
              logprob_chunk=logprob_chunk, prompts=prompts, rates=req.rates, old_pass=old_pass,
              reference_pass=reference_pass, peft_lora=peft_lora,
              keep_rollout_cache=False if keep_rollout_cache is False else None, role=role)
    last = min(plans, key=lambda p: p.peak + p.reserve)
    raise MemoryPlanError(_advice(dims, capacity=capacity, fixed_mb=micro_batch_size, fixed_gc=gradient_checkpointing,
                                  fixed_offload=optimizer_offload, fixed_copies=extra_weight_copies, last=last, kw=kw))


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
    least = "one KV slot" if kw.get("role") == ROLE_ROLLOUT else "gradient checkpointing with micro-batch 1"
    return f"memory plan: even {least} {need}: shorten the prompts (--max-prompt-length) or {gpu}"


# which of the plan's estimates covers a phase of the step (the memory a phase's out-of-memory is held against)
PHASE_PART = {"setup": "weights", "aqn": "rollout_peak", "rollout": "rollout_peak", "recompute": "train_peak",
              "fwd_bwd": "train_peak", "optimizer": "train_peak", "requant": "train_peak", "checkpoint": "train_peak"}


def phase_advice(phase: str, plan: MemoryPlan | None, cfg: Any) -> str:
    """The one setting to change first when a step that the plan let run ran out of memory in ``phase`` (the
    counterpart of the nothing-fits advice above, for a plan the real step proved wrong). The plan's choices are
    the start (the request's when no plan was made); ``--set KEY=VALUE`` works for `qerl train` and the benches."""
    mb = plan.micro_batch_size if plan is not None else (cfg.micro_batch_size or 1)
    gc = plan.gradient_checkpointing if plan is not None else bool(cfg.gradient_checkpointing)
    seqs = cfg.batch_prompts * cfg.num_generations
    if phase == "setup":
        return "the base alone does not fit: a 4-bit format (--formats nvfp4) or a larger GPU"
    if phase in ("aqn", "rollout"):
        return (f"decode fewer sequences at once (--set max_batch_slots={max(1, min(seqs, cfg.max_batch_slots) // 2)}"
                ") or lower --set gpu_memory_utilization (a smaller KV cache)")
    if phase in ("recompute", "fwd_bwd"):
        if mb > 1:
            return f"--set micro_batch_size={mb // 2}" + ("" if gc else " (or --set gradient_checkpointing=true)")
        if not gc:
            return "--set gradient_checkpointing=true"
        return f"--set max_completion_length={max(1, cfg.max_completion_length // 2)} (or fewer prompt tokens)"
    if phase == "optimizer":
        return f"--set lora_rank={max(1, cfg.lora_rank // 2)} (the fp32 masters and AdamW moments)"
    if phase == "requant":
        return "no --rollout-quant (the quantized rollout copy), or a larger GPU"
    return "--set async_checkpoint=false (no snapshot held beside the next step)"


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


def device_rates(device: Any) -> DeviceRates:
    """The rates the cost model assumes for ``device`` before anything ran: per GPU name (step_cost.py)."""
    import torch

    name = torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None
    return default_rates(name)


def role_prompts(cfg: Any, role: str) -> int:
    """The prompts one engine call of ``role`` decodes (all ``num_generations`` samples of each): a rollout rank's
    chunk under --rollout-gpus (the hub hands out at most that many: train/disagg.py), else the step's batch."""
    if role != ROLE_ROLLOUT or not getattr(cfg, "rollout_gpus", 0):
        return cfg.batch_prompts
    from qerl_cli.train.async_queue import chunk_prompts

    return chunk_prompts(cfg.batch_prompts, cfg.rollout_gpus)


def plan_for_config(cfg: Any, model_config: Any, *, weights: int | WeightBytes, device: Any, prompt_tokens: int,
                    elem: int, extra_weight_copies: bool | None = None, rates: DeviceRates | None = None,
                    role: str = ROLE_BOTH) -> MemoryPlan:
    """The plan for a resolved TrainConfig on ``device``; modes the plan does not model keep their settings.
    ``extra_weight_copies`` fixes that decision (taken before the weights were built); ``rates``: the device's
    measured rates (default: its name's); ``role``: this process's under --rollout-gpus (see :func:`plan_memory`;
    a rollout rank plans for the sequences of one chunk, all it ever decodes at once)."""
    capacity, total = device_capacity(device, cfg.gpu_memory_gib)
    if cfg.finetune != "lora" or cfg.rollout_format is not None:
        capacity = None  # full fine-tuning / a second quantized copy: not modelled, settings as given
    copies = cfg.kernel_weight_copies if cfg.kernel_weight_copies is not None else extra_weight_copies
    prompts = role_prompts(cfg, role)
    plan = plan_memory(
        ModelDims.from_config(model_config), weights=weights, capacity=capacity, device_total=total, elem=elem,
        sequences=prompts * cfg.num_generations, prompt_tokens=prompt_tokens,
        completion_tokens=cfg.max_episode_tokens or cfg.max_completion_length, lora_rank=cfg.lora_rank,
        lora_targets=list(cfg.lora_targets),
        micro_batch_size=cfg.micro_batch_size, gradient_checkpointing=cfg.gradient_checkpointing,
        logprob_chunk=cfg.logprob_chunk_tokens, gpu_memory_utilization=cfg.gpu_memory_utilization,
        optimizer_offload=cfg.optimizer_offload, extra_weight_copies=copies, prompts=prompts,
        keep_rollout_cache=cfg.keep_rollout_cache if cfg.rollout_engine == "builtin" else False,
        rates=rates or device_rates(device), old_pass=cfg.recompute_logprobs or cfg.lora_dropout > 0,
        reference_pass=cfg.beta > 0, peft_lora=cfg.lora_dropout > 0, role=role)
    if not plans_for_gpu(device, cfg.gpu_memory_gib):
        plan.device = "cpu"
    return plan


def plan_before_build(cfg: Any, model_config: Any, fmt: str, *, device: Any, prompt_tokens: int,
                      stored: int | None = None, rates: DeviceRates | None = None,
                      role: str = ROLE_BOTH) -> MemoryPlan:
    """The plan from the model's config and format alone (nothing built yet): raises MemoryPlanError when the
    run cannot fit. ``stored``: the checkpoint's file sizes, when there is one; ``role``: see plan_for_config."""
    c = cfg.resolved() if hasattr(cfg, "resolved") else cfg
    elem = dtype_of(c.precision).itemsize
    gpu = plans_for_gpu(device, c.gpu_memory_gib)
    wb = weight_bytes(model_config, fmt, elem, kernels=gpu, stored=stored, cpu=not gpu)
    return plan_for_config(c, model_config, weights=wb, device=device, prompt_tokens=prompt_tokens, elem=elem,
                           rates=rates, role=role)


@dataclass(frozen=True)
class ResolvedSettings:
    """The settings a run takes: the plan's choices where the TrainConfig left them to it (None), the user's
    otherwise. The trainer, its metrics and the benches read these; the TrainConfig stays what was asked."""

    micro_batch_size: int
    gradient_checkpointing: bool
    optimizer_offload: bool
    kernel_weight_copies: bool
    gpu_memory_utilization: float  # the builtin engine's KV-cache share (vLLM: its own share)
    kv_slots: int  # sequences the rollout engine decodes at once
    keep_rollout_cache: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_settings(cfg: Any, plan: MemoryPlan) -> ResolvedSettings:
    """The settings of ``cfg`` (a resolved TrainConfig) with ``plan``'s choices: the builtin engine gets the plan's
    KV slots and cache share and may keep its cache; vLLM takes half the memory the run may use unless told.
    A share the user gives (and vLLM's half) is of the memory the run may use: under --gpu-memory-gib on a larger
    GPU, 0.35 of a 79.2 GiB cap is 27.7 GiB, not 0.35 of the physical 141 GB that both engines' fractions are of
    (vLLM given 0.35 of an H200 beside a 30B trainer capped at 79.2 GiB ran out of memory in setup)."""
    builtin = cfg.rollout_engine == "builtin"
    if cfg.gpu_memory_utilization is not None:
        util = cfg.gpu_memory_utilization * capped_fraction(plan)
    elif builtin and plan.gpu_memory_utilization is not None:
        util = plan.gpu_memory_utilization  # the plan's is of the physical device already
    else:
        util = 0.5 * capped_fraction(plan)
    # the sequences the plan was made for: the step's, or a rollout rank's chunk (plan_for_config)
    slots = min(cfg.max_batch_slots, plan.sequences)
    if plan.capacity is not None and builtin:
        slots = min(slots, max(1, plan.kv_slots))
    return ResolvedSettings(plan.micro_batch_size, plan.gradient_checkpointing, plan.optimizer_offload,
                            plan.extra_weight_copies, float(util), int(slots), bool(plan.resident_cache) and builtin)


def capped_fraction(plan: MemoryPlan) -> float:
    """The share of the physical device that the run's capacity is (1.0 uncapped or off CUDA)."""
    if plan.capacity is None or not plan.device_total:
        return 1.0
    return min(1.0, plan.capacity / plan.device_total)


def role_summary(plan: MemoryPlan, settings: ResolvedSettings) -> dict[str, Any]:
    """One role's plan as the manifest records it under --rollout-gpus (train.extra.async.roles): the settings the
    role took and its estimated peak (with the reserve; allocated bytes without it). What a role never runs is
    None: a trainer rank's KV cache, a rollout rank's micro-batch, checkpointing and optimizer."""
    train, rollout = plan.role != ROLE_ROLLOUT, plan.role != ROLE_TRAIN

    def gb(b: int | None) -> float | None:
        return None if b is None else round(b / GIB, 3)

    return {
        "role": plan.role,
        "micro_batch_size": settings.micro_batch_size if train else None,
        "gradient_checkpointing": settings.gradient_checkpointing if train else None,
        "optimizer_offload": settings.optimizer_offload if train else None,
        "kernel_weight_copies": settings.kernel_weight_copies,
        "kv_slots": settings.kv_slots if rollout else None,
        "gpu_memory_utilization": settings.gpu_memory_utilization if rollout else None,
        "keep_rollout_cache": settings.keep_rollout_cache if rollout else None,
        "sequences": plan.sequences,
        "est_peak_gib": gb(plan.peak + plan.reserve), "est_peak_allocated_gib": gb(plan.peak),
        "capacity_gib": gb(plan.capacity), "est_step_s": plan.est_step_s,
    }


def model_dir_format(model_dir: Any) -> str:
    """The weight format of a model directory written by `qerl quantize` (its config's quantization_config)."""
    from qerl_cli.formats import FORMATS, detect
    from qerl_cli.model_config import read_config_dict

    config = read_config_dict(model_dir)
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

    from qerl_cli.manifest import RunDir
    from qerl_cli.model_config import read_model_config
    from qerl_cli.runlayout import quantized_model_dir

    try:
        run = RunDir(run_dir, create=False)
        model_dir = Path(quantized_model_dir(run))
        model_config = read_model_config(model_dir)
        fmt = model_dir_format(model_dir)
    except (QerlError, OSError, ValueError) as exc:
        return [f"memory plan: not available ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"]
    c = cfg.resolved()
    longest = _longest_prompt(model_dir, c)
    prompts = (f"prompts counted at the task's longest, {longest} tokens" if longest is not None else
               f"prompts counted at --max-prompt-length {c.max_prompt_length} tokens, the bound")
    # --rollout-gpus: trainer and rollout ranks hold different things, so each role gets its own plan (planned
    # from the config here whether or not this process could start the split)
    roles = (ROLE_TRAIN, ROLE_ROLLOUT) if getattr(c, "rollout_gpus", 0) else (ROLE_BOTH,)
    out = [] if len(roles) == 1 else [
        f"--rollout-gpus {c.rollout_gpus}: one plan per role (trainer ranks run the update, rollout ranks the "
        f"engine, {role_prompts(c, ROLE_ROLLOUT)} prompts x {c.num_generations} samples per chunk)"]
    for role in roles:
        try:
            plan = plan_before_build(c, model_config, fmt, device=pick_device().type,
                                     prompt_tokens=longest or c.max_prompt_length, stored=stored_bytes(model_dir),
                                     role=role)
        except MemoryPlanError as exc:
            out.append(str(exc) if role == ROLE_BOTH else f"{role} ranks: {exc}")
            continue
        out += plan.lines()
    return [*out, f"  (weights from the config and the checkpoint files; {prompts}, completions at "
                  f"{c.max_episode_tokens or c.max_completion_length}; the trainer plans again with the "
                  "measured weights)"]


def _longest_prompt(model_dir: Any, c: Any) -> int | None:
    """The longest training prompt of the run's task in tokens (within --max-prompt-length), as the trainer plans
    with; None when the task cannot be read here (the trainer says why when it runs)."""
    from qerl_cli.models import load_tokenizer, resolve_model
    from qerl_cli.tasks import load_task

    try:
        tok = load_tokenizer(resolve_model(str(model_dir)))
        task = load_task(c.task, split="train", shots=c.shots, chat_template=c.chat_template, tokenizer=tok,
                         seed=c.seed, level=c.task_level, tools=c.tools)
        texts = [e.prompt for e in task.examples]
    except (QerlError, OSError, ValueError):
        return None
    if not texts:
        return None
    bos = int(not c.chat_template and bool(getattr(tok, "add_bos_token", False)))
    longest = max(len(ids) for ids in tok(texts, add_special_tokens=False).input_ids) + bos
    return min(longest, c.max_prompt_length)


__all__ = ["GIB", "PHASES", "PHASE_PART", "MemoryPlan", "MemoryPlanError", "ModelDims", "PlanRequest",
           "ResolvedSettings", "WeightBytes", "cost_base", "device_capacity", "device_rates", "dry_run_lines",
           "linear_bytes", "min_capacity", "model_dir_format", "phase_advice", "plan_before_build", "plan_for_config",
           "plan_memory", "resolve_settings", "role_prompts", "role_summary", "rollout_reserve", "setting_text",
           "stored_bytes", "weight_bytes"]
