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
    cst.FunctionDef: (ast.FunctionDef, ast.AsyncFunctionDef),
    cst.ClassDef: (ast.ClassDef,),
    cst.If: (ast.If,),
    cst.For: (ast.For, ast.AsyncFor),
    cst.While: (ast.While,),
    cst.With: (ast.With, ast.AsyncWith),
    cst.Try: (ast.Try,),
    cst.TryStar: (ast.TryStar,),
    cst.Match: (ast.Match,),
}


@dataclass
class SourceMap:
    """The lines of each statement, at every depth, and Python's own tree.

    LibCST gives positions only by generating them for every node of the file,
    which costs more than the analysis itself; Python's parser gives them for
    free. Used only to skip statements that cannot matter and to number lines:
    what a statement is and holds is still read from LibCST. ``of`` returns
    None where the two parsers do not see the same statements.
    """

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
        names: set[str] = set()
        stack: list[ast.stmt] = list(self.tree.body)
        while stack:
            stmt = stack.pop()
            if isinstance(stmt, ast.ImportFrom):
                names.update(alias.name for alias in stmt.names if alias.asname is None)
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(stmt, field, ()):
                    stack += child.body if isinstance(child, (ast.excepthandler, ast.match_case)) else [child]
        return names

    def span(self, stmt: cst.CSTNode) -> tuple[int, int] | None:
        entry = self.spans.get(id(stmt))
        return (entry[1], entry[2]) if entry is not None and entry[0] is stmt else None

    def text(self, stmt: cst.CSTNode) -> bytes | None:
        span = self.span(stmt)
        return b"\n".join(self.lines[span[0] : span[1] + 1]) if span else None


def _map_block(
    body: Sequence[cst.BaseStatement],
    nodes: list[ast.stmt],
    spans: dict[int, tuple[cst.CSTNode, int, int]],
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
        first = min(
            min((d.lineno for d in getattr(g, "decorator_list", ())), default=g.lineno) for g in group
        )
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
    """The statement lists inside a compound statement, LibCST's and ast's side by side.

    One-line suites (``if x: y``) hold small statements, not statements: not paired.
    """
    pairs: list[tuple[Sequence[cst.BaseStatement], list[ast.stmt]]] = []

    def block(suite: cst.BaseSuite, nodes: list[ast.stmt]) -> None:
        if isinstance(suite, cst.IndentedBlock):
            pairs.append((suite.body, nodes))

    def orelse(other: cst.Else | None, nodes: list[ast.stmt]) -> None:
        if other is not None:
            block(other.body, nodes)
        elif nodes:
            pairs.append(([], nodes))  # a mismatch: _map_block says so

    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef, cst.With)):
        block(stmt.body, node.body)  # type: ignore[attr-defined]
    elif isinstance(stmt, (cst.For, cst.While)):
        block(stmt.body, node.body)  # type: ignore[attr-defined]
        orelse(stmt.orelse, node.orelse)  # type: ignore[attr-defined]
    elif isinstance(stmt, cst.If):
        assert isinstance(node, ast.If)
        block(stmt.body, node.body)
        if isinstance(stmt.orelse, cst.If):  # elif
            pairs.append(([stmt.orelse], node.orelse))
        else:
            orelse(stmt.orelse, node.orelse)
    elif isinstance(stmt, (cst.Try, cst.TryStar)):
        assert isinstance(node, (ast.Try, ast.TryStar))
        if len(stmt.handlers) != len(node.handlers):
            return None
        block(stmt.body, node.body)
        for handler, ast_handler in zip(stmt.handlers, node.handlers, strict=True):
            block(handler.body, ast_handler.body)
        orelse(stmt.orelse, node.orelse)
        if stmt.finalbody is not None:
            block(stmt.finalbody.body, node.finalbody)
        elif node.finalbody:
            return None
    elif isinstance(stmt, cst.Match):
        assert isinstance(node, ast.Match)
        if len(stmt.cases) != len(node.cases):
            return None
        for case, ast_case in zip(stmt.cases, node.cases, strict=True):
            block(case.body, ast_case.body)
    return pairs
