"""Human output (rich, on stderr) and the JSON report (stdout)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rewriter import __version__
from rewriter.apply import FileStatus
from rewriter.commands import Report

STATE_STYLE = {
    "needs-bypass": "yellow",
    "half-applied": "yellow",
    "patched": "green",
    "native": "green",
    "not-a-site": "dim",
    "unsupported": "red",
}

_SUMMARY = {
    FileStatus.NEEDS_REWRITE: ("would be rewritten", "to rewrite"),
    FileStatus.REWRITTEN: ("rewritten", "rewritten"),
    FileStatus.UNCHANGED: ("left unchanged", "left unchanged"),
    FileStatus.NO_SITES: ("without the fused op", "without the fused op"),
    FileStatus.REFUSED: ("refused", "refused"),
    FileStatus.ERROR: ("failed", "failed"),
}


def to_json(report: Report) -> dict[str, object]:
    return {
        "tool": "mm3-codemod",
        "version": __version__,
        "command": report.command,
        "exit_code": int(report.exit_code),
        "error": report.error,
        "note": report.note,
        "files": [f.to_json() | _target_fields(report, i) for i, f in enumerate(report.files)],
        "summary": {status.value: report.count(status) for status in FileStatus},
    }


def _origin(report: Report, index: int) -> str | None:
    return report.targets[index].origin if index < len(report.targets) else None


def _target_fields(report: Report, index: int) -> dict[str, object]:
    fields: dict[str, object] = {"origin": _origin(report, index)}
    if report.command == "survey":
        fields["vllm_version"] = report.targets[index].vllm_version or "unknown"
    return fields


def print_json(report: Report, out: TextIO) -> None:
    out.write(json.dumps(to_json(report), indent=2) + "\n")


def render_diff(diff: str) -> Text:
    """Colour a difflib unified diff line by line."""
    text = Text()
    for line in diff.splitlines(keepends=True):
        if line.startswith(("+++", "---")):
            style = "bold"
        elif line.startswith("@@"):
            style = "cyan"
        elif line.startswith("+"):
            style = "green"
        elif line.startswith("-"):
            style = "red"
        else:
            style = ""
        text.append(line, style=style)
    return text


def print_human(report: Report, err: Console, show_all: bool = False) -> None:
    """Per-site table, per-file errors, one summary line (all on stderr)."""
    if report.error:
        err.print(Text(f"error: {report.error}", style="red"), soft_wrap=True)
        return
    for result in report.files:
        for site in result.sites:
            if site.state.value == "not-a-site" and not show_all:
                continue
            where = f"{site.class_name}.{site.method}" if site.class_name else f"{site.method}()"
            line = Text(f"{result.path}:{site.line}: {where}: ")
            line.append(site.state.value, style=STATE_STYLE.get(site.state.value, ""))
            if site.action.value != "none":
                line.append(f" -> {site.action.value}")
            err.print(line, soft_wrap=True)
            err.print(f"    {site.reason}", soft_wrap=True)
    for result in report.files:
        if result.error:
            err.print(Text(f"error: {result.path}: {result.error}", style="red"), soft_wrap=True)
        if result.backup:
            err.print(f"backup: {result.backup}", soft_wrap=True, highlight=False)
    if report.note:
        err.print(Text(report.note, style="red"), soft_wrap=True)
    err.print(summary_line(report), soft_wrap=True, highlight=False)
    if report.command == "check" and report.count(FileStatus.NEEDS_REWRITE):
        err.print(
            "run `mm3-codemod run` with the same targets to apply the fp8 bypass",
            soft_wrap=True,
            highlight=False,
        )
    if report.command == "revert" and report.dry_run and report.count(FileStatus.NEEDS_REWRITE):
        err.print(
            "run `mm3-codemod revert` with the same targets to take the fp8 bypass out",
            soft_wrap=True,
            highlight=False,
        )


# `revert` rewrites files too, but the reader wants to know they were reverted.
_REVERT_SUMMARY = _SUMMARY | {
    FileStatus.NEEDS_REWRITE: ("would be reverted", "to revert"),
    FileStatus.REWRITTEN: ("reverted", "reverted"),
}


def summary_line(report: Report) -> str:
    dry = report.dry
    words = _REVERT_SUMMARY if report.command == "revert" else _SUMMARY
    parts = []
    for status, (dry_word, wet_word) in words.items():
        n = report.count(status)
        if n:
            parts.append(f"{n} file{'s' if n != 1 else ''} {dry_word if dry else wet_word}")
    if not parts:
        return "no files"
    if not report.files or all(f.status is FileStatus.NO_SITES for f in report.files):
        parts.append("(no call of fused_minimax_m3_qknorm_rope_kv_insert found)")
    return ", ".join(parts) + "."


# --- survey ---------------------------------------------------------------------------

_RUN_WOULD = {"rewrite": "rewrite", "complete": "complete", "none": "nothing", "refuse": "refuse"}


def shown_path(path: Path) -> str:
    """Relative to the working directory when under it, else as given."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def survey_table(report: Report, show_all: bool = False) -> Table:
    """One row per insert site (per file where it has none to show)."""
    table = Table(title="mm3-codemod survey", title_justify="left", header_style="bold")
    for name in ("vLLM", "file", "site", "state", "run would"):
        table.add_column(name, no_wrap=name != "file", overflow="fold")
    for index, result in enumerate(report.files):
        if result.status is FileStatus.NO_SITES and not show_all:
            continue
        version = report.targets[index].vllm_version or "unknown"
        where = shown_path(result.path)
        sites = [s for s in result.sites if show_all or s.state.value != "not-a-site"]
        if result.status is FileStatus.ERROR:
            table.add_row(version, where, "-", Text("error", style="red"), "refuse")
        elif not sites:
            state = "no insert site" if result.sites else "no fused op"
            table.add_row(version, where, "-", Text(state, style="dim"), "nothing")
        for site in sites if result.status is not FileStatus.ERROR else []:
            what = f"{site.class_name}.{site.method}" if site.class_name else f"{site.method}()"
            table.add_row(
                version,
                where,
                f"{what}:{site.line}",
                Text(site.state.value, style=STATE_STYLE.get(site.state.value, "")),
                _RUN_WOULD.get(site.action.value, site.action.value),
            )
    return table


def print_survey(report: Report, err: Console, show_all: bool = False) -> None:
    """The table, each file's error, and the summary line (all on stderr)."""
    if report.error:
        err.print(Text(f"error: {report.error}", style="red"), soft_wrap=True)
        return
    err.print(survey_table(report, show_all))
    for result in report.files:
        if result.error:
            err.print(Text(f"error: {result.path}: {result.error}", style="red"), soft_wrap=True)
    err.print(summary_line(report), soft_wrap=True, highlight=False)
