"""Is a written file right? One judgement for every rewrite the tests make.

``judge_rewrite(before, after, reference)`` returns the problems it finds (an
empty list: the rewrite is right). It looks with Python's own ``ast``, apart
from one question put to the codemod itself (does a second pass find every
site patched and nothing to do):

1. ``after`` compiles;
2. the codemod's second pass finds as many insert sites as before, all
   ``patched``, and nothing to do;
3. nothing but the bypass changed: with the bypass pieces taken out of both
   (flag, guard, post-call insert, guarded cache arguments, ``_insert_kv``,
   imports nothing reads) the two syntax trees are equal;
4. the pieces are wired: the cache arguments are ``X if G else None`` around
   the original ``X``; ``G = not self._fp8_kv`` is assigned once, on the way to
   the call; right after the call ``if not G:`` slices k, v and index_k out of
   the call's own qkv argument and passes them with the call's own slot
   mappings to ``self._insert_kv``; ``__init__`` sets ``self._fp8_kv`` from the
   kv-cache dtype attribute after that attribute is set; ``_insert_kv`` takes
   the slot mappings, writes with ``reshape_and_cache_flash`` and that dtype,
   and nothing else in the class calls it;
5. with ``reference`` (the rewrite of the unmutated file): the generated
   pieces are the same code, up to local names;
6. it does the same thing: the semantic level of ``mm3-codemod verify``
   (``rewriter.verify.semantic``) runs the layer class's own ``forward`` and
   ``_insert_kv`` with plain-PyTorch reference ops, once with a bf16 cache and
   once with an fp8 cache, and the two must agree (q, index_q, index cache
   identical; fp8 cache = e4m3 of the bf16 cache at every written slot, no
   other slot touched) - at two sizes: the kernel level's (head dims 128) and
   the semantic level's, where every head count and head size differs, so that
   none can stand in for another.
"""

from __future__ import annotations

import ast
import difflib
import warnings

import libcst as cst
from mutations import FUSED_OP, INDEX_CACHE, INDEX_SLOT_MAPPING, KV_CACHE, SCHEMA, SLOT_MAPPING

from codemods.analysis import analyze
from codemods.schema import SiteState

FLAG = "_fp8_kv"
SCALE = "_fp8_kv_scale"
INSERT_KV = "_insert_kv"


def judge_rewrite(before_src: str, after_src: str, reference_src: str | None = None) -> list[str]:
    try:
        compile(after_src, "<after>", "exec", dont_inherit=True)
    except SyntaxError as exc:
        return [f"does not compile: {exc.msg} (line {exc.lineno})"]
    before, after = ast.parse(before_src), ast.parse(after_src)
    problems = _second_pass(before, after_src)
    problems += _nothing_else_changed(before, after)
    problems += _wiring(before, after)
    if reference_src is not None and not problems:
        ours, theirs = _pieces(after), _pieces(ast.parse(reference_src))
        problems += [
            f"{name} differs from the reference rewrite" for name in ours if ours[name] != theirs[name]
        ]
    if not problems:
        problems += _semantic(after_src)
    return problems


# --- 6. the same results, run ------------------------------------------------------------------------


def _semantic(after_src: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU torch wheels warn when NumPy is absent
        try:
            import torch
        except ImportError:
            return ["torch is not installed: the semantic check cannot run (pip install '.[test]')"]
        from rewriter.verify import layercode, semantic, standin

    problems = []
    shapes = (layercode.Shape(), layercode.DISTINCT)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only spins on a busy CI machine
    try:
        for name in layercode.layer_classes(after_src):
            try:
                code = layercode.load_layer("<after>", name, source=after_src)
            except (layercode.HarnessError, SyntaxError) as exc:
                problems.append(f"semantic: {name}: {exc}")
                continue
            for shape in shapes:
                inputs = standin.Inputs.random(code.fit(shape), "cpu")
                result, _ = semantic.check_layer(code, standin.REFERENCE, inputs)
                if not result.passed:
                    problems.append(f"semantic: {name} ({inputs.shape}): {result.reason}")
    finally:
        torch.set_num_threads(threads)
    return problems


# --- 2. the codemod's own second pass ------------------------------------------------------------


def _second_pass(before: ast.Module, after_src: str) -> list[str]:
    analysis = analyze(cst.parse_module(after_src))
    sites = [s for s in analysis.sites if s.state is not SiteState.NOT_A_SITE]
    problems = []
    if len(sites) != len(_insert_calls(before)):
        problems.append(f"{len(_insert_calls(before))} insert call(s) before, {len(sites)} site(s) after")
    problems += [
        f"line {s.line}: {s.state.value} after the rewrite" for s in sites if s.state is not SiteState.PATCHED
    ]
    if analysis.needs_rewrite or analysis.refused:
        problems.append("a second pass still has something to do")
    return problems


# --- 3. nothing else changed ------------------------------------------------------------------------


def _nothing_else_changed(before: ast.Module, after: ast.Module) -> list[str]:
    a, b = _strip(before), _strip(after)
    if ast.dump(a) == ast.dump(b):
        return []
    diff = difflib.unified_diff(ast.unparse(a).splitlines(), ast.unparse(b).splitlines(), lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    return ["code outside the bypass changed: " + " | ".join(changed[:4])]


def _strip(tree: ast.Module) -> ast.Module:
    tree = _Strip().visit(ast.parse(ast.unparse(tree)))  # a copy
    used = _names_used(tree)
    body = []
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom):
            stmt.names = [a for a in stmt.names if (a.asname or a.name) in used]
            if not stmt.names:
                continue
        body.append(stmt)
    tree.body = body
    return tree


class _Strip(ast.NodeTransformer):
    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        node.body = [s for s in node.body if not (isinstance(s, ast.FunctionDef) and s.name == INSERT_KV)]
        self.generic_visit(node)
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                setattr(node, field, [s for s in value if not _is_bypass_statement(s)] or [ast.Pass()])
        return super().generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        if _is_fused(node):
            node.args = [_unguard(a) for a in node.args]
            for kw in node.keywords:
                kw.value = _unguard(kw.value)
        return node


def _is_bypass_statement(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):  # the scale as a buffer
        call = stmt.value
        first = call.args[0] if call.args else None
        if _self_attr(call.func) == "register_buffer" and isinstance(first, ast.Constant) and first.value == SCALE:
            return True
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        if _self_attr(stmt.targets[0]) in (FLAG, SCALE):
            return True
        if isinstance(stmt.targets[0], ast.Name) and _is_not_flag(stmt.value):
            return True
    if isinstance(stmt, ast.If) and not stmt.orelse and _guard_test(stmt.test) is not None:
        return any(is_insert_kv_call(n) for n in ast.walk(stmt))
    return False


def _names_used(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.update(node.value.replace(".", " ").replace("[", " ").replace("]", " ").split())
    return used


# --- 4. wiring ---------------------------------------------------------------------------------------


def _wiring(before: ast.Module, after: ast.Module) -> list[str]:
    old_calls, new_calls = _insert_calls(before), _insert_calls(after)
    if len(old_calls) != len(new_calls):
        return [f"{len(old_calls)} insert call(s) before, {len(new_calls)} after"]
    parents = _parents(after)
    problems = []
    for old, new in zip(old_calls, new_calls, strict=True):
        problems += _wired_call(old, new, parents)
    return problems


def _wired_call(old: ast.Call, new: ast.Call, parents: dict[ast.AST, ast.AST]) -> list[str]:
    old_args, new_args = _bind(old), _bind(new)
    where = f"call at line {new.lineno}"
    guards = set()
    for index in (KV_CACHE, INDEX_CACHE):
        guard = _guard_of(new_args.get(index))
        if guard is None:
            return [f"{where}: `{SCHEMA[index]}` is not `X if <guard> else None`"]
        guards.add(guard)
        if ast.dump(_unguard(new_args[index])) != ast.dump(_unguard(old_args[index])):
            return [f"{where}: `{SCHEMA[index]}` no longer passes the original cache"]
    if len(guards) != 1:
        return [f"{where}: the cache arguments are guarded by different names {sorted(guards)}"]
    (guard,) = guards
    if {i: ast.dump(v) for i, v in new_args.items() if i not in (KV_CACHE, INDEX_CACHE)} != {
        i: ast.dump(v) for i, v in old_args.items() if i not in (KV_CACHE, INDEX_CACHE)
    }:
        return [f"{where}: arguments other than the caches changed"]

    statement = _statement_of(new, parents)
    func = _enclosing(new, parents, ast.FunctionDef)
    cls = _enclosing(new, parents, ast.ClassDef)
    if statement is None or func is None or cls is None:
        return [f"{where}: not a statement of a method"]
    problems = _guard_assigned(guard, func, statement, parents, where)
    problems += _post_insert(guard, statement, parents, new_args, where)
    problems += _flag_and_insert_kv(cls, where)
    return problems


def _guard_assigned(guard: str, func: ast.FunctionDef, statement: ast.stmt, parents, where: str) -> list[str]:
    stores = [
        n
        for n in ast.walk(func)
        if isinstance(n, ast.Name) and n.id == guard and isinstance(n.ctx, ast.Store)
    ]
    if len(stores) != 1:
        return [f"{where}: guard `{guard}` is assigned {len(stores)} times"]
    assign = parents[stores[0]]
    if not (isinstance(assign, ast.Assign) and _is_not_flag(assign.value)):
        return [f"{where}: guard `{guard}` is not assigned `not self._fp8_kv`"]
    if assign not in _dominating(statement, parents):
        return [f"{where}: guard `{guard}` is not assigned on every way to the call"]
    return []


def _post_insert(
    guard: str, statement: ast.stmt, parents, args: dict[int, ast.expr], where: str
) -> list[str]:
    block = _block_of(statement, parents)
    i = block.index(statement)
    follow = block[i + 1] if i + 1 < len(block) else None
    if not (isinstance(follow, ast.If) and not follow.orelse and _guard_test(follow.test) in (guard, FLAG)):
        return [f"{where}: the statement after the call is not `if not {guard}:`"]
    inserts = [n for n in ast.walk(follow) if is_insert_kv_call(n)]
    if len(inserts) != 1:
        return [f"{where}: {len(inserts)} `self._insert_kv(...)` calls after the call"]
    (insert,) = inserts
    if insert.keywords or len(insert.args) != 5:
        return [f"{where}: `self._insert_kv` is not passed (k, v, index_k, slots, index slots)"]
    problems = []
    for got, index in ((insert.args[3], SLOT_MAPPING), (insert.args[4], INDEX_SLOT_MAPPING)):
        if ast.dump(got) != ast.dump(args[index]):
            problems.append(
                f"{where}: `_insert_kv` gets {ast.unparse(got)}, the call {ast.unparse(args[index])}"
            )
    qkv = args.get(0)
    if not isinstance(qkv, ast.Name):
        return [*problems, f"{where}: qkv is not a name"]
    sliced = {}
    for node in ast.walk(follow):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Subscript):
                sliced[node.targets[0].id] = node.value.value
    for arg in insert.args[:3]:
        source = sliced.get(arg.id) if isinstance(arg, ast.Name) else None
        if not (isinstance(source, ast.Name) and source.id == qkv.id):
            problems.append(f"{where}: `{ast.unparse(arg)}` is not a slice of the call's qkv `{qkv.id}`")
    return problems


def _flag_and_insert_kv(cls: ast.ClassDef, where: str) -> list[str]:
    init = _method(cls, "__init__")
    if init is None:
        return [f"{where}: class {cls.name} has no __init__"]
    dtype = "kv_cache_dtype"  # the main cache's dtype, what vLLM's attention backends read
    flags = [n for n in ast.walk(cls) if isinstance(n, ast.Assign) and _self_attr(n.targets[0]) == FLAG]
    problems = []
    if len(flags) != 1 or flags[0] not in list(ast.walk(init)):
        problems.append(f"{where}: `self._fp8_kv` is set {len(flags)} times (once, in __init__, expected)")
    else:
        value = flags[0].value
        if not (
            isinstance(value, ast.Compare)
            and isinstance(value.left, ast.Constant)
            and value.left.value == "fp8"
            and isinstance(value.ops[0], ast.In)
            and _self_attr(value.comparators[0]) == dtype
        ):
            problems.append(f'{where}: the flag is not `"fp8" in self.{dtype}`')
        sets = [n for n in ast.walk(init) if isinstance(n, ast.Assign) and _self_attr(n.targets[0]) == dtype]
        if not sets or not all(s.lineno < flags[0].lineno for s in sets):
            problems.append(f"{where}: the flag reads self.{dtype} before __init__ last sets it")
    callers = [
        n
        for s in cls.body
        if not (isinstance(s, ast.FunctionDef) and s.name == INSERT_KV)
        for n in ast.walk(s)
        if is_insert_kv_call(n)
    ]
    if len(callers) != 1:
        problems.append(
            f"{where}: `self._insert_kv(...)` is called {len(callers)} times in the class (once expected)"
        )
    insert_kvs = [s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == INSERT_KV]
    if len(insert_kvs) != 1:
        return [*problems, f"{where}: {len(insert_kvs)} `_insert_kv` methods"]
    (insert_kv,) = insert_kvs
    if len(insert_kv.args.args) != 6:
        problems.append(
            f"{where}: `_insert_kv` does not take (self, key, value, index_key, slots, index slots)"
        )
    writes = [
        n
        for n in ast.walk(insert_kv)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func).endswith("reshape_and_cache_flash")
        and len(n.args) == 8
    ]
    params = [a.arg for a in insert_kv.args.args]
    main = [w for w in writes if _self_attr(w.args[5]) == dtype]
    # the index key's store: "auto" (a bf16 index cache), or a local that is only ever
    # assigned "auto" or "fp8_e4m3" (picked by the index cache's dtype)
    assigned: dict[str, set[object]] = {}
    for node in ast.walk(insert_kv):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value.value if isinstance(node.value, ast.Constant) else None
            assigned.setdefault(node.targets[0].id, set()).add(value)
    stores = {name for name, values in assigned.items() if values <= {"auto", "fp8_e4m3"}}
    index = [
        w
        for w in writes
        if isinstance(w.args[5], ast.Constant) and w.args[5].value == "auto"
        or isinstance(w.args[5], ast.Name) and w.args[5].id in stores
    ]
    if len(writes) != 2 or len(main) != 1 or len(index) != 1:
        problems.append(
            f"{where}: `_insert_kv` does not write k/v with reshape_and_cache_flash(..., self.{dtype}, ...) "
            'and the index key with reshape_and_cache_flash(..., "auto", ...)'
        )
    elif params[4:] != [ast.unparse(main[0].args[4]), ast.unparse(index[0].args[4])]:
        problems.append(f"{where}: `_insert_kv`'s writes do not use its own slot-mapping parameters")
    scatters = [
        n
        for n in ast.walk(insert_kv)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Subscript) for t in n.targets)
    ]
    if scatters:
        problems.append(f"{where}: `_insert_kv` still scatters by slot ({ast.unparse(scatters[0])})")
    return problems


# --- 5. the same pieces as the reference rewrite -------------------------------------------------------


def _pieces(tree: ast.Module) -> dict[str, str]:
    """The generated code of the (single) insert site, names made neutral."""
    (call,) = _insert_calls(tree)
    parents = _parents(tree)
    args = _bind(call)
    guard = _guard_of(args[KV_CACHE])
    statement = _statement_of(call, parents)
    block = _block_of(statement, parents)
    follow = block[block.index(statement) + 1]
    cls = _enclosing(call, parents, ast.ClassDef)
    neutral = {ast.dump(args[0]): "QKV", ast.dump(args[SLOT_MAPPING]): "SLOTS"}
    neutral[ast.dump(args[INDEX_SLOT_MAPPING])] = "INDEX_SLOTS"
    neutral[ast.dump(ast.Name(guard, ast.Load()))] = "GUARD"
    insert_kv = _method(cls, INSERT_KV)
    flag = next(n for n in ast.walk(cls) if isinstance(n, ast.Assign) and _self_attr(n.targets[0]) == FLAG)
    return {
        "the post-call insert": _neutral([follow], neutral),
        "_insert_kv": _neutral(_body_without_docstring(insert_kv), {}),
        "the flag": ast.dump(flag),
    }


def _neutral(statements: list[ast.stmt], names: dict[str, str]) -> str:
    module = ast.parse(ast.unparse(ast.Module(body=statements, type_ignores=[])))
    module = _Placeholders(names).visit(module)
    order: list[str] = []
    for node in ast.walk(module):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in order:
            order.append(node.id)
    rename = {name: f"v{i}" for i, name in enumerate(sorted(order, key=_first_store(module)))}
    for node in ast.walk(module):
        if isinstance(node, ast.Name) and node.id in rename:
            node.id = rename[node.id]
    return ast.dump(module)


def _first_store(module: ast.Module):
    positions = {}
    for node in ast.walk(module):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            positions.setdefault(node.id, (node.lineno, node.col_offset))
    return lambda name: positions[name]


class _Placeholders(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr):
            key = ast.dump(node)
            if key in self.names:
                return ast.Name(self.names[key], ast.Load())
        return super().visit(node)


def _body_without_docstring(func: ast.FunctionDef) -> list[ast.stmt]:
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


# --- ast helpers -------------------------------------------------------------------------------------


def _is_fused(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == FUSED_OP)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == FUSED_OP)
    )


def _bind(call: ast.Call) -> dict[int, ast.expr]:
    bound = dict(enumerate(call.args))
    bound.update({SCHEMA.index(kw.arg): kw.value for kw in call.keywords if kw.arg in SCHEMA})
    return bound


def _insert_calls(tree: ast.AST) -> list[ast.Call]:
    calls = []
    for node in ast.walk(tree):
        if _is_fused(node):
            cache = _bind(node).get(KV_CACHE)
            if cache is not None and not (isinstance(cache, ast.Constant) and cache.value is None):
                calls.append(node)
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _self_attr(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _is_not_flag(node: ast.AST) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and _self_attr(node.operand) == FLAG


def _guard_test(test: ast.AST) -> str | None:
    """``not G`` -> ``"G"``; ``self._fp8_kv`` -> ``"_fp8_kv"``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Name):
        return test.operand.id
    if _self_attr(test) == FLAG:
        return FLAG
    return None


def _guard_of(node: ast.AST | None) -> str | None:
    if (
        isinstance(node, ast.IfExp)
        and isinstance(node.test, ast.Name)
        and isinstance(node.orelse, ast.Constant)
        and node.orelse.value is None
    ):
        return node.test.id
    return None


def _unguard(node: ast.expr) -> ast.expr:
    return node.body if _guard_of(node) is not None else node  # type: ignore[attr-defined]


def is_insert_kv_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _self_attr(node.func) == INSERT_KV


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    found = [s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == name]
    return found[-1] if found else None


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _statement_of(node: ast.AST, parents) -> ast.stmt | None:
    parent = parents.get(node)
    return parent if isinstance(parent, ast.Expr) and parent.value is node else None


def _enclosing(node: ast.AST, parents, kind: type) -> ast.AST | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, kind):
            return node
    return None


def _block_of(statement: ast.stmt, parents) -> list[ast.stmt]:
    parent = parents[statement]
    for _, value in ast.iter_fields(parent):
        if isinstance(value, list) and any(v is statement for v in value):
            return value
    raise AssertionError("statement not found in its parent")


def _dominating(statement: ast.stmt, parents) -> list[ast.stmt]:
    """Statements that run before ``statement`` on every way to it, in its function."""
    out = []
    node: ast.AST = statement
    while not isinstance(node, ast.FunctionDef):
        block = _block_of(node, parents)  # type: ignore[arg-type]
        out += block[: next(i for i, s in enumerate(block) if s is node)]
        node = parents[node]
    return out
