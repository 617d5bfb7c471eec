"""The ast pre-filter answers exactly as the LibCST analysis would, or not at all.

For every file here, ``plan_file`` with the pre-filter and ``plan_file`` with
LibCST alone must give the same report, human and JSON: the same sites,
lines, states, actions, reasons and pieces. The pre-filter must also actually
answer for native files (else ``check`` on them is not fast), and defer every
file that has a bypass piece, needs a rewrite or a refusal.
"""

from __future__ import annotations

import ast
import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import black
import pytest
from conftest import FIXTURES
from rich.console import Console
from test_real_wheels import PREFIX, VERSIONS, vllm_wheel

from codemods import prefilter as prefilter_module
from codemods.prefilter import prefilter
from rewriter import apply
from rewriter.apply import FileResult, plan_file
from rewriter.commands import Report
from rewriter.report import print_human, to_json
from rewriter.targets import Target

VARIANTS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
ANSWERED = {"native", "dense_only"}  # model.py: every call native or no site, no bypass name


def rendered(result: FileResult) -> tuple[str, str]:
    """The JSON report and the human report (with --all) of one file."""
    report = Report("check", [Target(result.path, "test")], [result])
    err = io.StringIO()
    print_human(report, Console(file=err, highlight=False, width=100), show_all=True)
    return json.dumps(to_json(report), indent=1), err.getvalue()


def disagreement(path: Path) -> tuple[str, str] | None:
    """None if both ways give the same reports, else (the pre-filter's, LibCST's). Where the
    pre-filter does not answer, ``plan_file`` runs the LibCST analysis either way: one
    computation, nothing to compare."""
    if prefilter(path.read_bytes()) is None:
        return None
    fast = rendered(plan_file(path))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(apply, "prefilter", lambda raw: None)
        slow = rendered(plan_file(path))
    return None if fast == slow else ("\n".join(fast), "\n".join(slow))


def assert_agree(path: Path) -> None:
    differ = disagreement(path)
    assert differ is None, f"pre-filter:\n{differ[0]}\nLibCST:\n{differ[1]}"


@pytest.mark.parametrize("name", ["model.py", "expected.py"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_agrees_on_every_fixture(variant: str, name: str) -> None:
    assert_agree(FIXTURES / variant / name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_answers_native_defers_the_rest(variant: str) -> None:
    model = (FIXTURES / variant / "model.py").read_bytes()
    expected = (FIXTURES / variant / "expected.py").read_bytes()
    assert (prefilter(model) is not None) == (variant in ANSWERED)
    if expected != model and prefilter(expected) is not None:  # a strip's result: native again
        assert {s.state.value for s in prefilter(expected)} <= {"native", "not-a-site"}
        assert_agree(FIXTURES / variant / "expected.py")


@pytest.fixture(scope="module", params=VERSIONS)
def wheel_files(request, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp(f"prefilter-{request.param}")
    with zipfile.ZipFile(vllm_wheel(request.param)) as wheel:
        names = [n for n in wheel.namelist() if n.startswith(PREFIX) and n.endswith(".py")]
        for name in names:
            wheel.extract(name, root)
    return [root / n for n in sorted(names)]


def test_agrees_on_real_vllm_files(wheel_files: list[Path]) -> None:
    for path in wheel_files:
        assert_agree(path)
    model = next(p for p in wheel_files if p.name == "model.py")
    sites = prefilter(model.read_bytes())
    assert sites is not None and "native" in {s.state.value for s in sites}


@pytest.mark.parametrize("line_length", [40, 79, 120])
@pytest.mark.parametrize("variant", sorted(ANSWERED))
def test_agrees_on_reformatted_files(variant: str, line_length: int, tmp_path: Path) -> None:
    """black moves parentheses and line breaks: the pre-filter must follow or defer."""
    for name in ("model.py", "expected.py"):
        source = (FIXTURES / variant / name).read_text()
        path = tmp_path / name
        path.write_text(black.format_str(source, mode=black.Mode(line_length=line_length)))
        assert_agree(path)


# --- layouts that ast cannot see, or sees differently from LibCST ---------------------------

FLAG = 'self._fp8_kv = "fp8" in self.kv_cache_dtype'
GUARD = "insert_via_fused = not self._fp8_kv"
CALL = "ops.fused_minimax_m3_qknorm_rope_kv_insert("
POST = "self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)"
IF_GUARD = "if not insert_via_fused:"


def edit(old: str, new: str, count: int = -1) -> Callable[[str], str]:
    def apply(source: str) -> str:
        assert old in source, old
        return source.replace(old, new, count)

    return apply


PATCHED_LAYOUTS = {
    "flag-then-semicolon": edit(FLAG, FLAG + "; pass"),
    "flag-after-semicolon": edit(FLAG, "pass; " + FLAG),
    "flag-in-if-block": edit(FLAG, "if True:\n            " + FLAG),
    "flag-in-one-line-suite": edit(FLAG, "if True: " + FLAG),
    "flag-continued-suite": edit(FLAG, "if True: \\\n            " + FLAG),
    "flag-annotated": edit(FLAG, FLAG.replace(" =", ": bool =")),
    "flag-two-targets": edit(FLAG, FLAG.replace(" =", " = self._other =")),
    "guard-after-semicolon": edit(GUARD, "pass; " + GUARD),
    "guard-continued": edit(GUARD, GUARD.replace("= not", "= \\\n            not")),
    "guard-annotated": edit(GUARD, GUARD.replace(" =", ": bool =")),
    "guard-other-value": edit(GUARD, GUARD + "\n        insert_via_fused = True"),
    "guard-in-parens": edit(GUARD, GUARD.replace("not self._fp8_kv", "(not (self._fp8_kv))")),
    "call-after-semicolon": edit("        " + CALL, "        pass; " + CALL),
    "call-parenthesized-callee": edit(CALL, "(" + CALL[:-1] + ")("),
    "post-not-guarded": edit(IF_GUARD, "if not insert_via_fused or False:"),
    "post-guarded-by-flag": edit(IF_GUARD, "if self._fp8_kv:"),
    "post-in-elif": edit(IF_GUARD, "if False:\n            pass\n        elif not insert_via_fused:"),
    "post-in-else": edit(IF_GUARD, "if False:\n            pass\n        else:"),
    "post-swapped-slots": edit(POST, POST.replace("main_slot_mapping, index", "index_slot_mapping, main")),
    "post-keyword-slots": edit(POST, POST.replace(", index_slot_mapping)", ", index=index_slot_mapping)")),
    "post-twice": edit(POST, POST + "; " + POST),
    "post-after-semicolon": edit("            " + POST, "            pass; " + POST),
    "insert-kv-reads-metadata": edit(
        "key_cache, value_cache =",
        "_ = get_forward_context().attn_metadata\n        key_cache, value_cache =",
    ),
    "insert-kv-extra-param": edit(
        "index_slot_mapping: torch.Tensor,\n    ) -> None:", "index_slot_mapping, extra,\n    ) -> None:"
    ),
    "crlf": lambda s: s.replace("\n", "\r\n"),
    "form-feed": edit("\n\nclass MiniMaxM3SparseAttention", "\n\x0c\nclass MiniMaxM3SparseAttention"),
}

NATIVE_DTYPE = "            self.kv_cache_dtype,\n        )"

NATIVE_LAYOUTS = {
    "dtype-in-parens": edit(
        NATIVE_DTYPE, NATIVE_DTYPE.replace("self.kv", "(self.kv").replace("e,", "e),", 1)
    ),
    "dtype-auto": edit(NATIVE_DTYPE, '            "auto",\n        )'),
    "dtype-auto-concatenated": edit(NATIVE_DTYPE, '            "au" "to",\n        )'),
    "dtype-auto-raw": edit(NATIVE_DTYPE, '            r"auto",\n        )'),
    "dtype-auto-bytes": edit(NATIVE_DTYPE, '            b"auto",\n        )'),
    "dtype-fstring": edit(NATIVE_DTYPE, '            f"{self.kv_cache_dtype}",\n        )'),
    "dtype-keyword": edit(NATIVE_DTYPE, "            kv_cache_dtype = self.kv_cache_dtype,\n        )"),
    "dtype-over-lines": edit(NATIVE_DTYPE, "            self.\\\n                kv_cache_dtype,\n        )"),
    "stale-flag": edit(
        "self.kv_cache = torch.tensor([])", "self.kv_cache = torch.tensor([])\n        self._fp8_kv = True"
    ),
    # a merge's post-call write without the call's slot mappings, found by its shape (it calls the
    # reshape op): the analysis refuses it, so the pre-filter must not answer native
    "stale-write-by-shape": lambda s: edit(NATIVE_DTYPE, NATIVE_DTYPE + "\n        self._store_kv(qkv, qkv, qkv)")(
        edit(
            "class MiniMaxM3SparseAttention(nn.Module):\n",
            "class MiniMaxM3SparseAttention(nn.Module):\n    def _store_kv(self, k, v, index_k, slots, index_slots):\n"
            "        ops.reshape_and_cache_flash(k, v, self.kv_cache, self.kv_cache, slots, self.kv_cache_dtype,"
            " None, None)\n\n",
        )(s)
    ),
    "star-args": edit(
        "            index_q,\n            self.kv", "            *index_q,\n            self.kv"
    ),
    "bom": lambda s: "\ufeff" + s,
    "crlf": lambda s: s.replace("\n", "\r\n"),
    "lone-cr": lambda s: s.replace("\n", "\r"),
    "form-feed": edit("\n\nclass MiniMaxM3SparseAttention", "\n\x0c\nclass MiniMaxM3SparseAttention"),
    "non-ascii-before-dtype": edit(NATIVE_DTYPE, "            self.kv_cache_dtype,  # é\n        )"),
    "non-ascii-on-dtype-line": edit(NATIVE_DTYPE, "            note='é', kv_cache_dtype=self.kv_cache_dtype, also='ü',\n        )"),
    "latin1-cookie": lambda s: "# -*- coding: latin-1 -*-\n" + s,
}


def wrap_call(before: str, after: str) -> Callable[[str], str]:
    """Put text around the last call of the fused op (the sparse layer's), found by ast."""

    def apply(source: str) -> str:
        calls = [
            n
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == CALL[4:-1]
        ]
        call = max(calls, key=lambda n: n.lineno)
        lines = source.splitlines(keepends=True)
        end = lines[call.end_lineno - 1]
        lines[call.end_lineno - 1] = end[: call.end_col_offset] + after + end[call.end_col_offset :]
        start = lines[call.lineno - 1]
        lines[call.lineno - 1] = start[: call.col_offset] + before + start[call.col_offset :]
        return "".join(lines)

    return apply


CALL_LAYOUTS = {
    "call-in-parens": wrap_call("(\n        ", ")"),
    "call-in-parens-one-line": wrap_call("(", ")"),
    "call-in-lambda": wrap_call("(lambda: ", ")()"),
    "call-assigned": wrap_call("_ = ", ""),
    "call-returned": wrap_call("return ", ""),
    "call-then-semicolon": wrap_call("", "; pass"),
    "call-in-one-line-if": wrap_call("if True: ", ""),
    "call-in-with": wrap_call("with nullcontext():\n            ", ""),
    "call-in-match": wrap_call("match 1:\n            case 1:\n                ", ""),
    "call-in-try": wrap_call("try:\n            ", "\n        finally:\n            pass"),
}
PATCHED_LAYOUTS.update(CALL_LAYOUTS)
NATIVE_LAYOUTS.update(CALL_LAYOUTS)


def write_variant(tmp_path: Path, variant: str, change: Callable[[str], str]) -> Path:
    source = (FIXTURES / variant / "model.py").read_text()
    changed = change(source)
    assert changed != source
    compile(changed.lstrip("\ufeff"), "variant", "exec")  # still Python
    path = tmp_path / "model.py"
    path.write_bytes(changed.encode("latin-1" if "latin-1" in changed[:40] else "utf-8"))
    return path


@pytest.mark.parametrize("layout", sorted(NATIVE_LAYOUTS))
def test_agrees_on_native_layouts(layout: str, tmp_path: Path) -> None:
    assert_agree(write_variant(tmp_path, "native", NATIVE_LAYOUTS[layout]))


def test_layouts_exercise_both_answers(tmp_path: Path) -> None:
    """The native layouts are not all deferred: the pre-filter answers several itself."""
    answered = deferred = 0
    for variant, layouts in (("native", NATIVE_LAYOUTS),):
        for change in layouts.values():
            raw = write_variant(tmp_path, variant, change).read_bytes()
            if prefilter(raw) is None:
                deferred += 1
            else:
                answered += 1
    assert answered >= 5 and deferred >= 5, (answered, deferred)


def test_a_wrong_prefilter_is_caught(tmp_path: Path, monkeypatch) -> None:
    """The agreement check can fail: a pre-filter that takes any dtype text as LibCST's."""
    path = write_variant(tmp_path, "native", NATIVE_LAYOUTS["dtype-in-parens"])
    assert disagreement(path) is None
    monkeypatch.setattr(prefilter_module, "_plain", lambda node, lines: True)
    assert disagreement(path) is not None
