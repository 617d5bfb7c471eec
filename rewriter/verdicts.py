"""What the analysis said of one model file's bytes, kept in the user's cache: the vLLM plugin
(``mm3_codemod.plugin``) reads it instead of analysing the same bytes again, in every process of
every start; ``run`` and ``check`` leave one for each file ``run`` writes or either finds native or
patched, so that the first fp8 start after them does not pay for the analysis.
Standard library only: the plugin imports it in every vLLM process."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rewriter.apply import FileResult

FINE = ("native", "patched")  # the states an fp8 start needs (check's words)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("MM3_CODEMOD_SERVE_CACHE") or os.path.join(base, "mm3-codemod", "served"))


def atomic_write(path: Path, data: bytes) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(temp, 0o644)  # readable where the cache is shared (a docker image's)
    os.replace(temp, path)


class Verdict:
    """The facts of one file's bytes (and the tool's version), under their digest."""

    def __init__(self, path: Path, key: str, facts: dict) -> None:
        self.path, self.key, self.facts = path, key, facts
        self.fine: bool = facts["fine"]
        self.states: str = facts["states"]
        self.classes: tuple[str, ...] = tuple(facts["classes"])
        self.refusal: str | None = facts["refusal"]
        # [reason, details] of the semantic level where it passed; where it reported it cannot run them
        self.proven: list | None = facts.get("proven")
        self.skipped: list | None = facts.get("skipped")

    @staticmethod
    def key_of(raw: bytes) -> str:
        from rewriter import __version__

        return hashlib.sha256(__version__.encode() + b"\0" + raw).hexdigest()[:32]

    @classmethod
    def load(cls, path: Path, raw: bytes) -> Verdict | None:
        key = cls.key_of(raw)
        try:
            return cls(path, key, json.loads((cache_dir() / f"{path.stem}-{key}.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def of(cls, result: FileResult, raw: bytes | None = None, keep: bool = True) -> Verdict:
        """The verdict of a ``classify_file`` / ``plan_file`` result on the bytes it read; with
        ``raw``, of ``run``'s new bytes (``result.new_sites``: what its second pass found).
        Kept in the cache unless ``keep`` is False (the pre-filter's answer: as quick again)."""
        from rewriter.apply import FileStatus

        sites = result.sites if raw is None else result.new_sites
        fine = raw is not None or result.status in (FileStatus.NO_SITES, FileStatus.UNCHANGED)
        work = [s for s in sites if s.state.value not in (*FINE, "not-a-site")]
        if fine:
            states = ", ".join(sorted({s.state.value for s in sites if s.state.value in FINE}))
        else:
            states = ", ".join(f"{s.state.value} at line {s.line}" for s in work) or "unreadable"
        refused = result.status is not FileStatus.NEEDS_REWRITE
        proof = result.proof if raw is None and result.proof is not None and result.proof.proven else None
        skip = result.proof if raw is None and kept_skip(result) else None
        facts = {
            "installed": str(result.path),
            "fine": fine,
            "states": states,
            # the layer classes to arm; none where a site is outside a class (then: all)
            "classes": sorted({s.class_name for s in work}) if all(s.class_name for s in work) else [],
            "refusal": None if fine or not refused else (work[0].reason if work else result.error),
            "proven": [proof.reason, list(proof.details)] if proof is not None else None,
            "skipped": [skip.reason, list(skip.details)] if skip is not None else None,  # type: ignore[union-attr]
        }
        verdict = cls(result.path, cls.key_of(result.original if raw is None else raw), facts)
        if keep:
            verdict.save()
        return verdict

    def save(self) -> None:
        with contextlib.suppress(OSError):  # a read-only home: every start analyses again
            cache_dir().mkdir(parents=True, exist_ok=True)
            atomic_write(cache_dir() / f"{self.path.stem}-{self.key}.json", json.dumps(self.facts).encode())


def remember(result: FileResult) -> None:
    """The word of ``run`` on a file it wrote (its new bytes, proven and checked by a second
    pass), or of ``run`` and ``check`` on a file they found native or patched, for the plugin to read."""
    from rewriter.apply import FileStatus

    if result.status is FileStatus.REWRITTEN and result.new is not None:
        Verdict.of(result, result.new)
    elif result.status is FileStatus.UNCHANGED and any(s.state.value in FINE for s in result.sites) and (
        # (no torch: the plugin runs it, where torch is)
        result.proof is None or result.proof.proven or kept_skip(result)
    ):
        Verdict.of(result)


def kept_skip(result: FileResult) -> bool:
    """A proof the semantic level skipped itself, reporting its rows (the stand-in cannot model the file):
    a fact of these bytes and this version, kept. Not a skip of its process (it stopped, torch is missing
    or broken)."""
    from rewriter.apply import SKIPPED

    return result.proof is not None and result.proof.status == SKIPPED and bool(result.proof.details)
