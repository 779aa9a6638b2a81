"""Which preset `qerl train` runs when the user names none: one decision, stated on the console's first line.

On a machine without CUDA the CPU-sized arith run. On a GPU the mission's recipe, DAPO + AQN: for the embedded
SmolLM2-135M the arith run sized for one GPU (it learns visibly in a couple of minutes), for any other model
QeRL's DAPO LoRA settings (rank 32, alpha 64, AQN on the paper's schedule, clip-higher, dynamic sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qerl_cli.errors import QerlError

CPU_PRESET = "quick_cpu"
GPU_EMBEDDED_PRESET = "gpu_arith"
GPU_PRESET = "gsm8k_dapo_paper"


@dataclass(frozen=True)
class PresetChoice:
    """The preset a run uses and why, for the console's first line and the manifest."""

    name: str
    reason: str
    chosen_by_default: bool  # False: the user named it with --config


def _quantized_from_embedded(run_dir: Path) -> bool | None:
    """Whether the run's base was quantized from the embedded model (None: the run has no quantize record yet)."""
    from qerl_cli.manifest import RunDir

    try:
        record = RunDir(run_dir, create=False).record("quantize")
    except QerlError:
        return None
    if not record:
        return None
    source = record.get("inputs", {}).get("model", {})
    return isinstance(source, dict) and source.get("kind") == "embedded"


def choose_preset(config: str | None, run_dir: Path, on_cuda: bool) -> PresetChoice:
    """``config`` when the user gave one, else the default for this machine and the run's model."""
    if config is not None:
        return PresetChoice(config, "named by --config", chosen_by_default=False)
    if not on_cuda:
        return PresetChoice(CPU_PRESET, "no CUDA device: the CPU-sized arith run (GRPO, AQN, LoRA r16)", True)
    if _quantized_from_embedded(run_dir) is False:
        return PresetChoice(GPU_PRESET, "a CUDA device and a model other than the embedded one: QeRL's DAPO LoRA "
                            "settings on GSM8K (AQN, LoRA r32, alpha 64, lr 1e-5)", True)
    return PresetChoice(GPU_EMBEDDED_PRESET, "a CUDA device and the embedded SmolLM2-135M: DAPO + AQN on mixed-level "
                        "arith, 64 x 8 samples per step, about 2 minutes on one H100", True)
