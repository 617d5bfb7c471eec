"""One ``run`` at a time per file: an exclusive ``flock`` on the file itself.

The lock is taken on the target's real path (a symlink and its target share
it), on the file's own inode: no lock file is created, so none can be left
behind. ``os.replace`` gives the path a new inode, so a run that waited on the
old one re-opens the path and locks again until the inode it holds is the one
the path names. Locks are taken in sorted order (two runs over overlapping
files cannot deadlock) and held from before the first read to after the last
write, so a second run reads what the first one wrote. Advisory: only
mm3-codemod takes it; ``check`` and ``preview`` never write and never wait.
Without ``fcntl`` (Windows) there is no lock.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

DEFAULT_TIMEOUT = 30.0  # seconds a run waits for another run's lock
_POLL = 0.05


class LockTimeout(Exception):
    """Another mm3-codemod held ``path`` for longer than the timeout."""

    def __init__(self, path: Path, waited: float) -> None:
        super().__init__(f"locked by another mm3-codemod (waited {waited:g} s); nothing written")
        self.path = path


@contextmanager
def locked(
    paths: Iterable[Path],
    timeout: float = DEFAULT_TIMEOUT,
    on_wait: Callable[[Path], None] | None = None,
) -> Iterator[None]:
    """Hold an exclusive lock on every file of ``paths`` that exists; ``on_wait(path)`` is
    called once for each file whose lock another run holds."""
    held: list[int] = []
    deadline = time.monotonic() + max(timeout, 0.0)
    try:
        for real in sorted({os.path.realpath(p) for p in paths}):
            fd = _lock(Path(real), deadline, timeout, on_wait)
            if fd is not None:
                held.append(fd)
        yield
    finally:
        for fd in held:
            os.close(fd)  # closing the descriptor releases its flock


def _lock(real: Path, deadline: float, timeout: float, on_wait: Callable[[Path], None] | None) -> int | None:
    """The descriptor holding the lock; None for what is no regular file
    (missing, unreadable, a folder: reading it reports why)."""
    if fcntl is None:  # pragma: no cover
        return None
    while True:
        try:
            # O_NONBLOCK: opening a FIFO must not hang; it is refused below.
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return None
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if on_wait is not None:
                        on_wait(real)
                        on_wait = None
                    if time.monotonic() >= deadline:
                        raise LockTimeout(real, timeout) from None
                    time.sleep(_POLL)
            if _same_file(fd, real):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # replaced while we waited: lock the file the path names now


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except OSError:
        return False
    return os.path.samestat(os.fstat(fd), now)
