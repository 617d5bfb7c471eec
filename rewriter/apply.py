"""Parse -> analyze -> rewrite -> validate -> atomic write, one file at a time. Nothing is written
unless the new source parses, compiles and a second pass finds every rewritten site ``patched``
(``revert``: no bypass left). LibCST is imported only for a file the pre-filter cannot answer."""

from __future__ import annotations

import contextlib
import difflib
import enum
import glob
import io
import itertools
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


# What `run` proved of a file's new source before writing it (rewriter/proof.py): verify's semantic
# level passed, failed or was skipped (the stand-in cannot run it); no torch; or --no-prove.
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
    not_an_undo: bool = False  # `revert` refused: taking the bypass out would not give back run's input

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
    """A Python file's bytes as text, as LibCST and ``compile`` decode them: a UTF-8 BOM dropped,
    then the PEP 263 coding line, else UTF-8. ``FileError`` where they cannot be decoded so."""
    body = raw.removeprefix(BOM)
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(body).readline)
        return body.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise FileError(f"cannot decode source: {exc}") from exc


def read_source(path: Path | str) -> str:
    """The file's text as ``run`` reads it: every reader in ``verify`` uses this."""
    return source_text(read_bytes(Path(path)))


def _through_proc(path: Path) -> bool:
    """Whether a symlink on the way to ``path`` lives in /proc (``/dev/stdin`` -> ``/proc/self/fd/0``):
    it names whatever a process has open (``run /dev/stdin < other.py``), not the file spelled."""
    try:
        proc = os.stat("/proc").st_dev
    except OSError:
        return False  # no /proc here
    # Not abspath: a ".." after a link goes up from where the link leads, as in the kernel.
    current, pending, links = Path("/"), list((Path.cwd() / path).parts[1:]), 0
    while pending:
        part = pending.pop(0)
        step = current.parent if part == ".." else current / part  # ``current`` holds no link
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
        # an absolute target's first part is "/", and ``current / "/"`` is the root
        pending[:0] = Path(os.readlink(step)).parts
    return False


# What LibCST cannot take: brackets nested deeper than Python's own limit (its native parser
# crashes on a few thousand), and a statement of thousands of operators (its parser slows down
# with their square). Python's tokenizer measures both in milliseconds; nesting below these
# that still overflows the stack raises RecursionError, which planning reports the same way.
MAX_BRACKETS = 200
MAX_OPERATORS = 2000  # per statement: every token but literals, brackets, commas and colons
TOO_DEEP = f"brackets nest more than {MAX_BRACKETS} deep"
TOO_LONG = f"a statement of more than {MAX_OPERATORS} operators"
SPLIT_IT = "split it (mm3-codemod reads the file with LibCST, which recurses once per level of nesting)"
_NOT_OPERATORS = {tokenize.NUMBER, tokenize.STRING, tokenize.NL, tokenize.COMMENT, tokenize.INDENT}
_NOT_OPERATORS |= {tokenize.DEDENT, tokenize.ENCODING}


def _check_nesting(body: bytes) -> None:
    """Refuse a file nested deeper or chained longer than LibCST can take, before it sees it;
    what the tokenizer cannot read is left to LibCST, which says what is wrong with it."""
    depth = operators = 0
    try:
        for token in tokenize.tokenize(io.BytesIO(body).readline):
            if token.type == tokenize.NEWLINE:
                operators = 0
            elif token.type == tokenize.OP and token.string in ("(", "[", "{"):
                depth += 1
            elif token.type == tokenize.OP and token.string in (")", "]", "}"):
                depth -= 1
            elif token.type not in _NOT_OPERATORS and token.string not in (",", ":"):
                operators += 1
            if depth > MAX_BRACKETS or operators > MAX_OPERATORS:
                what = TOO_DEEP if depth > MAX_BRACKETS else TOO_LONG
                raise FileError(f"line {token.start[0]}: {what}; {SPLIT_IT}")
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError, LookupError):
        return  # (LibCST says what is wrong: an undecodable byte is `cannot decode source`)


def _parse(raw: bytes, ours: bool = False) -> cst.Module:
    """``ours``: the tool's own output, from a file already read (its nesting checked there)."""
    import libcst as cst

    body = raw.removeprefix(BOM)
    if not ours:
        _check_nesting(body)
    try:
        return cst.parse_module(body)
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


def _lost_tail(module: cst.Module, raw: bytes) -> bytes:
    """What LibCST's round trip drops at the end of ``raw`` (the last ``\\r`` of a file whose lines
    end in a lone ``\\r``), to put back. Any other loss is refused (``\\n`` files lose nothing)."""
    body = raw.removeprefix(BOM)
    if b"\r" not in body.replace(b"\r\n", b""):
        return b""
    again = module.bytes
    if not body.startswith(again):
        raise FileError("LibCST does not give this file back byte for byte; nothing written")
    return body[len(again) :]


def plan_file(
    path: Path, name: str | None = None, raw: bytes | None = None, revert: bool = False,
    transform: bool = True, second_pass: bool = True,
) -> FileResult:
    """Read (or take ``raw``), pre-filter, parse, analyze; where a rewrite (or revert) is needed, the
    validated new bytes. ``name``: the path the diff names (``Target.diff_name``; default: the file's
    name); ``transform=False``: classify only; ``second_pass=False``: the new bytes are not validated
    (a round trip's, never written)."""
    result = FileResult(path, FileStatus.ERROR)
    try:
        raw = result.original = read_bytes(path) if raw is None else raw
        sites = quick_sites(raw) if not revert or FUSED_OP.encode() not in raw else None
        if sites is not None:
            result.status, result.sites = FileStatus.UNCHANGED if sites else FileStatus.NO_SITES, sites
            return result
        from codemods.analysis import analyze, analyze_revert, rewrite

        module = _parse(raw)
        analysis = analyze_revert(module) if revert else analyze(module, raw)
        result.sites = analysis.sites
        if analysis.refused:  # planning writes nothing; a command that writes says so in its note
            first = analysis.refused[0]
            result.status = FileStatus.REFUSED
            result.error = f"refused at line {first.line} ({first.state.value})"
            return result
        if not analysis.needs_rewrite:
            result.status = FileStatus.UNCHANGED if analysis.sites else FileStatus.NO_SITES
            return result
        result.status = FileStatus.NEEDS_REWRITE
        if not transform:  # classify only
            return result
        try:
            compile_quietly(raw, path)
        except SyntaxError as exc:  # LibCST read it: its grammar knows newer Python
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
            raise FileError(
                f"does not compile under Python {version} (line {exc.lineno}: {exc.msg}), so a rewrite"
                " cannot be checked here; if the file is written for a newer Python, run mm3-codemod"
                " under that Python"
            ) from exc
        tail = _lost_tail(module, raw)
        try:
            new = (BOM if raw.startswith(BOM) else b"") + rewrite(analysis).bytes + tail
            if second_pass:  # (else never written: see the docstring)
                result.new_sites = validate(new, path, revert, analysis.patched_after)
        except FileError as exc:
            raise FileError(f"rewrite failed validation: {exc}") from exc
        result.new, result.encoding = new, module.encoding
        result.diff = unified_diff(name or path.name, raw, new, module.encoding)
    except FileError as exc:
        result.status, result.error = FileStatus.ERROR, str(exc)
    except RecursionError:  # deeper than LibCST can go, below the limits: never a traceback
        result.status, result.sites = FileStatus.ERROR, []
        result.error = f"an expression is nested too deeply; {SPLIT_IT}"
    return result


def classify_file(path: Path, raw: bytes | None = None) -> FileResult:
    """Each site's state only: nothing is rewritten or validated (``verify``)."""
    return plan_file(path, raw=raw, transform=False)


def plan_revert_file(
    path: Path, name: str | None = None, whole_bypass: bool = False, raw: bytes | None = None,
    second_pass: bool = True,
) -> FileResult:
    """Like ``plan_file``, for taking the bypass out again (``revert``): refused where that would
    not give back what ``run`` started from (``undo_refusal``), unless ``whole_bypass``."""
    result = plan_file(path, name, raw, revert=True, second_pass=second_pass)
    if result.new is not None and not whole_bypass and (why := undo_refusal(result, second_pass)):
        result.status, result.new, result.diff, result.not_an_undo = FileStatus.REFUSED, None, "", True
        for site in result.sites:
            if site.action is Action.REVERT:
                site.action, site.reason = Action.REFUSE, f"cannot revert: {why}"
                result.error = f"refused at line {site.line} ({site.state.value})"
    return result


def undo_refusal(reverted: FileResult, second_pass: bool = True) -> str | None:
    """Why the planned revert is not an undo of ``run``, else None. It is one where ``run`` writes this
    file again byte for byte from what the revert leaves, or (the revert's second pass proved no bypass
    left) has nothing to do there: a stale bypass on a native call, which ``run`` takes out too."""
    raw, path = reverted.original, reverted.path
    again = plan_file(path, raw=reverted.new, second_pass=second_pass)
    if again.new == raw or (second_pass and again.status is FileStatus.UNCHANGED):
        return None
    if again.new is None:
        why = f"`run` cannot put a bypass back into what it leaves ({again.error})"
    else:
        ours, runs = raw.splitlines(), again.new.splitlines()
        opcodes = difflib.SequenceMatcher(None, ours, runs, autojunk=False).get_opcodes()
        _, i, j, k, m = next(op for op in opcodes if op[0] != "equal")
        has, writes = _first_words(ours[i:j], reverted.encoding), _first_words(runs[k:m], reverted.encoding)
        why = (
            f"this bypass is not the one `run` writes into the file without it (line {i + 1} has {has};"
            f" `run` writes {writes})"
        )
    write = next((f"`{s.write_method}`" for s in reverted.sites if s.write_method), "write method")
    backup = path.with_name(path.name + ".orig")
    restore = f"from {backup}, the copy `run --backup` kept," if backup.is_file() else "from version control"
    return (
        f"{why}, so taking it out would not give back the file as it was before `run` (a fork's own"
        f" bypass, one `run` upgraded, or a fork-era {write} `run` replaced and cannot put back)."
        f" Restore that {restore} or take the whole bypass out with"
        " `revert --whole-bypass`"
    )


def _first_words(lines: list[bytes], encoding: str, width: int = 60) -> str:
    """The first line of ``lines`` with words on it, quoted and cut to ``width``; else ``nothing``."""
    line = next((x.decode(encoding, "replace").strip() for x in lines if x.strip()), None)
    return "nothing" if line is None else f"`{line if len(line) <= width else line[: width - 3] + '...'}`"


def quick_sites(raw: bytes) -> list[InsertSite] | None:
    """Each site's state where the ``ast`` pre-filter can tell (none: no mention of the op);
    None where it takes the full analysis. Native files: LibCST is never imported."""
    return [] if FUSED_OP.encode() not in raw else prefilter(raw)


def compile_quietly(source: bytes, path: Path) -> None:
    """Compile ``source`` with this Python (``SyntaxError``), hiding the file's own warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (`x is 1`, "\d"): not ours to print
        compile(source.removeprefix(BOM), str(path), "exec", dont_inherit=True)


def validate(new: bytes, path: Path, revert: bool, expected_patched: int) -> list[InsertSite]:
    """The new source parses, compiles, and a second pass has nothing to do; its sites. A revert's:
    neither pass finds a bypass (or half of one) left; no sites (``run`` proves none)."""
    from codemods.analysis import analyze, analyze_revert

    module = _parse(new, ours=True)
    try:
        compile_quietly(new, path)
    except SyntaxError as exc:
        raise FileError(f"output does not compile: {exc.msg} (line {exc.lineno})") from exc
    sites = analyze_revert(module).sites if revert else analyze(module, new).sites
    for s in sites:
        if s.action is not Action.NONE:
            what = s.action.value if revert else s.state.value
            raise FileError(f"second pass still finds line {s.line} {what}: {s.reason}")
    if revert:
        stale = [s for s in analyze(module).sites if s.state in (SiteState.PATCHED, SiteState.HALF_APPLIED)]
        if stale:
            raise FileError(f"line {stale[0].line} is still {stale[0].state.value} after the revert")
        return []
    patched = sum(s.state is SiteState.PATCHED for s in sites)
    if patched < expected_patched:
        raise FileError(f"second pass finds {patched} patched site(s), expected {expected_patched}")
    return sites


def _lines(raw: bytes, encoding: str) -> list[str]:
    """The file's lines as ``patch`` and ``git apply`` read them: ended by ``\n`` only, with their
    endings (``str.splitlines`` would also split at ``\r``, ``\x0c``, ``\u2028``...)."""
    lines = raw.removeprefix(BOM).decode(encoding).split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def unified_diff(name: str, old: bytes, new: bytes, encoding: str) -> str:
    """A git-style diff of ``name`` (a relative POSIX path): ``a/``/``b/`` prefixes, so that
    ``git apply`` and ``patch -p1`` take it from the folder that ``name`` is relative to."""
    lines = difflib.unified_diff(_lines(old, encoding), _lines(new, encoding), f"a/{name}", f"b/{name}")
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


# --- writing ---------------------------------------------------------------------------


TEMP_SUFFIX = ".mm3-codemod.tmp"


def _temp_prefix(real: Path) -> str:
    return f".{real.name}."


@dataclass
class StagedWrite:
    """A rewrite ready to be moved into place: the new bytes fsynced beside the target (a backup)."""

    result: FileResult
    real: Path
    temp: Path
    backup: Path | None = None


def stage_write(result: FileResult, backup: bool = False) -> StagedWrite:
    """Check the file is still what was analysed and writable; write the temp file (and the
    backup). Nothing the user sees changes yet: on failure both are removed (``FileError``)."""
    assert result.new is not None
    real = Path(os.path.realpath(result.path))
    st = _check_unchanged(real, result.original)
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
    with contextlib.suppress(OSError):  # makes the rename durable; not every system can fsync a folder
        fd = os.open(staged.real.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    staged.result.backup = staged.backup
    staged.result.status = FileStatus.REWRITTEN


def discard(staged: StagedWrite) -> None:
    """Remove what staging wrote (the temp file and the backup)."""
    for path in filter(None, (staged.temp, staged.backup)):
        _unlink(path)


def _check_unchanged(real: Path, original: bytes) -> os.stat_result:
    """The file's status, where its bytes are still ``original``."""
    try:
        with open(real, "rb") as file:
            current, st = file.read(), os.fstat(file.fileno())
    except OSError as exc:
        raise FileError(f"cannot re-read before writing: {exc.strerror or exc}") from exc
    if current != original:
        raise FileError("changed by someone else since it was read; nothing written, run again")
    return st


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
        for n in itertools.count():
            candidate = real.with_name(f"{real.name}.orig.{n}" if n else f"{real.name}.orig")
            with contextlib.suppress(FileExistsError):
                os.link(temp, candidate)  # fails if it exists: never overwrites a backup
                return candidate
    except OSError as exc:
        raise FileError(f"cannot write the backup: {exc.strerror or exc}; nothing written") from exc
    finally:
        _unlink(temp)


def _write_temp(path: Path, data: bytes, mode: int, owner: tuple[int, int]) -> Path:
    """``data`` in a new fsynced file beside ``path`` with ``mode`` and ``owner``; removed on failure."""
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
    except BaseException as exc:
        _unlink(temp)
        if isinstance(exc, OSError):
            raise FileError(f"cannot write: {exc.strerror or exc}; nothing written") from exc
        raise
    return temp


def _chown(path: Path, uid: int, gid: int) -> None:
    """Give ``path`` this owner and group, or as much of it as this user may (as ``cp`` does)."""
    for want in ((uid, gid), (-1, gid)):
        with contextlib.suppress(PermissionError):
            os.chown(path, *want)
            return


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
