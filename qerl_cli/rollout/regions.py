"""Named ranges of the decode step for the profiler: ``region(name)`` around the host calls that launch a piece.

Kernel names alone cannot tell a LoRA GEMM from the lm_head GEMM (both are cuBLAS kernels), so the decode path
marks its pieces. A region is a ``torch.profiler.record_function`` range ``qerl.<name>`` while ``profiling()``
is on and a free no-op otherwise (inside a captured CUDA graph the ranges cost nothing at replay). The
layers open regions; ``bench/decode_profile.py`` turns them into GPU-time categories.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

PREFIX = "qerl."  # every region's profiler range starts with it
_active = False


def region(name: str) -> contextlib.AbstractContextManager[Any]:
    """A profiler range ``qerl.<name>`` while ``profiling()`` is on, else a free no-op."""
    if _active:
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()


@contextlib.contextmanager
def profiling() -> Iterator[None]:
    """Regions record profiler ranges inside this block."""
    global _active
    old, _active = _active, True
    try:
        yield
    finally:
        _active = old
