"""What each command does to its targets, and its report; ``cli`` reads options and prints."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from codemods.schema import CHANGING, Action, SiteState
from rewriter import proof, testhook
from rewriter.apply import (
    BOM,
    FileError,
    FileResult,
    FileStatus,
    Proof,
    StagedWrite,
    commit_write,
    discard,
    plan_file,
    plan_revert_file,
    remove_stray_temps,
    stage_write,
    unified_diff,
)
from rewriter.locking import DEFAULT_TIMEOUT, LockTimeout, locked
from rewriter.targets import Target, example_path, shown_path
from rewriter.verdicts import Verdict, remember

NOT_WRITTEN = "nothing written: a target could not be written"


@dataclass
class Report:
    command: str
    targets: list[Target]
    files: list[FileResult] = field(default_factory=list)
    error: str | None = None  # a target-level error (nothing was processed)
    note: str | None = None
    dry_run: bool = False  # `run`/`revert` with --dry-run or --diff: planned, nothing written
    exit_non_zero_on_fix: bool = False  # exit 1 when a file was written (pre-commit's fixer contract)
    verb: str = ""  # the command with the options a suggested rerun keeps (`revert --whole-bypass`)

    @property
    def dry(self) -> bool:
        return self.dry_run or self.command in ("check", "preview", "survey")  # commands that only look

    @property
    def exit_code(self) -> int:
        """2: a target could not be handled (nothing written); 1: a rewrite is needed (a dry run),
        or a file was written with --exit-non-zero-on-fix; 0: nothing to do, or done."""
        if self.error or any(f.failed for f in self.files):
            return 2
        if self.dry and self.count(FileStatus.NEEDS_REWRITE):
            return 1
        return 1 if self.exit_non_zero_on_fix and self.count(FileStatus.REWRITTEN) else 0

    def count(self, status: FileStatus) -> int:
        return sum(1 for f in self.files if f.status is status)


def under_pre_commit() -> bool:
    return os.environ.get("PRE_COMMIT") == "1"  # set by pre-commit for its hooks


def analyze_targets(command: str, targets: list[Target]) -> Report:
    """Plan every target; nothing is written (``check``, ``preview``) but the verdict on a
    patched file, for the plugin (``rewriter.verdicts``)."""
    files = [check_plan(t.path, t.diff_name) for t in targets]
    for result in files:
        remember(result)
    return Report(command, targets, files)


def check_plan(path: Path, name: str | None = None, promise: bool = True) -> FileResult:
    """What ``check``, ``survey`` and a dry ``run`` say ``run`` does with a file: its plan, judged. A plan
    that leaves a native call promises that call runs ("run with --kv-cache-dtype fp8 directly"): what it
    writes is run first, as ``judge`` runs a native call and as ``run`` will before writing it (``promise``
    False: ``run`` itself, which proves every file it writes)."""
    result = judge(honour_off(plan_file(path, name=name)))
    if not promise or result.status is not FileStatus.NEEDS_REWRITE or result.new is None:
        return result
    if not any(s.state is SiteState.NATIVE for s in result.new_sites):
        return result
    result.proof = proof.prove_apart(result.path, result.new, result.new_sites)
    if not failed_proof(result):
        ran = "was run" if result.proof.proven else "was not run here"
        for site in (s for s in result.sites if s.action in CHANGING):
            site.reason += f"; what `run` leaves {ran}: {result.proof.reason}"
    return result


def judge(result: FileResult) -> FileResult:
    """What no rewrite proves is run: ``verify``'s semantic level on the file as it is, bf16 cache
    against fp8 cache. That is a native call (its cache arguments, slots and dtype are the file's own),
    and a patched site whose bypass is not ``run``'s own (a fork's, a hand edit: ``revert`` does not
    give back the file ``run`` started from; it says why, in ``revert``'s words); ``run``'s own is
    proven as ``run`` is. Running it fails: refused (a native call, or a wired bypass's fp8 path, may
    write the wrong rows, or none); not run here: it says so. A pass, or a skip the level reported (what
    the stand-in cannot model), kept with the verdict of the same bytes (``rewriter.verdicts``) is read."""
    patched = [s for s in result.sites if s.state is SiteState.PATCHED]
    if patched:  # the bytes check judged, not a new read; a round trip compared byte for byte, never written
        reverted = plan_revert_file(result.path, raw=result.original, second_pass=False)
        if reverted.new is not None:  # `run` writes this file again into what `revert` leaves: its own
            patched = []
        refused = {s.line: s.reason for s in reverted.sites if s.action is Action.REFUSE}
        for site in patched:
            why = refused.get(site.line, reverted.error or "it finds no bypass to take out")
            why = why.removeprefix("cannot revert: ")
            if why not in site.reason:
                site.reason += f"; `revert` refuses it: {why}"
    others = patched + [s for s in result.sites if s.state is SiteState.NATIVE]
    if not others:
        return result
    kept = Verdict.load(result.path, result.original)  # these bytes, judged before by this version
    if kept is not None and kept.fine and (kept.proven or kept.skipped):  # run before: not again
        reason, details = kept.proven or kept.skipped
        result.proof = Proof(proof.PASSED if kept.proven else proof.SKIPPED, reason, tuple(details))
    else:
        result.proof = proof.prove_apart(result.path, result.original, others)
    shown = shlex.quote(shown_path(result.path))
    proven = result.proof.proven
    for site in others:
        bypass = site.state is SiteState.PATCHED
        if result.proof.status == proof.FAILED:
            wired = "an fp8 bypass is wired here, but it is not the one `run` writes"
            what = wired if bypass else "the call is native"
            mend = (
                "Mend it by hand, or take it out and let `run` write its own: "
                f"`mm3-codemod revert --whole-bypass {shown}`, then `mm3-codemod run {shown}`"
            ) if bypass else "Mend it by hand (upstream vLLM's call is the model)"
            site.state, site.action = SiteState.UNSUPPORTED, Action.REFUSE
            site.reason = (
                f"{what} and running it fails (the {proof.LEVEL} level, bf16 cache against fp8 cache): "
                f"{result.proof.reason}. {mend}"
            )
        else:
            ran = "it was run: " if proven else "it was not run here: "
            whose = ("it is not the bypass `run` writes, " + ("so " if proven else "and ")) if bypass else ""
            step = "" if proven else proof.how_to_run(result.proof, f"mm3-codemod verify {shown}")
            verify = f"; to run it: {step}" if step else ""
            site.reason += f"; {whose}{ran}{result.proof.reason}{verify}"
    if result.proof.status == proof.FAILED:
        result.status = FileStatus.REFUSED
        result.error = f"refused at line {others[0].line} (it fails when run)"
    return result


# --- the opt-out: `# mm3-codemod: off` ---------------------------------------------------
#
# A file-level directive, as isort's `# isort: skip_file`: `run` (and so the pre-commit hook)
# puts no bypass code into a file that has it on a line of its own. The `mm3-codemod-revert`
# hook writes it, so that a revert stays reverted; deleting the line turns `run` back on.
OFF_DIRECTIVE = "# mm3-codemod: off"
OFF_LINE = (
    f"{OFF_DIRECTIVE} - keep the fp8 KV-cache bypass out; delete this line to let mm3-codemod put it back"
)
_OFF = re.compile(rb"^[ \t]*#[ \t]*mm3-codemod:[ \t]*off\b", re.M)
ADDING = (Action.REWRITE, Action.COMPLETE, Action.UPGRADE)  # what puts bypass code in


def off_line(source: bytes) -> int | None:
    """The line of the file's ``# mm3-codemod: off``, else None."""
    match = _OFF.search(source)
    return source.count(b"\n", 0, match.start()) + 1 if match else None


def honour_off(result: FileResult) -> FileResult:
    """``run``'s plan of a file marked off: nothing that would put bypass code in is done (the
    whole file is left as it is), and each such site says so and how to turn it back on. Taking
    a stale bypass off a native call (``strip``) goes on: that keeps the bypass out too."""
    line = off_line(result.original) if result.status is FileStatus.NEEDS_REWRITE else None
    if line is None or not any(s.action in ADDING for s in result.sites):
        return result
    for site in result.sites:
        if site.action in CHANGING:
            site.reason += (
                f"; left alone (`{site.action.value}` not done): line {line} is `{OFF_DIRECTIVE}`;"
                " delete that line to let `run` do it"
            )
            site.action = Action.NONE
    result.status, result.new, result.diff, result.new_sites = FileStatus.UNCHANGED, None, "", []
    return result


def mark_off(result: FileResult, name: str | None) -> None:
    """Put ``OFF_LINE`` into the new source (if any) of a file ``revert`` takes the bypass out of, after
    its opening comment lines (a licence header, a shebang, a coding cookie), in its line ending."""
    new = result.new
    try:  # not an encoding that can spell it, or not an ASCII-compatible one: leave it
        directive = OFF_LINE.encode(result.encoding) if "#".encode(result.encoding) == b"#" else None
    except (LookupError, UnicodeError):
        return
    if new is None or directive is None or off_line(new) is not None:
        return
    start = len(BOM) if new.startswith(BOM) else 0
    lines = new[start:].splitlines(keepends=True)
    ending = b"\r\n" if lines and lines[0].endswith(b"\r\n") else b"\n"
    head = itertools.takewhile(lambda line: line.lstrip().startswith(b"#"), lines)
    offset = start + sum(map(len, head))
    before, after = new[:offset], new[offset:]
    if before and not before.endswith(b"\n"):  # only comments, and no final line ending
        before += ending
    result.new = before + directive + ending + after
    result.diff = unified_diff(name or result.path.name, result.original, result.new, result.encoding)
    line = before.count(b"\n") + 1
    for site in result.sites:
        if site.action is Action.REVERT:
            site.reason += (
                f"; `{OFF_DIRECTIVE}` written at line {line}: `run` and its hook leave this file"
                " alone until that line is deleted"
            )


def write_targets(
    command: str, targets: list[Target], backup: bool = False, dry_run: bool = False,
    exit_non_zero_on_fix: bool = False, lock_timeout: float = DEFAULT_TIMEOUT,
    on_wait: Callable[[Path], None] | None = None, prove: bool = True, whole_bypass: bool = False,
) -> Report:
    """Rewrite (``run``) or revert every target that needs it, all or nothing: a vLLM tree is
    left fully rewritten or as it was (barring a failing rename, which the report names).
    ``run`` proves each new file first (``rewriter.proof``; ``prove=False``: ``--no-prove``):
    one that fails its proof is an error, and nothing is written. ``revert`` takes out only a
    bypass whose removal gives back what ``run`` started from, unless ``whole_bypass``."""

    def plan() -> Report:
        if command == "run":
            files = [check_plan(t.path, t.diff_name, promise=dry_run) for t in targets]
        else:
            files = [plan_revert_file(t.path, t.diff_name, whole_bypass) for t in targets]
            if under_pre_commit():  # the revert hook: it stays reverted
                for target, result in zip(targets, files):
                    mark_off(result, target.diff_name)
        report = Report(command, targets, files, dry_run=dry_run, exit_non_zero_on_fix=exit_non_zero_on_fix)
        report.verb = "revert --whole-bypass" if whole_bypass else command
        return report

    if dry_run:
        return plan()  # writes nothing: no lock to wait for
    try:
        with locked([t.path for t in targets], lock_timeout, on_wait):
            testhook.at("locked")
            for target in targets:
                remove_stray_temps(target.path)  # left by a run killed mid-write
            report = plan()
            testhook.at("planned")
            if command == "run":
                _prove_all(report, prove)
            _write_all(report, backup)
            if command == "run":  # the plugin's first fp8 start after it needs no analysis
                for result in report.files:
                    remember(result)
            return report
    except LockTimeout as exc:
        report = plan()
        for result in report.files:
            if os.path.realpath(result.path) == str(exc.path):
                result.status, result.error = FileStatus.ERROR, str(exc)
        report.note = "nothing written: a target was locked by another mm3-codemod"
        return report


def _prove_all(report: Report, prove: bool) -> None:
    """Judge each file about to be written by the semantic level, before anything is staged; none
    where something failed already (nothing will be written, and torch is not imported)."""
    to_write = [f for f in report.files if f.status is FileStatus.NEEDS_REWRITE and f.new is not None]
    if not to_write or any(f.failed for f in report.files):
        return
    for result in to_write:
        result.proof = proof.prove(result) if prove else proof.NO_PROVE
        failed_proof(result)


def failed_proof(result: FileResult) -> bool:
    """A rewrite whose proof failed is an error: nothing is written (``run``), or would be (``check``)."""
    if result.proof is None or result.proof.status != proof.FAILED:
        return False
    why = f"the rewrite failed its proof ({proof.LEVEL} level): {result.proof.reason}"
    result.status, result.error = FileStatus.ERROR, f"{why}; nothing written"
    return True


def _write_all(report: Report, backup: bool) -> None:
    """Stage every new file (written and fsynced beside its target), then move them all into place."""
    if any(f.failed for f in report.files):
        report.note = "nothing written: a target was refused or failed"
        return

    def fail(result: FileResult, exc: FileError, left: list[StagedWrite], done: int = 0) -> None:
        for stage in left:
            discard(stage)
        result.status, result.error = FileStatus.ERROR, str(exc)
        report.note = f"{done} file(s) were rewritten before this failure" if done else NOT_WRITTEN

    staged: list[StagedWrite] = []
    for result in report.files:
        if result.status is FileStatus.NEEDS_REWRITE:
            try:
                staged.append(stage_write(result, backup=backup))
            except FileError as exc:
                return fail(result, exc, staged)
    with _no_interrupt():
        for i, stage in enumerate(staged):
            try:
                commit_write(stage)
            except FileError as exc:
                return fail(stage.result, exc, staged[i:], i)


@contextlib.contextmanager
def _no_interrupt() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until every staged file is in place: all or nothing, across files.
    A handler that notes it, not a signal mask, which another thread (torch's OpenMP pool, left by
    the proof) would dodge. Off the main thread nothing to hold: only it gets KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.SIG_DFL)
        if held:
            signal.raise_signal(signal.SIGINT)  # as it would have arrived: the handler held back


@contextlib.contextmanager
def example_copy() -> Iterator[Path]:
    """A private copy of the bundled example, removed afterwards: `run --example` never writes the package."""
    with tempfile.TemporaryDirectory(prefix="mm3-codemod-example-") as folder:
        target = Path(folder) / "example_model.py"
        shutil.copyfile(example_path(), target)
        yield target
