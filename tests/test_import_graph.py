"""No module of the tool's packages imports in a circle, read statically (ast) from the files.

A circle works only as long as every import in it stays lazy or lands after the names it
needs: one import moved to the top of a file breaks the program at import time. So every
import counts here, at module level, inside a function or under ``if TYPE_CHECKING:``
alike. ``from P import N`` reaches the submodule ``P.N`` where there is one, else ``P``
itself (whose ``__init__`` runs); a package's ``__init__`` is imported by each of its
submodules' imports anyway, so that implicit step is no edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = ("codemods", "rewriter")


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the packages."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports(name: str, file: Path, known: dict[str, Path]) -> dict[str, int]:
    """The modules of ``known`` that ``name`` imports anywhere in its file -> the first line."""
    tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
    package = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in known and target != name:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in known else source, node.lineno)
    return found


def graph(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    return {name: imports(name, file, known) for name, file in known.items()}


def circles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle (a path back to its start) per strongly connected set of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the packages are a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(walk_back(g, set(members), min(members)))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def walk_back(g: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``members`` (breadth first)."""
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in members and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(members)


def describe(g: dict[str, dict[str, int]], known: dict[str, Path], circle: list[str]) -> str:
    return " -> ".join(
        f"{a} ({known[a].relative_to(ROOT)}:{g[a][b]})" for a, b in zip(circle, circle[1:])
    ) + f" -> {circle[-1]}"


def test_no_module_imports_in_a_circle() -> None:
    known = modules()
    assert "rewriter.verify.engine" in known and "codemods.schema" in known
    g = graph(known)
    found = circles(g)
    assert not found, "import circles:\n" + "\n".join(describe(g, known, c) for c in found)


def test_the_reader_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    """The circle this test was written for (issue 30): a level module importing the package
    face inside a function, the face importing the level; and a submodule named in a
    ``from . import`` is the submodule, not the face."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text(
        "from .types import Status\n\ndef run():\n    from .level import go\n    return go()\n"
    )
    (pkg / "sub" / "types.py").write_text("Status = int\n")
    (pkg / "sub" / "level.py").write_text("from . import types\n\ndef go():\n    from . import Status\n    return Status\n")
    known = modules(tmp_path, ("pkg",))
    g = graph(known)
    assert g["pkg.sub.level"] == {"pkg.sub.types": 1, "pkg.sub": 4}
    assert circles(g) == [["pkg.sub", "pkg.sub.level", "pkg.sub"]]
    (pkg / "sub" / "level.py").write_text("from . import types\nfrom .types import Status\n")
    assert circles(graph(modules(tmp_path, ("pkg",)))) == []
