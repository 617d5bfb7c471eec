"""Advice that works as written.

This project is not on PyPI: `pip install mm3-codemod` (with or without an extra) would install
whatever someone else published under that name (dependency confusion), and its `[verify]`
extra pulls a CUDA torch. No message, and no page, may name it; what is missing is named by a
name that resolves where the user stands (torch itself, for the interpreter that runs the tool).
Also: an empty file is said to be empty, and the three spellings of the diff are one, documented.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import FIXTURES, ROOT, cli

# `pip install` (any options) of the requirement *named* mm3-codemod: not a path ending in it.
BY_NAME = re.compile(
    r"pip3?\s+install\s+(?:-\S+\s+)*['\"]?(?<![/\w.-])mm3[-_.]codemod(?![\w/.-])", re.IGNORECASE
)


def test_the_pattern_finds_an_install_by_name_and_not_by_path() -> None:
    for text in (
        "pip install 'mm3-codemod[verify]'",
        "pip install mm3-codemod",
        "pip install -U mm3_codemod>=0.1",
    ):
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
            found += [
                f"{path.relative_to(ROOT)}:{line}"
                for line, text in string_constants(path)
                if BY_NAME.search(text)
            ]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        found += [
            f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}" for m in BY_NAME.finditer(text)
        ]
    assert not found, "pip install of mm3-codemod by name (not on PyPI): " + ", ".join(found)


def test_the_torch_advice_is_a_command_for_this_interpreter() -> None:
    from rewriter.verify.layers import NO_TORCH

    install = f"{sys.executable} -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert install in NO_TORCH
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['torch'] = None\n"
            "from rewriter.verify.levels import install_torch\nprint(install_torch())",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )
    assert proc.stdout.strip() == install, proc.stderr


# --- an empty file ---------------------------------------------------------------------------


def test_an_empty_file_is_said_to_be_empty(tmp_path: Path) -> None:
    """Before: "1 file without the fused op, (no call of … found)."."""
    empty = tmp_path / "model.py"
    empty.write_bytes(b"")
    proc = cli("check", str(empty))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[-1] == "1 empty file (0 bytes): nothing to do."
    assert "without the fused op" not in proc.stderr
    again = tmp_path / "__init__.py"
    again.write_bytes(b"")
    assert (
        cli("check", str(empty), str(again)).stderr.splitlines()[-1]
        == "2 empty files (0 bytes): nothing to do."
    )
    # beside a file with text, an empty one is one more file without the op (a tree's __init__.py)
    both = cli("check", str(empty), str(ROOT / "rewriter" / "__init__.py"))
    assert both.stderr.splitlines()[-1] == (
        "2 files without the fused op (no call of fused_minimax_m3_qknorm_rope_kv_insert found)."
    )


def test_a_file_without_the_op_reads_as_one_sentence() -> None:
    proc = cli("check", str(ROOT / "rewriter" / "__init__.py"))
    assert proc.stderr.splitlines()[-1] == (
        "1 file without the fused op (no call of fused_minimax_m3_qknorm_rope_kv_insert found)."
    )


# --- the diff: one spelling, two documented aliases -----------------------------------------


def test_preview_and_run_diff_are_documented_aliases_of_check_diff(tmp_path: Path) -> None:
    target = tmp_path / "model.py"
    target.write_bytes((FIXTURES / "fork_era" / "model.py").read_bytes())
    outs = {
        " ".join(args): cli(*args, str(target), env={"NO_COLOR": "1"})
        for args in (("check", "--diff"), ("preview",), ("run", "--diff"))
    }
    assert len({p.stdout for p in outs.values()}) == 1 and all(p.returncode == 1 for p in outs.values())
    assert target.read_bytes() == (FIXTURES / "fork_era" / "model.py").read_bytes()
    assert "Alias of `check --diff`" in cli("preview", "--help", env={"COLUMNS": "200"}).stdout
    assert "aliases: `preview`, `run --diff`" in cli("check", "--help", env={"COLUMNS": "200"}).stdout
    assert "as check --diff" in cli("run", "--help", env={"COLUMNS": "200"}).stdout
    readme = (ROOT / "README.md").read_text()
    assert "### `check --diff` — the diff, on stdout" in readme
    assert "`preview` and `run --diff` are aliases" in readme
