"""The one place that decides which device a stage runs on.

A stage asks :func:`pick` (an explicit ``--device`` wins, else CUDA where visible, else CPU) or
:func:`require_cuda` (GPU-only work: one clear line where there is none).
"""

from __future__ import annotations

import torch

from qerl_cli.errors import QerlError


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick(requested: str | torch.device | None = None) -> torch.device:
    """The device a stage runs on: ``requested`` when given (checked), else ``cuda`` where visible, else ``cpu``."""
    if requested is None or requested == "":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(requested)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise QerlError(f"--device {requested} is not a device qerl runs on: use cpu or cuda (cuda:N for one GPU)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QerlError(f"--device {requested} asked for but no CUDA GPU is visible; use --device cpu")
    return dev


def require_cuda(what: str) -> torch.device:
    """The CUDA device for GPU-only work (``what`` names it in the error)."""
    if not torch.cuda.is_available():
        raise QerlError(f"{what} needs a CUDA GPU; none is visible here")
    return torch.device("cuda")


def empty_cache() -> None:
    """Give cached allocator blocks back between benchmark cells (nothing to do on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
