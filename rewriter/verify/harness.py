"""Execute a layer class's own ``forward`` / ``_insert_kv`` code on a stand-in.

The methods are compiled from the model file itself (their original line
numbers kept, so tracebacks point into the file); ``__init__`` is not run - it
builds vLLM layers - but its ``self.<attr> = <expr of self only>`` statements
are, so sizes and the ``_fp8_kv`` flag come from the file too. The stand-in
supplies the tensors and the collaborators the methods call (projections,
indexer, attention impl, forward context); the ops are a backend: the
plain-PyTorch references (:mod:`rewriter.verify.refops`) or vLLM's kernels.

One run with a bf16 cache (``kv_cache_dtype="auto"``, the fused insert) and one
with an fp8 cache (``"fp8"``, uint8 storage, the bypass) on the same inputs are
then compared by :func:`compare_runs`.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import re
import traceback
import types
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from codemods import schema
from codemods.schema import FUSED_OP, KV_CACHE, RESHAPE_OP

from . import refops

# Decorators kept when a method is compiled out of its class; others (vLLM's
# capture helpers, say) are dropped because they only wrap the call.
_KEPT_DECORATORS = {"property", "staticmethod", "classmethod"}


class HarnessError(Exception):
    """The file cannot be executed on the stand-in (not a failure of the bypass)."""


class StandInGap(Exception):
    """What the file needs here is something the stand-in does not model: not the file's fault."""


@dataclass(frozen=True)
class Shape:
    """Sizes of the stand-in layer. The default is the kernel level's: head dims 128 as
    the real kernels require, one index-q head per kv head as in the fork's layout."""

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

    @property
    def width(self) -> int:
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim + 2 * kv + (self.num_idx_heads + 1) * self.idx_head_dim

    def __str__(self) -> str:
        return (
            f"{self.num_heads} q / {self.num_kv_heads} kv / {self.num_idx_heads} index heads, "
            f"head dims {self.head_dim} / index {self.idx_head_dim}, rotary {self.rotary_dim}"
        )


# The sizes a file's attributes can hold. Where one attribute holds several (the
# file ties them), they take the value of the first in this order (LayerCode.fit).
SIZES = ("num_heads", "num_kv_heads", "num_idx_heads", "head_dim", "idx_head_dim", "rotary_dim")

# The semantic level's sizes: all different, so that no width, head count or head
# size can stand in for another. head_dim < idx_head_dim: an index key sliced with
# head_dim comes out short (a slice too wide clips at the end of qkv, harmlessly -
# the index key is its last part in vLLM too).
DISTINCT = Shape(num_heads=6, num_kv_heads=2, num_idx_heads=3, head_dim=64, idx_head_dim=128, rotary_dim=32)


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


def _wrappers(text: str) -> dict[str, dict[int, schema.OpParam]]:
    """The file's pass-through wrappers of the op, as the codemod finds them."""
    import libcst

    from codemods.anchors import pass_through_wrappers

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
    """Top-level imported names -> dotted origin; names bound to ``vllm._custom_ops``."""
    imported: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
    ops = {name for name, origin in imported.items() if origin.endswith("_custom_ops")}
    return imported, ops


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
    path = str(path)
    text = source if source is not None else Path(path).read_text(encoding="utf-8-sig")
    tree = ast.parse(text, filename=path)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise HarnessError(f"{path}: no top-level class {class_name}")
    imported, ops = _imports(tree)
    methods: dict[str, types.CodeType] = {}
    decorators: dict[str, list[str]] = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        if fn.name.startswith("__"):
            continue
        kept = [d.id for d in fn.decorator_list if isinstance(d, ast.Name) and d.id in _KEPT_DECORATORS]
        methods[fn.name] = _compiled(fn, path)
        decorators[fn.name] = kept
    if "forward" not in methods:
        raise HarnessError(f"{path}: {class_name} has no forward()")
    init = _init(cls, path)
    wrappers = _wrappers(text)
    bindings = _bindings(cls, wrappers)
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
    compile_aware = any(
        isinstance(n, ast.Call) and schema.is_compiling(n)
        for node in [cls, *(f for f in tree.body if isinstance(f, ast.FunctionDef))]
        for n in ast.walk(node)
    )
    return LayerCode(
        path, class_name, methods, decorators, init, ops, imported, bindings, called, functions, native,
        others - set(functions), _custom_ops(tree), compile_aware,
    )


def _custom_ops(tree: ast.Module) -> dict[str, str]:
    """``direct_register_custom_op(op_name="x", op_func=f, ...)`` at module level: ``torch.ops.vllm.x`` is ``f``."""
    found = {}
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if not (isinstance(call, ast.Call) and (schema.callee(call) or "").endswith("register_custom_op")):
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
    cls: ast.ClassDef, wrappers: dict[str, dict[int, schema.OpParam]]
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
    init = _init_values(cls)
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


def _init_values(cls: ast.ClassDef) -> list[tuple[str, ast.expr]]:
    """``self.X = <value>`` statements of the class's ``__init__``: (X, value)."""
    inits = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    return [
        (target.attr, stmt.value)
        for stmt in (ast.walk(inits[-1]) if inits else ())
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


def _init(cls: ast.ClassDef, path: str) -> Init:
    inits = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    if not inits:
        return Init([], {})
    fn = inits[-1]
    args = [*fn.args.posonlyargs, *fn.args.args][1:]
    defaults = dict(zip([a.arg for a in args][len(args) - len(fn.args.defaults):], fn.args.defaults))
    defaults |= {a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None}
    params = {
        a.arg: (d.value if isinstance(d, ast.Constant) else None)
        for a in [*args, *fn.args.kwonlyargs]
        for d in [defaults.get(a.arg)]
    }
    statements = [
        compile(ast.Module(body=[stmt], type_ignores=[]), path, "exec", flags=_ANNOTATIONS, dont_inherit=True)
        for stmt in fn.body
    ]
    return Init(statements, params)


# --- the stand-in ----------------------------------------------------------------


@dataclass
class Backend:
    """The two ops, with the fork's Python signatures (positional or keyword)."""

    name: str
    fused: Callable[..., None]
    reshape_and_cache_flash: Callable[..., None]


REFERENCE = Backend(
    "reference", refops.fused_minimax_m3_qknorm_rope_kv_insert, refops.reshape_and_cache_flash
)


FUSED_SIGNATURE = inspect.signature(refops.fused_minimax_m3_qknorm_rope_kv_insert)


class _Recorder:
    """Collaborators of the layer: record what reaches attention, return shapes."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.qkv: torch.Tensor | None = None  # the buffer the fused op was handed
        self.query: torch.Tensor | None = None
        self.index_query: torch.Tensor | None = None
        self.q_out: torch.Tensor | None = None
        self.index_q_out: torch.Tensor | None = None

    def fused(self, op: Callable[..., None]) -> Callable[..., None]:
        """The op, noting the buffer it reads and the q / index_q buffers it writes."""

        def call(*args: Any, **kwargs: Any) -> None:
            try:
                bound = FUSED_SIGNATURE.bind(*args, **kwargs).arguments
            except TypeError as exc:
                raise StandInGap(f"the call passes what the fork's 20-argument op does not take ({exc})") from exc
            qkv = bound.get("qkv")
            if isinstance(qkv, torch.Tensor) and qkv.shape[-1] != self.width:
                raise StandInGap(
                    f"the file's projections build a {qkv.shape[-1]}-wide buffer where the stand-in's "
                    f"[q | k | v | index_q | index_k] is {self.width} wide: its projections are not modelled"
                )
            self.qkv = qkv if self.qkv is None else self.qkv
            self.q_out = bound.get("q_out", self.q_out)
            self.index_q_out = bound.get("index_q_out", self.index_q_out)
            op(*args, **kwargs)

        return call

    def sink(self, *args: Any, **kwargs: Any) -> Any:
        """A collaborator the file calls but does not define (attention, say)."""
        return next((x for x in args if isinstance(x, torch.Tensor)), None)


class _Indexer:
    def __init__(self, rec: _Recorder, index_cache: Any) -> None:
        self._rec = rec
        self.index_cache = index_cache

    def __call__(self, index_query: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self._rec.index_query = index_query.clone()

    forward_with_cache = __call__  # the compiled path's attention op hands the cache over too


class _Impl:
    def __init__(self, rec: _Recorder) -> None:
        self._rec = rec

    def forward(self, layer: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._rec.query = query.clone()
        return next((x for x in reversed(args) if isinstance(x, torch.Tensor)), None)  # the output buffer


class _Imported:
    """A name the file imports and the stand-in does not model: called, it hands back the string it
    is given (vLLM's layer-name helpers), else another such value; anything else it cannot answer."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], str):
            return args[0]
        return _Imported(f"{self._name}(...)")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Imported(f"{self._name}.{attr}")

    def __getitem__(self, key: Any) -> Any:
        return _Imported(f"{self._name}[...]")

    def __contains__(self, item: Any) -> bool:
        return False

    def __iter__(self) -> Any:
        raise StandInGap(f"`{self._name}` is not modelled by the stand-in")

    def __repr__(self) -> str:
        return f"<stand-in for {self._name}>"


class _Projection:
    """A linear layer the file builds in __init__: ``(output, None)`` of the width it builds it
    with (seeded by its name, so every run reads the same), or the whole fused buffer."""

    def __init__(self, width: int | None) -> None:
        self.width = width
        self.full: torch.Tensor | None = None  # set by the stand-in: the whole [q|k|v|index_q|index_k]

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if self.width is None:
            assert self.full is not None
            return self.full.clone(), None
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        out = (torch.randn(x.shape[0], self.width, generator=g) * 2.0).to(torch.bfloat16)
        return out.to(x.device), None

    seed = 0  # the stand-in seeds each by the attribute that holds it


def _linear_width(name: str, args: tuple, kwargs: dict) -> int | None:
    """The output width of vLLM's linear layers at tensor-parallel size 1, from their arguments."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    try:
        if name == "QKVParallelLinear":
            head, heads = int(arg(1, "head_size")), int(arg(2, "total_num_heads"))
            kv = int(arg(3, "total_num_kv_heads") or heads)
            return (heads + kv) * head + kv * int(kwargs.get("v_head_size") or head)
        if name in ("ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear"):
            return int(arg(1, "output_size"))
        if name == "MergedColumnParallelLinear":
            return sum(int(x) for x in arg(1, "output_sizes"))
    except (TypeError, ValueError):
        return None
    return None


class _LinearClass:
    """An imported ``…Linear…`` class: building one gives a ``_Projection``."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> _Projection:
        return _Projection(_linear_width(self._name, args, kwargs))


# The stand-in runs as tensor-parallel rank 0 of 1.
_TP = {"get_tensor_model_parallel_world_size": 1, "get_tensor_model_parallel_rank": 0}


def _ops_namespace(backend: Backend) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{FUSED_OP: backend.fused, RESHAPE_OP: backend.reshape_and_cache_flash})


class _Compiler(types.ModuleType):
    """``torch.compiler`` / ``torch._dynamo`` answering ``is_compiling()`` for the run's path."""

    def __init__(self, real: Any, compiling: bool) -> None:
        super().__init__(real.__name__)
        self._real = real
        self.is_compiling = lambda: compiling

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _TorchProxy(types.ModuleType):
    """``torch`` with ``torch.ops._C.<fused>`` / ``torch.ops._C_cache_ops.<reshape>`` redirected;
    ``torch.ops.vllm`` (where forks register custom ops) holds the fused op and the file's own ops;
    ``torch.compiler.is_compiling()`` says which path the run takes."""

    def __init__(self, backend: Backend, compiling: bool = False) -> None:
        super().__init__("torch")
        ns = _ops_namespace(backend)
        self.ops = types.SimpleNamespace(_C=ns, _C_cache_ops=ns, vllm=types.SimpleNamespace(**{FUSED_OP: backend.fused}))
        self._compiling = compiling

    def __getattr__(self, name: str) -> Any:
        if name in ("compiler", "_dynamo"):  # looked up only when the file asks (dynamo is heavy)
            return _Compiler(getattr(torch, name), self._compiling)
        return getattr(torch, name)


@dataclass
class Inputs:
    """One set of random inputs; every run gets its own clones."""

    shape: Shape
    device: str
    qkv: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    weights: dict[str, torch.Tensor]
    main_slots: torch.Tensor
    index_slots: torch.Tensor

    @property
    def valid_main(self) -> torch.Tensor:
        return self.main_slots >= 0

    @property
    def valid_index(self) -> torch.Tensor:
        return self.index_slots >= 0

    @classmethod
    def random(cls, shape: Shape, device: str = "cpu", seed: int = 0) -> Inputs:
        g = torch.Generator(device="cpu").manual_seed(seed)
        slots_total = shape.num_blocks * shape.block_size
        if shape.tokens >= slots_total:
            raise ValueError("more tokens than cache slots")

        def slots() -> torch.Tensor:
            # Never the last slot, where a padded token's write would land
            # (index -1); padded tokens at the end of the batch, as vLLM pads.
            chosen = torch.randperm(slots_total - 1, generator=g)[: shape.tokens]
            chosen[shape.tokens - shape.padded :] = -1
            return chosen.to(device)

        def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*size, generator=g) * scale).to(torch.bfloat16).to(device)

        inv = 1.0 / (10000 ** (torch.arange(0, shape.rotary_dim, 2).float() / shape.rotary_dim))
        freqs = torch.arange(shape.max_position).float()[:, None] * inv[None, :]
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.bfloat16).to(device)
        return cls(
            shape=shape,
            device=device,
            qkv=rand(shape.tokens, shape.width, scale=2.0),
            positions=torch.randint(0, shape.max_position, (shape.tokens,), generator=g).to(device),
            cos_sin_cache=cos_sin,
            weights={
                name: rand(dim, scale=0.1)
                for name, dim in (
                    ("q_norm", shape.head_dim),
                    ("k_norm", shape.head_dim),
                    ("index_q_norm", shape.idx_head_dim),
                    ("index_k_norm", shape.idx_head_dim),
                )
            },
            main_slots=slots(),
            index_slots=slots(),
        )


@dataclass
class RunResult:
    """What one run of ``forward`` left behind (or how it failed)."""

    mode: str
    qkv: torch.Tensor | None = None
    query: torch.Tensor | None = None
    index_query: torch.Tensor | None = None
    kv_cache: torch.Tensor | None = None
    index_cache: torch.Tensor | None = None
    error: str | None = None
    traceback: list[str] = field(default_factory=list)
    gap: str | None = None  # the error is the stand-in's limit, not the file's fault


# The bypass's own attributes: a missing one is the file's bug, never the stand-in's.
_BYPASS_ATTRS = (schema.FP8_FLAG, schema.FP8_SCALE)


def _made_here(value: Any) -> bool:
    """A value the stand-in made up for something it does not model."""
    return isinstance(value, _Imported) or getattr(value, "__func__", None) is _Recorder.sink


def _gap(exc: BaseException, layer: Any, frame: types.FrameType | None) -> str | None:
    """Why ``exc`` is the stand-in's limit rather than the file's fault, if it is."""
    if isinstance(exc, StandInGap):
        return str(exc)
    if isinstance(exc, AttributeError) and exc.obj is layer and exc.name not in _BYPASS_ATTRS:
        return f"the stand-in lacks `self.{exc.name}` (set by __init__ code it does not run)"
    if frame is None:
        return None
    # The failing line reads a name or `self.` attribute the stand-in made up.
    line = inspect.getframeinfo(frame).code_context or [""]
    here = frame.f_locals
    for name in set(re.findall(r"\bself\.(\w+)", line[0])):
        owner = here.get("self")
        if owner is not None and _made_here(owner.__dict__.get(name)):
            return f"`self.{name}` is not modelled by the stand-in"
    for name in set(re.findall(r"\b(\w+)\b", line[0])):
        value = here.get(name, frame.f_globals.get(name))
        if _made_here(value):
            return f"`{name}` is not modelled by the stand-in"
    return None


MODES = {"bf16": ("auto", torch.bfloat16), "fp8": ("fp8", torch.uint8)}
COMPILED = " compiled"  # a mode's suffix: the run takes the torch.compile path (is_compiling() is True)
LAYER_NAME = "model.layers.3.self_attn.attn"
INDEX_PREFIX = "model.layers.3.self_attn.attn.indexer.k_cache"


def _config(s: Shape) -> types.SimpleNamespace:
    """MiniMax-M3's config, in the stand-in's sizes (what ``__init__`` reads them from)."""
    return types.SimpleNamespace(
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=s.eps,
        max_position_embeddings=s.max_position,
        rope_theta=10000.0,
        partial_rotary_factor=s.rotary_dim / s.head_dim,
        sparse_attention_config={
            "sparse_num_index_heads": s.num_idx_heads,
            "sparse_index_dim": s.idx_head_dim,
            "sparse_topk_blocks": 4,
            "sparse_block_size": s.block_size,
        },
    )


def _pinned_setattr(self: Any, name: str, value: Any) -> None:
    if name not in type(self).pinned:
        object.__setattr__(self, name, value)


def _standin(
    code: LayerCode, backend: Backend, inputs: Inputs, mode: str
) -> tuple[Any, _Recorder, dict]:
    s, dev = inputs.shape, inputs.device
    compiling = mode.endswith(COMPILED)
    cache_dtype_name, cache_dtype = MODES[mode.removesuffix(COMPILED)]
    rec = _Recorder(s.width)
    qkv = inputs.qkv.clone()
    kv_cache = torch.zeros(
        s.num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=cache_dtype, device=dev
    )
    index_cache = torch.zeros(s.num_blocks, s.block_size, s.idx_head_dim, dtype=torch.bfloat16, device=dev)
    meta = types.SimpleNamespace
    ctx = meta(
        slot_mapping={LAYER_NAME: inputs.main_slots, INDEX_PREFIX: inputs.index_slots},
        attn_metadata={
            LAYER_NAME: meta(slot_mapping=inputs.main_slots),
            INDEX_PREFIX: meta(slot_mapping=inputs.index_slots),
        },
        no_compile_layers={},
    )
    backend = Backend(backend.name, rec.fused(backend.fused), backend.reshape_and_cache_flash)
    torch_proxy = _TorchProxy(backend, compiling)
    namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": f"mm3_standin_{code.class_name}"}
    for name in code.module_names:
        namespace[name] = _Imported(name)
    for name, origin in code.imported.items():
        if origin.endswith("." + FUSED_OP):
            namespace[name] = backend.fused
        elif origin.endswith("." + RESHAPE_OP):
            namespace[name] = backend.reshape_and_cache_flash
        elif name == "get_forward_context":
            namespace[name] = lambda: ctx
        elif name.endswith("Metadata"):
            namespace[name] = meta  # the isinstance() asserts of attn_metadata readers
        elif name in _TP:
            namespace[name] = (lambda value: lambda *a, **k: value)(_TP[name])
        elif "Linear" in name:
            namespace[name] = _LinearClass(name)
        else:
            namespace[name] = _Imported(name)
    namespace["torch"] = torch_proxy
    for alias in code.ops_aliases:
        namespace[alias] = _ops_namespace(backend)
    for fn_code in code.functions.values():
        exec(fn_code, namespace)  # the module's own helpers and wrappers, as the file defines them
    for op_name, fn_name in code.custom_ops.items():  # torch.ops.vllm.<op>: the file's own body runs
        setattr(torch_proxy.ops.vllm, op_name, namespace[fn_name])
    attrs: dict[str, Any] = {"pinned": frozenset(), "__setattr__": _pinned_setattr}
    for name, fn_code in code.methods.items():
        exec(fn_code, namespace)  # defines the function under its own name
        fn = namespace.pop(name)
        for deco in code.decorators[name]:
            fn = getattr(builtins, deco)(fn)
        attrs[name] = fn
    cls = type(f"{code.class_name}StandIn", (), attrs)
    namespace[code.class_name] = cls  # `isinstance(layer, <the class>)` in the file's own ops
    layer = cls()
    ctx.no_compile_layers[LAYER_NAME] = layer
    weights = inputs.weights
    norm = types.SimpleNamespace
    full = _Projection(None)
    full.full = qkv
    values: dict[str, Any] = {
        "hidden_size": s.hidden_size,
        "scaling": s.head_dim**-0.5,
        "layer_name": LAYER_NAME,
        "kv_cache_dtype": cache_dtype_name,
        "kv_cache_torch_dtype": cache_dtype,
        "q_norm": norm(weight=weights["q_norm"], variance_epsilon=s.eps),
        "k_norm": norm(weight=weights["k_norm"], variance_epsilon=s.eps),
        "index_q_norm": norm(weight=weights["index_q_norm"], variance_epsilon=s.eps),
        "index_k_norm": norm(weight=weights["index_k_norm"], variance_epsilon=s.eps),
        "rotary_emb": norm(cos_sin_cache=inputs.cos_sin_cache, rotary_dim=s.rotary_dim, head_size=s.head_dim),
        "kv_cache": kv_cache,
        "indexer": _Indexer(rec, norm(prefix=INDEX_PREFIX, kv_cache=index_cache, dtype=index_cache.dtype)),
        "impl": _Impl(rec),
        "o_proj": lambda x: (x, None),
    }
    # What vLLM's set_default_quant_scales(layer) gives a layer in __init__ (a call
    # the stand-in does not run): identity scales, on the device and on the host.
    for scale in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale"):
        values[scale] = torch.ones((), dtype=torch.float32, device=dev)
        values[f"{scale}_float"] = 1.0
    for name, value in values.items():
        setattr(layer, name, value)
    value_of = {
        "q_norm_weight": weights["q_norm"],
        "k_norm_weight": weights["k_norm"],
        "cos_sin_cache": inputs.cos_sin_cache,
        "eps": s.eps,
        "index_q_norm_weight": weights["index_q_norm"],
        "index_k_norm_weight": weights["index_k_norm"],
        "kv_cache": kv_cache,
        "index_cache": index_cache,
        **{size: getattr(s, size) for size in SIZES},
    }
    for chain, what in code.bindings.items():
        owner = layer
        for part in chain[:-1]:
            if not hasattr(owner, part):
                setattr(owner, part, types.SimpleNamespace())
            owner = getattr(owner, part)
        setattr(owner, chain[-1], value_of[what[0]])  # a tie's first size: its value (LayerCode.fit)
        values.setdefault(chain[0], None)
    # __init__ itself, statement by statement, on the stand-in's sizes (tensor-parallel size 1);
    # what the stand-in set above stays, and a statement that raises is skipped.
    cls.pinned = frozenset(values)
    local = code.init.params | {
        "self": layer,
        "config": _config(s),
        "prefix": LAYER_NAME.removesuffix(".attn"),
        "quant_config": None,
        "cache_config": types.SimpleNamespace(cache_dtype=cache_dtype_name, block_size=s.block_size),
    }
    for statement in code.init.statements:
        try:
            with torch.device(dev):  # vLLM builds its layers on the target device
                exec(statement, namespace, local)
        except Exception:  # builds something the stand-in does not model
            continue
    cls.pinned = frozenset()
    if not isinstance(getattr(layer, "qkv_proj", None), _Projection):
        layer.qkv_proj = full  # one fused projection: the whole buffer
    for name, value in vars(layer).items():
        if isinstance(value, _Projection):
            value.full, value.seed = qkv, zlib.crc32(name.encode())
    for name in code.called_attrs - set(code.methods):
        if not hasattr(layer, name):
            setattr(layer, name, rec.sink)
    return layer, rec, {"kv_cache": kv_cache, "index_cache": index_cache}


def _traceback_tail(exc: BaseException, path: str, limit: int = 4) -> list[str]:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
    lines = [f"{Path(f.filename).name}:{f.lineno} in {f.name}: {f.line}" for f in frames[-limit:]]
    return lines + [f"{type(exc).__name__}: {exc}"]


def _last_file_frame(exc: BaseException, path: str) -> types.FrameType | None:
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            found = tb.tb_frame
        tb = tb.tb_next
    return found


def run_layer(code: LayerCode, backend: Backend, inputs: Inputs, mode: str) -> RunResult:
    """Run the layer's ``forward`` once with a ``mode`` cache ("bf16" or "fp8", eager; with
    `` compiled`` the path it takes under torch.compile)."""
    layer, rec, state = _standin(code, backend, inputs, mode)
    hidden = torch.zeros(
        inputs.shape.tokens, inputs.shape.hidden_size, dtype=torch.bfloat16, device=inputs.device
    )
    result = RunResult(mode)
    try:
        layer.forward(inputs.positions.clone(), hidden)
        if inputs.device != "cpu":
            torch.cuda.synchronize()
    except Exception as exc:  # the layer's own failure is the finding
        frame = _last_file_frame(exc, code.path)
        gap = _gap(exc, layer, frame)
        result.traceback = _traceback_tail(exc, code.path)
        where = ""
        if frame is not None:
            info = inspect.getframeinfo(frame)
            text = " ".join((info.code_context or [""])[0].split())
            where = f" (at {Path(code.path).name}:{info.lineno} in {info.function})"
            if gap is not None:
                gap = f"the stand-in cannot run {Path(code.path).name}:{info.lineno} `{text}`: {gap}"
        result.gap = gap
        result.error = f"{type(exc).__name__}: {exc}{where}"
        return result
    result.qkv = rec.qkv
    result.query = rec.query if rec.query is not None else rec.q_out
    result.index_query = rec.index_query if rec.index_query is not None else rec.index_q_out
    result.kv_cache = state["kv_cache"]
    result.index_cache = state["index_cache"]
    return result


# --- the comparison ---------------------------------------------------------------


@dataclass
class Comparison:
    passed: bool
    reason: str
    checks: dict[str, bool]
    gap: bool = False  # not run to the end for the stand-in's sake: neither passed nor failed


def compare_runs(inputs: Inputs, bf16: RunResult, fp8: RunResult, native: bool = False) -> Comparison:
    """The bypass (fp8 run) must store what the fused insert (bf16 run) stores, quantized;
    ``native``: the call passes kv_cache_dtype, the kernel quantizes by itself."""
    for run in (bf16, fp8):
        if run.gap is not None:
            return Comparison(False, run.gap, {}, gap=True)
        if run.error is not None:
            return Comparison(False, f"{run.mode} run failed: {run.error}", {})
        if run.qkv is None:
            return Comparison(False, f"{run.mode} run never called the fused op", {})
    assert bf16.kv_cache is not None and fp8.kv_cache is not None and bf16.qkv is not None
    s = inputs.shape
    checks: dict[str, bool] = {}
    checks["attention got q"] = bf16.query is not None and fp8.query is not None
    checks["attention got index_q"] = bf16.index_query is not None and fp8.index_query is not None
    if checks["attention got q"]:
        checks["q identical"] = torch.equal(bf16.query, fp8.query)
    if checks["attention got index_q"]:
        checks["index_q identical"] = torch.equal(bf16.index_query, fp8.index_query)
    checks["index cache identical"] = torch.equal(bf16.index_cache, fp8.index_cache)

    valid = inputs.valid_main
    slots = inputs.main_slots[valid].long()
    total = s.num_blocks * s.block_size
    written = torch.zeros(total, dtype=torch.bool, device=slots.device)
    written[slots] = True
    ref_rows = bf16.kv_cache.permute(0, 2, 1, 3, 4).reshape(total, -1)  # [slot, (k|v)]
    fp8_rows = fp8.kv_cache.permute(0, 2, 1, 3, 4).reshape(total, -1)
    # The fused insert wrote exactly the normed/roped k and raw v that qkv holds.
    kv = s.num_kv_heads * s.head_dim
    k0 = s.num_heads * s.head_dim
    expect = bf16.qkv[valid, k0 : k0 + 2 * kv]  # [k | v] per token, as the rows are laid out
    checks["bf16 run wrote every slot"] = torch.equal(ref_rows[slots], expect)
    if native:
        # A native kernel may convert from float before rounding to bf16: each
        # element within one e4m3 step of the bf16 value (a wrong layout is far off).
        checks["fp8 cache within one e4m3 step of the bf16 cache at every written slot"] = bool(
            refops.e4m3_steps(fp8_rows[slots], ref_rows[slots]).max() <= 1.0
        )
    else:
        # The bypass quantizes the bf16 k/v it is handed: bit for bit.
        checks["fp8 cache = e4m3(bf16 cache) at every written slot"] = torch.equal(
            fp8_rows[slots], refops.to_e4m3_bits(ref_rows[slots])
        )
    checks["unwritten slots untouched"] = bool(
        (ref_rows[~written] == 0).all() and (fp8_rows[~written] == 0).all()
    )
    if s.padded:
        # What the fused op does with slot -1 (nothing) the bypass must do too:
        # a padded token's write lands in the last row of a cache indexed by slot.
        index_rows = s.num_blocks * s.block_size
        index_written = torch.zeros(index_rows, dtype=torch.bool, device=slots.device)
        index_written[inputs.index_slots[inputs.valid_index].long()] = True
        checks[f"padded tokens (slot -1, last {s.padded}) wrote nothing"] = all(
            bool((rows[~mask] == 0).all())
            for rows, mask in (
                (fp8_rows, written),
                (fp8.index_cache.reshape(index_rows, -1), index_written),
                (bf16.index_cache.reshape(index_rows, -1), index_written),
            )
        )
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        return Comparison(False, "; ".join(failed) + ": no", checks)
    return Comparison(
        True,
        f"{len(checks)} checks, {s.tokens} tokens ({s.padded} padded), {s.num_kv_heads}x{s.head_dim} kv",
        checks,
    )


def check_layer(code: LayerCode, backend: Backend, inputs: Inputs) -> tuple[Comparison, list[RunResult]]:
    """bf16 against fp8 in eager; for a file that asks ``torch.compiler.is_compiling()``, the same
    on the path it takes under torch.compile, whose caches must also be eager's (bf16)."""
    bf16 = run_layer(code, backend, inputs, "bf16")
    fp8 = run_layer(code, backend, inputs, "fp8")
    result = compare_runs(inputs, bf16, fp8, native=code.native)
    if not code.compile_aware or not result.passed:
        return result, [bf16, fp8]
    runs = [run_layer(code, backend, inputs, mode + COMPILED) for mode in ("bf16", "fp8")]
    compiled = compare_runs(inputs, *runs, native=code.native)
    checks = result.checks | {f"compiled: {name}": ok for name, ok in compiled.checks.items()}
    if compiled.passed:
        checks["compiled: caches = eager's (bf16)"] = torch.equal(runs[0].kv_cache, bf16.kv_cache) and torch.equal(
            runs[0].index_cache, bf16.index_cache
        )
    failed = [name for name, ok in checks.items() if not ok]
    if compiled.gap or (not compiled.passed and not compiled.checks):
        return replace(compiled, reason=f"compiled path: {compiled.reason}", checks=checks), [bf16, fp8, *runs]
    if failed:
        return Comparison(False, "; ".join(failed) + ": no", checks), [bf16, fp8, *runs]
    return Comparison(True, f"{result.reason}; eager and compiled paths", checks), [bf16, fp8, *runs]
