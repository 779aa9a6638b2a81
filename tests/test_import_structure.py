"""The import structure: the kernels import nothing of the application, and no module imports itself back.

Every `import` counts, wherever it sits (module top, inside a function, under `if TYPE_CHECKING:`): a circle
through a type hint still means neither file can be read without the other. `qerl_kernels` is the import name of
`kernels/` (pyproject's package-dir)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"qerl_cli": ROOT / "qerl_cli", "qerl_kernels": ROOT / "kernels"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of both packages."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of both packages that ``name`` imports (``from pkg import mod`` resolves to the submodule)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            # a submodule by its own name; any other name is the module's (a package's __init__)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            # the longest known module the target names (a name imported from a module is that module)
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_a_circle_and_a_type_only_import(tmp_path) -> None:
    """The checker itself: a two-module circle, one side through a TYPE_CHECKING import, is found."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    from p import a\n")
    (tmp_path / "c.py").write_text("import p.a\n")
    modules = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py", "p.c": tmp_path / "c.py"}
    g = {n: imports_of(n, path, modules) for n, path in modules.items()}
    assert g == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert cycles(g) == [["p.a", "p.b"]]


def test_kernels_import_nothing_of_the_application() -> None:
    g = graph()
    bad = {m: sorted(t for t in ts if t.startswith("qerl_cli")) for m, ts in g.items() if m.startswith("qerl_kernels")}
    assert not {m: ts for m, ts in bad.items() if ts}, "kernels/ must not import qerl_cli"


def test_no_import_circles() -> None:
    found = cycles(graph())
    assert not found, "import circles (move the shared piece into the lower module): " + "; ".join(
        " <-> ".join(c) for c in found)
