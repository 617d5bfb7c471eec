"""`mm3-codemod verify`: the import and semantic levels (CPU), the kernel adapter.

The semantic level executes each file's own forward/_insert_kv on a stand-in
with reference ops; every patched fixture must pass it, the unpatched files
must fail it with the reason, and small breakages of a correct rewrite must be
caught (the mutants below).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli, make_vllm_tree

from rewriter.targets import Target, shown_path

torch = pytest.importorskip("torch")

from rewriter.verify import Status, kernels, layercode, refops, standin, verify  # noqa: E402
from rewriter.verify.semantic import check_layer  # noqa: E402

# Every fixture file whose code ends in the `patched` state.
PATCHED = [
    "fork_era/expected.py",
    "reformatted/expected.py",
    "no_insert_kv/expected.py",
    "patched/model.py",
    "half_applied/expected.py",
    "patch_fuzz/expected.py",
    "separate_projections/expected.py",
]
# Before-state files and what running them with an fp8 cache does.
UNPATCHED = {
    "fork_era/model.py": "kv_cache dtype must match qkv (bf16 cache only)",
    "reformatted/model.py": "kv_cache dtype must match qkv (bf16 cache only)",
    "no_insert_kv/model.py": "kv_cache dtype must match qkv (bf16 cache only)",
    "patch_fuzz/model.py": "kv_cache dtype must match qkv (bf16 cache only)",
    "half_applied/model.py": "NameError: name 'insert_via_fused' is not defined",
    "separate_projections/model.py": "kv_cache dtype must match qkv (bf16 cache only)",
    "compiled_native_lost_guard/model.py": "NameError: name 'insert_via_fused' is not defined",
}


def semantic(path: Path):
    report = verify([Target(path, "test")])
    (result,) = report.files
    levels = {level.level: level for level in result.levels}
    return levels["semantic"], levels


@pytest.mark.parametrize("name", PATCHED)
def test_semantic_passes_on_every_patched_fixture(name: str) -> None:
    level, _ = semantic(FIXTURES / name)
    assert level.status is Status.PASSED, level.reason + "\n" + "\n".join(level.details)
    assert any(d.endswith("fp8 cache = e4m3(bf16 cache) at every written slot: yes") for d in level.details)


@pytest.mark.parametrize("name", sorted(UNPATCHED))
def test_semantic_fails_on_unpatched_files_naming_the_reason(name: str) -> None:
    level, _ = semantic(FIXTURES / name)
    assert level.status is Status.FAILED
    assert UNPATCHED[name] in level.reason
    assert "forward" in level.reason  # where it failed, in the file's own code


@pytest.mark.parametrize("variant", ["seed_form", "old_form", "compiled_native"])
def test_the_older_forms_fail_the_padding_check(variant: str) -> None:
    """The seed's bypass (and this tool's earlier one) scatters the index key by slot:
    a padded token's slot -1 writes the last index slot, which the fused op never does."""
    level, _ = semantic(FIXTURES / variant / "model.py")
    assert level.status is Status.FAILED
    assert "padded tokens (slot -1, last 3) wrote nothing: no" in level.reason
    assert "MiniMaxM3SparseAttention: padded tokens (slot -1, last 3) wrote nothing: NO" in level.details


def test_cli_verify_example_fails_with_the_crash_and_exit_1() -> None:
    proc = cli("verify", "--example", "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    (entry,) = report["files"]
    levels = {lv["level"]: lv for lv in entry["levels"]}
    assert levels["semantic"]["status"] == "failed"
    assert "kv_cache dtype must match qkv" in levels["semantic"]["reason"]
    assert levels["kernel"]["status"] == "skipped"
    # `run --example` rewrites a copy: it shows the rewrite (a bare `mm3-codemod run` would not)
    assert "`mm3-codemod run --example --show-diff` shows its rewrite" in entry["note"]
    assert "kv_cache dtype must match qkv" in proc.stderr  # the human table says it too


def test_the_table_reads_at_100_columns_without_cutting_a_path_or_a_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each path on a line of its own, whole; reasons wrap between words, never inside one
    (a long import path, the op's name); every line fits; -v still shows every check."""
    import io

    from rich.console import Console

    from rewriter.verify import FileVerification, LevelResult, VerifyReport
    from rewriter.verify.table import verify_table

    monkeypatch.chdir(tmp_path)
    nvidia = "vllm/models/minimax_m3/nvidia/model.py"
    fork = Path(f"forks/minimax-m3-fp8-kv-cache-bypass-rebased/{nvidia}")  # shown relative
    site = Path(f"/opt/envs/vllm-0.34.0/lib/python3.12/site-packages/{nvidia}")  # shown absolute
    op = "fused_minimax_m3_qknorm_rope_kv_insert"
    reasons = {
        "import": f"cannot import name '{op}' from 'vllm._custom_ops' "
        "(/opt/envs/vllm-0.34.0/lib/python3.12/site-packages/vllm/_custom_ops.py)",
        "semantic": "MiniMaxM3SparseAttention: fp8 run failed: RuntimeError: kv_cache dtype must "
        "match qkv (bf16 cache only) (at model.py:276 in forward)",
        "kernel": "no CUDA GPU visible to torch",
    }
    details = [
        f"MiniMaxM3SparseAttention fp8 run: model.py:276 in forward: ops.{op}(",
        "MiniMaxM3SparseAttention: _insert_kv takes the slot mappings: yes",  # shown with -v only
    ]
    statuses = {"import": Status.FAILED, "semantic": Status.FAILED, "kernel": Status.SKIPPED}
    levels = [LevelResult(name, statuses[name], why, details) for name, why in reasons.items()]
    note = "needs-bypass at line 276: run `mm3-codemod run` first (the fork-era call writes bf16 only)"
    files = [
        FileVerification(tmp_path / fork, "test", levels=levels, note=note),
        FileVerification(site, "test", levels=levels),
    ]

    def rendered(verbose: bool) -> list[str]:
        out = io.StringIO()
        table = verify_table(VerifyReport(files), 100, verbose)
        Console(file=out, width=100, color_system=None).print(table)
        return [line.rstrip() for line in out.getvalue().splitlines()]

    lines = rendered(verbose=False)
    assert max(len(line) for line in lines) <= 100
    assert str(fork) in lines and str(site) in lines  # each on a line of its own, whole
    assert lines[1].split() == ["level", "result", "why"]
    words = {word for line in lines for word in line.split()}
    for text in [*reasons.values(), details[0], note]:
        assert set(text.split()) <= words, set(text.split()) - words  # no word split across lines
    starts = [line.split()[:2] for line in lines if line.startswith(tuple(reasons))]
    assert starts == 2 * [["import", "failed"], ["semantic", "failed"], ["kernel", "skipped"]]
    assert "yes" not in words
    assert set(details[1].split()) <= {word for line in rendered(verbose=True) for word in line.split()}


def test_cli_verify_after_run_passes(tmp_path: Path) -> None:
    target = tmp_path / "model.py"
    shutil.copyfile(ROOT / "rewriter" / "data" / "example_model.py", target)
    assert cli("run", str(target)).returncode == 0
    proc = cli("verify", str(target), "--json")
    assert proc.returncode == 0, proc.stderr
    levels = {lv["level"]: lv["status"] for lv in json.loads(proc.stdout)["files"][0]["levels"]}
    tp_rows = {level: "passed" for level in levels if level.startswith("semantic TP=")}
    assert len(tp_rows) == 2  # a TP that shards the KV heads, one that replicates them
    assert levels == {"import": "skipped", "semantic": "passed", "kernel": "skipped", **tp_rows}


def test_require_gpu_turns_a_skipped_kernel_level_into_a_failure() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernel level would run")
    proc = cli("verify", str(FIXTURES / "patched" / "model.py"), "--require-gpu", "--json")
    assert proc.returncode == 1
    kernel = next(lv for lv in json.loads(proc.stdout)["files"][0]["levels"] if lv["level"] == "kernel")
    assert kernel["status"] == "failed" and "--require-gpu" in kernel["reason"]


def test_native_and_siteless_files_are_skipped_with_a_reason() -> None:
    report = verify(
        [Target(FIXTURES / "native" / "model.py", "t"), Target(FIXTURES / "dense_only" / "model.py", "t")]
    )
    native, dense = report.files
    # A native call runs too: the kernel (here its reference) quantizes by itself.
    assert native.levels[1].status is Status.PASSED, native.levels[1].reason
    assert {lv.status for lv in dense.levels} == {Status.SKIPPED}
    assert report.exit_code == 0


@pytest.mark.parametrize(
    "name", ["half_native", "half_native_plain", "wrapper_native", "native_stale_bypass"]
)
def test_a_bypass_taken_out_of_a_native_call_is_proven_by_running_it(name: str) -> None:
    before, _ = semantic(FIXTURES / name / "model.py")
    assert before.status is Status.FAILED
    after, _ = semantic(FIXTURES / name / "expected.py")
    assert after.status is Status.PASSED, after.reason + "\n" + "\n".join(after.details)
    assert any("padded tokens (slot -1, last 3) wrote nothing: yes" in d for d in after.details)


def test_a_site_run_refuses_is_noted_with_its_reason_not_sent_to_run(tmp_path: Path) -> None:
    """A stale bypass whose strip `run` refuses (`_insert_kv` has another caller): running
    `run` first would not help; the note is the refusal, which says what to do by hand."""
    source = (FIXTURES / "native_stale_bypass" / "model.py").read_text()
    sparse = source.rindex("    def forward(")
    other_caller = "    def again(self, a, b, c, d, e):\n        self._insert_kv(a, b, c, d, e)\n\n"
    target = tmp_path / "model.py"
    target.write_text(source[:sparse] + other_caller + source[sparse:])
    (entry,) = verify([Target(target, "test")], timing=False).files
    assert entry.note is not None and entry.note.startswith("half-applied at line "), entry.note
    assert "`_insert_kv` is also called outside the bypass" in entry.note
    # `_insert_kv` has another caller: no deletion is advised (it would break `again`)
    assert "delete" not in entry.note.lower() and "no line is advised for deletion" in entry.note
    assert "run `mm3-codemod run` first" not in entry.note
    stale = verify([Target(FIXTURES / "native_stale_bypass" / "model.py", "test")], timing=False).files[0]
    # the run for that very file: a bare `mm3-codemod run` would rewrite whatever is around
    shown = shown_path(FIXTURES / "native_stale_bypass" / "model.py")
    assert stale.note is not None and stale.note.endswith(f"run `mm3-codemod run {shown}` first")


def test_a_lost_guard_fails_verify_with_the_files_own_name_error() -> None:
    level, _ = semantic(FIXTURES / "half_native" / "model.py")
    assert "NameError: name 'insert_via_fused' is not defined (at model.py:" in level.reason


def test_what_the_stand_in_cannot_model_is_a_skip_not_a_failure(tmp_path: Path) -> None:
    """An attribute __init__ sets through code the stand-in does not run is its limit."""
    source = (FIXTURES / "native" / "model.py").read_text()
    assert source.count("        qkv, _ = self.qkv_proj(hidden_states)\n") == 2
    path = tmp_path / "model.py"
    dtype = "        self.kv_cache_dtype = cache_config.cache_dtype\n"
    assert source.count(dtype) == 1
    source = source.replace(dtype, dtype + '        self.use_nvfp4_kv = "nvfp4" in list(kv_quant_modes(cache_config))\n')
    imports = "from vllm.forward_context import get_forward_context\n"  # (a name the file never binds fails in vLLM too)
    source = source.replace(imports, imports + "from vllm.config import kv_quant_modes\n")
    path.write_text(
        source.replace(
            "        qkv, _ = self.qkv_proj(hidden_states)\n        num_tokens",
            "        qkv, _ = self.qkv_proj(hidden_states)\n        assert self.use_nvfp4_kv is not None\n        num_tokens",
        )
    )
    level, _ = semantic(path)
    assert level.status is Status.SKIPPED, level.reason
    assert "the stand-in lacks `self.use_nvfp4_kv`" in level.reason


@pytest.mark.parametrize("variant", ["compiled_native", "compiled_native_lost_guard"])
def test_a_compile_aware_file_is_run_on_its_compiled_path_too(variant: str) -> None:
    """With is_compiling() true the file's registered cache-update op runs its own body (the
    layer found in the forward context) and its caches must be eager's, padded tokens included."""
    level, _ = semantic(FIXTURES / variant / "expected.py")
    assert level.status is Status.PASSED, level.reason + "\n" + "\n".join(level.details)
    assert "eager and compiled paths" in level.reason
    for check in ("compiled: bf16 run wrote every slot", "compiled: padded tokens (slot -1, last 3) wrote nothing",
                  "compiled: caches = eager's (bf16)"):
        assert f"MiniMaxM3SparseAttention: {check}: yes" in level.details


def _fixture_edited(tmp_path: Path, variant: str, old: str, new: str) -> Path:
    source = (FIXTURES / variant / "expected.py").read_text()
    assert source.count(old) == 1
    path = tmp_path / "model.py"
    path.write_text(source.replace(old, new))
    return path


def test_a_compiled_path_that_writes_nothing_fails(tmp_path: Path) -> None:
    """What the old advice (strip the bypass of a compile-aware fork) would leave: eager is
    fine, the compiled path writes no token to the cache."""
    path = _fixture_edited(
        tmp_path,
        "compiled_native_lost_guard",
        "kv_dep = torch.ops.vllm.sparse_kv_cache_update(k, v, index_k, layer_name)",
        "pass",
    )
    level, _ = semantic(path)
    assert level.status is Status.FAILED
    assert "compiled: bf16 run wrote every slot: no" in level.reason


def test_the_compiled_path_runs_the_files_own_op_body(tmp_path: Path) -> None:
    """The registered op's own body is what runs: a body that skips the padding-safe write fails."""
    path = _fixture_edited(
        tmp_path,
        "compiled_native",
        "    if isinstance(slots, dict) and layer.layer_name in slots:\n",
        "    if isinstance(slots, dict) and layer.layer_name not in slots:\n",
    )
    level, _ = semantic(path)
    assert level.status is Status.FAILED and "compiled:" in level.reason


def test_an_imported_helper_the_stand_in_cannot_model_is_a_skip_naming_the_line(tmp_path: Path) -> None:
    path = _fixture_edited(
        tmp_path,
        "separate_projections",
        "        num_tokens = qkv.shape[0]\n",
        "        num_tokens = qkv.shape[0]\n        low, high = kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, None)\n",
    )
    level, _ = semantic(path)
    assert level.status is Status.SKIPPED, level.reason
    assert "the stand-in cannot run model.py:" in level.reason
    assert "`low, high = kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, None)`" in level.reason


def test_projections_are_built_at_the_widths_init_gives_them(tmp_path: Path) -> None:
    """The separate projections' widths come from __init__: a width the file gets wrong is
    the stand-in's limit to say, never a made-up failure of the file."""
    path = _fixture_edited(
        tmp_path,
        "separate_projections",
        "self.index_k_proj = ReplicatedLinear(self.hidden_size, self.idx_head_dim, bias=False)",
        "self.index_k_proj = ReplicatedLinear(self.hidden_size, 2 * self.idx_head_dim, bias=False)",
    )
    level, _ = semantic(path)
    assert level.status is Status.SKIPPED, level.reason
    assert "projections" in level.reason and "wide" in level.reason


def test_unreadable_target_is_exit_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "model.py"
    bad.write_bytes((FIXTURES / "patched" / "model.py").read_bytes() + b"\ndef broken(:\n")
    proc = cli("verify", str(bad))
    assert proc.returncode == 2
    assert any(
        str(bad) in line and "not valid Python" in line for line in proc.stderr.splitlines()
    ), proc.stderr


def _verify_without_torch(path: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from rewriter.cli import main\n"
        f"sys.argv = ['mm3-codemod', 'verify', {str(path)!r}, '--json']\n"
        "main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


def test_without_torch_the_semantic_level_is_skipped_and_the_file_is_not_verified() -> None:
    """Nothing ran the file's code: said so, exit 1 (it was exit 0, "without failures")."""
    proc = _verify_without_torch(FIXTURES / "patched" / "model.py")
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["files"][0]["status"] == "unverified"
    levels = json.loads(proc.stdout)["files"][0]["levels"]
    assert [lv["status"] for lv in levels[1:]] == ["skipped", "skipped"]
    assert "torch is not installed" in levels[1]["reason"]


def test_an_unpatched_file_fails_verify_even_when_no_level_can_run() -> None:
    path = FIXTURES / "fork_era" / "model.py"
    proc = _verify_without_torch(path)
    assert proc.returncode == 1, proc.stderr
    assert f"{path}: needs-bypass at line" in proc.stderr


# --- the semantic check can fail: broken rewrites of a correct file ----------------

EXPECTED = (FIXTURES / "fork_era" / "expected.py").read_text()
MUTANTS = {
    # k sliced one column off
    "k offset": ("k0 = self.q_size\n", "k0 = self.q_size + 1\n"),
    # the two slot mappings swapped at the post-call insert
    "slots swapped": (
        "self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)",
        "self._insert_kv(k, v, index_k, index_slot_mapping, main_slot_mapping)",
    ),
    # the guard inverted: fused insert on the fp8 path
    "guard inverted": ("insert_via_fused = not self._fp8_kv", "insert_via_fused = self._fp8_kv"),
    # k and v swapped in the cache write
    "k/v swapped": ("self._insert_kv(k, v, index_k,", "self._insert_kv(v, k, index_k,"),
    # the index key taken from index_q's last head
    "index_k head": (
        "ik0 = k0 + 2 * kv + self.index_q_size",
        "ik0 = k0 + 2 * kv + self.index_q_size - self.idx_head_dim",
    ),
    # the post-call insert never runs
    "insert skipped": ("        if not insert_via_fused:\n", "        if False:\n"),
    # fp8 values scaled on the way in
    "scale": ("scale = self._fp8_kv_scale", "scale = 2 * self._fp8_kv_scale"),
    # the scale never made in __init__ (AttributeError on the fp8 path)
    "scale never set": (
        "        self.register_buffer(\n"
        '            "_fp8_kv_scale", torch.ones((), dtype=torch.float32), persistent=False\n'
        "        )\n",
        "",
    ),
    # the older raw index scatter: padded tokens write the last index slot
    "raw index scatter": (
        "        idx_cache = self.indexer.index_cache.kv_cache.view(-1, 1, 1, self.idx_head_dim)\n",
        "        idx_cache = self.indexer.index_cache.kv_cache.view(-1, 1, 1, self.idx_head_dim)\n"
        "        idx_cache.view(-1, self.idx_head_dim)[index_slot_mapping] = index_key\n"
        "        return\n",
    ),
    # the index key written to the main slots
    "index slots": (
        "            idx_cache,\n            index_slot_mapping,\n",
        "            idx_cache,\n            main_slot_mapping,\n",
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_semantic_catches_a_broken_rewrite(tmp_path: Path, mutant: str) -> None:
    old, new = MUTANTS[mutant]
    assert EXPECTED.count(old) == 1, f"mutant {mutant!r} no longer applies to expected.py"
    path = tmp_path / "model.py"
    path.write_text(EXPECTED.replace(old, new))
    level, _ = semantic(path)
    assert level.status is Status.FAILED, f"{mutant}: {level.reason}"



def test_semantic_runs_inits_own_dtype_and_its_return(tmp_path: Path) -> None:
    """The stand-in keeps what the file's ``__init__`` leaves in ``self.kv_cache_dtype``: a flag read
    from an "auto" placeholder set before the real dtype fails (the fused op gets the fp8 cache); and
    a ``return`` in ``__init__`` ends it there (it failed: "'return' outside function")."""
    flag = '        self._fp8_kv = "fp8" in self.kv_cache_dtype\n'
    dtype = "        self.kv_cache_dtype = (\n"
    assert EXPECTED.count(flag) == 1 and EXPECTED.count(dtype) == 1
    path = tmp_path / "model.py"
    path.write_text(EXPECTED.replace(flag, "").replace(dtype, '        self.kv_cache_dtype = "auto"\n' + flag + dtype))
    level, _ = semantic(path)
    assert level.status is Status.FAILED and "bf16 cache only" in level.reason, level.reason
    path.write_text(EXPECTED.replace(flag, flag + "        if cache_config is None:\n            return\n"))
    level, _ = semantic(path)
    assert level.status is Status.PASSED, level.reason



def test_an_attribute_nothing_in_the_file_sets_is_the_files_fault(tmp_path: Path) -> None:
    """The write method reads a scale under a name nothing in the file sets: every fp8 forward
    raises AttributeError in vLLM too, so the semantic level fails (it skipped, blaming the
    stand-in, for every name but the two `run` writes)."""
    read = "        scale = self._fp8_kv_scale  # identity: stores x / 1\n"
    assert EXPECTED.count(read) == 1
    path = tmp_path / "model.py"
    path.write_text(EXPECTED.replace(read, read.replace("_fp8_kv_scale", "_kv_scale_one")))
    level, _ = semantic(path)
    assert level.status is Status.FAILED and "_kv_scale_one" in level.reason, level.reason


# --- no size stands in for another: rewrites that take a width from the wrong product -------

# The generated lines that hold the index key's head size, in fork_era's rewrite.
_INDEX_KEY_DIM = [
    ("index_k = qkv[:, ik0 : ik0 + self.idx_head_dim]", "index_k = qkv[:, ik0 : ik0 + self.head_dim]"),
    ("idx_key = index_key.view(-1, 1, self.idx_head_dim)", "idx_key = index_key.view(-1, 1, self.head_dim)"),
    ("kv_cache.view(-1, 1, 1, self.idx_head_dim)", "kv_cache.view(-1, 1, 1, self.head_dim)"),
]
# The sparse layer's q_size line (the dense layer has one too) and a rotary product to go before it.
_SPARSE_Q_SIZE = (
    "        self.q_size = self.num_heads * self.head_dim\n"
    "        self.kv_size = self.num_kv_heads * self.head_dim\n"
    "        self.scaling"
)
_ROPE_Q_SIZE = (
    "        self.rotary_dim = config.rotary_dim\n"
    "        self.rope_q_size = self.num_heads * self.rotary_dim\n"
)
# case -> (fixture, edits of the file itself, the rewrite's wrong widths on top of them)
WRONG_WIDTHS = {
    # index_q's width taken as the kv width (`kv_size`): index_k read from the wrong offset
    "index_q width = kv width": ("fork_era", [], [("2 * kv + self.index_q_size", "2 * kv + self.kv_size")]),
    # the call passes `self.num_kv_heads` as num_index_heads; the first product of that
    # count in __init__ is `kv_size = num_kv_heads * head_dim`, so the index widths come
    # out as kv_size and head_dim (what the product-matching rewrite emits)
    "kv heads passed as index heads": (
        "fork_era",
        [("            self.num_idx_heads,\n            main_slot_mapping,",
          "            self.num_kv_heads,\n            main_slot_mapping,")],
        [("2 * kv + self.index_q_size", "2 * kv + self.kv_size"), *_INDEX_KEY_DIM],
    ),
    # the index key's head size taken as head_dim
    "head_dim for the index key": ("fork_era", [], _INDEX_KEY_DIM),
    # an extra `rope_q_size = num_heads * rotary_dim` before q_size: k's offset taken from it
    "q width from a rotary_dim product": (
        "fork_era",
        [(_SPARSE_Q_SIZE, _ROPE_Q_SIZE + _SPARSE_Q_SIZE)],
        [("k0 = self.q_size\n", "k0 = self.rope_q_size\n")],
    ),
    # index_q's width from the kv head count, in a file whose index head count is not the kv
    # count's attribute (the op is passed `self.num_idx_heads`: the slices must follow it; where
    # the file says `self.num_idx_heads = self.num_kv_heads`, the two are one size)
    "index_q width from the kv head count": (
        "fork_era",
        [
            (
                "self.num_idx_heads = self.num_kv_heads\n",
                "self.num_idx_heads = max(1, config.num_key_value_heads // tp_size)\n",
            )
        ],
        [("2 * kv + self.index_q_size", "2 * kv + self.num_kv_heads * self.idx_head_dim")],
    ),
    # renamed attributes (`self.dim`, `self.index_dim`): the index key sliced with `dim`
    "renamed: dim for the index key": (
        "no_insert_kv",
        [],
        [
            ("index_k = qkv[:, ik0 : ik0 + self.index_dim]", "index_k = qkv[:, ik0 : ik0 + self.dim]"),
            ("view(-1, 1, self.index_dim)", "view(-1, 1, self.dim)"),
            ("view(-1, 1, 1, self.index_dim)", "view(-1, 1, 1, self.dim)"),
        ],
    ),
}


def _edited(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert source.count(old) == 1, f"{old!r} no longer applies"
        source = source.replace(old, new)
    return source


def _wrong_widths_file(tmp_path: Path, case: str, wrong: bool) -> Path:
    fixture, file_edits, rewrite_edits = WRONG_WIDTHS[case]
    source = _edited((FIXTURES / fixture / "expected.py").read_text(), file_edits)
    path = tmp_path / "model.py"
    path.write_text(_edited(source, rewrite_edits) if wrong else source)
    return path


@pytest.mark.parametrize("case", sorted(WRONG_WIDTHS))
def test_semantic_fails_a_rewrite_that_takes_a_width_from_the_wrong_product(
    tmp_path: Path, case: str
) -> None:
    """Every one of these passed the semantic level before it ran at sizes that all
    differ (checked against 1260541, where num_idx_heads was num_kv_heads, head_dim
    and idx_head_dim were both 128, and head sizes were bound by any product with a
    head count - the rewrite's own assumption)."""
    level, _ = semantic(_wrong_widths_file(tmp_path, case, wrong=True))
    assert level.status is Status.FAILED, f"{case}: {level.reason}\n" + "\n".join(level.details)


@pytest.mark.parametrize("case", sorted(WRONG_WIDTHS))
def test_the_same_file_with_the_right_widths_passes(tmp_path: Path, case: str) -> None:
    """The control: the file edits alone (the rewrite's widths right) pass - the wrong
    width is what fails above, not the stand-in."""
    level, _ = semantic(_wrong_widths_file(tmp_path, case, wrong=False))
    assert level.status is Status.PASSED, f"{case}: {level.reason}\n" + "\n".join(level.details)


def test_the_stand_in_tells_each_size_from_the_file_and_keeps_its_ties(tmp_path: Path) -> None:
    """Head sizes renamed (`self.hd`, `self.ihd`), `self.num_kv_heads` used as the index
    head count too (passed to the op, and in `index_q_size`), an extra rotary product
    before q_size. Each attribute still gets its own size - `hd` and `ihd` from the norms
    built with them (every product with the kv count is ambiguous: it is two counts),
    `rotary_dim` by its name - and the two head counts that one attribute holds stay
    equal, the other sizes distinct."""
    _, file_edits, _ = WRONG_WIDTHS["q width from a rotary_dim product"]
    source = _edited(EXPECTED, [*file_edits, ("        self.num_idx_heads = self.num_kv_heads\n", "")])
    source = source.replace("self.num_idx_heads", "self.num_kv_heads")
    source = source.replace("self.idx_head_dim", "self.ihd").replace("self.head_dim", "self.hd")
    path = tmp_path / "model.py"
    path.write_text(source)
    code = layercode.load_layer(path, "MiniMaxM3SparseAttention")
    sizes = {chain: held for chain, held in code.bindings.items() if set(held) & set(layercode.SIZES)}
    assert sizes == {
        ("num_heads",): ("num_heads",),
        ("num_kv_heads",): ("num_kv_heads", "num_idx_heads"),
        ("rotary_emb", "rotary_dim"): ("rotary_dim",),
        ("rotary_dim",): ("rotary_dim",),
        ("hd",): ("head_dim",),
        ("ihd",): ("idx_head_dim",),
    }
    distinct = layercode.DISTINCT
    assert code.fit(distinct) == replace(distinct, num_idx_heads=distinct.num_kv_heads)
    level, _ = semantic(path)
    assert level.status is Status.PASSED, level.reason + "\n" + "\n".join(level.details)
    ran = "6 q / 2 kv / 2 index heads, head dims 64 / index 128, rotary 32"
    assert f"MiniMaxM3SparseAttention: sizes: {ran}" in level.details
    # the index norms built with head_dim: the op's index head size is head_dim, so the two stay
    # equal; and `self.num_idx_heads = self.num_kv_heads` (each bound once) ties the two counts
    tied = EXPECTED.replace("GemmaRMSNorm(self.idx_head_dim", "GemmaRMSNorm(self.head_dim")
    path.write_text(tied)
    code = layercode.load_layer(path, "MiniMaxM3SparseAttention")
    both = replace(distinct, idx_head_dim=distinct.head_dim, num_idx_heads=distinct.num_kv_heads)
    assert code.fit(distinct) == both
    assert semantic(path)[0].status is Status.PASSED



MODEL = (FIXTURES / "fork_era" / "model.py").read_text()
# The fork-era file says `self.num_idx_heads = self.num_kv_heads`: these two spell the index
# head count through the kv count (hunt 46, E D1 and D2), the same program.
INDEX_THROUGH_KV = {
    "call": [
        ("        q = qkv.new_empty(", "        num_kv_heads = self.num_kv_heads\n        q = qkv.new_empty("),
        ("            self.num_idx_heads,\n", "            num_kv_heads,\n"),
    ],
    "index_q_size": [
        ("self.index_q_size = self.num_idx_heads *", "self.index_q_size = self.num_kv_heads *"),
    ],
}


@pytest.mark.parametrize("case", sorted(INDEX_THROUGH_KV))
def test_an_index_count_the_file_ties_to_the_kv_count_is_run_as_one(tmp_path: Path, case: str) -> None:
    """`check` says rewrite; `run` then proves and writes it (before, the stand-in gave the two
    counts its own distinct sizes, its bf16 run of the file's own code failed and `run` refused:
    check and run disagreed); `verify` passes the output at TP=2 and 4."""
    path = tmp_path / "model.py"
    path.write_text(_edited(MODEL, INDEX_THROUGH_KV[case]))
    assert cli("check", str(path)).returncode == 1
    proc = cli("run", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "proven:" in proc.stderr
    proc = cli("verify", "--tp", "2", "--tp", "4", str(path))
    assert proc.returncode == 0, proc.stderr


def test_a_count_bound_again_after_the_copy_is_not_tied(tmp_path: Path) -> None:
    """`self.num_idx_heads = self.num_kv_heads`, then the kv count bound again: the two may differ,
    so the stand-in keeps its own distinct sizes for them."""
    rebound = "        self.num_idx_heads = self.num_kv_heads\n"
    source = _edited(EXPECTED, [(rebound, rebound + "        self.num_kv_heads = max(1, self.num_kv_heads)\n")])
    path = tmp_path / "model.py"
    path.write_text(source)
    code = layercode.load_layer(path, "MiniMaxM3SparseAttention")
    assert code.fit(layercode.DISTINCT).num_idx_heads == layercode.DISTINCT.num_idx_heads
    path.write_text(EXPECTED)
    tied = layercode.load_layer(path, "MiniMaxM3SparseAttention").fit(layercode.DISTINCT)
    assert tied.num_idx_heads == layercode.DISTINCT.num_kv_heads

# --- the import level -----------------------------------------------------------------

# A stand-in vLLM: the real model file is imported from disk; every other vllm.*
# module (and transformers) it imports is served as a stub whose names are classes.
STUB_VLLM = """
import importlib.abc, importlib.machinery, sys, types

class _Stub(types.ModuleType):
    __path__ = []
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "transformers"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        return _Stub(spec.name)
    def exec_module(self, module):
        pass

sys.meta_path.append(_Finder())
"""


def _in_vllm_tree(tmp_path: Path, source: bytes) -> Path:
    nvidia = make_vllm_tree(tmp_path, {"model.py": source}, init=STUB_VLLM)
    return nvidia / "model.py"


def test_import_level_passes_on_a_rewritten_module(tmp_path: Path) -> None:
    path = _in_vllm_tree(tmp_path, (FIXTURES / "fork_era" / "expected.py").read_bytes())
    _, levels = semantic(path)
    assert levels["import"].status is Status.PASSED, levels["import"].reason + "\n".join(
        levels["import"].details
    )
    assert "main_slot_mapping" in levels["import"].reason


def test_import_level_checks_a_forks_write_method_by_its_role_and_the_amd_file(tmp_path: Path) -> None:
    """A fork's write method under its own name (the post-call block's `_write_kv_fp8`) is
    the one inspected, and a file in the AMD model folder is imported like an NVIDIA one."""
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).parent))
    from variants import RESPELLINGS

    (renamed,) = [r for r in RESPELLINGS if r.name == "write-renamed"]
    source = renamed((FIXTURES / "seed_form" / "expected.py").read_text()).encode()
    nvidia = make_vllm_tree(tmp_path, {}, init=STUB_VLLM)
    amd = nvidia.parent / "amd"
    amd.mkdir()
    (amd / "model.py").write_bytes(source)
    _, levels = semantic(amd / "model.py")
    assert levels["import"].status is Status.PASSED, levels["import"].reason
    assert "vllm.models.minimax_m3.amd.model" in levels["import"].reason
    assert "._write_kv_fp8(" in levels["import"].reason and "main_slot_mapping" in levels["import"].reason


def test_import_level_fails_on_the_unpatched_module(tmp_path: Path) -> None:
    path = _in_vllm_tree(tmp_path, (FIXTURES / "fork_era" / "model.py").read_bytes())
    _, levels = semantic(path)
    assert levels["import"].status is Status.FAILED
    assert "does not take the slot mappings" in levels["import"].reason
    assert "does not guard its cache arguments" in levels["import"].reason


def test_import_level_shows_the_traceback_of_a_failing_import(tmp_path: Path) -> None:
    source = (
        FIXTURES / "fork_era" / "expected.py"
    ).read_bytes() + b"\nraise ImportError('kernel op missing')\n"
    path = _in_vllm_tree(tmp_path, source)
    _, levels = semantic(path)
    assert levels["import"].status is Status.FAILED
    assert "kernel op missing" in levels["import"].reason
    assert any("model.py" in line for line in levels["import"].details)


# --- the reference ops ------------------------------------------------------------------


def test_reference_norm_and_rope_match_their_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 8, generator=g)
    w = torch.randn(8, generator=g)
    manual = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(refops.gemma_rms_norm(x, w, 1e-6), manual, atol=1e-5)
    # NeoX on the first 4 dims is a rotation of (x[i], x[i+2]) pairs by the angle.
    angle = torch.tensor([[0.3, 1.1], [2.0, -0.7], [0.0, 0.5]])
    cos_sin = torch.cat((angle.cos(), angle.sin()), dim=-1)
    out = refops.neox_rope(x, cos_sin, 4)
    z = torch.complex(x[..., :2], x[..., 2:4]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    assert torch.allclose(out[..., :2], z.real, atol=1e-6) and torch.allclose(
        out[..., 2:4], z.imag, atol=1e-6
    )
    assert torch.equal(out[..., 4:], x[..., 4:])


def test_reference_fp8_store_saturates_and_rounds_like_e4m3() -> None:
    x = torch.tensor([0.0, 1.0, -1.5, 1000.0, -1000.0, 0.3])
    bits = refops.to_e4m3_bits(x)
    back = bits.view(torch.float8_e4m3fn).float()
    assert back.tolist()[:5] == [0.0, 1.0, -1.5, 448.0, -448.0]
    assert back[5] == torch.tensor(0.3).to(torch.float8_e4m3fn).float()
    assert torch.equal(refops.to_e4m3_bits(x, 2.0).view(torch.float8_e4m3fn).float()[1], torch.tensor(0.5))


def test_reference_fused_insert_refuses_a_non_bf16_cache() -> None:
    inputs = standin.Inputs.random(layercode.Shape(tokens=4))
    s = inputs.shape
    cache = torch.zeros(s.num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="bf16 cache only"):
        refops.fused_minimax_m3_qknorm_rope_kv_insert(
            **kernels._op_args(inputs, inputs.qkv.clone(), *kernels._outs(inputs)),
            slot_mapping=inputs.main_slots,
            kv_cache=cache,
            block_size=s.block_size,
        )


# --- the kernel adapter, on the CPU with a stand-in library --------------------------


def _fake_library(layout: str, extra: int = 6):
    """A 19 + ``extra`` argument op that stores the main cache in ``layout``."""

    def raw(*args):
        assert len(args) == 19 + extra
        fork = list(args[:19])
        cache = fork[14]
        if cache is None or layout == "fork":
            refops.fused_minimax_m3_qknorm_rope_kv_insert(*fork)
            return
        if layout == "none":
            raise RuntimeError("unsupported cache")
        if cache.dim() != 4:
            raise RuntimeError("kv_cache must be 4-D")
        nb, h, bs, d2 = cache.shape
        view = cache.view(nb, h, bs, 2, d2 // 2).permute(0, 3, 2, 1, 4)
        fork[14] = view.contiguous()
        refops.fused_minimax_m3_qknorm_rope_kv_insert(*fork)
        view.copy_(fork[14])

    return raw


def _fake_ops(layout: str) -> kernels.KernelOps:
    extra = list(kernels.EXTRA_DEFAULTS.items())
    return kernels.KernelOps("fake", _fake_library(layout), refops.reshape_and_cache_flash, extra)


def test_adapter_detects_the_cache_layout_and_the_bypass_agrees_through_it() -> None:
    ops = _fake_ops("hnd")
    inputs = standin.Inputs.random(layercode.Shape(tokens=40, num_blocks=8), seed=3)
    assert kernels.detect_layout(ops, inputs).name == "[blocks, heads, block, 2*dim]"
    checks = kernels.check_against_references(ops, inputs)
    assert checks and all(c.passed for c in checks), checks
    code = layercode.load_layer(FIXTURES / "fork_era" / "expected.py", "MiniMaxM3SparseAttention")
    comparison, _ = check_layer(code, ops.backend, inputs)
    assert comparison.passed, comparison.reason


def test_adapter_refuses_a_library_whose_insert_matches_no_layout() -> None:
    inputs = standin.Inputs.random(layercode.Shape(tokens=8), seed=1)
    with pytest.raises(kernels.KernelUnavailable, match="no known cache layout"):
        kernels.detect_layout(_fake_ops("none"), inputs)


def test_kernel_level_without_a_gpu_is_skipped_with_the_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    report = verify([Target(FIXTURES / "patched" / "model.py", "t")])
    kernel = next(lv for lv in report.files[0].levels if lv.level == "kernel")
    assert kernel.status is Status.SKIPPED and "no CUDA GPU" in kernel.reason


@pytest.mark.parametrize("write", ["_insert_kv", "_store_kv"])
def test_timing_plan_runs_the_files_own_insert_kv_at_every_size(tmp_path: Path, write: str) -> None:
    """The timed closures on the CPU (one call each instead of a CUDA graph), of the file's write
    method by its role: a fork's name for it was not timed (the GPU path asked for run's name)."""
    ops = _fake_ops("hnd")
    kernels.detect_layout(ops, standin.Inputs.random(layercode.Shape(tokens=16, num_blocks=8), seed=2))
    model = tmp_path / "model.py"
    model.write_text((FIXTURES / "fork_era" / "expected.py").read_text().replace("_insert_kv", write))
    code = layercode.load_layer(model, "MiniMaxM3SparseAttention")
    calls: list[str] = []
    written: list[int] = []
    real_reshape = ops.reshape_raw

    def counting_reshape(*args):
        written.append(args[4].numel())
        real_reshape(*args)

    ops.reshape_raw = counting_reshape

    def once(fn):
        fn()
        calls.append(fn.__name__)
        return 1.0, "one call"

    t = kernels.timings(ops, code, write, sizes=(16, 32), device="cpu", timer=once)
    assert calls == ["fused_insert", "norm_rope", "insert_kv", "bypass"] * 2
    assert [(r.name, r.tokens) for r in t["rows"]][:4] == [
        ("fused bf16 insert", 16),
        ("fused norm+rope only", 16),
        (f"the file's {write} (fp8 k/v + index key)", 16),
        ("bypass total", 16),
    ]
    # the file's own _insert_kv ran: two reshape_and_cache_flash calls (k/v, index key) per call
    assert written == [16, 16, 16, 16, 32, 32, 32, 32]
    per = t["kv_bytes_per_token"]
    assert per["bf16"] - per["fp8"] == 2 * 4 * 128  # k and v, 4 kv heads x 128, one byte saved each


# --- the import level: the file's failure, or the environment's skip ----------------------

from rewriter.verify.importcheck import HOW_TO_RUN, judge  # noqa: E402

FILE = "/t/vllm/models/minimax_m3/nvidia/model.py"
IN_VLLM = "/site/vllm/compilation/passes/fusion/matcher_utils.py"
IMPORTS = frozenset({3, 4, 5})  # the file's import-statement lines


@pytest.mark.parametrize(
    "exc_type, message, frames, name, syntax_file, expect",
    [
        # the file's own syntax
        ("SyntaxError", "invalid syntax", [], None, FILE, "the file's own syntax"),
        # raised at one of the file's lines: an undefined name
        ("NameError", "name 'insert_via_fused' is not defined", [(FILE, 40)], None, None, "model.py:40"),
        # a name the file imports from vLLM that this vLLM lacks
        (
            "ImportError",
            "cannot import name 'MiniMaxM3IndexerMetadata' from 'vllm.models.minimax_m3.common.sparse_attention'",
            [(FILE, 4)],
            "vllm.models.minimax_m3.common.sparse_attention",
            None,
            "this vLLM lacks what the file imports",
        ),
        # a vllm submodule the file imports directly that this vLLM lacks
        (
            "ModuleNotFoundError",
            "No module named 'vllm.models.minimax_m3.gone'",
            [(FILE, 5)],
            "vllm.models.minimax_m3.gone",
            None,
            "this vLLM lacks what the file imports",
        ),
        # the file ran whole, but this vLLM's package imports a class from it that it
        # does not define (a fork-era file over 0.24.0's nvidia/model.py, seen on the H200)
        (
            "ImportError",
            "cannot import name 'MiniMaxM3SparseForCausalLM' from 'vllm.models.minimax_m3.nvidia.model'",
            [("/t/vllm/models/minimax_m3/__init__.py", 17)],
            "vllm.models.minimax_m3.nvidia.model",
            None,
            "this vLLM imports a name the file does not define",
        ),
        # the file's module-level code called into vLLM, which raised
        (
            "RuntimeError",
            "bad argument",
            [(FILE, 90), (IN_VLLM, 12)],
            None,
            None,
            "called from the file's line",
        ),
    ],
)
def test_judge_fails_what_the_file_causes(exc_type, message, frames, name, syntax_file, expect) -> None:
    status, why = judge(exc_type, message, frames, FILE, name, IMPORTS, syntax_file)
    assert status == "failed" and expect in why, why
    assert HOW_TO_RUN not in why


@pytest.mark.parametrize(
    "exc_type, message, frames, name, syntax_file, expect",
    [
        # a third-party dependency missing, from vLLM's code or the file's own import
        (
            "ModuleNotFoundError",
            "No module named 'transformers'",
            [(FILE, 3), (IN_VLLM, 2)],
            "transformers",
            None,
            "a dependency is not installed",
        ),
        (
            "ModuleNotFoundError",
            "No module named 'transformers'",
            [(FILE, 3)],
            "transformers",
            None,
            "dependency",
        ),
        # vLLM's own code raising while the file's import runs (no kernel library: no GPU)
        (
            "AttributeError",
            "'_OpNamespace' '_C' object has no attribute 'rotary_embedding'",
            [(FILE, 4), (IN_VLLM, 44)],
            None,
            None,
            "while the file's import at",
        ),
        # a vllm module lacking one of vLLM's own submodules, reached through the file's import
        (
            "ModuleNotFoundError",
            "No module named 'vllm._C'",
            [(FILE, 5), (IN_VLLM, 3)],
            "vllm._C",
            None,
            "vLLM",
        ),
        # raised before the file's code ran (a parent package's __init__)
        (
            "ImportError",
            "libcuda.so.1: cannot open",
            [("/site/vllm/__init__.py", 9)],
            None,
            None,
            "before the file",
        ),
        # a syntax error in vLLM, not in the file
        ("SyntaxError", "invalid syntax", [], None, IN_VLLM, "vLLM itself does not compile"),
        # a third-party package that lacks a name the file imports from it
        (
            "ImportError",
            "cannot import name 'X' from 'transformers'",
            [(FILE, 3)],
            "transformers",
            None,
            "lacks",
        ),
    ],
)
def test_judge_skips_what_the_environment_causes(
    exc_type, message, frames, name, syntax_file, expect
) -> None:
    status, why = judge(exc_type, message, frames, FILE, name, IMPORTS, syntax_file)
    assert status == "skipped" and expect in why, why
    assert why.endswith(HOW_TO_RUN)


def _import_level(proc: subprocess.CompletedProcess[str]) -> dict:
    (entry,) = json.loads(proc.stdout)["files"]
    return {lv["level"]: lv for lv in entry["levels"]}["import"]


def _stub_tree(tmp_path: Path, tail: str = "", init: str = STUB_VLLM, **modules: str) -> Path:
    """The rewritten fork-era file in a stand-in vLLM, with ``tail`` appended to it and
    real ``vllm/<name>.py`` modules beside the stubs."""
    source = (FIXTURES / "fork_era" / "expected.py").read_text() + tail
    nvidia = make_vllm_tree(tmp_path, {"model.py": source.encode()}, init=init)
    for name, code in modules.items():
        (tmp_path / "vllm" / f"{name}.py").write_text(code)
    return nvidia / "model.py"


def test_a_lone_file_in_a_bare_tree_skips_the_import_with_the_reason(tmp_path: Path) -> None:
    nvidia = tmp_path / "vllm" / "models" / "minimax_m3" / "nvidia"
    nvidia.mkdir(parents=True)
    path = nvidia / "model.py"
    shutil.copyfile(FIXTURES / "fork_era" / "expected.py", path)
    proc = cli("verify", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    level = _import_level(proc)
    assert level["status"] == "skipped"
    assert "namespace package" in level["reason"] and HOW_TO_RUN in level["reason"]
    assert f"{path}: import skipped: no vLLM in" in proc.stderr  # one unwrapped line, for logs
    required = cli("verify", str(path), "--json", "--require-import")
    assert required.returncode == 1
    level = _import_level(required)
    assert level["status"] == "failed" and level["reason"].endswith("(--require-import)")
    assert f"{path}: import failed: no vLLM in" in required.stderr


def test_an_import_of_vllm_that_needs_a_missing_dependency_is_skipped(tmp_path: Path) -> None:
    path = _stub_tree(tmp_path, init="import mm3_no_such_dependency\n" + STUB_VLLM)
    proc = cli("verify", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    level = _import_level(proc)
    assert level["status"] == "skipped", level
    assert level["reason"].startswith("import vllm: a dependency is not installed")
    assert "mm3_no_such_dependency" in level["reason"]
    assert cli("verify", str(path), "--require-import").returncode == 1


def test_a_vllm_module_the_file_imports_that_needs_a_missing_dependency_is_skipped(tmp_path: Path) -> None:
    path = _stub_tree(
        tmp_path, "\nfrom vllm.needsdep import thing\n", needsdep="import mm3_no_such_dependency\nthing = 1\n"
    )
    proc = cli("verify", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    level = _import_level(proc)
    assert level["status"] == "skipped" and "No module named 'mm3_no_such_dependency'" in level["reason"]


def test_vllms_own_code_raising_during_the_files_import_is_skipped(tmp_path: Path) -> None:
    """What a CPU machine with a real vLLM sees: vLLM's compilation passes read a
    kernel-library op at import time."""
    raising = "raise AttributeError(\"'_OpNamespace' '_C' object has no attribute 'rotary_embedding'\")\n"
    path = _stub_tree(tmp_path, "\nfrom vllm.needsgpu import thing\n", needsgpu=raising)
    proc = cli("verify", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    level = _import_level(proc)
    assert level["status"] == "skipped" and "rotary_embedding" in level["reason"], level
    assert "vllm/needsgpu.py:1" in level["reason"]


def test_a_file_that_raises_at_its_own_line_fails_with_the_traceback(tmp_path: Path) -> None:
    path = _stub_tree(tmp_path, "\nUNDEFINED_AT_IMPORT + 1\n")
    proc = cli("verify", str(path), "--json")
    assert proc.returncode == 1, proc.stderr
    level = _import_level(proc)
    assert level["status"] == "failed"
    assert "NameError: name 'UNDEFINED_AT_IMPORT' is not defined" in level["reason"]
    assert "the file's own line" in level["reason"]
    assert any("model.py" in line for line in level["details"])  # the traceback tail
    assert "UNDEFINED_AT_IMPORT" in level["details"][-1]
    assert "import failed" in proc.stderr and "UNDEFINED_AT_IMPORT" in proc.stderr


def test_a_name_this_vllm_lacks_fails_the_import(tmp_path: Path) -> None:
    path = _stub_tree(tmp_path, "\nfrom vllm.lacking import absent_name\n", lacking="present = 1\n")
    proc = cli("verify", str(path), "--json")
    assert proc.returncode == 1, proc.stderr
    level = _import_level(proc)
    assert level["status"] == "failed", level
    assert "this vLLM lacks what the file imports" in level["reason"]
    assert "cannot import name 'absent_name' from 'vllm.lacking'" in level["reason"]
    assert any("absent_name" in line for line in level["details"])


def test_a_native_file_gets_the_import_level_alone(tmp_path: Path) -> None:
    path = make_vllm_tree(
        tmp_path, {"model.py": (FIXTURES / "native" / "model.py").read_bytes()}, init=STUB_VLLM
    )
    proc = cli("verify", str(path / "model.py"), "--json")
    assert proc.returncode == 0, proc.stderr
    level = _import_level(proc)
    assert level["status"] == "passed", level
    assert "native call, no bypass to inspect" in level["reason"]


# The fused op's schema in the kernel libraries: vLLM 0.24.0's (read from its
# _C_stable_libtorch.abi3.so) and 0.33.0's (five more, defaulted).
_FORK19 = (
    "Tensor! qkv, Tensor q_norm_weight, Tensor k_norm_weight, Tensor cos_sin_cache, Tensor positions, "
    "int num_heads, int num_kv_heads, int rotary_dim, float eps, Tensor? index_q_norm_weight, "
    "Tensor? index_k_norm_weight, int num_index_heads, Tensor? slot_mapping, Tensor? index_slot_mapping, "
    "Tensor!? kv_cache, Tensor!? index_cache, int block_size, Tensor!? q_out, Tensor!? index_q_out"
)
SCHEMAS = {
    "0.24.0": f"_C::fused_minimax_m3_qknorm_rope_kv_insert({_FORK19}, str kv_cache_dtype) -> ()",
    "0.33.0": f"_C::fused_minimax_m3_qknorm_rope_kv_insert({_FORK19}, str kv_cache_dtype, "
    "bool skip_index_branch=False, Tensor!? q_fp8_out=None, float q_fp8_scale=1., "
    "Tensor? kv_k_scale=None, Tensor? kv_v_scale=None) -> ()",
}


@pytest.mark.parametrize(
    "version, extras", [("0.24.0", ["kv_cache_dtype"]), ("0.33.0", list(kernels.EXTRA_DEFAULTS))]
)
def test_adapter_reads_each_librarys_schema(version: str, extras: list[str]) -> None:
    arguments = torch._C.parse_schema(SCHEMAS[version]).arguments
    extra = kernels.schema_extras(version, arguments)
    assert [name for name, _ in extra] == extras
    assert dict(extra)["kv_cache_dtype"] == "auto"  # the fork's bf16 insert, unless the call passes one


def test_adapter_passes_a_native_calls_dtype_through_a_20_argument_library() -> None:
    """vLLM 0.24's op: the fork's 19 arguments + kv_cache_dtype. A fork-era call gets "auto";
    a native call's own dtype reaches the library."""
    seen: list[tuple[int, str]] = []
    extra = kernels.schema_extras("0.24.0", torch._C.parse_schema(SCHEMAS["0.24.0"]).arguments)

    def raw(*args):
        seen.append((len(args), args[19]))

    ops = kernels.KernelOps("0.24.0", raw, refops.reshape_and_cache_flash, extra)
    inputs = standin.Inputs.random(layercode.Shape(tokens=4))
    args = kernels._op_args(inputs, inputs.qkv.clone(), *kernels._outs(inputs))
    ops.fused(**args)
    ops.fused(**args, kv_cache_dtype="fp8_e4m3")
    assert seen == [(20, "auto"), (20, "fp8_e4m3")]


def test_adapter_refuses_an_unknown_parameter_without_a_default() -> None:
    schema = SCHEMAS["0.24.0"].replace("str kv_cache_dtype)", "str kv_cache_dtype, int mystery)")
    with pytest.raises(kernels.KernelUnavailable, match="'mystery' has no known fork value"):
        kernels.schema_extras("x", torch._C.parse_schema(schema).arguments)


def test_an_async_forward_is_refused_by_run_and_noted_by_verify_alike(tmp_path: Path) -> None:
    """vLLM calls a layer's forward synchronously: `run` refuses a site in `async def forward`
    up front, and `verify` says the same refusal - never a failure of its own making."""
    source = (FIXTURES / "fork_era" / "model.py").read_text()
    sparse = source.rindex("    def forward(", 0, source.index("self.kv_cache,"))  # the insert call's method
    odd = source[:sparse] + "    async def forward(" + source[sparse + len("    def forward(") :]
    target = tmp_path / "model.py"
    target.write_text(odd)
    ran = cli("run", str(target))
    assert ran.returncode == 2 and "async def forward" in ran.stderr, ran.stderr
    assert target.read_text() == odd
    (entry,) = verify([Target(target, "test")], timing=False).files
    assert entry.failed and entry.note is not None and "async def forward" in entry.note, entry.note
    assert not any("has no forward" in level.reason for level in entry.levels)
    assert any("forward is `async def`" in level.reason for level in entry.levels if level.status is Status.FAILED)


@pytest.mark.parametrize(
    "line, named",
    [
        ("        from aiter import reshape_and_cache  # a ROCm fork's path\n", "imports `aiter`"),
        ("        assert not self.impl.use_split_kv_decode(self.layer_name)\n", "has no `use_split_kv_decode`"),
    ],
    ids=["platform-package", "unmodelled-impl"],
)
def test_what_the_stand_in_does_not_model_skips_the_level_never_fails_it(tmp_path: Path, line: str, named: str) -> None:
    """A native file that imports a platform's package in its forward, or asks vLLM's attention
    impl for more than the stand-in models: the semantic level is skipped with what it lacks -
    a failure must be the file's, never the stand-in's."""
    source = (FIXTURES / "native" / "model.py").read_text()
    sparse = source.rindex("    def forward(")
    body = source.index("\n", sparse) + 1
    target = tmp_path / "model.py"
    target.write_text(source[:body] + line + source[body:])
    _, levels = semantic(target)
    assert levels["semantic"].status is Status.SKIPPED, levels["semantic"].reason
    assert named in levels["semantic"].reason


@pytest.mark.parametrize("part", ["__init__", "a mixin's method"])
def test_semantic_runs_what_the_layer_inherits_from_a_class_of_its_file(tmp_path: Path, part: str) -> None:
    """The layer's ``__init__`` (or the method that sets its flag) defined in a base class of the
    same file: the stand-in, built from the class's own body, could not run it ("the stand-in
    cannot run", or AttributeError). It takes what ``self.<name>`` reaches, as Python does."""
    source = (FIXTURES / "fork_era" / "expected.py").read_text()
    layer = "class MiniMaxM3SparseAttention(nn.Module, AttentionLayerBase):\n"
    start = source.index("    def __init__(", source.index(layer))
    end = source.index("\n    def ", start + 10) + 1
    if part == "__init__":
        moved, source = source[start:end], source[:start] + source[end:]
    else:
        flag = '        self._fp8_kv = "fp8" in self.kv_cache_dtype\n'
        moved, source = "    def _set_mode(self):\n" + flag, source.replace(flag, "        self._set_mode()\n")
    base = f"class _LayerBase(nn.Module):\n{moved}\n\n"
    path = tmp_path / "model.py"
    path.write_text(source.replace(layer, base + layer.replace("(nn.Module,", "(_LayerBase,")))
    level, _ = semantic(path)
    assert level.status is Status.PASSED, level.reason + "\n" + "\n".join(level.details)


INDEX_WRITE_START = "        # Index-key cache: one head per token, written by reshape_and_cache_flash,\n"


@pytest.mark.parametrize(
    "write, why",
    [
        pytest.param(
            "        idx_cache = self.indexer.index_cache.kv_cache\n"
            "        valid = index_slot_mapping >= 0\n"
            "        slots = index_slot_mapping[valid].long()\n"
            "        idx_cache[slots // 16, slots % 16] = index_key[valid].to(idx_cache.dtype)\n",
            "IndexError", id="block-size-16-hard-coded",
        ),
        pytest.param(
            "        idx_cache = self.indexer.index_cache.kv_cache.view(-1, self.idx_head_dim)\n"
            "        valid = (index_slot_mapping >= 0).unsqueeze(-1)\n"
            "        safe = index_slot_mapping.clamp(min=0).long()\n"
            "        idx_cache[safe] = torch.where(valid, index_key.to(idx_cache.dtype), idx_cache[safe])\n",
            "index cache identical: no", id="padded-slots-clamped-to-0",
        ),
    ],
)
def test_an_index_write_right_for_one_block_size_or_slot_set_only_fails(tmp_path: Path, write: str, why: str) -> None:
    """An index write that assumes the block size (16, the kernel level's), or sends padded tokens to
    slot 0 with row 0's old value (undoing a real token's write there): the semantic level runs a second
    block size and always has a real token in slot 0, so both fail (they passed)."""
    source = (FIXTURES / "patched" / "model.py").read_text()
    start = source.index(INDEX_WRITE_START)
    end = source.index("        )\n", source.index("ops.reshape_and_cache_flash(", start)) + len("        )\n")
    path = tmp_path / "model.py"
    path.write_text(source[:start] + write + source[end:])
    level, _ = semantic(path)
    assert level.status is Status.FAILED and why in level.reason, level.reason
