"""The conventions users expect of a CLI: -h, -V, python -m, colour, one spelling per idea,
"nothing written" only where something could be, one JSON envelope."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli

from rewriter import __version__

COMMANDS = ("check", "preview", "run", "revert", "survey", "verify")
ESC = "\x1b["


def copy(tmp_path: Path, variant: str) -> Path:
    target = tmp_path / variant / "model.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(FIXTURES / variant / "model.py", target)
    return target


# --- -h, -V, python -m mm3_codemod -------------------------------------------------------------


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_dash_h_is_help(command: str) -> None:
    args = [command] if command else []
    short, long = cli(*args, "-h"), cli(*args, "--help")
    assert short.returncode == long.returncode == 0
    assert short.stdout == long.stdout and "Usage: mm3-codemod" in short.stdout


def test_dash_v_and_python_dash_m() -> None:
    for flag in ("-V", "--version"):
        proc = cli(flag)
        assert (proc.returncode, proc.stdout) == (0, f"mm3-codemod {__version__}\n")
    module = subprocess.run(
        [sys.executable, "-m", "mm3_codemod", "-V"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert (module.returncode, module.stdout) == (0, f"mm3-codemod {__version__}\n")
    target = str(FIXTURES / "fork_era" / "model.py")
    via_module = subprocess.run(
        [sys.executable, "-m", "mm3_codemod", "check", target], capture_output=True, text=True, timeout=120
    )
    assert (via_module.returncode, via_module.stderr) == (1, cli("check", target).stderr)


def test_mm3_codemod_is_an_installed_package() -> None:
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "mm3_codemod" in packages


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_values_not_python_types(command: str) -> None:
    proc = cli(command, "--help", env={"COLUMNS": "200"})
    types = re.findall(r"<(?:list\[\w+\]|bool|str|int|float|Path|int range|float range)>", proc.stdout)
    assert types == [], proc.stdout
    for option, metavar in (("--python", "EXE"), ("--vllm-root", "DIR"), ("--color", "WHEN")):
        assert re.search(rf"{option} +{metavar}\b", proc.stdout), (option, proc.stdout)


# --- colour ------------------------------------------------------------------------------


def on_terminal(*args: str, env: dict[str, str] | None = None) -> str:
    """Run the CLI with stdout and stderr on a pseudo-terminal; everything it printed."""
    leader, follower = pty.openpty()
    inherited = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    full_env = {**inherited, "TERM": "xterm-256color", "COLUMNS": "120", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rewriter", *args], stdout=follower, stderr=follower, env=full_env, cwd=ROOT
    )
    os.close(follower)
    out = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(leader)
    return out.decode()


def test_colour_auto_on_a_terminal_and_no_escape_codes_with_no_color() -> None:
    """NO_COLOR and --color never: no escape code at all - the diff's bold headers included."""
    args = ("check", "--diff", str(FIXTURES / "fork_era" / "model.py"))
    assert ESC in on_terminal(*args)
    plain = on_terminal(*args, env={"NO_COLOR": "1"})
    assert "+++ b/fixtures/fork_era/model.py" in plain and ESC not in plain
    never = on_terminal(*args, "--color", "never")
    assert "+++ b/fixtures/fork_era/model.py" in never and ESC not in never


@pytest.mark.parametrize("command", ["check", "run", "revert", "survey"])
def test_colour_always_and_never_through_a_pipe(tmp_path: Path, command: str) -> None:
    target = copy(tmp_path, "two_candidates")  # refused by run and check: red, yellow
    extra = ["--dry-run"] if command in ("run", "revert") else []
    piped = cli(command, *extra, str(target))
    assert ESC not in piped.stderr  # auto: a pipe is not a terminal
    always = cli(command, *extra, "--color", "always", str(target))
    assert ESC in always.stderr
    never = cli(command, *extra, "--color=never", str(target), env={"FORCE_COLOR": "1"})
    assert ESC not in never.stderr
    assert re.sub(r"\x1b\[[0-9;]*m", "", always.stderr) == never.stderr
    assert cli(command, "--color", "sometimes", str(target)).returncode == 2


# --- one spelling per idea ---------------------------------------------------------------------


def test_diff_and_dry_run_mean_the_same_on_every_command(tmp_path: Path) -> None:
    """--diff: write nothing, print the diff (check, run, revert); --dry-run: write nothing,
    exit 1 when a file would change (run, revert; revert's old --check still works)."""
    target = copy(tmp_path, "fork_era")
    original = target.read_bytes()
    checked = cli("check", "--diff", str(target))
    for args in (["run", "--diff"], ["run", "--dry-run", "--diff"]):
        proc = cli(*args, str(target))
        assert (proc.returncode, proc.stdout) == (1, checked.stdout), args
        assert target.read_bytes() == original
    dry = cli("run", "--dry-run", str(target))
    assert (dry.returncode, dry.stdout, dry.stderr) == (1, "", cli("check", str(target)).stderr)
    assert target.read_bytes() == original
    shown = cli("run", "--show-diff", str(target))  # writes, then shows what it wrote
    assert (shown.returncode, shown.stdout) == (0, checked.stdout)
    assert target.read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()

    patched = target.read_bytes()
    revert_dry = cli("revert", "--dry-run", str(target))
    assert revert_dry.returncode == 1 and "1 file would be reverted." in revert_dry.stderr
    old = cli("revert", "--check", str(target))
    assert (old.returncode, old.stdout, old.stderr) == (1, "", revert_dry.stderr)
    assert cli("revert", "--diff", str(target)).stdout.startswith("--- a/model.py\n")
    assert target.read_bytes() == patched
    assert "--check" not in cli("revert", "--help").stdout  # kept, but not advertised


def test_nothing_written_is_said_only_by_commands_that_could_write(tmp_path: Path) -> None:
    target = copy(tmp_path, "two_candidates")  # refused
    for args in (["check"], ["preview"], ["survey"], ["run", "--dry-run"], ["check", "--diff"]):
        proc = cli(*args, str(target))
        assert proc.returncode == 2 and "refused at line 37" in proc.stderr, args
        assert "nothing written" not in proc.stderr, args
    proc = cli("run", str(target))
    assert proc.returncode == 2 and "nothing written" in proc.stderr


# --- one JSON envelope ---------------------------------------------------------------------------

ENVELOPE = {"tool", "version", "command", "exit_code", "error", "note", "files", "summary"}


def test_every_command_prints_one_json_envelope(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # verify's semantic level
    native, fork_era = str(FIXTURES / "native" / "model.py"), copy(tmp_path, "fork_era")
    runs = {
        "check": ["check", "--json", native],
        "preview": ["preview", "--json", native],
        "run": ["run", "--json", str(fork_era)],
        "revert": ["revert", "--json", "--dry-run", str(fork_era)],
        "survey": ["survey", "--json", native],
        "verify": ["verify", "--json", str(fork_era)],
    }
    for command, args in runs.items():
        proc = cli(*args)
        report = json.loads(proc.stdout)
        assert set(report) - {"kernel"} == ENVELOPE and (command == "verify") == ("kernel" in report)
        assert (report["tool"], report["version"], report["command"]) == ("mm3-codemod", __version__, command)
        assert report["exit_code"] == proc.returncode
        assert report["files"] and all(
            {"path", "status", "error", "origin"} <= set(f) for f in report["files"]
        )
        assert sum(report["summary"].values()) == len(report["files"])
        assert {f["status"] for f in report["files"]} <= set(report["summary"])
    error = json.loads(cli("verify", "--json", str(tmp_path / "missing.py")).stdout)
    assert set(error) - {"kernel"} == ENVELOPE and error["exit_code"] == 2 and "missing.py" in error["error"]
