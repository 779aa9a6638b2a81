"""Every `module.NAME` that qerl's code reads off one of its own modules exists there. GPU-only paths (the kernel
self-check, the CUDA dispatch, the decode profiler) never run in CI, so a constant renamed or moved into the
options would otherwise surface only on a GPU machine, as `AttributeError` after minutes of checks."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"qerl_cli": ROOT / "qerl_cli", "qerl_kernels": ROOT / "kernels"}


def _module_name(path: Path) -> str:
    for pkg, folder in PACKAGES.items():
        if folder in path.parents:
            parts = path.relative_to(folder).with_suffix("").parts
            return ".".join((pkg, *parts)).removesuffix(".__init__")
    raise ValueError(path)


def _resolve(target: str, level: int, here: str, is_pkg: bool) -> str:
    if level == 0:
        return target
    base = here.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _bindings(tree: ast.AST, here: str, is_pkg: bool) -> dict[str, set[str]]:
    """Local name -> the qerl modules it is bound to by an import anywhere in the file."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.split(".")[0] in PACKAGES:
                    out.setdefault(a.asname, set()).add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, here, is_pkg)
            if base.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if _is_module(full):
                    out.setdefault(a.asname or a.name, set()).add(full)
    return out


def _rebound(tree: ast.AST) -> set[str]:
    """Names also assigned or used as parameters: their attribute reads may not be the module's."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _reads() -> list[tuple[str, int, str, str]]:
    found = []
    for folder in PACKAGES.values():
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            here = _module_name(path)
            bound = _bindings(tree, here, path.name == "__init__.py")
            bound = {k: v for k, v in bound.items() if k not in _rebound(tree)}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in bound and isinstance(node.ctx, ast.Load)):
                    for mod in bound[node.value.id]:
                        found.append((str(path.relative_to(ROOT)), node.lineno, mod, node.attr))
    return found


def test_the_scan_sees_the_gpu_only_modules() -> None:
    files = {f for f, *_ in _reads()}
    assert {"qerl_cli/bench/kernel_selfcheck.py", "kernels/linear.py", "qerl_cli/rollout/model_runner.py"} <= files


def test_every_attribute_read_off_a_qerl_module_exists() -> None:
    missing = []
    for file, line, mod, attr in _reads():
        try:
            module = importlib.import_module(mod)
        except ImportError as e:  # an optional dependency of that module (vLLM, humming): not this test's subject
            pytest.importorskip(e.name or mod)
            raise
        if not hasattr(module, attr) and not _is_module(f"{mod}.{attr}"):
            missing.append(f"{file}:{line}: {mod} has no attribute {attr!r}")
    assert not missing, "\n".join(missing)
