"""`run` proves before it writes (issue 29).

Where torch is importable, `run` runs verify's semantic level on the new source of every
file it is about to write; a rewrite that fails it is not written (exit 2, the level's
reason, the file untouched). Without torch, or where the stand-in cannot run the file, it
writes and says the rewrite is unproven and how to prove it. `check`, `preview`, the dry
runs and a `run` with nothing to write never import torch.

A wrong rewrite is made honestly: the real codemod runs, and its output is then broken in
a child process (``codemods.analysis.rewrite`` wrapped) in a way the structural validation
cannot see - the post-call write handed v for k and k for v.
"""

from __future__ import annotations

import json
import linecache
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli, python_c

from rewriter.targets import Target

# The real CLI with the codemod's output broken: every `self._insert_kv(a, b, ...)` of the
# new module gets its first two arguments swapped (k and v), only for the classes named in
# MM3_TEST_WRONG_CLASSES (default: every class). Planning validates structure only: this
# rewrite parses, compiles and a second pass finds it `patched`.
WRONG_REWRITE = r"""
import os, sys
import libcst as cst
import codemods.analysis as analysis

real = analysis.rewrite
only = set(filter(None, os.environ.get("MM3_TEST_WRONG_CLASSES", "").split(",")))


class SwapKV(cst.CSTTransformer):
    def leave_Call(self, original, updated):
        f = updated.func
        if (
            isinstance(f, cst.Attribute)
            and f.attr.value == "_insert_kv"
            and isinstance(f.value, cst.Name)
            and f.value.value == "self"
            and len(updated.args) >= 2
        ):
            a, b, *rest = updated.args
            return updated.with_changes(args=[a.with_changes(value=b.value), b.with_changes(value=a.value), *rest])
        return updated


def wrong(an):
    module = real(an)
    if only and not only & {s.class_name for s in an.sites}:
        return module
    return module.visit(SwapKV())


analysis.rewrite = wrong
from rewriter.cli import main

main(sys.argv[1:])
"""

# The real CLI where torch cannot be imported (find_spec finds nothing, `import torch` raises).
NO_TORCH = r"""
import sys
sys.modules["torch"] = None
from rewriter.cli import main

main(sys.argv[1:])
"""


def _copy(tmp_path: Path, variant: str, name: str = "model.py") -> Path:
    target = tmp_path / variant / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes((FIXTURES / variant / "model.py").read_bytes())
    return target


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "model.py")


# --- a wrong rewrite is not written -----------------------------------------------------------


def test_a_rewrite_that_fails_its_proof_is_not_written(tmp_path: Path) -> None:
    target = _copy(tmp_path, "fork_era")
    before = target.read_bytes()
    proc = python_c(WRONG_REWRITE, "run", "--backup", str(target))
    assert proc.returncode == 2, proc.stderr
    assert target.read_bytes() == before
    assert _leftovers(target.parent) == []  # no temporary file, no backup
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {target}: the rewrite failed its proof (semantic level): MiniMaxM3SparseAttention:"
        " fp8 cache = e4m3(bf16 cache) at every written slot: no; nothing written"
    ], proc.stderr
    assert "nothing written: a target was refused or failed" in proc.stderr
    assert "proven" not in proc.stderr and "1 file failed." in proc.stderr


def test_a_failed_proof_is_in_the_json_report(tmp_path: Path) -> None:
    target = _copy(tmp_path, "fork_era")
    proc = python_c(WRONG_REWRITE, "run", "--json", str(target))
    report = json.loads(proc.stdout)
    assert proc.returncode == report["exit_code"] == 2
    (entry,) = report["files"]
    assert entry["status"] == "error"
    assert entry["proof"]["level"] == "semantic"
    assert entry["proof"]["status"] == "failed"
    assert (
        entry["proof"]["reason"]
        == "MiniMaxM3SparseAttention: fp8 cache = e4m3(bf16 cache) at every written slot: no"
    )
    assert (
        "semantic: MiniMaxM3SparseAttention: fp8 cache = e4m3(bf16 cache) at every written slot: NO"
        in entry["proof"]["details"]
    )
    assert entry["error"].startswith("the rewrite failed its proof (semantic level): ")


def test_one_failed_proof_writes_no_file_at_all(tmp_path: Path) -> None:
    """All or nothing: the good file is proven, the wrong one fails, neither is written."""
    good = _copy(tmp_path, "fork_era")
    bad = tmp_path / "renamed" / "model.py"
    bad.parent.mkdir()
    bad.write_text(good.read_text().replace("MiniMaxM3SparseAttention", "WrongAttention"))
    before = {p: p.read_bytes() for p in (good, bad)}
    proc = python_c(
        WRONG_REWRITE, "run", "--json", str(good), str(bad), env={"MM3_TEST_WRONG_CLASSES": "WrongAttention"}
    )
    assert proc.returncode == 2, proc.stderr
    assert {p: p.read_bytes() for p in before} == before
    proofs = {f["path"]: (f["status"], f["proof"]["status"]) for f in json.loads(proc.stdout)["files"]}
    assert proofs == {str(good): ("needs-rewrite", "passed"), str(bad): ("error", "failed")}


def test_no_prove_writes_without_running_it(tmp_path: Path) -> None:
    """The opt-out: written as planned (here, wrongly), and said to be unproven."""
    target = _copy(tmp_path, "fork_era")
    proc = python_c(WRONG_REWRITE, "run", "--no-prove", "--json", str(target))
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() != (FIXTURES / "fork_era" / "model.py").read_bytes()
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["proof"]["status"] == "off"
    assert (
        f"unproven: {target}: --no-prove: not run before writing; to prove it: mm3-codemod verify {target}"
        in proc.stderr
    )


# --- a right rewrite is written, proven ------------------------------------------------------


def test_a_correct_rewrite_is_written_and_proven(tmp_path: Path) -> None:
    """Proven in every row verify runs the semantic level in: TP=1 and its default TPs."""
    from rewriter.verify import tp

    target = _copy(tmp_path, "fork_era")
    proc = cli("run", "--json", str(target))
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["status"] == "rewritten"
    assert entry["proof"]["status"] == "passed"
    tps = [plan.label.strip() for plan in tp.plans()[1:]]
    reason = "bf16 and fp8 cache runs agree (reference, cpu)" + (f"; {' and '.join(tps)} too" if tps else "")
    assert entry["proof"]["reason"] == reason
    for row in ["semantic", *(f"semantic {t}" for t in tps)]:  # each row ran the padded batch
        assert any(
            line.startswith(f"{row}: MiniMaxM3SparseAttention: ")
            and "padded tokens" in line
            and line.endswith(": yes")
            for line in entry["proof"]["details"]
        ), row
    assert f"proven: {target}: the semantic level passed before writing: {reason}" in proc.stderr.splitlines()


@pytest.mark.parametrize("variant", ["compiled_native", "compiled_native_lost_guard"])
def test_a_compile_aware_file_is_proven_on_both_paths(tmp_path: Path, variant: str) -> None:
    target = _copy(tmp_path, variant)
    proc = cli("run", "--json", str(target))
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == (FIXTURES / variant / "expected.py").read_bytes()
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["proof"]["status"] == "passed"
    assert "eager and compiled paths" in entry["proof"]["reason"]


def test_the_example_is_proven() -> None:
    proc = cli("run", "--example", "--json")
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["proof"]["status"] == "passed"
    assert "proven: " in proc.stderr


# --- unproven: written, and how to prove it --------------------------------------------------


def test_without_torch_it_writes_and_says_how_to_prove_it(tmp_path: Path) -> None:
    target = _copy(tmp_path, "fork_era")
    proc = python_c(NO_TORCH, "run", "--json", str(target))
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["proof"] == {
        "level": "semantic",
        "status": "unavailable",
        "reason": "torch is not installed",
        "details": [],
    }
    assert (
        f"unproven: {target}: torch is not installed, so the new code was not run before writing;"
        f" to prove it: {sys.executable} -m pip install torch --index-url https://download.pytorch.org/whl/cpu,"
        f" then mm3-codemod verify {target}"
    ) in proc.stderr.splitlines()


def test_without_torch_the_example_says_run_it_again() -> None:
    proc = python_c(NO_TORCH, "run", "--example")
    assert proc.returncode == 0, proc.stderr
    assert "torch is not installed, so the new code was not run before writing;" in proc.stderr
    install = f"{sys.executable} -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert f"to prove it: {install} and run it again" in proc.stderr  # torch by its name, never this tool's


def test_what_the_stand_in_cannot_run_is_written_unproven(tmp_path: Path) -> None:
    """A line the stand-in does not model: written, unproven, with the line quoted from the
    new source (which is not on disk yet: the old file's line there is another)."""
    target = tmp_path / "model.py"
    added = "        low, high = kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, None)\n"
    source = (FIXTURES / "separate_projections" / "model.py").read_text()
    anchor = "        num_tokens = qkv.shape[0]\n"
    assert source.count(anchor) == 1
    target.write_text(source.replace(anchor, anchor + added))
    proc = cli("run", "--json", str(target))
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["status"] == "rewritten"
    assert entry["proof"]["status"] == "skipped"
    written = target.read_text().splitlines()
    line = written.index(added.rstrip("\n")) + 1
    assert f"the stand-in cannot run model.py:{line} `{added.strip()}`" in entry["proof"]["reason"]
    assert f"unproven: {target}: the semantic level cannot run it here: " in proc.stderr
    assert f"to prove it: mm3-codemod verify {target}" in proc.stderr


# --- nothing to write: nothing to prove, no torch ----------------------------------------------

TORCH_PROBE = r"""
import sys
from rewriter.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("torch imported" if "torch" in sys.modules else "no torch", code)
"""


@pytest.mark.parametrize(
    "args, code",
    [
        (["check", "{fork_era}"], 1),
        (["check", "--diff", "{fork_era}"], 1),
        (["preview", "{fork_era}"], 1),
        (["run", "--dry-run", "{fork_era}"], 1),
        (["run", "--diff", "{fork_era}"], 1),
        (["run", "{patched}"], 0),  # nothing to do
        (["run", "{native}"], 0),
        (["run", "{fork_era}", "{two_candidates}"], 2),  # a refusal: nothing will be written
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else str(x),
)
def test_commands_that_write_nothing_never_import_torch(tmp_path: Path, args: list[str], code: int) -> None:
    files = {v: str(_copy(tmp_path, v)) for v in ("fork_era", "patched", "native", "two_candidates")}
    argv = [a.format(**files) for a in args]
    # A fresh interpreter: nothing imported before the command line runs.
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, *argv], capture_output=True, text=True, cwd=ROOT, env=os.environ
    )
    assert proc.stdout.splitlines()[-1] == f"no torch {code}", proc.stderr


def test_the_torch_probe_sees_a_proof(tmp_path: Path) -> None:
    target = _copy(tmp_path, "fork_era")
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, "run", str(target)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.stdout.splitlines()[-1] == "torch imported 0", proc.stderr


def test_dry_runs_carry_no_proof(tmp_path: Path) -> None:
    target = _copy(tmp_path, "fork_era")
    for flag in ("--dry-run", "--diff"):
        proc = cli("run", flag, "--json", str(target))
        (entry,) = json.loads(proc.stdout)["files"]
        assert entry["proof"] is None


# --- one judge: the semantic level of verify, on text not yet written -------------------------


def test_the_semantic_level_judges_the_source_it_is_given(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from rewriter.verify import Status, semantic_level

    path = _copy(tmp_path, "fork_era")  # the unpatched file: its own code fails
    classes = ["MiniMaxM3SparseAttention"]
    on_disk = semantic_level(path, classes)
    assert on_disk.status is Status.FAILED
    assert "kv_cache dtype must match qkv (bf16 cache only)" in on_disk.reason
    new = (FIXTURES / "fork_era" / "expected.py").read_text()
    assert semantic_level(path, classes, new).status is Status.PASSED
    # The new source's lines were only lent to linecache while it ran.
    assert linecache.getline(str(path), 276) == path.read_text().splitlines(keepends=True)[275]


def test_write_targets_proves_in_process(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from rewriter import commands

    target = _copy(tmp_path, "fork_era")
    report = commands.write_targets("run", [Target(target, "test")])
    (result,) = report.files
    assert result.proof is not None and result.proof.status == "passed"
    report = commands.write_targets(
        "run", [Target(_copy(tmp_path / "again", "fork_era"), "test")], prove=False
    )
    assert report.files[0].proof.status == "off"
