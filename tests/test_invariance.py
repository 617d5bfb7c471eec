"""Finding by structure: the same file reformatted gives the same rewrite.

"The same" is judged as the same syntax tree (``ast.dump``, docstrings
compared without their surrounding whitespace, which black may move) and the
same comments in the same order, so black's layout choices (parentheses, line
breaks) do not count, but every statement, name, slice and comment does.
"""

from __future__ import annotations

import io
import tokenize

import black
import libcst as cst
import pytest
from conftest import FIXTURES, syntax_tree

from codemods.analysis import analyze, rewrite
from codemods.schema import SiteState


def fmt(source: str, line_length: int) -> str:
    return black.format_str(source, mode=black.Mode(line_length=line_length))


def comments(source: str) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t.string for t in tokens if t.type == tokenize.COMMENT]


@pytest.mark.parametrize("variant", ["fork_era", "no_insert_kv", "half_applied", "patch_fuzz"])
@pytest.mark.parametrize("line_length", [40, 60, 79, 100, 140])
def test_reformatted_input_gives_the_same_rewrite(variant: str, line_length: int) -> None:
    source = (FIXTURES / variant / "model.py").read_text()
    expected = (FIXTURES / variant / "expected.py").read_text()
    reformatted = fmt(source, line_length)
    assert reformatted != source
    out = rewrite(analyze(cst.parse_module(reformatted))).code
    states = [s.state for s in analyze(cst.parse_module(out)).sites if s.state is not SiteState.NOT_A_SITE]
    assert states == [SiteState.PATCHED]
    assert syntax_tree(out) == syntax_tree(expected)
    assert comments(out) == comments(expected)
