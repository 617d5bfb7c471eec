"""Where statements lie in the text: LibCST statements paired with Python's own parser's,
at every depth, for their line spans (``SourceMap``) - so the analysis can skip statements
that cannot matter and number lines without LibCST's position metadata."""

from __future__ import annotations

import ast
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import libcst as cst


# LibCST compound statements and the ast statements they are.
_AST_OF = {
    cst.FunctionDef: (ast.FunctionDef, ast.AsyncFunctionDef), cst.For: (ast.For, ast.AsyncFor),
    cst.With: (ast.With, ast.AsyncWith), cst.ClassDef: (ast.ClassDef,), cst.If: (ast.If,),
    cst.While: (ast.While,), cst.Try: (ast.Try,), cst.Match: (ast.Match,),
    cst.TryStar: (getattr(ast, "TryStar", ast.Try),),  # ast has no TryStar before Python 3.11
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
        found = cls(tree, [b""] + raw.splitlines(), {}, {})
        return found if _map_block(module.body, tree.body, found) else None

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


def _map_block(body: Sequence[cst.BaseStatement], nodes: list[ast.stmt], found: SourceMap) -> bool:
    """Pair LibCST statements with ast ones (a line of ``a; b`` is two), at every depth, into
    ``found``; False where the two trees differ."""
    i = 0
    for stmt in body:
        count = len(stmt.body) if isinstance(stmt, cst.SimpleStatementLine) else 1
        group = nodes[i : i + count]
        i += count
        expected = _AST_OF.get(type(stmt))
        if len(group) != count or (expected is not None and not isinstance(group[0], expected)):
            return False
        first = min(n.lineno for g in group for n in (g, *getattr(g, "decorator_list", ())))  # decorators too
        found.spans[id(stmt)] = (stmt, first, max(g.end_lineno or g.lineno for g in group))
        if expected is not None:
            found.trees[id(stmt)] = group[0]
            pairs = _sub_blocks_of(stmt, group[0])
            if pairs is None or not all(_map_block(b, n, found) for b, n in pairs):
                return False
    return i == len(nodes)


def _sub_blocks_of(
    stmt: cst.BaseStatement, node: ast.stmt
) -> list[tuple[Sequence[cst.BaseStatement], list[ast.stmt]]] | None:
    """The statement lists inside a compound statement, LibCST's and ast's side by side, in
    source order: body, handlers, else (an ``elif``: the ``If`` it holds), finally; a one-line
    suite (``if x: y``) holds small statements: not paired. None where the clauses differ."""
    def clauses(x: Any, absent: object) -> list[Any]:  # the same for either tree
        if isinstance(x, (cst.Match, ast.Match)):
            return [case.body for case in x.cases]
        handlers = [h.body for h in getattr(x, "handlers", ())]
        return [x.body, *handlers, getattr(x, "orelse", absent), getattr(x, "finalbody", absent)]

    suites, blocks = clauses(stmt, None), clauses(node, [])
    if len(suites) != len(blocks):
        return None
    pairs: list[tuple[Sequence[cst.BaseStatement], list[ast.stmt]]] = []
    for suite, nodes in zip(suites, blocks):
        suite = suite.body if isinstance(suite, (cst.Else, cst.Finally)) else suite
        if isinstance(suite, cst.If):  # elif
            pairs.append(([suite], nodes))
        elif suite is None or isinstance(suite, cst.IndentedBlock):  # none: a mismatch where ast has one
            pairs.append((suite.body if suite is not None else [], nodes))
    return pairs
