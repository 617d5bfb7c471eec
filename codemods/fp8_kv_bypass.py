"""The rewrite's plan and its application: route fp8 KV-cache writes around MiniMax-M3's
bf16-only fused insert op.

For a call that needs work (``analysis.classify``, from ``sites``' facts and
``schema``'s verdict), ``plan_bypass`` checks every name the bypass needs
(``proofs``) and fills the templates (``codegen``) into a ``BypassPlan``, or
refuses (``Unsupported``); ``Fp8KvBypass`` applies the plan. What it writes::

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
skips padded slot -1). An older ``_insert_kv`` whose index write is a raw scatter
is upgraded in place (``_scatter_edits``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from codemods import anchors as a
from codemods import codegen, schema
from codemods.codegen import (
    FLAG,
    GUARD,
    INDEX_STORE,
    INDEX_WRITE,
    INSERT_KV_METHOD,
    NATIVE_GUARD,
    POST_INSERT,
    REPLACED,
    SCALE,
    SCALE_LOCAL,
    SCALE_READ,
    indented,
    parse_statements,
    remove_unused_imports,
    render,
)
from codemods.model import FileModel
from codemods.proofs import bare_import, cache_args, dtype_anchor, op_namespace, qkv_and_slots, widths
from codemods.schema import Unsupported
from codemods.sites import FoundCall, FoundPieces, other_insert_kv_call
from codemods.sourcemap import SourceMap

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
    # the wrapped arguments whose line would pass vLLM's line length (88): each goes on its own
    # lines in parentheses, as ruff format writes an argument that does not fit
    split_args: list[schema.OpParam] = field(default_factory=list)


def _fresh(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate = f"{name}_fp8" if n == 1 else f"{name}_fp8_{n}"
        n += 1
    taken.add(candidate)
    return candidate


def plan_bypass(m: FileModel, found: FoundCall, slot: a.StatementSlot, p: FoundPieces) -> BypassPlan:
    """Find and check every name the bypass needs; raise ``Unsupported`` if one is missing."""
    cls, method, op, module, functions = found.cls, found.method, found.op, m.module, m.functions
    assert cls is not None and method is not None
    if method.name.value == "__init__":
        raise Unsupported("the insert call is in __init__, not in a forward path")
    init = a.find_method(cls, "__init__")
    if init is None:
        raise Unsupported(f"class {cls.name.value} has no __init__ to hold `self.{p.flag_attr}`")
    if m.imports.get("torch") != "torch":
        raise Unsupported("the module does not `import torch`, which the bypass uses")
    imports = a.module_imports(module)
    insert_kv = {"absent": "add", "metadata": "replace", "slots": "keep"}.get(p.insert_kv)
    if p.insert_kv in schema.OLDER_FORMS:
        insert_kv = "upgrade"
    if insert_kv is None:
        raise Unsupported(
            f"`{p.insert_method}` exists in a form that is neither the attn_metadata one nor the slot-mapping one"
        )
    name = p.insert_method  # the write method, by its role: what the post-call block calls
    old_insert_kv = a.find_method(cls, name)
    # Only the post-call insert may call it: the rewrite gives it the slot-mapping
    # signature; a call elsewhere is a caller it would break, or a stale piece of a bypass.
    own = a.nodes_in(old_insert_kv) if old_insert_kv is not None else []
    call = other_insert_kv_call(cls, {id(p.post_insert_call), *map(id, own)}, name)
    if call is not None:
        raise Unsupported(
            f"`{' '.join(a.code(call).split())}` is called elsewhere than right after the insert call: "
            f"a caller the new `{name}` signature would break, or a stale bypass piece"
        )

    # On a native call (a torch.compile-aware bypass, ``schema``) the kernel writes fp8 in eager:
    # the guard only keeps the cache arguments from it while compiling, and needs no flag.
    native = op.arg(schema.KV_CACHE_DTYPE) is not None
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
    taken = a.bound_names(method)
    guard = _guard_name(p, taken)
    caches, wrap = cache_args(op, method, slot)
    qkv, main_slots, index_slots = qkv_and_slots(op)
    init_attrs = a.self_assignments(init)
    w = widths(op, method, slot, init_attrs)
    flag_slot = dtype_anchor(init, init_attrs)
    dtype_attr = f"self.{schema.DTYPE_ATTR}"
    if flag_slot is None:
        raise Unsupported("cannot find the kv-cache dtype attribute (`self.kv_cache_dtype`) in __init__")
    namespace = op_namespace(op, m.imports)
    reshape_import = bare_import(module, imports) if namespace is None else None
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
        for check, write in a.bf16_index_writes(fn):
            edits += _bf16_index_edits(fn, check, write, module)
    reads_scale = insert_kv in ("add", "replace") or p.scale_read or any(SCALE_READ in code for _, code in edits)
    scale_code = render(SCALE, module) if reads_scale and not p.scale_set else ""
    if p.flag_set and scale_code:  # the scale goes right after the statement of __init__ that sets the flag
        flag_slot = _flag_statement(m, cls, init, p.flag_attr) or flag_slot
    add_flag = not p.flag_set and not native
    local = {f"n_{k}": _fresh(k, taken) for k in ("kv", "k0", "ik0", "k", "v", "index_k")}
    return BypassPlan(
        cls=cls,
        method=method,
        op=op,
        call_slot=slot,
        guard=guard,
        add_guard=p.guard_assigned is None and p.guard_inline is None,
        guard_code=render(
            NATIVE_GUARD if native else GUARD, module, guard=guard, flag=p.flag_attr, compiling=m.compile_test()
        ),
        wrap_args=wrap,
        split_args=_split_args(m, op, slot.statement, wrap, guard),
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
            insert_kv=name,
            **local,
        ),
        flag_slot=flag_slot if (add_flag or scale_code) else None,
        flag_code=(render(FLAG, module, dtype=dtype_attr, flag=p.flag_attr) if add_flag else "") + scale_code,
        insert_kv=insert_kv,
        insert_kv_code=render(
            INSERT_KV_METHOD,
            module,
            len(found.outer) + 1,
            name=name,
            # filled in before the method's newlines are made the file's (render): no "\r\r\n"
            replaced=REPLACED.format(D=module.default_indent * (len(found.outer) + 2)) if insert_kv == "replace" else "",
            kv_cache=caches[schema.KV_CACHE.keyword],
            num_kv_heads=w.num_kv_heads,
            head_dim=w.head_dim,
            dtype=dtype_attr,
            reshape=reshape_call,
            index_write=indented(
                INDEX_WRITE.format(
                    I=module.default_indent,
                    idx_key="idx_key",
                    idx_cache="idx_cache",
                    idx_dtype="idx_dtype",
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


def _flag_statement(m: FileModel, cls: cst.ClassDef, init: cst.FunctionDef, flag: str) -> a.StatementSlot | None:
    """The last top-level statement of ``__init__`` that sets ``self.<flag>``: one of the flag's
    defining statements (``FileModel.flag_definition``: an ``if`` that only sets it, a call of
    its setter method), or one that assigns it, itself or in a block it holds."""
    defining = {id(s) for s in m.flag_definition(cls, init, flag)}
    block = init.body
    if not isinstance(block, cst.IndentedBlock):
        return None
    found = None
    for index, stmt in enumerate(block.body):
        assigns = any(
            isinstance(n, cst.AssignTarget) and a.self_attr(n.target) == flag for n in a.walk_all(stmt)
        )
        if id(stmt) in defining or assigns:
            found = a.StatementSlot(block, index)
    return found


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
        idx_dtype=_fresh("idx_dtype", taken),
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


def _bf16_index_edits(
    fn: cst.FunctionDef, check: a.StatementSlot, write: a.StatementSlot, module: cst.Module
) -> list[tuple[cst.BaseStatement, str]]:
    """``assert C.dtype == K.dtype`` + ``reshape_and_cache_flash(..., "auto", ...)`` (the index
    write ``run`` wrote before 0.2) -> the store picked by the index cache's dtype."""
    call = a.expression_call(write.statement)
    assert call is not None
    key, cache = a.code(call.args[0].value), a.code(call.args[2].value)
    idx_dtype = _fresh("idx_dtype", a.bound_names(fn))
    store = render(INDEX_STORE, module, idx_cache=cache, idx_key=key, idx_dtype=idx_dtype)
    args = list(call.args)
    args[5] = args[5].with_changes(value=cst.Name(idx_dtype))
    new_call = write.statement.with_changes(body=[write.statement.body[0].with_changes(value=call.with_changes(args=args))])  # type: ignore[attr-defined]
    # the comment on the assert's line said the cache stays bf16: it goes with the assert
    return [(check.statement, store), (write.statement, a.code(new_call.with_changes(leading_lines=[])))]


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
        raise Unsupported(f"the guard name is assigned something other than `not self.{p.flag_attr}`")
    if p.post_insert and not p.post_insert_wired:
        raise Unsupported(
            f"a post-call `self.{p.insert_method}(...)` exists but does not run exactly where the fused op "
            "did not write (`if not <guard>:`), or is not passed the call's own slot mappings"
        )
    if p.guard_args:
        return p.guard_args[0]
    return p.guard_assigned or _fresh(codegen.GUARD_NAME, taken)


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
                value = cst.IfExp(test=cst.Name(self.plan.guard), body=arg.value, orelse=cst.Name("None"))
                if any(orig_arg is self.plan.op.arg(p) for p in self.plan.split_args):
                    value = value.with_changes(lpar=[_open(2, self.module)], rpar=[_close(1, self.module)])
                arg = arg.with_changes(value=value)
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


LINE_LENGTH = 88  # vLLM's ruff line length


def _split_args(
    m: FileModel, op: a.OpCall, statement: cst.BaseStatement, wrap: list[schema.OpParam], guard: str
) -> list[schema.OpParam]:
    """The arguments whose line ``X if <guard> else None`` in place of their values (every
    wrapped one on that line) would make longer than vLLM's line length."""
    lines = m.module.code.splitlines()
    ends = {param: _end_line(m, statement, arg) for param in wrap if (arg := op.arg(param)) is not None}
    grown = {line: len(lines[line - 1]) + sum(len(f" if {guard} else None") for e in ends.values() if e == line) for line in ends.values()}
    return [param for param, line in ends.items() if grown[line] > LINE_LENGTH]


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


def _open(levels: int, module: cst.Module) -> cst.LeftParen:
    """``(`` then a new line, ``levels`` indents deeper than the statement."""
    return cst.LeftParen(
        whitespace_after=cst.ParenthesizedWhitespace(
            first_line=cst.TrailingWhitespace(), indent=True, last_line=cst.SimpleWhitespace(module.default_indent * levels)
        )
    )


def _close(levels: int, module: cst.Module) -> cst.RightParen:
    return cst.RightParen(
        whitespace_before=cst.ParenthesizedWhitespace(
            first_line=cst.TrailingWhitespace(), indent=True, last_line=cst.SimpleWhitespace(module.default_indent * levels)
        )
    )


def _replaced_comment(line: cst.EmptyLine) -> bool:
    return line.comment is not None and " ".join(line.comment.value.lstrip("#").split()) in REPLACED_COMMENTS


def apply_plan(module: cst.Module, plan: BypassPlan, source_map: SourceMap | None = None) -> cst.Module:
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
    module: cst.Module, source_map: SourceMap | None, names: set[str]
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
