"""The pre-commit hooks, for real: pre-commit from PyPI in a temporary vLLM-fork repo.

``pre-commit try-repo`` builds the hook's environment (pip-installs this
project) in a fresh temporary store on every call, so it runs once here; the
per-fixture matrix goes through ``pre-commit run`` with the README's
``.pre-commit-config.yaml`` snippet, whose environment is built once per test
session in a session-scoped ``PRE_COMMIT_HOME``. Both install a snapshot of the
working tree (committed to a temporary git repo), so the hooks tested are the
code under test, from a clean clone or a checkout with uncommitted changes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES, ROOT, cli

NVIDIA = "vllm/models/minimax_m3/nvidia"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "mm3-codemod tests",
    "GIT_AUTHOR_EMAIL": "tests@mm3-codemod.invalid",
    "GIT_COMMITTER_NAME": "mm3-codemod tests",
    "GIT_COMMITTER_EMAIL": "tests@mm3-codemod.invalid",
}
# Never copied into the snapshot: environments, caches, build output.
SKIP = {".git", ".venv", ".ci-venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist"}


def git(*args: str, cwd: Path) -> str:
    proc = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **GIT_ENV}, check=True
    )
    return proc.stdout


def project_files() -> list[str]:
    """The working tree's files as git sees them (tracked and new, not ignored)."""
    try:
        listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    except (subprocess.CalledProcessError, FileNotFoundError):
        listed = ""
    if listed:
        return [f for f in listed.split("\0") if f and os.path.lexists(ROOT / f)]
    # Not a git checkout (an unpacked sdist): everything but environments and caches.
    return [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if not p.is_dir()
        and not any(part in SKIP or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
    ]


@pytest.fixture(scope="session")
def hook_repo(tmp_path_factory) -> tuple[Path, str]:
    """A git repo holding this project's working tree, committed: (path, rev)."""
    repo = tmp_path_factory.mktemp("mm3-codemod-snapshot")
    for name in project_files():
        source, target = ROOT / name, repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    git("init", "-q", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "snapshot", cwd=repo)
    return repo, git("rev-parse", "HEAD", cwd=repo).strip()


@pytest.fixture(scope="session")
def pre_commit_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pre-commit-home")


def pre_commit(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", *args, "--color", "never"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_ENV, "PRE_COMMIT_HOME": str(home)},
        timeout=900,
    )


def fork_repo(root: Path, files: dict[str, Path]) -> Path:
    """A git repo laid out like a vLLM fork, the files staged."""
    root.mkdir(parents=True, exist_ok=True)
    git("init", "-q", cwd=root)
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, root / name)
    git("add", "-A", cwd=root)
    return root


def readme_config(repo: Path, rev: str) -> str:
    """The README's `.pre-commit-config.yaml` snippet, pointed at the snapshot."""
    readme = (ROOT / "README.md").read_text()
    (snippet,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "mm3-codemod-check" in b]
    snippet = re.sub(r"(?m)^(\s*- repo:|\s*repo:).*$", rf"\g<1> {repo}", snippet)
    return re.sub(r"(?m)^(\s*rev:).*$", rf"\g<1> {rev}", snippet)


# --- the manifest ---------------------------------------------------------------------------


def test_manifest() -> None:
    hooks = {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert set(hooks) == {"mm3-codemod", "mm3-codemod-check"}
    for hook in hooks.values():
        assert hook["language"] == "python" and hook["require_serial"] is True
        files = re.compile(hook["files"])
        assert files.search(f"{NVIDIA}/model.py") and files.search(f"{NVIDIA}/ops/fused.py")
        assert not files.search("vllm/models/minimax_m3/amd/model.py")
        assert not files.search(f"{NVIDIA}/README.md")
    assert hooks["mm3-codemod"]["entry"].split()[:2] == ["mm3-codemod", "run"]
    assert "--exit-non-zero-on-fix" in hooks["mm3-codemod"]["entry"]
    assert hooks["mm3-codemod-check"]["entry"].split()[:2] == ["mm3-codemod", "check"]


# --- the hooks' commands, without pre-commit ----------------------------------------------------


def test_run_exit_non_zero_on_fix(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    proc = cli("run", "--exit-non-zero-on-fix", str(target))
    assert proc.returncode == 1, proc.stderr
    assert target.read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()
    assert cli("run", "--exit-non-zero-on-fix", str(target)).returncode == 0  # nothing to fix now
    assert cli("run", "--exit-non-zero-on-fix", str(copy_fixture("native_stale_bypass"))).returncode == 2


def test_check_diff(copy_fixture) -> None:
    target = copy_fixture("half_applied")
    original = target.read_bytes()
    proc = cli("check", "--diff", str(target))
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"--- {target}\n+++ {target}\n")
    assert "+        insert_via_fused = not self._fp8_kv\n" in proc.stdout
    assert proc.stderr.rstrip().endswith(
        "run `mm3-codemod run` with the same targets to apply the fp8 bypass"
    )
    assert target.read_bytes() == original
    patched = cli("check", "--diff", str(copy_fixture("patched")))
    assert (patched.returncode, patched.stdout) == (0, "")


# --- pre-commit try-repo ---------------------------------------------------------------------------


def test_try_repo(tmp_path: Path, hook_repo: tuple[Path, str], pre_commit_home: Path) -> None:
    """`pre-commit try-repo <project> --files …`: both hooks, in manifest order."""
    files = {
        f"{NVIDIA}/model.py": FIXTURES / "fork_era" / "model.py",
        f"{NVIDIA}/patched.py": FIXTURES / "patched" / "model.py",
        f"{NVIDIA}/half_applied.py": FIXTURES / "half_applied" / "model.py",
        f"{NVIDIA}/native.py": FIXTURES / "native" / "model.py",
        "vllm/models/minimax_m3/amd/model.py": FIXTURES / "fork_era" / "model.py",  # not a hook file
    }
    fork = fork_repo(tmp_path / "fork", files)
    repo, _ = hook_repo
    proc = pre_commit("try-repo", str(repo), "--files", *files, cwd=fork, home=pre_commit_home)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    fixer, checker = out.split("mm3-codemod (fp8 KV-cache bypass)")[1].split("mm3-codemod check (fp8")
    assert "Failed" in fixer and "- exit code: 1" in fixer and "files were modified by this hook" in fixer
    assert "2 files rewritten, 2 files left unchanged." in fixer
    assert "amd" not in out
    assert "Passed" in checker  # the fixer left nothing to fix
    expected = {
        f"{NVIDIA}/model.py": FIXTURES / "fork_era" / "expected.py",
        f"{NVIDIA}/half_applied.py": FIXTURES / "half_applied" / "expected.py",
    }
    for name, source in files.items():
        assert (fork / name).read_bytes() == expected.get(name, source).read_bytes(), name


# --- pre-commit run with the README's config, per fixture ---------------------------------------------

# (hook, fixture) -> (hook exit code or None when it passes, file afterwards, text in the output)
MATRIX = {
    ("mm3-codemod", "fork_era"): (1, "expected.py", "1 file rewritten."),
    ("mm3-codemod", "half_applied"): (1, "expected.py", "half-applied -> complete"),
    ("mm3-codemod", "patched"): (None, "model.py", ""),
    ("mm3-codemod", "native"): (None, "model.py", ""),
    ("mm3-codemod", "native_stale_bypass"): (2, "model.py", "mm3-codemod revert"),
    ("mm3-codemod-check", "fork_era"): (1, "model.py", "+        insert_via_fused = not self._fp8_kv"),
    ("mm3-codemod-check", "half_applied"): (1, "model.py", "run `mm3-codemod run`"),
    ("mm3-codemod-check", "patched"): (None, "model.py", ""),
    ("mm3-codemod-check", "native"): (None, "model.py", ""),
    ("mm3-codemod-check", "native_stale_bypass"): (2, "model.py", "mm3-codemod revert"),
}


@pytest.mark.parametrize(("hook", "fixture"), sorted(MATRIX), ids=[f"{h}-{f}" for h, f in sorted(MATRIX)])
def test_pre_commit_run(
    hook: str, fixture: str, tmp_path: Path, hook_repo: tuple[Path, str], pre_commit_home: Path
) -> None:
    code, after, text = MATRIX[hook, fixture]
    model = f"{NVIDIA}/model.py"
    fork = fork_repo(tmp_path / "fork", {model: FIXTURES / fixture / "model.py"})
    (fork / ".pre-commit-config.yaml").write_text(readme_config(*hook_repo))
    git("add", ".pre-commit-config.yaml", cwd=fork)
    proc = pre_commit("run", hook, "--files", model, cwd=fork, home=pre_commit_home)
    out = proc.stdout + proc.stderr
    assert (fork / model).read_bytes() == (FIXTURES / fixture / after).read_bytes()
    if code is None:
        assert proc.returncode == 0 and "Passed" in out, out
    else:
        assert proc.returncode == 1 and "Failed" in out and f"- exit code: {code}" in out, out
        assert text in out
        assert ("files were modified by this hook" in out) == (after == "expected.py")
