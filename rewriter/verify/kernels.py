"""vLLM's real ops on a CUDA GPU: loading, a small adapter, checks and timings.

The ops come from an installed vLLM (``import vllm._custom_ops`` registers
them) or from a kernel library file (``--kernels PATH``, a vLLM ``_C*.so``,
loaded with ``torch.ops.load_library``). Two explicit adaptations turn the
fork-era Python call the model file makes into a call of the library's op:

- **schema**: the fork passes the op's first 19 arguments; newer libraries
  take more (vLLM 0.24: 20, ``kv_cache_dtype``; 0.33: 25). Each extra parameter must be in ``EXTRA_DEFAULTS``
  (or carry a default in the schema), else the library is refused.
- **cache layout**: the fork file hands the fused insert a
  ``[blocks, 2, block_size, kv_heads, head_dim]`` cache; newer kernels write
  their own layout. The layout is detected once by a probe insert and the
  adapter passes a buffer in that layout, copying back into the fork view.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from codemods import codegen

from . import layercode, refops, standin

FORK_PARAMS = list(standin.FUSED_SIGNATURE.parameters)[:19]
# Parameters after the fork's 19 that vLLM 0.33's schema adds, and the value
# that keeps the fork's meaning (bf16 insert, index branch on, no fp8 q, no nvfp4).
EXTRA_DEFAULTS: dict[str, Any] = {
    "kv_cache_dtype": "auto",
    "skip_index_branch": False,
    "q_fp8_out": None,
    "q_fp8_scale": 1.0,
    "kv_k_scale": None,
    "kv_v_scale": None,
}
MIN_CAPABILITY = (8, 9)


class KernelUnavailable(Exception):
    """No usable GPU or ops: the kernel level is skipped with this reason."""


@dataclass(frozen=True)
class Layout:
    """A main-cache layout: how to allocate it and how to view it as the fork's."""

    name: str
    alloc: Callable[[int, int, int, int, torch.dtype, str], torch.Tensor]
    to_fork: Callable[[torch.Tensor], torch.Tensor]  # -> [blocks, 2, block, heads, dim] view


LAYOUTS = [
    Layout(
        "[blocks, 2, block, heads, dim] (fork)",
        lambda nb, bs, h, d, dt, dev: torch.zeros(nb, 2, bs, h, d, dtype=dt, device=dev),
        lambda t: t,
    ),
    Layout(
        "[blocks, heads, block, 2*dim]",
        lambda nb, bs, h, d, dt, dev: torch.zeros(nb, h, bs, 2 * d, dtype=dt, device=dev),
        lambda t: t.view(t.shape[0], t.shape[1], t.shape[2], 2, -1).permute(0, 3, 2, 1, 4),
    ),
    Layout(
        "[blocks, 2*heads, block, dim]",
        lambda nb, bs, h, d, dt, dev: torch.zeros(nb, 2 * h, bs, d, dtype=dt, device=dev),
        lambda t: t.view(t.shape[0], 2, -1, t.shape[2], t.shape[3]).permute(0, 1, 3, 2, 4),
    ),
    Layout(
        "[2, blocks, block, heads, dim]",
        lambda nb, bs, h, d, dt, dev: torch.zeros(2, nb, bs, h, d, dtype=dt, device=dev),
        lambda t: t.permute(1, 0, 2, 3, 4),
    ),
]


@dataclass
class KernelOps:
    """The library's two ops plus what the adapter learned about them."""

    source: str
    fused_raw: Any
    reshape_raw: Any
    extra: list[tuple[str, Any]]
    layout: Layout | None = None

    def fused_call(self, bound: dict[str, Any], cache: torch.Tensor | None) -> None:
        args = [bound.get(name, standin.FUSED_SIGNATURE.parameters[name].default) for name in FORK_PARAMS]
        args[FORK_PARAMS.index("kv_cache")] = cache
        self.fused_raw(*args, *(bound.get(name, value) for name, value in self.extra))

    def fused(self, *args: Any, **kwargs: Any) -> None:
        """The fork's Python signature, adapted to the library's schema and layout."""
        bound = standin.FUSED_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        fork_cache = values.get("kv_cache")
        if fork_cache is None or self.layout is None or self.layout.name.endswith("(fork)"):
            self.fused_call(values, fork_cache)
            return
        nb, _, bs, heads, dim = fork_cache.shape
        native = self.layout.alloc(nb, bs, heads, dim, fork_cache.dtype, fork_cache.device)
        self.layout.to_fork(native).copy_(fork_cache)
        self.fused_call(values, native)
        fork_cache.copy_(self.layout.to_fork(native))

    @property
    def backend(self) -> standin.Backend:
        return standin.Backend(f"kernels ({self.source})", self.fused, self.reshape_raw)


def cuda_device() -> str:
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA GPU visible to torch")
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        raise KernelUnavailable(f"GPU compute capability {cap[0]}.{cap[1]} < 8.9 (no fp8 e4m3)")
    return "cuda"


def load_ops(kernels: str | None) -> KernelOps:
    """Register the ops (library file or installed vLLM) and build the schema adapter."""
    if kernels:
        try:
            torch.ops.load_library(kernels)
        except (OSError, RuntimeError) as exc:
            raise KernelUnavailable(f"{kernels}: cannot load: {str(exc).splitlines()[0]}") from exc
        source = kernels
    else:
        try:
            # vLLM's logger writes to stdout, which carries verify's --json report
            with contextlib.redirect_stdout(sys.stderr):
                import vllm._custom_ops  # noqa: F401  (registers torch.ops._C*)
        except Exception as exc:  # an absent or broken vLLM: the level is skipped
            raise KernelUnavailable(
                f"vllm._custom_ops is not importable ({type(exc).__name__}: {exc})"
            ) from exc
        from importlib.metadata import version

        source = f"vllm {version('vllm')}"
    try:
        fused = torch.ops._C.fused_minimax_m3_qknorm_rope_kv_insert.default
        reshape = torch.ops._C_cache_ops.reshape_and_cache_flash.default
    except (AttributeError, RuntimeError) as exc:
        raise KernelUnavailable(
            f"{source}: the fused MiniMax-M3 op or reshape_and_cache_flash is missing"
        ) from exc
    return KernelOps(source, fused, reshape, schema_extras(source, fused._schema.arguments))


def schema_extras(source: str, arguments: list[Any]) -> list[tuple[str, Any]]:
    """The parameters after the fork's 19 and the value that keeps the fork's meaning,
    read from the library's schema: vLLM 0.24 adds ``kv_cache_dtype`` alone (20),
    0.33 five more (25). A parameter neither known nor defaulted refuses the library."""
    names = [arg.name for arg in arguments]
    if names[:19] != FORK_PARAMS:
        raise KernelUnavailable(f"{source}: fused op's first 19 parameters are not the fork's: {names[:19]}")
    extra = []
    for arg in arguments[19:]:
        if arg.name in EXTRA_DEFAULTS:
            extra.append((arg.name, EXTRA_DEFAULTS[arg.name]))
        elif arg.has_default_value():
            extra.append((arg.name, arg.default_value))
        else:
            raise KernelUnavailable(f"{source}: fused op parameter {arg.name!r} has no known fork value")
    return extra


# --- probes and checks ---------------------------------------------------------


def _sync(inputs: standin.Inputs) -> None:
    if inputs.device != "cpu":
        torch.cuda.synchronize()


def _bf16_steps(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference in units of one bf16 step (ulp) of the expected value."""
    e = expected.float()
    ulp = torch.where(
        e.abs() > 0, 2.0 ** (torch.floor(torch.log2(e.abs())) - 7), torch.full_like(e, 2.0**-133)
    )
    return float(((actual.float() - e).abs() / ulp).max())


def _op_args(inputs: standin.Inputs, qkv: torch.Tensor, q_out, iq_out, **kw: Any) -> dict[str, Any]:
    s, w = inputs.shape, inputs.weights
    return dict(
        qkv=qkv,
        q_norm_weight=w["q_norm"],
        k_norm_weight=w["k_norm"],
        cos_sin_cache=inputs.cos_sin_cache,
        positions=inputs.positions,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        rotary_dim=s.rotary_dim,
        eps=s.eps,
        index_q_norm_weight=w["index_q_norm"],
        index_k_norm_weight=w["index_k_norm"],
        num_index_heads=s.num_idx_heads,
        q_out=q_out,
        index_q_out=iq_out,
        **kw,
    )


def _insert_args(
    inputs: standin.Inputs, qkv: torch.Tensor, q, iq, index_cache: torch.Tensor, main=None, index=None
) -> dict[str, Any]:
    """Insert-mode arguments (the main cache is passed separately, by the adapter)."""
    return _op_args(
        inputs,
        qkv,
        q,
        iq,
        slot_mapping=inputs.main_slots if main is None else main,
        index_slot_mapping=inputs.index_slots if index is None else index,
        index_cache=index_cache,
        block_size=inputs.shape.block_size,
    )


def _outs(inputs: standin.Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    s, dev = inputs.shape, inputs.device
    q = torch.zeros(s.tokens, s.num_heads * s.head_dim, dtype=torch.bfloat16, device=dev)
    iq = torch.zeros(s.tokens, s.num_idx_heads * s.idx_head_dim, dtype=torch.bfloat16, device=dev)
    return q, iq


def detect_layout(ops: KernelOps, inputs: standin.Inputs) -> Layout:
    """Insert once into each candidate layout; keep the one holding k|v at the slots."""
    s = inputs.shape
    k0, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    tried = []
    for layout in LAYOUTS:
        qkv = inputs.qkv.clone()
        q, iq = _outs(inputs)
        cache = layout.alloc(
            s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, torch.bfloat16, inputs.device
        )
        index_cache = torch.zeros(
            s.num_blocks, s.block_size, s.idx_head_dim, dtype=torch.bfloat16, device=inputs.device
        )
        args = _insert_args(inputs, qkv, q, iq, index_cache)
        try:
            ops.fused_call(args, cache)
            _sync(inputs)
        except RuntimeError as exc:
            tried.append(f"{layout.name}: {str(exc).splitlines()[0]}")
            continue
        rows = layout.to_fork(cache).permute(0, 2, 1, 3, 4).reshape(s.num_blocks * s.block_size, -1)
        valid = inputs.valid_main
        if torch.equal(rows[inputs.main_slots[valid].long()], qkv[valid, k0 : k0 + 2 * kv]):
            ops.layout = layout
            return layout
        tried.append(f"{layout.name}: k|v not found at the slots")
    raise KernelUnavailable("fused insert matches no known cache layout: " + "; ".join(tried))


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


def check_against_references(ops: KernelOps, inputs: standin.Inputs) -> list[Check]:
    """Real ops vs the references: norm+rope within one bf16 step, fp8 bit-exact."""
    s, dev = inputs.shape, inputs.device
    k0, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    v_end = k0 + 2 * kv
    iq_end = v_end + s.num_idx_heads * s.idx_head_dim
    checks: list[Check] = []

    real_qkv, ref_qkv = inputs.qkv.clone(), inputs.qkv.clone()
    real_q, real_iq = _outs(inputs)
    ref_q, ref_iq = _outs(inputs)
    ops.fused_call(_op_args(inputs, real_qkv, real_q, real_iq), None)
    refops.fused_minimax_m3_qknorm_rope_kv_insert(**_op_args(inputs, ref_qkv, ref_q, ref_iq))
    _sync(inputs)
    for name, real, ref in (
        ("q", real_q, ref_q),
        ("k", real_qkv[:, k0 : k0 + kv], ref_qkv[:, k0 : k0 + kv]),
        ("index_q", real_iq, ref_iq),
        ("index_k", real_qkv[:, iq_end:], ref_qkv[:, iq_end:]),
    ):
        steps = _bf16_steps(real, ref)
        checks.append(Check(f"norm+rope {name} vs reference", steps <= 1.0, f"max {steps:.2f} bf16 steps"))
    same_v = torch.equal(real_qkv[:, k0 + kv : v_end], inputs.qkv[:, k0 + kv : v_end])
    checks.append(Check("v untouched by norm+rope", same_v, "bit-exact" if same_v else "changed"))

    total = s.num_blocks * s.block_size
    key = real_qkv[:, k0 : k0 + kv].view(-1, s.num_kv_heads, s.head_dim)
    value = real_qkv[:, k0 + kv : v_end].view(-1, s.num_kv_heads, s.head_dim)
    slots, valid = inputs.main_slots, inputs.valid_main  # padded tokens (slot -1) must be skipped
    unwritten = torch.ones(total, dtype=torch.bool, device=dev)
    unwritten[slots[valid].long()] = False
    for dtype_name, cache_dtype, scale in (
        ("fp8", torch.uint8, 1.0),
        ("fp8_e4m3", torch.uint8, 0.5),
        ("auto", torch.bfloat16, 1.0),
    ):
        cache = torch.zeros(
            s.num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=cache_dtype, device=dev
        )
        sc = torch.tensor(scale, dtype=torch.float32, device=dev)
        kc, vc = cache.unbind(1)
        ops.reshape_raw(key, value, kc, vc, slots, dtype_name, sc, sc)
        _sync(inputs)
        rows = cache.permute(0, 2, 1, 3, 4).reshape(total, -1)
        expect = torch.cat((key.reshape(s.tokens, -1), value.reshape(s.tokens, -1)), dim=-1)[valid]
        if cache_dtype == torch.uint8:
            expect = refops.to_e4m3_bits(expect, scale)
        exact = torch.equal(rows[slots[valid].long()], expect) and bool((rows[unwritten] == 0).all())
        checks.append(
            Check(
                f"reshape_and_cache_flash {dtype_name!r} scale {scale} vs reference",
                exact,
                "bit-exact; padded and unwritten slots zero" if exact else "differs",
            )
        )
    return checks


# --- timings ---------------------------------------------------------------------


def gpu_time_us(fn: Callable[[], None], launches: int = 20, repeats: int = 25) -> tuple[float, str]:
    """Median µs per call of ``fn``: a CUDA graph of ``launches`` calls between events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                fn()
        run, how = graph.replay, f"CUDA graph of {launches} calls"
    except RuntimeError:
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(launches):
                fn()

        how = f"{launches} back-to-back launches"
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / launches)
    return statistics.median(samples), how


SIZES = (16, 128, 1024, 8192)


@dataclass
class Timing:
    name: str
    tokens: int
    us: float
    how: str


def timing_shape(tokens: int) -> layercode.Shape:
    """A MiniMax-M3 sparse layer on one GPU of a TP group: 16 q heads, 4 kv heads x 128."""
    return layercode.Shape(
        tokens=tokens,
        num_heads=16,
        num_kv_heads=4,
        num_idx_heads=4,
        num_blocks=2 * tokens // 16 + 1,
        padded=0,
    )


def timings(
    ops: KernelOps,
    code: layercode.LayerCode,
    write: str = codegen.INSERT_KV,  # the file's write method (the site's, by its role)
    sizes: tuple[int, ...] = SIZES,
    device: str = "cuda",
    timer: Callable[..., tuple[float, str]] | None = None,
) -> dict[str, Any]:
    """The fused bf16 insert vs the bypass: the fused op norm+rope only, then the file's
    own write method (``write``) on an fp8 cache (k, v, index_k as the strided views of qkv
    that the post-call block passes), at each batch size."""
    timer = timer or gpu_time_us
    rows: list[Timing] = []
    for n in sizes:
        inputs = standin.Inputs.random(timing_shape(n), device, seed=1)
        # Zero norm weights: re-running norm+rope in place on the same qkv (every
        # replay) then keeps k as it is. With random weights, hundreds of replays
        # drive most of k to denormals, and the fp8 conversion's division takes
        # its slow path (2.3x slower at 8192 tokens): a benchmark artefact.
        inputs.weights = {name: torch.zeros_like(w) for name, w in inputs.weights.items()}
        s = inputs.shape
        qkv = inputs.qkv
        q, iq = _outs(inputs)
        bf16_cache = ops.layout.alloc(
            s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, torch.bfloat16, device
        )
        bf16_index = torch.zeros(
            s.num_blocks, s.block_size, s.idx_head_dim, dtype=torch.bfloat16, device=device
        )
        insert = _insert_args(inputs, qkv, q, iq, bf16_index)
        rope_only = _op_args(inputs, qkv, q, iq)
        layer, _, _ = standin._standin(code, ops.backend, inputs, "fp8")
        k0, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        ik0 = k0 + 2 * kv + s.num_idx_heads * s.idx_head_dim
        k, v = qkv[:, k0 : k0 + kv], qkv[:, k0 + kv : k0 + 2 * kv]
        index_k = qkv[:, ik0 : ik0 + s.idx_head_dim]
        main, index = inputs.main_slots, inputs.index_slots

        def fused_insert() -> None:
            ops.fused_call(insert, bf16_cache)

        def norm_rope() -> None:
            ops.fused_call(rope_only, None)

        def insert_kv() -> None:
            getattr(layer, write)(k, v, index_k, main, index)

        def bypass() -> None:
            norm_rope()
            insert_kv()

        for name, fn in (
            ("fused bf16 insert", fused_insert),
            ("fused norm+rope only", norm_rope),
            (f"the file's {write} (fp8 k/v + index key)", insert_kv),
            ("bypass total", bypass),
        ):
            us, how = timer(fn)
            rows.append(Timing(name, n, us, how))
    s = timing_shape(sizes[0])
    kv = s.num_kv_heads * s.head_dim
    props = torch.cuda.get_device_properties(0) if device == "cuda" else None
    return {
        "device": props.name if props else device,
        "sizes": list(sizes),
        "shape": f"{s.num_heads} q heads, {s.num_kv_heads} kv heads x {s.head_dim}, index {s.num_idx_heads}x{s.idx_head_dim} + 1 key head, block {s.block_size}",
        "rows": rows,
        "kv_bytes_per_token": {"bf16": 2 * kv * 2 + s.idx_head_dim * 2, "fp8": 2 * kv + s.idx_head_dim * 2},
    }
