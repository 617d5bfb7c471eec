"""Structural finders shared by classification and rewriting: code is found by its shape (a call of the
fused op, ``self.<attr> = …``, ``X if flag else None``), never by line or text. Plain isinstance tests, not
libcst.matchers: importing those costs more than parsing an 80 KB model file (``python -X importtime``)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import libcst as cst

from codemods import guards, schema


def callee_name(call: cst.Call) -> str | None:
    """``f`` of ``f(…)`` and of ``a.b.f(…)``; None for any other callee."""
    func = call.func.attr if isinstance(call.func, cst.Attribute) else call.func
    return func.value if isinstance(func, cst.Name) else None


@dataclass(frozen=True)
class Wrapper:
    """A module-level function that hands its parameters unchanged to the op (or to
    another such function): ``params`` maps an op parameter's index to its own."""

    name: str
    params: dict[int, schema.OpParam]
    dtype_default: cst.BaseExpression | None = None  # what the op's kv_cache_dtype gets where a call omits it


@dataclass(frozen=True)
class OpCall:
    """A call of the fused op, made directly or through a pass-through wrapper."""

    call: cst.Call
    wrapper: Wrapper | None = None

    def arg(self, param: schema.OpParam) -> cst.Arg | None:
        """The argument the op's ``param`` receives from this call."""
        own = param if self.wrapper is None else self.wrapper.params.get(param.index)
        found = get_arg(self.call, own) if own is not None else None
        default = self.wrapper.dtype_default if self.wrapper is not None and param == schema.KV_CACHE_DTYPE else None
        return cst.Arg(default) if found is None and default is not None else found

    @property
    def native(self) -> bool:
        """The call passes a kv-cache dtype: a native build's call (the kernel writes fp8 itself)."""
        return self.arg(schema.KV_CACHE_DTYPE) is not None


def get_arg(call: cst.Call, param: schema.OpParam) -> cst.Arg | None:
    """The argument bound to ``param``, positional or keyword."""
    positional = [a for a in call.args if a.keyword is None and not a.star]
    keywords = [(a.keyword.value, a) for a in call.args if a.keyword is not None]
    return schema.bind_arg(param, positional, keywords)


def shown(node: cst.CSTNode) -> str:
    """A node's source on one line, its white space folded (for a message)."""
    return " ".join(code(node).split())


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
        keys = (el.slice for el in node.slice)
        return is_pure(node.value) and all(isinstance(k, cst.Index) and is_pure(k.value) for k in keys)
    return False


def methods(cls: cst.ClassDef) -> list[cst.FunctionDef]:
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    return [s for s in body if isinstance(s, cst.FunctionDef)]


def find_method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    return next((f for f in reversed(methods(cls)) if f.name.value == name), None)


SCOPES = (cst.FunctionDef, cst.Lambda, cst.ClassDef)  # what opens a scope of its own


def walk_scope(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Nodes of one function body, not descending into nested defs/lambdas/classes."""
    for child in node.children:
        yield child
        if not isinstance(child, SCOPES):
            yield from walk_scope(child)


def walk_all(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """``node`` and every node below it, in source order (pre-order)."""
    yield node
    for child in node.children:
        yield from walk_all(child)


# `node.children` visits the node again to list them; reading the dataclass fields is four times
# quicker. Field order is not source order: for questions where order does not count (any, all, a set).
_FIELDS: dict[type, tuple[str, ...]] = {}


def _child_nodes(node: cst.CSTNode) -> list[cst.CSTNode]:
    names = _FIELDS.get(type(node))
    if names is None:
        names = _FIELDS[type(node)] = tuple(f.name for f in dataclasses.fields(node))
    out: list[cst.CSTNode] = []
    for name in names:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, cst.CSTNode))
    return out


def nodes_in(node: cst.CSTNode, scope_only: bool = False) -> list[cst.CSTNode]:
    """``node`` and every node below it, in no particular order; ``scope_only``: not below
    nested defs, lambdas and classes (``walk_scope``)."""
    out = [node]
    stack = [node]
    while stack:
        children = _child_nodes(stack.pop())
        out += children
        stack += [c for c in children if not scope_only or not isinstance(c, SCOPES)]
    return out


# The clauses of a compound statement that hold blocks (an ``elif`` is an ``If``).
_CLAUSES = (cst.Else, cst.If, cst.ExceptHandler, cst.ExceptStarHandler, cst.Finally, cst.MatchCase)
# What holds statement lines: the module, a block, a compound statement and its clauses.
BLOCK_HOLDERS = (cst.Module, cst.IndentedBlock, cst.BaseCompoundStatement, *_CLAUSES)
_STATEMENT_PARTS = (*BLOCK_HOLDERS, cst.SimpleStatementSuite, cst.SimpleStatementLine)


def all_statements(node: cst.CSTNode) -> list[cst.CSTNode]:
    """Every statement under ``node``, small ones (``x = 1`` of ``a; x = 1`` or of ``if a: x = 1``)
    and compound ones, nested defs included; expressions are not entered."""
    out: list[cst.CSTNode] = []
    stack = [node]
    while stack:
        for child in _child_nodes(stack.pop()):
            if isinstance(child, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                out.append(child)
            if isinstance(child, _STATEMENT_PARTS):
                stack.append(child)
    return out


def first_in(node: cst.CSTNode, wanted: Callable[[cst.CSTNode], bool]) -> cst.CSTNode | None:
    """The first node under ``node`` (source order) that is ``wanted``."""
    hits = [n for n in nodes_in(node) if wanted(n)]
    if len(hits) <= 1:
        return hits[0] if hits else None
    return next(n for n in walk_all(node) if wanted(n))


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
    return (chain[-1] for chain in _slot_chains(func))


def slot_chain(func: cst.FunctionDef, target: StatementSlot) -> list[StatementSlot]:
    """The statements of ``func`` that hold ``target``, outermost first, ending with it."""
    chains = (c for c in _slot_chains(func) if c[-1].block is target.block and c[-1].index == target.index)
    return next(chains, [])


def _slot_chains(func: cst.FunctionDef) -> Iterator[list[StatementSlot]]:
    """Each statement's slot, after the slots of the statements that hold it."""

    def visit(block: cst.IndentedBlock, chain: list[StatementSlot]) -> Iterator[list[StatementSlot]]:
        for i, stmt in enumerate(block.body):
            here = [*chain, StatementSlot(block, i)]
            yield here
            if not isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                for sub in _sub_blocks(stmt):
                    yield from visit(sub, here)

    if isinstance(func.body, cst.IndentedBlock):
        yield from visit(func.body, [])


def _sub_blocks(stmt: cst.CSTNode) -> Iterator[cst.IndentedBlock]:
    for child in stmt.children:
        if isinstance(child, cst.IndentedBlock):
            yield child
        elif isinstance(child, _CLAUSES):
            yield from _sub_blocks(child)


def lone_small(stmt: cst.CSTNode) -> cst.BaseSmallStatement | None:
    """The small statement of a line (or of an ``if x: <it>`` suite) that holds only it."""
    lone = isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) and len(stmt.body) == 1
    return stmt.body[0] if lone else None  # type: ignore[attr-defined]


def expression_call(stmt: cst.BaseStatement) -> cst.Call | None:
    """The call of a statement that is nothing but one call (``f(...)``)."""
    small = lone_small(stmt)
    return small.value if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) else None


def simple_assignment(
    stmt: cst.BaseStatement,
) -> tuple[cst.BaseAssignTargetExpression, cst.BaseExpression] | None:
    """``target = value`` (one target, annotated or not) -> (target, value)."""
    small = lone_small(stmt)
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        return small.targets[0].target, small.value
    if isinstance(small, cst.AnnAssign) and small.value is not None:
        return small.target, small.value
    return None


# ``self.<attr> = value`` statements by attribute: (where, value) in order.
Assignments = dict[str, list[tuple[StatementSlot, cst.BaseExpression]]]


def self_assignments(func: cst.FunctionDef) -> Assignments:
    found: Assignments = {}
    for slot in statement_slots(func):
        pair = simple_assignment(slot.statement)
        attr = self_attr(pair[0]) if pair is not None else None
        if attr is not None:
            found.setdefault(attr, []).append((slot, pair[1]))
    return found


def bound_names(func: cst.FunctionDef) -> set[str]:
    """Every name a function binds or reads (parameters, locals, free names)."""
    names = {n.value for n in nodes_in(func.body, scope_only=True) if isinstance(n, cst.Name)}
    return names | set(param_names(func))


def _all_params(params: cst.Parameters) -> list[cst.Param]:
    stars = [star for star in (params.star_arg, params.star_kwarg) if isinstance(star, cst.Param)]
    return [*params.posonly_params, *params.params, *params.kwonly_params, *stars]


def param_names(func: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in _all_params(func.params)]


def _target_names(node: cst.CSTNode) -> Iterator[str]:
    """Names an assignment target binds (``a``, ``a, (b, *c)``); not attributes or subscripts."""
    if isinstance(node, cst.Name):
        yield node.value
    elif isinstance(node, (cst.Tuple, cst.List)):
        for element in node.elements:
            yield from _target_names(element.value)
    elif isinstance(node, cst.StarredElement):
        yield from _target_names(node.value)


# The node types that bind names (a set test first: LibCST's classes make isinstance slow);
# the _TARGETED ones bind their ``target``.
_TARGETED = (cst.AssignTarget, cst.AnnAssign, cst.AugAssign, cst.For, cst.CompFor, cst.NamedExpr, cst.Del)
_BINDERS = frozenset(_TARGETED) | {
    cst.AsName, cst.ImportAlias, cst.Global, cst.Nonlocal, cst.FunctionDef, cst.ClassDef,
    cst.MatchAs, cst.MatchStar, cst.MatchMapping,
}


def _bound_by(node: cst.CSTNode) -> Iterator[str]:
    """The names one node binds in the scope it sits in."""
    if type(node) not in _BINDERS:
        return
    if isinstance(node, _TARGETED):
        yield from _target_names(node.target)
    elif isinstance(node, cst.AsName):  # with ... as x, except ... as x, import ... as x
        yield from _target_names(node.name)
    elif isinstance(node, cst.ImportAlias) and node.asname is None:
        yield _import_bound(node)
    elif isinstance(node, (cst.Global, cst.Nonlocal)):
        yield from (item.name.value for item in node.names)
    elif isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.MatchAs, cst.MatchStar)) and node.name is not None:
        yield node.name.value
    elif isinstance(node, cst.MatchMapping) and node.rest is not None:
        yield node.rest.value


@functools.lru_cache(maxsize=16)  # asked again for each argument of one call; nodes hash by identity
def bindings(func: cst.FunctionDef) -> dict[str, list[cst.CSTNode]]:
    """Every way a name is bound in a function's own scope: parameters, assignments of any form (unpacking,
    augmented, ``for``, ``with … as``, ``:=``, ``except … as``, imports, nested defs, ``match`` captures,
    ``del``) and ``global``/``nonlocal``."""
    found: dict[str, list[cst.CSTNode]] = {p.name.value: [p] for p in _all_params(func.params)}
    for name, nodes in scope_bindings(func.body).items():
        found.setdefault(name, []).extend(nodes)
    return found


def scope_bindings(body: cst.CSTNode) -> dict[str, list[cst.CSTNode]]:
    """``bindings`` of the statements of one scope (a class body: its attributes and methods)."""
    found: dict[str, list[cst.CSTNode]] = {}
    for node in nodes_in(body, scope_only=True):
        for name in _bound_by(node):
            found.setdefault(name, []).append(node)
    return found


def local_value(func: cst.FunctionDef, name: str, before: StatementSlot) -> cst.BaseExpression | None:
    """The value ``name`` surely holds at ``before``: the local is bound once in ``func``
    (no parameter, unpacking, loop, ``with``, ``:=`` or other binding besides), by a plain
    ``name = value`` statement that runs on every path to ``before``; else None."""
    bound = bindings(func).get(name, [])
    if len(bound) != 1 or not isinstance(bound[0], cst.AssignTarget):
        return None
    pairs = (simple_assignment(stmt) for level in slot_chain(func, before) for stmt in level.before())
    return next((pair[1] for pair in pairs if pair is not None and pair[0] is bound[0].target), None)


def _assigns_within(func: cst.FunctionDef, chain: cst.Attribute) -> bool:
    """``func`` may rebind ``self.a.b`` (or ``self.a``) of a ``self.a.b.c`` chain:
    assigns or deletes a prefix of it, or calls ``setattr``."""
    wanted = code(chain).replace(" ", "") + "."
    for node in nodes_in(func.body, scope_only=True):
        if isinstance(node, (cst.AssignTarget, cst.AnnAssign, cst.AugAssign, cst.Del)):
            target = node.target
            if isinstance(target, cst.Attribute) and is_self_rooted(target):
                if wanted.startswith(code(target).replace(" ", "") + "."):  # the chain or a prefix of it
                    return True
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "setattr":
            return True
    return False


def resolve_self_expr(
    func: cst.FunctionDef, expr: cst.BaseExpression, before: StatementSlot
) -> cst.BaseExpression | None:
    """``self.x`` as is, or a local proven to hold ``self.x`` at ``before`` (and
    ``self.x`` not rebound in ``func``, so the two stay one tensor); else None."""
    if len(bindings(func).get("self", [])) != 1:
        return None  # `self` rebound: `self.x` is not the layer's attribute
    if isinstance(expr, cst.Name):
        expr = local_value(func, expr.value, before)
        if isinstance(expr, cst.Attribute) and _assigns_within(func, expr):
            return None
    return expr if isinstance(expr, cst.Attribute) and is_self_rooted(expr) else None


def unproven_cache(op: OpCall, method: cst.FunctionDef | None, slot: StatementSlot | None) -> str | None:
    """A cache argument of a call in a layer's method (not under a condition: a guard's or the caller's,
    read as such) that is no ``self.`` attribute, nor a local proven to hold one at the call."""
    for param in schema.CACHE_ARGS:
        arg = op.arg(param)
        if method is None or arg is None or is_none(arg.value) or isinstance(arg.value, cst.IfExp):
            continue
        held = resolve_self_expr(method, arg.value, slot) if slot is not None else arg.value
        if not (isinstance(held, cst.Attribute) and is_self_rooted(held)):
            return shown(arg.value)
    return None


def module_functions(module: cst.Module) -> dict[str, cst.FunctionDef]:
    """Top-level ``def``s of the module, by name (the last one wins, as at runtime)."""
    return {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}


def delegates(
    fn: cst.FunctionDef, cls: cst.ClassDef, functions: dict[str, cst.FunctionDef]
) -> list[cst.FunctionDef]:
    """Methods (``self.f(...)``) and module functions (``f(...)``) that ``fn`` calls: one level."""
    found: list[cst.FunctionDef] = []
    for call in (n for n in nodes_in(fn.body, scope_only=True) if isinstance(n, cst.Call)):
        method = self_attr(call.func)
        if method is not None:
            target = find_method(cls, method)
        else:
            target = functions.get(call.func.value) if isinstance(call.func, cst.Name) else None
        if target is not None and target is not fn and all(target is not f for f in found):
            found.append(target)
    return found


def raw_scatters(fn: cst.FunctionDef) -> list[StatementSlot]:
    """``cache[slots] = ...`` where ``slots`` is a parameter of ``fn``: a write by slot that
    sends slot -1 (a padded token) to the last row instead of skipping it."""
    params = set(param_names(fn))
    found = []
    for slot in statement_slots(fn):
        pair = simple_assignment(slot.statement)
        if pair is None or not isinstance(pair[0], cst.Subscript) or len(pair[0].slice) != 1:
            continue
        index = pair[0].slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.Name) and index.value.value in params:
            found.append(slot)
    return found


def bf16_index_writes(fn: cst.FunctionDef) -> list[tuple[StatementSlot, StatementSlot]]:
    """``assert C.dtype == K.dtype`` followed in its block by ``reshape_and_cache_flash(K, K, C,
    C, slots, "auto", …)``: an index write that asserts a bf16 index cache (an fp8 one, vLLM's
    indexer_kv_dtype "fp8", then raises). (the assert, the call) of each."""
    found = []
    for slot in statement_slots(fn):
        small = lone_small(slot.statement)
        test = small.test if isinstance(small, cst.Assert) else None
        compared = test.comparisons if isinstance(test, cst.Comparison) else ()
        if len(compared) != 1 or not isinstance(compared[0].operator, cst.Equal):
            continue
        names = [
            x.value.value
            for x in (test.left, compared[0].comparator)  # type: ignore[union-attr]
            if isinstance(x, cst.Attribute) and x.attr.value == "dtype" and isinstance(x.value, cst.Name)
        ]
        if len(names) != 2:
            continue
        cache, key = names
        for later, stmt in enumerate(slot.after(), slot.index + 1):
            call = expression_call(stmt)
            if call is None or callee_name(call) != schema.RESHAPE_OP or len(call.args) != 8:
                continue
            dtype = call.args[5].value
            auto = isinstance(dtype, cst.SimpleString) and dtype.evaluated_value == schema.AUTO_DTYPE
            if auto and [code(arg.value) for arg in call.args[:4]] == [key, key, cache, cache]:
                found.append((slot, StatementSlot(slot.block, later)))
                break
    return found


def insert_kv_form(fn: cst.FunctionDef | None, cls: cst.ClassDef, functions: dict[str, cst.FunctionDef]) -> str:
    """The form of the write method ``fn`` (``schema.insert_kv_form``), read in it and what it hands its arguments to."""
    if fn is None:
        return "absent"
    reads_metadata = any(isinstance(n, cst.Attribute) and n.attr.value == schema.METADATA_ATTR for n in nodes_in(fn.body))
    writers = (fn, *delegates(fn, cls, functions))
    scatter, bf16_index = any(map(raw_scatters, writers)), any(map(bf16_index_writes, writers))
    form = schema.insert_kv_form(reads_metadata, len(param_names(fn)) - 1, scatter, bf16_index)
    # a write that may return before it writes (for some batches, say) is none the bypass's (but for no token)
    returns = [(n, f) for f in writers for n in nodes_in(f.body, scope_only=True)]
    empty = {id(r) for n, f in returns if (r := _no_token_return(n, param_names(f))) is not None}
    leaves = any(isinstance(n, cst.Return) and id(n) not in empty for n, _ in returns)
    return "other" if leaves and form in schema.SLOTS_FORMS else form


def _no_token_return(node: cst.CSTNode, params: list[str]) -> cst.Return | None:
    """The ``return`` of ``if <no token>: return`` (``guards.no_token``)."""
    if not isinstance(node, cst.If) or node.orelse is not None:
        return None
    body = node.body.body[0] if isinstance(node.body, cst.IndentedBlock) and len(node.body.body) == 1 else node.body
    small = lone_small(body)
    bare = isinstance(small, cst.Return) and (small.value is None or is_none(small.value))
    return small if bare and guards.no_token(code(node.test), params) else None  # type: ignore[return-value]


@dataclass
class ImportedName:
    statement: cst.SimpleStatementLine
    alias: cst.ImportAlias
    bound: str
    importer: cst.Import | cst.ImportFrom  # the import of ``statement`` that holds ``alias``

    @property
    def qualified(self) -> str:
        """The qualified name ``bound`` is bound to (``model`` reads it where Python's parser cannot)."""
        name, small = code(self.alias.name).replace(" ", ""), self.importer
        if isinstance(small, cst.Import):
            return name if self.alias.asname is not None else self.bound
        base = "." * len(small.relative) + (code(small.module).replace(" ", "") if small.module is not None else "")
        return f"{base}.{name}" if base else name


def module_imports(module: cst.Module) -> list[ImportedName]:
    """Top-level ``import`` / ``from … import`` aliases and the names they bind."""
    return [
        ImportedName(stmt, alias, _import_bound(alias), small)
        for stmt in module.body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
        if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar)
        for alias in small.names
    ]


def _import_bound(alias: cst.ImportAlias) -> str:
    """The name an import alias binds: ``x`` of ``import a.b as x``, ``a`` of ``import a.b``."""
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return code(alias.name).split(".")[0]


def name_uses(module: cst.Module, skip: Sequence[cst.CSTNode] = ()) -> dict[str, int]:
    """How often each name is read outside import statements (strings counted too);
    ``skip``: statements known not to matter to the caller (not counted)."""
    counts: Counter[str] = Counter()
    skipped = {id(n): n for n in skip}
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        if skipped.get(id(node)) is node or isinstance(node, (cst.Import, cst.ImportFrom)):
            continue
        if isinstance(node, cst.Name):
            counts[node.value] += 1
        elif isinstance(node, cst.SimpleString):  # string annotations, __all__: any identifier-like word
            counts.update(re.findall(r"\w+", node.value))
        stack += _child_nodes(node)
    return counts


def names_read(node: cst.CSTNode) -> set[str]:
    return {n.value for n in nodes_in(node) if isinstance(n, cst.Name)}


def products(init_attrs: Assignments) -> list[tuple[str, cst.BaseExpression, str]]:
    """``self.W = <count> * self.D`` assigned once in __init__ (either order): (W, count, "self.D")."""
    found = []
    for attr, defs in init_attrs.items():
        value = defs[0][1] if len(defs) == 1 else None
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply):
            pairs = ((value.left, value.right), (value.right, value.left))
            found += [(attr, count, code(dim)) for count, dim in pairs if self_attr(dim) is not None]
    return found


def stale_widths(init: cst.FunctionDef, init_attrs: Assignments) -> set[str]:
    """The widths of ``products`` made from a count or size that __init__ binds again (an augmented assignment
    too; divided per rank, say): they may hold the model's width, not the rank's."""
    stored = Counter(self_attr(t) for n in all_statements(init.body) for t in store_targets(n))
    stored.pop(None, None)  # (a local, a subscript: no attribute)
    return {w for w, count, dim in products(init_attrs) if stored[self_attr(count)] > 1 or stored[dim[5:]] > 1}


def store_targets(stmt: cst.CSTNode) -> list[cst.BaseExpression]:
    """What a statement stores to (``self.x`` of ``self.x = …``, ``for self.x in …``, ``with … as self.x``)."""
    if isinstance(stmt, cst.Assign):
        return [t.target for t in stmt.targets]
    if isinstance(stmt, (cst.AnnAssign, cst.AugAssign, cst.Del, cst.For)):
        return [stmt.target]
    if isinstance(stmt, cst.With):
        return [item.asname.name for item in stmt.items if item.asname is not None]
    return []
