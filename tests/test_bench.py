"""bench/run_bench.py runs from a checkout, and docs/performance.md shows a real run of it.

No timing is asserted here: the goals are judged by the bench itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

BENCH = ROOT / "bench" / "run_bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("run_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_readme_table_is_the_committed_run() -> None:
    result = json.loads((ROOT / "bench" / "results.json").read_text())
    table = load_bench().markdown(result)
    assert table in (ROOT / "docs" / "performance.md").read_text()
    assert result["reps"] >= 10 and result["survey_files"] == 50


def test_bench_runs_and_writes_every_row(tmp_path: Path) -> None:
    """Asked nothing, it writes its results into the user's cache, not the checkout. One
    round and no warm-up round: every measure still runs (and its exit code is checked)."""
    committed = (ROOT / "bench" / "results.json").read_bytes()
    before = sorted(p.name for p in (ROOT / "bench").iterdir())
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--reps", "1", "--warm-up", "0", "--survey-files", "4"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "mm3-codemod" / "bench" / "results.json"
    assert f"results: {out}" in proc.stdout
    assert (ROOT / "bench" / "results.json").read_bytes() == committed
    assert sorted(p.name for p in (ROOT / "bench").iterdir()) == before
    result = json.loads(out.read_text())
    assert set(result["measures"]) == {
        "check-native",
        "check-native-first",
        "libcst-native",
        "check-patched",
        "libcst-patched",
        "check-example",
        "libcst-example",
        "run-example",
        "run-proved",
        "patch-seed",
        "survey-1",
        "survey-2",
        "control-1",
        "control-2",
    }
    goals = {r["measure"]: r["goal"] for r in result["ratios"]}
    assert goals["check-native"] == "<= 0.8" and goals["check-patched"] == "<= 1.6"
    assert goals["run-example"] == "<= 2.0" and goals["survey-2"] == "<= 0.65"
    assert "Hunk #1" in result["patch_output"]  # what patch(1) said is kept
    assert "check, native" in proc.stdout  # the table


def test_kv_forms_checks_every_candidate_form_on_the_cpu() -> None:
    """bench/kv_forms.py's correctness checks (padded tokens included) with the reference ops."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kv_forms.py"), "--reference", "--tokens", "16,32"],
        capture_output=True,
        text=True,
        # Tiny tensors: torch's thread pool only spins (20 s instead of 2 on a busy 2-core
        # machine); the checks compare exact bytes, which no thread count changes.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = [line for line in proc.stdout.splitlines() if " check " in line]
    assert len(checks) == 4 and all("main cache exact, index cache exact" in line for line in checks)
    assert "saturation: reshape fp8 stores 0x7e / 0xfe" in proc.stdout
    assert "% denormal)" in proc.stdout
