"""The roles of a bypass, proven from what its expressions do, never from how they are spelled.

A fork may name every piece differently and write every condition another way round. The *flag*
is a ``self.<attr>`` that ``__init__`` leaves true for every fp8 dtype and false for "auto"
(``reading.flags`` runs ``__init__`` on each dtype, reading with ``evaluate``); the *guard* conditions the
cache arguments on ``not flag`` and the *post-call block* runs when the guard is false, read as
truth tables over ``evaluate`` (``codemods.guards``). All on Python's own ``ast``.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field

from codemods import schema

FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
DTYPE = f"self.{schema.DTYPE_ATTR}"
COMPILING = "<compiling>"  # the truth tables' name for torch.compiler.is_compiling()
# vLLM's helper (in whichever vLLM module a release keeps it): true for every quantized
# cache dtype (``kv_cache_dtype != "auto"``).
VLLM_HELPERS = {"is_quantized_kv_cache": lambda dtype: dtype != schema.AUTO_DTYPE}
_STR_METHODS = {"startswith", "endswith", "lower", "upper", "strip", "casefold"}
DEPTH = 3  # how deep the reading follows helpers calling helpers (or methods __init__ calls)


# --- Python's own tree: names and expressions (parser-free) --------------------------------


def dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def self_member(node: ast.AST) -> str | None:
    """``x`` of ``self.x`` (not of ``self.x.y``)."""
    name = dotted(node)  # type: ignore[arg-type]
    return name[5:] if name is not None and name.startswith("self.") and name.count(".") == 1 else None


def callee(call: ast.Call) -> str | None:
    """``f`` of ``f(…)`` and of ``x.f(…)``."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def passes_slots(node: ast.AST, slots: list[ast.expr]) -> bool:
    """A call handed every one of ``slots``, a call's slot mappings (``self.<write>(…, slots,
    index_slots)``): what the fused op would write by, compared as Python's own trees."""
    if not isinstance(node, ast.Call):
        return False
    args = {ast.dump(a) for a in (*node.args, *(k.value for k in node.keywords))}
    return all(ast.dump(s) in args for s in slots)


def is_scale_value(node: ast.expr | None) -> bool:
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
    if not isinstance(node, ast.Call) or node.args or node.keywords:
        return False
    return qualified(node.func, imports) in COMPILE_TESTS


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
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitOr, ast.BitAnd)):  # on bools only
        left, right = ev(node.left), ev(node.right)
        if not (isinstance(left, bool) and isinstance(right, bool)):
            raise Unknown("binop")
        return left | right if isinstance(node.op, ast.BitOr) else left & right
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
        method = self_member(func)  # a method of the class, else a module function
        defs, key = (scope.methods, method) if method is not None else (scope.functions, name)
        if "." not in key and key in defs:
            try:
                return _helper(defs[key], args, kwargs, env, scope, depth, skip_self=method is not None)
            except KeyError:
                raise Unknown(name) from None
        # vLLM's helper, by what the name is bound to: a name imported from vLLM
        bound = qualified(func, scope.imports) or ""
        helper = VLLM_HELPERS.get(bound.rpartition(".")[2]) if bound.startswith("vllm.") else None
        if helper is not None and len(args) == 1:
            if not isinstance(args[0], str):
                raise Unknown(name.rpartition(".")[2])
            return helper(args[0])
    raise Unknown(name or "call")


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
    if depth >= DEPTH:
        raise Unknown("too deep")
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        raise Unknown(fn.name)
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)][1 if skip_self else 0 :]
    if fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or len(args) > len(params):
        raise Unknown(fn.name)
    bound = {**dict(zip(params, args)), **kwargs}
    defaults = fn.args.defaults
    for param, default in zip(params[len(params) - len(defaults) :], defaults):
        bound.setdefault(param, evaluate(default, {}, scope, depth + 1))
    if set(bound) != set(params):
        raise Unknown(fn.name)
    # a method still reads the layer's attributes; a module function only its parameters
    inner = {k: v for k, v in env.items() if skip_self and (k.startswith("self.") or k == COMPILING)}
    return evaluate(body[0].value, {**inner, **bound}, scope, depth + 1)


# --- the guard and the post-call block: truth tables ---------------------------------------


def self_attrs(node: ast.expr) -> set[str]:
    """The ``self.<attr>`` names an expression reads (one level: ``self.a``, not ``self.a.b``)."""
    return {attr for n in ast.walk(node) if (attr := self_member(n)) is not None}
