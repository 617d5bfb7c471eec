"""`verify` says only what it proved (issue "Says only what it proved").

A file is verified only where a level that runs its code (semantic, kernel or engine) passed.
Where none did - no torch, a file the stand-in cannot run - the file is not verified: exit 1,
with why and the one step that makes a level run. A level an option asks for (--engine,
--kernels, --tp, --require-gpu) fails where it cannot run. Every command a message suggests
carries the options of the user's command (--python above all).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli, make_vllm_tree

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed here")


def without_torch(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``mm3-codemod ARGS`` in a fresh interpreter where ``import torch`` fails."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from rewriter.cli import main\n"
        f"sys.argv = ['mm3-codemod', *{list(args)!r}]\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
        check=False,
    )


def levels_of(proc: subprocess.CompletedProcess[str], index: int = 0) -> dict[str, dict]:
    return {lv["level"]: lv for lv in json.loads(proc.stdout)["files"][index]["levels"]}


def interpreter(path: Path, tree: Path) -> str:
    """An executable standing in for another environment's python, whose vLLM is ``tree``'s."""
    path.write_text(f'#!/bin/sh\nPYTHONPATH={tree} exec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


# --- nothing proved, nothing claimed -------------------------------------------------------


def test_without_torch_a_correct_file_is_not_verified_exit_1_naming_why_and_the_step() -> None:
    """Before: every level skipped, `2 file(s): 2 without failures`, exit 0."""
    proc = without_torch(
        "verify", str(FIXTURES / "patched" / "model.py"), str(FIXTURES / "native" / "model.py"), "--json"
    )
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert [f["status"] for f in report["files"]] == ["unverified", "unverified"]
    assert report["summary"]["passed"] == 0 and report["summary"]["unverified"] == 2
    assert report["exit_code"] == 1
    install = f"{sys.executable} -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
    for f in report["files"]:
        assert "semantic skipped: torch is not installed" in f["unverified"]
        assert install in f["unverified"]  # the one step, for the interpreter that runs verify
    for path in ("patched", "native"):
        line = next(
            x
            for x in proc.stderr.splitlines()
            if x.startswith(str(FIXTURES / path / "model.py") + ": not verified")
        )
        assert "torch is not installed" in line and install in line
    assert "without failures" not in proc.stderr
    assert "2 files: 0 verified, 2 not verified, 0 failed, 0 not readable." in proc.stderr


def test_without_torch_an_explicit_tp_fails_rather_than_skips() -> None:
    proc = without_torch("verify", str(FIXTURES / "patched" / "model.py"), "--tp", "2", "--json")
    assert proc.returncode == 1, proc.stderr
    semantic = levels_of(proc)["semantic"]
    assert semantic["status"] == "failed" and semantic["reason"].endswith("(--tp 2)"), semantic


def test_a_file_without_an_insert_site_alone_proves_nothing(tmp_path: Path) -> None:
    proc = cli("verify", str(FIXTURES / "dense_only" / "model.py"), "--json")
    assert proc.returncode == 1, proc.stderr
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["status"] == "no-sites"
    assert "Nothing verified: no file has a call of the fused op that writes a cache." in proc.stderr


def test_a_native_call_outside_a_layer_class_is_a_site_not_run(tmp_path: Path) -> None:
    """A module function that finds its layer (a registered custom op) calls the op: verify cannot
    run it, and says so - never that the file has no insert site."""
    source = (
        "from vllm import _custom_ops as ops\n\n"
        "def insert(name, qkv):\n"
        "    layer = LAYERS[name]\n"
        "    ops.fused_minimax_m3_qknorm_rope_kv_insert(\n"
        "        qkv, kv_cache=layer.kv_cache, kv_cache_dtype=layer.kv_cache_dtype\n"
        "    )\n"
    )
    target = tmp_path / "model.py"
    target.write_text(source)
    proc = cli("verify", str(target), "--json")
    assert proc.returncode == 1, proc.stderr
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["status"] == "unverified", entry
    assert "outside a layer class" in entry["levels"][1]["reason"], entry
    assert "no insert site" not in proc.stderr


@needs_torch
def test_a_file_without_an_insert_site_beside_a_verified_one_is_neutral() -> None:
    proc = cli("verify", str(FIXTURES / "patched" / "model.py"), str(FIXTURES / "dense_only" / "model.py"))
    assert proc.returncode == 0, proc.stderr
    assert (
        "2 files: 1 verified, 0 not verified, 0 failed, 0 not readable, 1 without an insert site"
        in proc.stderr
    )


@needs_torch
def test_a_file_the_stand_in_cannot_run_is_not_verified_and_names_the_engine_level(tmp_path: Path) -> None:
    """The semantic level's own limit (an attribute __init__ sets by code the stand-in does not
    run): not the file's failure, and not a pass either."""
    source = (FIXTURES / "native" / "model.py").read_text()
    dtype = "        self.kv_cache_dtype = cache_config.cache_dtype\n"
    source = source.replace(dtype, dtype + '        self.use_nvfp4_kv = "nvfp4" in list(kv_quant_modes(cache_config))\n')
    imports = "from vllm.forward_context import get_forward_context\n"  # (a name the file never binds fails in vLLM too)
    source = source.replace(imports, imports + "from vllm.config import kv_quant_modes\n")
    path = tmp_path / "model.py"
    path.write_text(
        source.replace(
            "        qkv, _ = self.qkv_proj(hidden_states)\n        num_tokens",
            "        qkv, _ = self.qkv_proj(hidden_states)\n        assert self.use_nvfp4_kv is not None\n        num_tokens",
        )
    )
    proc = cli("verify", str(path), "--json", env={"COLUMNS": "200"})
    assert proc.returncode == 1, proc.stderr
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["status"] == "unverified"
    assert "the stand-in lacks `self.use_nvfp4_kv`" in entry["unverified"]
    assert f"to run it: mm3-codemod verify {path} --engine" in entry["unverified"]
    assert f"{path}: not verified: " in proc.stderr


@needs_torch
def test_run_on_a_file_the_stand_in_cannot_run_advises_the_level_that_can(tmp_path: Path) -> None:
    """Before: "to prove it: mm3-codemod verify FILE (where vLLM is installed: its import and
    kernel levels)" - but the kernel level runs on the same stand-in, and skips the same way."""
    target = tmp_path / "model.py"
    anchor = "        num_tokens = qkv.shape[0]\n"
    added = "        low, high = kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, None)\n"
    target.write_text(
        (FIXTURES / "separate_projections" / "model.py").read_text().replace(anchor, anchor + added)
    )
    proc = cli("run", str(target), env={"COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("unproven: "))
    assert line.endswith(
        f"to prove it: mm3-codemod verify {target} --engine (with a CUDA GPU and vLLM: the engine level "
        "runs the file in vLLM itself)"
    ), line
    assert "kernel levels" not in line
    verified = cli("verify", str(target), "--json")  # and verify says the same of the written file
    assert verified.returncode == 1
    assert (
        f"to run it: mm3-codemod verify {target} --engine"
        in json.loads(verified.stdout)["files"][0]["unverified"]
    )


# --- a level asked for that cannot run fails --------------------------------------------------


@needs_torch
def test_engine_asked_for_but_unable_to_run_fails() -> None:
    """Before: the engine level skipped silently, exit 0."""
    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        pytest.skip("the engine level can run here")
    proc = cli("verify", str(FIXTURES / "patched" / "model.py"), "--engine", "--json")
    assert proc.returncode == 1, proc.stderr
    engine = levels_of(proc)["engine"]
    assert engine["status"] == "failed" and engine["reason"].endswith("(--engine)"), engine
    assert "engine failed: " in proc.stderr


@needs_torch
def test_kernels_asked_for_but_unable_to_run_fails(tmp_path: Path) -> None:
    library = tmp_path / "_C.abi3.so"
    library.write_bytes(b"not a library")
    proc = cli("verify", str(FIXTURES / "patched" / "model.py"), "--kernels", str(library), "--json")
    assert proc.returncode == 1, proc.stderr
    kernel = levels_of(proc)["kernel"]
    assert kernel["status"] == "failed" and kernel["reason"].endswith(f"(--kernels {library})"), kernel


# --- suggested commands keep the user's options -------------------------------------------


def _fork_env(tmp_path: Path, model: str, init: str = "") -> tuple[Path, str]:
    """A vLLM tree holding fixtures/<model>, and an interpreter whose vLLM it is."""
    tree = tmp_path / "env"
    nvidia = make_vllm_tree(tree, {"model.py": (FIXTURES / model).read_bytes()}, init)
    return nvidia / "model.py", interpreter(tmp_path / "python-env", tree)


def test_verify_with_python_does_not_advise_python(tmp_path: Path) -> None:
    """`verify --python X`: the import level says what was wrong with X, never "run verify with
    the interpreter of an installed vLLM: --python PATH" (it was run with one)."""
    from rewriter.verify.importcheck import HOW_TO_RUN

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")
    path, python = _fork_env(tmp_path, "patched/model.py", "import mm3_no_such_dependency\n")
    proc = cli("verify", "--python", python, "--json", env={"COLUMNS": "200"})
    report = json.loads(proc.stdout)
    (entry,) = report["files"]
    assert entry["path"] == str(path)
    imp = levels_of(proc)["import"]
    assert imp["status"] == "skipped"
    assert imp["reason"].startswith(f"--python {python}: import vllm: a dependency is not installed"), imp
    assert "mm3_no_such_dependency" in imp["reason"]
    assert HOW_TO_RUN not in proc.stderr and "--python PATH" not in proc.stdout + proc.stderr


def test_run_with_python_suggests_verify_with_the_same_python(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")
    _, python = _fork_env(tmp_path, "fork_era/model.py")
    check = cli("check", "--python", python, env={"COLUMNS": "400"})
    assert check.returncode == 1, check.stderr
    assert check.stderr.rstrip().endswith(f"to apply the fp8 bypass: mm3-codemod run --python {python}")
    proc = cli("run", "--python", python, env={"COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    assert f"to confirm it by running it: mm3-codemod verify --python {python}" in proc.stderr.splitlines()


def test_unproven_run_with_python_says_to_verify_with_the_same_python(tmp_path: Path) -> None:
    """Without torch `run` writes and says how to prove it: that command keeps --python."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")
    _, python = _fork_env(tmp_path, "fork_era/model.py")
    proc = without_torch("run", "--python", python)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("unproven: "))
    install = f"{sys.executable} -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert line.endswith(f"to prove it: {install}, then mm3-codemod verify --python {python}"), line


def test_the_note_of_a_file_to_rewrite_names_the_run_for_that_file(tmp_path: Path) -> None:
    """Before: "run `mm3-codemod run` first", which, run as written, rewrites whatever vLLM
    is around the working folder rather than the file verified."""
    path = tmp_path / "model.py"
    path.write_bytes((FIXTURES / "fork_era" / "model.py").read_bytes())
    proc = without_torch("verify", str(path), "--json")
    assert proc.returncode == 1
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["note"].endswith(f"run `mm3-codemod run {path}` first"), entry["note"]
