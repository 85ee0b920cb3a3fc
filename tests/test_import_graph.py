"""No import circles inside a package (STYLE.md section 6), `TYPE_CHECKING` imports included.

For every package (``packages/*/src/*`` and ``apps/trainer/src/rl_trainer``) each module is parsed
with :mod:`ast` (nothing is imported or executed) and every import of a module of the same
top-level package is collected, wherever it sits: module level, inside a function or class, under
``if TYPE_CHECKING:`` (a type-only import is still a dependency: it says the two modules are one
concept or that a type belongs lower down). Imports are resolved to files:

- ``import pkg.a.b`` and ``from pkg.a import b`` (``b`` a submodule) import ``pkg/a/b.py`` (or
  ``pkg/a/b/__init__.py``); relative imports are resolved against the importing module;
- ``from pkg.a import name`` (``name`` not a submodule) and ``import pkg`` import the package's
  ``__init__.py``;
- the parent packages that Python also runs on ``import pkg.a.b`` are NOT edges: otherwise every
  ``__init__`` that re-exports its children would close a circle with each child importing a
  sibling by its full path, which says nothing about the design.

The strongly connected components of that graph (Tarjan's algorithm) with more than one file, or a
file importing itself, are the circles. This rule finds the same circles as ``farm-studio look``
(which reported six on the code before issue #35: two in rl_trainer, and one each in rl_agents,
rl_hf, rl_megatron and rl_sglang) with the same files in each; the one difference in method is
that ``farm-studio`` attributes ``from pkg import name`` to the file defining ``name`` where it can
see it (e.g. ``rl_trainer/ray/__init__.py``), which did not change any circle here.

``KNOWN_CIRCLES`` lists the packages that still have a circle, one per line; a package that loses
its circle must have its line deleted in the same commit (the test fails on a stale entry).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

KNOWN_CIRCLES: set[str] = set()


def _package_dirs() -> dict[str, Path]:
    """Map each top-level package name to its source directory."""
    dirs = {
        p.name: p for p in sorted(ROOT.glob("packages/*/src/*")) if (p / "__init__.py").is_file()
    }
    dirs["rl_trainer"] = ROOT / "apps/trainer/src/rl_trainer"
    return dirs


PACKAGES = _package_dirs()


@dataclass
class Graph:
    """The import graph of one package: module name -> {imported module: line numbers}."""

    files: dict[str, Path]
    edges: dict[str, dict[str, list[int]]] = field(default_factory=dict)


def _module_names(pkg: str, src: Path) -> dict[str, Path]:
    """Dotted module name of every ``.py`` file of the package (``__init__`` named by its package)."""
    names = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join([pkg, *parts])] = path
    return names


def _imports(tree: ast.AST, module: str, is_package: bool, files: dict[str, Path], pkg: str):
    """Yield ``(imported module, line)`` for every same-package import anywhere in the tree."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == pkg or alias.name.startswith(pkg + "."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == pkg or target.startswith(pkg + ".")):
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}"
                yield (child if child in files else target), node.lineno


def build_graph(pkg: str) -> Graph:
    """Parse every module of ``pkg`` and return its same-package import graph."""
    files = _module_names(pkg, PACKAGES[pkg])
    graph = Graph(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        out = graph.edges.setdefault(module, {})
        for target, line in _imports(tree, module, path.name == "__init__.py", files, pkg):
            while target not in files and "." in target:  # `import pkg.mod.attr`-style spelling
                target = target.rsplit(".", 1)[0]
            out.setdefault(target, []).append(line)
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """Strongly connected components with a cycle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph.edges:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.edges.get(node, {}):
                    found.append(sorted(component))
    return found


def _rel(path: Path) -> str:
    """The path relative to the repository root when it lies inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def describe(graph: Graph, component: list[str]) -> str:
    """The files of one circle and the imports (file:line -> module) that tie it."""
    members = set(component)
    lines = ["files: " + ", ".join(_rel(graph.files[m]) for m in component)]
    for module in component:
        for target, at in sorted(graph.edges[module].items()):
            if target in members:
                where = ", ".join(str(n) for n in at)
                lines.append(f"  {_rel(graph.files[module])}:{where} imports {target}")
    return "\n".join(lines)


def test_known_circles_names_real_packages():
    """Every entry of KNOWN_CIRCLES is a package this test scans (a typo would pass silently)."""
    assert not KNOWN_CIRCLES - set(PACKAGES), sorted(KNOWN_CIRCLES - set(PACKAGES))


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_no_import_circle(pkg: str):
    """A package outside KNOWN_CIRCLES has no import circle; one inside still has one."""
    graph = build_graph(pkg)
    found = circles(graph)
    if pkg in KNOWN_CIRCLES:
        assert found, (
            f"{pkg} has no import circle any more: remove it from KNOWN_CIRCLES in "
            f"{Path(__file__).relative_to(ROOT)} (stale entry)"
        )
        return
    report = "\n".join(describe(graph, c) for c in found)
    assert not found, (
        f"{pkg} has {len(found)} import circle(s) (STYLE.md section 6):\n{report}\n"
        "Fix: move the shared name (a type, a constant) into a lower module both import, or make "
        "the class own the other part as an object instead of a mixin that imports the class; "
        "a TYPE_CHECKING import counts too."
    )


def test_finds_a_circle_and_relative_imports(tmp_path, monkeypatch):
    """The scanner resolves relative, nested and TYPE_CHECKING imports and reports their circle."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n"
    )
    (pkg / "c.py").write_text("import toy.a\n")
    (pkg / "d.py").write_text("from toy import A\n")
    monkeypatch.setitem(PACKAGES, "toy", pkg)
    graph = build_graph("toy")
    assert graph.edges["toy.a"] == {"toy.sub.b": [2]}
    assert graph.edges["toy.d"] == {"toy": [1]}
    found = circles(graph)
    assert found == [["toy.a", "toy.c", "toy.sub.b"]]
    assert "sub/b.py:3 imports toy.c" in describe(graph, found[0])
