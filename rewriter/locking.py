"""One ``run`` at a time per file: an exclusive ``flock`` on the file's own inode, at its real path.

No lock file, so none can be left behind. ``os.replace`` gives the path a new inode, so a run
that waited on the old one locks again until the inode it holds is the one the path names.
Locks are taken in sorted order (no deadlock) and held from before the first read to after the
last write. Advisory: ``check`` and ``preview`` never wait. Without ``fcntl`` (Windows), no lock.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

DEFAULT_TIMEOUT = 30.0  # seconds a run waits for another run's lock
_POLL = 0.05
OnWait = Callable[[Path], None] | None  # called with a path whose lock another run holds


class LockTimeout(Exception):
    """Another mm3-codemod held ``path`` for longer than the timeout."""

    def __init__(self, path: Path, waited: float) -> None:
        super().__init__(f"locked by another mm3-codemod (waited {waited:g} s); nothing written")
        self.path = path


@contextlib.contextmanager
def locked(paths: Iterable[Path], timeout: float = DEFAULT_TIMEOUT, on_wait: OnWait = None) -> Iterator[None]:
    """Hold an exclusive lock on every file of ``paths`` that exists; ``on_wait(path)`` is
    called once for each file whose lock another run holds."""
    deadline = time.monotonic() + max(timeout, 0.0)
    with contextlib.ExitStack() as held:
        for real in sorted({os.path.realpath(p) for p in paths}):
            if (fd := _lock(Path(real), deadline, timeout, on_wait)) is not None:
                held.callback(os.close, fd)  # closing the descriptor releases its flock
        yield


def _lock(real: Path, deadline: float, timeout: float, on_wait: OnWait) -> int | None:
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
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode):
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
            with contextlib.suppress(OSError):  # the path is gone: as replaced
                if os.path.samestat(opened, os.stat(real)):
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # replaced while we waited: lock the file the path names now
