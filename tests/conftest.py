from __future__ import annotations

import ast
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (``python -m rewriter``) in a fresh process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rewriter", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or ROOT,
        timeout=300,
    )


@pytest.fixture
def copy_fixture(tmp_path: Path):
    """Copy ``fixtures/<variant>/model.py`` to a temp file and return its path."""

    def copy(variant: str, name: str = "model.py") -> Path:
        target = tmp_path / variant / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FIXTURES / variant / "model.py", target)
        return target

    return copy


def make_vllm_tree(root: Path, files: dict[str, bytes], init: str = "") -> Path:
    """A minimal ``vllm`` package under ``root`` with files in minimax_m3/nvidia."""
    nvidia = root / "vllm" / "models" / "minimax_m3" / "nvidia"
    nvidia.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(init)
    for name, data in files.items():
        path = nvidia / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return nvidia


@pytest.fixture(scope="session", autouse=True)
def no_temp_folder_left(tmp_path_factory):
    """Everything temporary that the code under test makes - in this process or in the CLI,
    pre-commit and pip processes the tests start - goes under one TMPDIR, which must be
    empty again at the end (pytest's own tmp_path folders live elsewhere)."""
    temp = tmp_path_factory.mktemp("TMPDIR")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(temp)
    tempfile.tempdir = None  # tempfile reads TMPDIR again
    yield
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    left = sorted(p.name for p in temp.iterdir())
    assert not left, f"temporary files left behind: {left}"


def pytest_terminal_summary(terminalreporter) -> None:
    """The mutation corpus counts: rewritten / refused / wrong, by mutation kind."""
    mutations = sys.modules.get("mutations")
    results = getattr(mutations, "RESULTS", None)
    if not results:
        return
    outcomes = ("rewritten", "refused", "wrong")
    write = terminalreporter.write_line
    terminalreporter.section("mutation corpus")
    total = {o: sum(1 for r in results if r[2] == o) for o in outcomes}
    write(f"{len(results)} variants: " + ", ".join(f"{total[o]} {o}" for o in outcomes))
    kinds = sorted({k for r in results for k in r[1]})
    write(f"{'kind (in a variant)':24} " + " ".join(f"{o:>9}" for o in outcomes))
    for kind in kinds:
        counts = [sum(1 for r in results if kind in r[1] and r[2] == o) for o in outcomes]
        write(f"{kind:24} " + " ".join(f"{n:>9}" for n in counts))
    for fixture, kinds_, outcome, reason in results:
        if outcome == "refused":
            write(f"refused: {fixture} {'+'.join(kinds_)}: {reason}")


def syntax_tree(source: str) -> str:
    """``ast.dump`` of a file, docstrings compared without the whitespace black may move."""
    module = ast.parse(source)
    for node in ast.walk(module):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and ast.get_docstring(node) is not None
        ):
            node.body[0] = ast.Expr(ast.Constant(inspect.cleandoc(node.body[0].value.value).strip()))
    return ast.dump(module)


_FIXTURE_BYTES: dict[Path, bytes] = {}


def pytest_sessionstart(session) -> None:
    _FIXTURE_BYTES.update((p, p.read_bytes()) for p in FIXTURES.rglob("*.py"))


def pytest_sessionfinish(session, exitstatus) -> None:
    """No test may write the fixtures it reads (a run on a fixture path writes it)."""
    changed = [str(p) for p, data in _FIXTURE_BYTES.items() if not p.exists() or p.read_bytes() != data]
    if changed:
        print("\nfixtures changed by the tests: " + ", ".join(changed))
        session.exitstatus = 1
