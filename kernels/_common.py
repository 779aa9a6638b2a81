"""Shared pieces of qerl's Triton kernels: the interpreter switch, dtype helpers, tile configs.

Under `TRITON_INTERPRET=1` (the CPU tests) Triton runs kernels through numpy, where bf16 arithmetic
and bf16 `tl.dot` are silently wrong, fp32->bf16 casts truncate, fp32->fp8 does not saturate and
inline PTX cannot run. Every kernel therefore takes a `F32` constexpr: it upcasts all loads to fp32,
decodes FP4 with plain integer arithmetic instead of inline asm, and multiplies in fp32. The GPU
build of the same kernel is the 16-bit tensor-core path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class KernelSettingError(ValueError):
    """A kernel setting (a backend name, an environment variable) that cannot work here. The message says what to
    choose instead; an application reports it as the user's error (qerl's CLI: one line, exit code 2)."""

    exit_code = 2

# Decode modes of the FP4 weight decoder (the `DECODE` constexpr of the kernels).
DECODE_ASM = 0  # inline PTX: 8 nibbles -> 8 16-bit values by shifting the magnitude bits into the exponent
DECODE_ARITH = 1  # integer arithmetic into fp32 bits (interpreter-safe, also runs on any GPU)
DECODE_LUT = 2  # gather from a 16-entry fp32 table in global memory (fallback / cross-check)


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. `split_k` > 1 makes a deterministic two-pass split-K reduction."""

    bm: int
    bn: int
    bk: int
    warps: int = 4
    stages: int = 3
    split_k: int = 1

    def key(self) -> str:
        return f"m{self.bm}n{self.bn}k{self.bk}w{self.warps}s{self.stages}x{self.split_k}"


def interpreter_config(cfg: TileConfig) -> TileConfig:
    """Interpreter runs are for correctness only: one pipeline stage and one warp group keep them fast."""
    return TileConfig(cfg.bm, cfg.bn, cfg.bk, 4, 1, cfg.split_k)


def launch_config(cfg: TileConfig) -> TileConfig:
    """The tile config a launch uses: `cfg` on the GPU, `interpreter_config(cfg)` under the interpreter."""
    return interpreter_config(cfg) if INTERPRET else cfg


def f32_path(x: torch.Tensor) -> bool:
    """The `F32` constexpr for activations x: fp32 activations, or any under the interpreter."""
    return INTERPRET or x.dtype == torch.float32


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host side of a launch: `triton.cdiv` is a constexpr function in recent Triton, ~1-4 us
    of Python per call, and a training step computes a few per linear per pass."""
    return -(-a // b)


def split_k_for(tiles: int, k: int, bk: int, sms: int, max_split: int = 16, waves: int = 2) -> int:
    """Smallest power-of-two split of K giving >= `waves` CTAs per SM, keeping >= 2 K-tiles per split."""
    ktiles = cdiv(k, bk)
    split = 1
    while tiles * split < waves * sms and split * 2 <= max_split and ktiles // (split * 2) >= 2:
        split *= 2
    return split


_SMS: dict[int, int] = {}


def device_index(device: torch.device | None) -> int:
    """The CUDA device index ``device`` names, the current device where it names none."""
    return device.index if device is not None and device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device_index(device)
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]
