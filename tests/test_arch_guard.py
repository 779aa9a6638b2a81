"""No product code outside `qerl_cli/arch/` decides by a model architecture or spells a projection's name: it asks
the architecture's spec (`qerl_cli.arch.spec_for`). A comparison, membership test, `case` or dict keyed by a
model type is a decision that belongs to the spec; a `model_type` compared with anything is one too; and any string
literal that is one of the seven projection names is a spelling that belongs to the spec (the names as data, a
default, a label: all of them come from the spec, so a renamed architecture changes them everywhere)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from qerl_cli.arch import model_types
from tests.helpers import name_decisions

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("qerl_cli", "kernels")
ARCH_PACKAGE = "qerl_cli/arch/"
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a projection name as a whole string or a dotted part of one (an f-string's ".0.gate_proj.weight" too)
PROJECTION_PART = re.compile(rf"(^|\.)({'|'.join(PROJECTION_NAMES)})(\.|$)")


def arch_decisions(source: str) -> list[tuple[int, str]]:
    """Decisions on a model type (inline, or a module constant holding any), comparisons of a ``model_type``
    attribute or variable, and projection names as string literals."""
    found = name_decisions(source, model_types(), "model type")
    tree = ast.parse(source)
    # a docstring may name a projection to explain the code; only the code's own strings are spellings
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                if (isinstance(operand, ast.Attribute) and operand.attr == "model_type") or (
                        isinstance(operand, ast.Name) and operand.id == "model_type") or (
                        isinstance(operand, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "model_type"
                                                              for a in operand.args)):
                    found.append((node.lineno, "compares a model_type"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and PROJECTION_PART.search(node.value):
            found.append((node.lineno, f"spells {node.value!r}"))
    return sorted(set(found))


def test_the_checker_finds_what_it_bans() -> None:
    found = arch_decisions(
        'if cfg.model_type == "qwen2": pass\n'
        'x = getattr(cfg, "model_type", None) in SUPPORTED\n'
        'y = {"llama": 1, "qwen3": 2}.get(t)\n'
        'match t:\n    case "qwen3_moe": pass\n'
        'TYPES = ("llama", "qwen2")\n'
        'if t not in TYPES: pass\n'
        'targets = ["q_proj", "v_proj"]\n'
        'name = f"mlp.{p.down}"\n'
        'key = f"{prefix}.0.gate_proj.weight"\n'
        '"""A docstring may say q_proj."""\n'
        'label = "llama" if a else "qwen2"\n'
        'ok = fmt == "nvfp4"\n')
    # a conditional label, a projection name from a spec and other names are not decisions
    assert [line for line, _ in found] == [1, 1, 2, 3, 5, 7, 8, 8, 10]
    assert {what.split()[0] for _, what in found} == {"compares", "dict", "matches", "spells"}


def test_no_architecture_is_decided_outside_the_arch_package() -> None:
    offenders = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ARCH_PACKAGE):
                continue
            offenders += [f"{rel}:{line}: {what}" for line, what in arch_decisions(path.read_text())]
    assert not offenders, ("ask the architecture's spec (qerl_cli.arch.spec_for(config_or_model)) instead; a new "
                           "architecture is a module under qerl_cli/arch/ (docs/DEVELOPING.md):\n"
                           + "\n".join(offenders))
