"""The codemod on small inline files: before/after pairs and the refusals."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from codemods.analysis import analyze, rewrite
from codemods.schema import Action, SiteState

BEFORE = """\
import torch
from vllm import _custom_ops as ops


class Layer:
    def __init__(self, cfg):
        self.num_heads = cfg.heads
        self.num_kv_heads = cfg.kv_heads
        self.num_idx_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.idx_head_dim = cfg.idx_dim
        self.q_size = self.num_heads * self.head_dim
        self.index_q_size = self.num_idx_heads * self.idx_head_dim
        self.kv_cache_dtype = cfg.cache_dtype
        self.kv_cache = torch.tensor([])

    def forward(self, positions, qkv, slots, index_slots, q, index_q):
        ops.fused_minimax_m3_qknorm_rope_kv_insert(
            qkv, self.q_norm.weight, self.k_norm.weight, self.cos_sin_cache,
            positions, self.num_heads, self.num_kv_heads, self.rotary_dim, self.eps,
            self.index_q_norm.weight, self.index_k_norm.weight, self.num_idx_heads,
            slots, index_slots, self.kv_cache, self.index_cache, 128, q, index_q,
        )
        return q, index_q
"""

AFTER = """\
import torch
from vllm import _custom_ops as ops


class Layer:
    def __init__(self, cfg):
        self.num_heads = cfg.heads
        self.num_kv_heads = cfg.kv_heads
        self.num_idx_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.idx_head_dim = cfg.idx_dim
        self.q_size = self.num_heads * self.head_dim
        self.index_q_size = self.num_idx_heads * self.idx_head_dim
        self.kv_cache_dtype = cfg.cache_dtype
        # fp8 KV cache: the fused qknorm+rope+kv-insert op writes bf16 caches only;
        # forward() then runs it norm+rope-only and writes the cache via _insert_kv().
        self._fp8_kv = "fp8" in self.kv_cache_dtype
        self.register_buffer(
            "_fp8_kv_scale", torch.ones((), dtype=torch.float32), persistent=False
        )
        self.kv_cache = torch.tensor([])

    def _insert_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        index_key: torch.Tensor,
        main_slot_mapping: torch.Tensor,
        index_slot_mapping: torch.Tensor,
    ) -> None:
        \"\"\"Write main K/V (fp8-quantizing) and index-K into their paged caches.

        Used only on the fp8-KV path, where the bf16-only fused op runs in
        norm+rope-only mode: ``reshape_and_cache_flash`` honours kv_cache_dtype.
        The index cache is copied (bf16) or stored x / 1 (fp8 e4m3), as the
        fused op does.
        \"\"\"
        key_cache, value_cache = self.kv_cache.unbind(1)
        scale = self._fp8_kv_scale  # identity: stores x / 1
        ops.reshape_and_cache_flash(
            key.view(-1, self.num_kv_heads, self.head_dim),
            value.view(-1, self.num_kv_heads, self.head_dim),
            key_cache,
            value_cache,
            main_slot_mapping,
            self.kv_cache_dtype,
            scale,
            scale,
        )
        # Index-key cache: one head per token, written by reshape_and_cache_flash,
        # which skips padded tokens (slot -1) as the fused op does.
        idx_key = index_key.view(-1, 1, self.idx_head_dim)
        idx_cache = self.index_cache.view(-1, 1, 1, self.idx_head_dim)
        if idx_cache.dtype == idx_key.dtype:
            idx_dtype = "auto"  # a bf16 index cache: copied as is
        elif idx_cache.dtype == torch.float8_e4m3fn:
            idx_dtype = "fp8_e4m3"  # an fp8 index cache: x / 1, saturating
        else:
            raise ValueError(
                f"index cache dtype {idx_cache.dtype}: "
                f"neither {idx_key.dtype} nor fp8 e4m3"
            )
        ops.reshape_and_cache_flash(
            idx_key,
            idx_key,
            idx_cache,
            idx_cache,
            index_slot_mapping,
            idx_dtype,
            scale,
            scale,
        )

    def forward(self, positions, qkv, slots, index_slots, q, index_q):
        # fp8 KV cache: cache arguments None -> the fused op only norms/ropes in place.
        insert_via_fused = not self._fp8_kv
        ops.fused_minimax_m3_qknorm_rope_kv_insert(
            qkv, self.q_norm.weight, self.k_norm.weight, self.cos_sin_cache,
            positions, self.num_heads, self.num_kv_heads, self.rotary_dim, self.eps,
            self.index_q_norm.weight, self.index_k_norm.weight, self.num_idx_heads,
            slots, index_slots, (
                self.kv_cache if insert_via_fused else None
            ), (
                self.index_cache if insert_via_fused else None
            ), 128, q, index_q,
        )
        if not insert_via_fused:
            # qkv is [q | k | v | index_q | index_k]: the fused op left k and
            # index_k (one index-key head) normed/roped in place and v raw; write
            # them (strided views) to the cache.
            kv = self.num_kv_heads * self.head_dim
            k0 = self.q_size
            ik0 = k0 + 2 * kv + self.index_q_size
            k = qkv[:, k0 : k0 + kv]
            v = qkv[:, k0 + kv : k0 + 2 * kv]
            index_k = qkv[:, ik0 : ik0 + self.idx_head_dim]
            self._insert_kv(k, v, index_k, slots, index_slots)
        return q, index_q
"""


def sites(source: str):
    return analyze(cst.parse_module(source)).sites


def transform(source: str) -> str:
    return rewrite(analyze(cst.parse_module(source))).code


def only_site(source: str):
    (site,) = [s for s in sites(source) if s.state is not SiteState.NOT_A_SITE]
    return site


def test_before_after() -> None:
    assert only_site(BEFORE).state is SiteState.NEEDS_BYPASS
    assert transform(BEFORE) == AFTER
    assert only_site(AFTER).state is SiteState.PATCHED
    assert transform(AFTER) == AFTER


def variant(source: str, *edits: tuple[str, str]) -> str:
    """Apply exact text edits, each of which must match once."""
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


CALL_CACHES = "slots, index_slots, self.kv_cache, self.index_cache, 128, q, index_q,"


# --- states --------------------------------------------------------------------------


def test_native_call_is_left_alone() -> None:
    native = variant(BEFORE, (CALL_CACHES, CALL_CACHES + " self.kv_cache_dtype,"))
    site = only_site(native)
    assert (site.state, site.action) == (SiteState.NATIVE, Action.NONE)
    assert "--kv-cache-dtype fp8" in site.reason
    assert transform(native) == native


def test_native_by_keyword_too() -> None:
    native = variant(BEFORE, (CALL_CACHES, CALL_CACHES + " kv_cache_dtype=self.kv_cache_dtype,"))
    assert only_site(native).state is SiteState.NATIVE


def test_native_through_a_local_that_holds_the_cache_dtype() -> None:
    native = variant(
        BEFORE,
        (CALL_CACHES, CALL_CACHES + " kv_cache_dtype=cache_dtype,"),
        ("        ops.fused_minimax", "        cache_dtype = self.kv_cache_dtype\n        ops.fused_minimax"),
    )
    assert only_site(native).state is SiteState.NATIVE


@pytest.mark.parametrize(
    "dtype",
    ['"fp8_e4m3"', "dt", "self.index_dtype", '"auto" if True else self.kv_cache_dtype', "self.kv_cache_dtype.upper()"],
)
def test_a_dtype_that_is_not_the_cache_dtype_is_no_native_call(dtype: str) -> None:
    """A native call is left alone only where its dtype argument holds the cache dtype for every
    dtype (what __init__ leaves): check called each of these native, exit 0, and the kernel was
    told another dtype than the cache's (verify's semantic level fails the real file so edited)."""
    source = variant(
        BEFORE,
        (CALL_CACHES, f"{CALL_CACHES} kv_cache_dtype={dtype},"),
        ("        self.kv_cache_dtype = cfg.cache_dtype\n", '        self.kv_cache_dtype = cfg.cache_dtype\n        self.index_dtype = "auto"\n'),
    )
    source = source.replace("        ops.fused_minimax", '        dt = "auto"\n        ops.fused_minimax', 1)
    site = only_site(source)
    assert (site.state, site.action) == (SiteState.UNSUPPORTED, Action.REFUSE), site
    assert "cannot be proven to be the cache dtype" in site.reason


def test_auto_dtype_with_a_cache_is_unsupported() -> None:
    odd = variant(BEFORE, (CALL_CACHES, CALL_CACHES + ' kv_cache_dtype="auto",'))
    site = only_site(odd)
    assert (site.state, site.action) == (SiteState.UNSUPPORTED, Action.REFUSE)
    assert '"auto"' in site.reason


def test_none_cache_is_not_a_site() -> None:
    plain = variant(BEFORE, (CALL_CACHES, "slots, index_slots, None, None, 128, q, index_q,"))
    assert [s.state for s in sites(plain)] == [SiteState.NOT_A_SITE]


def test_a_module_function_that_is_no_wrapper_is_refused_or_native() -> None:
    """A call outside any layer class in a function that computes its own arguments (no
    pass-through wrapper: a registered custom op that finds its layer, say) cannot get the
    bypass: a fork-era one is refused, never passed over as no site; a native one is native."""
    source = textwrap.dedent(
        """\
        from vllm import _custom_ops as ops

        def insert(qkv, *caches):
            ops.fused_minimax_m3_qknorm_rope_kv_insert(qkv, kv_cache=caches[0])
        """
    )
    (site,) = sites(source)
    assert site.state is SiteState.UNSUPPORTED and "module-level function `insert`" in site.reason
    assert "no pass-through wrapper" in site.reason
    native = source.replace("kv_cache=caches[0])", "kv_cache=caches[0], kv_cache_dtype=caches[1])")
    (site,) = sites(native)
    assert site.state is SiteState.UNSUPPORTED and "cannot be proven to be the cache dtype" in site.reason
    layer = native.replace("caches[1])", "layer.kv_cache_dtype)").replace("    ops.", "    layer = L[0]\n    ops.")
    (site,) = sites(layer)
    assert site.state is SiteState.NATIVE and site.action.value == "none"
    for literal in ('"fp8"', '"auto"'):  # a literal is no layer's dtype; "auto" with a cache is neither form
        (site,) = sites(native.replace("caches[1])", f"{literal})"))
        assert site.state is SiteState.UNSUPPORTED and "a fork-era insert call" not in site.reason, site.reason
        assert literal in site.reason


def test_flag_read_but_never_set_is_half_applied() -> None:
    half = variant(
        BEFORE,
        ("        ops.fused", "        use = not self._fp8_kv\n        ops.fused"),
    )
    site = only_site(half)
    assert (site.state, site.action) == (SiteState.HALF_APPLIED, Action.COMPLETE)
    assert "never set" in site.reason
    out = transform(half)
    assert only_site(out).state is SiteState.PATCHED
    assert 'self._fp8_kv = "fp8" in self.kv_cache_dtype' in out


# --- refusals: anything the rewrite cannot prove safe ----------------------------------


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ((CALL_CACHES, "*rest,"), "*args"),
        (
            ("self.kv_cache, self.index_cache, 128", "self.get_cache(), self.index_cache, 128"),
            "`kv_cache` argument",
        ),
        (
            ("self.kv_cache, self.index_cache, 128", "self.kv_cache if self.on else self.x, self.index_cache, 128"),
            "cannot be guarded",
        ),
        (("slots, index_slots, self.kv_cache", "slots.long(), index_slots, self.kv_cache"), "`slot_mapping`"),
        (("        self.q_size = self.num_heads * self.head_dim\n", ""), "head size"),
        (("        self.index_q_size = self.num_idx_heads * self.idx_head_dim\n", ""), "index head size"),
        (("        self.kv_cache_dtype = cfg.cache_dtype\n", ""), "kv-cache dtype"),
        (("        ops.fused", "        _ = ops.fused"), "not a statement of its own"),
        (
            (
                "    def forward(self, positions, qkv, slots, index_slots, q, index_q):\n        ops.fused",
                "    def forward(self, positions, qkv, slots, index_slots, q, index_q):\n      def inner():\n        ops.fused",
            ),
            "nested",
        ),
    ],
    ids=[
        "star-args",
        "cache-call",
        "odd-conditional",
        "impure-slots",
        "no-head-size",
        "no-index-head-size",
        "no-dtype",
        "assigned-call",
        "nested-function",
    ],
)
def test_refusals(edit: tuple[str, str], reason: str) -> None:
    source = variant(BEFORE, edit)
    compile(source, "<variant>", "exec")
    site = only_site(source)
    assert (site.state, site.action) == (SiteState.UNSUPPORTED, Action.REFUSE), site.reason
    assert reason in site.reason


def test_a_module_without_torch_is_refused_naming_the_import() -> None:
    """(The layer itself reads no torch: one that did would be refused as reading a name nothing binds.)"""
    edits = [("import torch\n", ""), ("        self.kv_cache = torch.tensor([])\n", "        self.kv_cache = cfg.cache\n")]
    site = only_site(variant(BEFORE, *edits))
    assert (site.state, site.action) == (SiteState.UNSUPPORTED, Action.REFUSE) and "import torch" in site.reason


def test_insert_kv_of_unknown_shape_is_refused() -> None:
    source = variant(
        BEFORE, ("    def forward(", "    def _insert_kv(self, key):\n        pass\n\n    def forward(")
    )
    site = only_site(source)
    assert site.state is SiteState.UNSUPPORTED and "_insert_kv" in site.reason


def test_guard_assigned_something_else_is_refused() -> None:
    source = variant(
        BEFORE,
        ("        ops.fused", "        insert_via_fused = True\n        ops.fused"),
        (
            "self.kv_cache, self.index_cache, 128",
            "self.kv_cache if insert_via_fused else None, self.index_cache, 128",
        ),
    )
    site = only_site(source)
    # `insert_via_fused = True` is not the bypass's guard: the condition is the file's own.
    assert site.state is SiteState.UNSUPPORTED and "condition the bypass did not write" in site.reason


@pytest.mark.parametrize(
    "caller",
    [
        "    def warmup(self, k, v, ik):\n        self._insert_kv(k, v, ik)\n\n",  # the old signature
        "    def fp8_path(self, k, v, ik, s, i):\n        if not insert_via_fused:\n"
        "            self._insert_kv(k, v, ik, s, i)\n\n",  # a stale piece, its guard not in scope
    ],
    ids=["old-signature-caller", "stale-post-insert"],
)
def test_insert_kv_called_elsewhere_is_refused(caller: str) -> None:
    """Found by the mutation corpus (the call moved into a helper of a half-applied file)."""
    source = variant(BEFORE, ("    def forward(", caller + "    def forward("))
    site = only_site(source)
    assert (site.state, site.action) == (SiteState.UNSUPPORTED, Action.REFUSE)
    assert "is called elsewhere than right after the insert call" in site.reason


def test_a_local_named_like_the_guard_is_not_a_guard() -> None:
    """Found by the mutation corpus (locals renamed to the names the rewrite generates)."""
    source = variant(
        BEFORE,
        ("        ops.fused", "        insert_via_fused = q.shape[0]\n        ops.fused"),
        ("        return q, index_q", "        return q, index_q, insert_via_fused"),
    )
    out = transform(source)
    assert "insert_via_fused_fp8 = not self._fp8_kv" in out
    assert "self.kv_cache if insert_via_fused_fp8 else None" in out
    assert "return q, index_q, insert_via_fused" in out
    assert only_site(out).state is SiteState.PATCHED


# --- names come from the file -------------------------------------------------------------


def test_taken_local_names_get_fresh_ones() -> None:
    source = variant(
        BEFORE, ("        return q, index_q", "        k = v = kv = 0\n        return q, index_q, k, v, kv")
    )
    out = transform(source)
    assert "k_fp8 = qkv[:, k0 : k0 + kv_fp8]" in out
    assert "self._insert_kv(k_fp8, v_fp8, index_k, slots, index_slots)" in out
    assert "return q, index_q, k, v, kv" in out
    assert only_site(out).state is SiteState.PATCHED


def test_locals_holding_self_attributes_are_resolved() -> None:
    source = variant(
        BEFORE,
        (
            "        ops.fused",
            "        cache = self.kv_cache\n        nkv = self.num_kv_heads\n        ops.fused",
        ),
        ("self.num_heads, self.num_kv_heads, self.rotary_dim", "self.num_heads, nkv, self.rotary_dim"),
        ("self.kv_cache, self.index_cache, 128", "cache, self.index_cache, 128"),
    )
    out = transform(source)
    assert "cache if insert_via_fused else None" in out
    assert "key_cache, value_cache = self.kv_cache.unbind(1)" in out
    assert "key.view(-1, self.num_kv_heads, self.head_dim)" in out


def test_bare_callee_gets_its_reshape_import() -> None:
    source = variant(
        BEFORE,
        (
            "from vllm import _custom_ops as ops\n",
            "from vllm._custom_ops import fused_minimax_m3_qknorm_rope_kv_insert\n",
        ),
        ("        ops.fused", "        fused"),
    )
    out = transform(source)
    assert (
        "from vllm._custom_ops import fused_minimax_m3_qknorm_rope_kv_insert, reshape_and_cache_flash\n"
        in out
    )
    assert "        reshape_and_cache_flash(\n" in out
    assert only_site(out).state is SiteState.PATCHED


def test_torch_ops_callee_uses_the_cache_ops_namespace() -> None:
    source = variant(BEFORE, ("        ops.fused", "        torch.ops._C.fused"))
    assert "torch.ops._C_cache_ops.reshape_and_cache_flash(" in transform(source)


# --- formatting is the file's own ------------------------------------------------------------


def test_tabs_and_crlf_are_kept() -> None:
    source = BEFORE.replace("    ", "\t").replace("\n", "\r\n")
    out = transform(source)
    assert out.count("\r\n") == out.count("\n")  # every line ends in CRLF
    assert "\n\tdef _insert_kv(\r\n\t\tself," in out
    assert "\r\n\t\tinsert_via_fused = not self._fp8_kv\r\n" in out
    assert not any(line.startswith(" ") for line in out.splitlines())
    assert only_site(out).state is SiteState.PATCHED


def test_everything_outside_the_sites_is_byte_identical() -> None:
    out = transform(BEFORE)
    # Every original line survives, in order (the rewrite only inserts, except the
    # two cache arguments on the call's line).
    kept = [line for line in BEFORE.splitlines() if "self.kv_cache, self.index_cache" not in line]
    it = iter(out.splitlines())
    assert all(any(line == o for o in it) for line in kept)


def test_unwired_post_insert_is_refused() -> None:
    patched = transform(BEFORE)
    # A merge that swapped the slot mappings in the post-call insert.
    swapped = variant(
        patched,
        (
            "self._insert_kv(k, v, index_k, slots, index_slots)",
            "self._insert_kv(k, v, index_k, index_slots, slots)",
        ),
    )
    site = only_site(swapped)
    assert site.state is SiteState.UNSUPPORTED and "slot mappings" in site.reason


def test_unguarded_post_insert_is_refused() -> None:
    patched = transform(BEFORE)
    unguarded = variant(patched, ("        if not insert_via_fused:\n", "        if True:\n"))
    site = only_site(unguarded)
    assert site.state is SiteState.UNSUPPORTED and "if not <guard>" in site.reason


def test_call_in_class_body_is_refused() -> None:
    source = textwrap.dedent(
        """\
        from vllm import _custom_ops as ops

        class Odd:
            ops.fused_minimax_m3_qknorm_rope_kv_insert(x, kv_cache=c)
        """
    )
    (site,) = sites(source)
    assert site.state is SiteState.UNSUPPORTED and "class body" in site.reason


# --- imports only the replaced _insert_kv used ----------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # the removed last alias hands its comma (and the line break before ')') on
        ("from m import (\n    A,\n    B,\n    Gone,\n)\n", "from m import (\n    A,\n    B,\n)\n"),
        ("from m import A, Gone\n", "from m import A\n"),
        ("from m import Gone, A\n", "from m import A\n"),
        ("from m import Gone\nimport os\n", "import os\n"),
        # a comment above an otherwise empty import is not lost (the module
        # header's comment is not the import's)
        ("import os\n# keep me\nfrom m import Gone\n", "import os\n# keep me\nfrom m import Gone\n"),
        ("# header\nfrom m import Gone\n", "# header\n"),
        # still used somewhere: kept (a name, or a string annotation)
        ("from m import Gone\nx = Gone\n", "from m import Gone\nx = Gone\n"),
        ("from m import Gone\nx: 'Gone | None' = None\n", "from m import Gone\nx: 'Gone | None' = None\n"),
        # aliased imports are left to their owner
        ("from m import Gone as G\n", "from m import Gone as G\n"),
    ],
)
def test_remove_unused_imports(before: str, after: str) -> None:
    from codemods.codegen import remove_unused_imports

    assert remove_unused_imports(cst.parse_module(before), {"Gone"}).code == after


# --- a torch.compile-aware bypass on a native call (the fixtures compiled_native*) ----------

def _sites(path: str) -> list:
    from conftest import FIXTURES

    sites = analyze(cst.parse_module((FIXTURES / path).read_bytes())).sites
    return [s for s in sites if s.state is not SiteState.NOT_A_SITE]


def test_a_compile_aware_bypass_that_lost_its_guard_is_repaired_not_stripped() -> None:
    """Its compiled path writes the cache only through the bypass (slot mappings None while
    compiling): taking the bypass out would leave torch.compile writing nothing."""
    (site,) = _sites("compiled_native_lost_guard/model.py")
    assert (site.state, site.action) == (SiteState.HALF_APPLIED, Action.COMPLETE)
    assert "insert_via_fused = not torch.compiler.is_compiling()" in site.reason
    assert "By hand" not in site.reason


def test_the_same_bypass_with_real_slot_mappings_while_compiling_is_still_stripped() -> None:
    (site,) = _sites("half_native/model.py")
    assert (site.state, site.action) == (SiteState.HALF_APPLIED, Action.STRIP)


def test_not_is_compiling_alone_is_no_guard_on_a_fork_era_call() -> None:
    """Without kv_cache_dtype the kernel asserts on an fp8 cache: eager fp8 must take the bypass."""
    from conftest import FIXTURES

    source = (FIXTURES / "compiled_native_lost_guard/expected.py").read_text()
    fork_era = source.replace("            self.kv_cache_dtype,\n        )\n        if torch", "        )\n        if torch")
    assert fork_era != source
    (site,) = [s for s in analyze(cst.parse_module(fork_era)).sites if s.state is not SiteState.NOT_A_SITE]
    assert site.state is not SiteState.PATCHED


def test_the_generated_scale_is_a_non_persistent_buffer() -> None:
    """The identity scale `run` makes in __init__ moves with the module (``.to(...)``) and stays
    out of the state dict, as vLLM's own layers keep such a tensor: a non-persistent buffer,
    not a plain tensor attribute made on whatever device was current."""
    torch = pytest.importorskip("torch")
    from conftest import FIXTURES

    new = rewrite(analyze(cst.parse_module((FIXTURES / "fork_era" / "model.py").read_text()))).code
    lines = [line.strip() for line in new.splitlines()]
    made = [i for i, line in enumerate(lines) if line.startswith("self._fp8_kv_scale =")]
    made += [i for i, line in enumerate(lines[:-2]) if line == "self.register_buffer(" and "_fp8_kv_scale" in lines[i + 1]]
    (start,) = made
    statement = lines[start] if lines[start].endswith(")") or "=" in lines[start][:20] else "".join(lines[start : start + 3])

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            exec(statement, {"self": self, "torch": torch})

    layer = Layer()
    assert "_fp8_kv_scale" in dict(layer.named_buffers()), statement
    assert "_fp8_kv_scale" not in layer.state_dict()
    assert layer.to(torch.float64)._fp8_kv_scale.dtype == torch.float64  # it moves with the module


def test_the_scale_goes_after_the_flag_not_after_another_self_call() -> None:
    """The scale made for a fork's own flag goes right after the statement that sets the flag;
    a later `self.<method>()` of __init__ that has nothing to do with the flag is not it."""
    from conftest import FIXTURES

    flag = '        self._fp8_kv = "fp8" in self.kv_cache_dtype\n'
    source = (FIXTURES / "seed_form" / "model.py").read_text()
    assert source.count(flag) == 1
    source = source.replace(flag, flag + "        self._warm_up()\n").replace(
        "    def forward(", "    def _warm_up(self) -> None:\n        pass\n\n    def forward(", 1
    )
    new = rewrite(analyze(cst.parse_module(source))).code
    after = new.split(flag, 1)[1].splitlines()
    assert after[0] == "        self.register_buffer(", after[:3]
