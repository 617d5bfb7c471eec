"""Cold-process timings of mm3-codemod, side by side with what they are judged against.

    pip install '.[test]' && python bench/run_bench.py

Every command runs as a fresh process (what pre-commit does), and all of them
run interleaved - one of each per round, the order rotated every round - for
``--reps`` rounds; the table shows medians. On a shared machine only ratios
taken in one run mean much: each goal is a ratio against the LibCST-parse
baseline of the same file measured in the same rounds.

- ``check`` on the vLLM 0.34.0 model file (native, 83 KB; the wheel is
  downloaded once into the tests' cache, ``~/.cache/mm3-codemod/wheels`` or
  ``$MM3_CODEMOD_WHEEL_CACHE``): reading the run a first ``check`` kept, and
  running it (a verdict cache emptied before each); on the bundled fork-era
  example (needs a rewrite) and on that example after ``run`` (patched);
- the baseline: ``python -c "import libcst; libcst.parse_module(src)"``;
- ``patch -p1 --dry-run`` with the seed's diff (``bench/seed.diff``) on a tree
  holding the example as its fork-era model file;
- ``run --no-prove`` on a fresh copy of the example (parse, rewrite, validate,
  diff, write), and ``run`` with its proof (the semantic level, where torch is);
- ``survey`` over 50 files (one per folder, as from 50 environments: the
  0.34.0 file, the example and the patched example in turn) with ``--jobs 1``
  and ``--jobs 2``.

The tool's modules are byte-compiled first, as ``pip install`` leaves them.
Results go to ``$XDG_CACHE_HOME/mm3-codemod/bench/results.json`` (default
``~/.cache/...``), never into the checkout unless asked: ``--json
bench/results.json`` updates the committed run docs/performance.md's table comes from;
``--markdown`` also prints that table.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_VERSION = "0.34.0"
MODEL_IN_WHEEL = "vllm/models/minimax_m3/nvidia/model.py"
BASELINE = "import sys, libcst; libcst.parse_module(open(sys.argv[1], 'rb').read())"
# A control for survey's ratio: the same fixed CPU work in a pool of 1 or 2
# processes shows how much of a second core the machine had to give.
CONTROL = (
    "import sys, multiprocessing as mp\n"
    "def work(n):\n    return sum(i * i for i in range(n))\n"
    "if __name__ == '__main__':\n"
    "    with mp.get_context('fork').Pool(int(sys.argv[1])) as pool:\n"
    "        pool.map(work, [800_000] * 16)\n"
)
# Issue 14's budgets: a native file is answered without LibCST, a patched one is read by it.
GOALS = {"check": 0.8, "check-patched": 1.6, "run": 2.0, "survey": 0.65}


@dataclass
class Measure:
    key: str
    label: str
    argv: list[str]
    expect_rc: set[int]
    cwd: Path | None = None
    before: object = None  # called (untimed) before each timed run
    samples: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # user + system seconds, all its processes
    rcs: list[int] = field(default_factory=list)
    output: str = ""

    def median(self) -> float:
        return statistics.median(self.samples)

    def stats(self) -> dict[str, object]:
        s = sorted(self.samples)
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
        return {
            "label": self.label,
            "argv": self.argv,
            "median_ms": round(1e3 * self.median(), 1),
            "p25_ms": round(1e3 * q[0], 1),
            "p75_ms": round(1e3 * q[2], 1),
            "min_ms": round(1e3 * s[0], 1),
            "samples_ms": [round(1e3 * x, 1) for x in self.samples],
            "cpu_median_ms": round(1e3 * statistics.median(self.cpu), 1),
            "exit_codes": sorted(set(self.rcs)),
        }


# --- inputs -------------------------------------------------------------------------------


def default_results() -> Path:
    """Outside the checkout: a run must not dirty the committed bench/results.json."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "mm3-codemod" / "bench" / "results.json"


def wheel_cache() -> Path:
    default = Path.home() / ".cache" / "mm3-codemod" / "wheels"
    return Path(os.environ.get("MM3_CODEMOD_WHEEL_CACHE", default))


def vllm_model_file(into: Path) -> Path:
    """The 0.34.0 wheel's NVIDIA model file (the wheel is fetched once, like the tests do)."""
    cache = wheel_cache()
    wheels = sorted(cache.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading the vllm {VLLM_VERSION} wheel into {cache} (once) ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
            + ["-d", str(cache), f"vllm=={VLLM_VERSION}"],
            check=True,
        )
        wheels = sorted(cache.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(MODEL_IN_WHEEL, into)
    return into / MODEL_IN_WHEEL


def tool_argv() -> tuple[list[str], str]:
    """The console script beside this interpreter, else ``python -m rewriter``."""
    script = Path(sys.executable).with_name("mm3-codemod")
    if script.exists():
        return [str(script)], str(script)
    found = shutil.which("mm3-codemod")
    if found:
        return [found], found
    return [sys.executable, "-m", "rewriter"], f"{sys.executable} -m rewriter"


def byte_compile() -> list[str]:
    import codemods
    import rewriter

    folders = [str(Path(p.__file__).parent) for p in (rewriter, codemods)]
    for folder in folders:
        compileall.compile_dir(folder, quiet=1)
    return folders


def has_command(tool: list[str], name: str) -> bool:
    proc = subprocess.run([*tool, name, "--help"], capture_output=True, text=True)
    return proc.returncode == 0


# --- measuring ----------------------------------------------------------------------------


def run_once(m: Measure) -> None:
    if callable(m.before):
        m.before()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(m.argv, cwd=m.cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in m.expect_rc:
        raise SystemExit(
            f"{m.label}: exit {proc.returncode}, expected {sorted(m.expect_rc)}\n{proc.stdout}{proc.stderr}"
        )
    m.samples.append(elapsed)
    m.cpu.append(now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime)
    m.rcs.append(proc.returncode)
    m.output = (proc.stdout + proc.stderr).strip()


def measure(measures: list[Measure], reps: int, warm_up: int = 1) -> None:
    for _ in range(warm_up):  # warm-up rounds, not counted (file caches)
        for m in measures:
            run_once(m)
            m.samples.clear()
            m.cpu.clear()
            m.rcs.clear()
    for r in range(reps):
        shift = r % len(measures)
        for m in measures[shift:] + measures[:shift]:
            run_once(m)
        print(f"\rround {r + 1}/{reps}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr, flush=True)


# --- report -------------------------------------------------------------------------------


def ratios(by_key: dict[str, Measure], files: int) -> list[dict[str, object]]:
    def row(what: str, key: str, base: str, goal: float | None) -> dict[str, object]:
        value = by_key[key].median() / by_key[base].median()
        return {
            "what": what,
            "measure": key,
            "baseline": base,
            "ratio": round(value, 2),
            "goal": f"<= {goal}" if goal else None,
            "met": (value <= goal) if goal else None,
        }

    survey = (
        [
            row(f"survey, {files} files: 2 jobs vs 1", "survey-2", "survey-1", GOALS["survey"]),
            row("control: fixed CPU work, 2 processes vs 1", "control-2", "control-1", None),
        ]
        if "survey-1" in by_key
        else []
    )
    return [
        row(
            "check, native (vLLM 0.34.0), its kept run read", "check-native", "libcst-native", GOALS["check"]
        ),
        row("check, native, run (no kept run)", "check-native-first", "libcst-native", None),
        row("check, patched (example after run)", "check-patched", "libcst-patched", GOALS["check-patched"]),
        row("check, needs-bypass (example)", "check-example", "libcst-example", None),
        row("run --no-prove, example -> temp copy", "run-example", "libcst-example", GOALS["run"]),
        row("run, example -> temp copy, proved", "run-proved", "libcst-example", None),
        row("patch -p1 --dry-run, seed diff", "patch-seed", "libcst-example", None),
        *survey,
    ]


def markdown(result: dict) -> str:
    """docs/performance.md's table, from a results JSON (so the page can be checked against it)."""
    sizes, measures = result["file_sizes"], result["measures"]

    def kb(name: str) -> str:
        return f"{sizes[name] / 1000:.1f} KB"

    files = {
        "check-native": f"vLLM {VLLM_VERSION} `model.py` (native, {kb('native')})",
        "check-native-first": "the same",
        "run-proved": "bundled example, temp copy",
        "check-patched": f"example after `run` (patched, {kb('patched')})",
        "check-example": f"bundled example (needs-bypass, {kb('example')})",
        "run-example": "bundled example, temp copy",
        "patch-seed": "bundled example as the fork-era file",
        "survey-2": f"{result['survey_files']} files (native, needs-bypass, patched in turn)",
        "control-2": "(how much of a second core the machine gave)",
    }
    labels = {
        "check-native": "`check`, its kept run read",
        "check-native-first": "`check`, run first (no kept run)",
        "run-proved": "`run`, its proof included (the semantic level)",
        "check-patched": "`check`",
        "check-example": "`check` (LibCST path)",
        "run-example": "`run --no-prove` (parse, rewrite, validate, diff, write)",
        "patch-seed": "`patch -p1 --dry-run` with the seed's diff",
        "survey-2": "`survey --jobs 2` (baseline: `--jobs 1`)",
        "control-2": "control: a CPU-bound pool of 2 (baseline: of 1)",
    }
    lines = [
        "| measurement (cold process) | file | median | baseline | ratio | goal |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in result["ratios"]:
        key, base = row["measure"], row["baseline"]
        verdict = f"{row['goal']} {'met' if row['met'] else 'MISSED'}" if row["goal"] else "-"
        lines.append(
            f"| {labels[key]} | {files[key]} | {measures[key]['median_ms']:.0f} ms "
            f"| {measures[base]['median_ms']:.0f} ms | {row['ratio']:.2f}x | {verdict} |"
        )
    return "\n".join(lines)


def print_table(by_key: dict[str, Measure], rows: list[dict[str, object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mm3-codemod, cold processes (medians)")
    for column in ("measurement", "median", "p25-p75", "baseline", "ratio", "goal"):
        table.add_column(column, justify="right" if column not in ("measurement", "goal") else "left")
    for row in rows:
        m, base = by_key[str(row["measure"])], by_key[str(row["baseline"])]
        s = m.stats()
        goal = row["goal"]
        verdict = f"{goal} {'met' if row['met'] else 'MISSED'}" if goal else "-"
        table.add_row(
            str(row["what"]),
            f"{s['median_ms']:.0f} ms",
            f"{s['p25_ms']:.0f}-{s['p75_ms']:.0f}",
            f"{1e3 * base.median():.0f} ms",
            f"{row['ratio']:.2f}x",
            verdict,
        )
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument(
        "--json",
        type=Path,
        default=default_results(),
        help="where the results go (default: %(default)s; bench/results.json is the committed run)",
    )
    parser.add_argument("--markdown", action="store_true", help="also print docs/performance.md's table")
    parser.add_argument("--survey-files", type=int, default=50, help="files for survey (default 50)")
    parser.add_argument(
        "--warm-up", type=int, default=1, help="uncounted rounds first (default 1; the tests use 0)"
    )
    args = parser.parse_args()

    from rewriter.targets import example_path

    tool, tool_shown = tool_argv()
    compiled = byte_compile()
    work = Path(tempfile.mkdtemp(prefix="mm3-codemod-bench-"))
    try:
        native = vllm_model_file(work / "wheel")
        example = work / "example" / "model.py"
        example.parent.mkdir()
        shutil.copyfile(example_path(), example)
        patched = work / "patched" / "model.py"
        patched.parent.mkdir()
        shutil.copyfile(example_path(), patched)
        subprocess.run([*tool, "run", str(patched)], check=True, capture_output=True)
        tree = work / "fork"
        (tree / MODEL_IN_WHEEL).parent.mkdir(parents=True)
        shutil.copyfile(example_path(), tree / MODEL_IN_WHEEL)
        copy = work / "run" / "model.py"
        copy.parent.mkdir()
        sizes = {
            name: f.stat().st_size
            for name, f in (("native", native), ("example", example), ("patched", patched))
        }

        def fresh_copy() -> None:
            shutil.copyfile(example, copy)

        def base(f: Path) -> list[str]:
            return [sys.executable, "-c", BASELINE, str(f)]

        first = work / "served-first"  # a verdict cache of its own, emptied before each run

        def no_kept_run() -> None:
            shutil.rmtree(first, ignore_errors=True)

        measures = [
            Measure("check-native", "check native", [*tool, "check", str(native)], {0}),
            Measure(
                "check-native-first",
                "check native, no kept run",
                ["env", f"MM3_CODEMOD_SERVE_CACHE={first}", *tool, "check", str(native)],
                {0},
                before=no_kept_run,
            ),
            Measure("libcst-native", "libcst parse native", base(native), {0}),
            Measure("check-patched", "check patched", [*tool, "check", str(patched)], {0}),
            Measure("libcst-patched", "libcst parse patched", base(patched), {0}),
            Measure("check-example", "check example", [*tool, "check", str(example)], {1}),
            Measure("libcst-example", "libcst parse example", base(example), {0}),
            Measure(
                "run-example",
                "run --no-prove example",
                [*tool, "run", "--no-prove", str(copy)],
                {0},
                before=fresh_copy,
            ),
            Measure("run-proved", "run example (proved)", [*tool, "run", str(copy)], {0}, before=fresh_copy),
            Measure(
                "patch-seed",
                "patch --dry-run seed",
                ["patch", "-p1", "--dry-run", "-i", str(HERE / "seed.diff")],
                {0, 1},
                cwd=tree,
            ),
        ]
        survey = has_command(tool, "survey")
        if survey:
            many = work / "survey"
            cycle = [native, example, patched]
            for i in range(args.survey_files):
                (many / f"env{i:02d}").mkdir(parents=True)
                shutil.copyfile(cycle[i % 3], many / f"env{i:02d}" / "model.py")
            for jobs in (1, 2):
                measures.append(
                    Measure(
                        f"survey-{jobs}",
                        f"survey {jobs} job(s)",
                        [*tool, "survey", "--jobs", str(jobs), str(many)],
                        {1},
                    )
                )
                measures.append(
                    Measure(
                        f"control-{jobs}",
                        f"control {jobs} process(es)",
                        [sys.executable, "-c", CONTROL, str(jobs)],
                        {0},
                    )
                )
        load_before = os.getloadavg()
        measure(measures, args.reps, args.warm_up)
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    by_key = {m.key: m for m in measures}
    rows = ratios(by_key, args.survey_files)
    print_table(by_key, rows)
    patch = by_key["patch-seed"]
    print(f"patch(1) said (exit {patch.rcs[-1]}):\n  " + patch.output.replace("\n", "\n  "))
    if not survey:
        print("survey: not in this version of mm3-codemod; its rows are left out")
    else:
        cpu = {
            k: by_key[k].stats()["cpu_median_ms"] for k in ("survey-1", "survey-2", "control-1", "control-2")
        }
        print(
            f"CPU time (all processes, median): survey {cpu['survey-1']:.0f} ms with 1 job, "
            f"{cpu['survey-2']:.0f} ms with 2; control {cpu['control-1']:.0f} / {cpu['control-2']:.0f} ms"
        )

    from rewriter import __version__

    result = {
        "tool": "mm3-codemod",
        "version": __version__,
        "command": " ".join(["python", "bench/run_bench.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "libcst": metadata.version("libcst"),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
        },
        "tool_command": tool_shown,
        "byte_compiled": compiled,
        "reps": args.reps,
        "file_sizes": sizes,
        "survey_files": args.survey_files,
        "measures": {m.key: m.stats() for m in measures},
        "ratios": rows,
        "patch_output": patch.output,
        "survey": "not available in this version" if not survey else "available but not measured",
        "gpu": None,  # bypass vs fused bf16 insert: filled in by the verify issue
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {args.json}")
    if args.markdown:
        print()
        print(markdown(result))


if __name__ == "__main__":
    main()
