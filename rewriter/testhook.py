"""Fault injection for the test suite only: ``MM3_CODEMOD_TEST_HOOK=POINT=ACTION[,POINT=ACTION…]``
stops, kills or fails a real ``mm3-codemod`` at one moment of a write; unset, ``at()`` does nothing.

points (in the order ``run`` reaches them, per file for the write points):
    locked        every target's lock is held, nothing read yet
    planned       every target read and analysed, nothing written
    temp-created  the temporary file exists beside the target, still empty
    temp-written  the new bytes are in it, not yet fsynced
    temp-synced   fsynced and given the original mode, not yet moved over the target
    replaced      moved over the target with ``os.replace``, folder not yet fsynced
actions:
    stop          SIGSTOP this process (the test continues or kills it)
    kill          SIGKILL this process
    error:ENAME   raise ``OSError(errno.ENAME)`` here, e.g. ``error:ENOSPC``
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "MM3_CODEMOD_TEST_HOOK"
POINTS = ("locked", "planned", "temp-created", "temp-written", "temp-synced", "replaced")


def at(point: str) -> None:
    """Do what the test hook asks at ``point``; nothing when it is unset."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    assert point in POINTS, point
    for item in spec.split(","):
        where, _, action = item.strip().partition("=")
        if where != point:
            continue
        if action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action.startswith("error:"):
            code = getattr(errno, action.removeprefix("error:"))
            raise OSError(code, os.strerror(code))
        else:
            raise ValueError(f"{ENV}: unknown action {action!r} at {point!r}")
