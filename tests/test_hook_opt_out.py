"""A revert stays reverted (`# mm3-codemod: off`), and advice under pre-commit names only a
hook the config in use has. The CLI, as pre-commit runs it (``PRE_COMMIT=1``, the repository's
top as working folder); tests/test_pre_commit.py runs the same with real pre-commit."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from conftest import FIXTURES, cli

MODEL = "vllm/models/minimax_m3/nvidia/model.py"
OFF = "# mm3-codemod: off"
UNDER_PRE_COMMIT = {"PRE_COMMIT": "1"}


def with_line(source: bytes, line: bytes, ending: bytes = b"\n") -> bytes:
    """``source`` with ``line`` after its opening comment lines."""
    lines = source.splitlines(keepends=True)
    head = next(i for i, text in enumerate(lines) if not text.startswith(b"#"))
    return b"".join([*lines[:head], line + ending, *lines[head:]])


def off_copy(tmp_path: Path, variant: str, source: str = "model.py") -> Path:
    target = tmp_path / variant / "model.py"
    target.parent.mkdir(parents=True)
    target.write_bytes(with_line((FIXTURES / variant / source).read_bytes(), OFF.encode()))
    return target


# --- `# mm3-codemod: off` ------------------------------------------------------------------------


def test_run_check_and_preview_leave_an_off_file_alone(tmp_path: Path) -> None:
    """A file marked off gets no bypass code from any command: needs-bypass, half-applied and
    outdated files are left as they are, each site saying which line to delete; a stale bypass
    on a native call is still taken out (that keeps the bypass out too)."""
    held = {name: off_copy(tmp_path, name) for name in ("fork_era", "half_applied", "seed_form")}
    stale = off_copy(tmp_path, "native_stale_bypass")
    before = {name: path.read_bytes() for name, path in held.items()}
    for command in (["check"], ["preview"], ["run", "--diff"], ["run", "--dry-run"]):
        proc = cli(*command, *map(str, held.values()))
        assert proc.returncode == 0 and proc.stdout == "", (command, proc.stdout, proc.stderr)
        said = re.findall(
            rf"not done\): line (\d+) is `{OFF}`; delete that line to let `run` do it", proc.stderr
        )
        assert said == ["5", "4", "3"], proc.stderr  # where each file has it
        assert "3 files left unchanged." in proc.stderr
    report = json.loads(cli("check", "--json", str(held["fork_era"])).stdout)
    (entry,) = report["files"]
    assert entry["status"] == "unchanged" and report["exit_code"] == 0
    assert [s["action"] for s in entry["sites"] if s["state"] == "needs-bypass"] == ["none"]
    proc = cli("run", *map(str, held.values()), str(stale))
    assert proc.returncode == 0, proc.stderr
    assert {name: path.read_bytes() for name, path in held.items()} == before
    assert "half-applied -> strip" in proc.stderr
    expected = with_line((FIXTURES / "native_stale_bypass" / "expected.py").read_bytes(), OFF.encode())
    assert stale.read_bytes() == expected
    # ... and once the line is deleted, `run` applies the bypass.
    target = held["fork_era"]
    target.write_bytes(target.read_bytes().replace(OFF.encode() + b"\n", b""))
    assert cli("run", str(target)).returncode == 0
    assert target.read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()


def test_the_revert_hook_writes_the_off_line(tmp_path: Path) -> None:
    """Under pre-commit, `revert` writes the off line after the opening comments, in the file's
    line ending and after a BOM; `check` then has nothing to do. Outside pre-commit it writes
    none: `revert(run(x)) == x`."""
    patched = (FIXTURES / "fork_era" / "expected.py").read_bytes()
    plain = (FIXTURES / "fork_era" / "model.py").read_bytes()
    cases = {
        "lf": (patched, with_line(plain, OFF.encode())),
        "crlf": (
            patched.replace(b"\n", b"\r\n"),
            with_line(plain.replace(b"\n", b"\r\n"), OFF.encode(), b"\r\n"),
        ),
        "bom": (b"\xef\xbb\xbf" + patched, b"\xef\xbb\xbf" + with_line(plain, OFF.encode())),
    }
    for name, (source, _) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.py").write_bytes(source)
    proc = cli("revert", *(str(tmp_path / n / "model.py") for n in cases), env=UNDER_PRE_COMMIT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(f"`{OFF}` written at line 5") == 3, proc.stderr
    for name, (_, expected) in cases.items():
        written = (tmp_path / name / "model.py").read_bytes()
        line = next(text for text in written.splitlines() if text.startswith(OFF.encode()))
        assert written == expected.replace(OFF.encode(), line), name  # the line may say more
        assert cli("check", str(tmp_path / name / "model.py")).returncode == 0
    outside = tmp_path / "outside" / "model.py"
    outside.parent.mkdir()
    outside.write_bytes(patched)
    assert cli("revert", str(outside)).returncode == 0
    assert outside.read_bytes() == plain


# --- advice under pre-commit names a hook of the config in use -----------------------------------

LOCAL_HOOK = """\
repos:
  - repo: local
    hooks:
      - id: {id}
        name: fp8
        entry: {entry}
        language: system
        files: vllm/models/minimax_m3/(nvidia|amd)/.*\\.py$
{extra}"""


def fork(tmp_path: Path, config: str | None, fixture: str = "fork_era", source: str = "model.py") -> Path:
    root = tmp_path / "fork"
    (root / MODEL).parent.mkdir(parents=True)
    shutil.copyfile(FIXTURES / fixture / source, root / MODEL)
    if config is not None:
        (root / ".pre-commit-config.yaml").write_text(config)
    return root


def advice(proc, lead: str) -> str:
    (line,) = re.findall(rf"^{re.escape(lead)}(.*)$", proc.stderr, re.M)
    return line


def test_advice_names_the_hook_that_runs_the_command(tmp_path: Path) -> None:
    """Whatever its id, wherever it comes from, at its stage."""
    cases = [
        (
            LOCAL_HOOK.format(id="fp8-bypass", entry="mm3-codemod run --exit-non-zero-on-fix", extra=""),
            f"pre-commit run fp8-bypass --files {MODEL}",
        ),
        (
            LOCAL_HOOK.format(
                id="fp8", entry="python -m mm3_codemod run", extra="        stages: [manual]\n"
            ),
            f"pre-commit run fp8 --hook-stage manual --files {MODEL}",
        ),
        (
            "repos:\n  - repo: /srv/git/mm3-codemod\n    rev: abc\n    hooks:\n"
            "      - id: mm3-codemod-check\n      - id: mm3-codemod\n",
            f"pre-commit run mm3-codemod --files {MODEL}",
        ),
    ]
    for i, (config, expected) in enumerate(cases):
        root = fork(tmp_path / str(i), config)
        proc = cli("check", MODEL, cwd=root, env=UNDER_PRE_COMMIT)
        assert proc.returncode == 1, proc.stderr
        assert advice(proc, "to apply the fp8 bypass: ") == expected, config
    root = fork(
        tmp_path / "revert",
        LOCAL_HOOK.format(id="take-it-out", entry="mm3-codemod revert", extra="        stages: [manual]\n"),
        "fork_era",
        "expected.py",
    )
    proc = cli("revert", "--dry-run", MODEL, cwd=root, env=UNDER_PRE_COMMIT)
    assert (
        advice(proc, "to take the fp8 bypass out: ")
        == f"pre-commit run take-it-out --hook-stage manual --files {MODEL}"
    )


def test_without_such_a_hook_the_advice_is_a_command_that_works(tmp_path: Path) -> None:
    """A check-only config, or none at all (`pre-commit try-repo`): no `pre-commit run` of a
    hook that is not there, but mm3-codemod itself - by name where the PATH has it, else by
    its path - and that command applies the bypass."""
    check_only = LOCAL_HOOK.format(id="mm3-codemod-check", entry="mm3-codemod check --diff", extra="")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "mm3-codemod"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -m rewriter "$@"\n')
    script.chmod(0o755)
    without = os.pathsep.join(
        d for d in os.environ["PATH"].split(os.pathsep) if not shutil.which("mm3-codemod", path=d)
    )
    for i, (config, path) in enumerate([(check_only, f"{bin_dir}{os.pathsep}{without}"), (None, without)]):
        root = fork(tmp_path / str(i), config)
        env = {**UNDER_PRE_COMMIT, "PATH": path}
        command = advice(cli("check", MODEL, cwd=root, env=env), "to apply the fp8 bypass: ")
        assert not command.startswith("pre-commit"), command
        program = command.split(" run ")[0]
        assert (
            program == "mm3-codemod" if config else (Path(program).is_file() or " -m mm3_codemod" in program)
        )
        assert command.endswith(f" run {MODEL}")
        proc = cli(*command.split(" ")[-2:], cwd=root, env={"PATH": path})  # that command's arguments
        assert proc.returncode == 0, proc.stderr
        assert (root / MODEL).read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()


def test_survey_reports_an_off_file_as_run_leaves_it(tmp_path: Path) -> None:
    """`survey` answers as `check` does: a file marked off is left alone (exit 0), not listed as
    one `run` would rewrite."""
    held = off_copy(tmp_path, "fork_era")
    proc = cli("survey", "--json", str(held))
    report = json.loads(proc.stdout)
    sites = [s for f in report["files"] for s in f["sites"] if s["state"] == "needs-bypass"]
    assert [s["action"] for s in sites] == ["none"], proc.stdout
    assert proc.returncode == 0, proc.stderr
