"""The entry points: ``analyze`` classifies every call of the fused op and plans the change of
the one that needs it (a ``BypassPlan``, or a ``RevertPlan`` stripping a native call's bypass);
``analyze_revert`` plans taking the bypass out; ``rewrite`` applies either analysis's plans."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import libcst as cst

from codemods import anchors as a
from codemods import schema
from codemods.fp8_kv_bypass import BypassPlan, apply_plan, plan_bypass
from codemods.fp8_kv_revert import RevertPlan, apply_revert, plan_site, revert_reason
from codemods.schema import CHANGING, Action, InsertSite, SiteState, Unsupported
from codemods.model import FileModel
from codemods.sites import FoundCall, FoundPieces, call_facts, collect_pieces, find_calls
from codemods.sourcemap import SourceMap


@dataclass
class FileAnalysis:
    """Each site with its action, and the plans of the changes (``revert``'s too: RevertPlans)."""

    module: cst.Module
    sites: list[InsertSite]
    plans: list[BypassPlan | RevertPlan]  # a RevertPlan strips a bypass from a native call
    source_map: SourceMap | None = None

    @property
    def patched_after(self) -> int:
        """How many sites the rewrite leaves ``patched`` (a stripped one ends ``native``)."""
        return sum(1 for p in self.plans if isinstance(p, BypassPlan))

    @property
    def needs_rewrite(self) -> bool:
        return bool(self.plans)  # a site left to change always has its plan

    @property
    def refused(self) -> list[InsertSite]:
        return [s for s in self.sites if s.action is Action.REFUSE]


def analyze(module: cst.Module, source: str | bytes | None = None) -> FileAnalysis:
    """Classify every call of the fused op in ``module`` (and plan what needs work);
    ``source``: the text it was parsed from, where the caller has it (else generated again)."""
    m = FileModel.of(module, source)
    finder = find_calls(module, m.source_map, m.wrappers)
    classified = [classify(m, f) for f in finder.found]
    strays = [_stray_site(stmt, m.source_map) for _, stmt in finder.strays()]
    sites = schema.one_candidate([site for site, _, _ in classified] + strays)
    plans = [plan for (_, plan, _), site in zip(classified, sites) if plan is not None and site.action in CHANGING]
    return FileAnalysis(module, sites, plans, m.source_map)


def _stray_site(stmt: cst.CSTNode | None, source_map: SourceMap | None) -> InsertSite:
    """The op named where its calls cannot be followed: the file cannot be called safe."""
    assert stmt is not None  # a name sits in a statement, which the finder visits first
    span = source_map.span(stmt) if source_map is not None else None
    # the statement itself (not the comments above it; a block's header line)
    text = a.code(stmt.with_changes(leading_lines=[]))
    shown = " ".join((text if isinstance(stmt, cst.SimpleStatementLine) else text.splitlines()[0]).split())
    shown = shown if len(shown) <= 100 else shown[:97] + "..."
    reason = (
        f"the op is named without being called by that name (`{shown}`): calls through an "
        f"import alias, a local or getattr cannot be followed, so whether this file needs the bypass "
        f"cannot be told. Call it as `ops.{schema.FUSED_OP}(…)` (or import it without `as`), then run again"
    )
    return InsertSite(None, "<module>", span[0] if span else 0, SiteState.UNSUPPORTED, Action.REFUSE, reason)


def classify(
    m: FileModel, found: FoundCall
) -> tuple[InsertSite, BypassPlan | RevertPlan | None, Callable[[], RevertPlan | None]]:
    """One call's site, asked of the file's model ``m``, the plan of its change, and ``revert``: the
    plan of taking its bypass out (``plan_site``), planned once, on the pieces the verdict found."""
    facts, slot = call_facts(found, m)
    found_pieces: list[FoundPieces] = []
    reverted: list[RevertPlan | Unsupported | None] = []

    def collect() -> FoundPieces:
        assert found.cls is not None and found.method is not None
        found_pieces.append(collect_pieces(m, found.cls, found.method, found.op, slot))
        return found_pieces[-1]

    def revert() -> RevertPlan | None:
        if not reverted:
            try:
                reverted.append(plan_site(m, found, found_pieces[-1] if found_pieces else None))
            except Unsupported as exc:
                reverted.append(exc)
        if isinstance(reverted[0], Unsupported):
            raise reverted[0]
        return reverted[0]

    decided = schema.verdict(facts, collect)
    plan: BypassPlan | RevertPlan | None = None
    failure = None
    try:
        if decided.state is SiteState.PATCHED:  # what `revert` would say of it, said here too
            revert()
        elif decided.action is Action.STRIP:  # the strip is the revert of that one site
            plan = revert()
            if plan is None:
                raise Unsupported("no bypass piece could be delimited")
        elif decided.action in CHANGING:
            assert slot is not None
            plan = plan_bypass(m, found, slot, found_pieces[-1])
    except Unsupported as exc:
        failure = str(exc)
    if decided.state is SiteState.PATCHED and failure is not None:
        return replace(decided, reason=f"{decided.reason}; `revert` cannot take it out: {failure}"), None, revert
    return schema.planned(decided, failure, found_pieces[-1] if found_pieces else None), plan, revert


def rewrite(analysis: FileAnalysis) -> cst.Module:
    module = analysis.module
    assert len(analysis.plans) <= 1, "the analyses refuse files with several sites to change"
    for plan in analysis.plans:
        if isinstance(plan, BypassPlan):
            module = apply_plan(module, plan, analysis.source_map)
        else:
            module = apply_revert(module, plan)
    return module


def analyze_revert(module: cst.Module) -> FileAnalysis:
    """Find every call of the fused op; plan the removal of a bypass around it."""
    m = FileModel.of(module)
    finder = find_calls(module, m.source_map, m.wrappers)
    sites: list[InsertSite] = []
    plans: list[RevertPlan | None] = []
    for found in finder.found:
        site, _, revert = classify(m, found)
        plan = failure = None
        try:
            plan = revert()
        except Unsupported as exc:
            failure = str(exc)
        sites.append(schema.reverted(site, revert_reason(plan) if plan else None, failure))
        plans.append(plan)
    sites = schema.one_revert(sites)
    kept = [plan for plan, site in zip(plans, sites) if plan is not None and site.action is Action.REVERT]
    # the op named where its calls cannot be followed: which bypass is whose cannot be told, as check says
    strays = [_stray_site(stmt, m.source_map) for _, stmt in finder.strays()]
    return FileAnalysis(module, sites + [replace(s, reason=f"cannot revert: {s.reason}") for s in strays], kept)
