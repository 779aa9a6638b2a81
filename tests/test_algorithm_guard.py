"""No product code outside `qerl_cli/train/algos/` decides by an RL algorithm's name: it asks the algorithm object
(`TrainConfig.algorithm`, `get_algorithm`). Names as plain data (a bench's grid, a preset, a label) are fine; a
comparison, a membership test, a `case` or a dict keyed by them is a decision that belongs to the algorithm."""

from __future__ import annotations

from pathlib import Path

from qerl_cli.train.algos import ALGORITHMS
from qerl_cli.train.config import FIELD_HELP, field_choices
from tests.helpers import name_decisions

ROOT = Path(__file__).resolve().parents[1]
ALGOS_PACKAGE = "qerl_cli/train/algos/"


def algorithm_name_decisions(source: str) -> list[tuple[int, str]]:
    """A comparison or membership test with an algorithm name (inline, or a module constant holding any), a `case`
    on one, a dict keyed by one."""
    return name_decisions(source, ALGORITHMS, "algorithm")


def test_the_checker_finds_what_it_bans() -> None:
    found = algorithm_name_decisions(
        'if cfg.algo == "dapo": pass\n'
        'x = algo in ("dapo", "gspo")\n'
        'y = {"dapo": 1.0, "dr_grpo": 2.0}.get(algo, 3.0)\n'
        'match algo:\n    case "pg_seq_is": pass\n'
        'CLIPPED: tuple[str, ...] = ("grpo", "dapo")\n'
        'if algo not in CLIPPED: pass\n'
        'fields = {"algo": "dapo", "steps": 3}\n'
        'label = "grpo" if a else "dapo"\n'
        'grid = [("bf16", "grpo"), ("fp16", "pg_seq_is")]\n'
        'ok = precision == "bf16"\n')
    # a value in a dict, a conditional label, a bench grid and other names are not decisions
    assert [line for line, _ in found] == [1, 2, 2, 3, 5, 7]
    assert {what.split()[0] for _, what in found} == {"compares", "dict", "matches"}


def test_no_algorithm_name_is_compared_outside_the_algorithms_package() -> None:
    offenders = []
    for path in sorted((ROOT / "qerl_cli").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ALGOS_PACKAGE):
            continue
        offenders += [f"{rel}:{line}: {what}" for line, what in algorithm_name_decisions(path.read_text())]
    assert not offenders, ("ask the algorithm object (TrainConfig.algorithm, qerl_cli.train.algos.get_algorithm) "
                           "instead:\n" + "\n".join(offenders))


def test_the_cli_choices_and_help_come_from_the_registry() -> None:
    assert field_choices("algo") == tuple(ALGORITHMS)
    assert FIELD_HELP["algo"] == ", ".join(ALGORITHMS)
