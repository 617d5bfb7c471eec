"""`verify` reads a model file as `run` does (issue 29).

A file with a PEP 263 coding line (``# -*- coding: latin-1 -*-``) and a non-ASCII byte was
rewritten by `run`, then `verify` died with a UnicodeDecodeError traceback: its readers took
every file for UTF-8. Every reader of a file's text in verify now goes through
``rewriter.apply.read_source``: a UTF-8 BOM dropped, then the coding line, else UTF-8 - what
LibCST and ``compile`` make of the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, cli, make_vllm_tree

from rewriter.apply import BOM, FileError, read_source

FORK_ERA = (FIXTURES / "fork_era" / "model.py").read_text()
EXPECTED = (FIXTURES / "fork_era" / "expected.py").read_text()
FORWARD = "    def forward(\n"


def _with_non_ascii(source: str, header: str = "") -> str:
    """``source`` with a comment holding non-ASCII text at the top and one inside the layer
    class (so that its methods' lines carry it), under ``header`` (a coding line)."""
    assert source.isascii() and source.count(FORWARD) >= 1
    source = source.replace(FORWARD, "    # café: the layer's forward, naïvely\n" + FORWARD, 1)
    return header + "# Ünïcödé comment: é\n" + source


# name -> how the file's bytes are made from its text
ENCODINGS = {
    "latin-1": lambda s: _with_non_ascii(s, "# -*- coding: latin-1 -*-\n").encode("latin-1"),
    "cp1252-line-2": lambda s: _with_non_ascii(
        s, "#!/usr/bin/env python\n# vim: set fileencoding=cp1252 :\n"
    ).encode("cp1252"),
    "utf-8-bom": lambda s: BOM + _with_non_ascii(s).encode("utf-8"),
    "utf-8-bom-coding": lambda s: BOM + _with_non_ascii(s, "# -*- coding: utf-8 -*-\n").encode("utf-8"),
}


def _write(tmp_path: Path, encoding: str, source: str = FORK_ERA) -> Path:
    path = tmp_path / encoding / "model.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(ENCODINGS[encoding](source))
    return path


def _levels(proc) -> dict[str, dict]:
    (entry,) = json.loads(proc.stdout)["files"]
    return {level["level"]: level for level in entry["levels"]}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_read_source_decodes_as_run_does(tmp_path: Path, encoding: str) -> None:
    import libcst

    path = _write(tmp_path, encoding)
    raw = path.read_bytes()
    text = read_source(path)
    assert text == libcst.parse_module(raw.removeprefix(BOM)).code  # what run reads
    assert "café" in text and not text.startswith("\ufeff")
    compile(raw, str(path), "exec")  # Python takes the bytes as they are


def test_undecodable_bytes_are_a_file_error(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_bytes(_with_non_ascii(FORK_ERA).encode("latin-1"))  # no coding line: not UTF-8
    with pytest.raises(FileError, match="cannot decode source"):
        read_source(path)
    proc = cli("verify", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{path}" in proc.stderr


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_run_then_verify_a_file_in_its_own_encoding(tmp_path: Path, encoding: str) -> None:
    torch = pytest.importorskip("torch")  # noqa: F841 - the semantic level runs
    path = _write(tmp_path, encoding)
    proc = cli("run", str(path))
    assert proc.returncode == 0, proc.stderr
    assert path.read_bytes() == ENCODINGS[encoding](EXPECTED)  # its encoding, BOM, coding line kept
    assert "proven: " in proc.stderr  # run's own proof read the new source the same way
    proc = cli("verify", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "UnicodeDecodeError" not in proc.stderr
    proc = cli("verify", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    semantic = _levels(proc)["semantic"]
    assert semantic["status"] == "passed", semantic


@pytest.mark.parametrize("encoding", ["latin-1"])
def test_verify_of_the_unpatched_file_fails_with_the_reason(tmp_path: Path, encoding: str) -> None:
    pytest.importorskip("torch")
    path = _write(tmp_path, encoding)
    check = cli("check", "--json", str(path))
    (site,) = [s for s in json.loads(check.stdout)["files"][0]["sites"] if s["state"] == "needs-bypass"]
    proc = cli("verify", "--json", str(path))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    semantic = _levels(proc)["semantic"]
    assert semantic["status"] == "failed"
    assert "kv_cache dtype must match qkv (bf16 cache only)" in semantic["reason"]
    assert f"(at model.py:{site['line']} in forward)" in semantic["reason"]  # the file's own line


def test_the_import_level_reads_a_latin1_files_import_lines(tmp_path: Path) -> None:
    """vLLM's own code raising while one of the file's imports runs is the environment's
    (skipped): telling so needs the file's import lines, read in its own encoding."""
    pytest.importorskip("torch")
    from test_verify import STUB_VLLM

    raising = "raise AttributeError(\"'_OpNamespace' '_C' object has no attribute 'rotary_embedding'\")\n"
    source = EXPECTED + "\nfrom vllm.needsgpu import thing\n"
    nvidia = make_vllm_tree(tmp_path, {"model.py": ENCODINGS["latin-1"](source)}, init=STUB_VLLM)
    (tmp_path / "vllm" / "needsgpu.py").write_text(raising)
    proc = cli("verify", "--json", str(nvidia / "model.py"))
    assert proc.returncode == 0, proc.stderr
    level = _levels(proc)["import"]
    assert level["status"] == "skipped", level
    assert "while the file's import at" in level["reason"]


def test_the_engine_level_reads_a_latin1_files_import_lines(tmp_path: Path) -> None:
    """The engine's child failing while loading the file: judged with the file's import lines."""
    from rewriter.verify.engine import judge_job

    source = ENCODINGS["latin-1"](EXPECTED + "\nfrom vllm.needsgpu import thing\n")
    path = tmp_path / "model.py"
    path.write_bytes(source)
    line = len(source.splitlines())
    job = {
        "label": "bf16",
        "status": "error",
        "phase": "import",
        "exc_type": "AttributeError",
        "message": "'_OpNamespace' '_C' object has no attribute 'rotary_embedding'",
        "frames": [[str(path), line], [str(tmp_path / "vllm" / "needsgpu.py"), 1]],
    }
    status, why = judge_job(job, path, [])
    assert status == "skipped", why
    assert "while the file's import at" in why
