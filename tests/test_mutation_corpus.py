"""The mutation corpus: every before-state fixture, mutated as forks, formatters
and refactors do, must be rewritten correctly or refused - never written wrong.

Variants are generated here (tests/mutations.py), run through the library's
real ``run`` (lock, plan, validate, atomic write) and judged by
``judge.judge_rewrite`` against the rewrite of the unmutated fixture. The counts
(rewritten / refused / wrong, by mutation kind) are printed at the end of the
test session. Each variant is also read by the pre-filter, before and after `run`
(``test_prefilter.assert_agree``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import FIXTURES, syntax_tree
from judge import judge_rewrite
from mutations import RESULTS, Mutation, apply_all, catalogue, combinations, shape
from test_prefilter import assert_agree

from codemods.prefilter import prefilter
from rewriter import commands
from rewriter.apply import FileStatus
from rewriter.targets import Target

# before-state fixture -> (every n-th single mutation, number of seeded combinations).
# `reformatted` and `patch_fuzz` are close kin of `fork_era` (400 lines each, the
# slow part of the corpus): half of the single mutations there; the small
# `no_insert_kv` gets more combinations.
FIXTURES_MUTATED = {
    "fork_era": (1, 12),
    "reformatted": (2, 4),
    "no_insert_kv": (1, 76),
    "half_applied": (1, 4),
    "patch_fuzz": (2, 4),
    # the seed's older bypass, which `run` upgrades
    "seed_form": (4, 3),
}

# Refusals that are right, by (fixture, mutation label) -> what the refusal must say.
JUSTIFIED_REFUSALS = {
    # The cache arrives as a parameter of the helper: nothing proves it is
    # `self.kv_cache`, which the generated _insert_kv must write to.
    ("no_insert_kv", "call-only"): "is not a `self.` attribute (or a local proven to hold one",
    # Half-applied: the bypass's post-call insert stays in forward() while the
    # call moves away; completing it would leave that insert with its guard out
    # of scope (a NameError on every forward).
    ("half_applied", "call-only"): ("is called elsewhere than right after the insert call", "has a condition the bypass did not write"),
    ("half_applied", "rebind-aliases"): ("is called elsewhere than right after the insert call", "has a condition the bypass did not write"),
    # Half-applied: the existing post-call insert passes `main_slot_mapping`, the
    # call now `fwd_slot_mapping[self.layer_name]`; equal values, but not provably.
    ("half_applied", "slot-expressions"): "is not wired",
    # The same for the seed's complete bypass that `run` upgrades.
    ("seed_form", "slot-expressions"): "is not wired",
    # (or, seen from the helper, the guard arrives as a parameter: the caller's condition)
    ("seed_form", "call-only"): ("is called elsewhere than right after the insert call", "has a condition the bypass did not write"),
    ("seed_form", "rebind-aliases"): ("is called elsewhere than right after the insert call", "has a condition the bypass did not write"),
    # What the rewrite must prove and cannot, in any fixture ("*"):
    # a cache bound other than by one plain assignment on every path,
    **{("*", form): "is not a `self.` attribute (or a local proven to hold one" for form in (
        "unpacking", "for", "walrus", "parameter-default")},
    # a condition of the caller's (or, under the bypass's own guard, a conditional cache),
    ("*", "caller-flag"): ("has a condition the bypass did not write", "is not a `self.` attribute"),
    # the bypass's names already in use, the op under another name,
    # (a name the bypass would write, used for something else; or the file's own bypass piece,
    # then not proven to hold what a bypass's does)
    ("*", "flag-assigned"): ("names the bypass would write are used for something else", "the file's own fp8 bypass cannot be proven"),
    ("*", "insert-kv-attribute"): ("names the bypass would write are used for something else", "the file's own fp8 bypass cannot be proven"),
    ("*", "import-alias"): "the op is named without being called by that name",
    ("*", "local"): "the op is named without being called by that name",
    # and, with no norms to tell it, a head size two products of the q head count offer.
    ("no_insert_kv", "rope-product"): "cannot tell the head size",
}


@dataclass(frozen=True)
class Variant:
    fixture: str
    mutations: tuple[Mutation, ...]

    @property
    def id(self) -> str:
        return f"{self.fixture}:{'+'.join(m.label for m in self.mutations)}"

    def source(self) -> str:
        """Built when the test runs, not at collection (black is slow)."""
        return apply_all(ORIGINAL[self.fixture], list(self.mutations))


ORIGINAL = {f: (FIXTURES / f / "model.py").read_text() for f in FIXTURES_MUTATED}
REFERENCE = {f: (FIXTURES / f / "expected.py").read_text() for f in FIXTURES_MUTATED}


def build_corpus() -> list[Variant]:
    """Single mutations that change the fixture, and seeded combinations."""
    corpus = []
    for fixture, (stride, n_combos) in FIXTURES_MUTATED.items():
        found = shape(ORIGINAL[fixture])
        singles = catalogue(found)[::stride]
        chains = [[m] for m in singles] + combinations(found, n_combos, seed=len(fixture))
        corpus += [Variant(fixture, tuple(chain)) for chain in chains]
    return corpus


CORPUS = build_corpus()


def test_the_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 200
    assert len({v.id for v in CORPUS}) == len(CORPUS)
    kinds = {m.kind for v in CORPUS for m in v.mutations}
    assert kinds == {m.kind for f in ORIGINAL.values() for m in catalogue(shape(f))}


@pytest.mark.parametrize("variant", CORPUS, ids=lambda v: v.id)
def test_variant_is_rewritten_correctly_or_refused(variant: Variant, tmp_path) -> None:
    # The mutation itself must change the file and keep the program: it
    # compiles, and layout-only mutations leave the syntax tree as it was.
    source = variant.source()
    assert source != ORIGINAL[variant.fixture], "a no-op mutation"
    compile(source, variant.id, "exec", dont_inherit=True)
    if all(m.layout_only for m in variant.mutations):
        assert syntax_tree(source) == syntax_tree(ORIGINAL[variant.fixture])

    path = tmp_path / "model.py"
    path.write_bytes(source.encode())
    assert_agree(path)  # the pre-filter answers as LibCST does, or defers
    report = commands.write_targets("run", [Target(path, "corpus")])
    result = report.files[0]
    after = path.read_bytes().decode()
    assert_agree(path)
    if result.status is FileStatus.REWRITTEN:
        assert prefilter(path.read_bytes()) is None  # the bypass is LibCST's to read
        problems = judge_rewrite(source, after, REFERENCE[variant.fixture])
        outcome = "wrong" if problems else "rewritten"
    elif result.failed and report.exit_code == 2:
        problems = [] if after == source else ["refused, but the file changed"]
        outcome = "wrong" if problems else "refused"
    else:
        problems = [f"left as {result.status.value}: a needed rewrite was missed"]
        outcome = "wrong"
    reason = result.error or ""
    if result.status is FileStatus.REFUSED:
        reason = "; ".join(s.reason for s in result.sites if s.action.value == "refuse")
    RESULTS.append((variant.fixture, [m.kind for m in variant.mutations], outcome, reason))

    assert outcome != "wrong", problems
    if outcome == "refused":
        justified = [
            why
            for (fixture, label), whys in JUSTIFIED_REFUSALS.items()
            if fixture in (variant.fixture, "*") and label in {m.label for m in variant.mutations}
            for why in ((whys,) if isinstance(whys, str) else whys)
        ]
        assert justified and any(why in reason for why in justified), f"unjustified refusal: {reason}"
