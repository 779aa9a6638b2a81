"""No module under qerl_cli/ or kernels/ (imported as qerl_kernels) calls or imports another qerl module's
`_private` name: what a module shares, it names publicly, so its private names can change without breaking a
caller elsewhere. Private names of other libraries (torch._utils, a peft config's _register_custom_module) are
not ours to police and are allowed.

What counts (ast): ``from qerl_cli.x import _name``; ``module._name`` on an imported qerl module; and
``obj._name`` on anything but ``self``/``cls`` when ``_name`` is defined in another qerl module and not in the
calling one (a class's private method or attribute reached from outside)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"qerl_cli": ROOT / "qerl_cli", "qerl_kernels": ROOT / "kernels"}

# (file, private name) -> why it is allowed for now. Remove an entry when its owner fixes the call.
ALLOWED: dict[tuple[str, str], str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = (pkg, *path.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def private_members(tree: ast.AST) -> set[str]:
    """Private names a module gives its own objects: class members (methods, class attributes) and the
    ``self._y`` attributes it assigns. (Setting ``other._y`` does not make ``_y`` this module's; its private
    top-level names only matter through an import, checked apart.)"""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(item.name):
                    out.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else \
                    [item.target] if isinstance(item, ast.AnnAssign) else []
                out |= {t.id for t in targets if isinstance(t, ast.Name) and _private(t.id)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            out.add(node.attr)
    return out


def violations(path: Path, module: str, tree: ast.AST, foreign: set[str]) -> list[tuple[int, str, str]]:
    """(line, private name, what) of every reach into another qerl module's private names."""
    own = private_members(tree)
    qerl_aliases: set[str] = set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PACKAGES:
            for a in node.names:
                if _private(a.name) and node.module != module:
                    out.append((node.lineno, a.name, f"from {node.module} import {a.name}"))
                if not _private(a.name):
                    qerl_aliases.add(a.asname or a.name)  # may be a module (from qerl_cli import x)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    qerl_aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        on_module = isinstance(base, ast.Name) and base.id in qerl_aliases
        if on_module or (node.attr in foreign and node.attr not in own):
            out.append((node.lineno, node.attr, ast.unparse(node)))
    return out


def _scan() -> list[str]:
    modules = _modules()
    trees = {m: ast.parse(p.read_text()) for m, p in modules.items()}
    defined = {m: private_members(t) for m, t in trees.items()}
    found = []
    for m, path in modules.items():
        foreign = set().union(*(d for other, d in defined.items() if other != m))
        rel = path.relative_to(ROOT).as_posix()
        for line, name, what in violations(path, m, trees[m], foreign):
            if (rel, name) not in ALLOWED:
                found.append(f"{rel}:{line} {what}")
    return found


def test_the_scanner_catches_each_form(tmp_path: Path) -> None:
    src = ("from qerl_cli.train.trainer import _x, Trainer\nimport qerl_cli.lora as lora\nlora._hidden()\n"
           "def f(t, m):\n    t._generate()\n    m._buffers\n    torch._utils\n    self_ok = 1\n")
    tree = ast.parse(src)
    got = violations(tmp_path / "m.py", "qerl_cli.m", tree, foreign={"_generate", "_hidden"})
    assert [(line, name) for line, name, _ in got] == [(1, "_x"), (3, "_hidden"), (5, "_generate")]
    # a module's own private names are its own business
    tree = ast.parse("class A:\n    def _generate(self): ...\ndef g(a):\n    a._generate()\n")
    assert violations(tmp_path / "m.py", "qerl_cli.m", tree, foreign={"_generate"}) == []


def test_no_module_reaches_into_another_modules_private_names() -> None:
    found = _scan()
    assert not found, ("private names of another qerl module used (make them public with a clear name, or move "
                       "the shared piece to a module both import):\n" + "\n".join(found))


def test_every_allowed_exception_is_still_needed() -> None:
    """An entry whose call was fixed must go, or the list would only grow."""
    modules = _modules()
    trees = {m: ast.parse(p.read_text()) for m, p in modules.items()}
    defined = {m: private_members(t) for m, t in trees.items()}
    used = set()
    for m, path in modules.items():
        foreign = set().union(*(d for other, d in defined.items() if other != m))
        used |= {(path.relative_to(ROOT).as_posix(), name) for _, name, _ in violations(path, m, trees[m], foreign)}
    assert set(ALLOWED) <= used, f"allowed but no longer used: {sorted(set(ALLOWED) - used)}"
