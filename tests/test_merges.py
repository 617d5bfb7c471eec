"""Merges: upstream's native file over a fork's fp8 bypass, keeping some of the fork's pieces
under the fork's names and taking upstream's others (the call, the guard, the post-call
block, the write method, the flag). Each goes through the whole command (``plan_file``,
the ast pre-filter included) and, where the verdict says the file runs as it is
(``native``, ``patched``), through ``verify``'s semantic level: no verdict may call a file
safe that the semantic level fails. The counts are printed with the spelling variants'.
"""

from __future__ import annotations

import itertools
import json

import pytest
from conftest import FIXTURES, cli
from variants import RESULTS

from rewriter.apply import plan_file

BASE = (FIXTURES / "native_stale_bypass" / "model.py").read_text()
SAFE = {"native", "patched", "not-a-site"}


def _upstream_call(source: str) -> str:
    """Upstream's call: the cache arguments unconditional."""
    return source.replace(" if insert_via_fused else None", "")


def _upstream_guard(source: str) -> str:
    """Upstream has no guard; the fork's post-call block now tests the flag itself."""
    source = source.replace("        insert_via_fused = not self._fp8_kv\n", "")
    return source.replace("if not insert_via_fused:", "if self._fp8_kv:")


def _upstream_flag(source: str) -> str:
    """Upstream's __init__: the fork's flag is gone."""
    return source.replace('        self._fp8_kv = "fp8" in self.kv_cache_dtype\n', "")


def _upstream_method(source: str) -> str:
    """Upstream's class: the fork's write method is gone (its call kept)."""
    start = source.index("    def _insert_kv(")
    return source[:start].rstrip() + "\n"


def _fork_names(source: str) -> str:
    for old, new in (("_fp8_kv", "_kv_fp8"), ("_insert_kv", "_write_kv_fp8"), ("insert_via_fused", "fused_ok")):
        source = source.replace(old, new)
    return source


TAKEN = {
    "call": _upstream_call,
    "guard": _upstream_guard,
    "flag": _upstream_flag,
    "method": _upstream_method,
}
CASES = [
    (taken, names)
    for n in range(1, len(TAKEN) + 1)
    for taken in itertools.combinations(TAKEN, n)
    if not ("guard" in taken and "call" not in taken)  # a guard gone from a guarded call is a NameError the fixtures cover
    for names in ("tool", "fork")
]


def _merge(taken: tuple[str, ...], names: str) -> str:
    source = BASE
    for piece in taken:
        source = TAKEN[piece](source)
    return _fork_names(source) if names == "fork" else source


@pytest.mark.parametrize("taken, names", CASES, ids=[f"{'+'.join(t)}:{n}" for t, n in CASES])
def test_no_verdict_calls_a_merge_safe_that_the_semantic_level_fails(tmp_path, taken, names) -> None:
    source = _merge(taken, names)
    assert source != BASE
    path = tmp_path / "model.py"
    path.write_text(source)
    (site,) = [s for s in plan_file(path).sites if s.state.value != "not-a-site"]
    verdict = f"{site.state.value} -> {site.action.value}"
    outcome = "refused" if site.action.value == "refuse" else "right"
    if site.state.value in SAFE:
        proc = cli("verify", "--json", "--tp", "1", str(path))
        levels = {lv["level"]: lv["status"] for f in json.loads(proc.stdout)["files"] for lv in f["levels"]}
        outcome = "right" if levels.get("semantic") == "passed" else "wrong"
        assert outcome == "right", f"{verdict}, but the semantic level: {proc.stdout}"
    RESULTS.append(("merge " + names, ["merge:" + "+".join(taken)], outcome, site.reason))
    # the same answer under the fork's names as under the tool's
    twin = tmp_path / "twin.py"
    twin.write_text(_merge(taken, "tool" if names == "fork" else "fork"))
    (other,) = [s for s in plan_file(twin).sites if s.state.value != "not-a-site"]
    assert f"{other.state.value} -> {other.action.value}" == verdict, (site.reason, other.reason)


def test_the_issue_merge_is_not_called_native(tmp_path) -> None:
    """vLLM's native call, the fork's stale post-call write kept under the fork's names: the
    old answer was `native`, and a padded token wrote the last index slot."""
    source = _merge(("call", "guard"), "fork")
    assert "self._write_kv_fp8(" in source and " if fused_ok else None" not in source
    path = tmp_path / "model.py"
    path.write_text(source)
    (site,) = [s for s in plan_file(path).sites if s.state.value != "not-a-site"]
    assert site.state.value == "half-applied", site.reason
    assert site.write_method == "_write_kv_fp8"


@pytest.mark.parametrize("taken", [("method",), ("flag", "method"), ("call", "guard", "method")])
def test_a_post_call_write_whose_method_the_merge_took_away_is_still_read_by_position(tmp_path, taken) -> None:
    """Upstream's side taken for the write method (gone): the post-call block still hands the call's
    slot mappings by position, so the stale bypass is read and taken out. Binding the write call to
    the method's parameters (for keywords) refused these merges when there was no method to bind to."""
    path = tmp_path / "model.py"
    path.write_text(_merge(taken, "tool"))
    (site,) = [s for s in plan_file(path).sites if s.state.value != "not-a-site"]
    assert site.action.value != "refuse", site.reason
