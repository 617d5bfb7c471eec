"""``survey``: every target's vLLM release, sites, states and what ``run`` would do, planned as
``check`` plans them, in a process pool when there are several jobs; vllm and torch are never imported."""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from rewriter.apply import FileResult, FileStatus
from rewriter.commands import Report, check_plan
from rewriter.targets import Target

# Chunks per worker: enough to balance uneven files, few enough to keep per-task overhead small.
CHUNKS_PER_JOB = 4


def survey_file(path: Path) -> FileResult:
    """``check``'s plan of one file, stripped to what the report shows."""
    result = check_plan(path)
    return dataclasses.replace(result, diff="", original=b"", new=None)


def survey_targets(
    targets: list[Target], jobs: int | None = None, advance: Callable[[], None] | None = None,
    no_vllm: Mapping[str, str] | None = None,
) -> Report:
    """Plan every target (nothing is written); ``advance`` is called after each file. Each
    interpreter in ``no_vllm`` (-> why) is one more entry, ``no-vllm``, named by its path."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    jobs = max(1, min(jobs or cpus, len(targets) or 1))
    paths = [t.path for t in targets]
    tick = advance or (lambda: None)
    files: list[FileResult] = []
    if jobs == 1:
        for path in paths:
            files.append(survey_file(path))
            tick()
    else:
        chunksize = max(1, math.ceil(len(paths) / (jobs * CHUNKS_PER_JOB)))
        # LibCST and the codemod, imported once before the fork rather than in each worker.
        import codemods.analysis  # noqa: F401

        context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)
        # Ctrl-C reaches the workers too: the parent alone answers it (and ends the pool).
        leave_interrupt_to_parent = functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN)
        with context.Pool(jobs, initializer=leave_interrupt_to_parent) as pool:
            for result in pool.imap(survey_file, paths, chunksize):
                files.append(result)
                tick()
    environments = (no_vllm or {}).items()
    targets = [*targets, *(Target(Path(python), f"--python {python}") for python, _ in environments)]
    files += [FileResult(Path(python), FileStatus.NO_VLLM, error=why) for python, why in environments]
    return Report("survey", targets, files)
