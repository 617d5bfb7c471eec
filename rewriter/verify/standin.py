"""The stand-in a layer's compiled methods run on: its tensors, collaborators and ops.

:func:`_standin` builds the layer for one run: a class of the file's methods in a
namespace where the file's imports are stand-ins - the fused op and the reshape op
of a :class:`Backend` (the plain-PyTorch references of :mod:`rewriter.verify.refops`
or vLLM's kernels), the forward context, the tensor-parallel size and rank of the
shape's ``parallel`` (TP=1 unless it says otherwise), vLLM's linear layers answering
seeded outputs of this rank's width for what they are built with, the few vLLM
helpers of ``VLLM_HELPERS`` and the attention config's indexer dtype as vLLM defines
them, anything else a value that answers nothing. It sets what ``forward`` reads from
:class:`Inputs` (projections, norms, rotary cache, caches, indexer, attention impl,
quant scales), then runs ``__init__`` statement by statement on MiniMax-M3's config
(the model's head counts across the ranks, the stand-in's head sizes).
The collaborators record what reaches attention; :func:`_gap` tells a failure that
is the stand-in's limit from the file's fault.
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import functools
import inspect
import re
import types
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from codemods.names import COMPILE_TESTS
from codemods.schema import DTYPE_ATTR, FUSED_OP, RESHAPE_OP

from . import refops
from .layercode import SIZES, LayerCode, Returned, Shape
from .vllm_parts import TP, VLLM_HELPERS, StandInGap, linear_width


@dataclass
class Backend:
    """The two ops, with the fork's Python signatures (positional or keyword)."""

    name: str
    fused: Callable[..., None]
    reshape_and_cache_flash: Callable[..., None]
    # The fused op takes a float8_e4m3fn index cache (the forks that allow indexer_kv_dtype
    # "fp8"): the layer can be run with one. Known of the references only.
    fp8_index: bool = False


REFERENCE = Backend(
    "reference", refops.fused_minimax_m3_qknorm_rope_kv_insert, refops.reshape_and_cache_flash, fp8_index=True
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
                raise StandInGap(f"the call passes what the op the stand-in models does not take ({exc})") from exc
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


class _Submodule(types.SimpleNamespace):
    """A module of the layer the stand-in models by what the op reads of it (a norm's weight, the rotary
    cache): calling it, or asking it for more, is what the stand-in does not run."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StandInGap("the file calls a module of the layer (a norm, the rotary embedding) that the stand-in models "
                         "by the tensors the op reads of it alone")


class _IndexCache:
    """The indexer's cache layer as vLLM builds it: its cache, dtype and prefix, and the dtype of
    the index query it reads (e4m3 for an fp8 index cache, else bf16)."""

    def __init__(self, prefix: str, kv_cache: torch.Tensor) -> None:
        self.prefix, self.kv_cache, self.dtype = prefix, kv_cache, kv_cache.dtype
        self.query_dtype = torch.float8_e4m3fn if kv_cache.dtype == torch.float8_e4m3fn else torch.bfloat16


class _Indexer:
    def __init__(self, rec: _Recorder, index_cache: Any) -> None:
        self._rec = rec
        self.index_cache = index_cache

    def __call__(self, index_query: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self._rec.index_query = index_query.clone()

    forward_with_cache = __call__  # the compiled path's attention op hands the cache over too


class _Impl:
    """vLLM's attention impl as the stand-in models it: it reads a bf16 query (no fp8-query decode)
    and returns no LSE."""

    use_cutlass_decode = need_to_return_lse_for_decode = False

    def __init__(self, rec: _Recorder) -> None:
        self._rec = rec

    def should_use_msa_decode(self, *args: Any) -> bool:
        return False

    def forward(self, layer: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._rec.query = query.clone()
        return next((x for x in reversed(args) if isinstance(x, torch.Tensor)), None)  # the output buffer


class _Imported:
    """A name the file imports and the stand-in does not model: called, it hands back the string it
    is given (vLLM's layer-name helpers), else another such value; anything else it cannot answer.
    ``known`` are the attributes it does model (the attention config of the current vLLM config)."""

    def __init__(self, name: str, known: dict[str, Any] | None = None) -> None:
        self._name = name
        self._known = known or {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], str):
            return args[0]
        return _Imported(f"{self._name}(...)")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr == "_known":
            raise AttributeError(attr)
        if attr in self._known:
            return self._known[attr]
        if attr in (FUSED_OP, RESHAPE_OP):  # (a made-up op would write nothing: a false failure)
            raise StandInGap(f"the file reaches `{attr}` through `{self._name}`, which the stand-in does not model")
        return _Imported(f"{self._name}.{attr}")

    def __getitem__(self, key: Any) -> Any:
        return _Imported(f"{self._name}[...]")

    def __contains__(self, item: Any) -> bool:
        return False

    def __instancecheck__(self, value: Any) -> bool:
        """``isinstance(x, <an unmodelled class>)``: what the stand-in hands the layer (its tensors) is none; what
        the file made by calling it (``_Imported("<name>(...)")``) is."""
        return isinstance(value, _Imported) and value._name.startswith(f"{self._name}(")

    def __iter__(self) -> Any:
        raise StandInGap(f"`{self._name}` is not modelled by the stand-in")

    def __repr__(self) -> str:
        return f"<stand-in for {self._name}>"


class _Projection:
    """A linear layer the file builds in __init__: ``(output, None)`` of this rank's width for
    what it builds it with (seeded by its name and the rank, so every run of a rank reads the
    same), or the whole fused buffer."""

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


class _LinearClass:
    """An imported ``…Linear…`` class: building one gives a ``_Projection`` of this rank's width."""

    def __init__(self, name: str, tp: int = 1) -> None:
        self._name = name
        self._tp = tp

    def __call__(self, *args: Any, **kwargs: Any) -> _Projection:
        return _Projection(linear_width(self._name, args, kwargs, self._tp))


def _vllm_config(index_dtype_name: str, cache_config: types.SimpleNamespace) -> _Imported:
    """What ``get_current_vllm_config()`` gives: its attention config says the run's indexer
    dtype (``indexer_kv_dtype``, "auto" unless the run has an fp8 index cache), its cache config the run's cache
    dtype and block size (the layer's own ``cache_config``); the rest is made up."""

    def resolve_indexer_kv_dtype(default: Any) -> Any:  # "auto" is the caller's default
        return default if index_dtype_name == "auto" else index_dtype_name

    attention = _Imported(
        "vllm_config.attention_config",
        {"indexer_kv_dtype": index_dtype_name, "resolve_indexer_kv_dtype": resolve_indexer_kv_dtype},
    )
    return _Imported("vllm_config", {"attention_config": attention, "cache_config": cache_config})


def _ops_namespace(backend: Backend) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{FUSED_OP: backend.fused, RESHAPE_OP: backend.reshape_and_cache_flash})


class _Compiler(types.ModuleType):
    """A module on the way to a compile test (``torch.compiler``, ``torch._dynamo.external_utils``):
    every spelling the codemod reads as ``is_compiling()`` (``names.COMPILE_TESTS``) answers the run's path."""

    def __init__(self, real: Callable[[], Any], compiling: bool, dotted: str) -> None:
        super().__init__(dotted)
        self._real, self._compiling = real, compiling  # the real module, imported only if asked for more

    def __getattr__(self, name: str) -> Any:
        return _compile_test(f"{self.__name__}.{name}", self._compiling, lambda: getattr(self._real(), name))


def _compile_test(dotted: str, compiling: bool, real: Callable[[], Any]) -> Any:
    """``torch.<...>`` as the stand-in serves it: a compile test answers ``compiling``; a module
    on the way to one is a ``_Compiler`` (the real module is imported only when the file asks it
    for something else: importing torch._dynamo leaves a torchinductor folder in the temp dir)."""
    if dotted in COMPILE_TESTS:
        return lambda: compiling
    if any(test.startswith(dotted + ".") for test in COMPILE_TESTS):
        return _Compiler(real, compiling, dotted)
    return real()


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
        if any(test.startswith(f"torch.{name}.") for test in COMPILE_TESTS):
            return _compile_test(f"torch.{name}", self._compiling, lambda: getattr(torch, name))
        if name == "cuda" and not torch.cuda.is_available():
            return _CudaOnCpu()
        return getattr(torch, name)


class _CudaOnCpu:
    """``torch.cuda`` on a machine without CUDA: its NVTX ranges and marks, a profiler's labels that
    change no value, do nothing (CPU torch raises on them); the rest is torch's."""

    nvtx = types.SimpleNamespace(range=lambda *a, **k: contextlib.nullcontext(), range_push=lambda *a, **k: 0,
                                 range_pop=lambda *a, **k: 0, mark=lambda *a, **k: None)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


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
            # (index -1); always slot 0, where one clamped to 0 would land; padded
            # tokens at the end of the batch, as vLLM pads.
            chosen = torch.randperm(slots_total - 1, generator=g)[: shape.tokens]
            if not bool((chosen == 0).any()):
                chosen[0] = 0
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


MODES = {"bf16": ("auto", torch.bfloat16), "fp8": ("fp8", torch.uint8)}
# A mode's suffixes, in this order: the index cache is float8_e4m3fn, as vLLM allocates it
# for --attention-config '{"indexer_kv_dtype": "fp8"}' (else bf16, "auto");
FP8_INDEX = " fp8-index"
# the run takes the torch.compile path (is_compiling() is True).
COMPILED = " compiled"
LAYER_NAME = "model.layers.3.self_attn.attn"
INDEX_PREFIX = "model.layers.3.self_attn.attn.indexer.k_cache"


def _config(s: Shape) -> types.SimpleNamespace:
    """MiniMax-M3's config, in the stand-in's sizes (what ``__init__`` reads them from): the
    head counts across all ranks, which a rank's ``__init__`` divides by the TP size."""
    heads, kv_heads, idx_heads = s.totals
    return types.SimpleNamespace(
        hidden_size=s.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=s.eps,
        max_position_embeddings=s.max_position,
        rope_theta=10000.0,
        partial_rotary_factor=s.rotary_dim / s.head_dim,
        sparse_attention_config={
            "sparse_num_index_heads": idx_heads,
            "sparse_index_dim": s.idx_head_dim,
            "sparse_topk_blocks": 4,
            "sparse_block_size": s.block_size,
        },
    )


def _parts(layer: Any, depth: int = 3) -> list[Any]:
    """The layer and the stand-in's objects it holds (``indexer.index_cache``), ``depth`` levels down."""
    found, level = [layer], [layer]
    for _ in range(depth):
        level = [v for o in level for v in vars(o).values() if isinstance(v, (types.SimpleNamespace, _Indexer))]
        found += [v for v in level if all(v is not f for f in found)]
    return found


def _pinned_setattr(self: Any, name: str, value: Any) -> None:
    if name not in type(self).pinned:
        object.__setattr__(self, name, value)
    elif isinstance(value, int) and value != self.__dict__.get(name, value):
        type(self).unheld[name] = value  # __init__ computes another size than the rank's


# Set while __init__ runs: see ``_import``.
_IN_INIT: contextvars.ContextVar[bool] = contextvars.ContextVar("_IN_INIT", default=False)


def _import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    """``import`` in the code the stand-in runs. While ``__init__`` runs, a vLLM module that is not here
    (vLLM 0.34's kernel classes, imported to ask which one a projection uses) is made up as a
    module-level import of it is (``_Imported``): what ``__init__`` decides of the layer's set-up. Elsewhere
    it is a gap: what a method imports there is the path of a platform (the AMD file's AITER ops)."""
    try:
        return builtins.__import__(name, globals, locals, fromlist, level)
    except ModuleNotFoundError:
        if level or not _IN_INIT.get() or name.partition(".")[0] != "vllm":
            raise
        return _Imported(name if fromlist else "vllm")


_BUILTINS = {**vars(builtins), "__import__": _import}


def _standin(
    code: LayerCode, backend: Backend, inputs: Inputs, mode: str
) -> tuple[Any, _Recorder, dict]:
    s, dev = inputs.shape, inputs.device
    compiling = mode.endswith(COMPILED)
    fp8_index = mode.removesuffix(COMPILED).endswith(FP8_INDEX)
    cache_dtype_name, cache_dtype = MODES[mode.removesuffix(COMPILED).removesuffix(FP8_INDEX)]
    index_dtype_name, index_dtype = ("fp8", torch.float8_e4m3fn) if fp8_index else ("auto", torch.bfloat16)
    cache_config = types.SimpleNamespace(cache_dtype=cache_dtype_name, block_size=s.block_size)
    vllm_config = _vllm_config(index_dtype_name, cache_config)
    rec = _Recorder(s.width)
    qkv = inputs.qkv.clone()
    kv_cache = torch.zeros(
        s.num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=cache_dtype, device=dev
    )
    index_cache = torch.zeros(s.num_blocks, s.block_size, s.idx_head_dim, dtype=index_dtype, device=dev)
    meta = types.SimpleNamespace
    ctx = meta(
        slot_mapping={LAYER_NAME: inputs.main_slots, INDEX_PREFIX: inputs.index_slots},
        attn_metadata={
            LAYER_NAME: meta(slot_mapping=inputs.main_slots),
            INDEX_PREFIX: meta(slot_mapping=inputs.index_slots),
        },
        no_compile_layers={},
    )
    backend = replace(backend, fused=rec.fused(backend.fused))
    torch_proxy = _TorchProxy(backend, compiling)
    namespace: dict[str, Any] = {"__builtins__": _BUILTINS, "__name__": f"mm3_standin_{code.class_name}"}
    for name in code.module_names:
        namespace[name] = code.constants[name] if name in code.constants else _Imported(name)
    for name, origin in code.imported.items():
        if origin.endswith("." + FUSED_OP):
            namespace[name] = backend.fused
        elif origin.endswith("." + RESHAPE_OP):
            namespace[name] = backend.reshape_and_cache_flash
        elif origin in ("torch.ops", "torch.ops._C", "torch.ops._C_cache_ops", "torch.ops.vllm") or any(
            test == origin or test.startswith(origin + ".") for test in COMPILE_TESTS
        ):  # `from torch.ops import _C`, `from torch.compiler import is_compiling`
            namespace[name] = functools.reduce(getattr, origin.split(".")[1:], torch_proxy)
        elif name == "get_forward_context":
            namespace[name] = lambda: ctx
        elif name == "get_current_vllm_config":
            namespace[name] = lambda: vllm_config
        elif origin.startswith("vllm.") and origin.rsplit(".", 1)[1] in VLLM_HELPERS:
            namespace[name] = VLLM_HELPERS[origin.rsplit(".", 1)[1]]
        elif name.endswith("Metadata"):
            namespace[name] = meta  # the isinstance() asserts of attn_metadata readers
        elif (tp_query := TP.get(origin.rsplit(".", 1)[-1])) is not None:
            namespace[name] = (lambda value: lambda *a, **k: value)(tp_query(s.parallel))
        elif "Linear" in name:
            namespace[name] = _LinearClass(name, s.parallel.size)
        else:
            namespace[name] = _Imported(name)
    namespace["torch"] = torch_proxy
    for alias in code.ops_aliases:  # (`vllm._custom_ops`, imported by its dotted name: `vllm` holds it)
        root, _, rest = alias.partition(".")
        namespace[root] = _Imported(root, {rest: _ops_namespace(backend)}) if rest else _ops_namespace(backend)
    for fn_code in code.functions.values():
        exec(fn_code, namespace)  # the module's own helpers and wrappers, as the file defines them
    for op_name, fn_name in code.custom_ops.items():  # torch.ops.vllm.<op>: the file's own body runs
        setattr(torch_proxy.ops.vllm, op_name, namespace[fn_name])
    attrs: dict[str, Any] = {
        "pinned": frozenset(),
        "unheld": {},
        "training": False,  # nn.Module's: vLLM's loader hands the engine ``model.eval()``
        "__setattr__": _pinned_setattr,
        # nn.Module's: a buffer is an attribute of the layer (the stand-in has no device to move to)
        "register_buffer": lambda self, name, tensor, persistent=True: setattr(self, name, tensor),
    }
    attrs |= code.class_constants  # a class attribute a flag reads until __init__ sets it
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
    norm = _Submodule
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
        "indexer": _Indexer(rec, _IndexCache(INDEX_PREFIX, index_cache)),
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
                setattr(owner, part, _Submodule())
            owner = getattr(owner, part)
        setattr(owner, chain[-1], value_of[what[0]])  # a tie's first size: its value (LayerCode.fit)
        values.setdefault(chain[0], None)
    # __init__ itself, statement by statement, on the stand-in's sizes as this rank sees them;
    # what the stand-in set above stays, and a statement that raises is skipped.
    # vLLM binds the layer's caches after building it (bind_kv_cache): __init__ sees placeholders
    spots = [(o, k, v) for o in _parts(layer) for k, v in list(vars(o).items()) if v is kv_cache or v is index_cache]
    for owner, key, cache in spots:
        object.__setattr__(owner, key, torch.empty(0, dtype=cache.dtype, device=dev))
    cls.pinned = frozenset(values) - {DTYPE_ATTR}  # (what the file's own __init__ leaves in it counts)
    # one dict for the module's names and __init__'s locals: a comprehension in __init__ sees both
    local = namespace | code.init.params | {
        "self": layer,
        "config": _config(s),
        "prefix": LAYER_NAME.removesuffix(".attn"),
        "quant_config": None,
        "cache_config": cache_config,
        "vllm_config": vllm_config,
        Returned.__name__: Returned,
    }
    failed: NameError | None = None
    in_init = _IN_INIT.set(True)
    try:
        for statement in code.init.statements:
            try:
                with torch.device(dev):  # vLLM builds its layers on the target device
                    exec(statement, local)
            except Returned:
                break
            except NameError as exc:  # a name the file binds nowhere: vLLM raises it too, building the layer
                failed = failed or (exc if code.binds is not None and exc.name not in code.binds else None)
            except Exception:  # builds something the stand-in does not model
                continue
    finally:
        _IN_INIT.reset(in_init)
    cls.pinned = frozenset()
    for owner, key, cache in spots:
        object.__setattr__(owner, key, cache)
    if not isinstance(getattr(layer, "qkv_proj", None), _Projection):
        layer.qkv_proj = full  # one fused projection: the whole buffer
    for name, value in vars(layer).items():
        if isinstance(value, _Projection):
            value.full, value.seed = qkv, zlib.crc32(name.encode()) + s.parallel.rank
    for name in code.called_attrs - set(code.methods):
        if not hasattr(layer, name):
            setattr(layer, name, rec.sink)
    state = {"kv_cache": kv_cache, "index_cache": index_cache, "unheld": dict(cls.unheld), "init_failed": failed}
    return layer, rec, state


def _made_here(value: Any) -> bool:
    """A value the stand-in made up for something it does not model."""
    return isinstance(value, _Imported) or getattr(value, "__func__", None) is _Recorder.sink


# The stand-in's own objects: an attribute one of them lacks is what it does not model.
_STAND_INS = (_Indexer, _IndexCache, _Impl, _Projection, _Recorder, _Submodule)


def _gap(exc: BaseException, layer: Any, frame: types.FrameType | None, code: LayerCode) -> str | None:
    """Why ``exc`` is the stand-in's limit rather than the file's fault, if it is (an attribute of
    the layer the file never sets, ``LayerCode.settable``, is the file's fault)."""
    if isinstance(exc, StandInGap):
        return str(exc)
    if isinstance(exc, AttributeError) and exc.obj is layer and (code.settable is None or exc.name in code.settable):
        return f"the stand-in lacks `self.{exc.name}` (set by __init__ code it does not run)"
    if isinstance(exc, AttributeError) and type(getattr(exc, "obj", None)) in _STAND_INS:
        return f"the stand-in's {type(exc.obj).__name__.lstrip('_')} has no `{exc.name}` (vLLM's has more than it models)"
    if isinstance(exc, ModuleNotFoundError):  # imported inside a method: a platform's package (aiter), or vLLM's
        return f"the file imports `{exc.name}`, which is not here (the stand-in runs without vLLM's platform packages)"
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
