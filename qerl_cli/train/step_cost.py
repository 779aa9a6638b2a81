"""Seconds per phase of an RL step for one setting: the cost model the memory plan ranks its candidates by.

A setting (micro-batch, gradient checkpointing, kernel weight copies, optimizer offload, KV slots, a resident
rollout cache) changes where a step's time goes; this model puts a number on each phase from the model's
dimensions, the weight format, the workload and two rates of the device (docs/memory.md, "What the step costs"):

  rollout    waves x decode steps x one decode step + prefill + a fixed part. A decode step is a per-layer
             floor (the graph's launches and the kernels' latency) + a low-bit weight at its dequantize-GEMM
             kernel's throughput (far from the copy bandwidth at batch <= 64, and the same on an H100 and an
             H200) or a 16-bit one, lm_head and the KV cache at the copy bandwidth + the batch's GEMM FLOPs.
             Fewer KV slots than sequences decode in more waves; a cache that is not resident is allocated and
             its graphs captured again every step.
  recompute  per micro-batch, one forward without autograd for pi_old where it needs a pass of its own, and one
             for the reference model (beta > 0); none when the update's forward supplies pi_old.
  fwd_bwd    per micro-batch, a forward and a backward (and under checkpointing one more forward): GEMM FLOPs
             (2 x weights x tokens forward, as much again for dx of the frozen base, the LoRA factors x 3,
             attention x 2, lm_head over the loss tokens) at a share of the matmul ceiling that grows with the
             micro-batch's rows; the weights once per pass (a low-bit base is dequantized per pass: its bytes
             read, bf16 written and read back); the elementwise work as a multiple of the bytes autograd keeps;
             and a host cost per layer per micro-batch (Python, autograd, kernel launches). GPU and host run
             side by side: a micro-batch takes the larger of the two plus a share of the smaller.
  optimizer  fixed + per adapter parameter, + the moments' PCIe round trip when they live in host memory (the
             first step's pinning of them is not counted: HostOffloadAdamW.prepare_state does it during the rollout).
  checkpoint the blocking host copy of the adapter and optimizer state (fixed + bytes at a host copy rate); moments
             in host memory are not copied (the writer reads them while the next step's rollout runs), so only
             the adapter's bytes count then.
  aqn, other per layer (the noisy norms) and a fixed remainder.

Under --rollout-gpus a process runs only its role's phases (train/phases.py's ROLE_TIME): ``estimate_step(...,
role=...)`` returns those alone, so a rollout rank's settings are ranked by its rollout and a trainer's by its
update.

Every constant that is not a device rate sits in :data:`CALIBRATION`, fitted to the step results in
docs/results (the list is beside it). The device's two rates are :class:`DeviceRates`: measured where a bench
measured them (``qerl bench step``), else per GPU name (:func:`default_rates`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qerl_cli.arch import DEFAULT_LORA_TARGETS
from qerl_cli.rollout.kv_cache import kv_elem
from qerl_cli.train.model_dims import ModelDims
from qerl_cli.train.phases import (
    AQN,
    CHECKPOINT,
    FWD_BWD,
    OPTIMIZER,
    OTHER,
    PLANNED_TIME,
    RECOMPUTE,
    ROLE_BOTH,
    ROLE_TIME,
    ROLLOUT,
    check_role,
)

PHASES = PLANNED_TIME  # the phases it estimates seconds for, in order (train/phases.py)
DEFAULT_TARGETS = DEFAULT_LORA_TARGETS  # lora_targets' default


@dataclass(frozen=True)
class DeviceRates:
    """The BF16 matmul ceiling (TFLOP/s, an 8192^3 GEMM) and the device copy bandwidth (GB/s, bytes read +
    written); ``source`` says whether they were measured or taken for the GPU's name."""

    matmul_tflops: float
    copy_gbps: float
    gpu: str = "H100"
    source: str = "default"


# per GPU name, for a plan made before anything ran: `qerl bench step`'s and `bench rollout`'s measurements
DEFAULT_RATES = {"H100": (778.0, 2960.0), "H200": (790.0, 4300.0)}


def default_rates(gpu_name: str | None) -> DeviceRates:
    """The rates of a known GPU found in ``gpu_name`` (e.g. 'NVIDIA H100 80GB HBM3'); an unknown one (or none:
    planning on a CPU for a GPU) is taken as an H100 and says so."""
    for key, (tflops, gbps) in DEFAULT_RATES.items():
        if gpu_name and key in gpu_name:
            return DeviceRates(tflops, gbps, key, "default")
    tflops, gbps = DEFAULT_RATES["H100"]
    why = f"{gpu_name} is not in the table" if gpu_name else "planned without a GPU"
    return DeviceRates(tflops, gbps, "H100", f"assumed ({why})")


@dataclass(frozen=True)
class Calibration:
    """The model's constants (module docstring), fitted on measured steps; seconds, shares and multiples."""

    gemm_share: float  # of the matmul ceiling, the training GEMMs at many rows
    gemm_half_rows: float  # rows per micro-batch at which they reach half that share
    fp32_lora_share: float  # peft's fp32 LoRA GEMMs over an unquantized base (no tensor cores), of the ceiling
    elementwise_fwd: float  # bytes the forward's elementwise kernels move per byte autograd keeps
    elementwise_bwd: float  # the same for the backward
    host_nograd_s: float  # host seconds per layer per micro-batch: a forward without autograd
    host_fwd_s: float  # ... a forward recording autograd's graph
    host_bwd_s: float  # ... a backward
    overlap: float  # share of the smaller of host and GPU time that is not hidden behind the larger
    copies_train_penalty: float  # the training passes' extra GPU time when the peer kernel's weight copies exist
    decode_layer_s: float  # per layer per decode step
    decode_dequant_share: float  # low-bit decode GEMMs: weights dequantized per second, per FLOP/s of the ceiling
    decode_dense_share: float  # ... a 16-bit weight
    decode_copies_share: float  # ... through the peer kernel's own copy (kernel_weight_copies)
    decode_flops_share: float  # of the matmul ceiling, the decode GEMMs' FLOPs
    prefill_share: float  # of the matmul ceiling, the prefill
    rollout_fixed_s: float  # per step: scoring, sampling set-up, the engine's bookkeeping
    recapture_s: float  # per step when the KV cache and the decode graphs are rebuilt
    optimizer_fixed_s: float
    optimizer_param_s: float  # per adapter parameter (clip, AdamW's foreach kernels)
    offload_gbps: float  # the moments' host round trip (pinned, overlapped per bucket)
    checkpoint_fixed_s: float
    checkpoint_gbps: float  # the snapshot's copy to host memory
    aqn_layer_s: float
    other_s: float
    # a mixture of experts' routed experts and their LoRA (qerl_cli/moe.py), as shares of the matmul ceiling: the
    # grouped Triton kernels' forward and backward (dispatch, i.e. align_blocks and the gathers, included: the bench
    # times the whole layer), and the per-expert loop's (kernels off, the CPU)
    # (issue 45; the numbers: docs/moe.md "The plan"). Grouped, one Qwen3-30B-A3B layer at 8,192 tokens on an
    # H200 (docs/results/2026-11-29/i45_moe_grouped_bench.json): forward 645 GFLOP in 5.48 ms = 118 TFLOP/s,
    # backward 699 GFLOP in 4.47 ms = 157 TFLOP/s (134 TFLOP/s both), over 790. The loop's forward from the same
    # bench (8.3 TFLOP/s); its backward fitted to the step measured on 2026-11-28 (fwd_bwd 55.63 s, grouped
    # forward + looped backward, micro-batch 8 with checkpointing: 7.3 TFLOP/s; the bench's per-projection loop
    # backwards give 6.7)
    moe_grouped_fwd_share: float = 0.149
    moe_grouped_bwd_share: float = 0.198
    moe_loop_fwd_share: float = 0.0105
    moe_loop_bwd_share: float = 0.0093
    # low-bit decode: touched expert weights per second, per FLOP/s of the ceiling: 24.7 ms per decode step at
    # batch 64 on an H200 (2026-11-28), less the step's other terms (5.8 ms), for 28.5 G touched expert weights
    decode_moe_share: float = 0.0019
    # the rollout prefill's expert FLOPs, of the ceiling: 2.40 s for 64 x 256 prompt tokens (62 TFLOP of experts)
    # on an H100 (docs/results/2026-11-27/i38_moe_step_mb16_h100.json, rollout_prefill_s)
    moe_prefill_share: float = 0.0346


# Fitted by least squares on the log of the measured phase times (rollout, recompute, fwd_bwd, checkpoint), worst
# cells weighted up, then rounded, on `qerl bench step` results under docs/results/: 7B bf16 + nvfp4 on an H100,
# 7B bf16 with the phase profile (its kernel time per phase pinned the GPU side: bf16 0.60 / 1.32 s, nvfp4 0.44 /
# 0.95 s of recompute / fwd_bwd), 72B micro-batch 1 + checkpointing on an H200 (training phases), and 7B, 14B, 32B
# with and without humming's copies and 72B on an H100 (32B micro-batch 8 on an H200). The cells and the residuals
# (<= 14%): tests/test_step_cost.py. The host terms are what a layer of
# today's LoRA path costs in Python and launches; refit when that path or the kernels change.
CALIBRATION = Calibration(
    gemm_share=0.9, gemm_half_rows=110.0, fp32_lora_share=0.028, elementwise_fwd=6.3, elementwise_bwd=5.0,
    host_nograd_s=3.2e-3, host_fwd_s=7.0e-3, host_bwd_s=3.0e-3, overlap=0.22, copies_train_penalty=2.4,
    decode_layer_s=6.0e-5, decode_dequant_share=0.0038, decode_dense_share=1.0, decode_copies_share=0.0040,
    decode_flops_share=0.7, prefill_share=0.5, rollout_fixed_s=0.0, recapture_s=0.3, optimizer_fixed_s=0.015,
    optimizer_param_s=1e-10, offload_gbps=40.0, checkpoint_fixed_s=0.15, checkpoint_gbps=6.4, aqn_layer_s=3e-3,
    other_s=0.04)


@dataclass(frozen=True)
class Workload:
    """One step's work. ``mean_completion``: the expected completion length (None: the most, the bound the
    plan assumes); ``old_pass``: pi_old gets a no-grad pass of its own (else the update's forward supplies it);
    ``reference_pass``: the reference model's (beta > 0); ``train_tokens``/``attention_pairs``/``loss_tokens``:
    measured counts, when known."""

    sequences: int
    prompt_tokens: float
    completion_tokens: int
    lora_rank: int = 32
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    mean_completion: float | None = None
    old_pass: bool = True
    reference_pass: bool = False
    train_tokens: float | None = None
    attention_pairs: float | None = None
    loss_tokens: float | None = None

    def counts(self) -> tuple[float, float, float]:
        """(tokens, attention pairs, loss tokens) of the whole batch."""
        new = self.completion_tokens if self.mean_completion is None else self.mean_completion
        n = self.prompt_tokens + new
        return (self.train_tokens if self.train_tokens is not None else self.sequences * n,
                self.attention_pairs if self.attention_pairs is not None else self.sequences * n * (n + 1) / 2,
                self.loss_tokens if self.loss_tokens is not None else self.sequences * new)


@dataclass(frozen=True)
class Setting:
    micro_batch_size: int
    gradient_checkpointing: bool
    kernel_weight_copies: bool = False
    optimizer_offload: bool = False
    kv_slots: int | None = None  # None: one per sequence
    keep_rollout_cache: bool = True


@dataclass(frozen=True)
class Base:
    """What the cost depends on in the base model: its dims, activation dtype bytes, the decoder linears' stored
    bytes and whether they are quantized (dequantized per training pass; an unquantized base runs peft's own
    LoRA layer, which casts its inputs to the fp32 adapters' dtype)."""

    dims: ModelDims
    elem: int
    linear_bytes: int
    dequantizes: bool
    peft_lora: bool = False  # LoRA through peft's own layer (dropout > 0): fp32 adapter inputs over a 16-bit base
    # how a mixture of experts' experts train: "grouped" (the Triton kernels forward and backward, CUDA's default),
    # "loop" (one expert at a time both ways: the CPU, kernels off), "loop_backward" (grouped forward, looped
    # backward: the code before 2026-11-29, kept to check the model against the step measured then)
    moe_path: str = "grouped"

    @property
    def fp32_lora_inputs(self) -> bool:
        return self.peft_lora and not self.dequantizes and self.elem < 4


@dataclass
class StepEstimate:
    """Seconds per phase (``PHASES``) and their sum; ``parts`` say where the training phases' time went."""

    phases: dict[str, float]
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, float]:
        return {**{f"{p}_s": v for p, v in self.phases.items()}, "step_s": self.step_s,
                **{f"part/{k}": v for k, v in self.parts.items()}}


def gemm_share(rows: float, cal: Calibration) -> float:
    return cal.gemm_share * rows / (rows + cal.gemm_half_rows)


def moe_shares(path: str, cal: Calibration) -> tuple[float, float]:
    """(forward, backward) shares of the matmul ceiling the routed experts run at on ``path`` (``Base.moe_path``)."""
    if path == "grouped":
        return cal.moe_grouped_fwd_share, cal.moe_grouped_bwd_share
    if path == "loop":
        return cal.moe_loop_fwd_share, cal.moe_loop_bwd_share
    if path == "loop_backward":
        return cal.moe_grouped_fwd_share, cal.moe_loop_bwd_share
    raise ValueError(f"unknown MoE path {path!r} (grouped, loop, loop_backward)")


def _combine(gpu: float, host: float, cal: Calibration) -> float:
    return max(gpu, host) + cal.overlap * min(gpu, host)


def _train_costs(base: Base, work: Workload, s: Setting, rates: DeviceRates, cal: Calibration) -> dict[str, float]:
    """GPU and host seconds of one micro-batch: 'fwd' (forward), 'bwd' (backward), 'gc' (the recomputed forward),
    and the number of micro-batches."""
    d = base.dims
    tokens, pairs, loss = work.counts()
    n_mb = math.ceil(work.sequences / max(1, min(s.micro_batch_size, work.sequences)))
    rows = tokens / n_mb
    fwd = d.forward_flops(tokens=rows, attention_pairs=pairs / n_mb, loss_tokens=loss / n_mb,
                          lora_rank=work.lora_rank, lora_targets=list(work.lora_targets))
    bwd = d.backward_flops(fwd)
    rate = rates.matmul_tflops * 1e12
    gemm_rate = rate * gemm_share(rows, cal)
    lora_rate = rate * cal.fp32_lora_share if base.fp32_lora_inputs else gemm_rate
    bw = rates.copy_gbps * 1e9
    weights = (base.linear_bytes + (2 * base.elem * d.linear_weights() if base.dequantizes else 0)) / bw
    kept = rows * d.layers * (d.act_bytes_per_token_layer(base.elem) + (d.fp32_input_bytes_per_token_layer(
        work.lora_rank, list(work.lora_targets), base.elem) if base.fp32_lora_inputs else 0)) / bw

    slower = 1.0 + (cal.copies_train_penalty if s.kernel_weight_copies else 0.0)
    fwd_share, bwd_share = moe_shares(base.moe_path, cal)

    def experts(fl: dict[str, float], share: float) -> float:
        # the routed experts and their LoRA at the expert kernels' measured rate, not the dense GEMMs'
        return (fl["experts"] + fl["expert_lora"]) / (rate * share) if fl["experts"] else 0.0

    def gpu(fl: dict[str, float], elementwise: float, head: bool = True) -> float:
        dense = fl["linear"] + fl["attention"] + (fl["head"] if head else 0.0)
        return dense / gemm_rate + fl["lora"] / lora_rate + weights + elementwise * kept

    return {"fwd": gpu(fwd, cal.elementwise_fwd) + experts(fwd, fwd_share),
            "bwd": slower * gpu(bwd, cal.elementwise_bwd) + experts(bwd, bwd_share),
            "gc": gpu(fwd, cal.elementwise_fwd, head=False) + experts(fwd, fwd_share),
            "host_nograd": d.layers * cal.host_nograd_s,
            "host_fwd": d.layers * cal.host_fwd_s,
            "host_bwd": d.layers * cal.host_bwd_s, "micro_batches": float(n_mb)}


def _rollout(base: Base, work: Workload, s: Setting, rates: DeviceRates, cal: Calibration) -> float:
    d = base.dims
    slots = max(1, min(work.sequences, s.kv_slots or work.sequences))
    waves = math.ceil(work.sequences / slots)
    bw, rate = rates.copy_gbps * 1e9, rates.matmul_tflops * 1e12
    experts = d.expert_weights()  # the k routed experts of every layer (0: a dense MLP)
    dense = d.linear_weights() - experts
    # a decode step reads every expert one of its `slots` tokens is routed to, not only k: E (1 - (1 - k/E)^b)
    touched = experts / max(1, d.top_k) * d.touched_experts(slots)
    if not base.dequantizes:  # a 16-bit base: its bytes at the copy bandwidth (of the experts, the touched ones')
        read = base.linear_bytes if not experts else (dense + touched) * base.elem
        weights = read / (bw * cal.decode_dense_share)
    else:
        weights = dense / (rate * (cal.decode_copies_share if s.kernel_weight_copies else cal.decode_dequant_share))
        weights += touched / (rate * cal.decode_moe_share)
    lora, expert_lora = d.active_lora_params(work.lora_rank, list(work.lora_targets))
    # the touched experts' LoRA copies are read in the model dtype beside their weights (rollout/fast_layers.py)
    shadows = expert_lora / max(1, d.top_k) * d.touched_experts(slots) * base.elem
    head = d.vocab * d.hidden * base.elem
    context = work.prompt_tokens + work.completion_tokens / 2
    kv = slots * context * d.kv_bytes_per_token(kv_elem(base.elem))
    flops = 2.0 * (d.linear_weights() + lora + expert_lora + head / base.elem)
    step = (d.layers * cal.decode_layer_s + weights + (head + kv + shadows) / (bw * cal.decode_dense_share)
            + flops * slots / (rate * cal.decode_flops_share))
    prompt = work.sequences * work.prompt_tokens
    prefill = 2.0 * (dense + head / base.elem) * prompt / (rate * cal.prefill_share) + 2.0 * (
        experts + expert_lora) * prompt / (rate * cal.moe_prefill_share)
    return waves * work.completion_tokens * step + prefill + cal.rollout_fixed_s + (
        0.0 if s.keep_rollout_cache else cal.recapture_s)


def estimate_step(base: Base, work: Workload, setting: Setting, rates: DeviceRates,
                  cal: Calibration = CALIBRATION, role: str = ROLE_BOTH) -> StepEstimate:
    """Seconds per phase of one steady-state step with ``setting`` (module docstring). ``role``: the phases one
    process runs (train/phases.py's ROLE_TIME): under --rollout-gpus a rollout rank's settings are ranked by its
    rollout alone and a trainer's by its update alone, since neither waits for the other's phases."""
    phases = ROLE_TIME[check_role(role)]
    aqn = base.dims.layers * cal.aqn_layer_s
    if FWD_BWD not in phases:  # a rollout rank: no training pass to cost (its micro-batch never runs)
        return StepEstimate({AQN: aqn, ROLLOUT: _rollout(base, work, setting, rates, cal)})
    c = _train_costs(base, work, setting, rates, cal)
    n_mb = c["micro_batches"]
    recompute = n_mb * _combine(c["fwd"], c["host_nograd"], cal) * (work.old_pass + work.reference_pass)
    gc = setting.gradient_checkpointing
    train_gpu = c["fwd"] + c["bwd"] + (c["gc"] if gc else 0.0)
    train_host = c["host_fwd"] * (2 if gc else 1) + c["host_bwd"]
    n_lora = base.dims.lora_params(work.lora_rank, list(work.lora_targets))
    optimizer = cal.optimizer_fixed_s + n_lora * cal.optimizer_param_s + (
        16 * n_lora / (cal.offload_gbps * 1e9) if setting.optimizer_offload else 0.0)
    # fp32 adapter (4 B) + AdamW's two moments (8 B) per parameter; offloaded moments are lent to the writer, not
    # copied (train/host_offload.py: the step after the checkpoint waits only if the writer outlasts its rollout)
    checkpoint_bytes = (4 if setting.optimizer_offload else 12) * n_lora
    times = {
        AQN: aqn,
        ROLLOUT: _rollout(base, work, setting, rates, cal) if ROLLOUT in phases else 0.0,
        RECOMPUTE: recompute,
        FWD_BWD: n_mb * _combine(train_gpu, train_host, cal),
        OPTIMIZER: optimizer,
        CHECKPOINT: cal.checkpoint_fixed_s + checkpoint_bytes / (cal.checkpoint_gbps * 1e9),
        OTHER: cal.other_s,
    }
    parts = {"train_gpu_s": n_mb * train_gpu, "train_host_s": n_mb * train_host, "micro_batches": n_mb}
    return StepEstimate({p: v for p, v in times.items() if p in phases}, parts)


__all__ = ["CALIBRATION", "DEFAULT_RATES", "PHASES", "Base", "Calibration", "DeviceRates", "Setting",
           "StepEstimate", "Workload", "default_rates", "estimate_step", "gemm_share"]
