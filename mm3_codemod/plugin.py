"""vLLM plugin (entry point group ``vllm.general_plugins``): guard the MiniMax-M3 model file
vLLM imports, in every vLLM process (API server, engine core, each tensor-parallel worker).

Loading the plugin imports the standard library and ``rewriter.targets`` (the model folders)
only, no LibCST, typer or rich (tests/test_plugin.py checks); it puts one import hook
(``sys.meta_path``) in front of vLLM's MiniMax-M3 model packages (``vllm/models/minimax_m3/
nvidia/`` and ``amd/``). When vLLM imports one of their modules, the hook asks the same
analysis as ``mm3-codemod check`` about the installed file, and by ``MM3_CODEMOD_PLUGIN``:

- ``check`` (the default): a file that is ``native`` or ``patched`` (or has no fused insert)
  is imported as it is, with one log line. Any other file is imported as it is too, but its
  layer classes stop their construction - inside the model's ``__init__``, before any weight
  is loaded - when vLLM's current config asks for an fp8 KV cache, with one line: the state,
  the file and the command that fixes it. A bf16 start is never stopped.
- ``apply``: a file ``run`` would rewrite is served from its rewrite, proven at start-up by
  the semantic level (as ``run`` proves before it writes) and kept in the user's cache, so
  that tracebacks and torch.compile read real source; no file of the installed vLLM changes.
  Every process reads the same installed bytes, so every process serves the same rewrite. A
  file ``run`` refuses, or whose rewrite is not proven, stops an fp8 start with that reason.
- ``off``: nothing is hooked. vLLM's own selection works too: ``VLLM_PLUGINS`` without
  ``mm3_codemod`` loads neither entry point; ``VLLM_PLUGINS=mm3_codemod_apply`` selects apply.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

MODE_VAR = "MM3_CODEMOD_PLUGIN"
MODES = ("check", "apply", "off")
APPLY_ENTRY = "mm3_codemod_apply"  # the entry point that selects apply through VLLM_PLUGINS
FINE = ("native", "patched")  # the states an fp8 start needs (check's words)
FP8 = "fp8"  # every fp8 KV-cache dtype vLLM knows ("fp8", "fp8_e4m3", "fp8_e5m2") starts so

logger = logging.getLogger("vllm.plugins.mm3_codemod")  # vLLM's handlers print it


class Fp8KvCacheStop(RuntimeError):
    """The one-line reason an fp8 start stops (raised in a layer's ``__init__``)."""


def register() -> None:
    """Both entry points, ``mm3_codemod`` and ``mm3_codemod_apply``: the hook, in ``mode()``."""
    install(mode())


def mode() -> str:
    """``MM3_CODEMOD_PLUGIN`` if set, else apply where ``VLLM_PLUGINS`` selects it, else check."""
    chosen = os.environ.get(MODE_VAR, "").strip().lower()
    if chosen:
        if chosen not in MODES:
            raise ValueError(f"{MODE_VAR}={chosen!r}: expected one of {', '.join(MODES)}")
        return chosen
    selected = {name.strip() for name in os.environ.get("VLLM_PLUGINS", "").split(",")}
    return "apply" if APPLY_ENTRY in selected else "check"


def install(how: str) -> None:
    """Put the hook in front of the import system, once a process (vLLM loads plugins more
    than once); a model module imported already is guarded where it is."""
    if how == "off" or any(isinstance(f, ModelHook) for f in sys.meta_path):
        return
    hook = ModelHook(how)
    sys.meta_path.insert(0, hook)
    for name, module in list(sys.modules.items()):
        if hook.guards(name) and getattr(module, "__file__", None):
            hook.guard_loaded(module)


def cache_dtype() -> str | None:
    """The KV-cache dtype of the config vLLM is building the model under, or None."""
    try:
        from vllm import config
    except Exception:  # no vLLM here: nothing to stop
        return None
    current = getattr(config, "get_current_vllm_config_or_none", None)
    try:
        vllm_config = current() if current else config.get_current_vllm_config()
    except Exception:  # outside a config context
        return None
    cache = getattr(vllm_config, "cache_config", None)
    return str(cache.cache_dtype) if cache is not None else None


class ModelHook(importlib.abc.MetaPathFinder):
    """Finds vLLM's MiniMax-M3 model modules first; every other import passes by."""

    def __init__(self, how: str) -> None:
        from rewriter.targets import MODEL_DIRS

        self.how = how
        self.prefixes = tuple("vllm." + ".".join(parts) + "." for parts in MODEL_DIRS)

    def guards(self, name: str) -> bool:
        return name.startswith(self.prefixes)

    def find_spec(self, fullname, path, target=None):  # the import system's finder protocol
        if not self.guards(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return spec
        served = self.judged(Path(spec.origin))
        if isinstance(served, Path):  # apply: the proven rewrite, from the cache
            return importlib.util.spec_from_file_location(fullname, served)
        if served is not None:  # a stop to arm in the module's layer classes
            spec.loader = GuardedLoader(spec.loader, served)
        return spec

    def guard_loaded(self, module) -> None:
        served = self.judged(Path(module.__file__))
        if isinstance(served, Path):
            served = Stop(module.__file__, "imported before the plugin was loaded; not served", ())
            logger.warning("mm3-codemod: %s", served.line)
        if served is not None:
            served.arm(module)

    def judged(self, path: Path) -> Stop | Path | None:
        """``judge``, where the tool's own failure never stops vLLM: it says so, in one line."""
        try:
            return self.judge(path)
        except Exception as exc:
            logger.warning("mm3-codemod: %s: not checked (%s: %s); imported as it is", path, type(exc).__name__, exc)
            return None

    def judge(self, path: Path) -> Stop | Path | None:
        """None: import the file as it is; a ``Stop``: as it is, with the stop armed; a path:
        the proven rewrite to import instead (apply)."""
        started = time.perf_counter()
        try:
            raw = path.read_bytes()
        except OSError:  # vLLM's own import says what is wrong with it
            return None
        result = None
        verdict = Verdict.load(path, raw)
        if verdict is None:  # one analysis; apply's also plans the rewrite it may serve
            from rewriter.apply import classify_file, plan_file

            result = (plan_file if self.how == "apply" else classify_file)(path)
            verdict = Verdict.of(path, result)
        took = f"{time.perf_counter() - started:.2f} s"
        if verdict.fine:
            if verdict.states:
                logger.info("mm3-codemod: %s: %s: fp8 KV cache supported (checked in %s)", path, verdict.states, took)
            return None
        if verdict.refusal is not None:
            return Stop(str(path), f"{verdict.states}: `run` refuses it: {verdict.refusal}", verdict.classes, fix=False)
        if self.how != "apply":
            return Stop(str(path), verdict.states, verdict.classes)
        served = verdict.serve(started, result)
        if isinstance(served, Path):
            return served
        return Stop(str(path), f"{verdict.states}: {served}", verdict.classes, fix=False)


class Verdict:
    """What the analysis says of one installed file, kept in the cache under its bytes' digest
    (and the tool's version): every process of a start, and every later start, reads the same
    verdict and serves the same proven rewrite without analysing again."""

    def __init__(self, path: Path, key: str, facts: dict) -> None:
        self.path, self.key, self.facts = path, key, facts
        self.fine: bool = facts["fine"]
        self.states: str = facts["states"]
        self.classes: tuple[str, ...] = tuple(facts["classes"])
        self.refusal: str | None = facts["refusal"]

    @staticmethod
    def key_of(raw: bytes) -> str:
        from rewriter import __version__

        return hashlib.sha256(__version__.encode() + b"\0" + raw).hexdigest()[:32]

    @classmethod
    def load(cls, path: Path, raw: bytes) -> Verdict | None:
        key = cls.key_of(raw)
        try:
            return cls(path, key, json.loads((cache_dir() / f"{path.stem}-{key}.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def of(cls, path: Path, result) -> Verdict:
        """The verdict of ``classify_file``'s or ``plan_file``'s result, keyed by the bytes it read."""
        from rewriter.apply import FileStatus

        fine = result.status in (FileStatus.NO_SITES, FileStatus.UNCHANGED)
        work = [s for s in result.sites if s.state.value not in (*FINE, "not-a-site")]
        if fine:
            states = ", ".join(sorted({s.state.value for s in result.sites if s.state.value in FINE}))
        else:
            states = ", ".join(f"{s.state.value} at line {s.line}" for s in work) or "unreadable"
        refused = result.status is not FileStatus.NEEDS_REWRITE
        facts = {
            "installed": str(path),
            "fine": fine,
            "states": states,
            # the layer classes to arm; none where a site is outside a class (then: all)
            "classes": sorted({s.class_name for s in work}) if all(s.class_name for s in work) else [],
            "refusal": None if fine or not refused else (work[0].reason if work else result.error),
        }
        verdict = cls(path, cls.key_of(result.original), facts)
        if not (fine and all(s.state.value == "native" for s in result.sites)):  # the fast path needs no cache
            verdict.save()
        return verdict

    def save(self) -> None:
        try:
            cache_dir().mkdir(parents=True, exist_ok=True)
            _atomic(cache_dir() / f"{self.path.stem}-{self.key}.json", json.dumps(self.facts).encode())
        except OSError as exc:  # a read-only home: every start analyses again
            logger.debug("mm3-codemod: the cache is not writable: %s", exc)

    def serve(self, started: float, result=None) -> Path | str:
        """The proven rewrite, as a file of the cache (proven now unless this file's rewrite was
        proven before), or why it cannot be served; ``result``: this start's ``plan_file`` of the
        file, where it made one."""
        served = cache_dir() / f"{self.path.stem}-{self.key}.py"
        known = self.facts.get("served")
        try:
            if known and hashlib.sha256(served.read_bytes()).hexdigest() == known["sha256"]:
                logger.info(
                    "mm3-codemod: serving %s, the rewrite of %s proven before: %s (%.2f s)",
                    served, self.path, known["proof"], time.perf_counter() - started,
                )
                return served
        except OSError:
            pass
        from rewriter.apply import FileStatus, plan_file
        from rewriter.proof import prove

        if result is None:  # the verdict came from the cache, its rewrite did not
            result = plan_file(self.path)
        if result.status is not FileStatus.NEEDS_REWRITE or result.new is None:  # changed meanwhile
            return f"the file changed while it was read ({result.status.value})"
        proof = prove(result)
        if not proof.proven:
            return f"its rewrite is not proven ({proof.status}: {proof.reason}), so it is not served"
        try:
            cache_dir().mkdir(parents=True, exist_ok=True)
            _atomic(served, result.new)
        except OSError as exc:
            return f"the proven rewrite cannot be kept in {cache_dir()} ({exc}), so it is not served"
        self.facts["served"] = {"sha256": hashlib.sha256(result.new).hexdigest(), "proof": proof.reason}
        self.save()
        logger.info(
            "mm3-codemod: serving the rewrite of %s from %s, proven now: %s (%.2f s); the installed file is unchanged",
            self.path, served, proof.reason, time.perf_counter() - started,
        )
        return served


class Stop:
    """What stops an fp8 start: the line, and the layer classes that raise it."""

    def __init__(self, path: str, why: str, classes: tuple[str, ...], fix: bool = True) -> None:
        from rewriter.report import direct_command

        self.classes = classes
        self.line = f"{path}: {why}: an fp8 KV cache crashes in the fused insert op"
        if fix:
            import shlex

            self.line += f"; fix: {direct_command()} run {shlex.quote(path)} (or serve with {MODE_VAR}=apply)"

    def arm(self, module) -> None:
        """The layer classes of the sites (every class the module defines where a site is in
        no class) check the KV-cache dtype before their ``__init__`` runs."""
        named = self.classes or [
            name for name, value in vars(module).items()
            if isinstance(value, type) and value.__module__ == module.__name__ and "__init__" in vars(value)
        ]
        for name in named:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and not hasattr(cls.__init__, "_mm3_codemod_stop"):
                cls.__init__ = self.guarded(cls.__init__)

    def guarded(self, init):
        import functools

        line = self.line

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            dtype = cache_dtype()
            if dtype is not None and dtype.startswith(FP8):
                raise Fp8KvCacheStop(f"mm3-codemod: --kv-cache-dtype {dtype}: {line}")
            init(self, *args, **kwargs)

        __init__._mm3_codemod_stop = line
        return __init__


class GuardedLoader(importlib.abc.Loader):
    """vLLM's own loader, then the stop armed in the module it made."""

    def __init__(self, loader: importlib.abc.Loader, stop: Stop) -> None:
        self.loader, self.stop = loader, stop

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.stop.arm(module)
        logger.info("mm3-codemod: %s; a bf16 KV cache runs as it is, an fp8 start stops here", self.stop.line)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("MM3_CODEMOD_SERVE_CACHE") or os.path.join(base, "mm3-codemod", "served"))


def _atomic(path: Path, data: bytes) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(temp, 0o644)  # readable where the cache is shared (a docker image's)
    os.replace(temp, path)
