"""A layer class's code, read out of its model file, and the sizes it is run at.

The class's methods are compiled from the file itself (their original line numbers
kept, so tracebacks point into the file; decorators other than property /
staticmethod / classmethod dropped), and so are the module's own functions.
``__init__`` becomes statements to run one by one on the stand-in
(:mod:`rewriter.verify.standin`). The file's own code - the insert call and
``__init__`` - tells which ``self.`` attributes hold which inputs and sizes, whether
the insert quantizes by itself, which custom ops the file registers and whether it
asks ``torch.compiler.is_compiling()``: a :class:`LayerCode`. :class:`Shape` holds
the stand-in's sizes; ``LayerCode.fit`` makes equal the ones the file ties.
"""

from __future__ import annotations

import ast
import collections
import functools
import types
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from codemods import names, roles, runtime, schema
from codemods.schema import FUSED_OP, KV_CACHE
from rewriter.apply import read_source

# Decorators kept when a method is compiled out of its class; others (vLLM's
# capture helpers, say) are dropped because they only wrap the call.
_KEPT_DECORATORS = {"property", "staticmethod", "classmethod"}


class HarnessError(Exception):
    """The file cannot be executed on the stand-in (not a failure of the bypass)."""


class Unmodelled(HarnessError):
    """The layer is not where the stand-in looks (no top-level class of that name, no
    ``forward`` of its own): the stand-in's limit, a skip - where ``HarnessError`` itself
    (``async def forward``) is the file's."""


@dataclass(frozen=True)
class Parallel:
    """Tensor-parallel rank ``rank`` of ``size`` ranks, and the model's head counts across
    all ranks: what the config holds and vLLM's parallel linear layers divide (see
    :mod:`rewriter.verify.tp`). At size 1 the totals are the shape's own counts."""

    size: int = 1
    rank: int = 0
    total_heads: int = 0
    total_kv_heads: int = 0
    total_idx_heads: int = 0


@dataclass(frozen=True)
class Shape:
    """Sizes of the stand-in layer. The default is the kernel level's: head dims 128 as
    the real kernels require, one index-q head per kv head as in the fork's layout.
    The head counts are one rank's (``parallel``; TP=1 unless it says otherwise)."""

    tokens: int = 24
    num_heads: int = 4
    num_kv_heads: int = 2
    num_idx_heads: int = 2
    head_dim: int = 128
    idx_head_dim: int = 128
    rotary_dim: int = 64
    block_size: int = 16
    num_blocks: int = 8
    max_position: int = 4096
    hidden_size: int = 256
    eps: float = 1e-6
    padded: int = 3  # the batch's last tokens are CUDA-graph padding: slot -1 in both mappings
    parallel: Parallel = Parallel()

    @property
    def totals(self) -> tuple[int, int, int]:
        """The model's q, kv and index head counts across the ranks (the config's)."""
        p = self.parallel
        if p.size == 1:
            return self.num_heads, self.num_kv_heads, self.num_idx_heads
        return p.total_heads, p.total_kv_heads, p.total_idx_heads

    @property
    def width(self) -> int:
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim + 2 * kv + (self.num_idx_heads + 1) * self.idx_head_dim

    def __str__(self) -> str:
        sizes = (
            f"{self.num_heads} q / {self.num_kv_heads} kv / {self.num_idx_heads} index heads, "
            f"head dims {self.head_dim} / index {self.idx_head_dim}, rotary {self.rotary_dim}"
        )
        p = self.parallel
        if p.size == 1:
            return sizes
        q, kv, index = self.totals
        return f"rank {p.rank} of TP={p.size}: {sizes} (of {q} q / {kv} kv / {index} index heads)"


# The sizes a file's attributes can hold. Where one attribute holds several (the
# file ties them), they take the value of the first in this order (LayerCode.fit).
SIZES = ("num_heads", "num_kv_heads", "num_idx_heads", "head_dim", "idx_head_dim", "rotary_dim")

# The semantic level's sizes: all different, so that no width, head count or head
# size can stand in for another. head_dim < idx_head_dim: an index key sliced with
# head_dim comes out short (a slice too wide clips at the end of qkv, harmlessly -
# the index key is its last part in vLLM too). Its block size is not the kernel level's
# either: a write that assumes one block size (``slots // 16``) fails at the other.
DISTINCT = Shape(
    num_heads=6, num_kv_heads=2, num_idx_heads=3, head_dim=64, idx_head_dim=128, rotary_dim=32, block_size=32
)


# --- the layer's code, out of the file -----------------------------------------


def _arg(call: ast.Call, param: schema.OpParam) -> ast.expr | None:
    positional = [arg for arg in call.args if not isinstance(arg, ast.Starred)]
    return schema.bind_arg(param, positional, [(k.arg, k.value) for k in call.keywords if k.arg is not None])


def _callee(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _calls_fused_with_cache(node: ast.AST, wrappers: dict[str, dict[int, schema.OpParam]] | None = None) -> bool:
    """A call of the op, or of a pass-through wrapper of it, that passes a main cache."""
    return any(
        cache is not None and not (isinstance(cache, ast.Constant) and cache.value is None)
        for call in _op_calls(node, wrappers or {})
        for cache in (_op_arg(call, KV_CACHE, wrappers or {}),)
    )


def _op_calls(node: ast.AST, wrappers: dict[str, dict[int, schema.OpParam]]) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and (_callee(c) == FUSED_OP or _callee(c) in wrappers)]


def _op_arg(call: ast.Call, param: schema.OpParam, wrappers: dict[str, dict[int, schema.OpParam]]) -> ast.expr | None:
    """What the op's ``param`` receives from ``call`` (through a wrapper's own parameter)."""
    mapping = wrappers.get(_callee(call) or "")
    if mapping is None:
        return _arg(call, param)
    own = mapping.get(param.index)
    return _arg(call, own) if own is not None else None


@functools.lru_cache(maxsize=8)
def _wrappers(text: str) -> dict[str, dict[int, schema.OpParam]]:
    """The file's pass-through wrappers of the op, as the codemod finds them (read-only). Once
    per text: the level loads each class once per tensor-parallel row, and this LibCST parse
    was most of each load (0.06 s of 0.09 on the example; `run`'s proof runs three rows)."""
    import libcst

    from codemods.model import pass_through_wrappers

    try:
        module = libcst.parse_module(text)
    except libcst.ParserSyntaxError:
        return {}
    return {name: w.params for name, w in pass_through_wrappers(module).items()}


@dataclass
class LayerCode:
    """A layer class's methods compiled from its file, ready to bind to a stand-in."""

    path: str
    class_name: str
    methods: dict[str, types.CodeType]
    decorators: dict[str, list[str]]
    init: Init
    ops_aliases: set[str]
    imported: dict[str, str]
    bindings: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)  # see _bindings
    called_attrs: set[str] = field(default_factory=set)
    functions: dict[str, types.CodeType] = field(default_factory=dict)  # the module's own defs
    native: bool = False  # the insert call passes kv_cache_dtype: the kernel quantizes itself
    module_names: set[str] = field(default_factory=set)  # the module's other top-level classes and names
    custom_ops: dict[str, str] = field(default_factory=dict)  # ops the file registers -> its function
    compile_aware: bool = False  # the class or a module function asks torch.compiler.is_compiling()
    constants: dict[str, object] = field(default_factory=dict)  # module-level literals (roles.module_constants)
    class_constants: dict[str, object] = field(default_factory=dict)  # its (and its bases') literal class attributes
    settable: frozenset[str] | None = None  # what the file may set on the layer (_settable); None: anything
    binds: frozenset[str] | None = None  # what the module and __init__ bind at run time (runtime.bound_by); None: anything

    def fit(self, shape: Shape) -> Shape:
        """``shape`` with the sizes that one attribute of the file holds made equal: the
        file says they are (``self.num_kv_heads`` passed as num_index_heads, say)."""
        root = {size: size for size in SIZES}

        def find(size: str) -> str:
            while root[size] != size:
                size = root[size]
            return size

        for held in self.bindings.values():
            sizes = [size for size in held if size in SIZES]
            for size in sizes[1:]:
                first, other = sorted((find(sizes[0]), find(size)), key=SIZES.index)
                root[other] = first
        return replace(shape, **{size: getattr(shape, find(size)) for size in SIZES})


def _imports(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """Top-level imported names -> dotted origin (a ``try:``'s too: vLLM installed, the import succeeds); names
    bound to ``vllm._custom_ops``."""
    imported: dict[str, str] = {}
    top = [x for n in tree.body for x in (n.body if isinstance(n, ast.Try) else [n])]
    for node in top:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
    ops = {name for name, origin in imported.items() if origin.endswith("_custom_ops")}
    dotted = (a.name for n in top if isinstance(n, ast.Import) for a in n.names if a.asname is None)
    return imported, ops | {name for name in dotted if name.endswith("._custom_ops")}  # `import vllm._custom_ops`


def layer_classes(source: str) -> list[str]:
    """Classes with a method that calls the fused op (or a wrapper of it) with a main cache."""
    tree = ast.parse(source)
    wrappers = _wrappers(source)
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(f, ast.FunctionDef) and _calls_fused_with_cache(f, wrappers) for f in node.body)
    ]


def _compiled(fn: ast.FunctionDef, path: str) -> types.CodeType:
    """A def compiled on its own, decorators dropped, its line numbers kept."""
    bare = ast.FunctionDef(
        name=fn.name,
        args=fn.args,
        body=fn.body,
        decorator_list=[],
        returns=None,
        type_comment=None,
        **({"type_params": []} if hasattr(fn, "type_params") else {}),
    )
    ast.copy_location(bare, fn)
    return compile(ast.Module(body=[bare], type_ignores=[]), path, "exec", flags=_ANNOTATIONS, dont_inherit=True)


_ANNOTATIONS = __import__("__future__").annotations.compiler_flag


def load_layer(path: Path | str, class_name: str, source: str | None = None) -> LayerCode:
    """The class ``class_name`` of ``source`` (default: the file's text, read as ``run`` reads
    it), compiled as the file at ``path``."""
    path = str(path)
    text = source if source is not None else read_source(path)
    tree = ast.parse(text, filename=path)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise Unmodelled(f"{path}: no top-level class {class_name}")
    imported, ops = _imports(tree)
    methods: dict[str, types.CodeType] = {}
    decorators: dict[str, list[str]] = {}
    defs = names.class_methods(cls, tree)  # a mixin's defined in the file too, __init__ included
    for fn in defs.values():
        if fn.name.startswith("__"):
            continue
        kept = [d.id for d in fn.decorator_list if isinstance(d, ast.Name) and d.id in _KEPT_DECORATORS]
        methods[fn.name] = _compiled(fn, path)
        decorators[fn.name] = kept
    if "forward" not in methods:
        if any(isinstance(fn, ast.AsyncFunctionDef) and fn.name == "forward" for fn in cls.body):
            raise HarnessError(
                f"{path}: {class_name}.forward is `async def`: vLLM calls a layer's forward synchronously"
            )
        raise Unmodelled(f"{path}: {class_name} has no forward()")
    init = _init(defs.get("__init__"), path)
    wrappers = _wrappers(text)
    bindings = _bindings(cls, wrappers, defs.get("__init__"))
    native = any(
        _op_arg(call, schema.KV_CACHE_DTYPE, wrappers) is not None
        for call in _op_calls(cls, wrappers)
        if _calls_fused_with_cache(call, wrappers)
    )
    called = {
        chain[0]
        for node in ast.walk(cls)
        if isinstance(node, ast.Call) and (chain := _self_chain(node.func)) is not None and len(chain) == 1
    }
    functions = {f.name: _compiled(f, path) for f in tree.body if isinstance(f, ast.FunctionDef)}
    others = {n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name != class_name} | {
        t.id
        for n in tree.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    imports = names.import_table(tree)
    compile_aware = any(
        names.is_compiling(n, imports)
        for node in [cls, *(f for f in tree.body if isinstance(f, ast.FunctionDef))]
        for n in ast.walk(node)
    )
    return LayerCode(
        path, class_name, methods, decorators, init, ops, imported, bindings, called, functions, native,
        others - set(functions), _custom_ops(tree), compile_aware, roles.module_constants(tree, roles.NO_SCOPE),
        {  # (not ``__slots__``: the stand-in is no nn.Module, which keeps a ``__dict__`` whatever they say)
            k.removeprefix("self."): v
            for k, v in roles.module_constants(tree, roles.NO_SCOPE, cls).items() if k != "self.__slots__"
        },
        _settable(cls, tree, defs, imports), _binds(tree, defs.get("__init__"), imports),
    )


def _binds(tree: ast.Module, init: ast.FunctionDef | None, imports: dict[str, str]) -> frozenset[str] | None:
    """What a statement of ``__init__`` may read without NameError: what the module binds at run time
    (``runtime.Module``), and ``__init__``'s own names (one a statement the stand-in skipped binds is its gap)."""
    bound = runtime.Module.of(tree, imports).bound
    return None if bound is None else bound | runtime.bound_by(list(ast.walk(init)) if init else [])


def _settable(
    cls: ast.ClassDef, tree: ast.Module, defs: dict[str, ast.FunctionDef], imports: dict[str, str]
) -> frozenset[str] | None:
    """The attributes the file may set on a layer of ``cls``: its classes' names and ``self.`` stores, any
    string (a name ``setattr`` or ``register_buffer`` may take); None where ``__init__`` sets some by a name
    that cannot be read (``roles.set_by_name``). An attribute outside them that a method reads is the file's
    bug (an AttributeError in vLLM too), not code the stand-in does not run."""
    init = defs.get("__init__")
    scope = roles.Scope({}, defs, imports)
    if init is not None and any(roles.set_by_name(fn, imports) is None for fn in roles.init_methods(init, scope)):
        return None
    found: set[str] = set()
    for c in names.lineage(cls, tree):
        for node in ast.walk(c):
            if isinstance(getattr(node, "ctx", None), ast.Store) and (attr := names.self_member(node)):
                found.add(attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
        found |= {n.name for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        found |= {t.id for n in c.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    return frozenset(found)


def _custom_ops(tree: ast.Module) -> dict[str, str]:
    """``direct_register_custom_op(op_name="x", op_func=f, ...)`` at module level: ``torch.ops.vllm.x`` is ``f``."""
    found = {}
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if not (isinstance(call, ast.Call) and (names.callee(call) or "").endswith("register_custom_op")):
            continue
        kw = {k.arg: k.value for k in call.keywords}
        name, func = kw.get("op_name", call.args[0] if call.args else None), kw.get("op_func")
        if func is None and len(call.args) > 1:
            func = call.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and isinstance(func, ast.Name):
            found[name.value] = func.id
    return found


# What the fused op's parameters hold, where a call passes them a `self.` chain:
# an input of the stand-in, or a size of the Shape (names differ between files).
_BOUND_PARAMS = [
    (schema.OpParam(1, "q_norm_weight"), "q_norm_weight"),
    (schema.OpParam(2, "k_norm_weight"), "k_norm_weight"),
    (schema.OpParam(3, "cos_sin_cache"), "cos_sin_cache"),
    (schema.NUM_HEADS, "num_heads"),
    (schema.NUM_KV_HEADS, "num_kv_heads"),
    (schema.OpParam(7, "rotary_dim"), "rotary_dim"),
    (schema.OpParam(8, "eps"), "eps"),
    (schema.OpParam(9, "index_q_norm_weight"), "index_q_norm_weight"),
    (schema.OpParam(10, "index_k_norm_weight"), "index_k_norm_weight"),
    (schema.NUM_INDEX_HEADS, "num_idx_heads"),
    (schema.KV_CACHE, "kv_cache"),
    (schema.INDEX_CACHE, "index_cache"),
]
# The head size that goes with each norm weight (the op reads it off the weight) and
# with each head count.
_NORM_DIMS = {
    "q_norm_weight": "head_dim",
    "k_norm_weight": "head_dim",
    "index_q_norm_weight": "idx_head_dim",
    "index_k_norm_weight": "idx_head_dim",
}
_COUNT_DIMS = {"num_heads": "head_dim", "num_kv_heads": "head_dim", "num_idx_heads": "idx_head_dim"}


def _self_chain(node: ast.AST) -> tuple[str, ...] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return tuple(reversed(parts))
    return None


def _bindings(
    cls: ast.ClassDef, wrappers: dict[str, dict[int, schema.OpParam]], init_def: ast.FunctionDef | None
) -> dict[tuple[str, ...], tuple[str, ...]]:
    """What each ``self.`` chain holds (sizes first, in ``SIZES`` order), told by the
    file's own code - never by the widths a rewrite slices with:

    1. what the insert call passes it;
    2. a size it is named for (``self.head_dim``, ``self.num_idx_heads``);
    3. the head size of a norm whose weight the call passes, where ``__init__``
       builds the norm from it (``self.q_norm = RMSNorm(self.hd, ...)``: ``hd`` is head_dim);
    4. for a chain none of those name, ``self.W = <count> * self.D`` in ``__init__``
       with a count that holds one head count: ``D`` is that count's head size
       (not where products disagree); with a count that is both the kv and the index
       head count, a size other than the one known kv head size is the index head size.

    A chain that holds two sizes ties them: ``LayerCode.fit`` keeps them equal.
    """
    held: dict[tuple[str, ...], set[str]] = {}
    for call in ast.walk(cls):
        if not (isinstance(call, ast.Call) and _calls_fused_with_cache(call, wrappers)):
            continue
        for param, what in _BOUND_PARAMS:
            arg = _op_arg(call, param, wrappers)
            chain = _self_chain(arg) if arg is not None else None
            if chain is not None:
                held.setdefault(chain, set()).add(what)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and _self_chain(node) == (node.attr,) and node.attr in SIZES:
            held.setdefault((node.attr,), set()).add(node.attr)
    init = _init_values(init_def)
    # `self.A = self.B` where __init__ binds each once and both hold sizes: the file makes them one.
    bound = collections.Counter(name for name, _ in init)
    for name, value in init:
        other = _self_chain(value) or ()
        once = len(other) == 1 and bound[name] == bound[other[0]] == 1
        if once and other != (name,) and {(name,), other} <= held.keys():
            held[(name,)] |= held[other]
            held[other] |= held[(name,)]
    built = {name: value for name, value in init if isinstance(value, ast.Call) and value.args}
    for chain, what in list(held.items()):
        dims = {_NORM_DIMS[w] for w in what if w in _NORM_DIMS}
        norm = built.get(chain[0]) if len(chain) == 2 and chain[1] == "weight" else None
        size = _self_chain(norm.args[0]) if norm is not None else None
        if dims and size is not None and len(size) == 1:
            held.setdefault(size, set()).update(dims)
    products: dict[tuple[str, ...], set[str]] = {}
    tied: list[tuple[str, ...]] = []  # sizes multiplied by a count that is both the kv and the index count
    for _, value in init:
        if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
            continue
        for count, size in ((value.left, value.right), (value.right, value.left)):
            counts = held.get(_self_chain(count) or (), set()) & set(_COUNT_DIMS)
            size_chain = _self_chain(size)
            if size_chain is None or len(size_chain) != 1 or size_chain in held:
                continue
            if len(counts) == 1:
                products.setdefault(size_chain, set()).add(_COUNT_DIMS[counts.pop()])
            elif counts == {"num_kv_heads", "num_idx_heads"}:
                tied.append(size_chain)
    held |= {size: dims for size, dims in products.items() if len(dims) == 1}
    # With the kv head size known, the tied count's other size is the index head size.
    heads = [chain for chain, what in held.items() if "head_dim" in what and len(chain) == 1]
    others = {size for size in tied if size not in held and size not in heads}
    if len(heads) == 1 and len(others) == 1:
        held[others.pop()] = {"idx_head_dim"}
    return {
        chain: (*[size for size in SIZES if size in what], *sorted(what - set(SIZES)))
        for chain, what in held.items()
    }


def _init_values(init: ast.FunctionDef | None) -> list[tuple[str, ast.expr]]:
    """``self.X = <value>`` statements of the class's ``__init__`` (its own or a base's): (X, value)."""
    return [
        (target.attr, stmt.value)
        for stmt in (ast.walk(init) if init is not None else ())
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
        for target in stmt.targets
        if isinstance(target, ast.Attribute) and _self_chain(target) == (target.attr,)
    ]


@dataclass
class Init:
    """``__init__`` as statements to run one by one on the stand-in (one that raises is skipped:
    it builds a vLLM layer the stand-in does not model), and its parameters' defaults."""

    statements: list[types.CodeType]
    params: dict[str, Any]


def _init(fn: ast.FunctionDef | None, path: str) -> Init:
    if fn is None:
        return Init([], {})
    args = [*fn.args.posonlyargs, *fn.args.args][1:]
    defaults = dict(zip([a.arg for a in args][len(args) - len(fn.args.defaults):], fn.args.defaults))
    defaults |= {a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None}
    params = {
        a.arg: (d.value if isinstance(d, ast.Constant) else None)
        for a in [*args, *fn.args.kwonlyargs]
        for d in [defaults.get(a.arg)]
    }
    statements = [
        compile(ast.Module([_Returns().visit(stmt)], []), path, "exec", flags=_ANNOTATIONS, dont_inherit=True)
        for stmt in fn.body
    ]
    return Init(statements, params)


class Returned(BaseException):
    """``__init__`` returned here (its ``return``, run one statement at a time, raises this)."""


class _Returns(ast.NodeTransformer):
    """``return`` in ``__init__``'s own code -> ``raise Returned`` (it is no function when run so)."""

    def visit_Return(self, node: ast.Return) -> ast.AST:
        raise_ = ast.Raise(exc=ast.Name(Returned.__name__, ast.Load()), cause=None)
        return ast.fix_missing_locations(ast.copy_location(raise_, node))

    def visit_FunctionDef(self, node: ast.AST) -> ast.AST:  # a nested def's own returns stay
        return node

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef
