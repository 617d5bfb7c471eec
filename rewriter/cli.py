"""The ``mm3-codemod`` command line: each option declared once, each command's body.

Importing typer costs a third of a native file's `check`, so a plain command line is read
here from ``COMMANDS`` without typer; anything else (``--help``, an unknown option, a bad
value, ``--``) goes to the typer app built from the same declarations. Both call the same body.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from rewriter import __version__
from rewriter.apply import FileStatus
from rewriter.commands import Report, analyze_targets, example_copy, write_targets
from rewriter.console import COLOR_MODES, OutputError, console, say, set_color, write_stdout
from rewriter.locking import DEFAULT_TIMEOUT
from rewriter.targets import Target, TargetError, resolve, shown_path

if TYPE_CHECKING:
    import typer
    from rich.console import Console


class Option:
    """One option, as both readers take it: ``flags`` its spellings ("--jobs -j", "--timing/--no-timing";
    none: the positional PATHS), ``dest`` the body's argument, ``metavar`` None for a switch (bool),
    ``kind`` of its value (str, Path, int or float), ``many`` repeatable (a list). A plain class:
    a dataclass or NamedTuple would cost a millisecond or more at every start."""

    def __init__(
        self, flags: str, dest: str, help: str, metavar: str | None = None, kind: type = str,
        default: Any = None, many: bool = False, minimum: float | None = None,
        choices: tuple[str, ...] = (), hidden: bool = False,
    ) -> None:
        self.flags, self.dest, self.help, self.metavar = tuple(flags.split()), dest, help, metavar
        self.is_flag = metavar is None
        self.kind = bool if self.is_flag else kind
        self.default = False if self.is_flag and default is None else default
        self.many, self.minimum, self.choices, self.hidden = many, minimum, choices, hidden


PATHS_HELP = (
    "Model files or directories. None given: the vLLM source tree around the working folder,"
    " else the vLLM of this interpreter."
)
PATHS = Option("", "paths", PATHS_HELP, "PATHS", Path, many=True)
PYTHONS = Option("--python", "pythons", "Find the vLLM of this interpreter (repeatable).", "EXE", many=True)
ROOTS_HELP = "A vLLM source checkout or site-packages folder (repeatable)."
ROOTS = Option("--vllm-root", "roots", ROOTS_HELP, "DIR", Path, many=True)
EXAMPLE = Option("--example", "example", "Also process the bundled fork-era example model file.")
JSON = Option("--json", "as_json", "Print one JSON report on stdout (human output stays on stderr).")
COLOR_HELP = "Colour: auto (a terminal, unless NO_COLOR is set), always or never."
COLOR = Option("--color", "color", COLOR_HELP, "WHEN", default="auto", choices=COLOR_MODES)
FIX_HELP = "Exit 1 when a file was written (for pre-commit and other fixers)."
LOCK_HELP = "How long to wait for another mm3-codemod run on the same file."

TARGETS = (PATHS, PYTHONS, ROOTS)
WRITES = (
    Option("--backup", "backup", "Keep the original as <file>.orig."),
    Option("--show-diff", "show_diff", "Also print the diff of each file written (stdout)."),
    Option("--exit-non-zero-on-fix", "exit_non_zero_on_fix", FIX_HELP),
    Option("--lock-timeout", "lock_timeout", LOCK_HELP, "SECONDS", float, default=DEFAULT_TIMEOUT, minimum=0),
)
REPORT = (JSON, Option("--all", "show_all", "List not-a-site calls too."), COLOR)
CHECK_OPTIONS = (
    *TARGETS,
    EXAMPLE,
    Option("--diff", "diff", "Also print the diff `run` would apply (stdout); `preview` is an alias."),
    *REPORT,
)
RUN_EXAMPLE_HELP = "Rewrite a temporary copy of the bundled example (never the package's own file)."
PROVE_HELP = (
    "Before writing, run the new code as verify's semantic level does (where torch is installed);"
    " a rewrite that fails it is not written."
)
RUN_OPTIONS = (
    *TARGETS,
    Option("--example", "example", RUN_EXAMPLE_HELP),
    Option("--dry-run", "dry_run", "Write nothing; exit 1 when a file would be changed (as check)."),
    Option("--diff", "diff", "Write nothing; print the diff a run would apply (stdout): as check --diff."),
    *WRITES,
    Option("--prove/--no-prove", "prove", PROVE_HELP, default=True),
    *REPORT,
)
WHOLE_HELP = (
    "Also take out a bypass whose removal does not give back what `run` started from (a fork's own"
    " bypass, or one run upgraded): the whole bypass goes."
)
REVERT_OPTIONS = (
    *TARGETS,
    Option("--dry-run", "dry_run", "Write nothing; exit 1 when a file carries a bypass to take out."),
    Option("--check", "check", "Old spelling of --dry-run.", hidden=True),
    Option("--diff", "diff", "Write nothing; print the diff a revert would apply (stdout)."),
    Option("--whole-bypass", "whole_bypass", WHOLE_HELP),
    *WRITES,
    *REPORT,
)
KERNELS_HELP = "A vLLM kernel library (_C*.so) to load instead of vllm._custom_ops (no GPU: fails)."
TP_HELP = (
    "Run the semantic and kernel levels at this tensor-parallel size too, every rank (repeatable; "
    "default: one TP that shards the KV heads and one that replicates them; --tp 1: TP=1 only; "
    "a row asked for that cannot run fails)."
)
ENGINE_HELP = (
    "Also serve a tiny random-weight MiniMax-M3 built from the file with vLLM's offline engine, "
    "bf16 vs fp8 KV cache (CUDA GPU and vLLM; minutes; where it cannot run, it fails)."
)
BLOCK_SIZE_HELP, BACKEND_HELP = "The engine level's block size.", "The engine level's attention backend."
VERIFY_OPTIONS = (
    PATHS,
    Option("--python", "python", "Interpreter whose vLLM to verify and import with.", "EXE"),
    ROOTS,
    Option("--example", "example", "Also verify the bundled example (it is unpatched: it fails)."),
    Option("--kernels", "kernels", KERNELS_HELP, "SO", Path),
    Option("--require-gpu", "require_gpu", "Fail, rather than skip, when the kernel level cannot run."),
    Option("--require-import", "require_import", "Fail, rather than skip, when the import level cannot run."),
    Option("--timing/--no-timing", "timing", "Time the kernels (GPU only).", default=True),
    Option("--tp", "tp", TP_HELP, "N", int, many=True, minimum=1),
    Option("--engine", "engine", ENGINE_HELP),
    Option("--engine-block-size", "engine_block_size", BLOCK_SIZE_HELP, "N", int, default=128, minimum=1),
    Option("--engine-backend", "engine_backend", BACKEND_HELP, "NAME", default="TRITON_ATTN"),
    Option("--engine-eager", "engine_eager", "Run the engine level with enforce_eager (no CUDA graphs)."),
    Option("--verbose -v", "verbose", "Show every check."),
    JSON,
    COLOR,
)
SURVEY_OPTIONS = (
    *TARGETS,
    Option("--jobs -j", "jobs", "Worker processes (default: the CPU count).", "N", int, minimum=1),
    JSON,
    Option("--all", "show_all", "Also list files without the fused op and not-a-site calls."),
    COLOR,
)


# --- the commands (``o``: the options read, each by its ``dest``) ------------------------------


def stderr(wide: bool = False) -> Console:
    # Tables are not squeezed to 80 columns when stderr is a pipe or a file.
    width = None if not wide or sys.stderr.isatty() else int(os.environ.get("COLUMNS", 0) or 240)
    return console(sys.stderr, width=width)


def _targets(command: str, *args: Any, **kwargs: Any) -> tuple[list[Target], Report | None]:
    """``resolve(*args, **kwargs)``; where it fails, no targets and the report that says why."""
    try:
        return resolve(*args, **kwargs), None
    except TargetError as exc:
        return [], Report(command, [], error=str(exc))


def print_diffs(report: Report, only: FileStatus | None = None) -> None:
    """Each file's unified diff on stdout; on stderr, the folder to apply it from (if not this one)."""
    roots: dict[Path, None] = {}  # an ordered set
    for target, result in zip(report.targets, report.files):
        if result.diff and (only is None or result.status is only):
            write_diff(result.diff, result.encoding)
            if target.root is not None and target.origin != "--example":
                roots[target.root] = None
    for root in (r for r in roots if os.path.abspath(r) != os.getcwd()):
        where = f"diff paths are relative to {shown_path(root)}: apply it there (git apply, or patch -p1)"
        say(stderr(), where)


# ANSI colours of a diff's lines: bold headers, cyan hunk headers, green/red lines.
_DIFF_COLOURS = {"+++": "1", "---": "1", "@@": "36", "+": "32", "-": "31"}
_DIFF_LINE = re.compile(r"^(\+\+\+|---|@@|\+|-).*", re.M)  # a line up to its "\n" (a "\r" stays in it)


def write_diff(diff: str, encoding: str) -> None:
    """The diff on stdout as the file's own bytes (its encoding, its line endings, its tabs),
    so that ``patch`` and ``git apply`` take it; coloured only where the console would colour,
    each line whole between escape codes (rich would turn tabs into spaces and eat carriage returns)."""
    out = console(sys.stdout)
    if out.color_system is not None and not out.no_color:
        diff = _DIFF_LINE.sub(lambda m: f"\x1b[{_DIFF_COLOURS[m[1]]}m{m[0]}\x1b[0m", diff)
    try:
        data = diff.encode(encoding, errors="surrogateescape")
    except UnicodeEncodeError:  # a file name the file's own encoding cannot spell
        data = diff.encode(encoding, errors="replace")
    write_stdout(data)


def print_json(data: dict[str, object]) -> None:
    """A ``--json`` report on stdout."""
    write_stdout(json.dumps(data, indent=2) + "\n")


def _finish(report: Report, o: SimpleNamespace, err: Console | None = None, diffs: bool = False) -> int:
    """The diffs (``diffs``, not with --json) and the JSON report on stdout, the human one on stderr;
    the exit code. Diffs of what was planned, or, where files were written, of those."""
    from rewriter.report import print_human, to_json

    if diffs and not o.as_json:
        print_diffs(report, only=None if report.dry else FileStatus.REWRITTEN)
    print_human(report, err or stderr(), show_all=o.show_all)
    if o.as_json:
        print_json(to_json(report))
    return report.exit_code


def check(o: SimpleNamespace, command: str = "check") -> int:
    """Report each call site's state; write nothing. Exit 1 when a rewrite is needed.

    --diff: also the diff `run` would apply, on stdout (aliases: `preview`, `run --diff`).
    """
    targets, failed = _targets(command, o.paths, o.pythons, o.roots, o.example)
    return _finish(failed or analyze_targets(command, targets), o, diffs=o.diff)


def preview(o: SimpleNamespace) -> int:
    """Alias of `check --diff`: the unified diff `run` would apply (stdout); write nothing.

    Exit 1 when there is one. Kept for scripts that use it; `check --diff` is the spelling.
    """
    o.diff = True
    return check(o, "preview")


def run(o: SimpleNamespace) -> int:
    """Apply the fp8 bypass where needed: validated, atomic, all or nothing."""
    with example_copy() if o.example else contextlib.nullcontext() as copy:
        return _write("run", o, o.dry_run or o.diff, copy)


def revert(o: SimpleNamespace) -> int:
    """Take the fp8 bypass out again (the inverse of run): validated, atomic, all or nothing."""
    return _write("revert", o, o.dry_run or o.check or o.diff)


def _write(command: str, o: SimpleNamespace, dry: bool, copy: Path | None = None) -> int:
    """``dry``: plan only; ``--diff`` prints what would be written, ``--show-diff`` what was."""
    targets, failed = _targets(command, o.paths + ([copy] if copy else []), o.pythons, o.roots)
    targets = [dataclasses.replace(t, origin="--example") if t.path == copy else t for t in targets]
    waiting = f"another mm3-codemod run holds it (up to {o.lock_timeout:g} s)"
    report = failed or write_targets(
        command, targets, backup=o.backup, dry_run=dry, exit_non_zero_on_fix=o.exit_non_zero_on_fix,
        lock_timeout=o.lock_timeout, on_wait=lambda path: say(stderr(), f"waiting for {path}: {waiting}"),
        prove=getattr(o, "prove", False), whole_bypass=getattr(o, "whole_bypass", False),
    )
    if copy is not None and not failed:
        say(stderr(), f"the bundled example, copied to {copy} for this run (removed afterwards)")
    return _finish(report, o, diffs=o.diff or o.show_diff)


# survey shows a progress bar (on a terminal) above this many targets.
PROGRESS_MIN_TARGETS = 8


def survey(o: SimpleNamespace) -> int:
    """One table of every target: vLLM version, file, each site's state, what run would do and why.

    Exit codes as check: 0 nothing to do, 1 a rewrite is needed, 2 a target could not be handled;
    an environment without vLLM is a row of its own (no-vllm), nothing to do there.
    """
    from rewriter.survey import survey_targets

    no_vllm: dict[str, str] = {}  # an environment without vLLM is a row, not an error
    # survey alone shows versions: only it asks a source tree's version file or git for one
    targets, failed = _targets("survey", o.paths, o.pythons, o.roots, no_vllm=no_vllm, versions=True)
    err = stderr(wide=True)
    if failed or len(targets) <= PROGRESS_MIN_TARGETS or not err.is_terminal or o.as_json:
        return _finish(failed or survey_targets(targets, o.jobs, no_vllm=no_vllm), o, err)
    from rich.progress import Progress

    # Refreshed by hand (no refresh thread): the pool forks its workers first.
    with Progress(console=err, transient=True, auto_refresh=False) as progress:
        task = progress.add_task("surveying", total=len(targets))
        report = survey_targets(
            targets, o.jobs, lambda: progress.update(task, advance=1, refresh=True), no_vllm
        )
    return _finish(report, o, err)


def verify(o: SimpleNamespace) -> int:
    """Import the rewritten module and run its code: reference ops (CPU) and vLLM's kernels (GPU).

    Says only what it proved: a file is verified where a level that runs its code passed.

    Exit 0: every file with an insert site verified (semantic, kernel or engine), none failed.

    Exit 1: a level failed; a level an option asks for could not run; a file is not verified.

    Exit 2: a target could not be read.
    """
    from rewriter.verify import VerifyReport
    from rewriter.verify import verify as verify_targets
    from rewriter.verify.engine import EngineOptions
    from rewriter.verify.table import print_verify

    targets, failed = _targets("verify", o.paths, [o.python] if o.python else [], o.roots, o.example)
    no_kernels = o.kernels is not None and not o.kernels.is_file()
    if failed is not None or no_kernels:
        report = VerifyReport([], error=failed.error if failed else f"{o.kernels}: --kernels: no such file")
    else:
        engine = EngineOptions(o.engine_block_size, o.engine_backend, o.engine_eager) if o.engine else None
        kernels = str(o.kernels) if o.kernels else None
        report = verify_targets(
            targets, python=o.python, kernels=kernels, require_gpu=o.require_gpu, timing=o.timing,
            require_import=o.require_import, engine=engine, tp_sizes=o.tp,
        )
    print_verify(report, stderr(), verbose=o.verbose)
    if o.as_json:
        print_json(report.to_json())
    return report.exit_code


# Each command's options (in the order its help lists them) and body (its docstring is the help).
COMMANDS = {
    "check": (CHECK_OPTIONS, check),
    "preview": ((*TARGETS, EXAMPLE, *REPORT), preview),
    "run": (RUN_OPTIONS, run),
    "verify": (VERIFY_OPTIONS, verify),
    "revert": (REVERT_OPTIONS, revert),
    "survey": (SURVEY_OPTIONS, survey),
}


def call(name: str, values: dict[str, Any]) -> int:
    """Run command ``name`` with the options read (by either reader)."""
    set_color(values.pop("color"))
    return COMMANDS[name][1](SimpleNamespace(**values))


# --- the fast reader -------------------------------------------------------------------------

_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def _value(declared: Option, text: str) -> object:
    """``text`` as the option's value; None where typer should read it (and explain)."""
    if declared.choices:
        return text if text in declared.choices else None
    if declared.kind in (int, float):
        if not (text.isascii() and _NUMBER.fullmatch(text)) or (declared.kind is int and not text.isdigit()):
            return None
        number = declared.kind(text)
        return number if declared.minimum is None or number >= declared.minimum else None
    if not text or text.startswith("-"):
        return None
    return declared.kind(text)


def read_plain(argv: list[str]) -> tuple[str, dict[str, Any]] | None:
    """``(command, values)`` for a plain command line; None: let typer read it."""
    if not argv or argv[0] not in COMMANDS:
        return None
    options = COMMANDS[argv[0]][0]
    values = {o.dest: [] if o.many else o.default for o in options}
    valued = {spelling: o for o in options if not o.is_flag for spelling in o.flags}
    # "--timing": (its option, True), "--no-timing": (its option, False)
    flags = [(o, flag.split("/")) for o in options if o.is_flag for flag in o.flags]
    switches = {name: (o, i == 0) for o, names in flags for i, name in enumerate(names)}
    rest = argv[1:]
    while rest:
        arg = rest.pop(0)
        name, eq, text = arg.partition("=")
        if arg in switches:
            switch, state = switches[arg]
            values[switch.dest] = state
        elif name in valued and not (eq and not name.startswith("--")):  # click reads "-j=2" as "=2"
            taking = valued[name]
            if not eq and not rest:
                return None
            value = _value(taking, text if eq else rest.pop(0))
            if value is None:
                return None
            values[taking.dest] = [*values[taking.dest], value] if taking.many else value
        elif arg and not arg.startswith("-"):
            values["paths"].append(Path(arg))
        else:
            return None  # --help, --, an unknown option: typer answers
    return argv[0], values


# --- the typer app, built from the same declarations -----------------------------------------


def typer_app() -> typer.Typer:
    import inspect
    from typing import Annotated, Optional

    import typer
    import typer.core

    # The help names an option's value by its metavar (EXE, DIR), never by a Python type
    # (`<list[Path]>`, `<bool>`); a flag takes no value and shows none.
    typer.core.TyperArgument.display_type_rich = lambda param, ctx: None
    typer.core.TyperOption.display_type_rich = lambda param, ctx: None if param.is_flag else param.metavar

    def parameter(declared: Option) -> inspect.Parameter:
        kind: Any = list[declared.kind] if declared.many else declared.kind
        if declared.default is None:
            kind = Optional[kind]
        if not declared.flags:
            info: Any = typer.Argument(metavar=declared.metavar, help=declared.help, show_default=False)
        else:
            info = typer.Option(
                *declared.flags, metavar=declared.metavar, help=declared.help, min=declared.minimum,
                hidden=declared.hidden, show_default=declared.default is not None,
                callback=choice_check(declared.choices) if declared.choices else None,
            )
        return inspect.Parameter(
            declared.dest,
            inspect.Parameter.KEYWORD_ONLY,
            default=[] if declared.many else declared.default,  # none given: [], as read_plain reads it
            annotation=Annotated[kind, info],
        )

    def choice_check(choices: tuple[str, ...]) -> Callable[[str], str]:
        def check(value: str) -> str:
            if value not in choices:
                raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
            return value

        return check

    def command(name: str, options: tuple[Option, ...], body: Callable[..., int]) -> Callable[..., None]:
        def function(**values: Any) -> None:
            raise typer.Exit(call(name, values))

        function.__doc__ = body.__doc__ or ""
        setattr(function, "__signature__", inspect.Signature([parameter(o) for o in options]))  # for typer
        return function

    app = typer.Typer(
        add_completion=False, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
        help="Rewrite vLLM's MiniMax-M3 NVIDIA model so that an fp8 KV cache works on SM89 GPUs.",
    )
    for name, (options, body) in COMMANDS.items():
        app.command(name)(command(name, options, body))

    def version(value: bool) -> None:
        if value:
            write_stdout(f"mm3-codemod {__version__}\n")
            raise typer.Exit()

    @app.callback()
    def _main(
        version: bool = typer.Option(
            False, "--version", "-V", callback=version, is_eager=True, help="Show the version."
        ),
    ) -> None:
        pass

    return app


# --- the console script ------------------------------------------------------------------------


class Interrupted(BaseException):
    """Ctrl-C. Not KeyboardInterrupt: click would print "Aborted!" and exit 1."""


def _interrupted(signum: int, frame: object) -> None:
    raise Interrupted


def _quit(line: str, code: int) -> None:
    """End with one line on stderr; what is still buffered for stdout goes nowhere."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(code)


def main(argv: list[str] | None = None, plain: bool = True) -> None:
    """The console script: the command's exit code; Ctrl-C: "interrupted", 130 (files are
    written whole or not at all); a stdout that cannot be written: one line, 2.
    ``plain=False``: typer reads every command line (what the tests compare against)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when ignored (nohup, &)
        signal.signal(signal.SIGINT, _interrupted)
    args = sys.argv[1:] if argv is None else argv
    try:
        read = read_plain(args) if plain else None
        if read is not None:
            sys.exit(call(*read))
        try:
            typer_app()(args=args, prog_name="mm3-codemod")
        except OSError as exc:  # click and rich print help and usage themselves
            if exc.errno not in (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
                raise
            raise OutputError(exc.strerror or str(exc)) from exc
    except Interrupted:
        _quit("interrupted", 130)
    except OutputError as exc:
        _quit(f"error: cannot write to stdout: {exc}", 2)
