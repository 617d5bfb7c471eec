"""Answer, with the standard library's ``ast``, the files that need no rewrite.

``check`` runs on every commit that touches a model file, and most of those
files are native or already patched: nothing to rewrite, nothing LibCST has to
hold in its hands. The triage gathers the same ``CallFacts`` and ``Pieces`` as
the LibCST codemod, from ``ast`` instead, and asks the same
``schema.verdict``. It answers only when every call of the fused op comes out
``native``, ``patched`` or ``not-a-site``; anything else - a site to rewrite
or refuse, or a fact that ``ast`` cannot establish exactly as LibCST would
(``ast`` forgets parentheses, semicolons and one-line suites) - is
``Undecided``, and the caller runs the LibCST analysis, which stays the
authority. It never guesses.

One difference is left on purpose: a file that this Python parses but
LibCST cannot (syntax newer than LibCST knows) is reported by its states
here, where the LibCST path would report a parse error; no such file needs
a rewrite, and ``run`` on one that did would go to LibCST and fail there.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from codemods import schema as s

# The states the triage may report; every other outcome goes to LibCST.
DECIDED = (s.SiteState.NATIVE, s.SiteState.PATCHED, s.SiteState.NOT_A_SITE)
BOM = b"\xef\xbb\xbf"
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPES = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


class Undecided(Exception):
    """A fact ``ast`` cannot establish exactly as LibCST would: ask LibCST."""


def triage(raw: bytes) -> list[s.InsertSite] | None:
    """Every call's site if the file needs no rewrite and nothing is in doubt, else None."""
    try:
        source = _Source(raw)
        sites = [_classify(source, found) for found in _find_calls(source)]
    except (Undecided, RecursionError):
        return None
    if any(site.state not in DECIDED for site in sites):
        return None
    # No site holds a plan, so the codemod's "two candidate sites" refusal cannot apply.
    return sites


# --- the source, as lines and as a tree ---------------------------------------------


class _Source:
    """The file's tree, and its lines as bytes (ast columns are UTF-8 byte offsets)."""

    def __init__(self, raw: bytes) -> None:
        body = raw[len(BOM) :] if raw.startswith(BOM) else raw
        try:
            encoding, _ = tokenize.detect_encoding(io.BytesIO(body).readline)
            text = body.decode("utf-8")
        except (SyntaxError, UnicodeDecodeError) as exc:
            raise Undecided("not plain UTF-8") from exc
        if encoding not in ("utf-8", "utf-8-sig") or "\r" in text.replace("\r\n", ""):
            raise Undecided("another encoding, or lone carriage returns")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the file's own warnings ("\d") are not ours
                self.tree = ast.parse(text)
        except (SyntaxError, ValueError, MemoryError) as exc:
            raise Undecided("ast cannot parse it; LibCST decides (and reports)") from exc
        self.lines = [b""] + re.split(rb"\r\n|\n", body)  # 1-based
        self.mentions_flag = s.FP8_FLAG.encode() in body
        needle = s.FUSED_OP.encode()
        self.op_lines = [i for i, line in enumerate(self.lines) if needle in line]

    def may_hold_op(self, node: ast.AST) -> bool:
        """A statement whose lines never name the op holds no call of it."""
        if not isinstance(node, ast.stmt):
            return True
        first = min((d.lineno for d in getattr(node, "decorator_list", ())), default=node.lineno)
        last = node.end_lineno or node.lineno
        return any(first <= line <= last for line in self.op_lines)

    def before(self, node: ast.AST) -> bytes:
        return self.lines[node.lineno][: node.col_offset]  # type: ignore[attr-defined]

    def after(self, node: ast.AST) -> bytes:
        return self.lines[node.end_lineno][node.end_col_offset :]  # type: ignore[attr-defined]

    def continued(self, line: int) -> bool:
        """The physical line before ``line`` ends with a backslash continuation."""
        return line > 1 and self.lines[line - 1].rstrip(b" \t\x0c").endswith(b"\\")

    def starts_line(self, node: ast.stmt) -> bool:
        """Only indentation before the statement, and no continuation into its line."""
        return not self.before(node).strip() and not self.continued(node.lineno)

    def alone(self, node: ast.stmt) -> bool:
        """The statement has its lines to itself (LibCST: one small statement in the line)."""
        rest = self.after(node).strip()
        return self.starts_line(node) and (not rest or rest.startswith(b"#"))

    def segment(self, node: ast.expr, within: ast.expr) -> str:
        """The expression's source exactly as LibCST's ``code()`` shows it.

        ``within`` is an enclosing expression that starts before it (the call):
        the token before ``node`` must not be an opening parenthesis, which
        LibCST would count as the expression's own.
        """
        if node.lineno != node.end_lineno:
            raise Undecided("an expression over several lines")
        if self._token_before(node, within) not in (",", "="):
            raise Undecided("maybe parenthesized (LibCST keeps the parentheses)")
        return self.lines[node.lineno][node.col_offset : node.end_col_offset].decode("utf-8")

    def _token_before(self, node: ast.expr, within: ast.expr) -> str | None:
        parts = [self.lines[within.lineno][within.col_offset :]]
        parts += self.lines[within.lineno + 1 : node.lineno + 1]
        if node.lineno == within.lineno:
            parts = [self.lines[node.lineno][within.col_offset : node.col_offset]]
        else:
            parts[-1] = parts[-1][: node.col_offset]
        text = b"\n".join(parts).decode("utf-8")
        last = None
        try:
            for token in tokenize.generate_tokens(io.StringIO(text).readline):
                if token.type not in _LAYOUT_TOKENS:
                    last = token.string
        except tokenize.TokenError:
            pass  # the region ends inside the call's parentheses
        except SyntaxError:
            return None
        return last


_LAYOUT_TOKENS = (
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
)


# --- finding the calls ------------------------------------------------------------------


@dataclass
class _FoundCall:
    call: ast.Call
    scopes: list[ast.AST]  # enclosing classes, functions and lambdas, outermost first


def _callee_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _find_calls(source: _Source) -> list[_FoundCall]:
    """Every call of the fused op, in source order (as LibCST visits them)."""
    found: list[_FoundCall] = []

    named: list[ast.AST] = []  # nodes that name the op

    def visit(node: ast.AST, scopes: list[ast.AST]) -> None:
        if not source.may_hold_op(node):
            return
        if isinstance(node, ast.Call) and _callee_name(node) == s.FUSED_OP:
            found.append(_FoundCall(node, scopes))
        if _names_op(node):
            named.append(node)
        inner = scopes + [node] if isinstance(node, _SCOPES) else scopes
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(source.tree, [])
    callees = {id(f.call.func) for f in found}
    if any(id(node) not in callees for node in named):
        raise Undecided("the op is named other than as a callee (an alias, a local, getattr)")
    # ast keeps fields, not source order (decorators after the body, dict keys
    # before values); outer calls first where two start at one place.
    found.sort(
        key=lambda f: (f.call.lineno, f.call.col_offset, -f.call.end_lineno, -f.call.end_col_offset)  # type: ignore[operator]
    )
    return found


def _names_op(node: ast.AST) -> bool:
    """``fused_…`` as a name, an attribute, a string (``getattr``), an ``import … as`` or a def."""
    if isinstance(node, ast.Name):
        return node.id == s.FUSED_OP
    if isinstance(node, ast.Attribute):
        return node.attr == s.FUSED_OP
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.rpartition(".")[2] == s.FUSED_OP
    if isinstance(node, ast.alias):
        return node.name == s.FUSED_OP and node.asname is not None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == s.FUSED_OP
    return False


# --- statements as LibCST's statement slots see them -----------------------------------


@dataclass
class _Slot:
    body: list[ast.stmt]  # the block
    index: int
    certain: bool  # every enclosing block is surely an indented block (not a one-line suite)

    @property
    def statement(self) -> ast.stmt:
        return self.body[self.index]


def _blocks_of(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The blocks ``anchors.statement_slots`` descends into (not defs)."""
    if isinstance(stmt, (ast.If, ast.For, ast.AsyncFor, ast.While)):
        return [stmt.body, stmt.orelse]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return [stmt.body]
    if isinstance(stmt, (ast.Try, ast.TryStar)):
        return [stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody]
    if isinstance(stmt, ast.Match):
        return [case.body for case in stmt.cases]
    return []


def _slots(source: _Source, func: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[_Slot]:
    def visit(body: list[ast.stmt], certain: bool) -> Iterator[_Slot]:
        if not body:
            return
        # `elif` is an `if` in `orelse`: a block of its own in LibCST too.
        is_elif = len(body) == 1 and isinstance(body[0], ast.If) and not source.starts_line(body[0])
        certain = certain and (source.starts_line(body[0]) or is_elif)
        for i, stmt in enumerate(body):
            yield _Slot(body, i, certain)
            for block in _blocks_of(stmt):
                yield from visit(block, certain)

    yield from visit(func.body, True)


def _single(source: _Source, slot: _Slot) -> bool:
    """The statement is surely a line of its own in an indented block; Undecided if unsure."""
    if slot.certain and source.alone(slot.statement):
        return True
    raise Undecided("a statement that may share its line or sit in a one-line suite")


def _is_self_attr(node: ast.AST | None, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _simple_assignment(stmt: ast.stmt) -> tuple[ast.expr, ast.expr] | None:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        return stmt.targets[0], stmt.value
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        return stmt.target, stmt.value
    return None


def _methods(cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    found = [f for f in cls.body if isinstance(f, _FUNCTIONS) and f.name == name]
    return found[-1] if found else None


# --- the facts and the pieces --------------------------------------------------------------


def _arg(call: ast.Call, param: s.OpParam) -> ast.expr | None:
    positional = [a for a in call.args if not isinstance(a, ast.Starred)]
    keywords = [(k.arg, k.value) for k in call.keywords if k.arg is not None]
    return s.bind_arg(param, positional, keywords)


def _is_none(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _classify(source: _Source, found: _FoundCall) -> s.InsertSite:
    call = found.call
    classes = [i for i, n in enumerate(found.scopes) if isinstance(n, ast.ClassDef)]
    cls = found.scopes[classes[-1]] if classes else None
    inner = found.scopes[classes[-1] + 1 :] if classes else []
    method = inner[0] if inner and isinstance(inner[0], _FUNCTIONS) else None
    nested = None
    if len(inner) > 1:
        nested = inner[-1].name if isinstance(inner[-1], _FUNCTIONS) else "<lambda>"
    outer = found.scopes[0] if found.scopes else None
    module_function = (outer.name if isinstance(outer, _FUNCTIONS) else "<module>") if cls is None else None

    if cls is None and isinstance(outer, _FUNCTIONS) and _is_called(source, outer.name):
        raise Undecided("maybe a pass-through wrapper: a call of it in a class may be a site")
    kv = _arg(call, s.KV_CACHE)
    dtype = _arg(call, s.KV_CACHE_DTYPE)
    dtype_code = source.segment(dtype, call) if dtype is not None else None
    slot = _call_slot(source, method, call) if method is not None and nested is None else None
    facts = s.CallFacts(
        line=call.lineno,
        class_name=cls.name if isinstance(cls, ast.ClassDef) else None,
        method=method.name if method is not None else None,
        module_function=module_function,
        nested_in=nested,
        star_args=any(isinstance(a, ast.Starred) for a in call.args)
        or any(k.arg is None for k in call.keywords),
        has_cache=kv is not None and not _is_none(kv),
        dtype=dtype_code,
        dtype_is_auto=dtype_code is not None and _is_auto(dtype, dtype_code),
        in_block=slot is not None,
    )

    def collect() -> s.Pieces:
        assert isinstance(cls, ast.ClassDef) and method is not None
        return _collect_pieces(source, cls, method, call, slot)

    return s.verdict(facts, collect).site(facts)


def _is_called(source: _Source, name: str) -> bool:
    """A call of ``name`` (bare or as an attribute, a wrapper's wrapper too) in the file."""
    return any(isinstance(node, ast.Call) and _callee_name(node) == name for node in ast.walk(source.tree))


def _is_auto(node: ast.expr, code: str) -> bool:
    """LibCST: one string literal (not implicitly concatenated) whose value is "auto"."""
    if not (isinstance(node, ast.Constant) and node.value == s.AUTO_DTYPE):
        return False
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.string.strip()]
    return len(tokens) == 1 and tokens[0].type == tokenize.STRING


def _call_slot(
    source: _Source, method: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call
) -> _Slot | None:
    """Where the call is a statement of its own (LibCST: ``expression_call``), or None."""
    for slot in _slots(source, method):
        stmt = slot.statement
        if isinstance(stmt, ast.Expr) and stmt.value is call:
            return slot if _single(source, slot) else None
    return None


def _collect_pieces(
    source: _Source, cls: ast.ClassDef, method: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, slot: _Slot | None
) -> s.Pieces:
    """``fp8_kv_bypass._collect_pieces``, read from ``ast``."""
    p = s.Pieces()
    init = _methods(cls, "__init__")
    _names_are_free_or_the_bypass(source, cls, init)
    if init is not None and source.mentions_flag:
        p.flag_set = _sets_flag(source, init)
        p.scale_set = _sets_flag(source, init, s.FP8_SCALE)
    if source.mentions_flag:
        attrs = {n.attr for stmt in cls.body for n in ast.walk(stmt) if _is_self_attr(n, getattr(n, "attr", ""))}
        p.flag_read = not p.flag_set and s.FP8_FLAG in attrs
        p.scale_read = s.FP8_SCALE in attrs
    p.guard_args = [g for g in (_guard_of(_arg(call, s.KV_CACHE)), _guard_of(_arg(call, s.INDEX_CACHE))) if g]
    fn = _methods(cls, s.INSERT_KV)
    if fn is not None:
        reads = any(
            isinstance(n, ast.Attribute) and n.attr == s.METADATA_ATTR
            for stmt in fn.body
            for n in ast.walk(stmt)
        )
        scatter = any(_raw_scatter(f) for f in (fn, *_delegates(source, fn, cls)))
        p.insert_kv = s.insert_kv_form(True, reads, len(_param_names(fn)) - 1, scatter)
    if slot is None:
        return p

    guard_names = set(p.guard_args) | {s.GUARD_NAME}
    for i in range(slot.index):
        before = _Slot(slot.body, i, slot.certain)
        pair = _simple_assignment(before.statement)
        if pair and isinstance(pair[0], ast.Name) and pair[0].id in guard_names and _single(source, before):
            s.note_guard_assignment(p, pair[0].id, s.is_guard_value(pair[1]))
    for name in {*p.guard_args, *([p.guard_assigned] if p.guard_assigned else [])}:
        binders = [n for n in ast.walk(method) if n is not method and _binds(n, name)]
        plain = {
            id(stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target)
            for stmt in slot.body
            if _simple_assignment(stmt) is not None
        }
        if any(not isinstance(n, ast.arg) and id(n) not in plain for n in binders) or (
            not binders and not name.startswith(s.GUARD_NAME)
        ):
            raise Undecided("whose condition guards the caches (the codemod's rule on bindings)")
    for i in range(slot.index + 1, len(slot.body)):
        stmt = slot.body[i]
        inserts = [n for n in ast.walk(stmt) if _is_insert_kv_call(n)]
        if not inserts:
            continue
        if len(inserts) > 1 or not (
            isinstance(stmt, ast.If) or _single(source, _Slot(slot.body, i, slot.certain))
        ):
            raise Undecided("which post-call insert LibCST takes first")
        p.post_insert = True
        p.post_insert_wired = _insert_is_wired(source, inserts[0], call) and _is_guarded_block(stmt, p)
        break
    return p


def _binds(node: ast.AST, name: str) -> bool:
    """``node`` binds ``name`` (``anchors.bindings``; nested scopes counted too: more doubt, not less)."""
    if isinstance(node, ast.Name):
        return node.id == name and isinstance(node.ctx, (ast.Store, ast.Del))
    if isinstance(node, ast.arg):
        return node.arg == name
    if isinstance(node, ast.alias):
        return (node.asname or node.name.split(".")[0]) == name
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return name in node.names
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)):
        return node.name == name
    if isinstance(node, (ast.MatchAs, ast.MatchStar)):
        return node.name == name
    if isinstance(node, ast.MatchMapping):
        return node.rest == name
    return False


def _names_are_free_or_the_bypass(
    source: _Source, cls: ast.ClassDef, init: ast.FunctionDef | ast.AsyncFunctionDef | None
) -> None:
    """``fp8_kv_bypass._taken_names`` finds nothing: else Undecided (the codemod says what is taken)."""
    names = (s.FP8_FLAG, s.FP8_SCALE, s.INSERT_KV)
    insert_kv = 0
    for stmt in cls.body:
        if isinstance(stmt, _FUNCTIONS):  # at class level, a def binds its own name only
            if stmt.name == s.INSERT_KV and not stmt.decorator_list:
                insert_kv += 1
            elif stmt.name in names:
                raise Undecided("a name of the bypass bound in the class body")
        elif any(_binds(n, name) for n in ast.walk(stmt) for name in (*names, "__slots__")):
            raise Undecided("a name of the bypass bound in the class body")
    if insert_kv > 1:
        raise Undecided("two `_insert_kv` defs")
    if not source.mentions_flag:
        return
    own_values = {s.FP8_FLAG: s.is_flag_value, s.FP8_SCALE: s.is_scale_value}
    first = {}
    for slot in _slots(source, init) if init is not None else ():
        pair = _simple_assignment(slot.statement)
        for name in own_values:
            if pair and _is_self_attr(pair[0], name) and name not in first:
                first[name] = pair[0] if own_values[name](pair[1]) else None
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in names
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and _is_self_attr(node, node.attr)
            and node is not first.get(node.attr)
        ):
            raise Undecided("a name of the bypass assigned other than as the bypass does")


def _param_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return names + [a.arg for a in (args.vararg, args.kwarg) if a is not None]


def _delegates(
    source: _Source, fn: ast.FunctionDef | ast.AsyncFunctionDef, cls: ast.ClassDef
) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """``anchors.delegates``: the methods and module functions ``fn`` calls, one level."""
    functions = {f.name: f for f in source.tree.body if isinstance(f, _FUNCTIONS)}
    found: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for node in _walk_scope(fn):
        if not isinstance(node, ast.Call):
            continue
        target = None
        if isinstance(node.func, ast.Attribute) and _is_self_attr(node.func, node.func.attr):
            target = _methods(cls, node.func.attr)
        elif isinstance(node.func, ast.Name):
            target = functions.get(node.func.id)
        if target is not None and target is not fn and all(target is not f for f in found):
            found.append(target)
    return found


def _walk_scope(fn: ast.AST) -> list[ast.AST]:
    """Nodes of a function body, not inside nested defs, lambdas or classes."""
    out: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, _SCOPES):
            stack += ast.iter_child_nodes(node)
    return out


def _raw_scatter(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``anchors.raw_scatters``: ``cache[<a parameter>] = ...`` in a statement of ``fn``'s blocks."""
    params = set(_param_names(fn))
    for stmt in _walk_scope(fn):
        pair = _simple_assignment(stmt) if isinstance(stmt, ast.stmt) else None
        if pair and isinstance(pair[0], ast.Subscript):
            index = pair[0].slice
            if isinstance(index, ast.Name) and index.id in params:
                return True
    return False


def _sets_flag(source: _Source, init: ast.FunctionDef | ast.AsyncFunctionDef, attr: str = s.FP8_FLAG) -> bool:
    """``self.<attr> = ...`` as a statement of ``__init__`` (``anchors.self_assignments``)."""
    unsure = False
    for slot in _slots(source, init):
        pair = _simple_assignment(slot.statement)
        if pair and _is_self_attr(pair[0], attr):
            if slot.certain and source.alone(slot.statement):
                return True
            unsure = True
    if unsure:
        raise Undecided("the flag is set on a line LibCST may not see as a statement")
    return False


def _guard_of(arg: ast.expr | None) -> str | None:
    """``X if G else None`` -> ``"G"``."""
    if isinstance(arg, ast.IfExp) and isinstance(arg.test, ast.Name) and _is_none(arg.orelse):
        if isinstance(arg.body, ast.IfExp):
            raise Undecided("a condition inside the guard (the caller's: the codemod says so)")
        return arg.test.id
    return None





def _is_insert_kv_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _is_self_attr(node.func, s.INSERT_KV)


def _is_guarded_block(stmt: ast.stmt, p: s.Pieces) -> bool:
    if not isinstance(stmt, ast.If):
        return False
    guard = s.post_block_guard(stmt.test)
    return guard == s.FP8_FLAG or guard in (set(p.guard_args) | {p.guard_assigned or s.GUARD_NAME})


def _insert_is_wired(source: _Source, insert: ast.Call, fused: ast.Call) -> bool:
    if any(isinstance(a, ast.Starred) for a in insert.args) or any(k.arg is None for k in insert.keywords):
        raise Undecided("a starred argument in the post-call insert (LibCST counts it as positional)")
    main = _arg(fused, s.SLOT_MAPPING)
    index = _arg(fused, s.INDEX_SLOT_MAPPING)
    if len(insert.args) != 5 or insert.keywords or main is None or index is None:
        return False
    return _same_expr(insert.args[s.POST_INSERT_MAIN_SLOTS], main) and _same_expr(
        insert.args[s.POST_INSERT_INDEX_SLOTS], index
    )


def _same_expr(a: ast.expr, b: ast.expr) -> bool:
    """``anchors.same_expr``: LibCST re-parses each expression's own source text."""
    for node in (a, b):
        if node.lineno != node.end_lineno or any(
            isinstance(n, (ast.Await, ast.Yield, ast.YieldFrom)) for n in ast.walk(node)
        ):
            raise Undecided("an expression LibCST may not re-parse on its own")
    return ast.dump(a) == ast.dump(b)
