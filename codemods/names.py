"""Python's own tree: names and expressions, parser-free. As in ruff's semantic model, a recogniser asks
what a name *is bound to* (``import_table``, ``qualified``), never how it is spelled: the compile test
(``is_compiling``) is known however the file imports it. And the file's classes: a class's lineage and methods."""

from __future__ import annotations

import ast
import collections
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
    getattr_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
    args = node.args if getattr_call and not node.keywords and len(node.args) in (2, 3) else []  # type: ignore[attr-defined]
    name = literal(args[1]) if args and isinstance(args[-1], ast.Constant) else None
    return name if name is not None and name.isidentifier() else None


def self_member(node: ast.AST) -> str | None:
    """``x`` of ``self.x`` (not of ``self.x.y``)."""
    name = dotted(node)  # type: ignore[arg-type]
    return name[5:] if name is not None and name.startswith("self.") and name.count(".") == 1 else None


def callee(call: ast.Call) -> str | None:
    """``f`` of ``f(…)`` and of ``x.f(…)``."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


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
    """Each name an import binds (anywhere in the file), or a module-level alias of one (``_tc =
    torch.compiler``), to the qualified name it is bound to; a name bound to two things, or also
    bound otherwise (a ``def``, an assignment, a parameter), is none: what it holds is not known."""
    pairs: list[tuple[str, str]] = []
    others: collections.Counter[str] = collections.Counter()  # bindings otherwise than by an import
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):  # `import a.b` binds `a`, and says that `a.b` is loaded
            pairs += [p for x in node.names for p in ([(x.asname, x.name)] if x.asname else [(x.name.split(".")[0],) * 2, (x.name,) * 2])]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            pairs += [(x.asname or x.name, f"{base}.{x.name}" if base else x.name) for x in node.names if x.name != "*"]
        stored = [node.id] if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) else []
        others.update([node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else [node.arg] if isinstance(node, ast.arg) else stored)
    table: dict[str, str] = {}
    for name, target in pairs:
        table[name] = target if table.get(name, target) == target else ""
    table = {k: v for k, v in table.items() if v and k not in others}
    for stmt in tree.body:  # `NAME = <an imported dotted name>`, bound once
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if isinstance(target, ast.Name) and others[target.id] == 1 and (dotted(stmt.value) or ".").split(".")[0] in table:
            table[target.id] = qualified(stmt.value, table)  # type: ignore[assignment]
    return table


def qualified(node: ast.expr, imports: Mapping[str, str]) -> str | None:
    """The dotted name ``node`` is, its first part resolved through the imports."""
    root, dot, rest = (dotted(node) or "").partition(".")
    return imports.get(root, root) + dot + rest if root else None


def is_compiling(node: ast.expr, imports: Mapping[str, str]) -> bool:
    """A call of ``torch.compiler.is_compiling()``, however the file imported or spelled it."""
    bare = isinstance(node, ast.Call) and not node.args and not node.keywords
    return bare and qualified(node.func, imports) in COMPILE_TESTS  # type: ignore[attr-defined]


def lineage(cls: ast.ClassDef, module: ast.Module) -> list[ast.ClassDef]:
    """The class, then its bases where the module defines them (a mixin), left to right, depth first."""
    classes = {c.name: c for c in module.body if isinstance(c, ast.ClassDef)}
    order, todo = [], [cls]
    while todo:
        if (c := todo.pop(0)) not in order:
            order.append(c)
            todo[:0] = [classes[b.id] for b in c.bases if isinstance(b, ast.Name) and b.id in classes]
    return order


def class_methods(cls: ast.ClassDef, module: ast.Module) -> dict[str, ast.FunctionDef]:
    """What ``self.<name>(…)`` reaches: the last def of that name in the first class of the lineage."""
    return {f.name: f for c in reversed(lineage(cls, module)) for f in c.body if isinstance(f, ast.FunctionDef)}


def literal(node: ast.AST) -> str | None:
    """A string constant's value."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
