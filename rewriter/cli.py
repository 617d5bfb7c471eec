"""The typer CLI: declares every command and option (the bodies of check, preview, run and survey
live in ``rewriter.entry``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core
from rich.console import Console

from rewriter import __version__, entry
from rewriter.apply import FileStatus
from rewriter.commands import Report
from rewriter.commands import revert as revert_targets
from rewriter.console import COLOR_MODES, set_color, write_stdout
from rewriter.locking import DEFAULT_TIMEOUT
from rewriter.targets import Target

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Rewrite vLLM's MiniMax-M3 NVIDIA model so that an fp8 KV cache works on SM89 GPUs.",
)


def _metavar_only(param: typer.core.TyperOption, ctx: object) -> str | None:
    """Help names an option's value by its metavar (EXE, DIR), never by a Python type
    (`<list[Path]>`, `<bool>`); a flag takes no value and shows none."""
    return None if param.is_flag else param.metavar


# typer >= 0.20 prints each parameter's Python type in the help; the name column says enough.
typer.core.TyperArgument.display_type_rich = lambda param, ctx: None  # type: ignore[method-assign]
typer.core.TyperOption.display_type_rich = _metavar_only  # type: ignore[method-assign]

Paths = Annotated[
    Optional[list[Path]],
    typer.Argument(
        metavar="PATHS",
        help="Model files or directories. None given: the vLLM source tree around the working folder,"
        " else the vLLM of this interpreter.",
        show_default=False,
    ),
]
Pythons = Annotated[
    Optional[list[str]],
    typer.Option(
        "--python", metavar="EXE", help="Find the vLLM of this interpreter (repeatable).", show_default=False
    ),
]
Roots = Annotated[
    Optional[list[Path]],
    typer.Option(
        "--vllm-root",
        metavar="DIR",
        help="A vLLM source checkout or site-packages folder (repeatable).",
        show_default=False,
    ),
]


def _color(value: str) -> str:
    if value not in COLOR_MODES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(COLOR_MODES)}")
    set_color(value)
    return value


Color = Annotated[
    str,
    typer.Option(
        "--color",
        metavar="WHEN",
        callback=_color,
        help="Colour: auto (a terminal, unless NO_COLOR is set), always or never.",
    ),
]
Example = Annotated[
    bool, typer.Option("--example", help="Also process the bundled fork-era example model file.")
]
Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON report on stdout (human output stays on stderr).")
]
ShowAll = Annotated[bool, typer.Option("--all", help="List not-a-site calls too.")]
Backup = Annotated[bool, typer.Option("--backup", help="Keep the original as <file>.orig.")]
ShowDiff = Annotated[
    bool, typer.Option("--show-diff", help="Also print the diff of each file written (stdout).")
]
DryRun = Annotated[
    bool, typer.Option("--dry-run", help="Write nothing; exit 1 when a file would be changed (as check).")
]
FixExit = Annotated[
    bool,
    typer.Option(
        "--exit-non-zero-on-fix", help="Exit 1 when a file was written (for pre-commit and other fixers)."
    ),
]
LockWait = Annotated[
    float,
    typer.Option(
        "--lock-timeout",
        metavar="SECONDS",
        min=0,
        help="How long to wait for another mm3-codemod run on the same file.",
    ),
]


# check, preview, run and survey live in rewriter.entry, which also runs their plain
# command lines without importing typer; here they only declare their options.

_say_waiting = entry.say_waiting


def _stderr(wide: bool = False) -> Console:
    return entry.stderr(wide)


def _targets(command: str, paths, pythons, roots, example: bool) -> tuple[list[Target], Report | None]:
    return entry.targets_of(command, paths or [], pythons or [], roots or [], example)


def _print_diffs(report: Report, only: FileStatus | None = None) -> None:
    entry.print_diffs(report, only)


def _finish(report: Report, as_json: bool, show_all: bool) -> None:
    raise typer.Exit(entry.finish(report, as_json, show_all))


@app.command()
def check(
    paths: Paths = None,
    python: Pythons = None,
    vllm_root: Roots = None,
    example: Example = False,
    diff: Annotated[
        bool, typer.Option("--diff", help="Also print the diff `run` would apply (stdout).")
    ] = False,
    json: Json = False,
    show_all: ShowAll = False,
    color: Color = "auto",
) -> None:
    """Report each call site's state; write nothing. Exit 1 when a rewrite is needed."""
    raise typer.Exit(entry.check(paths or [], python or [], vllm_root or [], example, diff, json, show_all))


@app.command()
def preview(
    paths: Paths = None,
    python: Pythons = None,
    vllm_root: Roots = None,
    example: Example = False,
    json: Json = False,
    show_all: ShowAll = False,
    color: Color = "auto",
) -> None:
    """Show the unified diff `run` would apply (stdout); write nothing. Exit 1 when there is one."""
    raise typer.Exit(entry.preview(paths or [], python or [], vllm_root or [], example, json, show_all))


@app.command()
def run(
    paths: Paths = None,
    python: Pythons = None,
    vllm_root: Roots = None,
    example: Annotated[
        bool,
        typer.Option(
            "--example",
            help="Rewrite a temporary copy of the bundled example (never the package's own file).",
        ),
    ] = False,
    dry_run: DryRun = False,
    diff: Annotated[
        bool, typer.Option("--diff", help="Write nothing; print the diff a run would apply (stdout).")
    ] = False,
    backup: Backup = False,
    show_diff: ShowDiff = False,
    exit_non_zero_on_fix: FixExit = False,
    lock_timeout: LockWait = DEFAULT_TIMEOUT,
    json: Json = False,
    show_all: ShowAll = False,
    color: Color = "auto",
) -> None:
    """Apply the fp8 bypass where needed: validated, atomic, all or nothing."""
    raise typer.Exit(
        entry.run(
            paths or [],
            python or [],
            vllm_root or [],
            example,
            backup=backup,
            dry_run=dry_run,
            diff=diff,
            show_diff=show_diff,
            exit_non_zero_on_fix=exit_non_zero_on_fix,
            as_json=json,
            show_all=show_all,
            lock_timeout=lock_timeout,
        )
    )


@app.command()
def verify(
    paths: Paths = None,
    python: Annotated[
        Optional[str],
        typer.Option(
            "--python",
            metavar="EXE",
            help="Interpreter whose vLLM to verify and import with.",
            show_default=False,
        ),
    ] = None,
    vllm_root: Roots = None,
    example: Annotated[
        bool, typer.Option("--example", help="Also verify the bundled example (it is unpatched: it fails).")
    ] = False,
    kernels: Annotated[
        Optional[Path],
        typer.Option(
            "--kernels",
            metavar="SO",
            help="A vLLM kernel library (_C*.so) to load instead of vllm._custom_ops.",
            show_default=False,
        ),
    ] = None,
    require_gpu: Annotated[
        bool, typer.Option("--require-gpu", help="Fail, rather than skip, when the kernel level cannot run.")
    ] = False,
    require_import: Annotated[
        bool,
        typer.Option("--require-import", help="Fail, rather than skip, when the import level cannot run."),
    ] = False,
    timing: Annotated[bool, typer.Option("--timing/--no-timing", help="Time the kernels (GPU only).")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show every check.")] = False,
    json: Json = False,
    color: Color = "auto",
) -> None:
    """Import the rewritten module and run its code: reference ops (CPU) and vLLM's kernels (GPU).

    Exit 0 when nothing failed, 1 when a level failed, 2 when a target could not be read.
    """
    from rewriter.verify import VerifyReport
    from rewriter.verify import verify as verify_targets
    from rewriter.verify.table import print_verify

    targets, failed = _targets("verify", paths, [python] if python else [], vllm_root, example)
    if failed is not None:
        report = VerifyReport([], error=failed.error)
    else:
        if kernels is not None and not kernels.is_file():
            report = VerifyReport([], error=f"{kernels}: --kernels: no such file")
        else:
            report = verify_targets(
                targets,
                python=python,
                kernels=str(kernels) if kernels else None,
                require_gpu=require_gpu,
                timing=timing,
                require_import=require_import,
            )
    print_verify(report, _stderr(), verbose=verbose)
    if json:
        import json as json_module

        write_stdout(json_module.dumps(report.to_json(), indent=2) + "\n")
    raise typer.Exit(report.exit_code)


@app.command()
def revert(
    paths: Paths = None,
    python: Pythons = None,
    vllm_root: Roots = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Write nothing; exit 1 when a file carries a bypass to take out."),
    ] = False,
    check: Annotated[bool, typer.Option("--check", hidden=True, help="Old spelling of --dry-run.")] = False,
    diff: Annotated[
        bool, typer.Option("--diff", help="Write nothing; print the diff a revert would apply (stdout).")
    ] = False,
    backup: Backup = False,
    show_diff: ShowDiff = False,
    exit_non_zero_on_fix: FixExit = False,
    lock_timeout: LockWait = DEFAULT_TIMEOUT,
    json: Json = False,
    show_all: ShowAll = False,
    color: Color = "auto",
) -> None:
    """Take the fp8 bypass out again (the inverse of run): validated, atomic, all or nothing."""
    targets, failed = _targets("revert", paths, python, vllm_root, False)
    dry = dry_run or check or diff
    report = failed or revert_targets(
        targets,
        backup=backup,
        dry_run=dry,
        exit_non_zero_on_fix=exit_non_zero_on_fix,
        lock_timeout=lock_timeout,
        on_wait=_say_waiting(lock_timeout),
    )
    if not json and (diff or show_diff):
        _print_diffs(report, only=None if dry else FileStatus.REWRITTEN)
    _finish(report, json, show_all)


@app.command()
def survey(
    paths: Paths = None,
    python: Pythons = None,
    vllm_root: Roots = None,
    jobs: Annotated[
        Optional[int],
        typer.Option(
            "--jobs",
            "-j",
            min=1,
            metavar="N",
            help="Worker processes (default: the CPU count).",
            show_default=False,
        ),
    ] = None,
    json: Json = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="Also list files without the fused op and not-a-site calls.")
    ] = False,
    color: Color = "auto",
) -> None:
    """One table of every target: vLLM version, file, each site's state, what run would do and why.

    Exit codes as check: 0 nothing to do, 1 a rewrite is needed, 2 a target could not be handled.
    """
    raise typer.Exit(entry.survey(paths or [], python or [], vllm_root or [], jobs, json, show_all))


def _version(value: bool) -> None:
    if value:
        write_stdout(f"mm3-codemod {__version__}\n")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    pass


def main() -> None:
    """Every command line through typer (the console script is ``rewriter.entry:main``)."""
    app(prog_name="mm3-codemod")
