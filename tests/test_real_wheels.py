"""Real vLLM releases from PyPI: every one with MiniMax-M3 is native and left alone.

The wheels (about 250 MB each) are downloaded once with ``pip download
--no-deps`` into ``$MM3_CODEMOD_WHEEL_CACHE`` (default
``~/.cache/mm3-codemod/wheels``); only the model files are read out of them,
nothing of vLLM is kept in the project.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
from conftest import cli

VERSIONS = ["0.24.0", "0.34.0"]
PREFIX = "vllm/models/minimax_m3/nvidia/"


def wheel_cache() -> Path:
    default = Path.home() / ".cache" / "mm3-codemod" / "wheels"
    return Path(os.environ.get("MM3_CODEMOD_WHEEL_CACHE", default))


def vllm_wheel(version: str) -> Path:
    """The cached wheel; downloaded first when missing. Test processes running side by side
    (pytest-xdist workers, two checkouts) take a lock on the cache, and pip downloads into a
    private folder whose wheel is then renamed into place: a wheel in the cache is whole."""
    cache = wheel_cache()
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        found = sorted(cache.glob(f"vllm-{version}-*.whl"))
        if not found:
            with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as partial:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "download",
                        "--no-deps",
                        "--only-binary=:all:",
                        "--quiet",
                        "-d",
                        partial,
                        f"vllm=={version}",
                    ],
                    check=True,
                    timeout=1800,
                )
                for wheel in Path(partial).glob(f"vllm-{version}-*.whl"):
                    os.replace(wheel, cache / wheel.name)
            found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    assert found, f"pip download left no vllm {version} wheel in {cache}"
    return found[0]


@pytest.fixture(scope="module", params=VERSIONS)
def real_tree(request, tmp_path_factory) -> tuple[str, Path]:
    """A vLLM-shaped tree holding the wheel's minimax_m3/nvidia/*.py files."""
    version = request.param
    root = tmp_path_factory.mktemp(f"vllm-{version}")
    with zipfile.ZipFile(vllm_wheel(version)) as wheel:
        names = [n for n in wheel.namelist() if n.startswith(PREFIX) and n.endswith(".py")]
        for name in names:
            wheel.extract(name, root)
    (root / "vllm" / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    assert (root / PREFIX / "model.py").stat().st_size > 40_000
    return version, root


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*.py"))}


def test_check_reports_native(real_tree) -> None:
    version, root = real_tree
    proc = cli("check", "--json", "--vllm-root", str(root))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    model = next(f for f in report["files"] if f["path"].endswith(PREFIX + "model.py"))
    states = [s["state"] for s in model["sites"]]
    assert "native" in states, states
    assert set(states) <= {"native", "not-a-site"}
    native = [s for s in model["sites"] if s["state"] == "native"]
    assert {s["class"] for s in native} == {"MiniMaxM3SparseAttention"}
    assert all("--kv-cache-dtype fp8" in s["reason"] for s in native)
    assert all(f["status"] in ("unchanged", "no-sites") for f in report["files"])
    if importlib.util.find_spec("torch") is not None:  # what check promises, it ran (0.34.0: not before stop 54)
        assert all("; it was run: " in s["reason"] for s in native), [s["reason"] for s in native]


def test_run_writes_nothing(real_tree) -> None:
    version, root = real_tree
    before = snapshot(root)
    proc = cli("run", "--vllm-root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert snapshot(root) == before
    assert not [p for p in root.rglob("*") if p.name.endswith((".orig", ".tmp"))]
