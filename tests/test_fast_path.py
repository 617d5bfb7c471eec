"""The fast path: what a command imports, and that taking it changes no output.

Speed itself is measured by ``bench/run_bench.py``, not asserted here: these
tests check the structure that makes it fast (no LibCST, no typer for a
native or patched file) and the promise that never moves (torch and vllm are
never imported), by looking at ``sys.modules`` of a real process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, fixture_folder, make_vllm_tree, python_c

from rewriter.cli import read_plain

# Runs the CLI in a fresh process and writes, at exit, the top-level names of
# every module it imported. argv: OUT ENTRY ARGS... (ENTRY: the fast reader or typer).
PROBE = """
import atexit, json, sys
out, entry = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted({m.split(".")[0] for m in sys.modules}))))
{preamble}
from rewriter.cli import main
main(plain=entry != "typer")
"""


def fake_packages(root: Path) -> Path:
    """Importable stand-ins for torch and vllm: an accidental import succeeds quietly."""
    for name in ("torch", "vllm"):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
    return root


def imported(
    tmp_path: Path, *args: str, entry: str = "fast", preamble: str = ""
) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    out = tmp_path / "modules.json"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.replace("{preamble}", preamble), str(out), entry, *args],
        capture_output=True,
        text=True,
        env=probe_env(tmp_path),
        cwd=ROOT,
        timeout=300,
    )
    return set(json.loads(out.read_text())), proc


def probe_env(tmp_path: Path) -> dict[str, str]:
    """Stand-ins for torch and vllm ahead of everything on the path."""
    stand_ins = tmp_path / "stand-ins"
    if not stand_ins.exists():
        fake_packages(stand_ins)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(stand_ins), str(ROOT)])}


def copy(tmp_path: Path, variant: str) -> Path:
    target = tmp_path / variant / "model.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(FIXTURES / variant / "model.py", target)
    return target


# --- torch and vllm are never imported ------------------------------------------------------

# Runs each command line in turn in one fresh process (argv: OUT ENTRY LINES-AS-JSON) and
# writes, after each, the top-level names of every module imported so far.
SEQUENCE = """
import json, sys
out, entry, lines = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
from rewriter.cli import main
seen = []
for line in lines:
    try:
        main(line, plain=entry != "typer")
    except SystemExit:
        pass
    seen.append(sorted({m.split(".")[0] for m in sys.modules}))
open(out, "w").write(json.dumps(seen))
"""


def command_lines(tmp_path: Path) -> list[list[str]]:
    tree = tmp_path / "tree"
    make_vllm_tree(tree, {"model.py": (FIXTURES / "fork_era" / "model.py").read_bytes()})
    states = fixture_folder(tmp_path / "states")
    return [
        ["check", str(copy(tmp_path, "fork_era"))],
        ["check", "--json", str(FIXTURES / "native" / "model.py")],
        ["preview", str(FIXTURES / "half_applied" / "model.py")],
        # A run that writes proves the new source first, with torch (tests/test_proof.py):
        # here, everything else it does.
        ["run", "--no-prove", "--backup", str(copy(tmp_path, "fork_era"))],
        ["run", "--no-prove", "--example", "--show-diff"],
        ["run", str(FIXTURES / "patched" / "model.py")],  # nothing to do: nothing to prove
        ["run", "--dry-run", str(FIXTURES / "fork_era" / "model.py")],
        ["run", str(FIXTURES / "two_candidates" / "model.py")],  # refused: nothing written
        ["check", "--vllm-root", str(tree)],
        ["check", "--python", sys.executable],
        ["check"],  # the vLLM of this interpreter: found, never imported
        ["survey", "--jobs", "1", str(states)],
        ["survey", "-j", "2", str(states), "--vllm-root", str(tree)],
        ["revert", str(copy(tmp_path, "patched"))],
        ["revert", "--check", str(FIXTURES / "half_applied" / "model.py")],
    ]


@pytest.mark.parametrize("entry", ["fast", "typer"])
def test_torch_and_vllm_are_never_imported(tmp_path: Path, entry: str) -> None:
    """check, preview, run, survey and revert (verify imports torch: that is its job, and so
    does the proof of a file run writes), one process running every command line in turn:
    what one imports stays imported, so the first line after which torch or vllm shows is the
    one that imported it."""
    lines = command_lines(tmp_path)
    out = tmp_path / "modules.json"
    proc = subprocess.run(
        [sys.executable, "-c", SEQUENCE, str(out), entry, json.dumps(lines)],
        capture_output=True,
        text=True,
        env=probe_env(tmp_path),
        cwd=ROOT,
        timeout=300,
    )
    seen = json.loads(out.read_text()) if out.exists() else []
    assert len(seen) == len(lines), proc.stderr  # every command ran
    for line, modules in zip(lines, seen):
        assert not set(modules) & {"torch", "vllm"}, (line, proc.stderr)


def test_the_probe_sees_an_import(tmp_path: Path) -> None:
    """The check above can fail: an import of torch anywhere in the process shows."""
    modules, _ = imported(tmp_path, "check", str(FIXTURES / "native" / "model.py"), preamble="import torch")
    assert "torch" in modules


# --- what the fast path leaves out ----------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [FIXTURES / "native" / "model.py", FIXTURES / "dense_only" / "model.py"],
    ids=["native", "dense-only"],
)
def test_check_of_a_native_file_imports_neither_libcst_nor_typer(tmp_path: Path, target: Path) -> None:
    modules, proc = imported(tmp_path, "check", str(target))
    assert proc.returncode == 0, proc.stderr
    assert not modules & {"libcst", "typer", "click", "pydantic"}


@pytest.mark.parametrize(
    "target", [FIXTURES / "patched" / "model.py", FIXTURES / "fork_era" / "expected.py"], ids=["patched", "run-output"]
)
def test_check_of_a_patched_file_reads_it_with_libcst_without_typer(tmp_path: Path, target: Path) -> None:
    """The bypass is read by the one analysis there is (LibCST), never by a second one."""
    modules, proc = imported(tmp_path, "check", str(target))
    assert proc.returncode == 0, proc.stderr
    assert "libcst" in modules and not modules & {"typer", "click", "pydantic"}


def test_a_rewrite_still_goes_through_libcst(tmp_path: Path) -> None:
    modules, proc = imported(tmp_path, "check", str(FIXTURES / "fork_era" / "model.py"))
    assert proc.returncode == 1, proc.stderr
    assert "libcst" in modules and "typer" not in modules


def test_survey_jobs_are_read_as_typer_reads_them() -> None:
    for argv, jobs in (
        (["survey", "d"], None),
        (["survey", "-j", "2", "d"], 2),
        (["survey", "d", "--jobs=3"], 3),
    ):
        plain = read_plain(argv)
        assert plain is not None and plain[1]["jobs"] == jobs and plain[1]["paths"] == [Path("d")]


def test_what_the_fast_reader_leaves_to_typer() -> None:
    assert read_plain(["check", "a.py", "--json", "--python=py3", "--vllm-root", "r"]) == (
        "check",
        {
            "paths": [Path("a.py")],
            "pythons": ["py3"],
            "roots": [Path("r")],
            "example": False,
            "diff": False,
            "as_json": True,
            "show_all": False,
            "color": "auto",
        },
    )
    revert = read_plain(["revert", "--check", "--lock-timeout", "2.5", "a.py"])
    assert revert is not None and revert[1]["check"] and revert[1]["lock_timeout"] == 2.5
    verify = read_plain(["verify", "--no-timing", "-v", "--python", "py3", "--python", "py4"])
    assert verify is not None and verify[1]["python"] == "py4"
    assert not verify[1]["timing"] and verify[1]["verbose"]
    for argv in (
        [],
        ["--version"],
        ["check", "--help"],
        ["check", "-h"],
        ["check", "--", "a.py"],
        ["check", "--json=1"],
        ["check", "--backup"],  # a run option
        ["check", "--python"],  # no value
        ["check", "--python", "--json"],
        ["check", "-"],
        ["survey", "-j", "0"],
        ["survey", "-j=2"],
        ["survey", "--jobs", "two"],
        ["survey", "-j"],
        ["survey", "--example"],
        ["check", "--color", "sometimes"],
        ["check", "--color"],
        ["check", "--dry-run"],  # a run option
        ["run", "--lock-timeout", "-1"],
        ["run", "--lock-timeout", "1e3"],
        ["verify", "--timing=1"],
        ["verify", "-v=1"],
        ["undo", "a.py"],
    ):
        assert read_plain(argv) is None, argv


# --- same output whichever reads the command line --------------------------------------------


def run_both(tmp_path: Path, args: list[str], restore: Path | None = None) -> None:
    """The fast reader and typer: same exit code, stdout, stderr (and file written). Only the
    output is compared here (what each imports is the tests above), so both run as
    ``python -c`` children of conftest's zygote, in the same environment."""
    results = []
    original = restore.read_bytes() if restore else b""
    out = tmp_path / "modules.json"
    for entry in ("fast", "typer"):
        if restore:
            restore.write_bytes(original)
            for leftover in restore.parent.glob("*.orig*"):
                leftover.unlink()
        proc = python_c(PROBE.replace("{preamble}", ""), str(out), entry, *args, cwd=ROOT)
        assert "rewriter" in json.loads(out.read_text()), proc.stderr  # the command really ran
        written = restore.read_bytes() if restore else b""
        results.append((proc.returncode, proc.stdout, proc.stderr, written))
    assert results[0] == results[1], args


@pytest.mark.parametrize(
    "args",
    [
        ["check", "fixtures/fork_era/model.py", "fixtures/native/model.py", "--all"],
        ["check", "--json", "{states}"],
        ["preview", "fixtures/half_applied/model.py"],
        ["preview", "--json", "--example"],
        ["check", "fixtures/no_such_file.py"],
        ["check", "--vllm-root", "{states}"],
        ["check", "--diff", "fixtures/fork_era/model.py", "fixtures/patched/model.py"],
        ["survey", "{states}", "--all"],
        ["survey", "--json", "-j", "2", "{states}"],
        ["check", "--bogus"],  # typer's error either way
        ["survey", "-j", "0", "{states}"],
        ["run", "--dry-run", "fixtures/fork_era/model.py", "fixtures/patched/model.py"],
        ["run", "--diff", "--color=always", "fixtures/half_applied/model.py"],
        ["check", "--diff", "--color", "always", "fixtures/fork_era/model.py"],
        ["survey", "--color", "never", "{states}"],
        ["check", "--color", "sometimes", "{states}"],  # typer's error either way
        ["revert", "--diff", "fixtures/patched/model.py"],
        ["revert", "--check", "--json", "fixtures/patched/model.py"],
        ["run", "--lock-timeout", "0.5", "--dry-run", "fixtures/fork_era/model.py"],
        ["run", "--lock-timeout", "-1", "{states}"],  # typer's error either way
    ],
    ids=lambda a: " ".join(a),
)
def test_same_output_through_typer(tmp_path: Path, args: list[str]) -> None:
    """A folder is ``{states}``: one file in each state (``conftest.STATES``); what is compared is
    how each reads the command line, the rest of the work is the same code."""
    if "{states}" in args:
        states = str(fixture_folder(tmp_path / "states"))
        args = [states if a == "{states}" else a for a in args]
    run_both(tmp_path, args)


@pytest.mark.parametrize("variant", ["fork_era", "patched", "native_stale_bypass", "two_candidates"])
def test_same_run_through_typer(tmp_path: Path, variant: str) -> None:
    target = copy(tmp_path, variant)
    run_both(tmp_path, ["run", "--backup", "--show-diff", str(target)], restore=target)
    run_both(tmp_path, ["run", "--json", "--exit-non-zero-on-fix", str(target)], restore=target)
