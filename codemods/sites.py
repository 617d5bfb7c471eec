"""Finding the sites: every call of the fused op (``find_calls``), where it sits and what it
passes (``call_facts``), and the bypass pieces around it (``collect_pieces``: flag, scale, guard,
post-call insert, ``_insert_kv``'s form). ``schema`` decides from these facts; nothing here writes."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from codemods import anchors as a
from codemods import codegen, guards, names, roles, runtime, schema
from codemods.model import FileModel
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
        if isinstance(node, a.SCOPES):
            self.stack.append(node)
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
            if isinstance(original_node, a.SCOPES):
                self.stack.pop()

    def visit_Call(self, node: cst.Call) -> None:
        name = a.callee_name(node)
        if name != schema.FUSED_OP and name not in self.wrappers:
            return
        op = a.OpCall(node, None if name == schema.FUSED_OP else self.wrappers[name])
        classes = [i for i, n in enumerate(self.stack) if isinstance(n, cst.ClassDef)]
        if not classes:
            outer = self.stack[0] if self.stack else None
            fn = outer.name.value if isinstance(outer, cst.FunctionDef) else "<module>"
            self.found.append(FoundCall(op, 0, None, None, None, fn))
            return
        cls, *inner = self.stack[classes[-1] :]
        method = inner[0] if inner and isinstance(inner[0], cst.FunctionDef) else None
        nested = None
        if len(inner) > 1:  # a def or lambda inside the method
            nested = inner[-1].name.value if isinstance(inner[-1], cst.FunctionDef) else "<lambda>"
        assert isinstance(cls, cst.ClassDef)
        self.found.append(FoundCall(op, 0, cls, method, nested, None, tuple(self.stack[: classes[-1]])))

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
    """Every call of the op, in source order, with the line it starts on (``found``), and where
    the op is named without being called (``strays``). Python's parser gives those lines and the
    statements to skip (``PositionProvider`` and a visit of every node cost more than the rest of
    the analysis); where the two parsers see other calls, every node is visited and numbered."""
    names = {schema.FUSED_OP, *wrappers}
    if source_map is not None:
        needles = [name.encode() for name in names]
        op_lines = [i for i, text in enumerate(source_map.lines) if any(n in text for n in needles)]
        skip = [stmt for stmt, first, last in source_map.spans.values() if not _holds(first, last, op_lines)]
        finder = CallFinder(wrappers, skip)
        module.visit(finder)
        calls = _ast_calls(source_map.tree, op_lines, names)
        if len(calls) == len(finder.found) and all(
            len(c.args) + len(c.keywords) == len(f.call.args) for c, f in zip(calls, finder.found)
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


def _ast_calls(tree: ast.Module, op_lines: list[int], wanted: set[str]) -> list[ast.Call]:
    """ast calls of ``wanted`` (the op, its wrappers), in source order; statements naming none skipped."""
    found: list[ast.Call] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            first = min((d.lineno for d in getattr(node, "decorator_list", ())), default=node.lineno)
            if not _holds(first, node.end_lineno or node.lineno, op_lines):
                return
        if isinstance(node, ast.Call) and names.callee(node) in wanted:
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    # ast keeps fields, not source order (decorators after the body); outer first where two start together
    found.sort(key=lambda n: (n.lineno, n.col_offset, -(n.end_lineno or 0), -(n.end_col_offset or 0)))
    return found


def _holds(first: int, last: int, op_lines: list[int]) -> bool:
    """A statement from ``first`` (its decorators) to ``last`` holds a line naming the op."""
    return any(first <= line <= last for line in op_lines)


def call_facts(found: FoundCall, m: FileModel) -> tuple[schema.CallFacts, a.StatementSlot | None]:
    """Where the call sits and what it passes (asked of ``m``); the slot of a call directly in a method."""
    call = found.call
    kv = found.op.arg(schema.KV_CACHE)
    dtype = found.op.arg(schema.KV_CACHE_DTYPE)
    dtype_value = dtype.value if dtype is not None else None
    auto = isinstance(dtype_value, cst.SimpleString) and dtype_value.evaluated_value == schema.AUTO_DTYPE
    method = found.method if found.nested_in is None else None  # directly in a method
    slots = a.statement_slots(method) if method is not None else ()
    slot = next((s for s in slots if a.expression_call(s.statement) is call), None)
    held = dtype_value  # what the dtype argument holds: a local's one value, where it has one
    if isinstance(held, cst.Name) and method is not None and slot is not None:
        held = a.local_value(method, held.value, slot) or held
    # the dtype holds the cache dtype: by what ``__init__`` leaves in it (``roles.carries_dtype``); outside
    # a class, only as ``<layer>.kv_cache_dtype`` of a local layer
    if found.cls is not None:
        proven = held is not None and m.carries_dtype(found.cls, held)
    else:
        layer = isinstance(held, cst.Attribute) and isinstance(held.value, cst.Name)
        proven = layer and held.attr.value == schema.DTYPE_ATTR  # type: ignore[union-attr]
    facts = schema.CallFacts(
        line=found.line,
        class_name=found.cls.name.value if found.cls else None,
        method=found.method.name.value if found.method else None,
        module_function=found.module_function, nested_in=found.nested_in, in_block=slot is not None,
        star_args=any(arg.star for arg in call.args), has_cache=kv is not None and not a.is_none(kv.value),
        dtype=a.code(dtype_value) if dtype_value is not None else None, dtype_is_auto=auto,
        dtype_proven=proven,
        is_async=found.method is not None and found.method.asynchronous is not None,
        in_wrapper=found.module_function in m.wrappers,
        cache_unproven=a.unproven_cache(found.op, method, slot) if dtype_value is not None and found.cls else None,
        broken=_broken(found, m),
    )
    return facts, slot


def _broken(found: FoundCall, m: FileModel) -> str | None:
    """Why the layer as vLLM runs it does not run the call with an fp8 cache (``runtime.broken``); the names a cache
    argument's condition reads are a lost guard's, which has a role of its own."""
    if found.cls is None or found.method is None:
        return None
    scope = m.scope(found.cls)
    init, fn = scope.methods.get("__init__"), scope.methods.get(found.method.name.value)
    tests = [names.expression(c) for x in schema.CACHE_ARGS if (c := guard_of(found.op.arg(x)))]
    known = {n.id for t in tests if t for n in ast.walk(t) if isinstance(n, ast.Name)}
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and n.lineno == found.line] if fn else []
    cls, call, values = m.ast_of(found.cls), calls[0] if calls else None, m.init_values(found.cls)
    return runtime.broken(m.runtime, cls, init, fn, call, values, scope, known)  # type: ignore[arg-type]


@dataclass
class FoundPieces(schema.Pieces):
    """The pieces (``schema.Pieces``), with the LibCST nodes the plan still needs."""

    post_insert_call: cst.Call | None = None
    post_block: cst.BaseStatement | None = None  # the statement after the call that holds it
    guard_statements: list[cst.BaseStatement] = field(default_factory=list)  # those binding `guard_assigned`
    flag_attr: str = codegen.FP8_FLAG  # the names run writes, where the file has no piece of the role
    insert_method: str = codegen.INSERT_KV
    scale_attr: str = codegen.FP8_SCALE


def _condition(arg: cst.Arg | None) -> tuple[cst.BaseExpression, str] | None:
    """``X if C else None`` -> (X, "C"); ``None if C else X`` -> (X, "not (C)"): the argument
    and the condition under which the fused op gets it."""
    value = arg.value if arg is not None else None
    if not isinstance(value, cst.IfExp) or a.is_none(value.body) == a.is_none(value.orelse):
        return None  # not a conditional with None on exactly one side
    if a.is_none(value.orelse):
        return value.body, a.code(value.test)
    return value.orelse, f"not ({a.code(value.test)})"


def guard_of(arg: cst.Arg | None) -> str | None:
    """The condition under which the fused op gets a cache argument (``_condition``); None for a plain one."""
    found = _condition(arg)
    return found[1] if found is not None else None


def unguarded(arg: cst.Arg) -> cst.BaseExpression:
    return (_condition(arg) or (arg.value,))[0]


def guard_local(condition: str) -> str | None:
    """The local a condition reads, where it is ``G`` or ``not G``."""
    tree = names.expression(condition)
    while isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.Not):
        tree = tree.operand
    return tree.id if isinstance(tree, ast.Name) else None


def is_insert_kv_call(node: cst.CSTNode, name: str = codegen.INSERT_KV) -> bool:
    return isinstance(node, cst.Call) and a.self_attr(node.func) == name


def other_insert_kv_call(cls: cst.ClassDef, allowed: set[int], name: str) -> cst.CSTNode | None:
    """The first ``self.<name>(...)`` in the class that is none of the ``allowed`` nodes (by id)."""
    return a.first_in(cls.body, lambda n: is_insert_kv_call(n, name) and id(n) not in allowed)


def collect_pieces(
    m: FileModel, cls: cst.ClassDef, method: cst.FunctionDef, op: a.OpCall, slot: a.StatementSlot | None
) -> FoundPieces:
    """Each piece by its role (``roles``), whatever the file calls it, asked of the file's model ``m``."""
    p = FoundPieces()
    native = op.native
    init = m.init(cls)
    init_attrs = a.self_assignments(init) if init is not None else {}

    # The guard: what the cache arguments are conditioned on.
    conditions = [(arg, guard_of(arg)) for arg in map(op.arg, schema.CACHE_ARGS)]
    guarded = [c for _, c in conditions if c]
    bound = a.bindings(method)
    guard = guard_flag = None
    method_tree = m.scope(cls).methods.get(method.name.value)
    # what the guard and the post-call test read: the file's functions and imports, and the method's compile-test locals
    tests = dataclasses.replace(m.module_scope, compiling=frozenset(guards.compile_locals(method_tree, m.imports)))
    if guarded and len(set(guarded)) == 1:
        condition = guarded[0]
        local = guard_local(condition)
        fused_when = names.expression(condition)
        chain = a.slot_chain(method, slot) if local is not None and slot is not None else []
        statements, value = _guard_binding(chain, local) if chain else ([], None)  # type: ignore[arg-type]
        if value is not None and not _bound_only_in(bound[local], slot.block, statements):  # type: ignore[union-attr]
            value = None  # also bound elsewhere: what it holds at the call is not proven
        # a local the method never binds, nor the module (a builtin counts as bound)
        lost = local is not None and local not in bound and not hasattr(builtins, local)
        lost = lost and local not in a.scope_bindings(m.module)
        if fused_when is not None and (local is None or value is not None or lost):
            guard = guards.Guard(fused_when, local, value, tests)
            guard_flag = guards.guard_flag(guard, native)
            if guard_flag is None and (local is None or value is not None):
                # the tested local holds something else; or, with no local, the condition is the caller's
                guard = None
                p.guard_other = local is not None
    if guard is not None:
        if guard.local is not None:
            p.guard_args = [guard.local] * len(guarded)
            p.guard_assigned = guard.local if guard.value is not None else None
            p.guard_statements = statements if guard.value is not None else []
            p.guard_lost = guard.value is None
        else:
            p.guard_inline = guarded[0]
    elif p.guard_other or len(set(guarded)) > 1:
        p.guard_args = [guard_local(c) or c for c in guarded]
    if len(set(guarded)) <= 1:
        free = m.dtype_free(cls) if native and guarded else set()

        def dtype_free(c: str) -> bool:  # (a native call honours a condition no cache dtype decides)
            tree, local = names.expression(c), guard_local(c)
            if tree is None or any(isinstance(n, ast.Call) for n in ast.walk(tree)):
                return False
            param = local is None or [type(b) for b in bound.get(local, [])] == [cst.Param]
            return param and guards.self_attrs(tree) <= free

        p.user_conditions = [
            a.code(arg.value)
            for arg, c in conditions
            if c and (guard is None or isinstance(unguarded(arg), cst.IfExp))  # type: ignore[arg-type]
            and not (native and dtype_free(c))
        ]

    # The flag: the attribute the guard reads, else the one __init__ leaves holding whether the cache dtype
    # is fp8 (``roles.flags``: by its value); a property, the class's API, only where the guard reads it.
    flags, scope = m.flags(cls), m.scope(cls)
    proven = [attr for attr, ok in flags.items() if ok and attr not in scope.properties()]
    p.flag_from_file = bool(guard_flag) or len(proven) == 1
    if p.flag_from_file:
        p.flag_attr = guard_flag or proven[0]
    p.flag_set = flags.get(p.flag_attr) is True
    if not p.flag_set and not native:  # (run writes one reading the dtype)
        p.dtype_unread = not m.carries_dtype(cls, names.expression(roles.DTYPE))
    if guard_flag and p.flag_attr in init_attrs and not p.flag_set:
        p.flag_unproven = "`, then `".join(a.code(v) for _, v in init_attrs[p.flag_attr])  # set to what?
    attrs = {a.self_attr(node) for node in a.nodes_in(cls.body)}
    # Once set, whether the flag is also read decides nothing (schema.Pieces.any_bypass).
    p.flag_read = not p.flag_set and p.flag_attr in attrs and p.flag_unproven is None

    # The post-call block: the `if` after the call handing its slot mappings to a method when the fused op
    # did not write, whatever the names; else (a block that lost them) a call of a write-shaped method.
    main, index = op.arg(schema.SLOT_MAPPING), op.arg(schema.INDEX_SLOT_MAPPING)
    forms: dict[str, str] = {}

    def write_shaped(node: cst.CSTNode) -> bool:  # taking the slot mappings, writing with the reshape op
        name = a.self_attr(node.func) if isinstance(node, cst.Call) else None
        if name is not None and name not in forms:
            writes = guards.writes_cache(name, scope)
            forms[name] = a.insert_kv_form(a.find_method(cls, name), cls, m.functions) if writes else "other"
        return name is not None and forms[name] in schema.SLOTS_FORMS

    p.slots_none = _slots_none_somewhere(method, op)
    for at, stmt in enumerate(slot.after() if slot is not None else ()):
        node = a.first_in(stmt, lambda n: _passes_slots(n, main, index)) or a.first_in(stmt, write_shaped)
        if not isinstance(node, cst.Call):
            continue
        p.post_insert, p.post_insert_call, p.post_block = True, node, stmt
        p.insert_method = a.self_attr(node.func) or codegen.INSERT_KV
        p.insert_from_file = _passes_slots(node, main, index)
        test = names.expression(a.code(stmt.test)) if isinstance(stmt, cst.If) else None
        lost = sorted(guards.self_attrs(test) - set(init_attrs) - set(flags)) if test is not None else []
        if guard is None and not p.flag_set and len(lost) == 1:  # the block tests a flag nothing sets
            p.flag_attr, p.flag_read, p.flag_from_file = lost[0], True, True
        block_guard = guard
        if block_guard is None and p.flag_set and not guarded:
            block_guard = guards.Guard(ast.parse(f"not self.{p.flag_attr}", mode="eval").body, scope=tests)
        post = guards.post_block(test, block_guard, guard_flag or p.flag_attr) if test and block_guard else None
        # wired: right after the call (before anything, attention say, reads the caches), and nothing in the
        # block leaves it before the write (an `except` re-raising a failed write leaves loudly)
        handled = {id(r) for h in a.nodes_in(stmt) if isinstance(h, _HANDLERS) for r in a.nodes_in(h) if isinstance(r, cst.Raise)}
        straight = at == 0 and a.first_in(stmt, lambda n: isinstance(n, _EXITS) and id(n) not in handled) is None
        write = m.methods(cls).get(p.insert_method)
        p.post_insert_wired = post is not None and straight and _insert_is_wired(node, op, write)
        read = {a.self_attr(n) for n in a.nodes_in(stmt)}
        stale = sorted(read & a.stale_widths(init, init_attrs)) if init is not None else []  # type: ignore[operator]
        if stale:  # (run writes the product itself there)
            p.role_problems.append(
                f"the post-call block slices with `self.{stale[0]}`, made in __init__ from a head count or size that "
                "__init__ sets again (divided per rank, say): it may hold the model's width, not the rank's"
            )
        p.compiled_write = p.post_insert_wired and post is not None and post.while_compiling and p.slots_none
        p.compiled_branch = a.first_in(stmt, m.compiled_path_write) is not None and p.slots_none
        break
    handed = (a.first_in(x, lambda n: _passes_slots(n, main, index, False)) for x in (slot.after() if slot else ()))
    other = next((n for n in handed if n is not None), None) if not p.post_insert else None
    if isinstance(other, cst.Call):  # (a registered op that finds the layer, say)
        p.role_problems.append(
            f"after the call, `{a.shown(other.func)}(…)` is handed the call's slot mappings: a cache write of the file's "
            "own that is no method of the layer, which `run` would write a second beside"
        )
    p.insert_kv = a.insert_kv_form(a.find_method(cls, p.insert_method), cls, m.functions)
    init_tree, write_tree = scope.methods.get("__init__"), scope.methods.get(p.insert_method)
    block = m.ast_of(p.post_block) if p.post_block else None
    if (p.compiled_write or p.compiled_branch) and block is not None and method_tree is not None:
        p.role_problems += guards.dropped_write_problems(block, method_tree, m.tree, m.imports)
    if p.insert_kv in schema.SLOTS_FORMS and write_tree is not None:  # (kept by run, all but its index write)
        runs = guards.reached(write_tree, scope, init_tree) + ([block] if block is not None else [])
        upgraded = p.insert_kv in schema.OLDER_FORMS
        carries = functools.partial(m.carries_dtype, cls, fp8=True)
        args = [op.arg(x) for x in schema.CACHE_ARGS]
        caches = [d for x in args if x and (t := names.expression(a.code(unguarded(x)))) and (d := names.dotted(t))]
        alike = functools.partial(m.fp8_alike, cls)
        p.role_problems += guards.kept_write_problems(
            runs, init_tree, m.imports, upgraded, p.insert_method, carries, caches, m.fp8_dtyped(cls), alike
        )
    write = m.methods(cls).get(p.insert_method)
    # The scale: the identity scale (``torch.ones``) __init__ makes that the write method reads.
    read = {a.self_attr(n) for n in a.nodes_in(write.body)} - {None} if write is not None else set()
    made = sorted(x for x in read if (value := _first_value(init_attrs, init, x)) is not None and is_scale_value(value))
    p.scale_attr = made[0] if len(made) == 1 else codegen.FP8_SCALE
    p.scale_set = p.scale_attr in init_attrs or registered_buffer(init, p.scale_attr) is not None
    p.scale_read = p.scale_attr in attrs
    _taken_names(m, cls, scope, init_attrs, p)
    slots = [names.expression(a.code(s.value)) for s in (main, index) if s is not None]
    writes = guards.own_writes(method_tree, scope, init_tree, [s for s in slots if s]) if native and method_tree else []
    if writes:  # in words: the callee, or the subscripted cache
        w = writes[0]
        p.own_write = f"{ast.unparse(w.func)}(…)" if isinstance(w, ast.Call) else f"{ast.unparse(w.value)}[…] = …"  # type: ignore[attr-defined]
    setters = {f.name for f in roles.init_methods(init_tree, scope)} if init_tree is not None else set()
    pieces = {method.name.value, p.insert_method, "__init__", *setters}  # (``attrs`` is every self.<x> read)
    p.subclassed = m.runtime.redefined_below(m.ast_of(cls), pieces, {p.flag_attr, p.scale_attr, schema.DTYPE_ATTR})  # type: ignore[arg-type]
    own = [p.flag_attr] if p.flag_from_file or p.flag_set else []
    outside = guards.set_through_another(m.stores, [*own, p.scale_attr, schema.DTYPE_ATTR])
    p.role_problems += [
        f"`{ast.unparse(node)}` at line {node.lineno} sets `{name}` through another object than `self` (the bypass "
        "relies on it being what the layer's __init__ sets)" for node, name in outside
    ] + [
        f"line {node.lineno} rebinds `{cls.name.value}.{name}` outside the class body: the bypass is proven for "
        "the class's own `def`, not for what runs" for node, name in
        guards.set_through_another(m.stores, sorted(pieces), cls.name.value)[:1]
    ]
    return p


_EXITS = (cst.Return, cst.Raise, cst.Break, cst.Continue)
_HANDLERS = (cst.ExceptHandler, cst.ExceptStarHandler)


def _passes_slots(node: cst.CSTNode, main: cst.Arg | None, index: cst.Arg | None, method: bool = True) -> bool:
    """``self.<m>(…, <the call's slot mappings>)``: a method handed what the fused op would write by
    (``guards.passes_slots``, prefilter's rule); ``method=False``: any call."""
    if not (isinstance(node, cst.Call) and (a.self_attr(node.func) is not None or not method)) or main is None or index is None:
        return False
    trees = [names.expression(a.code(n)) for n in (node, main.value, index.value)]
    return None not in trees and guards.passes_slots(trees[0], trees[1:])  # type: ignore[arg-type]


def _slots_none_somewhere(method: cst.FunctionDef, op: a.OpCall) -> bool:
    """A slot mapping the call passes is a local that ``method`` sets to ``None`` (while compiling, say)."""
    args = (op.arg(param) for param in (schema.SLOT_MAPPING, schema.INDEX_SLOT_MAPPING))
    names = {arg.value.value for arg in args if arg is not None and isinstance(arg.value, cst.Name)}
    pairs = (a.simple_assignment(x.statement) for x in a.statement_slots(method))
    return any(isinstance(p[0], cst.Name) and p[0].value in names and a.is_none(p[1]) for p in pairs if p)


def _guard_binding(chain: list[a.StatementSlot], local: str) -> tuple[list[cst.BaseStatement], ast.expr | None]:
    """The statements before the call that bind the guard local, in its block or one that holds it
    (``chain``: ``anchors.slot_chain``; the call under a ``with``, say), and the value the last leaves:
    ``G = <expr>``, or ``if T: G = A`` / ``else: G = B`` (``elif`` too), read as ``A if T else B``."""

    def value(stmt: cst.CSTNode) -> str | None:
        pair = a.simple_assignment(stmt)  # type: ignore[arg-type]  # (a line, or an `if x: G = …` suite)
        if pair is not None and isinstance(pair[0], cst.Name) and pair[0].value == local:
            return a.code(pair[1])
        if not isinstance(stmt, cst.If) or stmt.orelse is None:
            return None
        branches = (stmt.body, stmt.orelse if isinstance(stmt.orelse, cst.If) else stmt.orelse.body)
        lone = [b.body[0] if isinstance(b, cst.IndentedBlock) and len(b.body) == 1 else b for b in branches]
        body, orelse = map(value, lone)
        return f"({body}) if ({a.code(stmt.test)}) else ({orelse})" if body and orelse else None

    found = [(stmt, code) for level in chain for stmt in level.before() if (code := value(stmt)) is not None]
    return [stmt for stmt, _ in found], names.expression(found[-1][1]) if found else None


def _bound_only_in(nodes: list[cst.CSTNode], block: cst.IndentedBlock | cst.Module, also: list[cst.CSTNode]) -> bool:
    """Every binding (``anchors.bindings``) is a parameter or a plain assignment statement of ``block``
    (or of ``also``, the guard's binding statements, and their branches)."""
    plain = {id(pair[0]) for stmt in block.body if (pair := a.simple_assignment(stmt)) is not None}
    branches = [n for stmt in also for n in (stmt, *a.walk_all(stmt))]
    plain |= {id(pair[0]) for n in branches if (pair := a.simple_assignment(n)) is not None}  # type: ignore[arg-type]
    return all(isinstance(n, cst.Param) or id(getattr(n, "target", None)) in plain for n in nodes)


def _taken_names(m: FileModel, cls: cst.ClassDef, scope: roles.Scope, init_attrs: a.Assignments, p: schema.Pieces) -> None:
    """How the class uses the bypass's names (its flag and write method by their roles, the scale
    by its own name) otherwise than the bypass does, in words: in ``p.taken`` where ``run`` would
    write the name (a clash), in ``p.role_problems`` where it is the file's own piece."""
    own_roles = {name for name, own in ((p.flag_attr, p.flag_from_file), (p.insert_method, p.insert_from_file)) if own}

    def note(name: str, text: str) -> None:
        (p.role_problems if name in own_roles else p.taken).append(text)

    flag_def = m.flag_property(cls, p.flag_attr) if p.flag_set else None  # a proven flag's property: the flag
    at_class = a.scope_bindings(cls.body)
    for c in m.lineage(cls):  # the class, and its bases in this file
        bound = at_class if c is cls else a.scope_bindings(c.body)
        where = "the class body" if c is cls else f"the body of {c.name.value}, a base class of this one"
        attrs = (p.flag_attr, p.scale_attr) + ((p.insert_method,) if c is not cls else ())  # (own: below)
        for name in [n for n in attrs if n in bound]:
            # (not a proven flag's class attribute, what it holds until __init__ sets it, or its property)
            flag = name == p.flag_attr and p.flag_set
            if not (flag and all(isinstance(b, _CLASS_ATTR) or b is flag_def for b in bound[name])):
                note(name, f"`{name}` is defined in {where} (a property, method or class attribute)")
    insert_kv = at_class.get(p.insert_method, [])  # (``__slots__``: no clash, nn.Module keeps a ``__dict__``)
    grad = ("torch.no_grad", "torch.inference_mode")  # (what vLLM runs the write under anyway)
    decorators = [d for n in insert_kv for d in getattr(m.ast_of(n), "decorator_list", ())]
    decorators = [names.qualified(getattr(d, "func", d), m.imports) for d in decorators]
    if len(insert_kv) > 1 or set(decorators) - set(grad) or not all(isinstance(n, cst.FunctionDef) for n in insert_kv):
        note(p.insert_method, f"`{p.insert_method}` is bound in the class body other than by one `def` with no decorator")
    # Not a clash: __init__'s first scale assignment where it is the bypass's, and a proven flag's
    # assignments in __init__ and the methods it calls (``roles.flags``: all of it); a property flag's:
    # what it reads (and the methods it calls read), set there - stored elsewhere, it changes after __init__.
    setters = {f.name for f in roles.init_methods(scope.methods["__init__"], scope)} if p.flag_set else set()
    reads: set[str] = set()
    if flag_def is not None:
        prop = scope.methods[p.flag_attr]
        called = [scope.methods[n] for n in guards.self_attrs(prop) if n in scope.methods]
        reads = set().union(*map(guards.self_attrs, [prop, *called])) - set(scope.methods) - {schema.DTYPE_ATTR}
    own_roles |= reads
    scale = init_attrs.get(p.scale_attr, [])[:1]
    own = {id(scale[0][1])} if scale and is_scale_value(scale[0][1]) else set()
    for method in m.methods(cls).values():  # a mixin's too
        in_init = method.name.value in setters
        flag_free = p.flag_unproven is not None or (in_init and not flag_def)  # it may set the flag
        pieces = ({p.flag_attr, p.scale_attr} - ({p.flag_attr} if flag_free else set())) | (set() if in_init else reads)
        for node in a.all_statements(method.body):
            stored = {a.self_attr(t) for t in a.store_targets(node)}
            if p.insert_method in stored:
                note(p.insert_method, f"`self.{p.insert_method}` is assigned in {method.name.value}, hiding the method")
            for name in sorted(stored & pieces):
                if id(getattr(node, "value", None)) not in own:
                    once = f"the bypass relies on `self.{name}` being set once, in __init__"
                    note(name, f"`{a.shown(node)}` in {method.name.value} ({once})")
        tree = scope.methods.get(method.name.value)
        named = roles.set_by_name(tree, m.imports) if tree is not None else set()
        for name in sorted(pieces if named is None else {n.removeprefix("self.") for n in named} & pieces):
            how = "" if named is not None else ": it hands `self` to code the reading does not follow, or names what it sets"
            note(name, f"`self.{name}` may be set by name in {method.name.value}{how} (the bypass relies on it being set once, in __init__)")


_CLASS_ATTR = (cst.AssignTarget, cst.AnnAssign)


def is_scale_value(node: cst.BaseExpression) -> bool:
    """``torch.ones(…)``: the identity scale as the bypass makes it."""
    tree = names.expression(a.code(node))
    return isinstance(tree, ast.Call) and names.dotted(tree.func) == "torch.ones"


def _first_value(init_attrs: a.Assignments, init: cst.FunctionDef | None, name: str) -> cst.BaseExpression | None:
    """What __init__ first makes ``self.<name>``: assigned, or registered as a buffer."""
    if name in init_attrs:
        return init_attrs[name][0][1]
    buffer = registered_buffer(init, name)
    call = a.expression_call(buffer) if buffer is not None else None
    return call.args[1].value if call is not None and len(call.args) > 1 else None


def registered_buffer(init: cst.FunctionDef | None, name: str) -> cst.BaseStatement | None:
    """``self.register_buffer("<name>", …)`` as a statement of ``__init__``'s body."""
    for slot in a.statement_slots(init) if init is not None else ():
        call = a.expression_call(slot.statement)
        first = call.args[0].value if call is not None and call.args else None
        named = isinstance(first, cst.SimpleString) and first.evaluated_value == name
        if named and a.self_attr(call.func) == "register_buffer":  # type: ignore[union-attr]
            return slot.statement
    return None


def _insert_is_wired(insert: cst.Call, fused: a.OpCall, write: cst.FunctionDef | None) -> bool:
    """``self.<write>(_, _, _, <slots>, <index slots>)``: five arguments, bound to the write method's five
    parameters after ``self`` as Python binds them (by position, then by keyword), the last two the fused
    call's slot mappings."""
    params = a.param_names(write)[1:] if write is not None else []
    params = params if len(params) == 5 else ["0", "1", "2", "3", "4"]  # (no such method: by position alone)
    main, index = fused.arg(schema.SLOT_MAPPING), fused.arg(schema.INDEX_SLOT_MAPPING)
    if len(insert.args) != 5 or main is None or index is None or any(x.star for x in insert.args):
        return False
    bound = {params[i]: x.value for i, x in enumerate(x for x in insert.args if x.keyword is None)}
    bound |= {x.keyword.value: x.value for x in insert.args if x.keyword is not None}
    if set(bound) != set(params):
        return False  # an argument bound twice, or a keyword the method does not take
    return a.same_expr(bound[params[3]], main.value) and a.same_expr(bound[params[4]], index.value)
