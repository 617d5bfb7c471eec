"""Which files to look at: explicit paths, vLLM trees, or another interpreter's vLLM (found
with ``importlib.util.find_spec``, never imported: importing it is slow and wants a GPU stack)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# The one list of the model folders under ``vllm/`` (MiniMax-M3 ships one per platform, each with
# the same sparse layer and insert op): every way of finding files looks in each, in this order.
MODEL_PACKAGE = ("models", "minimax_m3")
PLATFORMS = ("nvidia", "amd")
MODEL_DIRS = tuple((*MODEL_PACKAGE, platform) for platform in PLATFORMS)
NVIDIA_PARTS = MODEL_DIRS[PLATFORMS.index("nvidia")]
# How messages name them: "vllm/models/minimax_m3/nvidia/ or amd/".
MODEL_DIRS_SHOWN = "/".join(("vllm", *MODEL_PACKAGE, "")) + "/ or ".join(PLATFORMS) + "/"
# The hooks' `files:` regex (.pre-commit-hooks.yaml, the README's snippet): every .py under them.
HOOK_FILES = "/".join(("vllm", *MODEL_PACKAGE)) + "/(" + "|".join(PLATFORMS) + r")/.*\.py$"


class TargetError(Exception):
    """A target that cannot be resolved; the message is one line and names it."""


@dataclass(frozen=True)
class Target:
    """One file to process, where it came from, and the vLLM release it belongs to."""

    path: Path
    origin: str
    vllm_version: str | None = None  # from distribution metadata; None for plain paths
    # The folder the user targeted (a fork root, a site-packages, the working folder):
    # diffs name the file relative to it, so that `git apply` works from there.
    root: Path | None = None

    @property
    def diff_name(self) -> str:
        """The path a diff names: relative to ``root`` (POSIX), else the file's name."""
        path = Path(os.path.abspath(self.path))
        if self.root is not None and path.is_relative_to(os.path.abspath(self.root)):
            return path.relative_to(os.path.abspath(self.root)).as_posix()
        return path.name


def dist_version_beside(package: Path) -> str | None:
    """The version in ``vllm-*.dist-info/METADATA`` (or an egg-info's PKG-INFO) next to the ``vllm``
    package folder (its header block); None if there is none or several disagree."""
    from email.parser import HeaderParser

    versions, parent = set(), package.parent
    for meta in [*parent.glob("vllm-*.dist-info/METADATA"), *parent.glob("vllm*.egg-info/PKG-INFO")]:
        with contextlib.suppress(OSError):
            headers = HeaderParser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
            version = (headers.get("version") or "").strip()
            if (headers.get("name") or "").strip().lower().replace("_", "-") == "vllm" and version:
                versions.add(version)
    return versions.pop() if len(versions) == 1 else None


def tree_version(package: Path, thorough: bool) -> str | None:
    """The version of the vLLM whose package folder is ``package``: the metadata beside it; with
    ``thorough`` (survey's), else its version file, else ``git describe --tags`` of its checkout."""
    version = dist_version_beside(package)
    if version or not thorough:
        return version
    return version_in_file(package) or git_describe(package.parent)


def version_in_file(package: Path) -> str | None:
    """The string a top-level ``__version__``/``version`` is set to in the package's version file:
    setuptools-scm's ``_version.py``, else the ``version.py`` of older trees (read, never imported)."""
    import ast

    for name in ("_version.py", "version.py"):
        try:
            module = ast.parse((package / name).read_bytes())
        except (OSError, SyntaxError, ValueError, RecursionError):
            continue
        for node in module.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
                names = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value.value
                named = any(isinstance(n, ast.Name) and n.id in ("__version__", "version") for n in names)
                if named and isinstance(value, str) and value.strip():
                    return value.strip()
    return None


def git_describe(checkout: Path) -> str | None:
    """``git describe --tags`` of a checkout whose top is ``checkout`` (not a folder inside another
    repository), a leading ``v`` dropped; None where git is missing, fails or has no tag to tell."""
    if not (checkout / ".git").exists():  # a folder, or a file in a worktree
        return None
    try:  # past 10 s the version is "unknown"
        proc = run_python(["git", "-C", str(checkout), "describe", "--tags"], timeout=10.0)
    except (OSError, subprocess.TimeoutExpired):
        return None
    described = proc.stdout.strip()
    if proc.returncode != 0 or len(described.split()) != 1:  # none, or not one word
        return None
    return described[1:] if described[:1] == "v" and described[1:2].isdigit() else described


def example_path() -> Path:
    """The bundled fork-era model file (state ``needs-bypass``)."""
    return Path(str(resources.files("rewriter") / "data" / "example_model.py"))


def model_dirs(root: Path, origin: str) -> list[Path]:
    """The model folders (``MODEL_DIRS``) that exist under a checkout, site-packages or the
    ``vllm`` package folder itself, in ``PLATFORMS`` order; a TargetError if there is none."""
    if not root.is_dir():
        raise TargetError(f"{root}: {origin}: no such directory")
    for base in (root / "vllm", root):
        found = [base.joinpath(*parts) for parts in MODEL_DIRS if base.joinpath(*parts).is_dir()]
        if found:
            return found
    vllm = (root / "vllm").is_dir() or (root / "__init__.py").is_file()
    what = "this vLLM has no MiniMax-M3 model" if vllm else "not a vLLM checkout, site-packages or package"
    raise TargetError(f"{root}: {origin}: {what} (no {MODEL_DIRS_SHOWN})")


def nvidia_dir(root: Path, origin: str) -> Path:
    """``vllm/models/minimax_m3/nvidia`` under a checkout, site-packages or the package."""
    for folder in model_dirs(root, origin):
        if folder.name == NVIDIA_PARTS[-1]:
            return folder
    raise TargetError(
        f"{root}: {origin}: this vLLM has no MiniMax-M3 NVIDIA model (no vllm/{'/'.join(NVIDIA_PARTS)}/)"
    )


def model_files(folders: Sequence[Path]) -> list[Path]:
    """Every ``*.py`` under the model folders, folder by folder (``python_files``)."""
    return [path for folder in folders for path in python_files(folder)]


def python_files(folder: Path) -> list[Path]:
    """Every ``*.py`` file under ``folder`` (hidden ones, cache and symlinked folders skipped), and
    every folder that cannot be listed: never skipped in silence, a target whose planning says why."""
    found: list[Path] = []
    for where, folders, files in os.walk(folder, onerror=lambda exc: found.append(Path(exc.filename))):
        folders[:] = [name for name in folders if not name.startswith(".") and name != "__pycache__"]
        found.extend(Path(where, f) for f in files if f.endswith(".py") and not f.startswith("."))
    return sorted(found)


# Runs in the target interpreter: finds vllm and its version without importing it.
_FIND_VLLM = """
import importlib.util, json
try:
    spec = importlib.util.find_spec("vllm")
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
else:
    locations = list(spec.submodule_search_locations or []) if spec else []
    try:
        import importlib.metadata
        version = importlib.metadata.version("vllm") if locations else None
    except Exception:
        version = None
    print(json.dumps({"locations": locations, "version": version}))
"""


class VllmNotInstalled(TargetError):
    """The interpreter asked has no vLLM, or none its import system can locate; ``reason`` says which."""

    def __init__(self, who: str, reason: str) -> None:
        super().__init__(f"{who}: {reason}")
        self.reason = reason


def _vllm_from_report(report: dict[str, object], who: str) -> Path:
    if "error" in report:
        raise VllmNotInstalled(who, f"cannot look up vllm: {report['error']}")
    locations = report.get("locations") or []
    if not locations:
        raise VllmNotInstalled(who, "vLLM is not installed in this environment")
    return Path(str(locations[0]))  # type: ignore[index]


def _is_answer(report: object) -> bool:
    """Whether another interpreter's last line is what ``_FIND_VLLM`` prints."""
    if not isinstance(report, dict):
        return False
    if "error" in report:
        return isinstance(report["error"], str)
    locations, version = report.get("locations"), report.get("version")
    paths = isinstance(locations, list) and all(isinstance(p, str) and p for p in locations)
    return paths and (version is None or isinstance(version, str))


PYTHON_TIMEOUT = 120.0  # how long another interpreter may take to answer (it imports nothing heavy)


def run_python(
    argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run another interpreter (or ``git``) in a session of its own (Ctrl-C reaches this process only);
    its output as text. On a timeout or Ctrl-C it is killed with all it started: a wrapper script's
    children would keep running, and keep its pipes open."""
    pipe = subprocess.PIPE
    with subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, env=env, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (AttributeError, OSError):  # not POSIX, or already gone
                proc.kill()
            raise
    out, err = (data.decode("utf-8", errors="replace") for data in (out, err))
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def vllm_of_current_interpreter() -> Path:
    """The vLLM package folder of this interpreter (no import of vllm)."""
    who = f"{sys.executable} (current interpreter)"
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as exc:
        raise TargetError(f"{who}: cannot look up vllm: {exc}") from exc
    locations = list(spec.submodule_search_locations or []) if spec else []
    return _vllm_from_report({"locations": locations}, who)


def source_tree_around(folder: Path) -> Path | None:
    """The vLLM source tree ``folder`` is in: the nearest folder up that holds a model folder."""
    folder = Path(os.path.abspath(folder))
    for candidate in (folder, *folder.parents):
        if any(candidate.joinpath("vllm", *parts).is_dir() for parts in MODEL_DIRS):
            return candidate
    return None


def shown_path(path: Path) -> str:
    """A path as the user would type it from the working folder: relative when it is in that folder
    or one it is in (``..``), else absolute (``../sibling`` reads differently from elsewhere)."""
    absolute, cwd = Path(os.path.abspath(path)), Path.cwd()
    if absolute.is_relative_to(cwd) or cwd.is_relative_to(absolute):
        return Path(os.path.relpath(absolute, cwd)).as_posix()
    return str(absolute)


def default_targets(versions: bool = False) -> list[Target]:
    """No target named: the vLLM source tree the working folder is in, else this interpreter's vLLM;
    both, when they differ, is a question for the user. ``versions``: as in ``tree_version``."""
    tree = source_tree_around(Path.cwd())
    try:
        package: Path | None = vllm_of_current_interpreter()
    except VllmNotInstalled as exc:
        if tree is None:
            raise TargetError(
                f"{exc}, and {Path.cwd()} is not inside a vLLM source tree (no {MODEL_DIRS_SHOWN}); "
                "name the files (PATH...), a fork checkout or site-packages (--vllm-root DIR), "
                "or another environment (--python EXE)"
            ) from None
        package = None
    if tree is not None:
        installed = package is not None and any(package.joinpath(*parts).is_dir() for parts in MODEL_DIRS)
        if installed and os.path.realpath(package) != os.path.realpath(tree / "vllm"):
            raise TargetError(
                f"{shown_path(tree)}: two vLLMs could be meant: this source tree and the one installed "
                f"for {sys.executable} ({package}); choose with --vllm-root {shown_path(tree)} (this tree) "
                f"or --python {sys.executable} (the installed one)"
            )
        folders = model_dirs(tree, f"source tree {tree}")
        version = tree_version(tree / "vllm", versions)
        return [Target(f, f"source tree {tree}", version, tree) for f in model_files(folders)]
    assert package is not None  # else raised above
    folders = model_dirs(package, f"vLLM of {sys.executable}")
    import importlib.metadata

    try:
        version = dist_version_beside(package) or importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return [Target(f, "current interpreter", version, package.parent) for f in model_files(folders)]


def vllm_install_of_interpreter(python: str) -> tuple[Path, str | None]:
    """The vLLM package folder of another interpreter and its version, found by running it."""
    try:
        proc = run_python(
            [python, "-c", _FIND_VLLM], PYTHON_TIMEOUT, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        )
    except FileNotFoundError as exc:
        raise TargetError(f"{python}: --python: no such interpreter") from exc
    except PermissionError as exc:
        raise TargetError(f"{python}: --python: not executable") from exc
    except OSError as exc:
        raise TargetError(f"{python}: --python: cannot run it: {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise TargetError(f"{python}: --python: did not answer within {PYTHON_TIMEOUT:g} s") from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TargetError(f"{python}: --python: interpreter failed: {detail}")
    try:
        report = json.loads(lines[-1])
    except (json.JSONDecodeError, RecursionError):
        report = None
    if not _is_answer(report):
        raise TargetError(
            f"{python}: --python: unexpected output {lines[-1][:80]!r}; is it a Python interpreter?"
        )
    folder = _vllm_from_report(report, f"{python} (--python)")
    return folder, dist_version_beside(folder) or report.get("version") or None  # a str, as _is_answer saw


def _path_root(path: Path, outside: Path) -> Path:
    """A path's root: the working folder when the path is under it, else ``outside``."""
    cwd = Path.cwd()
    return cwd if Path(os.path.abspath(path)).is_relative_to(cwd) else Path(os.path.abspath(outside))


def resolve(
    paths: Sequence[Path] = (), pythons: Sequence[str] = (), vllm_roots: Sequence[Path] = (),
    example: bool = False, no_vllm: dict[str, str] | None = None, versions: bool = False,
) -> list[Target]:
    """All files to process, each once (by the first name given), in a stable order; with nothing
    given, ``default_targets``. Given ``no_vllm``, an interpreter without a vLLM is put there
    (interpreter -> why) rather than being an error. ``versions``: as in ``tree_version``."""
    targets: list[Target] = []
    for path in paths:
        if path.is_dir():
            files = python_files(path)
            if not files:
                raise TargetError(f"{path}: directory holds no .py files")
            targets += [Target(f, str(path), root=_path_root(path, path)) for f in files]
        elif path.exists() or path.is_symlink():
            targets.append(Target(path, "path", root=_path_root(path, path.parent)))
        else:
            raise TargetError(f"{path}: no such file or directory")
    for root in vllm_roots:
        folders = model_dirs(root, "--vllm-root")
        version = tree_version(folders[0].parents[len(MODEL_PACKAGE)], versions)  # the vllm package
        targets += [Target(f, f"--vllm-root {root}", version, root) for f in model_files(folders)]
    for python in pythons:
        try:
            package, version = vllm_install_of_interpreter(python)
        except VllmNotInstalled as exc:
            if no_vllm is None:
                raise
            no_vllm[python] = exc.reason
            continue
        folders = model_dirs(package, f"vLLM of {python}")
        targets += [Target(f, f"--python {python}", version, package.parent) for f in model_files(folders)]
    if example:
        targets.append(Target(example_path(), "--example", root=example_path().parent))
    if not (paths or pythons or vllm_roots or example):
        targets += default_targets(versions)
    unique: dict[object, Target] = {}
    for target in targets:
        unique.setdefault(_same_file_key(target.path), target)
    return list(unique.values())


def _same_file_key(path: Path) -> object:
    """One key for every name of one file: a symlink, a hard link (whose second lock the
    first would wait on), ``a/../a``; the real path of what cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (st.st_dev, st.st_ino)
