"""Structural finders shared by classification and rewriting.

Everything here locates code by its shape (a call of the fused op, an
assignment to ``self.<attr>``, a guard ``X if flag else None``), never by line
number or by the text around it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

# The op schema and the bypass's names live in `schema` (no parser attached),
# shared with the ast triage; they are re-exported here for the finders' users.
from codemods.schema import (
    FP8_FLAG as FP8_FLAG,
    FUSED_OP as FUSED_OP,
    INDEX_CACHE as INDEX_CACHE,
    INDEX_SLOT_MAPPING as INDEX_SLOT_MAPPING,
    INSERT_KV as INSERT_KV,
    KV_CACHE as KV_CACHE,
    KV_CACHE_DTYPE as KV_CACHE_DTYPE,
    NUM_HEADS as NUM_HEADS,
    NUM_INDEX_HEADS as NUM_INDEX_HEADS,
    NUM_KV_HEADS as NUM_KV_HEADS,
    QKV as QKV,
    RESHAPE_OP as RESHAPE_OP,
    SLOT_MAPPING as SLOT_MAPPING,
    OpParam as OpParam,
    bind_arg,
)

# Plain isinstance tests rather than libcst.matchers: importing the matchers
# costs more than parsing an 80 KB model file (``python -X importtime``).


def callee_name(call: cst.Call) -> str | None:
    """``f`` of ``f(…)`` and of ``a.b.f(…)``; None for any other callee."""
    func = call.func
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return None


def is_fused_call(node: cst.CSTNode) -> bool:
    """``ops.fused_…(…)``, ``torch.ops._C.fused_…(…)`` or a bare ``fused_…(…)``."""
    return isinstance(node, cst.Call) and callee_name(node) == FUSED_OP


def has_star_args(call: cst.Call) -> bool:
    return any(arg.star for arg in call.args)


def get_arg(call: cst.Call, param: OpParam) -> cst.Arg | None:
    """The argument bound to ``param``, positional or keyword."""
    positional = [a for a in call.args if a.keyword is None and not a.star]
    keywords = [(a.keyword.value, a) for a in call.args if a.keyword is not None]
    return bind_arg(param, positional, keywords)


def is_none(node: cst.BaseExpression | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


def code(node: cst.CSTNode) -> str:
    """Source of a node on its own, without surrounding whitespace."""
    return cst.Module(body=[]).code_for_node(node).strip()


def same_expr(a: cst.BaseExpression, b: cst.BaseExpression) -> bool:
    """Equal as Python expressions: formatting, comments and parens ignored."""
    try:
        return ast.dump(ast.parse(code(a), mode="eval")) == ast.dump(ast.parse(code(b), mode="eval"))
    except SyntaxError:
        return False


def self_attr(node: cst.CSTNode | None) -> str | None:
    """``self.x`` -> ``"x"``; anything else -> None."""
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
        return node.attr.value
    return None


def is_self_rooted(node: cst.BaseExpression) -> bool:
    """``self.a.b.c``: an attribute chain that starts at ``self``."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name) and node.value == "self"


def is_pure(node: cst.BaseExpression) -> bool:
    """Names, attribute chains and constant/pure subscripts: safe to evaluate again."""
    if isinstance(node, (cst.Name, cst.Integer, cst.SimpleString)):
        return True
    if isinstance(node, cst.Attribute):
        return is_pure(node.value)
    if isinstance(node, cst.Subscript):
        return is_pure(node.value) and all(
            isinstance(el.slice, cst.Index) and is_pure(el.slice.value) for el in node.slice
        )
    return False


# --- methods and statements -------------------------------------------------


def methods(cls: cst.ClassDef) -> list[cst.FunctionDef]:
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    return [s for s in body if isinstance(s, cst.FunctionDef)]


def find_method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    found = [f for f in methods(cls) if f.name.value == name]
    return found[-1] if found else None


def _walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    yield node
    for child in node.children:
        yield from _walk(child)


def walk_scope(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Nodes of one function body, not descending into nested defs/lambdas/classes."""
    for child in node.children:
        yield child
        if not isinstance(child, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            yield from walk_scope(child)


def walk_all(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    return _walk(node)


@dataclass
class StatementSlot:
    """Where a statement sits: the block that holds it and its index there."""

    block: cst.IndentedBlock | cst.Module
    index: int

    @property
    def statement(self) -> cst.BaseStatement:
        return self.block.body[self.index]

    def after(self) -> list[cst.BaseStatement]:
        return list(self.block.body[self.index + 1 :])

    def before(self) -> list[cst.BaseStatement]:
        return list(self.block.body[: self.index])


def statement_slots(func: cst.FunctionDef) -> Iterator[StatementSlot]:
    """Every statement of a function body, in nested blocks too (not nested defs)."""

    def visit(block: cst.IndentedBlock) -> Iterator[StatementSlot]:
        for i, stmt in enumerate(block.body):
            yield StatementSlot(block, i)
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                continue
            for sub in _sub_blocks(stmt):
                yield from visit(sub)

    if isinstance(func.body, cst.IndentedBlock):
        yield from visit(func.body)


def _sub_blocks(stmt: cst.CSTNode) -> Iterator[cst.IndentedBlock]:
    for child in stmt.children:
        if isinstance(child, cst.IndentedBlock):
            yield child
        elif isinstance(child, (cst.Else, cst.If, cst.ExceptHandler, cst.Finally)):
            yield from _sub_blocks(child)
        elif isinstance(child, cst.ExceptStarHandler):
            yield from _sub_blocks(child)


def expression_call(stmt: cst.BaseStatement) -> cst.Call | None:
    """The call of a statement that is nothing but one call (``f(...)``)."""
    if (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.Call)
    ):
        return stmt.body[0].value
    return None


def simple_assignment(
    stmt: cst.BaseStatement,
) -> tuple[cst.BaseAssignTargetExpression, cst.BaseExpression] | None:
    """``target = value`` (one target, annotated or not) -> (target, value)."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        return small.targets[0].target, small.value
    if isinstance(small, cst.AnnAssign) and small.value is not None:
        return small.target, small.value
    return None


def self_assignments(func: cst.FunctionDef) -> dict[str, list[tuple[StatementSlot, cst.BaseExpression]]]:
    """``self.<attr> = value`` statements of a method, by attribute, in order."""
    found: dict[str, list[tuple[StatementSlot, cst.BaseExpression]]] = {}
    for slot in statement_slots(func):
        pair = simple_assignment(slot.statement)
        if pair is None:
            continue
        attr = self_attr(pair[0])
        if attr is not None:
            found.setdefault(attr, []).append((slot, pair[1]))
    return found


def bound_names(func: cst.FunctionDef) -> set[str]:
    """Every name a function binds or reads (parameters, locals, free names)."""
    names = {p.name.value for p in _all_params(func.params)}
    for node in walk_scope(func.body):
        if isinstance(node, cst.Name):
            names.add(node.value)
    return names


def _all_params(params: cst.Parameters) -> list[cst.Param]:
    out = list(params.posonly_params) + list(params.params) + list(params.kwonly_params)
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            out.append(star)
    return out


def param_names(func: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in _all_params(func.params)]


def local_value(func: cst.FunctionDef, name: str, before: StatementSlot) -> cst.BaseExpression | None:
    """The value of a local assigned exactly once in ``func``, before ``before``."""
    values: list[cst.BaseExpression] = []
    seen_target = False
    for slot in statement_slots(func):
        if slot.block is before.block and slot.index == before.index:
            seen_target = True
        pair = simple_assignment(slot.statement)
        if pair and isinstance(pair[0], cst.Name) and pair[0].value == name:
            if seen_target:
                return None  # reassigned after the call: not a stable alias
            values.append(pair[1])
    return values[0] if len(values) == 1 else None


def resolve_self_expr(
    func: cst.FunctionDef, expr: cst.BaseExpression, before: StatementSlot
) -> cst.BaseExpression | None:
    """``self.x`` as is, or a local that holds ``self.x``; else None."""
    if isinstance(expr, cst.Name):
        value = local_value(func, expr.value, before)
        if value is not None and is_self_rooted(value) and isinstance(value, cst.Attribute):
            return value
        return None
    if isinstance(expr, cst.Attribute) and is_self_rooted(expr):
        return expr
    return None


def product_of(value: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply):
        return value.left, value.right
    return None


# --- imports ------------------------------------------------------------------


@dataclass
class ImportedName:
    statement: cst.SimpleStatementLine
    alias: cst.ImportAlias
    bound: str


def module_imports(module: cst.Module) -> list[ImportedName]:
    """Top-level ``import`` / ``from … import`` aliases and the names they bind."""
    found: list[ImportedName] = []
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(
                small.names, cst.ImportStar
            ):
                for alias in small.names:
                    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                        bound = alias.asname.name.value
                    else:
                        bound = code(alias.name).split(".")[0]
                    found.append(ImportedName(stmt, alias, bound))
    return found


def name_uses(module: cst.Module) -> dict[str, int]:
    """How often each name is read outside import statements (strings counted too)."""
    counts: dict[str, int] = {}

    class Counter(cst.CSTVisitor):
        def visit_Import(self, node: cst.Import) -> bool:
            return False

        def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
            return False

        def visit_Name(self, node: cst.Name) -> None:
            counts[node.value] = counts.get(node.value, 0) + 1

        def visit_SimpleString(self, node: cst.SimpleString) -> None:
            # String annotations and __all__ entries: any identifier-like word.
            for word in _identifiers(node.value):
                counts[word] = counts.get(word, 0) + 1

    module.visit(Counter())
    return counts


def _identifiers(text: str) -> Iterator[str]:
    word = []
    for ch in text + " ":
        if ch.isalnum() or ch == "_":
            word.append(ch)
        elif word:
            yield "".join(word)
            word = []


def names_read(node: cst.CSTNode) -> set[str]:
    return {n.value for n in walk_all(node) if isinstance(n, cst.Name)}
