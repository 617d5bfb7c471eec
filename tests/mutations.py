"""Semantics-preserving mutations of a model file, built with LibCST.

Each mutation rewrites the source the way a fork, a formatter or a refactor
might - by structure, never by replacing fixed strings - and keeps what the
program does: the mutation corpus (test_mutation_corpus.py) checks that the
codemod still rewrites every variant correctly or refuses it.

The insert call is found here on its own (``_InsertCallFinder``), not with the
codemod's finders, so a bug there cannot hide itself.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import black
import libcst as cst
import libcst.matchers as m

FUSED_OP = "fused_minimax_m3_qknorm_rope_kv_insert"
# The fork-era op's parameters by position (vllm._custom_ops names, as
# verify's reference op (refops) takes them: keyword calls must bind there too).
SCHEMA = (
    "qkv",
    "q_norm_weight",
    "k_norm_weight",
    "cos_sin_cache",
    "positions",
    "num_heads",
    "num_kv_heads",
    "rotary_dim",
    "eps",
    "index_q_norm_weight",
    "index_k_norm_weight",
    "num_index_heads",
    "slot_mapping",
    "index_slot_mapping",
    "kv_cache",
    "index_cache",
    "block_size",
    "q_out",
    "index_q_out",
)
KV_CACHE, INDEX_CACHE, SLOT_MAPPING, INDEX_SLOT_MAPPING = 14, 15, 12, 13
# Outcomes of the mutation corpus, (fixture, mutation kinds, outcome, reason),
# filled by test_mutation_corpus and printed by conftest's terminal summary.
RESULTS: list[tuple[str, list[str], str, str]] = []

# Names the rewrite generates: locals renamed to these force it to pick fresh ones.
GENERATED_NAMES = ("k", "v", "kv", "k0", "ik0", "index_k", "insert_via_fused", "scale", "idx_cache")


# --- finding the insert call -------------------------------------------------------------------


def is_fused_call(node: cst.CSTNode) -> bool:
    return m.matches(node, m.Call(func=m.Name(FUSED_OP) | m.Attribute(attr=m.Name(FUSED_OP))))


def bind(call: cst.Call) -> dict[int, cst.Arg]:
    """Each argument by its parameter's position."""
    bound, position = {}, 0
    for arg in call.args:
        if arg.keyword is None:
            bound[position] = arg
            position += 1
        else:
            bound[SCHEMA.index(arg.keyword.value)] = arg
    return bound


def is_insert_call(node: cst.CSTNode) -> bool:
    if not is_fused_call(node):
        return False
    cache = bind(node).get(KV_CACHE)  # type: ignore[arg-type]
    return cache is not None and not m.matches(cache.value, m.Name("None"))


@dataclass
class InsertCall:
    cls: cst.ClassDef
    method: cst.FunctionDef
    statement: cst.SimpleStatementLine
    call: cst.Call
    path: list[cst.CSTNode]  # from the module down to (not including) the statement


_SUITES = (cst.BaseSuite, cst.BaseCompoundStatement, cst.Else, cst.ExceptHandler, cst.Finally)


def statements(node: cst.CSTNode, path: list[cst.CSTNode]) -> Iterator[tuple[cst.SimpleStatementLine, list]]:
    """Every simple statement under ``node`` and the nodes on the way to it
    (expressions are not entered: this is what keeps the mutations fast)."""
    for child in node.children:
        if isinstance(child, cst.SimpleStatementLine):
            yield child, path
        elif isinstance(child, _SUITES):
            yield from statements(child, [*path, child])


def insert_call(module: cst.Module) -> InsertCall:
    found = []
    for stmt, path in statements(module, [module]):
        if len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr) and is_insert_call(stmt.body[0].value):
            cls = next(n for n in reversed(path) if isinstance(n, cst.ClassDef))
            method = next(n for n in reversed(path) if isinstance(n, cst.FunctionDef))
            found.append(InsertCall(cls, method, stmt, stmt.body[0].value, path))  # type: ignore[arg-type]
    (one,) = found
    return one


class _Along(cst.CSTTransformer):
    """Visit only the nodes of ``along`` (by identity) and everything under ``under``."""

    def __init__(self, along: Iterable[cst.CSTNode], under: Iterable[cst.CSTNode] = ()) -> None:
        super().__init__()
        self._along = {id(n) for n in along}
        self._under = {id(n) for n in under}
        self._depth = 0

    def on_visit(self, node: cst.CSTNode) -> bool:
        if id(node) in self._under:
            self._depth += 1
        if self._depth or id(node) in self._along:
            return super().on_visit(node)
        return False

    def on_leave(self, original, updated):  # type: ignore[no-untyped-def]
        result = super().on_leave(original, updated)
        if id(original) in self._under:
            self._depth -= 1
        return result


class _Swap(_Along):
    def __init__(self, path: list[cst.CSTNode], old: cst.CSTNode, new) -> None:  # type: ignore[no-untyped-def]
        super().__init__([*path, old])
        self.old, self.new = old, new

    def on_leave(self, original, updated):  # type: ignore[no-untyped-def]
        if original is self.old:
            return cst.FlattenSentinel(self.new) if isinstance(self.new, list) else self.new
        return super().on_leave(original, updated)


def swap(root: cst.CSTNode, path: list[cst.CSTNode], old: cst.CSTNode, new) -> cst.CSTNode:  # type: ignore[no-untyped-def]
    """``root`` with ``old`` (reached through ``path``) replaced by ``new`` (a node or a list of statements)."""
    return root.visit(_Swap(path, old, new))


def _call_path(found: InsertCall) -> list[cst.CSTNode]:
    return [*found.path, found.statement, found.statement.body[0]]


def _method(cls: cst.ClassDef, name: str) -> cst.FunctionDef:
    return next(s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name)


def _methods(cls: cst.ClassDef) -> list[cst.FunctionDef]:
    return [s for s in cls.body.body if isinstance(s, cst.FunctionDef)]


def _class(module: cst.Module, name: str) -> cst.ClassDef:
    return next(s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == name)


# --- layout -------------------------------------------------------------------------------------


def reformat(source: str, line_length: int, magic_trailing_comma: bool = True) -> str:
    """black at another line length (without magic trailing commas: calls collapse onto one line)."""
    mode = black.Mode(line_length=line_length, magic_trailing_comma=magic_trailing_comma)
    return black.format_str(source, mode=mode)


def _comment(text: str) -> cst.EmptyLine:
    return cst.EmptyLine(indent=True, whitespace=cst.SimpleWhitespace(""), comment=cst.Comment(f"# {text}"))


def _blank() -> cst.EmptyLine:
    return cst.EmptyLine(indent=False, whitespace=cst.SimpleWhitespace(""))


def _call_layout(call: cst.Call, comments: bool, blanks: bool) -> cst.Call:
    """A trailing comment after every argument of the call, and a comment line
    or a blank line between arguments."""
    args = []
    for i, arg in enumerate(call.args):
        if not isinstance(arg.comma, cst.Comma):
            args.append(arg)
            continue
        ws = arg.comma.whitespace_after
        if not isinstance(ws, cst.ParenthesizedWhitespace):
            ws = cst.ParenthesizedWhitespace(
                first_line=cst.TrailingWhitespace(),
                empty_lines=[],
                indent=True,
                last_line=cst.SimpleWhitespace("    "),
            )
        first = ws.first_line
        if comments and first.comment is None:
            first = first.with_changes(
                whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(f"# argument {i}")
            )
        extra = []
        if comments:
            extra.append(_comment(f"{FUSED_OP}(qkv, kv_cache=self.kv_cache) - a comment, not a call"))
        if blanks:
            extra.append(_blank())
        ws = ws.with_changes(first_line=first, empty_lines=[*ws.empty_lines, *extra])
        args.append(arg.with_changes(comma=arg.comma.with_changes(whitespace_after=ws)))
    return call.with_changes(args=args)


class _StatementLayout(cst.CSTTransformer):
    """A comment line and/or a blank line before every statement of the methods of one class."""

    def __init__(self, class_name: str, comments: bool, blanks: bool) -> None:
        super().__init__()
        self.class_name, self.comments, self.blanks = class_name, comments, blanks
        self.inside = 0

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, (cst.SimpleStatementLine, cst.BaseExpression)):
            return False  # statements are changed from their block; nothing below them
        return super().on_visit(node)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if node.name.value == self.class_name:
            self.inside += 1
        return bool(self.inside)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        if original.name.value == self.class_name:
            self.inside -= 1
        return updated

    def _lines(self, stmt: cst.BaseStatement, n: int) -> list[cst.EmptyLine]:
        extra = []
        if self.blanks:
            extra.append(_blank())
        if self.comments:
            extra.append(_comment(f"mutation note {n}: self.kv_cache is passed as kv_cache below"))
        return [*stmt.leading_lines, *extra]

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        if not self.inside:
            return updated
        body = []
        for n, stmt in enumerate(updated.body):
            if isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)) and not _is_docstring(
                stmt
            ):
                stmt = stmt.with_changes(leading_lines=self._lines(stmt, n))
            body.append(stmt)
        return updated.with_changes(body=body)


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return m.matches(
        stmt, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])
    )


def call_comments(module: cst.Module) -> cst.Module:
    found = insert_call(module)
    return swap(module, _call_path(found), found.call, _call_layout(found.call, comments=True, blanks=False))


def call_blank_lines(module: cst.Module) -> cst.Module:
    found = insert_call(module)
    return swap(module, _call_path(found), found.call, _call_layout(found.call, comments=False, blanks=True))


def method_comments(module: cst.Module) -> cst.Module:
    name = insert_call(module).cls.name.value
    return module.visit(_StatementLayout(name, comments=True, blanks=False))


def method_blank_lines(module: cst.Module) -> cst.Module:
    name = insert_call(module).cls.name.value
    return module.visit(_StatementLayout(name, comments=False, blanks=True))


# --- argument style --------------------------------------------------------------------------------


def _arg_style(call: cst.Call, first_keyword: int, reverse_keywords: bool) -> cst.Call:
    """Rebind the call's arguments: positional below ``first_keyword``, keywords
    from there (in schema order, or reversed). Each position keeps its own comma
    and the comments after it, so the layout stays as it was."""
    bound = bind(call)
    assert sorted(bound) == list(range(len(bound))), "a gap in the arguments"
    order = sorted(bound)
    positional = [i for i in order if i < first_keyword]
    keywords = [i for i in order if i >= first_keyword]
    if reverse_keywords:
        keywords.reverse()
    args = []
    for slot, index in zip(call.args, positional + keywords, strict=True):
        value = bound[index].value
        if index < first_keyword:
            new = cst.Arg(value=value)
        else:
            equal = cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
            )
            new = cst.Arg(value=value, keyword=cst.Name(SCHEMA[index]), equal=equal)
        args.append(new.with_changes(comma=slot.comma, whitespace_after_arg=slot.whitespace_after_arg))
    return call.with_changes(args=args)


def args_style(module: cst.Module, first_keyword: int, reverse_keywords: bool = False) -> cst.Module:
    found = insert_call(module)
    return swap(
        module, _call_path(found), found.call, _arg_style(found.call, first_keyword, reverse_keywords)
    )


# --- names -----------------------------------------------------------------------------------------


def _target_names(node: cst.CSTNode) -> Iterable[str]:
    if isinstance(node, cst.Name):
        yield node.value
    elif isinstance(node, (cst.Tuple, cst.List)):
        for el in node.elements:
            yield from _target_names(el.value)
    elif isinstance(node, cst.StarredElement):
        yield from _target_names(node.value)


class _Stores(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: list[str] = []
        self.used: set[str] = set()

    def _add(self, target: cst.CSTNode) -> None:
        for name in _target_names(target):
            if name not in self.names:
                self.names.append(name)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._add(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._add(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._add(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._add(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self._add(node.name)

    def visit_Name(self, node: cst.Name) -> None:
        self.used.add(node.value)


def local_names(func: cst.FunctionDef) -> tuple[list[str], set[str]]:
    """(locals the function assigns, parameters excluded, in order; every name it mentions)."""
    stores = _Stores()
    func.body.visit(stores)
    params = {
        p.name.value for p in (*func.params.params, *func.params.kwonly_params, *func.params.posonly_params)
    }
    return [n for n in stores.names if n not in params], stores.used | params


class _RenameVariables(cst.CSTTransformer):
    """Rename variables by ``self.mapping``; attribute names and keywords are not variables."""

    mapping: dict[str, str]

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return updated.with_changes(value=self.mapping.get(original.value, original.value))

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        return updated.with_changes(keyword=original.keyword)


class _Rename(_Along, _RenameVariables):
    """Rename variables inside one function."""

    def __init__(self, path: list[cst.CSTNode], func: cst.FunctionDef, mapping: dict[str, str]) -> None:
        super().__init__(path, under=[func.body])
        self.mapping = mapping


def _fresh_names(scheme: str, locals_: list[str], used: set[str]) -> dict[str, str]:
    taken = set(used)
    mapping = {}
    pool = {
        "suffix": (f"{n}_renamed" for n in locals_),
        "short": (f"{a}{b}" for b in ("", "1", "2", "3") for a in "abcdefghjmnprstuwxyz"),
        "collide": iter(GENERATED_NAMES + tuple(f"{n}_x" for n in locals_)),
    }[scheme]
    for name in locals_:
        for candidate in pool:
            if candidate not in taken:
                mapping[name] = candidate
                taken.add(candidate)
                break
    return mapping


def rename_locals(module: cst.Module, scheme: str, every_method: bool = False) -> cst.Module:
    """Rename the locals of the method holding the call (or of every method of its class)."""
    found = insert_call(module)
    class_name = found.cls.name.value
    names = [f.name.value for f in _methods(found.cls)] if every_method else [found.method.name.value]
    for name in names:
        cls = _class(module, class_name)
        func = _method(cls, name)
        locals_, used = local_names(func)
        mapping = _fresh_names(scheme, locals_, used)
        if mapping:
            module = module.visit(_Rename([module, cls, cls.body, func], func, mapping))
    return module


def _walk(node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    yield node
    for child in node.children:
        yield from _walk(child)


class _RenameGlobal(_RenameVariables):
    def __init__(self, mapping: dict[str, str]) -> None:
        super().__init__()
        self.mapping = mapping


def rename_class(module: cst.Module, every_class: bool = False) -> cst.Module:
    """Rename the class holding the call (or every class), and every reference to it."""
    if every_class:
        names = [s.name.value for s in module.body if isinstance(s, cst.ClassDef)]
    else:
        names = [insert_call(module).cls.name.value]
    code = module.code
    mapping = {}
    for name in names:
        new = f"Fork{name}Renamed"
        assert new not in code
        mapping[name] = new
    return module.visit(_RenameGlobal(mapping))


# --- structure -------------------------------------------------------------------------------------


REORDERINGS = ("reverse", "rotate", "call-method-first", "call-method-last", "shuffle")


def permute(names: list[str], call_method: str, order: str) -> list[str]:
    """The method order ``order`` gives (on names, so the corpus can drop no-ops unbuilt)."""
    names = list(names)
    if order == "reverse":
        return names[::-1]
    if order == "rotate":
        return names[1:] + names[:1]
    if order == "call-method-first":
        return sorted(names, key=lambda n: n != call_method)
    if order == "call-method-last":
        return sorted(names, key=lambda n: n == call_method)
    if order == "shuffle":
        random.Random(5).shuffle(names)
        return names
    raise ValueError(order)


def reorder_methods(module: cst.Module, order: str) -> cst.Module:
    """Permute the methods of the class holding the call; other statements stay in place."""
    found = insert_call(module)
    cls = found.cls
    body = list(cls.body.body)
    slots = [i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef)]
    by_name = {body[i].name.value: body[i] for i in slots}
    names = permute(list(by_name), found.method.name.value, order)
    for i, name in zip(slots, names, strict=True):
        body[i] = by_name[name]  # with its own leading comments and blank lines
    new_cls = cls.with_changes(body=cls.body.with_changes(body=body))
    return swap(module, [module], cls, new_cls)  # type: ignore[return-value]


HELPER = "_norm_rope_insert"


def move_call_to_helper(module: cst.Module, rebind_aliases: bool = False) -> cst.Module:
    """Move the insert call into a new method of its class, called where it was.

    Locals the call reads become the helper's parameters; with ``rebind_aliases``
    a local that only aliases a ``self.`` attribute is assigned again in the
    helper instead (``kv_cache = self.kv_cache``).
    """
    found = insert_call(module)
    locals_, _ = local_names(found.method)
    params = [p.name.value for p in found.method.params.params if p.name.value != "self"]
    variables = set(locals_) | set(params)
    read = []
    for node in _walk(found.call):
        if isinstance(node, cst.Name) and node.value in variables and node.value not in read:
            read.append(node.value)
    # Attribute names and keywords are Name nodes too; keep only names read as variables.
    read = [n for n in read if _reads_variable(found.call, n)]
    aliases = _self_aliases(found.method) if rebind_aliases else {}
    passed = [n for n in read if n not in aliases]
    prologue = [
        cst.parse_statement(f"{n} = {cst.Module([]).code_for_node(aliases[n])}") for n in read if n in aliases
    ]
    helper = cst.FunctionDef(
        name=cst.Name(HELPER),
        params=cst.Parameters(params=[cst.Param(cst.Name(n)) for n in ["self", *passed]]),
        body=cst.IndentedBlock(body=[*prologue, found.statement]),
        leading_lines=[_blank()],
    )
    replacement = cst.parse_statement(f"self.{HELPER}({', '.join(passed)})")
    inside = found.path[found.path.index(found.method) :]
    method = swap(found.method, inside, found.statement, replacement)
    body = []
    for stmt in found.cls.body.body:
        if stmt is found.method:
            body += [method, helper]
        else:
            body.append(stmt)
    new_cls = found.cls.with_changes(body=found.cls.body.with_changes(body=body))
    return swap(module, [module], found.cls, new_cls)  # type: ignore[return-value]


def _reads_variable(call: cst.Call, name: str) -> bool:
    tree = ast.parse(cst.Module([]).code_for_node(call).strip(), mode="eval")
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(tree))


def _self_aliases(func: cst.FunctionDef) -> dict[str, cst.BaseExpression]:
    """Locals assigned exactly once, to ``self.<attribute chain>``."""
    values: dict[str, list[cst.BaseExpression]] = {}
    for node in _walk(func.body):
        if (
            isinstance(node, cst.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0].target, cst.Name)
        ):
            values.setdefault(node.targets[0].target.value, []).append(node.value)
    out = {}
    for name, vals in values.items():
        if len(vals) == 1 and _is_self_chain(vals[0]):
            out[name] = vals[0]
    return out


def _is_self_chain(node: cst.BaseExpression) -> bool:
    while isinstance(node, cst.Attribute):
        node = node.value
    return m.matches(node, m.Name("self"))


def alias_caches(module: cst.Module) -> cst.Module:
    """Pass the caches through locals (``main_cache = self.kv_cache``) set just before the call."""
    found = insert_call(module)
    _, used = local_names(found.method)
    bound = bind(found.call)
    lines, replace = [], {}
    for index, name in ((KV_CACHE, "main_cache"), (INDEX_CACHE, "side_cache")):
        arg = bound[index]
        guarded = isinstance(arg.value, cst.IfExp)  # `X if guard else None`: alias X
        cache = arg.value.body if guarded else arg.value
        if not isinstance(cache, cst.Attribute) or not _is_self_chain(cache):
            continue
        while name in used:
            name += "_"
        lines.append(cst.parse_statement(f"{name} = {cst.Module([]).code_for_node(cache)}"))
        value = arg.value.with_changes(body=cst.Name(name)) if guarded else cst.Name(name)
        replace[id(arg)] = arg.with_changes(value=value)
    assert lines, "no cache argument to alias"
    call = found.call.with_changes(args=[replace.get(id(a), a) for a in found.call.args])
    expr = found.statement.body[0].with_changes(value=call)
    lines[0] = lines[0].with_changes(leading_lines=found.statement.leading_lines)
    statement = found.statement.with_changes(body=[expr], leading_lines=[])
    return swap(module, found.path, found.statement, [*lines, statement])  # type: ignore[return-value]


def inline_slot_locals(module: cst.Module) -> cst.Module:
    """Pass the slot mappings as the expressions their locals hold (``maps[self.layer_name]``)."""
    found = insert_call(module)
    values: dict[str, list[cst.BaseExpression]] = {}
    for node in _walk(found.method.body):
        if (
            isinstance(node, cst.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0].target, cst.Name)
        ):
            values.setdefault(node.targets[0].target.value, []).append(node.value)
    bound = bind(found.call)
    replace = {}
    for index in (SLOT_MAPPING, INDEX_SLOT_MAPPING):
        arg = bound[index]
        if isinstance(arg.value, cst.Name) and len(values.get(arg.value.value, [])) == 1:
            value = values[arg.value.value][0]
            if isinstance(value, cst.Subscript):
                replace[id(arg)] = arg.with_changes(value=value)
    assert replace, "no slot-mapping local to inline"
    call = found.call.with_changes(args=[replace.get(id(a), a) for a in found.call.args])
    return swap(module, _call_path(found), found.call, call)  # type: ignore[return-value]


# --- what the rewrite must prove, not assume --------------------------------------------------------
# Each keeps what the program does, and gives the rewrite something it could take on
# trust: a cache bound another way than one plain assignment, a condition of the
# caller's, another product of a head count, the indexer's dtype converted first, a
# bypass name already in use, the op reached by another name.


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node).strip()


def _fresh(name: str, used: set[str]) -> str:
    while name in used:
        name += "_"
    return name


def _with_call(found: InsertCall, call: cst.Call) -> cst.SimpleStatementLine:
    return found.statement.with_changes(body=[found.statement.body[0].with_changes(value=call)])


def _replace_args(call: cst.Call, new: dict[int, cst.Arg]) -> cst.Call:
    return call.with_changes(args=[new.get(id(a), a) for a in call.args])


def _self_value(found: InsertCall, expr: cst.BaseExpression) -> cst.BaseExpression:
    """``self.x`` as is, or what a local alias of it holds."""
    if isinstance(expr, cst.Name):
        expr = _self_aliases(found.method).get(expr.value, expr)
    assert isinstance(expr, cst.Attribute) and _is_self_chain(expr), "not a self. attribute"
    return expr


def _add_parameter(module: cst.Module, name: str, default: str) -> cst.Module:
    """A last positional parameter of the method holding the call, with a default."""
    found = insert_call(module)
    params = found.method.params
    param = cst.Param(cst.Name(name), default=cst.parse_expression(default), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    method = found.method.with_changes(params=params.with_changes(params=[*params.params, param]))
    return swap(module, found.path[: found.path.index(found.method)], found.method, method)  # type: ignore[return-value]


def rebind_cache(module: cst.Module, form: str) -> cst.Module:
    """Pass the main cache through a local bound by unpacking, a loop, ``:=`` or a parameter's
    default - the same tensor, but not by one plain assignment."""
    found = insert_call(module)
    arg = bind(found.call)[KV_CACHE]
    guarded = isinstance(arg.value, cst.IfExp)
    cache = _self_value(found, arg.value.body if guarded else arg.value)  # type: ignore[attr-defined]
    name = _fresh("main_cache", local_names(found.method)[1])
    code = _code(cache)
    text = {
        "unpacking": f"{name}, {name}_spare = {code}, None\n",
        "for": f"for {name} in ({code},):\n    pass\n",
        "walrus": f"if ({name} := {code}) is None:\n    raise RuntimeError('no cache')\n",
        "parameter-default": f"if {name} is None:\n    {name} = {code}\n",
    }[form]
    lines = list(cst.parse_module(text).body)
    lines[0] = lines[0].with_changes(leading_lines=found.statement.leading_lines)
    value = arg.value.with_changes(body=cst.Name(name)) if guarded else cst.Name(name)  # type: ignore[attr-defined]
    statement = _with_call(found, _replace_args(found.call, {id(arg): arg.with_changes(value=value)}))
    module = swap(module, found.path, found.statement, [*lines, statement.with_changes(leading_lines=[])])  # type: ignore[assignment]
    return _add_parameter(module, name, "None") if form == "parameter-default" else module


def caller_condition(module: cst.Module) -> cst.Module:
    """Both caches passed under a flag of the caller's (a parameter that defaults to True)."""
    found = insert_call(module)
    name = _fresh("write_cache", local_names(found.method)[1])
    bound = bind(found.call)
    new = {}
    for index in (KV_CACHE, INDEX_CACHE):
        arg = bound[index]
        guarded = isinstance(arg.value, cst.IfExp)
        cache = arg.value.body if guarded else arg.value  # type: ignore[attr-defined]
        wrapped = cst.parse_expression(f"({_code(cache)} if {name} else None)")
        value = arg.value.with_changes(body=wrapped) if guarded else wrapped.with_changes(lpar=[], rpar=[])  # type: ignore[attr-defined]
        new[id(arg)] = arg.with_changes(value=value)
    module = swap(module, _call_path(found)[:-1], found.statement, _with_call(found, _replace_args(found.call, new)))  # type: ignore[assignment]
    return _add_parameter(module, name, "True")


def _init_statements(found: InsertCall) -> cst.FunctionDef:
    return _method(found.cls, "__init__")


def _insert_in_init(module: cst.Module, before: Callable[[cst.BaseStatement], bool], text: str) -> cst.Module:
    """``text``'s statements into the class's ``__init__``, before its first top-level
    statement that is ``before`` (or at its end when ``before`` matches none)."""
    found = insert_call(module)
    init = _init_statements(found)
    body = list(init.body.body)
    index = next((i for i, stmt in enumerate(body) if before(stmt)), len(body))
    body[index:index] = list(cst.parse_module(text).body)
    new = init.with_changes(body=init.body.with_changes(body=body))
    return swap(module, found.path[: found.path.index(found.method)], init, new)  # type: ignore[return-value]


def _assigns(stmt: cst.BaseStatement, test: Callable[[str, cst.BaseExpression], bool]) -> bool:
    """``self.<attr> = value`` for which ``test(attr, value)``."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign)):
        return False
    assign = stmt.body[0]
    target = assign.targets[0].target
    return isinstance(target, cst.Attribute) and _is_self_chain(target) and test(target.attr.value, assign.value)


def _product_of(value: cst.BaseExpression, count: str) -> bool:
    return isinstance(value, cst.BinaryOperation) and count in (_code(value.left), _code(value.right))


def extra_head_product(module: cst.Module) -> cst.Module:
    """``self.rope_q_size = <q head count> * self.rope_dim`` before the first product of that count."""
    found = insert_call(module)
    count = _code(_self_value(found, bind(found.call)[SCHEMA.index("num_heads")].value))
    text = f"self.rope_dim = 64\nself.rope_q_size = {count} * self.rope_dim\n"
    return _insert_in_init(module, lambda s: _assigns(s, lambda _, v: _product_of(v, count)), text)


def index_heads_by_kv_count(module: cst.Module) -> cst.Module:
    """The index head count is ``self.X = self.<kv count>`` in __init__: pass the kv count
    itself, and make every product of the index count one of the kv count (equal values)."""
    found = insert_call(module)
    bound = bind(found.call)
    index_arg = bound[SCHEMA.index("num_index_heads")]
    index_count = _code(_self_value(found, index_arg.value))
    kv_count = _code(_self_value(found, bound[SCHEMA.index("num_kv_heads")].value))
    init = _init_statements(found)
    aliased = [s for s in init.body.body if _assigns(s, lambda attr, v: f"self.{attr}" == index_count and _code(v) == kv_count)]
    assert aliased, "the index head count is not the kv head count"
    statement = _with_call(found, _replace_args(found.call, {id(index_arg): index_arg.with_changes(value=cst.parse_expression(kv_count))}))
    module = swap(module, found.path, found.statement, statement)  # type: ignore[assignment]

    class Recount(cst.CSTTransformer):
        def leave_BinaryOperation(self, original, updated):  # type: ignore[no-untyped-def]
            sides = {}
            for side in ("left", "right"):
                if _code(getattr(updated, side)) == index_count:
                    sides[side] = cst.parse_expression(kv_count)
            return updated.with_changes(**sides)

    found = insert_call(module)
    init = _init_statements(found)
    return swap(module, found.path[: found.path.index(found.method)], init, init.visit(Recount()))  # type: ignore[return-value]


def indexer_dtype_first(module: cst.Module) -> cst.Module:
    """Another cache dtype converted in __init__ before the main one is assigned."""
    text = 'self.index_dtype_str = "auto"\nself.index_torch_dtype = kv_cache_dtype_str_to_dtype(self.index_dtype_str, None)\n'
    return _insert_in_init(module, lambda s: _assigns(s, lambda attr, _: attr == "kv_cache_dtype"), text)


def dtype_lambda_first(module: cst.Module) -> cst.Module:
    """A lambda that converts the main dtype, defined before the dtype is assigned (never called)."""
    text = "self.torch_dtype_of = lambda: kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, None)\n"
    return _insert_in_init(module, lambda s: _assigns(s, lambda attr, _: attr == "kv_cache_dtype"), text)


def flag_name_taken(module: cst.Module) -> cst.Module:
    """``self._fp8_kv = False`` at the end of __init__ (the file has no bypass: unused)."""
    return _insert_in_init(module, lambda s: False, "self._fp8_kv = False\n")


def insert_kv_name_taken(module: cst.Module) -> cst.Module:
    """A class attribute ``_insert_kv = None`` at the end of the class (nothing calls it)."""
    found = insert_call(module)
    body = [*found.cls.body.body, cst.parse_statement("_insert_kv = None").with_changes(leading_lines=[_blank()])]
    new = found.cls.with_changes(body=found.cls.body.with_changes(body=body))
    return swap(module, found.path[: found.path.index(found.cls)], found.cls, new)  # type: ignore[return-value]


def op_by_another_name(module: cst.Module, form: str) -> cst.Module:
    """The op called through an import alias or a local bound to it (the same function)."""
    found = insert_call(module)
    if form == "import-alias":
        name = "fused_insert_op"
        line = cst.parse_statement(f"from vllm._custom_ops import {FUSED_OP} as {name}")
        last = max(i for i, s in enumerate(module.body) if m.matches(s, m.SimpleStatementLine([m.Import() | m.ImportFrom()])))
        module = module.with_changes(body=[*module.body[: last + 1], line, *module.body[last + 1 :]])
        found = insert_call(module)
        return swap(module, found.path, found.statement, _with_call(found, found.call.with_changes(func=cst.Name(name))))  # type: ignore[return-value]
    name = _fresh("insert_op", local_names(found.method)[1])
    bind_line = cst.parse_statement(f"{name} = {_code(found.call.func)}").with_changes(leading_lines=found.statement.leading_lines)
    statement = _with_call(found, found.call.with_changes(func=cst.Name(name))).with_changes(leading_lines=[])
    return swap(module, found.path, found.statement, [bind_line, statement])  # type: ignore[return-value]


# --- the catalogue ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    kind: str  # the mutation class, as the corpus report counts it
    label: str  # this instance
    apply: Callable[[cst.Module], cst.Module] | Callable[[str], str]
    layout_only: bool = False  # comments, blank lines, formatting: the AST must not change
    on_text: bool = False  # ``apply`` takes and gives source text (a formatter)


@dataclass(frozen=True)
class Shape:
    """What a fixture looks like, as far as choosing its mutations goes."""

    keyword_call: bool  # the insert call already passes keywords
    methods: tuple[str, ...]  # of the class holding the call, in order
    call_method: str
    bypass_names: bool = False  # the file already uses `_fp8_kv` or calls `self._insert_kv`


def shape(source: str) -> Shape:
    module = cst.parse_module(source)
    found = insert_call(module)
    positional = sum(1 for a in found.call.args if a.keyword is None)
    return Shape(
        positional < len(found.call.args),
        tuple(f.name.value for f in _methods(found.cls)),
        found.method.name.value,
        "_fp8_kv" in source or "self._insert_kv(" in source,
    )


def catalogue(fixture: Shape) -> list[Mutation]:
    """Every single mutation that changes this fixture (no two reorderings alike)."""
    keyword_call = fixture.keyword_call
    muts = [
        *(
            Mutation("reformat", f"black-{n}", lambda s, n=n: reformat(s, n), layout_only=True, on_text=True)
            for n in (45, 70, 110, 150)
        ),
        Mutation(
            "reformat",
            "black-flat",
            lambda s: reformat(s, 400, magic_trailing_comma=False),
            True,
            on_text=True,
        ),
        Mutation("args", "keyword-all", lambda s: args_style(s, 0)),
        Mutation("args", "keyword-reversed", lambda s: args_style(s, 12, reverse_keywords=True)),
        Mutation("args", "keyword-from-5", lambda s: args_style(s, 5)),
    ]
    if keyword_call:
        muts.append(Mutation("args", "positional", lambda s: args_style(s, len(SCHEMA))))
    else:
        muts += [
            Mutation("args", "keyword-from-12", lambda s: args_style(s, 12)),
            Mutation("args", "keyword-from-14", lambda s: args_style(s, 14)),
        ]
    muts += [
        Mutation("rename-locals", "suffix", lambda s: rename_locals(s, "suffix")),
        Mutation("rename-locals", "short", lambda s: rename_locals(s, "short")),
        Mutation("rename-locals", "generated-names", lambda s: rename_locals(s, "collide")),
        Mutation("rename-locals", "every-method", lambda s: rename_locals(s, "collide", every_method=True)),
        Mutation("comments", "call-comments", call_comments, layout_only=True),
        Mutation("comments", "method-comments", method_comments, layout_only=True),
        Mutation("blank-lines", "call-blank-lines", call_blank_lines, layout_only=True),
        Mutation("blank-lines", "method-blank-lines", method_blank_lines, layout_only=True),
        *(
            Mutation("reorder-methods", order, lambda s, o=order: reorder_methods(s, o))
            for order in _distinct_reorderings(fixture)
        ),
        Mutation("rename-class", "sparse-class", rename_class),
        Mutation("rename-class", "every-class", lambda s: rename_class(s, every_class=True)),
        Mutation("helper-method", "call-only", move_call_to_helper),
        Mutation("helper-method", "rebind-aliases", lambda s: move_call_to_helper(s, rebind_aliases=True)),
        Mutation("cache-alias", "cache-locals", alias_caches),
        Mutation("inline-slots", "slot-expressions", inline_slot_locals),
        *(
            Mutation("cache-rebound", form, lambda s, f=form: rebind_cache(s, f))
            for form in ("unpacking", "for", "walrus", "parameter-default")
        ),
        Mutation("caller-condition", "caller-flag", caller_condition),
        Mutation("head-sizes", "rope-product", extra_head_product),
        Mutation("head-sizes", "index-heads-by-kv", index_heads_by_kv_count),
        Mutation("dtype-anchor", "indexer-dtype-first", indexer_dtype_first),
        Mutation("dtype-anchor", "dtype-lambda-first", dtype_lambda_first),
        *(
            Mutation("op-renamed", form, lambda s, f=form: op_by_another_name(s, f))
            for form in ("import-alias", "local")
        ),
    ]
    if not fixture.bypass_names:  # elsewhere these names are the bypass's own
        muts += [
            Mutation("names-taken", "flag-assigned", flag_name_taken),
            Mutation("names-taken", "insert-kv-attribute", insert_kv_name_taken),
        ]
    return muts


def _distinct_reorderings(fixture: Shape) -> list[str]:
    seen = {fixture.methods}
    out = []
    for order in REORDERINGS:
        names = tuple(permute(list(fixture.methods), fixture.call_method, order))
        if names not in seen:
            seen.add(names)
            out.append(order)
    return out


# Combinations apply structure first, then names, then layout, then formatting.
_STAGES = (
    ("helper-method", "cache-alias", "inline-slots"),
    ("args",),
    ("rename-locals",),
    ("reorder-methods",),
    ("rename-class",),
    ("comments", "blank-lines"),
    ("reformat",),
)


def combinations(fixture: Shape, count: int, seed: int) -> list[list[Mutation]]:
    """``count`` distinct combinations of 2 to 5 mutations of different kinds."""
    rng = random.Random(seed)
    singles = catalogue(fixture)
    by_stage = [[mu for mu in singles if mu.kind in kinds] for kinds in _STAGES]
    out: list[list[Mutation]] = []
    seen = set()
    while len(out) < count:
        stages = sorted(rng.sample(range(len(_STAGES)), rng.randint(2, 5)))
        combo = [rng.choice(by_stage[i]) for i in stages]
        key = tuple(mu.label for mu in combo)
        if key not in seen:
            seen.add(key)
            out.append(combo)
    return out


def apply_all(source: str, mutations: list[Mutation]) -> str:
    """Apply in turn, parsing once (and again only after a formatter)."""
    module: cst.Module | None = cst.parse_module(source)
    for mutation in mutations:
        if mutation.on_text:
            source = mutation.apply(module.code if module is not None else source)  # type: ignore[arg-type]
            module = None
        else:
            module = mutation.apply(module if module is not None else cst.parse_module(source))  # type: ignore[arg-type]
    return module.code if module is not None else source
