"""The benches' cell names: ``BASE[+ROLLOUT][@ENGINE]`` or a peer's name, parsed in one place.

* ``nvfp4``: the trainer on an NVFP4 base, rollouts by the builtin engine on the same weights.
* ``bf16+int8``: FlashRL mode, the trained model in BF16 and rollouts through a copy quantized to INT8
  (re-quantized after every update).
* ``nvfp4@vllm``: the same trainer with the vLLM rollout engine.
* ``trl``: a peer (another framework's trainer), named as it is.

A cell has either a rollout format or an engine, not both: vLLM serves the trained model's own checkpoint.
Which base and rollout formats exist is the format registry's business (:func:`check_cell`); the grammar
itself knows nothing about formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from qerl_cli.errors import QerlError

ENGINES = ("vllm",)  # engines a cell can name; the builtin engine is the one named by nothing
_NAME = re.compile(r"[a-z0-9_.-]+")


@dataclass(frozen=True)
class Cell:
    """One parsed cell name. ``text`` is the name as given (the key of the cell's result row)."""

    text: str
    base: str  # the trained model's weight format, or the peer's name
    rollout: str | None = None  # FlashRL: the rollout copy's format
    engine: str | None = None  # the rollout engine when not the builtin one
    peer: bool = False  # another framework's trainer, not a qerl cell

    @property
    def builtin(self) -> bool:
        """A qerl cell on qerl's own rollout engine."""
        return not self.peer and self.engine is None

    @property
    def key(self) -> str:
        """``text`` in a form usable in a result field name (``nvfp4@vllm`` -> ``nvfp4_vllm``)."""
        return self.text.replace("@", "_").replace("+", "_")


def parse_cell(text: str, peers: Iterable[str] = ()) -> Cell:
    """``text`` as a :class:`Cell`; ``peers``: the names that stand for a peer's cell. Raises QerlError for text
    outside the grammar (empty parts, a second ``+`` or ``@``, a rollout format and an engine together, an
    engine other than :data:`ENGINES`)."""
    if not isinstance(text, str):
        raise QerlError(f"a bench cell is a name like nvfp4, bf16+int8 or nvfp4@vllm, got {text!r}")
    if text in tuple(peers):
        return Cell(text, text, peer=True)
    name, at, engine = text.partition("@")
    base, plus, rollout = name.partition("+")
    problem = None
    if not base or not _NAME.fullmatch(base):
        problem = "no base format" if not base else f"bad base format {base!r}"
    elif plus and not _NAME.fullmatch(rollout):
        problem = f"bad rollout format {rollout!r}" if rollout else "no rollout format after '+'"
    elif at and engine not in ENGINES:
        problem = f"unknown engine {engine!r} (one of {', '.join(ENGINES)})"
    elif plus and at:
        problem = "a rollout format and an engine together (vLLM serves the trained model's own checkpoint)"
    if problem is not None:
        raise QerlError(f"bad bench cell {text!r}: {problem}; a cell is BASE, BASE+ROLLOUT (FlashRL rollouts) "
                        f"or BASE@{'|'.join(ENGINES)}")
    return Cell(text, base, rollout or None, engine or None)


def check_cell(cell: Cell, bases: Iterable[str], rollouts: Iterable[str]) -> bool:
    """Whether a parsed cell names formats that exist: its base among ``bases``, its rollout among ``rollouts``."""
    if cell.peer:
        return True
    return cell.base in tuple(bases) and (cell.rollout is None or cell.rollout in tuple(rollouts))


__all__ = ["ENGINES", "Cell", "check_cell", "parse_cell"]
