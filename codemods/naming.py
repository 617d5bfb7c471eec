"""Names as Python's own ``ast`` reads them, parser-free: dotted names (``getattr`` with a
constant name read as an attribute), ``self.`` members, and imports resolved to qualified names, so
that the compile test is known by what it is however the file imports or spells it."""

from __future__ import annotations

import ast
from collections.abc import Mapping


def dotted(node: ast.expr) -> str | None:
    """``a.b.c``; ``getattr(a, "b", <constant>)`` is ``a.b`` (its default stands only where the
    attribute is unset, where the reading knows no value)."""
    parts = []
    while (attr := _attribute(node)) is not None:
        parts.append(attr)
        node = node.value if isinstance(node, ast.Attribute) else node.args[0]  # type: ignore[attr-defined]
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _attribute(node: ast.AST) -> str | None:
    """``b`` of ``a.b``, ``getattr(a, "b")`` and ``getattr(a, "b", <constant>)``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"):
        return None
    args = node.args if not node.keywords and len(node.args) in (2, 3) else []
    name = literal(args[1]) if args and isinstance(args[-1], ast.Constant) else None
    return name if name is not None and name.isidentifier() else None


def self_member(node: ast.AST) -> str | None:
    """``x`` of ``self.x`` (not of ``self.x.y``)."""
    name = dotted(node)  # type: ignore[arg-type]
    return name[5:] if name is not None and name.startswith("self.") and name.count(".") == 1 else None


def callee(call: ast.Call) -> str | None:
    """``f`` of ``f(…)`` and of ``x.f(…)``."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def expression(code: str) -> ast.expr | None:
    """One expression's source as Python's own tree (None: not an expression)."""
    try:
        return ast.parse(f"({code})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


# What `torch.compiler.is_compiling()` is, under any of its public names (dynamo's own test too: vLLM compiles with it).
COMPILE_TESTS = frozenset(
    f"torch.{name}" for name in "compiler.is_compiling compiler.is_dynamo_compiling _dynamo.is_compiling "
    "_dynamo.external_utils.is_compiling _utils.is_compiling".split()
)


def import_table(tree: ast.Module) -> dict[str, str]:
    """Each name an import binds (anywhere in the file), to the qualified name it is bound to."""
    table: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # `import a.b` binds `a`, and says that `a.b` is loaded
                root = alias.name.partition(".")[0]
                table |= {alias.asname: alias.name} if alias.asname else {root: root, alias.name: alias.name}
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                if alias.name != "*":
                    table[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
    return table


def qualified(node: ast.expr, imports: Mapping[str, str]) -> str | None:
    """The dotted name ``node`` is, its first part resolved through the imports."""
    root, dot, rest = (dotted(node) or "").partition(".")
    return imports.get(root, root) + dot + rest if root else None


def is_compiling(node: ast.expr, imports: Mapping[str, str]) -> bool:
    """A call of ``torch.compiler.is_compiling()``, however the file imported or spelled it."""
    if not isinstance(node, ast.Call) or node.args or node.keywords:
        return False
    return qualified(node.func, imports) in COMPILE_TESTS


def literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
