"""Level 1: import the model module in a subprocess of the target interpreter.

The module is imported by its dotted name from the vLLM tree the file sits in
(``<root>/vllm/models/minimax_m3/{nvidia,amd}/<name>.py``). Then ``inspect`` checks
each layer class that carries the bypass: its write method (``_insert_kv``, or
the fork's own name for it: ``InsertSite.write_method``) takes the two slot
mappings, and the class's fused call guards its cache arguments (``X if <guard>
else None``, or ``None if <flag> else X``). A native file is imported only.

What the level can honestly claim: a failure must be the file's. The level is
**skipped** (with the reason and what would make it run) when the interpreter
cannot import vLLM itself - no ``vllm``, a namespace package (a tree holding
model files but no vLLM), ``import vllm`` raising, a third-party module missing,
or vLLM's own code raising while the file's imports run. It **fails** when the
file is the cause - its syntax, an exception raised at one of its lines (a name
it does not define, say), a name or submodule it imports from vLLM that this
vLLM lacks. :func:`judge` decides, from facts the subprocess reports.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from codemods.schema import FUSED_OP, KV_CACHE
from rewriter.apply import FileError, read_source
from rewriter.targets import MODEL_DIRS, MODEL_DIRS_SHOWN, run_python

HOW_TO_RUN = "run verify with the interpreter of an installed vLLM: --python PATH"
TAIL = 8  # traceback lines kept

_SCRIPT = r"""
import ast, importlib, importlib.util, inspect, json, os, sys, textwrap, traceback
root, module, path, classes, op, cache_index, cache_kw = sys.argv[1:8]
sys.path.insert(0, root)
report, sys.stdout = sys.stdout, sys.stderr  # vLLM logs to stdout: keep it off the report line

def emit(status, reason, tail=(), **facts):
    print(json.dumps({"status": status, "reason": reason, "traceback": list(tail), **facts}), file=report)
    report.flush()
    os._exit(0)  # no atexit hook of an imported vLLM runs after the report

def raised(where, exc):
    tb = traceback.extract_tb(exc.__traceback__)
    emit(
        "raised",
        where,
        traceback.format_exception(type(exc), exc, exc.__traceback__),
        exc_type=type(exc).__name__,
        message=str(exc).splitlines()[0] if str(exc) else "",
        name=getattr(exc, "name", None) if isinstance(exc, ImportError) else None,
        syntax_file=getattr(exc, "filename", None) if isinstance(exc, SyntaxError) else None,
        frames=[[f.filename, f.lineno] for f in tb],
    )

try:
    spec = importlib.util.find_spec("vllm")
except BaseException as exc:
    raised("vllm", exc)
if spec is None:
    emit("skipped", f"vllm is not importable from {sys.executable}")
if spec.origin is None or not spec.has_location:
    where = ", ".join(spec.submodule_search_locations or [])
    emit("skipped", f"no vLLM in {sys.executable}: `vllm` is a namespace package ({where} holds no vllm/__init__.py)")
try:
    import vllm
except BaseException as exc:
    raised("vllm", exc)
try:
    mod = importlib.import_module(module)
except BaseException as exc:
    raised(module, exc)
if os.path.realpath(mod.__file__) != os.path.realpath(path):
    emit("skipped", f"{sys.executable} imports {module} from {mod.__file__}, not this file: its vllm is {os.path.dirname(vllm.__file__)}")

def guarded(cls):
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", None)) == op:
            arg = call.args[int(cache_index)] if len(call.args) > int(cache_index) else None
            arg = arg or next((k.value for k in call.keywords if k.arg == cache_kw), None)
            none = lambda n: isinstance(n, ast.Constant) and n.value is None
            if isinstance(arg, ast.IfExp) and (none(arg.orelse) or none(arg.body)):
                return True
    return False

problems, seen = [], []
for entry in filter(None, classes.split(",")):
    name, _, write = entry.partition(":")  # the class, and its write method (by role: any name)
    cls = getattr(mod, name, None)
    if cls is None:
        problems.append(f"{name} is not in {module}")
        continue
    insert = getattr(cls, write, None)
    if insert is None:
        problems.append(f"{name} has no {write}")
        continue
    sig = inspect.signature(insert)
    if len(sig.parameters) < 6:
        problems.append(f"{name}.{write}{sig} does not take the slot mappings")
    if not guarded(cls):
        problems.append(f"{name}: the fused call does not guard its cache arguments")
    seen.append(f"{name}.{write}{sig}")
if problems:
    emit("failed", "; ".join(problems))
version = getattr(vllm, "__version__", "?")
what = ", ".join(seen) if seen else "native call, no bypass to inspect"
emit("passed", f"imported {module} with vllm {version} from {os.path.dirname(vllm.__file__)}: {what}")
"""


def module_of(path: Path) -> tuple[Path, str] | None:
    """(root on sys.path, dotted module) for a file inside one of the model folders
    (``vllm/models/minimax_m3/nvidia`` or ``amd``: ``targets.MODEL_DIRS``)."""
    real = Path(os.path.realpath(path))
    if real.suffix != ".py":
        return None
    for folder in (("vllm", *dirs) for dirs in MODEL_DIRS):
        if len(real.parts) > len(folder) and tuple(real.parts[-len(folder) - 1 : -1]) == folder:
            return real.parents[len(folder)], ".".join((*folder, real.stem))
    return None


def import_lines(source: str) -> frozenset[int]:
    """Lines of the file's import statements (a multi-line ``from … import (…)`` whole)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return frozenset()
    return frozenset(
        line
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    )


def _is_vllm(module: str | None) -> bool:
    return bool(module) and (module == "vllm" or module.startswith("vllm."))


def judge(
    exc_type: str,
    message: str,
    frames: list[tuple[str, int]],
    file: str,
    name: str | None = None,
    imports: frozenset[int] = frozenset(),
    syntax_file: str | None = None,
) -> tuple[str, str]:
    """``("failed" | "skipped", why)`` for an exception raised while importing ``file``.

    ``frames``: the traceback's (filename, line), outermost first; ``name``: an
    ImportError's module; ``imports``: the file's import-statement lines. Failed
    when the file is the cause; skipped when the environment cannot import vLLM.
    """
    real = os.path.realpath(file)
    error = f"{exc_type}: {message}" if message else exc_type

    def mine(filename: str) -> bool:
        return os.path.realpath(filename) == real

    def at(frame: tuple[str, int]) -> str:
        return f"{_short(frame[0])}:{frame[1]}"

    env = f"; {HOW_TO_RUN}"
    if exc_type in ("SyntaxError", "IndentationError", "TabError"):
        if syntax_file and mine(syntax_file):
            return "failed", f"{error} (the file's own syntax)"
        return "skipped", f"vLLM itself does not compile here: {error} (in {_short(syntax_file or '?')}){env}"
    if exc_type == "ModuleNotFoundError" and not _is_vllm(name):
        where = f", imported at {at(frames[-1])}" if frames else ""
        return "skipped", f"a dependency is not installed: {error}{where}{env}"
    mod = module_of(Path(file))
    if exc_type == "ImportError" and mod and name == mod[1]:
        where = f" (at {at(frames[-1])})" if frames else ""
        return "failed", (
            f"this vLLM imports a name the file does not define: {error}{where}; "
            "a model file from another vLLM version or fork, whose classes this vLLM's package does not find"
        )
    own = [f for f in frames if mine(f[0])]
    if not own:
        where = f" (at {at(frames[-1])})" if frames else ""
        return "skipped", f"vLLM cannot be imported here, before the file's code ran: {error}{where}{env}"
    last_own = own[-1]
    if mine(frames[-1][0]):
        if exc_type == "ImportError" and name and not _is_vllm(name):
            return "skipped", f"a dependency lacks a name the file imports: {error} (at {at(last_own)}){env}"
        if exc_type in ("ImportError", "ModuleNotFoundError"):
            return "failed", f"this vLLM lacks what the file imports: {error} (at {at(last_own)})"
        return "failed", f"{error} (at {at(last_own)}, the file's own line)"
    if last_own[1] in imports:
        return "skipped", (
            f"vLLM cannot be imported here: {error} (at {at(frames[-1])}, while the file's import at "
            f"{at(last_own)} ran){env}"
        )
    return "failed", f"{error} (at {at(frames[-1])}, called from the file's line {at(last_own)})"


def _short(filename: str) -> str:
    """``vllm/…/x.py`` from a path inside a vllm tree, else the path."""
    parts = Path(filename).parts
    if "vllm" in parts:
        i = len(parts) - 1 - parts[::-1].index("vllm")
        return "/".join(parts[i:])
    return filename


def import_check(path: Path, classes: list[str], python: str | None = None, timeout: float = 300) -> dict:
    """``{"status", "reason", "traceback"}`` of importing the module that holds ``path``."""
    where = module_of(path)
    if where is None:
        return {
            "status": "skipped",
            "reason": f"not inside a {MODEL_DIRS_SHOWN} tree: nothing to import it as",
            "traceback": [],
        }
    root, module = where
    exe = python or sys.executable
    argv = [exe, "-c", _SCRIPT, str(root), module, os.path.realpath(path), ",".join(classes)]
    argv += [FUSED_OP, str(KV_CACHE.index), KV_CACHE.keyword]
    try:
        proc = run_python(argv, timeout)  # on a timeout, killed with what it started
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"status": "failed", "reason": f"{exe}: {exc}", "traceback": []}
    try:
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
        facts["status"]
    except (IndexError, json.JSONDecodeError, KeyError, TypeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-TAIL:]
        return {
            "status": "failed",
            "reason": f"{exe} exited {proc.returncode} during the import",
            "traceback": tail,
        }
    tail = "".join(facts.get("traceback", [])).rstrip().splitlines()[-TAIL:]
    if facts["status"] == "skipped":
        facts["reason"] += f"; {HOW_TO_RUN}"
    if facts["status"] != "raised":
        return facts | {"traceback": tail}
    try:
        imports = import_lines(read_source(path))
    except FileError:
        imports = frozenset()
    status, why = judge(
        facts["exc_type"],
        facts["message"],
        [(f, n) for f, n in facts["frames"]],
        os.path.realpath(path),
        facts.get("name"),
        imports,
        facts.get("syntax_file"),
    )
    what = "import vllm" if facts["reason"] == "vllm" else f"import {module}"
    return {"status": status, "reason": f"{what}: {why}", "traceback": tail}
