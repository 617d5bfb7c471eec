"""Spelling variants of a bypass: the same program, each piece written another way.

A fork re-spells the bypass it carries: another flag expression, another name for
the flag, the guard or the write method, a condition the other way round, the
guard inlined, the flag's test moved into a helper. Each ``Respelling`` here is a
LibCST transformation of one such kind. Applied to a fixture's ``model.py`` and to
its ``expected.py`` alike, it gives a variant and what ``run`` must write for it:
the rewrite of a re-spelled file is the re-spelled rewrite (test_variants.py).

The pieces are found here on their own, by the names the fixtures use - never with
the codemod's finders, so a bug there cannot hide itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst

FLAG, GUARD, INSERT = "_fp8_kv", "insert_via_fused", "_insert_kv"
DTYPE = "self.kv_cache_dtype"
COMPILING = "torch.compiler.is_compiling()"


def _expr(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


def _is_self_attr(node: cst.CSTNode, name: str) -> bool:
    return (
        isinstance(node, cst.Attribute)
        and isinstance(node.value, cst.Name)
        and node.value.value == "self"
        and node.attr.value == name
    )


class _RenameAttr(cst.CSTTransformer):
    """``self.<old>`` -> ``self.<new>``, and a method ``def <old>`` -> ``def <new>``."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__()
        self.old, self.new = old, new

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=cst.Name(self.new)) if _is_self_attr(original, self.old) else updated

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        return updated.with_changes(name=cst.Name(self.new)) if original.name.value == self.old else updated


class _RenameLocal(cst.CSTTransformer):
    """The local ``old`` -> ``new`` in every method (the guard lives in ``forward`` only)."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__()
        self.old, self.new = old, new

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return updated.with_changes(value=self.new) if original.value == self.old else updated


class _Replace(cst.CSTTransformer):
    """Each expression ``wanted`` accepts becomes ``make(expression)``."""

    def __init__(self, wanted: Callable[[cst.CSTNode], bool], make: Callable[[cst.BaseExpression], cst.BaseExpression]) -> None:
        super().__init__()
        self.wanted, self.make, self.count = wanted, make, 0

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):  # type: ignore[no-untyped-def]
        if isinstance(updated, cst.BaseExpression) and self.wanted(original):
            self.count += 1
            return self.make(updated)
        return updated


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def _flag_value(node: cst.CSTNode) -> bool:
    """The value of ``self._fp8_kv = <value>`` (whatever it is: a value that reads the dtype)."""
    return isinstance(node, cst.BaseExpression) and id(node) in _FLAG_VALUES


_FLAG_VALUES: set[int] = set()  # filled by _flag_by* before each replace: the flag assignments' values


def _mark_flag_values(module: cst.Module) -> None:
    class Find(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            if len(node.targets) == 1 and _is_self_attr(node.targets[0].target, FLAG):
                _FLAG_VALUES.add(id(node.value))

    _FLAG_VALUES.clear()
    module.visit(Find())


def _post_test(node: cst.CSTNode) -> bool:
    """The post-call block's test: ``not G`` or ``torch.compiler.is_compiling() or not G``."""
    text = _code(node).replace(" ", "")
    return text in (f"not{GUARD}", f"{COMPILING}ornot{GUARD}".replace(" ", ""))


def _guard_value(node: cst.CSTNode) -> bool:
    """What the guard is assigned: ``not self._fp8_kv`` (± ``not is_compiling() and``)."""
    text = _code(node).replace(" ", "")
    return text in (f"notself.{FLAG}", f"not{COMPILING}andnotself.{FLAG}".replace(" ", ""))


@dataclass(frozen=True)
class Respelling:
    """One way a fork writes a piece differently; ``applies`` to a source holding the piece."""

    name: str
    piece: str  # flag | guard | post-call | write | helper
    transform: Callable[[cst.Module], cst.Module]
    needs: tuple[str, ...] = ()  # texts the source must hold for the respelling to apply

    def applies(self, source: str) -> bool:
        """The source holds the piece, and re-spelling it changes the code."""
        return all(n in source for n in self.needs) and self(source) != source

    def __call__(self, source: str) -> str:
        return self.transform(cst.parse_module(source)).code


def _replace(wanted, make) -> Callable[[cst.Module], cst.Module]:  # type: ignore[no-untyped-def]
    def transform(module: cst.Module) -> cst.Module:
        t = _Replace(wanted, make)
        new = module.visit(t)
        assert t.count, "the piece to re-spell is not there"
        return new

    return transform


def _add_import(module: cst.Module, line: str) -> cst.Module:
    """``line`` after the module's last top-level import."""
    last = max(
        i
        for i, s in enumerate(module.body)
        if isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], (cst.Import, cst.ImportFrom))
    )
    body = list(module.body)
    body.insert(last + 1, cst.parse_statement(line))
    return module.with_changes(body=body)


def _add_function(module: cst.Module, code: str) -> cst.Module:
    """A module-level function before the first class."""
    first = next(i for i, s in enumerate(module.body) if isinstance(s, cst.ClassDef))
    body = list(module.body)
    body.insert(first, cst.parse_statement(code).with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()]))
    return module.with_changes(body=body)


def _flag_by(code: str, *, imports: str = "", function: str = "") -> Callable[[cst.Module], cst.Module]:
    def transform(module: cst.Module) -> cst.Module:
        _mark_flag_values(module)
        module = _replace(_flag_value, lambda _: _expr(code))(module)
        if imports and imports not in module.code:
            module = _add_import(module, imports)
        if function:
            module = _add_function(module, function)
        return module

    return transform


def _flag_by_method(module: cst.Module) -> cst.Module:
    """The flag's test moved into a method of the class: ``self._uses_fp8()``."""
    _mark_flag_values(module)
    module = _replace(_flag_value, lambda _: _expr("self._uses_fp8()"))(module)
    method = cst.parse_statement(f'def _uses_fp8(self) -> bool:\n    return {DTYPE}.startswith("fp8")\n')

    class AddMethod(cst.CSTTransformer):
        def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
            names = [s.name.value for s in updated.body.body if isinstance(s, cst.FunctionDef)]
            if "__init__" not in names:
                return updated
            body = list(updated.body.body)
            at = names.index("__init__") + 1
            index = [i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef)][at]
            indented = cst.parse_module(_code(method)).body[0].with_changes(leading_lines=[cst.EmptyLine()])
            body.insert(index, indented)
            return updated.with_changes(body=updated.body.with_changes(body=body))

    return module.visit(AddMethod())


def _flag_statements(code: str, *, constant: str = "", method: str = "") -> Callable[[cst.Module], cst.Module]:
    """The flag's one assignment replaced by statements that reach the same value another way
    (``code``, with ``{F}`` for the flag and ``{D}`` for the dtype); ``constant``: a module-level
    assignment it reads; ``method``: a method of the class it calls."""

    def transform(module: cst.Module) -> cst.Module:
        class Flag(cst.CSTTransformer):
            count = 0

            def leave_SimpleStatementLine(self, original, updated):  # type: ignore[no-untyped-def]
                small = original.body[0]
                if not (isinstance(small, cst.Assign) and _is_self_attr(small.targets[0].target, FLAG)):
                    return updated
                self.count += 1
                text = code.format(F=f"self.{FLAG}", D=DTYPE)
                body = cst.parse_module(text).body
                if not body:  # the flag is no longer assigned (a property is the flag)
                    return cst.RemoveFromParent()
                return cst.FlattenSentinel([body[0].with_changes(leading_lines=original.leading_lines), *body[1:]])

            def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
                names = [s.name.value for s in updated.body.body if isinstance(s, cst.FunctionDef)]
                if not method or "__init__" not in names:
                    return updated
                added = cst.parse_module(method.format(F=f"self.{FLAG}", D=DTYPE)).body[0]
                return updated.with_changes(
                    body=updated.body.with_changes(body=[*updated.body.body, added.with_changes(leading_lines=[cst.EmptyLine()])])
                )

        t = Flag()
        new = module.visit(t)
        assert t.count, "the flag's assignment is not there"
        if constant:
            new = _add_import(new, constant)
        return new

    return transform


def _compile_test(imports: str, spelled: str) -> Callable[[cst.Module], cst.Module]:
    """``torch.compiler.is_compiling()`` imported and spelled otherwise."""

    def transform(module: cst.Module) -> cst.Module:
        new = _replace(lambda n: _code(n) == COMPILING, lambda _: _expr(spelled))(module)
        return _add_import(new, imports)

    return transform


def _rename_attr(old: str, new: str) -> Callable[[cst.Module], cst.Module]:
    return lambda module: module.visit(_RenameAttr(old, new))


def _rename_local(old: str, new: str) -> Callable[[cst.Module], cst.Module]:
    return lambda module: module.visit(_RenameLocal(old, new))


def _post(make: Callable[[str], str]) -> Callable[[cst.Module], cst.Module]:
    """The post-call test rewritten: ``make(the test's code)``."""
    return _replace(_post_test, lambda node: _expr(make(_code(node))))


def _swap_or(test: str) -> str:
    first, sep, second = test.partition(" or ")
    return f"{second} or {first}" if sep else test


def _is_false(test: str) -> str:
    return test.replace(f"not {GUARD}", f"{GUARD} is False")


def _eq_false(test: str) -> str:
    return test.replace(f"not {GUARD}", f"{GUARD} == False")


def _inline_guard(module: cst.Module) -> cst.Module:
    """The guard inlined: ``G = not self.F`` gone, ``X if G else None`` -> ``None if self.F else X``,
    ``if not G:`` -> ``if self.F:`` (the seed's form only: the guard is ``not self._fp8_kv``)."""

    class Inline(cst.CSTTransformer):
        def leave_IfExp(self, original: cst.IfExp, updated: cst.IfExp) -> cst.BaseExpression:
            if isinstance(original.test, cst.Name) and original.test.value == GUARD:
                return updated.with_changes(test=_expr(f"self.{FLAG}"), body=updated.orelse, orelse=updated.body)
            return updated

        def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
            if _code(original.test).replace(" ", "") == f"not{GUARD}":
                return updated.with_changes(test=_expr(f"self.{FLAG}"))
            return updated

        def leave_SimpleStatementLine(self, original, updated):  # type: ignore[no-untyped-def]
            small = original.body[0]
            if isinstance(small, cst.Assign) and _code(small.targets[0].target) == GUARD:
                return cst.RemoveFromParent()
            return updated

    return module.visit(Inline())


def _guard_demorgan(module: cst.Module) -> cst.Module:
    """``not is_compiling() and not self.F`` -> ``not (is_compiling() or self.F)``;
    ``not self.F`` -> ``self.F is False``."""

    def make(node: cst.BaseExpression) -> cst.BaseExpression:
        text = _code(node)
        if COMPILING in text:
            return _expr(f"not ({COMPILING} or self.{FLAG})")
        return _expr(f"self.{FLAG} is False")

    return _replace(_guard_value, make)(module)


def _guard_if_else(module: cst.Module) -> cst.Module:
    """``G = <value>`` -> ``if <value>: G = True`` / ``else: G = False`` (the guard decided by an ``if``)."""

    class Guard(cst.CSTTransformer):
        count = 0

        def leave_SimpleStatementLine(self, original, updated):  # type: ignore[no-untyped-def]
            small = original.body[0]
            if not (isinstance(small, cst.Assign) and _guard_value(small.value)):
                return updated
            self.count += 1
            name, value = _code(small.targets[0].target), _code(small.value)
            text = f"if {value}:\n    {name} = True\nelse:\n    {name} = False\n"
            return cst.parse_module(text).body[0].with_changes(leading_lines=original.leading_lines)

    t = Guard()
    new = module.visit(t)
    assert t.count, "the guard's assignment is not there"
    return new


def _guard_getattr(module: cst.Module) -> cst.Module:
    """The guard reads the flag as ``getattr(self, "F", False)`` (the fork guarding a layer
    built before the flag existed)."""
    return _replace(_guard_value, lambda n: _expr(_code(n).replace(f"self.{FLAG}", f'getattr(self, "{FLAG}", False)')))(module)


NATIVE_DTYPE = "            index_q,\n            self.kv_cache_dtype,\n        )"


def _dtype_via_local(module: cst.Module) -> cst.Module:
    """A native call's dtype handed on through a local the method sets first."""
    source = module.code
    at = source.index(NATIVE_DTYPE)
    source = source[:at] + NATIVE_DTYPE.replace("self.kv_cache_dtype", "cache_dtype") + source[at + len(NATIVE_DTYPE) :]
    lines = source[:at].split("\n")
    method = max(i for i, line in enumerate(lines) if line.startswith("    def "))
    body = next(i for i in range(method, len(lines)) if lines[i].rstrip().endswith(":")) + 1
    lines.insert(body, "        cache_dtype = self.kv_cache_dtype")  # the method's first statement
    return cst.parse_module("\n".join(lines) + source[at:])


def _init_in_base(module: cst.Module) -> cst.Module:
    """The layer's ``__init__`` moved into a base class of the same file, which the layer
    inherits it from (its other methods stay where they are)."""
    body = list(module.body)
    at = next(i for i, s in enumerate(body) if isinstance(s, cst.ClassDef) and s.name.value == "MiniMaxM3SparseAttention")
    layer = body[at]
    init = next(s for s in layer.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__")
    base = cst.ClassDef(
        name=cst.Name("_SparseAttentionInit"),
        body=cst.IndentedBlock([init.with_changes(leading_lines=[])]),
        bases=[cst.Arg(_expr("nn.Module"))],
        leading_lines=layer.leading_lines,
    )
    kept = [s for s in layer.body.body if s is not init]
    bases = [cst.Arg(_expr("_SparseAttentionInit"), comma=layer.bases[0].comma), *layer.bases[1:]]
    blank = [cst.EmptyLine(), cst.EmptyLine()]
    layer = layer.with_changes(bases=bases, body=layer.body.with_changes(body=kept), leading_lines=blank)
    return module.with_changes(body=[*body[:at], base, layer, *body[at + 1 :]])


# Every re-spelling, by the piece it re-spells. ``needs``: the text it works on.
RESPELLINGS = (
    Respelling("flag-startswith", "flag", _flag_by(f'{DTYPE}.startswith("fp8")'), (f"self.{FLAG} = ",)),
    # (false for "bfloat16", vLLM's other MiniMax-M3 cache dtype, too: `!= "auto"` alone is no flag)
    Respelling("flag-not-auto", "flag", _flag_by(f'{DTYPE} not in ("auto", "bfloat16")'), (f"self.{FLAG} = ",)),
    Respelling("flag-membership", "flag", _flag_by(f'{DTYPE} in ("fp8", "fp8_e4m3", "fp8_e5m2")'), (f"self.{FLAG} = ",)),
    Respelling(
        "flag-vllm-helper",
        "flag",
        _flag_by(f"is_quantized_kv_cache({DTYPE})", imports="from vllm.utils.torch_utils import is_quantized_kv_cache"),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-module-helper",
        "helper",
        _flag_by(
            f"_uses_fp8({DTYPE})",
            function='def _uses_fp8(kv_cache_dtype: str) -> bool:\n    return "fp8" in kv_cache_dtype\n',
        ),
        (f"self.{FLAG} = ",),
    ),
    Respelling("flag-method-helper", "helper", _flag_by_method, (f"self.{FLAG} = ",)),
    # the flag's value reached by other statements of __init__ (and of the class)
    Respelling(
        "flag-if-else", "flag", _flag_statements('if "fp8" in {D}:\n    {F} = True\nelse:\n    {F} = False\n'), (f"self.{FLAG} = ",)
    ),
    Respelling(
        "flag-default-then-set",
        "flag",
        _flag_statements('{F} = False\nif {D} not in ("auto", "bfloat16"):\n    {F} = True\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-or-assigned", "flag", _flag_statements('{F} = False\n{F} |= "fp8" in {D}\n'), (f"self.{FLAG} = ",)
    ),
    Respelling(
        "flag-in-try",
        "flag",
        _flag_statements('try:\n    {F} = "fp8" in {D}\nexcept Exception:\n    {F} = False\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-by-loop",
        "flag",
        _flag_statements('{F} = False\nfor dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):\n    if {D} == dtype:\n        {F} = True\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-by-match",
        "flag",
        _flag_statements('match {D}:\n    case "auto" | "bfloat16":\n        {F} = False\n    case _:\n        {F} = True\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-by-walrus",
        "flag",
        _flag_statements('if (quantized := "fp8" in {D}):\n    pass\n{F} = quantized\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-by-while",
        "flag",
        _flag_statements('{F} = False\nwhile not {F} and {D}.startswith("fp8"):\n    {F} = True\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-deleted-then-set", "flag", _flag_statements('{F} = None\ndel {F}\n{F} = "fp8" in {D}\n'), (f"self.{FLAG} = ",)
    ),
    Respelling(
        "flag-then-registered",
        "flag",
        _flag_statements('_LAYERS[id(self)] = self\n{F} = "fp8" in {D}\n', constant="_LAYERS = {}"),
        (f"self.{FLAG} = ",),
    ),
    Respelling("flag-via-local", "flag", _flag_statements('quantized = {D}.startswith("fp8")\n{F} = quantized\n'), (f"self.{FLAG} = ",)),
    Respelling(
        "flag-module-constant",
        "flag",
        _flag_statements("{F} = {D} in FP8_CACHE_DTYPES\n", constant='FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-set-by-method",
        "helper",
        _flag_statements("self._set_cache_mode()\n", method='def _set_cache_mode(self):\n    {F} = "fp8" in {D}\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-by-staticmethod",
        "helper",
        _flag_statements("{F} = self._is_fp8({D})\n", method='@staticmethod\ndef _is_fp8(dtype):\n    return "fp8" in dtype\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-by-property",
        "flag",
        _flag_statements("", method=f'@property\ndef {FLAG}(self) -> bool:\n    return "fp8" in {{D}}\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling(
        "flag-by-any",
        "flag",
        _flag_statements('{F} = any({D} == dtype for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"))\n'),
        (f"self.{FLAG} = ",),
    ),
    Respelling("init-in-base", "helper", _init_in_base, ("class MiniMaxM3SparseAttention(nn.Module",)),
    # the compile test imported and spelled otherwise
    Respelling("compile-from-import", "compile", _compile_test("from torch.compiler import is_compiling", "is_compiling()"), (COMPILING,)),
    Respelling("compile-dynamo-alias", "compile", _compile_test("import torch._dynamo as dynamo", "dynamo.is_compiling()"), (COMPILING,)),
    Respelling("compile-module-alias", "compile", _compile_test("from torch import compiler as tc", "tc.is_compiling()"), (COMPILING,)),
    Respelling("compile-dynamo-test", "compile", _compile_test("import torch", "torch.compiler.is_dynamo_compiling()"), (COMPILING,)),
    Respelling("compile-utils-alias", "compile", _compile_test("from torch._utils import is_compiling", "is_compiling()"), (COMPILING,)),
    Respelling("native-dtype-via-local", "dtype", _dtype_via_local, (NATIVE_DTYPE,)),
    Respelling("flag-renamed", "flag", _rename_attr(FLAG, "_kv_is_fp8"), (f"self.{FLAG}",)),
    Respelling("guard-renamed", "guard", _rename_local(GUARD, "use_fused_insert"), (GUARD,)),
    Respelling("guard-demorgan", "guard", _guard_demorgan, (f"{GUARD} = not",)),
    Respelling("guard-reads-by-getattr", "guard", _guard_getattr, (f"{GUARD} = not",)),
    Respelling("guard-by-if-else", "guard", _guard_if_else, (f"{GUARD} = not",)),
    Respelling(
        "flag-and-guard-renamed",
        "flag",
        lambda m: _rename_local(GUARD, "fused_writes")(_rename_attr(FLAG, "fp8_cache")(m)),
        (f"self.{FLAG}", GUARD),
    ),
    Respelling("post-or-swapped", "post-call", _post(_swap_or), (f"{COMPILING} or not {GUARD}",)),
    Respelling("post-is-false", "post-call", _post(_is_false), (f"not {GUARD}:",)),
    Respelling("post-eq-false", "post-call", _post(_eq_false), (f"not {GUARD}:",)),
    Respelling("post-is-false-swapped", "post-call", _post(lambda t: _swap_or(_is_false(t))), (f"{COMPILING} or not {GUARD}",)),
    Respelling("write-renamed", "write", _rename_attr(INSERT, "_write_kv_fp8"), (f"self.{INSERT}(",)),
    Respelling("guard-inlined", "guard", _inline_guard, (f"{GUARD} = not self.{FLAG}\n",)),
    Respelling(
        "all-renamed",
        "flag",
        lambda m: _rename_attr(INSERT, "_store_kv")(_rename_local(GUARD, "fused")(_rename_attr(FLAG, "_quant_kv")(m))),
        (f"self.{FLAG}", GUARD, f"self.{INSERT}("),
    ),
)


# The fixtures re-spelled, each with the outcome its rewrite has: the compile-aware forms
# (wired, with its flag set by vLLM's helper, the guard lost) and the seed's own form
# (complete, and half-applied).
FORMS = {
    "compiled_native": "outdated -> upgrade",
    "compiled_native_vllm_flag": "outdated -> upgrade",
    "compiled_native_lost_guard": "half-applied -> complete",
    "seed_form": "outdated -> upgrade",
    "half_applied": "half-applied -> complete",
}


def variants(model: str) -> list[Respelling]:
    """The re-spellings that apply to a fixture's model."""
    return [r for r in RESPELLINGS if r.applies(model)]


# Outcomes, (form, [respelling], outcome, reason), filled by test_variants and printed by
# conftest's terminal summary: right / refused / wrong / harmful advice.
RESULTS: list[tuple[str, list[str], str, str]] = []
