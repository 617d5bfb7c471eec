"""The guard and the post-call block, read as truth tables over ``roles.evaluate``: the guard
conditions the cache arguments on ``not flag`` (``guard_flag``), the post-call block runs where
the fused op did not write (``post_block``) - however either is written."""

from __future__ import annotations

import ast
import collections
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from codemods import schema
from codemods.names import callee, dotted, expression, is_compiling, literal, qualified, self_member
from codemods.roles import COMPILING, NO_SCOPE, Scope, Unknown, evaluate, init_methods


def self_attrs(node: ast.expr) -> set[str]:
    """The ``self.<attr>`` names an expression reads (one level: ``self.a``, not ``self.a.b``)."""
    return {attr for n in ast.walk(node) if (attr := self_member(n)) is not None}


@dataclass(frozen=True)
class Guard:
    """What the cache arguments are conditioned on: ``fused_when``, true where the fused op
    gets the caches (``G`` of ``X if G else None``, ``not C`` of ``None if C else X``)."""

    fused_when: ast.expr
    local: str | None = None  # the local it reads (None: inlined)
    value: ast.expr | None = None  # what the local holds before the call (None: bound nowhere, a lost guard)
    scope: Scope = NO_SCOPE  # the file's functions and imports (``model.FileModel.module_scope``)

    def reads(self) -> set[str]:
        """The ``self.`` attributes the guard reads (its value's where it has one)."""
        return self_attrs(self.fused_when) | (self_attrs(self.value) if self.value is not None else set())

    def table(self, expr: ast.expr, flag: str | None) -> tuple[list[dict[str, bool]], list[bool] | None]:
        """The rows over ``COMPILING``, ``self.<flag>`` and a local nothing binds, in
        ``itertools.product`` order, and ``expr``'s truth on each (the local's value read over
        them); None: not a function of those alone."""
        unbound = [self.local] if self.local is not None and self.value is None else []
        atoms = [COMPILING, *([f"self.{flag}"] if flag else []), *unbound]
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


def compile_locals(fn: ast.FunctionDef | None, imports: Mapping[str, str]) -> set[str]:
    """The locals of ``fn`` bound once, to ``torch.compiler.is_compiling()`` however imported (``compiling = …``)."""
    return {name for name, value in _bound_once(fn).items() if is_compiling(value, imports)}


def _bound_once(fn: ast.AST | None) -> dict[str, ast.expr]:
    """The locals ``fn`` binds once, by a plain ``name = value``: their values."""
    nodes = list(ast.walk(fn)) if fn is not None else []
    names = (n for n in nodes if isinstance(n, ast.Name))
    stores = collections.Counter(n.id for n in names if isinstance(n.ctx, ast.Store))
    assigns = ((n.targets[0], n.value) for n in nodes if isinstance(n, ast.Assign) and len(n.targets) == 1)
    return {t.id: value for t, value in assigns if isinstance(t, ast.Name) and stores[t.id] == 1}


def writes_cache(method: str | None, scope: Scope) -> bool:
    """``self.<method>(…)`` writes a cache: the method, or a method or module function it calls,
    calls the reshape op - whatever it is handed (the post-call write found by its shape)."""
    def defined(call: ast.Call) -> ast.FunctionDef | None:  # a method of the class, or a module function
        name = self_member(call.func)
        return scope.methods.get(name) if name is not None else scope.functions.get(dotted(call.func) or "")

    fn = scope.methods.get(method) if method is not None else None
    called = [defined(n) for n in ast.walk(fn) if isinstance(n, ast.Call)] if fn is not None else []
    return any(is_reshape(n, scope.imports) for f in (fn, *called) if f is not None for n in ast.walk(f))


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
        if is_reshape(n, scope.imports) or (isinstance(n, ast.Subscript) and indexed(n))
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
_MASKS = {
    "ge", "gt", "le", "lt", "eq", "ne", "greater_equal", "greater", "less_equal", "less", "not_equal", "isin",
    "logical_and", "logical_or", "logical_not", "logical_xor", "isnan", "isinf", "isfinite", "bool",
}
_REDUCTIONS = {"any", "all", "min", "max", "sum", "amax", "amin", "count_nonzero"}  # a tensor, read as a bool in a test
# What the host knows of a tensor without waiting for the device; and what hands the host a value.
_HOST = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "size", "numel", "dim", "stride", "element_size", "nbytes"}
_TO_HOST = {"int", "float", "bool", "complex", "str", "repr", "format", "print"}
_KNOWN = {"len", "isinstance", "hasattr", "type", "id", "callable"}  # of a tensor: what the host knows


def _on_device(node: ast.AST, device: set[str]) -> bool:
    """``node``'s value is read from the device: it reads a name (or ``self.<name>``) of ``device``, not only
    through what the host knows (``x.shape``, ``x.numel()``, ``len(x)``, ``x is None``: ``_HOST``, ``_KNOWN``)."""
    if isinstance(node, ast.Name):
        return node.id in device
    if isinstance(node, ast.Attribute):
        return f"self.{self_member(node)}" in device or node.attr not in _HOST and _on_device(node.value, device)
    if isinstance(node, ast.Call) and (dotted(node.func) in _KNOWN or callee(node) in _HOST and isinstance(node.func, ast.Attribute)):
        return False
    if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
        return False  # which object it is (`x is None`), not what it holds
    return any(_on_device(c, device) for c in ast.iter_child_nodes(node))


def _spread(fn: ast.AST, seeds: set[str], read: Callable[[ast.AST, set[str]], bool]) -> set[str]:
    """``seeds`` and the names ``fn`` binds (assigned, looped over, ``with … as``) from what ``read`` says reads them."""
    binds = [(t, v) for n in ast.walk(fn) for t, v in (
        [(t, n.value) for t in n.targets] if isinstance(n, ast.Assign) else
        [(n.target, n.value)] if isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and n.value else
        [(n.target, n.iter)] if isinstance(n, (ast.For, ast.comprehension)) else
        [(i.optional_vars, i.context_expr) for i in n.items if i.optional_vars] if isinstance(n, ast.With) else [])]
    found, grown = set(seeds), True
    while grown:
        new = {x.id for t, v in binds if read(v, found) for x in ast.walk(t) if isinstance(x, ast.Name)} - found
        found, grown = found | new, bool(new)
    return found


def _mask(n: ast.AST, names: set[str]) -> bool:
    """``n`` is a boolean mask: a comparison, ``~x``, a test of ``_MASKS``, ``x.to(torch.bool)``, a name of ``names``."""
    if isinstance(n, ast.Name):
        return n.id in names
    if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.BitAnd, ast.BitOr)):
        return _mask(n.left, names) or _mask(n.right, names)
    if isinstance(n, ast.Tuple):  # x[mask, :]
        return any(_mask(e, names) for e in n.elts)
    if isinstance(n, ast.Call) and callee(n) in ("to", "type"):
        return "torch.bool" in map(dotted, [*n.args, *(k.value for k in n.keywords)])
    invert = isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Invert)
    return invert or isinstance(n, ast.Compare) or isinstance(n, ast.Call) and callee(n) in _MASKS


def _tests(n: ast.AST) -> list[ast.expr]:
    """What ``n`` tests: an ``if``'s, a loop's, an ``assert``'s or a conditional's test, ``and``/``or``'s operands but
    the last, a comprehension's ``if``s, a ``match``'s subject."""
    tested = [n.test] if isinstance(n, (ast.If, ast.While, ast.Assert, ast.IfExp)) else [n.subject] if isinstance(n, ast.Match) else []
    return tested + (n.ifs if isinstance(n, ast.comprehension) else n.values[:-1] if isinstance(n, ast.BoolOp) else [])


def _named(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(x, ast.Name) and x.id in names for x in ast.walk(node))


def _counts(node: ast.AST, tensors: set[str]) -> bool:
    """``node`` reads how many items a tensor of ``tensors`` holds: ``x.shape``, ``x.size()``, ``x.numel()``, ``len(x)``."""
    for x in ast.walk(node):
        method = x.func.value if isinstance(x, ast.Call) and callee(x) in ("size", "numel") else None  # type: ignore[attr-defined]
        owner = x.value if isinstance(x, ast.Attribute) and x.attr == "shape" else method
        owner = x.args[0] if isinstance(x, ast.Call) and dotted(x.func) == "len" and x.args else owner
        if owner is not None and _named(owner, tensors):
            return True
    return False


def _zero_split(test: ast.Compare) -> bool:
    """``n == 0``, ``n != 0``, ``n > 0``, ``n <= 0``, ``n >= 1``, ``n < 1``: some tokens or none, and no other split."""
    ops, right = test.ops, test.comparators[0]
    value = right.value if isinstance(right, ast.Constant) and len(ops) == 1 else None
    return (value == 0 and isinstance(ops[0], (ast.Eq, ast.NotEq, ast.Gt, ast.LtE))) or (
        value == 1 and isinstance(ops[0], (ast.GtE, ast.Lt))
    )


def batch_branches(code: Iterable[ast.AST]) -> list[ast.expr]:
    """Tests in ``code`` (not an ``assert``'s, which fails loudly) that compare how many tokens a tensor it is handed
    holds (``_counts``), or a value made from that, otherwise than with none (``_zero_split``: a batch of no token
    has nothing to write): the write takes another path for some batch sizes, and the proof runs one."""
    found: list[ast.expr] = []
    for fn in code:
        args = fn.args if isinstance(fn, (ast.FunctionDef, ast.Lambda)) else None
        params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} if args is not None else set()
        tensors = _spread(fn, params - {"self"}, _named)
        sizes = _spread(fn, set(), lambda v, made: _counts(v, tensors) or _named(v, made))
        tests = (t for n in ast.walk(fn) if not isinstance(n, ast.Assert) for t in _tests(n))
        found += [
            t for t in tests if any(isinstance(c, ast.Compare) and (_counts(c, tensors) or _named(c, sizes))
                                    and not _zero_split(c) for c in ast.walk(t))
        ]
    return found


def _host_reads(n: ast.AST) -> list[ast.AST]:
    """What ``n`` hands the host: a test (of an ``if``, a loop, an ``assert``, ``and``/``or``), the arguments of a
    conversion (``int(…)``, ``print(…)``), an f-string's value, a slice's bounds, ``repeat_interleave``'s repeats
    (with no ``output_size``: the size of its result)."""
    tested = _tests(n)
    if isinstance(n, ast.Call):
        kws = {k.arg: k.value for k in n.keywords}
        tested += n.args if dotted(n.func) in _TO_HOST else []
        if callee(n) == "repeat_interleave" and "output_size" not in kws:
            at = 1 if dotted(n.func) == "torch.repeat_interleave" and len(n.args) > 1 else 0
            tested += [kws.get("repeats") or n.args[at]] if n.args or "repeats" in kws else []
    tested += [n.value] if isinstance(n, ast.FormattedValue) else [n.lower, n.upper, n.step] if isinstance(n, ast.Slice) else []
    return [x for x in tested if x is not None]


def host_syncs(code: Iterable[ast.AST], tensors: Iterable[str] = ()) -> list[ast.AST]:
    """Where ``code`` makes the host wait for the device, which a captured CUDA graph cannot replay: a call of
    ``SYNCS`` (``torch.where`` with one argument too); a value from the device handed the host (``_host_reads``),
    from the device meaning read from a parameter (not annotated as other than a tensor) or a ``self.<x>`` of
    ``tensors``, or made from one; a tensor reduction tested as a bool; indexing by a boolean mask (``x[slots >= 0]``,
    or through locals). Not: what the host knows of a tensor (its ``shape``, ``numel()``: ``_HOST``), nor what runs
    only as the write fails (a ``raise``, an ``assert``'s message)."""
    found: list[ast.AST] = []
    for fn in code:
        args = fn.args if isinstance(fn, (ast.FunctionDef, ast.Lambda)) else None
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs] if args is not None else []
        seeds = {a.arg for a in params if a.arg != "self" and "Tensor" in ast.unparse(a.annotation or ast.Name("Tensor"))}
        device, masks = _spread(fn, seeds | {f"self.{t}" for t in tensors}, _on_device), _spread(fn, set(), _mask)
        failing = [x.msg if isinstance(x, ast.Assert) else x for x in ast.walk(fn) if isinstance(x, (ast.Raise, ast.Assert))]
        skipped = {id(x) for f in failing if f is not None for x in ast.walk(f)}  # what runs only as it fails
        for n in (n for n in ast.walk(fn) if id(n) not in skipped):
            where = isinstance(n, ast.Call) and callee(n) == "where" and len(n.args) + len(n.keywords) == 1
            read = [n if isinstance(n, ast.Call) else x for x in _host_reads(n) if _on_device(x, device)][:1]
            synced = isinstance(n, ast.Call) and (callee(n) in SYNCS or where) or isinstance(n, ast.Subscript) and _mask(n.slice, masks)
            found += [n] if synced else read
            tests = [getattr(n, "test", None)] if isinstance(n, (ast.If, ast.While, ast.Assert, ast.IfExp)) else []
            found += [c for t in tests for c in ast.walk(t) if isinstance(c, ast.Call) and callee(c) in _REDUCTIONS][:1]  # type: ignore[arg-type]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


# Where vLLM defines the reshape op: its Python wrapper, and the torch library it registers.
RESHAPE_HOMES = {f"vllm._custom_ops.{schema.RESHAPE_OP}", f"torch.ops._C_cache_ops.{schema.RESHAPE_OP}"}


def is_reshape(node: ast.AST, imports: Mapping[str, str]) -> bool:
    """A call of the reshape op, by its name or by what the name is bound to (``import … as write``)."""
    bound = (qualified(node.func, imports) or "").rpartition(".")[2] if isinstance(node, ast.Call) else None
    return isinstance(node, ast.Call) and schema.RESHAPE_OP in (callee(node), bound)


def reshape_calls(code: Iterable[ast.AST], imports: Mapping[str, str]) -> list[ast.Call]:
    """The calls of the reshape op in ``code``."""
    return [n for fn in code for n in ast.walk(fn) if is_reshape(n, imports)]


def foreign_reshapes(code: Iterable[ast.AST], imports: Mapping[str, str]) -> list[ast.Call]:
    """Calls of the reshape op in ``code`` through what is not one of ``RESHAPE_HOMES`` however the file
    imports it (``torch.ops._C.reshape_and_cache_flash``: no such op, an AttributeError on the first write)."""
    return [c for c in reshape_calls(code, imports) if qualified(c.func, imports) not in RESHAPE_HOMES]


# The reshape op's key, value and kv-cache dtype parameters.
_KEY, _VALUE, _DTYPE = schema.OpParam(0, "key"), schema.OpParam(1, "value"), schema.OpParam(5, "kv_cache_dtype")


def _arg(call: ast.Call, param: schema.OpParam) -> ast.expr | None:
    return schema.bind_arg(param, call.args, [(k.arg, k.value) for k in call.keywords])  # type: ignore[misc]


def _index_write(call: ast.Call) -> bool:
    """A write of the index key: the same tensor as key and value."""
    return ast.dump(_arg(call, _KEY) or call) == ast.dump(_arg(call, _VALUE) or ast.Pass())


def foreign_dtypes(code: Iterable[ast.AST], carries: Callable[[ast.expr], bool], imports: Mapping[str, str]) -> list[ast.Call]:
    """The main writes in ``code`` (a key and a value, not the index key twice) whose kv-cache dtype ``carries``
    does not prove to be the layer's for every fp8 dtype: the kernel quantizes by it ("fp8" into an e5m2 cache: e4m3)."""
    mains = [c for c in reshape_calls(code, imports) if not _index_write(c)]
    return [c for c in mains if (dtype := _arg(c, _DTYPE)) is None or not carries(dtype)]


def spelled_writes(
    code: Iterable[ast.AST], dtyped: set[str], alike: Callable[[ast.expr], bool], imports: Mapping[str, str]
) -> list[ast.expr]:
    """Where what ``code`` writes depends on which fp8 dtype the cache is ("fp8", "fp8_e4m3", "fp8_e5m2": the flag is
    true for each): a test (``_tests``), or the index write's kv-cache dtype (the index cache has a dtype of its own),
    that reads a value made from ``dtyped`` (``self.<x>`` names) and that ``alike`` does not prove one for each."""
    def reads(node: ast.AST, made: set[str]) -> bool:
        return any(isinstance(x, ast.Name) and x.id in made or f"self.{self_member(x)}" in made for x in ast.walk(node))

    found: list[ast.expr] = []
    for fn in code:
        made = _spread(fn, dtyped, reads) - {"self"}  # (a store to ``self.<x>`` is no local)
        index = [d for c in reshape_calls([fn], imports) if _index_write(c) and (d := _arg(c, _DTYPE)) is not None]
        found += [x for x in [*(t for n in ast.walk(fn) for t in _tests(n)), *index] if reads(x, made) and not alike(x)]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _one(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 1


_FLOAT32 = {"torch.float32", "torch.float"}


def unproven_scales(
    code: Iterable[ast.AST], made: dict[str, list[ast.expr]], upgraded: bool, imports: Mapping[str, str]
) -> list[ast.expr]:
    """The scales the reshape op's calls in ``code`` hand the kernel (``k_scale``, ``v_scale``: a float32 on the
    device, to it) not proven so. Proven: ``torch.ones(…, device=…)`` (or ``torch.full(…, 1.0, device=…)``) made at
    run time (float32 by default); a ``self.<x>`` that ``__init__`` makes (or registers) as ``torch.ones(…,
    dtype=torch.float32)`` (vLLM builds a model on the device but in its own dtype, bf16); a local bound once to
    either, or (``upgraded``: ``run`` replaces it) to any ``torch.ones(…)``. ``made``: ``init_stores``."""
    def ones(value: ast.AST | None, at_init: bool) -> bool:  # (``torch.full(shape, 1.0, …)`` too: 1 is int64)
        fill = value.args[1] if isinstance(value, ast.Call) and len(value.args) == 2 else None
        full = isinstance(value, ast.Call) and dotted(value.func) == "torch.full" and _one(fill)
        if not (isinstance(value, ast.Call) and dotted(value.func) == "torch.ones" or full):
            return False
        given = {k.arg: dotted(k.value) for k in value.keywords}  # type: ignore[union-attr]
        int_fill = full and not isinstance(fill.value, float)  # type: ignore[union-attr]
        default = None if at_init or int_fill else "torch.float32"
        device = next((k.value for k in value.keywords if k.arg == "device"), None)  # type: ignore[union-attr]
        on_host = device is not None and "cpu" in map(literal, [device, *getattr(device, "args", [])])
        return given.get("dtype", default) in _FLOAT32 and (at_init or "device" in given) and not on_host

    found: list[ast.expr] = []
    for fn in code:
        once = _bound_once(fn)
        calls = reshape_calls([fn], imports)
        scales = (x for c in calls for x in [*c.args[6:8], *(k.value for k in c.keywords if k.arg in ("k_scale", "v_scale"))])
        for scale in scales:
            value = once.get(scale.id, scale) if isinstance(scale, ast.Name) else scale  # a local's value
            local = value is not scale
            attr = self_member(value)
            held: list[ast.expr | None] = made.get(attr, [None]) if attr is not None else [None]  # type: ignore[assignment]
            replaced = upgraded and local and isinstance(value, ast.Call) and dotted(value.func) == "torch.ones"
            if not (replaced or ones(value, False) or len(held) == 1 and ones(held[0], True)):
                found.append(scale)
    return found


def init_stores(init: ast.FunctionDef | None) -> dict[str, list[ast.expr]]:
    """What ``__init__`` stores in each ``self.<x>``, in order: assigned (each target of ``self.x = self.y = v``, each
    name of a tuple target, the whole value) or registered (``self.register_buffer("x", v)``)."""
    found: dict[str, list[ast.expr]] = {}
    for n in ast.walk(init) if init is not None else ():
        if isinstance(n, ast.Assign):
            for x in (x for t in n.targets for x in ast.walk(t) if self_member(x) is not None):
                found.setdefault(self_member(x), []).append(n.value)  # type: ignore[arg-type]
        elif isinstance(n, ast.Call) and self_member(n.func) == "register_buffer" and len(n.args) >= 2:
            found.setdefault(literal(n.args[0]) or "", []).append(n.args[1])
    return found


def reach_stores(init: ast.FunctionDef | None, scope: Scope) -> dict[str, list[ast.FunctionDef]]:
    """What ``__init__`` and the methods it calls (``roles.init_methods``) store (``init_stores``): by attribute, the
    functions that store it."""
    found: dict[str, list[ast.FunctionDef]] = {}
    for f in init_methods(init, scope) if init is not None else ():
        for x in init_stores(f):
            found.setdefault(x, []).append(f)
    return found


def _made_tensors(stores: dict[str, list[ast.expr]]) -> set[str]:
    """The ``self.<x>`` that ``__init__`` makes tensors (``init_stores``): a ``torch.<f>(…)`` (not ``torch.nn``'s)."""
    calls = ((x, dotted(v.func) or "") for x, vs in stores.items() for v in vs if isinstance(v, ast.Call))
    return {x for x, f in calls if f.startswith("torch.") and not f.startswith("torch.nn.")}


def _captured(stores: dict[str, list[ast.expr]], caches: Iterable[str]) -> dict[str, ast.expr]:
    """The ``self.<y>`` that ``__init__`` binds to a value made from a cache the call passes (``self.kv_cache``), by
    name: vLLM binds the layer's real caches after building it, so ``y`` keeps the placeholder."""
    wanted = set(caches)
    return {y: v for y, vs in stores.items() for v in vs if any(dotted(x) in wanted for x in ast.walk(v))}  # type: ignore[arg-type]


def kept_write_problems(
    runs: list[ast.AST], init: ast.FunctionDef | None, imports: Mapping[str, str], upgraded: bool, name: str,
    carries: Callable[[ast.expr], bool], caches: list[str], dtyped: set[str], alike: Callable[[ast.expr], bool],
) -> list[str]:
    """What the write a bypass keeps must not do, in words, the first of each kind (``runs``: what it and the
    post-call block run; ``caches``: the call's cache attributes, read for ``_captured``)."""
    stores = init_stores(init)
    syncs, scales = host_syncs(runs, _made_tensors(stores))[:1], unproven_scales(runs, stores, upgraded, imports)[:1]
    held = _captured(stores, caches)
    stale = [n for fn in runs for n in ast.walk(fn) if isinstance(n, ast.Attribute) and self_member(n) in held][:1]
    handlers = (h for fn in runs for h in ast.walk(fn) if isinstance(h, ast.ExceptHandler))
    swallowed = [h for h in handlers if not any(isinstance(n, ast.Raise) for n in ast.walk(h))][:1]
    return [
        *(f"the write reads `{ast.unparse(n)}` at line {n.lineno}, which __init__ binds to a cache the call passes (line "
          f"{held[n.attr].lineno}): vLLM binds the layer's real caches after building it, so it holds the placeholder "
          "and the fp8 write misses the cache. Read the cache attribute itself in the write" for n in stale),
        *(f"the write at line {n.lineno} depends on which fp8 dtype the cache is (`{ast.unparse(n)}`): the flag is true "
          'for "fp8", "fp8_e4m3" and "fp8_e5m2" alike, and the write is proven for one; write each the same way (the '
          "kernel takes the dtype), and the index cache by its own dtype" for n in spelled_writes(runs, dtyped, alike, imports)[:1]),
        *(f"the write at line {n.lineno} takes another path for some batch sizes (`{ast.unparse(n)}`), and the proof "
          "runs one batch: write every batch the same way" for n in batch_branches(runs)[:1]),
        *(f"an `except` at line {h.lineno} around the write goes on without raising: a write that fails leaves the "
          "cache as it was, and attention reads it as if written" for h in swallowed),
        *(f"the post-call write (`self.{name}(…)`) makes the host wait for the device, or switches streams, at line "
          f"{n.lineno} (`{ast.unparse(n)}`): a CUDA graph cannot capture it, nor torch.compile without a graph break"
          for n in syncs),
        *(f"the scale `{ast.unparse(n)}` that the write hands `{schema.RESHAPE_OP}` at line {n.lineno} is not proven "
          "the identity scale the kernel reads: a float32 tensor of ones on the device (made in __init__ as "
          "`torch.ones(…, dtype=torch.float32)`)" for n in scales),
        *(f"the write calls `{ast.unparse(n.func)}` at line {n.lineno}: vLLM defines `{schema.RESHAPE_OP}` in "
          "`vllm._custom_ops` and `torch.ops._C_cache_ops` alone" for n in foreign_reshapes(runs, imports)[:1]),
        *(f"the write at line {n.lineno} hands `{schema.RESHAPE_OP}` a kv-cache dtype not proven to be the layer's "
          '`self.kv_cache_dtype` for "fp8", "fp8_e4m3" and "fp8_e5m2": the kernel quantizes by it, so an fp8_e5m2 '
          "cache would be written in another format" for n in foreign_dtypes(runs, carries, imports)[:1]),
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


def set_through_another(nodes: Iterable[ast.AST], names: list[str], owner: str = "") -> list[tuple[ast.expr, str]]:
    """``<x>.<name> = …`` or ``setattr(<x>, "<name>", …)`` among ``nodes`` (the file's), with ``x`` not
    ``self``: another object changes a layer's ``name`` (its flag, scale or cache dtype) after its ``__init__``;
    with ``owner``, ``x`` the class of that name (a method rebound after the class body)."""
    found: list[tuple[ast.expr, ast.expr, str]] = []  # (the store, the object, the name)
    for n in nodes:
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = (t for top in getattr(n, "targets", [getattr(n, "target", None)]) for t in ast.walk(top))
            found += [(t, t.value, t.attr) for t in targets if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)]
        elif isinstance(n, ast.Call) and callee(n) == "setattr" and len(n.args) >= 2:
            name = n.args[1].value if isinstance(n.args[1], ast.Constant) else None
            found += [(n, n.args[0], name)] if isinstance(name, str) else []
    return [(node, name) for node, x, name in found if name in names and (dotted(x) == owner if owner else dotted(x) != "self")]


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
