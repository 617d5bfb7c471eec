"""``mm3-codemod verify``: confirm a rewritten model file by running it.

Three levels per file, each passed / failed / skipped with a reason:

1. **import** - the module imports in the target interpreter and its layer
   class has the bypass's shape (:mod:`rewriter.verify.importcheck`); skipped
   when that interpreter cannot import vLLM itself, failed when the file is
   the cause.
2. **semantic** - the class's own ``forward``/``_insert_kv`` run on a stand-in
   with plain-PyTorch reference ops, bf16 cache vs fp8 cache
   (:mod:`rewriter.verify.semantic`, CPU).
3. **kernel** - the same with vLLM's real ops on a CUDA GPU of compute
   capability >= 8.9, plus the ops against the references and timings
   (:mod:`rewriter.verify.kernels`).
4. **engine** (opt-in, ``--engine``) - vLLM's offline engine serves a tiny
   random-weight MiniMax-M3 built from the file, bf16 vs fp8 cache
   (:mod:`rewriter.verify.engine`).

torch is imported only inside the semantic and kernel levels; without it they
are skipped and say so. A file is **verified** only where a level that runs its code
(semantic, kernel or engine) passed: one with an insert site where none did is not
verified, and ``verify`` exits 1 for it, saying why and the one step that makes a level
run. A level an option asks for (``--require-import``, ``--require-gpu``, ``--kernels``,
``--engine``, ``--tp``) fails, rather than skips, where it cannot run.
``semantic_level`` (:mod:`rewriter.verify.layers`) is the one judge of a file's text:
``verify`` runs it on a file, ``run`` on the new source before it writes it
(:mod:`rewriter.proof`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codemods.schema import CHANGING, SiteState
from rewriter.apply import FileStatus, classify_file
from rewriter.targets import Target

from .importcheck import HOW_TO_RUN, import_check
from .layers import NO_TORCH, import_torch, insert_classes, semantic_level, torch_available
from .layers import run_layers as _semantic  # the kernel level's rows (its name here before layers.py)
from .levels import BEHAVIOUR, ENGINE_STEP, LevelResult, Status, behaviour  # (below face and levels)


LEVELS = ("import", "semantic", "kernel")
FILE_STATUSES = ("passed", "unverified", "failed", "error", "no-sites")  # FileVerification.status
NO_INSERT_SITE = "no insert site in this file: nothing to verify"
OUTSIDE = "the levels run a layer's own code, so it is not run"


@dataclass
class FileVerification:
    path: Path
    origin: str
    sites: list[str] = field(default_factory=list)
    levels: list[LevelResult] = field(default_factory=list)
    error: str | None = None  # the file could not be read or parsed
    note: str | None = None  # e.g. "needs-bypass at line 276: run `mm3-codemod run model.py` first"
    timings: dict[str, Any] | None = None  # the kernel level's timings of this file's bypass
    engine: dict[str, Any] | None = None  # the engine level's runs and comparisons (--engine)
    no_insert_site: bool = False  # no call of the op writes a cache here: nothing to verify
    step: str | None = None  # not verified: the one step that makes a level run its code
    write_methods: dict[str, str] = field(default_factory=dict)  # class -> the site's write method

    @property
    def failed(self) -> bool:
        # A site still to rewrite is never "confirmed", even where no level could run.
        return self.note is not None or any(level.status is Status.FAILED for level in self.levels)

    @property
    def verified(self) -> bool:
        """A level that runs the file's code (semantic, kernel, engine) passed."""
        return any(behaviour(level) and level.status is Status.PASSED for level in self.levels)

    @property
    def unverified(self) -> bool:
        """Readable, nothing failed, an insert site, and no level ran its code to a pass."""
        return not (self.error or self.failed or self.no_insert_site or self.verified)

    def unverified_why(self) -> str:
        """Why nothing proved the file (the first behaviour level's reason), and what to do."""
        rows = [level for level in self.levels if behaviour(level)]
        why = f"{rows[0].level} {rows[0].status.value}: {rows[0].reason}" if rows else "no level ran"
        step = f"; to run it: {self.step}" if self.step else ""
        return f"no level ran its code to a pass ({', '.join(BEHAVIOUR)}): {why}{step}"

    @property
    def status(self) -> str:
        """One word per file, like the other commands' file status: error, failed, passed
        (a level ran its code and passed, none failed), unverified (nothing proved it) or
        no-sites (no insert site: nothing to verify)."""
        if self.error:
            return "error"
        if self.failed:
            return "failed"
        if self.no_insert_site:
            return "no-sites"
        return "passed" if self.verified else "unverified"

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "status": self.status,
            "origin": self.origin,
            "error": self.error,
            "note": self.note,
            "unverified": self.unverified_why() if self.unverified else None,
            "sites": self.sites,
            "levels": [level.to_json() for level in self.levels],
            "timings": _timings_json(self.timings) if self.timings else None,
            "engine": self.engine,
        }


def _timings_json(t: dict[str, Any]) -> dict[str, object]:
    return {
        "device": t["device"],
        "shape": t["shape"],
        "sizes": t["sizes"],
        "kv_bytes_per_token": t["kv_bytes_per_token"],
        "rows": [{"name": r.name, "tokens": r.tokens, "us": round(r.us, 2), "how": r.how} for r in t["rows"]],
    }


@dataclass
class KernelContext:
    """The real ops, loaded once per verify run, or why the level is skipped."""

    ops: Any = None
    skipped: str | None = None
    checks: list[Any] = field(default_factory=list)
    timing: bool = True  # time each verified file's bypass

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"skipped": self.skipped}
        if self.ops is not None:
            out |= {
                "source": self.ops.source,
                "cache_layout": self.ops.layout.name if self.ops.layout else None,
                "schema_extra": [name for name, _ in self.ops.extra],
                "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in self.checks],
            }
        return out


@dataclass
class VerifyReport:
    files: list[FileVerification]
    kernel: KernelContext | None = None
    error: str | None = None

    @property
    def exit_code(self) -> int:
        """2: a target could not be read; 1: a file failed or is not verified, or no file at
        all was (only files without an insert site); 0: every file with an insert site passed
        a level that runs its code, and nothing failed."""
        if self.error or any(f.error for f in self.files):
            return 2
        if any(f.failed or f.unverified for f in self.files):
            return 1
        return 0 if any(f.verified for f in self.files) else 1

    def to_json(self) -> dict[str, object]:
        from rewriter.report import envelope

        files = [f.to_json() for f in self.files]
        summary = {status: sum(1 for f in self.files if f.status == status) for status in FILE_STATUSES}
        report = envelope("verify", self.exit_code, self.error, None, files, summary)
        return report | {"kernel": self.kernel.to_json() if self.kernel else None}


def load_kernels(kernels: str | None, timing: bool = True) -> KernelContext:
    """GPU, ops, layout probe, ops-vs-reference checks and timings - once per run."""
    if not torch_available():
        return KernelContext(skipped=NO_TORCH)
    import_torch()
    from . import kernels as k
    from . import layercode, standin

    try:
        device = k.cuda_device()
        ops = k.load_ops(kernels)
        inputs = standin.Inputs.random(layercode.Shape(tokens=257, num_blocks=64), device, seed=7)
        k.detect_layout(ops, inputs)
    except k.KernelUnavailable as exc:
        return KernelContext(skipped=str(exc))
    ctx = KernelContext(ops=ops, timing=timing)
    try:
        ctx.checks = k.check_against_references(ops, inputs)
    except Exception as exc:  # a kernel error is a failed check, not a crash
        ctx.checks = [k.Check("real ops vs references", False, f"{type(exc).__name__}: {exc}")]
    return ctx


def _insist(level: LevelResult, option: str) -> LevelResult:
    """A level that ``option`` asked for and that could not run: failed, with its reason."""
    if level.status is not Status.SKIPPED:
        return level
    return LevelResult(level.level, Status.FAILED, f"{level.reason} ({option})", level.details)


def _command(verb: str, target: Target) -> str:
    """``mm3-codemod <verb>`` on ``target``, named as the user named it (``--python`` …)."""
    from rewriter.report import mm3_commands

    return mm3_commands(verb, [target])[0]


def verify_file(
    target: Target,
    python: str | None = None,
    kernel: KernelContext | None = None,
    require_gpu: bool = False,
    require_import: bool = False,
    engine: Any = None,  # engine.EngineOptions: run the engine level (--engine)
    plans: list[Any] | None = None,  # tp.Plan: the TPs the semantic and kernel levels run (tp.plans())
    kernels: str | None = None,  # --kernels SO: the kernel level is asked for
    tp_sizes: Sequence[int] = (),  # --tp N: those semantic rows are asked for
) -> FileVerification:
    path = target.path
    out = FileVerification(path, target.origin)
    planned = classify_file(path)
    if planned.status is FileStatus.ERROR:
        out.error = planned.error
        return out
    out.sites = [f"{s.class_name}.{s.method}:{s.line} {s.state.value}" for s in planned.sites]
    inserts = [s for s in planned.sites if s.state is not SiteState.NOT_A_SITE and s.class_name]
    outside = [s for s in planned.sites if s.state is not SiteState.NOT_A_SITE and not s.class_name]
    if not inserts:  # (a call outside a layer class is a site the levels cannot run: not proven)
        out.no_insert_site, why = not outside, NO_INSERT_SITE
        if outside:
            call = outside[0]
            why = f"the call at line {call.line} is in `{call.method}`, outside a layer class: {OUTSIDE}"
        out.levels = [LevelResult(level, Status.SKIPPED, why) for level in LEVELS]
        return out
    classes = insert_classes(inserts)  # a bypass taken out of a native call is proven here too
    pending = [  # (a site `run` refuses too: its reason, never a failure the levels would make up)
        s
        for s in inserts
        if s.state in (SiteState.NEEDS_BYPASS, SiteState.HALF_APPLIED, SiteState.OUTDATED, SiteState.UNSUPPORTED)
    ]
    if pending:  # what `run` does there first, or why it cannot (its reason names the way out)
        first = pending[0]
        if first.action not in CHANGING:
            todo = first.reason
        elif target.origin == "--example":  # `run --example` rewrites a copy: it shows the rewrite
            todo = "the bundled example is unpatched: `mm3-codemod run --example --show-diff` shows"
            todo += " its rewrite"
        else:
            todo = f"run `{_command('run', target)}` first"
        out.note = f"{first.state.value} at line {first.line}: {todo}"

    # A native class is imported only: it has no bypass whose shape could be inspected.
    out.write_methods = {s.class_name: s.write_method for s in inserts if s.class_name and s.write_method}
    bypassed = sorted({f"{s.class_name}:{s.write_method}" for s in inserts if s.class_name and s.state is not SiteState.NATIVE})
    imp = import_check(path, bypassed, python)
    status, reason = Status(imp["status"]), imp["reason"]
    if status is Status.SKIPPED and python and reason.endswith(HOW_TO_RUN):
        # not "use --python": it was; what was wrong with that interpreter, and no more
        reason = f"--python {python}: {reason.removesuffix(f'; {HOW_TO_RUN}')}"
    if status is Status.SKIPPED and require_import:
        status, reason = Status.FAILED, reason + " (--require-import)"
    out.levels.append(LevelResult("import", status, reason, imp.get("traceback", [])))

    asked_tp = " ".join(f"--tp {n}" for n in tp_sizes)
    if not torch_available():
        level = LevelResult("semantic", Status.SKIPPED, NO_TORCH)
        out.levels.append(_insist(level, asked_tp) if asked_tp else level)
    else:
        from . import tp

        plans = plans or tp.plans()
        for plan in plans:
            level = semantic_level(path, classes, plan=plan)
            out.levels.append(_insist(level, f"--tp {plan.size}") if plan.size in tp_sizes else level)

    if kernel is None or kernel.ops is None:
        reason = kernel.skipped if kernel and kernel.skipped else "kernel level not requested"
        level = LevelResult("kernel", Status.SKIPPED, reason)
        asked = "--require-gpu" if require_gpu else f"--kernels {kernels}" if kernels else None
        out.levels.append(_insist(level, asked) if asked else level)
    else:
        semantic_rows = {level.level: level for level in out.levels}
        for plan in plans or [None]:
            row = semantic_rows.get("semantic" + plan.label) if plan is not None else None
            if plan is not None and plan.size > 1 and row is not None and row.status is not Status.PASSED:
                # The real kernels trust the sizes they are handed: sizes the reference rejects
                # can make them write out of bounds, which ends the process (no report at all).
                why = f"not run: the semantic level at TP={plan.size} did not pass ({row.status.value})"
                out.levels.append(LevelResult("kernel" + plan.label, Status.SKIPPED, why))
                continue
            out.levels.append(_semantic(path, classes, kernel, out, plan))
    if engine is not None:
        from .engine import engine_level

        level, result = engine_level(path, [s.line for s in inserts], python, engine)
        out.levels.append(_insist(level, "--engine"))
        out.engine = result.to_json()
    if out.unverified:  # the one step that makes a level run the file's code
        out.step = (
            None  # NO_TORCH says how to install it
            if any(level.reason.startswith(NO_TORCH) for level in out.levels if behaviour(level))
            else f"{_command('verify', target)} {ENGINE_STEP}"
        )
    return out


def verify(
    targets: list[Target],
    python: str | None = None,
    kernels: str | None = None,
    require_gpu: bool = False,
    timing: bool = True,
    require_import: bool = False,
    engine: Any = None,
    tp_sizes: list[int] | None = None,  # --tp: these TPs (every rank) after TP=1, else tp.plans()'s
) -> VerifyReport:
    from . import tp

    try:
        plans = tp.plans(tp_sizes or ())
    except ValueError as exc:
        return VerifyReport([], error=str(exc))
    ctx = load_kernels(kernels, timing=timing)
    sizes = tuple(tp_sizes or ())
    options = (python, ctx, require_gpu, require_import, engine, plans, kernels, sizes)
    files = [verify_file(t, *options) for t in targets]
    return VerifyReport(files, ctx)
