"""Hunt 48's wrong verdicts, through the whole command (``check --json``), as small edits of the fixtures, each
with its control (the base file is not refused): what a captured CUDA graph cannot replay in the write a bypass
keeps (``guards.host_syncs``), and scales the kernel would not read as float32 ones (``guards.unproven_scales``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, cli
from test_hunt47 import COMPILED, PATCHED, _edited, _states, refused_but_not_its_base

OLD_FORM = (FIXTURES / "old_form" / "model.py").read_text()
SCALE_LINE = "        scale = self._fp8_kv_scale  # identity: stores x / 1\n"
INDEX_CALL = "        ops.reshape_and_cache_flash(\n            idx_key,"
POST_CALL = "            self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)\n"

# name -> (base, edits): each is refused ("unsupported")
CASES = {
    "an .item() assert in the write": (
        PATCHED, [(SCALE_LINE, SCALE_LINE + "        assert int(main_slot_mapping.max().item()) < key_cache.numel()\n")]
    ),
    "slots logged through .cpu()": (PATCHED, [(SCALE_LINE, SCALE_LINE + "        print(main_slot_mapping.cpu())\n")]),
    "the index write under `if (slots >= 0).any():`": (
        PATCHED, [(INDEX_CALL, "        if (index_slot_mapping >= 0).any():\n            pass\n" + INDEX_CALL)]
    ),
    "one-argument torch.where": (
        PATCHED,
        [(INDEX_CALL, "        keep = torch.where(index_slot_mapping >= 0)[0]\n" + INDEX_CALL),
         ("            idx_key,\n            idx_key,\n", "            idx_key[keep],\n            idx_key[keep],\n"),
         ("            index_slot_mapping,\n            idx_dtype,", "            index_slot_mapping[keep],\n            idx_dtype,")],
    ),
    "the write on a side stream": (
        PATCHED,
        [("        self.register_buffer(\n", "        self._kv_stream = torch.cuda.Stream() if torch.cuda.is_available() else None\n"
          "        self.register_buffer(\n"),
         (POST_CALL, "            with torch.cuda.stream(self._kv_stream):\n    " + POST_CALL)],
    ),
    "a per-call scale copied from the host": (
        PATCHED, [(SCALE_LINE, "        scale = torch.tensor(1.0, device=key.device)\n")]
    ),
    # the kernel reads the scale as a float32 tensor on the device
    "a scale buffer with no dtype (bf16 where vLLM builds the model)": (
        PATCHED, [("torch.ones((), dtype=torch.float32), persistent=False", "torch.ones(()), persistent=False")]
    ),
    "a float scale": (PATCHED, [(SCALE_LINE, "        scale = 1.0\n")]),
    "a scale in the key's dtype": (PATCHED, [(SCALE_LINE, "        scale = key.new_ones(())\n")]),
    "a run-time scale on the host": (PATCHED, [(SCALE_LINE, "        scale = torch.ones(())\n")]),
    # a failed write swallowed: the cache holds what it held, and attention reads it as written (hunt 48's e19)
    "a post-call that swallows a failed write": (
        PATCHED, [(POST_CALL, "            try:\n    " + POST_CALL + "            except Exception:\n                pass\n")]
    ),
    # no such op: an AttributeError at the first fp8 write (an upgrade copies the spelling into its index write)
    "the reshape op under torch.ops._C": (
        PATCHED, [("        ops.reshape_and_cache_flash(\n            key.view", "        torch.ops._C.reshape_and_cache_flash(\n            key.view")]
    ),
    # the compiled path's write returns a tensor nothing reads, of an op declaring no mutation: torch.compile
    # drops it as dead code (aot_eager and inductor write nothing; eager, and so the stand-in, still write)
    "the compiled write's result left unread": (
        COMPILED, [("        return self.attend(q, index_q, kv_dep)\n", "        return self.attend(q, index_q, None)\n")]
    ),
    # an upgrade keeps all of the write but its index write: a host sync there stays
    "an upgrade keeping an .item() assert": (
        OLD_FORM, [("        idx_cache[index_slot_mapping] =", "        assert index_slot_mapping.min().item() >= -1\n        idx_cache[index_slot_mapping] =")]
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_is_refused_and_its_base_is_not(tmp_path: Path, case: str) -> None:
    refused_but_not_its_base(tmp_path / "model.py", *CASES[case])


@pytest.mark.parametrize(
    "scale", ["torch.ones((), device=key.device)", "torch.ones((), dtype=torch.float32, device=key.device)"]
)
def test_a_scale_made_on_the_device_at_run_time_is_proven(tmp_path: Path, scale: str) -> None:
    """Float32 by default where the forward runs (vLLM's bf16 default holds only while it builds the model)."""
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [(SCALE_LINE, f"        scale = {scale}\n")]))
    assert _states(path)[-1] == "patched"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="a `type` statement compiles from Python 3.12 on")
def test_a_file_this_python_cannot_compile_is_not_said_to_fail(tmp_path: Path) -> None:
    """Hunt 48 D2: LibCST reads the syntax of a newer Python; the proof's stand-in compiles with this one. That
    is not the bypass failing when run (a refusal advising `revert --whole-bypass`, which refuses it too)."""
    pytest.importorskip("torch")
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [("\n\nclass ", "\n\ntype SlotMap = torch.Tensor\n\n\nclass ")]))
    proc = cli("check", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "running it fails" not in out and "cannot compile it (line" in out


def test_a_compiled_write_declared_mutating_is_kept_without_its_result_read(tmp_path: Path) -> None:
    """An op registered with ``mutates_args`` is no dead code: the compiler keeps it whether or not its result is read."""
    path = tmp_path / "model.py"
    path.write_text(_edited(COMPILED, [("        return self.attend(q, index_q, kv_dep)\n", "        return self.attend(q, index_q, None)\n"),
                                       ("    mutates_args=[],\n    fake_impl=sparse_kv_cache_update_fake", '    mutates_args=["key"],\n    fake_impl=sparse_kv_cache_update_fake')]))
    assert "unsupported" not in _states(path)


@pytest.mark.parametrize(
    ("scale", "proven"),
    [("torch.full((), 1.0, device=key.device)", True), ("torch.full((), 1, device=key.device)", False),
     ("torch.full((), 1, dtype=torch.float32, device=key.device)", True), ("torch.full((), 2.0, device=key.device)", False)],
)
def test_a_scale_filled_with_one(tmp_path: Path, scale: str, proven: bool) -> None:
    """``torch.full`` takes its dtype from the fill where none is given: 1 is an int64 tensor, 1.0 a float32 one."""
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [(SCALE_LINE, f"        scale = {scale}\n")]))
    assert (_states(path)[-1] == "patched") is proven
