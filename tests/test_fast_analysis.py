"""The LibCST analysis' short cuts change no answer.

The codemod numbers lines with Python's own parser instead of LibCST's
PositionProvider, skips statements that cannot hold a call, walks dataclass
fields instead of ``node.children``, and counts names only where they can be.
Each short cut is compared here with the slow way it replaces.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import black
import libcst as cst
import pytest
from conftest import FIXTURES, ROOT
from test_prefilter import NATIVE_LAYOUTS, PATCHED_LAYOUTS, wheel_files  # noqa: F401 (fixture)

from codemods import anchors as a
from codemods.analysis import analyze
from codemods.model import pass_through_wrappers
from codemods.sites import find_calls
from codemods.sourcemap import SourceMap

CORPUS = sorted({p.resolve() for p in FIXTURES.glob("*/*.py")})


def sources() -> dict[str, Callable[[], bytes]]:
    """Each file by name; made when its test runs (black at line length 40 takes a second
    or two per file: not at collection, in every worker)."""
    out: dict[str, Callable[[], bytes]] = {str(p.relative_to(ROOT)): p.read_bytes for p in CORPUS}

    def reformatted(variant: str) -> bytes:
        text = (FIXTURES / variant / "model.py").read_text()
        return black.format_str(text, mode=black.Mode(line_length=40)).encode()

    def changed(variant: str, change: Callable[[str], str]) -> bytes:
        return change((FIXTURES / variant / "model.py").read_text()).encode()

    for variant in ("patched", "fork_era", "native"):
        out[f"{variant} black-40"] = partial(reformatted, variant)
    for name, change in PATCHED_LAYOUTS.items():
        out[f"patched {name}"] = partial(changed, "patched", change)
    for name, change in NATIVE_LAYOUTS.items():
        if name != "latin1-cookie":
            out[f"native {name}"] = partial(changed, "native", change)
    return out


def found(module: cst.Module, source_map: SourceMap | None) -> list[tuple[int, int]]:
    wrappers = pass_through_wrappers(module)
    return [(id(f.call), f.line) for f in find_calls(module, source_map, wrappers).found]


SOURCES = sources()


@pytest.mark.parametrize("name", SOURCES)
def test_calls_and_lines_as_position_provider_gives_them(name: str) -> None:
    body = SOURCES[name]().removeprefix(b"\xef\xbb\xbf")
    module = cst.parse_module(body)
    source_map = SourceMap.of(module, body)
    assert source_map is not None  # the short cut is taken
    assert found(module, source_map) == found(module, None)


def test_real_files_too(wheel_files: list[Path]) -> None:  # noqa: F811
    for path in wheel_files:
        module = cst.parse_module(path.read_bytes())
        source_map = SourceMap.of(module, path.read_bytes())
        assert source_map is not None
        assert found(module, source_map) == found(module, None)


def test_a_wrong_statement_map_falls_back() -> None:
    """If the statements are mapped to the wrong lines, LibCST's own visit and positions decide."""
    source = (FIXTURES / "fork_era" / "model.py").read_bytes()
    module = cst.parse_module(source)
    good = found(module, None)
    source_map = SourceMap.of(module, source)
    assert source_map is not None
    source_map.spans = {
        k: (stmt, first + 10_000, last + 10_000) for k, (stmt, first, last) in source_map.spans.items()
    }
    assert found(module, source_map) == good


def test_loads_where_ast_has_no_try_star() -> None:
    """pyproject says Python 3.10, whose ``ast`` has no ``TryStar``: the map must still load and map."""
    code = (
        "import ast, sys; del ast.TryStar; import libcst as cst; from codemods.sourcemap import SourceMap; "
        "src = open(sys.argv[1], 'rb').read(); print(SourceMap.of(cst.parse_module(src), src) is not None)"
    )
    model = FIXTURES / "fork_era" / "model.py"
    done = subprocess.run([sys.executable, "-c", code, str(model)], cwd=ROOT, capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quick_walks_see_the_same_nodes(path: Path) -> None:
    module = cst.parse_module(path.read_bytes())
    assert {id(n) for n in a.nodes_in(module)} == {id(n) for n in a.walk_all(module)}
    for func in (n for n in a.walk_all(module) if isinstance(n, cst.FunctionDef)):
        assert {id(n) for n in a.nodes_in(func.body, scope_only=True)} - {id(func.body)} == {
            id(n) for n in a.walk_scope(func.body)
        }

    def is_call(node: cst.CSTNode) -> bool:
        return isinstance(node, cst.Call)

    for stmt in module.body:
        assert a.first_in(stmt, is_call) is next((n for n in a.walk_all(stmt) if is_call(n)), None)


@pytest.mark.parametrize("variant", ["fork_era", "half_applied", "patch_fuzz", "reformatted"])
def test_names_counted_where_they_can_be(variant: str) -> None:
    """The rewrite's name count, with statements skipped, matches a full count."""
    source = (FIXTURES / variant / "model.py").read_bytes()
    module = cst.parse_module(source)
    analysis = analyze(module, source)
    assert analysis.source_map is not None
    words = analysis.source_map.from_imported()
    silent = [
        stmt
        for stmt, _, _ in analysis.source_map.spans.values()
        if not any(w.encode() in (analysis.source_map.text(stmt) or b"") for w in words)
    ]
    assert silent  # something is skipped
    full = a.name_uses(module)
    quick = a.name_uses(module, skip=silent)
    assert {w: quick.get(w, 0) for w in words} == {w: full.get(w, 0) for w in words}


@pytest.mark.parametrize("name", ["patched", "native_stale_bypass"])
def test_revert_plans_each_site_once(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``analyze_revert`` asks ``classify`` (which plans a patched site's revert, to say what `revert` would) and
    takes that plan: it planned every site twice, collecting its pieces again."""
    from codemods import analysis

    calls: list[object] = []
    real = analysis.plan_site
    monkeypatch.setattr(analysis, "plan_site", lambda *args: calls.append(args[1]) or real(*args))
    path = next(p for p in CORPUS if p.parent.name == name and p.name == "model.py")
    result = analysis.analyze_revert(cst.parse_module(path.read_text()))
    assert any(s.action.value == "revert" for s in result.sites) and result.plans
    assert calls and len(calls) == len({id(c) for c in calls}), len(calls)
