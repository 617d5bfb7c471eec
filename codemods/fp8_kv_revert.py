"""Revert the fp8 KV-cache bypass: the structural inverse of ``fp8_kv_bypass``, found with the same
finders (``sites.collect_pieces``), so that ``revert(run(x)) == x`` byte for byte on every before-state
fixture: ``X if insert_via_fused else None`` becomes ``X``; the guard, the flag and the guarded post-call
block go, with the comment lines the rewrite (or the seed write-up's diff) put above them; the slot-mapping
``_insert_kv`` goes back to the fork-era ``attn_metadata`` form (``codegen.INSERT_KV_METADATA``) where the
file imports the metadata classes it asserts on (one ``run`` dropped as unused comes back), else it goes.
On a native call with a stale or half-applied bypass the result is a clean native call; anything it cannot
prove is refused, with the reason."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from codemods import anchors as a
from codemods import codegen, proofs, schema, sites
from codemods.model import FileModel
from codemods.schema import SLOTS_FORMS, Unsupported


# The metadata classes the attn_metadata ``_insert_kv`` asserts on.
MAIN_METADATA = "MiniMaxM3SparseMetadata"
INDEX_METADATA = "MiniMaxM3IndexerMetadata"
FORWARD_CONTEXT = "get_forward_context"
# Why a slot-mapping `_insert_kv` is removed, not restored, on a fork-era call.
NO_METADATA = "no attn_metadata class is imported, so no fork-era form to restore"


@dataclass
class RevertPlan:
    """What comes out of one class, all found in and checked against the file."""

    call_statement: cst.BaseStatement
    unwrap_args: list[cst.Arg]  # `X if G else None` -> `X`
    remove: list[cst.BaseStatement]  # flag, guard, post-call block
    insert_kv: str = "keep"  # keep | restore | remove
    old_insert_kv: cst.FunctionDef | None = None
    insert_kv_code: str = ""
    add_imports: dict[int, list[str]] = field(default_factory=dict)  # a from-import (id) -> names it gets
    pieces: dict[str, bool] = field(default_factory=dict)
    also_remove: list[cst.FunctionDef] = field(default_factory=list)  # delegates only _insert_kv used
    removed_because: str = ""
    dead: list[cst.BaseStatement] = field(default_factory=list)  # module code only the bypass used
    write_method: str = ""  # the file's name for it (``sites.FoundPieces.insert_method``)


def revert_reason(plan: RevertPlan) -> str:
    have = ", ".join(k for k, v in plan.pieces.items() if v) or "a read of a flag nothing sets"
    what = {
        "restore": f"{plan.write_method} back to its stock attn_metadata form (`run` replaced the file's own, "
        "whose lines it did not keep: where it was edited, compare with version control)",
        "remove": f"{plan.write_method} removed ({plan.removed_because})",
        "keep": f"{plan.write_method} kept",
    }[plan.insert_kv]
    if plan.also_remove:
        what += " with " + ", ".join(f.name.value for f in plan.also_remove)
    if plan.insert_kv == "remove" and plan.removed_because == NO_METADATA:
        what += (
            "; where the bypass was the fork's own and `run` only upgraded its index write, the whole "
            "bypass goes and the older form is not put back"
        )
    return f"fp8 bypass ({have}) taken out: plain cache arguments, {what}"


def plan_site(
    m: FileModel, found: sites.FoundCall, pieces: sites.FoundPieces | None = None
) -> RevertPlan | None:
    """None when there is no bypass around this call; ``Unsupported`` when one cannot be proven.
    ``pieces``: what ``collect_pieces`` found there, where the caller has it."""
    cls, method, op = found.cls, found.method, found.op
    facts, slot = sites.call_facts(found, m)
    if cls is None or method is None or facts.star_args or not facts.has_cache:
        return None  # not a site the bypass is written around (schema.verdict)
    if facts.nested_in is not None:
        if any(m.flags(cls).values()):  # a flag, by its value: the class carries a bypass
            raise Unsupported("the call is not directly in a method: its bypass cannot be delimited")
        return None
    pieces = pieces or sites.collect_pieces(m, cls, method, op, slot)
    native = op.native
    if not pieces.any_bypass(native=native):
        return None
    if slot is None:
        raise Unsupported("the call is not a statement of its own in a block")
    if (pieces.compiled_write or pieces.compiled_branch) and native:
        raise Unsupported(
            f"on this native call the bypass is torch.compile's cache write ({schema.COMPILED_DESIGN}): "
            "taking it out would leave the compiled path writing no token. Keep it: in eager the "
            "native kernel writes fp8 itself, and `check` on this file says whether it is wired"
        )

    guards = set(pieces.guard_args)  # (an assigned guard is one of them: ``sites.collect_pieces``)
    if pieces.guard_other:
        raise Unsupported(f"the guard name is assigned something other than `not self.{pieces.flag_attr}`")

    remove: list[cst.BaseStatement] = []
    init = m.init(cls)
    if init is not None:
        attrs = a.self_assignments(init)
        if pieces.flag_set:  # the statements that decide the proven flag (its value was evaluated: pure)
            prop = m.flag_property(cls, pieces.flag_attr)
            if prop is not None and prop is not a.find_method(cls, pieces.flag_attr):
                raise Unsupported(f"the flag `{pieces.flag_attr}` is a property of a base class, which other classes may use")
            remove += m.flag_definition(cls, init, pieces.flag_attr)
        defined = {id(n) for r in remove for n in a.walk_all(r)}  # the flag's definition, whole
        for flag_slot, value in attrs.get(pieces.flag_attr, []):
            if id(flag_slot.statement) in defined:
                continue
            if not pieces.flag_set and any(isinstance(n, cst.Call) for n in a.walk_all(value)):
                raise Unsupported(f"`self.{pieces.flag_attr}` is assigned a call, which removing would skip")
            remove.append(flag_slot.statement)
        # another fp8 flag by its value that nothing reads (a renamed copy, a merge's): the bypass's too
        for extra in [f for f, ok in m.flags(cls).items() if ok and f != pieces.flag_attr]:
            definition = m.flag_definition(cls, init, extra)
            own = {id(n) for r in definition for n in a.walk_all(r)}
            if definition and all(id(n) in own for n in _attribute_reads(m, cls, extra)):
                remove += definition
        remove += [scale_slot.statement for scale_slot, _ in attrs.get(pieces.scale_attr, [])]
        buffer = sites.registered_buffer(init, pieces.scale_attr)
        remove += [buffer] if buffer is not None else []
    remove += pieces.guard_statements  # the guard's binding (`sites._guard_binding`)
    post = _post_call_block(m, slot, pieces)
    remove += [post] if post is not None else []

    # `X if G else None` cache arguments (or the inlined `None if self.F else X`), and any
    # other argument the guard decides (a merge's `self.kv_cache.size(2) if G else 0` block size).
    unwrap = [arg for arg in op.call.args if _guarded_by(arg, guards, pieces.guard_inline)]

    gone: list[cst.CSTNode] = [*remove, *(arg.value.test for arg in unwrap)]  # type: ignore[attr-defined]
    _check_nothing_left(m, cls, method, gone, guards, pieces.flag_attr)
    dead = _dead_module_code(m, remove)
    removed = {id(s) for s in remove}
    for fn in a.methods(cls):
        if any(s.index == 0 and all(id(x) in removed for x in s.block.body) for s in a.statement_slots(fn)):
            raise Unsupported("removing the bypass would leave an empty block")

    plan = RevertPlan(
        slot.statement, unwrap, remove, pieces=pieces.present(), dead=dead, write_method=pieces.insert_method
    )
    if pieces.insert_kv in SLOTS_FORMS:
        _plan_insert_kv(m, found, slot, post, plan, native)
    elif pieces.insert_kv == "other" and post is not None:
        raise Unsupported(
            f"`{pieces.insert_method}` is neither the attn_metadata form nor the slot-mapping one: cannot restore it"
        )
    return plan


def _guarded_by(arg: cst.Arg, guards: set[str], inline: str | None) -> bool:
    """A cache argument under the bypass's guard, however it is written (``sites.guard_of``: ``X if G
    else None``, ``None if not G else X``, the inlined condition), or any other argument the guard
    decides as ``X if G else <a number>`` (a merge's ``self.kv_cache.size(2) if G else 0`` block size)."""
    condition, value = sites.guard_of(arg), arg.value
    if condition is not None:
        return condition == inline or sites.guard_local(condition) in guards
    return (
        isinstance(value, cst.IfExp) and isinstance(value.test, cst.Name) and value.test.value in guards
        and isinstance(value.orelse, (cst.Integer, cst.Float))
    )


def _post_call_block(m: FileModel, slot: a.StatementSlot, pieces: sites.FoundPieces) -> cst.If | None:
    """The post-call block (``sites``: the ``if`` that runs where the fused op did not write,
    however its test is written): slices and asserts, then ``self.<write>(...)`` - on the
    compiled path maybe a custom op instead (``if torch.compiler.is_compiling(): ...``)."""
    name, stmt = pieces.insert_method, pieces.post_block
    if stmt is None:
        return None
    if not isinstance(stmt, cst.If) or stmt.orelse is not None:
        raise Unsupported(f"the post-call `self.{name}(...)` is not in an `if not <guard>:` block")
    if not pieces.post_insert_wired:  # (check's reason: ``schema.WIRED``)
        raise Unsupported(f"the post-call `self.{name}(...)` is not wired: {schema.WIRED}")
    assigned: set[str] = set()
    if _block_inserts(m, stmt.body, assigned, name) != 1:
        raise Unsupported(f"the post-call block does not hold exactly one `self.{name}(...)`")
    later = set().union(*(a.names_read(rest) for rest in slot.after()[1:]))  # (wired: it is the first)
    if assigned & later:
        raise Unsupported(f"names set in the post-call block are used after it: {', '.join(sorted(assigned & later))}")
    return stmt


def _block_inserts(m: FileModel, suite: cst.BaseSuite, assigned: set[str], name: str) -> int:
    """How many ``self._insert_kv(...)`` a post-call block holds, once it is proven to hold
    nothing else: slices (``assigned``), asserts, and a compiled-path branch of calls."""
    inserts = 0
    for inner in suite.body if isinstance(suite, cst.IndentedBlock) else ():
        pair = a.simple_assignment(inner)
        call = a.expression_call(inner)
        if pair is not None and isinstance(pair[0], cst.Name):
            assigned.add(pair[0].value)
        elif call is not None and sites.is_insert_kv_call(call, name):
            inserts += 1
        elif isinstance(inner, cst.SimpleStatementLine) and all(isinstance(x, cst.Assert) for x in inner.body):
            continue
        elif _is_compile_branch(m, inner):
            assert isinstance(inner, cst.If) and isinstance(inner.orelse, cst.Else)
            inserts += _block_inserts(m, inner.orelse.body, assigned, name)
        else:
            raise Unsupported(
                f"the post-call block holds more than slices, asserts and `self.{name}(...)`: "
                f"`{a.shown(inner)[:80]}` - it cannot be removed as a whole"
            )
    return inserts


def _is_compile_branch(m: FileModel, stmt: cst.BaseStatement) -> bool:
    """``if torch.compiler.is_compiling(): <calls> else: ...``: the compiled path's cache write."""
    if not isinstance(stmt, cst.If) or not isinstance(stmt.orelse, cst.Else):
        return False
    body = stmt.body.body if isinstance(stmt.body, cst.IndentedBlock) else ()
    return m.is_compiling(stmt.test) and bool(body) and all(a.expression_call(x) is not None for x in body)


def _check_nothing_left(
    m: FileModel, cls: cst.ClassDef, method: cst.FunctionDef,
    gone: list[cst.CSTNode], guards: set[str], flag: str,
) -> None:
    """After the removal of ``gone`` no read of the flag (``self.<flag>``, or ``<x>.<flag>`` anywhere in the
    file: another class's read through the layer) or of a guard may remain."""
    removed_nodes = {id(n) for root in gone for n in a.walk_all(root)}
    flags = [(n, f"`{a.shown(n)}`") for n in _attribute_reads(m, cls, flag)]
    guard_reads = [n for n in a.walk_scope(method.body) if isinstance(n, cst.Name) and n.value in guards]
    for node, what in flags + [(n, f"the guard `{n.value}`") for n in guard_reads]:
        if id(node) not in removed_nodes:
            line = m.positions[node].start.line if node in m.positions else "?"
            raise Unsupported(f"{what} is also used at line {line}, outside the bypass")


def _attribute_reads(m: FileModel, cls: cst.ClassDef, name: str) -> list[cst.CSTNode]:
    """Every ``<x>.<name>`` in the file, and every string that is ``name`` (``getattr(x, "<name>")``); but
    ``self.<name>`` in a class outside the layer's lineage, another object's attribute."""
    lineage = {id(n) for c in m.lineage(cls) for n in a.nodes_in(c)}
    found = [n for n in m.named(name) if isinstance(n, (cst.Attribute, cst.SimpleString))]
    return [n for n in found if a.self_attr(n) is None or id(n) in lineage]


def _plan_insert_kv(
    m: FileModel, found: sites.FoundCall, slot: a.StatementSlot, post: cst.If | None, plan: RevertPlan,
    native: bool,
) -> None:
    """Restore the attn_metadata ``_insert_kv``, or remove the one the rewrite added
    (on a native call always: the kernel writes the cache, upstream has no ``_insert_kv``)."""
    cls, method, op, module, name = found.cls, found.method, found.op, m.module, plan.write_method
    assert cls is not None and method is not None
    fn = plan.old_insert_kv = a.find_method(cls, name)
    assert fn is not None
    allowed = {id(n) for n in a.nodes_in(post)} if post is not None else set()
    if sites.other_insert_kv_call(cls, allowed, name) is not None:
        raise Unsupported(f"`{name}` is also called outside the bypass: its signature must stay")
    allowed |= {id(n) for root in (fn, *plan.dead) for n in a.walk_all(root)}  # (module code only it left dead)
    other = next((n for n in _attribute_reads(m, cls, name) if id(n) not in allowed), None)
    if other is not None:
        line = m.positions[other].start.line if other in m.positions else "?"
        raise Unsupported(f"`{a.shown(other)}` at line {line} also names `{name}`, outside the bypass")
    imports = a.module_imports(module)
    metadata = [  # plain from-imports of the metadata classes
        i.importer for i in imports if i.bound in (MAIN_METADATA, INDEX_METADATA) and i.alias.asname is None
        and isinstance(i.importer, cst.ImportFrom)
    ]
    missing = [n for n in (INDEX_METADATA, MAIN_METADATA) if n not in {i.bound for i in imports}]
    if native or not metadata:
        # The attn_metadata form asserts on the metadata classes: with neither imported there is
        # nothing to restore it from (run added the method, or dropped both imports as unused).
        plan.removed_because = "a native call writes the cache itself" if native else NO_METADATA
        plan.insert_kv = "remove"
        plan.also_remove = _exclusive_delegates(m, cls, fn, plan.dead if native else [])
        return

    if not any(i.bound == FORWARD_CONTEXT for i in imports):
        raise Unsupported(f"`{FORWARD_CONTEXT}` is not imported: cannot restore the attn_metadata {name}")
    init = m.init(cls)
    if init is None:
        raise Unsupported(f"class {cls.name.value} has no __init__")
    names = proofs.write_names(op, method, slot, init, m.top_imports, m.init_stores(cls))
    if names["reshape"] == schema.RESHAPE_OP and not any(i.bound == schema.RESHAPE_OP for i in imports):
        raise Unsupported(f"`{schema.RESHAPE_OP}` is not imported: cannot restore the attn_metadata {name}")

    plan.add_imports = {id(metadata[0]): missing}
    plan.insert_kv = "restore"
    plan.also_remove = _exclusive_delegates(m, cls, fn)
    plan.insert_kv_code = codegen.render(
        codegen.INSERT_KV_METADATA, module, m.depth(cls) + 1,
        main_key=_metadata_key(method, op, schema.SLOT_MAPPING, slot),
        index_key=_metadata_key(method, op, schema.INDEX_SLOT_MAPPING, slot),
        main_slots="main_meta.slot_mapping", main_metadata=MAIN_METADATA, index_metadata=INDEX_METADATA,
        **names,
    )


def _metadata_key(method: cst.FunctionDef, op: a.OpCall, param: schema.OpParam, slot: a.StatementSlot) -> str:
    """``fwd_slot_mapping[<key>]`` (directly or through a local) -> the code of ``<key>``."""
    arg = op.arg(param)
    value = arg.value if arg is not None else None
    if isinstance(value, cst.Name):
        value = a.local_value(method, value.value, slot)
    key = value.slice[0].slice if isinstance(value, cst.Subscript) and len(value.slice) == 1 else None
    if isinstance(key, cst.Index) and a.is_pure(key.value):
        return a.code(key.value)
    raise Unsupported(
        f"`{param.keyword}` is not `<slot mappings>[<layer key>]`: cannot tell which attn_metadata "
        "entry the restored write method reads"
    )


def _exclusive_delegates(
    m: FileModel, cls: cst.ClassDef, fn: cst.FunctionDef, gone: list[cst.CSTNode] = ()
) -> list[cst.FunctionDef]:
    """Methods ``fn`` hands its work to that nothing else names: they go with it (``gone``: removed too)."""
    inside = {id(n) for root in (fn, *gone) for n in a.nodes_in(root)}
    return [d for d in a.delegates(fn, cls, {}) if all(id(n) in inside for n in _uses(m, d.name.value, d))]


def _uses(m: FileModel, name: str, definition: cst.CSTNode) -> list[cst.CSTNode]:
    """Where ``name`` is named, outside ``definition``: as a name, an attribute (``x.name``) or a string."""
    own = {id(n) for n in a.nodes_in(definition)}
    return [n for n in m.named(name) if id(n) not in own]


def _dead_module_code(m: FileModel, removed: list[cst.CSTNode]) -> list[cst.BaseStatement]:
    """Module-level code that only the removed bypass used: the compiled path's custom
    op (its registration, named by a string nothing else names, and the functions only
    that names) and helpers only the removed code calls."""
    gone = {id(n) for root in removed for n in a.nodes_in(root)}  # (a dead statement's own nodes join it)
    dead: list[cst.BaseStatement] = []
    while new := [s for s in m.module.body if id(s) not in gone and _used_only_in(m, s, gone)]:
        dead += new
        gone |= {id(n) for s in new for n in a.nodes_in(s)}
    return dead


def _used_only_in(m: FileModel, stmt: cst.BaseStatement, gone: set[int]) -> bool:
    """A module function, or a registration by a string, that is named elsewhere only in ``gone``."""
    if isinstance(stmt, cst.FunctionDef):
        uses = _uses(m, stmt.name.value, stmt)
    else:
        args = call.args if (call := a.expression_call(stmt)) is not None else ()
        name = next((x.value.evaluated_value for x in args if isinstance(x.value, cst.SimpleString)), None)
        if name is None:
            return False
        uses = [n for n in _uses(m, name, stmt) if not isinstance(n, cst.SimpleString)]
    return bool(uses) and all(id(n) in gone for n in uses)


class Fp8KvRevert(codegen.Splice):
    """Apply one ``RevertPlan``."""

    def __init__(self, module: cst.Module, plan: RevertPlan) -> None:
        self.plan = plan
        self.remove = {id(n) for n in (*plan.remove, *_gone(plan))}
        methods = {id(plan.old_insert_kv): plan.insert_kv_code} if plan.insert_kv == "restore" else {}
        super().__init__(module, methods, plan.add_imports, {*self.remove, id(plan.call_statement)})

    def replace(self, original: cst.BaseStatement, updated: cst.BaseStatement) -> codegen.Replacement:
        """A removed statement hands its comments on but the bypass's; the call loses the bypass's."""
        if id(original) in self.remove:
            kept = codegen.strip_comments(updated.leading_lines)
            return [], [line for line in kept if line.comment is not None]
        if original is self.plan.call_statement:
            lines = codegen.strip_comments(updated.leading_lines)
            return [updated.with_changes(leading_lines=lines)], []
        return [updated], []

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        if any(original is arg for arg in self.plan.unwrap_args):
            assert isinstance(updated.value, cst.IfExp)
            kept = updated.value.orelse if a.is_none(updated.value.body) else updated.value.body
            return updated.with_changes(value=kept)
        return updated

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        kept = zip(original.body, updated.body, strict=True)
        return updated.with_changes(body=[new for orig, new in kept if id(orig) not in self.remove])


def _gone(plan: RevertPlan) -> list[cst.CSTNode]:
    """What goes whole besides the bypass's statements: module code only it used, the delegates
    only ``_insert_kv`` used, and ``_insert_kv`` itself where it is removed."""
    removed = plan.old_insert_kv if plan.insert_kv == "remove" else None
    return [*plan.dead, *plan.also_remove] + ([removed] if removed is not None else [])


def apply_revert(module: cst.Module, plan: RevertPlan) -> cst.Module:
    new = module.visit(Fp8KvRevert(module, plan))
    # Imports that only removed code used (the compiled path's registration helper, say).
    candidates = {n for node in _gone(plan) for n in a.names_read(node)}
    if plan.insert_kv == "remove":
        candidates.add(schema.RESHAPE_OP)
    return codegen.remove_unused_imports(new, candidates)
