"""`qerl bench mismatch`'s workload defaults, declared once: the bench's function and the CLI's options both read
them. No torch here, so the CLI can read them before it parses (its heavy imports wait for the command to run)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MismatchSettings:
    precisions: tuple[str, ...] = ("bf16", "fp16", "fp32")
    formats: tuple[str, ...] = ("bf16", "nvfp4", "mxfp4", "int8", "fp8")
    task: str = "arith"
    prompts: int = 16
    samples: int = 4
    max_tokens: int = 32
    temperature: float = 1.0
    seed: int = 0
    device: str = "cpu"
    prompt_len: int = 64  # random prompts' length with a shape (a random model)


DEFAULTS = MismatchSettings()

__all__ = ["DEFAULTS", "MismatchSettings"]
