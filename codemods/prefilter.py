"""Answer, without LibCST, the files whose every call of the op is native or no site (most files
``check`` sees on a commit are vLLM's own). ``ast`` reads only facts it reads exactly and
``schema.verdict`` decides; only where structure proves a native call has no bypass piece (no
guarded cache argument, no flag by ``roles.flags``, no post-call write). Else None: LibCST answers."""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Callable

from codemods import guards, names, roles, runtime, schema

_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def prefilter(raw: bytes) -> list[schema.InsertSite] | None:
    """Every call's site when all are native or not a site, else None (ask LibCST)."""
    try:
        tree, lines = ast.parse(raw), importlib.util.decode_source(raw).split("\n")
    except (SyntaxError, ValueError, RecursionError, MemoryError, UnicodeDecodeError):
        return None
    imports = names.import_table(tree)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    constants = roles.module_constants(tree, roles.Scope(functions, {}, imports))

    @functools.cache  # what the module binds at run time: read once, and only where the op is called
    def module() -> runtime.Module:
        return runtime.Module.of(tree, imports)

    @functools.cache  # by class: __init__ read once, however many calls it holds
    def read(cls: ast.ClassDef) -> tuple[ast.FunctionDef | None, roles.Scope, dict[str, dict]]:
        methods = names.class_methods(cls, tree)
        init, scope = methods.get("__init__"), roles.Scope(functions, methods, imports)
        attrs = roles.module_constants(tree, roles.NO_SCOPE, cls)  # class attributes, as ``self.NAME``
        return init, scope, roles.init_values(init, scope, constants | attrs) if init is not None else {}

    sites: list[schema.InsertSite] = []
    stores: list[ast.AST] = []  # for ``guards.set_through_another``
    named = 0  # every place the op is named: each must be the callee of a call read below

    def visit(node: ast.AST, stack: tuple[ast.AST, ...]) -> None:
        nonlocal named
        named += sum(isinstance(v, str) and schema.FUSED_OP in v for _, v in ast.iter_fields(node))
        if isinstance(node, guards.STORES):
            stores.append(node)
        if isinstance(node, ast.Call) and names.callee(node) == schema.FUSED_OP:
            sites.append(_site(node, stack, lines, read, module))
        inner = (*stack, node) if isinstance(node, _DEFS) else stack
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    try:
        visit(tree, ())
    except (_Defer, RecursionError):
        return None
    if guards.set_through_another(stores, [schema.DTYPE_ATTR]):
        return None  # a layer's cache dtype changed from outside: LibCST says what
    answered = (schema.SiteState.NATIVE, schema.SiteState.NOT_A_SITE)
    return sites if named == len(sites) and all(s.state in answered for s in sites) else None


class _Defer(Exception):
    """A fact ``ast`` cannot read exactly as LibCST does."""


def _after(call: ast.Call, body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements after the one holding ``call``, in its block (within ``body``; no handler's)."""
    after: list[ast.stmt] = []
    for block, i in runtime.path_to(call, body, ("body", "orelse", "finalbody")):
        after = block[i + 1 :]
    return after


def _site(
    call: ast.Call, stack: tuple[ast.AST, ...], lines: list[str],
    read: Callable[[ast.ClassDef], tuple[ast.FunctionDef | None, roles.Scope, dict[str, dict]]], module: Callable[[], runtime.Module],
) -> schema.InsertSite:
    cls, method = stack[-2:] if len(stack) >= 2 else (None, None)
    if not (isinstance(cls, ast.ClassDef) and isinstance(method, ast.FunctionDef)):
        raise _Defer  # not directly in a method (a wrapper, a nested def): LibCST follows these
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise _Defer
    args = list(call.args)
    keywords = [(k.arg, k.value) for k in call.keywords if k.arg is not None]
    kv, index = (schema.bind_arg(p, args, keywords) for p in schema.CACHE_ARGS)
    if any(c is not None and not _self_chain(c) for c in (kv, index)):
        raise _Defer  # a cache argument under a condition (a bypass's guard, whatever it is called), or not self's
    dtype = schema.bind_arg(schema.KV_CACHE_DTYPE, args, keywords)
    has_cache = kv is not None and not (isinstance(kv, ast.Constant) and kv.value is None)
    init, scope, values = read(cls)
    proven = init is not None and dtype is not None and roles.carries_dtype(dtype, scope, values)
    if has_cache and (dtype is None or not _plain(dtype, lines) or not proven):
        raise _Defer  # a fork-era call, a dtype whose text LibCST may give differently, or not proven
    if has_cache:
        slots = [schema.bind_arg(p, args, keywords) for p in (schema.SLOT_MAPPING, schema.INDEX_SLOT_MAPPING)]
        passed = [s for s in slots if s is not None]
        after = [n for s in _after(call, method.body) for n in ast.walk(s)]
        if any(roles.flags(init, scope, values).values()) or any(  # type: ignore[arg-type]
            guards.passes_slots(n, passed) for n in after
        ) or guards.own_writes(method, scope, init, passed):  # (every method and function a call after it reaches)
            raise _Defer  # a flag, or a write of its own: the pieces of a bypass, whatever their names
    facts = schema.CallFacts(
        line=call.lineno, class_name=cls.name, method=method.name, module_function=None, nested_in=None,
        star_args=False, has_cache=has_cache, dtype=names.dotted(dtype) if has_cache else None,
        dtype_is_auto=False, dtype_proven=True, in_block=False,  # in_block: not asked with a dtype
        broken=runtime.broken(module(), cls, init, method, call, values, scope, set()),
    )
    return schema.verdict(facts, schema.Pieces)


def _self_chain(node: ast.expr) -> bool:
    """``self.a.b`` (or None)."""
    return (isinstance(node, ast.Constant) and node.value is None) or (names.dotted(node) or "").startswith("self.")


def _plain(node: ast.expr, lines: list[str]) -> bool:
    """``self.kv_cache_dtype``-like, written plainly between ``=``/``,`` and ``,``/``)``."""
    if names.dotted(node) is None or node.end_lineno != node.lineno:
        return False
    line = lines[node.lineno - 1].encode()
    start, end = node.col_offset, node.end_col_offset or 0
    # The last text before it: on its own line, else on the nearest line above with any.
    above = (text.encode().rstrip() for text in reversed(lines[: node.lineno - 1]))
    before = line[:start].rstrip() or next((text for text in above if text), b"")
    return (
        line[start:end].decode() == names.dotted(node)
        and before[-1:] in (b"=", b",")
        and line[end:].lstrip()[:1] in (b",", b")", b"")
    )
