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

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rewriter.apply import FileStatus
from rewriter.commands import Report, analyze_targets, example_copy
from rewriter.commands import run as run_targets
from rewriter.locking import DEFAULT_TIMEOUT
from rewriter.targets import Target, TargetError, resolve

if TYPE_CHECKING:
    from rich.console import Console


def stderr(wide: bool = False) -> Console:
    from rich.console import Console

    # Tables are not squeezed to 80 columns when stderr is a pipe or a file.
    width = None if not wide or sys.stderr.isatty() else int(os.environ.get("COLUMNS", 0) or 240)
    return Console(file=sys.stderr, highlight=False, width=width)


def say_waiting(timeout: float) -> Callable[[Path], None]:
    def say(path: Path) -> None:
        stderr().print(
            f"waiting for {path}: another mm3-codemod run holds it (up to {timeout:g} s)", soft_wrap=True
        )

    return say


def targets_of(
    command: str, paths: list[Path], pythons: list[str], roots: list[Path], example: bool
) -> tuple[list[Target], Report | None]:
    try:
        return resolve(paths, pythons, roots, example=example), None
    except TargetError as exc:
        return [], Report(command, [], error=str(exc))


def print_diffs(report: Report, only: FileStatus | None = None) -> None:
    """Each file's unified diff on stdout (coloured only on a terminal)."""
    from rich.console import Console

    from rewriter.report import render_diff

    out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    for result in report.files:
        if result.diff and (only is None or result.status is only):
            out.print(render_diff(result.diff), end="")


def finish(report: Report, as_json: bool, show_all: bool) -> int:
    """The human report on stderr, the JSON one on stdout; the exit code."""
    from rewriter.report import print_human, print_json

    print_human(report, stderr(), show_all=show_all)
    if as_json:
        print_json(report, sys.stdout)
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
    backup: bool,
    show_diff: bool,
    exit_non_zero_on_fix: bool,
    as_json: bool,
    show_all: bool,
    lock_timeout: float = DEFAULT_TIMEOUT,
) -> int:
    extra = [example_copy()] if example else []
    targets, failed = targets_of("run", paths + extra, pythons, roots, False)
    report = failed or run_targets(
        targets,
        backup=backup,
        exit_non_zero_on_fix=exit_non_zero_on_fix,
        lock_timeout=lock_timeout,
        on_wait=say_waiting(lock_timeout),
    )
    if example and not failed:
        stderr().print(f"example copied to {extra[0]}", soft_wrap=True)
    if show_diff and not as_json:
        print_diffs(report, only=FileStatus.REWRITTEN)
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
        print_json(report, sys.stdout)
    return int(report.exit_code)


# --- the fast command-line reader ---------------------------------------------------------

_VALUE_OPTIONS = {"--python": "pythons", "--vllm-root": "roots"}
_JOBS = ("--jobs", "-j")  # survey only; a positive whole number
_FLAGS = {
    "check": {"--example", "--diff", "--json", "--all"},
    "preview": {"--example", "--json", "--all"},
    "run": {"--example", "--json", "--all", "--backup", "--show-diff", "--exit-non-zero-on-fix"},
    "survey": {"--json", "--all"},
}


def read_plain(argv: list[str]) -> tuple[str, dict[str, object]] | None:
    """``(command, options)`` for a plain check/preview/run/survey line; None: let typer read it."""
    if not argv or argv[0] not in _FLAGS:
        return None
    command, flags = argv[0], _FLAGS[argv[0]]
    options: dict[str, object] = {"paths": [], "pythons": [], "roots": []}
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


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    plain = read_plain(args)
    if plain is None:
        from rewriter.cli import app

        app(args=args, prog_name="mm3-codemod")
        return
    command, o = plain
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
            o["--backup"],  # type: ignore[arg-type]
            o["--show-diff"],  # type: ignore[arg-type]
            o["--exit-non-zero-on-fix"],  # type: ignore[arg-type]
            o["--json"],  # type: ignore[arg-type]
            o["--all"],  # type: ignore[arg-type]
        )
    sys.exit(code)
