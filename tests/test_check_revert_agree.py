"""``check`` and ``revert`` agree: whatever ``check`` calls patched, ``revert`` takes back, or
refuses for one stated reason that ``check``'s own report already gives - over every fixture
(before and after ``run``) and every generated spelling variant of what ``run`` wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES
from variants import FORMS, variants

from codemods.analysis import analyze
from codemods.schema import Action, SiteState

import libcst as cst

from rewriter.apply import plan_revert_file
from rewriter.commands import analyze_targets
from rewriter.targets import Target


def _sources() -> list[tuple[str, str]]:
    found = [
        (f"{d.name}/{name}", (d / name).read_text())
        for d in sorted(FIXTURES.iterdir())
        if d.is_dir()
        for name in ("model.py", "expected.py")
    ]
    for form in FORMS:
        expected = (FIXTURES / form / "expected.py").read_text()
        found += [(f"{form}:{r.name}", r(expected)) for r in variants((FIXTURES / form / "model.py").read_text())]
    return found


SOURCES = _sources()


def test_the_corpus_holds_patched_files_of_every_kind() -> None:
    patched = [name for name, source in SOURCES if any(s.state is SiteState.PATCHED for s in analyze(cst.parse_module(source)).sites)]
    assert len(patched) >= 90


@pytest.mark.parametrize("name, source", SOURCES, ids=[n for n, _ in SOURCES])
def test_revert_takes_back_what_check_calls_patched_or_check_says_why_not(
    name: str, source: str, tmp_path: Path
) -> None:
    """The commands as the user runs them: revert's refusals include the file-level one (taking
    the bypass out would not give back what `run` started from)."""
    path = tmp_path / "model.py"
    path.write_text(source)
    checked = {s.line: s for s in analyze_targets("check", [Target(path, "test")]).files[0].sites}
    for site in plan_revert_file(path).sites:
        if checked[site.line].state is not SiteState.PATCHED:
            continue
        assert site.action in (Action.REVERT, Action.REFUSE), site.reason
        if site.action is Action.REFUSE:
            why = site.reason.removeprefix("cannot revert: ")
            assert why in checked[site.line].reason, (why, checked[site.line].reason)
