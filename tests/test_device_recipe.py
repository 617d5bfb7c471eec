"""bench/vllm024_pack.sh and bench/vllm024_device.sh: the vLLM 0.24.0 device recipe.

The device run itself needs the GPU machine; here: the scripts parse, the pack
carries one pinned version of each wheel, and the device script's bookkeeping
(a missing earlier part is exit 3, a fresh machine) works in bash.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

PACK = ROOT / "bench" / "vllm024_pack.sh"
DEVICE = ROOT / "bench" / "vllm024_device.sh"
ENGINE = ROOT / "bench" / "vllm024_engine.sh"
CARRY = ROOT / "bench" / "vllm024_carry.sh"


@pytest.mark.parametrize("script", [PACK, DEVICE, ENGINE, CARRY], ids=lambda p: p.name)
def test_the_scripts_parse(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_pack_pins_one_version_of_each_wheel() -> None:
    bodies = re.findall(r"^(?:ENGINE_)?WHEELS=\((.*?)^\)", PACK.read_text(), re.S | re.M)
    assert len(bodies) == 2
    pins = " ".join(bodies).split()
    names = [p.split("==")[0].lower().replace("_", "-") for p in pins]
    assert all("==" in p for p in pins), pins
    assert len(names) == len(set(names)), names
    # what the import reaches and the device image lacks, and this project's own
    for needed in ("pydantic", "pydantic-core", "pyzmq", "openai", "cbor2", "libcst", "typer", "rich"):
        assert needed in names
    # and what the offline engine reaches besides (bench/vllm024_engine.sh)
    for needed in ("msgspec", "llguidance", "xgrammar", "fastapi", "flashinfer-python"):
        assert needed in names


@pytest.mark.parametrize("script", [DEVICE, ENGINE], ids=lambda p: p.name)
def test_run_without_the_earlier_part_is_exit_3(tmp_path: Path, script: Path) -> None:
    """A second call that lands on a fresh machine must say so, not half-run."""
    part = tmp_path / "v24_2"
    part.mkdir()
    (part / "v24.parts").write_text("2\n")
    (part / "v24.tar.xz.2").write_bytes(b"x")
    (part / "v24.sha256").write_text("0\n")
    env = {"PATH": "/usr/bin:/bin", "V24_HOME": str(tmp_path / "home"), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(
        ["bash", str(script), "run", str(part)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "part 1 of 2" in proc.stdout
    assert (tmp_path / "out" / "transcript.txt").read_text().startswith("part 1 of 2")


@pytest.mark.parametrize("script", [DEVICE, ENGINE], ids=lambda p: p.name)
def test_store_then_run_finds_the_earlier_part(tmp_path: Path, script: Path) -> None:
    """store copies part 1 to the machine's home; run then gets past the check
    (and stops at the checksum of these stand-in bytes: exit 4)."""
    home = tmp_path / "home"
    one, two = tmp_path / "v24_1", tmp_path / "v24_2"
    one.mkdir()
    two.mkdir()
    (one / "v24.tar.xz.1").write_bytes(b"a")
    (two / "v24.tar.xz.2").write_bytes(b"b")
    (two / "v24.parts").write_text("2\n")
    (two / "v24.sha256").write_text("0\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "V24_HOME": str(home),
        "OUT": str(tmp_path / "out"),
        "V24_SITE": str(tmp_path / "site"),
    }
    store = subprocess.run(["bash", str(script), "store", str(one)], capture_output=True, text=True, env=env)
    assert store.returncode == 0, store.stderr
    proc = subprocess.run(
        ["bash", str(script), "run", str(two)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "sha256 mismatch" in proc.stdout
