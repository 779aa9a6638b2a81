"""qerl's RL algorithms: one class per algorithm (a module per family), one registry.

`ALGORITHMS` maps an algorithm's name to its class, in the order the CLI and the docs list them; `get_algorithm`
is the lookup with a one-line error where a name is read (the config, a manifest, a caller of `policy_loss`).
Code outside this package asks the object (``clipped``, ``defaults``, ``validate``, ``normalizer``, ...) and never
compares an algorithm's name (tests/test_algorithm_guard.py checks that). The manifest and checkpoints keep the
name as text. How to add an algorithm: docs/DEVELOPING.md ("An RL algorithm").
"""

from __future__ import annotations

from qerl_cli.errors import QerlError
from qerl_cli.train.algos.base import Algorithm, AlgorithmConfig, LossSettings, TokenView
from qerl_cli.train.algos.clipped import ClippedAlgorithm
from qerl_cli.train.algos.dapo import DAPO
from qerl_cli.train.algos.dr_grpo import DrGRPO
from qerl_cli.train.algos.grpo import GRPO
from qerl_cli.train.algos.gspo import GSPO
from qerl_cli.train.algos.pg_seq_is import PGSeqIS, PGSeqTIS

ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (GRPO, DAPO, DrGRPO, GSPO, PGSeqIS, PGSeqTIS)}


def get_algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; a one-line QerlError naming the choices."""
    cls = ALGORITHMS.get(name)
    if cls is None:
        raise QerlError(f"unknown loss algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return cls()


def as_algorithm(algo: str | Algorithm) -> Algorithm:
    """``algo`` as its object, for a function that takes a name too (tests and benches pass names)."""
    return algo if isinstance(algo, Algorithm) else get_algorithm(algo)


def clipped_names() -> tuple[str, ...]:
    """The algorithms that take --epsilon/--epsilon-high."""
    return tuple(n for n, cls in ALGORITHMS.items() if cls.clipped)


__all__ = [
    "ALGORITHMS", "DAPO", "GRPO", "GSPO", "Algorithm", "AlgorithmConfig", "ClippedAlgorithm", "DrGRPO",
    "LossSettings", "PGSeqIS", "PGSeqTIS", "TokenView", "as_algorithm", "clipped_names", "get_algorithm",
]
