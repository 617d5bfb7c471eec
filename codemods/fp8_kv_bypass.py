"""The rewrite: route fp8 KV-cache writes around MiniMax-M3's bf16-only fused insert op.

What it matches: every call of ``fused_minimax_m3_qknorm_rope_kv_insert`` (and
of a module function that passes its arguments through), the class and method
around it, and the bypass pieces there (``collect_pieces``); ``schema`` decides
each call's state. For a call that needs work it plans, from names it proves in
the file, what to write (``BypassPlan``), or refuses (``Unsupported``).

What it writes (the templates below, ``FLAG`` to ``INSERT_KV_METHOD``)::

    # before: a fork-era forward              # after
    ops.fused_…(qkv, …,                        insert_via_fused = not self._fp8_kv
        self.kv_cache,                         ops.fused_…(qkv, …,
        self.indexer.kv_cache, …)                  self.kv_cache if insert_via_fused else None,
                                                   self.indexer.kv_cache if insert_via_fused else None, …)
                                               if not insert_via_fused:
                                                   k, v, index_k = <strided views of qkv>
                                                   self._insert_kv(k, v, index_k, slots, index_slots)

plus ``self._fp8_kv = "fp8" in self.kv_cache_dtype`` in ``__init__`` and an
``_insert_kv`` that writes with ``reshape_and_cache_flash`` (which quantizes and
skips padded slot -1). ``INSERT_KV_METADATA`` is the fork-era ``_insert_kv``
that ``revert`` puts back.

How: ``Fp8KvBypass``, the transformer that applies one plan.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from codemods import anchors as a
from codemods import schema
from codemods.schema import CHANGING, GUARD_NAME, Action, InsertSite, SiteState

if TYPE_CHECKING:
    from codemods.fp8_kv_revert import RevertPlan


class Unsupported(Exception):
    """The rewrite cannot be proven safe; the message says what was missing."""


@dataclass
class FileAnalysis:
    """Each site with its action, and the plans of the changes (``revert``'s too: RevertPlans)."""

    module: cst.Module
    sites: list[InsertSite]
    plans: list[BypassPlan | RevertPlan]  # a RevertPlan strips a bypass from a native call
    source_map: a.SourceMap | None = None

    @property
    def patched_after(self) -> int:
        """How many sites the rewrite leaves ``patched`` (a stripped one ends ``native``)."""
        return sum(1 for p in self.plans if isinstance(p, BypassPlan))

    @property
    def needs_rewrite(self) -> bool:
        return bool(self.plans)  # a site left to change always has its plan

    @property
    def refused(self) -> list[InsertSite]:
        return [s for s in self.sites if s.action is Action.REFUSE]


# --- classification -----------------------------------------------------------------


def analyze(module: cst.Module, source: str | bytes | None = None) -> FileAnalysis:
    """Classify every call of the fused op in ``module`` (and plan what needs work);
    ``source``: the text it was parsed from, where the caller has it (else generated again)."""
    if source is None:
        source = module.code
    source_map = a.SourceMap.of(module, source)
    finder = find_calls(module, source_map, a.pass_through_wrappers(module))
    found_calls = finder.found
    flag = schema.FP8_FLAG if isinstance(source, str) else schema.FP8_FLAG.encode()
    mentions_flag = flag in source  # type: ignore[operator]
    functions = a.module_functions(module)
    classified = [classify(module, f, functions, mentions_flag) for f in found_calls]
    strays = [_stray_site(stmt, source_map) for _, stmt in finder.strays()]
    sites = schema.one_candidate([site for site, _ in classified] + strays)
    plans = [plan for (_, plan), site in zip(classified, sites) if plan is not None and site.action in CHANGING]
    return FileAnalysis(module, sites, plans, source_map)


def _stray_site(stmt: cst.CSTNode | None, source_map: a.SourceMap | None) -> InsertSite:
    """The op named where its calls cannot be followed: the file cannot be called safe."""
    assert stmt is not None  # a name sits in a statement, which the finder visits first
    span = source_map.span(stmt) if source_map is not None else None
    # the statement itself (not the comments above it; a block's header line)
    text = a.code(stmt.with_changes(leading_lines=[]))
    shown = " ".join((text if isinstance(stmt, cst.SimpleStatementLine) else text.splitlines()[0]).split())
    if len(shown) > 100:
        shown = shown[:97] + "..."
    reason = (
        f"the op is named without being called by that name (`{shown}`): calls through an "
        f"import alias, a local or getattr cannot be followed, so whether this file needs the bypass "
        f"cannot be told. Call it as `ops.{schema.FUSED_OP}(…)` (or import it without `as`), then run again"
    )
    return InsertSite(None, "<module>", span[0] if span else 0, SiteState.UNSUPPORTED, Action.REFUSE, reason)


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


def classify(
    module: cst.Module,
    found: FoundCall,
    functions: dict[str, cst.FunctionDef],
    mentions_flag: bool = True,
) -> tuple[InsertSite, BypassPlan | RevertPlan | None]:
    facts, slot = call_facts(found)
    found_pieces: list[_Pieces] = []

    def collect() -> _Pieces:
        assert found.cls is not None and found.method is not None
        found_pieces.append(collect_pieces(found.cls, found.method, found.op, slot, functions, mentions_flag))
        return found_pieces[-1]

    decided = schema.verdict(facts, collect)
    plan: BypassPlan | RevertPlan | None = None
    failure = None
    try:
        if decided.action is Action.STRIP:
            from codemods import fp8_kv_revert  # the strip is the revert of that one site

            plan = fp8_kv_revert.plan_strip(module, found, functions)
        elif decided.action in CHANGING:
            assert slot is not None
            plan = _build_plan(module, found, slot, found_pieces[-1], functions)
    except Unsupported as exc:
        failure = str(exc)
    return schema.planned(decided, failure), plan


# --- finding the calls --------------------------------------------------------


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
    module: cst.Module, source_map: a.SourceMap | None, wrappers: dict[str, a.Wrapper]
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


# --- the pieces of a bypass ----------------------------------------------------


@dataclass
class _Pieces(schema.Pieces):
    """The pieces (``schema.Pieces``), with the LibCST nodes the plan still needs."""

    post_insert_call: cst.Call | None = None


def _guard_of(arg: cst.Arg | None) -> str | None:
    """``X if G else None`` -> ``"G"``."""
    value = arg.value if arg is not None else None
    if isinstance(value, cst.IfExp) and isinstance(value.test, cst.Name) and a.is_none(value.orelse):
        return value.test.value
    return None


def _unguarded(arg: cst.Arg) -> cst.BaseExpression:
    value = arg.value
    if isinstance(value, cst.IfExp) and _guard_of(arg) is not None:
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
) -> _Pieces:
    """``functions``: the module's top-level defs (``_insert_kv`` may hand its work to one).
    ``mentions_flag``: the file's text holds the flag's name at all (else no walk for it)."""
    p = _Pieces()
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
    conditions = [(arg, _guard_of(arg)) for arg in (op.arg(schema.KV_CACHE), op.arg(schema.INDEX_CACHE))]
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
        if g and (g not in own or isinstance(_unguarded(arg), cst.IfExp))  # type: ignore[arg-type]
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


def _taken_names(cls: cst.ClassDef, init_attrs: _Assignments) -> list[str]:
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


# --- the plan -------------------------------------------------------------------


@dataclass
class BypassPlan:
    """Everything the transformer needs, found in and checked against the file."""

    cls: cst.ClassDef
    method: cst.FunctionDef
    op: a.OpCall
    call_slot: a.StatementSlot
    guard: str
    add_guard: bool
    guard_code: str
    wrap_args: list[schema.OpParam]
    add_post_insert: bool
    post_insert_code: str
    flag_slot: a.StatementSlot | None  # insert `self._fp8_kv = ...` (and the scale) after it
    flag_code: str
    insert_kv: str  # keep | replace | add | upgrade
    insert_kv_code: str
    old_insert_kv: cst.FunctionDef | None
    reshape_import: tuple[cst.SimpleStatementLine, cst.ImportFrom] | None
    scopes: tuple[cst.CSTNode, ...] = ()  # the defs/classes the transformer must enter
    # statement -> the code that replaces it (the upgrade of an older `_insert_kv`)
    edits: list[tuple[cst.BaseStatement, str]] = field(default_factory=list)


_Assignments = dict[str, list[tuple[a.StatementSlot, cst.BaseExpression]]]


def _fresh(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate = f"{name}_fp8" if n == 1 else f"{name}_fp8_{n}"
        n += 1
    taken.add(candidate)
    return candidate


def _custom_ops(imports: list[a.ImportedName]) -> str | None:
    """The code that names ``vllm._custom_ops`` in this module (``ops`` of ``from vllm import
    _custom_ops as ops``), where ``reshape_and_cache_flash`` is; None if it is not imported."""
    for imp in imports:
        statement = imp.statement.body[0] if len(imp.statement.body) == 1 else None
        name = a.code(imp.alias.name).replace(" ", "")
        if isinstance(statement, cst.ImportFrom) and statement.module is not None:
            module = a.code(statement.module).replace(" ", "")
            if statement.relative or f"{module}.{name}" != "vllm._custom_ops":
                continue
            return imp.bound
        if isinstance(statement, cst.Import) and name == "vllm._custom_ops":
            return imp.bound if imp.alias.asname is not None else name
    return None


def op_namespace(op: a.OpCall, imports: list[a.ImportedName]) -> str | None:
    """Where ``reshape_and_cache_flash`` is, proven from how the module reaches the fused op:
    ``torch.ops._C`` -> ``torch.ops._C_cache_ops``; ``vllm._custom_ops`` under any name -> that
    name; a bare name -> None (imported beside it, ``_bare_import``). Any other namespace
    (``torch.ops.vllm``, a fork's own module) is not known to hold it: the module's
    ``vllm._custom_ops``, else ``Unsupported``."""
    func = op.call.func
    if op.wrapper is None and isinstance(func, cst.Attribute):
        if a.code(func.value).replace(" ", "") == "torch.ops._C":
            return "torch.ops._C_cache_ops"
    elif op.wrapper is None and isinstance(func, cst.Name):
        return None
    namespace = _custom_ops(imports)
    if namespace is None:
        shown = a.code(func) if op.wrapper is None else f"wrapper `{op.wrapper.name}`"
        raise Unsupported(
            f"the op is called through {shown}, and the module does not import `vllm._custom_ops`, "
            f"where `{schema.RESHAPE_OP}` is: add `from vllm import _custom_ops as ops`, then run again"
        )
    return namespace


def _build_plan(
    module: cst.Module,
    found: FoundCall,
    slot: a.StatementSlot,
    p: _Pieces,
    functions: dict[str, cst.FunctionDef],
) -> BypassPlan:
    """Find and check every name the bypass needs; raise ``Unsupported`` if one is missing.
    ``functions``: the module's top-level defs (``collect_pieces``)."""
    cls, method, op = found.cls, found.method, found.op
    assert cls is not None and method is not None
    if method.name.value == "__init__":
        raise Unsupported("the insert call is in __init__, not in a forward path")
    init = a.find_method(cls, "__init__")
    if init is None:
        raise Unsupported(f"class {cls.name.value} has no __init__ to hold `self._fp8_kv`")
    imports = a.module_imports(module)
    if not any(i.bound == "torch" and a.code(i.alias.name) == "torch" for i in imports):
        raise Unsupported("the module does not `import torch`, which the bypass uses")
    insert_kv = {"absent": "add", "metadata": "replace", "slots": "keep", "scatter": "upgrade"}.get(p.insert_kv)
    if insert_kv is None:
        raise Unsupported(
            "`_insert_kv` exists in a form that is neither the attn_metadata one nor the slot-mapping one"
        )
    old_insert_kv = a.find_method(cls, schema.INSERT_KV)
    # Only the post-call insert may call `_insert_kv`: the rewrite gives it the slot-mapping
    # signature; a call elsewhere is a caller it would break, or a stale piece of a bypass.
    own = a.nodes_in(old_insert_kv) if old_insert_kv is not None else []
    call = other_insert_kv_call(cls, {id(p.post_insert_call), *map(id, own)})
    if call is not None:
        raise Unsupported(
            f"`{' '.join(a.code(call).split())}` is called elsewhere than right after the insert call: "
            "a caller the new `_insert_kv` signature would break, or a stale bypass piece"
        )

    # On a native call (a torch.compile-aware bypass, ``schema``) the kernel writes fp8 in eager:
    # the guard only keeps the cache arguments from it while compiling, and needs no flag.
    native = op.arg(schema.KV_CACHE_DTYPE) is not None
    if native and p.flag_read and not p.flag_set:
        raise Unsupported(
            f"`self.{schema.FP8_FLAG}` is read but never set: set it in __init__ "
            f'(`self.{schema.FP8_FLAG} = "fp8" in self.{schema.DTYPE_ATTR}`) or drop its reads, then run again'
        )
    taken = a.bound_names(method)
    guard = _guard_name(p, taken)
    caches, wrap = cache_args(op, method, slot)
    qkv, main_slots, index_slots = _qkv_and_slots(op)
    init_attrs = a.self_assignments(init)
    w = widths(op, method, slot, init_attrs)
    flag_slot = _dtype_anchor(init, init_attrs)
    dtype_attr = f"self.{schema.DTYPE_ATTR}"
    if flag_slot is None:
        raise Unsupported("cannot find the kv-cache dtype attribute (`self.kv_cache_dtype`) in __init__")
    namespace = op_namespace(op, imports)
    reshape_import = _bare_import(module, imports) if namespace is None else None
    reshape_call = schema.RESHAPE_OP if namespace is None else f"{namespace}.{schema.RESHAPE_OP}"

    # The upgrade: the raw index scatters of `_insert_kv` and of what it hands its work to.
    upgraded: list[cst.FunctionDef] = []
    if insert_kv == "upgrade":
        assert old_insert_kv is not None
        upgraded = [old_insert_kv, *a.delegates(old_insert_kv, cls, functions)]
    edits: list[tuple[cst.BaseStatement, str]] = []
    for fn in upgraded:
        for scatter in a.raw_scatters(fn):
            edits += _scatter_edits(fn, scatter, module)
    reads_scale = insert_kv in ("add", "replace") or p.scale_read or any(SCALE_READ in code for _, code in edits)
    scale_code = render(SCALE, module) if reads_scale and not p.scale_set else ""
    if p.flag_set and scale_code:
        flag_slot = init_attrs[schema.FP8_FLAG][-1][0]  # the scale goes right after the existing flag
    add_flag = not p.flag_set and not native
    local = {f"n_{k}": _fresh(k, taken) for k in ("kv", "k0", "ik0", "k", "v", "index_k")}
    return BypassPlan(
        cls=cls,
        method=method,
        op=op,
        call_slot=slot,
        guard=guard,
        add_guard=p.guard_assigned is None,
        guard_code=render(NATIVE_GUARD if native else GUARD, module, guard=guard),
        wrap_args=wrap,
        add_post_insert=not p.post_insert,
        post_insert_code=render(
            POST_INSERT,
            module,
            guard=guard,
            qkv=qkv,
            kv_width=w.kv,
            q_width=w.q,
            index_q_width=w.index_q,
            idx_head_dim=w.idx_head_dim,
            main_slots=main_slots,
            index_slots=index_slots,
            **local,
        ),
        flag_slot=flag_slot if (add_flag or scale_code) else None,
        flag_code=(render(FLAG, module, dtype=dtype_attr) if add_flag else "") + scale_code,
        insert_kv=insert_kv,
        insert_kv_code=render(
            INSERT_KV_METHOD,
            module,
            len(found.outer) + 1,
            kv_cache=caches[schema.KV_CACHE.keyword],
            num_kv_heads=w.num_kv_heads,
            head_dim=w.head_dim,
            dtype=dtype_attr,
            reshape=reshape_call,
            index_write=_indented(
                INDEX_WRITE.format(
                    I=module.default_indent,
                    idx_key="idx_key",
                    idx_cache="idx_cache",
                    index_key="index_key",
                    index_cache=caches[schema.INDEX_CACHE.keyword],
                    idx_head_dim=w.idx_head_dim,
                    index_slots="index_slot_mapping",
                    reshape=reshape_call,
                    scale="scale",
                ),
                module.default_indent,
            ),
        ),
        old_insert_kv=old_insert_kv if insert_kv == "replace" else None,
        reshape_import=reshape_import,
        scopes=(*found.outer, cls, method, init, *upgraded),
        edits=edits,
    )


# --- the upgrade of an older `_insert_kv` ------------------------------------------------


def _scatter_edits(
    fn: cst.FunctionDef, scatter: a.StatementSlot, module: cst.Module
) -> list[tuple[cst.BaseStatement, str]]:
    """``idx = <cache>.view(-1, D)`` + ``idx[slots] = key[.to(...)]`` -> the padding-safe write,
    proven to write the same rows; ``Unsupported`` when any part is not that shape."""
    shown = " ".join(a.code(scatter.statement).split())
    pair = a.simple_assignment(scatter.statement)
    assert pair is not None and isinstance(pair[0], cst.Subscript)
    target, value = pair
    slots = a.code(target.slice[0].slice.value)  # type: ignore[attr-defined]
    key = value.func.value if _is_method_call(value, "to") else value  # type: ignore[attr-defined]
    if not (isinstance(key, cst.Name) and key.value in a.param_names(fn)):
        raise Unsupported(f"cannot upgrade `{shown}`: what it writes is not a parameter of {fn.name.value}")
    view_stmt = None
    view = target.value
    if isinstance(target.value, cst.Name):
        view_slot = _single_assignment(fn, target.value.value, scatter)
        if view_slot is None:
            raise Unsupported(f"cannot upgrade `{shown}`: `{target.value.value}` is not assigned once before it")
        view_stmt = view_slot.statement
        view = a.simple_assignment(view_stmt)[1]  # type: ignore[index]
    if not (_is_method_call(view, "view") and len(view.args) == 2 and a.code(view.args[0].value) == "-1"):  # type: ignore[attr-defined]
        raise Unsupported(f"cannot upgrade `{shown}`: its cache is not `<index cache>.view(-1, <head dim>)`")
    calls = (n for n in a.walk_scope(fn.body) if isinstance(n, cst.Call))
    reshape = next((c for c in calls if a.callee_name(c) == schema.RESHAPE_OP), None)
    if reshape is None:
        raise Unsupported(f"cannot upgrade `{shown}`: {fn.name.value} holds no `{schema.RESHAPE_OP}` call to follow")
    scale_arg = a.get_arg(reshape, schema.OpParam(6, "k_scale"))
    if scale_arg is None or not a.is_pure(scale_arg.value):
        raise Unsupported(f"cannot upgrade `{shown}`: the scale of `{schema.RESHAPE_OP}` is not a plain name")
    taken = a.bound_names(fn)
    write = render(
        INDEX_WRITE,
        module,
        idx_key=_fresh("idx_key", taken),
        idx_cache=target.value.value if isinstance(target.value, cst.Name) else _fresh("idx_cache", taken),
        index_key=key.value,
        index_cache=a.code(view.func.value),  # type: ignore[attr-defined]
        idx_head_dim=a.code(view.args[1].value),  # type: ignore[attr-defined]
        index_slots=slots,
        reshape=a.code(reshape.func),
        scale=a.code(scale_arg.value),
    )
    edits = [(view_stmt, write), (scatter.statement, "")] if view_stmt is not None else [(scatter.statement, write)]
    scale = _ones_scale(fn, scale_arg.value)
    if scale is not None and a.param_names(fn)[:1] == ["self"]:
        edits.append((scale.statement, render(SCALE_LOCAL, module, scale=a.code(scale_arg.value))))
    return edits


def _is_method_call(node: cst.BaseExpression, name: str) -> bool:
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == name


def _single_assignment(fn: cst.FunctionDef, name: str, before: a.StatementSlot) -> a.StatementSlot | None:
    """The one statement of ``fn`` that assigns ``name``, if it comes before ``before`` in its block
    and ``name`` is read nowhere but in ``before``."""
    assigned = [
        x
        for x in a.statement_slots(fn)
        if (pair := a.simple_assignment(x.statement)) and isinstance(pair[0], cst.Name) and pair[0].value == name
    ]
    if len(assigned) != 1 or assigned[0].block is not before.block or assigned[0].index > before.index:
        return None
    reads = [
        node
        for x in a.statement_slots(fn)
        if x.statement is not assigned[0].statement and x.statement is not before.statement
        for node in a.nodes_in(x.statement)
        if isinstance(node, cst.Name) and node.value == name
    ]
    return None if reads else assigned[0]


def _ones_scale(fn: cst.FunctionDef, scale: cst.BaseExpression) -> a.StatementSlot | None:
    """``<scale> = torch.ones(...)``: a fill kernel on every call, where the buffer needs none."""
    if not isinstance(scale, cst.Name):
        return None
    for x in a.statement_slots(fn):
        pair = a.simple_assignment(x.statement)
        if (
            pair
            and isinstance(pair[0], cst.Name)
            and pair[0].value == scale.value
            and isinstance(pair[1], cst.Call)
            and a.code(pair[1].func).replace(" ", "") == "torch.ones"
        ):
            return x
    return None


def _guard_name(p: schema.Pieces, taken: set[str]) -> str:
    """From guarded arguments, else an existing guard assignment, else a fresh name."""
    if len(set(p.guard_args)) > 1:
        raise Unsupported(f"cache arguments are guarded by different names: {sorted(set(p.guard_args))}")
    if p.guard_other:
        raise Unsupported("the guard name is assigned something other than `not self._fp8_kv`")
    if p.post_insert and not p.post_insert_wired:
        raise Unsupported(
            "a post-call `self._insert_kv(...)` exists but is not under `if not <guard>:` "
            "or is not passed the call's own slot mappings"
        )
    if p.guard_args:
        return p.guard_args[0]
    return p.guard_assigned or _fresh(GUARD_NAME, taken)


def cache_args(
    op: a.OpCall, method: cst.FunctionDef, slot: a.StatementSlot
) -> tuple[dict[str, str], list[schema.OpParam]]:
    """The cache expressions `_insert_kv` can reach, and which arguments still need the guard."""
    caches: dict[str, str] = {}
    wrap: list[schema.OpParam] = []
    for param in (schema.KV_CACHE, schema.INDEX_CACHE):
        arg = op.arg(param)
        if arg is None or a.is_none(arg.value):
            raise Unsupported(f"the call passes no `{param.keyword}` argument to guard")
        if isinstance(arg.value, cst.IfExp) and _guard_of(arg) is None:
            raise Unsupported(
                f"`{param.keyword}` is a conditional that cannot be guarded: {a.code(arg.value)}"
            )
        if _guard_of(arg) is None:
            wrap.append(param)
        value = _unguarded(arg)
        resolved = a.resolve_self_expr(method, value, slot)
        if resolved is None:
            raise Unsupported(
                f"`{param.keyword}` argument `{a.code(value)}` is not a `self.` attribute "
                "(or a local proven to hold one on every path to the call) that _insert_kv can reach"
            )
        caches[param.keyword] = a.code(resolved)
    return caches, wrap


def _qkv_and_slots(op: a.OpCall) -> tuple[str, str, str]:
    """The fused buffer and the two slot-mapping expressions, safe to use again after the call."""
    qkv = op.arg(schema.QKV)
    if qkv is None or not isinstance(qkv.value, cst.Name):
        raise Unsupported("the fused qkv argument is not a plain local name")
    slots = []
    for param in (schema.SLOT_MAPPING, schema.INDEX_SLOT_MAPPING):
        arg = op.arg(param)
        if arg is None or a.is_none(arg.value) or not a.is_pure(arg.value):
            shown = a.code(arg.value) if arg is not None else "nothing"
            raise Unsupported(
                f"`{param.keyword}` ({shown}) is not a name or attribute that can be passed again"
            )
        slots.append(a.code(arg.value))
    return qkv.value.value, slots[0], slots[1]


@dataclass
class _Widths:
    """Code for the widths of the fused buffer's parts: [q | k | v | index_q | index_k]."""

    q: str
    kv: str
    index_q: str
    head_dim: str
    idx_head_dim: str  # also the width of index_k: a single head
    num_kv_heads: str


_NORM_WEIGHTS = {  # the norms whose weights the call passes, by the head size they are built with
    "head_dim": (schema.OP_PARAMS[1], schema.OP_PARAMS[2]),  # q_norm_weight, k_norm_weight
    "idx_head_dim": (schema.OP_PARAMS[9], schema.OP_PARAMS[10]),  # index_q_norm_weight, index_k_norm_weight
}


def widths(
    op: a.OpCall, method: cst.FunctionDef, slot: a.StatementSlot, init_attrs: _Assignments
) -> _Widths:
    """Each size by what it is in the fused buffer's layout, never by the first product that fits.

    The head counts are what the call passes. A head size is what the norms of that part
    are built with (``self.q_norm = Norm(self.head_dim, …)``, whose ``.weight`` the call
    passes); without that, the one size that multiplies both the q and the kv head count
    in ``__init__`` (for the index part: the index head count). A width is a
    ``self.W = <count> * <size>`` of ``__init__`` assigned once, else that product itself.
    """
    counts: dict[str, cst.BaseExpression] = {}
    for param in (schema.NUM_HEADS, schema.NUM_KV_HEADS, schema.NUM_INDEX_HEADS):
        arg = op.arg(param)
        resolved = a.resolve_self_expr(method, arg.value, slot) if arg is not None else None
        if resolved is None:
            raise Unsupported(f"`{param.keyword}` is not a `self.` attribute (or a local proven to hold one)")
        counts[param.keyword] = resolved
    products = _products(init_attrs)

    def size(what: str, label: str, *count_names: str) -> str:
        built = _norm_sizes(op, method, slot, init_attrs, _NORM_WEIGHTS[what])
        if len(built) > 1:
            raise Unsupported(f"the norms of one part are built with different sizes: {sorted(built)}")
        if built:
            return built.pop()
        # The sizes each count multiplies; the first count's narrowed by the next ones'.
        found = [f for n in count_names if (f := {d for w, c, d in products if a.same_expr(c, counts[n])})]
        candidates = found[0] if found else set()
        for more in found[1:]:
            if len(candidates) > 1 and candidates & more:
                candidates &= more
        if len(candidates) != 1:
            could = sorted(candidates)
            raise Unsupported(
                f"cannot tell the {label} ({what}): "
                + (f"{', '.join(could)} could each be it" if could else "no norm is built with it and no "
                   f"`self.<width> = <{count_names[0]}> * self.<size>` is in __init__")
                + f"; build the norms with it (`self.q_norm = RMSNorm(self.{what}, …)`), then run again"
            )
        return candidates.pop()

    head_dim = size("head_dim", "head size", "num_heads", "num_kv_heads")
    idx_head_dim = size("idx_head_dim", "index head size", "num_index_heads")

    def width(count: cst.BaseExpression, dim: str) -> str:
        for attr, c, d in products:
            if a.same_expr(c, count) and d == dim:
                return f"self.{attr}"
        return f"{a.code(count)} * {dim}"

    return _Widths(
        q=width(counts["num_heads"], head_dim),
        kv=width(counts["num_kv_heads"], head_dim),
        index_q=width(counts["num_index_heads"], idx_head_dim),
        head_dim=head_dim,
        idx_head_dim=idx_head_dim,
        num_kv_heads=a.code(counts["num_kv_heads"]),
    )


def _products(init_attrs: _Assignments) -> list[tuple[str, cst.BaseExpression, str]]:
    """``self.W = <count> * self.D`` assigned once in __init__ (either order): (W, count, "self.D")."""
    found = []
    for attr, defs in init_attrs.items():
        value = defs[0][1] if len(defs) == 1 else None
        if not (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply)):
            continue
        for count, dim in ((value.left, value.right), (value.right, value.left)):
            if a.self_attr(dim) is not None:
                found.append((attr, count, a.code(dim)))
    return found


def _norm_sizes(
    op: a.OpCall, method: cst.FunctionDef, slot: a.StatementSlot, init_attrs: _Assignments, params
) -> set[str]:
    """The ``self.D`` that the norms passed as ``params`` are built with: ``self.N = Norm(self.D, …)``
    in __init__ (assigned once), ``self.N.weight`` passed."""
    sizes = set()
    for param in params:
        arg = op.arg(param)
        weight = a.resolve_self_expr(method, arg.value, slot) if arg is not None else None
        if not (isinstance(weight, cst.Attribute) and weight.attr.value == "weight"):
            continue
        owner = a.self_attr(weight.value)
        defs = init_attrs.get(owner, []) if owner is not None else []
        ctor = defs[0][1] if len(defs) == 1 else None
        if isinstance(ctor, cst.Call):
            first = next((x for x in ctor.args if x.keyword is None and not x.star), None)
            if first is not None and a.self_attr(first.value) is not None:
                sizes.add(a.code(first.value))
    return sizes


def _dtype_anchor(init: cst.FunctionDef, attrs: _Assignments) -> a.StatementSlot | None:
    """The statement after which the flag goes; None where __init__ does not set the dtype.

    The flag is made from the main cache's dtype, ``self.kv_cache_dtype`` (what vLLM's
    backends read; the indexer's own dtype is another attribute), after the last statement
    of __init__'s body that assigns it - and after the torch dtype made from it, if one
    follows (that statement, not one in a lambda or nested def)."""
    defs = attrs.get(schema.DTYPE_ATTR)
    if not defs:
        return None
    top = a.slot_chain(init, defs[-1][0])[0]
    for i in range(top.index + 1, len(top.block.body)):
        if any(_is_dtype_conversion(n) for n in a.nodes_in(top.block.body[i], scope_only=True)):
            return a.StatementSlot(top.block, i)
    return top


def _is_dtype_conversion(node: cst.CSTNode) -> bool:
    """``kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, …)``."""
    return (
        isinstance(node, cst.Call)
        and a.callee_name(node) == "kv_cache_dtype_str_to_dtype"
        and bool(node.args)
        and a.self_attr(node.args[0].value) == schema.DTYPE_ATTR
    )


def _bare_import(
    module: cst.Module, imports: list[a.ImportedName]
) -> tuple[cst.SimpleStatementLine, cst.ImportFrom] | None:
    """For a bare ``fused_…(…)`` callee: ``from vllm._custom_ops import fused_…``, beside which
    ``reshape_and_cache_flash`` is imported."""
    if any(i.bound == schema.RESHAPE_OP for i in imports):
        return None
    for imp in imports:
        if imp.bound == schema.FUSED_OP and imp.alias.asname is None:
            for small in imp.statement.body:
                if (
                    isinstance(small, cst.ImportFrom)
                    and imp.alias in small.names
                    and not small.relative
                    and small.module is not None
                    and a.code(small.module).replace(" ", "") == "vllm._custom_ops"
                ):
                    return imp.statement, small
    raise Unsupported(
        f"`{schema.FUSED_OP}` is called by a bare name that `from vllm._custom_ops import …` does not bring in: "
        f"where `{schema.RESHAPE_OP}` is cannot be told; import both from `vllm._custom_ops`, then run again"
    )


# --- generated code ---------------------------------------------------------------

FLAG = """\
# fp8 KV cache: the fused qknorm+rope+kv-insert op writes bf16 caches only;
# forward() then runs it norm+rope-only and writes the cache via _insert_kv().
self._fp8_kv = "fp8" in {dtype}
"""

SCALE = """\
self._fp8_kv_scale = torch.ones((), dtype=torch.float32)  # identity: x / 1
"""

SCALE_READ = "self._fp8_kv_scale"
SCALE_LOCAL = """\
{scale} = self._fp8_kv_scale  # identity: stores x / 1
"""

GUARD = """\
# fp8 KV cache: cache arguments None -> the fused op only norms/ropes in place.
{guard} = not self._fp8_kv
"""

NATIVE_GUARD = """\
# fp8 KV cache, torch.compile-aware: in eager the native kernel writes the cache
# (fp8 included, padded slots skipped); while compiling the slot mappings are
# None, so the cache arguments are too and the post-call block writes the cache.
{guard} = not torch.compiler.is_compiling()
"""

POST_INSERT = """\
if not {guard}:
{I}# {qkv} is [q | k | v | index_q | index_k]: the fused op left k and index_k
{I}# normed/roped in place and v raw; write them (strided views) to the cache.
{I}{n_kv} = {kv_width}
{I}{n_k0} = {q_width}
{I}{n_ik0} = {n_k0} + 2 * {n_kv} + {index_q_width}
{I}{n_k} = {qkv}[:, {n_k0} : {n_k0} + {n_kv}]
{I}{n_v} = {qkv}[:, {n_k0} + {n_kv} : {n_k0} + 2 * {n_kv}]
{I}{n_index_k} = {qkv}[:, {n_ik0} : {n_ik0} + {idx_head_dim}]  # one index-key head
{I}self._insert_kv({n_k}, {n_v}, {n_index_k}, {main_slots}, {index_slots})
"""

# The index key as the key and value of a one-slot-per-block view of the index
# cache: reshape_and_cache_flash skips slot -1 (a padded token) as the fused op does.
INDEX_WRITE = """\
# Index-key cache: one head per token, written by reshape_and_cache_flash,
# which skips padded tokens (slot -1) as the fused op does.
{idx_key} = {index_key}.view(-1, 1, {idx_head_dim})
{idx_cache} = {index_cache}.view(-1, 1, 1, {idx_head_dim})
assert {idx_cache}.dtype == {idx_key}.dtype  # the index cache stays bf16
{reshape}(
{I}{idx_key},
{I}{idx_key},
{I}{idx_cache},
{I}{idx_cache},
{I}{index_slots},
{I}"auto",
{I}{scale},
{I}{scale},
)
"""

INSERT_KV_METHOD = '''\
def _insert_kv(
{I}self,
{I}key: torch.Tensor,
{I}value: torch.Tensor,
{I}index_key: torch.Tensor,
{I}main_slot_mapping: torch.Tensor,
{I}index_slot_mapping: torch.Tensor,
) -> None:
{I}"""Write main K/V (fp8-quantizing) and index-K into their paged caches.

{D}Used only on the fp8-KV path, where the bf16-only fused op runs in
{D}norm+rope-only mode: ``reshape_and_cache_flash`` honours kv_cache_dtype.
{D}The index cache stays bf16 (no quantization).
{D}"""
{I}key_cache, value_cache = {kv_cache}.unbind(1)
{I}scale = self._fp8_kv_scale  # identity: stores x / 1
{I}{reshape}(
{I}{I}key.view(-1, {num_kv_heads}, {head_dim}),
{I}{I}value.view(-1, {num_kv_heads}, {head_dim}),
{I}{I}key_cache,
{I}{I}value_cache,
{I}{I}main_slot_mapping,
{I}{I}{dtype},
{I}{I}scale,
{I}{I}scale,
{I})
{index_write}'''


# What `revert` puts back: the fork-era `_insert_kv`, reading the slot mappings from the
# forward context's metadata (names filled in from the file like the templates above).
INSERT_KV_METADATA = '''\
def _insert_kv(
{I}self, key: torch.Tensor, value: torch.Tensor, index_key: torch.Tensor
) -> None:
{I}"""Write main K/V and index-K into their paged caches.

{D}No-op during the profiling run, where caches are not yet bound and
{D}``attn_metadata`` is None.
{D}"""
{I}attn_metadata = get_forward_context().attn_metadata
{I}if not isinstance(attn_metadata, dict):
{I}{I}return
{I}main_meta = attn_metadata[{main_key}]
{I}index_meta = attn_metadata[{index_key}]
{I}assert isinstance(main_meta, {main_metadata})
{I}assert isinstance(index_meta, {index_metadata})

{I}# Identity scale: unused for the bf16 cache, required arg of the op.
{I}key_cache, value_cache = {kv_cache}.unbind(1)
{I}scale = torch.ones((), device=key.device)
{I}{reshape}(
{I}{I}key.view(-1, {num_kv_heads}, {head_dim}),
{I}{I}value.view(-1, {num_kv_heads}, {head_dim}),
{I}{I}key_cache,
{I}{I}value_cache,
{I}{I}main_meta.slot_mapping,
{I}{I}{dtype},
{I}{I}scale,
{I}{I}scale,
{I})

{I}# Index-key cache: single vector per token, scatter by slot.
{I}idx_cache = {index_cache}.view(-1, {idx_head_dim})
{I}idx_cache[index_meta.slot_mapping] = index_key.to(idx_cache.dtype)
'''

def _indented(text: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else line for line in text.splitlines(keepends=True))


def render(template: str, module: cst.Module, depth: int = 1, **names: str) -> str:
    """Fill a template in the file's indent and newline; ``{I}`` is one indent step, ``{D}``
    a docstring line of a method in a class ``depth`` blocks deep (its text is not re-indented)."""
    text = template.format(I=module.default_indent, D=module.default_indent * (depth + 1), **names)
    return text.replace("\n", module.default_newline)


def parse_statements(text: str, module: cst.Module) -> list[cst.BaseStatement]:
    """Parse generated code with the file's indent and newline; comments included."""
    # A leading `pass` keeps the first comment lines on the first statement
    # instead of the module header.
    parsed = cst.parse_module("pass" + module.default_newline + text, config=module.config_for_parsing)
    return list(parsed.body[1:])


# --- the transformer --------------------------------------------------------------------


class Fp8KvBypass(cst.CSTTransformer):
    """Apply one ``BypassPlan``: flag in __init__, guard and insert in the forward path."""

    def __init__(self, module: cst.Module, plan: BypassPlan) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        statements = [plan.call_slot.statement] + ([plan.reshape_import[0]] if plan.reshape_import else [])
        self._enter = {id(n) for n in (*plan.scopes, *statements)}

    def on_visit(self, node: cst.CSTNode) -> bool:
        # Enter only what holds a change: the other methods, classes and simple
        # statements are kept as they are (visiting them costs, changes nothing).
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.SimpleStatementLine)):
            if id(node) not in self._enter:
                return False
        return super().on_visit(node)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if original is not self.plan.op.call:
            return updated
        wrap = [self.plan.op.arg(p) for p in self.plan.wrap_args]
        new_args = []
        for orig_arg, arg in zip(original.args, updated.args, strict=True):
            if any(orig_arg is w for w in wrap):
                arg = arg.with_changes(
                    value=cst.IfExp(
                        test=cst.Name(self.plan.guard),
                        body=arg.value,
                        orelse=cst.Name("None"),
                    )
                )
            new_args.append(arg)
        return updated.with_changes(args=new_args)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        """For a bare-name callee: import ``reshape_and_cache_flash`` beside it."""
        if self.plan.reshape_import is None or original is not self.plan.reshape_import[1]:
            return updated
        assert not isinstance(updated.names, cst.ImportStar)
        names = list(updated.names)
        last = names[-1]
        names[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        names.append(cst.ImportAlias(name=cst.Name(schema.RESHAPE_OP), comma=last.comma))
        return updated.with_changes(names=names)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if original is self.plan.old_insert_kv:
            (new,) = parse_statements(self.plan.insert_kv_code, self.module)
            assert isinstance(new, cst.FunctionDef)
            return new.with_changes(leading_lines=original.leading_lines, decorators=original.decorators)
        return updated

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        plan = self.plan
        edits = {id(stmt): code for stmt, code in plan.edits}
        if any(id(stmt) in edits for stmt in original.body):
            body, carried = self._edited(original, updated, edits)
            return updated.with_changes(body=body, footer=[*carried, *updated.footer])
        body = list(updated.body)
        if original is plan.call_slot.block:
            i = plan.call_slot.index
            after = parse_statements(plan.post_insert_code, self.module) if plan.add_post_insert else []
            before = parse_statements(plan.guard_code, self.module) if plan.add_guard else []
            body[i : i + 1] = [*before, body[i], *after]
        if plan.flag_slot is not None and original is plan.flag_slot.block:
            i = plan.flag_slot.index
            body[i + 1 : i + 1] = parse_statements(plan.flag_code, self.module)
        if original is plan.cls.body and plan.insert_kv == "add":
            (new,) = parse_statements(plan.insert_kv_code, self.module)
            assert isinstance(new, cst.FunctionDef)
            new = new.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
            index = next(i for i, s in enumerate(original.body) if s is plan.method)
            body.insert(index, new)
        return updated.with_changes(body=body)

    def _edited(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock, edits: dict[int, str]
    ) -> tuple[list[cst.BaseStatement], list[cst.EmptyLine]]:
        """The block with each edited statement replaced by its new code (none: removed);
        the comments above it stay, but for those of the code it replaces (those above
        a removed last statement go to the block's end)."""
        body: list[cst.BaseStatement] = []
        carried: list[cst.EmptyLine] = []
        for orig, new in zip(original.body, updated.body, strict=True):
            replacement = [new]
            if id(orig) in edits:
                carried += [line for line in new.leading_lines if not _replaced_comment(line)]
                replacement = parse_statements(edits[id(orig)], self.module)
            if replacement and carried:
                first = replacement[0]
                replacement[0] = first.with_changes(leading_lines=[*carried, *first.leading_lines])
                carried = []
            body += replacement
        return body, carried


# Comments of the code the upgrade replaces (the tool's earlier form and the
# seed write-up's), recognised by their text; any other comment stays.
REPLACED_COMMENTS = (
    "Index-key cache: one vector per token, scattered by slot.",
    "Index-key cache: single vector per token, scatter by slot.",
)


def _replaced_comment(line: cst.EmptyLine) -> bool:
    return line.comment is not None and " ".join(line.comment.value.lstrip("#").split()) in REPLACED_COMMENTS


def apply_plan(module: cst.Module, plan: BypassPlan, source_map: a.SourceMap | None = None) -> cst.Module:
    """Rewrite one site; then drop imports that only the replaced method used."""
    new = module.visit(Fp8KvBypass(module, plan))
    if plan.old_insert_kv is not None:
        added = a.names_read(cst.parse_module(plan.insert_kv_code, config=module.config_for_parsing))
        dropped = a.names_read(plan.old_insert_kv) - added
        if source_map is not None:
            dropped &= source_map.from_imported()  # only those can lose their import
        new = remove_unused_imports(new, dropped, _silent_statements(module, source_map, dropped))
    return new


def _silent_statements(
    module: cst.Module, source_map: a.SourceMap | None, names: set[str]
) -> list[cst.CSTNode]:
    """Statements of ``module`` whose text holds none of ``names``: nothing to count there.

    The rewrite keeps untouched statements as the same objects, so they can be
    skipped in the rewritten module too.
    """
    if source_map is None:
        return []
    try:
        words = [n.encode(module.encoding) for n in names]
    except (UnicodeEncodeError, LookupError):
        return []
    silent = []
    for stmt, _, _ in source_map.spans.values():
        text = source_map.text(stmt)
        if text is not None and not any(w in text for w in words):
            silent.append(stmt)
    return silent


def rewrite(analysis: FileAnalysis) -> cst.Module:
    module = analysis.module
    assert len(analysis.plans) <= 1, "the analyses refuse files with several sites to change"
    for plan in analysis.plans:
        if isinstance(plan, BypassPlan):
            module = apply_plan(module, plan, analysis.source_map)
        else:
            from codemods import fp8_kv_revert

            module = fp8_kv_revert.apply_revert(module, plan)
    return module


# --- imports ------------------------------------------------------------------------------


_STATEMENT_CONTAINERS = (
    cst.Module,
    cst.IndentedBlock,
    cst.BaseCompoundStatement,
    cst.Else,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.Finally,
    cst.MatchCase,
)


def remove_unused_imports(
    module: cst.Module, candidates: set[str], silent: Sequence[cst.CSTNode] = ()
) -> cst.Module:
    """Remove from-import aliases among ``candidates`` that nothing reads any more.

    ``silent``: statements known to mention none of them (not visited).
    """
    if not candidates:
        return module
    uses = a.name_uses(module, skip=silent)
    unused = {n for n in candidates if uses.get(n, 0) == 0}
    if not unused:
        return module

    class Remove(cst.CSTTransformer):
        def on_visit(self, node: cst.CSTNode) -> bool:
            # Only statements hold imports; expressions and one-line statements need no visit.
            return isinstance(node, _STATEMENT_CONTAINERS)

        def leave_SimpleStatementLine(
            self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
        ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
            if len(updated.body) != 1 or not isinstance(updated.body[0], cst.ImportFrom):
                return updated
            imp = updated.body[0]
            if isinstance(imp.names, cst.ImportStar):
                return updated
            names = list(imp.names)
            keep = [n for n in names if n.asname is not None or a.code(n.name) not in unused]
            if len(keep) == len(names):
                return updated
            if not keep:
                if any(line.comment for line in updated.leading_lines):
                    return updated  # keep it rather than lose its comment
                return cst.RemoveFromParent()
            if names[-1] not in keep:  # the removed last alias hands its comma on
                keep[-1] = keep[-1].with_changes(comma=names[-1].comma)
            return updated.with_changes(body=[imp.with_changes(names=keep)])

    return module.visit(Remove())
