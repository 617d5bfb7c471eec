"""The level types every verify level returns, below both the package face and the levels.

:mod:`rewriter.verify` (the face) runs the levels and re-exports these names;
a level module (:mod:`rewriter.verify.engine`, say) imports them from here, so
no level imports the face that imports it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass
class LevelResult:
    level: str
    status: Status
    reason: str
    details: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "level": self.level,
            "status": self.status.value,
            "reason": self.reason,
            "details": self.details,
        }


# The levels that run the file's code; a file is verified only where one of them passed
# (the import level shows that the module loads, not what its cache write does).
BEHAVIOUR = ("semantic", "kernel", "engine")
CPU_TORCH = "https://download.pytorch.org/whl/cpu"
# What runs a file the stand-in cannot (the kernel level runs on the same stand-in): appended
# to the verify command that named the file.
ENGINE_STEP = "--engine (with a CUDA GPU and vLLM: the engine level runs the file in vLLM itself)"


def behaviour(level: LevelResult) -> bool:
    """Whether ``level`` (``semantic TP=2`` too) runs the file's code."""
    return level.level.split(" ")[0] in BEHAVIOUR


def install_torch() -> str:
    """The one command that makes torch importable where ``mm3-codemod`` runs: pip of this
    very interpreter, torch by its own name, the CPU build (enough for the semantic level,
    and no CUDA download). Never this tool's name: it is not on PyPI, so a name there
    would be someone else's (dependency confusion)."""
    import shlex
    import sys

    return f"{shlex.quote(sys.executable or 'python3')} -m pip install torch --index-url {CPU_TORCH}"
