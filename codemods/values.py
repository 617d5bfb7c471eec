"""What each ``self.`` attribute holds after ``__init__``, for each cache dtype.

``attribute_values`` runs ``__init__``'s statements (and the methods it calls on
``self``) with ``roles.evaluate`` on each dtype, so that a flag is known by the value
it ends up holding, whatever statements decide it (``flags``). Everything here works
on Python's own ``ast`` and imports nothing heavy: the ast pre-filter asks it too.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

from codemods import roles, schema

_DEPTH = 3  # methods calling methods from __init__: how deep the reading follows


def module_constants(tree: ast.Module, scope: roles.Scope) -> dict[str, object]:
    """Module-level ``NAME = <value>`` whose value reads nothing (``FP8 = ("fp8", ...)``)."""
    env: dict[str, object] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            _assign(stmt.targets[0], stmt.value, env, scope)
    return env


# --- what __init__ leaves in each attribute ----------------------------------------------


class _Stop(Exception):
    """A ``return`` or ``raise``: this path does not reach the end of the method."""


def attribute_values(
    init: ast.FunctionDef, dtype: str, scope: roles.Scope, base: Mapping[str, object] = {}
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
    sources = {roles.DTYPE}
    values: dict[str, ast.expr] = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = schema.dotted(node.targets[0])
            if name is not None:
                values.setdefault(name, node.value)
    todo = [roles.DTYPE]
    while todo:
        value = values.get(todo.pop())
        name = schema.dotted(value) if value is not None else None
        if name is not None and name not in sources:
            sources.add(name)
            todo.append(name)
    return sources


def _assign(target: ast.expr, value: ast.expr | None, env: dict[str, object], scope: roles.Scope) -> None:
    name = schema.dotted(target)
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
            raise roles.Unknown(name)
        env[name] = roles.evaluate(value, env, scope)
    except (roles.Unknown, TypeError, ValueError, RecursionError, AttributeError):
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
                name = schema.dotted(part) if isinstance(part, (ast.Name, ast.Attribute)) else None
                if name is not None and name != roles.DTYPE:
                    env.pop(name, None)


def _block(body: list[ast.stmt], env: dict[str, object], scope: roles.Scope, depth: int) -> None:
    for stmt in body:
        _statement(stmt, env, scope, depth)


def _statement(stmt: ast.stmt, env: dict[str, object], scope: roles.Scope, depth: int) -> None:
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
            taken = bool(roles.evaluate(stmt.test, env, scope))
        except (roles.Unknown, TypeError, ValueError, RecursionError, AttributeError):
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


def _either(stmt: ast.If, env: dict[str, object], scope: roles.Scope, depth: int) -> None:
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


def _self_call(call: ast.Call, env: dict[str, object], scope: roles.Scope, depth: int) -> None:
    """``self.<method>(…)`` in ``__init__``: its statements run on the same attributes."""
    name = schema.dotted(call.func)
    method = name[5:] if name is not None and name.startswith("self.") and name.count(".") == 1 else None
    fn = scope.methods.get(method) if method is not None and method in scope.methods else None
    if fn is None:
        return  # a call of something else: vLLM's layers do not set this layer's attributes
    inner: dict[str, object] = {k: v for k, v in env.items() if k.startswith("self.")}
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)][1:]
    try:
        if depth >= _DEPTH or fn.args.vararg or fn.args.kwarg or call.keywords or len(call.args) != len(params):
            raise roles.Unknown(method or "")
        for param, arg in zip(params, call.args):
            inner[param] = roles.evaluate(arg, env, scope)
    except (roles.Unknown, TypeError, ValueError, RecursionError, AttributeError):
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


def flags(init: ast.FunctionDef, scope: roles.Scope, base: Mapping[str, object] = {}) -> dict[str, bool]:
    """Each attribute ``__init__`` assigns: whether it is a flag - true for every fp8 dtype and
    false for "auto" when ``__init__`` returns, whatever statements decide it."""
    assigned = {
        name[5:]
        for node in ast.walk(init)
        for target in _targets(node)
        if (name := schema.dotted(target)) is not None and name.startswith("self.") and name.count(".") == 1
    }
    assigned |= {
        name[5:]
        for method in _called_methods(init, scope)
        for node in ast.walk(method)
        for target in _targets(node)
        if (name := schema.dotted(target)) is not None and name.startswith("self.") and name.count(".") == 1
    }
    runs = {d: attribute_values(init, d, scope, base) for d in (*roles.FP8_DTYPES, schema.AUTO_DTYPE)}
    found = {}
    for attr in assigned - {schema.DTYPE_ATTR}:
        key = f"self.{attr}"
        values = [runs[d].get(key, _MISSING) for d in roles.FP8_DTYPES]
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


def _called_methods(init: ast.FunctionDef, scope: roles.Scope) -> list[ast.FunctionDef]:
    """The methods ``__init__`` calls on ``self`` as statements (one level)."""
    found = []
    for node in ast.walk(init):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            name = schema.dotted(node.value.func)
            if name is not None and name.startswith("self.") and name.count(".") == 1 and name[5:] in scope.methods:
                try:
                    found.append(scope.methods[name[5:]])
                except KeyError:
                    continue
    return found
