"""Finding model files: --vllm-root, --python, the current interpreter; never importing vllm."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, cli, make_vllm_tree

from rewriter.targets import TargetError, nvidia_dir, resolve

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
    with pytest.raises(TargetError, match="has no MiniMax-M3 NVIDIA model"):
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
    assert "no MiniMax-M3 NVIDIA model" in line and str(tmp_path / "vllm") in line


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
