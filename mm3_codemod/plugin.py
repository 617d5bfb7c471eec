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

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

from rewriter.verdicts import Verdict, atomic_write, cache_dir

MODE_VAR = "MM3_CODEMOD_PLUGIN"
MODES = ("check", "apply", "off")
APPLY_ENTRY = "mm3_codemod_apply"  # the entry point that selects apply through VLLM_PLUGINS
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

    def judged(self, path: Path, judge=None) -> Stop | Path | None:
        """``judge`` (or another judge of ``path``), where the tool's own failure never stops
        vLLM: it says so, in one line."""
        try:
            return (judge or self.judge)(path)
        except Exception as exc:
            logger.warning("mm3-codemod: %s: not checked (%s: %s); imported as it is", path, type(exc).__name__, exc)
            return None

    def judge(self, path: Path) -> Stop | Path | None:
        """None: import the file as it is; a ``Stop``: as it is, with the stop armed; a path:
        the proven rewrite to import instead (apply). ``check`` reads a file the pre-filter
        cannot answer (no LibCST), or a native call (it is run, as ``check`` runs it), only when a layer of it is
        built for an fp8 cache: a bf16 start never pays for the analysis."""
        started = time.perf_counter()
        try:
            raw = path.read_bytes()
        except OSError:  # vLLM's own import says what is wrong with it
            return None
        verdict = Verdict.load(path, raw)
        if verdict is None and self.how == "check":
            from rewriter.apply import FileResult, FileStatus, quick_sites

            sites = quick_sites(raw)
            if sites is None or any(s.state.value == "native" for s in sites):  # at the first fp8 layer (``Stop.settled``)
                now = lambda p: self.decided(p, raw, started=time.perf_counter())  # noqa: E731
                return Stop(str(path), "", (), later=lambda: self.judged(path, now))
            status = FileStatus.UNCHANGED if sites else FileStatus.NO_SITES
            verdict = Verdict.of(FileResult(path, status, sites, original=raw), keep=False)
        return self.decided(path, raw, verdict, started)

    def decided(self, path: Path, raw: bytes, verdict: Verdict | None = None, started: float = 0.0):
        """``judge``'s answer from the verdict; without one, from one analysis of ``raw``, the
        bytes read at import (apply's also plans the rewrite it may serve)."""
        result = None
        if verdict is None:
            from rewriter.apply import classify_file, plan_file
            from rewriter.commands import judge  # a bypass not run's own is run, as check does

            planned = plan_file(path, raw=raw) if self.how == "apply" else classify_file(path, raw=raw)
            with plain_torch():  # a bypass that is not run's own is run here, off vLLM's device
                result = judge(planned)
            verdict = Verdict.of(result)
        took = f"{time.perf_counter() - started:.2f} s"
        if verdict.fine:
            if verdict.states:
                logger.info("mm3-codemod: %s: %s: fp8 KV cache supported (checked in %s)", path, verdict.states, took)
            return None
        if verdict.refusal is not None:
            return Stop(str(path), f"{verdict.states}: `run` refuses it: {verdict.refusal}", verdict.classes, fix=False)
        if self.how != "apply":
            return Stop(str(path), verdict.states, verdict.classes)
        served = serve(verdict, raw, started, result)
        if isinstance(served, Path):
            return served
        return Stop(str(path), f"{verdict.states}: {served}", verdict.classes, fix=False)


@contextlib.contextmanager
def plain_torch():
    """torch's defaults as a fresh interpreter has them - vLLM builds its layers under the
    model's dtype and device, the proof's stand-in expects float32 on the CPU; nothing to do
    where torch is not imported yet."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def serve(verdict: Verdict, raw: bytes, started: float, result=None) -> Path | str:
    """The proven rewrite of ``raw`` (the installed bytes the verdict is keyed by), as a file of
    the cache (proven now unless it was proven before), or why it cannot be served; ``result``:
    this start's ``plan_file`` of them, where it made one."""
    served = cache_dir() / f"{verdict.path.stem}-{verdict.key}.py"
    known = verdict.facts.get("served")
    try:
        if known and hashlib.sha256(served.read_bytes()).hexdigest() == known["sha256"]:
            logger.info(
                "mm3-codemod: serving %s, the rewrite of %s proven before: %s (%.2f s)",
                served, verdict.path, known["proof"], time.perf_counter() - started,
            )
            return served
    except OSError:
        pass
    from rewriter.apply import FileStatus, plan_file
    from rewriter.proof import prove

    if result is None:  # the verdict came from the cache, its rewrite did not
        result = plan_file(verdict.path, raw=raw)
    # a kept record that these bytes' plan does not bear out
    if result.status is not FileStatus.NEEDS_REWRITE or result.new is None:
        return f"its rewrite cannot be planned again ({result.status.value}: {result.error})"
    proof = prove(result)
    if not proof.proven:
        return f"its rewrite is not proven ({proof.status}: {proof.reason}), so it is not served"
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        atomic_write(served, result.new)
    except OSError as exc:
        return f"the proven rewrite cannot be kept in {cache_dir()} ({exc}), so it is not served"
    verdict.facts["served"] = {"sha256": hashlib.sha256(result.new).hexdigest(), "proof": proof.reason}
    verdict.save()
    logger.info(
        "mm3-codemod: serving the rewrite of %s from %s, proven now: %s (%.2f s); the installed file is unchanged",
        verdict.path, served, proof.reason, time.perf_counter() - started,
    )
    return served

class Stop:
    """What stops an fp8 start: the line, and the layer classes that raise it; ``later``: the
    file is not judged yet, and the first fp8 layer built asks it (then every class is armed)."""

    def __init__(self, path: str, why: str, classes: tuple[str, ...], fix: bool = True, later=None) -> None:
        self.classes, self.later, self.told = classes, later, False
        self.line = f"{path}: {why}: an fp8 KV cache crashes in the fused insert op"
        if later is not None:
            self.line = f"{path}: not judged (it is when a layer is built for an fp8 KV cache)"
        elif fix:
            import shlex

            from rewriter.report import direct_command

            self.line += f"; fix: {direct_command()} run {shlex.quote(path)} (or serve with {MODE_VAR}=apply)"

    def settled(self) -> Stop | None:
        """The stop an fp8 layer raises, or None: a file judged later is judged now, once."""
        if self.later is not None:
            self.later, judged = None, self.later()
            self.line = judged.line if judged is not None else ""
        return self if self.line else None

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

        stop = self

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            dtype = cache_dtype()
            if dtype is not None and dtype.startswith(FP8) and (judged := stop.settled()) is not None:
                raise Fp8KvCacheStop(f"mm3-codemod: --kv-cache-dtype {dtype}: {judged.line}")
            if stop.later is not None and not stop.told:  # not judged: said once, by the first layer
                logger.info("mm3-codemod: %s; this start's KV cache is %s: runs as it is", stop.line, dtype or "not set")
                stop.told = True
            init(self, *args, **kwargs)

        __init__._mm3_codemod_stop = stop
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
        if self.stop.later is None:  # one a file judged later says when its first layer is built
            logger.info("mm3-codemod: %s; a bf16 KV cache runs as it is, an fp8 start stops here", self.stop.line)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)
