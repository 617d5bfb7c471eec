"""Property: edits outside the sites never change the rewrite of the sites, and
are themselves kept byte for byte.

Hypothesis draws edits (comments, blank lines, assignments, functions, classes,
imports, string statements; at module level, in the classes without a site, as
new methods of the layer class, inside its methods that hold no piece of the
bypass) and applies the same edits to a fixture's model.py and to its
expected.py. The rewrite of the edited model.py must be the edited expected.py,
byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from conftest import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mutations import insert_call

from rewriter.apply import FileStatus, plan_file

VARIANTS = ("fork_era", "no_insert_kv", "half_applied", "patch_fuzz")
BYPASS_METHODS = {"__init__", "_insert_kv"}  # and the method holding the call


@dataclass(frozen=True)
class Layout:
    """Where edits may go in one fixture (the same places exist in expected.py)."""

    module_len: int
    classes: dict[str, int]  # classes without a site -> body length
    layer: str  # the class holding the insert call
    layer_methods: tuple[str, ...]
    quiet_methods: dict[str, int]  # methods of the layer class without bypass pieces -> body length


def layout(variant: str) -> Layout:
    module = cst.parse_module((FIXTURES / variant / "model.py").read_text())
    found = insert_call(module)
    classes = {
        s.name.value: len(s.body.body)
        for s in module.body
        if isinstance(s, cst.ClassDef) and s is not found.cls
    }
    methods = [s for s in found.cls.body.body if isinstance(s, cst.FunctionDef)]
    busy = BYPASS_METHODS | {found.method.name.value}
    quiet = {f.name.value: len(f.body.body) for f in methods if f.name.value not in busy}
    return Layout(
        len(module.body), classes, found.cls.name.value, tuple(f.name.value for f in methods), quiet
    )


LAYOUTS = {v: layout(v) for v in VARIANTS}

# --- what an edit inserts --------------------------------------------------------------------

comment_text = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=30)
literal = st.one_of(
    st.integers(-(10**9), 10**9),
    st.text(max_size=12),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.tuples(st.integers(0, 9), st.text(max_size=3)),
).map(repr)
number = st.integers(0, 999)
IMPORTS = ("os", "os.path", "collections", "json", "typing")


@st.composite
def lines(draw) -> list[tuple[str, str]]:
    """Comment and blank lines put before an inserted (or existing) statement."""
    return draw(st.lists(st.one_of(st.tuples(st.just("#"), comment_text), st.just(("", ""))), max_size=3))


@st.composite
def module_statement(draw) -> str:
    n, lit, doc = draw(number), draw(literal), draw(comment_text)
    return draw(
        st.sampled_from(
            [
                f"extra_{n} = {lit}\n",
                f"def extra_{n}(a, b={lit}):\n    {doc!r}\n    return a\n",
                f"class Extra{n}:\n    {doc!r}\n    x = {lit}\n\n    def m(self):\n        return self.x\n",
                f"import {draw(st.sampled_from(IMPORTS))} as extra_{n}\n",
                f"from collections import OrderedDict as extra_{n}\n",
                f"{doc!r}\n",
            ]
        )
    )


@st.composite
def class_statement(draw) -> str:
    n, lit, doc = draw(number), draw(literal), draw(comment_text)
    return draw(
        st.sampled_from(
            [
                f"extra_{n} = {lit}\n",
                f"def extra_{n}(self, a={lit}):\n    {doc!r}\n    return a\n",
                f"@staticmethod\ndef extra_static_{n}():\n    return {lit}\n",
            ]
        )
    )


@st.composite
def body_statement(draw) -> str:
    n, lit = draw(number), draw(literal)
    return draw(st.sampled_from([f"extra_{n} = {lit}\n", f"extra_{n} = ({lit},)\n", "pass\n"]))


@dataclass(frozen=True)
class Edit:
    where: tuple  # ("module", i) | ("class", name, i) | ("after-method", name) | ("method", name, i)
    lines: tuple[tuple[str, str], ...]
    statement: str | None


@st.composite
def edits(draw, variant: str) -> list[Edit]:
    lay = LAYOUTS[variant]
    out = []
    for _ in range(draw(st.integers(1, 6))):
        where_kind = draw(st.sampled_from(["module", "class", "after-method", "method"]))
        if where_kind == "class" and lay.classes:
            name = draw(st.sampled_from(sorted(lay.classes)))
            where = ("class", name, draw(st.integers(0, lay.classes[name])))
            stmt = draw(st.one_of(st.none(), class_statement()))
        elif where_kind == "after-method":
            # A whole method, comments on it: lines never attach to the layer's own methods.
            where = ("after-method", draw(st.sampled_from(lay.layer_methods)))
            stmt = draw(class_statement())
        elif where_kind == "method" and lay.quiet_methods:
            name = draw(st.sampled_from(sorted(lay.quiet_methods)))
            where = ("method", name, draw(st.integers(0, lay.quiet_methods[name])))
            stmt = draw(st.one_of(st.none(), body_statement()))
        else:
            where = ("module", draw(st.integers(0, lay.module_len)))
            stmt = draw(st.one_of(st.none(), module_statement()))
        out.append(Edit(where, tuple(draw(lines())), stmt))
    return out


# --- applying the same edits to model.py and expected.py -----------------------------------------


def _empty_lines(spec: tuple[tuple[str, str], ...], indent: bool) -> list[cst.EmptyLine]:
    return [
        cst.EmptyLine(indent=indent, comment=cst.Comment(f"# {text}"))
        if mark
        else cst.EmptyLine(indent=False)
        for mark, text in spec
    ]


def _insert(body: list, at: list[Edit], footer: list, indent: bool, index_of) -> tuple[list, list]:
    """Insert the edits of one block; ``index_of(edit)`` is where each goes in ``body``."""
    out = []
    footer = list(footer)
    for i in range(len(body) + 1):
        pending: list[cst.EmptyLine] = []
        for edit in at:
            if index_of(edit) != i:
                continue
            pending += _empty_lines(edit.lines, indent)
            if edit.statement is not None:
                for j, stmt in enumerate(cst.parse_module(edit.statement).body):
                    out.append(
                        stmt.with_changes(leading_lines=[*pending, *stmt.leading_lines]) if j == 0 else stmt
                    )
                pending = []
        if i < len(body):
            stmt = body[i]
            out.append(stmt.with_changes(leading_lines=[*pending, *stmt.leading_lines]) if pending else stmt)
        else:
            footer = [*pending, *footer]
    return out, footer


def apply_edits(source: str, variant: str, edits_: list[Edit]) -> str:
    module = cst.parse_module(source)
    layer = LAYOUTS[variant].layer
    new_body = []
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef):
            stmt = _edit_class(stmt, edits_, is_layer=stmt.name.value == layer)
        new_body.append(stmt)
    mine = [e for e in edits_ if e.where[0] == "module"]
    body, footer = _insert(new_body, mine, module.footer, False, lambda e: e.where[1])
    return module.with_changes(body=body, footer=footer).code


def _edit_class(cls: cst.ClassDef, edits_: list[Edit], is_layer: bool) -> cst.ClassDef:
    block = cls.body
    assert isinstance(block, cst.IndentedBlock)
    name = cls.name.value
    if is_layer:
        methods = {}
        body = []
        for stmt in block.body:
            if isinstance(stmt, cst.FunctionDef):
                stmt = _edit_method(stmt, edits_)
                methods[stmt.name.value] = stmt
            body.append(stmt)
        after = [e for e in edits_ if e.where[0] == "after-method"]

        def index_of(edit: Edit) -> int:
            # Right after the named method (by name: expected.py may have one more method).
            return next(i for i, s in enumerate(body) if s is methods[edit.where[1]]) + 1

        new, footer = _insert(body, after, block.footer, True, index_of)
    else:
        mine = [e for e in edits_ if e.where[0] == "class" and e.where[1] == name]
        new, footer = _insert(list(block.body), mine, block.footer, True, lambda e: e.where[2])
    return cls.with_changes(body=block.with_changes(body=new, footer=footer))


def _edit_method(func: cst.FunctionDef, edits_: list[Edit]) -> cst.FunctionDef:
    mine = [e for e in edits_ if e.where[0] == "method" and e.where[1] == func.name.value]
    if not mine:
        return func
    block = func.body
    new, footer = _insert(list(block.body), mine, block.footer, True, lambda e: e.where[2])
    return func.with_changes(body=block.with_changes(body=new, footer=footer))


# --- the property --------------------------------------------------------------------------------------


@st.composite
def edited_variant(draw) -> tuple[str, list[Edit]]:
    variant = draw(st.sampled_from(VARIANTS))
    return variant, draw(edits(variant))


def test_layouts_match_expected() -> None:
    """The anchors exist alike in model.py and expected.py."""
    for variant, lay in LAYOUTS.items():
        expected = cst.parse_module((FIXTURES / variant / "expected.py").read_text())
        assert len(expected.body) == lay.module_len, variant
        found = insert_call(expected)
        assert found.cls.name.value == lay.layer
        methods = {s.name.value for s in found.cls.body.body if isinstance(s, cst.FunctionDef)}
        assert set(lay.layer_methods) <= methods


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same examples on every CI run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(edited_variant())
def test_edits_outside_the_sites_are_kept_and_change_no_rewrite(tmp_path_factory, case) -> None:
    variant, edits_ = case
    before = apply_edits((FIXTURES / variant / "model.py").read_text(), variant, edits_)
    expected = apply_edits((FIXTURES / variant / "expected.py").read_text(), variant, edits_)
    path = Path(tmp_path_factory.mktemp("prop")) / "model.py"
    path.write_bytes(before.encode())
    result = plan_file(path)
    assert result.status is FileStatus.NEEDS_REWRITE, result.error
    assert result.new is not None and result.new.decode() == expected
