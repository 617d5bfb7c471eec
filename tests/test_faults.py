"""Faults at the moment of writing, and two runs at once on one file.

Real ``mm3-codemod`` processes are stopped or killed at a write point through
the test-only hook ``MM3_CODEMOD_TEST_HOOK`` (rewriter/testhook.py); full disks
and permission errors are injected in-process (the suite runs as root, so the
kernel would not refuse a write).
"""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli

from rewriter import apply, commands, testhook
from rewriter.apply import FileStatus
from rewriter.targets import Target, resolve

FORK_ERA = (FIXTURES / "fork_era" / "model.py").read_bytes()
EXPECTED = (FIXTURES / "fork_era" / "expected.py").read_bytes()
HOOK = testhook.ENV


def fork_era(tmp_path: Path, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_bytes(FORK_ERA)
    return path


def stray_temps(folder: Path) -> list[Path]:
    return sorted(folder.glob(f".*{apply.TEMP_SUFFIX}"))


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def spawn(*args: str, hook: str | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != HOOK}
    if hook:
        env[HOOK] = hook
    return subprocess.Popen(
        [sys.executable, "-m", "rewriter", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


def wait_stopped(proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until the hook has SIGSTOPped ``proc`` (it must not have exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            assert os.WIFSTOPPED(status), f"exited before the hook point (status {status})"
            return
        time.sleep(0.02)
    raise AssertionError("the hook point was never reached")


def read_line(stream, timeout: float = 120) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, "no output in time"
    return stream.readline()


@pytest.fixture
def reaper():
    """Kill what a test started, even if it fails half-way (stopped processes too)."""
    started: list[subprocess.Popen[str]] = []
    yield started.append
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)


# --- SIGKILL while writing -------------------------------------------------------------------


@pytest.mark.parametrize("point", testhook.POINTS)
def test_sigkill_at_each_write_point_leaves_a_whole_file(tmp_path: Path, point: str) -> None:
    target = fork_era(tmp_path)
    proc = cli("run", str(target), env={HOOK: f"{point}=kill"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # Old or new, whole: never a mix, never a short file.
    assert target.read_bytes() == (EXPECTED if point == "replaced" else FORK_ERA)
    # Killed between creating the temp file and the rename, it stays behind ...
    temps = stray_temps(tmp_path)
    assert len(temps) == (1 if point.startswith("temp-") else 0), temps
    # ... hidden, and not a .py file: no directory scan picks it up; the next run removes it.
    scan = commands.analyze_targets("check", resolve([tmp_path]))
    assert [f.path.name for f in scan.files] == ["model.py"]
    report = commands.write_targets("run", [Target(target, "test")])
    assert report.exit_code == 0
    assert target.read_bytes() == EXPECTED
    assert listing(tmp_path) == ["model.py"]


def test_a_stray_temp_file_of_another_file_is_not_touched(tmp_path: Path) -> None:
    target = fork_era(tmp_path)
    other = tmp_path / ".model.py.x.abcd1234.mm3-codemod.tmp"  # temp of `model.py.x`
    other.write_text("not ours")
    commands.write_targets("run", [Target(target, "test")])
    assert other.read_text() == "not ours"


# --- full disk, permission errors ------------------------------------------------------------


def _is_temp(fd: int) -> bool:
    return os.readlink(f"/proc/self/fd/{fd}").endswith(apply.TEMP_SUFFIX)


def _fail_on_temp(real, code: int):
    def failing(fd, *args):
        if _is_temp(fd):
            raise OSError(code, os.strerror(code))
        return real(fd, *args)

    return failing


@pytest.mark.parametrize(
    ("name", "code", "message"),
    [
        ("write", errno.ENOSPC, "cannot write: No space left on device; nothing written"),
        ("fsync", errno.EIO, "cannot write: Input/output error; nothing written"),
        (
            "mkstemp",
            errno.EACCES,
            "cannot create a temporary file beside it: Permission denied; nothing written",
        ),
        ("chmod", errno.EPERM, "cannot write: Operation not permitted; nothing written"),
        ("replace", errno.EACCES, "cannot replace the file: Permission denied; nothing written"),
    ],
)
def test_write_errors_leave_the_original_and_no_temp(
    tmp_path: Path, monkeypatch, name: str, code: int, message: str
) -> None:
    target = fork_era(tmp_path)
    if name in ("write", "fsync"):
        monkeypatch.setattr(apply.os, name, _fail_on_temp(getattr(os, name), code))
    else:
        owner = apply.tempfile if name == "mkstemp" else apply.os

        def fail(*args, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(owner, name, fail)
    report = commands.write_targets("run", [Target(target, "test")], backup=True)
    monkeypatch.undo()
    assert report.exit_code == 2
    assert report.files[0].status is FileStatus.ERROR and report.files[0].error == message
    assert target.read_bytes() == FORK_ERA
    assert listing(tmp_path) == ["model.py"]  # no temp file, no backup


def test_a_failing_backup_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    target = fork_era(tmp_path)

    def no_link(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(apply.os, "link", no_link)
    report = commands.write_targets("run", [Target(target, "test")], backup=True)
    monkeypatch.undo()
    assert report.files[0].error == "cannot write the backup: No space left on device; nothing written"
    assert target.read_bytes() == FORK_ERA and listing(tmp_path) == ["model.py"]


def test_full_disk_on_the_second_file_writes_neither(tmp_path: Path, monkeypatch) -> None:
    """All or nothing across files: every new file is staged before any is moved into place."""
    first, second = fork_era(tmp_path, "a.py"), fork_era(tmp_path, "b.py")
    real_write = os.write

    def write(fd, data):
        if _is_temp(fd) and os.readlink(f"/proc/self/fd/{fd}").split("/")[-1].startswith(".b.py."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(apply.os, "write", write)
    report = commands.write_targets("run", [Target(first, "test"), Target(second, "test")], backup=True)
    monkeypatch.undo()
    assert report.exit_code == 2 and "nothing written" in report.note
    assert [f.status for f in report.files] == [FileStatus.NEEDS_REWRITE, FileStatus.ERROR]
    assert first.read_bytes() == second.read_bytes() == FORK_ERA
    assert listing(tmp_path) == ["a.py", "b.py"]


def test_full_disk_through_the_cli_is_one_line(tmp_path: Path) -> None:
    target = fork_era(tmp_path)
    proc = cli("run", str(target), env={HOOK: "temp-written=error:ENOSPC"})
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line == f"error: {target}: cannot write: No space left on device; nothing written"
    assert target.read_bytes() == FORK_ERA and listing(tmp_path) == ["model.py"]


def test_the_hook_does_nothing_when_unset(monkeypatch) -> None:
    monkeypatch.delenv(HOOK, raising=False)
    for point in testhook.POINTS:
        testhook.at(point)  # returns: no stop, no kill, no error
    monkeypatch.setenv(HOOK, "temp-written=error:ENOSPC")
    testhook.at("temp-synced")  # another point: nothing
    with pytest.raises(OSError) as exc:
        testhook.at("temp-written")
    assert exc.value.errno == errno.ENOSPC


# --- changed by someone else, two runs at once ---------------------------------------------------


def test_edit_while_a_run_is_paused_is_refused(tmp_path: Path, reaper) -> None:
    target = fork_era(tmp_path)
    proc = spawn("run", str(target), hook="planned=stop")
    reaper(proc)
    wait_stopped(proc)
    edited = FORK_ERA + b"# edited by someone else meanwhile\n"
    target.write_bytes(edited)
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    (line,) = error_lines(stderr)
    assert str(target) in line and "changed by someone else since it was read" in line
    assert target.read_bytes() == edited and listing(tmp_path) == ["model.py"]


def test_a_second_run_waits_then_finds_the_first_ones_result(tmp_path: Path, reaper) -> None:
    target = fork_era(tmp_path)
    first = spawn("run", str(target), hook="temp-synced=stop")  # held just before its os.replace
    reaper(first)
    wait_stopped(first)
    assert target.read_bytes() == FORK_ERA and len(stray_temps(tmp_path)) == 1

    second = spawn("run", str(target))
    reaper(second)
    line = read_line(second.stderr)
    assert line.startswith(f"waiting for {target}: another mm3-codemod run holds it")
    time.sleep(0.5)
    assert second.poll() is None  # still waiting: it has read nothing yet

    first.send_signal(signal.SIGCONT)
    _, first_err = first.communicate(timeout=120)
    assert first.returncode == 0 and "1 file rewritten." in first_err
    _, second_err = second.communicate(timeout=120)
    # The second run re-read the file after taking the lock: nothing left to do.
    assert second.returncode == 0, second_err
    assert "patched" in second_err and "1 file left unchanged." in second_err
    assert target.read_bytes() == EXPECTED and listing(tmp_path) == ["model.py"]


def test_a_second_run_gives_up_after_the_lock_timeout(tmp_path: Path, reaper) -> None:
    target = fork_era(tmp_path)
    first = spawn("run", str(target), hook="temp-synced=stop")
    reaper(first)
    wait_stopped(first)

    proc = cli("run", "--lock-timeout", "0.5", str(target))
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line == f"error: {target}: locked by another mm3-codemod (waited 0.5 s); nothing written"
    assert target.read_bytes() == FORK_ERA

    first.kill()  # SIGKILL the holder at its write point: the lock dies with it
    first.communicate(timeout=60)
    assert target.read_bytes() == FORK_ERA and len(stray_temps(tmp_path)) == 1
    proc = cli("run", "--lock-timeout", "0.5", str(target))
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == EXPECTED and listing(tmp_path) == ["model.py"]


def test_a_lock_taken_while_the_file_was_replaced_follows_the_new_file(tmp_path: Path) -> None:
    """os.replace gives the path a new inode: a waiter must end up locking that one,
    or a third run could lock the new file while the waiter works on it."""
    import fcntl
    import threading

    from rewriter.locking import locked

    target = fork_era(tmp_path)
    holder = os.open(target, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a first run holds the lock on the old inode
    waiting, inside, release = threading.Event(), threading.Event(), threading.Event()

    def second_run() -> None:
        with locked([target], timeout=60, on_wait=lambda path: waiting.set()):
            inside.set()
            release.wait(60)

    thread = threading.Thread(target=second_run)
    thread.start()
    try:
        assert waiting.wait(60)
        new = tmp_path / "new.tmp"
        new.write_bytes(EXPECTED)
        os.replace(new, target)  # the first run writes ...
        os.close(holder)  # ... and exits
        assert inside.wait(60)
        third = os.open(target, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(third)
    finally:
        release.set()
        thread.join(60)


def test_revert_takes_the_same_lock(tmp_path: Path) -> None:
    import fcntl

    target = tmp_path / "model.py"
    patched = (FIXTURES / "patched" / "model.py").read_bytes()
    target.write_bytes(patched)
    holder = os.open(target, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another run holds it
    try:
        report = commands.write_targets("revert", [Target(target, "test")], lock_timeout=0.2)
    finally:
        os.close(holder)
    assert report.exit_code == 2
    assert report.files[0].error == "locked by another mm3-codemod (waited 0.2 s); nothing written"
    assert target.read_bytes() == patched
    again = commands.write_targets("revert", [Target(target, "test")], whole_bypass=True)  # a hand bypass
    assert again.files[0].status is FileStatus.REWRITTEN
