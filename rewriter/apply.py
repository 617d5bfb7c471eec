"""Parse -> analyze -> rewrite -> validate -> atomic write, one file at a time.

Nothing is written unless the new source parses, compiles, and a second pass
of the codemod finds every rewritten site ``patched`` (black's discipline);
for ``revert``, a second pass finds no bypass left.

LibCST is imported only for a file that the pre-filter cannot answer: a
native file is checked without it (``codemods/prefilter.py``).
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import glob
import io
import os
import shutil
import stat
import sys
import tempfile
import tokenize
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from codemods.schema import FUSED_OP, Action, InsertSite, SiteState
from codemods.prefilter import prefilter
from rewriter import testhook

if TYPE_CHECKING:
    import libcst as cst

    from codemods.analysis import FileAnalysis, RevertAnalysis

BOM = b"\xef\xbb\xbf"


class FileStatus(str, enum.Enum):
    NO_SITES = "no-sites"  # no call of the fused op at all
    UNCHANGED = "unchanged"  # sites found, nothing to do
    NEEDS_REWRITE = "needs-rewrite"
    REWRITTEN = "rewritten"
    REFUSED = "refused"  # unsupported structure or a site that must not be rewritten
    ERROR = "error"  # unreadable, not Python, failed validation, write failed
    NO_VLLM = "no-vllm"  # survey: a --python environment without vLLM (the path is the interpreter)


class FileError(Exception):
    """A one-line reason why a file could not be handled."""


# What `run` proved of a file's new source before writing it (rewriter/proof.py): verify's
# semantic level passed, failed, or was skipped (the stand-in cannot run the file); torch was
# unavailable; or proving was off (--no-prove).
PASSED, FAILED, SKIPPED, UNAVAILABLE, OFF = "passed", "failed", "skipped", "unavailable", "off"
LEVEL = "semantic"


@dataclass(frozen=True)
class Proof:
    status: str  # PASSED, FAILED, SKIPPED, UNAVAILABLE or OFF
    reason: str
    details: tuple[str, ...] = ()  # the level's checks (--json)

    @property
    def proven(self) -> bool:
        return self.status == PASSED

    def to_json(self) -> dict[str, object]:
        return {"level": LEVEL, "status": self.status, "reason": self.reason, "details": list(self.details)}


@dataclass
class FileResult:
    path: Path
    status: FileStatus
    sites: list[InsertSite] = field(default_factory=list)
    error: str | None = None
    diff: str = ""
    encoding: str = "utf-8"  # the file's: the diff is printed in it, byte for byte
    backup: Path | None = None
    original: bytes = field(default=b"", repr=False)
    new: bytes | None = field(default=None, repr=False)
    new_sites: list[InsertSite] = field(default_factory=list, repr=False)  # the new source's (run)
    proof: Proof | None = None  # `run`: the semantic level on ``new`` before it is written

    @property
    def failed(self) -> bool:
        return self.status in (FileStatus.REFUSED, FileStatus.ERROR)

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "status": self.status.value,
            "error": self.error,
            "sites": [s.to_json() for s in self.sites],
            "diff": self.diff,
            "backup": str(self.backup) if self.backup else None,
            "proof": self.proof.to_json() if self.proof else None,
        }


def read_bytes(path: Path) -> bytes:
    """The bytes of a regular file, reached by its path; else ``FileError`` saying why."""
    if not path.exists() and not path.is_symlink():
        raise FileError("no such file")
    if path.is_dir():
        try:
            os.scandir(path).close()
        except OSError as exc:  # python_files names such a folder as a target
            raise FileError(
                f"cannot read this folder: {exc.strerror or exc}; the .py files in it were not checked"
            ) from exc
        raise FileError("is a directory, not a file")
    if _through_proc(path):
        raise FileError(
            "not a regular file: the path leads through /proc, to whatever a process has open"
            " (/dev/stdin, /dev/fd/N, /proc/self/fd/N); name the file itself"
        )
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise FileError("not a regular file")  # a FIFO or a device would block or never end
        raw = path.read_bytes()
    except OSError as exc:
        raise FileError(f"cannot read: {exc.strerror or exc}") from exc
    if b"\0" in raw:
        raise FileError("binary file (NUL bytes), not Python source")
    return raw


def source_text(raw: bytes) -> str:
    """A Python file's bytes as text, decoded as ``run`` reads them: a UTF-8 BOM dropped, then
    the PEP 263 coding line (``# -*- coding: latin-1 -*-``), else UTF-8 (what LibCST and
    ``compile`` make of the same bytes). ``FileError`` where they cannot be decoded so."""
    body = raw.removeprefix(BOM)
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(body).readline)
        return body.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise FileError(f"cannot decode source: {exc}") from exc


def read_source(path: Path | str) -> str:
    """The text of the file at ``path``, read (``read_bytes``) and decoded (``source_text``) as
    ``run`` reads it: every reader of a model file's text in ``verify`` goes through here."""
    return source_text(read_bytes(Path(path)))


def _through_proc(path: Path) -> bool:
    """Whether a symlink on the way to ``path`` lives in /proc (``/dev/stdin`` ->
    ``/proc/self/fd/0``): what such a link names is whatever a process has open (``run
    /dev/stdin < other.py`` would rewrite other.py), not the file the path spells."""
    try:
        proc = os.stat("/proc").st_dev
    except OSError:
        return False  # no /proc here
    # Not abspath: a ".." after a link goes up from where the link leads, as in the kernel.
    current, pending, links = Path("/"), list((Path.cwd() / path).parts[1:]), 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            current = current.parent
            continue
        step = current / part
        try:
            st = os.lstat(step)
        except OSError:
            return False  # reading it says what is wrong
        if not stat.S_ISLNK(st.st_mode):
            current = step
            continue
        if st.st_dev == proc:
            return True
        links += 1
        if links > 40:  # the kernel's own limit: a loop, which reading it reports
            return False
        target = Path(os.readlink(step))
        pending[:0] = target.parts[1:] if target.is_absolute() else target.parts
        current = Path("/") if target.is_absolute() else current
    return False


def analyze(module: cst.Module, source: bytes | None = None) -> FileAnalysis:
    """The LibCST codemod's analysis (imported here, on first need)."""
    from codemods.analysis import analyze as analyze_module

    return analyze_module(module, source)


def rewrite(analysis: FileAnalysis) -> cst.Module:
    from codemods.analysis import rewrite as rewrite_module

    return rewrite_module(analysis)


def analyze_revert(module: cst.Module, source: bytes | None = None) -> RevertAnalysis:
    """Like ``analyze`` (``source`` unused), for taking the bypass out again."""
    from codemods.analysis import analyze_revert as analyze_module

    return analyze_module(module)


def revert_module(analysis: RevertAnalysis) -> cst.Module:
    from codemods.analysis import revert

    return revert(analysis)


# What LibCST cannot take: brackets nested deeper than Python's own limit (its native
# parser crashes on a few thousand), and a statement of thousands of operators (its parser
# slows down with their square: 20,000 terms take minutes). Python's tokenizer measures both
# in milliseconds, for any file; nesting below these that still overflows Python's stack
# (a sum of 500 terms) raises RecursionError, which planning reports the same way.
MAX_BRACKETS = 200
MAX_OPERATORS = 2000  # per statement: every token but literals, brackets, commas and colons
SPLIT_IT = "split it (mm3-codemod reads the file with LibCST, which recurses once per level of nesting)"
_NOT_OPERATORS = {tokenize.NUMBER, tokenize.STRING, tokenize.NL, tokenize.COMMENT, tokenize.INDENT}
_NOT_OPERATORS |= {tokenize.DEDENT, tokenize.ENCODING}


def _check_nesting(body: bytes) -> None:
    """Refuse, before LibCST sees it, a file nested deeper or chained longer than it can take.
    What the tokenizer cannot read is left to LibCST, which says what is wrong with it."""
    depth = operators = 0
    try:
        for token in tokenize.tokenize(io.BytesIO(body).readline):
            if token.type == tokenize.NEWLINE:
                operators = 0
            elif token.type == tokenize.OP and token.string in ("(", "[", "{"):
                depth += 1
                if depth > MAX_BRACKETS:
                    raise FileError(
                        f"line {token.start[0]}: brackets nest more than {MAX_BRACKETS} deep; {SPLIT_IT}"
                    )
            elif token.type == tokenize.OP and token.string in (")", "]", "}"):
                depth -= 1
            elif token.type not in _NOT_OPERATORS and token.string not in (",", ":"):
                operators += 1
                if operators > MAX_OPERATORS:
                    raise FileError(
                        f"line {token.start[0]}: a statement of more than {MAX_OPERATORS} operators; {SPLIT_IT}"
                    )
    except (tokenize.TokenError, SyntaxError):
        return


def _parse(raw: bytes, ours: bool = False) -> cst.Module:
    """``ours``: the tool's own output, from a file already read (its nesting checked there)."""
    import libcst as cst

    body = raw.removeprefix(BOM)
    if not ours:
        _check_nesting(body)
    try:
        module = cst.parse_module(body)
    except cst.ParserSyntaxError as exc:
        try:  # Python's own word on where and what, as `python file.py` would say it
            compile(body, "<file>", "exec", dont_inherit=True)
        except SyntaxError as py:
            raise FileError(f"not valid Python (line {py.lineno}, column {py.offset}): {py.msg}") from exc
        except (ValueError, MemoryError, RecursionError):
            pass
        raise FileError(
            f"not valid Python (line {exc.raw_line}, column {exc.raw_column}): {exc.message}"
        ) from exc
    except (UnicodeDecodeError, LookupError, SyntaxError) as exc:
        raise FileError(f"cannot decode source: {exc}") from exc
    return module


def _lost_tail(module: cst.Module, raw: bytes) -> bytes:
    """What LibCST's round trip drops at the end of ``raw`` (the last ``\\r`` of a file whose
    lines end in a lone ``\\r``), to put back after the rewrite. Anything else it would not
    give back byte for byte is refused: everything but the rewrite must stay as it was.
    (Only such a file is generated again to see: ``\\n`` and ``\\r\\n`` files come back whole.)"""
    body = raw.removeprefix(BOM)
    if b"\r" not in body.replace(b"\r\n", b""):
        return b""
    again = module.bytes
    if not body.startswith(again):
        raise FileError("LibCST does not give this file back byte for byte; nothing written")
    return body[len(again) :]


def plan_file(path: Path, name: str | None = None) -> FileResult:
    """Analyze one file and, where a rewrite is needed, prepare the validated new bytes;
    ``name`` is the path the diff names (``Target.diff_name``; default: the file's name)."""
    return _plan(path, analyze, rewrite, lambda new, a: validate(new, path, a.patched_after), True, name)


def classify_file(path: Path) -> FileResult:
    """Each site's state only: nothing is rewritten or validated (``verify``)."""
    return _plan(path, analyze, None, None, quick=True)


def plan_revert_file(path: Path, name: str | None = None) -> FileResult:
    """Like ``plan_file``, for taking the bypass out again (``revert``)."""
    return _plan(path, analyze_revert, revert_module, lambda new, _: validate_revert(new, path), False, name)


def _plan(path: Path, analyze_module, transform, check, quick: bool, name: str | None = None) -> FileResult:
    """Read, pre-filter, parse, analyze; then transform and ``check`` the new bytes."""
    try:
        raw = read_bytes(path)
    except FileError as exc:
        return FileResult(path, FileStatus.ERROR, error=str(exc))
    if FUSED_OP.encode() not in raw:  # no mention of the op: no parse at all
        return FileResult(path, FileStatus.NO_SITES, original=raw)
    sites = prefilter(raw) if quick else None  # native files: LibCST is never imported
    if sites is not None:
        return FileResult(
            path, FileStatus.UNCHANGED if sites else FileStatus.NO_SITES, sites=sites, original=raw
        )
    result = FileResult(path, FileStatus.ERROR, original=raw)
    try:
        _plan_with_libcst(result, analyze_module, transform, check, name)
    except FileError as exc:
        result.status, result.error = FileStatus.ERROR, str(exc)
    except RecursionError:  # deeper than LibCST can go, below the limits: never a traceback
        result.status, result.sites = FileStatus.ERROR, []
        result.error = f"an expression is nested too deeply; {SPLIT_IT}"
    return result


def _plan_with_libcst(result: FileResult, analyze_module, transform, check, name: str | None) -> None:
    """Fill in ``result``; ``FileError`` says why the file cannot be rewritten."""
    raw = result.original
    module = _parse(raw)
    analysis = analyze_module(module, raw)
    result.sites = analysis.sites
    if analysis.refused:
        first = analysis.refused[0]
        # Planning writes nothing; a command that writes says so in its note.
        result.status = FileStatus.REFUSED
        result.error = f"refused at line {first.line} ({first.state.value})"
        return
    if not analysis.needs_rewrite:
        result.status = FileStatus.UNCHANGED if analysis.sites else FileStatus.NO_SITES
        return
    result.status = FileStatus.NEEDS_REWRITE
    if transform is None:  # classify only
        return
    try:
        _compile(raw, result.path)
    except SyntaxError as exc:  # LibCST read it: its grammar knows newer Python
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise FileError(
            f"does not compile under Python {version} (line {exc.lineno}: {exc.msg}), so a rewrite cannot"
            f" be checked here; if the file is written for a newer Python, run mm3-codemod under that Python"
        ) from exc
    tail = _lost_tail(module, raw)
    try:
        new = (BOM if raw.startswith(BOM) else b"") + transform(analysis).bytes + tail
        result.new_sites = check(new, analysis) or []
    except FileError as exc:
        raise FileError(f"rewrite failed validation: {exc}") from exc
    result.new, result.encoding = new, module.encoding
    result.diff = unified_diff(name or result.path.name, raw, new, module.encoding)


def _compile(source: bytes, path: Path) -> None:
    """Compile ``source`` with this Python; raises ``SyntaxError``."""
    with warnings.catch_warnings():
        # The file's own warnings (`x is 1`, "\d") are not ours to print.
        warnings.simplefilter("ignore")
        compile(source.removeprefix(BOM), str(path), "exec", dont_inherit=True)


def _parse_and_compile(new: bytes, path: Path) -> cst.Module:
    module = _parse(new, ours=True)
    try:
        _compile(new, path)
    except SyntaxError as exc:
        raise FileError(f"output does not compile: {exc.msg} (line {exc.lineno})") from exc
    return module


def validate(new: bytes, path: Path, expected_patched: int) -> list[InsertSite]:
    """The new source parses, compiles, and a second pass has nothing to do; its sites."""
    module = _parse_and_compile(new, path)
    again = analyze(module, new)
    for s in again.sites:
        if s.action is not Action.NONE:
            raise FileError(f"second pass still finds line {s.line} {s.state.value}: {s.reason}")
    patched = sum(1 for s in again.sites if s.state is SiteState.PATCHED)
    if patched < expected_patched:
        raise FileError(f"second pass finds {patched} patched site(s), expected {expected_patched}")
    return again.sites


def validate_revert(new: bytes, path: Path) -> None:
    """The reverted source parses, compiles, and carries no bypass any more:
    a second revert finds nothing, and no site is left patched or half-applied."""
    module = _parse_and_compile(new, path)
    again = analyze_revert(module)
    for s in again.sites:
        if s.action is not Action.NONE:
            raise FileError(f"second pass still finds line {s.line} {s.action.value}: {s.reason}")
    stale = [s for s in analyze(module).sites if s.state in (SiteState.PATCHED, SiteState.HALF_APPLIED)]
    if stale:
        raise FileError(f"line {stale[0].line} is still {stale[0].state.value} after the revert")


def _lines(raw: bytes, encoding: str) -> list[str]:
    """The file's lines as ``patch`` and ``git apply`` read them: ended by ``\n`` only, each
    with its ending (``\r\n`` stays; ``str.splitlines`` would also split at ``\r``, ``\x0c``,
    ``\x1c``, ``\u2028``... and make a diff no tool applies)."""
    body = raw.removeprefix(BOM)
    lines = body.decode(encoding).split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def unified_diff(name: str, old: bytes, new: bytes, encoding: str) -> str:
    """A git-style diff of ``name`` (a relative POSIX path): ``a/``/``b/`` prefixes, so that
    ``git apply`` and ``patch -p1`` take it from the folder that ``name`` is relative to."""
    lines = difflib.unified_diff(
        _lines(old, encoding),
        _lines(new, encoding),
        fromfile=f"a/{name}",
        tofile=f"b/{name}",
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


# --- writing ---------------------------------------------------------------------------


TEMP_SUFFIX = ".mm3-codemod.tmp"


def _temp_prefix(real: Path) -> str:
    return f".{real.name}."


@dataclass
class StagedWrite:
    """A rewrite ready to be moved into place: the new bytes are on disk beside
    the target, fsynced, with its mode (and a backup made, if asked for)."""

    result: FileResult
    real: Path
    temp: Path
    backup: Path | None = None


def stage_write(result: FileResult, backup: bool = False) -> StagedWrite:
    """Check the file is still what was analysed and writable; write the temp file (and the
    backup). Nothing the user sees changes yet: on failure both are removed (``FileError``)."""
    assert result.new is not None
    real = Path(os.path.realpath(result.path))
    _check_unchanged(real, result.original)
    try:
        st = real.stat()
    except OSError as exc:
        raise FileError(f"cannot stat before writing: {exc.strerror or exc}") from exc
    mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise FileError("file is read-only; nothing written")
    staged = StagedWrite(result, real, _write_temp(real, result.new, mode, owner))
    if backup:
        try:
            staged.backup = _write_backup(real, result.original, mode, owner)
        except FileError:
            discard(staged)
            raise
    return staged


def commit_write(staged: StagedWrite) -> None:
    """Move the staged temp file over the target (``os.replace``: old or new, never half)."""
    try:
        _check_unchanged(staged.real, staged.result.original)
        os.replace(staged.temp, staged.real)
    except OSError as exc:
        raise FileError(f"cannot replace the file: {exc.strerror or exc}; nothing written") from exc
    testhook.at("replaced")
    _fsync_dir(staged.real.parent)
    staged.result.backup = staged.backup
    staged.result.status = FileStatus.REWRITTEN


def discard(staged: StagedWrite) -> None:
    """Remove what staging wrote (the temp file and the backup)."""
    for path in (staged.temp, staged.backup):
        if path is not None:
            _unlink(path)


def _check_unchanged(real: Path, original: bytes) -> None:
    try:
        current = real.read_bytes()
    except OSError as exc:
        raise FileError(f"cannot re-read before writing: {exc.strerror or exc}") from exc
    if current != original:
        raise FileError("changed by someone else since it was read; nothing written, run again")


def remove_stray_temps(path: Path) -> None:
    """Remove the temp files of ``path`` left by a run killed mid-write (the lock is held)."""
    real = Path(os.path.realpath(path))
    prefix = _temp_prefix(real)
    try:
        candidates = list(real.parent.glob(f"{glob.escape(prefix)}*{TEMP_SUFFIX}"))
    except OSError:
        return
    for temp in candidates:
        if temp.is_file() and not temp.is_symlink() and "." not in temp.name[len(prefix) : -len(TEMP_SUFFIX)]:
            _unlink(temp)


def _write_backup(real: Path, data: bytes, mode: int, owner: tuple[int, int]) -> Path:
    """``<file>.orig`` (or ``.orig.N``), written whole or not at all, never over another."""
    temp = _write_temp(real, data, mode, owner)
    try:
        shutil.copystat(real, temp)
        candidate, n = real.with_name(real.name + ".orig"), 0
        while True:
            try:
                os.link(temp, candidate)  # fails if it exists: never overwrites a backup
                return candidate
            except FileExistsError:
                n += 1
                candidate = real.with_name(f"{real.name}.orig.{n}")
    except OSError as exc:
        raise FileError(f"cannot write the backup: {exc.strerror or exc}; nothing written") from exc
    finally:
        _unlink(temp)


def _write_temp(path: Path, data: bytes, mode: int, owner: tuple[int, int]) -> Path:
    """``data`` in a new fsynced file beside ``path`` with ``mode`` and, as far as this user
    may give it, ``owner`` (uid, gid); removed again on failure."""
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=TEMP_SUFFIX)
    except OSError as exc:
        raise FileError(
            f"cannot create a temporary file beside it: {exc.strerror or exc}; nothing written"
        ) from exc
    temp = Path(name)
    try:
        try:
            testhook.at("temp-created")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            testhook.at("temp-written")
            os.fsync(fd)
        finally:
            os.close(fd)
        _chown(temp, *owner)
        os.chmod(temp, mode)  # after chown, which may clear set-id bits
        testhook.at("temp-synced")
    except OSError as exc:
        _unlink(temp)
        raise FileError(f"cannot write: {exc.strerror or exc}; nothing written") from exc
    except BaseException:
        _unlink(temp)
        raise
    return temp


def _chown(path: Path, uid: int, gid: int) -> None:
    """Give ``path`` this owner and group, or as much of it as this user may (root: both;
    anyone: a group they are in); what is not permitted stays theirs, as with ``cp``."""
    for want in ((uid, gid), (-1, gid)):
        try:
            os.chown(path, *want)
            return
        except PermissionError:
            continue


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable; not every system can fsync a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
