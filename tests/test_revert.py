"""revert: the structural inverse of run, byte for byte, and its refusals."""

from __future__ import annotations

import re

import json
import shutil
from pathlib import Path

import libcst as cst
import pytest
from conftest import FIXTURES, cli
from test_codemod import AFTER, BEFORE, variant

from codemods.analysis import analyze, analyze_revert, rewrite
from codemods.codegen import add_import_alias
from codemods.schema import Action, SiteState
from rewriter import commands
from rewriter.apply import FileStatus, plan_revert_file
from rewriter.targets import Target

BEFORE_STATES = ["fork_era", "reformatted", "no_insert_kv"]
# Variants whose revert changes model.py -> the hand-written clean file whose body it must equal.
REVERTED = {
    "patched": "fork_era",
    "seed_form": "fork_era",
    "old_form": "fork_era",
    "bf16_index_form": "fork_era",
    "half_applied": "fork_era",
    "patch_fuzz": "fork_era",
    "native_stale_bypass": "native",
    "seed_split": "fork_era",
}
# Native calls carrying a bypass: `run` takes it out, which is what `revert` does.
NATIVE_STRIPS = ["native_stale_bypass", "half_native", "half_native_plain", "wrapper_native"]
# On these native calls the bypass is torch.compile's only cache write: revert refuses.
COMPILED = ["compiled_native", "compiled_native_lost_guard", "compiled_native_vllm_flag", "fp8_index"]
ALL = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name not in COMPILED)


def copy(path: Path, tmp_path: Path, name: str = "model.py") -> Path:
    target = tmp_path / name
    shutil.copyfile(path, target)
    return target


def body(data: bytes) -> bytes:
    """Without the fixture's leading `# mm3-codemod fixture: …` comment block."""
    lines = data.splitlines(keepends=True)
    while lines and lines[0].startswith(b"#"):
        lines.pop(0)
    return b"".join(lines)


def run_file(path: Path) -> FileStatus:
    return commands.write_targets("run", [Target(path, "test")]).files[0].status


def revert_file(path: Path, whole: bool = False) -> FileStatus:
    return commands.write_targets("revert", [Target(path, "test")], whole_bypass=whole).files[0].status


def refuses_undo(path: Path) -> str:
    """``revert`` (without --whole-bypass) refuses before writing, as not an undo; its reason."""
    before = path.read_bytes()
    report = commands.write_targets("revert", [Target(path, "test")])
    (result,) = report.files
    assert result.status is FileStatus.REFUSED and result.not_an_undo, result
    assert path.read_bytes() == before
    (site,) = [s for s in result.sites if s.action is Action.REFUSE]
    assert "not the one `run` writes" in site.reason or "cannot put a bypass back" in site.reason
    assert "--whole-bypass" in site.reason
    return site.reason


# --- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("name", BEFORE_STATES)
def test_revert_of_run_is_the_original(name: str, tmp_path: Path) -> None:
    original = (FIXTURES / name / "model.py").read_bytes()
    target = copy(FIXTURES / name / "model.py", tmp_path)
    assert run_file(target) is FileStatus.REWRITTEN
    assert target.read_bytes() == (FIXTURES / name / "expected.py").read_bytes()
    assert revert_file(target) is FileStatus.REWRITTEN
    assert target.read_bytes() == original
    assert revert_file(target) is FileStatus.UNCHANGED  # a second revert finds nothing


@pytest.mark.parametrize("name", BEFORE_STATES)
def test_run_of_revert_is_the_patched_file(name: str, tmp_path: Path) -> None:
    patched = (FIXTURES / name / "expected.py").read_bytes()
    target = copy(FIXTURES / name / "expected.py", tmp_path)
    assert revert_file(target) is FileStatus.REWRITTEN
    assert target.read_bytes() == (FIXTURES / name / "model.py").read_bytes()
    assert run_file(target) is FileStatus.REWRITTEN
    assert target.read_bytes() == patched


# The fixtures `run` rewrites: their expected.py is not their model.py.
REWRITTEN = [n for n in ALL if (FIXTURES / n / "expected.py").read_bytes() != (FIXTURES / n / "model.py").read_bytes()]


@pytest.mark.parametrize("name", REWRITTEN)
def test_revert_after_run_gives_back_the_original_or_refuses_before_writing(name: str, tmp_path: Path) -> None:
    """Whatever ``run`` wrote, ``revert`` gives back what it started from, or refuses with the
    reason and writes nothing: never a third file."""
    original = (FIXTURES / name / "model.py").read_bytes()
    target = copy(FIXTURES / name / "model.py", tmp_path)
    assert run_file(target) is FileStatus.REWRITTEN
    ran = target.read_bytes()
    report = commands.write_targets("revert", [Target(target, "test")])
    if report.files[0].status is FileStatus.REWRITTEN:
        assert target.read_bytes() == original
    elif name in NATIVE_STRIPS:  # run took a stale bypass off a native call: none to take out
        assert report.files[0].status is FileStatus.UNCHANGED and target.read_bytes() == ran
    else:
        assert report.exit_code == 2 and target.read_bytes() == ran
        assert all(s.reason.startswith("cannot revert: ") for s in report.files[0].sites if s.action is Action.REFUSE)


def test_what_revert_gives_back_is_decided_by_run_itself(tmp_path: Path) -> None:
    """The fixtures of both kinds are there: run's input comes back where it had no bypass, and
    a fork's own bypass that run upgraded is refused, naming the first line run writes otherwise."""
    gave_back, refused = [], []
    for name in ALL:
        target = copy(FIXTURES / name / "model.py", tmp_path, f"{name}.py")
        if run_file(target) is FileStatus.REWRITTEN:
            status = revert_file(target)
            (gave_back if status is FileStatus.REWRITTEN else refused).append(name)
    assert set(BEFORE_STATES) <= set(gave_back)
    assert {"amd_fork_era", "seed_form", "old_form"} <= set(refused)
    reason = refuses_undo(copy(FIXTURES / "amd_fork_era" / "expected.py", tmp_path))
    assert "line 209 has `# The HIP build of the fused op" in reason


def test_the_whole_bypass_command_it_suggests_works_as_written(tmp_path: Path) -> None:
    target = copy(FIXTURES / "patched" / "model.py", tmp_path)
    proc = cli("revert", target.name, cwd=tmp_path)
    assert proc.returncode == 2 and target.read_bytes() == (FIXTURES / "patched" / "model.py").read_bytes()
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("to take the whole bypass out anyway: ")]
    words = line.split(": ", 1)[1].split()
    assert words[:3] == ["mm3-codemod", "revert", "--whole-bypass"]
    again = cli(*words[1:], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert target.read_bytes() == (FIXTURES / "patched" / "reverted.py").read_bytes()


def test_check_says_what_revert_refuses(tmp_path: Path) -> None:
    target = copy(FIXTURES / "seed_form" / "expected.py", tmp_path)
    why = refuses_undo(target).removeprefix("cannot revert: ")
    checked = commands.analyze_targets("check", [Target(target, "test")])
    (site,) = [s for s in checked.files[0].sites if s.state is SiteState.PATCHED]
    assert why in site.reason


@pytest.mark.parametrize("name", sorted(REVERTED))
def test_revert_leaves_a_clean_file(name: str, tmp_path: Path) -> None:
    """The seed's own patch, the half-applied merges and the stale native bypass."""
    reverted = (FIXTURES / name / "reverted.py").read_bytes()
    clean = FIXTURES / REVERTED[name] / "model.py"
    assert body(reverted) == body(clean.read_bytes())  # reverted.py is the hand-written clean file
    target = copy(FIXTURES / name / "model.py", tmp_path)
    if name not in NATIVE_STRIPS:  # a bypass run did not write: taking it out is not an undo
        refuses_undo(target)
    assert revert_file(target, whole=name not in NATIVE_STRIPS) is FileStatus.REWRITTEN
    assert target.read_bytes() == reverted
    assert revert_file(target) is FileStatus.UNCHANGED


@pytest.mark.parametrize("name", sorted(REVERTED))
def test_run_after_revert(name: str, tmp_path: Path) -> None:
    """What holds for the variants that are not run's own output: run then writes
    exactly what it writes for the clean file, and revert goes back again."""
    clean = REVERTED[name]
    target = copy(FIXTURES / name / "reverted.py", tmp_path)
    status = run_file(target)
    after_run = target.read_bytes()
    assert body(after_run) == body((FIXTURES / clean / "expected.py").read_bytes())
    assert status is (FileStatus.UNCHANGED if clean == "native" else FileStatus.REWRITTEN)
    revert_file(target)
    assert target.read_bytes() == (FIXTURES / name / "reverted.py").read_bytes()


@pytest.mark.parametrize("name", NATIVE_STRIPS)
def test_run_on_a_bypassed_native_call_is_its_revert(name: str, tmp_path: Path) -> None:
    ran = copy(FIXTURES / name / "model.py", tmp_path, "ran.py")
    reverted = copy(FIXTURES / name / "model.py", tmp_path, "reverted.py")
    assert run_file(ran) is FileStatus.REWRITTEN
    assert revert_file(reverted) is FileStatus.REWRITTEN
    assert ran.read_bytes() == reverted.read_bytes() == (FIXTURES / name / "expected.py").read_bytes()
    (site,) = [
        s for s in analyze(cst.parse_module(ran.read_bytes())).sites if s.state is not SiteState.NOT_A_SITE
    ]
    assert site.state is SiteState.NATIVE


@pytest.mark.parametrize("name", ["half_applied", "patch_fuzz"])
def test_revert_of_completed_half_applied_files(name: str, tmp_path: Path) -> None:
    target = copy(FIXTURES / name / "expected.py", tmp_path)
    refuses_undo(target)  # run completed a merge's half: its removal is not what was there before
    revert_file(target, whole=True)
    assert target.read_bytes() == (FIXTURES / name / "reverted.py").read_bytes()


def test_the_seed_patch_cannot_come_back_byte_for_byte(tmp_path: Path) -> None:
    """run(revert(y)) == y holds for run's own output only: the seed's comments and
    wide index_k slice are not what run writes. It ends in run's patched form."""
    target = copy(FIXTURES / "patched" / "model.py", tmp_path)
    refuses_undo(target)
    revert_file(target, whole=True)
    run_file(target)
    assert target.read_bytes() != (FIXTURES / "patched" / "model.py").read_bytes()
    assert body(target.read_bytes()) == body((FIXTURES / "fork_era" / "expected.py").read_bytes())


@pytest.mark.parametrize("name", ALL)
def test_revert_is_idempotent_on_every_fixture(name: str, tmp_path: Path) -> None:
    target = copy(FIXTURES / name / "model.py", tmp_path)
    first = commands.write_targets("revert", [Target(target, "test")], whole_bypass=True)
    assert first.exit_code == 0
    once = target.read_bytes()
    second = plan_revert_file(target)
    assert second.status in (FileStatus.UNCHANGED, FileStatus.NO_SITES)
    assert target.read_bytes() == once
    if (FIXTURES / name / "reverted.py").exists():
        assert once == (FIXTURES / name / "reverted.py").read_bytes()
    elif name not in REVERTED and name not in NATIVE_STRIPS:
        assert once == (FIXTURES / name / "model.py").read_bytes()  # nothing to revert


# --- the codemod on inline files ------------------------------------------------------------


def reverted(source: str) -> str:
    return rewrite(analyze_revert(cst.parse_module(source))).code


def run(source: str) -> str:
    return rewrite(analyze(cst.parse_module(source))).code


def only_revert_site(source: str):
    (site,) = [s for s in analyze_revert(cst.parse_module(source)).sites if s.action is not Action.NONE]
    return site


def test_inline_before_after() -> None:
    assert reverted(AFTER) == BEFORE
    assert reverted(BEFORE) == BEFORE
    site = only_revert_site(AFTER)
    assert (site.state, site.action) == (SiteState.PATCHED, Action.REVERT)
    assert "_insert_kv removed" in site.reason


@pytest.mark.parametrize(
    "edits",
    [
        # a bare callee: run imports reshape_and_cache_flash beside it, revert drops it again
        (
            (
                "from vllm import _custom_ops as ops\n",
                "from vllm._custom_ops import fused_minimax_m3_qknorm_rope_kv_insert\n",
            ),
            ("        ops.fused", "        fused"),
        ),
        (("        ops.fused", "        torch.ops._C.fused"),),
        # a local holding the cache, and a taken local name (k -> k_fp8)
        (
            ("        ops.fused", "        cache = self.kv_cache\n        ops.fused"),
            ("self.kv_cache, self.index_cache, 128", "cache, self.index_cache, 128"),
            ("        return q, index_q", "        k = 0\n        return q, index_q, k"),
        ),
    ],
    ids=["bare-callee", "torch-ops", "local-cache-and-taken-name"],
)
def test_inline_round_trips(edits) -> None:
    source = variant(BEFORE, *edits)
    out = run(source)
    assert out != source
    assert reverted(out) == source


def test_tabs_and_crlf_round_trip() -> None:
    source = BEFORE.replace("    ", "\t").replace("\n", "\r\n")
    assert reverted(run(source)) == source


def test_an_unknown_comment_above_the_guard_is_kept() -> None:
    with_note = variant(
        AFTER,
        (
            "        # fp8 KV cache: cache arguments None",
            "        # NOTE: keep in sync with the AMD path.\n        # fp8 KV cache: cache arguments None",
        ),
    )
    out = reverted(with_note)
    assert "        # NOTE: keep in sync with the AMD path.\n        ops.fused" in out
    assert "insert_via_fused" not in out and "_fp8_kv" not in out


def test_metadata_form_restored_with_its_import() -> None:
    """A class whose file imports the metadata classes had the attn_metadata _insert_kv."""
    before = variant(
        BEFORE,
        (
            "from vllm import _custom_ops as ops\n",
            "from vllm import _custom_ops as ops\n"
            "from vllm.forward_context import get_forward_context\n"
            "from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3IndexerMetadata\n",
        ),
        (
            "    def forward(self, positions, qkv, slots, index_slots, q, index_q):\n",
            "    def forward(self, positions, qkv, index_q, q):\n"
            "        slot_map = get_forward_context().slot_mapping\n"
            "        slots = slot_map[self.layer_name]\n"
            "        index_slots = slot_map[self.indexer.prefix]\n",
        ),
        (
            "        return q, index_q",
            "        meta: MiniMaxM3IndexerMetadata = None\n        return q, index_q",
        ),
    )
    out = reverted(run(before))
    assert (
        "from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3IndexerMetadata, "
        "MiniMaxM3SparseMetadata\n" in out
    )
    assert "        main_meta = attn_metadata[self.layer_name]\n" in out
    assert "        index_meta = attn_metadata[self.indexer.prefix]\n" in out
    assert "            main_meta.slot_mapping,\n" in out
    assert "_fp8_kv" not in out and "insert_via_fused" not in out
    site = only_revert_site(run(before))
    assert "attn_metadata form" in site.reason
    # the restored file is a clean fork-era one: run rewrites it again
    assert [s.state for s in analyze(cst.parse_module(out)).sites] == [SiteState.NEEDS_BYPASS]


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (("        return q, index_q\n", "        return q, index_q, insert_via_fused\n"), "guard"),
        (
            ("    def forward(", "    def is_fp8(self):\n        return self._fp8_kv\n\n    def forward("),
            "`self._fp8_kv` is also used",
        ),
        (
            ("            self._insert_kv(k, v", "            print(k)\n            self._insert_kv(k, v"),
            "more than slices",
        ),
        (("        return q, index_q\n", "        return q, index_q, k\n"), "used after it"),
        (
            (
                "    def forward(",
                "    def again(self, a, b, c, d, e):\n        self._insert_kv(a, b, c, d, e)\n\n    def forward(",
            ),
            "called outside the bypass",
        ),
        (("        if not insert_via_fused:\n", "        if True:\n"), "is not wired"),
        (
            ('self._fp8_kv = "fp8" in self.kv_cache_dtype', "self._fp8_kv = is_fp8(self.kv_cache_dtype)"),
            "assigned a call",
        ),
    ],
    ids=[
        "guard-read-elsewhere",
        "flag-read-elsewhere",
        "extra-statement-in-block",
        "slice-used-later",
        "insert-kv-other-caller",
        "unguarded-block",
        "flag-from-a-call",
    ],
)
def test_refusals(edit: tuple[str, str], reason: str) -> None:
    source = variant(AFTER, edit)
    compile(source, "<variant>", "exec")
    site = only_revert_site(source)
    assert site.action is Action.REFUSE, site.reason
    assert reason in site.reason


@pytest.mark.parametrize(
    ("before", "name", "after"),
    [
        ("from m import A, C\n", "B", "from m import A, B, C\n"),
        ("from m import A\n", "B", "from m import A, B\n"),
        ("from m import B\n", "A", "from m import A, B\n"),
        ("from m import (\n    A,\n    C,\n)\n", "B", "from m import (\n    A,\n    B,\n    C,\n)\n"),
        ("from m import (\n    A,\n    B,\n)\n", "C", "from m import (\n    A,\n    B,\n    C,\n)\n"),
        ("from m import (\n    A,\n    B\n)\n", "C", "from m import (\n    A,\n    B,\n    C\n)\n"),
        # isort order: classes before functions
        ("from m import Alpha, select\n", "Beta", "from m import Alpha, Beta, select\n"),
        # not sorted: appended
        ("from m import C, A\n", "B", "from m import C, A, B\n"),
    ],
)
def test_add_import_alias(before: str, name: str, after: str) -> None:
    module = cst.parse_module(before)
    (stmt,) = module.body
    imp = stmt.body[0]
    new = module.with_changes(body=[stmt.with_changes(body=[add_import_alias(imp, name)])])
    assert new.code == after


# --- the CLI -----------------------------------------------------------------------------------


def test_cli_revert_check_diff_and_write(tmp_path: Path) -> None:
    target = copy(FIXTURES / "fork_era" / "expected.py", tmp_path)
    patched = target.read_bytes()

    for dry in ("--dry-run", "--check"):  # --check: the old spelling, kept hidden
        proc = cli("revert", dry, str(target))
        assert proc.returncode == 1 and proc.stdout == ""
        assert "patched -> revert" in proc.stderr and "1 file would be reverted." in proc.stderr
        assert f"to take the fp8 bypass out: mm3-codemod revert {target}" in proc.stderr
        assert target.read_bytes() == patched

    proc = cli("revert", "--diff", str(target))
    assert proc.returncode == 1
    assert proc.stdout.startswith("--- a/model.py\n+++ b/model.py\n")
    assert "-        insert_via_fused = not self._fp8_kv\n" in proc.stdout
    assert "+    MiniMaxM3SparseMetadata,\n" in proc.stdout
    assert target.read_bytes() == patched

    proc = cli("revert", "--json", "--backup", str(target))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["command"] == "revert" and report["exit_code"] == 0
    (entry,) = report["files"]
    assert entry["status"] == "rewritten"
    site = next(s for s in entry["sites"] if s["action"] == "revert")
    assert site["state"] == "patched" and site["class"] == "MiniMaxM3SparseAttention"
    assert target.read_bytes() == (FIXTURES / "fork_era" / "model.py").read_bytes()
    assert Path(entry["backup"]).read_bytes() == patched

    proc = cli("revert", "--exit-non-zero-on-fix", str(target))
    assert proc.returncode == 0  # nothing left to revert
    assert "1 file left unchanged." in proc.stderr


def test_cli_revert_exit_non_zero_on_fix_and_show_diff(tmp_path: Path) -> None:
    target = copy(FIXTURES / "no_insert_kv" / "expected.py", tmp_path)
    proc = cli("revert", "--exit-non-zero-on-fix", "--show-diff", str(target))
    assert proc.returncode == 1
    assert "-    def _insert_kv(\n" in proc.stdout
    assert "1 file reverted." in proc.stderr
    assert target.read_bytes() == (FIXTURES / "no_insert_kv" / "model.py").read_bytes()


def test_cli_revert_is_all_or_nothing(tmp_path: Path) -> None:
    good = copy(FIXTURES / "fork_era" / "expected.py", tmp_path, "good.py")
    bad = copy(FIXTURES / "fork_era" / "expected.py", tmp_path, "bad.py")
    # The sparse layer's forward (the last `return output`) reads the guard once more.
    text = bad.read_text().rsplit("        return output\n", 1)
    bad.write_text("        return output, insert_via_fused\n".join(text))
    before = good.read_bytes(), bad.read_bytes()
    proc = cli("revert", str(good), str(bad))
    assert proc.returncode == 2
    assert (good.read_bytes(), bad.read_bytes()) == before
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "refused" in errors[0]
    assert "the guard `insert_via_fused` is also used" in proc.stderr


def test_run_takes_a_stale_native_bypass_out(tmp_path: Path) -> None:
    target = copy(FIXTURES / "native_stale_bypass" / "model.py", tmp_path)
    proc = cli("run", str(target))
    assert proc.returncode == 0, proc.stderr
    assert "half-applied -> strip" in proc.stderr and "native kernel writes fp8" in proc.stderr
    assert cli("check", str(target)).returncode == 0  # a clean native call now


def test_a_strip_it_cannot_prove_advises_no_deletion_and_its_way_out_works(tmp_path: Path) -> None:
    """The post-call block also does something of the fork's own: which lines are the bypass's
    alone is not proven, so no deletion is advised (the block may be read elsewhere); the way
    out it names - restore the lost guard, serve with a bf16 cache - applied as written, leaves
    a file whose forward runs (no NameError), which the tool then reads without that error."""
    source = (FIXTURES / "half_native_plain" / "model.py").read_text()
    odd = variant(
        source,
        (
            "            self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)\n",
            "            self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)\n"
            "            self.kv_written = True\n",
        ),
    )
    target = tmp_path / "model.py"
    target.write_text(odd)
    proc = cli("check", str(target))
    assert proc.returncode == 2, proc.stderr
    assert "every forward raises NameError" in proc.stderr
    assert "delete" not in proc.stderr.lower() and "no line is advised for deletion" in proc.stderr
    guard = re.search(r"restore the lost guard before the call, `(.*?)`", proc.stderr)
    flag = re.search(r"\(and `(.*?)` in __init__\)", proc.stderr)
    assert guard and flag, proc.stderr
    # the way out, applied mechanically: the guard before the call, the flag in __init__
    call = odd.index("        qknorm_rope_kv_insert(\n") if "        qknorm_rope_kv_insert(\n" in odd else odd.index("        ops.fused_")
    fixed = odd[:call] + f"        {guard.group(1)}\n" + odd[call:]
    anchor = "        self.kv_cache_dtype = "
    line_end = fixed.index("\n", fixed.index(anchor)) + 1
    fixed = fixed[:line_end] + f"        {flag.group(1)}\n" + fixed[line_end:]
    target.write_text(fixed)
    after = cli("check", str(target))
    assert "NameError" not in after.stderr and "AttributeError" not in after.stderr, after.stderr
    assert "delete" not in after.stderr.lower()


def test_revert_over_a_vllm_root(tmp_path: Path) -> None:
    from conftest import make_vllm_tree

    nvidia = make_vllm_tree(
        tmp_path,
        {
            "model.py": (FIXTURES / "half_applied" / "model.py").read_bytes(),
            "mtp.py": b"# no fused op here\n",
        },
        init="raise RuntimeError('vllm was imported')\n",
    )
    proc = cli("revert", "--json", "--whole-bypass", "--vllm-root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    statuses = {Path(f["path"]).name: f["status"] for f in json.loads(proc.stdout)["files"]}
    assert statuses == {"model.py": "rewritten", "mtp.py": "no-sites"}
    assert (nvidia / "model.py").read_bytes() == (FIXTURES / "half_applied" / "reverted.py").read_bytes()


STALE = (FIXTURES / "native_stale_bypass" / "model.py").read_text()
GUARD_LINE = "        insert_via_fused = not self._fp8_kv\n"
FLAG_LINE = '        self._fp8_kv = "fp8" in self.kv_cache_dtype\n'
POST_BLOCK = STALE[
    STALE.index("        if not insert_via_fused:\n") : STALE.index("        return self.attend")
]
GUARDED = "self.kv_cache if insert_via_fused else None,\n            self.indexer.index_cache.kv_cache if insert_via_fused else None,"
PLAIN = "self.kv_cache,\n            self.indexer.index_cache.kv_cache,"


@pytest.mark.parametrize(
    "edits",
    [
        ((GUARD_LINE, ""),),  # the guard assignment lost in the merge (NameError)
        ((GUARD_LINE, ""), (FLAG_LINE, "")),
        ((GUARD_LINE, ""), (POST_BLOCK, ""), (GUARDED, PLAIN)),  # only the flag and _insert_kv
        ((FLAG_LINE, ""), (POST_BLOCK, "")),  # guard and guarded arguments only
    ],
    ids=["no-guard", "no-guard-no-flag", "flag-and-insert-kv", "guard-only"],
)
def test_half_applied_stale_bypass_on_a_native_call(edits) -> None:
    source = variant(STALE, *edits)
    assert [s.state for s in analyze(cst.parse_module(source)).sites][-1] is SiteState.HALF_APPLIED
    out = reverted(source)
    clean = (FIXTURES / "native" / "model.py").read_bytes()
    assert body(out.encode()) == body(clean)
    assert [s.state for s in analyze(cst.parse_module(out)).sites][-1] is SiteState.NATIVE


def _mixed_merges() -> dict[str, str]:
    """The two other shapes of the lost-guard merge, built from the fixtures that bracket them."""
    full = (FIXTURES / "half_native" / "model.py").read_text()
    plain = (FIXTURES / "half_native_plain" / "model.py").read_text()
    plain_insert = plain[plain.index("    def _insert_kv(") :]
    # a compiled path whose custom op calls _insert_kv itself; no delegate
    start = full.index("    layer._insert_kv_into_caches(\n")
    end = full.index("    )\n", start) + len("    )\n")
    no_delegate = (
        full[:start]
        + "    layer._insert_kv(\n        key, value, index_key,"
        + " slot_mapping[layer.layer_name], slot_mapping[layer.indexer.index_cache.prefix]\n    )\n"
        + full[end:]
    )
    no_delegate = no_delegate[: no_delegate.index("    def _insert_kv(")] + plain_insert
    # the delegate without a compiled path (no custom op, a plain `if not insert_via_fused:` block)
    block = full[
        full.index("        if torch.compiler.is_compiling() or not") : full.index(
            "        return self.attend"
        )
    ]
    plain_block = plain[
        plain.index("        if not insert_via_fused:") : plain.index("        return self.attend")
    ]
    no_compile = full.replace(block, plain_block)
    no_compile = (
        no_compile[: no_compile.index("def _encode_layer_name")] + no_compile[no_compile.index("class ") :]
    )
    no_compile = no_compile.replace("from vllm.utils.torch_utils import direct_register_custom_op\n", "")
    return {"compile branch, no delegate": no_delegate, "delegate, no compile branch": no_compile}


@pytest.mark.parametrize("shape", sorted(_mixed_merges()))
def test_every_shape_of_the_lost_guard_merge_is_taken_out_and_proven(shape: str, tmp_path: Path) -> None:
    from test_verify import Status, semantic  # torch: the tests' extra has it

    source = _mixed_merges()[shape]
    target = tmp_path / "model.py"
    target.write_text(source)
    proc = cli("check", str(target))
    assert proc.returncode == 1, proc.stderr
    assert "insert_via_fused" in proc.stderr and "every forward raises NameError" in proc.stderr
    before, _ = semantic(target)
    assert before.status is Status.FAILED and "NameError: name 'insert_via_fused'" in before.reason
    proc = cli("run", str(target))
    assert proc.returncode == 0, proc.stderr
    assert "half-applied -> strip" in proc.stderr
    # past the header comment: the same clean native layer as the fixtures' own strip
    code = target.read_text().split("\nimport torch\n", 1)[1]
    assert code == (FIXTURES / "half_native" / "expected.py").read_text().split("\nimport torch\n", 1)[1]
    assert cli("check", str(target)).returncode == 0
    level, _ = semantic(target)
    assert level.status is Status.PASSED, level.reason + "\n" + "\n".join(level.details)
    assert any("padded tokens (slot -1, last 3) wrote nothing: yes" in d for d in level.details)


@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("form", ["model.py", "expected.py"])
def test_revert_refuses_a_bypass_that_is_the_compiled_paths_cache_write(name: str, form: str, tmp_path: Path) -> None:
    target = copy(FIXTURES / name / form, tmp_path)
    report = commands.write_targets("revert", [Target(target, "test")])
    assert report.exit_code == 2
    assert target.read_bytes() == (FIXTURES / name / form).read_bytes()
    (site,) = [s for s in report.files[0].sites if s.action.value == "refuse"]
    assert "taking it out would leave the compiled path writing no token" in site.reason


NESTED = '''from vllm import _custom_ops as ops


class Layer:
    def __init__(self, kv_cache_dtype):
        self.kv_cache_dtype = kv_cache_dtype
        self.FLAG = "fp8" in self.kv_cache_dtype

    def forward(self, qkv):
        def inner():
            ops.fused_minimax_m3_qknorm_rope_kv_insert(qkv, kv_cache=self.kv_cache)

        inner()
'''


@pytest.mark.parametrize("flag", ["_fp8_kv", "_quant_kv"])
def test_a_call_in_a_nested_def_of_a_class_with_a_flag_is_refused_whatever_the_flag_is_called(flag: str) -> None:
    """revert refused this under run's flag name only; under a fork's it said there was nothing to revert."""
    (site,) = analyze_revert(cst.parse_module(NESTED.replace("FLAG", flag))).sites
    assert site.action.value == "refuse" and "not directly in a method" in site.reason, site


def test_a_replaced_write_method_is_said_to_come_back_in_its_stock_form(tmp_path: Path) -> None:
    """`run` replaces a fork-era `_insert_kv` and keeps none of its lines; `revert` puts back the stock
    form. Where the file's own had a line of its own, that line is gone: the reason says so rather than
    letting exit 0 read as the file before `run`."""
    source = (FIXTURES / "fork_era" / "model.py").read_text()
    marker = "        main_meta = attn_metadata[self.layer_name]\n"
    assert source.count(marker) == 1
    head, _, tail = source.partition(marker)
    path = tmp_path / "model.py"
    path.write_text(head + marker + "        self.writes = getattr(self, 'writes', 0) + 1\n" + tail)
    assert cli("run", str(path)).returncode == 0
    reverted = plan_revert_file(path)
    assert reverted.new is not None and b"self.writes" not in reverted.new
    assert any("stock attn_metadata form" in s.reason and "did not keep" in s.reason for s in reverted.sites)
