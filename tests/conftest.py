"""Shared fixtures. Tests run on CPU; the embedded SmolLM2 model is loaded once per session."""

from __future__ import annotations

import os

# Triton kernels run under the interpreter on CPU; this must be set before any kernel module imports.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct in fp32 with its tokenizer (loaded once per session)."""
    import torch

    from qerl_cli.models import load_model

    torch.manual_seed(0)
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def quantized_runs(embedded, tmp_path_factory):
    """One run directory per format, quantized from the shared embedded model."""
    from qerl_cli.quantize import quantize_model

    runs = {}
    for fmt in ("nvfp4", "mxfp4", "int4", "int8", "fp8", "nf4", "bf16"):
        path = tmp_path_factory.mktemp(f"run_{fmt}")
        runs[fmt] = quantize_model(path, None, fmt=fmt, loaded=embedded)
    return runs
