"""The vLLM plugin (``mm3_codemod.plugin``), loaded by vLLM's own plugin loader from the real
vLLM 0.24.0 wheel's Python files, in front of the import of a MiniMax-M3 model file in each
state (tests/plugin_harness.py is one start; its docstring says what a CPU stands in for)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from test_real_wheels import vllm_wheel

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "plugin_harness.py"
FIXTURES = ROOT / "fixtures"
NEEDS_BYPASS = FIXTURES / "no_insert_kv" / "model.py"  # the layer: SparseAttentionLayer
PATCHED = FIXTURES / "no_insert_kv" / "expected.py"  # `run`'s rewrite of it
OUTDATED = "outdated"  # made from PATCHED by `outdated()`
HALF_APPLIED = FIXTURES / "half_native" / "model.py"
NATIVE = FIXTURES / "native" / "model.py"
REFUSED = FIXTURES / "two_candidates" / "model.py"
LAYER = "SparseAttentionLayer"

pytestmark = pytest.mark.skipif(
    not any(ep.value.startswith("mm3_codemod.plugin:") for ep in entry_points(group="vllm.general_plugins")),
    reason="mm3-codemod's vllm.general_plugins entry points are not installed (pip install -e .)",
)


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory) -> Path:
    """The Python files of the vLLM 0.24.0 wheel (its kernel libraries left out)."""
    root = tmp_path_factory.mktemp("vllm024")
    with zipfile.ZipFile(vllm_wheel("0.24.0")) as wheel:
        wheel.extractall(root, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    return root


def outdated() -> bytes:
    """`run`'s rewrite of the needs-bypass layer with an older bypass's index write instead of
    its own: the keys scattered by slot, slot -1 included (``outdated``)."""
    text = PATCHED.read_text()
    start, end = text.index("        # Index-key cache: one head per token"), text.index("    def forward")
    scatter = (
        "        idx_cache = self.indexer.index_cache.kv_cache.view(-1, self.index_dim)\n"
        "        idx_cache[index_slot_mapping] = index_key.to(idx_cache.dtype)\n\n"
    )
    return (text[:start] + scatter + text[end:]).encode()


def install(vllm_python: Path, tmp_path: Path, model: Path | str) -> Path:
    """A vLLM tree (hard links to the wheel's files) whose MiniMax-M3 package holds ``model``
    as ``nvidia/model.py``; the package's own ``__init__`` (it imports every submodule) is
    replaced by an empty one."""
    tree = tmp_path / "site"
    shutil.copytree(vllm_python, tree, copy_function=os.link)
    package = tree / "vllm" / "models" / "minimax_m3"
    shutil.rmtree(package)
    (package / "nvidia").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nvidia" / "__init__.py").write_text("")
    (package / "nvidia" / "model.py").write_bytes(outdated() if model == OUTDATED else model.read_bytes())
    return tree


def start(tree: Path, dtype: str, layer: str = LAYER, **env: str) -> tuple[dict, list[str]]:
    """One start: the harness's facts, and the lines it logged that name mm3-codemod."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MM3_CODEMOD_PLUGIN", "VLLM_PLUGINS")}
    environ.update(MM3_CODEMOD_SERVE_CACHE=str(tree.parent / "served"), **env)
    environ["TORCHINDUCTOR_CACHE_DIR"] = str(tree.parent / "inductor")  # vLLM's import makes it
    proc = subprocess.run(
        [sys.executable, str(HARNESS), str(tree), dtype, layer],
        capture_output=True, text=True, env=environ, cwd=tree.parent, timeout=300,
    )
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and out, proc.stderr[-3000:]
    logged = [line for line in (proc.stdout + proc.stderr).splitlines() if "mm3-codemod:" in line]
    return json.loads(out[-1]), [line for line in logged if not line.startswith("{")]


LATER = "not judged (it is when a layer is built for an fp8 KV cache)"


def model_of(tree: Path) -> Path:
    return tree / "vllm" / "models" / "minimax_m3" / "nvidia" / "model.py"


def stopped(facts: dict) -> str:
    assert facts["constructed"] is False, facts
    error = facts["error"]
    assert error.startswith("mm3_codemod.plugin.Fp8KvCacheStop: "), error
    assert "\n" not in error
    return error


@pytest.mark.parametrize(
    ("model", "state"),
    [(NEEDS_BYPASS, "needs-bypass"), (OUTDATED, "outdated"), (HALF_APPLIED, "half-applied")],
    ids=["needs-bypass", "outdated", "half-applied"],
)
def test_check_stops_an_fp8_start_in_one_line(vllm_python: Path, tmp_path: Path, model: Path, state: str) -> None:
    tree = install(vllm_python, tmp_path, model)
    layer = "MiniMaxM3SparseAttention" if model == HALF_APPLIED else LAYER
    facts, logged = start(tree, "fp8_e4m3", layer)
    assert facts["loaded_at_plugin_time"] == [] and facts["hooks"] == ["ModelHook"]
    line = stopped(facts)
    assert f"{model_of(tree)}: {state} at line " in line and "--kv-cache-dtype fp8_e4m3" in line
    assert f"fix: mm3-codemod run {model_of(tree)}" in line or f"mm3_codemod run {model_of(tree)}" in line
    assert logged == []  # judged at the fp8 layer: the stop is the one line


def test_the_fix_it_names_works_as_written(vllm_python: Path, tmp_path: Path) -> None:
    tree = install(vllm_python, tmp_path, NEEDS_BYPASS)
    line = stopped(start(tree, "fp8")[0])
    command = line.split("fix: ", 1)[1].split(" (or ", 1)[0].split()
    assert command[-2:] == ["run", str(model_of(tree))]
    cli = [sys.executable, "-m", "mm3_codemod", *command[command.index("run") :]]
    env = {**os.environ, "MM3_CODEMOD_SERVE_CACHE": str(tree.parent / "served")}  # the user's cache
    subprocess.run(cli, check=True, capture_output=True, cwd=tmp_path, timeout=300, env=env)
    facts, logged = start(tree, "fp8")
    assert facts["constructed"] is True and facts["fp8_flag"].get("_fp8_kv") is True
    # `run` left its verdict on the bytes it wrote: the start reads it, and analyses nothing
    assert len(logged) == 1 and "patched: fp8 KV cache supported" in logged[0], logged


@pytest.mark.parametrize(("model", "state"), [(NATIVE, "native"), (PATCHED, "patched")], ids=["native", "patched"])
def test_check_passes_native_and_patched_with_one_log_line(
    vllm_python: Path, tmp_path: Path, model: Path, state: str
) -> None:
    tree = install(vllm_python, tmp_path, model)
    layer = "MiniMaxM3SparseAttention" if model == NATIVE else LAYER
    facts, logged = start(tree, "fp8_e4m3", layer)
    assert facts["file"] == str(model_of(tree))
    assert "Fp8KvCacheStop" not in facts.get("error", "")
    assert f"{model_of(tree)}: {state}: fp8 KV cache supported" in logged[-1]
    assert len(logged) == 1  # each at its first fp8 layer, where it is run (native) or judged (patched)


def test_check_stops_an_fp8_start_on_a_native_call_that_fails_when_run(vllm_python: Path, tmp_path: Path) -> None:
    """The call's shape is native, its caches swapped: run as ``check`` runs it, the fp8 start stops (it had passed on
    the pre-filter's answer, at import)."""
    caches = "            self.kv_cache,\n            self.indexer.index_cache.kv_cache,\n"
    swapped = tmp_path / "swapped.py"
    swapped.write_text(NATIVE.read_text().replace(caches, "".join(reversed(caches.splitlines(True)))))
    assert swapped.read_text() != NATIVE.read_text()
    tree = install(vllm_python, tmp_path, swapped)
    facts, logged = start(tree, "fp8_e4m3", "MiniMaxM3SparseAttention")
    line = stopped(facts)
    assert "unsupported at line" in line and "the call is native and running it fails" in line, line


def test_a_bf16_start_is_never_stopped(vllm_python: Path, tmp_path: Path) -> None:
    tree = install(vllm_python, tmp_path, NEEDS_BYPASS)
    facts, logged = start(tree, "auto")
    assert facts["constructed"] is True, facts
    (line,) = logged
    assert line.endswith(f"mm3-codemod: {model_of(tree)}: {LATER}; this start's KV cache is auto: runs as it is")
    assert not list((tree.parent / "served").glob("*.json"))  # nothing was analysed
    assert stopped(start(tree, "fp8_e5m2")[0])  # the same file, the same layer: fp8 stops


def test_apply_serves_the_proven_rewrite_and_leaves_the_file(vllm_python: Path, tmp_path: Path) -> None:
    tree = install(vllm_python, tmp_path, NEEDS_BYPASS)
    before = hashlib.sha256(model_of(tree).read_bytes()).hexdigest()
    facts, logged = start(tree, "fp8_e4m3", MM3_CODEMOD_PLUGIN="apply")
    assert facts["constructed"] is True and facts["fp8_flag"].get("_fp8_kv") is True, facts
    served = Path(facts["file"])
    assert served.parent == tree.parent / "served" and facts["has_write_method"]
    assert served.read_bytes() == PATCHED.read_bytes()  # what `run` writes, byte for byte
    assert hashlib.sha256(model_of(tree).read_bytes()).hexdigest() == before
    assert len(logged) == 1 and "proven now" in logged[0] and "unchanged" in logged[0]
    # A second process (a TP worker, the engine core) serves the same rewrite, proven once;
    # vLLM's own selection picks apply too.
    again, logged = start(tree, "fp8_e4m3", VLLM_PLUGINS="mm3_codemod_apply")
    assert again["file"] == facts["file"] and "proven before" in logged[0]
    assert hashlib.sha256(model_of(tree).read_bytes()).hexdigest() == before


def test_apply_stops_an_fp8_start_on_a_file_run_refuses(vllm_python: Path, tmp_path: Path) -> None:
    tree = install(vllm_python, tmp_path, REFUSED)
    facts, _ = start(tree, "fp8", "SparseAttentionLayer", MM3_CODEMOD_PLUGIN="apply")
    line = stopped(facts)
    assert "unsupported at line" in line and "`run` refuses it" in line and "fix:" not in line


@pytest.mark.parametrize("env", [{"MM3_CODEMOD_PLUGIN": "off"}, {"VLLM_PLUGINS": "some_other_plugin"}])
def test_off(vllm_python: Path, tmp_path: Path, env: dict[str, str]) -> None:
    tree = install(vllm_python, tmp_path, NEEDS_BYPASS)
    facts, logged = start(tree, "fp8", **env)
    assert facts["hooks"] == [] and facts["constructed"] is True and logged == []
