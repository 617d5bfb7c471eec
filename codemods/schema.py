"""The decision, by rules applied in order: ``verdict`` (from the facts found at a call), ``planned``,
``one_candidate`` and, for ``revert``, ``reverted`` and ``one_revert``. It imports nothing heavy: ``check``
on a native file (read by ``prefilter`` with ``ast``) must not pay for importing LibCST."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

FUSED_OP = "fused_minimax_m3_qknorm_rope_kv_insert"
RESHAPE_OP = "reshape_and_cache_flash"
DTYPE_ATTR = "kv_cache_dtype"  # `self.kv_cache_dtype`: the main cache's dtype, what vLLM's backends read
AUTO_DTYPE = "auto"  # kv_cache_dtype="auto" with a cache: neither fork-era nor native
METADATA_ATTR = "attn_metadata"  # what the fork-era `_insert_kv` reads its slot mappings from


@dataclass(frozen=True)
class OpParam:
    index: int
    keyword: str


# The fork-era 19-argument schema of the fused op, then the kv-cache dtype that native
# builds pass (vllm._custom_ops, vLLM 0.24 - 0.34).
QKV = OpParam(0, "qkv")
NUM_HEADS = OpParam(5, "num_heads")
NUM_KV_HEADS = OpParam(6, "num_kv_heads")
NUM_INDEX_HEADS = OpParam(11, "num_index_heads")
SLOT_MAPPING = OpParam(12, "slot_mapping")
INDEX_SLOT_MAPPING = OpParam(13, "index_slot_mapping")
KV_CACHE = OpParam(14, "kv_cache")
INDEX_CACHE = OpParam(15, "index_cache")
CACHE_ARGS = (KV_CACHE, INDEX_CACHE)
KV_CACHE_DTYPE = OpParam(19, "kv_cache_dtype")
# Every parameter, in order: a pass-through wrapper may hand any of them on.
OP_PARAMS = tuple(
    OpParam(i, name)
    for i, name in enumerate(
        "qkv q_norm_weight k_norm_weight cos_sin_cache positions num_heads num_kv_heads rotary_dim eps "
        "index_q_norm_weight index_k_norm_weight num_index_heads slot_mapping index_slot_mapping "
        "kv_cache index_cache block_size q_out index_q_out kv_cache_dtype".split()
    )
)

T = TypeVar("T")


def bind_arg(param: OpParam, positional: Sequence[T], keywords: Sequence[tuple[str, T]]) -> T | None:
    """The argument bound to ``param``: by position if there are enough, else by keyword."""
    if param.index < len(positional):
        return positional[param.index]
    return next((arg for keyword, arg in keywords if keyword == param.keyword), None)


class Unsupported(Exception):
    """The change cannot be proven safe; the message says what was missing."""


class SiteState(str, enum.Enum):
    NEEDS_BYPASS = "needs-bypass"
    PATCHED = "patched"
    OUTDATED = "outdated"  # a complete bypass in an older form (the raw index scatter)
    HALF_APPLIED = "half-applied"
    NATIVE = "native"
    NOT_A_SITE = "not-a-site"
    UNSUPPORTED = "unsupported"


class Action(str, enum.Enum):
    REWRITE = "rewrite"  # needs-bypass: add the whole bypass
    COMPLETE = "complete"  # half-applied on a fork-era call: add what is missing
    UPGRADE = "upgrade"  # outdated: replace the raw index scatter with the current write
    STRIP = "strip"  # a bypass around a native call: take it out (the kernel writes fp8 itself)
    NONE = "none"
    REFUSE = "refuse"
    REVERT = "revert"  # `revert`: take a bypass out again


NEITHER = "neither a fork-era nor a native call"

# The actions that change the file.
CHANGING = (Action.REWRITE, Action.COMPLETE, Action.UPGRADE, Action.STRIP)


@dataclass
class InsertSite:
    """One call of the fused op, what state it is in and what `run` does with it."""

    class_name: str | None
    method: str | None
    line: int
    state: SiteState
    action: Action
    reason: str
    pieces: dict[str, bool] = field(default_factory=dict)
    write_method: str = ""  # the method the bypass writes the cache with (the fork's name for it)

    def to_json(self) -> dict[str, object]:
        fields = asdict(self)  # in their order, ``pieces`` copied
        state, action = self.state.value, self.action.value
        return {"class": fields.pop("class_name"), **fields, "state": state, "action": action}


@dataclass
class CallFacts:
    """Where a call of the fused op sits and what it passes (no bypass pieces yet)."""

    line: int
    class_name: str | None  # innermost enclosing class
    method: str | None  # the class's method holding the call; None: in the class body
    module_function: str | None  # outside any class: the outer function or "<module>"
    nested_in: str | None  # a def/lambda between the method and the call
    star_args: bool
    has_cache: bool  # a main K/V cache argument that is not None
    dtype: str | None  # source of the kv-cache dtype argument; None when not passed
    dtype_is_auto: bool  # it is the string literal "auto"
    dtype_proven: bool  # it holds the cache dtype, for every dtype (``roles.carries_dtype``)
    in_block: bool  # the call is a statement of its own in a block of the method
    is_async: bool = False  # the method holding the call is an `async def`
    in_wrapper: bool = False  # outside a class: in a pass-through wrapper (the layer's call of it is the site)
    cache_unproven: str | None = None  # a native call's cache argument that is no `self.` attribute
    broken: str | None = None  # why the layer as vLLM runs it does not run the call with an fp8 cache (``runtime.broken``)


@dataclass
class Pieces:
    """The bypass pieces found around one call."""

    flag_set: bool = False  # `self._fp8_kv = ...` in __init__
    flag_read: bool = False  # `self._fp8_kv` anywhere in the class (moot once set)
    scale_set: bool = False  # `self._fp8_kv_scale = ...` in __init__
    scale_read: bool = False  # `self._fp8_kv_scale` read in the class
    guard_args: list[str] = field(default_factory=list)  # guard names in the cache args
    guard_assigned: str | None = None  # `G = not self._fp8_kv` before the call
    guard_lost: bool = False  # the cache arguments read a local G that nothing binds (NameError)
    guard_other: bool = False  # G assigned some other way
    post_insert: bool = False  # `self._insert_kv(...)` after the call
    post_insert_wired: bool = False
    insert_kv: str = "absent"  # absent | metadata | slots | scatter | other
    user_conditions: list[str] = field(default_factory=list)  # `X if C else None`, C the caller's own
    taken: list[str] = field(default_factory=list)  # the bypass's names used by the file for something else
    # the post-call block also runs while compiling, when the call's slot mappings are None: its
    # compiled branch is the only cache write under torch.compile (a torch.compile-aware fork)
    compiled_write: bool = False
    # the post-call block holds a compiled-path write, wired or not, and the call's slot mappings
    # are None somewhere: the compiled path may need that write, so it is never taken out
    compiled_branch: bool = False
    subclassed: str | None = None  # a class of the file derives from this one and redefines a piece (in words)
    own_write: str | None = None  # a cache write the call's method reaches besides a bypass's (``guards.own_writes``)
    slots_none: bool = False  # a slot mapping the call passes is set to None somewhere (while compiling, say)
    # The roles' names in this file (``roles``): the flag the guard reads, the method the post-call block
    # hands the write to; codegen's names where the file has none (sites.FoundPieces).
    flag_attr: str = ""
    insert_method: str = ""
    guard_inline: str | None = None  # the cache arguments' condition, where no local holds it
    flag_unproven: str | None = None  # what the guard's flag is set to, where that is no fp8 flag
    flag_from_file: bool = False  # the flag is the file's (read by its guard, or the one set from the dtype)
    insert_from_file: bool = False  # the write method is the one the file's post-call block calls
    # the file's own pieces used otherwise than a bypass does (what they hold at the call is not proven)
    role_problems: list[str] = field(default_factory=list)
    # a flag is needed and `self.kv_cache_dtype` is not proven to hold the cache dtype after __init__
    dtype_unread: bool = False

    def present(self, native: bool = False) -> dict[str, bool]:
        """Which pieces are there; on a native call the flag is a piece only where it is read
        (the guard `not torch.compiler.is_compiling()` lets the kernel write fp8 in eager)."""
        flag_needed = not native or self.flag_read or self.flag_set
        return {
            "flag": (self.flag_set or not flag_needed) and (self.scale_set or not self.scale_read),
            "guard": self.guard_assigned is not None or self.guard_inline is not None,
            "guarded-args": len(self.guard_args) == 2 or self.guard_inline is not None,
            "post-insert": self.post_insert and self.post_insert_wired,
            "insert-kv": self.insert_kv in SLOTS_FORMS,
        }

    def any_bypass(self, native: bool = False) -> bool:
        """A piece of a bypass is there. On a native call, only a piece that acts: a flag, the
        guard, the post-call write (a write method nothing calls, or a scale, does nothing)."""
        acts = self.flag_set or bool(self.guard_args) or self.guard_inline is not None or self.post_insert
        inert = self.flag_read or self.guard_assigned is not None or self.insert_kv in SLOTS_FORMS
        return acts or (not native and (inert or self.scale_set or self.scale_read))


# `_insert_kv` taking the slot mappings: the current form, and the older ones `run` upgrades (what is wrong).
SLOTS_FORMS = ("slots", "scatter", "bf16-index")
OLDER_FORMS = {
    "scatter": "its index-key write `idx_cache[<slots>] = ...` sends padded tokens (slot -1, CUDA-graph "
    "padding) to the last index slot, corrupting whichever sequence owns it",
    "bf16-index": "its index-key write asserts a bf16 index cache (this tool's own earlier output): with an "
    "fp8 index cache (--attention-config '{\"indexer_kv_dtype\": \"fp8\"}') every forward raises",
}


# what wires a post-call write (``sites.collect_pieces``), said where one is not
WIRED = (
    "it must be the statement right after the call (before attention or anything else reads the caches), "
    "run exactly where the fused op did not write (`if not <guard>:`) with nothing leaving the block before "
    "the write, and be handed the call's own slot mappings"
)


def insert_kv_form(reads_metadata: bool, params_after_self: int, raw_scatter: bool, bf16_index: bool) -> str:
    """Which `_insert_kv` the class has ("absent": none, said by the caller): the fork-era ``(self, key,
    value, index_key)`` reading attn_metadata, the bypass's with the two slot mappings after those (current,
    raw scatter or bf16 index write: ``anchors.raw_scatters``, ``bf16_index_writes``), or other."""
    if reads_metadata and params_after_self == 3:
        return "metadata"
    if not reads_metadata and params_after_self == 5:
        return "scatter" if raw_scatter else "bf16-index" if bf16_index else "slots"
    return "other"


def verdict(f: CallFacts, pieces: Callable[[], Pieces]) -> InsertSite:
    """The site of one call, in its state. ``pieces`` is asked only for a call in a method.
    A changing verdict still needs a plan (``planned``)."""
    p: Pieces | None = None
    present: dict[str, bool] = {}  # the pieces shown, once asked for

    def site(state: SiteState, action: Action, reason: str) -> InsertSite:
        method = f.method if f.class_name is not None else f.module_function
        # the write method where the file has one (by its role)
        write = p.insert_method if p is not None and (p.post_insert or p.insert_kv != "absent") else ""
        return InsertSite(f.class_name, method, f.line, state, action, reason, dict(present), write)

    def refuse(reason: str) -> InsertSite:
        return site(SiteState.UNSUPPORTED, Action.REFUSE, reason)

    if f.star_args:
        return refuse("the call passes *args/**kwargs: its cache arguments cannot be seen")
    if not f.has_cache:
        return site(SiteState.NOT_A_SITE, Action.NONE, "no main K/V cache argument: a norm+rope-only call")
    if f.class_name is None and f.in_wrapper:
        wrapper = f"in module-level function `{f.module_function}`, a pass-through wrapper"
        return site(SiteState.NOT_A_SITE, Action.NONE, f"{wrapper}: the layer's call of it is the site")
    if f.class_name is None:
        where = f"module-level function `{f.module_function}`" if f.module_function != "<module>" else "module code"
        if f.dtype_is_auto:
            return refuse(f'{where} passes kv_cache_dtype="{AUTO_DTYPE}" together with a cache: {NEITHER}')
        if f.dtype is not None and not f.dtype_proven:
            return refuse(
                f"{where} passes kv_cache_dtype={f.dtype}, which cannot be proven to be the cache dtype: "
                f"outside a layer class only a layer's own `<layer>.{DTYPE_ATTR}` is (with an fp8 cache the "
                f"native kernel would be told another). Pass the layer's `{DTYPE_ATTR}`, then run again"
            )
        if f.dtype is not None:
            reason = (
                f"native fp8 support (passes kv_cache_dtype={f.dtype}) in {where}, outside a layer class "
                "(a registered custom op that finds its layer in the forward context, say): run with "
                "--kv-cache-dtype fp8 directly"
            )
            return site(SiteState.NATIVE, Action.NONE, reason)
        return refuse(
            f"a fork-era insert call (no kv_cache_dtype) in {where}, which is no pass-through wrapper (it "
            "computes its own arguments): the bypass is written around a call in a layer's method only, "
            "so this one cannot be rewritten, and with an fp8 cache the fused op asserts here. "
            "Nothing was changed"
        )
    if f.method is None:
        return refuse("the call is in a class body, not in a method")
    if f.nested_in is not None:
        return refuse(f"the call sits inside nested `{f.nested_in}`, not directly in a method")
    if f.is_async:
        return refuse(
            f"the call is in `async def {f.method}`: vLLM calls a layer's forward synchronously, "
            "and the bypass is proven only in a plain `def`"
        )
    if f.broken is not None:
        return refuse(f.broken)
    p = pieces()
    present = p.present()
    if p.flag_unproven is not None:  # a piece of the file's own bypass whose role cannot be proven
        return refuse(
            f"the guard reads `self.{p.flag_attr}`, set in __init__ to `{p.flag_unproven}`, which cannot be "
            f'proven true for "fp8", "fp8_e4m3", "fp8_e5m2" and false for "bfloat16" and "{AUTO_DTYPE}" from '
            f"`self.{DTYPE_ATTR}` alone: the flag's role is not proven, nothing was changed. Either that is no "
            f"fp8 test, or __init__ hands `self` to code the reading cannot follow, which may change the flag or "
            f"the dtype (hand such calls what they read instead). If it is meant to be true for the fp8 cache "
            f'dtypes, write it as `"fp8" in self.{DTYPE_ATTR}` (or a helper returning that) after __init__ sets '
            f"`self.{DTYPE_ATTR}`, once, then run again"
        )
    if p.role_problems:
        return refuse(
            f"the file's own fp8 bypass cannot be proven: {'; '.join(p.role_problems)}. "
            "Nothing was changed; no piece of it is the tool's to remove"
        )
    if p.dtype_unread:
        return refuse(
            f"`self.{DTYPE_ATTR}` is not proven to hold the cache dtype once __init__ has run (it is set more than "
            "once on one path, or from what the reading cannot follow), so no fp8 flag read from it can be proven. "
            f"Set `self.{DTYPE_ATTR}` once in __init__, then run again"
        )
    if p.subclassed is not None:
        return refuse(f"{p.subclassed}: what the bypass relies on is proven for this class alone. Nothing was changed")
    taken = refuse(
        f"names the bypass would write are used for something else: {'; '.join(p.taken)}. "
        "Rename that other use (every place the name appears), then run again"
    )
    way_out = (
        "The call's slot mappings are None on some path (while compiling, say), where an unconditional cache "
        "argument fails too: this file's fp8 path must be written by hand"
        if p.slots_none else "Pass the cache unconditionally (or write the fp8 path by hand), then run again"
    )
    conditioned = refuse(
        f"cache argument `{(p.user_conditions or [''])[0]}` has a condition the bypass did not write: "
        f"the fp8 write after the call cannot honour it (with an fp8 cache it may write nothing). {way_out}"
    )
    if f.dtype is not None:
        if f.dtype_is_auto:
            return refuse(f'the call passes kv_cache_dtype="{AUTO_DTYPE}" together with a cache: {NEITHER}')
        if not f.dtype_proven:
            return refuse(
                f"the call passes kv_cache_dtype={f.dtype}, which cannot be proven to be the cache dtype "
                f'(`self.{DTYPE_ATTR}` as __init__ sets it) for "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16" and "auto": '
                "with an fp8 cache the native kernel would be told another. Pass "
                f"`self.{DTYPE_ATTR}`, then run again"
            )
        if p.user_conditions:
            return conditioned
        if f.cache_unproven is not None:
            return refuse(
                f"the call's cache argument `{f.cache_unproven}` is not a `self.` attribute (or a local proven to "
                "hold one on every path to the call): that the kernel gets the layer's cache, fp8 included, "
                "is not proven. Pass the cache attribute itself, then run again"
            )
        if not p.any_bypass(native=True):
            if p.own_write is not None:
                return refuse(
                    f"besides the native call, the layer writes a cache itself (`{p.own_write}`): the native kernel "
                    "writes fp8 and skips padded slots, and a second write into its cache is not proven (a stale "
                    "fp8 write of a fork, say). Take that write out, then run again"
                )
            native = f"native fp8 support (passes kv_cache_dtype={f.dtype})"
            return site(SiteState.NATIVE, Action.NONE, f"{native}: run with --kv-cache-dtype fp8 directly")
        if p.taken:
            return taken  # which pieces are the bypass's cannot be told
        if p.compiled_write:
            present = p.present(native=True)
            return _compiled_bypass(f, p, site)
        have = ", ".join(k for k, v in present.items() if v) or f"a read of self.{p.flag_attr}"
        reason = (
            f"native call (kv_cache_dtype={f.dtype}) carrying a stale fp8 bypass ({have}): "
            f"{_broken_now(p, f.line)}; `run` takes the bypass out - the native kernel writes "
            "fp8 and skips padded slots itself - then run with --kv-cache-dtype fp8 directly"
        )
        return site(SiteState.HALF_APPLIED, Action.STRIP, reason)

    if not f.in_block:
        return refuse(
            "the call is not a statement of its own in a block (assigned, returned or on one line with `if`)"
        )
    if p.taken:
        return taken
    if p.user_conditions:
        return conditioned
    if all(present.values()):
        if p.insert_kv in OLDER_FORMS:
            reason = f"fp8 bypass in an older form: {OLDER_FORMS[p.insert_kv]}; `run` upgrades it"
            return site(SiteState.OUTDATED, Action.UPGRADE, reason)
        return site(SiteState.PATCHED, Action.NONE, "fp8 bypass present and wired")
    if p.any_bypass():
        return site(SiteState.HALF_APPLIED, Action.COMPLETE, _half_applied_reason(p, present))
    reason = "fork-era insert call (no kv_cache_dtype): the fused op would assert on an fp8 cache"
    return site(SiteState.NEEDS_BYPASS, Action.REWRITE, reason)


COMPILED_DESIGN = (
    "while compiling, the call's slot mappings are None and the post-call block's compiled "
    "branch writes the cache"
)


def _compiled_bypass(f: CallFacts, p: Pieces, site: Callable[..., InsertSite]) -> InsertSite:
    """A native call carrying a torch.compile-aware bypass: the bypass is the compiled path's
    only cache write, so it stays; ``run`` upgrades its index write or restores a lost guard."""
    what = f"native call (kv_cache_dtype={f.dtype}) with a torch.compile-aware fp8 bypass ({COMPILED_DESIGN})"
    if all(p.present(native=True).values()):
        if p.insert_kv in OLDER_FORMS:
            older = f"{OLDER_FORMS[p.insert_kv]}, on the eager and the compiled path alike"
            reason = f"{what}, in an older form: {older}; `run` upgrades that write where it is"
            return site(SiteState.OUTDATED, Action.UPGRADE, reason)
        return site(SiteState.PATCHED, Action.NONE, f"{what}: present and wired")
    fix = (
        f"`run` restores the guard as `{(p.guard_args or ['<guard>'])[0]} = not torch.compiler.is_compiling()`: in eager "
        "the native kernel writes the cache (fp8 included, padded slots skipped), while compiling "
        "the file's own cache-update path still writes it"
    )
    if p.insert_kv in OLDER_FORMS:
        fix += ", and upgrades its index-key write (" + OLDER_FORMS[p.insert_kv] + ")"
    return site(SiteState.HALF_APPLIED, Action.COMPLETE, f"{what}, partial: {_broken_now(p, f.line)}; {fix}")


def _broken_now(p: Pieces, line: int) -> str:
    """What the bypass pieces do to a native call today."""
    if p.guard_lost:
        return (
            f"now `{p.guard_args[0]}` is read by the call at line {line} but never assigned: "
            "every forward raises NameError"
        )
    if p.flag_read and not p.flag_set:
        return f"now `self.{p.flag_attr}` is read but never set: every forward raises AttributeError"
    return "with an fp8 cache the bypass writes the fork-era layout into the native cache"


def _half_applied_reason(p: Pieces, present: dict[str, bool]) -> str:
    """What is missing, in the words the reports use (the file's own names for the pieces)."""
    guard = p.guard_assigned or (p.guard_args[0] if p.guard_args else "<guard>")
    words = {
        "flag": f"`self.{p.flag_attr}` set in __init__ (and the scale, where it is read)",
        "guard": f"the guard (`{guard} = not self.{p.flag_attr}`) assigned before the call",
        "guarded-args": f"cache arguments `X if {guard} else None`",
        "post-insert": f"`self.{p.insert_method}(k, v, index_k, <slots>)` after the call",
        "insert-kv": f"`{p.insert_method}` taking the slot mappings",
    }
    problems = []
    if p.guard_lost:
        problems.append(f"`{p.guard_args[0]}` is read but never assigned (NameError at runtime)")
    if p.flag_read and not p.flag_set:
        problems.append(f"`self.{p.flag_attr}` is read but never set (AttributeError at runtime)")
    if p.scale_read and not p.scale_set:
        problems.append("the fp8 scale is read but never set (AttributeError at runtime)")
    if p.insert_kv in OLDER_FORMS:
        problems.append(f"`{p.insert_method}` is in an older form: {OLDER_FORMS[p.insert_kv]}")
    if p.post_insert and not p.post_insert_wired:
        problems.append(f"the post-call `{p.insert_method}` is not wired ({WIRED})")
    text = "partial fp8 bypass; missing: " + "; ".join(words[k] for k, v in present.items() if not v)
    return text + (" - " + "; ".join(problems) if problems else "")


# --- once the changes are planned --------------------------------------------------------


def planned(site: InsertSite, failure: str | None, pieces: Pieces | None) -> InsertSite:
    """A changing verdict whose plan could not be proven safe (``failure`` says why) is refused.
    A strip it cannot prove advises no deletion (what else the file's post-call block and write
    method do is not proven); its way out changes no line of the fork's own."""
    if failure is None or site.action not in CHANGING:
        return site
    if site.action is not Action.STRIP:
        return replace(site, state=SiteState.UNSUPPORTED, action=Action.REFUSE, reason=failure)
    p = pieces or Pieces()
    way_out = "serve this file without --kv-cache-dtype fp8 (with a bf16 cache the fused op writes and the bypass is skipped)"
    if p.guard_lost:
        way_out = (
            f"restore the lost guard before the call, `{p.guard_args[0]} = not self.{p.flag_attr}`"
            + ("" if p.flag_set else f' (and `self.{p.flag_attr} = "fp8" in self.{DTYPE_ATTR}` in __init__)')
            + ", then " + way_out
        )
    reason = (
        f"{site.reason.split('; `run` takes')[0]}; `run` cannot take the bypass out: {failure}. "
        f"What else the post-call block and `{p.insert_method}` do is not proven, so no line is "
        f"advised for deletion and nothing was changed. Until the bypass's author takes it out: {way_out}"
    )
    return replace(site, state=SiteState.HALF_APPLIED, action=Action.REFUSE, reason=reason)


def _where(sites: list[InsertSite]) -> str:
    return ", ".join(f"{s.class_name}.{s.method} (line {s.line})" for s in sites)


def one_candidate(sites: list[InsertSite]) -> list[InsertSite]:
    """Plans are made on one tree and applied one at a time: when a change is planned, it must
    be at the file's only insert site the bypass could own (sites to change, patched ones)."""
    candidates = [s for s in sites if s.action in CHANGING or s.state is SiteState.PATCHED]
    if len(candidates) < 2 or not any(s.action in CHANGING for s in candidates):
        return sites
    where = _where(candidates)
    reason = f"{len(candidates)} candidate insert sites ({where}); the bypass can be proven for one only"
    refusal = {"state": SiteState.UNSUPPORTED, "action": Action.REFUSE, "reason": reason}
    return [replace(s, **refusal) if any(s is c for c in candidates) else s for s in sites]


def reverted(site: InsertSite, revert_reason: str | None, failure: str | None) -> InsertSite:
    """``revert`` at one site: its bypass taken out (``revert_reason``), refused (``failure``), or none."""
    if failure is not None:
        return replace(site, action=Action.REFUSE, reason=f"cannot revert: {failure}")
    if revert_reason is not None:
        return replace(site, action=Action.REVERT, reason=revert_reason)
    if site.state is SiteState.NOT_A_SITE:
        return replace(site, action=Action.NONE)
    return replace(site, action=Action.NONE, reason="no fp8 bypass here: nothing to revert")


def one_revert(sites: list[InsertSite]) -> list[InsertSite]:
    """A revert is planned on one tree too: more than one site with a bypass is refused."""
    reverts = [s for s in sites if s.action is Action.REVERT]
    if len(reverts) < 2:
        return sites
    reason = f"cannot revert: {len(reverts)} sites carry an fp8 bypass ({_where(reverts)})"
    return [replace(s, action=Action.REFUSE, reason=reason) if s.action is Action.REVERT else s for s in sites]
