"""Stop 51 (hunt 51): the layer as vLLM runs it, whatever the cache dtype (``codemods.runtime``). ``verify``'s stand-in
runs neither the module's own statements nor a decorator, so a name bound only for a type checker, bound again at
module level, shadowed by a local, a file's own decorator on the call's method, or a test that keeps the call from
running with an fp8 cache had been answered ``native`` or ``patched`` (and proven). Each is refused for what it is;
each control, the same edit made harmless, is not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_hunt47 import NATIVE, PATCHED, _edited, _states, refused_but_not_its_base

FORK_ERA = (Path(__file__).parent.parent / "fixtures" / "fork_era" / "model.py").read_text()
CONTEXT = "from vllm.forward_context import get_forward_context\n"
DTYPE_HELPER = "from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype\n"
TYPE_CHECKING = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    "
NATIVE_CALL = "        ops.fused_minimax_m3_qknorm_rope_kv_insert(\n            qkv,\n            self.q_norm.weight,\n            self.k_norm.weight,\n            self.rotary_emb.cos_sin_cache,\n            positions,\n            self.num_heads,\n            self.num_kv_heads,\n            self.rotary_emb.rotary_dim,\n            self.q_norm.variance_epsilon,\n            self.index_q_norm.weight,"
NATIVE_RETURN = "        return self.attend(q, index_q)\n"
NATIVE_FORWARD = "    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:\n        qkv, _ = self.qkv_proj(hidden_states)\n        num_tokens"
SKIP = "\n\ndef _disabled(fn):\n    def wrapper(*args, **kwargs):\n        return None\n\n    return wrapper\n"

# name -> (base, edits, what the refusal says)
CASES = {
    # a name __init__ reads, imported for a type checker alone: NameError building the layer
    "a TYPE_CHECKING import __init__ reads": (PATCHED, [(DTYPE_HELPER, TYPE_CHECKING + DTYPE_HELPER)], "nor the module binds at run time"),
    # one forward reads: NameError on every forward
    "a TYPE_CHECKING import forward reads": (NATIVE, [(CONTEXT, TYPE_CHECKING + CONTEXT)], "nor the module binds at run time"),
    # the op's namespace imported in __init__ alone, where forward cannot see it
    "an import in __init__ alone": (
        NATIVE, [("from vllm import _custom_ops as ops\n", ""), ("        super().__init__()\n", "        super().__init__()\n        from vllm import _custom_ops as ops\n")],
        "nor the module binds at run time",
    ),
    # the module binds the op's namespace again after importing it
    "ops = None at module end": (NATIVE, [("\nclass MiniMaxM3Attention", "\nops = None\n\n\nclass MiniMaxM3Attention")], "binds again at module level"),
    "del at module end": (PATCHED, [(CONTEXT, CONTEXT + "del get_forward_context\n")], "binds again at module level"),
    # a local of forward named as the module's import, bound after the call: the call reads the local
    "a local shadowing ops": (NATIVE, [(NATIVE_RETURN, "        ops = None\n" + NATIVE_RETURN)], "UnboundLocalError"),
    # the file's own decorator returns what runs in the method's place
    "a decorator the file defines": (NATIVE, [(CONTEXT, CONTEXT + SKIP), (NATIVE_FORWARD, "    @_disabled\n" + NATIVE_FORWARD)], "is wrapped by `_disabled`"),
    # forward with no self, or replaced in __init__ by another callable
    "forward a staticmethod": (NATIVE, [(NATIVE_FORWARD, "    @staticmethod\n" + NATIVE_FORWARD)], "is wrapped by `staticmethod`"),
    "forward bound in __init__": (
        NATIVE, [("        self.kv_cache_dtype = cache_config.cache_dtype\n", ("        self.kv_cache_dtype = cache_config.cache_dtype\n"
                  "        self.forward = lambda positions, hidden_states: hidden_states\n"))],
        "binds `self.forward` in __init__",
    ),
    # the native call runs only for "auto", or forward leaves first for fp8
    "the call only for auto": (
        NATIVE,
        [(NATIVE_CALL, '        if self.kv_cache_dtype == "auto":\n    ' + NATIVE_CALL.replace("\n", "\n    ")),
         ("            self.kv_cache_dtype,\n        )\n", "                self.kv_cache_dtype,\n            )\n")],
        "takes the other branch",
    ),
    "an early return for fp8": (
        NATIVE, [(NATIVE_CALL, '        if "fp8" in self.kv_cache_dtype:\n            return q\n' + NATIVE_CALL)], "leaves the method first"
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_layer_vllm_cannot_run_as_proven_is_refused(tmp_path: Path, case: str) -> None:
    from conftest import cli

    base, edits, words = CASES[case]
    path = tmp_path / "model.py"
    refused_but_not_its_base(path, base, edits)
    proc = cli("check", str(path))
    assert words in proc.stdout + proc.stderr


# The same edits made harmless: none is refused.
HARMLESS = {
    "a TYPE_CHECKING import read in annotations alone": (NATIVE, [(CONTEXT, CONTEXT + TYPE_CHECKING + "from vllm.config import VllmConfig\n"),
                                                                 (NATIVE_RETURN, '        shown: "VllmConfig | None" = None\n' + NATIVE_RETURN)]),
    "a fallback bound in a try": (NATIVE, [(CONTEXT, "try:\n    " + CONTEXT + "except ImportError:\n    get_forward_context = None\n")]),
    "a local of another name": (NATIVE, [(NATIVE_RETURN, "        other = None\n" + NATIVE_RETURN)]),
    "torch's own decorator": (NATIVE, [(NATIVE_FORWARD, "    @torch.no_grad()\n" + NATIVE_FORWARD)]),
    "an early return no cache dtype decides": (NATIVE, [(NATIVE_CALL, "        if self.kv_cache.numel() == 0:\n            return q\n" + NATIVE_CALL)]),
}


@pytest.mark.parametrize("case", sorted(HARMLESS))
def test_the_same_edit_made_harmless_is_not_refused(tmp_path: Path, case: str) -> None:
    base, edits = HARMLESS[case]
    path = tmp_path / "model.py"
    path.write_text(_edited(base, edits))
    assert _states(path)[-1] == "native"


def test_run_writes_no_bypass_into_a_layer_that_cannot_run(tmp_path: Path) -> None:
    """Hunt 51's k112: ``run`` wrote its bypass into a fork-era file whose forward reads a deleted name, and ``check``
    called the output patched."""
    from conftest import cli

    path = tmp_path / "model.py"
    edited = _edited(FORK_ERA, [(CONTEXT, CONTEXT + "del get_forward_context\n")])
    path.write_text(edited)
    proc = cli("run", str(path))
    assert proc.returncode == 2 and "binds again at module level" in proc.stdout + proc.stderr
    assert path.read_text() == edited


def test_the_stand_in_fails_a_name_bound_for_a_type_checker_alone(tmp_path: Path) -> None:
    """The semantic level agrees: ``__init__`` raises NameError (the stand-in had skipped the statement)."""
    pytest.importorskip("torch")
    from test_fp8_index import semantic

    from rewriter.verify import Status

    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [(DTYPE_HELPER, TYPE_CHECKING + DTYPE_HELPER)]))
    level = semantic(path)
    assert level.status is Status.FAILED and "kv_cache_dtype_str_to_dtype" in level.reason


def test_an_import_in_a_try_is_the_import_the_stand_in_runs(tmp_path: Path) -> None:
    """Hunt 51's k21: ``ops`` imported in a ``try:`` (vLLM installed, it succeeds) had been refused as failing when run:
    the stand-in bound top-level imports alone, so the fork's own write raised NameError on it."""
    pytest.importorskip("torch")
    path = tmp_path / "model.py"
    imports = "from vllm import _custom_ops as ops\n"
    fork = re.sub(r"_fp8_kv\b", "_fp8_cache", PATCHED)  # (a fork's own names: check runs its bypass)
    path.write_text(_edited(fork, [(imports, "try:\n    " + imports + "except ImportError:\n    pass\n")]))
    assert _states(path)[-1] == "patched"
