"""The guard and the post-call block, read as truth tables over ``roles.evaluate``: the guard
conditions the cache arguments on ``not flag`` (``guard_flag``), the post-call block runs where
the fused op did not write (``post_block``) - however either is written."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from codemods import schema
from codemods.roles import COMPILING, NO_SCOPE, Scope, Unknown, callee, dotted, evaluate, expression, qualified, self_member


def self_attrs(node: ast.expr) -> set[str]:
    """The ``self.<attr>`` names an expression reads (one level: ``self.a``, not ``self.a.b``)."""
    return {attr for n in ast.walk(node) if (attr := self_member(n)) is not None}


@dataclass(frozen=True)
class Guard:
    """What the cache arguments are conditioned on: ``fused_when``, true where the fused op
    gets the caches (``G`` of ``X if G else None``, ``not C`` of ``None if C else X``);
    ``local``: the local it reads (None: inlined); ``value``: what the local holds before
    the call (None: bound nowhere, a lost guard)."""

    fused_when: ast.expr
    local: str | None = None
    value: ast.expr | None = None
    scope: Scope = NO_SCOPE  # the file's functions and imports (``model.FileModel.module_scope``)

    def reads(self) -> set[str]:
        """The ``self.`` attributes the guard reads (its value's where it has one)."""
        return self_attrs(self.fused_when) | (self_attrs(self.value) if self.value is not None else set())

    def table(self, expr: ast.expr, flag: str | None) -> tuple[list[dict[str, bool]], list[bool] | None]:
        """The rows over ``COMPILING``, ``self.<flag>`` and a local nothing binds, in
        ``itertools.product`` order, and ``expr``'s truth on each (the local's value read over
        them); None: not a function of those alone."""
        atoms = [COMPILING] + ([f"self.{flag}"] if flag else [])
        if self.local is not None and self.value is None:
            atoms.append(self.local)
        rows = [dict(zip(atoms, values)) for values in itertools.product((False, True), repeat=len(atoms))]
        scope, table = self.scope, []
        for row in rows:
            env: dict[str, object] = dict(row)
            try:
                if self.local is not None and self.value is not None:
                    env[self.local] = bool(evaluate(self.value, env, scope))
                table.append(bool(evaluate(expr, env, scope)))
            except (Unknown, TypeError, ValueError, RecursionError):
                return rows, None
        return rows, table


def guard_flag(guard: Guard, native: bool) -> str | None:
    """The flag a guard reads, where it is a guard: the fused op writes where ``not F`` or
    ``not compiling and not F`` -> ``"F"``; on a native call also ``not compiling`` -> ``""``
    (in eager the kernel writes fp8 itself). None: not a bypass's guard (or a lost one)."""
    attrs = guard.reads()
    if (guard.local is not None and guard.value is None) or len(attrs) > 1:
        return None
    flag = next(iter(attrs), None)
    rows, table = guard.table(guard.fused_when, flag)
    if table is None:
        return None
    if flag is None:
        return "" if native and table == [not r[COMPILING] for r in rows] else None
    f = f"self.{flag}"
    proven = ([not r[f] for r in rows], [not r[COMPILING] and not r[f] for r in rows])
    return flag if table in proven else None


def passes_slots(node: ast.AST, slots: list[ast.expr]) -> bool:
    """A call handed every one of ``slots``, a call's slot mappings (``self.<write>(…, slots,
    index_slots)``): what the fused op would write by, compared as Python's own trees."""
    if not isinstance(node, ast.Call):
        return False
    args = {ast.dump(a) for a in (*node.args, *(k.value for k in node.keywords))}
    return all(ast.dump(s) in args for s in slots)


def no_token(test: str, params: list[str]) -> bool:
    """``X.numel() == 0`` (``not X.numel()``, ``X.shape[0] == 0``, ``X.size(0) == 0``, ``len(X) == 0``), ``X`` one of a
    write's ``params`` (its tokens, first): a batch of no token, where there is nothing to write."""
    tree = expression(test)
    zero = isinstance(tree, ast.Compare) and [type(o) for o in tree.ops] == [ast.Eq] and ast.unparse(tree.comparators[0]) == "0"
    count = tree.left if zero else tree.operand if isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.Not) else None  # type: ignore[union-attr]
    counts = {c for p in params for c in (f"{p}.numel()", f"{p}.shape[0]", f"{p}.size(0)", f"len({p})")}
    return count is not None and ast.unparse(count) in counts


def writes_cache(method: str | None, scope: Scope) -> bool:
    """``self.<method>(…)`` writes a cache: the method, or a method or module function it calls,
    calls the reshape op - whatever it is handed (the post-call write found by its shape)."""
    def calls(fn: ast.AST | None) -> list[ast.Call]:
        return [n for n in ast.walk(fn) if isinstance(n, ast.Call)] if fn is not None else []

    def defined(call: ast.Call) -> ast.FunctionDef | None:  # a method of the class, or a module function
        name = self_member(call.func)
        return scope.methods.get(name) if name is not None else scope.functions.get(dotted(call.func) or "")

    fn = scope.methods.get(method) if method is not None else None
    return any(callee(c) == schema.RESHAPE_OP for f in [fn, *map(defined, calls(fn))] for c in calls(f))


def own_writes(
    method: ast.FunctionDef, scope: Scope, init: ast.FunctionDef | None, slots: list[ast.expr]
) -> list[ast.AST]:
    """What ``method`` reaches (``reached``) that writes a cache itself: a call of the reshape op, or a
    store indexed by one of the call's ``slots``."""
    dumps = {ast.dump(s) for s in slots}

    def indexed(n: ast.Subscript) -> bool:
        return isinstance(n.ctx, ast.Store) and any(ast.dump(x) in dumps for x in ast.walk(n.slice))

    return [
        n for fn in reached(method, scope, init) for n in ast.walk(fn)
        if (isinstance(n, ast.Call) and callee(n) == schema.RESHAPE_OP) or (isinstance(n, ast.Subscript) and indexed(n))
    ]


def reached(code: ast.AST, scope: Scope, init: ast.FunctionDef | None) -> list[ast.AST]:
    """``code`` and what it runs, whatever it is called: the methods and module functions it names
    (``type(self).m`` too), and a lambda ``__init__`` puts in an attribute it names, in turn."""
    assigns = (n for n in (ast.walk(init) if init is not None else ()) if isinstance(n, ast.Assign))
    values = {self_member(t): n.value for n in assigns for t in n.targets if isinstance(n.value, ast.Lambda)}
    seen, todo = [code], [code]
    while todo:
        for n in ast.walk(todo.pop()):
            name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else None
            for found in (scope.methods.get(name), scope.functions.get(name), values.get(name) if name else None):
                if found is not None and all(found is not s for s in seen):
                    seen.append(found)
                    todo.append(found)
    return seen


# What a CUDA graph cannot capture (torch.compile breaks its graph there too): tensor methods and torch
# functions whose result the host must wait for (a value, a size), a copy from the host, another stream.
SYNCS = {
    "item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select", "unique",
    "tensor", "as_tensor", "from_numpy", "synchronize", "stream", "Stream",
}
_MASKS = {"ge", "gt", "le", "lt", "eq", "ne", "isin", "logical_and", "logical_or", "logical_not", "bool"}
_REDUCTIONS = {"any", "all", "min", "max", "sum", "amax", "amin"}  # a tensor, read as a bool in a test


def host_syncs(code: Iterable[ast.AST]) -> list[ast.AST]:
    """Where ``code`` does what a captured CUDA graph cannot replay: a call of ``SYNCS`` (``torch.where``
    with one argument too), a tensor reduction tested as a bool (``if (slots >= 0).any():``), or indexing
    by a boolean mask (``x[slots >= 0]``, ``x[valid]`` where ``valid = …`` is one), whose size the host needs."""
    def mask(n: ast.AST, names: set[str]) -> bool:
        if isinstance(n, ast.Name):
            return n.id in names
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.BitAnd, ast.BitOr)):
            return mask(n.left, names) or mask(n.right, names)
        if isinstance(n, ast.Tuple):  # x[mask, :]
            return any(mask(e, names) for e in n.elts)
        invert = isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Invert)
        return invert or isinstance(n, ast.Compare) or isinstance(n, ast.Call) and callee(n) in _MASKS

    def tested(n: ast.AST) -> list[ast.AST]:  # the reductions a test reads as a bool
        test = getattr(n, "test", None) if isinstance(n, (ast.If, ast.While, ast.Assert, ast.IfExp)) else None
        calls = (c for c in ast.walk(test) if isinstance(c, ast.Call)) if test is not None else ()
        return [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr in _REDUCTIONS]

    found: list[ast.AST] = []
    for fn in code:
        assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)]
        names = {t.id for n in assigns if mask(n.value, set()) for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            where = isinstance(n, ast.Call) and callee(n) == "where" and len(n.args) + len(n.keywords) == 1
            synced = isinstance(n, ast.Call) and (callee(n) in SYNCS or where)
            found += [n] if synced or isinstance(n, ast.Subscript) and mask(n.slice, names) else []
            found += tested(n)
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


# Where vLLM defines the reshape op: its Python wrapper, and the torch library it registers.
RESHAPE_HOMES = {f"vllm._custom_ops.{schema.RESHAPE_OP}", f"torch.ops._C_cache_ops.{schema.RESHAPE_OP}"}


def foreign_reshapes(code: Iterable[ast.AST], imports: Mapping[str, str]) -> list[ast.Call]:
    """Calls of the reshape op in ``code`` through what is not one of ``RESHAPE_HOMES`` however the file
    imports it (``torch.ops._C.reshape_and_cache_flash``: no such op, an AttributeError on the first write)."""
    calls = (n for fn in code for n in ast.walk(fn) if isinstance(n, ast.Call) and callee(n) == schema.RESHAPE_OP)
    return [c for c in calls if qualified(c.func, imports) not in RESHAPE_HOMES]


def _one(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 1


_FLOAT32 = {"torch.float32", "torch.float"}


def unproven_scales(code: Iterable[ast.AST], init: ast.FunctionDef | None, upgraded: bool) -> list[ast.expr]:
    """The scales the reshape op's calls in ``code`` hand the kernel (``k_scale``, ``v_scale``: a float32 on the
    device, to it) not proven so. Proven: ``torch.ones(…, device=…)`` (or ``torch.full(…, 1.0, device=…)``) made at
    run time (float32 by default); a ``self.<x>`` that ``__init__`` makes (or registers) as ``torch.ones(…,
    dtype=torch.float32)`` (vLLM builds a model on the device but in its own dtype, bf16); a local bound once to
    either, or (``upgraded``: ``run`` replaces it) to any ``torch.ones(…)``."""
    def ones(value: ast.AST | None, at_init: bool) -> bool:  # (``torch.full(shape, 1.0, …)`` too: 1 is int64)
        fill = value.args[1] if isinstance(value, ast.Call) and len(value.args) == 2 else None
        full = isinstance(value, ast.Call) and dotted(value.func) == "torch.full" and _one(fill)
        if not (isinstance(value, ast.Call) and dotted(value.func) == "torch.ones" or full):
            return False
        given = {k.arg: dotted(k.value) for k in value.keywords}  # type: ignore[union-attr]
        int_fill = full and not isinstance(fill.value, float)  # type: ignore[union-attr]
        default = None if at_init or int_fill else "torch.float32"
        return given.get("dtype", default) in _FLOAT32 and (at_init or "device" in given)

    made: dict[str | None, list[ast.AST]] = {}
    for n in ast.walk(init) if init is not None else ():
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            made.setdefault(self_member(n.targets[0]), []).append(n.value)
        elif isinstance(n, ast.Call) and self_member(n.func) == "register_buffer" and len(n.args) >= 2:
            made.setdefault(getattr(n.args[0], "value", None), []).append(n.args[1])
    found: list[ast.expr] = []
    for fn in code:
        bound: dict[str, list[ast.AST]] = {}  # a local's bindings: the value of a lone `x = …`, else the node
        for n in ast.walk(fn):
            if isinstance(getattr(n, "ctx", None), ast.Store) and isinstance(n, ast.Name):
                bound.setdefault(n.id, []).append(n)
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                bound[n.targets[0].id] = [n.value] * len(bound[n.targets[0].id])
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and callee(n) == schema.RESHAPE_OP]
        scales = (x for c in calls for x in [*c.args[6:8], *(k.value for k in c.keywords if k.arg in ("k_scale", "v_scale"))])
        for scale in scales:
            local = isinstance(scale, ast.Name) and len(bound.get(scale.id, [])) == 1
            value = bound[scale.id][0] if local else scale  # type: ignore[union-attr]
            attr = self_member(value)  # type: ignore[arg-type]
            held = made.get(attr, [None]) if attr is not None else [None]
            replaced = upgraded and local and isinstance(value, ast.Call) and dotted(value.func) == "torch.ones"
            if not (replaced or ones(value, False) or len(held) == 1 and ones(held[0], True)):
                found.append(scale)
    return found


def kept_write_problems(
    runs: list[ast.AST], init: ast.FunctionDef | None, imports: Mapping[str, str], upgraded: bool, name: str
) -> list[str]:
    """What the write a bypass keeps must not do, in words (``runs``: what it and the post-call block run):
    the first host sync (``host_syncs``), unproven scale (``unproven_scales``), reshape op vLLM does not define
    (``foreign_reshapes``), and an ``except`` that swallows a failed write."""
    syncs, scales = host_syncs(runs)[:1], unproven_scales(runs, init, upgraded)[:1]
    handlers = (h for fn in runs for h in ast.walk(fn) if isinstance(h, ast.ExceptHandler))
    swallowed = [h for h in handlers if not any(isinstance(n, ast.Raise) for n in ast.walk(h))][:1]
    return [
        *(f"an `except` at line {h.lineno} around the write goes on without raising: a write that fails leaves the "
          "cache as it was, and attention reads it as if written" for h in swallowed),
        *(f"the post-call write (`self.{name}(…)`) makes the host wait for the device at line {n.lineno} "
          f"(`{ast.unparse(n)}`): a CUDA graph cannot capture it, nor torch.compile without a graph break"
          for n in syncs),
        *(f"the scale `{ast.unparse(n)}` that the write hands `{schema.RESHAPE_OP}` at line {n.lineno} is not proven "
          "the identity scale the kernel reads: a float32 tensor of ones on the device (made in __init__ as "
          "`torch.ones(…, dtype=torch.float32)`)" for n in scales),
        *(f"the write calls `{ast.unparse(n.func)}` at line {n.lineno}: vLLM defines `{schema.RESHAPE_OP}` in "
          "`vllm._custom_ops` and `torch.ops._C_cache_ops` alone" for n in foreign_reshapes(runs, imports)[:1]),
    ]


def dropped_writes(
    block: ast.stmt, method: ast.FunctionDef, module: ast.Module, imports: Mapping[str, str]
) -> list[ast.Call]:
    """The registered ops (``torch.ops.<ns>.<op>(…)``) the post-call ``block`` calls that torch.compile may drop:
    the file registers none of them as mutating (``direct_register_custom_op``'s or ``custom_op``'s
    ``mutates_args``) and nothing in ``method`` after the block reads what the call returns (vLLM hands it to
    attention as ``kv_cache_dummy_dep``): a call whose result no one uses is dead code to the compiler."""
    mutating = set()
    registers = ("direct_register_custom_op", "custom_op")
    for n in (n for n in ast.walk(module) if isinstance(n, ast.Call) and callee(n) in registers):
        given = {k.arg: k.value for k in n.keywords} | ({"op_name": n.args[0]} if n.args else {})
        name, mutates = given.get("op_name"), given.get("mutates_args")
        if isinstance(name, ast.Constant) and isinstance(mutates, (ast.List, ast.Tuple)) and mutates.elts:
            mutating.add(str(name.value).rpartition("::")[2])
    end = block.end_lineno or block.lineno
    later = {n.id for n in ast.walk(method) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.lineno > end}
    assigns = (n for n in ast.walk(block) if isinstance(n, ast.Assign))
    kept = {id(n.value) for n in assigns if any(getattr(t, "id", None) in later for t in n.targets)}
    ops = ((n, qualified(n.func, imports) or "") for n in ast.walk(block) if isinstance(n, ast.Call))
    return [c for c, op in ops if op.startswith("torch.ops.") and id(c) not in kept and op.rpartition(".")[2] not in mutating]


def dropped_write_problems(
    block: ast.stmt, method: ast.FunctionDef, module: ast.Module, imports: Mapping[str, str]
) -> list[str]:
    """The first of ``dropped_writes``, in words."""
    return [
        f"the compiled path's cache write `{ast.unparse(c.func)}(…)` at line {c.lineno}: the op declares no "
        "mutation and nothing after the post-call block reads what it returns, so torch.compile drops it (no "
        "token written while compiled); hand its result to attention, as vLLM's `kv_cache_dummy_dep`"
        for c in dropped_writes(block, method, module, imports)[:1]
    ]


STORES = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Call)  # the nodes ``set_through_another`` reads


def set_through_another(nodes: Iterable[ast.AST], names: list[str]) -> list[tuple[ast.expr, str]]:
    """``<x>.<name> = …`` or ``setattr(<x>, "<name>", …)`` among ``nodes`` (the file's), with ``x`` not
    ``self``: another object changes a layer's ``name`` (its flag, scale or cache dtype) after its ``__init__``."""
    found: list[tuple[ast.expr, ast.expr, str]] = []  # (the store, the object, the name)
    for n in nodes:
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = (t for top in getattr(n, "targets", [getattr(n, "target", None)]) for t in ast.walk(top))
            found += [(t, t.value, t.attr) for t in targets if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)]
        elif isinstance(n, ast.Call) and callee(n) == "setattr" and len(n.args) >= 2:
            name = n.args[1].value if isinstance(n.args[1], ast.Constant) else None
            found += [(n, n.args[0], name)] if isinstance(name, str) else []
    return [(node, name) for node, x, name in found if name in names and not (isinstance(x, ast.Name) and x.id == "self")]


@dataclass(frozen=True)
class PostBlock:
    """An ``if`` after the call that runs exactly when the fused op did not write."""

    while_compiling: bool  # it runs while compiling, whatever the flag


def post_block(test: ast.expr, guard: Guard, flag: str | None) -> PostBlock | None:
    """Whether ``test`` is the post-call block's: true exactly where the fused op did not
    write (``not G``, ``G is False``, ``self.F`` where ``G = not self.F``), or where it did
    not or the model is compiling (``torch.compiler.is_compiling() or not G``, either order)."""
    rows, table = guard.table(test, flag)
    fused = guard.table(guard.fused_when, flag)[1]
    if table is None or fused is None:
        return None
    compiling = [r[COMPILING] for r in rows]
    if table == [not w for w in fused]:
        return PostBlock(all(t for t, c in zip(table, compiling) if c))
    if table == [c or not w for c, w in zip(compiling, fused)]:
        return PostBlock(True)
    return None
