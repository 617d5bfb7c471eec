"""The library behind each CLI command; the CLI only parses options and prints."""

from __future__ import annotations

import enum
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rewriter.apply import FileError, FileResult, FileStatus, plan_file, plan_revert_file, write_result
from rewriter.targets import Target, example_path


class ExitCode(enum.IntEnum):
    OK = 0  # nothing to do, or done
    NEEDS_REWRITE = (
        1  # check/preview/survey (or a dry run): a rewrite is needed; a fix with --exit-non-zero-on-fix
    )
    ERROR = 2  # a target could not be handled; nothing written


# Commands that only look: a needed rewrite is their exit 1.
DRY_COMMANDS = ("check", "preview", "survey")


@dataclass
class Report:
    command: str
    targets: list[Target]
    files: list[FileResult] = field(default_factory=list)
    error: str | None = None  # a target-level error (nothing was processed)
    note: str | None = None
    dry_run: bool = False  # `revert --check/--diff`: planned, nothing written
    exit_non_zero_on_fix: bool = False  # exit 1 when a file was written (pre-commit's fixer contract)

    @property
    def dry(self) -> bool:
        return self.dry_run or self.command in DRY_COMMANDS

    @property
    def exit_code(self) -> ExitCode:
        if self.error or any(f.failed for f in self.files):
            return ExitCode.ERROR
        if self.dry and any(f.status is FileStatus.NEEDS_REWRITE for f in self.files):
            return ExitCode.NEEDS_REWRITE
        if self.exit_non_zero_on_fix and any(f.status is FileStatus.REWRITTEN for f in self.files):
            return ExitCode.NEEDS_REWRITE
        return ExitCode.OK

    def count(self, status: FileStatus) -> int:
        return sum(1 for f in self.files if f.status is status)


def analyze_targets(command: str, targets: list[Target]) -> Report:
    """Plan every target; nothing is written (``check`` and ``preview``)."""
    return Report(command, targets, [plan_file(t.path) for t in targets])


def run(targets: list[Target], backup: bool = False, exit_non_zero_on_fix: bool = False) -> Report:
    """Rewrite every target that needs it - all or nothing.

    If any target is refused or fails, nothing at all is written: a vLLM tree
    is left either fully rewritten or as it was.
    """
    report = analyze_targets("run", targets)
    report.exit_non_zero_on_fix = exit_non_zero_on_fix
    _write_all(report, backup)
    return report


def revert(
    targets: list[Target], backup: bool = False, dry_run: bool = False, exit_non_zero_on_fix: bool = False
) -> Report:
    """Take the fp8 bypass out of every target that carries one - all or nothing, like ``run``."""
    report = Report(
        "revert",
        targets,
        [plan_revert_file(t.path) for t in targets],
        dry_run=dry_run,
        exit_non_zero_on_fix=exit_non_zero_on_fix,
    )
    if not dry_run:
        _write_all(report, backup)
    return report


def _write_all(report: Report, backup: bool) -> None:
    if any(f.failed for f in report.files):
        report.note = "nothing written: a target was refused or failed"
        return
    for result in report.files:
        if result.status is FileStatus.NEEDS_REWRITE:
            try:
                write_result(result, backup=backup)
            except FileError as exc:
                result.status = FileStatus.ERROR
                result.error = str(exc)


def example_copy() -> Path:
    """A private copy of the bundled example, so that `run --example` never
    writes into the installed package."""
    folder = Path(tempfile.mkdtemp(prefix="mm3-codemod-example-"))
    target = folder / "model.py"
    shutil.copyfile(example_path(), target)
    return target
