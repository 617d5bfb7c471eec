"""Generated code: the templates the rewrite and the revert fill in from names proven in the
file (``FLAG`` to ``INSERT_KV_METADATA``), filling and parsing them in the file's own indent
and newline, and removing the imports a change left unused."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import libcst as cst

from codemods import anchors as a


# The templates pass the fork's pre-commit (vLLM's `ruff check` and `ruff format`, line length 88)
# at the indent they land at (tests/test_lint_output.py). FLAG's and GUARD's comment lines are how
# revert knows the bypass's own comments (BYPASS_COMMENTS), in every earlier version's output too.
# The names `run` writes where the file has no piece of that role live only here: the finders
# know each piece by what it does (tests/test_codegen_names.py).
FP8_FLAG = "_fp8_kv"
FP8_SCALE = "_fp8_kv_scale"  # the identity scale the write method passes, made once in __init__
INSERT_KV = "_insert_kv"
GUARD_NAME = "insert_via_fused"

FLAG = """\
# fp8 KV cache: the fused qknorm+rope+kv-insert op writes bf16 caches only;
# forward() then runs it norm+rope-only and writes the cache via _insert_kv().
self.{flag} = "fp8" in {dtype}
"""

# A non-persistent buffer, as vLLM's own layers keep such a tensor: it moves with the module
# (``.to(device)``) and stays out of the state dict.
SCALE = """\
self.register_buffer(
{I}"_fp8_kv_scale", torch.ones((), dtype=torch.float32), persistent=False
)
"""

SCALE_READ = "self._fp8_kv_scale"
SCALE_LOCAL = """\
{scale} = self._fp8_kv_scale  # identity: stores x / 1
"""

GUARD = """\
# fp8 KV cache: cache arguments None -> the fused op only norms/ropes in place.
{guard} = not self.{flag}
"""

NATIVE_GUARD = """\
# fp8 KV cache, torch.compile-aware: in eager the native kernel writes
# the cache (fp8 included, padded slots skipped); while compiling the
# slot mappings are None, so the cache arguments are too and the
# post-call block writes the cache.
{guard} = not {compiling}
"""

POST_INSERT = """\
if not {guard}:
{I}# {qkv} is [q | k | v | index_q | index_k]: the fused op left k and
{I}# index_k (one index-key head) normed/roped in place and v raw; write
{I}# them (strided views) to the cache.
{I}{n_kv} = {kv_width}
{I}{n_k0} = {q_width}
{I}{n_ik0} = {n_k0} + 2 * {n_kv} + {index_q_width}
{I}{n_k} = {qkv}[:, {n_k0} : {n_k0} + {n_kv}]
{I}{n_v} = {qkv}[:, {n_k0} + {n_kv} : {n_k0} + 2 * {n_kv}]
{I}{n_index_k} = {qkv}[:, {n_ik0} : {n_ik0} + {idx_head_dim}]
{I}self.{insert_kv}({n_k}, {n_v}, {n_index_k}, {main_slots}, {index_slots})
"""

# The index key as the key and value of a one-slot-per-block view of the index
# cache: reshape_and_cache_flash skips slot -1 (a padded token) as the fused op does.
# The cache's dtype picks the store (INDEX_STORE): a bf16 one copies, an fp8 e4m3
# one (vLLM's indexer_kv_dtype "fp8") stores x / 1, saturating, as the fused op does.
INDEX_STORE = """\
if {idx_cache}.dtype == {idx_key}.dtype:
{I}{idx_dtype} = "auto"  # a bf16 index cache: copied as is
elif {idx_cache}.dtype == torch.float8_e4m3fn:
{I}{idx_dtype} = "fp8_e4m3"  # an fp8 index cache: x / 1, saturating
else:
{I}raise ValueError(
{I}{I}f"index cache dtype {{{idx_cache}.dtype}}: "
{I}{I}f"neither {{{idx_key}.dtype}} nor fp8 e4m3"
{I})
"""

INDEX_WRITE = """\
# Index-key cache: one head per token, written by reshape_and_cache_flash,
# which skips padded tokens (slot -1) as the fused op does.
{idx_key} = {index_key}.view(-1, 1, {idx_head_dim})
{idx_cache} = {index_cache}.view(-1, 1, 1, {idx_head_dim})
""" + INDEX_STORE + """\
{reshape}(
{I}{idx_key},
{I}{idx_key},
{I}{idx_cache},
{I}{idx_cache},
{I}{index_slots},
{I}{idx_dtype},
{I}{scale},
{I}{scale},
)
"""


def indented(text: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else line for line in text.splitlines(keepends=True))


# The main K/V write of both write methods, the bypass's and the fork-era one.
MAIN_WRITE = """\
{reshape}(
{I}key.view(-1, {num_kv_heads}, {head_dim}),
{I}value.view(-1, {num_kv_heads}, {head_dim}),
{I}key_cache,
{I}value_cache,
{I}{main_slots},
{I}{dtype},
{I}scale,
{I}scale,
)
"""

# The new write method: its scale and writes are SCALE_LOCAL, MAIN_WRITE and INDEX_WRITE with these
# names of its own.
METHOD_NAMES = {n: n for n in ("idx_key", "idx_cache", "idx_dtype", "index_key", "scale")} | {
    "main_slots": "main_slot_mapping", "index_slots": "index_slot_mapping"
}
INSERT_KV_METHOD = '''\
def {name}(
{I}self,
{I}key: torch.Tensor,
{I}value: torch.Tensor,
{I}index_key: torch.Tensor,
{I}main_slot_mapping: torch.Tensor,
{I}index_slot_mapping: torch.Tensor,
) -> None:
{I}"""Write main K/V (fp8-quantizing) and index-K into their paged caches.

{D}Used only on the fp8-KV path, where the bf16-only fused op runs in
{D}norm+rope-only mode: ``reshape_and_cache_flash`` honours kv_cache_dtype.
{D}The index cache is copied (bf16) or stored x / 1 (fp8 e4m3), as the
{D}fused op does.{replaced}
{D}"""
{I}key_cache, value_cache = {kv_cache}.unbind(1)
''' + indented(SCALE_LOCAL + MAIN_WRITE + INDEX_WRITE, "{I}")


# What `revert` puts back: the fork-era `_insert_kv`, reading the slot mappings from the
# forward context's metadata (names filled in from the file like the templates above).
INSERT_KV_METADATA = '''\
def _insert_kv(
{I}self, key: torch.Tensor, value: torch.Tensor, index_key: torch.Tensor
) -> None:
{I}"""Write main K/V and index-K into their paged caches.

{D}No-op during the profiling run, where caches are not yet bound and
{D}``attn_metadata`` is None.
{D}"""
{I}attn_metadata = get_forward_context().attn_metadata
{I}if not isinstance(attn_metadata, dict):
{I}{I}return
{I}main_meta = attn_metadata[{main_key}]
{I}index_meta = attn_metadata[{index_key}]
{I}assert isinstance(main_meta, {main_metadata})
{I}assert isinstance(index_meta, {index_metadata})

{I}# Identity scale: unused for the bf16 cache, required arg of the op.
{I}key_cache, value_cache = {kv_cache}.unbind(1)
{I}scale = torch.ones((), device=key.device)
''' + indented(MAIN_WRITE, "{I}") + '''
{I}# Index-key cache: single vector per token, scatter by slot.
{I}idx_cache = {index_cache}.view(-1, {idx_head_dim})
{I}idx_cache[index_meta.slot_mapping] = index_key.to(idx_cache.dtype)
'''

# Said in the new `_insert_kv`'s docstring where it replaced the fork-era one.
REPLACED = """

{D}It replaces the fork-era form, which read the slot mappings from
{D}get_forward_context().attn_metadata."""


def render(template: str, module: cst.Module, depth: int = 1, **names: str) -> str:
    """Fill a template in the file's indent and newline; ``{I}`` is one indent step, ``{D}``
    a docstring line of a method in a class ``depth`` blocks deep (its text is not re-indented)."""
    text = template.format(I=module.default_indent, D=module.default_indent * (depth + 1), **names)
    return text.replace("\n", module.default_newline)


def parse_statements(text: str, module: cst.Module) -> list[cst.BaseStatement]:
    """Parse generated code with the file's indent and newline; comments included (a leading
    `pass` keeps the first comment lines on the first statement, not the module header)."""
    parsed = cst.parse_module("pass" + module.default_newline + text, config=module.config_for_parsing)
    return list(parsed.body[1:])


def parse_method(code: str, module: cst.Module, **changes: object) -> cst.FunctionDef:
    (new,) = parse_statements(code, module)
    assert isinstance(new, cst.FunctionDef)
    return new.with_changes(**changes)


Replacement = tuple[list[cst.BaseStatement], list[cst.EmptyLine]]  # what ``Splice.replace`` returns


class Splice(cst.CSTTransformer):
    """What the rewrite and the revert both do to a file, by node: a def of ``methods`` becomes
    its new code (its leading lines and decorators kept), a from-import of ``imports`` gets names
    (``add_import_alias``), and each statement of ``touched`` becomes what ``replace`` makes of it."""

    def __init__(
        self, module: cst.Module, methods: dict[int, str], imports: dict[int, list[str]], touched: set[int]
    ) -> None:
        super().__init__()
        self.module, self.methods, self.imports, self.touched = module, methods, imports, touched

    def replace(self, original: cst.BaseStatement, updated: cst.BaseStatement) -> Replacement:
        """The statements in the place of one of ``touched``, and the comment lines handed on to
        the next statement (after the last: kept at the block's end)."""
        return [updated], []

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if id(original) not in self.methods:
            return updated
        code, lines, decorators = self.methods[id(original)], original.leading_lines, original.decorators
        return parse_method(code, self.module, leading_lines=lines, decorators=decorators)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        for name in self.imports.get(id(original), ()):
            updated = add_import_alias(updated, name)
        return updated

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        if not any(id(s) in self.touched for s in original.body):
            return updated
        body: list[cst.BaseStatement] = []
        carried: list[cst.EmptyLine] = []
        for orig, new in zip(original.body, updated.body, strict=True):
            replacement, handed = self.replace(orig, new)
            carried += handed
            if replacement and carried:
                first = replacement[0]
                replacement[0] = first.with_changes(leading_lines=[*carried, *first.leading_lines])
                carried = []
            body += replacement
        return updated.with_changes(body=body, footer=[*carried, *updated.footer])


# --- imports ------------------------------------------------------------------------------


def add_import_alias(imp: cst.ImportFrom, name: str) -> cst.ImportFrom:
    """Add ``name`` to a from-import, in sorted place when the names are sorted
    (isort's order: constants, classes, then the rest), else at the end; the
    punctuation is copied from the neighbours (the inverse of removing one)."""
    assert not isinstance(imp.names, cst.ImportStar)
    names = list(imp.names)

    def key(text: str) -> tuple[int, str]:
        kind = 0 if text.isupper() else 1 if text[:1].isupper() else 2
        return kind, text.lower()

    keys = [key(a.code(n.name)) for n in names]
    index = bisect.bisect_right(keys, key(name)) if keys == sorted(keys) else len(names)
    commas = (n.comma for n in names[:-1] if isinstance(n.comma, cst.Comma))
    middle = next(commas, cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    comma = middle
    if index == len(names):  # the new last alias takes the old last one's comma (none, or a trailing one)
        comma, names[-1] = names[-1].comma, names[-1].with_changes(comma=middle)
    names.insert(index, cst.ImportAlias(name=cst.Name(name), comma=comma))
    return imp.with_changes(names=names)


def remove_unused_imports(
    module: cst.Module, candidates: set[str], silent: Sequence[cst.CSTNode] = ()
) -> cst.Module:
    """Remove from-import aliases among ``candidates`` that nothing reads any more (``silent``:
    statements known to mention none of them, not visited)."""
    uses = a.name_uses(module, skip=silent) if candidates else {}
    unused = {n for n in candidates if uses.get(n, 0) == 0}
    if not unused:
        return module

    class Remove(cst.CSTTransformer):
        def on_visit(self, node: cst.CSTNode) -> bool:
            # Only statements hold imports; expressions and one-line statements need no visit.
            return isinstance(node, a.BLOCK_HOLDERS)

        def leave_SimpleStatementLine(
            self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
        ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
            imp = updated.body[0] if len(updated.body) == 1 else None
            if not isinstance(imp, cst.ImportFrom) or isinstance(imp.names, cst.ImportStar):
                return updated
            names = list(imp.names)
            keep = [n for n in names if n.asname is not None or a.code(n.name) not in unused]
            if len(keep) == len(names):
                return updated
            commented = any(line.comment for line in updated.leading_lines)
            if not keep:  # a commented line is kept rather than lose its comment
                return updated if commented else cst.RemoveFromParent()
            if names[-1] not in keep:  # the removed last alias hands its comma on
                keep[-1] = keep[-1].with_changes(comma=names[-1].comma)
            return updated.with_changes(body=[imp.with_changes(names=keep)])

    return module.visit(Remove())


# The comments the bypass writes (run's, and the seed write-up's), which revert takes out.
SEED_COMMENTS = (
    (
        "fp8 main-K/V cache: the fused qknorm+rope+kv-insert op is bf16-cache-only",
        "(asserts kv_cache dtype == qkv), so on the fp8 path we run it in",
        "norm+rope-only mode and write the cache via the fp8-capable",
        "reshape_and_cache_flash in _insert_kv. (index cache stays bf16.)",
    ),
    (
        "On the fp8-KV path the fused op cannot write the (fp8) cache, so pass",
        "kv_cache/index_cache = None -> insert_kv=False (norm+rope only): it still",
        "de-interleaves q/index_q and rewrites the normed/roped k & index_k in",
        "place in qkv, leaving v raw (correct -- v is never normed/roped). We then",
        "write the cache via _insert_kv below.",
    ),
)


def comment_text(comment: str) -> str:
    return " ".join(comment.lstrip("#").split())


BYPASS_COMMENTS = (  # FLAG's and GUARD's comment lines, then the seed write-up's
    *(tuple(comment_text(line) for line in t.splitlines() if line.startswith("#")) for t in (FLAG, GUARD)),
    *SEED_COMMENTS,
)


def strip_comments(
    lines: Sequence[cst.EmptyLine], blocks: Sequence[tuple[str, ...]] = BYPASS_COMMENTS
) -> list[cst.EmptyLine]:
    """Leading lines without any run of comment lines that is one of ``blocks`` (by their text)."""
    out = list(lines)
    for block in blocks:
        i = 0
        while i + len(block) <= len(out):
            window = out[i : i + len(block)]
            if tuple(comment_text(line.comment.value) if line.comment else None for line in window) == block:
                del out[i : i + len(block)]
            else:
                i += 1
    return out
