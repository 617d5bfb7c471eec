"""The semantic and kernel levels over a file's layer classes: one function of a path and its
text, so that ``verify`` (on a file) and ``run`` (on the new source it is about to write,
:mod:`rewriter.proof`) judge with the same code.

Below the package face (:mod:`rewriter.verify`, which re-exports these names): it imports
the level types and the layer modules, never the face, whose report imports the command
reports that ``run``'s proof is part of.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import linecache
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from codemods.schema import InsertSite, SiteState
from rewriter.apply import FileError, read_source

from .levels import LevelResult, Status, install_torch

NO_TORCH = f"torch is not installed (to install it: {install_torch()})"


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def import_torch() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU wheels warn when NumPy is absent
        import torch  # noqa: F401


def _timings(code: Any, ctx: Any, out: Any, failures: list[str], write: str) -> None:
    """Time this file's bypass, its write method ``write``, with the real ops (a failure to run it is the file's)."""
    from . import kernels as k

    try:
        out.timings = k.timings(ctx.ops, code, write)
    except Exception as exc:
        failures.append(f"timing {code.class_name}.{write} failed: {type(exc).__name__}: {exc}")


def insert_classes(sites: Iterable[InsertSite]) -> list[str]:
    """The classes the semantic and kernel levels run: each with an insert site (a native
    call's too: the kernel quantizes by itself, and running the file shows it)."""
    return sorted({s.class_name for s in sites if s.state is not SiteState.NOT_A_SITE and s.class_name})


def semantic_level(path: Path, classes: list[str], source: str | None = None, plan: Any = None) -> LevelResult:
    """The semantic level (reference ops, CPU; a file that asks ``is_compiling()`` on both its
    paths) of ``classes`` in ``source``, the text of the file at ``path`` (default: that file's
    text, read as ``run`` reads it), at ``plan``'s ranks (default TP=1). ``verify`` runs it on
    a file; ``run`` on the new source before it writes it. Skipped without torch."""
    if not torch_available():
        return LevelResult("semantic", Status.SKIPPED, NO_TORCH)
    import_torch()
    import torch

    # Its tensors hold a few thousand elements: a pool of threads only costs (2.5x on 2 cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_layers(path, classes, None, plan=plan, source=source)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _lines_of(path: Path, source: str) -> Iterator[None]:
    """While a level runs ``source`` as the file at ``path``, the lines that tracebacks and the
    stand-in read (``linecache``: what it cannot model is told by the failing line's text) are
    ``source``'s, not what is on disk: ``run`` judges new source before it writes it."""
    key = str(path)
    before = linecache.cache.get(key)
    # Split as Python splits a file into lines (\n, \r\n, \r; a form feed is no line end).
    lines = io.StringIO(source, newline=None).readlines()
    linecache.cache[key] = (len(source), None, lines, key)  # no mtime: never re-read from disk
    try:
        yield
    finally:
        if before is None:
            linecache.cache.pop(key, None)
        else:
            linecache.cache[key] = before


def run_layers(
    path: Path,
    classes: list[str],
    ctx: Any,  # a KernelContext: the kernel level, with vLLM's ops; None: the semantic level
    out: Any = None,  # the FileVerification that gets the kernel level's timings
    plan: Any = None,
    source: str | None = None,
) -> LevelResult:
    """The semantic level (the kernel level with ``ctx``) of ``classes`` in ``source``, the
    text of the file at ``path`` (default: that file's, read as ``run`` reads it), as the
    ranks of ``plan`` (a :class:`tp.Plan`; TP=1 by default), each TP its own row: ``semantic
    TP=8``, say."""
    if source is None:
        try:
            source = read_source(path)
        except FileError as exc:
            return LevelResult("kernel" if ctx is not None else "semantic", Status.FAILED, f"{path}: {exc}")
    with _lines_of(path, source):
        return _run_classes(path, classes, ctx, out, plan, source)


def _run_classes(path: Path, classes: list[str], ctx: Any, out: Any, plan: Any, source: str) -> LevelResult:
    from . import layercode, semantic, standin, tp

    plan = plan or tp.Plan(1)
    level = ("kernel" if ctx is not None else "semantic") + plan.label

    if ctx is not None:
        backend, device = ctx.ops.backend, "cuda"
        shape = layercode.Shape(tokens=257, num_blocks=64)
    else:
        backend, device, shape = standin.REFERENCE, "cpu", layercode.DISTINCT
    details: list[str] = []
    failures: list[str] = []
    gaps: list[str] = []
    notes: list[str] = []
    compiled = False
    for name in classes:
        try:
            code = layercode.load_layer(path, name, source)
        except layercode.Unmodelled as exc:  # the stand-in runs forward(): not the file's failure
            gaps.append(f"{name}: the stand-in cannot run it: {exc}")
            continue
        except (layercode.HarnessError, SyntaxError) as exc:
            return LevelResult(level, Status.FAILED, str(exc))
        result, runs, shapes = semantic.check_plan(code, backend, shape, device, plan)
        compiled = compiled or code.compile_aware
        details += [f"{name}: sizes: {ran}" for ran in shapes]
        notes += [f"{name}: {result.note}"] if result.note else []
        details += [f"{name}: {check}: {'yes' if ok else 'NO'}" for check, ok in result.checks.items()]
        for run in runs:
            if run.error:
                details += [f"{name} {run.mode} run: {line}" for line in run.traceback]
        if result.gap:
            gaps.append(f"{name}: {result.reason}")
        elif not result.passed:
            failures.append(f"{name}: {result.reason}")
        elif ctx is not None and ctx.timing and out is not None and out.timings is None and plan.size == 1:
            write = out.write_methods.get(name, "")  # the site's, by its role (whatever the file calls it)
            if write in code.methods:
                _timings(code, ctx, out, failures, write)
    if ctx is not None and plan.size == 1:  # the ops themselves: once, on the TP=1 row
        details += [f"{c.name}: {'ok' if c.passed else 'FAILED'} ({c.detail})" for c in ctx.checks]
        bad = [c.name for c in ctx.checks if not c.passed]
        if bad:
            failures.append("real ops differ from the references: " + ", ".join(bad))
    if failures:
        return LevelResult(level, Status.FAILED, "; ".join(failures), details)
    if gaps:
        return LevelResult(level, Status.SKIPPED, "; ".join(gaps), details)
    paths = "eager and compiled paths, " if compiled else ""
    what = f"bf16 and fp8 cache runs agree ({paths}{backend.name}, {device})"
    if plan.size > 1:
        what += f" at {plan.describe()}"
    return LevelResult(level, Status.PASSED, "; ".join([what, *notes]), details)
