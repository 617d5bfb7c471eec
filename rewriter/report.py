"""Human output (rich, on stderr) and the JSON report (stdout)."""

from __future__ import annotations

import json
from typing import TextIO

from rich.console import Console
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
        "files": [f.to_json() | {"origin": _origin(report, i)} for i, f in enumerate(report.files)],
        "summary": {status.value: report.count(status) for status in FileStatus},
    }


def _origin(report: Report, index: int) -> str | None:
    return report.targets[index].origin if index < len(report.targets) else None


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


def summary_line(report: Report) -> str:
    dry = report.command in ("check", "preview")
    parts = []
    for status, (dry_word, wet_word) in _SUMMARY.items():
        n = report.count(status)
        if n:
            parts.append(f"{n} file{'s' if n != 1 else ''} {dry_word if dry else wet_word}")
    if not parts:
        return "no files"
    if not report.files or all(f.status is FileStatus.NO_SITES for f in report.files):
        parts.append("(no call of fused_minimax_m3_qknorm_rope_kv_insert found)")
    return ", ".join(parts) + "."
