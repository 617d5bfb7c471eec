"""Stop 52: what hunt 51 found refused although it is the same program (k34, k61, k103), and what hunt 52 found."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_adversarial import FORK_ERA, assert_rewritten_right, edit
from test_hunt47 import PATCHED, _edited, _states

WRITE_DEF = "    def _insert_kv(\n"
FORK_NAMES = re.sub(r"_fp8_kv\b", "_fp8_cache", PATCHED)  # a fork's own names: check runs its bypass


@pytest.mark.parametrize("slots", ["()", '("_fp8_kv",)'])
def test_slots_leave_an_nn_module_room_for_the_flag(tmp_path: Path, slots: str) -> None:
    """``__slots__`` on an nn.Module subclass takes nothing away: nn.Module keeps a ``__dict__`` (hunt 51's k61, k103 had
    been refused as leaving no room for the flag)."""
    assert_rewritten_right(tmp_path, edit(FORK_ERA, ("    def _run_attention(", f"    __slots__ = {slots}\n\n    def _run_attention(")))


def test_the_stand_in_runs_a_layer_with_slots(tmp_path: Path) -> None:
    """The stand-in is no nn.Module: it took ``__slots__ = ()`` as its own and had no room for the layer's attributes."""
    pytest.importorskip("torch")
    from test_fp8_index import semantic

    from rewriter.verify import Status

    path = tmp_path / "model.py"
    path.write_text(_edited(FORK_NAMES, [("    def _run_attention(", "    __slots__ = ()\n\n    def _run_attention(")]))
    assert semantic(path).status is Status.PASSED


@pytest.mark.parametrize("decorator", ["@torch.no_grad()", "@torch.inference_mode()", "@no_grad()"])
def test_a_grad_mode_decorator_on_the_write_is_the_same_program(tmp_path: Path, decorator: str) -> None:
    """vLLM runs the layer under inference mode, so ``no_grad``/``inference_mode`` on the write change nothing (hunt 51's
    k34 had been refused as a write bound other than by a plain ``def``), however torch's name is imported."""
    path = tmp_path / "model.py"
    imports = "from torch import no_grad\n" if decorator == "@no_grad()" else ""
    path.write_text(_edited(FORK_NAMES, [("import torch\n", "import torch\n" + imports), (WRITE_DEF, f"    {decorator}\n{WRITE_DEF}")]))
    assert _states(path)[-1] == "patched"


def test_any_other_decorator_on_the_write_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(_edited(FORK_NAMES, [(WRITE_DEF, f"    @torch.compiler.disable\n{WRITE_DEF}")]))
    assert _states(path)[-1] == "unsupported"


# --- hunt 52: a native call is run, as a fork's own bypass is; what running cannot see is read ---------------------

NATIVE = (Path(__file__).parent.parent / "fixtures" / "native" / "model.py").read_text()
CALL = "        ops.fused_minimax_m3_qknorm_rope_kv_insert(\n"
CALL_END = "            self.kv_cache_dtype,\n        )\n"
DTYPE = "        self.kv_cache_dtype = cache_config.cache_dtype\n"
CALLED = NATIVE[NATIVE.index(CALL, NATIVE.index("class MiniMaxM3SparseAttention")) :].split(CALL_END)[0] + CALL_END


def _indented(code: str) -> str:
    return "".join("    " + line for line in code.splitlines(True))


# name -> edits of the native file that break it with an fp8 cache (or any), which only running it shows
RUN_FAILS = {
    "caches swapped": [("            self.kv_cache,\n            self.indexer.index_cache.kv_cache,\n",
                        "            self.indexer.index_cache.kv_cache,\n            self.kv_cache,\n")],
    "slot mappings swapped": [("            main_slot_mapping,\n            index_slot_mapping,\n",
                              "            index_slot_mapping,\n            main_slot_mapping,\n")],
    "the dtype upper-cased": [(DTYPE, DTYPE.replace("cache_dtype\n", "cache_dtype.upper()\n"))],
    "the dtype reset in forward": [("        qkv, _ = self.qkv_proj(hidden_states)\n",
                                   '        qkv, _ = self.qkv_proj(hidden_states)\n        self.kv_cache_dtype = "auto"\n')],
}


@pytest.mark.parametrize("case", sorted(RUN_FAILS))
def test_a_native_call_that_fails_when_run_is_refused(tmp_path: Path, case: str) -> None:
    """``native`` had been said of the call's shape alone (``kv_cache_dtype=self.kv_cache_dtype``, the caches ``self.``
    attributes): ``check`` now runs it as ``verify``'s semantic level does, as it runs a fork's own bypass."""
    pytest.importorskip("torch")
    from conftest import cli

    path = tmp_path / "model.py"
    path.write_text(NATIVE)
    proc = cli("check", str(path))
    assert proc.returncode == 0 and "native" in proc.stderr and "; it was run: " in proc.stderr, proc.stderr
    path.write_text(_edited(NATIVE, RUN_FAILS[case]))
    proc = cli("check", str(path))
    assert proc.returncode == 2 and "the call is native and running it fails" in proc.stderr, proc.stderr


def test_a_native_call_is_not_called_proven_without_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from rewriter import commands
    from rewriter.targets import Target

    real = importlib.util.find_spec
    monkeypatch.setenv("MM3_CODEMOD_SERVE_CACHE", str(tmp_path / "served"))  # (no run kept by another test)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    path = tmp_path / "model.py"
    path.write_text(NATIVE)
    (result,) = commands.analyze_targets("check", [Target(path, "t")]).files
    (site,) = [s for s in result.sites if s.class_name == "MiniMaxM3SparseAttention"]
    assert site.state.value == "native" and "; it was not run here: torch is not installed; to run it: " in site.reason
    assert "-m pip install torch" in site.reason and ", then mm3-codemod verify " in site.reason


SUBCLASS = "\n\nclass Fp8Attention(MiniMaxM3SparseAttention):\n"
PATCHED_DTYPE = '        self.kv_cache_dtype = (\n            cache_config.cache_dtype if cache_config is not None else "auto"\n        )\n'
HELPER = "    def _set_dtype(self, cache_config) -> None:\n" + PATCHED_DTYPE + "\n" + WRITE_DEF
# name -> (base, edits, what the refusal says): what the semantic level does not run (it runs the class, once)
STATIC = {
    "the call in a loop": (NATIVE, [(CALLED, "        for _ in range(2):\n" + _indented(CALLED))], "stands in the loop at line"),
    "a loop that never runs": (NATIVE, [(CALLED, "        while False:\n" + _indented(CALLED))], "stands in the loop at line"),
    "the call twice": (NATIVE, [(CALLED, CALLED + CALLED)], "calls the op again, on the same path"),
    "a patched site in a loop": (
        PATCHED, [("        insert_via_fused = not self._fp8_kv\n", "        insert_via_fused = not self._fp8_kv\n        for _ in range(2):\n    ")],
        "stands in the loop at line",
    ),
    "a subclass that redefines forward": (
        NATIVE, [(CALL_END + "        return self.attend(q, index_q)\n", CALL_END + "        return self.attend(q, index_q)\n" + SUBCLASS
                  + "    def forward(self, positions, hidden_states):\n        return hidden_states\n")],
        "class `Fp8Attention` derives from `MiniMaxM3SparseAttention` and redefines `forward`",
    ),
    "a subclass that sets the cache dtype": (
        NATIVE, [(CALL_END + "        return self.attend(q, index_q)\n", CALL_END + "        return self.attend(q, index_q)\n" + SUBCLASS
                  + '    def __init__(self, *args, **kwargs):\n        super().__init__(*args, **kwargs)\n        self.kv_cache_dtype = "auto"\n')],
        "redefines `kv_cache_dtype`",
    ),
    "the cache dtype set by a method __init__ does not run": (
        PATCHED, [(PATCHED_DTYPE, ""), (WRITE_DEF, HELPER)], "is set by `_set_dtype` (line",
    ),
}
# The same edits made harmless: the loop's twin in exclusive branches, the helper called from __init__.
HARMLESS = {
    "a call in each branch": (NATIVE, [(CALLED, "        if num_tokens:\n" + _indented(CALLED) + "        else:\n" + _indented(CALLED))]),
    # vLLM's loader hands the engine ``model.eval()``: the stand-in had no ``training`` and failed the file for it
    "a call for inference only": (NATIVE, [(CALLED, "        if not self.training:\n" + _indented(CALLED))]),
    "the cache dtype set by a method __init__ runs": (
        PATCHED, [(PATCHED_DTYPE, "        self._set_dtype(cache_config)\n"), (WRITE_DEF, HELPER)],
    ),
}


@pytest.mark.parametrize("case", sorted(STATIC))
def test_what_running_the_class_once_cannot_see_is_refused(tmp_path: Path, case: str) -> None:
    """Run twice, the op ropes the keys it writes twice, and bf16 and fp8 runs agree all the same; the stand-in runs
    the class it is handed, not a subclass the model builds, and sets the cache dtype itself. Hunt 52's C, B, D."""
    from test_hunt47 import refused_but_not_its_base

    from rewriter.apply import plan_file

    base, edits, words = STATIC[case]
    path = tmp_path / "model.py"
    refused_but_not_its_base(path, base, edits)
    assert any(words in s.reason for s in plan_file(path).sites if s.state.value == "unsupported")


@pytest.mark.parametrize("case", sorted(HARMLESS))
def test_the_same_edits_made_harmless_are_not_refused(tmp_path: Path, case: str) -> None:
    base, edits = HARMLESS[case]
    path = tmp_path / "model.py"
    path.write_text(_edited(base, edits))
    assert _states(path)[-1] == _states_of(tmp_path, base)[-1]


def _states_of(tmp_path: Path, source: str) -> list[str]:
    path = tmp_path / "base.py"
    path.write_text(source)
    return _states(path)


def test_run_writes_no_bypass_around_a_call_in_a_loop(tmp_path: Path) -> None:
    """Hunt 52's l26: ``run`` wrote its bypass around a fork-era call in a loop, and ``check`` called the output patched."""
    from conftest import cli

    sparse = FORK_ERA.index("class MiniMaxM3SparseAttention")
    fork_call = FORK_ERA[FORK_ERA.index(CALL, sparse) :].split("        )\n", 1)[0] + "        )\n"
    edited = _edited(FORK_ERA, [(fork_call, "        for _ in range(2):\n" + _indented(fork_call))])
    path = tmp_path / "model.py"
    path.write_text(edited)
    proc = cli("run", str(path))
    assert proc.returncode == 2 and "stands in the loop at line" in proc.stdout + proc.stderr
    assert path.read_text() == edited


def test_the_cache_dtype_read_from_vllms_config_is_the_runs(tmp_path: Path) -> None:
    """Hunt 52's l83: ``get_current_vllm_config().cache_config.cache_dtype`` is the cache dtype, as ``cache_config``'s;
    the stand-in's config had no cache config, so the fork's fp8 run used the bf16 path and failed, and ``check``
    refused a file that runs."""
    pytest.importorskip("torch")
    from conftest import cli

    path = tmp_path / "model.py"
    path.write_text(_edited(FORK_NAMES, [(PATCHED_DTYPE, "        self.kv_cache_dtype = vllm_config.cache_config.cache_dtype\n")]))
    proc = cli("check", str(path))
    assert proc.returncode == 0 and "patched" in proc.stderr and "so it was run: " in proc.stderr, proc.stderr


def test_the_cache_dtype_set_by_a_method_init_calls_is_found(tmp_path: Path) -> None:
    """Hunt 52's l86: a fork-era file whose ``__init__`` sets the cache dtype through a method of its own had been
    refused (the dtype looked for among ``__init__``'s own statements); the flag goes after that call, and ``revert``
    gives the file back."""
    fork_dtype = '        self.kv_cache_dtype = (\n            cache_config.cache_dtype if cache_config is not None else "auto"\n        )\n'
    helper = "    def _set_dtype(self, cache_config) -> None:\n" + fork_dtype + "\n" + WRITE_DEF
    source = _edited(FORK_ERA, [(fork_dtype, "        self._set_dtype(cache_config)\n"), (WRITE_DEF, helper)])
    from conftest import cli

    path = tmp_path / "model.py"
    path.write_text(source)
    assert cli("run", str(path)).returncode == 0
    after = path.read_text()
    assert "        self._set_dtype(cache_config)\n" in after.split('        self._fp8_kv = "fp8" in self.kv_cache_dtype\n')[0]
    assert _states(path)[-1] == "patched"
    assert cli("revert", str(path)).returncode == 0 and path.read_text() == source


def test_no_kv_head_at_a_rank_fails_the_run(tmp_path: Path) -> None:
    """Hunt 52's E: ``total // tp`` heads without ``max(1, …)`` leaves a rank of a TP size the count is less than
    with no kv head; the stand-in ran vLLM's own per-rank count there and noted the file's, so check passed it."""
    pytest.importorskip("torch")
    from conftest import cli

    sparse = "        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)\n"
    assert FORK_NAMES.count(sparse) == 2  # the dense layer's, then the sparse layer's
    head, tail = FORK_NAMES.rsplit(sparse, 1)
    path = tmp_path / "model.py"
    path.write_text(head + "        self.num_kv_heads = config.num_key_value_heads // tp_size\n" + tail)
    proc = cli("check", str(path))
    assert proc.returncode == 2 and "__init__ computes self.num_kv_heads = 0, no head at this rank" in proc.stderr, proc.stderr
