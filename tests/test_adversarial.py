"""Valid variants of a fork-era file that a naive rewrite would get wrong.

Each variant must end as a correct rewrite (judged like every other: compiles,
second pass patched, nothing else changed, the pieces wired, and the layer run
bf16 against fp8 on the stand-in) or as a refusal that names what could not be
proven - never as a wrong rewrite, and never as "unchanged" on a file that
crashes with an fp8 cache. ``check`` (the ast pre-filter first) must agree.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES
from judge import judge_rewrite

from codemods.schema import InsertSite
from rewriter import commands
from rewriter.apply import FileStatus, plan_revert_file
from rewriter.targets import Target

FORK_ERA = (FIXTURES / "fork_era" / "model.py").read_text()
PATCHED = (FIXTURES / "patched" / "model.py").read_text()
CALL = "        ops.fused_minimax_m3_qknorm_rope_kv_insert(\n"
FORWARD = "    def forward(\n        self,\n        positions: torch.Tensor,\n        hidden_states: torch.Tensor,\n    ) -> torch.Tensor:\n"
KV_ARG = "            self.kv_cache,\n            self.indexer.index_cache.kv_cache,\n"
DTYPE = "        self.kv_cache_dtype = (\n"


def forward_param(param: str) -> tuple[str, str]:
    """An edit that gives the sparse layer's forward one more parameter."""
    return FORWARD, FORWARD.replace("hidden_states: torch.Tensor,\n", f"hidden_states: torch.Tensor,\n        {param},\n")


def edit(source: str, *pairs: tuple[str, str]) -> str:
    """Replace each text, which must be there (in the sparse layer: the last occurrence)."""
    for old, new in pairs:
        assert old in source, old
        head, _, tail = source.rpartition(old)
        source = head + new + tail
    return source


def outcome(tmp_path: Path, source: str) -> tuple[str, str, str]:
    """(what `check` says, what `run` did, the reason or the rewritten text)."""
    path = tmp_path / "model.py"
    path.write_text(source)
    checked = commands.analyze_targets("check", [Target(path, "t")])
    report = commands.write_targets("run", [Target(path, "t")])
    result = report.files[0]
    after = path.read_text()
    if result.status is FileStatus.REWRITTEN:
        return checked.files[0].status.value, "rewritten", after
    assert after == source, "refused or unchanged, but the file changed"
    reason = "; ".join([s.reason for s in result.sites if s.action.value == "refuse"] + [result.error or ""])
    return checked.files[0].status.value, result.status.value, reason


def assert_refused(tmp_path: Path, source: str, why: str) -> None:
    compile(source, "<variant>", "exec")
    checked, ran, reason = outcome(tmp_path, source)
    assert (checked, ran) == ("refused", "refused"), reason
    assert why in reason, reason


def assert_rewritten_right(tmp_path: Path, source: str) -> str:
    compile(source, "<variant>", "exec")
    checked, ran, after = outcome(tmp_path, source)
    assert (checked, ran) == ("needs-rewrite", "rewritten"), after
    assert judge_rewrite(source, after) == []
    return after


def sparse_init(after: str) -> str:
    return after.split("class MiniMaxM3SparseAttention")[1].split("def __init__(")[1].split("    def ")[0]


def post_insert(after: str) -> str:
    """The generated block after the call, as source."""
    tree = ast.parse(after)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "self._insert_kv" in ast.unparse(node):
            return ast.unparse(node)
    raise AssertionError("no post-call insert")


# --- 1. the cache a call passes is proven to be the one `_insert_kv` writes -----------------------

ALIAS = "        main_cache = self.kv_cache\n"
ALIASED_ARG = "            main_cache,\n            self.indexer.index_cache.kv_cache,\n"


@pytest.mark.parametrize(
    "rebinding",
    [
        "        main_cache, spare = self.indexer.index_cache.kv_cache, None\n",
        "        for main_cache in (self.indexer.index_cache.kv_cache,):\n            pass\n",
        "        with torch.no_grad() as main_cache:\n            pass\n",
        "        if (main_cache := self.indexer.index_cache.kv_cache) is None:\n            pass\n",
        "        main_cache += 0\n",
        "        self.kv_cache = self.indexer.index_cache.kv_cache\n",
        "        setattr(self, 'kv_cache', self.indexer.index_cache.kv_cache)\n",
        "        del main_cache\n        main_cache = self.indexer.index_cache.kv_cache\n",
    ],
    ids=["unpacking", "for", "with", "walrus", "augmented", "attribute-rebound", "setattr", "del"],
)
def test_an_alias_rebound_on_the_way_is_refused(tmp_path: Path, rebinding: str) -> None:
    source = edit(FORK_ERA, (CALL, ALIAS + rebinding + CALL), (KV_ARG, ALIASED_ARG))
    assert_refused(tmp_path, source, "is not a `self.` attribute (or a local proven to hold one")


def test_an_alias_bound_on_one_path_only_is_refused(tmp_path: Path) -> None:
    source = edit(
        FORK_ERA,
        (CALL, "        if positions.numel():\n    " + ALIAS + "        else:\n            main_cache = None\n" + CALL),
        (KV_ARG, ALIASED_ARG),
    )
    assert_refused(tmp_path, source, "is not a `self.` attribute (or a local proven to hold one")


def test_a_parameter_defaulting_to_the_cache_is_refused(tmp_path: Path) -> None:
    source = edit(
        FORK_ERA,
        forward_param("main_cache=None"),
        (CALL, "        if main_cache is None:\n    " + ALIAS + CALL),
        (KV_ARG, ALIASED_ARG),
    )
    assert_refused(tmp_path, source, "is not a `self.` attribute (or a local proven to hold one")


def test_a_plain_alias_is_rewritten(tmp_path: Path) -> None:
    after = assert_rewritten_right(tmp_path, edit(FORK_ERA, (CALL, ALIAS + CALL), (KV_ARG, ALIASED_ARG)))
    assert "main_cache if insert_via_fused else None" in after
    assert "key_cache, value_cache = self.kv_cache.unbind(1)" in after


# --- 2. a condition the tool did not write is the caller's -----------------------------------------

USER_ARGS = (
    "            self.kv_cache if write_cache else None,\n"
    "            self.indexer.index_cache.kv_cache if write_cache else None,\n"
)


@pytest.mark.parametrize(
    "binding",
    [
        ("forward-parameter", forward_param("write_cache: bool = True")),
        ("local", (CALL, "        write_cache = positions.numel() > 0\n" + CALL)),
        ("module-global", ("\n\nclass MiniMaxM3SparseAttention", "\n\nwrite_cache = True\n\n\nclass MiniMaxM3SparseAttention")),
        ("tool-name-assigned-otherwise", (CALL, "        write_cache = True\n" + CALL)),
    ],
    ids=lambda b: b[0] if isinstance(b, tuple) else b,
)
def test_the_callers_condition_is_not_taken_for_the_guard(tmp_path: Path, binding) -> None:
    _, pair = binding
    source = edit(FORK_ERA, pair, (KV_ARG, USER_ARGS))
    assert_refused(tmp_path, source, "has a condition the bypass did not write")
    # and `revert` finds no bypass of the tool's to take out: the conditions stay
    path = tmp_path / "model.py"
    report = commands.write_targets("revert", [Target(path, "t")])
    assert report.files[0].status is not FileStatus.REWRITTEN
    assert path.read_text() == source


def test_a_native_call_with_the_callers_condition_is_native(tmp_path: Path) -> None:
    native = edit(
        FORK_ERA,
        forward_param("write_cache: bool = True"),
        (KV_ARG, USER_ARGS),
        ("            index_q,\n        )\n\n        output", "            index_q,\n            self.kv_cache_dtype,\n        )\n\n        output"),
    )
    path = tmp_path / "model.py"
    path.write_text(native)
    report = commands.write_targets("run", [Target(path, "t")])
    assert [s.state.value for s in report.files[0].sites if s.class_name == "MiniMaxM3SparseAttention"] == ["native"]
    assert path.read_text() == native


# --- 3. each size by what it is --------------------------------------------------------------------


def test_index_heads_counted_by_the_kv_head_count(tmp_path: Path) -> None:
    """The call passes `self.num_kv_heads` as num_index_heads: its product with the head
    size (kv_size) is not the index width, and head_dim is not the index head size."""
    source = edit(
        FORK_ERA,
        ("        self.num_idx_heads = self.num_kv_heads\n", ""),
        ("self.index_q_size = self.num_idx_heads * self.idx_head_dim", "self.index_q_size = self.num_kv_heads * self.idx_head_dim"),
        ("            self.num_idx_heads,\n            main_slot_mapping,", "            self.num_kv_heads,\n            main_slot_mapping,"),
        ("num_index_heads=self.num_idx_heads,", "num_index_heads=self.num_kv_heads,"),
    )
    block = post_insert(assert_rewritten_right(tmp_path, source))
    assert "+ self.index_q_size" in block and "+ self.idx_head_dim]" in block, block


@pytest.mark.parametrize(
    "extra",
    [
        "        self.rope_q_size = self.num_heads * self.rotary_dim\n",
        "        self.rope_q_size = self.rotary_dim * self.num_heads\n        self.rope_k_size = self.num_kv_heads * self.rotary_dim\n",
    ],
    ids=["rope-q", "rope-q-and-k"],
)
def test_another_product_of_the_head_count_is_not_the_head_size(tmp_path: Path, extra: str) -> None:
    source = edit(
        FORK_ERA,
        ("        self.q_size = self.num_heads * self.head_dim\n        self.kv_size", "        self.rotary_dim = 64\n" + extra + "        self.q_size = self.num_heads * self.head_dim\n        self.kv_size"),
    )
    after = assert_rewritten_right(tmp_path, source)
    block = post_insert(after)
    assert "= self.q_size" in block and "rope" not in block, block
    assert "key.view(-1, self.num_kv_heads, self.head_dim)" in after


def test_without_norms_the_head_size_is_the_one_both_counts_share(tmp_path: Path) -> None:
    source = edit(
        FORK_ERA,
        ("        self.q_size = self.num_heads * self.head_dim\n        self.kv_size", "        self.rotary_dim = 64\n        self.rope_q_size = self.num_heads * self.rotary_dim\n        self.q_size = self.num_heads * self.head_dim\n        self.kv_size"),
        ("self.q_norm = GemmaRMSNorm(self.head_dim,", "self.q_norm = GemmaRMSNorm(config.head_dim,"),
        ("self.k_norm = GemmaRMSNorm(self.head_dim,", "self.k_norm = GemmaRMSNorm(config.head_dim,"),
    )
    block = post_insert(assert_rewritten_right(tmp_path, source))
    assert "= self.q_size" in block, block


def test_an_index_size_that_cannot_be_told_is_refused(tmp_path: Path) -> None:
    source = edit(
        FORK_ERA,
        ("        self.num_idx_heads = self.num_kv_heads\n", ""),
        ("self.index_q_size = self.num_idx_heads * self.idx_head_dim", "self.index_q_size = self.num_kv_heads * self.idx_head_dim"),
        ("            self.num_idx_heads,\n            main_slot_mapping,", "            self.num_kv_heads,\n            main_slot_mapping,"),
        ("num_index_heads=self.num_idx_heads,", "num_index_heads=self.num_kv_heads,"),
        ("self.index_q_norm = GemmaRMSNorm(self.idx_head_dim,", "self.index_q_norm = GemmaRMSNorm(config.idx,"),
        ("self.index_k_norm = GemmaRMSNorm(self.idx_head_dim,", "self.index_k_norm = GemmaRMSNorm(config.idx,"),
    )
    assert_refused(tmp_path, source, "cannot tell the index head size (idx_head_dim): self.head_dim, self.idx_head_dim could each be it")


# --- 4. the flag comes from the main cache's dtype ------------------------------------------------

INDEXER_FIRST = (
    "        self.indexer_kv_dtype = vllm_config.attention_config.indexer_kv_dtype\n"
    "        self.indexer_torch_dtype = kv_cache_dtype_str_to_dtype(\n"
    "            self.indexer_kv_dtype, vllm_config.model_config\n"
    "        )\n"
)


def test_the_indexer_dtype_converted_first_is_not_the_anchor(tmp_path: Path) -> None:
    after = assert_rewritten_right(tmp_path, edit(FORK_ERA, (DTYPE, INDEXER_FIRST + DTYPE)))
    assert 'self._fp8_kv = "fp8" in self.kv_cache_dtype' in after
    assert "indexer_kv_dtype," not in after.split("def _insert_kv(")[1].split("def forward(")[0]
    init = sparse_init(after)
    assert init.index("self._fp8_kv =") > init.index("self.kv_cache_torch_dtype =")


def test_a_lambda_converting_the_dtype_early_is_not_the_anchor(tmp_path: Path) -> None:
    lam = "        self.torch_dtype_of = lambda: kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, None)\n"
    after = assert_rewritten_right(tmp_path, edit(FORK_ERA, ("        self.layer_name = f\"{prefix}.attn\"\n", lam + "        self.layer_name = f\"{prefix}.attn\"\n")))
    init = sparse_init(after)
    assert init.index("self._fp8_kv =") > init.index("self.kv_cache_dtype =") > init.index("self.torch_dtype_of =")


def test_the_dtype_assigned_in_both_branches_gets_the_flag_after_them(tmp_path: Path) -> None:
    source = edit(
        FORK_ERA,
        (DTYPE + "            cache_config.cache_dtype if cache_config is not None else \"auto\"\n        )\n",
         "        if cache_config is not None:\n            self.kv_cache_dtype = cache_config.cache_dtype\n        else:\n            self.kv_cache_dtype = \"auto\"\n"),
    )
    after = assert_rewritten_right(tmp_path, source)
    assert '\n        self._fp8_kv = "fp8" in self.kv_cache_dtype\n' in after


# --- 5. names the file already uses ----------------------------------------------------------------

END_OF_INIT = "        self.kv_cache = torch.tensor([])  # replaced by bind_kv_cache\n"


@pytest.mark.parametrize(
    "source, why",
    [
        (edit(FORK_ERA, (END_OF_INIT, END_OF_INIT + "        self._fp8_kv = False\n")), "`self._fp8_kv = False` in __init__"),
        # the patched file's own flag (its guard reads it), set otherwise: its role is not proven
        (edit(PATCHED, (END_OF_INIT, END_OF_INIT + "        self._fp8_kv = False\n")), 'set in __init__ to `"fp8" in self.kv_cache_dtype`, then `False`'),
        (edit(PATCHED, ('self._fp8_kv = "fp8" in self.kv_cache_dtype', 'self._fp8_kv = "fp8" in self.indexer_kv_dtype')), 'set in __init__ to `"fp8" in self.indexer_kv_dtype`, which cannot be proven'),
        (edit(FORK_ERA, (FORWARD, "    @property\n    def _fp8_kv(self) -> bool:\n        return False\n\n" + FORWARD)), "`_fp8_kv` is defined in the class body"),
        (edit(FORK_ERA, ("    def _run_attention(", "    _insert_kv = None\n\n    def _run_attention(")), "`_insert_kv` is bound in the class body"),
        (edit(PATCHED, ("    def _run_attention(", "    _insert_kv = staticmethod(lambda *args: None)\n\n    def _run_attention(")), "`_insert_kv` is bound in the class body"),
        (edit(FORK_ERA, ("    def _run_attention(", "    def warm(self):\n        self._fp8_kv_scale = 2.0\n\n    def _run_attention(")), "`self._fp8_kv_scale = 2.0` in warm"),
    ],
    ids=["flag-later-in-init", "patched-flag-later", "flag-from-indexer-dtype", "property", "class-attr", "patched-class-attr", "scale-elsewhere"],
)
def test_names_the_file_already_uses_are_refused(tmp_path: Path, source: str, why: str) -> None:
    assert_refused(tmp_path, source, why)


# --- 6. where reshape_and_cache_flash is ------------------------------------------------------------


def test_an_op_namespace_without_reshape_uses_custom_ops(tmp_path: Path) -> None:
    source = edit(FORK_ERA, (CALL, CALL.replace("ops.fused", "torch.ops.vllm.fused")))
    after = assert_rewritten_right(tmp_path, source)
    assert "torch.ops.vllm.reshape_and_cache_flash" not in after
    assert "ops.reshape_and_cache_flash(" in after.split("def _insert_kv(")[1]


def test_an_op_namespace_with_no_custom_ops_import_is_refused(tmp_path: Path) -> None:
    source = edit(
        FORK_ERA,
        (CALL, CALL.replace("ops.fused", "torch.ops.vllm.fused")),
        ("from vllm import _custom_ops as ops\n", ""),
        ("    ops.fused_minimax_m3_qknorm_rope_kv_insert(\n        qkv,", "    torch.ops.vllm.fused_minimax_m3_qknorm_rope_kv_insert(\n        qkv,"),
        ("        ops.reshape_and_cache_flash(", "        torch.ops._C_cache_ops.reshape_and_cache_flash("),
    )
    assert_refused(tmp_path, source, "no statement of the module's own imports `vllm._custom_ops`")


def test_the_c_namespace_imported_by_name_is_known_by_what_it_is(tmp_path: Path) -> None:
    """``from torch.ops import _C`` and ``_C.fused_…(…)``: the namespace is ``torch.ops._C`` by what
    the name is bound to (it was matched by that spelling), so the write goes to its cache ops."""
    source = edit(
        FORK_ERA,
        ("from vllm import _custom_ops as ops\n", "from torch.ops import _C\nfrom vllm import _custom_ops as ops\n"),
        (CALL, CALL.replace("ops.fused", "_C.fused")),
    )
    after = assert_rewritten_right(tmp_path, source)
    assert "torch.ops._C_cache_ops.reshape_and_cache_flash(" in after.split("def _insert_kv(")[1]


def test_a_bare_name_from_another_module_is_refused(tmp_path: Path) -> None:
    source = edit(
        FORK_ERA,
        ("from vllm import _custom_ops as ops\n", "from vllm import _custom_ops as ops\nfrom my_fork.kernels import fused_minimax_m3_qknorm_rope_kv_insert\n"),
        (CALL, CALL.replace("ops.fused", "fused")),
    )
    assert_refused(tmp_path, source, "that `from vllm._custom_ops import …` does not bring in")


# --- 7. the op reached by another name is never "unchanged" -----------------------------------------


@pytest.mark.parametrize(
    "pairs",
    [
        (("from vllm import _custom_ops as ops\n", "from vllm import _custom_ops as ops\nfrom vllm._custom_ops import fused_minimax_m3_qknorm_rope_kv_insert as fused_insert\n"), (CALL, CALL.replace("ops.fused_minimax_m3_qknorm_rope_kv_insert", "fused_insert"))),
        ((CALL, "        op = ops.fused_minimax_m3_qknorm_rope_kv_insert\n" + CALL.replace("ops.fused_minimax_m3_qknorm_rope_kv_insert", "op")),),
        ((CALL, CALL.replace("ops.fused_minimax_m3_qknorm_rope_kv_insert", 'getattr(ops, "fused_minimax_m3_qknorm_rope_kv_insert")')),),
        (("\n\nclass MiniMaxM3SparseAttention", "\n\n_insert_op = ops.fused_minimax_m3_qknorm_rope_kv_insert\n\n\nclass MiniMaxM3SparseAttention"), (CALL, CALL.replace("ops.fused_minimax_m3_qknorm_rope_kv_insert", "_insert_op"))),
    ],
    ids=["import-alias", "local", "getattr", "module-binding"],
)
def test_the_op_under_another_name_is_not_unchanged(tmp_path: Path, pairs) -> None:
    source = edit(FORK_ERA, *pairs)
    assert_refused(tmp_path, source, "the op is named without being called by that name (`")
    reason = outcome(tmp_path, source)[2]
    assert "#" not in reason.split("(`")[1].split("`)")[0], "the comments above the statement are not it"


def test_the_op_named_in_an_except_clause_quotes_the_statement_that_holds_it(tmp_path: Path) -> None:
    """The clause is read after the ``try`` body: the quote is the ``try`` statement, not the
    body's last statement (which only mentions the op in a comment)."""
    probe = (
        "        try:\n            probe = 1  # before fused_minimax_m3_qknorm_rope_kv_insert\n"
        '        except getattr(ops, "fused_minimax_m3_qknorm_rope_kv_insert"):\n            pass\n'
    )
    source = edit(FORK_ERA, (CALL, probe + CALL))
    assert_refused(tmp_path, source, "the op is named without being called by that name (`try:`)")


# --- calls in a `match` case are sites like any other -------------------------------------------------


def test_a_call_in_a_match_case_is_rewritten(tmp_path: Path) -> None:
    body = FORK_ERA.split(CALL)[-1].split("        )\n", 1)[0]
    indented = "".join("        " + line if line.strip() else line for line in (CALL + body + "        )\n").splitlines(True))
    source = edit(FORK_ERA, (CALL + body + "        )\n", "        match positions.dim():\n            case _:\n" + indented))
    after = assert_rewritten_right(tmp_path, source)
    assert "                insert_via_fused = not self._fp8_kv\n" in after


# --- and more of each kind -------------------------------------------------------------------------------


def test_self_rebound_in_the_method_is_refused(tmp_path: Path) -> None:
    source = edit(FORK_ERA, (CALL, "        self = self.impl.layer\n" + CALL))
    assert_refused(tmp_path, source, "is not a `self.` attribute")


@pytest.mark.parametrize(
    "source, why",
    [
        (edit(FORK_ERA, (END_OF_INIT, END_OF_INIT + "        self._insert_kv = None\n")), "`self._insert_kv` is assigned in __init__"),
        (edit(PATCHED, (END_OF_INIT, END_OF_INIT + "        self._insert_kv = None\n")), "`self._insert_kv` is assigned in __init__"),
    ],
    ids=["instance-insert-kv", "patched-instance-insert-kv"],
)
def test_more_names_the_bypass_needs_are_refused(tmp_path: Path, source: str, why: str) -> None:
    assert_refused(tmp_path, source, why)


def test_a_callers_condition_inside_the_guard_is_not_patched(tmp_path: Path) -> None:
    """A patched file whose cache argument a fork wrapped in its own flag: the fp8 write
    after the call would ignore that flag, so this is not `patched`."""
    source = edit(
        PATCHED,
        forward_param("write_cache: bool = True"),
        ("            self.kv_cache if insert_via_fused else None,\n", "            (self.kv_cache if write_cache else None) if insert_via_fused else None,\n"),
    )
    assert_refused(tmp_path, source, "has a condition the bypass did not write")


def test_a_guard_rebound_between_its_assignment_and_the_call_is_not_the_guard(tmp_path: Path) -> None:
    source = edit(
        PATCHED,
        ("        ops.fused_minimax_m3_qknorm_rope_kv_insert(\n", "        if positions.numel() == 0:\n            insert_via_fused = True\n        ops.fused_minimax_m3_qknorm_rope_kv_insert(\n"),
    )
    assert_refused(tmp_path, source, "has a condition the bypass did not write")


# --- a flag that __init__ deletes again -----------------------------------------------------------

FLAG_LINE = '        self._fp8_kv = "fp8" in self.kv_cache_dtype\n'
PATCHED_RUN = (FIXTURES / "fork_era" / "expected.py").read_text()


def test_a_flag_deleted_in_init_is_no_flag(tmp_path: Path) -> None:
    """`del self._fp8_kv` after its assignment: every forward raises AttributeError, so the
    file is not patched (check once said it was, exit 0); set again afterwards, it is."""
    deleted = edit(PATCHED_RUN, (FLAG_LINE, FLAG_LINE + "        del self._fp8_kv\n"))
    assert_refused(tmp_path, deleted, "`self._fp8_kv`")
    again = edit(PATCHED_RUN, (FLAG_LINE, FLAG_LINE + "        del self._fp8_kv\n" + FLAG_LINE))
    path = tmp_path / "again.py"
    path.write_text(again)
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    assert result.status is FileStatus.UNCHANGED
    assert [s.state.value for s in result.sites if s.state.value != "not-a-site"] == ["patched"]


@pytest.mark.parametrize(
    "by_name",
    [
        'setattr(self, "_fp8_kv", False)',
        'object.__setattr__(self, "_fp8_kv", False)',
        'self.__setattr__("_fp8_kv", False)',
        'self.__dict__["_fp8_kv"] = False',
        "vars(self).update(_fp8_kv=False)",
    ],
)
def test_a_flag_set_again_by_name_is_no_proven_flag(tmp_path: Path, by_name: str) -> None:
    """The flag assigned, then set by name (as nn.Module's own code may): its value is not the
    assignment's any more. check once said patched (exit 0) about files whose fp8 forward
    hands the fused op its caches."""
    assert_refused(tmp_path, edit(PATCHED_RUN, (FLAG_LINE, FLAG_LINE + f"        {by_name}\n")), "`self._fp8_kv`")


@pytest.mark.parametrize(
    "escape",
    [
        'exec("self._fp8_kv = False")',
        '(lambda s: setattr(s, "_fp8_kv", False))(self)',
        'getattr(self, "__setattr__")("_fp8_kv", False)',
        "me = self\n        me._fp8_kv = False",
        "layers = (self,)\n        layers[0]._fp8_kv = False",
        "_reset_cache_mode(self)",
        'delattr(self, "_fp8_kv")',
    ],
    ids=["exec", "lambda", "getattr-setattr", "alias", "tuple", "module-function", "delattr"],
)
def test_a_flag_reached_through_self_itself_is_no_proven_flag(tmp_path: Path, escape: str) -> None:
    """``self`` handed where its attributes cannot be followed (another name, a lambda, a
    function of this file, ``exec``): check once said patched (exit 0) about each of these
    files, whose fp8 forward hands the fused op its caches (verify's semantic level fails)."""
    helper = "\n\ndef _reset_cache_mode(layer):\n    layer._fp8_kv = False\n"
    source = edit(PATCHED_RUN, (FLAG_LINE, FLAG_LINE + f"        {escape}\n"))
    assert_refused(tmp_path, source + (helper if "_reset" in escape else ""), "`self._fp8_kv`")


@pytest.mark.parametrize("escape", ['exec("self._fp8_kv = False")', "me = self\n        me._fp8_kv = False"])
def test_a_flag_reached_through_self_in_another_method_is_refused(tmp_path: Path, escape: str) -> None:
    guard = "        insert_via_fused = not self._fp8_kv\n"
    forward = PATCHED_RUN.rindex("    def forward(", 0, PATCHED_RUN.index(guard))
    method = f"    def process_weights_after_loading(self):\n        {escape}\n\n"
    assert_refused(tmp_path, PATCHED_RUN[:forward] + method + PATCHED_RUN[forward:], "set by name in process_weights")


def test_self_handed_to_vllm_or_registered_leaves_the_flag(tmp_path: Path) -> None:
    """What vLLM's layers do with ``self`` in ``__init__`` - register it in a context dict,
    hand it to an imported function, read an attribute by a literal name - sets no flag."""
    lines = (
        '        get_forward_context().no_compile_layers["mm3"] = self\n'
        "        kv_cache_dtype_str_to_dtype(self, None)\n"
        '        getattr(self, "_k_scale", None)\n'
        "        isinstance(self, nn.Module)\n"
    )
    path = tmp_path / "model.py"
    path.write_text(edit(PATCHED_RUN, (FLAG_LINE, FLAG_LINE + lines)))
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    assert [s.state.value for s in result.sites if s.state.value != "not-a-site"] == ["patched"]


def test_another_attribute_set_by_name_leaves_the_flag(tmp_path: Path) -> None:
    source = edit(PATCHED_RUN, (FLAG_LINE, FLAG_LINE + '        setattr(self, "layer_tag", 1)\n'))
    path = tmp_path / "model.py"
    path.write_text(source)
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    assert [s.state.value for s in result.sites if s.state.value != "not-a-site"] == ["patched"]


@pytest.mark.parametrize("by_name", ['setattr(self, "_fp8_kv", False)', 'self.__dict__["_fp8_kv"] = False'])
def test_a_flag_set_by_name_in_another_method_is_refused(tmp_path: Path, by_name: str) -> None:
    """vLLM calls process_weights_after_loading after __init__: a flag it sets by name is not
    the one __init__ proved (a plain `self._fp8_kv = False` there was refused already)."""
    guard = "        insert_via_fused = not self._fp8_kv\n"
    forward = PATCHED_RUN.rindex("    def forward(", 0, PATCHED_RUN.index(guard))
    method = f"    def process_weights_after_loading(self):\n        {by_name}\n\n"
    assert_refused(tmp_path, PATCHED_RUN[:forward] + method + PATCHED_RUN[forward:], "set by name in process_weights")


# --- a wired bypass whose fp8 write is wrong -----------------------------------------------------

MAIN_WRITE = "            main_slot_mapping,\n            self.kv_cache_dtype,\n"
K_SLICE = "            k = qkv[:, k0 : k0 + kv]\n"
# the main write's caches swapped: the keys land in the value cache (wired, every piece there; it fails when run)
KV_SWAP = ("            key_cache,\n            value_cache,\n", "            value_cache,\n            key_cache,\n")


@pytest.mark.parametrize(
    "edits",
    [
        [(MAIN_WRITE, '            main_slot_mapping,\n            "auto",\n')],
        [KV_SWAP],
        [("        key_cache, value_cache = self.kv_cache.unbind(1)\n", "        if key.numel() >= 0:\n            return\n        key_cache, value_cache = self.kv_cache.unbind(1)\n")],
        [(K_SLICE, "            k = qkv[:, k0 + 1 : k0 + kv + 1]\n")],
        [("            index_slot_mapping,\n            idx_dtype,\n", "            main_slot_mapping,\n            idx_dtype,\n")],
        [("        scale = self._fp8_kv_scale  # identity: stores x / 1\n", "        scale = self._fp8_kv_scale * 2\n")],
    ],
    ids=["auto-dtype", "k-v-swapped", "early-return", "k-shifted", "index-by-main-slots", "scale-2"],
)
def test_a_wired_bypass_whose_fp8_write_is_wrong_is_refused(tmp_path: Path, edits) -> None:
    """`run`'s own bypass, its write then edited by hand: every piece is there and wired, so
    check once said patched (exit 0), but the fp8 path writes the wrong rows, dtype or scale.
    Not `run`'s own any more, it is run (the semantic level) and refused; a write that may return
    first, a scale that is no identity one, or a dtype not the layer's, is refused by its shape before that."""
    early, scaled, auto = "return" in edits[0][1], "_fp8_kv_scale *" in edits[0][1], '"auto"' in edits[0][1]
    why = "may return before it writes" if early else "not proven the identity scale" if scaled else "running it fails"
    why = "kv-cache dtype not proven to be the layer's" if auto else why
    assert_refused(tmp_path, edit(PATCHED_RUN, *edits), why)


def test_a_bypass_that_is_not_runs_own_but_right_is_patched_once_run(tmp_path: Path) -> None:
    """The same program with another comment in the write: not `run`'s own (revert refuses it),
    so it is run; it passes, and check says so."""
    path = tmp_path / "model.py"
    path.write_text(edit(PATCHED_RUN, (K_SLICE, "            # the key's columns\n" + K_SLICE)))
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    (site,) = [s for s in result.sites if s.state.value != "not-a-site"]
    assert site.state.value == "patched" and "so it was run: " in site.reason, site.reason
    assert result.proof is not None and result.proof.proven


def test_a_bypass_not_runs_own_is_not_called_proven_without_torch(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setenv("MM3_CODEMOD_SERVE_CACHE", str(tmp_path / "served"))  # (no run kept by another test)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    path = tmp_path / "model.py"
    path.write_text(edit(PATCHED_RUN, KV_SWAP))
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    (site,) = [s for s in result.sites if s.state.value != "not-a-site"]
    # the step that runs it where the user stands: torch first (verify alone would not run it either)
    assert "it was not run here: torch is not installed; to run it: " in site.reason, site.reason
    assert "-m pip install torch --index-url " in site.reason and ", then mm3-codemod verify " in site.reason


def test_runs_own_bypass_is_not_run_again(tmp_path: Path, monkeypatch) -> None:
    """`run`'s own bypass (revert gives back run's input) is proven as `run` is: check runs nothing."""
    from rewriter import proof

    monkeypatch.setattr(proof, "prove_source", lambda *a: pytest.fail("ran a bypass that is run's own"))
    path = tmp_path / "model.py"
    path.write_text(PATCHED_RUN)
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    assert [s.state.value for s in result.sites if s.state.value != "not-a-site"] == ["patched"]


def test_the_way_out_of_a_wired_bypass_that_fails_works_as_written(tmp_path: Path) -> None:
    """The refusal names two commands; run as written where the file is, they leave `run`'s own
    bypass, which check calls patched."""
    path = tmp_path / "model.py"
    path.write_text(edit(PATCHED_RUN, KV_SWAP))
    proc = subprocess.run([sys.executable, "-m", "rewriter", "check", "model.py"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    steps = re.findall(r"`(mm3-codemod [^`]+)`", proc.stderr.split("Mend it by hand", 1)[1])
    assert [s.split()[1] for s in steps] == ["revert", "run"], proc.stderr
    for step in steps:
        done = subprocess.run([sys.executable, "-m", "rewriter", *shlex.split(step)[1:]], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    assert [s.state.value for s in result.sites if s.state.value != "not-a-site"] == ["patched"]


def test_a_flag_set_in_a_tuple_assignment_is_the_flag(tmp_path: Path) -> None:
    """``self._fp8_kv, self.x = "fp8" in d, 1``: check once said `self._fp8_kv` was read but never
    set (half-applied) about a file that sets it; now it is the flag, read by its value."""
    site = checked_site(tmp_path, edit(PATCHED_RUN, (FLAG_LINE, '        self._fp8_kv, self.layer_tag = "fp8" in self.kv_cache_dtype, 1\n')))
    assert site.state.value == "patched" and "never set" not in site.reason, site.reason


RESET = "    def _reset_cache_mode(self):\n        self._fp8_kv = False\n\n"


def with_method(source: str, method: str) -> str:
    """``source`` with ``method`` (a def's text) in the sparse layer, before ``forward``."""
    forward = source.rindex("    def forward(", 0, source.index("        insert_via_fused = not"))
    return source[:forward] + method + source[forward:]


def with_set_mode(source: str) -> str:
    """``source`` with a method that sets the flag to its argument."""
    return with_method(source, "    def _set_mode(self, enabled=True):\n        self._fp8_kv = enabled\n\n")


def checked_site(tmp_path: Path, source: str) -> InsertSite:
    """``check``'s one insert site in ``source`` (its not-a-site calls left out)."""
    path = tmp_path / "model.py"
    path.write_text(source)
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    (site,) = [s for s in result.sites if s.state.value != "not-a-site"]
    return site


@pytest.mark.parametrize(
    "reset",
    [
        "for _ in range(1):\n            self._reset_cache_mode()",
        "try:\n            self._reset_cache_mode()\n        except Exception:\n            pass",
        "while not hasattr(self, '_seen'):\n            self._seen = self._reset_cache_mode()",
    ],
    ids=["loop", "try", "while"],
)
def test_a_method_resetting_the_flag_from_a_compound_statement_is_refused(tmp_path: Path, reset: str) -> None:
    """A method of the class that sets the flag again, called inside a loop or a ``try``: the
    reading forgot only what the statement itself binds, so the flag kept its assignment's value
    (patched by structure, about a file whose fp8 forward hands the fused op its caches)."""
    source = edit(PATCHED_RUN, (FLAG_LINE, FLAG_LINE + f"        {reset}\n"))
    assert_refused(tmp_path, with_method(source, RESET), "set in __init__ to")


def test_a_def_in_init_that_sets_the_flag_later_is_refused(tmp_path: Path) -> None:
    """A closure defined in ``__init__`` that stores the flag may run at any time after it."""
    closure = "        def reset():\n            self._fp8_kv = False\n\n"
    source = edit(PATCHED_RUN, (FLAG_LINE, closure + FLAG_LINE + "        reset()\n"))
    assert_refused(tmp_path, source, "`self._fp8_kv`")


@pytest.mark.parametrize(
    "decided",
    [
        'try:\n            self._fp8_kv = "fp8" in self.kv_cache_dtype\n        except Exception:\n            self._fp8_kv = False\n',
        'self._fp8_kv = False\n        for d in ("fp8", "fp8_e4m3", "fp8_e5m2"):\n            if self.kv_cache_dtype == d:\n                self._fp8_kv = True\n',
        'match self.kv_cache_dtype:\n            case "auto" | "bfloat16":\n                self._fp8_kv = False\n            case _:\n                self._fp8_kv = True\n',
        'if (quantized := "fp8" in self.kv_cache_dtype):\n            pass\n        self._fp8_kv = quantized\n',
        'self._fp8_kv = False\n        while not self._fp8_kv and "fp8" in self.kv_cache_dtype:\n            self._fp8_kv = True\n',
        'self._set_mode(enabled="fp8" in self.kv_cache_dtype)\n',
        'self._fp8_kv = any(self.kv_cache_dtype == d for d in ("fp8", "fp8_e4m3", "fp8_e5m2"))\n',
    ],
    ids=["try", "for", "match", "walrus", "while", "method-by-keyword", "any"],
)
def test_a_flag_decided_by_try_for_or_match_is_the_flag(tmp_path: Path, decided: str) -> None:
    """The same program as ``self._fp8_kv = "fp8" in self.kv_cache_dtype``: a ``try`` whose body
    cannot raise, a loop over the fp8 dtypes, a ``match`` on the dtype, a ``:=``, a ``while`` that
    ends, a method called with a keyword, ``any`` over the fp8 dtypes. Each was refused as unproven."""
    source = edit(PATCHED_RUN, (FLAG_LINE, "        " + decided))
    site = checked_site(tmp_path, with_set_mode(source) if "_set_mode" in decided else source)
    assert site.state.value == "patched", site.reason


@pytest.mark.parametrize(
    "loop",
    [
        'while "fp8" in self.kv_cache_dtype:\n            self._fp8_kv = True\n',
        'while True:\n            self._fp8_kv = "fp8" in self.kv_cache_dtype\n            break\n',
        'self._set_mode(enabled="fp8" in self.kv_cache_dtype, extra=1)\n',
    ],
    ids=["never-ends", "break", "unknown-keyword"],
)
def test_a_flag_whose_loop_or_call_the_reading_cannot_follow_is_refused(tmp_path: Path, loop: str) -> None:
    """A ``while`` still running after the reading's rounds, one left by ``break``, a call that
    binds no parameter of the method: what they bind is not known, so the flag is not proven."""
    source = edit(PATCHED_RUN, (FLAG_LINE, FLAG_LINE + "        " + loop))
    assert_refused(tmp_path, with_set_mode(source) if "_set_mode" in loop else source, "`self._fp8_kv`")


@pytest.mark.parametrize("args", ["k, v, index_k", "k, v, index_k, main_slot_mapping, main_slot_mapping"])
def test_a_post_call_write_that_lost_its_slots_is_found_by_its_shape(tmp_path: Path, args: str) -> None:
    """The post-call block calls the write method without the call's slot mappings: under the
    tool's names it was refused, under a fork's names called half-applied -> complete (``run``
    then added a second write beside the broken one). By the method's shape, both are refused."""
    post = "self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)"
    broken = edit(PATCHED, (post, f"self._insert_kv({args})"))
    renamed = broken.replace("_insert_kv", "_store_kv").replace("_fp8_kv", "_quant_kv")
    assert_refused(tmp_path, broken, "a post-call `self._insert_kv(...)` exists")
    assert_refused(tmp_path, renamed, "a post-call `self._store_kv(...)` exists")


SPARSE = "class MiniMaxM3SparseAttention(nn.Module, AttentionLayerBase):\n"


def with_mixin(source: str, body: str) -> str:
    """``source`` with the sparse layer inheriting from a class of the same file holding ``body``."""
    layer = SPARSE.replace("AttentionLayerBase)", "AttentionLayerBase, _CacheModeMixin)")
    return edit(source, (SPARSE, f"class _CacheModeMixin:\n{body}\n\n{layer}"))


def test_a_flag_set_by_a_mixins_method_is_the_flag(tmp_path: Path) -> None:
    """``self._set_cache_mode()`` in ``__init__``, the method defined in a base class of the same
    file: check said half-applied, "`self._fp8_kv` is read but never set (AttributeError at
    runtime)", about a file that runs, and `run` wrote a second assignment of the flag."""
    setter = '    def _set_cache_mode(self):\n        self._fp8_kv = "fp8" in self.kv_cache_dtype\n'
    site = checked_site(tmp_path, with_mixin(edit(PATCHED_RUN, (FLAG_LINE, "        self._set_cache_mode()\n")), setter))
    assert site.state.value == "patched", site.reason


@pytest.mark.parametrize(
    "body, why",
    [
        ("    _fp8_kv_scale = 1.0\n", "`_fp8_kv_scale` is defined in the body of _CacheModeMixin"),
        ("    def _insert_kv(self, *args):\n        raise NotImplementedError\n", "`_insert_kv` is defined in the body of _CacheModeMixin"),
        ("    def _fp8_kv(self):\n        return False\n", "`_fp8_kv` is defined in the body of _CacheModeMixin"),
    ],
    ids=["scale", "write-method", "flag"],
)
def test_a_name_run_writes_that_a_base_class_defines_is_refused(tmp_path: Path, body: str, why: str) -> None:
    """A base class of the same file that binds a name `run` would write: `run` wrote the bypass
    anyway - with the scale, a file whose every layer fails to build (``register_buffer`` refuses
    a name the object already has)."""
    assert_refused(tmp_path, with_mixin(FORK_ERA, body), why)


def test_a_mixins_method_that_resets_the_flag_is_refused(tmp_path: Path) -> None:
    """A base class's method that sets the flag again: set once in ``__init__`` no longer holds
    (a method of the class itself was refused so; a base class's went unseen: patched)."""
    source = with_mixin(PATCHED_RUN, "    def reset_cache_mode(self):\n        self._fp8_kv = False\n")
    assert_refused(tmp_path, source, "`self._fp8_kv = False` in reset_cache_mode")


def test_a_guard_the_reading_cannot_decide_is_not_called_unassigned(tmp_path: Path) -> None:
    """A native call's stale guard assigned from ``torch.compiler.is_exporting()`` (not the compile
    test): check said the guard "is read by the call but never assigned: every forward raises
    NameError" about a file that assigns it on the line before. It is refused, saying what is so."""
    source = (FIXTURES / "compiled_native" / "model.py").read_text()
    source = source.replace("torch.compiler.is_compiling()", "torch.compiler.is_exporting()")
    checked, ran, reason = outcome(tmp_path, source)
    assert (checked, ran) == ("refused", "refused"), reason
    assert "never assigned" not in reason and "NameError" not in reason, reason


FLAG_IF_FP8 = '        if "fp8" in self.kv_cache_dtype:\n            self._fp8_kv = True\n'


@pytest.mark.parametrize("where", ["class", "mixin"])
def test_a_flag_defaulted_by_a_class_attribute_is_the_flag(tmp_path: Path, where: str) -> None:
    """``_fp8_kv: bool = False`` in the class body (or a base class's), set true in ``__init__`` for
    an fp8 cache: the same program as one assignment. It was refused ("defined in the class
    body"); and verify's stand-in, which built the class from its methods alone, read no default."""
    source = edit(PATCHED_RUN, (FLAG_LINE, FLAG_IF_FP8))
    source = edit(source, (SPARSE, SPARSE + "    _fp8_kv: bool = False\n")) if where == "class" else with_mixin(source, "    _fp8_kv = False\n")
    site = checked_site(tmp_path, source)
    assert site.state.value == "patched", site.reason
    assert "bf16 and fp8 cache runs agree" in site.reason, site.reason  # proven by running it


@pytest.mark.parametrize("default", ["", "    _fp8_kv = True\n"], ids=["none", "true"])
def test_a_flag_whose_class_default_is_missing_or_wrong_is_refused(tmp_path: Path, default: str) -> None:
    """Set only for fp8, with no default (AttributeError under "auto") or a default of True."""
    source = edit(PATCHED_RUN, (FLAG_LINE, FLAG_IF_FP8))
    assert_refused(tmp_path, edit(source, (SPARSE, SPARSE + default)) if default else source, "`self._fp8_kv`")


PROPERTY = "    @property\n    def _fp8_kv(self) -> bool:\n        return {}\n\n"


def test_a_flag_that_is_a_property_is_read_by_its_value(tmp_path: Path) -> None:
    """``@property def _fp8_kv(self): return "fp8" in self.kv_cache_dtype``, read by the guard: the
    same program as the assignment, refused ("`_fp8_kv` is defined in the class body"). One true
    only for "fp8" is still refused; `run` never writes an assignment to a property."""
    source = with_method(edit(PATCHED_RUN, (FLAG_LINE, "")), PROPERTY.format('"fp8" in self.kv_cache_dtype'))
    site = checked_site(tmp_path, source)
    assert site.state.value == "patched", site.reason
    assert "bf16 and fp8 cache runs agree" in site.reason, site.reason  # proven by running it
    wrong = with_method(edit(PATCHED_RUN, (FLAG_LINE, "")), PROPERTY.format('self.kv_cache_dtype == "fp8"'))
    assert_refused(tmp_path, wrong, "`_fp8_kv` is defined in the class body")


def test_a_property_no_guard_reads_is_no_piece_of_a_bypass(tmp_path: Path) -> None:
    """An fp8 property that no guard reads is the class's own API, not a flag: a native file
    carrying one stays native (its strip would delete the property), a fork-era one needs the
    bypass (written with a flag of its own)."""
    prop = PROPERTY.replace("_fp8_kv", "uses_fp8_cache").format('self.kv_cache_dtype.startswith("fp8")')
    for source, state in (((FIXTURES / "native" / "model.py").read_text(), "native"), (FORK_ERA, "needs-bypass")):
        forward = source.index("    def forward(", source.index("class MiniMaxM3SparseAttention"))
        assert checked_site(tmp_path, source[:forward] + prop + source[forward:]).state.value == state


def test_a_property_flag_of_a_base_class_is_refused_alike_by_check_and_revert(tmp_path: Path) -> None:
    """The flag a property of a mixin: `check` said patched, while `revert` took the guard and
    the write out, left the property, and its second pass failed ("rewrite failed validation"):
    two reasons. Both now give one: a base class's property is not revert's to remove."""
    source = with_mixin(edit(PATCHED_RUN, (FLAG_LINE, "")), PROPERTY.format('"fp8" in self.kv_cache_dtype').rstrip("\n"))
    why = "the flag `_fp8_kv` is a property of a base class"
    site = checked_site(tmp_path, source)
    assert site.state.value == "patched" and f"`revert` cannot take it out: {why}" in site.reason, site.reason
    (path := tmp_path / "model.py").write_text(source)
    (result,) = commands.write_targets("revert", [Target(path, "t")]).files
    (refused,) = [s for s in result.sites if s.state.value == "patched"]
    assert result.status is FileStatus.REFUSED and why in refused.reason, refused.reason


@pytest.mark.parametrize(
    "imports, callee, proof",
    [
        ("import vllm._custom_ops\n", "vllm._custom_ops.fused", "passed"),
        ("from torch import ops as torch_ops\n", "torch_ops._C.fused", "passed"),
        ("import my_fork.kernels as kernels\n", "kernels.fused", "skipped"),
    ],
    ids=["dotted-custom-ops", "torch-ops-alias", "unknown-module"],
)
def test_the_op_reached_through_another_import_is_run_or_unproven_never_failed(
    tmp_path: Path, imports: str, callee: str, proof: str
) -> None:
    """The fused op called through a name verify's stand-in did not model: it made the name up, the
    call wrote nothing, and `run` refused a right rewrite ("the rewrite failed its proof: bf16 run
    never called the fused op"). Such a name is now modelled, or the proof says it cannot run."""
    source = edit(FORK_ERA, ("from vllm import _custom_ops as ops\n", imports + "from vllm import _custom_ops as ops\n"))
    (path := tmp_path / "model.py").write_text(edit(source, (CALL, CALL.replace("ops.fused", callee))))
    (result,) = commands.write_targets("run", [Target(path, "t")]).files
    assert result.status is FileStatus.REWRITTEN, result.error
    assert result.proof is not None and result.proof.status == proof, result.proof


def test_a_property_flag_whose_reading_a_method_changes_is_refused(tmp_path: Path) -> None:
    """The property reads ``self._cache_mode``, set in ``__init__`` and again by another method: the
    flag changes after ``__init__`` (an assigned flag set again so is refused). It was patched."""
    source = edit(PATCHED_RUN, (FLAG_LINE, "        self._cache_mode = self.kv_cache_dtype\n"))
    reset = '    def reset_mode(self):\n        self._cache_mode = "auto"\n\n'
    source = with_method(source, PROPERTY.format('"fp8" in self._cache_mode') + reset)
    assert_refused(tmp_path, source, '`self._cache_mode = "auto"` in reset_mode')
    assert checked_site(tmp_path, source.replace(reset, "")).state.value == "patched"  # set in __init__ alone: the flag


DTYPE_FROM_CONFIG = '        self.kv_cache_dtype = (\n            cache_config.cache_dtype if cache_config is not None else "auto"\n        )\n'


def test_a_local_the_dtype_was_read_from_is_the_dtype_until_bound_again(tmp_path: Path) -> None:
    """``kv_cache_dtype`` set in both branches of an ``if`` (vLLM's own layers do so), then
    ``self.kv_cache_dtype = kv_cache_dtype``: the flag ``"fp8" in kv_cache_dtype`` is the flag. Bound
    again after that (``kv_cache_dtype = "auto"``), the local is a plain local: the reading held it
    to the cache dtype still and called a flag false for every dtype proven."""
    local = (
        "        if cache_config is not None:\n            kv_cache_dtype = cache_config.cache_dtype\n"
        '        else:\n            kv_cache_dtype = "auto"\n        self.kv_cache_dtype = kv_cache_dtype\n'
    )
    source = edit(PATCHED_RUN, (DTYPE_FROM_CONFIG, local), (FLAG_LINE, FLAG_LINE.replace("self.kv_cache_dtype", "kv_cache_dtype")))
    assert checked_site(tmp_path, source).state.value == "patched"
    rebound = edit(source, (local, local + '        kv_cache_dtype = "auto"\n'))
    assert_refused(tmp_path, rebound, 'set in __init__ to `"fp8" in kv_cache_dtype`, which cannot be proven')


@pytest.mark.parametrize("value, state", [("self.kv_cache_dtype", "native"), ('"auto"', "unsupported")])
def test_a_native_dtype_through_a_property_is_read_by_its_value(tmp_path: Path, value: str, state: str) -> None:
    """A native call passing ``self.cache_dtype``, a property returning the cache dtype: it holds
    the cache dtype for every dtype, so the call is native (it was refused as unproven); one that
    returns "auto" tells the kernel another dtype, and is refused."""
    native = (FIXTURES / "native" / "model.py").read_text()
    prop = f"    @property\n    def cache_dtype(self) -> str:\n        return {value}\n\n"
    forward = native.index("    def forward(", native.index("class MiniMaxM3SparseAttention"))
    source = native[:forward] + prop + native[forward:]
    source = edit(source, ("            self.kv_cache_dtype,\n        )", "            self.cache_dtype,\n        )"))
    assert checked_site(tmp_path, source).state.value == state


GUARD_LINE = "        insert_via_fused = not self._fp8_kv\n"


def test_a_guard_reading_the_flag_by_getattr_is_the_guard(tmp_path: Path) -> None:
    """``not getattr(self, "_fp8_kv", False)`` is ``not self._fp8_kv`` where ``__init__`` sets the
    flag for every dtype: it was refused ("a condition the bypass did not write")."""
    source = edit(PATCHED_RUN, (GUARD_LINE, GUARD_LINE.replace("self._fp8_kv", 'getattr(self, "_fp8_kv", False)')))
    site = checked_site(tmp_path, source)
    assert site.state.value == "patched", site.reason
    assert "bf16 and fp8 cache runs agree" in site.reason, site.reason  # proven by running it


@pytest.mark.parametrize("default", ["False", "True", "self.kv_cache_dtype"])
def test_a_getattr_guard_whose_default_could_stand_is_refused(tmp_path: Path, default: str) -> None:
    """Set only for fp8, the default stands under "auto" (True: the fused op never writes a bf16
    cache); a default that is not a constant is not read as the attribute at all."""
    source = edit(PATCHED_RUN, (FLAG_LINE, FLAG_IF_FP8))
    guard = GUARD_LINE.replace("self._fp8_kv", f'getattr(self, "_fp8_kv", {default})')
    assert_refused(tmp_path, edit(source, (GUARD_LINE, guard)), "`self._fp8_kv")


def test_a_getattr_guard_of_an_attribute_nothing_sets_is_completed(tmp_path: Path) -> None:
    """``getattr(self, "_fp8_kvv", False)`` (a typo): the fp8 forward would hand the fused op its
    caches; never `patched`, and `run` sets the attribute the guard reads."""
    source = edit(PATCHED_RUN, (GUARD_LINE, GUARD_LINE.replace("self._fp8_kv", 'getattr(self, "_fp8_kvv", False)')))
    site = checked_site(tmp_path, source)
    assert (site.state.value, site.action.value) == ("half-applied", "complete"), site.reason
    assert "`self._fp8_kvv` set in __init__" in site.reason, site.reason


IF_ELSE = "        if self._fp8_kv:\n            insert_via_fused = {}\n        else:\n            insert_via_fused = {}\n"


@pytest.mark.parametrize(
    "guard",
    [
        IF_ELSE.format("False", "True"),
        "        if self._fp8_kv: insert_via_fused = False\n        else: insert_via_fused = True\n",
    ],
    ids=["blocks", "one-line-suites"],
)
def test_a_guard_decided_by_if_else_is_the_guard_and_revert_takes_it_out(tmp_path: Path, guard: str) -> None:
    """``if self._fp8_kv: G = False`` / ``else: G = True`` is ``G = not self._fp8_kv``: it was
    refused ("a condition the bypass did not write"); revert --whole-bypass takes the ``if`` out."""
    source = edit(PATCHED_RUN, (GUARD_LINE, guard))
    site = checked_site(tmp_path, source)
    assert site.state.value == "patched", site.reason
    assert "bf16 and fp8 cache runs agree" in site.reason, site.reason  # proven by running it
    reverted = plan_revert_file(tmp_path / "model.py", whole_bypass=True)
    assert reverted.new is not None, reverted.error
    assert ast.dump(ast.parse(reverted.new)) == ast.dump(ast.parse((FIXTURES / "fork_era" / "model.py").read_text()))


@pytest.mark.parametrize(
    "guard",
    [
        IF_ELSE.format("True", "False"),  # the wrong way round: the fused op writes an fp8 cache
        "        insert_via_fused = True\n        if self._fp8_kv:\n            insert_via_fused = False\n",
        IF_ELSE.format("False\n            print('fp8')", "True"),
        "        if self._fp8_kv: insert_via_fused = False; print('fp8')\n        else: insert_via_fused = True\n",
    ],
    ids=["reversed", "no-else", "two-statements", "two-small-statements"],
)
def test_a_guard_if_else_that_is_not_the_guard_is_refused(tmp_path: Path, guard: str) -> None:
    assert_refused(tmp_path, edit(PATCHED_RUN, (GUARD_LINE, guard)), "insert_via_fused")


# --- the post-call write: right after the call, nothing leaving before it --------------------------

EXPECTED = (FIXTURES / "fork_era" / "expected.py").read_text()
POST_END = "            self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)\n"
ATTEND = "\n        output = torch.empty_like(q)\n        attn_output = self._run_attention(q, index_q, output)\n"
POST_START = "        if not insert_via_fused:\n"


def _write_after_attention(source: str) -> str:
    """The whole post-call block moved below attention (a merge that kept both, in the wrong order)."""
    start, end = source.rindex(POST_START), source.rindex(POST_END) + len(POST_END)
    block = source[start:end]
    source = source[:start] + source[end:]
    return edit(source, (ATTEND, ATTEND + block))


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(_write_after_attention, id="write-after-attention"),
        pytest.param(lambda s: edit(s, (POST_START, "        if num_tokens == 1:\n            return q\n" + POST_START)),
                     id="early-return-between"),
        pytest.param(lambda s: edit(s, (POST_END, "            if num_tokens > 4096:\n                return q\n" + POST_END)),
                     id="return-in-block"),
    ],
)
def test_a_write_that_may_come_too_late_or_never_is_not_patched(tmp_path: Path, variant) -> None:
    """With an fp8 cache, attention must read the caches after the fp8 write, and every batch must
    write: a post-call block below attention, or one a `return` can leave first, is not wired."""
    source = variant(EXPECTED)
    assert_refused(tmp_path, source, "is not wired")
    assert "right after the call" in outcome(tmp_path, source)[2]


def test_a_native_call_whose_caches_hang_on_the_dtype_is_refused(tmp_path: Path) -> None:
    """Cache arguments `X if self.kv_cache_dtype == "auto" else None` on a native call: with an fp8
    cache the kernel is handed no cache and writes nothing (the caller's own condition stays native,
    above)."""
    native = edit(
        FORK_ERA,
        (KV_ARG, KV_ARG.replace(",\n", ' if self.kv_cache_dtype == "auto" else None,\n')),
        ("            index_q,\n        )\n\n        output", "            index_q,\n            self.kv_cache_dtype,\n        )\n\n        output"),
    )
    assert_refused(tmp_path, native, "has a condition the bypass did not write")


def test_a_write_method_that_may_return_first_is_not_the_bypass(tmp_path: Path) -> None:
    """`_insert_kv` returning early for one batch size (a decode fast path, say): with an fp8 cache
    those batches are never written, so the file is not patched."""
    body = "        key_cache, value_cache = self.kv_cache.unbind(1)\n"
    source = edit(EXPECTED, (body, "        if key.shape[0] == 1:\n            return\n" + body))
    assert_refused(tmp_path, source, "may return before it writes")


@pytest.mark.parametrize(
    "placeholder",
    [
        pytest.param('        self.kv_cache_dtype = "auto"\n        self._fp8_kv = "fp8" in self.kv_cache_dtype\n', id="flag-before-the-dtype"),
        pytest.param('        self.kv_cache_dtype = "auto"\n        self.kernel_dtype = self.kv_cache_dtype\n', id="copy-before-the-dtype"),
    ],
)
def test_what_init_reads_before_it_sets_the_dtype_is_not_the_dtype(tmp_path: Path, placeholder: str) -> None:
    """``self.kv_cache_dtype = "auto"`` first, the flag (or the native call's dtype) read from it, the
    real dtype set after: the flag is false (the dtype "auto") for every cache dtype. The reading held
    the attribute at the cache dtype all through __init__ and called the file patched (or native)."""
    if "_fp8_kv" in placeholder:
        source = edit(EXPECTED, ('        self._fp8_kv = "fp8" in self.kv_cache_dtype\n', ""), (DTYPE, placeholder + DTYPE))
        why = "the flag's role is not proven"
    else:
        native = (FIXTURES / "native" / "model.py").read_text()
        source = edit(native, ("            self.kv_cache_dtype,\n        )", "            self.kernel_dtype,\n        )"))
        source = edit(source, ("        self.kv_cache_dtype = cache_config.cache_dtype\n",
                               placeholder + "        self.kv_cache_dtype = cache_config.cache_dtype\n"))
        why = "cannot be proven to be the cache dtype"
    assert_refused(tmp_path, source, why)


@pytest.mark.parametrize(
    "call, state",
    [
        ("self._insert_kv(k, v, index_k, index_slot_mapping=index_slot_mapping, main_slot_mapping=main_slot_mapping)", "patched"),
        ("self._insert_kv(key=k, value=v, index_key=index_k, main_slot_mapping=main_slot_mapping, index_slot_mapping=index_slot_mapping)", "patched"),
        ("self._insert_kv(k, v, index_k, index_slot_mapping=main_slot_mapping, main_slot_mapping=index_slot_mapping)", "unsupported"),
        ("self._insert_kv(k, v, index_k, main_slot_mapping, main_slot_mapping=index_slot_mapping)", "unsupported"),
    ],
)
def test_the_write_call_is_bound_as_python_binds_it(tmp_path: Path, call: str, state: str) -> None:
    """The post-call write handed the slot mappings by keyword, in any order, is wired (it was
    refused); the same keywords swapped, or an argument given twice, are not."""
    source = edit(EXPECTED, (POST_END, f"            {call}\n"))
    assert checked_site(tmp_path, source).state.value == state


def test_a_guard_bound_before_the_block_that_holds_the_call(tmp_path: Path) -> None:
    """``G = not self.F`` before a ``with`` that holds the call and the post-call block: the guard's
    value is what that binding leaves (it was refused: the condition the bypass did not write)."""
    start = EXPECTED.rindex(CALL)
    end = EXPECTED.rindex(POST_END) + len(POST_END)
    body = "".join("    " + line if line.strip() else line for line in EXPECTED[start:end].splitlines(keepends=True))
    source = EXPECTED[:start] + "        with torch.no_grad():\n" + body + EXPECTED[end:]
    assert checked_site(tmp_path, source).state.value == "patched"
    rebound = edit(source, ("        with torch.no_grad():\n", "        with torch.no_grad():\n            insert_via_fused = True\n"))
    assert checked_site(tmp_path, rebound).state.value == "unsupported"  # bound again inside: not proven


def test_a_scale_under_the_forks_own_name_is_the_scale_by_its_role(tmp_path: Path) -> None:
    """The identity scale `__init__` makes and the write method reads is the scale whatever it is
    called: `revert --whole-bypass` took out every piece but a renamed scale (found by `run`'s name)."""
    source = PATCHED_RUN.replace("_fp8_kv_scale", "_unit_scale")
    assert checked_site(tmp_path, source).state.value == "patched"
    reverted = plan_revert_file(tmp_path / "model.py", whole_bypass=True)
    assert reverted.new is not None, reverted.error
    assert ast.dump(ast.parse(reverted.new)) == ast.dump(ast.parse((FIXTURES / "fork_era" / "model.py").read_text()))
    # another `torch.ones` the write method does not read is not the scale
    other = edit(source, ("        self._fp8_kv = ", "        self._spare = torch.ones(())\n        self._fp8_kv = "))
    assert checked_site(tmp_path, other).state.value == "patched"
    assert b"self._spare" in (plan_revert_file(tmp_path / "model.py", whole_bypass=True).new or b"")


# --- hunt 45: merges, compile-test spellings, re-runs, subclasses, wrappers ---------------------------

COMPILED = (FIXTURES / "compiled_native" / "model.py").read_text()
COMPILE_TEST = "torch.compiler.is_compiling()"
STALE = (FIXTURES / "native_stale_bypass" / "model.py").read_text()


@pytest.mark.parametrize(
    "header, spelled",
    [
        ("_compiling = torch.compiler.is_compiling\n", "_compiling()"),
        ("_tc = torch.compiler\n", "_tc.is_compiling()"),
        ("def _in_compile() -> bool:\n    return torch.compiler.is_compiling()\n", "_in_compile()"),
    ],
    ids=["function-alias", "module-alias", "helper-function"],
)
def test_the_compile_test_through_an_alias_or_a_helper_is_the_compile_test(tmp_path: Path, header: str, spelled: str) -> None:
    """A module-level alias of `torch.compiler.is_compiling` (or of `torch.compiler`), or a function
    returning it, is the compile test: the file is read as the fixture is (it was refused, with advice to
    pass the cache unconditionally that breaks the compiled path)."""
    source = COMPILED.replace(COMPILE_TEST, spelled).replace("\nclass ", "\n" + header + "\n\nclass ", 1)
    assert checked_site(tmp_path, source).state == checked_site(tmp_path, COMPILED).state


def test_an_imported_compile_test_the_file_binds_again_is_not_the_compile_test(tmp_path: Path) -> None:
    """`from torch.compiler import is_compiling`, then a `def is_compiling()` of the file's own: the name
    is the file's function (always False here), not torch's: no compile-aware bypass."""
    source = COMPILED.replace(COMPILE_TEST, "is_compiling()").replace(
        "\nclass ", "\nfrom torch.compiler import is_compiling\n\n\ndef is_compiling() -> bool:\n    return False\n\n\nclass ", 1
    )
    site = checked_site(tmp_path, source)
    assert "torch.compile-aware" not in site.reason, site.reason
    assert site.action.value in ("refuse", "strip"), site.reason


def test_advice_never_passes_a_cache_whose_slot_mappings_may_be_none(tmp_path: Path) -> None:
    """A guard the tool cannot read, on a call whose slot mappings are None while compiling: passing the
    cache unconditionally fails there too, so the refusal does not advise it."""
    source = COMPILED.replace(COMPILE_TEST, "torch.cuda.is_current_stream_capturing()")
    site = checked_site(tmp_path, source)
    assert site.action.value == "refuse"
    assert "Pass the cache unconditionally" not in site.reason and "None on some path" in site.reason, site.reason


def test_a_flag_read_through_another_object_is_not_stripped(tmp_path: Path) -> None:
    """The decoder layer reads the attention layer's stale flag (`self.self_attn._fp8_kv`): taking the
    flag out would raise AttributeError there, so the strip is refused, naming that read."""
    reader = "    def uses_fp8(self) -> bool:\n        return self.self_attn._fp8_kv\n\n\n"
    source = STALE.replace("\nclass MiniMaxM3Attention", "\nclass Reader(nn.Module):\n" + reader + "class MiniMaxM3Attention", 1)
    assert checked_site(tmp_path, STALE).action.value == "strip"
    site = checked_site(tmp_path, source)
    assert site.action.value == "refuse" and "`self.self_attn._fp8_kv`" in site.reason, site.reason


def test_a_write_method_called_but_inherited_from_elsewhere_is_not_added(tmp_path: Path) -> None:
    """The post-call block calls `self._insert_kv`, which a base imported from another module may
    define: `run` would add an `_insert_kv` over it. Refused, naming the base."""
    start = PATCHED_RUN.index("    def _insert_kv(")
    end = PATCHED_RUN.index("    def forward(", start)
    source = PATCHED_RUN[:start] + PATCHED_RUN[end:]
    source = source.replace("(nn.Module, AttentionLayerBase)", "(nn.Module, AttentionLayerBase, KVWriter)")
    source = source.replace("\nclass ", "\nfrom vllm.fp8_kv import KVWriter\n\n\nclass ", 1)
    site = checked_site(tmp_path, source)
    assert site.action.value == "refuse" and "`KVWriter`" in site.reason, site.reason


def test_an_unread_second_flag_goes_with_the_bypass(tmp_path: Path) -> None:
    """`run`'s output with a second fp8 flag nobody reads (a half rename): `check` said patched and
    `revert` failed its own second pass; now both say why revert refuses, and --whole-bypass takes both out."""
    flag = '        self._fp8_kv = "fp8" in self.kv_cache_dtype\n'
    source = edit(PATCHED_RUN, (flag, flag + '        self._kv_is_fp8 = "fp8" in self.kv_cache_dtype\n'))
    site = checked_site(tmp_path, source)
    reverted = plan_revert_file(tmp_path / "model.py")
    assert site.state.value == "patched" and reverted.status is FileStatus.REFUSED, reverted.error
    why = reverted.sites[-1].reason.removeprefix("cannot revert: ")
    assert why[:80] in site.reason, (why, site.reason)
    whole = plan_revert_file(tmp_path / "model.py", whole_bypass=True)
    assert whole.new is not None and b"_kv_is_fp8" not in whole.new, whole.error


@pytest.mark.parametrize("redefined", ["_insert_kv", "__init__"])
def test_a_subclass_that_redefines_a_piece_is_refused(tmp_path: Path, redefined: str) -> None:
    """A class of the file deriving from the layer and redefining its write method (the raw scatter,
    say) or `__init__` (setting the flag False after `super().__init__`) builds a layer the bypass was
    not proven with: `check` called the file patched."""
    body = {
        "_insert_kv": "    def _insert_kv(self, key, value, index_key, main_slot_mapping, index_slot_mapping):\n        pass\n",
        "__init__": "    def __init__(self, *args, **kwargs):\n        super().__init__(*args, **kwargs)\n        self._fp8_kv = False\n",
    }[redefined]
    source = PATCHED_RUN.replace("\nclass MiniMaxM3DecoderLayer", f"\nclass Sub(MiniMaxM3SparseAttention):\n{body}\n\nclass MiniMaxM3DecoderLayer", 1)
    site = next(s for s in sites_of(tmp_path, source) if s.class_name == "MiniMaxM3SparseAttention" and s.state.value != "not-a-site")
    assert site.action.value == "refuse" and f"redefines `{redefined}`" in site.reason, site.reason


def test_a_wrapper_whose_dtype_parameter_defaults_to_auto_is_not_fork_era(tmp_path: Path) -> None:
    """A pass-through wrapper with `kv_cache_dtype="auto"` as a default, called without it: the op gets
    "auto", as if written out (refused); it was called fork-era and given the fork-era bypass."""
    params = "qkv q_norm_weight k_norm_weight cos_sin_cache positions num_heads num_kv_heads rotary_dim eps "
    params += "index_q_norm_weight index_k_norm_weight num_index_heads slot_mapping index_slot_mapping kv_cache "
    params += "index_cache block_size q_out index_q_out"
    names = ", ".join(params.split())
    wrapper = f'def _run({names}, kv_cache_dtype="auto"):\n    ops.fused_minimax_m3_qknorm_rope_kv_insert({names}, kv_cache_dtype)\n'
    source = FORK_ERA.replace(CALL, "        _run(\n").replace("\nclass ", "\n" + wrapper + "\n\nclass ", 1)
    site = next(s for s in sites_of(tmp_path, source) if s.class_name is not None and s.state.value != "not-a-site")
    assert site.action.value == "refuse" and 'kv_cache_dtype="auto"' in site.reason, site.reason
    plain = source.replace(', kv_cache_dtype="auto"):', "):").replace(", kv_cache_dtype)", ")")
    assert [s.state.value for s in sites_of(tmp_path, plain) if s.class_name and s.state.value != "not-a-site"] == ["needs-bypass"]


def sites_of(tmp_path: Path, source: str) -> list[InsertSite]:
    path = tmp_path / "model.py"
    path.write_text(source)
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    return result.sites


def test_a_call_under_an_nvtx_range_is_rewritten_and_proven_on_cpu(tmp_path: Path) -> None:
    """`with torch.cuda.nvtx.range(...)` around the call: a profiler's label, no value changes. CPU torch
    raises on NVTX, so the proof failed in the unchanged bf16 path and `run` refused a file `check`
    said it would rewrite; on the stand-in NVTX does nothing where there is no CUDA."""
    start = FORK_ERA.rindex(CALL)
    end = FORK_ERA.index("        )\n", start) + len("        )\n")
    body = "".join("    " + line if line.strip() else line for line in FORK_ERA[start:end].splitlines(keepends=True))
    source = FORK_ERA[:start] + '        with torch.cuda.nvtx.range("qknorm_rope_kv_insert"):\n' + body + FORK_ERA[end:]
    after = assert_rewritten_right(tmp_path, source)
    assert "nvtx.range" in after


def test_the_write_methods_docstring_is_indented_as_its_body_in_a_nested_class(tmp_path: Path) -> None:
    """The layer class under an `if` (an env switch, `TYPE_CHECKING`'s `else`): the generated method's
    docstring lines stood at a top-level class's indent, 4 columns short of the body's."""
    start = FORK_ERA.index("class MiniMaxM3SparseAttention")
    end = FORK_ERA.index("\nclass ", start + 1) + 1
    block = "".join("    " + line if line.strip() else line for line in FORK_ERA[start:end].splitlines(keepends=True))
    source = FORK_ERA[:start] + "if True:\n" + block + "\n" + FORK_ERA[end:]
    checked, ran, after = outcome(tmp_path, source)
    assert ran == "rewritten", after
    doc = after.index('"""Write main K/V')
    body = after[after.rindex("\n", 0, doc) + 1 : doc]
    continuation = after[doc:].split("\n")[2]  # the docstring's third line (after its blank line)
    assert continuation.startswith(body) and not continuation.startswith(body + " "), (body, continuation)


REBOUND = (
    ("        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)\n",
     "        self.num_kv_heads = config.num_key_value_heads\n"),
    ("        self.kv_size = self.num_kv_heads * self.head_dim\n",
     "        self.kv_size = self.num_kv_heads * self.head_dim\n        self.num_kv_heads = max(1, self.num_kv_heads // tp_size)\n"),
)


def test_a_width_made_before_its_head_count_is_divided_per_rank_is_not_sliced_with(tmp_path: Path) -> None:
    """`self.kv_size` made from the model's KV head count, which __init__ then divides per rank: it holds
    the model's width, and slicing with it crashes every fp8 forward at TP >= 2 (verify's stand-in, which
    holds each size at the rank's, cannot see it). `run` slices with the product itself; a fork's own
    bypass slicing with the stale width is refused."""
    after = assert_rewritten_right(tmp_path, edit(FORK_ERA, *REBOUND))
    assert "kv = self.num_kv_heads * self.head_dim" in post_insert(after) and "self.kv_size" not in post_insert(after)
    assert_refused(tmp_path, edit(PATCHED_RUN, *REBOUND), "slices with `self.kv_size`")


def test_another_class_reading_its_own_attribute_of_the_flags_name_is_no_read_of_the_flag(tmp_path: Path) -> None:
    """Two layer classes, each with its own bypass: `self._fp8_kv` in the other class is that object's
    attribute, not a read of this layer's flag through another object (which a strip must not leave)."""
    start = PATCHED_RUN.index("class MiniMaxM3SparseAttention(")
    end = PATCHED_RUN.index("\nclass ", start + 1) + 1
    twin = PATCHED_RUN[start:end].replace("class MiniMaxM3SparseAttention(", "class MiniMaxM3SparseAttentionTwin(", 1)
    sites = [s for s in sites_of(tmp_path, PATCHED_RUN[:end] + "\n" + twin + PATCHED_RUN[end:]) if s.state.value == "patched"]
    assert len(sites) == 2
    assert all("2 sites carry an fp8 bypass" in s.reason and "outside the bypass" not in s.reason for s in sites), sites[0].reason
