"""What `run` writes passes the fork's own checks.

Every vLLM fork carries vLLM's pre-commit: ``ruff check`` (rules E, F, UP, B, ISC, SIM,
I, G; line length 88) and ``ruff format``. A rewrite must add no ``ruff check`` finding
the original did not have, and keep ``ruff format --check`` passing wherever it passed
on the original - else the fork's next commit fails on code the tool wrote. The real
``ruff`` is run, with ``--isolated`` so that this project's own ruff config (line length
110, fixtures excluded) does not apply.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import FIXTURES

from rewriter.commands import write_targets
from rewriter.targets import Target

if importlib.util.find_spec("ruff") is not None:
    RUFF = [sys.executable, "-m", "ruff"]
elif shutil.which("ruff"):
    RUFF = [str(shutil.which("ruff"))]
else:  # pragma: no cover - the `test` extra installs it
    RUFF = []

pytestmark = pytest.mark.skipif(not RUFF, reason="ruff is not installed (pip install -e '.[test]')")

# vLLM's pre-commit settings (its pyproject's [tool.ruff]), for any fork.
LINE_LENGTH = "88"
CHECK = [
    "check",
    "--isolated",
    "--no-cache",
    "--select",
    "E,F,UP,B,ISC,SIM,I,G",
    "--line-length",
    LINE_LENGTH,
    "--target-version",
    "py310",
    "--output-format",
    "json",
    "--exit-zero",
]
FORMAT = ["format", "--isolated", "--no-cache", "--line-length", LINE_LENGTH]

# Every fixture whose model.py `run` rewrites (its expected.py differs).
REWRITTEN = sorted(
    d.name
    for d in FIXTURES.iterdir()
    if (d / "model.py").is_file()
    and (d / "expected.py").is_file()
    and (d / "model.py").read_bytes() != (d / "expected.py").read_bytes()
)

def findings(path: Path) -> Counter[tuple[str, str]]:
    """``ruff check``'s findings, by rule code and message (not by line: lines move)."""
    proc = subprocess.run([*RUFF, *CHECK, str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return Counter((f["code"], f["message"]) for f in json.loads(proc.stdout))


def format_clean(path: Path) -> bool:
    proc = subprocess.run([*RUFF, *FORMAT, "--check", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


def format_diff(path: Path) -> str:
    return subprocess.run(
        [*RUFF, *FORMAT, "--diff", str(path)], capture_output=True, text=True, check=False
    ).stdout


def rewrite(source: Path, tmp_path: Path) -> Path:
    """`run` on a copy of ``source``; the copy, rewritten."""
    target = tmp_path / "rewritten" / "model.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    write_targets("run", [Target(target, "test")], prove=False)
    assert target.read_bytes() != source.read_bytes(), "run changed nothing"
    return target


def assert_passes_checks(original: Path, rewritten: Path) -> None:
    new = findings(rewritten) - findings(original)
    assert not new, f"ruff check findings the original did not have: {dict(new)}"
    if format_clean(original):
        assert format_clean(rewritten), "ruff format would change the rewrite:\n" + format_diff(rewritten)


def _cases(known: dict[str, str]) -> list:  # type: ignore[type-arg]
    """Every rewritten fixture; the known failures strictly expected to fail (fixed: an XPASS)."""
    return [
        pytest.param(v, marks=[pytest.mark.xfail(reason=known[v], strict=True)] if v in known else [])
        for v in REWRITTEN
    ]


@pytest.mark.parametrize("variant", _cases({}))
def test_rewrite_adds_no_lint_finding(variant: str, tmp_path: Path) -> None:
    original = FIXTURES / variant / "model.py"
    assert_passes_checks(original, rewrite(original, tmp_path))


@pytest.mark.parametrize("variant", _cases({}))
def test_rewrite_of_a_ruff_formatted_file_stays_formatted(variant: str, tmp_path: Path) -> None:
    """The fixture's model.py as a fork that runs ``ruff format`` has it: formatted, so the
    format property is exercised on every shape (most fixtures are not formatted as is)."""
    original = tmp_path / "formatted" / "model.py"
    original.parent.mkdir()
    shutil.copyfile(FIXTURES / variant / "model.py", original)
    subprocess.run([*RUFF, *FORMAT, "--quiet", str(original)], check=True)
    assert format_clean(original)
    assert_passes_checks(original, rewrite(original, tmp_path))


def test_the_checks_see_what_a_long_generated_line_would_add(tmp_path: Path) -> None:
    """The comparison itself: a rewrite with one line past 88 columns and one that ruff
    format would wrap is caught (so the tests above cannot pass by comparing nothing)."""
    original = tmp_path / "formatted" / "model.py"
    original.parent.mkdir()
    shutil.copyfile(FIXTURES / "fork_era" / "model.py", original)
    subprocess.run([*RUFF, *FORMAT, "--quiet", str(original)], check=True)
    rewritten = rewrite(original, tmp_path)
    text = rewritten.read_text()
    split = 'raise ValueError(\n                f"index cache dtype {idx_cache.dtype}: "\n                f"neither'
    assert split in text
    long_line = 'raise ValueError(f"index cache dtype {idx_cache.dtype}: neither'
    rewritten.write_text(text.replace(split, long_line))
    with pytest.raises(AssertionError, match="E501"):
        assert_passes_checks(original, rewritten)
    rewritten.write_text(
        text.replace("        if not insert_via_fused:\n", "        if  not insert_via_fused:\n")
    )
    with pytest.raises(AssertionError, match="ruff format would change"):
        assert_passes_checks(original, rewritten)
