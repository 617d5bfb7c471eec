"""The roles of a bypass, proven from what its expressions do, never from how they are spelled.

A fork's own bypass may name every piece differently, and write every condition
another way round. Each piece is known here by its role:

- *flag*: a ``self.<attr>`` that ``__init__`` leaves true for ``"fp8"``, ``"fp8_e4m3"``,
  ``"fp8_e5m2"`` and false for ``"auto"``, whatever statements decide it: ``flags`` runs
  ``__init__`` (and the methods it calls) on each dtype (``attribute_values``), reading
  every expression with ``evaluate`` (``"fp8" in d``,
  ``d.startswith("fp8")``, ``d != "auto"``, a membership test, vLLM's
  ``is_quantized_kv_cache(d)``, a module or ``self`` function that returns one of
  those);
- *guard*: what the cache arguments are conditioned on, a local or inlined
  (``None if self.<flag> else X``); ``guard_flag`` reads its truth table over
  "compiling" and the flag: ``not flag``, ``not compiling and not flag`` or (a
  native call) ``not compiling``;
- *post-call block*: the ``if`` after the call that runs when the guard is false,
  its test read as a truth table too (``post_block``), so ``not G``, ``G is
  False``, ``torch.compiler.is_compiling() or not G`` in either order are one role.

Everything here works on Python's own ``ast`` and imports nothing heavy.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from codemods import schema

FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
DTYPE = f"self.{schema.DTYPE_ATTR}"
COMPILING = "<compiling>"  # the truth tables' name for torch.compiler.is_compiling()
# vLLM's helper (in whichever vLLM module a release keeps it): true for every quantized
# cache dtype (``kv_cache_dtype != "auto"``).
VLLM_HELPERS = {"is_quantized_kv_cache": lambda dtype: dtype != schema.AUTO_DTYPE}
_STR_METHODS = {"startswith", "endswith", "lower", "upper", "strip", "casefold"}
_DEPTH = 3  # helper functions calling helper functions: how deep a flag is followed


# --- Python's own tree: names and expressions (parser-free) --------------------------------


def dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def callee(call: ast.Call) -> str | None:
    """``f`` of ``f(…)`` and of ``x.f(…)``."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def is_scale_value(node: ast.expr) -> bool:
    """``torch.ones(…)``: the identity scale as the bypass makes it."""
    return isinstance(node, ast.Call) and dotted(node.func) == "torch.ones"


def expression(code: str) -> ast.expr | None:
    """One expression's source as Python's own tree (None: not an expression)."""
    try:
        return ast.parse(f"({code})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class Unknown(Exception):
    """The expression holds something the reading cannot evaluate."""


# What `torch.compiler.is_compiling()` is, under any of its public names.
COMPILE_TESTS = frozenset(
    {"torch.compiler.is_compiling", "torch._dynamo.is_compiling", "torch._dynamo.external_utils.is_compiling"}
)


def import_table(tree: ast.Module) -> dict[str, str]:
    """Each name an import binds (anywhere in the file), to the qualified name it is bound to."""
    table: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    table[alias.asname] = alias.name
                else:  # `import a.b` binds `a`, and says that `a.b` is loaded
                    table[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
                    table[alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                if alias.name != "*":
                    table[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
    return table


def qualified(node: ast.expr, imports: Mapping[str, str]) -> str | None:
    """The dotted name ``node`` is, its first part resolved through the imports."""
    name = dotted(node)
    if name is None:
        return None
    root, dot, rest = name.partition(".")
    return imports.get(root, root) + dot + rest


def is_compiling(node: ast.expr, imports: Mapping[str, str]) -> bool:
    """A call of ``torch.compiler.is_compiling()``, however the file imported or spelled it."""
    return (
        isinstance(node, ast.Call)
        and not node.args
        and not node.keywords
        and qualified(node.func, imports) in COMPILE_TESTS
    )



@dataclass(frozen=True)
class Scope:
    """What an expression's calls can reach: the module's functions, the class's methods
    (``ast`` defs by name) and what the file's imports bind (``import_table``)."""

    functions: Mapping[str, ast.FunctionDef]
    methods: Mapping[str, ast.FunctionDef]
    imports: Mapping[str, str] = field(default_factory=dict)


NO_SCOPE = Scope({}, {})


def evaluate(node: ast.expr, env: Mapping[str, object], scope: Scope = NO_SCOPE, depth: int = 0) -> object:
    """The value of ``node`` where ``env`` gives names, ``self.`` attributes (dotted) and
    ``COMPILING``; ``Unknown`` for anything else."""

    def ev(n: ast.expr) -> object:
        return evaluate(n, env, scope, depth)

    if isinstance(node, ast.Constant):
        return node.value
    name = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
    if name is not None:
        if name in env:
            return env[name]
        raise Unknown(name)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return tuple(ev(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not ev(node.operand)
    if isinstance(node, ast.BoolOp):
        value: object = None
        for item in node.values:
            value = ev(item)
            if bool(value) is isinstance(node.op, ast.Or):
                return value
        return value
    if isinstance(node, ast.IfExp):
        return ev(node.body) if ev(node.test) else ev(node.orelse)
    if isinstance(node, ast.Compare):
        left = ev(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = ev(right_node)
            if not _compare(op, left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call):
        return _call(node, env, scope, depth)
    raise Unknown(type(node).__name__)


def _compare(op: ast.cmpop, left: object, right: object) -> bool:
    if isinstance(op, (ast.In, ast.NotIn)):
        if not isinstance(right, (str, tuple)) or (isinstance(right, str) and not isinstance(left, str)):
            raise Unknown("in")
        return (left in right) is isinstance(op, ast.In)
    if isinstance(op, (ast.Eq, ast.NotEq)):
        return (left == right) is isinstance(op, ast.Eq)
    if isinstance(op, (ast.Is, ast.IsNot)):  # `G is False`: only on bools and None, where it is ==
        if not all(v is None or isinstance(v, bool) for v in (left, right)):
            raise Unknown("is")
        return (left is right) is isinstance(op, ast.Is)
    raise Unknown(type(op).__name__)


def _call(node: ast.Call, env: Mapping[str, object], scope: Scope, depth: int) -> object:
    if is_compiling(node, scope.imports):
        if COMPILING in env:
            return env[COMPILING]
        raise Unknown("is_compiling")
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        raise Unknown("*args")
    func = node.func
    args = [evaluate(a, env, scope, depth) for a in node.args]
    kwargs = {k.arg: evaluate(k.value, env, scope, depth) for k in node.keywords if k.arg is not None}
    if isinstance(func, ast.Attribute) and func.attr in _STR_METHODS and dotted(func.value) != "self":
        owner = evaluate(func.value, env, scope, depth)
        if isinstance(owner, str) and not kwargs and all(isinstance(a, (str, tuple)) for a in args):
            return getattr(owner, func.attr)(*args)
        raise Unknown(func.attr)
    name = dotted(func)
    if name in ("bool", "str") and len(args) == 1 and not kwargs:
        return bool(args[0]) if name == "bool" else str(args[0])
    if name is not None:
        last = name.rpartition(".")[2]
        try:
            if name.startswith("self.") and name.count(".") == 1 and last in scope.methods:
                return _helper(scope.methods[last], args, kwargs, env, scope, depth, skip_self=True)
            if "." not in name and name in scope.functions:
                return _helper(scope.functions[name], args, kwargs, env, scope, depth, skip_self=False)
        except KeyError:
            raise Unknown(name) from None
        helper = _vllm_helper(qualified(func, scope.imports) or "")
        if helper is not None and len(args) == 1:
            if not isinstance(args[0], str):
                raise Unknown(last)
            return helper(args[0])
    raise Unknown(name or "call")


def _vllm_helper(name: str) -> Callable[[str], object] | None:
    """vLLM's helper, by what the name is bound to: a name imported from vLLM."""
    return VLLM_HELPERS.get(name.rpartition(".")[2]) if name.startswith("vllm.") else None


def _helper(
    fn: ast.FunctionDef,
    args: list[object],
    kwargs: dict[str, object],
    env: Mapping[str, object],
    scope: Scope,
    depth: int,
    skip_self: bool,
) -> object:
    """A small function's value: its body is one ``return <expr>`` (after a docstring)."""
    if depth >= _DEPTH:
        raise Unknown("too deep")
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        raise Unknown(fn.name)
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)][1 if skip_self else 0 :]
    if fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or len(args) > len(params):
        raise Unknown(fn.name)
    bound = dict(zip(params, args))
    bound.update(kwargs)
    defaults = fn.args.defaults
    for param, default in zip(params[len(params) - len(defaults) :], defaults):
        bound.setdefault(param, evaluate(default, {}, scope, depth + 1))
    if set(bound) != set(params):
        raise Unknown(fn.name)
    # a method still reads the layer's attributes; a module function only its parameters
    inner: dict[str, object] = {k: v for k, v in env.items() if k.startswith("self.") or k == COMPILING} if skip_self else {}
    inner.update(bound)
    return evaluate(body[0].value, inner, scope, depth + 1)


_INIT_DEPTH = 3  # methods calling methods from __init__: how deep the reading follows


def module_constants(tree: ast.Module, scope: Scope) -> dict[str, object]:
    """Module-level ``NAME = <value>`` whose value reads nothing (``FP8 = ("fp8", ...)``)."""
    env: dict[str, object] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            _assign(stmt.targets[0], stmt.value, env, scope)
    return env


# --- the flag: what __init__ leaves in each attribute, for each cache dtype ----------------


class _Stop(Exception):
    """A ``return`` or ``raise``: this path does not reach the end of the method."""


def attribute_values(
    init: ast.FunctionDef, dtype: str, scope: Scope, base: Mapping[str, object] = {}
) -> dict[str, object]:
    """What each ``self.<attr>`` holds when ``__init__`` returns, with ``self.kv_cache_dtype``
    (and whatever ``__init__`` sets it from) equal to ``dtype``: the attributes whose value is
    the same on every path the reading cannot decide; the others are left out."""
    env: dict[str, object] = dict(base)
    env[_SOURCES] = sources = frozenset(_dtype_sources(init))
    env.update(dict.fromkeys(sources, dtype))
    try:
        _block(init.body, env, scope, 0)
    except _Stop:
        pass
    return {k: v for k, v in env.items() if k.startswith("self.")}


def _dtype_sources(init: ast.FunctionDef) -> set[str]:
    """``self.kv_cache_dtype`` and what it is assigned from: a name, or the locals a name is
    assigned from in turn (``d = cache_config.cache_dtype``; ``self.kv_cache_dtype = d``)."""
    sources = {DTYPE}
    values: dict[str, ast.expr] = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = dotted(node.targets[0])
            if name is not None:
                values.setdefault(name, node.value)
    todo = [DTYPE]
    while todo:
        value = values.get(todo.pop())
        name = dotted(value) if value is not None else None
        if name is not None and name not in sources:
            sources.add(name)
            todo.append(name)
    return sources


def _assign(target: ast.expr, value: ast.expr | None, env: dict[str, object], scope: Scope) -> None:
    name = dotted(target)
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            _assign(element, None, env, scope)
        return
    if name is None or (name.count(".") > 1) or (name.count(".") == 1 and not name.startswith("self.")):
        return  # a subscript or a deeper attribute: no attribute of ours changes
    if name in env.get(_SOURCES, ()):  # type: ignore[operator]
        return  # the cache dtype itself, whatever __init__ reads it from
    try:
        if value is None:
            raise Unknown(name)
        env[name] = evaluate(value, env, scope)
    except (Unknown, TypeError, ValueError, RecursionError, AttributeError):
        env.pop(name, None)


def _forget(node: ast.AST, env: dict[str, object]) -> None:
    """Every name or ``self.`` attribute a statement may bind: no longer known."""
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [sub.target]
        elif isinstance(sub, ast.NamedExpr):
            targets = [sub.target]
        elif isinstance(sub, (ast.With, ast.AsyncWith)):
            targets = [i.optional_vars for i in sub.items if i.optional_vars is not None]
        for target in targets:
            for part in ast.walk(target):
                name = dotted(part) if isinstance(part, (ast.Name, ast.Attribute)) else None
                if name is not None and name != DTYPE:
                    env.pop(name, None)


def _block(body: list[ast.stmt], env: dict[str, object], scope: Scope, depth: int) -> None:
    for stmt in body:
        _statement(stmt, env, scope, depth)


def _statement(stmt: ast.stmt, env: dict[str, object], scope: Scope, depth: int) -> None:
    if isinstance(stmt, ast.Assign):
        if len(stmt.targets) == 1:
            _assign(stmt.targets[0], stmt.value, env, scope)
        else:
            for target in stmt.targets:
                _assign(target, stmt.value, env, scope)
    elif isinstance(stmt, ast.AnnAssign):
        if stmt.value is not None:
            _assign(stmt.target, stmt.value, env, scope)
    elif isinstance(stmt, ast.If):
        try:
            taken = bool(evaluate(stmt.test, env, scope))
        except (Unknown, TypeError, ValueError, RecursionError, AttributeError):
            _either(stmt, env, scope, depth)
            return
        _block(stmt.body if taken else stmt.orelse, env, scope, depth)
    elif isinstance(stmt, (ast.Return, ast.Raise)):
        raise _Stop
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        for item in stmt.items:
            if item.optional_vars is not None:
                _assign(item.optional_vars, None, env, scope)
        _block(stmt.body, env, scope, depth)
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        _self_call(stmt.value, env, scope, depth)
    elif isinstance(stmt, (ast.Pass, ast.Assert, ast.Import, ast.ImportFrom, ast.Expr, ast.Global, ast.Nonlocal)):
        pass
    else:  # loops, try, match, nested defs: what they bind is not known afterwards
        _forget(stmt, env)


def _either(stmt: ast.If, env: dict[str, object], scope: Scope, depth: int) -> None:
    """An ``if`` the reading cannot decide: what both branches leave alike stays known."""
    ends = []
    for body in (stmt.body, stmt.orelse):
        branch = dict(env)
        try:
            _block(body, branch, scope, depth)
        except _Stop:
            continue
        ends.append(branch)
    if not ends:
        raise _Stop
    merged = {k: v for k, v in ends[0].items() if all(k in e and _same(e[k], v) for e in ends[1:])}
    env.clear()
    env.update(merged)


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def _self_call(call: ast.Call, env: dict[str, object], scope: Scope, depth: int) -> None:
    """``self.<method>(…)`` in ``__init__``: its statements run on the same attributes."""
    name = dotted(call.func)
    method = name[5:] if name is not None and name.startswith("self.") and name.count(".") == 1 else None
    fn = scope.methods.get(method) if method is not None and method in scope.methods else None
    if fn is None:
        return  # a call of something else: vLLM's layers do not set this layer's attributes
    inner: dict[str, object] = {k: v for k, v in env.items() if k.startswith("self.")}
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)][1:]
    try:
        if depth >= _INIT_DEPTH or fn.args.vararg or fn.args.kwarg or call.keywords or len(call.args) != len(params):
            raise Unknown(method or "")
        for param, arg in zip(params, call.args):
            inner[param] = evaluate(arg, env, scope)
    except (Unknown, TypeError, ValueError, RecursionError, AttributeError):
        _forget(fn, env)
        return
    try:
        _block(fn.body, inner, scope, depth + 1)
    except _Stop:
        _forget(fn, env)  # the reading does not follow which path returned
        return
    for key in [k for k in env if k.startswith("self.")]:
        if key not in inner:
            del env[key]
    env.update({k: v for k, v in inner.items() if k.startswith("self.")})


def flags(init: ast.FunctionDef, scope: Scope, base: Mapping[str, object] = {}) -> dict[str, bool]:
    """Each attribute ``__init__`` assigns: whether it is a flag - true for every fp8 dtype and
    false for "auto" when ``__init__`` returns, whatever statements decide it."""
    assigned = {
        name[5:]
        for method in (init, *_called_methods(init, scope))
        for node in ast.walk(method)
        for target in _targets(node)
        if (name := dotted(target)) is not None and name.startswith("self.") and name.count(".") == 1
    }
    runs = {d: attribute_values(init, d, scope, base) for d in (*FP8_DTYPES, schema.AUTO_DTYPE)}
    found = {}
    for attr in assigned - {schema.DTYPE_ATTR}:
        key = f"self.{attr}"
        values = [runs[d].get(key, _MISSING) for d in FP8_DTYPES]
        auto = runs[schema.AUTO_DTYPE].get(key, _MISSING)
        known = all(v is not _MISSING for v in (*values, auto))
        found[attr] = known and all(bool(v) for v in values) and not bool(auto)
    return found


_MISSING = object()
_SOURCES = "<dtype sources>"  # env's key for the names that are the cache dtype


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _called_methods(init: ast.FunctionDef, scope: Scope) -> list[ast.FunctionDef]:
    """The methods ``__init__`` calls on ``self`` as statements (one level)."""
    found = []
    for node in ast.walk(init):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            name = dotted(node.value.func)
            if name is not None and name.startswith("self.") and name.count(".") == 1 and name[5:] in scope.methods:
                try:
                    found.append(scope.methods[name[5:]])
                except KeyError:
                    continue
    return found


# --- the guard and the post-call block: truth tables ---------------------------------------


def self_attrs(node: ast.expr) -> set[str]:
    """The ``self.<attr>`` names an expression reads (one level: ``self.a``, not ``self.a.b``)."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            found.add(n.attr)
    return found


@dataclass(frozen=True)
class Guard:
    """What the cache arguments are conditioned on: ``fused_when``, true where the fused op
    gets the caches (``G`` of ``X if G else None``, ``not C`` of ``None if C else X``);
    ``local``: the local it reads (None: inlined); ``value``: what the local holds before
    the call (None: bound nowhere, a lost guard)."""

    fused_when: ast.expr
    local: str | None = None
    value: ast.expr | None = None
    imports: Mapping[str, str] = field(default_factory=dict)  # the file's (``import_table``)

    def atoms(self, flag: str | None) -> tuple[list[str], dict[str, ast.expr]]:
        atoms = [COMPILING] + ([f"self.{flag}"] if flag else [])
        if self.local is not None and self.value is None:
            atoms.append(self.local)
        derived = {self.local: self.value} if self.local is not None and self.value is not None else {}
        return atoms, derived

    def reads(self) -> set[str]:
        """The ``self.`` attributes the guard reads (its value's where it has one)."""
        return self_attrs(self.fused_when) | (self_attrs(self.value) if self.value is not None else set())


def _table(
    expr: ast.expr, atoms: list[str], derived: Mapping[str, ast.expr], imports: Mapping[str, str]
) -> list[bool] | None:
    """``expr``'s truth value for every assignment of ``atoms`` (``COMPILING`` first), in
    ``itertools.product`` order; ``derived``: locals whose value is an expression over the
    atoms. None: not a function of those alone."""
    table = []
    scope = Scope({}, {}, imports)
    for values in itertools.product((False, True), repeat=len(atoms)):
        env: dict[str, object] = dict(zip(atoms, values))
        try:
            for name, value in derived.items():
                env[name] = bool(evaluate(value, env, scope))
            table.append(bool(evaluate(expr, env, scope)))
        except (Unknown, TypeError, ValueError, RecursionError):
            return None
    return table


def _rows(atoms: list[str]) -> list[dict[str, bool]]:
    return [dict(zip(atoms, values)) for values in itertools.product((False, True), repeat=len(atoms))]


def guard_flag(guard: Guard, native: bool) -> str | None:
    """The flag a guard reads, where it is a guard: the fused op writes where ``not F`` or
    ``not compiling and not F`` -> ``"F"``; on a native call also ``not compiling`` -> ``""``
    (in eager the kernel writes fp8 itself). None: not a bypass's guard (or a lost one)."""
    if guard.local is not None and guard.value is None:
        return None
    attrs = guard.reads()
    if len(attrs) > 1:
        return None
    flag = next(iter(attrs), None)
    atoms, derived = guard.atoms(flag)
    table = _table(guard.fused_when, atoms, derived, guard.imports)
    if table is None:
        return None
    rows = _rows(atoms)
    if flag is None:
        return "" if native and table == [not r[COMPILING] for r in rows] else None
    f = f"self.{flag}"
    if table in ([not r[f] for r in rows], [not r[COMPILING] and not r[f] for r in rows]):
        return flag
    return None


@dataclass(frozen=True)
class PostBlock:
    """An ``if`` after the call that runs exactly when the fused op did not write."""

    while_compiling: bool  # it runs while compiling, whatever the flag


def post_block(test: ast.expr, guard: Guard, flag: str | None) -> PostBlock | None:
    """Whether ``test`` is the post-call block's: true exactly where the fused op did not
    write (``not G``, ``G is False``, ``self.F`` where ``G = not self.F``), or where it did
    not or the model is compiling (``torch.compiler.is_compiling() or not G``, either order)."""
    atoms, derived = guard.atoms(flag)
    table = _table(test, atoms, derived, guard.imports)
    fused = _table(guard.fused_when, atoms, derived, guard.imports)
    if table is None or fused is None:
        return None
    compiling = [r[COMPILING] for r in _rows(atoms)]
    if table == [not w for w in fused]:
        return PostBlock(all(t for t, c in zip(table, compiling) if c))
    if table == [c or not w for c, w in zip(compiling, fused)]:
        return PostBlock(True)
    return None
