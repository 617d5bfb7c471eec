"""``check`` promises what ``run`` does: a plan that leaves a native call ("then run with
--kv-cache-dtype fp8 directly") is run before it is promised, as ``run`` runs it before writing."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, cli

from rewriter.verify.levels import ENGINE_STEP

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
    dry = cli("run", "--dry-run", str(path))  # "as check"
    ran = cli("run", str(path))
    assert checked.returncode == dry.returncode == ran.returncode == 2, (checked.stderr, dry.stderr, ran.stderr)
    for proc in (checked, dry, ran):
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


NATIVE = (FIXTURES / "native" / "model.py").read_text()
# a statement of __init__ the stand-in does not run (its projection has no quant_method), read by forward
UNMODELLED = [
    ("        self.kv_cache = torch.tensor([])\n",
     "        self.kv_cache = torch.tensor([])\n        self.epilogue = self.qkv_proj.quant_method is None\n"),
    ("        qkv, _ = self.qkv_proj(hidden_states)\n        num_tokens",
     "        qkv, _ = self.qkv_proj(hidden_states)\n        assert not self.epilogue\n        num_tokens"),
]


def _checked_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: Path) -> tuple[str, str]:
    """The reason ``check`` gives the native site, run; then read from what the first kept (running it fails)."""
    from rewriter import commands, proof
    from rewriter.targets import Target

    monkeypatch.setenv("MM3_CODEMOD_SERVE_CACHE", str(tmp_path / "served"))
    reasons = []
    for _ in range(2):
        (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
        reasons += [s.reason for s in result.sites if s.class_name == "MiniMaxM3SparseAttention"]
        monkeypatch.setattr(proof, "prove_apart", lambda *a: pytest.fail("run again"))
    return reasons[0], reasons[1]


def test_what_the_stand_in_cannot_run_is_kept_and_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from test_hunt47 import _edited

    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, UNMODELLED))
    first, second = _checked_twice(tmp_path, monkeypatch, path)
    assert "; it was not run here: " in first and "the stand-in" in first and second == first
    # `verify` alone runs the same stand-in and would skip it again: the engine level is the step
    assert first.endswith(f"; to run it: mm3-codemod verify {path} {ENGINE_STEP}"), first


def test_an_isinstance_of_an_unmodelled_class_is_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.34's forward asks ``isinstance(hidden_states, QuantizedActivation)``: the stand-in hands it a tensor,
    which is no such thing (it was a gap: "not modelled by the stand-in", and the file was not run)."""
    pytest.importorskip("torch")
    from test_hunt47 import _edited

    path = tmp_path / "model.py"
    source = _edited(NATIVE, [
        ("from vllm import _custom_ops as ops\n", "from vllm import _custom_ops as ops\nfrom vllm.quant import QuantizedActivation\n"),
        ("        qkv, _ = self.qkv_proj(hidden_states)\n        num_tokens",
         "        if isinstance(hidden_states, QuantizedActivation):\n            raise ValueError\n"
         "        qkv, _ = self.qkv_proj(hidden_states)\n        num_tokens"),
    ])
    path.write_text(source)
    first, _ = _checked_twice(tmp_path, monkeypatch, path)
    assert "; it was run: " in first, first
