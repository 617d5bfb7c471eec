"""The roles of a bypass, proven from what its expressions do, never from how they are spelled (on ``ast``).

The *flag* is a ``self.<attr>`` that ``__init__`` leaves true for every fp8 dtype and false for "bfloat16"
and "auto" (``flags`` runs ``__init__`` on each dtype, reading with ``evaluate``); the *guard* (``not flag``
on the cache arguments) and the *post-call block* (run when it is false) are truth tables of ``evaluate``."""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from codemods import schema
from codemods.names import callee, dotted, is_compiling, lineage, literal, qualified, self_member

FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
# The dtypes a flag is false for: vLLM's other KV-cache dtype for MiniMax-M3 ("bfloat16") and "auto".
NOT_FP8 = ("bfloat16", schema.AUTO_DTYPE)
DTYPE = f"self.{schema.DTYPE_ATTR}"
COMPILING = "<compiling>"  # the truth tables' name for torch.compiler.is_compiling()
# vLLM's helper (wherever a release keeps it): true for every quantized cache dtype (0.24.0's test).
VLLM_HELPERS = {"is_quantized_kv_cache": lambda dtype: dtype.startswith("fp8") or dtype.endswith("per_token_head")}
_METHODS = {str: {"startswith", "endswith", "lower", "upper", "strip", "casefold", "replace", "partition"}, dict: {"get"}}
_BUILTINS = {"bool": bool, "str": str, "any": any, "all": all, "frozenset": frozenset, "set": frozenset, "tuple": tuple}
DEPTH = 3  # how deep the reading follows helpers calling helpers (or methods __init__ calls)
_MISSING = object()
_STEPPED_OVER = (ast.Pass, ast.Assert, ast.Import, ast.ImportFrom, ast.Expr, ast.Global, ast.Nonlocal)  # bind nothing read
_SOURCES = "<dtype sources>"  # env's key for the names that are the cache dtype (to that dtype)
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


class _Present:
    """An object the reading knows is there (not None), and nothing else of: ``cache_config`` where the dtype is read."""

    def __repr__(self) -> str:
        return "<present>"


PRESENT = _Present()


class Unknown(Exception):
    """The expression holds something the reading cannot evaluate."""


# What evaluating raises: Unknown, or Python's own error on the values the reading holds.
EVAL_ERRORS = (Unknown, TypeError, ValueError, RecursionError, AttributeError, LookupError)


@dataclass(frozen=True)
class Scope:
    """What an expression's calls can reach: module functions, class methods (``ast`` defs by name), what
    imports bind (``import_table``); ``compiling``: locals bound once to ``torch.compiler.is_compiling()``."""

    functions: Mapping[str, ast.FunctionDef]
    methods: Mapping[str, ast.FunctionDef]
    imports: Mapping[str, str] = field(default_factory=dict)
    compiling: frozenset[str] = frozenset()

    def properties(self) -> list[str]:
        """The class's ``@property`` defs: a flag may be one (``return "fp8" in self.kv_cache_dtype``)."""
        return [name for name, fn in self.methods.items() if "property" in map(dotted, fn.decorator_list)]


NO_SCOPE = Scope({}, {})


def evaluate(node: ast.expr, env: Mapping[str, object], scope: Scope = NO_SCOPE, depth: int = 0) -> object:
    """``node``'s value, ``env`` giving names, ``self.`` attributes (dotted), ``COMPILING``; else Unknown."""

    def ev(n: ast.expr) -> object:
        return evaluate(n, env, scope, depth)

    if isinstance(node, ast.Constant):
        return node.value
    if (name := dotted(node)) is not None:  # a name, or an attribute of one
        if name in env or name in scope.compiling and COMPILING in env:
            return env[name if name in env else COMPILING]
        raise Unknown(name)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = tuple(ev(e) for e in node.elts)
        return frozenset(items) if isinstance(node, ast.Set) else items
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
    if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp)) and len(node.generators) == 1:
        loop, items = node.generators[0], ev(node.generators[0].iter)  # (every item read: a tuple)
        if not isinstance(items, (tuple, str, frozenset)) or loop.is_async:
            raise Unknown("comprehension")
        out = []
        for item in _in_order(items):
            _store(loop.target, item, inner := dict(env))  # type: ignore[arg-type]
            if all(evaluate(test, inner, scope, depth) for test in loop.ifs):
                out.append(evaluate(node.elt, inner, scope, depth))
        return frozenset(out) if isinstance(node, ast.SetComp) else tuple(out)
    if isinstance(node, ast.NamedExpr) and isinstance(env, dict):  # `(q := …)` binds q, as Python does
        value = ev(node.value)
        _store(node.target, value, env)
        return value
    if isinstance(node, ast.Compare):
        left = ev(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = ev(right_node)
            if not _compare(op, left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Dict) and None not in node.keys:  # a table (`{"fp8": True, …}`)
        return dict(zip(map(ev, node.keys), map(ev, node.values)))  # type: ignore[arg-type]
    if isinstance(node, ast.Slice):  # a subscript's
        return slice(*(ev(x) if x is not None else None for x in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Subscript):  # of a tuple, string or table the reading holds (a missing key: unknown)
        value, key = ev(node.value), ev(node.slice)
        if not isinstance(value, (tuple, str, dict)):
            raise Unknown("subscript")
        return value[key]  # type: ignore[index]
    if isinstance(node, ast.Call):
        return _call(node, env, scope, depth)
    raise Unknown(type(node).__name__)


def _in_order(items: object) -> list:
    """A set's items in one order on every run (Python's own depends on string hashing); else as they are."""
    return sorted(items, key=repr) if isinstance(items, frozenset) else list(items)  # type: ignore[call-overload]


def _compare(op: ast.cmpop, left: object, right: object) -> bool:
    if isinstance(op, (ast.Is, ast.IsNot)) and all(v is None or isinstance(v, bool) or v is PRESENT for v in (left, right)):
        if left is right is PRESENT:
            raise Unknown("is")  # (two objects known to be there: the same one or not)
        return (left is right) is isinstance(op, ast.Is)  # `G is False`: only on bools and None, where it is ==
    if any(v is PRESENT for v in (left, right)):
        raise Unknown("present")  # (``x is None`` alone is known of it)
    if isinstance(op, (ast.In, ast.NotIn)):
        if not isinstance(right, (str, tuple, dict, frozenset)) or (isinstance(right, str) and not isinstance(left, str)):
            raise Unknown("in")
        return (left in right) is isinstance(op, ast.In)
    if isinstance(op, (ast.Eq, ast.NotEq)):
        return (left == right) is isinstance(op, ast.Eq)
    raise Unknown(type(op).__name__)


def _call(node: ast.Call, env: Mapping[str, object], scope: Scope, depth: int) -> object:
    if is_compiling(node, scope.imports):
        if COMPILING in env:
            return env[COMPILING]
        raise Unknown("is_compiling")
    func = node.func
    if dotted(func) == "getattr" and len(node.args) in (2, 3) and not node.keywords and (attr := literal(node.args[1])):
        return evaluate(ast.Attribute(node.args[0], attr, ast.Load()), env, scope, depth)  # (the default: unknown)
    args, kwargs = _arguments(node, env, scope, depth)
    if isinstance(func, ast.Attribute) and func.attr in _METHODS[str] | _METHODS[dict] and dotted(func.value) != "self":
        owner = evaluate(func.value, env, scope, depth)  # a string's method, or a table's `get`
        if func.attr in _METHODS.get(type(owner), ()) and not kwargs and all(isinstance(a, (str, tuple, bool)) for a in args):
            return getattr(owner, func.attr)(*args)
        raise Unknown(func.attr)
    name = dotted(func)
    if name in _BUILTINS and len(args) == 1 and not kwargs and (name in ("bool", "str") or isinstance(args[0], (tuple, frozenset))):
        return _BUILTINS[name](args[0])  # (any, all: of a comprehension the reading evaluated)
    if name is not None:
        method = self_member(func)  # a method of the class, else a module function
        defs, key = (scope.methods, method) if method is not None else (scope.functions, name)
        if "." not in key and key in defs:
            return _helper(defs[key], node, (args, kwargs), env, scope, depth)
        # vLLM's helper, by what the name is bound to: a name imported from vLLM
        bound = qualified(func, scope.imports) or ""
        helper = VLLM_HELPERS.get(bound.rpartition(".")[2]) if bound.startswith("vllm.") else None
        if helper is not None and len(args) == 1 and isinstance(args[0], str):
            return helper(args[0])
    raise Unknown(name or "call")


def _arguments(call: ast.Call, env: Mapping[str, object], scope: Scope, depth: int) -> tuple[list, dict]:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise Unknown("*args")
    kwargs = {k.arg: evaluate(k.value, env, scope, depth) for k in call.keywords}
    return [evaluate(a, env, scope, depth) for a in call.args], kwargs


def _bind(fn: ast.FunctionDef, call: ast.Call, passed: tuple[list, dict], scope: Scope, depth: int) -> dict:
    """``fn``'s parameters (but a non-static method's ``self``) bound to ``call``'s argument values
    (``passed``), defaults read; ``Unknown`` past ``DEPTH`` or for ``*args``, ``**kwargs``, keyword-only."""
    args, kwargs = passed
    skip = self_member(call.func) is not None and "staticmethod" not in map(dotted, fn.decorator_list)
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)][skip:]
    if depth >= DEPTH or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or len(args) > len(params):
        raise Unknown(fn.name)
    bound = {**dict(zip(params, args)), **kwargs}
    for param, default in zip(params[len(params) - len(fn.args.defaults) :], fn.args.defaults):
        bound.setdefault(param, evaluate(default, {}, scope, depth + 1))
    if set(bound) != set(params):
        raise Unknown(fn.name)
    return bound


def _helper(
    fn: ast.FunctionDef, call: ast.Call, passed: tuple[list, dict], env: Mapping[str, object], scope: Scope, depth: int
) -> object:
    """A small function's value: its body is one ``return <expr>`` (after a docstring)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        raise Unknown(fn.name)
    # a method still reads the layer's attributes; a module function only its parameters (and whether compiling)
    inner = {k: v for k, v in env.items() if k == COMPILING or (self_member(call.func) and k.startswith("self."))}
    return evaluate(body[0].value, {**inner, **_bind(fn, call, passed, scope, depth)}, scope, depth + 1)


def module_constants(tree: ast.Module, scope: Scope, cls: ast.ClassDef | None = None) -> dict[str, object]:
    """``NAME = <value>`` (or ``NAME: T = <value>``) at the module's top level that reads nothing (``FP8 =
    ("fp8", ...)``); with ``cls``, in its lineage's bodies, as ``self.NAME``: read until ``__init__`` sets it."""
    env: dict[str, object] = {}
    for stmt in [s for c in reversed(lineage(cls, tree)) for s in c.body] if cls else tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and len(targets) == 1 and isinstance(targets[0], ast.Name):
            _assign(targets[0], stmt.value, env, scope)
    return {("self." if cls else "") + k: v for k, v in env.items()}


# --- the flag: what __init__ leaves in each attribute, for each cache dtype ----------------


class _Stop(Exception):
    """A ``return`` or ``raise``: this path does not reach the end of the method."""


def _dtype_sources(init: ast.FunctionDef, scope: Scope) -> tuple[set[str], bool, set[str]]:
    """``self.kv_cache_dtype`` and the chain of names it is assigned from (``d = cache_config.cache_dtype``),
    each set by one statement on a path of __init__ or a method it calls (two: which is the dtype's is not
    known); whether __init__ sets it (the dtype from there); the objects the chain reads that are there."""
    body = [*init.body, *(s for fn in init_methods(init, scope)[1:] for s in fn.body)]
    assigns = [n for n in ast.walk(init) if isinstance(n, ast.Assign) and len(n.targets) == 1]
    values = {name: n.value for n in reversed(assigns) if (name := dotted(n.targets[0]))}  # (the first)
    sources, present, name = set(), set(), DTYPE
    while name is not None and name not in sources and _stores_on_a_path(body, name) <= 1:
        sources.add(name)
        name, root = _source(values[name]) if name in values else (None, None)
        if root is not None and _stores_on_a_path(body, root):
            name = None  # the object rebound: what it holds is another question
        present |= {root} - {None}
    return sources, _stores_on_a_path(body, DTYPE) > 0, present  # type: ignore[return-value]


def _source(value: ast.expr) -> tuple[str | None, str | None]:
    """What a dtype is assigned from: ``d`` of ``= d``; ``X.a`` of ``= X.a if X is not None else "auto"`` (``X``, ``not
    X``, ``X is None`` too, either way round), with ``X``: there wherever the dtype is read from it."""
    if not isinstance(value, ast.IfExp):
        return dotted(value), None
    test, there = value.test, True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, there = test.operand, False
    if isinstance(test, ast.Compare) and [type(o) for o in test.ops] in ([ast.Is], [ast.IsNot]):
        nothing = isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
        test, there = (test.left, there == isinstance(test.ops[0], ast.IsNot)) if nothing else (test, there)
    read, default = (value.body, value.orelse) if there else (value.orelse, value.body)
    name, root = dotted(read), dotted(test)
    if name is None or root is None or "." in root or not name.startswith(root + ".") or literal(default) is None:
        return None, None
    return name, root


def _stores_on_a_path(body: list[ast.stmt], name: str) -> int:
    """How often one path through ``body`` may store ``name`` (an ``if``'s branches are two paths)."""
    def stores(node: ast.AST) -> int:
        return sum(dotted(n) == name for n in ast.walk(node) if isinstance(getattr(n, "ctx", None), ast.Store))

    return sum(
        stores(s.test) + max(_stores_on_a_path(s.body, name), _stores_on_a_path(s.orelse, name))
        if isinstance(s, ast.If) else stores(s)
        for s in body
    )


def _assign(target: ast.expr, value: ast.expr | None, env: dict[str, object], scope: Scope) -> None:
    try:  # (the whole value first, as Python does)
        _store(target, _MISSING if value is None else evaluate(value, env, scope), env)
    except EVAL_ERRORS:
        _store(target, _MISSING, env)


def _store(target: ast.expr, value: object, env: dict[str, object]) -> None:
    """``target`` holds ``value`` now (``_MISSING``: not known); a tuple of targets takes a tuple of as many
    values item by item (``self.F, self.x = "fp8" in d, 1``)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        fits = isinstance(value, tuple) and len(value) == len(target.elts)
        fits = fits and not any(isinstance(e, ast.Starred) for e in target.elts)
        for i, element in enumerate(target.elts):
            _store(element, value[i] if fits else _MISSING, env)  # type: ignore[index]
        return
    name = dotted(target)
    if name is None or ("." in name and self_member(target) is None):
        return  # a subscript or a deeper attribute: no attribute of ours changes
    if name in env.get(_SOURCES, ()):  # type: ignore[operator]
        value = env[_SOURCES][name]  # type: ignore[index]  # the cache dtype itself, whatever it is read from
    if value is _MISSING:
        env.pop(name, None)
    else:
        env[name] = value


def _forget(node: ast.AST, env: dict[str, object], scope: Scope) -> None:
    """Every name or ``self.`` attribute a statement may bind, itself or in methods it calls: not known."""
    todo, seen = [node], set()
    while todo:
        for sub in ast.walk(todo.pop()):
            method = self_member(sub.func) if isinstance(sub, ast.Call) else None
            if method in scope.methods and method not in seen:
                seen.add(method)
                todo.append(scope.methods[method])
            # bound or deleted, whatever binds it (an assignment, a loop, `with … as`, `:=`, `del`)
            if isinstance(getattr(sub, "ctx", None), (ast.Store, ast.Del)):
                _store(sub, _MISSING, env)  # type: ignore[arg-type]  # (the cache dtype: itself from here on)


def _block(body: list[ast.stmt], env: dict[str, object], scope: Scope, depth: int) -> None:
    for stmt in body:
        _statement(stmt, env, scope, depth)


def _statement(stmt: ast.stmt, env: dict[str, object], scope: Scope, depth: int) -> None:
    named = set_by_name(stmt, scope.imports)
    for key in named if named is not None else [k for k in env if k.startswith("self.")]:
        if key not in env.get(_SOURCES, ()):  # type: ignore[operator]  # the cache dtype stays itself
            env.pop(key, None)  # set by name: no longer known
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):  # (`self.x: T` alone binds nothing)
        for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]) if stmt.value is not None else ():
            _assign(target, stmt.value, env, scope)
    elif isinstance(stmt, ast.AugAssign):  # `self.F |= <test>`: the target read, then stored
        _assign(stmt.target, ast.BinOp(stmt.target, stmt.op, stmt.value), env, scope)
    elif isinstance(stmt, ast.If):
        try:
            taken = bool(evaluate(stmt.test, env, scope))
        except EVAL_ERRORS:
            _either(stmt, env, scope, depth)
        else:
            _block(stmt.body if taken else stmt.orelse, env, scope, depth)
    elif isinstance(stmt, (ast.Return, ast.Raise)):
        raise _Stop
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        for target in [i.optional_vars for i in stmt.items if i.optional_vars is not None]:
            _assign(target, None, env, scope)
        _block(stmt.body, env, scope, depth)
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        _self_call(stmt.value, env, scope, depth)
    elif isinstance(stmt, ast.Try) and (not stmt.handlers or _raises_nothing(stmt.body, env, scope)):
        try:  # no handler runs
            _block([*stmt.body, *stmt.orelse], env, scope, depth)
        finally:
            _block(stmt.finalbody, env, scope, depth)
    elif isinstance(stmt, (ast.For, ast.While, ast.Match)):
        _unrolled(stmt, env, scope, depth)
    elif not isinstance(stmt, _STEPPED_OVER):
        _forget(stmt, env, scope)  # a try that may raise, nested defs: what they bind is not known


def _raises_nothing(body: list[ast.stmt], env: dict[str, object], scope: Scope) -> bool:
    """A ``try`` body of assignments to names and ``self.x`` of values the reading evaluates: no handler runs."""
    trial = dict(env)
    for stmt in body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) or stmt.value is None:
            return False
        _statement(stmt, trial, scope, 0)  # a value it cannot read, or a target but a name or self.x, may raise
        if any(not (isinstance(t, ast.Name) or self_member(t)) or dotted(t) not in trial for t in targets):  # type: ignore[arg-type]
            return False
    return True


def _unrolled(stmt: ast.For | ast.While | ast.Match, env: dict[str, object], scope: Scope, depth: int) -> None:
    """A ``for`` over a known tuple or string, or a ``while`` whose test it reads (no ``break``/``continue``;
    16 rounds at most), round by round; a ``match`` on literals, the case that matches. Else forgotten."""
    before = dict(env)
    try:
        if isinstance(stmt, ast.Match):
            subject = evaluate(stmt.subject, env, scope)
            case = next((c for c in stmt.cases if _matches(c, subject, env, scope)), None)
            _block(case.body if case is not None else [], env, scope, depth)
            return
        jumps = any(isinstance(n, (ast.Break, ast.Continue)) for n in ast.walk(stmt))
        items = evaluate(stmt.iter, env, scope) if isinstance(stmt, ast.For) else range(16)
        if jumps or not isinstance(items, (tuple, str, range, frozenset)):
            raise Unknown("loop")
        for item in _in_order(items):
            if isinstance(stmt, ast.For):
                _store(stmt.target, item, env)
            elif not evaluate(stmt.test, env, scope):
                break
            _block(stmt.body, env, scope, depth)
        if isinstance(stmt, ast.While) and evaluate(stmt.test, env, scope):
            raise Unknown("while")  # still running after 16 rounds
        _block(stmt.orelse, env, scope, depth)
    except EVAL_ERRORS:
        env.clear()
        env.update(before)
        _forget(stmt, env, scope)


def _matches(case: ast.match_case, subject: object, env: dict[str, object], scope: Scope) -> bool:
    pattern = case.pattern
    if case.guard is None and isinstance(pattern, ast.MatchAs) and pattern.pattern is pattern.name is None:
        return True  # case _
    patterns = pattern.patterns if isinstance(pattern, ast.MatchOr) else [pattern]
    if case.guard is not None or not all(isinstance(p, ast.MatchValue) for p in patterns):
        raise Unknown("pattern")
    return any(evaluate(p.value, env, scope) == subject for p in patterns)  # type: ignore[attr-defined]


# Builtins that read an object they are handed, never set its attributes.
_READERS = set("isinstance issubclass hasattr id type print repr str len hash callable super".split())
_SETTERS = ("setattr", "__setattr__", "delattr", "__delattr__")


def set_by_name(node: ast.AST, imports: Mapping[str, str]) -> set[str] | None:
    """The attributes of ``self`` that ``node`` sets (or deletes) by name (``setattr(self, "x", v)``,
    ``object.__setattr__(self, …)``, ``self.__setattr__("x", v)``) as ``self.x``. None: any of them (a name
    not a literal, ``self.__dict__``, ``exec``/``eval``, ``self`` handed where it cannot be followed: another
    name, a lambda, ``vars``, a function of this file; not: ``ctx[k] = self``, an imported function)."""
    found: set[str] = set()
    handed: set[int] = set()  # the places ``self`` itself may stand
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute):
            if sub.attr == "__dict__" and dotted(sub.value) == "self":
                return None
            handed.add(id(sub.value))
        elif isinstance(sub, ast.Assign) and all(isinstance(t, ast.Subscript) for t in sub.targets):
            handed.add(id(sub.value))
        elif isinstance(sub, ast.Call):
            name = sub.func.id if isinstance(sub.func, ast.Name) else None
            if name in ("exec", "eval"):
                return None
            func, setter = sub.func, callee(sub) in _SETTERS
            on_self = isinstance(func, ast.Attribute) and (dotted(func.value) == "self" or isinstance(func.value, ast.Call))
            at = next((i + 1 for i, arg in enumerate(sub.args) if dotted(arg) == "self"), 0 if on_self else None)
            if setter and at is not None:  # (else another object's attribute)
                attr = literal(sub.args[at]) if at < len(sub.args) else None
                if attr is None:
                    return None
                found.add(f"self.{attr}")
            trusted = setter or isinstance(func, ast.Attribute) or name in imports or name in _READERS
            if name == "getattr":
                attr = literal(sub.args[1]) if len(sub.args) > 1 else None
                trusted = attr is not None and not attr.startswith("__")
            if trusted:
                handed.update(id(arg) for arg in (*sub.args, *(k.value for k in sub.keywords)))
    loads = (sub for sub in ast.walk(node) if dotted(sub) == "self" and isinstance(sub.ctx, ast.Load))  # type: ignore[attr-defined]
    return None if any(id(sub) not in handed for sub in loads) else found


def _either(stmt: ast.If, env: dict[str, object], scope: Scope, depth: int) -> None:
    """An ``if`` the reading cannot decide: what both branches leave alike stays known."""
    ends = []
    for body in (stmt.body, stmt.orelse):
        branch = dict(env)
        with contextlib.suppress(_Stop):
            _block(body, branch, scope, depth)
            ends.append(branch)
    if not ends:
        raise _Stop
    alike = {k: v for k, v in ends[0].items() if all(k in e and type(e[k]) is type(v) and e[k] == v for e in ends[1:])}
    env.clear()  # (each end a copy) what is alike: equal, and of one type (True is not 1)
    env.update(alike)


def _self_call(call: ast.Call, env: dict[str, object], scope: Scope, depth: int) -> None:
    """``self.<method>(…)`` in ``__init__``: its statements run on the same attributes."""
    fn = scope.methods.get(self_member(call.func) or "")
    if fn is None:
        return  # a call of something else: vLLM's layers do not set this layer's attributes
    try:
        passed = _arguments(call, env, scope, depth)
        inner = {k: v for k, v in env.items() if k.startswith("self.")} | _bind(fn, call, passed, scope, depth)
        _block(fn.body, inner, scope, depth + 1)
    except (_Stop, *EVAL_ERRORS):  # (_Stop: the reading does not follow which path returned)
        _forget(fn, env, scope)
        return
    for key in [k for k in env if k.startswith("self.") and k not in inner]:
        del env[key]
    env.update({k: v for k, v in inner.items() if k.startswith("self.")})


def init_values(init: ast.FunctionDef, scope: Scope, base: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """What each ``self.<attr>`` holds when ``__init__`` returns (``base``: before), for each fp8 dtype,
    "bfloat16" and "auto" as the cache dtype, where every path the reading cannot decide agrees."""
    # what a def nested in __init__ (or in a method it calls) stores through ``self``: whenever it is called
    nested = [d for fn in init_methods(init, scope) for d in ast.walk(fn) if d is not fn and isinstance(d, _NESTED)]
    late = {f"self.{attr}" for d in nested for attr in stored(d)}
    sources, set_here, present = _dtype_sources(init, scope)
    pinned, values = sources - {DTYPE} if set_here else sources, {}  # (the attribute: where __init__ sets it)
    props = {name: ast.Call(ast.parse(f"self.{name}", mode="eval").body, [], []) for name in scope.properties()}
    for dtype in (*FP8_DTYPES, *NOT_FP8):
        env = {**base, _SOURCES: dict.fromkeys(sources, dtype), **dict.fromkeys(pinned, dtype), **dict.fromkeys(present, PRESENT)}
        with contextlib.suppress(_Stop):
            _block(init.body, env, scope, 0)
        for name, call in props.items():  # what a property gives once __init__ has run
            with contextlib.suppress(*EVAL_ERRORS):
                env[f"self.{name}"] = _helper(scope.methods[name], call, ([], {}), env, scope, 0)
        values[dtype] = {k: v for k, v in env.items() if k.startswith("self.") and k not in late}
    return values


def flags(init: ast.FunctionDef, scope: Scope, values: Mapping[str, Mapping[str, object]]) -> dict[str, bool]:
    """Each attribute ``__init__`` assigns (or property): whether it is a flag - true for every fp8 dtype and
    false for "bfloat16" and "auto" once ``__init__`` has run (``values``: ``init_values``)."""
    assigned = set().union(*map(stored, init_methods(init, scope)), scope.properties()) - {schema.DTYPE_ATTR}
    held = {attr: {d: run.get(f"self.{attr}", _MISSING) for d, run in values.items()} for attr in assigned}
    return {
        attr: _MISSING not in runs.values() and all(runs[d] for d in FP8_DTYPES) and not any(runs[d] for d in NOT_FP8)
        for attr, runs in held.items()
    }


def carries_dtype(node: ast.expr, scope: Scope, values: Mapping[str, Mapping[str, object]]) -> bool:
    """A native call's ``kv_cache_dtype`` argument holds the cache dtype once ``__init__`` has run
    (``values``): for each dtype, that dtype (or "fp8" for "fp8_e4m3": one to vLLM's kernels)."""
    kernel = {"fp8_e4m3": "fp8"}.get
    try:  # (each env a copy: a `:=` in it binds nothing here)
        found = {dtype: evaluate(node, dict(env), scope) for dtype, env in values.items()}
        return all(kernel(v, v) == kernel(d, d) for d, v in found.items())  # type: ignore[call-overload]
    except EVAL_ERRORS:
        return False


def init_methods(init: ast.FunctionDef, scope: Scope) -> list[ast.FunctionDef]:
    """``__init__`` and the methods it calls as statements (``self.m(…)``): what ``_self_call`` follows."""
    calls = (n.value for n in ast.walk(init) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call))
    return [init, *{scope.methods[m]: 0 for call in calls if (m := self_member(call.func)) in scope.methods}]


def stored(node: ast.AST) -> set[str]:
    """The ``self.`` attributes ``node``'s code binds, whatever binds them (``x`` of ``self.x``)."""
    stores = (n for n in ast.walk(node) if isinstance(getattr(n, "ctx", None), ast.Store))
    return {attr for n in stores if (attr := self_member(n)) is not None}
