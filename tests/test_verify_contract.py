"""`verify` says only what it proved (issue "Says only what it proved").

Every command a message suggests carries the options of the user's command (--python above all).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli, make_vllm_tree

def without_torch(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``mm3-codemod ARGS`` in a fresh interpreter where ``import torch`` fails."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from rewriter.cli import main\n"
        f"sys.argv = ['mm3-codemod', *{list(args)!r}]\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def levels_of(proc: subprocess.CompletedProcess[str], index: int = 0) -> dict[str, dict]:
    return {lv["level"]: lv for lv in json.loads(proc.stdout)["files"][index]["levels"]}


def interpreter(path: Path, tree: Path) -> str:
    """An executable standing in for another environment's python, whose vLLM is ``tree``'s."""
    path.write_text(f'#!/bin/sh\nPYTHONPATH={tree} exec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


# --- suggested commands keep the user's options -------------------------------------------


def _fork_env(tmp_path: Path, model: str, init: str = "") -> tuple[Path, str]:
    """A vLLM tree holding fixtures/<model>, and an interpreter whose vLLM it is."""
    tree = tmp_path / "env"
    nvidia = make_vllm_tree(tree, {"model.py": (FIXTURES / model).read_bytes()}, init)
    return nvidia / "model.py", interpreter(tmp_path / "python-env", tree)


def test_verify_with_python_does_not_advise_python(tmp_path: Path) -> None:
    """`verify --python X`: the import level says what was wrong with X, never "run verify with
    the interpreter of an installed vLLM: --python PATH" (it was run with one)."""
    from rewriter.verify.importcheck import HOW_TO_RUN

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")
    path, python = _fork_env(tmp_path, "patched/model.py", "import mm3_no_such_dependency\n")
    proc = cli("verify", "--python", python, "--json", env={"COLUMNS": "200"})
    report = json.loads(proc.stdout)
    (entry,) = report["files"]
    assert entry["path"] == str(path)
    imp = levels_of(proc)["import"]
    assert imp["status"] == "skipped"
    assert imp["reason"].startswith(f"--python {python}: import vllm: a dependency is not installed"), imp
    assert "mm3_no_such_dependency" in imp["reason"]
    assert HOW_TO_RUN not in proc.stderr and "--python PATH" not in proc.stdout + proc.stderr


def test_run_with_python_suggests_verify_with_the_same_python(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")
    _, python = _fork_env(tmp_path, "fork_era/model.py")
    check = cli("check", "--python", python, env={"COLUMNS": "400"})
    assert check.returncode == 1, check.stderr
    assert check.stderr.rstrip().endswith(f"to apply the fp8 bypass: mm3-codemod run --python {python}")
    proc = cli("run", "--python", python, env={"COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    assert f"to confirm it by running it: mm3-codemod verify --python {python}" in proc.stderr.splitlines()


def test_unproven_run_with_python_says_to_verify_with_the_same_python(tmp_path: Path) -> None:
    """Without torch `run` writes and says how to prove it: that command keeps --python."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")
    path, python = _fork_env(tmp_path, "fork_era/model.py")
    proc = without_torch("run", "--python", python)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("unproven: "))
    install = f"{sys.executable} -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert line.endswith(f"to prove it: {install}, then mm3-codemod verify --python {python}"), line


def test_the_note_of_a_file_to_rewrite_names_the_run_for_that_file(tmp_path: Path) -> None:
    """Before: "run `mm3-codemod run` first", which, run as written, rewrites whatever vLLM
    is around the working folder rather than the file verified."""
    path = tmp_path / "model.py"
    path.write_bytes((FIXTURES / "fork_era" / "model.py").read_bytes())
    proc = without_torch("verify", str(path), "--json")
    assert proc.returncode == 1
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["note"].endswith(f"run `mm3-codemod run {path}` first"), entry["note"]
