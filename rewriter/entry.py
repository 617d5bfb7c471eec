"""The ``mm3-codemod`` console script, and what each command prints.

``check`` sits in pre-commit and ``survey`` walks dozens of environments, so
a plain ``check``/``preview``/``run``/``survey`` command line is read here and
run without typer: importing typer and building its pydantic-backed option
converters costs more than the whole ast triage. The fast reader accepts
only the commands' own options in their plain forms;
anything else (``--help``, ``--version``, another command, an option it does
not know, ``--``) goes to the typer app in ``rewriter.cli``, which stays the
definition of the command line. Both call the same functions below, so the
output is the same whichever read the command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rewriter.apply import FileStatus
from rewriter.commands import Report, analyze_targets, example_copy
from rewriter.commands import run as run_targets
from rewriter.console import COLOR_MODES, OutputError, console, say, set_color, write_stdout
from rewriter.locking import DEFAULT_TIMEOUT
from rewriter.targets import Target, TargetError, resolve, shown_path

if TYPE_CHECKING:
    from rich.console import Console


def stderr(wide: bool = False) -> Console:
    # Tables are not squeezed to 80 columns when stderr is a pipe or a file.
    width = None if not wide or sys.stderr.isatty() else int(os.environ.get("COLUMNS", 0) or 240)
    return console(sys.stderr, width=width)


def say_waiting(timeout: float) -> Callable[[Path], None]:
    def waiting(path: Path) -> None:
        say(stderr(), f"waiting for {path}: another mm3-codemod run holds it (up to {timeout:g} s)")

    return waiting


def targets_of(
    command: str, paths: list[Path], pythons: list[str], roots: list[Path], example: bool
) -> tuple[list[Target], Report | None]:
    try:
        return resolve(paths, pythons, roots, example=example), None
    except TargetError as exc:
        return [], Report(command, [], error=str(exc))


def print_diffs(report: Report, only: FileStatus | None = None) -> None:
    """Each file's unified diff on stdout (coloured only on a terminal); on stderr,
    the folder to apply it from when that is not the working folder."""
    roots = []
    for index, result in enumerate(report.files):
        if result.diff and (only is None or result.status is only):
            write_diff(result.diff, result.encoding)
            target = report.targets[index] if index < len(report.targets) else None
            root = target.root if target and target.origin != "--example" else None
            if root is not None and os.path.abspath(root) != os.getcwd() and root not in roots:
                roots.append(root)
    for root in roots:
        say(
            stderr(),
            f"diff paths are relative to {shown_path(root)}: apply it there (git apply, or patch -p1)",
        )


def write_diff(diff: str, encoding: str) -> None:
    """The diff on stdout as the file's own bytes (its encoding, its line endings, its tabs),
    so that ``patch`` and ``git apply`` take it; coloured only where the console would colour."""
    out = console(sys.stdout)
    if out.color_system is not None and not out.no_color:
        from rewriter.report import colour_diff

        diff = colour_diff(diff)
    try:
        data = diff.encode(encoding, errors="surrogateescape")
    except UnicodeEncodeError:  # a file name the file's own encoding cannot spell
        data = diff.encode(encoding, errors="replace")
    write_stdout(data)


def finish(report: Report, as_json: bool, show_all: bool) -> int:
    """The human report on stderr, the JSON one on stdout; the exit code."""
    from rewriter.report import print_human, print_json

    print_human(report, stderr(), show_all=show_all)
    if as_json:
        print_json(report)
    return int(report.exit_code)


def check(
    paths: list[Path],
    pythons: list[str],
    roots: list[Path],
    example: bool,
    diff: bool,
    as_json: bool,
    show_all: bool,
) -> int:
    targets, failed = targets_of("check", paths, pythons, roots, example)
    report = failed or analyze_targets("check", targets)
    if diff and not as_json:
        print_diffs(report)
    return finish(report, as_json, show_all)


def preview(
    paths: list[Path], pythons: list[str], roots: list[Path], example: bool, as_json: bool, show_all: bool
) -> int:
    targets, failed = targets_of("preview", paths, pythons, roots, example)
    report = failed or analyze_targets("preview", targets)
    if not as_json:
        print_diffs(report)
    return finish(report, as_json, show_all)


def run(
    paths: list[Path],
    pythons: list[str],
    roots: list[Path],
    example: bool,
    *,
    backup: bool = False,
    dry_run: bool = False,
    diff: bool = False,
    show_diff: bool = False,
    exit_non_zero_on_fix: bool = False,
    as_json: bool = False,
    show_all: bool = False,
    lock_timeout: float = DEFAULT_TIMEOUT,
) -> int:
    """``--diff`` writes nothing and prints the diff (as ``check --diff``); ``--show-diff``
    prints the diff of what was written."""
    dry = dry_run or diff
    with contextlib.ExitStack() as stack:
        copy = stack.enter_context(example_copy()) if example else None
        targets, failed = targets_of("run", paths + ([copy] if copy else []), pythons, roots, False)
        targets = [dataclasses.replace(t, origin="--example") if t.path == copy else t for t in targets]
        report = failed or run_targets(
            targets,
            backup=backup,
            exit_non_zero_on_fix=exit_non_zero_on_fix,
            lock_timeout=lock_timeout,
            on_wait=say_waiting(lock_timeout),
            dry_run=dry,
        )
        if copy is not None and not failed:
            say(stderr(), f"the bundled example, copied to {copy} for this run (removed afterwards)")
        if (diff or show_diff) and not as_json:
            print_diffs(report, only=None if dry else FileStatus.REWRITTEN)
        return finish(report, as_json, show_all)


# survey shows a progress bar (on a terminal) above this many targets.
PROGRESS_MIN_TARGETS = 8


def survey(
    paths: list[Path], pythons: list[str], roots: list[Path], jobs: int | None, as_json: bool, show_all: bool
) -> int:
    from rewriter.report import print_json, print_survey
    from rewriter.survey import survey as survey_targets

    targets, failed = targets_of("survey", paths, pythons, roots, False)
    err = stderr(wide=True)
    if failed:
        report = failed
    elif len(targets) > PROGRESS_MIN_TARGETS and err.is_terminal and not as_json:
        from rich.progress import Progress

        # Refreshed by hand (no refresh thread): the pool forks its workers first.
        with Progress(console=err, transient=True, auto_refresh=False) as progress:
            task = progress.add_task("surveying", total=len(targets))
            report = survey_targets(
                targets, jobs, advance=lambda: progress.update(task, advance=1, refresh=True)
            )
    else:
        report = survey_targets(targets, jobs)
    print_survey(report, err, show_all=show_all)
    if as_json:
        print_json(report)
    return int(report.exit_code)


# --- the fast command-line reader ---------------------------------------------------------

_VALUE_OPTIONS = {"--python": "pythons", "--vllm-root": "roots"}
_JOBS = ("--jobs", "-j")  # survey only; a positive whole number
_COLOR = "--color"  # every command; one of COLOR_MODES
_FLAGS = {
    "check": {"--example", "--diff", "--json", "--all"},
    "preview": {"--example", "--json", "--all"},
    "run": {
        "--example",
        "--json",
        "--all",
        "--backup",
        "--dry-run",
        "--diff",
        "--show-diff",
        "--exit-non-zero-on-fix",
    },
    "survey": {"--json", "--all"},
}


def read_plain(argv: list[str]) -> tuple[str, dict[str, object]] | None:
    """``(command, options)`` for a plain check/preview/run/survey line; None: let typer read it."""
    if not argv or argv[0] not in _FLAGS:
        return None
    command, flags = argv[0], _FLAGS[argv[0]]
    options: dict[str, object] = {"paths": [], "pythons": [], "roots": [], "color": "auto"}
    options.update({flag: False for flag in flags})
    if command == "survey":
        options["jobs"] = None
    rest = argv[1:]
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if command == "survey" and name in _JOBS:
            if eq and name == "-j":
                return None  # click reads "-j=2" as the value "=2"
            if not eq:
                if not rest:
                    return None
                value = rest.pop(0)
            if not (value.isascii() and value.isdigit() and int(value) >= 1):
                return None  # typer explains what is wrong with it
            options["jobs"] = int(value)
        elif name == _COLOR:
            if not eq:
                if not rest:
                    return None
                value = rest.pop(0)
            if value not in COLOR_MODES:
                return None  # typer explains what is wrong with it
            options["color"] = value
        elif name in _VALUE_OPTIONS:
            if not eq:
                if not rest:
                    return None
                value = rest.pop(0)
            if not value or value.startswith("-"):
                return None
            field = _VALUE_OPTIONS[name]
            options[field].append(value if field == "pythons" else Path(value))  # type: ignore[attr-defined]
        elif arg in flags:
            options[arg] = True
        elif arg and not arg.startswith("-"):
            options["paths"].append(Path(arg))  # type: ignore[attr-defined]
        else:
            return None  # --help, --, an unknown option: typer answers
    return command, options


class Interrupted(BaseException):
    """Ctrl-C. Not KeyboardInterrupt: click would print "Aborted!" and exit 1."""


def _interrupted(signum: int, frame: object) -> None:
    raise Interrupted


def _quit(line: str, code: int) -> None:
    """End with one line on stderr; what is still buffered for stdout goes nowhere."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """The console script: the command's exit code; Ctrl-C: "interrupted", 130 (files are
    written whole or not at all); a stdout that cannot be written: one line, 2."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when ignored (nohup, &)
        signal.signal(signal.SIGINT, _interrupted)
    try:
        _main(sys.argv[1:] if argv is None else argv)
    except Interrupted:
        _quit("interrupted", 130)
    except OutputError as exc:
        _quit(f"error: cannot write to stdout: {exc}", 2)


def _main(args: list[str]) -> None:
    plain = read_plain(args)
    if plain is None:
        from rewriter.cli import app

        try:
            app(args=args, prog_name="mm3-codemod")
        except OSError as exc:  # click and rich print help and usage themselves
            if exc.errno not in (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
                raise
            raise OutputError(exc.strerror or str(exc)) from exc
        return
    command, o = plain
    set_color(o["color"])  # type: ignore[arg-type]
    if command == "survey":
        sys.exit(survey(o["paths"], o["pythons"], o["roots"], o["jobs"], o["--json"], o["--all"]))  # type: ignore[arg-type]
    common = (o["paths"], o["pythons"], o["roots"], o["--example"])
    if command == "check":
        code = check(*common, o["--diff"], o["--json"], o["--all"])  # type: ignore[arg-type]
    elif command == "preview":
        code = preview(*common, o["--json"], o["--all"])  # type: ignore[arg-type]
    else:
        code = run(
            *common,  # type: ignore[arg-type]
            backup=o["--backup"],  # type: ignore[arg-type]
            dry_run=o["--dry-run"],  # type: ignore[arg-type]
            diff=o["--diff"],  # type: ignore[arg-type]
            show_diff=o["--show-diff"],  # type: ignore[arg-type]
            exit_non_zero_on_fix=o["--exit-non-zero-on-fix"],  # type: ignore[arg-type]
            as_json=o["--json"],  # type: ignore[arg-type]
            show_all=o["--all"],  # type: ignore[arg-type]
        )
    sys.exit(code)
