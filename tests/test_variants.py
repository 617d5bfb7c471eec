"""Forks it has never seen: every bypass piece re-spelled (tests/variants.py), on the
compile-aware fixtures and the seed's own form, must be recognised by its role.

A re-spelling changes how a piece is written, never what the program does, so the
rewrite of the re-spelled model must be the re-spelled ``expected.py``, in the same
state, with its own names kept; the result passes the semantic level (both branches
where the file compiles). Programs that only look alike - a flag false for
"fp8_e4m3", a post-call block under the wrong condition - are refused, naming the
role. No refusal's advice may delete a block that writes the cache. The counts are
printed at the end of the session (right / refused / wrong / harmful advice).
"""

from __future__ import annotations

import pytest
from conftest import FIXTURES, cli
from variants import FORMS, RESPELLINGS, RESULTS, variants

from codemods.analysis import analyze, rewrite
from codemods.schema import CHANGING, SiteState
from rewriter.apply import plan_file

import libcst as cst

CASES = [
    (form, r.name)
    for form in FORMS
    for r in variants((FIXTURES / form / "model.py").read_text())
]
BY_NAME = {r.name: r for r in RESPELLINGS}


def _site(source: str):  # type: ignore[no-untyped-def]
    analysis = analyze(cst.parse_module(source), source)
    (site,) = [s for s in analysis.sites if s.state is not SiteState.NOT_A_SITE]
    return analysis, site


def _through_the_command(tmp_path, source: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "through_the_command.py"
    path.write_text(source)
    return plan_file(path)


def _harmful(reason: str) -> bool:
    """Advice to delete code, where the file's post-call block holds the compiled path's write."""
    return "delete" in reason.lower()


def test_the_generator_covers_every_piece_on_every_form() -> None:
    pieces = {BY_NAME[name].piece for _, name in CASES}
    assert pieces == {"flag", "guard", "post-call", "write", "helper", "compile", "dtype"}
    assert {form for form, _ in CASES} == set(FORMS)
    assert len(CASES) >= 50


@pytest.mark.parametrize("form, respelling", CASES, ids=[f"{f}:{r}" for f, r in CASES])
def test_a_respelled_bypass_is_rewritten_as_respelled(tmp_path, form: str, respelling: str) -> None:
    r = BY_NAME[respelling]
    model = r((FIXTURES / form / "model.py").read_text())
    expected = r((FIXTURES / form / "expected.py").read_text())
    assert model != (FIXTURES / form / "model.py").read_text()
    analysis, site = _site(model)
    outcome = "right"
    if site.action.value == "refuse":
        outcome = "harmful advice" if _harmful(site.reason) else "refused"
    elif site.action not in CHANGING or rewrite(analysis).code != expected:
        outcome = "wrong"
    RESULTS.append((form, [respelling], outcome, site.reason))
    assert f"{site.state.value} -> {site.action.value}" == FORMS[form], site.reason
    new = rewrite(analysis).code
    assert new == expected
    # the whole command (`plan_file`: the ast pre-filter, the parse, the validation) agrees
    whole = _through_the_command(tmp_path, model)
    (planned,) = [s for s in whole.sites if s.state is not SiteState.NOT_A_SITE]
    assert (planned.state, planned.action) == (site.state, site.action)
    assert whole.new is not None and whole.new.decode() == expected
    _, again = _site(new)
    assert again.state in (SiteState.PATCHED, SiteState.NATIVE), again.reason
    # the rewritten variant runs: the semantic level, eager and (where it compiles) compiled
    path = tmp_path / "model.py"
    path.write_text(new)
    proc = cli("verify", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '"semantic"' in proc.stdout and '"passed"' in proc.stdout


# Programs that differ from a bypass in what they do, not only in spelling: refused,
# naming the role that could not be proven, and never with advice to delete code.
NOT_THE_SAME = [
    # true for "fp8" only, false for "fp8_e4m3": not the flag of an fp8 cache
    ("compiled_native", ('"fp8" in self.kv_cache_dtype', 'self.kv_cache_dtype == "fp8"'), "cannot be proven true"),
    ("seed_form", ('"fp8" in self.kv_cache_dtype', 'self.kv_cache_dtype.endswith("e4m3")'), "cannot be proven true"),
    # the post-call block runs where the fused op did write: not the block that writes instead
    ("seed_form", ("        if not insert_via_fused:", "        if insert_via_fused:"), "is not wired"),
    # (on a native call: not a bypass `run` can keep, and its block holds the compiled path's
    # write, which taking the bypass out would lose)
    (
        "compiled_native",
        ("if torch.compiler.is_compiling() or not insert_via_fused:", "if torch.compiler.is_compiling() and not insert_via_fused:"),
        "the bypass is torch.compile's cache write",
    ),
    # a guard that lets the fused op write an fp8 cache: the caller's condition, not a bypass's
    ("seed_form", ("insert_via_fused = not self._fp8_kv", "insert_via_fused = self._fp8_kv or True"), "condition the bypass did not write"),
]


@pytest.mark.parametrize("form, edit, why", NOT_THE_SAME, ids=[f"{f}:{e[1][:30]}" for f, e, _ in NOT_THE_SAME])
def test_a_different_program_is_refused_naming_the_role(tmp_path, form: str, edit: tuple[str, str], why: str) -> None:
    source = (FIXTURES / form / "model.py").read_text()
    assert source.count(edit[0]) == 1
    _, site = _site(source.replace(*edit))
    planned = [s for s in _through_the_command(tmp_path, source.replace(*edit)).sites if s.state is not SiteState.NOT_A_SITE]
    assert [s.reason for s in planned] == [site.reason]
    outcome = "harmful advice" if _harmful(site.reason) else "refused" if site.action.value == "refuse" else "wrong"
    RESULTS.append((form, ["different:" + edit[1][:40]], outcome, site.reason))
    assert site.action.value == "refuse", site.reason
    assert why in site.reason
    assert not _harmful(site.reason)


def test_every_refusals_hand_edit_applied_as_written_leaves_a_file_run_and_verify_pass(tmp_path) -> None:
    """A refusal's by-hand text is derived from the roles it proved: where it names an edit
    (the flag written as a flag of the fp8 dtypes), that edit, applied as written, gives a
    file `run` rewrites and `verify` passes; elsewhere it says what it cannot prove and
    advises no deletion."""
    import re

    applied = 0
    for form, (old, new), _ in NOT_THE_SAME:
        source = (FIXTURES / form / "model.py").read_text().replace(old, new)
        _, site = _site(source)
        assert not _harmful(site.reason)
        edit = re.search(r"set in __init__ to `(.+?)`, which cannot be proven.*write it as `(.+?)`", site.reason)
        if edit is None:
            continue
        fixed = source.replace(f"= {edit.group(1)}\n", f"= {edit.group(2)}\n")
        assert fixed != source
        path = tmp_path / f"{form}_{applied}.py"
        path.write_text(fixed)
        assert cli("run", str(path)).returncode == 0
        proc = cli("verify", "--json", str(path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        applied += 1
    assert applied == 2  # the two flags false for an fp8 dtype
