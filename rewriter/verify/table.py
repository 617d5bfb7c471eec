"""verify's human output: one table of files x levels (laid out as survey's), then the kernel facts."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..report import COLUMN_GAP, FP8_LAUNCH, Folded, Section, file_sections
from ..targets import shown_path
from . import Status, VerifyReport

STYLE = {Status.PASSED: "green", Status.FAILED: "red", Status.SKIPPED: "yellow"}
COLUMNS = ("level", "result", "why")
WHY_MIN = 20  # a narrower terminal: the table goes past its edge rather than a word a line


def verify_table(report: VerifyReport, width: int, verbose: bool = False) -> Group:
    """Each file's path on a line of its own (whole: folded only after a ``/`` where it is wider
    than the terminal), its note, then a row per level; reasons wrap between words, and the
    ``why`` column takes what the level and result columns leave."""
    sections: list[Section] = []
    for f in report.files:
        head: list[RenderableType] = [Folded(shown_path(f.path), "/", style="bold")]
        if f.note:
            head.append(Text(f.note, style="yellow"))
        rows = [(Text("-"), Text("error", style="red"), Text(f.error))] if f.error else []
        for level in f.levels:
            why = level.reason
            if verbose or level.status is Status.FAILED:
                shown = [d for d in level.details if verbose or not (d.endswith(": yes") or ": ok (" in d)]
                why += "".join(f"\n  {d}" for d in shown)
            rows.append((Text(level.level), Text(level.status.value, style=STYLE[level.status]), Text(why)))
        sections.append((head, rows))
    cells = [row for _, rows in sections for row in rows]
    widths = [max([len(name), *(len(row[i].plain) for row in cells)]) for i, name in enumerate(COLUMNS[:2])]
    widths.append(max(WHY_MIN, width - sum(widths) - COLUMN_GAP * (len(COLUMNS) - 1)))
    return file_sections("mm3-codemod verify", COLUMNS, widths, sections)


def print_verify(report: VerifyReport, err: Console, verbose: bool = False) -> None:
    if report.error:
        err.print(Text(f"error: {report.error}", style="red"), soft_wrap=True)
        return
    err.print(verify_table(report, err.width, verbose))
    for f in report.files:  # one unwrapped line per failure, for logs and hooks
        if f.error:
            err.print(Text(f"{f.path}: {f.error}", style="red"), soft_wrap=True)
        if f.note:
            err.print(Text(f"{f.path}: {f.note}", style="red"), soft_wrap=True)
        for level in f.levels:
            if level.status is Status.FAILED:
                err.print(
                    Text(f"{f.path}: {level.level} failed: {level.reason}", style="red"), soft_wrap=True
                )
            elif level.level == "import" and level.status is Status.SKIPPED:
                # why the import could not say anything, on one line (the table wraps it)
                err.print(Text(f"{f.path}: import skipped: {level.reason}", style="yellow"), soft_wrap=True)
    ctx = report.kernel
    if ctx is not None and ctx.ops is not None:
        extra = ", ".join(n for n, _ in ctx.ops.extra)
        err.print(
            escape(
                f"kernels: {ctx.ops.source}; main-cache layout {ctx.ops.layout.name}; schema extras: {extra}"
            ),
            soft_wrap=True,
        )
        for c in ctx.checks:
            err.print(
                Text(
                    f"  {'ok ' if c.passed else 'BAD'} {c.name}: {c.detail}",
                    style="green" if c.passed else "red",
                ),
                soft_wrap=True,
            )
    for f in report.files:
        if f.timings:
            print_timings(f.path, f.timings, err)
    if any(lv.level == "engine" and lv.status is Status.PASSED for f in report.files for lv in f.levels):
        err.print(FP8_LAUNCH, soft_wrap=True)
    for f in report.files:
        if f.unverified:
            err.print(Text(f"{f.path}: not verified: {f.unverified_why()}", style="red"), soft_wrap=True)
    err.print(summary_line(report), soft_wrap=True)


def summary_line(report: VerifyReport) -> str:
    """What was proved, file by file: verified (a level ran the file's code and passed), not
    verified, failed, not readable, and files with nothing to verify; where no file was
    verified at all, that too (exit 1)."""
    files = report.files

    def count(status: str) -> int:
        return sum(1 for f in files if f.status == status)

    parts = [f"{count('passed')} verified", f"{count('unverified')} not verified"]
    parts += [f"{count('failed')} failed", f"{count('error')} not readable"]
    parts += [f"{count('no-sites')} without an insert site (nothing to verify)"] if count("no-sites") else []
    line = f"{len(files)} file{'' if len(files) == 1 else 's'}: " + ", ".join(parts) + "."
    if not any(f.verified for f in files) and not any(f.failed or f.error or f.unverified for f in files):
        line += " Nothing verified: no file has a call of the fused op that writes a cache."
    return line


def print_timings(path, t: dict, err: Console) -> None:
    sizes = t["sizes"]
    table = Table(title=escape(f"{path}: µs per layer call on {t['device']}; {t['shape']}"))
    table.add_column("path")
    for n in sizes:
        table.add_column(f"N={n}", justify="right")
    by_name: dict[str, dict[int, float]] = {}
    for row in t["rows"]:
        by_name.setdefault(row.name, {})[row.tokens] = row.us
    for name, us in by_name.items():
        table.add_row(escape(name), *(f"{us[n]:.2f}" for n in sizes))
    fused, total = by_name.get("fused bf16 insert"), by_name.get("bypass total")
    if fused and total:
        table.add_row("bypass total / fused insert", *(f"{total[n] / fused[n]:.2f}x" for n in sizes))
    err.print(table)
    per = t["kv_bytes_per_token"]
    err.print(
        f"KV-cache bytes per token per layer: bf16 {per['bf16']}, fp8 {per['fp8']} "
        f"({per['fp8'] / per['bf16']:.3f}x); timed as: {t['rows'][0].how}, median",
        soft_wrap=True,
    )
