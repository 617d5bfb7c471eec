"""The rewrite's plan and its application: route fp8 KV-cache writes around MiniMax-M3's
bf16-only fused insert op. For a call that needs work (``analysis.classify``), ``plan_bypass``
checks every name the bypass needs (``proofs``) and fills the templates (``codegen``) into a
``BypassPlan``, or refuses (``Unsupported``); ``Fp8KvBypass`` applies it. Before the call it writes
``insert_via_fused = not self._fp8_kv``, the cache arguments become ``X if insert_via_fused else None``,
and after it ``if not insert_via_fused:`` hands strided views of qkv to ``self._insert_kv(k, v, index_k,
slots, index_slots)``; plus ``self._fp8_kv = "fp8" in self.kv_cache_dtype`` in ``__init__`` and an
``_insert_kv`` writing with ``reshape_and_cache_flash`` (which quantizes and skips padded slot -1). An
older ``_insert_kv`` whose index write is a raw scatter is upgraded in place (``_scatter_edits``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from codemods import anchors as a
from codemods import codegen, schema
from codemods.codegen import parse_statements, render
from codemods.model import FileModel
from codemods.proofs import bare_import, dtype_anchor, qkv_and_slots, write_names
from codemods.schema import Unsupported
from codemods.sites import FoundCall, FoundPieces, guard_of, is_scale_value, other_insert_kv_call
from codemods.sourcemap import SourceMap


@dataclass
class BypassPlan:
    """Everything the transformer needs, found in and checked against the file (a code of "" adds nothing)."""

    method: cst.FunctionDef
    call_slot: a.StatementSlot
    guard: str
    guard_code: str  # goes before the call
    wrap_args: list[cst.Arg]  # `X` -> `X if <guard> else None`
    # wrapped arguments whose line would pass vLLM's line length (88): on lines of their own, as ruff
    split_args: list[cst.Arg]
    post_insert_code: str  # goes after the call
    flag_slot: a.StatementSlot  # insert `self._fp8_kv = ...` (and the scale) after it
    flag_code: str
    insert_kv: str  # keep | replace | add | upgrade
    insert_kv_code: str
    old_insert_kv: cst.FunctionDef | None  # the one insert_kv_code replaces
    reshape_import: tuple[cst.SimpleStatementLine, cst.ImportFrom] | None
    scopes: tuple[cst.CSTNode, ...]  # the defs/classes the transformer must enter
    edits: list[tuple[cst.BaseStatement, str]]  # statement -> its new code (the upgrade)


def _fresh(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate = f"{name}_fp8" if n == 1 else f"{name}_fp8_{n}"
        n += 1
    taken.add(candidate)
    return candidate


def plan_bypass(m: FileModel, found: FoundCall, slot: a.StatementSlot, p: FoundPieces) -> BypassPlan:
    """Find and check every name the bypass needs; raise ``Unsupported`` if one is missing."""
    cls, method, op, module = found.cls, found.method, found.op, m.module
    assert cls is not None and method is not None
    if method.name.value == "__init__":
        raise Unsupported("the insert call is in __init__, not in a forward path")
    init = m.init(cls)
    if init is None:
        raise Unsupported(f"class {cls.name.value} has no __init__ to hold `self.{p.flag_attr}`")
    if m.imports.get("torch") != "torch":
        raise Unsupported("the module does not `import torch`, which the bypass uses")
    forms = {"absent": "add", "metadata": "replace", "slots": "keep"}
    insert_kv = "upgrade" if p.insert_kv in schema.OLDER_FORMS else forms.get(p.insert_kv)
    if insert_kv is None:
        raise Unsupported(
            f"`{p.insert_method}` exists in a form that is neither the attn_metadata one nor the slot-mapping "
            "one (or it may return before it writes)"
        )
    name = p.insert_method  # the write method, by its role: what the post-call block calls
    old_insert_kv = a.find_method(cls, name)
    outside = m.bases_outside(cls)
    if insert_kv == "add" and p.post_insert and outside:
        raise Unsupported(
            f"the post-call block calls `self.{name}`, which this file does not define: it may be inherited "
            f"from {', '.join(f'`{b}`' for b in outside)}, defined elsewhere, and a new `{name}` would override it"
        )
    # Only the post-call insert may call it: the rewrite gives it the slot-mapping
    # signature; a call elsewhere is a caller it would break, or a stale piece of a bypass.
    own = a.nodes_in(old_insert_kv) if old_insert_kv is not None else []
    call = other_insert_kv_call(cls, {id(p.post_insert_call), *map(id, own)}, name)
    if call is None and insert_kv != "keep":  # through another object: a decoder's `self.self_attn.<name>(…)`
        call = next((n for n in m.named(name) if isinstance(n, cst.Attribute) and a.self_attr(n) is None), None)
    if call is not None:
        raise Unsupported(
            f"`{a.shown(call)}` is called elsewhere than right after the insert call: "
            f"a caller the new `{name}` signature would break, or a stale bypass piece"
        )

    # On a native call (a torch.compile-aware bypass, ``schema``) the kernel writes fp8 in eager:
    # the guard only keeps the cache arguments from it while compiling, and needs no flag.
    native = op.native
    if native and p.flag_read and not p.flag_set:
        raise Unsupported(
            f"`self.{p.flag_attr}` is read but never set: set it in __init__ "
            f'(`self.{p.flag_attr} = "fp8" in self.{schema.DTYPE_ATTR}`), then run again'
        )
    if p.guard_inline is not None and not p.post_insert:
        raise Unsupported(
            f"the cache arguments carry the guard inline (`{p.guard_inline}`) but no post-call block "
            "writes the cache where they are None: the bypass cannot be completed around an inlined guard"
        )
    if len(set(p.guard_args)) > 1:
        raise Unsupported(f"cache arguments are guarded by different names: {sorted(set(p.guard_args))}")
    if p.guard_other:
        raise Unsupported(f"the guard name is assigned something other than `not self.{p.flag_attr}`")
    if p.post_insert and not p.post_insert_wired:
        raise Unsupported(f"a post-call `self.{name}(...)` exists but is not wired: {schema.WIRED}")
    taken = a.bound_names(method)
    # the guard: the guarded arguments' name (an assigned guard's among them), else a fresh name
    guard = p.guard_args[0] if p.guard_args else _fresh(codegen.GUARD_NAME, taken)
    stored = m.init_stores(cls)
    names = write_names(op, method, slot, init, m.top_imports, stored)
    caches = tuple(map(op.arg, schema.CACHE_ARGS))
    wrap = [arg for arg in caches if arg is not None and guard_of(arg) is None]
    qkv, main_slots, index_slots = qkv_and_slots(op)
    flag_slot = dtype_anchor(init, a.self_assignments(init), [f.name for f in stored.get(schema.DTYPE_ATTR, [])])
    assert flag_slot is not None  # write_names proved that __init__ sets the dtype
    reshape_import = bare_import(a.module_imports(module)) if names["reshape"] == schema.RESHAPE_OP else None

    # The upgrade: the raw index scatters of `_insert_kv` and of what it hands its work to.
    upgraded: list[cst.FunctionDef] = []
    if insert_kv == "upgrade":
        assert old_insert_kv is not None
        upgraded = [old_insert_kv, *a.delegates(old_insert_kv, cls, m.functions)]
    edits: list[tuple[cst.BaseStatement, str]] = []
    for fn in upgraded:
        edits += [e for x in a.raw_scatters(fn) for e in _scatter_edits(fn, x, module)]
        edits += [e for x in a.bf16_index_writes(fn) for e in _bf16_index_edits(fn, *x, module)]
    upgrade_reads_scale = any(codegen.SCALE_READ in code for _, code in edits)
    reads_scale = insert_kv in ("add", "replace") or p.scale_read or upgrade_reads_scale
    scale_code = render(codegen.SCALE, module) if reads_scale and not p.scale_set else ""
    if p.flag_set and scale_code:  # the scale goes right after the statement of __init__ that sets the flag
        flag_slot = _flag_statement(m, cls, init, p.flag_attr) or flag_slot
    add_flag = not p.flag_set and not native
    flag_code = render(codegen.FLAG, module, dtype=names["dtype"], flag=p.flag_attr) if add_flag else ""
    flag_code += scale_code
    guard_code = render(
        codegen.NATIVE_GUARD if native else codegen.GUARD, module, guard=guard, flag=p.flag_attr,
        compiling=m.compile_test(),
    )
    post_insert_code = render(
        codegen.POST_INSERT, module, guard=guard, qkv=qkv, insert_kv=name,
        main_slots=main_slots, index_slots=index_slots, **names,
        **{f"n_{k}": _fresh(k, taken) for k in ("kv", "k0", "ik0", "k", "v", "index_k")},
    )
    insert_kv_code = render(
        codegen.INSERT_KV_METHOD.replace("{replaced}", codegen.REPLACED if insert_kv == "replace" else ""),
        module, m.depth(cls) + 1, name=name, **names, **codegen.METHOD_NAMES,
    )
    return BypassPlan(
        method=method, call_slot=slot, guard=guard,
        guard_code=guard_code if p.guard_assigned is None and p.guard_inline is None else "",
        wrap_args=wrap, split_args=_split_args(m, slot.statement, wrap, guard),
        post_insert_code="" if p.post_insert else post_insert_code, flag_slot=flag_slot, flag_code=flag_code,
        insert_kv=insert_kv, insert_kv_code=insert_kv_code, reshape_import=reshape_import,
        old_insert_kv=old_insert_kv if insert_kv == "replace" else None, edits=edits,
        scopes=(*found.outer, *m.lineage(cls), method, init, *upgraded),  # (a base class's __init__)
    )


# --- the upgrade of an older `_insert_kv` ------------------------------------------------


def _flag_statement(m: FileModel, cls: cst.ClassDef, init: cst.FunctionDef, flag: str) -> a.StatementSlot | None:
    """The last top-level statement of ``__init__`` that sets ``self.<flag>``: one of the flag's
    defining statements (``FileModel.flag_definition``), or one that assigns it anywhere in it."""
    defining = {id(s) for s in m.flag_definition(cls, init, flag)}
    body = init.body.body if isinstance(init.body, cst.IndentedBlock) else ()
    stores = [{a.self_attr(t) for n in a.all_statements(stmt) for t in a.store_targets(n)} for stmt in body]
    setting = [i for i, stmt in enumerate(body) if id(stmt) in defining or flag in stores[i]]
    return a.StatementSlot(init.body, setting[-1]) if setting else None  # type: ignore[arg-type]


def _scatter_edits(
    fn: cst.FunctionDef, scatter: a.StatementSlot, module: cst.Module
) -> list[tuple[cst.BaseStatement, str]]:
    """``idx = <cache>.view(-1, D)`` + ``idx[slots] = key[.to(...)]`` -> the padding-safe write,
    proven to write the same rows; ``Unsupported`` when any part is not that shape."""
    shown = a.shown(scatter.statement)
    pair = a.simple_assignment(scatter.statement)
    assert pair is not None and isinstance(pair[0], cst.Subscript)
    target, value = pair
    slots = a.code(target.slice[0].slice.value)  # type: ignore[attr-defined]
    key = value.func.value if _is_method_call(value, "to") else value  # type: ignore[attr-defined]
    if not (isinstance(key, cst.Name) and key.value in a.param_names(fn)):
        raise Unsupported(f"cannot upgrade `{shown}`: what it writes is not a parameter of {fn.name.value}")
    view_stmt, view = None, target.value
    if isinstance(target.value, cst.Name):
        assigned = _single_assignment(fn, target.value.value, scatter)
        if assigned is None:
            raise Unsupported(f"cannot upgrade `{shown}`: `{target.value.value}` is not assigned once before it")
        view_stmt, view = assigned[0].statement, assigned[1]
    if not (_is_method_call(view, "view") and len(view.args) == 2 and a.code(view.args[0].value) == "-1"):  # type: ignore[attr-defined]
        raise Unsupported(f"cannot upgrade `{shown}`: its cache is not `<index cache>.view(-1, <head dim>)`")
    calls = (n for n in a.walk_scope(fn.body) if isinstance(n, cst.Call))
    reshape = next((c for c in calls if a.callee_name(c) == schema.RESHAPE_OP), None)
    if reshape is None:
        raise Unsupported(f"cannot upgrade `{shown}`: {fn.name.value} holds no `{schema.RESHAPE_OP}` call to follow")
    scale_arg = a.get_arg(reshape, schema.OpParam(6, "k_scale"))
    if scale_arg is None or not a.is_pure(scale_arg.value):
        raise Unsupported(f"cannot upgrade `{shown}`: the scale of `{schema.RESHAPE_OP}` is not a plain name")
    scale = a.code(scale_arg.value)
    taken = a.bound_names(fn)
    write = render(
        codegen.INDEX_WRITE, module, idx_key=_fresh("idx_key", taken),
        idx_cache=target.value.value if isinstance(target.value, cst.Name) else _fresh("idx_cache", taken),
        idx_dtype=_fresh("idx_dtype", taken), index_key=key.value, index_slots=slots, scale=scale,
        reshape=a.code(reshape.func), index_cache=a.code(view.func.value),  # type: ignore[attr-defined]
        idx_head_dim=a.code(view.args[1].value),  # type: ignore[attr-defined]
    )
    edits = [(view_stmt, write), (scatter.statement, "")] if view_stmt is not None else [(scatter.statement, write)]
    # `<scale> = torch.ones(...)`: a fill kernel on every call, where the buffer needs none
    named = scale_arg.value.value if isinstance(scale_arg.value, cst.Name) else ""
    ones = [x for x, v in _assignments(fn, named) if is_scale_value(v)]
    if ones and a.param_names(fn)[:1] == ["self"]:
        edits.append((ones[0].statement, render(codegen.SCALE_LOCAL, module, scale=scale)))
    return edits


def _bf16_index_edits(
    fn: cst.FunctionDef, check: a.StatementSlot, write: a.StatementSlot, module: cst.Module
) -> list[tuple[cst.BaseStatement, str]]:
    """``assert C.dtype == K.dtype`` + ``reshape_and_cache_flash(..., "auto", ...)`` (the index
    write ``run`` wrote before 0.2) -> the store picked by the index cache's dtype."""
    call = a.expression_call(write.statement)
    assert call is not None
    key, cache = a.code(call.args[0].value), a.code(call.args[2].value)
    idx_dtype = _fresh("idx_dtype", a.bound_names(fn))
    store = render(codegen.INDEX_STORE, module, idx_cache=cache, idx_key=key, idx_dtype=idx_dtype)
    args = list(call.args)
    args[5] = args[5].with_changes(value=cst.Name(idx_dtype))
    new_call = write.statement.with_changes(body=[write.statement.body[0].with_changes(value=call.with_changes(args=args))])  # type: ignore[attr-defined]
    # the comment on the assert's line said the cache stays bf16: it goes with the assert
    return [(check.statement, store), (write.statement, a.code(new_call.with_changes(leading_lines=[])))]


def _is_method_call(node: cst.BaseExpression, name: str) -> bool:
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == name


def _single_assignment(
    fn: cst.FunctionDef, name: str, before: a.StatementSlot
) -> tuple[a.StatementSlot, cst.BaseExpression] | None:
    """The one statement of ``fn`` that assigns ``name`` (and its value), if it comes before
    ``before`` in its block and ``name`` is read nowhere but in ``before``."""
    assigned = _assignments(fn, name)
    if len(assigned) != 1 or assigned[0][0].block is not before.block or assigned[0][0].index > before.index:
        return None
    stmt = assigned[0][0].statement
    others = (x.statement for x in a.statement_slots(fn) if x.statement not in (stmt, before.statement))
    return None if any(name in a.names_read(other) for other in others) else assigned[0]


def _assignments(fn: cst.FunctionDef, name: str) -> list[tuple[a.StatementSlot, cst.BaseExpression]]:
    """The ``<name> = <value>`` statements of ``fn``: (where, value)."""
    pairs = ((x, a.simple_assignment(x.statement)) for x in a.statement_slots(fn))
    return [(x, p[1]) for x, p in pairs if p and isinstance(p[0], cst.Name) and p[0].value == name]


class Fp8KvBypass(codegen.Splice):
    """Apply one ``BypassPlan``: flag in __init__, guard and insert in the forward path."""

    def __init__(self, module: cst.Module, plan: BypassPlan) -> None:
        self.plan = plan
        self._edits = {id(stmt): code for stmt, code in plan.edits}
        methods = {id(plan.old_insert_kv): plan.insert_kv_code} if plan.old_insert_kv is not None else {}
        imports = {id(plan.reshape_import[1]): [schema.RESHAPE_OP]} if plan.reshape_import else {}
        touched = {*self._edits, *map(id, (plan.call_slot.statement, plan.flag_slot.statement, plan.method))}
        super().__init__(module, methods, imports, touched)
        statements = [plan.call_slot.statement] + ([plan.reshape_import[0]] if plan.reshape_import else [])
        self._enter = {id(n) for n in (*plan.scopes, *statements)}

    def on_visit(self, node: cst.CSTNode) -> bool:
        # Enter only what holds a change: visiting other defs, classes and lines costs, changes nothing.
        skippable = isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.SimpleStatementLine))
        return (not skippable or id(node) in self._enter) and super().on_visit(node)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        if not any(original is w for w in self.plan.wrap_args):
            return updated
        value = cst.IfExp(test=cst.Name(self.plan.guard), body=updated.value, orelse=cst.Name("None"))
        if any(original is s for s in self.plan.split_args):  # `(` and `)` each end a line, as ruff writes
            lpar = cst.LeftParen(whitespace_after=self._new_line(2))
            rpar = cst.RightParen(whitespace_before=self._new_line(1))
            value = value.with_changes(lpar=[lpar], rpar=[rpar])
        return updated.with_changes(value=value)

    def _new_line(self, levels: int) -> cst.ParenthesizedWhitespace:
        """A new line, ``levels`` indents deeper than the statement."""
        indent = cst.SimpleWhitespace(self.module.default_indent * levels)
        return cst.ParenthesizedWhitespace(first_line=cst.TrailingWhitespace(), indent=True, last_line=indent)

    def replace(self, original: cst.BaseStatement, updated: cst.BaseStatement) -> codegen.Replacement:
        """The guard and the post-call block around the call, the flag after its anchor, the new
        write method before the forward one; an edited statement -> its new code (none: removed),
        and the comments above it but those of the code it replaces."""
        plan, module = self.plan, self.module
        if id(original) in self._edits:
            kept = codegen.strip_comments(updated.leading_lines, REPLACED_COMMENTS)
            return parse_statements(self._edits[id(original)], module), kept
        new = [updated]
        if original is plan.call_slot.statement:
            guard, post = plan.guard_code, plan.post_insert_code
            new = [*parse_statements(guard, module), updated, *parse_statements(post, module)]
        if original is plan.flag_slot.statement:
            new += parse_statements(plan.flag_code, module)
        if original is plan.method and plan.insert_kv == "add":
            blank = [cst.EmptyLine(indent=False)]
            new.insert(0, codegen.parse_method(plan.insert_kv_code, module, leading_lines=blank))
        return new, []


# Comments of the code the upgrade replaces (the tool's earlier form and the
# seed write-up's), recognised by their text; any other comment stays.
REPLACED_COMMENTS = (
    ("Index-key cache: one vector per token, scattered by slot.",),
    ("Index-key cache: single vector per token, scatter by slot.",),
)
LINE_LENGTH = 88  # vLLM's ruff line length


def _split_args(m: FileModel, statement: cst.BaseStatement, wrap: list[cst.Arg], guard: str) -> list[cst.Arg]:
    """The arguments whose line ``X if <guard> else None`` in place of their values (every
    wrapped one on that line) would make longer than vLLM's line length."""
    lines = m.module.code.splitlines()
    ends = [(arg, _end_line(m, statement, arg)) for arg in wrap]
    grown = {line: len(lines[line - 1]) for _, line in ends}
    for _, line in ends:
        grown[line] += len(f" if {guard} else None")
    return [arg for arg, line in ends if grown[line] > LINE_LENGTH]


def _end_line(m: FileModel, statement: cst.BaseStatement, arg: cst.Arg) -> int:
    """The line ``arg``'s value ends on: the one line of the call's statement that holds its
    text, once (no position pass over the file), else from LibCST's positions."""
    span = m.source_map.span(statement) if m.source_map is not None else None
    text = a.code(arg.value).encode()
    if span is not None and b"\n" not in text:
        whole = re.compile(rb"(?<![\w.])" + re.escape(text) + rb"(?![\w.(\[])")  # not part of a longer expression
        hits = [n for n in range(span[0], span[1] + 1) for _ in whole.finditer(m.source_map.lines[n])]
        if len(hits) == 1:
            return hits[0]
    return m.positions[arg.value].end.line


def apply_plan(module: cst.Module, plan: BypassPlan, source_map: SourceMap | None) -> cst.Module:
    """Rewrite one site; then drop imports that only the replaced method used."""
    new = module.visit(Fp8KvBypass(module, plan))
    if plan.old_insert_kv is not None:
        added = a.names_read(cst.parse_module(plan.insert_kv_code, config=module.config_for_parsing))
        dropped = a.names_read(plan.old_insert_kv) - added
        if source_map is not None:
            dropped &= source_map.from_imported()  # only those can lose their import
        new = codegen.remove_unused_imports(new, dropped, _silent_statements(module, source_map, dropped))
    return new


def _silent_statements(
    module: cst.Module, source_map: SourceMap | None, names: set[str]
) -> list[cst.CSTNode]:
    """Statements of ``module`` whose text holds none of ``names``: nothing to count there (the
    rewrite keeps untouched statements as the same objects, so they are skipped in its result too)."""
    if source_map is None:
        return []
    try:
        words = [n.encode(module.encoding) for n in names]
    except (UnicodeEncodeError, LookupError):
        return []
    texts = ((stmt, source_map.text(stmt)) for stmt, _, _ in source_map.spans.values())
    return [stmt for stmt, text in texts if text is not None and not any(w in text for w in words)]
