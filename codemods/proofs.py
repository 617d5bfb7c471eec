"""Proving from the file what the bypass relies on: the caches ``_insert_kv`` reaches, the fused buffer, slot
mappings and each width of its layout, where the flag goes in ``__init__``, where ``reshape_and_cache_flash``
is. Each returns code naming what it proved, or raises ``Unsupported`` saying what was missing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import libcst as cst

from codemods import anchors as a
from codemods import names, schema
from codemods.anchors import products, stale_widths
from codemods.schema import Unsupported
from codemods.sites import guard_of, unguarded


def op_namespace(op: a.OpCall, imports: Mapping[str, str]) -> str | None:
    """Where ``reshape_and_cache_flash`` is, from how the module reaches the fused op: ``torch.ops._C`` ->
    ``torch.ops._C_cache_ops``; a bare name -> None (``bare_import``); else the ``vllm._custom_ops`` name."""
    func = op.call.func
    if op.wrapper is None and isinstance(func, cst.Attribute):  # (by what it is bound to: `from torch.ops import _C`)
        tree = names.expression(a.code(func.value))
        if tree is not None and names.qualified(tree, imports) == "torch.ops._C":
            return "torch.ops._C_cache_ops"
    elif op.wrapper is None and isinstance(func, cst.Name):
        return None
    # the code that names `vllm._custom_ops` here (``ops`` of ``from vllm import _custom_ops as ops``)
    namespace = next((bound for bound, name in sorted(imports.items()) if name == "vllm._custom_ops"), None)
    if namespace is None:
        shown = a.code(func) if op.wrapper is None else f"wrapper `{op.wrapper.name}`"
        raise Unsupported(
            f"the op is called through {shown}, and no statement of the module's own imports `vllm._custom_ops` (one "
            "in a function or under an `if` binds its name there alone, or not at all), "
            f"where `{schema.RESHAPE_OP}` is: add `from vllm import _custom_ops as ops`, then run again"
        )
    return namespace


def write_names(
    op: a.OpCall, method: cst.FunctionDef, slot: a.StatementSlot, init: cst.FunctionDef, imports: Mapping[str, str],
    stored: Mapping[str, object],
) -> dict[str, str]:
    """What a write method and the post-call block are filled in with (the bypass's ``INSERT_KV_METHOD``,
    ``POST_INSERT`` and revert's ``INSERT_KV_METADATA`` alike): the caches (``cache_args``), the widths
    (``widths``), the cache dtype, ``reshape_and_cache_flash`` where the module reaches it (``op_namespace``;
    bare: the op's own name). ``stored``: what ``__init__`` and its methods store (``init_stores``)."""
    init_attrs = a.self_assignments(init)
    names = cache_args(op, method, slot) | widths(op, method, slot, init_attrs, stale_widths(init, init_attrs))
    if schema.DTYPE_ATTR not in stored:
        raise Unsupported("cannot find the kv-cache dtype attribute (`self.kv_cache_dtype`) set by __init__")
    namespace = op_namespace(op, imports)
    return names | {
        "dtype": f"self.{schema.DTYPE_ATTR}",
        "reshape": schema.RESHAPE_OP if namespace is None else f"{namespace}.{schema.RESHAPE_OP}",
    }


def cache_args(op: a.OpCall, method: cst.FunctionDef, slot: a.StatementSlot) -> dict[str, str]:
    """The cache expressions `_insert_kv` can reach (an argument under a condition: a guard's), by the
    parameters' keywords (``kv_cache``, ``index_cache``: the templates' names for them)."""
    caches: dict[str, str] = {}
    for param in schema.CACHE_ARGS:
        arg = op.arg(param)
        if arg is None or a.is_none(arg.value):
            raise Unsupported(f"the call passes no `{param.keyword}` argument to guard")
        if isinstance(arg.value, cst.IfExp) and guard_of(arg) is None:
            shown = a.code(arg.value)
            raise Unsupported(f"`{param.keyword}` is a conditional that cannot be guarded: {shown}")
        value = unguarded(arg)
        resolved = a.resolve_self_expr(method, value, slot)
        if resolved is None:
            raise Unsupported(
                f"`{param.keyword}` argument `{a.code(value)}` is not a `self.` attribute "
                "(or a local proven to hold one on every path to the call) that the write method can reach"
            )
        caches[param.keyword] = a.code(resolved)
    return caches


def qkv_and_slots(op: a.OpCall) -> tuple[str, str, str]:
    """The fused buffer and the two slot-mapping expressions, safe to use again after the call."""
    qkv = op.arg(schema.QKV)
    if qkv is None or not isinstance(qkv.value, cst.Name):
        raise Unsupported("the fused qkv argument is not a plain local name")
    slots = []
    for param in (schema.SLOT_MAPPING, schema.INDEX_SLOT_MAPPING):
        arg = op.arg(param)
        if arg is None or a.is_none(arg.value) or not a.is_pure(arg.value):
            shown = a.code(arg.value) if arg is not None else "nothing"
            raise Unsupported(f"`{param.keyword}` ({shown}) is not a name or attribute "
                              "that can be passed again")
        slots.append(a.code(arg.value))
    return qkv.value.value, slots[0], slots[1]


def widths(
    op: a.OpCall, method: cst.FunctionDef, slot: a.StatementSlot, init_attrs: a.Assignments, stale: set[str]
) -> dict[str, str]:
    """Code for the widths of the fused buffer's parts [q | k | v | index_q | index_k] (index_k: one head), by
    the templates' names; each by what it is in the layout, never the first product that fits: a head size is
    what that part's norms are built with (the call passes their ``.weight``), else the one size multiplying
    its head counts in ``__init__``; a width is a ``self.W = <count> * <size>`` of ``__init__`` assigned once
    and not stale (``anchors.stale_widths``: it may hold the model's width), else that product."""
    counts: dict[str, cst.BaseExpression] = {}
    for param in (schema.NUM_HEADS, schema.NUM_KV_HEADS, schema.NUM_INDEX_HEADS):
        arg = op.arg(param)
        resolved = a.resolve_self_expr(method, arg.value, slot) if arg is not None else None
        if resolved is None:
            raise Unsupported(f"`{param.keyword}` is not a `self.` attribute (or a local proven to hold one)")
        counts[param.keyword] = resolved
    found_products = products(init_attrs)

    def size(what: str, label: str, norm_weights: tuple[schema.OpParam, ...], *count_names: str) -> str:
        built = _norm_sizes(op, method, slot, init_attrs, norm_weights)
        if len(built) > 1:
            raise Unsupported(f"the norms of one part are built with different sizes: {sorted(built)}")
        if built:
            return built.pop()
        # The sizes each count multiplies; the first count's narrowed by the next ones'.
        found = [f for n in count_names if (f := {d for w, c, d in found_products if a.same_expr(c, counts[n])})]
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

    # each part's norm weights the call passes: (index_)q_norm_weight, (index_)k_norm_weight
    head_dim = size("head_dim", "head size", schema.OP_PARAMS[1:3], "num_heads", "num_kv_heads")
    idx_head_dim = size("idx_head_dim", "index head size", schema.OP_PARAMS[9:11], "num_index_heads")

    def width(count: cst.BaseExpression, dim: str) -> str:
        found = (f"self.{w}" for w, c, d in found_products if w not in stale and a.same_expr(c, count) and d == dim)
        return next(found, f"{a.code(count)} * {dim}")

    return {
        "q_width": width(counts["num_heads"], head_dim), "kv_width": width(counts["num_kv_heads"], head_dim),
        "index_q_width": width(counts["num_index_heads"], idx_head_dim), "head_dim": head_dim,
        "idx_head_dim": idx_head_dim, "num_kv_heads": a.code(counts["num_kv_heads"]),
    }


def _norm_sizes(
    op: a.OpCall, method: cst.FunctionDef, slot: a.StatementSlot, init_attrs: a.Assignments, params
) -> set[str]:
    """The ``self.D`` that the norms passed as ``params`` (``self.N.weight``) are built with: ``self.N =
    Norm(self.D, …)`` in __init__, assigned once."""
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


def dtype_anchor(init: cst.FunctionDef, attrs: a.Assignments, setters: Sequence[str] = ()) -> a.StatementSlot | None:
    """The statement after which the flag goes: the top-level statement of __init__ holding the
    last assignment of ``self.kv_cache_dtype`` (the main cache's, what vLLM's backends read), else its last call of a
    method of ``setters`` (that set it), or the torch dtype made from it if one follows; None where __init__ sets none."""
    defs = attrs.get(schema.DTYPE_ATTR)
    body = init.body.body if isinstance(init.body, cst.IndentedBlock) else ()
    calls = [i for i, stmt in enumerate(body) for n in a.nodes_in(stmt, scope_only=True)
             if isinstance(n, cst.Call) and a.self_attr(n.func) in setters]
    if not defs and not calls:
        return None
    top = a.slot_chain(init, defs[-1][0])[0] if defs else a.StatementSlot(init.body, calls[-1])  # type: ignore[arg-type]
    for i in range(top.index + 1, len(top.block.body)):
        if any(_is_dtype_conversion(n) for n in a.nodes_in(top.block.body[i], scope_only=True)):
            return a.StatementSlot(top.block, i)
    return top


def _is_dtype_conversion(node: cst.CSTNode) -> bool:
    """``kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, …)``."""
    convert = isinstance(node, cst.Call) and a.callee_name(node) == "kv_cache_dtype_str_to_dtype"
    return convert and bool(node.args) and a.self_attr(node.args[0].value) == schema.DTYPE_ATTR


def bare_import(imports: list[a.ImportedName]) -> tuple[cst.SimpleStatementLine, cst.ImportFrom] | None:
    """For a bare ``fused_…(…)`` callee: ``from vllm._custom_ops import fused_…``, beside which
    ``reshape_and_cache_flash`` is imported (None: it is imported already)."""
    if any(i.bound == schema.RESHAPE_OP for i in imports):
        return None
    for imp in imports:
        plain = isinstance(imp.importer, cst.ImportFrom) and imp.alias.asname is None
        if plain and imp.qualified == f"vllm._custom_ops.{schema.FUSED_OP}":
            return imp.statement, imp.importer  # type: ignore[return-value]
    raise Unsupported(
        f"`{schema.FUSED_OP}` is called by a bare name that `from vllm._custom_ops import …` does not bring in: "
        f"where `{schema.RESHAPE_OP}` is cannot be told; import both from `vllm._custom_ops`, then run again"
    )
