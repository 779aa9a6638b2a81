"""The one table from a precision name (``bf16``, ``fp16``, ``fp32``) to a torch dtype.

Every stage that turns a precision string into a dtype asks here, so a new precision is one line.
"""

from __future__ import annotations

import torch

from qerl_cli.errors import QerlError

PRECISIONS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# torch's own spellings, accepted where a user may type them (`qerl quantize --dtype float16`)
ALIASES: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def canonical(name: str) -> str:
    """The short name of a precision (``float16`` -> ``fp16``); a one-line error for an unknown one."""
    key = ALIASES.get(name, name)
    if key not in PRECISIONS:
        raise QerlError(f"unknown precision {name!r}: use one of {', '.join(PRECISIONS)}")
    return key


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a precision name (short or torch spelling)."""
    return PRECISIONS[canonical(name)]


def uses_loss_scaling(name: str) -> bool:
    """fp16 training needs a dynamic loss scale (its range underflows small gradients); bf16/fp32 do not."""
    return canonical(name) == "fp16"
