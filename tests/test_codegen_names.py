"""The names `run` writes live in codegen alone: every other module of the tool knows a piece
of a bypass by what it does, and names it by the file's own name for it. A literal of one of
those names anywhere else (docstrings and comments aside) fails here, naming file and line,
as tests/test_import_graph.py does for circles."""

from __future__ import annotations

import ast
import re

from conftest import ROOT

from codemods import codegen

WRITTEN = (codegen.FP8_FLAG, codegen.FP8_SCALE, codegen.INSERT_KV, codegen.GUARD_NAME)
NAMED = re.compile(r"\b(" + "|".join(map(re.escape, WRITTEN)) + r")\b")


def _docstrings(tree: ast.Module) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def test_the_names_run_writes_are_codegens_alone() -> None:
    sources = [*(ROOT / "codemods").glob("*.py"), *(ROOT / "rewriter").rglob("*.py")]
    sources = [p for p in sources if p.name != "codegen.py" and "data" not in p.relative_to(ROOT).parts]
    assert len(sources) > 20
    found = []
    for path in sources:
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if NAMED.search(node.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:70]!r}")
    assert not found, "names run writes, outside codegen:\n" + "\n".join(found)


def test_the_check_sees_such_a_literal(tmp_path) -> None:
    tree = ast.parse(f'"""a docstring naming {codegen.FP8_FLAG}"""\nMESSAGE = "`{codegen.INSERT_KV}` is missing"\n')
    literals = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in _docstrings(tree)]
    assert [s for s in literals if NAMED.search(s)] == [f"`{codegen.INSERT_KV}` is missing"]
