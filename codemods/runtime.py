"""What runs when vLLM runs the layer, whatever the cache dtype (``check`` answers only for one that runs):
the names ``__init__`` and the call's method read as bound at run time, the method as its decorators leave it,
whether the call runs with an fp8 cache; read here: ``verify``'s stand-in runs no module code or decorator."""

from __future__ import annotations

import ast
import builtins
import functools
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from codemods import guards, names, roles, schema

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)
_EXITS = (ast.Return, ast.Raise)
_BLOCKS = ("body", "orelse", "finalbody", "handlers")


# What Python binds in every module: its builtins, ``__name__`` and the like, and a method's ``__class__``.
PYTHON_NAMES = frozenset(dir(builtins)) | frozenset(vars(types.ModuleType("m"))) | {"__file__", "__builtins__", "__path__", "__class__"}


def _type_checking(stmt: ast.AST) -> list[ast.stmt]:
    """The body of ``if TYPE_CHECKING:`` (``typing.TYPE_CHECKING``): what a type checker reads and Python never runs."""
    test = stmt.test if isinstance(stmt, ast.If) else None
    return stmt.body if test is not None and (names.dotted(test) or "").rpartition(".")[2] == "TYPE_CHECKING" else []  # type: ignore[attr-defined]


def _rebound(tree: ast.Module) -> dict[str, ast.stmt]:
    """The names a statement of the module's own binds as an import, a def or a class, and a later one of its
    own binds again or deletes (``ops = None``, ``del ops``): by name, that statement."""
    defined: set[str] = set()
    found: dict[str, ast.stmt] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).partition(".")[0] for a in stmt.names}
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(stmt.name)
        else:
            stored = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
            found |= {x: stmt for x in stored & defined if x not in found}
    return found


@dataclass(frozen=True)
class Module:
    """What the module's own code binds at run time (``bound``; None where a star import may bind anything), what it
    binds again after importing it (``_rebound``), and its functions."""

    bound: frozenset[str] | None
    rebound: dict[str, ast.stmt]
    functions: Mapping[str, ast.FunctionDef]
    tree: ast.Module
    imports: Mapping[str, str]  # (``names.import_table``)

    @classmethod
    def of(cls, tree: ast.Module, imports: Mapping[str, str]) -> Module:
        functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        scope = _own(tree)  # (an ``if TYPE_CHECKING:`` that binds at module level is one of its nodes)
        hidden = {id(x) for n in scope for s in _type_checking(n) for x in ast.walk(s)}
        own = [n for n in scope if id(n) not in hidden]
        star = any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in own)
        return cls(None if star else PYTHON_NAMES | bound_by(own), _rebound(tree), functions, tree, imports)

    def redefined_below(self, cls: ast.ClassDef, methods: set[str], attrs: set[str]) -> str | None:
        """A subclass in the file defining one of ``methods`` or storing ``self.<attr>`` of ``attrs``: the
        layer it builds runs what ``cls`` was not proven with. In words."""
        for sub in (c for c in self.classes if c is not cls and cls in names.lineage(c, self.tree)):
            stored = set().union(*(roles.stored(f) for f in sub.body if isinstance(f, ast.FunctionDef)))
            if found := sorted(methods & bound_by(_own(sub)) | attrs & stored):
                return f"class `{sub.name}` derives from `{cls.name}` and redefines `{found[0]}`"
        return None

    def remade(self, cls: ast.ClassDef) -> str | None:
        """What runs when ``cls`` is made and may leave another class than its own ``def``s: a class
        decorator, a metaclass (its or its bases') or a base's ``__init_subclass__`` that changes what it is
        handed (``_changes``), or one the file does not define but vLLM's and ``abc``'s. In words."""
        lineage = names.lineage(cls, self.tree)
        metaclasses = [k.value for c in lineage for k in c.keywords if k.arg == "metaclass"]
        hooks = [*(d for c in lineage for d in c.decorator_list), *metaclasses]
        hooks += [f for c in lineage[1:] for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init_subclass__"]
        defined = {c.name: c for c in self.tree.body if isinstance(c, ast.ClassDef)} | dict(self.functions)
        for hook in hooks:
            if isinstance(hook, ast.FunctionDef):
                code, shown = hook, f"`{hook.name}` of a base class"
            else:
                target = hook.func if isinstance(hook, ast.Call) else hook
                code, shown = defined.get(names.dotted(target) or ""), f"`{ast.unparse(hook)}`"
                if code is None and not (names.qualified(target, self.imports) or "").startswith(_KNOWN):
                    return (f"{shown} (line {hook.lineno}) makes the class `{cls.name}`, and this file does not define it: "
                            "what vLLM builds is not proven to be the class's own `def`s")
            if code is not None and (change := _changes(code)) is not None:
                what = ast.unparse(change).splitlines()[0][:60]
                return (f"{shown} (line {hook.lineno}) runs when `{cls.name}` is made and changes it (line {change.lineno}: "
                        f"`{what}`): what vLLM builds is not the class's own `def`s, which are all that is proven")
        return None

    @functools.cached_property
    def classes(self) -> list[ast.ClassDef]:
        """Every class of the file, nested ones too: read once, however many calls ask."""
        return [c for c in ast.walk(self.tree) if isinstance(c, ast.ClassDef)]


_KNOWN = ("vllm.", "abc.", "typing.")  # what makes a class: vLLM's registries and compile wrappers, ABCMeta
_MUTATING = {"update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"}


def _changes(code: ast.AST) -> ast.AST | None:
    """Where code that makes a class changes it: it sets or deletes an attribute (``cls._insert_kv = …``,
    ``setattr``), stores into or mutates a parameter (a metaclass's namespace), makes a class, or returns
    other than a name or ``super()``'s answer (a wrapper)."""
    params = {n.arg for n in ast.walk(code) if isinstance(n, ast.arg)}
    tops = [code] if isinstance(code, ast.FunctionDef) else [f for f in code.body if isinstance(f, ast.FunctionDef)]  # type: ignore[attr-defined]
    returns = {id(n) for f in tops for n in _own(f) if isinstance(n, ast.Return)}  # (the hook's own, not a wrapper's)
    for n in (n for n in ast.walk(code) if n is not code):
        stored = isinstance(getattr(n, "ctx", None), (ast.Store, ast.Del))
        if isinstance(n, ast.Attribute) and stored or isinstance(n, ast.ClassDef):
            return n
        if isinstance(n, ast.Subscript) and stored and isinstance(n.value, ast.Name) and n.value.id in params:
            return n
        func = n.func if isinstance(n, ast.Call) else None
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") or isinstance(func, ast.Name) and func.id == "type" and len(n.args) == 3:  # type: ignore[union-attr]
            return n
        if isinstance(func, ast.Attribute) and func.attr in _MUTATING and isinstance(func.value, ast.Name) and func.value.id in params:
            return n
        if id(n) in returns and n.value is not None and not isinstance(n.value, ast.Name):  # type: ignore[attr-defined]
            inner = n.value.func.value if isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute) else None
            if not (isinstance(inner, ast.Call) and names.dotted(inner.func) == "super" or names.dotted(getattr(n.value, "func", n.value)) == "type.__new__"):
                return n
    return None


def bound_by(nodes: Iterable[ast.AST]) -> frozenset[str]:
    """The names ``nodes`` bind: stored, imported, defined, a parameter, caught."""
    found = {n.id for n in nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    found |= {(a.asname or a.name).partition(".")[0] for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    found |= {n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)) and n.name}
    return frozenset(found | {n.arg for n in nodes if isinstance(n, ast.arg)})


def _own(fn: ast.AST) -> list[ast.AST]:
    """The nodes of ``fn``'s own scope (not a nested def's, lambda's, class's or comprehension's)."""
    found, todo = [], list(ast.iter_child_nodes(fn))
    while todo:
        n = todo.pop()
        found.append(n)
        todo += [] if isinstance(n, _SCOPES) else list(ast.iter_child_nodes(n))
    return found


def _read(code: list[ast.AST]) -> list[ast.Name]:
    """The names ``code`` reads, in order, but in annotations (which Python does not run here)."""
    notes = [x for fn in code for n in ast.walk(fn) for x in (
        [n.annotation] if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation else
        [n.returns] if isinstance(n, ast.FunctionDef) and n.returns else [])]
    skip = {id(x) for note in notes for x in ast.walk(note)}
    read = (n for fn in code for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    return sorted((n for n in read if id(n) not in skip), key=lambda n: (n.lineno, n.col_offset))


def _names(code: list[ast.AST], module: Module, known: set[str]) -> str | None:
    """A name a function reads that neither it nor the module binds at run time, or the module binds again
    after its import, or read before its local is bound (UnboundLocalError); ``known``: a lost guard's."""
    for fn in code:
        inner = bound_by(list(ast.walk(fn)))  # (its locals, and its comprehensions' and lambdas')
        for n in (n for n in _read([fn]) if n.id not in known and n.id not in inner):
            if module.bound is not None and n.id not in module.bound:
                return f"line {n.lineno} reads `{n.id}`, which neither the function nor the module binds at run time"
            if n.id in module.rebound:
                at = module.rebound[n.id]
                return f"line {n.lineno} reads `{n.id}`, which line {at.lineno} binds again at module level (`{ast.unparse(at)[:60]}`)"
    for fn in (fn for fn in code if isinstance(fn, (ast.FunctionDef, ast.Lambda))):
        own = _own(fn)
        declared = {x for n in own if isinstance(n, (ast.Global, ast.Nonlocal)) for x in n.names}
        stores = [n for n in own if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load) and n.id not in declared]
        params = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        top = (module.bound or frozenset()) - PYTHON_NAMES - params
        for n in sorted((n for n in own if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in top), key=lambda n: (n.lineno, n.col_offset)):
            later = [s for s in stores if s.id == n.id]
            if later and all((s.lineno, s.col_offset) > (n.lineno, n.col_offset) for s in later):
                return f"line {n.lineno} reads `{n.id}` before line {later[0].lineno} binds it in the function (UnboundLocalError)"
    return None


def _decorated(method: ast.FunctionDef, init: ast.FunctionDef | None, module: Module) -> str | None:
    """What vLLM runs by the method's name, not proven to be it: the method under a decorator the file
    defines, ``staticmethod``/``classmethod`` (no ``self``), or an attribute ``__init__`` binds by it."""
    for d in method.decorator_list:
        name = names.dotted(d.func if isinstance(d, ast.Call) else d)
        if name in module.functions or name in ("staticmethod", "classmethod"):
            return f"`{method.name}` is wrapped by `{name}` (line {d.lineno}): what runs is not proven to be the method"
    at = guards.init_stores(init).get(method.name)
    return f"line {at[0].lineno} binds `self.{method.name}` in __init__: what runs is not the method" if at else None


def _holds(block: list, call: ast.AST) -> bool:
    return any(n is call for s in block for n in ast.walk(s))


def path_to(call: ast.AST, body: list | None, fields: tuple = _BLOCKS) -> Iterator[tuple[list, int]]:
    """Each block from ``body`` down to ``call`` (a statement's ``fields``: body, else branch, ``finally``,
    handlers), with the index of its statement that holds ``call``."""
    while body and (i := next((i for i, s in enumerate(body) if _holds([s], call)), None)) is not None:
        yield body, i
        blocks = (getattr(body[i], f, None) for f in fields)
        body = next((b for b in blocks if isinstance(b, list) and _holds(b, call)), None)


def _unreached(body: list[ast.stmt], call: ast.AST, runs: Iterable[dict[str, object]], scope: roles.Scope) -> str | None:
    """A test that keeps ``call`` from running with some fp8 cache dtype (``runs``: what ``__init__`` leaves for each): an
    ``if`` holding it whose branch the test does not take, or an ``if`` before it that leaves the method."""
    def holds(test: ast.expr) -> list[bool]:
        try:
            return [bool(roles.evaluate(test, dict(env), scope)) for env in runs]
        except roles.EVAL_ERRORS:
            return []

    for block, i in path_to(call, body):
        for before in block[:i]:
            leaves = isinstance(before, ast.If) and not before.orelse and isinstance(before.body[-1], _EXITS)
            if leaves and any(holds(before.test)):  # type: ignore[attr-defined]
                return f"`{ast.unparse(before.test)}` (line {before.lineno}) leaves the method first"  # type: ignore[attr-defined]
        if isinstance(stmt := block[i], ast.If):
            inside = _holds(stmt.body, call)
            if not all(t == inside for t in holds(stmt.test)):
                return f"`{ast.unparse(stmt.test)}` (line {stmt.lineno}) takes the other branch"
    return None


def _again(body: list[ast.stmt], call: ast.Call) -> str | None:
    """Where the call may run other than once a forward: a loop holding it, or a statement beside it that calls the
    op too. The op norms and ropes the fused buffer in place: run twice, it ropes the keys it writes twice."""
    for block, i in path_to(call, body):
        stmt = block[i]
        beside = [s.value for s in block if s is not stmt and isinstance(getattr(s, "value", None), ast.Call)]  # type: ignore[attr-defined]
        if again := [c for c in beside if names.dotted(c.func) == names.dotted(call.func)]:
            return f"line {again[0].lineno} calls the op again, on the same path"
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)) and _holds(stmt.body, call):
            return f"it stands in the loop at line {stmt.lineno}"
    return None


def broken(
    module: Module, cls: ast.ClassDef | None, init: ast.FunctionDef | None, method: ast.FunctionDef | None,
    call: ast.AST, values: Mapping[str, Mapping[str, object]] | None, scope: roles.Scope, known: set[str],
) -> str | None:
    """Why the layer as vLLM runs it does not run the call with an fp8 cache, whatever the bypass (in words),
    or None: a name ``__init__`` or what the method reaches reads (``_names``), a decorator (``_decorated``),
    the call run other than once (``_again``), a subclass redefining the method or cache dtype, the cache
    dtype set where ``__init__`` does not run, a test keeping the call from running (``_unreached``)."""
    code = [c for c in (init, *(guards.reached(method, scope, init) if method else ())) if c is not None]
    if (lost := _names(code, module, known)) is not None:
        return f"{lost}: vLLM fails building or running the layer, with any cache dtype. Bind it once, at module level, then run again"
    if method is not None and (wrapped := _decorated(method, init, module)) is not None:
        return f"{wrapped}. Call the method as it is defined (or write the fp8 path by hand), then run again"
    if method is not None and isinstance(call, ast.Call) and (again := _again(method.body, call)) is not None:
        return f"the op may run other than once a forward: {again}; it norms and ropes q and k in place. Call it once"
    if cls is not None and method is not None and (sub := module.redefined_below(cls, {method.name}, {schema.DTYPE_ATTR})):
        return f"{sub}: what the call relies on is proven for this class alone. Nothing was changed"
    if cls is not None and (remade := module.remade(cls)) is not None:
        return f"{remade}. Nothing was changed"
    if init is not None and schema.DTYPE_ATTR not in guards.reach_stores(init, scope):  # (then: who else sets it)
        at = next((f for f in scope.methods.values() if schema.DTYPE_ATTR in guards.init_stores(f)), None)
        if at is not None:
            return f"`self.{schema.DTYPE_ATTR}` is set by `{at.name}` (line {at.lineno}), which __init__ does not run: vLLM fails building the layer"
    runs = [values[d] for d in roles.FP8_DTYPES if d in values] if values and method is not None else []
    unreached = _unreached(method.body, call, runs, scope) if runs else None  # type: ignore[union-attr]
    return f"the call does not run with an fp8 cache: {unreached}, so nothing writes the fp8 cache there" if unreached else None
