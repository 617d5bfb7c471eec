from __future__ import annotations

import ast
import inspect
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


# --- the CLI, run as ``python -m rewriter`` -------------------------------------------------
#
# A fresh interpreter costs 0.2-0.6 s before the CLI does anything (startup, importing
# libcst, typer and rich), and the suite runs the CLI about a thousand times. So ``cli()``
# asks a *zygote* for it: one ``python`` started from this process, once, that imports the
# CLI's modules and then, per call, forks a child that becomes ``python -m rewriter ARGS``:
# the call's working folder, environment, argv and stdin/stdout/stderr (the pipes this
# process reads, passed over a Unix socket), ``sys.path[0]`` as ``-m`` sets it, and the
# interpreter's own exit (threads joined, atexit, flushing, exit code, tracebacks; not the
# teardown of every module, which prints nothing and, with torch imported, takes a second). The child is forked
# from the pristine zygote, never from this process: nothing a test imported, patched or
# locked here, and no thread of this process, reaches it. What a fork cannot give is what
# the interpreter reads at startup; a call whose environment differs from the zygote's in
# those variables (PYTHONPATH, PYTHONIOENCODING, LANG, LC_*, ...) runs a fresh process.

_ZYGOTE = r"""
import json, os, pkgutil, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
sys.path[0] = sys.argv[2]
# Everything the CLI imports, imported once; torch too in the zygote for `verify` and `run` (the
# semantic level imports it, quietly, as here; importing torch starts no thread, so forking
# after it is safe). Not in the other: a fork copies torch's page tables, 20-30 ms a call.
import warnings
if sys.argv[3] == "torch":
    # One thread, as the judge runs the same semantic level: verify's tensors are tiny, and a
    # pool of threads only spins on a machine the other test workers keep busy.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import torch
        except Exception:
            pass
for package in ("rewriter", "codemods"):
    try:
        module = __import__(package)
    except Exception:
        continue
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        if not info.name.endswith(".__main__") and (sys.argv[3] == "torch" or ".verify." not in info.name):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    __import__(info.name)
            except Exception:
                pass
# Forking a process with threads is unsafe: then every call runs a fresh process.
if os.path.isdir("/proc/self/task") and len(os.listdir("/proc/self/task")) > 1:
    sock.sendall(b"threads")
    os._exit(0)
import gc
gc.freeze()  # the children's collections skip what the zygote made (no copy-on-write of it all)
sock.sendall(b"ready")
while True:
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
    if not msg:
        os._exit(0)
    request = json.loads(msg)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        break
    for fd in fds:
        os.close(fd)
    sock.sendall(json.dumps(["pid", pid]).encode())
    _, status = os.waitpid(pid, 0)
    sock.sendall(json.dumps(["exit", os.waitstatus_to_exitcode(status)]).encode())
# The child: from here on it is `python -m rewriter ARGS` (or `python -c CODE ARGS`).
sock.close()
for target, fd in enumerate(fds):
    os.dup2(fd, target)
    os.close(fd)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
import atexit, importlib, runpy, signal, tempfile, threading
tempfile.tempdir = None
importlib.invalidate_caches()
code = request["code"]
try:
    if code is None:
        sys.path[0] = os.getcwd()  # what -m puts first
        sys.argv = ["-m", *request["args"]]
        del sock, fds, msg, request, pid, target, fd, code
        runpy._run_module_as_main("rewriter")
    else:
        sys.path[0] = ""  # what -c puts first
        sys.argv = ["-c", *request["args"]]
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        exec(compile(code, "<string>", "exec"), main.__dict__)
    status = 0
except SystemExit as exc:
    if exc.code is None:
        status = 0
    elif isinstance(exc.code, int):
        status = exc.code
    else:
        print(exc.code, file=sys.stderr)
        status = 1
except BaseException as exc:
    sys.excepthook(type(exc), exc, exc.__traceback__)
    status = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
# The interpreter's exit, without tearing down every module (torch's teardown alone takes
# a second): threads joined, atexit run, stdout and stderr flushed (a failure: exit 120).
threading._shutdown()
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except Exception as exc:
        try:
            print(f"Exception ignored in: {stream!r}\n{type(exc).__name__}: {exc}", file=sys.__stderr__)
        except Exception:
            pass
        status = 120
if status < 0:
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
os._exit(status & 0xFF)
"""

# What the interpreter reads at startup: a call that changes one of these needs a fresh process.
_STARTUP_PREFIXES = ("PYTHON", "LC_")
_STARTUP_NAMES = ("LANG", "LANGUAGE")


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) or k in _STARTUP_NAMES}


class _Zygote:
    def __init__(self, torch: bool) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, str(theirs.fileno()), str(ROOT), "torch" if torch else "-"],
            pass_fds=[theirs.fileno()],
            # stdout and stderr are pipes, as for subprocess.run(capture_output=True): the
            # children's sys.stdout and sys.stderr are the zygote's, made for a pipe.
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=self.env,
        )
        theirs.close()
        self.sock = ours
        ours.settimeout(300)
        answer = ours.recv(16)
        if answer not in (b"ready", b"threads"):
            self.proc.kill()
            raise RuntimeError("the CLI zygote did not start: " + self.proc.communicate()[1].decode())
        self.usable = answer == b"ready"
        ours.settimeout(None)

    def serves(self, env: dict[str, str]) -> bool:
        return self.usable and self.proc.poll() is None and _startup_env(env) == _startup_env(self.env)

    def close(self) -> None:
        self.sock.close()  # the zygote reads end-of-file and exits
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def run(self, code: str | None, args: tuple[str, ...], env: dict[str, str], cwd: Path, timeout: float):
        """(exit code, stdout, stderr) of ``python -m rewriter ARGS`` (code None) or ``python -c CODE ARGS``."""
        argv = [sys.executable, *(["-m", "rewriter"] if code is None else ["-c", code]), *args]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = {"code": code, "args": list(args), "env": env, "cwd": str(cwd)}
        try:
            stdin = os.dup(0)
        except OSError:
            stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], [stdin, out_w, err_w])
        finally:
            for fd in (stdin, out_w, err_w):
                os.close(fd)
        kind, pid = json.loads(self.sock.recv(4096))
        assert kind == "pid"
        deadline = time.monotonic() + timeout
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    os.kill(pid, 9)
                    self.sock.recv(4096)
                    for fd in chunks:
                        os.close(fd)
                    raise subprocess.TimeoutExpired(argv, timeout)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        for fd in chunks:
            os.close(fd)
        kind, code = json.loads(self.sock.recv(4096))
        assert kind == "exit"
        return code, b"".join(chunks[out_r]), b"".join(chunks[err_r])


_zygotes: dict[bool, _Zygote] = {}  # with torch imported (for verify) or not


def _text(data: bytes) -> str:
    """What ``subprocess.run(text=True)`` makes of the bytes: locale encoding, universal newlines."""
    import locale

    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI, ``python -m rewriter ARGS``: forked from the zygote, or a fresh process."""
    return _python(None, args, env, cwd)


def python_c(
    code: str, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` as ``cli()`` runs the CLI: forked from the zygote, or fresh.
    The zygote has imported the CLI's modules: not for a test of what a process imports."""
    return _python(code, args, env, cwd)


def _python(
    code: str | None, args: tuple[str, ...], env: dict[str, str] | None, cwd: Path | None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    argv = [sys.executable, *(["-m", "rewriter"] if code is None else ["-c", code]), *args]
    if not os.environ.get("MM3_CODEMOD_TEST_FRESH_CLI") and hasattr(socket, "send_fds"):
        # `run` proves what it writes by verify's semantic level: torch imported too.
        torch = code is None and ("verify" in args or "run" in args)
        zygote = _zygotes.get(torch)
        if zygote is None or (zygote.usable and zygote.proc.poll() is not None):
            zygote = _zygotes[torch] = _Zygote(torch)
        if zygote.serves(full_env):
            status, out, err = zygote.run(code, args, full_env, Path(cwd or ROOT).resolve(), timeout=300)
            return subprocess.CompletedProcess(argv, status, _text(out), _text(err))
    return subprocess.run(argv, capture_output=True, text=True, env=full_env, cwd=cwd or ROOT, timeout=300)


def pytest_unconfigure(config) -> None:
    while _zygotes:
        _zygotes.popitem()[1].close()


@pytest.fixture
def copy_fixture(tmp_path: Path):
    """Copy ``fixtures/<variant>/model.py`` to a temp file and return its path."""

    def copy(variant: str, name: str = "model.py") -> Path:
        target = tmp_path / variant / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FIXTURES / variant / "model.py", target)
        return target

    return copy


# One fixture in each state a report shows (not-a-site, needs-bypass, half-applied, patched,
# native, outdated, a stale bypass to strip, a refusal): a folder for tests of how a
# command line is read, where the rest of the work is the same code for every file.
STATES = (
    "dense_only",
    "fork_era",
    "half_applied",
    "patched",
    "native",
    "seed_form",
    "native_stale_bypass",
    "two_candidates",
)


def fixture_folder(root: Path, variants: Iterable[str] = STATES) -> Path:
    """``root/<fixture>/model.py`` for each of ``variants``, as real files (the fixtures
    folder holds symlinks)."""
    for variant in variants:
        (root / variant).mkdir(parents=True)
        shutil.copyfile(FIXTURES / variant / "model.py", root / variant / "model.py")
    return root


def make_vllm_tree(root: Path, files: dict[str, bytes], init: str = "") -> Path:
    """A minimal ``vllm`` package under ``root`` with files in minimax_m3/nvidia."""
    nvidia = root / "vllm" / "models" / "minimax_m3" / "nvidia"
    nvidia.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(init)
    for name, data in files.items():
        path = nvidia / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return nvidia


@pytest.fixture(scope="session", autouse=True)
def verdict_cache(tmp_path_factory):
    """`run` leaves a verdict for the plugin in the user's cache (rewriter.verdicts): under the
    tests, in a folder of theirs, never the real ~/.cache (a test that needs its own sets it)."""
    os.environ.setdefault("MM3_CODEMOD_SERVE_CACHE", str(tmp_path_factory.mktemp("verdicts")))
    yield


@pytest.fixture(scope="session", autouse=True)
def no_temp_folder_left(tmp_path_factory):
    """Everything temporary that the code under test makes - in this process or in the CLI,
    pre-commit and pip processes the tests start - goes under one TMPDIR, which must be
    empty again at the end (pytest's own tmp_path folders live elsewhere)."""
    temp = tmp_path_factory.mktemp("TMPDIR")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(temp)
    tempfile.tempdir = None  # tempfile reads TMPDIR again
    yield
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    left = sorted(p.name for p in temp.iterdir())
    assert not left, f"temporary files left behind: {left}"


# The mutation corpus's and the spelling variants' results, gathered from the test reports:
# under pytest-xdist the tests run in worker processes, and what reaches this (controlling)
# process is their reports. Each module's RESULTS: (fixture, kinds, outcome, reason).
_OUTCOMES = {
    "mutations": ("mutation corpus", ("rewritten", "refused", "wrong")),
    "variants": ("spelling variants", ("right", "refused", "wrong", "harmful advice")),
}
_RESULTS: dict[str, list[tuple]] = {name: [] for name in _OUTCOMES}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A corpus or variant test's results (RESULTS of tests/mutations.py, tests/variants.py)
    ride on its report."""
    lists = {name: getattr(sys.modules.get(name), "RESULTS", None) for name in _OUTCOMES}
    counts = {name: len(r) if r is not None else 0 for name, r in lists.items()}
    yield
    for name, results in lists.items():
        if results is not None and len(results) > counts[name]:
            index = item.session.items.index(item)  # the same in every xdist worker: all collect alike
            for fixture, kinds, result, reason in results[counts[name] :]:
                item.user_properties.append((name, (index, fixture, list(kinds), result, reason)))


def pytest_runtest_logreport(report) -> None:
    for name, value in report.user_properties:
        if name in _RESULTS and report.when == "call":
            _RESULTS[name].append(tuple(value))


def pytest_terminal_summary(terminalreporter) -> None:
    """The counts of the mutation corpus and of the spelling variants, by kind."""
    write = terminalreporter.write_line
    for name, (title, outcomes) in _OUTCOMES.items():
        results = [r[1:] for r in sorted(_RESULTS[name], key=lambda r: r[0])]  # in collection order
        if not results:
            continue
        terminalreporter.section(title)
        total = {o: sum(1 for r in results if r[2] == o) for o in outcomes}
        write(f"{len(results)} variants: " + ", ".join(f"{total[o]} {o}" for o in outcomes))
        kinds = sorted({k for r in results for k in r[1]})
        write(f"{'kind (in a variant)':40} " + " ".join(f"{o:>14}" for o in outcomes))
        for kind in kinds:
            counts = [sum(1 for r in results if kind in r[1] and r[2] == o) for o in outcomes]
            write(f"{kind:40} " + " ".join(f"{n:>14}" for n in counts))
        for fixture, kinds_, outcome, reason in results:
            if outcome != outcomes[0]:
                write(f"{outcome}: {fixture} {'+'.join(kinds_)}: {reason}")


def syntax_tree(source: str) -> str:
    """``ast.dump`` of a file, docstrings compared without the whitespace black may move."""
    module = ast.parse(source)
    for node in ast.walk(module):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and ast.get_docstring(node) is not None
        ):
            node.body[0] = ast.Expr(ast.Constant(inspect.cleandoc(node.body[0].value.value).strip()))
    return ast.dump(module)


_FIXTURE_BYTES: dict[Path, bytes] = {}


def pytest_sessionstart(session) -> None:
    _FIXTURE_BYTES.update((p, p.read_bytes()) for p in FIXTURES.rglob("*.py"))


def pytest_sessionfinish(session, exitstatus) -> None:
    """No test may write the fixtures it reads (a run on a fixture path writes it)."""
    changed = [str(p) for p, data in _FIXTURE_BYTES.items() if not p.exists() or p.read_bytes() != data]
    if changed:
        print("\nfixtures changed by the tests: " + ", ".join(changed))
        session.exitstatus = 1


# ---- the inner loop: `pytest -m "not slow"` ---------------------------------------------
# Every test function runs in it, with its first parametrized case; the other cases, a real
# pre-commit hook environment (its file), the property test's hundreds of random edits, the
# vLLM plugin's starts (a vLLM import each) and
# the bench scripts' whole runs are `slow`: the full suite (the README's test command, CI)
# runs all.
SLOW_FILES = {"test_pre_commit.py", "test_properties.py", "test_plugin.py"}
SLOW_TESTS = {"test_bench_runs_and_writes_every_row"}


def pytest_collection_modifyitems(config, items) -> None:
    seen: set[tuple[str, str]] = set()
    for item in items:
        key = (item.path.name, getattr(item, "originalname", item.name))
        if item.path.name in SLOW_FILES or key[1] in SLOW_TESTS or key in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(key)
