"""The semantic level: run a layer's ``forward`` on the stand-in and judge the runs.

One run with a bf16 cache (``kv_cache_dtype="auto"``, the fused insert) and one with
an fp8 cache (``"fp8"``, uint8 storage, the bypass) on the same inputs, padded tokens
included, are compared by :func:`compare_runs`; :func:`check_layer` does the same on
the path a file takes under torch.compile when it asks ``is_compiling()``, and, for a
layer that reads the attention config's indexer dtype (``indexer_kv_dtype``), once more
with a float8_e4m3fn index cache: both runs must store the same e4m3 bits, those of the
bf16 index cache converted. A run the stand-in cannot carry to the end is neither passed
nor failed. :func:`check_plan` does all of it as each rank of a tensor-parallel size
(:mod:`rewriter.verify.tp`) runs the layer; a failure names the TP and the rank.
"""

from __future__ import annotations

import inspect
import re
import traceback
import types
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import refops
from .layercode import SIZES, LayerCode, Shape
from .standin import COMPILED, FP8_INDEX, Backend, Inputs, _gap, _standin
from .tp import Plan

INDEXER_DTYPE = "indexer_kv_dtype"  # a layer whose code names it may get an fp8 index cache


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
    unheld: dict[str, int] = field(default_factory=dict)  # sizes __init__ computes otherwise than the rank's


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


def _reads_cache(frame: types.FrameType, state: dict) -> bool:
    """The failing line names the stand-in's own cache (a local or ``self.`` attribute holding it): on the reference
    (bf16) run, where no bypass writes, a layout the stand-in does not model, not the file's failure."""
    line = (inspect.getframeinfo(frame).code_context or [""])[0]
    owner = frame.f_locals.get("self")
    held = [frame.f_locals.get(n) for n in re.findall(r"\b(\w+)\b", line)]
    held += [vars(owner).get(n) for n in re.findall(r"\bself\.(\w+)", line) if hasattr(owner, "__dict__")]
    return any(v is state["kv_cache"] or v is state["index_cache"] for v in held)


def run_layer(code: LayerCode, backend: Backend, inputs: Inputs, mode: str) -> RunResult:
    """Run the layer's ``forward`` once with a ``mode`` cache ("bf16" or "fp8", eager; with
    `` fp8-index`` a float8_e4m3fn index cache; with `` compiled`` the path it takes under
    torch.compile)."""
    layer, rec, state = _standin(code, backend, inputs, mode)
    hidden = torch.zeros(
        inputs.shape.tokens, inputs.shape.hidden_size, dtype=torch.bfloat16, device=inputs.device
    )
    result = RunResult(mode, unheld=state["unheld"])
    try:
        if state["init_failed"] is not None:  # (__init__ itself failed: the file's fault)
            raise state["init_failed"]
        layer.forward(inputs.positions.clone(), hidden)
        if inputs.device != "cpu":
            torch.cuda.synchronize()
    except Exception as exc:  # the layer's own failure is the finding
        frame = _last_file_frame(exc, code.path)
        gap = _gap(exc, layer, frame, code)
        reference = mode == "bf16"  # eager: the fused op writes; no bypass's write runs (the compiled path's may)
        shaped = isinstance(exc, (ValueError, IndexError, RuntimeError))  # (a name the file lacks is its own)
        if gap is None and reference and shaped and frame is not None and _reads_cache(frame, state):
            gap = "it reads the stand-in's cache, which has vLLM's NVIDIA layout, in a layout of its own (a platform's)"
        result.traceback = _traceback_tail(exc, code.path)
        where = ""
        if frame is not None:
            info = inspect.getframeinfo(frame)
            text = " ".join((info.code_context or [""])[0].split())
            function = "__init__" if info.function == "<module>" else info.function  # (its statements run one by one)
            where = f" (at {Path(code.path).name}:{info.lineno} in {function})"
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
    note: str = ""  # passing, what the reader should still know (sizes the file does not shard)


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """A cache as comparable data: a float8 one as its bytes (torch compares no float8)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def compare_runs(
    inputs: Inputs, bf16: RunResult, fp8: RunResult, native: bool = False, index_of: RunResult | None = None
) -> Comparison:
    """The bypass (fp8 run) must store what the fused insert (bf16 run) stores, quantized;
    ``native``: the call passes kv_cache_dtype, the kernel quantizes by itself. ``index_of``:
    the runs have an fp8 index cache, which must hold e4m3 of that (bf16 index) run's cache."""
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
    assert bf16.index_cache is not None and fp8.index_cache is not None
    checks["index cache identical"] = torch.equal(_bits(bf16.index_cache), _bits(fp8.index_cache))

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
    index_rows = s.num_blocks * s.block_size
    index_slots = inputs.index_slots[inputs.valid_index].long()
    index_written = torch.zeros(index_rows, dtype=torch.bool, device=slots.device)
    index_written[index_slots] = True
    if index_of is not None and index_of.index_cache is not None:
        # The fused op stores index_k clamped to +-448 and converted; the bypass x / 1
        # saturating: either way e4m3 of what the bf16 index cache holds, bit for bit.
        ref_index = index_of.index_cache.reshape(index_rows, -1)[index_slots]
        checks["index cache = e4m3(bf16 index cache) at every written slot"] = torch.equal(
            _bits(fp8.index_cache).reshape(index_rows, -1)[index_slots], refops.to_e4m3_bits(ref_index)
        )
    if s.padded:
        # What the fused op does with slot -1 (nothing) the bypass must do too:
        # a padded token's write lands in the last row of a cache indexed by slot.
        checks[f"padded tokens (slot -1, last {s.padded}) wrote nothing"] = all(
            bool((rows[~mask] == 0).all())
            for rows, mask in (
                (fp8_rows, written),
                (_bits(fp8.index_cache).reshape(index_rows, -1), index_written),
                (_bits(bf16.index_cache).reshape(index_rows, -1), index_written),
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


def reads_indexer_dtype(code: LayerCode) -> bool:
    """The layer class's code names the attention config's indexer dtype (``indexer_kv_dtype``,
    ``resolve_indexer_kv_dtype(...)``, ``getattr(..., "indexer_kv_dtype", ...)``): its index
    cache may be an fp8 one, and the layer is run with one too."""

    def names(co: types.CodeType) -> bool:
        words = [*co.co_names, *(c for c in co.co_consts if isinstance(c, str))]
        return any(INDEXER_DTYPE in w for w in words) or any(
            names(c) for c in co.co_consts if isinstance(c, types.CodeType)
        )

    return any(names(co) for co in [*code.methods.values(), *code.init.statements])


def _check_paths(
    code: LayerCode, backend: Backend, inputs: Inputs, index: str = "", index_of: RunResult | None = None
) -> tuple[Comparison, list[RunResult]]:
    """bf16 against fp8 in eager; for a file that asks ``torch.compiler.is_compiling()``, the same
    on the path it takes under torch.compile, whose caches must also be eager's (bf16). ``index``:
    the modes' index-cache suffix (``FP8_INDEX``), ``index_of`` the bf16-index run it is judged by."""
    bf16 = run_layer(code, backend, inputs, "bf16" + index)
    fp8 = run_layer(code, backend, inputs, "fp8" + index)
    result = compare_runs(inputs, bf16, fp8, native=code.native, index_of=index_of)
    if not code.compile_aware or not result.passed:
        return result, [bf16, fp8]
    runs = [run_layer(code, backend, inputs, mode + index + COMPILED) for mode in ("bf16", "fp8")]
    compiled = compare_runs(inputs, *runs, native=code.native, index_of=index_of)
    checks = result.checks | {f"compiled: {name}": ok for name, ok in compiled.checks.items()}
    if compiled.passed:
        assert runs[0].kv_cache is not None and runs[0].index_cache is not None and bf16.index_cache is not None
        checks["compiled: caches = eager's (bf16)"] = torch.equal(runs[0].kv_cache, bf16.kv_cache) and torch.equal(
            _bits(runs[0].index_cache), _bits(bf16.index_cache)
        )
    failed = [name for name, ok in checks.items() if not ok]
    if compiled.gap or (not compiled.passed and not compiled.checks):
        return replace(compiled, reason=f"compiled path: {compiled.reason}", checks=checks), [bf16, fp8, *runs]
    if failed:
        return Comparison(False, "; ".join(failed) + ": no", checks), [bf16, fp8, *runs]
    return Comparison(True, f"{result.reason}; eager and compiled paths", checks), [bf16, fp8, *runs]


FP8_INDEX_CHECK = "fp8 index cache: "  # the prefix of the fp8-index runs' checks


def check_layer(code: LayerCode, backend: Backend, inputs: Inputs) -> tuple[Comparison, list[RunResult]]:
    """bf16 against fp8 in eager, and on the compiled path where the file has one; for a layer that
    reads the indexer dtype (and a backend whose fused op takes an fp8 index cache), all of it
    again with a float8_e4m3fn index cache, judged also against the bf16 index cache."""
    result, runs = _check_paths(code, backend, inputs)
    if not (result.passed and backend.fp8_index and reads_indexer_dtype(code)):
        return result, runs
    fp8_index, more = _check_paths(code, backend, inputs, FP8_INDEX, index_of=runs[0])
    checks = result.checks | {FP8_INDEX_CHECK + name: ok for name, ok in fp8_index.checks.items()}
    if fp8_index.gap or (not fp8_index.passed and not fp8_index.checks):
        return replace(fp8_index, reason=FP8_INDEX_CHECK + fp8_index.reason, checks=checks), [*runs, *more]
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        return Comparison(False, "; ".join(failed) + ": no", checks), [*runs, *more]
    return Comparison(True, f"{result.reason}; an fp8 index cache too", checks), [*runs, *more]


_COUNTS = SIZES[:3]  # the head counts a rank divides (the head sizes are every rank's)


def _unheld(run: RunResult, shape: Shape) -> str:
    """The sizes this rank's ``__init__`` computes otherwise than vLLM's arithmetic gives the rank
    (a file whose sizes are TP=1's): the stand-in ran the rank's, so the rewrite's slices were
    still checked at them, but the file's own count would not shard."""
    return ", ".join(
        f"self.{name} = {value} (the rank has {getattr(shape, name)})"
        for name, value in sorted(run.unheld.items())
        if name in SIZES
    )


def check_plan(
    code: LayerCode, backend: Backend, shape: Shape, device: str, plan: Plan
) -> tuple[Comparison, list[RunResult], list[Shape]]:
    """:func:`check_layer` as each rank of ``plan`` (at TP=1, on ``shape`` itself): the file's
    ``__init__`` computes the rank's sizes from the model's head counts and the TP size and rank
    it is handed, its projections give the rank's widths. The first rank that fails is the
    result (its reason starts with ``TP=N rank r: ``); passing, the ranks' checks, each named
    by its rank. Also the shapes the ranks ran at."""
    if plan.size == 1:
        inputs = Inputs.random(code.fit(shape), device)
        result, runs = check_layer(code, backend, inputs)
        return result, runs, [inputs.shape]
    checks: dict[str, bool] = {}
    every: list[RunResult] = []
    shapes: list[Shape] = []
    notes: list[str] = []
    result = Comparison(False, "no rank run", {})
    for rank in plan.ranks:
        where = f"TP={plan.size} rank {rank}"
        ranked = plan.shape(shape, rank)
        fitted = code.fit(ranked)
        if [getattr(fitted, n) for n in _COUNTS] != [getattr(ranked, n) for n in _COUNTS]:
            differ = [n for n in _COUNTS if getattr(fitted, n) != getattr(ranked, n)]
            tied = ", ".join(f"{n} {getattr(ranked, n)}" for n in differ)
            why = f"{where}: the file holds in one attribute head counts that differ at this rank ({tied})"
            return Comparison(False, why, checks, gap=True), every, shapes
        inputs = Inputs.random(fitted, device, seed=rank)
        result, runs = check_layer(code, backend, inputs)
        shapes.append(fitted)
        every += runs
        checks |= {f"rank {rank}: {name}": ok for name, ok in result.checks.items()}
        if not result.passed:
            return replace(result, reason=f"{where}: {result.reason}", checks=checks), every, shapes
        none = [(n, v) for n, v in (runs[0].unheld.items() if runs else ()) if n in _COUNTS and v < 1]
        if none:  # (a count the TP size exceeds is replicated: vLLM's layers divide as max(1, total // tp))
            name, value = none[0]
            given = getattr(fitted, name)
            why = f"{where}: __init__ computes self.{name} = {value}, no head at this rank"
            why += f" (vLLM's layers give it {given})"
            return Comparison(False, why, checks), every, shapes
        unheld = _unheld(runs[0], fitted) if runs else ""
        if unheld and unheld not in notes:
            notes.append(unheld)
    ranks = ", ".join(str(r) for r in plan.ranks)
    note = f"__init__ computes TP=1 sizes: {'; '.join(notes)}" if notes else ""
    passed = Comparison(True, f"ranks {ranks} of TP={plan.size}: {result.reason}", checks, note=note)
    return passed, every, shapes
