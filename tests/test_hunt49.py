"""Hunt 49: programs that are the same as a supported form, refused before (each with its base), and the
wrong verdicts hunt 49 found, as small edits of the fixtures through the whole command (``check --json``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hunt47 import COMPILED, NATIVE, PATCHED, _edited, _states, refused_but_not_its_base

POST_CALL = "            self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)\n"
SCALE_LINE = "        scale = self._fp8_kv_scale  # identity: stores x / 1\n"
CLASS = "MiniMaxM3SparseAttention"


def _in_write(*lines: str) -> list[tuple[str, str]]:
    """``lines`` added to the write method, after its scale."""
    return [(SCALE_LINE, SCALE_LINE + "".join(f"        {line}\n" for line in lines))]


# name -> the lines added to the write: each makes the host wait for the device (hunt 49's W1), so a captured
# CUDA graph cannot replay it, however it is spelled
SYNCS = {
    "a tensor element tested in a loop": ["for i, s in enumerate(index_slot_mapping):", "    if s >= 0:", "        pass"],
    "a mask through an alias": ["valid = index_slot_mapping >= 0", "keep = valid", "rows = index_key[keep]"],
    "a mask made by .to(torch.bool)": ["keep = (index_slot_mapping + 1).to(torch.bool)", "rows = index_key[keep]"],
    "a mask made by torch.greater_equal": ["keep = torch.greater_equal(index_slot_mapping, 0)", "rows = index_key[keep]"],
    "a count held in a local, then tested": ["n_real = (index_slot_mapping >= 0).sum()", "if n_real:", "    pass"],
    "the scale converted to a float": ["if float(scale) != 1.0:", '    raise ValueError("identity scale expected")'],
    "a count converted to an int": ["n_real = int(torch.count_nonzero(index_slot_mapping >= 0))"],
    "a count as a slice's bound": ["n_real = (index_slot_mapping >= 0).sum()", "rows = index_key[:n_real]"],
    "slots formatted into a string": ['text = f"slots={main_slot_mapping}"'],
    "repeat_interleave by a tensor": [
        "rows = torch.repeat_interleave(torch.arange(key.shape[0]), (index_slot_mapping >= 0).long())"
    ],
}


@pytest.mark.parametrize("case", sorted(SYNCS))
def test_a_host_sync_in_the_write_is_refused(tmp_path: Path, case: str) -> None:
    refused_but_not_its_base(tmp_path / "model.py", PATCHED, _in_write(*SYNCS[case]))


def test_what_the_host_knows_of_a_tensor_is_no_sync(tmp_path: Path) -> None:
    """Its shape, size and dtype are the host's: reading them waits for nothing."""
    path = tmp_path / "model.py"
    lines = ['text = f"{key.shape} {key.dtype}"', "rows = index_key[: key.shape[0]]", "n = int(key.numel()) + len(key)",
             "twice = key.repeat_interleave(2, dim=0)", "if key.size(0) > 0 and key.dim() == 3:", "    pass",
             "if key is None or not isinstance(key, torch.Tensor) or scale is None:",
             '    raise ValueError(f"slots {main_slot_mapping.tolist()}")',
             'assert key.dim() >= 1, f"key {key}"']
    path.write_text(_edited(PATCHED, _in_write(*lines)))
    assert _states(path)[-1] == "patched"


# name -> edits of PATCHED: each is refused (hunt 49's W2-W4)
REFUSED = {
    # the class's write method or __init__ rebound after the class body: what runs is not what was read
    "the write method rebound after the class": [("    return loaded\n", f"    return loaded\n\n\n{CLASS}._insert_kv = lambda self, *a: None\n")],
    "the write method set by setattr": [("    return loaded\n", f'    return loaded\n\n\nsetattr({CLASS}, "_insert_kv", lambda self, *a: None)\n')],
    "__init__ rebound after the class": [("    return loaded\n", f"    return loaded\n\n\n{CLASS}.__init__ = {CLASS}.__init__\n")],
    # the main write quantizes by its dtype argument: "fp8" writes e4m3 into an fp8_e5m2 cache
    "a literal fp8 dtype in the main write": [("            self.kv_cache_dtype,\n", '            "fp8",\n')],
    "the main write's dtype made e4m3 from e5m2": [
        ("            self.kv_cache_dtype,\n", '            self.kv_cache_dtype.replace("fp8_e5m2", "fp8"),\n')
    ],
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_is_refused_and_its_base_is_not(tmp_path: Path, case: str) -> None:
    refused_but_not_its_base(tmp_path / "model.py", PATCHED, REFUSED[case])


def test_another_class_rebinding_the_same_name_is_not_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [("    return loaded\n", "    return loaded\n\n\nMiniMaxM3DecoderLayer._insert_kv = None\n")]))
    assert _states(path)[-1] == "patched"


def test_int32_slots_handed_the_kernel_fail_the_proof(tmp_path: Path) -> None:
    """The kernel reads slot mappings as int64 (``data_ptr<int64_t>``); the reference op does too now (hunt 49's W4)."""
    pytest.importorskip("torch")
    refused_but_not_its_base(tmp_path / "model.py", PATCHED, _in_write("main_slot_mapping = main_slot_mapping.to(torch.int32)"))

FLAG = 'self._fp8_kv = "fp8" in self.kv_cache_dtype'
TABLE = '{"auto": False, "bfloat16": False, "fp8": True, "fp8_e4m3": True, "fp8_e5m2": True}'


def _table(flag: str, table: str = TABLE) -> list[tuple[str, str]]:
    """A module table ``_KV_IS_FP8`` of the cache dtypes, and the flag ``flag`` reading it."""
    imports = "from vllm import _custom_ops as ops\n"
    return [(imports, f"{imports}\n_KV_IS_FP8 = {table}\n"), (FLAG, f"self._fp8_kv = {flag}")]


def _compiling_local(value: str) -> list[tuple[str, str]]:
    """``compiling = <value>`` first in the compile-aware forward, read wherever it asked ``torch.compiler.is_compiling()``."""
    first = "        qkv, _ = self.qkv_proj(hidden_states)\n"
    return [("torch.compiler.is_compiling()", "compiling"), (first, f"        compiling = {value}\n{first}")]


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
    # the flag read from a table of the cache dtypes, or a part of the dtype's string (hunt 49's d01, d02, d07, d18)
    "a flag looked up in a module table": (PATCHED, _table("_KV_IS_FP8[self.kv_cache_dtype]"), "patched"),
    "a flag got from a module table": (PATCHED, _table("_KV_IS_FP8.get(self.kv_cache_dtype, False)"), "patched"),
    "a flag got from a class table": (
        PATCHED,
        [("    def _insert_kv(\n", '    _FP8 = {"fp8": True, "fp8_e4m3": True, "fp8_e5m2": True}\n\n    def _insert_kv(\n'),
         (FLAG, "self._fp8_kv = self._FP8.get(self.kv_cache_dtype, False)")],
        "patched",
    ),
    "a flag from the dtype's first part": (PATCHED, [(FLAG, 'self._fp8_kv = self.kv_cache_dtype.partition("_")[0] == "fp8"')], "patched"),
    # sets are equal whatever order their items are written in
    "a flag compared as a set": (
        PATCHED, [(FLAG, 'self._fp8_kv = {self.kv_cache_dtype.partition("_")[0], "x"} == {"x", "fp8"}')], "patched"
    ),
    # the compile test held in a local of the forward, bound once (hunt 49's e03)
    "the compile test held in a local": (COMPILED, _compiling_local("torch.compiler.is_compiling()"), "patched"),
}


@pytest.mark.parametrize("value", ["False", "is_compiling()"])
def test_a_local_that_is_not_the_compile_test_is_no_guard(tmp_path: Path, value: str) -> None:
    """A local bound to something else (a constant; a function of this file named ``is_compiling``) is not read as
    the compile test: the guard is not the bypass's."""
    path = tmp_path / "model.py"
    source = _edited(COMPILED, _compiling_local(value))
    path.write_text(source.replace("\nclass ", "\ndef is_compiling():\n    return False\n\n\nclass ", 1))
    assert _states(path)[-1] != "patched"


@pytest.mark.parametrize(
    "table",
    ['{"auto": False, "bfloat16": True, "fp8": True, "fp8_e4m3": True, "fp8_e5m2": True}',  # true for bf16
     '{"auto": False, "bfloat16": False, "fp8": True, "fp8_e4m3": True}'],  # no fp8_e5m2: a KeyError there
)
def test_a_table_that_is_no_fp8_test_is_no_flag(tmp_path: Path, table: str) -> None:
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, _table("_KV_IS_FP8[self.kv_cache_dtype]", table)))
    assert _states(path)[-1] == "unsupported"


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


def test_revert_refuses_what_check_cannot_tell(tmp_path: Path) -> None:
    """The op named where its calls cannot be followed (hunt 49's c10, through ``functools.partial``): check
    refuses the file, and revert, which once left it "unchanged" beside a whole bypass, refuses it for that reason."""
    from conftest import cli

    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [("from vllm import _custom_ops as ops\n", "from vllm import _custom_ops as ops\n\n"
                                       "_fused = functools.partial(ops.fused_minimax_m3_qknorm_rope_kv_insert)\n")]))
    reasons = []
    for command in (["check"], ["revert", "--dry-run"], ["revert", "--whole-bypass", "--dry-run"]):
        proc = cli(*command, str(path))
        assert proc.returncode == 2, (command, proc.stdout + proc.stderr)
        reasons.append("the op is named without being called by that name" in proc.stdout + proc.stderr)
    assert all(reasons)
