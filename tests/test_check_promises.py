"""``check`` promises what ``run`` does: a plan that leaves a native call ("then run with
--kv-cache-dtype fp8 directly") is run before it is promised, as ``run`` runs it before writing."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, cli

STALE = (FIXTURES / "native_stale_bypass" / "model.py").read_text()
RETURN = "        return self.attend(q, index_q)\n"


def test_a_strip_that_run_would_refuse_is_refused_by_check_too(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = tmp_path / "model.py"
    path.write_text(STALE)
    proc = cli("check", str(path))
    assert (
        proc.returncode == 1 and "-> strip" in proc.stderr and "what `run` leaves was run: " in proc.stderr
    ), proc.stderr
    assert STALE.count(RETURN) == 1
    broken = STALE.replace(RETURN, "        q = q.view(-1, 7, 5)\n" + RETURN)  # (fails with any cache)
    path.write_text(broken)
    checked = cli("check", str(path))
    ran = cli("run", str(path))
    assert checked.returncode == ran.returncode == 2, (checked.stderr, ran.stderr)
    for proc in (checked, ran):
        assert "the rewrite failed its proof (semantic level): " in proc.stderr, proc.stderr
    assert path.read_text() == broken


def test_a_strip_is_not_called_run_without_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from rewriter import commands
    from rewriter.targets import Target

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    path = tmp_path / "model.py"
    path.write_text(STALE)
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    (site,) = [s for s in result.sites if s.action.value == "strip"]
    assert result.status.value == "needs-rewrite"
    assert "; what `run` leaves was not run here: torch is not installed" in site.reason
