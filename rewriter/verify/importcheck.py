"""Level 1: import the model module in a subprocess of the target interpreter.

The module is imported by its dotted name from the vLLM tree the file sits in
(``<root>/vllm/models/minimax_m3/nvidia/<name>.py``), and only when ``vllm`` is
importable there. Then ``inspect`` checks each layer class: ``_insert_kv``
takes the two slot mappings, and the class's fused call guards its cache
arguments (``X if <guard> else None``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from codemods.anchors import FUSED_OP, KV_CACHE

NVIDIA_PARTS = ("vllm", "models", "minimax_m3", "nvidia")

_SCRIPT = r"""
import ast, importlib, importlib.util, inspect, json, os, sys, textwrap, traceback
root, module, path, classes, op, cache_index, cache_kw = sys.argv[1:8]
sys.path.insert(0, root)

def emit(status, reason, tail=()):
    print(json.dumps({"status": status, "reason": reason, "traceback": list(tail)}))
    raise SystemExit(0)

if importlib.util.find_spec("vllm") is None:
    emit("skipped", f"vllm is not importable from {sys.executable}")
try:
    mod = importlib.import_module(module)
except BaseException:
    lines = traceback.format_exc().rstrip().splitlines()
    emit("failed", f"import {module} failed: {lines[-1]}", lines[-6:])
if os.path.realpath(mod.__file__) != os.path.realpath(path):
    emit("failed", f"import {module} loaded {mod.__file__}, not {path}")

def guarded(cls):
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", None)) == op:
            arg = call.args[int(cache_index)] if len(call.args) > int(cache_index) else None
            arg = arg or next((k.value for k in call.keywords if k.arg == cache_kw), None)
            if isinstance(arg, ast.IfExp) and isinstance(arg.orelse, ast.Constant) and arg.orelse.value is None:
                return True
    return False

problems, seen = [], []
for name in filter(None, classes.split(",")):
    cls = getattr(mod, name, None)
    if cls is None:
        problems.append(f"{name} is not in {module}")
        continue
    insert = getattr(cls, "_insert_kv", None)
    if insert is None:
        problems.append(f"{name} has no _insert_kv")
        continue
    sig = inspect.signature(insert)
    if len(sig.parameters) < 6:
        problems.append(f"{name}._insert_kv{sig} does not take the slot mappings")
    if not guarded(cls):
        problems.append(f"{name}: the fused call does not guard its cache arguments")
    seen.append(f"{name}._insert_kv{sig}")
if problems:
    emit("failed", "; ".join(problems))
emit("passed", f"imported {module}: " + ", ".join(seen))
"""


def module_of(path: Path) -> tuple[Path, str] | None:
    """(root on sys.path, dotted module) for a file inside ``vllm/models/minimax_m3/nvidia``."""
    real = Path(os.path.realpath(path))
    parts = real.parts
    if len(parts) < 6 or tuple(parts[-5:-1]) != NVIDIA_PARTS or real.suffix != ".py":
        return None
    return real.parents[4], ".".join((*NVIDIA_PARTS, real.stem))


def import_check(path: Path, classes: list[str], python: str | None = None, timeout: float = 300) -> dict:
    """``{"status", "reason", "traceback"}`` of importing the module that holds ``path``."""
    where = module_of(path)
    if where is None:
        return {
            "status": "skipped",
            "reason": "not inside a vllm/models/minimax_m3/nvidia/ tree: nothing to import it as",
            "traceback": [],
        }
    root, module = where
    exe = python or sys.executable
    argv = [exe, "-c", _SCRIPT, str(root), module, os.path.realpath(path), ",".join(classes)]
    argv += [FUSED_OP, str(KV_CACHE.index), KV_CACHE.keyword]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"status": "failed", "reason": f"{exe}: {exc}", "traceback": []}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {
            "status": "failed",
            "reason": f"{exe} exited {proc.returncode} during the import",
            "traceback": tail,
        }
