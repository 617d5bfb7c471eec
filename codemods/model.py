"""The one model of a file, read once and asked by every command. As in ruff's semantic model,
a recogniser asks what a name *is*, not how it is spelled: imports resolve names to qualified
ones (``names.import_table``), and a flag is known by the value ``__init__`` leaves in it."""

from __future__ import annotations

import ast
import contextlib
import functools
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from codemods import anchors as a
from codemods import guards, names, roles, runtime, schema
from codemods.sourcemap import SourceMap


def _defs(defs: dict[str, cst.FunctionDef], source_map: SourceMap | None) -> dict[str, ast.FunctionDef]:
    """LibCST defs by name as Python's own tree (the source map's, else parsed from its code); a def
    Python's parser reads as no plain def is left out."""
    trees = {}
    for name, fn in defs.items():
        node = source_map.trees.get(id(fn)) if source_map is not None else None
        if node is None:
            code = a.code(fn.with_changes(leading_lines=[], decorators=[]))
            with contextlib.suppress(SyntaxError, ValueError):
                node = ast.parse(textwrap.dedent(code)).body[0]
        if isinstance(node, ast.FunctionDef):
            trees[name] = node
    return trees


@dataclass
class FileModel:
    """The file, read once (``model``): its module functions and pass-through wrappers, what
    its imports bind, and per class what its flags are; every finder asks it."""

    module: cst.Module
    source_map: SourceMap | None
    functions: dict[str, cst.FunctionDef]
    wrappers: dict[str, a.Wrapper]
    imports: dict[str, str]
    _scopes: dict[int, roles.Scope] = field(default_factory=dict)
    _init_values: dict[int, dict[str, dict[str, object]] | None] = field(default_factory=dict)

    @classmethod
    def of(cls, module: cst.Module, source: str | bytes | None = None) -> FileModel:
        source_map = SourceMap.of(module, module.code if source is None else source)
        try:
            imports = names.import_table(source_map.tree if source_map is not None else ast.parse(module.code))
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # newer Python than this one's
            imports = {i.bound: i.qualified for i in a.module_imports(module)}
        return cls(module, source_map, a.module_functions(module), pass_through_wrappers(module), imports)

    @property
    def tree(self) -> ast.Module:
        """Python's own tree of the file (empty where its parser reads other statements than LibCST's)."""
        return self.source_map.tree if self.source_map is not None else ast.Module([], [])

    @functools.cached_property
    def top_imports(self) -> dict[str, str]:
        """``imports`` bound by an import or alias of the module's own (no function's, no ``if``'s; a
        ``try``'s, each binding resolving alike): what code written into a method may name."""
        top = {i.bound for i in a.module_imports(self.module)}  # and a module-level alias (``ops = torch.ops._C``)
        tried = [n for t in self.tree.body if isinstance(t, ast.Try) for n in ast.walk(t) if isinstance(n, (ast.Import, ast.ImportFrom))]
        top |= runtime.bound_by(tried)
        top |= {t.id for n in self.tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        return {k: v for k, v in self.imports.items() if k in top}

    @functools.cached_property
    def runtime(self) -> runtime.Module:
        """What the module binds at run time (``runtime.Module``); nothing known where Python's parser cannot read it."""
        return runtime.Module.of(self.tree, self.imports) if self.source_map is not None else runtime.Module(None, {}, {}, ast.Module([], []), {})

    @functools.cached_property
    def stores(self) -> list[ast.AST]:
        """The file's assignments and calls (``guards.STORES``): where ``guards.set_through_another`` looks."""
        return [n for n in ast.walk(self.tree) if isinstance(n, guards.STORES)]

    def ast_of(self, node: cst.CSTNode) -> ast.stmt | None:
        """The compound statement (a def, a class, an ``if``) of Python's own tree that ``node`` is."""
        return self.source_map.trees.get(id(node)) if self.source_map is not None else None

    @functools.cached_property
    def positions(self) -> Mapping[cst.CSTNode, CodeRange]:
        """Every node's position: LibCST generates them for the whole file, so only when asked."""
        return MetadataWrapper(self.module, unsafe_skip_copy=True).resolve(PositionProvider)

    @functools.cached_property
    def _names(self) -> dict[str, list[cst.CSTNode]]:
        """By name, every place it is named (a name, an attribute ``x.name``, a string) but a def's or class's
        own name: one walk of the file."""
        found: dict[str, list[cst.CSTNode]] = {}
        nodes = a.nodes_in(self.module)
        defined = {id(n.name) for n in nodes if isinstance(n, (cst.FunctionDef, cst.ClassDef))}
        for n in nodes:
            if id(n) in defined:
                continue
            if isinstance(n, cst.Name):
                found.setdefault(n.value, []).append(n)
            elif isinstance(n, cst.Attribute):
                found.setdefault(n.attr.value, []).append(n)
            elif isinstance(n, cst.SimpleString) and isinstance(n.evaluated_value, str):
                found.setdefault(n.evaluated_value, []).append(n)
        return found

    def named(self, name: str) -> list[cst.CSTNode]:
        return self._names.get(name, [])

    def scope(self, cls: cst.ClassDef) -> roles.Scope:
        """What a flag's expression may call: the module's functions, the class's methods, imports."""
        if id(cls) not in self._scopes:
            methods = _defs(self.methods(cls), self.source_map)
            self._scopes[id(cls)] = roles.Scope(self.module_scope.functions, methods, self.imports)
        return self._scopes[id(cls)]

    def init_stores(self, cls: cst.ClassDef) -> dict[str, list[ast.FunctionDef]]:
        """What ``__init__`` and the methods it calls store (``guards.reach_stores``), by attribute."""
        scope = self.scope(cls)
        return guards.reach_stores(scope.methods.get("__init__"), scope)

    def lineage(self, cls: cst.ClassDef) -> list[cst.ClassDef]:
        """The class, then its bases that this file defines (``names.lineage``)."""
        tree = self.ast_of(cls)
        if not isinstance(tree, ast.ClassDef):
            return [cls]
        classes = {id(self.ast_of(c)): c for c in self.module.body if isinstance(c, cst.ClassDef)}
        classes[id(tree)] = cls  # (a class nested in another, too)
        return [classes[id(c)] for c in names.lineage(tree, self.tree)]

    def methods(self, cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
        """What ``self.<name>(…)`` reaches (``names.class_methods``): a mixin's methods too."""
        return {f.name.value: f for c in reversed(self.lineage(cls)) for f in a.methods(c)}

    def bases_outside(self, cls: cst.ClassDef) -> list[str]:
        """The bases of the class and its lineage that this file does not define (but ``nn.Module``)."""
        lineage = self.lineage(cls)
        bases = [a.code(b.value) for c in lineage for b in c.bases if b.keyword is None]
        module = ("torch.nn.Module", "torch.nn.modules.module.Module")
        qualified = {b: names.qualified(names.expression(b), self.imports) for b in bases}  # type: ignore[arg-type]
        return [b for b in bases if b not in {c.name.value for c in lineage} and qualified[b] not in module]

    def depth(self, node: cst.CSTNode) -> int:
        """How many blocks deep a statement stands: its column over the file's indent step."""
        tree = self.ast_of(node)
        column = tree.col_offset if isinstance(tree, ast.stmt) else self.positions[node].start.column
        return column // max(len(self.module.default_indent), 1)

    def init(self, cls: cst.ClassDef) -> cst.FunctionDef | None:
        """The ``__init__`` that builds the class: its own, else a base class's of this file."""
        return self.methods(cls).get("__init__")

    def flag_property(self, cls: cst.ClassDef, flag: str) -> cst.FunctionDef | None:
        """The ``@property`` def (``roles.Scope.properties``) that ``self.<flag>`` reaches, if it is one."""
        return self.methods(cls).get(flag) if flag in self.scope(cls).properties() else None

    @functools.cached_property
    def module_scope(self) -> roles.Scope:
        """What an expression outside a class may call: the module's functions, and imports."""
        return roles.Scope(_defs(self.functions, self.source_map), {}, self.imports)

    @functools.cached_property
    def constants(self) -> dict[str, object]:
        """The module's literal constants (``roles.module_constants``), read once for every class."""
        return roles.module_constants(self.tree, self.module_scope)

    def init_values(self, cls: cst.ClassDef) -> dict[str, dict[str, object]] | None:
        """What ``__init__`` leaves in each attribute, per cache dtype (``roles.init_values``), read once a
        class; None where Python's parser reads no plain ``def __init__``."""
        if id(cls) not in self._init_values:
            init, tree = self.scope(cls).methods.get("__init__"), self.ast_of(cls)
            attrs = roles.module_constants(self.tree, roles.NO_SCOPE, tree) if tree else {}  # type: ignore[arg-type]
            values = roles.init_values(init, self.scope(cls), self.constants | attrs) if init is not None else None
            self._init_values[id(cls)] = values
        return self._init_values[id(cls)]

    def flags(self, cls: cst.ClassDef) -> dict[str, bool]:
        """Each attribute ``__init__`` sets: whether it is a flag by the value it holds (``roles.flags``);
        not kept: from the kept values it costs under a millisecond a class."""
        values, scope = self.init_values(cls), self.scope(cls)
        return roles.flags(scope.methods["__init__"], scope, values) if values is not None else {}

    def dtype_free(self, cls: cst.ClassDef) -> set[str]:
        """The attributes ``__init__`` leaves holding the same value whatever the cache dtype."""
        first, *rest = list((self.init_values(cls) or {}).values()) or [{}]
        same = [k for k, v in first.items() if all(k in r and repr(r[k]) == repr(v) for r in rest)]
        return {k.removeprefix("self.") for k in same}

    def carries_dtype(self, cls: cst.ClassDef, expr: cst.BaseExpression | ast.expr | None, fp8: bool = False) -> bool:
        """``expr``, a native call's dtype argument, holds the cache dtype (``roles.carries_dtype``); ``fp8``: where
        the cache dtype is one of the fp8 dtypes alone (a write the fp8 flag runs)."""
        tree = expr if isinstance(expr, ast.expr) or expr is None else names.expression(a.code(expr))
        values = {d: v for d, v in (self.init_values(cls) or {}).items() if d in roles.FP8_DTYPES or not fp8} or None
        return values is not None and tree is not None and roles.carries_dtype(tree, self.scope(cls), values)

    def fp8_dtyped(self, cls: cst.ClassDef) -> set[str]:
        """The cache dtype, and the ``self.`` attributes ``__init__`` leaves another value in for another fp8 dtype,
        or reads the dtype into where what it leaves is not known: what tells the fp8 dtypes apart."""
        runs = [(self.init_values(cls) or {}).get(d, {}) for d in roles.FP8_DTYPES]
        init = self.scope(cls).methods.get("__init__")
        assigns = [n for n in ast.walk(init) if isinstance(n, ast.Assign)] if init is not None else []
        reading = [n for n in assigns if roles.DTYPE in map(names.dotted, ast.walk(n.value))]  # type: ignore[arg-type]
        unknown = {f"self.{y}" for n in reading for t in n.targets if (y := names.self_member(t))} - set.intersection(*map(set, runs))
        return {roles.DTYPE, *unknown, *(k for k in set().union(*runs) if len({repr(r.get(k, ...)) for r in runs}) > 1)}

    def fp8_alike(self, cls: cst.ClassDef, expr: ast.expr) -> bool:
        """``expr`` holds one value for every fp8 dtype once ``__init__`` has run (``roles.evaluate``)."""
        values = self.init_values(cls) or {}
        try:
            held = {repr(roles.evaluate(expr, dict(values[d]), self.scope(cls))) for d in roles.FP8_DTYPES}
        except roles.EVAL_ERRORS:
            return False
        return len(held) == 1

    def is_compiling(self, expr: cst.BaseExpression) -> bool:
        tree = names.expression(a.code(expr))
        return tree is not None and names.is_compiling(tree, self.imports)

    def compile_test(self) -> str:
        """How this file calls ``torch.compiler.is_compiling()``: as it calls it already, else its own
        spelling where it imports it (``is_compiling()``, ``dynamo.is_compiling()``), else that one."""
        calls = (ast.unparse(n) for n in ast.walk(self.tree) if names.is_compiling(n, self.imports))  # type: ignore[arg-type]
        if (called := next(calls, None)) is not None:
            return called
        for bound, name in sorted(self.imports.items()):
            if name in names.COMPILE_TESTS:
                return f"{bound}()"
            if f"{name}.is_compiling" in names.COMPILE_TESTS and bound != "torch":
                return f"{bound}.is_compiling()"
        return "torch.compiler.is_compiling()"

    def compiled_path_write(self, node: cst.CSTNode) -> bool:
        """A branch on ``torch.compiler.is_compiling()`` (however imported), or a call of a
        registered op (``torch.ops.<namespace>.<op>(...)``): the compiled path's cache write."""
        if isinstance(node, cst.If):
            return self.is_compiling(node.test)
        if not isinstance(node, cst.Call):
            return False
        tree = names.expression(a.code(node.func))
        return tree is not None and (names.qualified(tree, self.imports) or "").startswith("torch.ops.")

    def flag_definition(self, cls: cst.ClassDef, init: cst.FunctionDef, flag: str) -> list[cst.BaseStatement]:
        """The statements of ``__init__`` that do nothing but decide ``self.<flag>``: its assignments, an
        ``if`` on a pure test whose branches only assign it, a call of a method of the class that only assigns
        it (with that method), the locals only they read; or the class's property that is the flag."""
        scope = self.scope(cls)
        setters: list[cst.FunctionDef] = []

        def evaluated(expr: cst.BaseExpression) -> object | None:
            """What ``expr`` holds for an fp8 cache dtype, where that can be read (else None)."""
            tree = names.expression(a.code(expr))
            env = {**_locals, roles.DTYPE: "fp8"}
            try:
                return roles.evaluate(tree, env, scope) if tree is not None else None
            except (roles.Unknown, TypeError, ValueError, RecursionError, AttributeError):
                return None

        def block_sets(suite: cst.BaseSuite) -> bool:
            return isinstance(suite, cst.IndentedBlock) and all(only_sets(x) for x in suite.body)

        def only_sets(stmt: cst.CSTNode) -> bool:
            if isinstance(stmt, cst.SimpleStatementLine):
                return all(small_sets(x) for x in stmt.body)
            if isinstance(stmt, cst.If) and evaluated(stmt.test) is not None:
                if isinstance(stmt.orelse, cst.If):  # elif
                    return block_sets(stmt.body) and only_sets(stmt.orelse)
                return block_sets(stmt.body) and (stmt.orelse is None or block_sets(stmt.orelse.body))
            return False

        def small_sets(x: cst.BaseSmallStatement) -> bool:
            if isinstance(x, cst.Assign) and len(x.targets) == 1 and a.self_attr(x.targets[0].target) == flag:
                return evaluated(x.value) is not None
            if isinstance(x, cst.Expr) and isinstance(x.value, cst.Call) and not x.value.args:
                name = a.self_attr(x.value.func) or ""
                method = a.find_method(cls, name)
                calls = [n for n in self.named(name) if isinstance(n, cst.Attribute)]
                if method is not None and len(calls) == 1 and block_sets(method.body):
                    setters.append(method)
                    return True
            return False

        _locals: dict[str, object] = {}
        body = list(init.body.body) if isinstance(init.body, cst.IndentedBlock) else []
        pairs = [(stmt, a.simple_assignment(stmt)) for stmt in body]
        assigned = [(stmt, p[0].value, p[1]) for stmt, p in pairs if p and isinstance(p[0], cst.Name)]
        for _, name, expr in assigned:  # what the top-level locals hold (for the fp8 dtype), where readable
            if (value := evaluated(expr)) is not None:
                _locals[name] = value
        found = [stmt for stmt in body if only_sets(stmt)]
        # locals read only by those statements (``quantized = "fp8" in d``; ``self.F = quantized``)
        for stmt, name, expr in reversed(assigned):
            readers = [s for s in body if s is not stmt and name in a.names_read(s)]
            only_theirs = readers and all(any(r is f for f in found) for r in readers)
            if stmt not in found and only_theirs and evaluated(expr) is not None:
                found.append(stmt)
        prop = self.flag_property(cls, flag)  # the flag as a property
        return [*found, *setters, *([prop] if prop is not None else [])]


def pass_through_wrappers(module: cst.Module) -> dict[str, a.Wrapper]:
    """Module functions whose every call of the op (or of a wrapper found one level
    down) passes only the function's own parameters, by name: followed two levels."""
    functions = a.module_functions(module)
    found: dict[str, a.Wrapper] = {}
    for _ in range(2):
        for name, fn in functions.items():
            if name not in found and (wrapper := _as_wrapper(fn, found)) is not None:
                found[name] = wrapper
    return found


def _as_wrapper(fn: cst.FunctionDef, known: dict[str, a.Wrapper]) -> a.Wrapper | None:
    params = [*fn.params.posonly_params, *fn.params.params, *fn.params.kwonly_params]
    positional = len(params) - len(fn.params.kwonly_params)  # (keyword-only ones bind by keyword alone)
    own = {p.name.value: schema.OpParam(i if i < positional else 10_000, p.name.value) for i, p in enumerate(params)}
    mappings = []
    for node in a.nodes_in(fn.body, scope_only=True):
        name = a.callee_name(node) if isinstance(node, cst.Call) else None
        if name != schema.FUSED_OP and name not in known:
            continue
        inner = None if name == schema.FUSED_OP else known[name]
        if any(arg.star for arg in node.args):
            return None
        passed = [(p, arg.value) for p in schema.OP_PARAMS if (arg := a.OpCall(node, inner).arg(p)) is not None]
        if not all(isinstance(value, cst.Name) and value.value in own for _, value in passed):
            return None  # not handed on unchanged
        mappings.append({p.index: own[value.value] for p, value in passed})  # type: ignore[attr-defined]
    if not mappings or any(m != mappings[0] for m in mappings):
        return None
    dtype = mappings[0].get(schema.KV_CACHE_DTYPE.index)
    default = next((p.default for p in params if dtype is not None and p.name.value == dtype.keyword), None)
    return a.Wrapper(fn.name.value, mappings[0], default)
