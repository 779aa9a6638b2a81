"""The trainer joins two sides: a rollout side (train/rollouter.py) and an update side (train/updater.py), with
bookkeeping apart (train/bookkeeping.py). These guards keep the hub from growing back: the Trainer stays small, the
kind of episode is chosen once (no branch on it in the step), and the modules that work on the step take the typed
sides, not the trainer as ``Any``."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "qerl_cli" / "train"


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_trainer_has_at_most_20_methods() -> None:
    cls = _class(ROOT / "trainer.py", "Trainer")
    defs = [n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(defs) <= 20, f"Trainer has {len(defs)} methods (properties included): {defs}"


def test_the_step_never_asks_which_kind_of_episode_it_runs() -> None:
    """Single- and multi-turn episodes are two EpisodeKinds chosen at setup: no `if ... episodes ...` anywhere in the
    sides or the loop."""
    from qerl_cli.train.rollouter import Rollouter
    from qerl_cli.train.trainer import Trainer
    from qerl_cli.train.updater import PolicyUpdater

    for cls in (Trainer, Rollouter, PolicyUpdater):
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for node in ast.walk(tree):
            if isinstance(node, ast.If | ast.IfExp):
                names = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
                names |= {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
                assert "episodes" not in names, f"{cls.__name__} branches on the episodes at line {node.lineno}"


def test_the_step_modules_take_the_typed_sides() -> None:
    """modes, the step backends, async_rollout and disagg hold no ``self.t`` and take no trainer/worker typed Any."""
    for name in ("modes.py", "step_backend.py", "distributed.py", "fsdp.py", "async_rollout.py", "disagg.py"):
        tree = ast.parse((ROOT / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                assert node.attr != "t", f"{name}:{node.lineno} reaches the trainer through self.t"
            if isinstance(node, ast.arg) and node.arg in {"trainer", "worker", "rollouter", "updater", "sides"}:
                hint = ast.unparse(node.annotation) if node.annotation is not None else "Any"
                assert hint != "Any", f"{name}:{node.lineno} takes {node.arg} typed Any"
