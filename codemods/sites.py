"""Finding the sites: every call of the fused op, where it sits, and the bypass pieces around it.

``find_calls`` finds each call of ``fused_minimax_m3_qknorm_rope_kv_insert`` (and of a
module function that passes its arguments through) with its class and method;
``call_facts`` says where it sits and what it passes; ``collect_pieces`` gathers the
bypass pieces there (flag, scale, guard, post-call insert, ``_insert_kv``'s form).
``schema`` turns these facts into a state; nothing here decides or writes.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from codemods import anchors as a
from codemods import schema
from codemods.schema import GUARD_NAME
from codemods.sourcemap import SourceMap


@dataclass
class FoundCall:
    op: a.OpCall
    line: int  # set once every call is found (see find_calls)
    cls: cst.ClassDef | None
    method: cst.FunctionDef | None
    nested_in: str | None  # name of a def/lambda between the method and the call
    module_function: str | None
    outer: tuple[cst.CSTNode, ...] = ()  # the defs/classes that enclose the class

    @property
    def call(self) -> cst.Call:
        return self.op.call


class CallFinder(cst.CSTVisitor):
    """Calls of the op, and of its pass-through wrappers (``wrappers``)."""

    def __init__(self, wrappers: dict[str, a.Wrapper], skip: list[cst.CSTNode] | None = None) -> None:
        self.stack: list[cst.CSTNode] = []
        self.found: list[FoundCall] = []
        self.skip = {id(n): n for n in skip or ()}
        self.wrappers = wrappers
        # Where the op is named other than as the callee of a call (an alias, a local, getattr):
        # (the node, the innermost statement holding it).
        self.named: list[tuple[cst.CSTNode, cst.CSTNode | None]] = []
        self.statements: list[cst.CSTNode] = []  # those being visited, innermost last

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.skip.get(id(node)) is node:
            return False  # a statement that holds no call of the op
        if isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            self.statements.append(node)
        return super().on_visit(node)

    def _named(self, node: cst.CSTNode, name: str | None) -> None:
        if name == schema.FUSED_OP:
            self.named.append((node, self.statements[-1] if self.statements else None))

    def visit_Name(self, node: cst.Name) -> None:  # the attribute of `ops.fused_…` too
        self._named(node, node.value)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if schema.FUSED_OP in node.value:
            self._named(node, str(node.evaluated_value).rpartition(".")[2])

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if self.skip.get(id(original_node)) is not original_node:
            super().on_leave(original_node)
            if isinstance(original_node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                self.statements.pop()

    def _push(self, node: cst.CSTNode) -> None:
        self.stack.append(node)

    def _pop(self, node: cst.CSTNode) -> None:
        self.stack.pop()

    visit_ClassDef = visit_FunctionDef = visit_Lambda = _push  # type: ignore[assignment]
    leave_ClassDef = leave_FunctionDef = leave_Lambda = _pop  # type: ignore[assignment]

    def visit_Call(self, node: cst.Call) -> None:
        name = a.callee_name(node)
        if name != schema.FUSED_OP and name not in self.wrappers:
            return
        op = a.OpCall(node, None if name == schema.FUSED_OP else self.wrappers[name])
        line = 0  # numbered once every call is found (find_calls)
        classes = [i for i, n in enumerate(self.stack) if isinstance(n, cst.ClassDef)]
        if not classes:
            outer = self.stack[0] if self.stack else None
            fn = outer.name.value if isinstance(outer, cst.FunctionDef) else None
            self.found.append(FoundCall(op, line, None, None, None, fn or "<module>"))
            return
        ci = classes[-1]
        cls = self.stack[ci]
        inner = self.stack[ci + 1 :]
        method = inner[0] if inner and isinstance(inner[0], cst.FunctionDef) else None
        nested = None
        if len(inner) > 1:
            n = inner[-1]
            nested = n.name.value if isinstance(n, cst.FunctionDef) else "<lambda>"
        assert isinstance(cls, cst.ClassDef)
        self.found.append(FoundCall(op, line, cls, method, nested, None, tuple(self.stack[:ci])))

    def visit_Import(self, node: cst.Import) -> bool:
        return False  # nothing to find in an import

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if not isinstance(node.names, cst.ImportStar):
            for alias in node.names:  # `import fused_… as other`: its calls go by the other name
                if alias.asname is not None and a.code(alias.name) == schema.FUSED_OP:
                    self._named(alias, schema.FUSED_OP)
        return False

    def strays(self) -> list[tuple[cst.CSTNode, cst.CSTNode | None]]:
        """Where the op is named but not called by that name (nor imported plainly)."""
        calls = [f.call for f in self.found if f.op.wrapper is None]
        callees = {id(c.func.attr if isinstance(c.func, cst.Attribute) else c.func) for c in calls}
        return [(node, stmt) for node, stmt in self.named if id(node) not in callees]


def find_calls(
    module: cst.Module, source_map: SourceMap | None, wrappers: dict[str, a.Wrapper]
) -> CallFinder:
    """Every call of the op, in source order, with the line it starts on (``found``), and
    where the op is named without being called (``strays``).

    The lines are those ``PositionProvider`` gives (the callee's first line; a
    call's own parentheses are not part of it), read from Python's parser of
    the same text, which also says which statements can be skipped:
    ``PositionProvider`` and a visit of every node cost more than the rest of
    the analysis. If the two parsers do not see the same
    calls, every node is visited and ``PositionProvider`` numbers them.
    """
    names = {schema.FUSED_OP, *wrappers}
    if source_map is not None:
        needles = [name.encode() for name in names]
        op_lines = [i for i, text in enumerate(source_map.lines) if any(n in text for n in needles)]
        skip = [stmt for stmt, first, last in source_map.spans.values() if not _holds(first, last, op_lines)]
        finder = CallFinder(wrappers, skip)
        module.visit(finder)
        calls = _ast_calls(source_map.tree, op_lines, names)
        if len(calls) == len(finder.found) and all(
            len(c.args) + len(c.keywords) == len(f.call.args)
            for c, f in zip(calls, finder.found, strict=True)
        ):
            for f, c in zip(finder.found, calls, strict=True):
                f.line = c.lineno
            return finder
    finder = CallFinder(wrappers)
    module.visit(finder)
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    for f in finder.found:
        f.line = positions[f.call].start.line
    return finder


def _ast_calls(tree: ast.Module, op_lines: list[int], names: set[str]) -> list[ast.Call]:
    """ast calls of the op (and wrappers: ``names``), in source order (statements
    without any of the names skipped)."""
    found: list[ast.Call] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            first = min((d.lineno for d in getattr(node, "decorator_list", ())), default=node.lineno)
            if not _holds(first, node.end_lineno or node.lineno, op_lines):
                return
        if isinstance(node, ast.Call) and schema.callee(node) in names:
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    # ast keeps fields, not source order (decorators after the body); outer calls
    # first where two start at one place.
    found.sort(key=lambda n: (n.lineno, n.col_offset, -(n.end_lineno or 0), -(n.end_col_offset or 0)))
    return found


def _holds(first: int, last: int, op_lines: list[int]) -> bool:
    """A statement from ``first`` (its decorators) to ``last`` holds a line naming the op."""
    return any(first <= line <= last for line in op_lines)


def call_facts(found: FoundCall) -> tuple[schema.CallFacts, a.StatementSlot | None]:
    """Where the call sits and what it passes; the statement slot of a call directly in a method."""
    call = found.call
    kv = found.op.arg(schema.KV_CACHE)
    dtype = found.op.arg(schema.KV_CACHE_DTYPE)
    method = found.method if found.nested_in is None else None  # directly in a method
    slots = a.statement_slots(method) if method is not None else ()
    slot = next((s for s in slots if a.expression_call(s.statement) is call), None)
    facts = schema.CallFacts(
        line=found.line,
        class_name=found.cls.name.value if found.cls else None,
        method=found.method.name.value if found.method else None,
        module_function=found.module_function,
        nested_in=found.nested_in,
        star_args=a.has_star_args(call),
        has_cache=kv is not None and not a.is_none(kv.value),
        dtype=a.code(dtype.value) if dtype is not None else None,
        dtype_is_auto=(
            dtype is not None
            and isinstance(dtype.value, cst.SimpleString)
            and dtype.value.evaluated_value == schema.AUTO_DTYPE
        ),
        in_block=slot is not None,
    )
    return facts, slot


# --- the pieces of a bypass ----------------------------------------------------


@dataclass
class FoundPieces(schema.Pieces):
    """The pieces (``schema.Pieces``), with the LibCST nodes the plan still needs."""

    post_insert_call: cst.Call | None = None


def guard_of(arg: cst.Arg | None) -> str | None:
    """``X if G else None`` -> ``"G"``."""
    value = arg.value if arg is not None else None
    if isinstance(value, cst.IfExp) and isinstance(value.test, cst.Name) and a.is_none(value.orelse):
        return value.test.value
    return None


def unguarded(arg: cst.Arg) -> cst.BaseExpression:
    value = arg.value
    if isinstance(value, cst.IfExp) and guard_of(arg) is not None:
        return value.body
    return value


def _insert_kv_form(
    fn: cst.FunctionDef | None, cls: cst.ClassDef, functions: dict[str, cst.FunctionDef]
) -> str:
    if fn is None:
        return "absent"
    reads_metadata = any(
        isinstance(n, cst.Attribute) and n.attr.value == schema.METADATA_ATTR for n in a.nodes_in(fn.body)
    )
    scatter = any(a.raw_scatters(f) for f in (fn, *a.delegates(fn, cls, functions)))
    return schema.insert_kv_form(reads_metadata, len(a.param_names(fn)) - 1, scatter)


def is_insert_kv_call(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Call) and a.self_attr(node.func) == schema.INSERT_KV


def other_insert_kv_call(cls: cst.ClassDef, allowed: set[int]) -> cst.CSTNode | None:
    """The first ``self._insert_kv(...)`` in the class that is none of the ``allowed`` nodes (by id)."""
    return a.first_in(cls.body, lambda n: is_insert_kv_call(n) and id(n) not in allowed)


def collect_pieces(
    cls: cst.ClassDef,
    method: cst.FunctionDef,
    op: a.OpCall,
    slot: a.StatementSlot | None,
    functions: dict[str, cst.FunctionDef],
    mentions_flag: bool = True,
) -> FoundPieces:
    """``functions``: the module's top-level defs (``_insert_kv`` may hand its work to one).
    ``mentions_flag``: the file's text holds the flag's name at all (else no walk for it)."""
    p = FoundPieces()
    init = a.find_method(cls, "__init__")
    assigned = a.self_assignments(init) if init is not None and mentions_flag else {}
    p.taken = _taken_names(cls, assigned)
    flag = assigned.get(schema.FP8_FLAG, [])
    p.flag_set = len(flag) == 1 and matches(flag[0][1], schema.is_flag_value)
    p.scale_set = schema.FP8_SCALE in assigned
    if mentions_flag:
        attrs = {a.self_attr(node) for node in a.nodes_in(cls.body)}
        # Once set, whether the flag is also read decides nothing (schema.Pieces.any_bypass).
        p.flag_read = not p.flag_set and schema.FP8_FLAG in attrs
        p.scale_read = schema.FP8_SCALE in attrs
    conditions = [(arg, guard_of(arg)) for arg in (op.arg(schema.KV_CACHE), op.arg(schema.INDEX_CACHE))]
    p.guard_args = [g for _, g in conditions if g]
    p.insert_kv = _insert_kv_form(a.find_method(cls, schema.INSERT_KV), cls, functions)
    native = op.arg(schema.KV_CACHE_DTYPE) is not None
    if slot is not None:
        guard_names = set(p.guard_args) | {GUARD_NAME}
        for stmt in slot.before():
            pair = a.simple_assignment(stmt)
            if pair and isinstance(pair[0], cst.Name) and pair[0].value in guard_names:
                is_guard = matches(pair[1], lambda t: schema.is_guard_value(t, native))
                schema.note_guard_assignment(p, pair[0].value, is_guard)
    # A condition is the bypass's guard only if the bypass could have written it: the
    # name is assigned `not self._fp8_kv` in the call's block before the call (and bound
    # nowhere else but there and as a parameter), or it is the bypass's own name, read
    # but never bound (a half-applied merge). Any other condition is the caller's.
    bound = a.bindings(method)
    if p.guard_assigned is not None and not _bound_only_in(bound[p.guard_assigned], slot.block):  # type: ignore[union-attr]
        p.guard_assigned = None  # also bound elsewhere: what it holds at the call is not proven
    own = {g for g in p.guard_args if g == p.guard_assigned or (g.startswith(GUARD_NAME) and g not in bound)}
    # (and a condition of the caller's under the bypass's own guard: `(X if C else None) if G else None`)
    p.user_conditions = [
        a.code(arg.value)
        for arg, g in conditions
        if g and (g not in own or isinstance(unguarded(arg), cst.IfExp))  # type: ignore[arg-type]
    ]
    p.guard_args = [g for g in p.guard_args if g in own]
    if slot is None:
        return p
    for stmt in slot.after():
        node = a.first_in(stmt, is_insert_kv_call)
        if isinstance(node, cst.Call):
            p.post_insert, p.post_insert_call = True, node
            # under `if not G:` (G the guard) or `if self._fp8_kv:`, passed the call's slot mappings
            guards = {schema.FP8_FLAG, *p.guard_args, p.guard_assigned or GUARD_NAME}
            guarded = isinstance(stmt, cst.If) and block_guard(stmt) in guards
            p.post_insert_wired = guarded and _insert_is_wired(node, op)
            p.compiled_write = guarded and matches(stmt.test, schema.runs_compiling) and _slots_none_somewhere(method, op)  # type: ignore[attr-defined]
            break
    return p


def _slots_none_somewhere(method: cst.FunctionDef, op: a.OpCall) -> bool:
    """A slot mapping the call passes is a local that ``method`` sets to ``None`` (while compiling, say)."""
    names = {
        arg.value.value
        for param in (schema.SLOT_MAPPING, schema.INDEX_SLOT_MAPPING)
        if (arg := op.arg(param)) is not None and isinstance(arg.value, cst.Name)
    }
    return any(
        (pair := a.simple_assignment(x.statement)) is not None
        and isinstance(pair[0], cst.Name)
        and pair[0].value in names
        and a.is_none(pair[1])
        for x in a.statement_slots(method)
    )


def _bound_only_in(nodes: list[cst.CSTNode], block: cst.IndentedBlock | cst.Module) -> bool:
    """Every binding (``anchors.bindings``) is a parameter or a plain assignment statement of ``block``."""
    plain = {id(pair[0]) for stmt in block.body if (pair := a.simple_assignment(stmt)) is not None}
    return all(isinstance(n, cst.Param) or id(getattr(n, "target", None)) in plain for n in nodes)


def matches(expr: cst.BaseExpression, test: Callable[[ast.expr], bool]) -> bool:
    """``test``, one of ``schema``'s recognisers, on the expression as Python's own tree."""
    tree = schema.expression(a.code(expr))
    return tree is not None and test(tree)


def block_guard(block: cst.If) -> str | None:
    """What the ``if`` around the post-call insert tests (``schema.post_block_guard``)."""
    test = schema.expression(a.code(block.test))
    return schema.post_block_guard(test) if test is not None else None


# What the bypass sets its names to (anything else there is the file's own use of them).
_OWN_VALUES = {schema.FP8_FLAG: schema.is_flag_value, schema.FP8_SCALE: schema.is_scale_value}


def _taken_names(cls: cst.ClassDef, init_attrs: a.Assignments) -> list[str]:
    """How the class uses the bypass's names for something else, in words (none: free).
    ``init_attrs``: ``__init__``'s ``self.`` assignments (none where the file never names the flag)."""
    taken = []
    at_class = a.scope_bindings(cls.body)
    for name in (schema.FP8_FLAG, schema.FP8_SCALE):
        if name in at_class:
            taken.append(f"`{name}` is defined in the class body (a property, method or class attribute)")
    if "__slots__" in at_class:
        taken.append("the class declares `__slots__`, which leaves no room for `self._fp8_kv`")
    insert_kv = at_class.get(schema.INSERT_KV, [])
    if len(insert_kv) > 1 or any(not isinstance(n, cst.FunctionDef) or n.decorators for n in insert_kv):
        taken.append(f"`{schema.INSERT_KV}` is bound in the class body other than by one plain `def`")
    own = set()  # the values of the first flag and scale assignments in __init__, if they are the bypass's
    for name, is_own in _OWN_VALUES.items():
        first = init_attrs.get(name, [])[:1]
        if first and matches(first[0][1], is_own):
            own.add(id(first[0][1]))
    for method in a.methods(cls):
        for node in a.all_statements(method.body):
            stored = {a.self_attr(t) for t in _store_targets(node)}
            if schema.INSERT_KV in stored:
                taken.append(f"`self.{schema.INSERT_KV}` is assigned in {method.name.value}, hiding the method")
            names = stored & set(_OWN_VALUES)
            if names and id(getattr(node, "value", None)) not in own:
                shown = " ".join(a.code(node).split())
                taken.append(
                    f"`{shown}` in {method.name.value} (the bypass sets `self.{min(names)}` once, in __init__, "
                    f"to its own value)"
                )
    return taken


def _store_targets(stmt: cst.CSTNode) -> list[cst.BaseExpression]:
    """What a statement stores to (``self.x`` of ``self.x = …``, ``for self.x in …``, ``with … as self.x``)."""
    if isinstance(stmt, cst.Assign):
        return [t.target for t in stmt.targets]
    if isinstance(stmt, (cst.AnnAssign, cst.AugAssign, cst.Del, cst.For)):
        return [stmt.target]
    if isinstance(stmt, cst.With):
        return [item.asname.name for item in stmt.items if item.asname is not None]
    return []


def _insert_is_wired(insert: cst.Call, fused: a.OpCall) -> bool:
    args = [x for x in insert.args if x.keyword is None]
    main = fused.arg(schema.SLOT_MAPPING)
    index = fused.arg(schema.INDEX_SLOT_MAPPING)
    if len(insert.args) != 5 or len(args) != 5 or main is None or index is None:
        return False
    return a.same_expr(args[3].value, main.value) and a.same_expr(args[4].value, index.value)
