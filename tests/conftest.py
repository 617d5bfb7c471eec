from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (``python -m rewriter``) in a fresh process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rewriter", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or ROOT,
        timeout=300,
    )


@pytest.fixture
def copy_fixture(tmp_path: Path):
    """Copy ``fixtures/<variant>/model.py`` to a temp file and return its path."""

    def copy(variant: str, name: str = "model.py") -> Path:
        target = tmp_path / variant / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FIXTURES / variant / "model.py", target)
        return target

    return copy


def make_vllm_tree(root: Path, files: dict[str, bytes], init: str = "") -> Path:
    """A minimal ``vllm`` package under ``root`` with files in minimax_m3/nvidia."""
    nvidia = root / "vllm" / "models" / "minimax_m3" / "nvidia"
    nvidia.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(init)
    for name, data in files.items():
        path = nvidia / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return nvidia
