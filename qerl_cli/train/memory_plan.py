"""The memory plan of an RL run: what each part of a step needs on the GPU, and the settings that fit.

Before the first step the trainer adds up, for the GPU it runs on (or ``gpu_memory_gib``, a cap that
stands for a smaller card):

  weights      the frozen base as it sits on the device (measured after loading; for ``--dry-run``
               the checkpoint's file sizes)
  adapters     LoRA factors: fp32 master, gradient, two AdamW moments (16 B per parameter) and the
               rollout engine's in-dtype shadows (2 B)
  activations  what the training forward keeps for the backward, per micro-batch, with and without
               gradient checkpointing (a per-token, per-layer model of a Llama/Qwen2 layer: below)
  logprobs     one chunk of lm_head logits in fp32 (train/logprobs.py) plus the kept hidden rows and
               their Jacobian
  kv cache     one slot of prompt + completion tokens per sequence, K and V over every layer
  rollout      the engine's activation reserve (prefill of 8192 tokens, sampling over the vocabulary)
  reserve      1 GiB + 5% of the GPU for the allocator's fragmentation and the CUDA context

The rollout and the update never hold their transient memory at once (the KV cache is freed before the
backward pass), so the peak is weights + adapters + max(rollout, training) + reserve.

Choices, first that fits: no gradient checkpointing with the largest micro-batch that still feeds the
GEMMs >= 2048 tokens; then gradient checkpointing with the largest micro-batch; then smaller
micro-batches without it. Settings given explicitly (``micro_batch_size``, ``gradient_checkpointing``) are
kept. The KV cache then gets what is really free at rollout time: ``gpu_memory_utilization`` becomes
the cap's share of the device (the cache stops at one slot per sequence anyway). When nothing fits,
:class:`MemoryPlanError` says which setting to change and to what.

Activation model per token and layer (bf16, LoRA on all seven projections, SDPA attention): the two
RMSNorms keep their fp32 input and normalised copy and the bf16 output (~10 H bytes each); q, k and v
after RoPE with K/V repeated to every head, and the attention output (4 H values); the o_proj input
(H); gate, up, SiLU(gate) and their product (4 I). So (15 H + 4 I) * dtype bytes; with checkpointing
only the layer input (H) is kept per layer, plus one layer's full set during its recompute.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from qerl_cli.device import pick as pick_device
from qerl_cli.errors import QerlError
from qerl_cli.precision import dtype_of

GIB = 2**30
MAX_DEFAULT_MICRO_BATCH = 8
MIN_GEMM_TOKENS = 2048  # below this many rows per micro-batch the base GEMMs run far under their rate
ENGINE_PREFILL_TOKENS = 8192  # the builtin engine's max_prefill_tokens
CACHE_ALIGN = 64  # the builtin engine rounds the cache length up to this


class MemoryPlanError(QerlError):
    """Nothing fits: the message names the setting to change."""


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: Any) -> ModelDims:
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return cls(int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers), heads,
                   int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim, int(cfg.vocab_size))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection LoRA may target."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)

    def kv_bytes_per_token(self, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def act_bytes_per_token_layer(self, elem: int) -> int:
        return (15 * self.hidden + 4 * self.intermediate) * elem


@dataclass
class MemoryPlan:
    """Bytes per part and the chosen settings; ``capacity`` None means no limit is known (CPU)."""

    capacity: int | None
    reserve: int
    weights: int
    adapters: int
    activations: int  # the chosen setting's
    activations_no_gc: int  # at the chosen micro-batch
    activations_gc: int
    logprobs: int
    kv_cache: int
    rollout: int
    micro_batch_size: int
    gradient_checkpointing: bool
    kv_slots: int
    gpu_memory_utilization: float | None
    sequences: int
    seq_tokens: int
    tried: list[str] = field(default_factory=list)

    @property
    def train_peak(self) -> int:
        return self.weights + self.adapters + self.activations + self.logprobs + self.reserve

    @property
    def resident_cache_fits(self) -> bool:
        """Whether the KV cache can stay allocated through the update (no re-allocation, no graph re-capture)."""
        return self.capacity is None or self.train_peak + self.kv_cache <= self.capacity

    @property
    def rollout_peak(self) -> int:
        return self.weights + self.adapters + self.kv_cache + self.rollout + self.reserve

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.rollout_peak)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(train_peak=self.train_peak, rollout_peak=self.rollout_peak, peak=self.peak)
        return d

    def lines(self) -> list[str]:
        """The plan as printed by ``qerl train --dry-run`` (GiB)."""
        def g(b: int | None) -> str:
            return "-" if b is None else f"{b / GIB:8.2f}"

        cap = "no limit known (CPU)" if self.capacity is None else f"{self.capacity / GIB:.2f} GiB"
        return [
            f"memory plan ({self.sequences} sequences x {self.seq_tokens} tokens; GPU memory {cap})",
            f"  weights                         {g(self.weights)} GiB",
            f"  adapters + optimizer state      {g(self.adapters)} GiB",
            f"  activations, no grad ckpt       {g(self.activations_no_gc)} GiB  (micro-batch {self.micro_batch_size})",
            f"  activations, grad ckpt          {g(self.activations_gc)} GiB  (micro-batch {self.micro_batch_size})",
            f"  logprob chunk + kept rows       {g(self.logprobs)} GiB",
            f"  kv cache                        {g(self.kv_cache)} GiB  ({self.kv_slots} slots)",
            f"  rollout activations             {g(self.rollout)} GiB",
            f"  reserve                         {g(self.reserve)} GiB",
            f"  peak: rollout {self.rollout_peak / GIB:.2f} GiB, training {self.train_peak / GIB:.2f} GiB",
            f"  chosen: micro_batch_size {self.micro_batch_size}, gradient_checkpointing "
            f"{str(self.gradient_checkpointing).lower()}, gpu_memory_utilization "
            f"{'-' if self.gpu_memory_utilization is None else f'{self.gpu_memory_utilization:.3f}'}",
        ]


def _activations(dims: ModelDims, elem: int, tokens: int, gc: bool) -> int:
    per_layer = dims.act_bytes_per_token_layer(elem)
    if gc:  # layer inputs of every layer + one layer recomputed at a time (+ its gradient in flight)
        return tokens * (dims.layers * dims.hidden * elem + per_layer + 2 * dims.hidden * elem)
    return tokens * dims.layers * per_layer


def _logprobs(dims: ModelDims, elem: int, completion_tokens: int, chunk: int) -> int:
    chunk = completion_tokens if chunk <= 0 else min(chunk, completion_tokens)
    # the chunk's logits in dtype, z and the (log-)softmax in fp32, the fp32 Jacobian factor; the kept
    # hidden rows and their Jacobian, the final hidden states of the micro-batch
    return chunk * dims.vocab * (elem + 12) + 2 * completion_tokens * dims.hidden * elem


def rollout_reserve(dims: ModelDims, elem: int, slots: int) -> int:
    """The builtin engine's activation reserve for ``slots`` sequences, in bytes (its own formula)."""
    from qerl_cli.rollout.kv_cache import activation_reserve

    return activation_reserve(hidden=dims.hidden, intermediate=dims.intermediate, heads=dims.heads,
                              kv_heads=dims.kv_heads, head_dim=dims.head_dim, layers=dims.layers, vocab=dims.vocab,
                              elem=elem, prefill_tokens=ENGINE_PREFILL_TOKENS, slots=slots)


def plan_memory(dims: ModelDims, *, weights: int, capacity: int | None, device_total: int | None, elem: int,
                sequences: int, prompt_tokens: int, completion_tokens: int, lora_rank: int,
                lora_targets: list[str], micro_batch_size: int | None = None,
                gradient_checkpointing: bool | None = None, logprob_chunk: int = 512,
                gpu_memory_utilization: float | None = None, advise: bool = True) -> MemoryPlan:
    """Choose micro-batch size and gradient checkpointing so the step fits ``capacity`` bytes.

    Raises :class:`MemoryPlanError` when nothing fits (with the one-line advice unless ``advise`` is False).
    """
    seq_tokens = prompt_tokens + completion_tokens
    n_lora = dims.lora_params(lora_rank, lora_targets)
    adapters = n_lora * (16 + elem)
    reserve = (GIB + capacity // 20) if capacity is not None else 0
    cache_len = -(-(seq_tokens + 1) // CACHE_ALIGN) * CACHE_ALIGN
    per_slot = cache_len * dims.kv_bytes_per_token(elem)
    mb_max = min(micro_batch_size or MAX_DEFAULT_MICRO_BATCH, sequences)
    sizes = sorted({max(1, mb_max >> k) for k in range(mb_max.bit_length() + 1)}, reverse=True)
    if micro_batch_size is not None:
        sizes = [mb_max]
    if gradient_checkpointing is None:
        big = [m for m in sizes if m * seq_tokens >= MIN_GEMM_TOKENS or m == sizes[0]]
        order = [(False, m) for m in big] + [(True, m) for m in sizes] + [(False, m) for m in sizes if m not in big]
    else:
        order = [(gradient_checkpointing, m) for m in sizes]

    def build(gc: bool, mb: int, slots: int) -> MemoryPlan:
        tokens = mb * seq_tokens
        util = gpu_memory_utilization
        if util is None and capacity is not None and device_total:
            util = min(1.0, capacity / device_total)
        return MemoryPlan(
            capacity=capacity, reserve=reserve, weights=weights, adapters=adapters,
            activations=_activations(dims, elem, tokens, gc),
            activations_no_gc=_activations(dims, elem, tokens, False),
            activations_gc=_activations(dims, elem, tokens, True),
            logprobs=_logprobs(dims, elem, mb * completion_tokens, logprob_chunk),
            kv_cache=slots * per_slot, rollout=rollout_reserve(dims, elem, slots), micro_batch_size=mb,
            gradient_checkpointing=gc, kv_slots=slots, gpu_memory_utilization=util, sequences=sequences,
            seq_tokens=seq_tokens)

    if capacity is None:  # CPU: nothing to fit; the defaults as they always were
        return build(bool(gradient_checkpointing), sizes[0], sequences)
    fixed = weights + adapters + reserve
    free_for_cache = capacity - fixed - rollout_reserve(dims, elem, sequences)
    slots = max(0, min(sequences, free_for_cache // per_slot if per_slot else sequences))
    tried = []
    for gc, mb in order:
        p = build(gc, mb, max(1, slots))
        tried.append(f"gc={str(gc).lower()} mb={mb}: {p.train_peak / GIB:.1f} GiB")
        if slots >= 1 and p.train_peak <= capacity:
            p.tried = tried
            return p
    if not advise:
        raise MemoryPlanError("memory plan: nothing fits")
    raise MemoryPlanError(_advice(dims, weights=weights, capacity=capacity, elem=elem, sequences=sequences,
                                  prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  lora_rank=lora_rank, lora_targets=lora_targets, fixed_mb=micro_batch_size,
                                  fixed_gc=gradient_checkpointing, logprob_chunk=logprob_chunk, last=p))


def _advice(dims: ModelDims, *, weights: int, capacity: int, elem: int, sequences: int, prompt_tokens: int,
            completion_tokens: int, lora_rank: int, lora_targets: list[str], fixed_mb: int | None,
            fixed_gc: bool | None, logprob_chunk: int, last: MemoryPlan) -> str:
    """One line: what does not fit and the nearest setting that would."""
    cap = capacity / GIB
    need = f"needs {last.peak / GIB:.1f} GiB of {cap:.1f} GiB (weights {weights / GIB:.1f}, adapters + optimizer " \
           f"{last.adapters / GIB:.1f}, activations {last.activations / GIB:.1f}, kv cache {last.kv_cache / GIB:.1f})"
    if fixed_mb is not None or fixed_gc is not None:
        try:  # would the planner's own choice fit?
            p = plan_memory(dims, weights=weights, capacity=capacity, device_total=None, elem=elem,
                            sequences=sequences, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            lora_rank=lora_rank, lora_targets=lora_targets, logprob_chunk=logprob_chunk,
                            advise=False)
            return (f"memory plan: micro_batch_size {fixed_mb or '-'} / gradient_checkpointing "
                    f"{fixed_gc if fixed_gc is not None else '-'} {need}: use --micro-batch-size "
                    f"{p.micro_batch_size}{' --gradient-checkpointing' if p.gradient_checkpointing else ''} "
                    "(or leave both unset and the plan chooses)")
        except MemoryPlanError:
            pass
    if weights + last.adapters + last.reserve >= capacity:
        return (f"memory plan: the weights and adapter state alone {need}: quantize the base to 4 bits "
                "(qerl quantize --format nvfp4), lower --lora-rank, or raise --gpu-memory-gib / use a larger GPU")

    def fits(completion: int) -> bool:
        try:
            plan_memory(dims, weights=weights, capacity=capacity, device_total=None, elem=elem, sequences=sequences,
                        prompt_tokens=prompt_tokens, completion_tokens=completion, lora_rank=lora_rank,
                        lora_targets=lora_targets, logprob_chunk=logprob_chunk, advise=False)
            return True
        except MemoryPlanError:
            return False

    lo, hi = 0, completion_tokens  # largest completion length that fits (0: none)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid >= 1 and fits(mid):
            lo = mid
        else:
            hi = mid - 1
    if lo >= 1:
        return (f"memory plan: {sequences} sequences of {prompt_tokens} + {completion_tokens} tokens {need}: "
                f"lower --max-completion-length to {lo} (or --max-prompt-length / the batch), or raise "
                "--gpu-memory-gib / use a larger GPU")
    return (f"memory plan: even gradient checkpointing with micro-batch 1 {need}: shorten the prompts "
            "(--max-prompt-length) or use a larger GPU")


def gib(x: float | None) -> int | None:
    return None if x is None else int(math.floor(x * GIB))




# ---- the trainer's and `qerl train --dry-run`'s entry points -------------------------------------------
def device_capacity(device: Any, cap_gib: float | None) -> tuple[int | None, int | None]:
    """(capacity, device total) in bytes: the cap when given, else the whole device; (None, None) off CUDA."""
    import torch

    if torch.device(device).type != "cuda":
        return None, None
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return (min(total, gib(cap_gib)) if cap_gib is not None else total), total


def module_bytes(model: Any) -> int:
    seen: set[int] = set()
    n = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def plan_for_config(cfg: Any, model_config: Any, *, weights: int, device: Any, prompt_tokens: int,
                    elem: int) -> MemoryPlan:
    """The plan for a resolved TrainConfig on ``device``; modes the plan does not model keep their settings."""
    capacity, total = device_capacity(device, cfg.gpu_memory_gib)
    if cfg.finetune != "lora" or cfg.rollout_quant != "none":
        capacity = None  # full fine-tuning / a second quantized copy: not modelled, settings as given
    return plan_memory(
        ModelDims.from_config(model_config), weights=weights, capacity=capacity, device_total=total, elem=elem,
        sequences=cfg.batch_prompts * cfg.num_generations, prompt_tokens=prompt_tokens,
        completion_tokens=cfg.max_completion_length, lora_rank=cfg.lora_rank, lora_targets=list(cfg.lora_targets),
        micro_batch_size=cfg.micro_batch_size, gradient_checkpointing=cfg.gradient_checkpointing,
        logprob_chunk=cfg.logprob_chunk_tokens, gpu_memory_utilization=cfg.gpu_memory_utilization)


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
    except (QerlError, OSError, ValueError) as exc:
        return [f"memory plan: not available ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"]
    c = cfg.resolved()
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    elem = dtype_of(c.precision).itemsize
    device = pick_device().type
    try:
        plan = plan_for_config(c, model_config, weights=weights, device=device, prompt_tokens=c.max_prompt_length,
                               elem=elem)
    except MemoryPlanError as exc:
        return [str(exc)]
    return [*plan.lines(), f"  (weights from the checkpoint files; prompts counted at --max-prompt-length "
                           f"{c.max_prompt_length} tokens, the bound; the trainer plans with the real ones)"]


__all__ = ["GIB", "MemoryPlan", "MemoryPlanError", "ModelDims", "dry_run_lines", "plan_for_config", "plan_memory",
           "rollout_reserve"]
