"""Odd input (issue 13): one line naming the file and what is wrong, the right exit code, no
traceback, nothing lost; ``--json`` still prints its one document where the command got that far.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli

FORK_ERA = (FIXTURES / "fork_era" / "model.py").read_bytes()
EXPECTED = (FIXTURES / "fork_era" / "expected.py").read_bytes()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_clean(proc: subprocess.CompletedProcess[str], code: int) -> None:
    """The exit code, and no Python traceback anywhere."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in f"{proc.stderr}{proc.stdout or ''}", proc.stderr


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --- 2. text is printed as it is, never read as rich markup -----------------------------------


def test_brackets_in_a_path_are_printed_as_they_are(tmp_path: Path) -> None:
    target = put(tmp_path / "[/x]" / "[bold]model.py", FORK_ERA)
    proc = cli("run", "--json", str(target), "--color", "always")
    assert_clean(proc, 0)
    assert json.loads(proc.stdout)["files"][0]["status"] == "rewritten"
    assert f"{target}:276:" in re.sub(r"\x1b\[[0-9;]*m", "", proc.stderr)
    assert target.read_bytes() == EXPECTED


def test_waiting_message_names_a_bracketed_path(tmp_path: Path) -> None:
    target = put(tmp_path / "[/x]" / "model.py", FORK_ERA)
    with open(target, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another run would
        proc = cli("run", "--lock-timeout", "0.2", str(target))
    assert_clean(proc, 2)
    assert f"waiting for {target}: another mm3-codemod run holds it" in proc.stderr
    assert target.read_bytes() == FORK_ERA


@pytest.mark.parametrize("argument", ["self.kv_caches[self.layer_idx]", 'self.kv_caches["[/x]"]'])
def test_reasons_that_quote_source_keep_their_brackets(tmp_path: Path, argument: str) -> None:
    source = FORK_ERA.replace(b"            self.kv_cache,\n", f"            {argument},\n".encode(), 1)
    target = put(tmp_path / "model.py", source)
    proc = cli("check", str(target))
    assert_clean(proc, 2)
    assert f"`kv_cache` argument `{argument}` is not a `self.` attribute" in proc.stderr
    assert len(error_lines(proc.stderr)) == 1


def test_human_output_is_never_a_markup_string() -> None:
    """``console.print`` of a str reads markup; every line goes through ``say`` (a Text)."""
    for path in sorted((ROOT / "rewriter").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "print" and node.args:
                first = node.args[0]
                is_text = isinstance(first, ast.JoinedStr) or (
                    isinstance(first, ast.Constant) and isinstance(first.value, str)
                )
                assert not is_text, f"{path.name}:{node.lineno}: print a Text (console.say), not a str"


# --- 3. the printed diff is the file's diff, byte for byte --------------------------------------


def _crlf(data: bytes) -> bytes:
    return data.replace(b"\n", b"\r\n")


def _tabs(data: bytes) -> bytes:
    return re.sub(rb"(?m)^(?:    )+", lambda m: b"\t" * (len(m.group(0)) // 4), data)


def _form_feed(data: bytes) -> bytes:
    # A form-feed line, and characters str.splitlines splits at, in a comment the diff shows.
    at = data.index(b"        # Gemma QK-norm")
    odd = "\x0c\n        # a file\x1cseparator, a line\u2028separator, a next line\x85too\n".encode()
    return data[:at] + odd + data[at:]


VARIANTS = {"crlf": _crlf, "tabs": _tabs, "form-feed": _form_feed}
DIFF_COMMANDS = {
    "preview": ["preview"],
    "check --diff": ["check", "--diff"],
    "run --diff": ["run", "--diff"],
    "run --show-diff": ["run", "--show-diff"],
}


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch(1) is not installed")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("command", sorted(DIFF_COMMANDS))
def test_printed_diff_applies_and_gives_the_rewrite(tmp_path: Path, variant: str, command: str) -> None:
    original = VARIANTS[variant](FORK_ERA)
    expected_dir = tmp_path / "expected"
    rewritten = put(expected_dir / "model.py", original)
    assert_clean(cli("run", str(rewritten), cwd=expected_dir), 0)
    assert rewritten.read_bytes() != original
    work = tmp_path / "work"
    target = put(work / "model.py", original)
    proc = subprocess.run(
        [*cli_argv(), *DIFF_COMMANDS[command], "model.py"], capture_output=True, cwd=work, timeout=300
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert proc.stdout.startswith(b"--- a/model.py\n+++ b/model.py\n@@ ")
    assert (b"\r\n" in proc.stdout) == (variant == "crlf")
    if command == "preview":  # the JSON report's diff is the same text
        report = json.loads(cli("preview", "--json", "model.py", cwd=work).stdout)
        assert report["files"][0]["diff"].encode() == proc.stdout
    target.write_bytes(original)  # run --show-diff wrote it: apply its diff to the original
    subprocess.run(["patch", "-p1", "-s"], input=proc.stdout, cwd=work, check=True)
    assert target.read_bytes() == rewritten.read_bytes()
    target.write_bytes(original)
    subprocess.run(["git", "apply", "-"], input=proc.stdout, cwd=work, check=True)
    assert target.read_bytes() == rewritten.read_bytes()


def cli_argv() -> list[str]:
    return [sys.executable, "-m", "rewriter"]


def test_coloured_diff_is_the_plain_diff_plus_escape_codes(tmp_path: Path) -> None:
    target = put(tmp_path / "model.py", _tabs(_crlf(FORK_ERA)))
    plain = subprocess.run([*cli_argv(), "check", "--diff", str(target)], capture_output=True, timeout=300)
    coloured = subprocess.run(
        [*cli_argv(), "check", "--diff", "--color", "always", str(target)], capture_output=True, timeout=300
    )
    assert b"\x1b[" in coloured.stdout and b"\t" in plain.stdout
    assert re.sub(rb"\x1b\[[0-9;]*m", b"", coloured.stdout) == plain.stdout


# --- 1. deep nesting: one line, exit 2, in seconds ---------------------------------------------


def _sum(terms: int) -> bytes:
    return b"x = " + b" + ".join([b"1"] * terms) + b"\n"


DEEP = {
    "sum-500": _sum(500),
    "sum-20000": _sum(20_000),
    "parens-20000": b"x = " + b"(" * 20_000 + b"1" + b")" * 20_000 + b"\n",
    "calls-240": b"x = " + b"f(" * 240 + b"1" + b")" * 240 + b"\n",
    "and-20000": b"x = " + b" and ".join([b"a"] * 20_000) + b"\n",
}


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("shape", sorted(DEEP))
def test_deep_nesting_is_one_line_exit_2_in_seconds(tmp_path: Path, shape: str, command: str) -> None:
    source = FORK_ERA + DEEP[shape]
    target = put(tmp_path / "model.py", source)
    started = time.monotonic()
    proc = cli(command, "--json", str(target))
    assert time.monotonic() - started < 20  # minutes before; a few seconds on a busy machine
    assert_clean(proc, 2)
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: {target}: ") and "split it" in line, line
    report = json.loads(proc.stdout)
    assert report["exit_code"] == 2 and report["files"][0]["status"] == "error"
    assert target.read_bytes() == source


def test_recursion_anywhere_in_libcst_is_reported_not_raised(tmp_path: Path, monkeypatch) -> None:
    import codemods.analysis
    from rewriter import apply

    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(codemods.analysis, "rewrite", too_deep)
    result = apply.plan_file(put(tmp_path / "model.py", FORK_ERA))
    assert result.status is apply.FileStatus.ERROR
    assert result.error.startswith("an expression is nested too deeply; split it"), result.error


def test_deep_nesting_in_a_native_file_needs_no_libcst(tmp_path: Path) -> None:
    """The ast pre-filter answers a native file: its depth is no concern."""
    target = put(tmp_path / "model.py", (FIXTURES / "native" / "model.py").read_bytes() + _sum(500))
    assert_clean(cli("check", str(target)), 0)


# --- 10. newer Python than this one: the input's fault, named, exit 2 ---------------------------

NEWER = {
    "type-alias": (b"type Cache = dict[str, int]\n", (3, 12)),
    "pep701": (b's = f"{ {"a": 1}["a"] }"\n', (3, 12)),
}


@pytest.mark.parametrize("syntax", sorted(NEWER))
def test_newer_syntax_is_the_input_not_the_output(tmp_path: Path, syntax: str) -> None:
    code, since = NEWER[syntax]
    if sys.version_info >= since:
        pytest.skip(f"Python {sys.version_info.major}.{sys.version_info.minor} compiles it")
    source = FORK_ERA + code
    target = put(tmp_path / "model.py", source)
    proc = cli("run", "--json", str(target))
    assert_clean(proc, 2)
    (line,) = error_lines(proc.stderr)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert line.startswith(f"error: {target}: does not compile under Python {version} (line 375: "), line
    assert "run mm3-codemod under that Python" in line and "output" not in line
    assert json.loads(proc.stdout)["files"][0]["status"] == "error"
    assert target.read_bytes() == source and sorted(p.name for p in tmp_path.iterdir()) == ["model.py"]


def test_newer_syntax_in_a_native_file_is_still_native(tmp_path: Path) -> None:
    if sys.version_info >= (3, 12):
        pytest.skip("this Python compiles type aliases")
    native = (FIXTURES / "native" / "model.py").read_bytes()
    assert_clean(cli("check", str(put(tmp_path / "model.py", native + NEWER["type-alias"][0]))), 0)


# --- 11. line endings are kept exactly, the last one of a \r-only file included -----------------


@pytest.mark.parametrize("ending", [b"\r", b"\r\n"], ids=["cr", "crlf"])
def test_line_endings_are_kept_exactly(tmp_path: Path, ending: bytes) -> None:
    target = put(tmp_path / "model.py", FORK_ERA.replace(b"\n", ending))
    assert_clean(cli("run", str(target)), 0)
    assert target.read_bytes() == EXPECTED.replace(b"\n", ending)


# --- 12. owner and group are kept ----------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root may give a file away")
def test_owner_and_group_are_kept_on_rewrite_and_backup(tmp_path: Path) -> None:
    target = put(tmp_path / "model.py", FORK_ERA)
    os.chown(target, 12345, 23456)
    os.chmod(target, 0o640)
    assert_clean(cli("run", "--backup", str(target)), 0)
    assert target.read_bytes() == EXPECTED
    for path in (target, tmp_path / "model.py.orig"):
        st = path.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (12345, 23456, 0o640), path


# --- 4. what is not a regular file reached by its own path is refused ------------------------------

NOT_A_PATH = "not a regular file: the path leads through /proc"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="no /proc")
@pytest.mark.parametrize("spelling", ["/dev/stdin", "/dev/fd/0", "/proc/self/fd/0", "link-to-stdin"])
def test_a_path_through_proc_is_refused_and_its_file_untouched(tmp_path: Path, spelling: str) -> None:
    other = put(tmp_path / "other.py", FORK_ERA)
    (tmp_path / "link-to-stdin").symlink_to("/dev/stdin")
    with open(other, "rb") as stdin:
        proc = subprocess.run(
            [*cli_argv(), "run", "--json", spelling],
            stdin=stdin,
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
    assert_clean(proc, 2)
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: {spelling}: {NOT_A_PATH}"), line
    assert json.loads(proc.stdout)["files"][0]["status"] == "error"
    assert other.read_bytes() == FORK_ERA
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link-to-stdin", "other.py"]


def test_a_device_is_refused(tmp_path: Path) -> None:
    proc = cli("run", "/dev/null")
    assert_clean(proc, 2)
    assert error_lines(proc.stderr) == ["error: /dev/null: not a regular file"]


def test_a_folder_link_that_goes_up_is_followed_as_the_kernel_does(tmp_path: Path) -> None:
    """``link/..`` is the folder above where the link leads, not the link's own folder."""
    put(tmp_path / "deep" / "sub" / "model.py", FORK_ERA)
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "sub")
    proc = cli("check", "link/../sub/model.py", cwd=tmp_path)
    assert_clean(proc, 1)


# --- 5. one file given twice (hard links) is one target ---------------------------------------


def test_hard_links_to_one_file_are_one_target(tmp_path: Path) -> None:
    first = put(tmp_path / "model.py", FORK_ERA)
    second = tmp_path / "again.py"
    os.link(first, second)
    started = time.monotonic()
    proc = cli("run", "--json", str(first), str(second))  # the second lock would wait 30 s
    assert time.monotonic() - started < 20
    assert_clean(proc, 0)
    assert [f["path"] for f in json.loads(proc.stdout)["files"]] == [str(first)]
    assert "1 file rewritten." in proc.stderr and first.read_bytes() == EXPECTED


# --- 6. Ctrl-C: "interrupted", exit 130, files whole ---------------------------------------------


def _wait_stopped(proc: subprocess.Popen) -> bool:
    """True once ``proc`` stops itself (the test hook's ``stop``); False if it ended instead."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return True
        time.sleep(0.02)
    raise AssertionError("the CLI neither stopped nor ended")


def _as_from_a_shell() -> None:
    """Ctrl-C as an interactive shell leaves it to a command it starts (the test process's
    own SIGINT state - ignored or blocked under a test runner's worker - is not inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _interrupt_at(point: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI, press Ctrl-C when it reaches ``point`` the first time, let it finish."""
    proc = subprocess.Popen(
        [*cli_argv(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MM3_CODEMOD_TEST_HOOK": f"{point}=stop"},
        preexec_fn=_as_from_a_shell,
    )
    interrupted = False
    while _wait_stopped(proc):
        if not interrupted:
            os.kill(proc.pid, signal.SIGINT)  # delivered when it runs again
            interrupted = True
        os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert interrupted, err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize("command", ["run", "revert"])
def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path, command: str) -> None:
    """``revert`` goes through typer (click would say "Aborted!" and exit 1)."""
    source = FORK_ERA if command == "run" else EXPECTED
    target = put(tmp_path / "model.py", source)
    proc = _interrupt_at("planned", command, "--json", str(target))
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "interrupted\n", "")
    assert target.read_bytes() == source and sorted(p.name for p in tmp_path.iterdir()) == ["model.py"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_ctrl_c_between_two_renames_waits_for_the_second(tmp_path: Path) -> None:
    """All or nothing across files: Ctrl-C after the first file is moved into place
    arrives once the second one is too."""
    first, second = put(tmp_path / "a" / "model.py", FORK_ERA), put(tmp_path / "b" / "model.py", FORK_ERA)
    proc = _interrupt_at("replaced", "run", str(tmp_path))
    assert (proc.returncode, proc.stderr) == (130, "interrupted\n")
    assert first.read_bytes() == second.read_bytes() == EXPECTED


# --- 7. stdout that cannot be written: one line, exit 2 -----------------------------------------


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize(
    "args",
    [
        ["check", "--json"],
        ["check", "--diff"],
        ["preview"],
        ["run", "--diff"],
        ["survey", "--json"],
        ["-h"],
        ["-V"],
    ],
    ids=" ".join,
)
def test_a_full_stdout_is_one_line_exit_2(tmp_path: Path, args: list[str]) -> None:
    target = put(tmp_path / "model.py", FORK_ERA)
    files = [] if args[0].startswith("-") else [str(target)]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*cli_argv(), *args, *files], stdout=full, stderr=subprocess.PIPE, text=True)
    assert_clean(proc, 2)
    assert proc.stderr.splitlines()[-1] == "error: cannot write to stdout: No space left on device"
    assert target.read_bytes() == FORK_ERA


# --- 7, 8. --python: an interpreter that answers garbage, or never -------------------------------


def fake_python(folder: Path, body: str) -> Path:
    script = folder / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script


GARBAGE = {
    "bytes": r"printf '\377\376 not json\n'",
    "a list": "echo '[1, 2]'",
    "wrong types": """echo '{"locations": 5, "version": null}'""",
    "not paths": """echo '{"locations": [1], "version": "0.24.0"}'""",
    "deep json": "python3 -c 'print(\"[\" * 100000)'",
}


@pytest.mark.parametrize("answer", sorted(GARBAGE))
def test_a_python_that_answers_garbage_is_one_line_exit_2(tmp_path: Path, answer: str) -> None:
    python = fake_python(tmp_path, GARBAGE[answer])
    proc = cli("check", "--json", "--python", str(python))
    assert_clean(proc, 2)
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: {python}: --python: unexpected output "), line
    assert line.endswith("is it a Python interpreter?"), line
    assert json.loads(proc.stdout)["exit_code"] == 2


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent (init here) has not reaped it


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_python_that_never_answers_is_killed_with_its_children(tmp_path: Path, monkeypatch) -> None:
    from rewriter import targets

    pids = tmp_path / "pids"
    python = fake_python(tmp_path, f"sleep 60 &\necho $$ $! > {pids}\nwait")
    monkeypatch.setattr(targets, "PYTHON_TIMEOUT", 1.0)
    started = time.monotonic()
    with pytest.raises(targets.TargetError, match=r"--python: did not answer within 1 s$"):
        targets.vllm_install_of_interpreter(str(python))
    assert time.monotonic() - started < 20  # its child kept the pipe open: no wait for it either
    shell, child = (int(pid) for pid in pids.read_text().split())
    deadline = time.monotonic() + 10
    while (_alive(shell) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(shell) and not _alive(child)


# --- 9. a folder that cannot be read is reported, not skipped ------------------------------------


def without_read_override() -> list[str]:
    """The command prefix under which a mode-000 folder cannot be read: none for a user;
    for root, setpriv without the capabilities that read anything."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root reads any folder, and setpriv is not installed to drop that")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


@pytest.mark.parametrize("command", ["check", "run"])
def test_an_unreadable_subfolder_is_an_error_that_does_not_stop_the_others(
    tmp_path: Path, command: str
) -> None:
    tree = tmp_path / "tree"
    readable = put(tree / "ok" / "model.py", FORK_ERA)
    hidden = put(tree / "locked" / "model.py", FORK_ERA)
    os.chmod(hidden.parent, 0)
    try:
        proc = subprocess.run(
            [*without_read_override(), *cli_argv(), command, "--json", "tree"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
        )
    finally:
        os.chmod(hidden.parent, 0o755)
    assert_clean(proc, 2)
    assert error_lines(proc.stderr) == [
        "error: tree/locked: cannot read this folder: Permission denied; the .py files in it were not checked"
    ]
    files = {f["path"]: f["status"] for f in json.loads(proc.stdout)["files"]}
    assert files == {str(Path("tree/locked")): "error", str(Path("tree/ok/model.py")): "needs-rewrite"}
    assert readable.read_bytes() == hidden.read_bytes() == FORK_ERA  # run: all or nothing


def test_an_unreadable_target_folder_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    put(folder / "model.py", FORK_ERA)
    os.chmod(folder, 0)
    try:
        proc = subprocess.run(
            [*without_read_override(), *cli_argv(), "check", str(folder)], capture_output=True, text=True
        )
    finally:
        os.chmod(folder, 0o755)
    assert_clean(proc, 2)
    assert error_lines(proc.stderr) == [
        f"error: {folder}: cannot read this folder: Permission denied; the .py files in it were not checked"
    ]


def test_an_async_init_is_no_crash(tmp_path: Path) -> None:
    """A class whose ``__init__`` is ``async def`` has no flag to read by value: the file is
    judged (here refused for the sizes it lacks), never a traceback."""
    path = tmp_path / "model.py"
    path.write_text(
        "import torch\nfrom vllm import _custom_ops as ops\n\n\nclass A:\n"
        "    async def __init__(self):\n        self.kv_cache_dtype = 'auto'\n\n"
        "    def forward(self, qkv):\n        ops.fused_minimax_m3_qknorm_rope_kv_insert(\n"
        "            qkv, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, self.kv_cache, self.index_cache, 128, 0, 0\n        )\n"
    )
    proc = cli("check", str(path))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2 and "A.forward: unsupported -> refuse" in proc.stderr
