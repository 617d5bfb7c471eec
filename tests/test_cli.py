"""The CLI contract: exit codes, stdout vs stderr, JSON, and never a broken write."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import libcst as cst
import pytest
from conftest import FIXTURES, cli

import codemods.analysis
from rewriter import apply, commands
from rewriter.apply import FileStatus
from rewriter.targets import Target, example_path


def test_check_exit_codes(copy_fixture) -> None:
    before = copy_fixture("fork_era")
    proc = cli("check", str(before))
    assert proc.returncode == 1
    assert proc.stdout == ""  # human output goes to stderr
    assert "needs-bypass" in proc.stderr and "mm3-codemod run" in proc.stderr
    assert cli("run", str(before)).returncode == 0
    assert cli("check", str(before)).returncode == 0


def test_preview_prints_the_diff_on_stdout_and_writes_nothing(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    original = target.read_bytes()
    proc = cli("preview", str(target))
    assert proc.returncode == 1
    # Outside the working folder, the diff is relative to the file's own folder.
    assert proc.stdout.startswith("--- a/model.py\n+++ b/model.py\n@@ ")
    assert f"diff paths are relative to {target.parent}" in proc.stderr
    assert "+        insert_via_fused = not self._fp8_kv\n" in proc.stdout
    assert target.read_bytes() == original


def test_preview_diff_applies_with_patch(copy_fixture, tmp_path: Path) -> None:
    """The diff is a real unified diff: applying it gives exactly what run writes."""
    import shutil
    import subprocess

    if shutil.which("patch") is None:
        pytest.skip("patch(1) is not installed")
    target = copy_fixture("fork_era")
    diff = cli("preview", str(target)).stdout
    subprocess.run(["patch", "-s", str(target)], input=diff, text=True, check=True)
    assert target.read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()


NVIDIA_MODEL = "vllm/models/minimax_m3/nvidia/model.py"


def git_fork(root: Path) -> Path:
    """A git repo laid out like a vLLM fork holding the fork-era model file, committed."""
    (root / NVIDIA_MODEL).parent.mkdir(parents=True)
    shutil.copyfile(FIXTURES / "fork_era" / "model.py", root / NVIDIA_MODEL)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t.invalid"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t.invalid"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "fork"]):
        subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True)
    return root


def elsewhere(fork: Path) -> Path:
    folder = fork.parent / "elsewhere"
    folder.mkdir(exist_ok=True)
    return folder


# (how the user names the target, from which folder) -> the folder the diff applies from
DIFF_ROOTS = {
    "--vllm-root elsewhere": (lambda fork: ["--vllm-root", str(fork)], lambda fork: fork.parent, "fork"),
    "--vllm-root .": (lambda fork: ["--vllm-root", "."], lambda fork: fork, "fork"),
    "bare, inside the fork": (lambda fork: [], lambda fork: fork / "vllm" / "models", "fork"),
    "relative file": (lambda fork: [NVIDIA_MODEL], lambda fork: fork, "fork"),
    "absolute file elsewhere": (
        lambda fork: [str(fork / NVIDIA_MODEL)],
        lambda fork: elsewhere(fork),
        "file",
    ),
}


@pytest.mark.parametrize("how", sorted(DIFF_ROOTS))
def test_preview_diff_applies_with_git_apply_from_the_targeted_root(tmp_path: Path, how: str) -> None:
    """`git apply` (and `patch -p1`) take preview's diff as it is, from the folder the user
    targeted - the fork root - or, for a file outside the working folder, the file's folder."""
    import importlib.util

    if how.startswith("bare") and importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")
    fork = git_fork(tmp_path / "fork")
    args, cwd, root = DIFF_ROOTS[how]
    proc = cli("preview", *args(fork), cwd=cwd(fork))
    assert proc.returncode == 1, proc.stderr
    apply_in = fork if root == "fork" else (fork / NVIDIA_MODEL).parent
    name = NVIDIA_MODEL if root == "fork" else "model.py"
    assert proc.stdout.startswith(f"--- a/{name}\n+++ b/{name}\n@@ ")
    if shutil.which("patch"):
        subprocess.run(
            ["patch", "-p1", "--dry-run", "-s"], input=proc.stdout, text=True, cwd=apply_in, check=True
        )
    subprocess.run(["git", "apply", "--check", "-"], input=proc.stdout, text=True, cwd=apply_in, check=True)
    subprocess.run(["git", "apply", "-"], input=proc.stdout, text=True, cwd=apply_in, check=True)
    assert (fork / NVIDIA_MODEL).read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()


def test_json_report(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    proc = cli("preview", "--json", str(target))
    report = json.loads(proc.stdout)  # stdout is one JSON document, nothing else
    assert report["command"] == "preview" and report["exit_code"] == 1 == proc.returncode
    (entry,) = report["files"]
    assert entry["status"] == "needs-rewrite"
    assert entry["diff"].startswith("--- ")
    site = next(s for s in entry["sites"] if s["state"] == "needs-bypass")
    assert site["class"] == "MiniMaxM3SparseAttention" and site["method"] == "forward"
    assert site["action"] == "rewrite" and site["line"] == 276
    assert report["summary"]["needs-rewrite"] == 1


def test_run_json_and_backup(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    original = target.read_bytes()
    proc = cli("run", "--json", "--backup", str(target))
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["status"] == "rewritten"
    assert Path(entry["backup"]) == target.with_name("model.py.orig")
    assert target.with_name("model.py.orig").read_bytes() == original


def test_run_says_how_to_confirm_and_how_to_launch(copy_fixture) -> None:
    from rewriter.report import FP8_LAUNCH

    target = copy_fixture("fork_era")
    proc = cli("run", str(target))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    confirm = next(i for i, line in enumerate(lines) if line.startswith("to confirm it by running it:"))
    assert lines[confirm + 1] == f"then, {FP8_LAUNCH}"
    assert cli("run", str(target)).stderr.count(FP8_LAUNCH) == 0  # nothing written: nothing to launch


def test_backup_never_overwrites_an_earlier_one(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    target.with_name("model.py.orig").write_text("older backup")
    assert cli("run", "--backup", str(target)).returncode == 0
    assert target.with_name("model.py.orig").read_text() == "older backup"
    assert (
        target.with_name("model.py.orig.1").read_bytes() == (FIXTURES / "fork_era" / "model.py").read_bytes()
    )


def test_run_example_writes_a_copy_not_the_package(tmp_path: Path) -> None:
    """The copy is rewritten (its diff turns the example into what run writes), then
    removed with its folder: the package's file is untouched, no temp folder is left."""
    original = example_path().read_bytes()
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = cli("run", "--example", "--show-diff", env={"TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr
    assert "1 file rewritten." in proc.stderr and "(removed afterwards)" in proc.stderr
    (tmp_path / "example_model.py").write_bytes(original)
    subprocess.run(["git", "apply", "-"], input=proc.stdout, text=True, cwd=tmp_path, check=True)
    assert (tmp_path / "example_model.py").read_bytes() == (
        FIXTURES / "fork_era" / "expected.py"
    ).read_bytes()
    assert example_path().read_bytes() == original
    assert list(temp.iterdir()) == []


def test_preview_example() -> None:
    proc = cli("preview", "--example")
    assert proc.returncode == 1
    assert "+            self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)" in proc.stdout


def test_run_is_all_or_nothing(copy_fixture) -> None:
    good = copy_fixture("fork_era")
    bad = copy_fixture("two_candidates")
    before = good.read_bytes(), bad.read_bytes()
    proc = cli("run", str(good), str(bad))
    assert proc.returncode == 2
    assert (good.read_bytes(), bad.read_bytes()) == before
    assert "nothing written" in proc.stderr


def test_directory_target_scans_every_py(tmp_path: Path, copy_fixture) -> None:
    copy_fixture("fork_era")
    copy_fixture("native")
    (tmp_path / "notes.txt").write_text("not python")
    proc = cli("check", "--json", str(tmp_path))
    report = json.loads(proc.stdout)
    assert sorted(Path(f["path"]).parent.name for f in report["files"]) == ["fork_era", "native"]
    assert proc.returncode == 1


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d / "missing.py", "no such file or directory"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "directory holds no .py files"),
    ],
    ids=["missing", "empty-dir"],
)
@pytest.mark.parametrize("command", ["check", "run"])
def test_target_errors_are_one_line_exit_2(tmp_path: Path, setup, message: str, command: str) -> None:
    path = setup(tmp_path)
    proc = cli(command, str(path))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert str(path) in line and message in line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"def f(:\n    ops.fused_minimax_m3_qknorm_rope_kv_insert(x)\n", "not valid Python"),
        (b"# fused_minimax_m3_qknorm_rope_kv_insert\nx = '\xff\xfe'\n", "cannot decode"),
    ],
    ids=["syntax-error", "not-utf8"],
)
def test_bad_files_exit_2_untouched(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "model.py"
    path.write_bytes(content)
    for command in ("check", "run"):
        proc = cli(command, str(path))
        assert proc.returncode == 2
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(path) in errors[0] and message in errors[0]
        assert path.read_bytes() == content


def test_file_without_the_op_is_not_parsed(tmp_path: Path) -> None:
    path = tmp_path / "other.py"
    path.write_text("this is not python at all (\n")
    proc = cli("check", str(path))
    assert proc.returncode == 0
    assert "no call of fused_minimax_m3_qknorm_rope_kv_insert found" in proc.stderr


def test_version() -> None:
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == "mm3-codemod 0.1.0"


# --- the write itself (library level) -----------------------------------------------------


def test_failed_validation_writes_nothing(copy_fixture, monkeypatch) -> None:
    target = copy_fixture("fork_era")
    original = target.read_bytes()

    def bad_rewrite(analysis):
        # Output that parses but still holds the fork-era call: the second pass objects.
        return analysis.module

    monkeypatch.setattr(codemods.analysis, "rewrite", bad_rewrite)
    report = commands.write_targets("run", [Target(target, "test")])
    assert report.exit_code == 2
    assert report.files[0].status is FileStatus.ERROR
    assert "second pass" in report.files[0].error
    assert target.read_bytes() == original


def test_uncompilable_output_writes_nothing(copy_fixture, monkeypatch) -> None:
    target = copy_fixture("fork_era")
    original = target.read_bytes()
    # `return` outside a function parses but does not compile.
    monkeypatch.setattr(codemods.analysis, "rewrite", lambda analysis: cst.parse_module("return 1\n"))
    report = commands.write_targets("run", [Target(target, "test")])
    assert report.files[0].status is FileStatus.ERROR
    assert "does not compile" in report.files[0].error
    assert target.read_bytes() == original


def test_mode_is_kept_and_no_temp_file_is_left(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    os.chmod(target, 0o640)
    commands.write_targets("run", [Target(target, "test")])
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.py"]


def test_symlink_target_is_rewritten_and_link_kept(copy_fixture) -> None:
    real = copy_fixture("fork_era")
    link = real.with_name("link.py")
    link.symlink_to(real.name)
    commands.write_targets("run", [Target(link, "test")])
    assert link.is_symlink()
    assert real.read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()


def test_read_only_file_is_refused(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    original = target.read_bytes()
    os.chmod(target, 0o444)
    report = commands.write_targets("run", [Target(target, "test")])
    assert report.exit_code == 2 and "read-only" in report.files[0].error
    assert target.read_bytes() == original


def test_file_changed_between_read_and_write_is_refused(copy_fixture, monkeypatch) -> None:
    target = copy_fixture("fork_era")
    real_plan = apply.plan_file

    def plan_then_edit(path, **kwargs):
        result = real_plan(path, **kwargs)
        path.write_bytes(path.read_bytes() + b"# edited by someone else\n")
        return result

    monkeypatch.setattr(commands, "plan_file", plan_then_edit)
    report = commands.write_targets("run", [Target(target, "test")])
    assert report.exit_code == 2 and "changed by someone else" in report.files[0].error
    assert target.read_bytes().endswith(b"# edited by someone else\n")


def test_bom_is_kept(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    target.write_bytes(apply.BOM + target.read_bytes())
    commands.write_targets("run", [Target(target, "test")])
    assert target.read_bytes() == apply.BOM + (FIXTURES / "fork_era" / "expected.py").read_bytes()


def test_preview_with_nothing_to_do(copy_fixture) -> None:
    proc = cli("preview", str(copy_fixture("patched")))
    assert proc.returncode == 0
    assert proc.stdout == ""
    assert "1 file left unchanged." in proc.stderr
