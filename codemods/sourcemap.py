"""Where statements lie in the text: LibCST statements paired with Python's own parser's,
at every depth, for their line spans (``SourceMap``) - so the analysis can skip statements
that cannot matter and number lines without LibCST's position metadata."""

from __future__ import annotations

import ast
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import libcst as cst


# LibCST compound statements and the ast statements they are.
_AST_OF = {
    cst.FunctionDef: (ast.FunctionDef, ast.AsyncFunctionDef), cst.For: (ast.For, ast.AsyncFor),
    cst.With: (ast.With, ast.AsyncWith), cst.ClassDef: (ast.ClassDef,), cst.If: (ast.If,),
    cst.While: (ast.While,), cst.Try: (ast.Try,), cst.TryStar: (ast.TryStar,), cst.Match: (ast.Match,),
}


@dataclass
class SourceMap:
    """The lines of each statement, at every depth, and Python's own tree: LibCST's positions
    cost more than the analysis itself. Only for skipping statements and numbering lines (what
    a statement holds is read from LibCST); ``of`` is None where the parsers see other statements."""

    tree: ast.Module
    lines: list[bytes]  # 1-based
    spans: dict[int, tuple[cst.CSTNode, int, int]]  # id -> (statement, first line, last line)
    trees: dict[int, ast.stmt]  # id of a compound statement (a def, say) -> the same one in ``tree``

    @classmethod
    def of(cls, module: cst.Module, source: str | bytes) -> SourceMap | None:
        raw = source.encode(module.encoding) if isinstance(source, str) else source
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the file's own warnings ("\d") are not ours
                tree = ast.parse(raw)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        spans: dict[int, tuple[cst.CSTNode, int, int]] = {}
        trees: dict[int, ast.stmt] = {}
        if not _map_block(module.body, tree.body, spans, trees):
            return None
        return cls(tree, [b""] + raw.splitlines(), spans, trees)

    def from_imported(self) -> set[str]:
        """Names that a ``from … import name`` (no ``as``) binds, anywhere in the file."""
        imports = (node for node in ast.walk(self.tree) if isinstance(node, ast.ImportFrom))
        return {alias.name for node in imports for alias in node.names if alias.asname is None}

    def span(self, stmt: cst.CSTNode) -> tuple[int, int] | None:
        entry = self.spans.get(id(stmt))
        return (entry[1], entry[2]) if entry is not None and entry[0] is stmt else None

    def text(self, stmt: cst.CSTNode) -> bytes | None:
        span = self.span(stmt)
        return b"\n".join(self.lines[span[0] : span[1] + 1]) if span else None


def _map_block(
    body: Sequence[cst.BaseStatement], nodes: list[ast.stmt], spans: dict[int, tuple[cst.CSTNode, int, int]],
    trees: dict[int, ast.stmt],
) -> bool:
    """Pair LibCST statements with ast ones (a line of ``a; b`` is two), at every depth;
    False where the two trees differ."""
    i = 0
    for stmt in body:
        count = len(stmt.body) if isinstance(stmt, cst.SimpleStatementLine) else 1
        group = nodes[i : i + count]
        i += count
        expected = _AST_OF.get(type(stmt))
        if len(group) != count or (expected is not None and not isinstance(group[0], expected)):
            return False
        first = min(n.lineno for g in group for n in (g, *getattr(g, "decorator_list", ())))  # decorators too
        spans[id(stmt)] = (stmt, first, max(g.end_lineno or g.lineno for g in group))
        if expected is not None:
            trees[id(stmt)] = group[0]
            pairs = _sub_blocks_of(stmt, group[0])
            if pairs is None or not all(_map_block(b, n, spans, trees) for b, n in pairs):
                return False
    return i == len(nodes)


def _sub_blocks_of(
    stmt: cst.BaseStatement, node: ast.stmt
) -> list[tuple[Sequence[cst.BaseStatement], list[ast.stmt]]] | None:
    """The statement lists inside a compound statement, LibCST's and ast's side by side, in
    source order (a one-line suite, ``if x: y``, holds small statements: not paired)."""
    pairs: list[tuple[Sequence[cst.BaseStatement], list[ast.stmt]]] = []

    def block(suite: cst.BaseSuite, nodes: list[ast.stmt]) -> None:
        if isinstance(suite, cst.IndentedBlock):
            pairs.append((suite.body, nodes))

    if isinstance(stmt, cst.Match):
        if len(stmt.cases) != len(node.cases):  # type: ignore[attr-defined]
            return None
        for case, ast_case in zip(stmt.cases, node.cases, strict=True):  # type: ignore[attr-defined]
            block(case.body, ast_case.body)
        return pairs
    block(stmt.body, node.body)  # type: ignore[attr-defined]
    is_try = isinstance(stmt, (cst.Try, cst.TryStar))
    if is_try:
        if len(stmt.handlers) != len(node.handlers) or (stmt.finalbody is None and node.finalbody):
            return None
        for handler, ast_handler in zip(stmt.handlers, node.handlers, strict=True):
            block(handler.body, ast_handler.body)
    orelse = getattr(stmt, "orelse", None)
    if isinstance(orelse, cst.If):  # elif
        pairs.append(([orelse], node.orelse))  # type: ignore[attr-defined]
    elif orelse is not None:
        block(orelse.body, node.orelse)  # type: ignore[attr-defined]
    elif getattr(node, "orelse", None):
        pairs.append(([], node.orelse))  # type: ignore[attr-defined]  # a mismatch: _map_block says so
    if is_try and stmt.finalbody is not None:
        block(stmt.finalbody.body, node.finalbody)
    return pairs
