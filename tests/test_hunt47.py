"""Hunt 47's wrong verdicts, each through the whole command (``check --json``: the prefilter and the
LibCST analysis), as small edits of the fixtures; each case with its control, the same file right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, cli

NATIVE = (FIXTURES / "native" / "model.py").read_text()
PATCHED = (FIXTURES / "patched" / "model.py").read_text()
COMPILED = (FIXTURES / "compiled_native" / "expected.py").read_text()
FORK_ERA = (FIXTURES / "fork_era" / "model.py").read_text()
CALL_END = "            self.kv_cache_dtype,\n        )\n"
WRITE = (
    "        key_cache, value_cache = self.kv_cache.unbind(1)\n"
    "        ops.reshape_and_cache_flash(k, v, key_cache, value_cache, main_slot_mapping, self.kv_cache_dtype, s, s)\n"
)


def _edited(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert source.count(old) >= 1, f"{old!r} no longer applies"
        source = source.replace(old, new)
    return source


# name -> (base, edits, the verdict: "unsupported" for each case)
CASES = {
    # a flag true for "bfloat16", vLLM's other cache dtype for MiniMax-M3: the bypass writes a bf16 cache as fp8
    "flag != auto": (PATCHED, [('self._fp8_kv = "fp8" in self.kv_cache_dtype', 'self._fp8_kv = self.kv_cache_dtype != "auto"')]),
    # the decoder layer sets the layer's flag (or its cache dtype) after building it
    "flag set by another class": (
        PATCHED,
        [("        self.input_layernorm = ", "        self.self_attn._fp8_kv = False\n        self.input_layernorm = ")],
    ),
    "flag set by another class with setattr": (
        PATCHED,
        [("        self.input_layernorm = ", '        setattr(self.self_attn, "_fp8_kv", False)\n        self.input_layernorm = ')],
    ),
    # a native call's cache arguments through a local the cache dtype decides
    "native cache through a local": (
        NATIVE,
        [("            self.kv_cache,\n            self.indexer", "            kv_arg,\n            self.indexer"),
         ("        ops.fused_minimax", '        kv_arg = self.kv_cache if self.kv_cache_dtype == "auto" else None\n        ops.fused_minimax')],
    ),
    # __init__ sets the cache dtype, then "auto", in one block: it is "auto" at the call
    "native dtype set twice in one block": (
        NATIVE,
        [("        self.kv_cache_dtype = cache_config.cache_dtype\n",
          "        if cache_config is not None:\n            self.kv_cache_dtype = cache_config.cache_dtype\n"
          '            self.kv_cache_dtype = "auto"\n        else:\n            self.kv_cache_dtype = "auto"\n')],
    ),
    # a native call followed by the layer's own (stale) cache write, inline
    "native with its own write": (NATIVE, [(CALL_END, CALL_END + WRITE.replace("k, v,", "qkv, qkv,").replace("s, s", "None, None"))]),
    # the same write in a lambda __init__ keeps in an attribute
    "native with a lambda write": (
        NATIVE,
        [("        self.kv_cache_dtype = cache_config.cache_dtype\n",
          "        self.kv_cache_dtype = cache_config.cache_dtype\n"
          "        self._post = lambda k, v: ops.reshape_and_cache_flash(k, v, *self.kv_cache.unbind(1), None, 'fp8', None, None)\n"),
         (CALL_END, CALL_END + "        self._post(qkv, qkv)\n")],
    ),
    # the cache dtype set from outside the layer (a module function): the prefilter must not answer native
    "native dtype set through another object": (NATIVE, [("\n\nclass ", '\n\ndef _tweak(layer):\n    layer.kv_cache_dtype = "auto"\n\n\nclass ')]),
    # another object calls the fork-era write method that `run` would give the slot-mapping signature (H W2)
    "write method called through another object": (
        FORK_ERA, [("\n\nclass ", "\n\ndef _refill(layer, k, v, ik):\n    layer._insert_kv(k, v, ik)\n\n\nclass ")]
    ),
    # the compile test as dynamo's own name, with a compiled branch that writes nothing: verify's stand-in
    # must take the compiled path for it too (it ran eager twice and said patched)
    "compiled branch writes nothing (is_dynamo_compiling)": (
        COMPILED,
        [("torch.compiler.is_compiling()", "torch.compiler.is_dynamo_compiling()"),
         ("                kv_dep = torch.ops.vllm.sparse_kv_cache_update(k, v, index_k, layer_name)\n", "                pass\n")],
    ),
    # H W1: the write skips padded slots by a boolean mask, whose size the host must wait for: no CUDA graph
    "write by a boolean mask": (
        PATCHED,
        [("        ops.reshape_and_cache_flash(\n            idx_key,",
          "        valid = index_slot_mapping >= 0\n        idx_key, index_slot_mapping = idx_key[valid], index_slot_mapping[valid]\n"
          "        ops.reshape_and_cache_flash(\n            idx_key,")],
    ),
    "post-call block reads a slot on the host": (
        PATCHED,
        [("            self._insert_kv(k, v, index_k,", "            assert min(main_slot_mapping.tolist()) >= -1\n            self._insert_kv(k, v, index_k,")],
    ),
}


def _states(path: Path) -> list[str]:
    proc = cli("check", "--json", str(path))
    return [s["state"] for f in json.loads(proc.stdout)["files"] for s in f["sites"] if s["class"]]


def refused_but_not_its_base(path: Path, base: str, edits: list[tuple[str, str]]) -> None:
    path.write_text(base)
    assert "unsupported" not in _states(path)  # the control: the base file as it is
    path.write_text(_edited(base, edits))
    assert "unsupported" in _states(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_is_refused_and_its_base_is_not(tmp_path: Path, case: str) -> None:
    refused_but_not_its_base(tmp_path / "model.py", *CASES[case])


# Hunt 47's disagreements: check and revert give one reason, and it is true.
POSITIVE_GUARD = [
    ("insert_via_fused = not self._fp8_kv", "use_bypass = self._fp8_kv"),
    ("self.kv_cache if insert_via_fused else None", "None if use_bypass else self.kv_cache"),
    ("self.indexer.index_cache.kv_cache if insert_via_fused else None", "None if use_bypass else self.indexer.index_cache.kv_cache"),
    ("if not insert_via_fused:", "if use_bypass:"),
]


def test_a_positive_guard_is_taken_out_whole(tmp_path: Path) -> None:
    """H D1: ``None if use_bypass else X`` is the bypass's guarded argument, not a use "outside the bypass"."""
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, POSITIVE_GUARD))
    assert _states(path)[-1] == "patched"
    proc = cli("revert", "--whole-bypass", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "use_bypass" not in path.read_text() and "_fp8_kv" not in path.read_text()


def test_an_unwired_post_call_is_refused_for_one_reason(tmp_path: Path) -> None:
    """H D2: slot mappings handed on as ``.long()``: check and revert --whole-bypass both say it is not wired."""
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [("main_slot_mapping, index_slot_mapping)\n", "main_slot_mapping.long(), index_slot_mapping)\n")]))
    check, revert = cli("check", str(path)), cli("revert", "--whole-bypass", "--dry-run", str(path))
    assert check.returncode == revert.returncode == 2
    assert "is not wired: it must be the statement right after the call" in revert.stdout + revert.stderr
    assert "not wired: it must be the statement right after the call" in check.stdout + check.stderr


def test_a_dtype_set_twice_is_refused_before_the_rewrite(tmp_path: Path) -> None:
    """H D3: __init__ normalises the cache dtype after setting it: the verdict names that, not a rewrite
    whose own flag then fails its proof (advice to write what the file would already get)."""
    path = tmp_path / "model.py"
    again = '\n        if self.kv_cache_dtype == "fp8":\n            self.kv_cache_dtype = "fp8_e4m3"\n'
    path.write_text(FORK_ERA)
    assert _states(path)[-1] == "needs-bypass"  # the control
    path.write_text(_edited(FORK_ERA, [('cache_config.cache_dtype if cache_config is not None else "auto"\n        )\n',
                                        'cache_config.cache_dtype if cache_config is not None else "auto"\n        )' + again)]))
    proc = cli("check", "--json", str(path))
    site = json.loads(proc.stdout)["files"][0]["sites"][-1]
    assert (proc.returncode, site["state"], site["action"]) == (2, "unsupported", "refuse")
    assert "is not proven to hold the cache dtype" in proc.stdout
