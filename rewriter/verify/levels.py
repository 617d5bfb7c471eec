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
