"""The one table from a precision name (``bf16``, ``fp16``, ``fp32``) to a torch dtype.

Every stage that turns a precision string into a dtype asks here, so a new precision is one line. The
names import without torch (the train config validates them torch-free); the dtypes are looked up on use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qerl_cli.errors import QerlError

if TYPE_CHECKING:
    import torch

# precision name -> torch dtype attribute; the order is the order users see
_TORCH_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PRECISIONS: tuple[str, ...] = tuple(_TORCH_NAMES)
# torch's own spellings, accepted where a user may type them (`qerl quantize --dtype float16`)
ALIASES: dict[str, str] = {torch_name: name for name, torch_name in _TORCH_NAMES.items()}


def canonical(name: str) -> str:
    """The short name of a precision (``float16`` -> ``fp16``); a one-line error for an unknown one."""
    key = ALIASES.get(name, name)
    if key not in _TORCH_NAMES:
        raise QerlError(f"unknown precision {name!r}: use one of {', '.join(PRECISIONS)}")
    return key


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a precision name (short or torch spelling)."""
    import torch

    return getattr(torch, _TORCH_NAMES[canonical(name)])


def uses_loss_scaling(name: str) -> bool:
    """fp16 training needs a dynamic loss scale (its range underflows small gradients); bf16/fp32 do not."""
    return canonical(name) == "fp16"
