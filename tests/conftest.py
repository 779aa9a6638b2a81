"""Shared fixtures. Tests run on CPU; the embedded SmolLM2 model is loaded once per session."""

from __future__ import annotations

import os

# Triton kernels run under the interpreter on CPU; this must be set before any kernel module imports.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
