"""Human output (rich, on stderr) and the JSON report (stdout)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

from codemods.schema import CHANGING, FUSED_OP, Action, InsertSite, SiteState
from rewriter import __version__
from rewriter.apply import FileResult, FileStatus
from rewriter.commands import Report, under_pre_commit
from rewriter.console import say
from rewriter.proof import proof_line
from rewriter.targets import Target, shown_path

STATE_STYLE = {SiteState.NEEDS_BYPASS: "yellow", SiteState.HALF_APPLIED: "yellow", SiteState.PATCHED: "green"}
STATE_STYLE |= {SiteState.NATIVE: "green", SiteState.NOT_A_SITE: "dim", SiteState.UNSUPPORTED: "red"}


def envelope(
    command: str, exit_code: int, error: str | None, note: str | None, files: list[dict[str, object]],
    summary: dict[str, int],
) -> dict[str, object]:
    """The one JSON shape every command prints with ``--json`` (``verify`` adds ``kernel``)."""
    outcome = {"command": command, "exit_code": int(exit_code), "error": error, "note": note}
    return {"tool": "mm3-codemod", "version": __version__, **outcome, "files": files, "summary": summary}


def to_json(report: Report) -> dict[str, object]:
    files = []
    for target, result in zip(report.targets, report.files):
        survey = {"vllm_version": shown_version(target, result)} if report.command == "survey" else {}
        files.append(result.to_json() | {"origin": target.origin, **survey})
    summary = {status.value: report.count(status) for status in FileStatus}
    return envelope(report.command, report.exit_code, report.error, report.note, files, summary)


def shown_version(target: Target, result: FileResult) -> str | None:
    """survey's vLLM version of a target: None where there is no vLLM at all."""
    return None if result.status is FileStatus.NO_VLLM else target.vllm_version or "unknown"


def shown_sites(result: FileResult, show_all: bool) -> list[InsertSite]:
    """The sites a report lists: not-a-site calls only with ``--all`` or where a file has no other."""
    sites = [s for s in result.sites if show_all or s.state is not SiteState.NOT_A_SITE]
    return sites or result.sites


def _where(site: InsertSite) -> str:
    return f"{site.class_name}.{site.method}" if site.class_name else f"{site.method}()"


def print_human(report: Report, err: Console, show_all: bool = False) -> None:
    """Per-site lines (survey: its table), per-file errors, a summary line, what to do next."""
    if report.error:
        say(err, f"error: {report.error}", style="red")
        return
    if report.command == "survey":
        err.print(survey_table(report, err.width, show_all))
    else:
        for result in report.files:
            for site in shown_sites(result, show_all):
                line = Text(f"{result.path}:{site.line}: {_where(site)}: ")
                line.append(site.state.value, style=STATE_STYLE.get(site.state, ""))
                if site.action is not Action.NONE:
                    line.append(f" -> {site.action.value}")
                err.print(line, soft_wrap=True)
                say(err, f"    {site.reason}")
    for target, result in zip(report.targets, report.files):
        if result.error and result.failed:
            say(err, f"error: {result.path}: {result.error}", style="red")
        if result.backup:
            say(err, f"backup: {result.backup}")
        if result.proof is not None and result.status is FileStatus.REWRITTEN:
            verify = mm3_commands("verify", [target])[0]
            line = proof_line(result, example=target.origin == "--example", verify=verify)
            if line:
                say(err, line, style="" if result.proof.proven else "yellow")
    if report.note:
        say(err, report.note, style="red")
    say(err, summary_line(report))
    for step in next_steps(report):
        say(err, step)


# --- what to do next -------------------------------------------------------------------

# The hook of .pre-commit-hooks.yaml that runs each command, and whether it is manual-stage.
# Advice names a hook only where the config in use has one that runs the command.
HOOKS = {
    "run": ("mm3-codemod", False),
    "check": ("mm3-codemod-check", False),
    "revert": ("mm3-codemod-revert", True),
}
PRE_COMMIT_CONFIG = ".pre-commit-config.yaml"  # pre-commit runs hooks at the repository's top


def entry_verb(entry: str) -> str | None:
    """The mm3-codemod command a hook's ``entry`` runs (``mm3-codemod run …``), else None."""
    try:
        words = shlex.split(entry)
    except ValueError:
        return None
    for i, word in enumerate(words[:-1]):
        module = word in ("mm3_codemod", "rewriter") and i and words[i - 1] == "-m"
        if os.path.basename(word) in ("mm3-codemod", "mm3-codemod.exe") or module:
            return words[i + 1]
    return None


def configured_hook(verb: str) -> tuple[str, str | None] | None:
    """(id, the ``--hook-stage`` it needs or None) of the first hook of the pre-commit config
    that runs ``mm3-codemod <verb>``: a hook with its own ``entry`` by that entry, a hook of a
    remote repo without one by this project's manifest. None where there is none (or no config)."""
    try:
        import yaml  # libcst's dependency: there wherever mm3-codemod is

        data = yaml.safe_load(Path(PRE_COMMIT_CONFIG).read_text(encoding="utf-8"))
    except Exception:  # no config, not YAML, no yaml: name no hook
        return None
    if not isinstance(data, dict):
        return None
    manifest = {hook: (name, manual) for name, (hook, manual) in HOOKS.items()}
    default_stages = data.get("default_stages") or []
    for repo in data.get("repos") or []:
        for hook in (repo.get("hooks") or []) if isinstance(repo, dict) else []:
            if not isinstance(hook, dict):
                continue
            stages = hook.get("stages")
            if "entry" in hook or repo.get("repo") in ("local", "meta"):
                runs = entry_verb(str(hook.get("entry", "")))
            else:
                runs, manual = manifest.get(hook.get("id"), (None, False))
                stages = stages or (["manual"] if manual else None)
            if runs == verb and hook.get("id"):
                return hook["id"], _hook_stage(stages or default_stages)
    return None


def _hook_stage(stages: list[str]) -> str | None:
    """The ``--hook-stage`` that runs a hook of these stages; None for the default one."""
    stages = [{"commit": "pre-commit"}.get(s, s) for s in stages]
    if not stages or "pre-commit" in stages:
        return None
    return "manual" if "manual" in stages else stages[0]


def direct_command() -> str:
    """How the user runs this mm3-codemod from their shell: by name where their PATH has it,
    else by its path (a hook environment pre-commit built is on the hook's PATH only)."""
    hook_env = os.path.normcase(os.path.join(sys.prefix, ""))
    own_env = os.path.basename(os.path.normpath(sys.prefix)).startswith("py_env-")  # pre-commit's
    user_path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    if own_env:  # not the hook environment pre-commit put first on the hook's PATH
        user_path = [d for d in user_path if not os.path.normcase(os.path.abspath(d)).startswith(hook_env)]
    if shutil.which("mm3-codemod", path=os.pathsep.join(user_path)):
        return "mm3-codemod"
    script = Path(sys.executable).parent / "mm3-codemod"
    return shlex.quote(str(script)) if script.is_file() else f"{shlex.quote(sys.executable)} -m mm3_codemod"


def command_for(verb: str, report: Report, indices: Iterable[int]) -> str:
    """The command line that runs ``mm3-codemod <verb>`` on those files of the report: under
    pre-commit, the configured hook that runs it, else a command that works from the user's shell."""
    targets = [report.targets[i] for i in indices]
    commands = mm3_commands(verb, targets)
    if not under_pre_commit() or any(t.origin == "--example" for t in targets):
        return "; ".join(commands)
    hook = configured_hook(verb)
    if hook is None:
        return "; ".join(direct_command() + c.removeprefix("mm3-codemod") for c in commands)
    hook_id, stage = hook
    stages = [f"--hook-stage {stage}"] if stage else []
    names = [shlex.quote(shown_path(t.path)) for t in targets]
    return " ".join(["pre-commit run", shlex.quote(hook_id), *stages, "--files", *names])


def mm3_commands(verb: str, targets: Iterable[Target]) -> list[str]:
    """``mm3-codemod <verb>`` on ``targets`` as the user named them: by ``--python EXE`` or
    ``--vllm-root DIR`` (verify's import level needs the interpreter), by path, or ``--example``.
    ``verify`` takes one ``--python``: a command per interpreter."""
    targets = list(targets)
    pythons: dict[str, None] = {}  # ordered sets of options
    roots: dict[str, None] = {}
    names = []
    for t in targets:
        option, _, value = t.origin.partition(" ")
        if option in ("--python", "--vllm-root") and value:
            (pythons if option == "--python" else roots)[f"{option} {shlex.quote(value)}"] = None
        elif t.origin != "--example":
            names.append(shlex.quote(shown_path(t.path)))
    example = ["--example"] if any(t.origin == "--example" for t in targets) else []
    groups = [[p] for p in pythons] if verb == "verify" and len(pythons) > 1 else [list(pythons)]
    first = " ".join(["mm3-codemod", verb, *groups[0], *roots, *example, *names])
    return [first, *(" ".join(["mm3-codemod", verb, *group]) for group in groups[1:])]


# How to launch with the bypass in place: the seed's command line (on SM89 FlashInfer
# lacks the 128-token block MiniMax-M3's sparse layers page by, so Triton attention).
FP8_LAUNCH = (
    "to serve with an fp8 KV cache: vllm serve <model> --kv-cache-dtype fp8_e4m3 "
    "(on SM89, RTX 4090 class, also --block-size 128 --attention-backend TRITON_ATTN: "
    "FlashInfer lacks that block size there)"
)


def next_steps(report: Report) -> list[str]:
    """One line per thing left to do, each with the exact command."""
    steps = []
    pending = [i for i, f in enumerate(report.files) if f.status is FileStatus.NEEDS_REWRITE]
    if report.dry and pending and report.command != "survey":
        actions = {s.action for i in pending for s in report.files[i].sites if s.action in CHANGING}
        if report.command == "revert":
            what, verb = "take the fp8 bypass out", report.verb or "revert"
        else:
            what = "take the stale bypass out" if actions <= {Action.STRIP} else "apply the fp8 bypass"
            verb = "run"
        steps.append(f"to {what}: {command_for(verb, report, pending)}")
    whole = [i for i, f in enumerate(report.files) if f.not_an_undo]
    if whole:  # no hook runs it: from the user's shell
        anyway = command_for("revert --whole-bypass", report, whole)
        steps.append(f"to take the whole bypass out anyway: {anyway}")
    written = [i for i, f in enumerate(report.files) if f.status is FileStatus.REWRITTEN]
    if written and under_pre_commit():
        names = " ".join(shlex.quote(shown_path(report.files[i].path)) for i in written)
        steps.append(f"review the change, then stage it: git add {names}")
    elif written and report.command == "run" and not any(t.origin == "--example" for t in report.targets):
        steps.append(f"to confirm it by running it: {command_for('verify', report, written)}")
        steps.append(f"then, {FP8_LAUNCH}")
    return steps


def summary_line(report: Report) -> str:
    # `revert` rewrites files too, but the reader wants to know they were reverted.
    verb, done = ("revert", "reverted") if report.command == "revert" else ("rewrite", "rewritten")
    words = {
        FileStatus.NEEDS_REWRITE: f"would be {done}" if report.dry else f"to {verb}",
        FileStatus.REWRITTEN: done,
        FileStatus.UNCHANGED: "left unchanged",
        FileStatus.NO_SITES: "without the fused op",
        FileStatus.REFUSED: "refused",
        FileStatus.ERROR: "failed",
    }
    counts = [(report.count(status), "file", word) for status, word in words.items()]
    counts.append((report.count(FileStatus.NO_VLLM), "environment", "without vLLM"))
    parts = [f"{n} {noun}{'s' if n != 1 else ''} {word}" for n, noun, word in counts if n]
    if not parts:
        return "no files"
    if all(f.status is FileStatus.NO_SITES for f in report.files):
        if not any(f.original for f in report.files):  # 0 bytes: no model file at all
            n = len(report.files)
            return f"{n} empty file{'s' if n != 1 else ''} (0 bytes): nothing to do."
        parts[0] += f" (no call of {FUSED_OP} found)"
    return ", ".join(parts) + "."


# --- survey ---------------------------------------------------------------------------


class Folded:
    """A name that wraps only after one of ``separators`` (``/`` in paths, ``.`` in
    ``Class.method``), so that no file, folder, class or method name is cut."""

    def __init__(self, text: str, separators: str, style: str = "") -> None:
        self.text, self.style = text, style
        s = re.escape(separators)
        self.parts: list[str] = re.findall(f"[^{s}]*[{s}]|[^{s}]+", text)  # split after each separator

    @property
    def shortest(self) -> int:
        return max((len(p) for p in self.parts), default=0)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(1, options.max_width)
        lines: list[str] = []
        for part in self.parts:
            if lines and len(lines[-1]) + len(part) <= width:
                lines[-1] += part
            else:
                lines += [part[i : i + width] for i in range(0, len(part), width)]  # cut only if it must
        yield Text("\n".join(lines), style=self.style)


def brief_reason(site: InsertSite) -> str:
    """The site's reason to its first ": " or "; " (``check`` prints it whole), with what a half-applied
    bypass misses; a stale bypass on a native call keeps what it breaks now (to the first "; ")."""
    if site.action is Action.STRIP:
        return site.reason.split("; ", 1)[0]
    text = re.split(r": |; ", site.reason, maxsplit=1)[0]
    missing = [name for name, present in site.pieces.items() if not present]
    if site.state is SiteState.HALF_APPLIED and missing:
        text += "; missing: " + ", ".join(missing)
    return text


# survey's columns, under a line naming each file; "state" also says what run would do.
_COLUMNS = ("vLLM", "site", "state", "why")
COLUMN_GAP = 2
_WHY_MIN = 12  # narrower, the reason becomes a word per line
_CUT_MIN = 8  # where even whole names do not fit: cut, but keep this much of the column


def _fit(minimum: list[int], maximum: list[int], available: int) -> list[int]:
    """Column widths within ``available``: the widest cells shrunk first, never below a whole name;
    where even that is too wide, the reason and then the site are cut, never the version or state."""
    widths = list(maximum)
    for floor in (minimum, [*minimum[:3], _CUT_MIN], [minimum[0], _CUT_MIN, minimum[2], _CUT_MIN]):
        while sum(widths) > available:
            shrinkable = [i for i, w in enumerate(widths) if w > floor[i]]
            if not shrinkable:
                break
            widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    return widths


Row = tuple[Text, Folded, Text, Folded]
# A file in a table of files: the lines that name it, then its rows.
Section = tuple[list[RenderableType], list[tuple[RenderableType, ...]]]


def survey_table(report: Report, width: int, show_all: bool = False) -> Group:
    """survey's table (``file_sections``): a row per insert site of each file (a file without one, a
    row saying why), its columns fit to ``width``."""
    sections: list[Section] = []
    all_rows: list[Row] = []
    for target, result in zip(report.targets, report.files):
        if result.status is FileStatus.NO_SITES and not result.sites and not show_all:
            continue
        version = shown_version(target, result) or "-"
        rows: list[Row] = []
        if result.status is FileStatus.ERROR or not result.sites:
            state = Text(result.status.value, style="red" if result.failed else "dim")
            why = Folded(result.error or f"no call of {FUSED_OP}", " =.")
            rows.append((Text(version), Folded("-", "."), state, why))
        else:
            for site in shown_sites(result, show_all):
                state = Text(site.state.value, style=STATE_STYLE.get(site.state, ""))
                if site.action is not Action.NONE:
                    state.append(f"\n-> {site.action.value}")
                why = Folded(brief_reason(site), " =.")
                rows.append((Text(version), Folded(f"{_where(site)}:{site.line}", "."), state, why))
        sections.append(([Folded(shown_path(result.path), "/", style="bold")], rows))
        all_rows += rows
    states = [max(len(line) for line in state.plain.splitlines()) for _, _, state, _ in all_rows]
    # Each column's narrowest and widest width (a long word of the reason may be cut).
    narrowest = [(len(v), site.shortest, w, _WHY_MIN) for (v, site, _, _), w in zip(all_rows, states)]
    widest = [(len(v), len(site.text), w, len(why.text)) for (v, site, _, why), w in zip(all_rows, states)]
    headers = [len(name) for name in _COLUMNS]
    minimum = [max(column) for column in zip(headers, *narrowest)]
    maximum = [max(column) for column in zip(headers, *widest)]
    widths = _fit(minimum, maximum, width - COLUMN_GAP * (len(_COLUMNS) - 1))
    return file_sections("mm3-codemod survey", _COLUMNS, widths, sections)


def file_sections(
    title: str, headers: Sequence[str], widths: Sequence[int], sections: list[Section]
) -> Group:
    """``title``, the column headers, then each file: the lines that name it (never in a column that
    would cut its path), then its rows in columns of ``widths``. No vertical rules: 80 columns are few."""

    def columns(rows: list[tuple[RenderableType, ...]], header: bool = False) -> Table:
        # SIMPLE_HEAD: its rules are blanks but for the line under the header
        table = Table(
            box=box.SIMPLE_HEAD, show_header=header, header_style="bold", show_edge=False, pad_edge=False,
            padding=(0, COLUMN_GAP - 1, 0, 0),
        )
        for name, column_width in zip(headers, widths):
            table.add_column(name, width=column_width, overflow="fold")
        for row in rows:
            table.add_row(*row)
        return table

    parts: list[RenderableType] = [Text(title, style="bold"), columns([], header=True)]
    for head, rows in sections:
        parts += [*head, columns(rows)]
    return Group(*parts)
