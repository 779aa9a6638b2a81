"""The phases of one RL step, in order: the one definition the trainer, the memory plan, the cost model, the
console and the benches read.

A step runs AQN's noise draw, the rollout, the no-grad pi_old pass, forward + backward, the optimizer step, the
rollout copy's re-quantization (FlashRL) and the checkpoint; ``setup`` is before the first step and ``other`` is
a step's wall time the phases leave over (advantages, batch building, bookkeeping).

The trainer logs each phase as ``timing/<phase>_s`` and, on CUDA, ``memory/<phase>_peak_gb`` and
``memory/<phase>_end_gb`` (metrics.jsonl, for users); code reads the same numbers typed, as a :class:`StepRecord`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

SETUP = "setup"
AQN = "aqn"
ROLLOUT = "rollout"
RECOMPUTE = "recompute"
FWD_BWD = "fwd_bwd"
OPTIMIZER = "optimizer"
REQUANT = "requant"
CHECKPOINT = "checkpoint"
OTHER = "other"

# what the trainer times and tracks the peak memory of, in the order a step runs them
STEP_PHASES = (AQN, ROLLOUT, RECOMPUTE, FWD_BWD, OPTIMIZER, REQUANT, CHECKPOINT)
# the update's phases: their largest peak is memory/train_peak_gb
TRAIN_PHASES = (FWD_BWD, OPTIMIZER, REQUANT)
# the memory plan's estimates: after setup, then each step phase (the re-quantization peaks inside the update's
# budget, one layer at a time, so it has no estimate of its own)
PLANNED_MEMORY = (SETUP, *(p for p in STEP_PHASES if p != REQUANT))
# the cost model's estimates: the step phases and the rest of the step's wall time
PLANNED_TIME = (*(p for p in STEP_PHASES if p != REQUANT), OTHER)

# The role a process plays in a step. "both": it runs every phase (one process, or data-parallel ranks); under
# --rollout-gpus (train/disagg.py) a trainer rank runs only the update and a rollout rank only AQN's draw and the
# rollout, so each one's memory plan counts, and its cost model times, only its own phases.
ROLE_BOTH, ROLE_TRAIN, ROLE_ROLLOUT = "both", "train", "rollout"
ROLES = (ROLE_BOTH, ROLE_TRAIN, ROLE_ROLLOUT)
ROLE_TIME = {ROLE_BOTH: PLANNED_TIME, ROLE_TRAIN: (RECOMPUTE, FWD_BWD, OPTIMIZER, CHECKPOINT, OTHER),
             ROLE_ROLLOUT: (AQN, ROLLOUT)}
# the planned memory phases each role goes through (setup: every role loads the base and the adapters)
ROLE_MEMORY = {role: tuple(p for p in PLANNED_MEMORY if p == SETUP or p in phases) for role, phases in
               ROLE_TIME.items()}


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} ({', '.join(ROLES)})")
    return role


def timing_key(phase: str) -> str:
    return f"timing/{phase}_s"


def peak_key(phase: str) -> str:
    return f"memory/{phase}_peak_gb"


def end_key(phase: str) -> str:
    return f"memory/{phase}_end_gb"


@dataclass(frozen=True)
class PhaseRecord:
    """One phase of one step as the trainer measured it; ``peak_gb`` / ``end_gb`` (CUDA only, else None): the most
    allocated during the phase and what stayed allocated after it."""

    seconds: float = 0.0
    peak_gb: float | None = None
    end_gb: float | None = None


@dataclass(frozen=True)
class StepRecord:
    """What one step measured, for code (benches) to read: each step phase, and the rollout's own split (its engine's
    prefill and decode, the tokens it generated, its decode token-steps). ``pi_old_pass``: whether pi_old took a
    no-grad pass of its own (else the update's forward supplied it). The checkpoint is timed by the caller that
    writes it, so its record here is empty."""

    phases: dict[str, PhaseRecord] = field(default_factory=dict)
    rollout_tokens: float = 0.0
    rollout_prefill_s: float = 0.0
    rollout_decode_s: float = 0.0
    decode_steps: float = 0.0
    pi_old_pass: bool = True

    def seconds(self, phase: str) -> float:
        return self.phases[phase].seconds if phase in self.phases else 0.0

    def peak_gb(self, phase: str) -> float | None:
        return self.phases[phase].peak_gb if phase in self.phases else None

    def end_gb(self, phase: str) -> float | None:
        return self.phases[phase].end_gb if phase in self.phases else None

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> StepRecord:
        """The record of a step's metrics line (the keys this module names)."""
        phases = {p: PhaseRecord(float(metrics.get(timing_key(p), 0.0)), metrics.get(peak_key(p)),
                                 metrics.get(end_key(p))) for p in STEP_PHASES}
        return cls(phases, rollout_tokens=float(metrics.get("timing/rollout_tokens", 0.0)),
                   rollout_prefill_s=float(metrics.get("timing/rollout_prefill_s", 0.0)),
                   rollout_decode_s=float(metrics.get("timing/rollout_decode_s", 0.0)),
                   decode_steps=float(metrics.get("rollout/decode_steps", 0.0)),
                   pi_old_pass=bool(metrics.get("timing/pi_old_pass", 1.0)))


class PhaseClock:
    """The phase a step is in and its clock, shared by the rollout side and the update side (and read by the console
    and the benches): ``phase`` names where a step ran out of memory, ``on_phase`` is called as each phase starts and
    ``on_progress`` as a long phase gets on (micro-batches, tool calls: a CPU update runs for minutes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phase = SETUP
        self.on_phase: Callable[[str], None] | None = None
        self.on_progress: Callable[[str], None] | None = None

    def clock(self) -> float:
        """perf_counter after the device's queued work: CUDA phases would otherwise bleed into the next."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def enter(self, phase: str) -> None:
        self.phase = phase
        if self.on_phase is not None:
            self.on_phase(phase)

    def progress(self, text: str) -> None:
        if self.on_progress is not None:
            self.on_progress(text)

    def record_peak(self, metrics: dict[str, Any], phase: str) -> None:
        """Record this phase's CUDA peak (and what stays allocated after it) and restart the count for the next."""
        if self.device.type == "cuda":
            metrics[peak_key(phase)] = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics[end_key(phase)] = torch.cuda.memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
