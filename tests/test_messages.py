"""Advice that works as written.

This project is not on PyPI: `pip install mm3-codemod` (with or without an extra) would install
whatever someone else published under that name (dependency confusion), and its `[verify]`
extra pulls a CUDA torch. No message, and no page, may name it; what is missing is named by a
name that resolves where the user stands (torch itself, for the interpreter that runs the tool).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

# `pip install` (any options) of the requirement *named* mm3-codemod: not a path ending in it.
BY_NAME = re.compile(
    r"pip3?\s+install\s+(?:-\S+\s+)*['\"]?(?<![/\w.-])mm3[-_.]codemod(?![\w/.-])", re.I
)


def test_the_pattern_finds_an_install_by_name_and_not_by_path() -> None:
    for text in ("pip install 'mm3-codemod[verify]'", "pip install mm3-codemod", "pip install -U mm3_codemod>=0.1"):
        assert BY_NAME.search(text), text
    for text in ("pip install '/src/mm3-codemod[verify]'", "pip install .", "pip install torch"):
        assert not BY_NAME.search(text), text


def string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module (docstrings, messages, f-strings' literal parts)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_no_message_and_no_page_installs_this_tool_by_name() -> None:
    found = []
    for package in ("rewriter", "codemods"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}" for line, text in string_constants(path) if BY_NAME.search(text)]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        found += [f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}" for m in BY_NAME.finditer(text)]
    assert not found, "pip install of mm3-codemod by name (not on PyPI): " + ", ".join(found)


def test_the_torch_advice_is_a_command_for_this_interpreter() -> None:
    from rewriter.verify.layers import NO_TORCH

    install = f"{sys.executable} -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert install in NO_TORCH
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['torch'] = None\nfrom rewriter import proof\nprint(proof.install())"],
        capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert proc.stdout.strip() == install, proc.stderr
