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
