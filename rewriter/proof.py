"""``run`` proves before it writes: ``verify``'s semantic level (``rewriter.verify.layers``) on the
new source of each file to write, bf16 cache against fp8 cache on the stand-in. A failed proof
writes nothing; a file the stand-in cannot run, or a machine without torch, is written and said to
be unproven, with the command that proves it. torch is imported here only: for a file to write, or
for a patched bypass that is not ``run``'s own (``commands.judge``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from codemods.schema import InsertSite
from rewriter.apply import FAILED, LEVEL, OFF, PASSED, SKIPPED, UNAVAILABLE, FileResult, Proof
from rewriter.apply import compile_quietly, source_text
from rewriter.targets import shown_path

NO_PROVE = Proof(OFF, "--no-prove: not run before writing")


def prove(result: FileResult) -> Proof:
    """The semantic level on ``result.new`` as ``result.path`` (``prove_source``)."""
    from rewriter.verify.layers import insert_classes

    assert result.new is not None
    return prove_source(result.path, result.new, insert_classes(result.new_sites))


# ``prove_apart``'s child: the proof of the bytes on stdin, as JSON on stdout.
_CHILD = (
    "import json, sys; from pathlib import Path; from rewriter.proof import prove_source; "
    "p = prove_source(Path(sys.argv[1]), sys.stdin.buffer.read(), sys.argv[2:]); "
    "print(json.dumps([p.status, p.reason, list(p.details)]))"
)


def prove_apart(path: Path, raw: bytes, sites: list[InsertSite]) -> Proof:
    """``prove_source`` without importing torch into this process: ``check`` and ``run`` do not
    for a file they do not write. In a child interpreter, unless torch is imported here already
    (the plugin, inside vLLM)."""
    from rewriter.verify.layers import insert_classes

    classes = insert_classes(sites)
    if "torch" in sys.modules or importlib.util.find_spec("torch") is None:
        return prove_source(path, raw, classes)
    argv = [sys.executable, "-c", _CHILD, str(path), *classes]
    child = subprocess.run(argv, input=raw, capture_output=True, timeout=600, check=False)
    try:
        status, reason, details = json.loads(child.stdout.decode(errors="replace").splitlines()[-1])
    except (ValueError, IndexError):
        last = (child.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return Proof(SKIPPED, f"the level's process stopped (exit {child.returncode}): {last}")
    return Proof(status, reason, tuple(details))


def prove_source(path: Path, raw: bytes, classes: list[str]) -> Proof:
    """The semantic level of ``classes`` in ``raw`` as ``path``, in each row ``verify`` runs (TP=1,
    then its TP sizes). Without a working torch, or where the level breaks, unproven: never a traceback."""
    if importlib.util.find_spec("torch") is None:
        return Proof(UNAVAILABLE, "torch is not installed")
    from rewriter.verify import tp
    from rewriter.verify.layers import import_torch, semantic_level
    from rewriter.verify.levels import Status

    try:
        import_torch()
    except Exception as exc:  # a broken install: as good as none
        return Proof(UNAVAILABLE, f"torch cannot be imported here: {type(exc).__name__}: {exc}")
    source = source_text(raw)  # these bytes compiled in planning: they decode
    try:  # (LibCST reads newer syntax than this Python may compile: not the file's failure)
        compile_quietly(raw, path)
    except SyntaxError as exc:
        here = f"Python {sys.version_info.major}.{sys.version_info.minor} cannot compile it"
        why = f"(line {exc.lineno}: {exc.msg}): run mm3-codemod under the Python vLLM runs on"
        return Proof(SKIPPED, f"{here} {why}")
    if not classes:  # not expected: a rewrite is of a layer class's insert call
        return Proof(SKIPPED, "no layer class with an insert site in the new source")
    try:
        rows = [semantic_level(path, classes, source, plan) for plan in tp.plans()]
    except Exception as exc:  # the level's own failure, not the file's: verify shows the traceback
        return Proof(SKIPPED, f"the level stopped: {type(exc).__name__}: {exc}")
    details = tuple(f"{row.level}: {line}" for row in rows for line in row.details)
    for status, word in ((Status.FAILED, FAILED), (Status.SKIPPED, SKIPPED)):
        first = next((row for row in rows if row.status is status), None)
        if first is not None:  # TP=1's reason, else the first TP row's (it names TP and rank)
            reason = first.reason if first is rows[0] else f"{first.level}: {first.reason}"
            return Proof(word, reason, details)
    also = " and ".join(row.level.removeprefix(LEVEL).strip() for row in rows[1:])
    return Proof(PASSED, rows[0].reason + (f"; {also} too" if also else ""), details)


def proof_line(result: FileResult, example: bool, verify: str) -> str | None:
    """What the human report says of a written file's proof: proven, or unproven and how to prove
    it (``verify``: the command that names the file; ``--example``, whose copy is gone: run again)."""
    proof = result.proof
    if proof is None or proof.status == FAILED:
        return None
    name = shown_path(result.path)
    if proof.proven:
        return f"proven: {name}: the {LEVEL} level passed before writing: {proof.reason}"
    from rewriter.verify.levels import install_torch

    if proof.status == UNAVAILABLE:
        why = f"{proof.reason}, so the new code was not run before writing"
        how = f"{install_torch()} and run it again" if example else how_to_run(proof, verify)
    elif proof.status == OFF:
        why, how = proof.reason, ("run it again without --no-prove" if example else verify)
    else:
        why = f"the {LEVEL} level cannot run it here: {proof.reason}"
        how = None if example else how_to_run(proof, verify)
    return f"unproven: {name}: {why}" + (f"; to prove it: {how}" if how else "")


def how_to_run(proof: Proof, verify: str) -> str:
    """The step that runs what ``proof`` did not, where the user stands (``verify``: the command naming the
    file): torch installed first where it is missing; else the engine level, for ``verify`` alone would
    skip it again (the kernel level runs on the same stand-in)."""
    from rewriter.verify.levels import ENGINE_STEP, install_torch

    return f"{install_torch()}, then {verify}" if proof.status == UNAVAILABLE else f"{verify} {ENGINE_STEP}"
