"""The verdict the plugin reads (rewriter/verdicts.py) and check's lazy judgement, without vLLM:
`run` and `check` leave their verdict on the bytes they wrote or found patched; the plugin's
check judges a file the pre-filter cannot answer only when a layer is built for fp8, and a
failure of that judgement never stops vLLM. tests/test_plugin.py runs the same through
vLLM's own plugin loader (slow)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT

from mm3_codemod import plugin
from rewriter import commands
from rewriter.targets import Target
from rewriter.verdicts import Verdict


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("MM3_CODEMOD_SERVE_CACHE", str(folder))
    return folder


def test_run_leaves_the_verdict_on_the_bytes_it_wrote(tmp_path: Path, cache: Path) -> None:
    target = tmp_path / "model.py"
    shutil.copyfile(FIXTURES / "fork_era" / "model.py", target)
    assert Verdict.load(target, target.read_bytes()) is None
    commands.write_targets("run", [Target(target, "test")], dry_run=True)
    assert not cache.exists()  # a dry run wrote nothing, and keeps no verdict
    commands.write_targets("run", [Target(target, "test")], prove=False)
    verdict = Verdict.load(target, target.read_bytes())
    assert verdict is not None and verdict.fine and verdict.states == "patched"
    assert Verdict.load(target, (FIXTURES / "fork_era" / "model.py").read_bytes()) is None


def test_check_leaves_one_on_a_patched_or_native_file_only(tmp_path: Path, cache: Path) -> None:
    pytest.importorskip("torch")  # (a native call is run; not run here, its verdict is not kept)
    for name in ("patched", "fork_era", "native"):
        target = tmp_path / f"{name}.py"
        shutil.copyfile(FIXTURES / name / "model.py", target)
        commands.analyze_targets("check", [Target(target, "test")])
    kept = {p.name.split("-")[0] for p in cache.glob("*.json")}
    assert kept == {"patched", "native"}  # fork_era needs work


def test_check_keeps_no_verdict_it_did_not_run(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch a native call is not run: the plugin, inside vLLM, runs it rather than read ``native``."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    target = tmp_path / "native.py"
    shutil.copyfile(FIXTURES / "native" / "model.py", target)
    commands.analyze_targets("check", [Target(target, "test")])
    assert not cache.exists() or not list(cache.glob("*.json"))


LAZY = """
import sys
from pathlib import Path
from mm3_codemod import plugin
stop = plugin.ModelHook("check").judge(Path(sys.argv[1]))
print(type(stop).__name__, stop.later is not None, "libcst" in sys.modules)
judged = stop.settled()
print(judged.line if judged else None)
print("libcst" in sys.modules)
"""


def test_check_judges_only_when_an_fp8_layer_is_built(tmp_path: Path, cache: Path) -> None:
    """At import: the pre-filter alone (no LibCST) and a stop armed in every class; the first
    fp8 layer judges the file, once."""
    proc = subprocess.run(
        [sys.executable, "-c", LAZY, str(FIXTURES / "fork_era" / "model.py")],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    at_import, line, after = proc.stdout.splitlines()
    assert at_import == "Stop True False"
    assert "needs-bypass at line" in line and "fix: " in line
    assert after == "True"


def test_a_failing_judgement_never_stops_vllm(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self, path, raw, verdict=None, started=0.0):
        raise RuntimeError("a bug of the tool")

    monkeypatch.setattr(plugin.ModelHook, "decided", broken)
    stop = plugin.ModelHook("check").judge(FIXTURES / "fork_era" / "model.py")
    assert isinstance(stop, plugin.Stop) and stop.later is not None
    with caplog.at_level(logging.WARNING, logger=plugin.logger.name):
        assert stop.settled() is None  # the layer is built as it is
    assert "not checked (RuntimeError: a bug of the tool); imported as it is" in caplog.text
    assert stop.settled() is None  # judged once


def test_a_native_file_is_run_at_its_first_fp8_layer_and_its_verdict_kept(cache: Path) -> None:
    """A native call is run as check runs it, when a layer is built for fp8 (it had been answered at import, by its
    shape); the next start reads the verdict."""
    pytest.importorskip("torch")
    stop = plugin.ModelHook("check").judge(FIXTURES / "native" / "model.py")
    assert isinstance(stop, plugin.Stop) and stop.later is not None
    assert stop.settled() is None
    assert plugin.ModelHook("check").judge(FIXTURES / "native" / "model.py") is None
    assert len(list(cache.glob("*.json"))) == 1


def test_an_fp8_start_stops_on_a_wired_bypass_whose_write_fails_when_run(tmp_path: Path, cache: Path) -> None:
    """The plugin judges as check does: a patched bypass that is not run's own is run (the
    semantic level), and one whose fp8 write swaps the key and value caches stops the start, naming
    why; the verdict it keeps stops the next start without running it again."""
    source = (FIXTURES / "fork_era" / "expected.py").read_text()
    old = "            key_cache,\n            value_cache,\n"
    assert source.count(old) == 1
    target = tmp_path / "model.py"
    target.write_text(source.replace(old, "            value_cache,\n            key_cache,\n"))
    stop = plugin.ModelHook("check").judge(target)
    assert isinstance(stop, plugin.Stop) and stop.later is not None
    judged = stop.settled()
    assert isinstance(judged, plugin.Stop) and "running it fails" in judged.line, judged
    again = plugin.ModelHook("check").judge(target)
    assert isinstance(again, plugin.Stop) and again.later is None and "running it fails" in again.line


def test_the_proof_inside_vllm_runs_on_torchs_plain_defaults(tmp_path: Path, cache: Path) -> None:
    """vLLM builds layers under its model dtype and device: the proof of a bypass that is not
    run's own runs as in a fresh interpreter, and vLLM's defaults are back afterwards."""
    torch = pytest.importorskip("torch")
    torch.set_default_dtype(torch.bfloat16)
    try:
        with plugin.plain_torch():
            assert torch.get_default_dtype() is torch.float32 and torch.empty(1).device.type == "cpu"
        assert torch.get_default_dtype() is torch.bfloat16
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_right_bypass_that_is_not_runs_own_starts_under_vllms_defaults(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    source = (FIXTURES / "fork_era" / "expected.py").read_text()
    k_slice = "            k = qkv[:, k0 : k0 + kv]\n"
    assert source.count(k_slice) == 1
    target = tmp_path / "model.py"
    target.write_text(source.replace(k_slice, "            # the key's columns\n" + k_slice))
    from rewriter import proof

    proofs = []
    real = proof.prove_source
    monkeypatch.setattr(proof, "prove_source", lambda *a: proofs.append(real(*a)) or proofs[-1])
    stop = plugin.ModelHook("check").judge(target)
    torch.set_default_dtype(torch.bfloat16)  # as vLLM has it while it builds the layers,
    try:
        with torch.device("meta"):  # on its device (meta here: no tensor of the stand-in's runs there)
            assert isinstance(stop, plugin.Stop) and stop.settled() is None  # the start goes on
    finally:
        torch.set_default_dtype(torch.float32)
    assert [p.status for p in proofs] == ["passed"], proofs
    verdict = Verdict.load(target, target.read_bytes())
    assert verdict is not None and verdict.fine


def test_check_runs_the_same_bytes_once(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the semantic level passed is kept with the verdict of those bytes (and this version): ``check`` reads it,
    word for word, instead of running them again; other bytes are run."""
    pytest.importorskip("torch")
    from rewriter import proof as proofs

    target = tmp_path / "native.py"
    shutil.copyfile(FIXTURES / "native" / "model.py", target)

    def proof() -> tuple[str, tuple[str, ...]]:
        (result,) = commands.analyze_targets("check", [Target(target, "test")]).files
        assert result.proof is not None and result.proof.proven, result.proof
        return result.proof.reason, result.proof.details

    first = proof()
    prove = proofs.prove_apart
    monkeypatch.setattr(proofs, "prove_apart", lambda *a: pytest.fail("the same bytes were run again"))
    assert proof() == first and first[1]
    target.write_text(target.read_text() + "# another byte\n")
    monkeypatch.setattr(proofs, "prove_apart", prove)
    assert proof() == first  # (run again: the same answer)
