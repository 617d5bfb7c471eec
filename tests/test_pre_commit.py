"""The pre-commit hooks, for real: pre-commit from PyPI in a temporary vLLM-fork repo.

Every `.pre-commit-config.yaml` snippet of the README and docs/ is read from its page and
run as written, in a fresh git repository and a fresh environment: no PYTHONPATH, and a
PATH with `mm3-codemod` on it only for the snippet whose page says it needs it.

``pre-commit try-repo`` builds the hook's environment (pip-installs this
project) in a fresh temporary store on every call, so it runs once here; the
per-fixture matrix goes through ``pre-commit run`` with the README's
``.pre-commit-config.yaml`` snippet, whose environment is built once per test
session in a session-scoped ``PRE_COMMIT_HOME``. Both install a snapshot of the
working tree (committed to a temporary git repo), so the hooks tested are the
code under test, from a clean clone or a checkout with uncommitted changes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES, ROOT, cli

from rewriter.report import HOOKS

# One xdist worker runs them all: the session's hook environment (a pip install of this
# project into PRE_COMMIT_HOME) is then built once, not once per worker.
pytestmark = pytest.mark.xdist_group("pre-commit")

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
        # A virtual environment that .gitignore does not name (`python -m venv .v`) is no project file.
        venvs = {p.parent.name for p in ROOT.glob("*/pyvenv.cfg")}
        return [
            f for f in listed.split("\0") if f and os.path.lexists(ROOT / f) and f.split("/")[0] not in venvs
        ]
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


def fresh_env(tmp_path: Path, home: Path, codemod_on_path: bool = False) -> dict[str, str]:
    """The environment of a user's shell in the fork: `pre-commit` on PATH (this interpreter's),
    git and the system's tools, and `mm3-codemod` (this working tree's code) only where asked.
    Nothing of the test process leaks in: no PYTHONPATH, no virtual environment, not under
    pre-commit. pip's own configuration (environment and pip.conf) stays: it is the user's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scripts = {"pre-commit": f'exec {shlex.quote(sys.executable)} -m pre_commit "$@"'}
    if codemod_on_path:  # what `pip install .` of this working tree puts on PATH
        scripts["mm3-codemod"] = (
            f'PYTHONPATH={shlex.quote(str(ROOT))} exec {shlex.quote(sys.executable)} -m rewriter "$@"'
        )
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    system = [d for d in ("/usr/local/bin", "/usr/bin", "/bin") if os.path.isdir(d)]
    git_dir = os.path.dirname(shutil.which("git") or "/usr/bin/git")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PRE_COMMIT")}
    env.update(GIT_ENV, PRE_COMMIT_HOME=str(home), PATH=os.pathsep.join([str(bin_dir), git_dir, *system]))
    for name in ("mm3-codemod", "pre-commit"):
        found = shutil.which(name, path=env["PATH"])
        assert (found is not None) == (name == "pre-commit" or codemod_on_path), (name, found)
    return env


def pre_commit(
    *args: str, cwd: Path, home: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`pre-commit ARGS` in a fresh environment without mm3-codemod on PATH."""
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", *args, "--color", "never"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env or fresh_env(cwd.parent, home),
        timeout=900,
    )


def shell(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
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


README = (ROOT / "README.md").read_text()
FORK_WORKFLOW = (ROOT / "docs" / "fork-workflow.md").read_text()  # pinned hooks, the walk-through
MODEL = f"{NVIDIA}/model.py"


# The snippets the pages show, each known by a line only it has.
LOCAL = "repo: local"  # README: the installed mm3-codemod, on PATH
PINNED = "additional_dependencies:"  # docs/fork-workflow.md: pre-commit's environment, torch added
CHECK_ONLY = "- id: mm3-codemod-check"  # docs/fork-workflow.md: the check hook alone


def doc_snippets() -> list[str]:
    """Every `yaml` block of the README and of docs/*.md."""
    pages = [README, *(page.read_text() for page in sorted((ROOT / "docs").glob("*.md")))]
    return [b for page in pages for b in re.findall(r"```yaml\n(.*?)```", page, re.S)]


def readme_snippet(marker: str) -> str:
    """The one `.pre-commit-config.yaml` snippet of the README and docs/ that contains ``marker``."""
    (snippet,) = [b for b in doc_snippets() if marker in b]
    return snippet


def pinned_config(repo: Path, rev: str, marker: str = PINNED, hook: str | None = None) -> str:
    """A snippet with a pinned `repo:`, its placeholders filled in: the snapshot of this
    project and its commit. ``hook``, where the snippet does not list it, is added, so that
    each hook of the manifest can be run on its own."""
    snippet = readme_snippet(marker)
    snippet = re.sub(r"(?m)^(\s*- repo:).*$", rf"\g<1> {repo}", snippet)
    snippet = re.sub(r"(?m)^(\s*rev:).*$", rf"\g<1> {rev}", snippet)
    if hook and f"- id: {hook}\n" not in snippet:
        snippet += f"      - id: {hook}\n"
    return snippet


def readme_config(repo: Path, rev: str, hook: str) -> str:
    return pinned_config(repo, rev, PINNED, hook)


def config_hook_ids(config: str) -> set[str]:
    return {hook["id"] for repo in yaml.safe_load(config)["repos"] for hook in repo["hooks"]}


def assert_named_hooks_exist(out: str, config: str) -> None:
    """Each `pre-commit run <id>` a message tells the user to run names a hook of their config."""
    named = set(re.findall(r"pre-commit run (\S+)", out))
    assert named <= config_hook_ids(config), (named, out)


def test_every_config_the_docs_show_is_run_here() -> None:
    """The pages show these three configs and no other: a new one fails here until it is tested."""
    snippets = doc_snippets()
    assert len(snippets) == 3, snippets
    assert all(sum(marker in b for b in snippets) == 1 for marker in (LOCAL, PINNED, CHECK_ONLY))
    assert all(sum(marker in b for marker in (LOCAL, PINNED, CHECK_ONLY)) == 1 for b in snippets)


# --- the manifest ---------------------------------------------------------------------------


def manifest() -> dict[str, dict]:
    return {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}


def test_manifest() -> None:
    hooks = manifest()
    assert set(hooks) == {"mm3-codemod", "mm3-codemod-check", "mm3-codemod-revert"}
    for hook in hooks.values():
        assert hook["language"] == "python" and hook["require_serial"] is True
        files = re.compile(hook["files"])
        assert files.search(f"{NVIDIA}/model.py") and files.search(f"{NVIDIA}/ops/fused.py")
        assert files.search("vllm/models/minimax_m3/amd/model.py")
        assert not files.search("vllm/models/minimax_m3/common/indexer.py")
        assert not files.search(f"{NVIDIA}/README.md")
    assert hooks["mm3-codemod"]["entry"].split()[:2] == ["mm3-codemod", "run"]
    assert "--exit-non-zero-on-fix" in hooks["mm3-codemod"]["entry"]
    assert hooks["mm3-codemod-check"]["entry"].split()[:2] == ["mm3-codemod", "check"]
    assert hooks["mm3-codemod-revert"]["entry"].split()[:2] == ["mm3-codemod", "revert"]
    assert hooks["mm3-codemod-revert"]["stages"] == ["manual"]  # only when asked


def test_the_commands_messages_name_are_the_manifests_hooks() -> None:
    """What a message under pre-commit tells the user to run is a hook that exists, at its stage."""
    hooks = manifest()
    for verb, (hook, manual) in HOOKS.items():
        assert hooks[hook]["entry"].split()[:2] == ["mm3-codemod", verb]
        assert ("manual" in hooks[hook].get("stages", [])) == manual


def test_readme_local_hooks_are_the_manifests() -> None:
    """The copy-paste snippet (`repo: local`) declares each hook as the manifest does; only
    the language differs (the installed mm3-codemod, not an environment pre-commit builds)."""
    hooks = manifest()
    (local,) = yaml.safe_load(readme_snippet("repo: local"))["repos"]
    assert local["repo"] == "local" and local["hooks"]
    for hook in local["hooks"]:
        assert hook.pop("language") == "system"
        expected = {k: v for k, v in hooks[hook["id"]].items() if k not in ("language", "description")}
        assert hook == expected


# --- the hooks' commands, without pre-commit ----------------------------------------------------


def test_run_exit_non_zero_on_fix(copy_fixture) -> None:
    target = copy_fixture("fork_era")
    proc = cli("run", "--exit-non-zero-on-fix", str(target))
    assert proc.returncode == 1, proc.stderr
    assert target.read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()
    assert cli("run", "--exit-non-zero-on-fix", str(target)).returncode == 0  # nothing to fix now
    assert cli("run", "--exit-non-zero-on-fix", str(copy_fixture("two_candidates"))).returncode == 2


def test_check_diff(copy_fixture) -> None:
    target = copy_fixture("half_applied")
    original = target.read_bytes()
    proc = cli("check", "--diff", str(target))
    assert proc.returncode == 1
    assert proc.stdout.startswith("--- a/model.py\n+++ b/model.py\n")
    assert "+        insert_via_fused = not self._fp8_kv\n" in proc.stdout
    assert proc.stderr.rstrip().endswith(f"to apply the fp8 bypass: mm3-codemod run {target}")
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
        "vllm/models/minimax_m3/amd/model.py": FIXTURES / "amd_fork_era" / "model.py",  # the AMD file too
        "vllm/models/minimax_m3/common/indexer.py": FIXTURES / "fork_era" / "model.py",  # not a hook file
    }
    fork = fork_repo(tmp_path / "fork", files)
    repo, _ = hook_repo
    proc = pre_commit("try-repo", str(repo), "--files", *files, cwd=fork, home=pre_commit_home)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    fixer, checker = out.split("mm3-codemod (fp8 KV-cache bypass)")[1].split("mm3-codemod check (fp8")
    assert "Failed" in fixer and "- exit code: 1" in fixer and "files were modified by this hook" in fixer
    assert "3 files rewritten, 2 files left unchanged." in fixer
    assert "common" not in out
    assert "Passed" in checker  # the fixer left nothing to fix
    expected = {
        f"{NVIDIA}/model.py": FIXTURES / "fork_era" / "expected.py",
        f"{NVIDIA}/half_applied.py": FIXTURES / "half_applied" / "expected.py",
        "vllm/models/minimax_m3/amd/model.py": FIXTURES / "amd_fork_era" / "expected.py",
    }
    for name, source in files.items():
        assert (fork / name).read_bytes() == expected.get(name, source).read_bytes(), name


# --- pre-commit run with the README's config, per fixture ---------------------------------------------

# (hook, fixture) -> (hook exit code or None when it passes, file afterwards, text in the output)
MATRIX = {
    ("mm3-codemod", "fork_era"): (1, "expected.py", f"review the change, then stage it: git add {MODEL}"),
    ("mm3-codemod", "half_applied"): (1, "expected.py", "half-applied -> complete"),
    ("mm3-codemod", "patched"): (None, "model.py", ""),
    ("mm3-codemod", "native"): (None, "model.py", ""),
    ("mm3-codemod", "native_stale_bypass"): (1, "expected.py", "half-applied -> strip"),
    ("mm3-codemod", "half_native"): (1, "expected.py", "every forward raises NameError"),
    ("mm3-codemod", "two_candidates"): (2, "model.py", "the bypass can be proven for one only"),
    ("mm3-codemod-check", "fork_era"): (1, "model.py", "+        insert_via_fused = not self._fp8_kv"),
    (
        "mm3-codemod-check",
        "half_applied",
    ): (1, "model.py", f"to apply the fp8 bypass: pre-commit run mm3-codemod --files {MODEL}"),
    ("mm3-codemod-check", "patched"): (None, "model.py", ""),
    ("mm3-codemod-check", "native"): (None, "model.py", ""),
    (
        "mm3-codemod-check",
        "native_stale_bypass",
    ): (1, "model.py", f"to take the stale bypass out: pre-commit run mm3-codemod --files {MODEL}"),
    ("mm3-codemod-revert", "native_stale_bypass"): (1, "reverted.py", "1 file reverted."),
    # the seed's hand patch: not run's, so taking it out is no undo; the way out works from a shell
    ("mm3-codemod-revert", "patched"): (2, "model.py", f"mm3-codemod revert --whole-bypass {MODEL}"),
    ("mm3-codemod-revert", "native"): (None, "model.py", ""),
}


@pytest.mark.parametrize(("hook", "fixture"), sorted(MATRIX), ids=[f"{h}-{f}" for h, f in sorted(MATRIX)])
def test_pre_commit_run(
    hook: str, fixture: str, tmp_path: Path, hook_repo: tuple[Path, str], pre_commit_home: Path
) -> None:
    """docs/fork-workflow.md's pinned snippet (the hooks in pre-commit's own environment, torch
    added to the fixer's): mm3-codemod is not on PATH, so every message names a hook of the
    config; a rewrite is proven before it is written."""
    code, after, text = MATRIX[hook, fixture]
    fork = fork_repo(tmp_path / "fork", {MODEL: FIXTURES / fixture / "model.py"})
    config = readme_config(*hook_repo, hook)
    (fork / ".pre-commit-config.yaml").write_text(config)
    git("add", ".pre-commit-config.yaml", cwd=fork)
    stage = ["--hook-stage", "manual"] if "manual" in manifest()[hook].get("stages", []) else []
    proc = pre_commit("run", hook, *stage, "--files", MODEL, cwd=fork, home=pre_commit_home)
    out = proc.stdout + proc.stderr
    assert_named_hooks_exist(out, config)
    if hook == "mm3-codemod-revert" and after == "reverted.py":  # it stays reverted: the off line
        assert (fork / MODEL).read_bytes() == with_off_line(FIXTURES / fixture / after), out
        assert "`# mm3-codemod: off` written at line" in out
        return
    assert (fork / MODEL).read_bytes() == (FIXTURES / fixture / after).read_bytes()
    if (hook, after) == ("mm3-codemod", "expected.py"):  # torch in the hook's environment: proven
        assert re.search(rf"^proven: {re.escape(MODEL)}: the semantic level passed", out, re.M), out
        assert "unproven" not in out
    if code is None:
        assert proc.returncode == 0 and "Passed" in out, out
    else:
        assert proc.returncode == 1 and "Failed" in out and f"- exit code: {code}" in out, out
        assert text in out
        assert ("files were modified by this hook" in out) == (after != "model.py")


# --- the README's fork workflow, end to end --------------------------------------------------


def walkthrough() -> list[list[tuple[str, list[str]]]]:
    """The README's walk-through: per code block, each `$ command` with the output lines
    shown under it (blank lines and lines shortened with "…" left out)."""
    section = FORK_WORKFLOW.split("### Walk-through\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        steps: list[tuple[str, list[str]]] = []
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            elif line.strip() and "…" not in line:
                steps[-1][1].append(line)
        blocks.append(steps)
    return blocks


# What comes in before each block of the walk-through (the README's narrative): the
# fork-era file; a merge that left the patched file half-applied; a native-era merge
# that kept the bypass and lost its guard. Each is staged, as a merge leaves it.
ARRIVALS = ["fork_era", "half_applied", "half_native"]


def test_readme_fork_workflow_end_to_end(tmp_path: Path, pre_commit_home: Path) -> None:
    """The README's `repo: local` snippet, copied from the README as it is, in a fork repo
    with real pre-commit and git hooks; each command of the walk-through run as written,
    each output line the README shows found in what really came out, and every next
    command the one the tool printed."""
    blocks = walkthrough()
    assert len(blocks) == len(ARRIVALS)
    fork = tmp_path / "fork"
    fork.mkdir()
    git("init", "-q", cwd=fork)
    (fork / ".pre-commit-config.yaml").write_text(readme_snippet("repo: local"))
    git("add", ".pre-commit-config.yaml", cwd=fork)
    git("commit", "-q", "-m", "pre-commit config", cwd=fork)
    # The README's `repo: local` snippet needs mm3-codemod on PATH (its `pip install .`).
    env = fresh_env(tmp_path, pre_commit_home, codemod_on_path=True)
    printed_next: str | None = None
    for arrival, steps in zip(ARRIVALS, blocks):
        (fork / MODEL).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FIXTURES / arrival / "model.py", fork / MODEL)
        if arrival != "fork_era":  # the first block stages the file itself
            git("add", MODEL, cwd=fork)
        for command, shown in steps:
            if printed_next is not None:  # follow only what the tool printed
                assert command.startswith(printed_next), (command, printed_next)
            proc = shell(command, fork, env)
            out = (proc.stdout + proc.stderr).splitlines()
            assert_named_hooks_exist(proc.stdout + proc.stderr, readme_snippet(LOCAL))
            for line in shown:
                assert line in out, (command, line, out)
            printed_next = None
            for line in out:
                for lead in ("review the change, then stage it: ", "to take the stale bypass out: "):
                    if lead in line:
                        printed_next = line.split(lead, 1)[1]
            assert proc.returncode == (1 if any(line.endswith("Failed") for line in shown) else 0), out
    assert (fork / MODEL).read_bytes() == (FIXTURES / "half_native" / "expected.py").read_bytes()
    # ... and the file the hook left runs: verify's semantic level, padded tokens included
    proc = shell(f"mm3-codemod verify --json {MODEL}", fork, env)
    assert proc.returncode == 0, proc.stderr
    (verified,) = json.loads(proc.stdout)["files"]
    semantic = next(level for level in verified["levels"] if level["level"] == "semantic")
    assert semantic["status"] == "passed", semantic
    assert git("status", "--porcelain", cwd=fork) == ""
    assert len(git("log", "--oneline", cwd=fork).splitlines()) == 4


# --- what the docs promise of each config -------------------------------------------------------


# The line the revert hook writes, as docs/fork-workflow.md shows it.
OFF_LINE = re.search(r"```python\n(# mm3-codemod: off\b[^\n]*)\n```", FORK_WORKFLOW).group(1)


def with_off_line(source: Path) -> bytes:
    """``source`` with the revert hook's `# mm3-codemod: off` line after its opening comments."""
    lines = source.read_bytes().splitlines(keepends=True)
    head = next(i for i, line in enumerate(lines) if not line.startswith(b"#"))
    return b"".join([*lines[:head], OFF_LINE.encode() + b"\n", *lines[head:]])


def test_local_snippet_needs_mm3_codemod_on_path(tmp_path: Path, pre_commit_home: Path) -> None:
    """What the README says of its `repo: local` snippet: without `mm3-codemod` on the PATH
    of `git commit`, the hook fails with pre-commit's own message, and nothing is checked."""
    said = re.search(r"pre-commit's ``(Executable `mm3-codemod` not found)``", README)
    assert said, "the README says what happens without mm3-codemod on PATH"
    fork = fork_repo(tmp_path / "fork", {MODEL: FIXTURES / "fork_era" / "model.py"})
    (fork / ".pre-commit-config.yaml").write_text(readme_snippet(LOCAL))
    git("add", ".pre-commit-config.yaml", cwd=fork)
    env = fresh_env(tmp_path, pre_commit_home, codemod_on_path=False)
    assert shell("pre-commit install", fork, env).returncode == 0
    proc = shell("git commit -qm 'fork-era model'", fork, env)
    assert proc.returncode == 1 and said.group(1) in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert (fork / MODEL).read_bytes() == (FIXTURES / "fork_era" / "model.py").read_bytes()
    # ... and with it on PATH, the same commit gets the hook's rewrite.
    env = fresh_env(tmp_path, pre_commit_home, codemod_on_path=True)
    proc = shell("git commit -qm 'fork-era model'", fork, env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 file rewritten." in out, out
    assert (fork / MODEL).read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()


def test_check_only_config_names_a_command_that_works(
    tmp_path: Path, hook_repo: tuple[Path, str], pre_commit_home: Path
) -> None:
    """docs/fork-workflow.md's check-only config, as written: it has no `mm3-codemod` hook, so
    the advice must not send the user to one; the command it prints, run from the user's
    shell (no mm3-codemod on PATH), applies the bypass, and the check then passes."""
    config = pinned_config(*hook_repo, CHECK_ONLY)
    assert config_hook_ids(config) == {"mm3-codemod-check"}
    fork = fork_repo(tmp_path / "fork", {MODEL: FIXTURES / "fork_era" / "model.py"})
    (fork / ".pre-commit-config.yaml").write_text(config)
    git("add", ".pre-commit-config.yaml", cwd=fork)
    env = fresh_env(tmp_path, pre_commit_home)
    proc = pre_commit("run", "--files", MODEL, cwd=fork, home=pre_commit_home, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "+        insert_via_fused = not self._fp8_kv" in out, out
    assert_named_hooks_exist(out, config)
    (advice,) = re.findall(r"^to apply the fp8 bypass: (.*)$", out, re.M)
    assert not advice.startswith("pre-commit run") and advice.endswith(f" run {MODEL}"), advice
    assert (fork / MODEL).read_bytes() == (FIXTURES / "fork_era" / "model.py").read_bytes()  # checks only
    fixed = shell(advice, fork, env)
    assert fixed.returncode == 0, fixed.stderr
    assert (fork / MODEL).read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()
    again = pre_commit("run", "--files", MODEL, cwd=fork, home=pre_commit_home, env=env)
    assert again.returncode == 0 and "Passed" in again.stdout, again.stdout + again.stderr


def test_a_revert_stays_reverted_until_the_line_is_deleted(
    tmp_path: Path, hook_repo: tuple[Path, str], pre_commit_home: Path
) -> None:
    """The pinned config, git hooks installed: the manual revert hook, then commits; the run
    hook leaves the reverted file alone until the `# mm3-codemod: off` line is deleted, as the
    docs say, and then applies the bypass again."""
    assert "# mm3-codemod: off" in FORK_WORKFLOW and "delete the line and commit" in FORK_WORKFLOW
    fork = fork_repo(tmp_path / "fork", {MODEL: FIXTURES / "fork_era" / "expected.py"})  # patched
    (fork / ".pre-commit-config.yaml").write_text(pinned_config(*hook_repo, PINNED))
    env = fresh_env(tmp_path, pre_commit_home)

    def commit(message: str) -> subprocess.CompletedProcess[str]:
        shell(f"git add -A && git commit -qm {shlex.quote(message)}", fork, env)
        return shell("git status --porcelain", fork, env)

    assert shell("pre-commit install", fork, env).returncode == 0
    assert commit("patched model").stdout == ""  # the run hook passed: committed
    revert = shell(f"pre-commit run mm3-codemod-revert --hook-stage manual --files {MODEL}", fork, env)
    assert revert.returncode == 1 and "1 file reverted." in revert.stdout, revert.stdout
    reverted = with_off_line(FIXTURES / "fork_era" / "model.py")
    assert (fork / MODEL).read_bytes() == reverted
    assert commit("revert the fp8 bypass").stdout == ""  # the run hook left it alone
    with (fork / MODEL).open("a") as f:  # a later change to the file: still off
        f.write("# a later change\n")
    assert commit("a later change").stdout == ""
    assert (fork / MODEL).read_bytes() == reverted + b"# a later change\n"
    assert shell(f"pre-commit run --files {MODEL}", fork, env).returncode == 0
    # On again: delete the line, commit; the run hook applies the bypass (and fails, as a fixer).
    (fork / MODEL).write_bytes(reverted.replace(OFF_LINE.encode() + b"\n", b"") + b"# a later change\n")
    shell("git add -A", fork, env)
    on = shell("git commit -qm 'the fp8 bypass again'", fork, env)
    assert on.returncode == 1 and "needs-bypass -> rewrite" in on.stdout + on.stderr, on.stdout + on.stderr
    expected = (FIXTURES / "fork_era" / "expected.py").read_bytes() + b"# a later change\n"
    assert (fork / MODEL).read_bytes() == expected
    assert commit("the fp8 bypass again").stdout == ""
