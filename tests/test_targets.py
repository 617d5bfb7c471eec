"""Finding model files: --vllm-root, --python, the current interpreter; never importing vllm."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES, ROOT, cli, make_vllm_tree

from rewriter.targets import HOOK_FILES, MODEL_DIRS, TargetError, model_dirs, nvidia_dir, resolve

# If anything imported vllm instead of locating it, this makes the run fail loudly.
POISON = "raise RuntimeError('vllm was imported')\n"


def fork_tree(root: Path) -> Path:
    return make_vllm_tree(
        root,
        {
            "model.py": (FIXTURES / "fork_era" / "model.py").read_bytes(),
            "mtp.py": b"# no fused op here\n",
            "ops/__init__.py": b"",
        },
        init=POISON,
    )


@pytest.mark.parametrize("layout", ["checkout", "site-packages", "package"])
def test_vllm_root_layouts(tmp_path: Path, layout: str) -> None:
    nvidia = fork_tree(tmp_path)
    root = tmp_path / "vllm" if layout == "package" else tmp_path
    assert nvidia_dir(root, "--vllm-root") == nvidia
    files = [t.path.relative_to(nvidia).as_posix() for t in resolve(vllm_roots=[root])]
    assert files == ["model.py", "mtp.py", "ops/__init__.py"]


def test_vllm_root_without_minimax(tmp_path: Path) -> None:
    (tmp_path / "vllm" / "models").mkdir(parents=True)
    with pytest.raises(TargetError, match=r"has no MiniMax-M3 model \(no vllm/models/minimax_m3/nvidia/ or amd/\)"):
        resolve(vllm_roots=[tmp_path])


def test_vllm_root_that_is_not_vllm(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="not a vLLM checkout"):
        resolve(vllm_roots=[tmp_path])


def test_check_over_a_vllm_root(tmp_path: Path) -> None:
    fork_tree(tmp_path)
    proc = cli("check", "--json", "--vllm-root", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    statuses = {Path(f["path"]).name: f["status"] for f in report["files"]}
    assert statuses == {"model.py": "needs-rewrite", "mtp.py": "no-sites", "__init__.py": "no-sites"}
    assert {f["origin"] for f in report["files"]} == {f"--vllm-root {tmp_path}"}


def test_python_option_finds_another_environment(tmp_path: Path) -> None:
    nvidia = fork_tree(tmp_path)
    proc = cli("run", "--json", "--python", sys.executable, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    files = json.loads(proc.stdout)["files"]
    assert [Path(f["path"]) for f in files if f["status"] == "rewritten"] == [nvidia / "model.py"]
    assert (nvidia / "model.py").read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()


def test_no_target_means_the_current_interpreter(tmp_path: Path) -> None:
    fork_tree(tmp_path)
    proc = cli("check", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    assert "needs-bypass" in proc.stderr


def test_no_vllm_is_a_one_line_error(tmp_path: Path) -> None:
    # An empty folder first on the path and no vllm anywhere: a clear exit 2.
    proc = cli("check", "--python", sys.executable, env={"PYTHONPATH": str(tmp_path)})
    if "vLLM is not installed" not in proc.stderr:
        pytest.skip("this interpreter has a real vLLM installed")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert sys.executable in line


def test_python_that_does_not_exist(tmp_path: Path) -> None:
    proc = cli("check", "--python", str(tmp_path / "nope"))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "no such interpreter" in line and str(tmp_path / "nope") in line


def test_targets_are_deduplicated(tmp_path: Path) -> None:
    nvidia = fork_tree(tmp_path)
    targets = resolve(paths=[nvidia / "model.py"], vllm_roots=[tmp_path])
    assert [t.path.name for t in targets].count("model.py") == 1


def test_vllm_without_minimax_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "vllm" / "models").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text(POISON)
    proc = cli("check", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "no MiniMax-M3 model" in line and str(tmp_path / "vllm") in line


# --- no target named: the source tree around the working folder ----------------------------


def no_installed_vllm() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")


def test_bare_command_in_a_fork_checkout_targets_it(tmp_path: Path) -> None:
    """Inside a fork's source tree (here two folders down), with no vLLM installed."""
    no_installed_vllm()
    fork = tmp_path / "fork"
    nvidia = fork_tree(fork)
    inside = fork / "vllm" / "models"
    proc = cli("check", "--json", cwd=inside)
    assert proc.returncode == 1, proc.stderr
    files = {Path(f["path"]).resolve(): f for f in json.loads(proc.stdout)["files"]}
    assert files[(nvidia / "model.py").resolve()]["status"] == "needs-rewrite"
    assert {f["origin"] for f in files.values()} == {f"source tree {fork}"}
    assert cli("run", cwd=inside).returncode == 0
    assert (nvidia / "model.py").read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()


def test_a_fork_checkout_and_an_installed_vllm_is_a_question(tmp_path: Path) -> None:
    """An installed vLLM elsewhere: exit 2, one line naming both and how to choose."""
    fork = tmp_path / "fork"
    nvidia = fork_tree(fork)
    site = tmp_path / "site-packages"
    installed = fork_tree(site)
    before = (nvidia / "model.py").read_bytes(), (installed / "model.py").read_bytes()
    for command in ("check", "run"):
        proc = cli(command, cwd=fork / "vllm", env={"PYTHONPATH": str(site)})
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert str(site / "vllm") in line and "two vLLMs" in line
        assert "--vllm-root .." in line and f"--python {sys.executable}" in line
    assert ((nvidia / "model.py").read_bytes(), (installed / "model.py").read_bytes()) == before
    # Either way out works.
    assert cli("check", "--vllm-root", "..", cwd=fork / "vllm", env={"PYTHONPATH": str(site)}).returncode == 1


def test_a_fork_installed_from_its_own_checkout_is_not_ambiguous(tmp_path: Path) -> None:
    """`pip install -e .` of the fork: the installed vLLM is the tree itself."""
    fork = tmp_path / "fork"
    fork_tree(fork)
    proc = cli("check", "--json", cwd=fork, env={"PYTHONPATH": str(fork)})
    assert proc.returncode == 1, proc.stderr
    assert {f["origin"] for f in json.loads(proc.stdout)["files"]} == {f"source tree {fork}"}


def test_no_vllm_anywhere_says_how_to_name_the_files(tmp_path: Path) -> None:
    no_installed_vllm()
    proc = cli("check", cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "vLLM is not installed" in line and f"{tmp_path} is not inside a vLLM source tree" in line
    assert "PATH" in line and "--vllm-root DIR" in line and "--python EXE" in line


def test_paths_are_shown_relative_only_under_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rewriter.targets import shown_path

    inside = tmp_path / "fork" / "model.py"
    inside.parent.mkdir()
    outside = tmp_path / "elsewhere.py"
    monkeypatch.chdir(tmp_path / "fork")
    assert shown_path(inside) == "model.py"
    # A short ``../`` path would depend on where the checkout lives; an absolute one does not.
    assert shown_path(outside) == str(outside)
    # The source tree the user stands in is reached upward.
    assert shown_path(tmp_path) == ".."


# --- the AMD model folder beside the NVIDIA one ----------------------------------------------
#
# A fork-era tree holds both: nvidia/model.py without the bypass (needs-bypass) and
# amd/model.py with the seed's (outdated: its index scatter writes padded tokens).

MINIMAX = ("vllm", "models", "minimax_m3")


def two_platform_tree(root: Path) -> tuple[Path, Path]:
    """``fork_tree`` with an ``amd/`` folder beside ``nvidia/``: (nvidia folder, amd folder)."""
    nvidia = fork_tree(root)
    amd = root.joinpath(*MINIMAX, "amd")
    (amd / "ops").mkdir(parents=True)
    (amd / "model.py").write_bytes((FIXTURES / "amd_fork_era" / "model.py").read_bytes())
    (amd / "mtp.py").write_bytes(b"# no fused op here\n")
    (amd / "ops" / "__init__.py").write_bytes(b"")
    return nvidia, amd


BOTH = [
    "nvidia/model.py",
    "nvidia/mtp.py",
    "nvidia/ops/__init__.py",
    "amd/model.py",
    "amd/mtp.py",
    "amd/ops/__init__.py",
]


def relative(paths, root: Path) -> list[str]:
    return [Path(p).resolve().relative_to(root.resolve().joinpath(*MINIMAX)).as_posix() for p in paths]


def test_the_model_folders_are_one_list() -> None:
    """Every way of finding files reads MODEL_DIRS; the hooks' pattern is made from it too."""
    assert [parts[-1] for parts in MODEL_DIRS] == ["nvidia", "amd"]
    files = re.compile(HOOK_FILES)
    for parts in MODEL_DIRS:
        folder = "/".join(("vllm", *parts))
        assert files.search(f"{folder}/model.py") and files.search(f"{folder}/ops/fused.py")
        assert files.search(f"fork/{folder}/model.py")  # pre-commit passes paths from the repo root
        assert not files.search(f"{folder}/README.md")
    assert not files.search("vllm/models/minimax_m3/common/indexer.py")
    assert not files.search("vllm/models/minimax_m3/model.py")
    # The manifest's hooks and the README's copy-paste snippet: that one pattern, written out.
    manifest = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert {hook["files"] for hook in manifest} == {HOOK_FILES}
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"^ +files: (.*)$", readme, re.M)) == {HOOK_FILES}


@pytest.mark.parametrize("layout", ["checkout", "site-packages", "package"])
def test_vllm_root_finds_the_amd_files_too(tmp_path: Path, layout: str) -> None:
    nvidia, amd = two_platform_tree(tmp_path)
    root = tmp_path / "vllm" if layout == "package" else tmp_path
    assert model_dirs(root, "--vllm-root") == [nvidia, amd]
    assert nvidia_dir(root, "--vllm-root") == nvidia
    assert relative([t.path for t in resolve(vllm_roots=[root])], tmp_path) == BOTH


def test_a_vllm_with_only_the_amd_folder(tmp_path: Path) -> None:
    """An AMD-only tree is a vLLM tree for every target kind; only nvidia_dir (the engine
    level's reference file) still wants the NVIDIA folder."""
    amd = tmp_path.joinpath(*MINIMAX, "amd")
    amd.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text(POISON)
    (amd / "model.py").write_bytes((FIXTURES / "amd_fork_era" / "model.py").read_bytes())
    assert [t.path for t in resolve(vllm_roots=[tmp_path])] == [amd / "model.py"]
    with pytest.raises(TargetError, match="no MiniMax-M3 NVIDIA model"):
        nvidia_dir(tmp_path, "installed vLLM")
    proc = cli("check", "--json", env={"PYTHONPATH": str(tmp_path)})  # the installed-vLLM default
    assert proc.returncode == 1, proc.stderr
    (entry,) = json.loads(proc.stdout)["files"]
    assert Path(entry["path"]) == amd / "model.py" and entry["status"] == "needs-rewrite"


def test_check_run_check_over_a_vllm_root_with_both(tmp_path: Path) -> None:
    """--vllm-root: both files need a rewrite; run writes both; check then exits 0."""
    nvidia, amd = two_platform_tree(tmp_path)
    proc = cli("check", "--json", "--vllm-root", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    files = {Path(f["path"]): f for f in json.loads(proc.stdout)["files"]}
    assert relative(files, tmp_path) == BOTH
    states = {
        relative([path], tmp_path)[0]: [(s["state"], s["action"]) for s in f["sites"] if s["state"] != "not-a-site"]
        for path, f in files.items()
        if f["sites"]
    }
    assert states == {"nvidia/model.py": [("needs-bypass", "rewrite")], "amd/model.py": [("outdated", "upgrade")]}
    assert cli("run", "--vllm-root", str(tmp_path)).returncode == 0
    assert (nvidia / "model.py").read_bytes() == (FIXTURES / "fork_era" / "expected.py").read_bytes()
    assert (amd / "model.py").read_bytes() == (FIXTURES / "amd_fork_era" / "expected.py").read_bytes()
    proc = cli("check", "--vllm-root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr


def test_python_option_finds_the_amd_files(tmp_path: Path) -> None:
    nvidia, amd = two_platform_tree(tmp_path)
    proc = cli("run", "--json", "--python", sys.executable, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    files = json.loads(proc.stdout)["files"]
    assert relative([f["path"] for f in files], tmp_path) == BOTH
    assert [Path(f["path"]) for f in files if f["status"] == "rewritten"] == [nvidia / "model.py", amd / "model.py"]
    assert (amd / "model.py").read_bytes() == (FIXTURES / "amd_fork_era" / "expected.py").read_bytes()


def test_no_target_means_the_current_interpreters_amd_files_too(tmp_path: Path) -> None:
    two_platform_tree(tmp_path)
    proc = cli("check", "--json", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    files = json.loads(proc.stdout)["files"]
    assert relative([f["path"] for f in files], tmp_path) == BOTH
    assert {f["origin"] for f in files} == {"current interpreter"}


def test_bare_command_in_a_fork_checkout_with_both_folders(tmp_path: Path) -> None:
    no_installed_vllm()
    fork = tmp_path / "fork"
    nvidia, amd = two_platform_tree(fork)
    proc = cli("check", "--json", cwd=amd / "ops")  # inside the AMD folder
    assert proc.returncode == 1, proc.stderr
    files = json.loads(proc.stdout)["files"]
    assert relative([f["path"] for f in files], fork) == BOTH
    assert {f["origin"] for f in files} == {f"source tree {fork}"}
    assert cli("run", cwd=fork).returncode == 0
    assert (amd / "model.py").read_bytes() == (FIXTURES / "amd_fork_era" / "expected.py").read_bytes()


def test_an_amd_only_checkout_is_a_source_tree(tmp_path: Path) -> None:
    from rewriter.targets import source_tree_around

    amd = tmp_path.joinpath("fork", *MINIMAX, "amd")
    amd.mkdir(parents=True)
    assert source_tree_around(amd) == tmp_path / "fork"
    assert source_tree_around(tmp_path) is None
