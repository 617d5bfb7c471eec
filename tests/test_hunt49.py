"""Hunt 49: programs that are the same as a supported form, refused before (each with its base), and the
wrong verdicts hunt 49 found, as small edits of the fixtures through the whole command (``check --json``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hunt47 import NATIVE, PATCHED, _edited, _states

POST_CALL = "            self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)\n"

# name -> (base, edits, the state `check` gives): the same program as the base, so the base's state
SAME = {
    # vLLM's kernels take "fp8" as "fp8_e4m3": the native kernel is told the cache dtype (hunt 48's g09)
    "a native dtype spelled fp8 for fp8_e4m3": (
        NATIVE, [("            self.kv_cache_dtype,\n", '            self.kv_cache_dtype.replace("fp8_e4m3", "fp8"),\n')], "native"
    ),
    # a failed write re-raised leaves the block loudly, never silently unwritten (hunt 48's e18)
    "a post-call that re-raises a failed write": (
        PATCHED,
        [(POST_CALL, "            try:\n    " + POST_CALL + "            except RuntimeError as e:\n"
          '                raise RuntimeError("fp8 kv insert failed") from e\n')],
        "patched",
    ),
    # a module constant made a frozenset: membership in it is membership in its items (hunt 47's f29)
    "a flag tested against a frozenset constant": (
        PATCHED,
        [("from vllm import _custom_ops as ops\n", 'from vllm import _custom_ops as ops\n\n_FP8 = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})\n'),
         ('self._fp8_kv = "fp8" in self.kv_cache_dtype', "self._fp8_kv = self.kv_cache_dtype in _FP8")],
        "patched",
    ),
    # a batch of no token has nothing to write: the early return skips no write (hunt 48's a07)
    "an early return for a batch of no token": (
        PATCHED,
        [("        key_cache, value_cache = self.kv_cache.unbind(1)\n",
          "        if key.numel() == 0:\n            return\n        key_cache, value_cache = self.kv_cache.unbind(1)\n")],
        "patched",
    ),
}


@pytest.mark.parametrize("case", sorted(SAME))
def test_the_same_program_gets_its_bases_verdict(tmp_path: Path, case: str) -> None:
    base, edits, state = SAME[case]
    path = tmp_path / "model.py"
    path.write_text(base)
    assert _states(path)[-1] == state  # the control
    path.write_text(_edited(base, edits))
    assert _states(path)[-1] == state


@pytest.mark.parametrize(
    "dtype", ['self.kv_cache_dtype.replace("fp8", "fp8_e4m3")', 'self.kv_cache_dtype.replace("fp8_e5m2", "fp8")']
)
def test_a_native_dtype_the_kernel_reads_as_another_is_refused(tmp_path: Path, dtype: str) -> None:
    """"fp8_e4m3" stays one to the kernels, but "fp8" for "fp8_e5m2" is another format (and "fp8_e4m3_e4m3" none)."""
    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, [("            self.kv_cache_dtype,\n", f"            {dtype},\n")]))
    assert _states(path)[-1] == "unsupported"


def test_a_raise_that_leaves_before_the_write_is_not_wired(tmp_path: Path) -> None:
    """Only a raise in an ``except`` (the write failed) is let through; one before the write still leaves it."""
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [(POST_CALL, '            if k is None:\n                raise ValueError("no key")\n' + POST_CALL)]))
    assert _states(path)[-1] != "patched"


@pytest.mark.parametrize("test", ["key.numel() == 1", "self.kv_cache.numel() == 0", "key.numel() == 0 or True"])
def test_an_early_return_for_a_batch_with_tokens_is_no_write_of_the_bypass(tmp_path: Path, test: str) -> None:
    """A return under any other test may skip tokens: the write is not the bypass's (``other``), not patched."""
    path = tmp_path / "model.py"
    line = "        key_cache, value_cache = self.kv_cache.unbind(1)\n"
    path.write_text(_edited(PATCHED, [(line, f"        if {test}:\n            return\n" + line)]))
    assert _states(path)[-1] != "patched"
