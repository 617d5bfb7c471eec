"""Bad input: the right state, or exit 2 with one line naming the file and the reason.

Every case leaves the file byte-identical unless the rewrite succeeded (and then
keeps its BOM, line endings and indentation). Cases covered elsewhere:
a missing path and an empty directory (test_cli.test_target_errors_are_one_line_exit_2),
a syntax error and non-UTF-8 bytes (test_cli.test_bad_files_exit_2_untouched), a
file changed between read and write (test_cli, in-process; here with two real
processes in test_faults), two runs at once (test_faults).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, cli

from rewriter import apply, commands
from rewriter.apply import FileStatus
from rewriter.targets import Target

FORK_ERA = (FIXTURES / "fork_era" / "model.py").read_bytes()
EXPECTED = (FIXTURES / "fork_era" / "expected.py").read_bytes()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_one_error(proc, path: Path, reason: str) -> None:
    assert proc.returncode == 2, proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert str(path) in errors[0] and reason in errors[0], errors[0]


def folder_listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- exit 2, one line, untouched (through the real CLI) ------------------------------------


def _binary(d: Path) -> tuple[Path, bytes]:
    path = d / "model.so"
    path.write_bytes(b"\x7fELF\x00\x00fused_minimax_m3_qknorm_rope_kv_insert\x00\x01")
    return path, path.read_bytes()


def _prose(d: Path) -> tuple[Path, bytes]:
    path = d / "NOTES.md"
    path.write_bytes(b"# Notes\n\nWe call fused_minimax_m3_qknorm_rope_kv_insert (see model.py).\n")
    return path, path.read_bytes()


def _read_only(d: Path) -> tuple[Path, bytes]:
    path = d / "model.py"
    path.write_bytes(FORK_ERA)
    os.chmod(path, 0o444)  # refused by its mode bits: root (CI) could write it anyway
    return path, FORK_ERA


def _dangling_link(d: Path) -> tuple[Path, bytes]:
    link = d / "model.py"
    link.symlink_to("gone.py")
    return link, b""


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_binary, "binary file (NUL bytes), not Python source"),
        (_prose, "not valid Python"),
        (_read_only, "file is read-only; nothing written"),
        (_dangling_link, "cannot read: No such file or directory"),
    ],
    ids=["binary", "non-python-text", "read-only", "dangling-symlink"],
)
def test_run_refuses_with_one_line(tmp_path: Path, make, reason: str) -> None:
    path, data = make(tmp_path)
    before = folder_listing(tmp_path)
    proc = cli("run", str(path))
    assert_one_error(proc, path, reason)
    if data:
        assert path.read_bytes() == data
    assert folder_listing(tmp_path) == before  # no temp file, no backup


def test_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "model.py"
    os.mkfifo(fifo)
    proc = cli("run", str(fifo))  # a read would block forever on a FIFO without a writer
    assert_one_error(proc, fifo, "not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


# --- the right state ------------------------------------------------------------------------


def test_empty_file_has_nothing_to_do(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_bytes(b"")
    proc = cli("run", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "1 empty file (0 bytes): nothing to do." in proc.stderr and not error_lines(proc.stderr)
    assert path.read_bytes() == b"" and folder_listing(tmp_path) == ["model.py"]


def test_directory_with_model_files_rewrites_only_what_needs_it(tmp_path: Path) -> None:
    (tmp_path / "fork").mkdir()
    (tmp_path / "fork" / "model.py").write_bytes(FORK_ERA)
    native = (FIXTURES / "native" / "model.py").read_bytes()
    (tmp_path / "native.py").write_bytes(native)
    (tmp_path / "README.md").write_text("fused_minimax_m3_qknorm_rope_kv_insert, not Python\n")
    (tmp_path / "looks_like.py").mkdir()  # a folder named *.py is not a target
    proc = cli("run", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "1 file rewritten, 1 file left unchanged." in proc.stderr
    assert (tmp_path / "fork" / "model.py").read_bytes() == EXPECTED
    assert (tmp_path / "native.py").read_bytes() == native
    assert folder_listing(tmp_path) == ["README.md", "fork", "looks_like.py", "native.py"]


def test_directory_given_where_a_file_is_read(tmp_path: Path) -> None:
    """A folder reaching plan_file (e.g. a race with targets) is one clean error."""
    result = apply.plan_file(tmp_path)
    assert result.status is FileStatus.ERROR and result.error == "is a directory, not a file"


# --- encodings, line endings, indentation: kept when the rewrite succeeds -----------------


def crlf(data: bytes) -> bytes:
    return data.replace(b"\n", b"\r\n")


def tabs(data: bytes) -> bytes:
    """Each leading run of four spaces becomes a tab (docstring lines included)."""
    out = []
    for line in data.split(b"\n"):
        body = line.lstrip(b" ")
        depth = len(line) - len(body)
        out.append(b"\t" * (depth // 4) + b" " * (depth % 4) + body)
    return b"\n".join(out)


@pytest.mark.parametrize(
    "encode",
    [crlf, tabs, lambda d: apply.BOM + crlf(tabs(d))],
    ids=["crlf", "tabs", "bom+crlf+tabs"],
)
def test_layout_is_kept(tmp_path: Path, encode) -> None:
    path = tmp_path / "model.py"
    path.write_bytes(encode(FORK_ERA))
    compile(encode(FORK_ERA), "before", "exec")  # the mangled input is itself valid
    report = commands.write_targets("run", [Target(path, "test")])
    assert report.files[0].status is FileStatus.REWRITTEN, report.files[0].error
    assert path.read_bytes() == encode(EXPECTED)


def test_crlf_bom_through_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_bytes(apply.BOM + crlf(FORK_ERA))
    proc = cli("run", str(path))
    assert proc.returncode == 0, proc.stderr
    assert path.read_bytes() == apply.BOM + crlf(EXPECTED)


def test_mixed_line_endings_are_kept_line_by_line(tmp_path: Path) -> None:
    """Each existing line keeps its own ending; added lines take the first line's (LibCST's rule)."""
    lines = FORK_ERA.split(b"\n")
    lines[0] += b"\r"  # only the first line ends in CRLF
    path = tmp_path / "model.py"
    path.write_bytes(b"\n".join(lines))
    commands.write_targets("run", [Target(path, "test")])
    out = path.read_bytes()
    assert out.replace(b"\r\n", b"\n") == EXPECTED
    assert out.startswith(lines[0] + b"\n")
    tail = b"\n".join(lines[-60:])  # after the last rewritten line: LF as it was
    assert out.endswith(tail) and b"\r" not in tail


def test_the_files_own_syntax_warnings_are_not_printed(tmp_path: Path) -> None:
    """Compiling the output for validation must not echo the file's warnings (found by hypothesis)."""
    path = tmp_path / "model.py"
    path.write_bytes(FORK_ERA + b'\nSTRICT = "fp8" is "fp8"\n')
    proc = cli("run", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr
    assert path.read_bytes() == EXPECTED + b'\nSTRICT = "fp8" is "fp8"\n'


# --- symlinks -------------------------------------------------------------------------------


def test_relative_symlink_from_another_folder(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    real = tmp_path / "real" / "model.py"
    real.write_bytes(FORK_ERA)
    os.chmod(real, 0o640)
    link = tmp_path / "links" / "model.py"
    link.symlink_to(Path("..") / "real" / "model.py")
    proc = cli("run", str(link))
    assert proc.returncode == 0, proc.stderr
    assert os.readlink(link) == str(Path("..") / "real" / "model.py")  # the link is kept as it was
    assert real.read_bytes() == EXPECTED and stat.S_IMODE(real.stat().st_mode) == 0o640
    assert folder_listing(tmp_path / "real") == ["model.py"]
    assert folder_listing(tmp_path / "links") == ["model.py"]


def test_link_and_target_given_together_are_one_file(tmp_path: Path) -> None:
    real = tmp_path / "model.py"
    real.write_bytes(FORK_ERA)
    (tmp_path / "alias.py").symlink_to("model.py")
    proc = cli("run", str(real), str(tmp_path / "alias.py"))
    assert proc.returncode == 0, proc.stderr
    assert "1 file rewritten." in proc.stderr
    assert real.read_bytes() == EXPECTED and (tmp_path / "alias.py").is_symlink()


@pytest.mark.parametrize(
    "source",
    [
        "from vllm import _custom_ops as ops\nclass A:\n    def f(self):\n        ops.fused_minimax_m3_qknorm_rope_kv_insert(x,\n        return x\n",
        "import torch\n\nops.fused_minimax_m3_qknorm_rope_kv_insert(1)\ndef f(:\n    pass\n",
        "ops.fused_minimax_m3_qknorm_rope_kv_insert(1)\nif True:\n  x = 1\n    y = 2\n",
    ],
)
def test_a_syntax_error_is_reported_where_python_reports_it(tmp_path, source: str) -> None:
    """The line, column and message Python itself gives (``python file.py``), not LibCST's
    parser's position, which can be lines away."""
    path = tmp_path / "model.py"
    path.write_text(source)
    with pytest.raises(SyntaxError) as python:
        compile(source, str(path), "exec")
    proc = cli("check", str(path))
    assert proc.returncode == 2
    expected = f"not valid Python (line {python.value.lineno}, column {python.value.offset}): {python.value.msg}"
    assert expected in proc.stderr, proc.stderr
    assert path.read_text() == source


def test_an_undecodable_byte_past_line_two_is_one_line_exit_2(tmp_path: Path) -> None:
    """A latin-1 byte on line 3 (no coding line): tokenize raises UnicodeDecodeError late, which the
    nesting check let through as a traceback, exit 1 ("work needed" to CI), no JSON."""
    path = tmp_path / "model.py"
    lines = (FIXTURES / "fork_era" / "model.py").read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:2] + [b"# caf\xe9"] + lines[2:]))
    proc = subprocess.run([sys.executable, "-m", "rewriter", "check", "--json", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot decode source" in proc.stderr and json.loads(proc.stdout)["exit_code"] == 2
