"""The semantic level: run a layer's ``forward`` on the stand-in and judge the runs.

One run with a bf16 cache (``kv_cache_dtype="auto"``, the fused insert) and one with
an fp8 cache (``"fp8"``, uint8 storage, the bypass) on the same inputs, padded tokens
included, are compared by :func:`compare_runs`; :func:`check_layer` does the same on
the path a file takes under torch.compile when it asks ``is_compiling()``. A run the
stand-in cannot carry to the end is neither passed nor failed.
"""

from __future__ import annotations

import inspect
import traceback
import types
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import refops
from .layercode import LayerCode
from .standin import COMPILED, Backend, Inputs, _gap, _standin


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
